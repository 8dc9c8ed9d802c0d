"""Standalone quantize: Triton kernel vs the torch-composed reference, against the copy floor.

For each format, M and K: median microseconds per call under CUDA-graph replay, the bytes the
quantize must move (bf16 in, fp8 + scales out), the floor those bytes give at the copy bandwidth
measured in this run, and the fraction of that bandwidth the kernel reaches. Small problems are
launch-latency bound, so each case also times a plain elementwise copy moving the same bytes
(``copy_us``): ``copy_fraction = copy_us / triton_us`` is the quantize's speed relative to the
fastest kernel that moves those bytes at that size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sgl-kernel"))

from fp8chain.argtypes import positive_int  # noqa: E402
from fp8chain.bench import harness  # noqa: E402
from fp8chain_kernel import quant, reference  # noqa: E402
from fp8chain_kernel.formats import ActFormat, empty_pair  # noqa: E402

ROWS = [1, 4, 16, 64, 256, 2048, 8192]
COLS = [1280, 2048, 5120, 8192]
QUICK_ROWS = [1, 16, 256, 8192]
QUICK_COLS = [1280, 5120]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--formats", nargs="+", default=[f.value for f in ActFormat],
                        choices=[f.value for f in ActFormat], help="activation formats to time")
    parser.add_argument("--rows", nargs="+", type=positive_int, help="M values")
    parser.add_argument("--cols", nargs="+", type=positive_int, help="K values")
    harness.add_quick(parser, rows=(ROWS, QUICK_ROWS), cols=(COLS, QUICK_COLS))
    parser.add_argument("--iters", type=positive_int, default=100, help="calls per captured graph")


def quantize_bytes(rows: int, cols: int, fmt: ActFormat) -> int:
    return rows * cols * 2 + harness.pair_bytes(rows, cols, fmt)


def run(args) -> tuple[dict, list[dict]]:
    if not torch.cuda.is_available():
        raise SystemExit("benchmark quant needs a CUDA GPU (kernel logic is tested on CPU instead)")
    meta = harness.bench_meta()
    bandwidth = harness.copy_bandwidth()
    meta["copy_bandwidth_TBps"] = bandwidth / 1e12
    cases = [(ActFormat(f), m, k) for f in args.formats for k in args.cols for m in args.rows]
    records = []
    for fmt, rows, cols in harness.progress(cases, "quantize"):
        x = torch.randn(rows, cols, device="cuda").bfloat16()
        out = empty_pair(rows, cols, fmt, "cuda")
        triton_us = harness.graph_time_us(lambda: quant.quantize(x, fmt, out=out), iters=args.iters)
        torch_us = harness.graph_time_us(lambda: reference.quantize(x, fmt), iters=args.iters)
        nbytes = quantize_bytes(rows, cols, fmt)
        floor_us = nbytes / bandwidth * 1e6
        copy_us = harness.copy_time_us(nbytes, iters=args.iters)
        records.append({
            "format": fmt.value, "M": rows, "K": cols, "triton_us": triton_us, "torch_us": torch_us,
            "floor_us": floor_us, "bytes": nbytes, "bw_fraction": floor_us / triton_us,
            "copy_us": copy_us, "copy_fraction": copy_us / triton_us,
            "speedup_vs_torch": torch_us / triton_us,
        })
    return meta, records


COLUMNS = ["format", "M", "K", "triton_us", "torch_us", "floor_us", "bw_fraction", "copy_us", "copy_fraction",
           "speedup_vs_torch"]


def report(meta: dict, records: list[dict], results_dir=None) -> str:
    json_path = harness.save_results("quant", meta, records, results_dir)
    for fmt in sorted({r["format"] for r in records}):
        subset = [dict(r, shape=f"K={r['K']}") for r in records if r["format"] == fmt]
        harness.plot_records(f"quant_{fmt}", subset, "M", ["triton_us", "torch_us", "floor_us"],
                             "us per call", group="shape", results_dir=results_dir)
    return f"{json_path}\n" + harness.markdown_table(records, COLUMNS)


if __name__ == "__main__":
    harness.benchmark_main(__doc__, add_arguments, run, report)
