"""Contract of 2026's FSDP hooks: ``get_fsdp(module, compute_dtype)``, ``fsdp_on_after_backward`` and
``fsdp_gather_full_params``.

Gloo ranks (2 and 3) train a model written like the course's (einsum ``Linear`` with weight
(d_out, d_in), ``Embedding``, ``RMSNorm``) whose sizes no world size divides (vocab 19, d_model 7,
d_ff 13), on their slice of the batch, loss on the last position, beside one process that trains a
copy on the whole batch (for a low-precision compute dtype the copy casts Linear / Embedding weights
and their inputs to it for forward and backward, and keeps fp32 masters, as the course's test does).

Checked: every trainable parameter stays fp32 and after ``fsdp_on_after_backward`` has an fp32
``.grad`` of its own shape; the replicated parameters' (RMSNorm) gradients are bitwise equal across
ranks; Linear / Embedding weights are sharded (a rank holds at most ceil(rows / world) rows' worth,
the ranks together at least all); ``fsdp_gather_full_params`` gives every parameter under the
unwrapped model's names at full shape, equal to the single-process weights after one and after three
steps (fp32 compute: 1e-5; fp16: the course's 1e-4; bf16: 1e-3, bf16 keeps 8 bits).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cs336_systems.distributed.comm import shard_batch, world

from ..helpers.course_layers import Embedding, Linear, RMSNorm
from .contract import Hooks, assert_no_misses, case_results, fmt, miss, run_rank_cases, selected_cases

HOOKS = ("get_fsdp", "fsdp_on_after_backward", "fsdp_gather_full_params")
VOCAB, D, HIDDEN, SEQ, BATCH, STEPS = 19, 7, 13, 5, 6, 3
DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-5, "fp16": 1e-4, "bf16": 1e-3}  # measured: fp16 1.3e-5, bf16 1e-4
CASES = [("fp32", "sgd"), ("fp32", "adamw"), ("fp16", "sgd"), ("bf16", "sgd")]
WORLD_SIZES = (2, 3)


class CourseLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = Embedding(VOCAB, D)
        self.norm = RMSNorm(D)
        self.up = Linear(D, HIDDEN)
        self.down = Linear(HIDDEN, D)
        self.final_norm = RMSNorm(D)
        self.lm_head = Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.lm_head(self.final_norm(x))


def _sharded_names(model: nn.Module) -> set[str]:
    return {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Linear | Embedding)}


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":  # lr 0.05: fp16 rounding of the half-batch gradients stays inside 1e-4 (3 steps)
        return torch.optim.SGD(params, lr=0.05)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH,), generator=g)


def _loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids)[:, -1].float(), targets)


def _param_misses(fsdp: nn.Module, step: int) -> list[str]:
    misses = []
    for name, p in fsdp.module.named_parameters():
        if p.dtype != torch.float32:
            misses.append(f"step {step}: parameter {name} is {p.dtype}, not an fp32 master")
        elif p.requires_grad and (p.grad is None or p.grad.shape != p.shape or p.grad.dtype != torch.float32):
            got = "None" if p.grad is None else f"{p.grad.dtype} {tuple(p.grad.shape)}"
            misses.append(
                f"step {step}: {name}.grad is {got}; expected fp32 {tuple(p.shape)} (its own shape)"
            )
    return misses


def _gathered_misses(full: dict, reference: nn.Module, dtype: str, label: str) -> list[str]:
    ref = dict(reference.named_parameters())
    if set(full) != set(ref):
        return [f"{label}: gathered names {sorted(full)} != the model's {sorted(ref)}"]
    return [miss(f"gathered {n}", full[n], ref[n], TOL[dtype], TOL[dtype], label) for n in ref]


def _update_ratio(full: dict, start: dict, reference: nn.Module) -> float:
    """|FSDP's first update| / |single process's first update|: world_size when gradients are summed."""
    num = sum((full[n].double() - start[n].double()).norm() ** 2 for n in start) ** 0.5
    den = (
        sum((p.detach().double() - start[n].double()).norm() ** 2 for n, p in reference.named_parameters())
        ** 0.5
    )
    return float(num / den)


def _train(hooks: Hooks, case: tuple) -> dict:
    dtype, opt_name = case
    rank, world_size = world()
    torch.manual_seed(0)
    model = CourseLike()
    reference = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for m in reference.modules():
        if isinstance(m, Linear | Embedding):
            m.cast = DTYPES[dtype]
    fsdp = hooks.get_fsdp(model, compute_dtype=DTYPES[dtype])
    opt, opt_ref = _optimizer(opt_name, fsdp.parameters()), _optimizer(opt_name, reference.parameters())
    sharded = _sharded_names(model)
    misses, replicated, local = [], [], {}
    where = f"{dtype} compute, {opt_name}, world size {world_size}"
    for step in range(STEPS):
        ids, targets = _batch(step)
        opt.zero_grad()
        _loss(fsdp, shard_batch(ids, rank, world_size), shard_batch(targets, rank, world_size)).backward()
        hooks.fsdp_on_after_backward(fsdp, opt)
        misses += _param_misses(fsdp, step)
        replicated.append(
            {
                n: p.grad.clone()
                for n, p in fsdp.module.named_parameters()
                if n not in sharded and p.grad is not None
            }
        )
        local = {n: p.numel() for n, p in fsdp.module.named_parameters() if n in sharded}
        opt.step()
        opt_ref.zero_grad()
        _loss(reference, ids, targets).backward()
        opt_ref.step()
        if step == 0:
            full = hooks.fsdp_gather_full_params(fsdp)
            first = _gathered_misses(full, reference, dtype, f"after 1 step; {where}")
            if opt_name == "sgd" and any(first) and set(full) == set(start):
                ratio = _update_ratio(full, start, reference)
                if abs(ratio - world_size) < 0.05 * world_size:
                    first.append(
                        "gradients summed, not averaged: the first SGD step moved the weights "
                        f"{ratio:.2f} x as far as one process on the whole batch"
                    )
            misses += first
    misses += _gathered_misses(
        hooks.fsdp_gather_full_params(fsdp), reference, dtype, f"after {STEPS} steps; {where}"
    )
    full_numel = {n: p.numel() for n, p in reference.named_parameters() if n in sharded}
    rows = {n: p.shape[0] for n, p in reference.named_parameters() if n in sharded}
    for n, numel in local.items():
        bound = math.ceil(rows[n] / world_size) * (full_numel[n] // rows[n])
        if numel > bound:
            misses.append(
                f"{n} is not sharded: this rank holds {numel} of its {full_numel[n]} elements (> {bound})"
            )
    return {
        "misses": [m for m in misses if m][:8],
        "replicated": replicated,
        "local": local,
        "full": full_numel,
    }


def fsdp_rank(path: str, cases: list[tuple]) -> dict:
    torch.use_deterministic_algorithms(True)
    return run_rank_cases(path, _train, cases)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.hook(*HOOKS)
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda ws: f"ws{ws}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_fsdp_matches_single_process(
    request, spawned, adapters_under_test, world_size: int, case: tuple
) -> None:
    """fp32 masters and gradients of the shard's shape, sharded weights, bitwise-equal replicated
    gradients, gathered weights = single-process training after 1 and 3 steps."""
    per_rank = spawned(fsdp_rank, world_size, str(adapters_under_test), selected_cases(request, world_size))
    results = case_results(per_rank, case)
    misses = [f"rank {r}: {m}" for r, res in enumerate(results) for m in res["misses"]]
    for step, grads in enumerate(zip(*(res["replicated"] for res in results), strict=True)):
        for name in grads[0]:
            spread = max((g[name] - grads[0][name]).abs().max().item() for g in grads)
            if spread > 0:
                misses.append(
                    f"step {step}: replicated {name}.grad differs across ranks by {fmt(spread)} (must be bitwise equal)"
                )
    for name, full in results[0]["full"].items():
        held = sum(res["local"].get(name, 0) for res in results)
        if held < full:
            misses.append(f"{name}: the ranks hold {held} of its {full} elements together")
    assert_no_misses(misses)
