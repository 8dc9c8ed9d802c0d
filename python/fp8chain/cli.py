"""The ``fp8chain`` command: demo, bench, verify, info.

    fp8chain demo                 tiny DSv4.1 checkpoint, chain on vs off, tokens + launches saved
    fp8chain bench {quant,producers,gemm,attention,layer,all} [--quick]
    fp8chain verify               bitwise / accuracy checks of the kernels on the hardware present
    fp8chain info                 GPU, arch, consumer backends found and rejected
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from .argtypes import output_dir, output_dir_problem

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "benchmark"
BENCHMARKS = ["quant", "producers", "gemm", "attention", "layer"]


def _named(argv: list[str] | None) -> argparse.Namespace:
    """The subcommand and ``--device`` on the command line, read before the full parser is built."""
    wanted = argparse.ArgumentParser(add_help=False)
    wanted.add_argument("command", nargs="?")
    wanted.add_argument("--device")
    return wanted.parse_known_args(sys.argv[1:] if argv is None else argv)[0]


def _use_interpreter_for_cpu(named: argparse.Namespace) -> None:
    """Kernels run on the Triton CPU interpreter when there is no GPU, or when ``demo --device cpu``
    asks for the CPU on a machine with one. Set before any kernel module loads (``build_parser``
    loads the benchmarks for ``bench``, which import them): a kernel compiled for the GPU cannot run
    on CPU tensors."""
    import torch

    if not torch.cuda.is_available() or (named.command == "demo" and named.device == "cpu"):
        os.environ["TRITON_INTERPRET"] = "1"  # the only way kernels run there (a 0 set by hand included)


def _load_benchmark(name: str):
    path = BENCH_DIR / f"{name}.py"
    if not path.exists():
        raise SystemExit(f"benchmark '{name}' not found at {path} (run from a source checkout)")
    spec = importlib.util.spec_from_file_location(f"fp8chain_benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_parser(sub, benchmarks: bool) -> None:
    """``bench`` and, with ``benchmarks``, each benchmark's own options (loading benchmark/*.py,
    which imports torch and the kernels: only for a ``bench`` command line)."""
    from fp8chain.bench import harness

    bench = sub.add_parser("bench", help="run benchmarks on the GPU found (JSON + PNG + markdown)",
                           description="Per-op and per-layer benchmarks: CUDA-graph replay, median "
                                       "of many, both arms in one process.")
    if not benchmarks:
        return
    which = bench.add_subparsers(dest="benchmark", required=True, metavar="{" + ",".join(BENCHMARKS + ["all"]) + "}")
    for name in BENCHMARKS:
        path = BENCH_DIR / f"{name}.py"
        module = _load_benchmark(name) if path.exists() else None
        doc = (module.__doc__ or "").strip() if module is not None else ""
        parser = which.add_parser(name, help=doc.splitlines()[0] if doc else f"benchmark/{name}.py",
                                  description=f"benchmark/{name}.py: {doc}" if doc else f"benchmark/{name}.py",
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        if module is not None:
            module.add_arguments(parser)
        harness.add_results_dir(parser)
    everything = which.add_parser("all", help="every benchmark in turn",
                                  description="Every benchmark in turn, each in a process of its own; exit status 1 "
                                              "when any failed.")
    everything.add_argument("--quick", action="store_true", help="the reduced sweep of each benchmark")
    everything.add_argument("--results-dir", default=None, type=output_dir, help="where JSON/PNG/markdown go")


def _run_benchmark(name: str, args) -> None:
    from fp8chain.bench import harness

    module = _load_benchmark(name)
    meta, records = module.run(harness.apply_quick(args))
    if hasattr(module, "report"):  # its first line: the JSON it saved (a sweep saves under its own name)
        text = module.report(meta, records, args.results_dir)
        path = Path(text.splitlines()[0])
    else:
        path = harness.save_results(name, meta, records, args.results_dir)
        columns = list(dict.fromkeys(k for r in records for k in r))
        text = f"{path}\n" + harness.markdown_table(records, columns)
    header = (f"### {name} - {meta.get('date')}, {meta.get('device')}, commit {meta.get('commit')}, "
              f"torch {meta.get('torch')}, triton {meta.get('triton')}")
    if "copy_bandwidth_TBps" in meta:
        header += f", copy bandwidth {meta['copy_bandwidth_TBps']:.2f} TB/s (measured in this run)"
    path.with_suffix(".md").write_text(header + "\n\n" + text + "\n")  # beside its JSON
    print(header)
    print(text)


def _cmd_bench(args) -> int:
    import torch

    from fp8chain.bench import harness

    if args.results_dir is None and (problem := output_dir_problem(harness.RESULTS_DIR)) is not None:
        print(f"fp8chain bench: cannot write to {problem}; pass --results-dir", file=sys.stderr)  # before the GPU work
        return 2
    if not torch.cuda.is_available():
        print("fp8chain bench needs a CUDA GPU; none found (kernel logic is checked on CPU by "
              "`fp8chain verify` and the test suite)", file=sys.stderr)
        return 2
    if args.benchmark != "all":
        _run_benchmark(args.benchmark, args)
        return 0
    failed, ran = [], 0
    for name in BENCHMARKS:
        if not (BENCH_DIR / f"{name}.py").exists():
            print(f"[skip] benchmark/{name}.py is not in this checkout")
            continue
        ran += 1
        # each benchmark in a process of its own: after one benchmark's torch.profiler launch
        # counts, every kernel a later one times would be slower (fp8chain.bench.harness)
        command = [sys.executable, "-m", "fp8chain", "bench", name] + (["--quick"] if args.quick else [])
        if args.results_dir:
            command += ["--results-dir", str(args.results_dir)]
        if subprocess.run(command).returncode != 0:  # one broken benchmark must not hide the others
            failed.append(name)
    if failed:
        print("failed benchmarks:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    if not ran:
        print(f"no benchmark ran: {BENCH_DIR} holds none (run from a source checkout)", file=sys.stderr)
        return 1
    return 0


def _cmd_demo(args) -> int:
    from fp8chain.runtime.demo import run_demo

    return run_demo(args) or 0


def _cmd_verify(args) -> int:
    from fp8chain.verify import run_checks

    return 0 if run_checks(quick=args.quick) else 1


def _cmd_info(args) -> int:
    import torch
    import triton

    # where Triton comes from: a PYTHONPATH can put another release before the installed one
    print(f"torch {torch.__version__}, triton {triton.__version__} from {triton.__file__}, "
          f"python {sys.version.split()[0]}")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print(f"GPU: {props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
              f"{props.total_memory / 2**30:.0f} GiB")
    else:
        print("GPU: none (kernels run on the Triton CPU interpreter)")
    from fp8chain_kernel import backends, einsum, gemm, launch, mhc
    from fp8chain_kernel.formats import ActFormat

    tested_releases = ((3, 6), (3, 8))  # pyproject's triton pin admits these
    tested = "tested" if launch.triton_release() in tested_releases else "untested"
    dotted = "{}.{}".format
    names = " and ".join(dotted(*release) for release in tested_releases)
    # where the M = 64 GEMM entries cap registers: at every token-scale stride from Triton 3.7 on
    aligned = gemm.ALIGNED_SCALE_STRIDE
    cap_where = "" if gemm.m64_register_cap(aligned) else f" where the token scales' stride is not a multiple of {aligned}"
    # the M-bucket-256 launches: up to 3.6 both capped on padded token-scale rows, from 3.7 on the
    # gate_up with the SiLU*mul epilogue at every M
    bucket256 = ("on padded token-scale rows" if gemm.bucket256_register_cap(True, False)
                 else "for the gate_up with the SiLU*mul epilogue")
    finish_tokens = mhc.stats_finish_tokens(rows=256, split_tile=1)
    finish = "one token a program" if finish_tokens == 1 else f"up to {finish_tokens} tokens a program"
    pipelined = "unpipelined" if mhc.stats_partial_stages(mhc.DECODE_STATS_TILE) else "pipelined"
    print(f"triton release: {tested} (fp8chain tests {names}; launch tables swept under "
          f"{dotted(*launch.SWEPT_RELEASE)}), FP8-weight wo_a "
          f"tiles up to {einsum.FP8_WEIGHT_TILE_ROWS} rows, M = 64 GEMM entries capped at "
          f"{gemm.THREE_PROGRAMS_PER_SM} registers{cap_where}, M-bucket-256 entries capped {bucket256}, "
          f"mHC stats finish: {finish}, "
          f"mHC stats partial sums at decode: {pipelined}")
    caps = backends.probe()
    print(f"capabilities: {caps}")
    print("programmatic dependent launch: " + ("on" if launch.enabled() else
          "off (" + ("FP8CHAIN_PDL=0" if launch.supported() else "needs sm_90+ and compiled kernels") + ")"))
    compiled = torch.cuda.is_available() and launch.compiled_for_gpu(torch.device("cuda", 0))
    off = "the Triton interpreter runs programs one after another" if not compiled else mhc.row_barrier_off_reason()
    barrier = "on" if off is None else f"off ({off})"
    print(f"mHC boundary row barrier at decode: {barrier}")
    for block, fmt in ((32, backends.input_format_for(32)), (128, ActFormat.SM90_G128_FP32_MN)):
        for n, k in ((1792, 5120), (5120, 8192)):
            print(f"weight block {block}, {fmt.value}, N={n} K={k}:")
            for name in backends.BACKEND_NAMES:
                reason = backends.get_backend(name).rejection(fmt, block, n, k)
                print(f"  {name:16s} {'usable' if reason is None else 'rejected: ' + reason}")
    print(_sglang_plugin_status())
    return 0


def _sglang_plugin_status() -> str:
    """Whether SGLang would find fp8chain's plugin, whether SGLang itself is importable, and
    whether the plugin acts on this machine's device."""
    import importlib.metadata
    import importlib.util

    import torch

    from fp8chain.integrations.sglang import PLUGIN_GROUP, why_idle

    entries = [ep.value for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP) if ep.name == "fp8chain"]
    registered = f"registered ({entries[0]})" if entries else "not registered (reinstall fp8chain)"
    sglang = "importable" if importlib.util.find_spec("sglang") else "not installed"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    idle = why_idle(device)
    acts = ("leaves every layer to upstream: " + idle if idle else
            "feeds DeepSeek-V4's wqkv_a, wq_b, wo_b and shared-expert gate_up_proj and down_proj from fp8chain's producers")
    return f"SGLang plugin: {PLUGIN_GROUP} entry point {registered}; sglang {sglang}; on {device.type}: {acts}"


