"""D19: optimizer state sharding. Each rank keeps optimizer state for ~1/world_size of the
parameters and updates only those; after the local step every parameter is broadcast from the
rank that owns it, so all ranks hold the same weights again.

Assignment: ``add_param_group`` (called by ``torch.optim.Optimizer.__init__`` for every group and
again for groups added during training) hands each new parameter, largest first, to the rank with
the fewest elements so far (ties to the lowest rank). It depends only on the parameters' shapes and
order, so every rank computes the same owners without communicating.

Communication per step: each owner's parameters are broadcast as flat buffers (one per
(device, dtype), split into chunks of at most 512 MiB so the extra memory stays bounded), not one
call per tensor. Each rank receives (N-1)/N of the parameter bytes on top of DDP's all-reduce of
the gradients (2(N-1)/N): 1.5x the bytes of plain DDP. ZeRO stage 1 instead reduce-scatters the
gradients and all-gathers the parameters, the same bytes as one all-reduce, and needs only the
local shard's averaged gradients, which this simplified version does not exploit.

Checkpoint layout (``state_dict()`` on each rank; save one file per rank):

    {"state": {i: state of parameter i}            # only the parameters this rank owns
     "param_groups": [{hyperparameters..., "params": [i, ...]}, ...],   # every parameter
     "shard": {"rank": r, "world_size": n, "owners": [owner of parameter 0, 1, ...]}}

Parameter indices ``i`` are global: they number the parameters of all groups in order, as torch's
own ``Optimizer.state_dict`` does, so ``load_state_dict`` also accepts an unsharded state dict of
``optimizer_cls`` over the same parameters (each rank keeps the entries it owns). Loading another
rank's shard, or a shard taken with a different world size, raises an error.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from cs336_systems.distributed.comm import broadcast_tensors, world


def assign_owners(numels: Sequence[int], loads: list[int]) -> list[int]:
    """Owner rank of each item: largest first, to the rank with the fewest elements so far (ties to
    the lowest rank; equal sizes in input order). Updates ``loads`` (elements per rank) in place.
    Deterministic, so every rank computes the same assignment without communicating."""
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        owner = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[i] = owner
        loads[owner] += numels[i]
    return owners


class ShardedOptimizer(torch.optim.Optimizer):
    """``ShardedOptimizer(params, optimizer_cls, **kwargs)``: ``kwargs`` go to ``optimizer_cls``;
    per-group options in ``params`` are kept. ``local_optimizer`` is the ``optimizer_cls`` instance
    over this rank's shard; its groups mirror this optimizer's groups one to one (possibly empty).
    Hyperparameters changed on ``param_groups`` (e.g. by an LR scheduler) reach it at every step.
    ``zero_grad`` (torch's) clears every parameter's gradient, not only the shard's: every rank
    computes all gradients.
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any):
        self.rank, self.world_size = world()
        self.optimizer_cls = optimizer_cls
        self.optimizer_kwargs = kwargs
        self.loads = [0] * self.world_size  # elements owned per rank
        self.owner: dict[torch.Tensor, int] = {}
        self.local_optimizer: torch.optim.Optimizer | None = None
        super().__init__(params, defaults=dict(kwargs))
        # Expose the local state, so ``optimizer.state[p]`` works for the parameters this rank owns.
        self.state = self.local_optimizer.state

    # -- assignment --------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # validates, fills defaults, rejects repeats
        group = self.param_groups[-1]
        new = [p for p in dict.fromkeys(group["params"]) if p not in self.owner]  # repeats owned once
        for p, owner in zip(new, assign_owners([p.numel() for p in new], self.loads), strict=True):
            self.owner[p] = owner
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [p for p in dict.fromkeys(group["params"]) if self.owner[p] == self.rank]
        if self.local_optimizer is None:
            self.local_optimizer = self.optimizer_cls([local], **self.optimizer_kwargs)
        else:
            self.local_optimizer.add_param_group(local)
        # Options the wrapped class filled in from its own defaults become visible here too (an LR
        # scheduler reads param_groups[i]["lr"] even when the user relied on the default lr).
        for key, value in self.local_optimizer.param_groups[-1].items():
            group.setdefault(key, value)

    def shard_of(self, rank: int | None = None) -> list[torch.Tensor]:
        rank = self.rank if rank is None else rank
        return [p for g in self.param_groups for p in g["params"] if self.owner[p] == rank]

    # -- step --------------------------------------------------------------------------------

    def _sync_hyperparameters(self) -> None:
        for group, local in zip(self.param_groups, self.local_optimizer.param_groups, strict=True):
            local.update({k: v for k, v in group.items() if k != "params"})

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        self._sync_hyperparameters()
        loss = self.local_optimizer.step(closure, **kwargs)
        self.synchronize_parameters()
        return loss

    def synchronize_parameters(self) -> None:
        """Every parameter from its owner: each owner's parameters flattened into a few chunks
        (``comm.flat_chunks``: one per (device, dtype) up to 512 MiB), not one call per tensor."""
        broadcast_tensors([(owner, self.shard_of(owner)) for owner in range(self.world_size)], src=None)

    # -- checkpoints -------------------------------------------------------------------------

    def _index(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard; see the module docstring for the layout."""
        self._sync_hyperparameters()
        index = {p: i for i, p in enumerate(self._index())}
        local = self.local_optimizer.state_dict()
        local_params = [p for g in self.local_optimizer.param_groups for p in g["params"]]
        state = {index[p]: local["state"][j] for j, p in enumerate(local_params) if j in local["state"]}
        groups = []
        for group in self.param_groups:
            entry = {k: v for k, v in group.items() if k != "params"}
            entry["params"] = [index[p] for p in group["params"]]
            groups.append(entry)
        owners = [self.owner[p] for p in self._index()]
        return {
            "state": state,
            "param_groups": groups,
            "shard": {"rank": self.rank, "world_size": self.world_size, "owners": owners},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = self._index()
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(
                "state dict does not match this optimizer's parameter groups: sizes "
                f"{[len(g['params']) for g in groups]} vs {[len(g['params']) for g in self.param_groups]}"
            )
        shard = state_dict.get("shard")
        if shard is not None:
            owners = [self.owner[p] for p in params]
            if shard["world_size"] != self.world_size or shard["owners"] != owners:
                raise ValueError(
                    f"state dict was sharded over {shard['world_size']} ranks with another assignment; "
                    f"this optimizer runs on {self.world_size} ranks (save an unsharded state dict to reshard)"
                )
            if shard["rank"] != self.rank:
                raise ValueError(f"state dict holds rank {shard['rank']}'s shard; this is rank {self.rank}")
        # Map global indices to the local optimizer's own numbering and hand it a normal state dict.
        local_index = {}
        local_groups = []
        for group, saved in zip(self.param_groups, groups, strict=True):
            entry = {k: copy.deepcopy(v) for k, v in saved.items() if k != "params"}
            ids = []
            for p, i in zip(group["params"], saved["params"], strict=True):
                if self.owner[p] == self.rank:
                    local_index[i] = len(local_index)
                    ids.append(local_index[i])
            entry["params"] = ids
            local_groups.append(entry)
            group.update({k: v for k, v in saved.items() if k != "params"})
        local_state = {local_index[i]: s for i, s in state_dict["state"].items() if i in local_index}
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.local_optimizer.state
