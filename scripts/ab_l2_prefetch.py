"""Does prefetching a linear's weights into L2, beside a latency-bound kernel, shorten the linear?

A decode step alternates weight-streaming linears with kernels that barely touch HBM (the attention
core, RoPE, norms, the mHC boundary). This times, in CUDA graphs with the weights rotating past
L2, ``spin -> linear`` against the same with an L2 prefetch of the linear's weights launched on a
side stream at the spin's start (``torch.cuda._sleep`` stands in for the latency-bound kernel),
for a few spin lengths and prefetch variants. Diagnostic: prints a table, writes JSON.

    python scripts/ab_l2_prefetch.py --json-out $OUT/ab_l2_prefetch.json
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

_ROOT = Path(__file__).resolve().parents[1]
for _p in (_ROOT / "python", _ROOT / "sgl-kernel"):
    sys.path.insert(0, str(_p))

from fp8chain.bench import harness  # noqa: E402
from fp8chain_kernel import einsum, gemm, quant, reference  # noqa: E402
from fp8chain_kernel.formats import ActFormat  # noqa: E402

_BULK = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
         "mov.u32 $0, 0; }")
_LINE = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, $2; }")
_LINE_LAST = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $3, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, $2; }")


@triton.jit
def _prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK * CHUNK
    offs = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    for start in range(0, tl.cdiv(nbytes, step)):
        o = start.to(tl.int64) * step + offs
        ok = (o < nbytes).to(tl.int32)
        size = tl.minimum(nbytes - o, CHUNK).to(tl.int32)
        if MODE == 0:
            tl.inline_asm_elementwise(_BULK, "=r,l,r,r", [ptr + o, size, ok], dtype=tl.int32, is_pure=False, pack=1)
        elif MODE == 1:
            tl.inline_asm_elementwise(_LINE, "=r,l,r,r", [ptr + o, size, ok], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_LINE_LAST, "=r,l,r,r", [ptr + o, size, ok], dtype=tl.int32, is_pure=False,
                                      pack=1)


VARIANTS = {  # name: (mode, chunk bytes, programs)
    "bulk4k_x16": (0, 4096, 16),
    "bulk16k_x16": (0, 16384, 16),
    "bulk4k_x132": (0, 4096, 132),
    "line_x132": (1, 128, 132),
    "line_last_x132": (2, 128, 132),
}


def prefetch(tensors, variant):
    mode, chunk, programs = VARIANTS[variant]
    for t in tensors:
        flat = t.view(torch.uint8).reshape(-1)
        _prefetch_kernel[(programs,)](flat, flat.numel(), CHUNK=chunk, BLOCK=128, MODE=mode, num_warps=4)


def targets(m):
    dev = torch.device("cuda")
    out = {}
    for name in ("wq_b", "wo_b", "gate_up", "wqkv_a"):
        n, k = gemm.DSV41_TP1_LINEARS[name]
        pair = quant.quantize(torch.randn(m, k, device=dev).bfloat16(), ActFormat.SM90_G32_FP32_MN)
        copies = [reference.random_fp8_weight(n, k, 32, dev) for _ in range(harness.copies_past_l2(n * k))]
        y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        out[name] = (copies, lambda w, s, pair=pair, y=y: gemm.fp8_gemm(pair, w, s, weight_block=32, out=y), n * k)
    g, r, d = 8, 1024, 4096
    o = torch.randn(m, g, d, device=dev).bfloat16()
    wbytes = g * r * d * 2
    copies = [((torch.randn(g, r, d, device=dev) / 64).bfloat16(),) for _ in range(harness.copies_past_l2(wbytes))]
    out["wo_a"] = (copies, lambda w, o=o: einsum.wo_a_einsum(o, w), wbytes)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=4)
    parser.add_argument("--spins-us", default="0,5,10,15")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    cycles_per_us = torch.cuda.get_device_properties(0).clock_rate / 1e3  # kHz -> cycles per us
    side = torch.cuda.Stream()
    records = []
    for name, (copies, call, wbytes) in targets(args.m).items():
        for spin_us in [float(s) for s in args.spins_us.split(",")]:
            cycles = int(spin_us * cycles_per_us)

            def make(variant, copies=copies, call=call, cycles=cycles):
                state = {"i": 0}

                def step():
                    item = copies[state["i"] % len(copies)]
                    state["i"] += 1
                    if variant is not None:
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            prefetch([t for t in item if t.numel() * t.element_size() > 1 << 20], variant)
                    if cycles:
                        torch.cuda._sleep(cycles)
                    call(*item)
                    if variant is not None:
                        torch.cuda.current_stream().wait_stream(side)
                step.period = len(copies)
                return step

            arms = {"none": make(None), **{v: make(v) for v in args.variants.split(",")}}
            iters = max(args.iters, len(copies))
            graphs = {a: harness.capture_graph(fn, iters) for a, fn in arms.items()}
            times = harness.replay_times_us(graphs, iters, rounds=9)
            rec = {"target": name, "m": args.m, "spin_us": spin_us, "weight_mb": wbytes / 1e6, **times}
            records.append(rec)
            print(name, f"spin {spin_us:g}", " ".join(f"{a} {t:.2f}" for a, t in times.items()), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
