"""Benchmark harness: CUDA-graph replay timing, copy bandwidth, launch counts, results on disk.

Every benchmark times both arms of a comparison in the same process with ``graph_time_us``
(many calls captured in one CUDA graph, replayed several times, median per call) or, where the
arms' differences are a few percent, ``capture_graph`` + ``replay_times_us`` (the arms' replays
alternated round by round), measures the
device's copy bandwidth in the same run for the bytes floor, and writes JSON + PNG under
``benchmark/results/``.

Time first, profile last: once torch.profiler has run in a process, CUPTI stays attached (Kineto
does not tear it down) and every kernel of a later graph replay takes longer (~0.7 us per kernel
on the H200, 2026-12-01: the TP1 layer step at M = 16 went from 123.4 / 130.4 us chained / unchained
to 135.1 / 145.3 after one ``kernel_profile``). The overhead is per kernel, so it would charge the
arm with more launches more. ``replay_times_us`` refuses to time after ``kernel_profile``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..argtypes import output_dir

RESULTS_DIR = Path(__file__).resolve().parents[3] / "benchmark" / "results"


def capture_graph(fn: Callable[[], object], iters: int = 100) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``iters`` calls of ``fn``, replayed once (warm).

    ``fn`` must be capturable (no host sync; allocations come from the graph's own pool). Warms up
    eagerly first so compilation stays outside the graph. Whatever ``fn`` reads must stay alive as
    long as the graph is replayed. A ``rotating`` ``fn`` is captured from its first item on, over
    whole turns (``iters`` a multiple of its ``period``: ``graph_calls``), so that graphs replayed
    in turn meet at the rotation's usual distance: one graph's last call never reads the copy the
    next graph's first call reads. The graph keeps its call count as ``calls``
    (``replay_times_us`` checks it).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("timing CUDA graphs needs a CUDA device")
    period = getattr(fn, "period", 1)
    if iters % period:
        raise ValueError(f"{iters} calls of a rotation of {period} items: take graph_calls(fn, iters)")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if hasattr(fn, "reset"):
        fn.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    graph.calls = iters
    return graph


_profiler_used = False  # set by kernel_profile: later timings in this process would carry CUPTI's cost


class ProfiledProcessError(RuntimeError):
    """Timing asked for in a process where torch.profiler has already run."""


def replay_times_us(graphs: dict[str, torch.cuda.CUDAGraph], iters: int, rounds: int = 7) -> dict[str, float]:
    """Median microseconds per call of each graph of ``iters`` calls over ``rounds`` rounds, each
    round replaying every graph once in turn: drifts of clocks or temperature weigh on every arm
    alike, where timing one arm after the other would charge them to whichever ran second.
    Raises ``ProfiledProcessError`` after ``kernel_profile`` (see the module docstring), and
    ``ValueError`` for a graph of ``capture_graph`` captured with another call count than ``iters``
    (its per-call time would be off by their ratio)."""
    if _profiler_used:
        raise ProfiledProcessError("torch.profiler already ran in this process; CUPTI stays attached and "
                                   "slows every kernel of later replays: time first, profile last")
    for name, graph in graphs.items():
        calls = getattr(graph, "calls", iters)
        if calls != iters:
            raise ValueError(f"graph {name!r} holds {calls} calls, timed as {iters}: pass the count it was captured with")
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3 / iters)
    return {name: statistics.median(values) for name, values in samples.items()}


def graph_time_us(fn: Callable[[], object], iters: int = 100, repeats: int = 7) -> float:
    """Median microseconds per call of ``fn``, from ``repeats`` replays of a CUDA graph of
    ``iters`` calls (``capture_graph``); at least one call per item of a ``rotating`` ``fn``, so
    that the graph reads every weight copy."""
    iters = graph_calls(fn, iters)
    return replay_times_us({"fn": capture_graph(fn, iters)}, iters, repeats)["fn"]


def graph_calls(fn: Callable[[], object], iters: int) -> int:
    """Calls of ``fn`` per captured graph: ``iters`` rounded up to whole turns of a ``rotating``
    ``fn`` (a graph of fewer calls would leave copies unread, one of a part turn would end on a
    copy the next graph starts on: ``capture_graph``)."""
    period = getattr(fn, "period", 1)
    return -(-max(iters, 1) // period) * period


L2_DEFEAT_BYTES = 160 << 20  # weight copies that a benchmark rotates through add up to this


def pair_bytes(rows: int, cols: int, fmt) -> int:
    """Bytes of the FP8 pair of ``rows x cols`` values in ``fmt`` (an ``ActFormat``): one byte a
    value and its scales (``fmt.scale_shape``, 4-byte elements), what a producer writes and its
    consumer reads."""
    return rows * cols + rows * fmt.scale_shape(rows, cols)[1] * 4


def roofline_us(nbytes: float, bandwidth: float, flops: float = 0.0, rate: float | None = None) -> float:
    """The roofline of a launch in us: the larger of ``nbytes`` over ``bandwidth`` (bytes / s) and
    ``flops`` over ``rate`` (flop / s; None: the bytes alone)."""
    seconds = nbytes / bandwidth
    if rate:
        seconds = max(seconds, flops / rate)
    return seconds * 1e6


def copies_past_l2(nbytes: int, most: int = 64) -> int:
    """How many copies of an ``nbytes`` weight to rotate through so that every call streams its
    weights from HBM rather than L2 (the H200's 50 MB): ``L2_DEFEAT_BYTES`` of them in all, at
    most ``most`` copies (a 2.9 MB TP4 down shard takes 57)."""
    return max(1, min(most, -(-L2_DEFEAT_BYTES // nbytes)))


def rotating(fn: Callable[..., object], items: list[tuple]) -> Callable[[], object]:
    """A no-argument call that runs ``fn(*items[i])`` for i = 0, 1, 2, ... in turn (with
    ``copies_past_l2`` weight copies: each call reads weights the previous ones did not). Its
    ``period`` is ``len(items)`` (a graph of fewer calls would leave copies unread); ``reset()``
    starts the turn again from the first item."""
    state = {"i": 0}

    def call():
        item = items[state["i"] % len(items)]
        state["i"] += 1
        return fn(*item)

    call.period = len(items)
    call.reset = lambda: state.update(i=0)  # capture_graph: every graph from the first item on
    return call


def followed_by(call: Callable[[], object], after: Callable[[], object]) -> Callable[[], object]:
    """``call()`` then ``after()`` as one call, carrying a ``rotating`` ``call``'s ``period`` and
    ``reset`` (an arm that adds a launch to another arm's rotation turns with it)."""
    def both():
        return call(), after()

    for attr in ("period", "reset"):
        if hasattr(call, attr):
            setattr(both, attr, getattr(call, attr))
    return both


def copy_time_us(moved_bytes: int, device=None, iters: int = 100) -> float:
    """Graph-replay time of an elementwise copy that reads ``moved_bytes / 2`` and writes as many:
    what moving that many bytes costs at that size, launch latency included.

    An elementwise kernel does the copy: a ``copy_`` captured in a graph becomes a memcpy node
    served by the copy engines, which are slower than what kernels reach.
    """
    device = torch.device(device or "cuda")
    src = torch.randn(max(1, moved_bytes // 4), device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return graph_time_us(lambda: torch.neg(src, out=dst), iters=iters, repeats=7)


def copy_bandwidth(device=None, nbytes: int = 1 << 31) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written) of a large copy."""
    return 2 * nbytes / (copy_time_us(2 * nbytes, device, iters=10) * 1e-6)


def bf16_matmul_rate(device=None, size: int = 8192) -> float:
    """bf16 matmul throughput in flop/s: a ``size``-cubed torch matmul under graph replay (the
    tensor-core rate a kernel's flops are held against)."""
    device = torch.device(device or "cuda")
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    out = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    return 2 * size**3 / (graph_time_us(lambda: torch.matmul(a, b, out=out), iters=5, repeats=5) * 1e-6)


def fp8_matmul_rate(device=None, size: int = 8192) -> float:
    """e4m3 matmul throughput in flop/s: a ``size``-cubed ``torch._scaled_mm`` (per-tensor scales,
    bf16 output) under graph replay (the tensor-core rate an FP8 GEMM's flops are held against).
    Raises ``RuntimeError`` where torch has no FP8 ``_scaled_mm`` for this device."""
    device = torch.device(device or "cuda")
    if not hasattr(torch, "_scaled_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no torch._scaled_mm")
    a = torch.randn(size, size, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS reads it
    one = torch.ones((), device=device)

    def matmul():
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    return 2 * size**3 / (graph_time_us(matmul, iters=5, repeats=5) * 1e-6)


def kernel_profile(fn: Callable[[], object]) -> dict[str, dict[str, float]]:
    """Kernel name -> ``{"launches": n, "us": total GPU time}`` during one eager call of ``fn``
    (torch.profiler, CUDA activity), after one warm-up call. Kernels launch without PDL here: with
    it, a kernel's span would include its programs' wait for the kernel before it. No timing
    with ``replay_times_us`` may follow in this process."""
    from torch.profiler import ProfilerActivity, profile

    from fp8chain_kernel.launch import programmatic_launches

    global _profiler_used
    _profiler_used = True
    with programmatic_launches(False):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    kernels: dict[str, dict[str, float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, {"launches": 0, "us": 0.0})
            entry["launches"] += 1
            entry["us"] += event.time_range.elapsed_us()
    return kernels


def launch_counts(kernels: dict[str, dict[str, float]]) -> dict[str, int]:
    """Kernel name -> launches, from a ``kernel_profile`` result."""
    return {name: int(entry["launches"]) for name, entry in kernels.items()}


def count_launches(fn: Callable[[], object]) -> dict[str, int]:
    """Kernel name -> launches during one call of ``fn`` (``kernel_profile``)."""
    return launch_counts(kernel_profile(fn))


def quantize_launches(launches: dict[str, int]) -> int:
    """Launches of the standalone quantize kernel among ``count_launches`` results."""
    return sum(n for name, n in launches.items() if "_quantize_kernel" in name)


def _git_commit(checkout: Path = Path(__file__).parent) -> str:
    """HEAD of the checkout, ``-dirty`` when it has uncommitted changes (the figures then measured
    other code), or ``FP8CHAIN_COMMIT`` where the tree travelled without ``.git`` (e.g.
    ``FP8CHAIN_COMMIT=$(git rev-parse --short HEAD)`` in the remote command)."""
    if os.environ.get("FP8CHAIN_COMMIT"):
        return os.environ["FP8CHAIN_COMMIT"]
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
                              capture_output=True, text=True, cwd=checkout, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_meta() -> dict:
    """Date, device, commit, versions and whether kernels launch with PDL: what every recorded
    figure carries."""
    import triton

    from fp8chain_kernel import launch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device,
        "commit": _git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "programmatic_dependent_launch": launch.enabled(),
    }


def save_results(name: str, meta: dict, records: list[dict], results_dir: Path | None = None) -> Path:
    """Write ``{"meta": ..., "records": [...]}`` to ``<results_dir>/<name>.json``; return the path."""
    out_dir = Path(results_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=2, default=str))
    return path


def plot_records(name: str, records: list[dict], x: str, y_keys: Iterable[str], ylabel: str,
                 group: str | None = None, results_dir: Path | None = None, logy: bool = True) -> Path:
    """One PNG: ``y_keys`` against ``x`` (log-log), one panel per value of ``group``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    y_keys = list(y_keys)
    groups = sorted({r[group] for r in records}, key=str) if group else [None]
    cols = min(3, len(groups))
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, value in zip(axes.flat, groups):
        subset = [r for r in records if group is None or r[group] == value]
        for key in y_keys:
            points = [(r[x], r[key]) for r in subset if r.get(key) is not None]
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", label=key)
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel)
        if value is not None:
            ax.set_title(str(value), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_visible(False)
    fig.tight_layout()
    out_dir = Path(results_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown_table(records: list[dict], columns: list[str]) -> str:
    """A markdown table of ``columns`` (floats to 4 significant digits, lists of floats joined by
    ' / ', None as '-')."""

    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):  # 4 digits: 0.8996 and 0.9004 read apart at the 0.90 line
            return f"{value:.4g}"
        if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
            return " / ".join(cell(v) for v in value)
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in records]
    return "\n".join(lines)


def progress(iterable, desc: str, total: int | None = None):
    """A progress bar on stderr (tqdm); none when stderr is not a terminal (a log file, a pipe)."""
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, dynamic_ncols=True, leave=False, disable=None)


def add_results_dir(parser: argparse.ArgumentParser) -> None:
    """``--results-dir`` unless the benchmark declares it itself."""
    if "--results-dir" not in parser._option_string_actions:
        parser.add_argument("--results-dir", default=None, type=output_dir,
                            help="where JSON/PNG/markdown go (default benchmark/results)")


def _as_words(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def add_quick(parser: argparse.ArgumentParser, **sweeps: tuple[object, object]) -> None:
    """``--quick``, the reduced sweep: ``sweeps[name] = (full, quick)`` for options already declared.
    An option given on the command line wins; the others take ``quick`` under --quick and ``full``
    otherwise (filled in by ``apply_quick`` after parsing). States both values in each option's help."""
    actions = {action.dest: action for action in parser._actions}
    missing = sorted(set(sweeps) - set(actions))
    if missing:
        raise ValueError(f"add_quick: no option declared for {missing}")
    for name, (full, quick) in sweeps.items():
        actions[name].default = None  # "not given": apply_quick fills it
        actions[name].help = f"{actions[name].help} (default: {_as_words(full)}; --quick: {_as_words(quick)})"
    reduced = ", ".join(f"--{name.replace('_', '-')} {_as_words(quick)}" for name, (_, quick) in sweeps.items())
    parser.add_argument("--quick", action="store_true",
                        help=f"the reduced sweep: {reduced} (an option given explicitly wins)")
    parser.set_defaults(quick_sweeps=sweeps)


def apply_quick(args: argparse.Namespace) -> argparse.Namespace:
    """Fill in the options ``add_quick`` declared and the command line left out (in place)."""
    for name, (full, quick) in getattr(args, "quick_sweeps", {}).items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def benchmark_main(doc: str, add_arguments, run, report, argv=None) -> None:
    """``python benchmark/<name>.py``: parse, run, print the device line and the report."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    add_results_dir(parser)
    args = apply_quick(parser.parse_args(argv))
    meta, records = run(args)
    print(f"device {meta['device']}, copy {meta['copy_bandwidth_TBps']:.2f} TB/s, commit {meta['commit']}")
    print(report(meta, records, args.results_dir))
