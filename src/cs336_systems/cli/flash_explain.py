"""Which FlashAttention kernels a call runs, and why: route, tuning key, config source, kernels.

    python -m cs336_systems.cli.flash_explain --shape 1,16,16384,64 --dtype bf16 --device cuda --compile

``--device cuda`` asks this machine's GPU (and the tuner's state in this process: the shipped table for
this GPU model, the tune cache). A GPU model's name (``--device "NVIDIA H100 80GB HBM3"``) works without
one: the choice that GPU would make from its shipped table, the rest marked as tuned live at the first
call (a GPU run confirms it). Inputs are taken as the handout passes them: contiguous (batch, heads, seq,
d) Q, K, V; O in the plan's layout; dO contiguous when compiled (the leaderboard's ``.sum()`` gradient
arrives expanded and the plan copies it) or, eager, in O's layout (the model's).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from cs336_systems.cli.common import Parser

if TYPE_CHECKING:
    import torch

    from cs336_systems.kernels import flash
    from cs336_systems.kernels.flash.select import Case, Layouts

# torch and the kernels are imported where they run: ``--help`` needs neither.
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # name -> torch's attribute
HOPPER = re.compile(r"\b(H100|H200|H800|H20|GH200)\b")  # sm_90 parts
ROUTES = {
    "plan": "the call signature's plan, launched from Python",
    "op": "an opaque custom op whose body runs the eager plan",
}


def _device(device: str) -> tuple[str, bool, bool]:
    """(name, is a GPU, is Hopper) of ``device``: "cuda", "cpu" or a GPU model's name."""
    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name()
        return name, True, torch.cuda.get_device_capability() == (9, 0)
    if device == "cpu":
        return "cpu", False, False
    return device, True, bool(HOPPER.search(device))


def _layouts(b: int, h: int, n: int, d: int, dtype: torch.dtype, hopper: bool, compile: bool) -> Layouts:
    import torch

    from cs336_systems.kernels import flash
    from cs336_systems.kernels.flash.select import layouts_of

    t = lambda: torch.empty(b, h, n, d, dtype=dtype, device="meta")
    o = flash.new_output(t())
    do = t() if compile else flash.new_output(t())
    lse = torch.empty(b, h, n, device="meta")
    return layouts_of(hopper, aligned=True, q=t(), k=t(), v=t(), o=o, do=do, lse=lse, dq=t(), dk=t(), dv=t())


def _config(kernel: str, case: Case, name: str, gpu: bool, local: bool) -> tuple[str, flash.TileConfig, str]:
    """The tuning key, the config the table or tuner supplies, and where it comes from (``local``: this
    machine's GPU, through the tuner)."""
    from cs336_systems.kernels import flash
    from cs336_systems.kernels.flash.configs import gpu_candidate_configs, key_str, tune_key
    from cs336_systems.kernels.flash.tune_table import read_table, table_path

    key = tune_key(kernel, *case)
    candidates = gpu_candidate_configs(kernel, case.d, case.dtype)
    live = f"live tuning at the first call ({len(candidates)} candidates by sustained time; shown: the first)"
    if not gpu:
        return key_str(key), candidates[0], "no GPU: the first candidate, untuned"
    if local:
        cfg = flash.TUNER.lookup(key, candidates)
        return key_str(key), cfg or candidates[0], flash.TUNER.source(key) if cfg else live
    table = read_table(table_path(name))
    cfg = table.entries.get(key)
    if cfg is not None and cfg in candidates:
        return key_str(key), cfg, f"shipped table ({table_path(name).name})"
    return key_str(key), candidates[0], f"{live}; table: {table.why_not or 'no entry'}"


def explain(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: str,
    compile: bool = False,
    deterministic: bool = False,
    causal: bool = True,
) -> str:
    """The report :func:`main` prints (a pure function of its arguments and the shipped tables)."""
    from cs336_systems.kernels import flash
    from cs336_systems.kernels.flash.select import Case, route_for

    b, h, n, d = shape
    name, gpu, hopper = _device(device)
    case = Case(b * h, n, n, d, causal, dtype)
    route = route_for(compiling=compile, dispatch_mode=False)
    configs, lines = {}, []
    for kernel in flash.KERNELS:
        key, cfg, source = _config(kernel, case, name, gpu, device == "cuda")
        configs[kernel] = cfg
        lines.append(f"  {kernel}: key {key}\n        config {cfg} from {source}")
    choice = flash.select(case, _layouts(b, h, n, d, dtype, hopper, compile), configs, deterministic)
    mode = "compiled" if compile else "eager"
    out = [
        f"case: batch*heads {case.bh}, n_q {n}, n_k {n}, d {d}, {'causal' if causal else 'full'}, "
        f"{str(dtype).removeprefix('torch.')}; {mode}; device {name} ({'sm_90' if hopper else 'not sm_90'})",
        f"route: {route} ({ROUTES[route]})",
        "configs (the table or the tuner asks):",
        *lines,
        f"kernels (select: what runs; deterministic={deterministic}), backward {choice.backward}:",
    ]
    for kernel in flash.KERNELS:
        p = choice.passes().get(kernel)
        if p is None:
            out.append(f"  {kernel}: no pass (the one-pass dK/dV kernel adds dQ into a float32 accumulator)")
            continue
        out.append(f"  {kernel}: {p.kernel} {p.config}")
        out += [f"        refused: {why}" for why in p.refused]
    if choice.backward == "one-pass":
        out.append("  (then D and the zeroed accumulator by flash_bwd_delta_kernel before it; dQ cast after)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = Parser("flash_explain", description=__doc__)
    p.add_argument("--shape", required=True, help="B,H,N,D (batch, heads, sequence, head dim)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="the inputs' dtype")
    p.add_argument(
        "--device", default="cuda", help='"cuda", "cpu" or a GPU model, e.g. "NVIDIA H100 80GB HBM3"'
    )
    p.add_argument("--compile", action="store_true", help="under torch.compile (CUDA graphs or not)")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    p.add_argument("--full", action="store_true", help="non-causal")
    a = p.parse_args(argv)
    b, h, n, d = (int(x) for x in a.shape.split(","))
    import torch

    dtype = getattr(torch, DTYPES[a.dtype])
    print(explain((b, h, n, d), dtype, a.device, a.compile, a.deterministic, not a.full))


if __name__ == "__main__":
    main()
