"""End-to-end benchmark of the Transformer LM (handout benchmarking_script, nsys_profile, memory_profiling).

    python -m cs336_systems.cli.benchmark --size xl --context 512 --mode train --dtype bf16 --compile \\
        --warmup 5 --steps 10 [--attention sdpa] [--profile DIR] [--memory-snapshot FILE]

``--size``, ``--context``, ``--mode`` and ``--dtype`` take several values; every combination runs in
this one process (each freed before the next). Timing, OOM handling and the step itself are the same
code as the bench cases (``profiling.workload`` and ``harness.model_case``). Prints a table; ``--json`` also writes
the rows. NVTX ranges stay in, so ``nsys profile python -m cs336_systems.cli.benchmark ...`` works where
nsys is installed; ``--profile`` gives the torch.profiler equivalent without it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from tabulate import tabulate

from cs336_systems.cli import choices
from cs336_systems.cli.common import Parser, check_outputs
from cs336_systems.rows.contention import INTERPRETER_NOTE, row_verdict, verdict_label

if TYPE_CHECKING:  # the rest imports torch: imported where used, after the arguments parsed
    import torch

    from cs336_systems.profiling.profiler import ProfileSummary
    from cs336_systems.profiling.workload import Case, Workload

OVERRIDES = ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size")


def build_parser() -> argparse.ArgumentParser:
    p = Parser("benchmark", description=__doc__)
    p.add_argument(
        "--size", nargs="+", default=["small"], choices=choices.PRESET_NAMES, help="model preset(s)"
    )
    p.add_argument("--context", nargs="+", type=int, default=[512], help="context length(s)")
    p.add_argument(
        "--mode",
        nargs="+",
        default=["fwd_bwd"],
        choices=[*choices.MODES, *choices.MODE_ALIASES],
        help="what one step runs",
    )
    p.add_argument(
        "--dtype", nargs="+", default=["fp32"], choices=choices.DTYPE_NAMES, help="bf16 = bf16 autocast"
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the whole model")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument(
        "--cudagraphs",
        action="store_true",
        help='with --compile: mode="reduce-overhead", the compiled step replayed from CUDA graphs',
    )
    p.add_argument("--attention", default="pytorch", help="attention implementation (registry name)")
    p.add_argument("--checkpoint", default="none", help="activation checkpointing: none, every:K or nested")
    p.add_argument("--fused-loss", action="store_true", help="fused LM-head + cross-entropy (no logits)")
    p.add_argument("--batch", type=int, default=choices.BATCH_SIZE, help="sequences per step")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)"
    )
    for name in OVERRIDES:
        p.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"override the preset's {name}"
        )
    p.add_argument("--no-mfu", action="store_true", help="skip measuring the matmul rate (no MFU column)")
    p.add_argument(
        "--profile", metavar="DIR", type=Path, help="torch.profiler summary + Chrome trace into DIR"
    )
    p.add_argument("--profile-steps", type=int, default=1, help="steps recorded by --profile")
    p.add_argument(
        "--memory-snapshot",
        metavar="FILE",
        type=Path,
        help="CUDA memory-history pickle of one step (for pytorch.org/memory_viz); several cases: FILE gets the case id",
    )
    p.add_argument("--json", metavar="FILE", type=Path, help="also write the result rows as JSON")
    p.add_argument(
        "--show-unreliable",
        action="store_true",
        help="print the figures of rows timed under contention too, marked '*' (default: 'unreliable')",
    )
    p.add_argument("--traceback", action="store_true", help="a failing case shows its full traceback")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    return p


def parse_device(parser: argparse.ArgumentParser, spec: str | None) -> torch.device:
    """``--device`` as a torch device this machine has; anything else is an argparse error."""
    import torch

    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        parser.error(f"--device {spec!r} is not a device; use cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {spec!r}: this CLI runs on cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            parser.error(
                f"--device {spec!r}: no CUDA GPU is available here (torch {torch.__version__}, "
                "torch.cuda.is_available() is False); use --device cpu"
            )
        if device.index is not None and device.index >= count:
            parser.error(f"--device {spec!r}: only {count} CUDA GPU(s) here (cuda:0 to cuda:{count - 1})")
    return device


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[torch.device, list[Case]]:
    """Every check that can fail before a case runs, as argparse errors (exit 2): the device, step
    counts, output paths, the compile backend and the cases themselves."""
    import torch

    from cs336_systems.harness.environment import device_name
    from cs336_systems.profiling.memory import require_cuda

    device = parse_device(parser, args.device)
    if args.warmup < 0 or args.steps < 1:
        parser.error(f"need --warmup >= 0 and --steps >= 1, got {args.warmup} and {args.steps}")
    if args.profile_steps < 1:
        parser.error(f"need --profile-steps >= 1, got {args.profile_steps}")
    # written after the run: a path that cannot be written is found now, not after every case ran
    outputs = {"--json": (args.json, False), "--profile": (args.profile, True)}
    check_outputs(parser, {**outputs, "--memory-snapshot": (args.memory_snapshot, False)})
    if args.compile and args.compile_backend not in torch._dynamo.list_backends(exclude_tags=None):
        backends = ", ".join(torch._dynamo.list_backends())
        parser.error(
            f"--compile-backend {args.compile_backend!r} is not a torch.compile backend; try {backends}"
        )
    if args.cudagraphs and args.compile and (device.type != "cuda" or args.compile_backend != "inductor"):
        parser.error(
            f"--cudagraphs needs a CUDA device and the inductor backend, got {device} and "
            f"--compile-backend {args.compile_backend}"
        )
    if "bf16" in args.dtype and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        parser.error(f"--dtype bf16: {device_name(device)} does not support bf16")
    try:
        if args.memory_snapshot is not None:
            require_cuda(device, "--memory-snapshot")
        return device, make_cases(args)
    except ValueError as exc:
        parser.error(str(exc))


class Progress:
    """What the CLI is doing, on stderr (stdout keeps the tables): the matmul-rate probe, then per
    case the build, the warm-up steps (the first step of a compiled model compiles it) and the timed
    steps, with the elapsed time. On a terminal one line is rewritten in place; elsewhere (logs, CI)
    each update is a line of its own."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.prefix, self.compiling = "", False
        self.start = self.last = time.perf_counter()

    def _write(self, text: str, final: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write(f"\r\x1b[K{text}" + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        self._write(text, final=True)

    def case(self, index: int, case: Case) -> None:
        self.prefix, self.compiling = f"[{index}/{self.total}] {case.id}", case.compile
        self.start = time.perf_counter()
        self._write(f"{self.prefix}: building the model")

    def __call__(self, phase: str, done: int, total: int) -> None:
        """``run_benchmark``'s callback: ``phase`` is "warm-up" or "step", ``done`` of ``total`` are
        finished (0: the phase starts)."""
        now = time.perf_counter()
        if not self.tty and 0 < done < total and now - self.last < 1.0:
            return  # logs get a line per phase boundary and at most one a second in between
        self.last = now
        if done:
            self.compiling = False
        note = " (the first step compiles the model)" if self.compiling else ""
        bar = "#" * round(20 * done / total)
        self._write(f"{self.prefix}: {phase} {done}/{total} [{bar:<20}] {now - self.start:.1f} s{note}")

    def done(self) -> None:
        self._write(f"{self.prefix}: done in {time.perf_counter() - self.start:.1f} s", final=True)


def make_cases(args: argparse.Namespace) -> list[Case]:
    from cs336_systems.profiling.workload import Case

    overrides = tuple((k, getattr(args, k)) for k in OVERRIDES if getattr(args, k) is not None)
    return [
        Case(
            size,
            ctx,
            mode,
            dtype,
            args.compile,
            args.attention,
            args.batch,
            overrides,
            args.checkpoint,
            args.fused_loss,
            args.cudagraphs,
        )
        for size, ctx, dtype, mode in itertools.product(args.size, args.context, args.dtype, args.mode)
    ]


def _case_path(path: Path, case: Case, many: bool) -> Path:
    if not many:
        return path
    suffixes = "".join(path.suffixes)
    return path.with_name(f"{path.name[: len(path.name) - len(suffixes)]}-{case.id}{suffixes or '.pickle'}")


def make_after(
    args: argparse.Namespace, case: Case, device: torch.device, many: bool
) -> Callable[[Workload], dict[str, Any]] | None:
    """The extra passes on the warmed-up model: profiler summary and/or memory snapshot."""
    from cs336_systems.profiling.memory import snapshot_step

    if args.profile is None and args.memory_snapshot is None:
        return None

    def after(workload: Workload) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if args.profile is not None:
            out.update(run_profile(workload, args.profile, args.profile_steps))
        if args.memory_snapshot is not None:
            path = _case_path(args.memory_snapshot, case, many)
            out.update(snapshot_step(workload.step, path, device, warmup=0))
            out["snapshot"] = str(path)
            print(f"memory snapshot: {path} ({out['snapshot_file_mib']:.1f} MiB) -> pytorch.org/memory_viz")
        return out

    return after


def run_profile(workload: Workload, directory: Path, steps: int) -> dict[str, Any]:
    from cs336_systems.profiling.flops import forward_flops
    from cs336_systems.profiling.profiler import profile_step

    case = workload.case
    directory.mkdir(parents=True, exist_ok=True)
    trace = directory / f"{case.id}.trace.json.gz"
    summary = profile_step(workload.step, workload.device, steps=steps, warmup=0, trace_path=trace)
    answers = summary.d3_answers(forward_flops(case.config, case.batch, case.ctx))
    kernels = summary.launches.groupby(["kernel", "category"]).duration_us.agg(["size", "sum"]).reset_index()
    kernels.to_csv(directory / f"{case.id}.kernels.csv", index=False)
    (directory / f"{case.id}.d3.json").write_text(json.dumps(answers, indent=2, default=str))
    print_profile(case, summary, answers)
    print(f"chrome trace: {trace}")
    return {"profile_trace": str(trace), **{f"d3_{k}": v for k, v in answers.items()}}


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def print_profile(case: Case, summary: ProfileSummary, answers: dict[str, Any]) -> None:
    print(f"\n== profile {case.id} ({summary.device_type}, {summary.steps} step(s), per step) ==")
    print(tabulate(summary.range_table(), headers="keys", tablefmt="github", floatfmt=".3f", showindex=False))
    scopes = {
        "forward": ["forward"],
        "forward+backward": ["forward", "loss", "backward"],
        "step": ["profiled step"],
    }
    for title, ranges in scopes.items():
        if not summary.launches[ranges].any(axis=None):
            continue
        top = summary.top_kernels(ranges, n=8).assign(kernel=lambda t: t["kernel"].map(_short))
        print(f"\ntop kernels, {title}:")
        print(tabulate(top, headers="keys", tablefmt="github", floatfmt=".3f", showindex=False))
    print("\nD3 answers:")
    for key, value in answers.items():
        print(f"  {key}: {_short(value, 200) if isinstance(value, str) else value}")


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


HEADERS = ("case", "mean ms", "std ms", "tokens/s", "TFLOP/s", "MFU % meas", "MFU % peak", "peak MiB")
UNRELIABLE_MARK = "*"


def _cells(r: dict[str, Any], show_unreliable: bool = False) -> list[str]:
    """One row's cells: significant digits, not fixed decimals (0.004 TFLOP/s is not 0.0); a row
    timed under contention shows no figures (with ``show_unreliable``: its figures marked ``*``),
    its reason goes on the line below."""
    if r.get("oom"):
        return [r["case"], "OOM", *[""] * 6]
    if r.get("contention") and not show_unreliable:
        return [r["case"], verdict_label(r["contention"]), *["-"] * 5, _fmt(r.get("peak_memory_mib"), ",.0f")]
    mark = UNRELIABLE_MARK if r.get("contention") else ""
    timed = [
        _fmt(r.get("mean_ms"), ".4g"),
        _fmt(r.get("std_ms"), ".2g"),
        _fmt(r.get("tokens_per_s"), ",.0f"),
        _fmt(r.get("tflops"), ".3g"),
        _fmt(100 * r["mfu"] if "mfu" in r else None, ".3g"),
        _fmt(100 * r["mfu_peak"] if "mfu_peak" in r else None, ".3g"),
    ]
    return [r["case"], *(c + mark if c != "-" else c for c in timed), _fmt(r.get("peak_memory_mib"), ",.0f")]


def mfu_legend(gpu: str, rates: dict[str, float]) -> str:
    """What the two MFU columns divide by, and the FLOP count they divide (named: conventions differ)."""
    from cs336_systems.profiling.flops import DENSE_BF16_PEAK_TFLOPS, MODEL_FLOP_FORMULA

    rate_note = ", ".join(f"{k} {v:.3g}" for k, v in rates.items()) or "not measured (--no-mfu)"
    peaks = ", ".join(f"{k} {v:g}" for k, v in DENSE_BF16_PEAK_TFLOPS.items())
    return (
        f"MFU % meas: of the dense matmul rate measured here (TFLOP/s: {rate_note}); MFU % peak: of the "
        f"GPU's dense bf16 peak ({peaks} TFLOP/s; '-' for {gpu} when it is not one of them)\n{MODEL_FLOP_FORMULA}"
    )


SHOW_HINT = f"--show-unreliable prints its figures, marked {UNRELIABLE_MARK}"


def verdict_line(why: str, shown: bool) -> str:
    """The line under a row whose timing is no result; when its figures are withheld, it names the
    flag that prints them (issue 73: the CLI withheld them without saying how to see them)."""
    mark = f"{UNRELIABLE_MARK} " if shown else ""
    hint = "" if shown else f" ({SHOW_HINT})"
    if why == INTERPRETER_NOTE:
        return f"  ^ {mark}{INTERPRETER_NOTE}{hint}"
    return f"  ^ {mark}unreliable timing: {why}; rerun on a quiet machine{hint}"


class RowPrinter:
    """The result table, streamed: the header once, then each case's row as it finishes (a long
    sweep shows its results as it goes, and no row is printed twice)."""

    def __init__(self, case_width: int, stream: TextIO | None = None, show_unreliable: bool = False):
        self.widths = [max(case_width, len(HEADERS[0])), *(max(10, len(h)) for h in HEADERS[1:])]
        self.stream = stream or sys.stdout
        self.started = False
        self.show_unreliable = show_unreliable

    def _line(self, cells: Sequence[str]) -> str:
        first = f"{cells[0]:<{self.widths[0]}}"
        return (
            "| "
            + " | ".join([first, *(f"{c:>{w}}" for c, w in zip(cells[1:], self.widths[1:], strict=True))])
            + " |"
        )

    def row(self, r: dict[str, Any]) -> None:
        if not self.started:
            rule = "|" + "|".join("-" * (w + 2) for w in self.widths) + "|"
            self.stream.write(self._line(HEADERS) + "\n" + rule + "\n")
            self.started = True
        self.stream.write(self._line(_cells(r, self.show_unreliable)) + "\n")
        if r.get("contention"):
            self.stream.write(verdict_line(r["contention"], self.show_unreliable) + "\n")
        self.stream.flush()


def format_table(rows: Sequence[dict[str, Any]], show_unreliable: bool = False) -> str:
    """The rows as one GitHub table (e.g. for a log); ``main`` streams them through RowPrinter."""
    cells = [_cells(r, show_unreliable) for r in rows]
    return tabulate(cells, headers=HEADERS, tablefmt="github", disable_numparse=True)


def _one_line(case: Case, exc: BaseException) -> str:
    """A case that failed, in one line: what and where, not a traceback (``--traceback`` shows it)."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"error: case {case.id}: {type(exc).__name__}: {first} (--traceback shows where)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import torch

    import cs336_systems.cli.triton_env  # noqa: F401  (sets TRITON_INTERPRET before any kernel import)
    from cs336_systems.harness.environment import device_name
    from cs336_systems.harness.model_case import benchmark_model_case
    from cs336_systems.harness.record import Recorder
    from cs336_systems.profiling.workload import peak_rate

    device, cases = check_args(parser, args)
    progress = Progress(len(cases), enabled=not args.no_progress)
    rates: dict[str, float] = {}
    rows = []
    printer = RowPrinter(max(len(c.id) for c in cases), show_unreliable=args.show_unreliable)
    for index, case in enumerate(cases, 1):
        if not args.no_mfu and case.dtype not in rates:
            progress.note(f"measuring the {case.dtype} matmul rate on {device} (the MFU denominator)")
        rate = None if args.no_mfu else peak_rate(device, case.dtype, rates)
        after = make_after(args, case, device, many=len(cases) > 1)
        progress.case(index, case)
        try:
            info = benchmark_model_case(
                Recorder(),
                case,
                device,
                warmup=args.warmup,
                rounds=args.steps,
                peak_tflops=rate,
                compile_backend=args.compile_backend,
                after=after,
                progress=progress,
            )
        except Exception as exc:  # out of memory is a row already; anything else ends the run here
            if args.traceback:
                raise
            print(_one_line(case, exc), file=sys.stderr)
            return 1
        progress.done()
        info = {"case": case.id, **info}
        why = None if info.get("oom") else row_verdict(info)  # the report's and the bench table's verdict
        if why:  # recorded in the row too, so the report marks it as well
            info["contention"] = why
            if args.profile is not None:  # the profile ran under the same load: one verdict for both
                print(f"  ^ the profile of {case.id} ran under the same contention ({info['contention']})")
        rows.append(info)
        printer.row(info)
    gpu = device_name(device)
    print(f"\n{gpu}, torch {torch.__version__}\n{mfu_legend(gpu, rates)}")
    if args.json is not None:
        if not args.json.parent.exists():
            args.json.parent.mkdir(parents=True)
            print(f"created the folder {args.json.parent} for --json", file=sys.stderr)
        args.json.write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