def build_parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """The whole command line; ``benchmarks=False`` leaves ``bench``'s own options out (other commands)."""
    parser = argparse.ArgumentParser(prog="fp8chain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="tiny DSv4.1 model, chain on vs off (CPU or GPU)",
                          description="A tiny random DSv4.1 checkpoint, generated with the FP8 chain on and off: "
                                      "the tokens, whether they are identical (exit status 1 if not) and the "
                                      "standalone quantize launches saved per decode step.")
    try:
        from fp8chain.runtime.demo import add_demo_arguments
    except ImportError:  # runtime not installed in a kernel-only checkout
        pass
    else:
        add_demo_arguments(demo)
    _bench_parser(sub, benchmarks)
    verify = sub.add_parser("verify", help="correctness checks of the kernels on the hardware present",
                            description="Each producer's FP8 pair against the standalone quantization of its own "
                                        "bf16 output (bit for bit), the wo_a einsum, mHC, attention, GEMMs and "
                                        "router against their references, with zero and NaN rows; on the GPU "
                                        "found, else on the Triton CPU interpreter. Exit status 1 when a check "
                                        "fails.")
    verify.add_argument("--quick", action="store_true", help="fewer shapes")
    sub.add_parser("info", help="GPU, arch, backends found and rejected",
                   description="The GPU and its arch, torch and triton versions, which GEMM backend serves "
                               "which format and shape (and why the others are rejected), and whether SGLang "
                               "finds the plugin.")
    return parser


def main(argv: list[str] | None = None) -> int:
    named = _named(argv)
    _use_interpreter_for_cpu(named)
    args = build_parser(benchmarks=named.command == "bench").parse_args(argv)
    command = {"demo": _cmd_demo, "bench": _cmd_bench, "verify": _cmd_verify, "info": _cmd_info}
    return command[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
