"""Judging the DDP hooks and the sharded optimizer: the judge makes every initial weight and batch, runs
the single-process reference itself (same model, same optimizer, same device kind as the worker), and
compares what each rank returned with it.

DDP, ``course`` (the course's test_ddp*.py): ranks start from different weights; after wrapping, every
rank holds rank 0's (torch.allclose); after every step rank 0's parameters equal the non-parallel
model's within the course's tolerance. ``beyond``: every rank, every step: gradients after the
after-backward hook equal the full-batch gradient (the average over ranks, not the sum), parameters
equal, and equal across ranks, in float64.

Sharded optimizer, ``course`` (test_sharded_optimizer.py): final parameters on every rank equal the
unsharded AdamW's (rtol 1e-7). ``beyond``: every step, ranks agree, and each parameter's optimizer state
sits on exactly one rank and equals the unsharded optimizer's state for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ..exchange import Untrusted, field, tensors
from ..shared.cases import Case, Tolerance
from ..shared.dtypes import DTYPES
from ..shared.models import IN, OUT, VOCAB, loss_fn, make_model
from ..shared.training import make_optimizer, optimizer_params, optimizer_spec, sharded_loss
from ..verdict import Verdict, fmt
from .compare import close, max_diff


@contextlib.contextmanager
def like_a_worker(device: torch.device) -> Iterator[None]:
    """The reference computes as a worker does: one thread on the CPU (workers run with
    OMP_NUM_THREADS=1, and thread count can change a CPU reduction's rounding)."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _seed(gen: torch.Generator) -> int:
    return int(torch.randint(2**31 - 1, (1,), generator=gen))


def _state(case: Case, seed: int) -> dict[str, torch.Tensor]:
    return make_model(case.model, case.dtype, seed=seed).state_dict()


def _batch(
    case: Case, gen: torch.Generator, batch: int, uniform: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = DTYPES[case.dtype]
    if case.model == "tied":
        return torch.randint(VOCAB, (batch, 6), generator=gen), torch.randint(
            VOCAB, (batch, 6), generator=gen
        )
    draw = torch.rand if uniform else torch.randn
    return draw(batch, IN, generator=gen, dtype=dtype), draw(batch, OUT, generator=gen, dtype=dtype)


def make_ddp_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    steps, batch, ws = case.knob("steps"), case.knob("global_batch"), case.world_size
    x, y = _batch(case, gen, batch)
    xs, ys, masks = [], [], []
    for _ in range(steps):  # the course reshuffles one pool of data every step
        order = torch.randperm(batch, generator=gen)
        xs.append(x[order])
        ys.append(y[order])
        mask = torch.zeros(batch, dtype=torch.bool)
        extra = case.knob("extra")
        mask[: batch if extra == "all" else batch // ws if extra == "rank0" else 0] = True
        masks.append(mask)
    init = [
        _state(case, _seed(gen)) for _ in range(ws)
    ]  # different on every rank: the wrapper must broadcast
    return {"init": init, "x": torch.stack(xs), "y": torch.stack(ys), "mask": torch.stack(masks)}


def _reference_ddp(case: Case, inputs: dict, device: torch.device) -> tuple[nn.Module, list, list]:
    model = make_model(case.model, case.dtype, inputs["init"][0]).to(device)
    opt = make_optimizer(case.knob("optimizer"), model.parameters())
    grads, params = [], []
    with like_a_worker(device):
        for step in range(case.knob("steps")):
            opt.zero_grad(set_to_none=True)
            model.use_extra = inputs["mask"][step].to(device)
            x, y = inputs["x"][step].to(device), inputs["y"][step].to(device)
            loss_fn(case.model, model(x), y).backward()
            grads.append(
                [None if p.grad is None else p.grad.detach().cpu().clone() for p in model.parameters()]
            )
            opt.step()
            params.append([p.detach().cpu().clone() for p in model.parameters()])
    return model, grads, params


def _rank_outputs(case: Case, payload: dict, shapes: list, state_shapes: list) -> tuple[list, list, list]:
    result = field(payload, "result", dict, "ddp")
    after = tensors(result.get("after_wrap"), "parameters and buffers after wrapping", state_shapes)
    steps = case.knob("steps")
    grads, params = field(result, "grads", list, "grads"), field(result, "params", list, "params")
    if len(grads) != steps or len(params) != steps:
        raise Untrusted(
            f"expected {steps} steps of gradients and parameters, got {len(grads)} and {len(params)}"
        )
    grads = [tensors(g, f"step {s} gradients", shapes, allow_none=True) for s, g in enumerate(grads)]
    params = [tensors(p, f"step {s} parameters", shapes) for s, p in enumerate(params)]
    return after, grads, params


def _grad_miss(
    name: str, got: torch.Tensor | None, ref: torch.Tensor | None, tol: Tolerance, ws: int, where: str
) -> str | None:
    if ref is None:
        nonzero = got is not None and bool(got.abs().max() > 0)
        return f"{where}: {name} has no gradient on any rank but got a nonzero one" if nonzero else None
    grad = torch.zeros_like(ref) if got is None else got
    if close(grad, ref, tol):
        return None
    summed = (
        ": gradients summed, not averaged (= world size x the full-batch gradient)"
        if close(grad, ws * ref, tol)
        else ""
    )
    return f"{where}: max |grad {name} - full-batch grad| = {fmt(max_diff(grad, ref))} > {tol.describe()}{summed}"


def judge_ddp(case: Case, inputs: dict, payloads: list[dict], device: torch.device) -> Verdict:
    model, ref_grads, ref_params = _reference_ddp(case, inputs, device)
    names = [n for n, _ in model.named_parameters()]
    shapes = [tuple(p.shape) for p in model.parameters()]
    start = make_model(case.model, case.dtype, inputs["init"][0])
    init0 = [*start.parameters(), *start.buffers()]  # tied weights once, as the worker lists them
    state_names = names + [n for n, _ in model.named_buffers()]
    tol, ws, every_rank = case.tolerance, case.world_size, case.knob("every_rank")
    misses: list[str | None] = []
    try:
        ranks = [_rank_outputs(case, p, shapes, [tuple(t.shape) for t in init0]) for p in payloads]
    except Untrusted as exc:
        return Verdict.failed(str(exc))
    wrap_tol = case.knob("wrap_tolerance")
    for r, (after, _, _) in enumerate(ranks):
        bad = [
            n for n, a, i in zip(state_names, after, init0, strict=True) if not close(a, i.detach(), wrap_tol)
        ]
        if bad:
            misses.append(
                f"parameters / buffers not broadcast from rank 0 at construction: rank {r}'s {bad[0]} differs from rank 0's"
            )
    for step in range(case.knob("steps")):
        for r, (_, grads, params) in enumerate(ranks if every_rank else ranks[:1]):
            where = f"step {step}" + (f", rank {r}" if every_rank else "")
            off = [
                i
                for i, (p, q) in enumerate(zip(params[step], ref_params[step], strict=True))
                if not close(p, q, tol)
            ]
            if off:
                i = off[0]
                misses.append(
                    f"{where}: max |{names[i]} - non-parallel model's| = {fmt(max_diff(params[step][i], ref_params[step][i]))} "
                    f"> {tol.describe()}"
                )
            grad_misses = [
                _grad_miss(n, g, q, tol, ws, where)
                for n, g, q in zip(names, grads[step], ref_grads[step], strict=True)
            ]
            if off or case.knob("every_step_gradients"):
                misses += grad_misses
    if case.knob("ranks_agree"):
        final = [torch.cat([p.reshape(-1) for p in params[-1]]) for _, _, params in ranks]
        spread = max(max_diff(f, final[0]) for f in final)
        if spread > 0:
            misses.append(
                f"ranks hold different weights after {case.knob('steps')} steps: max |rank r - rank 0| = {fmt(spread)}"
            )
    return Verdict.from_misses(misses)


# -- sharded optimizer --------------------------------------------------------------------------------


def make_sharded_inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    steps, batch = case.knob("steps"), case.knob("batch")
    pairs = [_batch(case, gen, batch, uniform=case.knob("draw") == "uniform") for _ in range(steps)]
    return {
        "init": _state(case, _seed(gen)),
        "x": torch.stack([x for x, _ in pairs]),
        "y": torch.stack([y for _, y in pairs]),
    }


def _reference_sharded(case: Case, inputs: dict, device: torch.device) -> tuple[nn.Module, list, dict]:
    model = make_model(case.model, case.dtype, inputs["init"]).to(device)
    model.use_extra = torch.ones(case.knob("batch"), dtype=torch.bool, device=device)
    cls, kwargs = optimizer_spec(case.knob("optimizer"))
    opt = cls(optimizer_params(case, model), **kwargs)
    params = []
    with like_a_worker(device):
        for step in range(case.knob("steps")):
            opt.zero_grad()
            sharded_loss(case, model, inputs["x"][step].to(device), inputs["y"][step].to(device)).backward()
            opt.step()
            params.append([p.detach().cpu().clone() for p in model.parameters()])
            if case.knob("add_after") == step:
                opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.03})
    index = {id(p): i for i, p in enumerate(model.parameters())}
    state = {
        index[id(p)]: {k: v.detach().cpu() for k, v in s.items() if isinstance(v, torch.Tensor)}
        for p, s in opt.state.items()
    }
    return model, params, state


def _ownership_misses(case: Case, states: list[dict], ref_state: dict, names: list[str]) -> list[str]:
    owners: dict[int, list[int]] = {}
    misses = []
    for rank, held in enumerate(states):
        for index, entries in held.items():
            owners.setdefault(index, []).append(rank)
            for key, ref in ref_state.get(index, {}).items():
                got = entries.get(key) if isinstance(entries, dict) else None
                if (
                    not isinstance(got, torch.Tensor)
                    or got.shape != ref.shape
                    or not close(got, ref, case.tolerance)
                ):
                    misses.append(
                        f"rank {rank}'s optimizer state {key!r} of {names[index]} is not the unsharded optimizer's"
                    )
    shared = {names[i]: r for i, r in owners.items() if len(r) > 1}
    if shared:
        example = next(iter(shared))
        misses.append(
            f"each rank must hold only its shard's state: {len(shared)} of {len(ref_state)} parameters have "
            f"optimizer state on several ranks, e.g. {example} on ranks {shared[example]}"
        )
    missing = [names[i] for i in ref_state if i not in owners]
    if missing:
        misses.append(
            f"no rank holds optimizer state for {missing} (looked in .state of the optimizers it holds)"
        )
    return misses[:6]


def judge_sharded(case: Case, inputs: dict, payloads: list[dict], device: torch.device) -> Verdict:
    model, ref_params, ref_state = _reference_sharded(case, inputs, device)
    names = [n for n, _ in model.named_parameters()]
    shapes = [tuple(p.shape) for p in model.parameters()]
    runs, states = [], []
    try:
        for payload in payloads:
            result = field(payload, "result", dict, "sharded")
            steps = field(result, "params", list, "params")
            if len(steps) != case.knob("steps"):
                raise Untrusted(f"expected {case.knob('steps')} steps of parameters, got {len(steps)}")
            runs.append([tensors(s, f"step {i} parameters", shapes) for i, s in enumerate(steps)])
            held = field(result, "state", dict, "state")
            states.append({int(k): v for k, v in held.items() if isinstance(k, int) and 0 <= k < len(names)})
    except Untrusted as exc:
        return Verdict.failed(str(exc))
    misses: list[str] = []
    checked = range(len(ref_params)) if case.knob("every_step") else [len(ref_params) - 1]
    for r, run in enumerate(runs):
        for step in checked:
            off = [
                i
                for i, (p, q) in enumerate(zip(run[step], ref_params[step], strict=True))
                if not close(p, q, case.tolerance)
            ]
            if off:
                i = off[0]
                misses.append(
                    f"rank {r}, step {step}: max |{names[i]} - unsharded {optimizer_spec(case.knob('optimizer'))[0].__name__}'s| = "
                    f"{fmt(max_diff(run[step][i], ref_params[step][i]))} > {case.tolerance.describe()}"
                )
                break
    if case.knob("ranks_agree"):
        final = [torch.cat([p.reshape(-1) for p in run[-1]]) for run in runs]
        spread = max(max_diff(f, final[0]) for f in final)
        if spread > 0:
            misses.insert(0, f"ranks hold different weights: max |rank r - rank 0| = {fmt(spread)}")
    if case.knob("state_ownership"):
        misses += _ownership_misses(case, states, ref_state, names)
    return Verdict.from_misses(misses)
