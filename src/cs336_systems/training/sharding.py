"""The 8B step's model materialized and sharded unit by unit (ours, FSDP2, or none), and its optimizer
(FusedAdamW, also on FSDP2's local shards, or torch's fused AdamW)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from cs336_systems.distributed.fsdp import FSDP, is_sharded_layer
from cs336_systems.model.transformer import Embedding, Linear, RMSNorm, RotaryEmbedding
from cs336_systems.training.options import DTYPES, StepOptions, optimizer_in_backward_plan
from cs336_systems.training.step_model import StepModel

# -- materialization: unit by unit, deterministic ----------------------------------------------------


def _init_module(module: nn.Module) -> None:
    """Initialize a module's own parameters and buffers as its constructor would."""
    if isinstance(module, Linear | Embedding):
        module.reset_parameters()
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)
    elif any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    ):
        raise TypeError(f"no initialization known for {type(module).__name__}; add it to _init_module")


@torch.no_grad()
def materialize_(
    module: nn.Module, device: torch.device, seed: int, index_of: dict[int, int], recurse: bool = True
) -> None:
    """Move ``module``'s meta tensors (and its submodules', with ``recurse``) to ``device`` and
    initialize them; each module draws from a generator seeded by ``seed`` and its index in the whole
    model (``index_of``), so the values do not depend on which unit, rank or order materializes it."""
    for sub in module.modules() if recurse else [module]:
        if not any(t.is_meta for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False))):
            continue
        sub.to_empty(device=device, recurse=False)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed * 1_000_003 + index_of[id(sub)])
            _init_module(sub)


def fsdp_units(model: StepModel) -> list[nn.Module]:
    """The sharding units, in forward order: embedding, each block, LM head (the root holds the rest)."""
    return [model.token_embeddings, *model.layers, model.lm_head]


def module_indices(model: nn.Module) -> dict[int, int]:
    return {id(m): i for i, m in enumerate(model.modules())}


def shard_model(model: StepModel, options: StepOptions, device: torch.device) -> nn.Module:
    """Materialize and shard ``model`` (built on meta) unit by unit; returns the module to train."""
    index_of = module_indices(model)
    # The RoPE tables are derived, not learned, and shared by every block: compute them once, first.
    config = model.config
    rope = RotaryEmbedding(config.d_head, config.context_length, config.rope_theta, device=device)
    for name in ("cos", "sin"):
        model.rope.register_buffer(name, getattr(rope, name), persistent=False)
    if options.fsdp == "none":
        materialize_(model, device, options.seed, index_of)
        return model
    if options.fsdp == "torch":
        return _shard_fsdp2(model, options, device, index_of)
    return _shard_ours(model, options, device, index_of)


def _shard_fsdp2(model: StepModel, options: StepOptions, device: torch.device, index_of: dict) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[options.compute_dtype], reduce_dtype=DTYPES[options.reduce_dtype]
    )
    for unit in fsdp_units(model):
        materialize_(unit, device, options.seed, index_of)
        fully_shard(unit, mp_policy=policy)
    materialize_(model, device, options.seed, index_of)  # what is left: the final norm
    fully_shard(model, mp_policy=policy)
    return model


def _shard_ours(model: StepModel, options: StepOptions, device: torch.device, index_of: dict) -> nn.Module:
    # Replicated parameters (the norm gains) are a few KB: materialize them up front.
    for sub in model.modules():
        if not is_sharded_layer(sub):
            materialize_(sub, device, options.seed, index_of, recurse=False)
    return MaterializingFSDP(
        model,
        lambda layer: materialize_(layer, device, options.seed, index_of),
        compute_dtype=DTYPES[options.compute_dtype],
        reduce_dtype=DTYPES[options.reduce_dtype],
        units=list(model.layers),
    )


