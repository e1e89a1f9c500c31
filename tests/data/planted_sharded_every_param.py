"""Planted bug, sharded optimizer: every rank steps every parameter (the optimizer is not sharded at
all). The weights still match the unsharded optimizer; only the state-ownership check can see it."""

from __future__ import annotations

from tests.data.planted_common import suite_hooks

globals().update(suite_hooks())


def get_sharded_optimizer(params, optimizer_cls, **kwargs):
    return optimizer_cls(params, **kwargs)
