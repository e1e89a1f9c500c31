"""Judging 2026's FSDP hooks on the course's FSDP model (``shared/models.LayersModel``).

The reference trains the same model of the course's layer math (``shared/course_layers``: einsum
Linear, indexed Embedding, RMSNorm with eps 1e-5) in this process, on the whole batch; for a low compute
dtype it runs Linear / Embedding weights in that dtype for forward and backward and keeps fp32 masters,
as the course's test does. The student's model is built from their own ``cs336_basics`` layers, so the
worker first runs those layers on probe inputs: when they do not compute the course's math, the case
cannot be graded faithfully and says so (an error of the grading, not a failure of FSDP).

``train`` (test_fsdp_correctness): after every step the gathered full parameters equal the reference's;
parameters stay fp32 masters with fp32 gradients of their own shape; Linear / Embedding weights are
sharded. ``grad-sync`` (test_fsdp_gradient_sync): every trainable parameter has a gradient of its own
shape and dtype, and the replicated parameters' gradients are bitwise equal across ranks. ``beyond``
adds sizes no world size divides, 3 ranks, bf16, AdamW, and bitwise-equal replicated gradients in
training.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..exchange import Untrusted, field, tensor, text
from ..shared import course_layers
from ..shared.cases import Case
from ..shared.course_layers import probe_layers
from ..shared.dtypes import DTYPES
from ..shared.models import LayersModel
from ..shared.training import make_optimizer
from ..verdict import Verdict, fmt
from .training import like_a_worker

OURS = (
    "embedding.weight",
    "norm1.weight",
    "linear1.weight",
    "norm2.weight",
    "linear2.weight",
    "lm_head.weight",
)
SHARDED = (0, 2, 4, 5)  # Linear / Embedding weights, by position
LAYERS = (course_layers.Linear, course_layers.Embedding, course_layers.RMSNorm)
LOW = {name: DTYPES[name] for name in ("fp16", "bf16")}  # the low-precision compute dtypes
PROBE_TOL = {"fp32": 1e-5, "fp16": 2e-3}  # relative: the course's math, whatever the order of a product


def make_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    vocab, d, d_ff = case.knob("sizes")
    torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=gen)))
    init = [p.detach().clone() for p in LayersModel(LAYERS, vocab, d, d_ff).parameters()]
    probe = {
        "linear_w": torch.randn(d_ff, d, generator=gen),
        "linear_x": torch.randn(3, 5, d, generator=gen),
        "linear_dy": torch.randn(3, 5, d_ff, generator=gen),
        "embedding_w": torch.randn(vocab, d, generator=gen),
        "ids": torch.randint(vocab, (3, 5), generator=gen),
        "embedding_dy": torch.randn(3, 5, d, generator=gen),
        "norm_w": 1 + 0.1 * torch.randn(d, generator=gen),
        "norm_x": torch.randn(3, 5, d, generator=gen),
        "norm_dy": torch.randn(3, 5, d, generator=gen),
    }
    inputs: dict[str, Any] = {"init": init, "probe": probe}
    if case.knob("check") == "grad-sync":
        inputs["ids"] = torch.randint(vocab, (case.world_size, 4, 8), generator=gen)
        return inputs
    batch = case.knob("global_batch")
    ids, targets = (
        torch.randint(vocab, (batch, 8), generator=gen),
        torch.randint(vocab, (batch,), generator=gen),
    )
    orders = [torch.randperm(batch, generator=gen) for _ in range(case.knob("steps"))]
    inputs["ids"] = torch.stack([ids[o] for o in orders])
    inputs["targets"] = torch.stack([targets[o] for o in orders])
    return inputs


def _probe_reference(probe: dict) -> dict[str, torch.Tensor]:
    return probe_layers(LAYERS, probe)


def probe_miss(result: dict, probe: dict) -> str | None:
    """Why the student's layers do not compute the course's math (None when they do)."""
    got = field(result, "probe", dict, "layer probe")
    source = result.get("layers_from")
    for name, ref in _probe_reference(probe).items():
        value = tensor(got.get(name), f"layer probe {name}", tuple(ref.shape))
        err = (value.double() - ref.double()).abs().max().item()
        scale = ref.double().abs().max().item() or 1.0
        if err > PROBE_TOL["fp16" if "fp16" in name else "fp32"] * scale:
            layer = name.split("_")[0]
            return (
                f"cannot grade FSDP against the course's model: the {source} {layer} layer computes something else "
                f"than the course's layers ({name}: max diff {fmt(err)} of max {fmt(scale)})"
            )
    return None


def low_precision_reference(model: nn.Module, dtype: torch.dtype) -> None:
    """Run ``model``'s Linear / Embedding weights in ``dtype`` for forward and backward while the
    parameters stay fp32 masters with fp32 gradients (the course test's single-process reference)."""

    def swap_in(m: nn.Module, *_: Any) -> None:
        m.master = m.weight.data
        m.weight.data = m.master.to(dtype)

    def swap_out(m: nn.Module, *_: Any) -> None:
        m.weight.data = m.master

    def master_grad(m: nn.Module, p: nn.Parameter) -> None:
        swap_out(m)
        p.grad = p.grad.float()

    for m in model.modules():
        if isinstance(m, LAYERS[:2]):
            m.register_forward_pre_hook(swap_in)
            m.register_forward_hook(swap_out)
            m.register_full_backward_pre_hook(swap_in)
            m.weight.register_post_accumulate_grad_hook(lambda p, m=m: master_grad(m, p))


def _reference(
    case: Case, inputs: dict, device: torch.device, dtype: str | None = None
) -> list[list[torch.Tensor]]:
    """The parameters after each step of single-process training in ``dtype`` (default: the case's)."""
    dtype = dtype or case.dtype
    model = LayersModel(LAYERS, *case.knob("sizes"))
    with torch.no_grad():
        for p, t in zip(model.parameters(), inputs["init"], strict=True):
            p.copy_(t)
    model = model.to(device)
    if dtype in LOW:
        low_precision_reference(model, LOW[dtype])
    opt = make_optimizer(case.knob("optimizer"), model.parameters())
    params = []
    with like_a_worker(device), warnings.catch_warnings():
        # the backward pre-hooks fire on module outputs only (the ids need no gradient): expected here
        warnings.simplefilter("ignore", UserWarning)
        for step in range(case.knob("steps")):
            opt.zero_grad(set_to_none=True)
            ids, targets = inputs["ids"][step].to(device), inputs["targets"][step].to(device)
            F.cross_entropy(model(ids)[:, -1].float(), targets).backward()
            opt.step()
            params.append([copy.deepcopy(p.detach().cpu()) for p in model.parameters()])
    return params


def _names(result: dict) -> list[str]:
    names = field(result, "names", list, "parameter names")
    if len(names) != len(OURS) or not all(isinstance(n, str) for n in names):
        raise Untrusted(f"expected the names of the model's {len(OURS)} parameters, got {names!r:.200}")
    return names


def _sharding_misses(
    case: Case, results: list[dict], names: list[str], init: list[torch.Tensor]
) -> list[str]:
    misses = []
    held = [field(r, "local_numel", dict, "local element counts") for r in results]
    for i in SHARDED:
        full = init[i]
        rows = full.shape[0]
        bound = math.ceil(rows / case.world_size) * (full.numel() // rows)
        counts = [h.get(names[i]) for h in held]
        if not all(isinstance(c, int) for c in counts):
            misses.append(f"{names[i]}: a rank reports no local parameter of that name")
            continue
        if max(counts) > bound:
            misses.append(
                f"{names[i]} is not sharded: a rank holds {max(counts)} of its {full.numel()} elements (> {bound})"
            )
        if sum(counts) < full.numel():
            misses.append(f"{names[i]}: the ranks hold {sum(counts)} of its {full.numel()} elements together")
    return misses


def _fact_misses(facts: Any, names: list[str], where: str, same_dtype_only: bool = False) -> list[str]:
    if not isinstance(facts, dict):
        raise Untrusted(f"{where}: no parameter facts")
    misses = []
    for name in names:
        f = facts.get(name)
        if not isinstance(f, dict):
            raise Untrusted(f"{where}: no facts about {name}")
        grad = f.get("grad")
        if not same_dtype_only and f.get("dtype") != "float32":
            misses.append(f"{where}: parameter {name} is {f.get('dtype')}, not an fp32 master")
        if not f.get("requires_grad"):
            continue
        if not isinstance(grad, torch.Tensor):
            misses.append(f"{where}: {name}.grad is None")
        elif list(grad.shape) != f.get("shape") or str(grad.dtype).removeprefix("torch.") != f.get("dtype"):
            misses.append(
                f"{where}: {name}.grad is {grad.dtype} {tuple(grad.shape)}; the parameter is {f.get('dtype')} {tuple(f.get('shape') or ())}"
            )
        elif not same_dtype_only and grad.dtype != torch.float32:
            misses.append(f"{where}: {name}.grad is {grad.dtype}, not fp32")
    return misses


def _replicated_misses(facts_per_rank: list[dict], names: list[str], where: str) -> list[str]:
    misses = []
    for i, name in enumerate(names):
        if i in SHARDED:
            continue
        grads = [f[name].get("grad") for f in facts_per_rank]
        if not all(isinstance(g, torch.Tensor) for g in grads):
            continue  # reported as a missing gradient
        tensor(grads[0], f"{name}.grad")
        if any(g.shape != grads[0].shape or not torch.equal(g, grads[0]) for g in grads[1:]):
            spread = max(
                (g.double() - grads[0].double()).abs().max().item()
                for g in grads[1:]
                if g.shape == grads[0].shape
            )
            misses.append(
                f"{where}: replicated {name}.grad differs across ranks by {fmt(spread)} (must be bitwise equal)"
            )
    return misses


def _gathered_misses(
    gathered: Any, names: list[str], ref: list[torch.Tensor], case: Case, where: str
) -> list[str]:
    if not isinstance(gathered, dict) or set(gathered) != set(names):
        got = sorted(gathered) if isinstance(gathered, dict) else type(gathered).__name__
        return [f"{where}: gathered names {got} != the model's {sorted(names)}"]
    tol, misses = case.tolerance, []
    for name, r in zip(names, ref, strict=True):
        got = tensor(gathered[name], f"gathered {name}", tuple(r.shape))
        err = (got.double() - r.double()).abs()
        if not bool((err <= tol.atol + tol.rtol * r.double().abs()).all()):
            misses.append(
                f"{where}: max |gathered {name} - single process| = {fmt(err.max().item())} > {tol.describe()}"
            )
    return misses


def _compute_dtype_miss(case: Case, step: dict, where: str) -> list[str]:
    """Under a low compute dtype the last Linear computes in it, so the model's output has it (the
    course's reference returns its logits in that dtype; the loss casts them up)."""
    if case.dtype not in LOW or step.get("out_dtype") == str(LOW[case.dtype]).removeprefix("torch."):
        return []
    return [
        f"{where}: the model's output is {text(step.get('out_dtype'), 40)}, not {case.dtype}: compute_dtype is not used"
    ]


def _matches_fp32(
    case: Case, inputs: dict, device: torch.device, results: list[dict], names: list[str]
) -> bool:
    """Whether rank 0's gathered parameters are those of fp32 training (within the case's tolerance)."""
    ref = _reference(case, inputs, device, dtype="fp32")
    steps = results[0]["steps"]
    return not any(
        _gathered_misses(step.get("gathered"), names, ref[s], case, "") for s, step in enumerate(steps)
    )


def judge(case: Case, inputs: dict, payloads: list[dict], device: torch.device) -> Verdict:
    try:
        results = [field(p, "result", dict, "fsdp") for p in payloads]
        miss = probe_miss(results[0], inputs["probe"])
        if miss:
            return Verdict.error("cannot-grade", miss)
        names = _names(results[0])
        beyond = case.knob("state_checked")  # sharded storage, fp32 masters, compute dtype (cases.py)
        misses = _sharding_misses(case, results, names, inputs["init"]) if beyond else []
        if case.knob("check") == "grad-sync":
            facts = [field(r, "facts", dict, "facts") for r in results]
            for r, f in enumerate(facts):
                misses += _fact_misses(f, names, f"rank {r}", same_dtype_only=True)
            return Verdict.from_misses(misses + _replicated_misses(facts, names, "after one backward"))
        ref = _reference(case, inputs, device)
        label = f"{case.dtype} compute, {case.knob('optimizer')}, world size {case.world_size}"
        for r, result in enumerate(results):
            steps = field(result, "steps", list, "steps")
            if len(steps) != len(ref):
                raise Untrusted(f"rank {r}: expected {len(ref)} steps, got {len(steps)}")
            for s, step in enumerate(steps):
                where = f"rank {r}, after step {s}; {label}"
                if beyond:
                    misses += _fact_misses(field(step, "facts", dict, "facts"), names, where)
                    misses += _compute_dtype_miss(case, step, where)
                misses += _gathered_misses(step.get("gathered"), names, ref[s], case, where)
        if misses and case.dtype in LOW and _matches_fp32(case, inputs, device, results, names):
            misses.insert(
                0,
                f"the gathered parameters follow fp32 training, not {case.dtype} compute: compute_dtype is not used",
            )
        if beyond:
            for s in range(len(ref)):
                misses += _replicated_misses([r["steps"][s]["facts"] for r in results], names, f"step {s}")
    except Untrusted as exc:
        return Verdict.failed(str(exc))
    return Verdict.from_misses(misses)
