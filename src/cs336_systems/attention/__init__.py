"""Attention implementations, selectable by name.

Every implementation takes ``(q, k, v, is_causal)`` with q of shape ``(..., n_queries, d)`` and k, v of
shape ``(..., n_keys, d)`` and returns ``(..., n_queries, d)``. The model picks one by name through
:func:`get_attention_fn`, so a benchmark can swap the attention of the whole model with one flag.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module

import torch

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]

# name -> (module, attribute); imported lazily so that e.g. the Triton kernels are only compiled when used.
_REGISTRY: dict[str, tuple[str, str]] = {
    "pytorch": ("cs336_systems.attention.reference", "scaled_dot_product_attention"),
    "pytorch_compiled": ("cs336_systems.attention.reference", "compiled_scaled_dot_product_attention"),
    "sdpa": ("cs336_systems.attention.reference", "torch_sdpa"),
    "flash_triton": ("cs336_systems.attention.flash_triton", "flash_attention_triton"),
    "flash_pytorch": ("cs336_systems.attention.flash_pytorch", "flash_attention_pytorch"),
}


def register_attention(name: str, module: str, attribute: str) -> None:
    _REGISTRY[name] = (module, attribute)


def attention_names() -> list[str]:
    return sorted(_REGISTRY)


def get_attention_fn(name: str) -> AttentionFn:
    try:
        module, attribute = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown attention implementation {name!r}; choose one of {attention_names()}"
        ) from None
    return getattr(import_module(module), attribute)