class MaterializingFSDP(FSDP):
    """The suite's FSDP over a model whose sharded layers are still on the meta device: each layer is
    materialized (full, on the rank's device, deterministically initialized by ``init_layer``) right
    before FSDP cuts its row shard, so a rank holds one layer's full weight at a time. Nothing is
    broadcast: every rank initializes the same values, and a broadcast would need the full model."""

    def __init__(self, module: nn.Module, init_layer: Callable[[nn.Module], None], **kwargs: Any):
        self.__dict__["_init_layer"] = init_layer  # before nn.Module.__init__, which FSDP calls
        from cs336_systems.distributed import fsdp

        broadcast, fsdp.broadcast_module = fsdp.broadcast_module, lambda module: None
        try:
            super().__init__(module, **kwargs)
        finally:
            fsdp.broadcast_module = broadcast

    def _shard(self, sub: nn.Module, name: str, offset: int):
        self._init_layer(sub)
        return super()._shard(sub, name, offset)

    def _register_module_hooks(self) -> None:
        """Each unit swaps all its gathered weights in when it starts and out when it ends, instead of
        around each layer: a block's forward then runs no hook inside, so ``torch.compile`` of the
        block's forward sees one graph (as with FSDP2), not a graph break at every Linear."""
        for unit in self._units:
            unit.root.register_forward_pre_hook(
                lambda m, args, kwargs, u=unit: self._begin_and_swap_in(u, args, kwargs), with_kwargs=True
            )
            unit.root.register_forward_hook(lambda m, args, out, u=unit: self._swap_out_and_end(u))

    def _begin_and_swap_in(self, unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # Out of every dispatch mode: selective checkpointing's mode would otherwise count the
        # gather's ops as the block's and find them different in the re-run (prefetched or not).
        with _disable_current_modes():
            self._begin_unit(unit)
            cast = None
            for k in range(len(unit.entries)):
                cast = self._swap_in(unit, k, args, kwargs) or cast  # the unit's inputs, cast once
        return cast

    def _swap_out_and_end(self, unit) -> None:
        for entry in unit.entries:
            self._swap_out(entry)
        self._end_unit(unit)


# -- optimizer ---------------------------------------------------------------------------------------


def build_optimizer(model: nn.Module, options: StepOptions) -> Any:
    """The step's optimizer; with ``optimizer_in_backward`` resolved on (``optimizer_in_backward_plan``),
    one per FSDP unit, stepped inside the backward (``distributed.optim_in_backward``)."""
    if optimizer_in_backward_plan(options)[0]:
        from cs336_systems.distributed.optim_in_backward import OptimizerInBackward

        return OptimizerInBackward(model, lambda ps: _plain_optimizer(ps, options))
    return _plain_optimizer([p for p in model.parameters() if p.requires_grad], options)


def _plain_optimizer(params: list[torch.Tensor], options: StepOptions) -> Any:
    kwargs = dict(lr=options.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=options.weight_decay)
    if options.optimizer == "torch_fused":
        return torch.optim.AdamW(params, fused=True, **kwargs)
    from cs336_systems.kernels.fused_adamw import FusedAdamW

    if any(hasattr(p, "to_local") for p in params):  # FSDP2: DTensor parameters
        return OnLocalShards(params, lambda local: FusedAdamW(local, **kwargs))
    return FusedAdamW(params, **kwargs)


class OnLocalShards:
    """Steps an optimizer written for plain tensors (FusedAdamW's Triton kernel takes data pointers)
    on the local shards of DTensor parameters (FSDP2's): the shards alias the parameters' storage, and
    each step hands them the local shards of the gradients."""

    def __init__(self, params: list[torch.Tensor], make: Callable[[list[torch.Tensor]], Any]):
        self.params = params
        with torch.no_grad():
            self.local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        self.inner = make(self.local)

    def step(self) -> None:
        for p, local in zip(self.params, self.local, strict=True):
            if local is not p:
                local.grad = None if p.grad is None else p.grad.to_local()
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, local in zip(self.params, self.local, strict=True):
            p.grad = local.grad = None
