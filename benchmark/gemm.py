"""FP8 GEMM consumers at DSv4.1 shapes: the chained pair GEMM against its baselines.

Columns per (shape, M), all timed in one process with CUDA-graph replay (median):

* ``pair_us``: Triton GEMM on a ``sm90_g32_fp32_mn`` pair as a producer wrote it (DSv4.1 32x32
  power-of-two weight blocks);
* ``bf16_quant_us``: bf16 activations -> standalone quantize -> the same GEMM (unchained);
* ``w8a16_us``: bf16 activations x FP8 weights widened in the kernel (Triton W8A16);
* ``cublas_g128_us``: cuBLAS blockwise (``torch._scaled_mm``, 1x128 x 128x128) on the g128 problem;
* ``triton_g128_us``: the Triton GEMM on the same g128 problem (both None where K % 128 != 0: no
  g128 problem);
* ``silu_epilogue_us`` / ``silu_launch_us`` (the shared expert's gate_up shapes only): the pair
  GEMM writing ``act.swiglu`` of its output and that output's ``sm90_g32_fp32_mn`` pair in its
  epilogue (``gemm.fp8_gemm_silu_mul`` on the tensor-core GEMM's config), against the table's GEMM
  (``gemm.gemm_config``: the GEMV where it serves) then ``act.silu_mul`` writing the same pair, the
  chained shared expert's two ways; ``silu_rule`` is the one ``gemm.silu_mul_epilogue_pays`` takes;
* ``floor_us``: weight bytes / device copy bandwidth measured in this run; ``bw_frac``: floor /
  pair_us (the fraction of copy bandwidth the pair GEMM reaches on weight bytes: the decode bound);
* ``roofline_us``: the pair GEMM's roofline, the larger of every byte it moves (weights and their
  scales, the pair, the bf16 output) / copy bandwidth and its flops / the FP8 matmul rate measured
  in this run (``harness.fp8_matmul_rate``); ``roofline_frac``: roofline_us / pair_us.

Weights rotate through enough copies to exceed L2 (every call streams its weights from HBM).
``--sweep`` times candidate launch configs per (shape, M bucket) and prints the best (the source
of ``gemm.CONFIG_TABLE``; at M <= 4 the ``gemv`` mode's candidates too: ``gemv.GEMV_TABLE``);
with ``--silu`` on the gate_up shapes it times them through the SiLU*mul epilogue
(``gemm.fp8_gemm_silu_mul`` writing the pair alone, as the chained shared expert calls it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
for _p in (_ROOT / "python", _ROOT / "sgl-kernel"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from fp8chain.argtypes import positive_int  # noqa: E402
from fp8chain.bench import harness  # noqa: E402
from fp8chain.models.deepseek_v41 import DeepseekV41Config  # noqa: E402
from fp8chain.verify import relative_error  # noqa: E402
from fp8chain_kernel import gemm, quant, reference  # noqa: E402
from fp8chain_kernel.act import silu_mul  # noqa: E402
from fp8chain_kernel.formats import ActFormat, empty_pair  # noqa: E402
from fp8chain_kernel.gemv import MAX_GEMV_TOKENS, GemvConfig, select_gemv  # noqa: E402

SHAPES = {**gemm.DSV41_TP1_LINEARS, **gemm.DSV41_TP4_SHARDS}
# by default the TP1 linears and the TP4 shard of wo_b (the one with 128-group table entries); the
# other shards run on request (--shapes; the down shard's K = 576 has no g128 arms)
DEFAULT_SHAPES = [*gemm.DSV41_TP1_LINEARS, "wo_b_tp4"]
MS = [1, 4, 16, 64, 256, 2048]
# the shared expert's gate_up ([gate; up] rows), timed with SiLU*mul too, at DSv4.1's clamp
SILU_SHAPES = ("gate_up", "gate_up_tp4")
SWIGLU_LIMIT = DeepseekV41Config.flash().swiglu_limit
QUICK_MS = [1, 16, 64, 2048]
G32, G128 = ActFormat.SM90_G32_FP32_MN, ActFormat.SM90_G128_FP32_MN


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help=f"M in {QUICK_MS} unless --ms, fewer replays")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help=f"comma-separated shape names, of {', '.join(SHAPES)}")
    parser.add_argument("--ms", default=None, help="comma-separated M values")
    parser.add_argument("--iters", type=positive_int, default=None, help="calls per captured graph")
    parser.add_argument("--sweep", action="store_true", help="time candidate configs, print the best")
    parser.add_argument("--silu", action="store_true",
                        help=f"with --sweep: time the candidates through the SiLU*mul epilogue "
                             f"({', '.join(SILU_SHAPES)} only)")
    parser.add_argument("--groups", default="32,128", help="weight block sizes the sweep covers")
    parser.add_argument("--stages", default="4",
                        help="comma-separated pipeline depths of the generated candidates (M <= 256)")
    parser.add_argument("--block-k", default="128,256",
                        help="comma-separated BLOCK_K of the generated candidates (M <= 256)")
    parser.add_argument("--block-n", default="64,128",
                        help="comma-separated BLOCK_N of the generated candidates (M <= 256)")
    parser.add_argument("--warps", default="4",
                        help="comma-separated warp counts of the generated candidates (M <= 256)")
    parser.add_argument("--token-tiles", default="",
                        help="comma-separated token tiles of the block-diagonal candidates (default: one tile "
                             "of 4, 8 or 16 tokens, never narrower than M, at M <= 16; 16 and 32 above)")
    parser.add_argument("--splits", default="",
                        help="comma-separated K splits of the generated candidates (default: the four largest "
                             "that leave each slice two or more K iterations)")
    parser.add_argument("--scale-ahead", default="default",
                        help="comma-separated scale prefetch depths (0-4, or 'default') of the generated "
                             "candidates (M <= 256)")
    parser.add_argument("--max-regs", default="none",
                        help="comma-separated register caps per thread (24-255, or 'none') each GEMM "
                             "candidate is timed with (GemmConfig.max_regs)")
    parser.add_argument("--modes", default=",".join([*OPERAND_MODES, GEMV_MODE]),
                        help=f"comma-separated operand modes of the candidates ({', '.join(OPERAND_MODES)}; "
                             f"{GEMV_MODE}: the CUDA-core kernel, at M <= {MAX_GEMV_TOKENS})")
    parser.add_argument("--sweep-budget-s", type=float, default=150.0, help="stop the sweep's timing after this")
    parser.add_argument("--precompile", type=int, default=0,
                        help="compile the planned kernels in this many worker processes first")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "i/n": compile share i
    parser.add_argument("--check-blockwise", action="store_true",
                        help="print which scale_b layouts torch._scaled_mm accepts and their error")
    parser.add_argument("--table-from", default=None,
                        help="use the best configs of a --sweep JSON as the config table")


# --------------------------------------------------------------------------------------------

def _weights(n, k, block, device, copies):
    return [reference.random_fp8_weight(n, k, block, device) for _ in range(copies)]


SPLIT_CHOICES = (1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 16, 20)


def _splits(iters: int, wanted: tuple[int, ...] = ()) -> list[int]:
    """K splits worth timing over ``iters`` K iterations: ``wanted`` (default the four largest of
    ``SPLIT_CHOICES``), those dividing ``iters`` with at least two iterations per slice."""
    fits = [d for d in wanted or SPLIT_CHOICES if iters % d == 0 and iters // d >= 2]
    return (fits if wanted else fits[-4:]) or [1]


OPERAND_MODES = {"fp8": (False, False), "dequant": (True, False), "block_diag": (False, True)}
GEMV_MODE = "gemv"  # the CUDA-core kernel (fp8chain_kernel.gemv), candidates at M <= MAX_GEMV_TOKENS only


def gemv_candidates(group: int) -> list[GemvConfig]:
    """GEMV launches worth timing at any token count (1 to ``MAX_GEMV_TOKENS``): 2-32 weight rows
    per program (dividing the group), 128-2048 columns per step, 2 KB to 16 KB of weights per step,
    2-8 warps with at most 128 converted weights per thread and step (the accumulators are 16x fewer
    per token), loads pipelined or not."""
    return [GemvConfig(bn, bk, warps, stages) for bn in (2, 4, 8, 16, 32) for bk in (128, 256, 512, 1024, 2048)
            for warps in (2, 4, 8) for stages in (1, 3)
            if group % bn == 0 and bk % group == 0 and 2048 <= bn * bk <= 16384 and bn * bk <= 128 * 32 * warps]


def _block_diag_token_tiles(m: int) -> tuple[int, ...]:
    """Token tile widths of the block-diagonal candidates for M tokens: one tile of 4, 8 or 16
    tokens at M <= 16 (never narrower than M), tiles of 16 or 32 above."""
    if m > 16:
        return (16, 32)
    return tuple(t for t in (4, 8, 16) if t >= m)


def sweep_candidates(m: int, n: int, k: int, group: int, stages: tuple[int, ...] = (4,),
                     modes: tuple[str, ...] = tuple(OPERAND_MODES), block_ks: tuple[int, ...] = (128, 256),
                     scale_ahead: tuple[int | None, ...] = (None,), block_ns: tuple[int, ...] = (64, 128),
                     warps: tuple[int, ...] = (4,), splits: tuple[int, ...] = (),
                     token_tiles: tuple[int, ...] = ()) -> list[gemm.GemmConfig]:
    """Launch configs worth timing for one (M bucket, N, K, group); bf16-dequantized operands
    and block-diagonal FP8 dots only for 32-groups (power-of-two scales: exact). ``stages``,
    ``modes`` (keys of ``OPERAND_MODES``), ``block_ks``, ``scale_ahead`` (None: the mode's
    default), ``block_ns`` (below 64 the dots are mma.sync, not wgmma), ``warps``, ``splits`` (K
    splits; default: ``_splits``) and ``token_tiles`` (the block-diagonal token tiles; default:
    ``_block_diag_token_tiles``, several tiles cover M where one is narrower) narrow or widen the
    generated candidates of M <= 256. Above M = 64 their FP8 and dequantized tiles are 64 or 128
    tokens wide and a fixed list of tiles (some of 8 warps and 3 stages) joins them; above M = 256
    only such a list is timed."""
    cands = []
    # (dequant, block_diag) operand modes; both alternatives to the per-group FP8 dot need 32-groups
    modes = tuple(OPERAND_MODES[name] for name in modes if group == 32 or name == "fp8")
    if m <= 256:
        m_tiles = (max(16, 1 << (m - 1).bit_length()),) if m <= 64 else (64, 128)
        for dequant, block_diag in modes:
            # the block-diagonal token operand is SUB x wider: keep its accumulator <= 128 columns;
            # at M <= 8 it may also be 4 or 8 tokens wide (its dot stays >= 16 columns)
            for block_m in (token_tiles or _block_diag_token_tiles(m)) if block_diag else m_tiles:
                for bn in block_ns:
                    for bk in block_ks:
                        token_cols = (bk // group) * block_m if block_diag else block_m
                        if k % bk or token_cols > 128:
                            continue
                        for depth in stages:
                            if depth * bk * (bn + token_cols) > 200 << 10:  # the stages fit the 227 KB of smem
                                continue
                            for split in _splits(k // bk, splits):
                                for ahead in scale_ahead if dequant or block_diag else (None,):
                                    cands += [gemm.GemmConfig(bn, block_m, bk, split, depth, w, 8, dequant, block_diag,
                                                              ahead) for w in warps]
    if m <= 64:
        return cands
    if m <= 256:
        fp8 = [(128, 64, 128, 1, 4, 4), (64, 64, 128, 1, 4, 4), (128, 128, 128, 1, 3, 8),
               (128, 64, 128, 2, 4, 4), (64, 128, 128, 1, 4, 4)]
        deq = [(128, 64, 128, 1, 4, 4), (128, 128, 128, 1, 3, 8), (64, 128, 128, 1, 4, 4)]
    else:
        fp8 = [(128, 128, 128, 1, 3, 8), (128, 64, 128, 1, 4, 4), (64, 128, 128, 1, 4, 4),
               (256, 128, 128, 1, 3, 8), (128, 256, 128, 1, 3, 8)]
        deq = [(128, 128, 128, 1, 3, 8), (128, 128, 64, 1, 4, 8), (128, 256, 64, 1, 3, 8),
               (256, 128, 64, 1, 3, 8), (128, 64, 128, 1, 4, 4)]
    if (False, False) in modes:
        for cfg in fp8:
            if k % cfg[2] == 0 and (k // cfg[2]) % cfg[3] == 0:
                cands.append(gemm.GemmConfig(*cfg, 8, False))
    if (True, False) in modes:
        for cfg in deq:
            if k % cfg[2] == 0:
                cands.append(gemm.GemmConfig(*cfg, 8, True))
    return list(dict.fromkeys(cands))  # the generated and listed tiles may coincide


def _items(text: str, parse=str) -> tuple:
    """A comma-separated option's values, each through ``parse``."""
    return tuple(parse(v) for v in text.split(",") if v)


def _candidates(args, m: int, n: int, k: int, group: int) -> list[gemm.GemmConfig | GemvConfig]:
    modes = _items(args.modes)
    ahead = _items(args.scale_ahead, lambda v: None if v == "default" else int(v))
    caps = _items(args.max_regs, lambda v: None if v == "none" else int(v))
    gemv = gemv_candidates(group) if GEMV_MODE in modes and m <= MAX_GEMV_TOKENS else []
    tiles = sweep_candidates(m, n, k, group, _items(args.stages, int),
                             tuple(mode for mode in modes if mode != GEMV_MODE), _items(args.block_k, int),
                             ahead, _items(args.block_n, int), _items(args.warps, int),
                             _items(args.splits, int), _items(args.token_tiles, int))
    return gemv + [cfg._replace(max_regs=cap) for cfg in tiles for cap in caps]


def _sweep_points(args):
    shapes = [s for s in args.shapes.split(",") if s]
    ms = [16, 64, 256, 2048] if not args.quick else [16, 64, 2048]  # one M per table bucket
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]
    for name in shapes:
        n, k = SHAPES[name]
        for group in (int(g) for g in args.groups.split(",")):
            for m in ms:
                yield name, n, k, group, m


def _plan(args):
    """Every (kind, shape name, M, config) this invocation will launch (for precompiling)."""
    shapes = [s for s in args.shapes.split(",") if s]
    plan = []
    if args.sweep:
        for name, n, k, group, m in _sweep_points(args):
            for cfg in _candidates(args, m, n, k, group):
                plan.append(("silu" if args.silu else "fp8", name, group, m, cfg))
    else:
        for name in shapes:
            n, k = SHAPES[name]
            for m in _ms(args):
                for group in (32, 128):
                    plan.append(("fp8", name, group, m, None))
                plan.append(("w8a16", name, 32, m, None))
    return plan


def _ms(args):
    if args.ms:
        return [int(v) for v in args.ms.split(",")]
    return QUICK_MS if args.quick else MS


def _precompile_share(args, device):
    """Run each planned kernel once (compiles it into Triton's on-disk cache)."""
    index, count = (int(v) for v in args.worker.split("/"))
    plan = _plan(args)[index::count]
    weights = {}
    for kind, name, group, m, cfg in plan:
        n, k = SHAPES[name]
        if (n, k, group) not in weights:
            weights = {(n, k, group): _weights(n, k, group, device, 1)[0]}
        w, s = weights[(n, k, group)]
        x = torch.randn(m, k, device=device).bfloat16()
        try:
            if kind == "fp8":
                gemm.fp8_gemm(x, w, s, weight_block=group, fmt=gemm.input_format_for_block(group), config=cfg)
            elif kind == "silu":
                pair = quant.quantize(x, gemm.input_format_for_block(group))
                gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=group, limit=SWIGLU_LIMIT, out_format=pair.fmt,
                                       return_bf16=False, config=cfg)
            else:
                gemm.w8a16_gemm(x, w, s, weight_block=group, config=cfg)
        except Exception as exc:  # noqa: BLE001 - report, keep compiling the rest
            print(f"compile failed {kind} {name} g{group} M={m} {cfg}: {type(exc).__name__}: {exc}"[:400],
                  flush=True)
    torch.cuda.synchronize()


def _precompile(args):
    """Compile the planned kernels in ``args.precompile`` worker processes (Triton's on-disk cache
    is shared), so the timing process only loads them."""
    argv = ["--shapes", args.shapes]
    if args.quick:
        argv.append("--quick")
    if args.sweep:
        argv.append("--sweep")
    if args.silu:
        argv.append("--silu")
    if args.ms:
        argv += ["--ms", args.ms]
    argv += ["--groups", args.groups, "--stages", args.stages, "--modes", args.modes, "--block-k", args.block_k,
             "--scale-ahead", args.scale_ahead, "--block-n", args.block_n, "--warps", args.warps,
             "--splits", args.splits, "--token-tiles", args.token_tiles]
    if args.table_from:
        argv += ["--table-from", args.table_from]
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", f"{i}/{args.precompile}"])
             for i in range(args.precompile)]
    for p in procs:
        p.wait()


def _time_arms(calls: dict, args) -> dict:
    """Median us per call of each arm: every arm's graph captured first, then their replays
    alternated (``harness.replay_times_us``), so drift weighs on every arm alike."""
    iters = max(harness.graph_calls(fn, args.iters or (20 if args.quick or args.sweep else 50))
                for fn in calls.values())
    graphs = {name: harness.capture_graph(fn, iters) for name, fn in calls.items()}
    return harness.replay_times_us(graphs, iters, rounds=3 if (args.quick or args.sweep) else 7)


def _time(fn, args):
    return _time_arms({"fn": fn}, args)["fn"]


def run_sweep(args, device, copy_bw):
    records = []
    start = time.time()
    weights = {}
    for name, n, k, group, m in _sweep_points(args):
        if time.time() - start > args.sweep_budget_s:
            print(f"sweep budget spent, stopping before {name} g{group} M={m}", flush=True)
            break
        if (n, k, group) not in weights:
            weights = {(n, k, group): _weights(n, k, group, device, harness.copies_past_l2(n * k))}
        ws = weights[(n, k, group)]
        x = torch.randn(m, k, device=device) * torch.exp2(torch.randint(-6, 6, (m, 1), device=device).float())
        pair = quant.quantize(x.bfloat16(), gemm.input_format_for_block(group))
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        heur = gemm.gemm_config(m, n, k, group, device)  # what config=None runs
        results = []
        if args.silu:  # checked on bf16 y, timed writing the pair alone (the chained shared expert)
            h_pair = empty_pair(m, n // 2, pair.fmt, device)
            want = reference.fp8_gemm_silu_mul(pair, ws[0][0], ws[0][1], group, limit=SWIGLU_LIMIT).double()

            def check(cfg):
                return gemm.fp8_gemm_silu_mul(pair, ws[0][0], ws[0][1], weight_block=group, limit=SWIGLU_LIMIT,
                                              config=cfg)

            def call(w, s, cfg):
                gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=group, limit=SWIGLU_LIMIT, out_format=pair.fmt,
                                       out=h_pair, return_bf16=False, config=cfg)
        else:
            want = reference.fp8_gemm(pair, ws[0][0], ws[0][1], group)

            def check(cfg):
                return gemm.fp8_gemm(pair, ws[0][0], ws[0][1], weight_block=group, config=cfg)

            def call(w, s, cfg):
                gemm.fp8_gemm(pair, w, s, weight_block=group, out=out, config=cfg)

        for cfg in _candidates(args, m, n, k, group) + [None]:
            try:
                got = check(cfg)
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            err = relative_error(got, want)
            if not err < 5e-3:  # NaN-safe: a wrong config is never a candidate
                print(f"  {cfg}: WRONG, relative error {err:.3g}", flush=True)
                continue
            fn = harness.rotating(lambda w, s, c=cfg: call(w, s, c), ws)
            try:
                results.append((_time(fn, args), cfg))
            except Exception as exc:  # noqa: BLE001
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        if not results:
            continue
        if not any(c is not None for _, c in results):
            continue
        best_us, best = min((r for r in results if r[1] is not None), key=lambda r: r[0])
        current = next((us for us, c in results if c is None), None)  # None: the default config failed
        floor = n * k / copy_bw * 1e6
        shown = "failed" if current is None else f"{current:8.2f}us"
        print(f"{name:9s} g{group:<3d} M={m:<5d} best {best_us:8.2f}us {tuple(best)} | table/heur "
              f"{shown} {tuple(heur)} | floor {floor:6.2f}us", flush=True)
        records.append(dict(shape=name, n=n, k=k, group=group, m=m, best_us=best_us, best=list(best),
                            kind=GEMV_MODE if isinstance(best, GemvConfig) else "gemm",
                            current_us=current, floor_us=floor,
                            all=[(us, list(c) if c else None) for us, c in results]))
    return records


def check_blockwise_views(device):
    """Which 128x128 scale_b view torch._scaled_mm takes (K/128 = 10 and 40), and its error."""
    from fp8chain_kernel.backends.torch_blockwise import TorchBlockwiseBackend

    for n, k in ((32768, 1280), (5120, 2304), (1792, 5120)):
        (w, s), = _weights(n, k, 128, device, 1)
        padded = TorchBlockwiseBackend().derive_weight_tensors(w, s, 128)["weight_scale_blockwise"]
        pair = quant.quantize(torch.randn(8, k, device=device).bfloat16(), G128)
        want = reference.fp8_gemm(pair, w, s, 128)
        for view in ("contig", "exact", "padded"):
            try:
                got = torch._scaled_mm(pair.data, w.t(), scale_a=pair.scale,
                                       scale_b=TorchBlockwiseBackend._scale_b(padded, k, view, s),
                                       out_dtype=torch.bfloat16)
                err = relative_error(got, want)
                print(f"blockwise {n}x{k} scale_b view {view}: rel err {err:.3g}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"blockwise {n}x{k} scale_b view {view}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


def _power_of_two_from_16(v: str) -> bool:
    return v.isdigit() and int(v) >= 16 and int(v) & (int(v) - 1) == 0


def check_lists(args) -> None:
    """Every comma-separated option (SystemExit naming the option, before any GPU work): known
    shape names and operand modes, positive M values, weight blocks of 32 or 128, and the sweep's
    candidate values (tiles powers of two from 16, warps 1-16 in powers of two, scale prefetch
    0-4 or 'default', register caps 24-255 or 'none')."""
    unknown = [s for s in _items(args.shapes) if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    positive = (lambda v: v.isdigit() and int(v) > 0, "positive integers")
    for option, text, (ok, what) in (
            ("--ms", args.ms or "", positive),
            ("--groups", args.groups, (lambda v: v in ("32", "128"), "32 or 128")),
            ("--stages", args.stages, positive),
            ("--block-k", args.block_k, (_power_of_two_from_16, "powers of two >= 16")),
            ("--block-n", args.block_n, (_power_of_two_from_16, "powers of two >= 16")),
            ("--warps", args.warps, (lambda v: v in ("1", "2", "4", "8", "16"), "1, 2, 4, 8 or 16")),
            ("--token-tiles", args.token_tiles, positive),
            ("--splits", args.splits, positive),
            ("--scale-ahead", args.scale_ahead, (lambda v: v == "default" or v in "01234" and len(v) == 1,
                                                 "0-4 or 'default'")),
            ("--max-regs", args.max_regs, (lambda v: v == "none" or v.isdigit() and 24 <= int(v) <= 255,
                                           "24-255 or 'none'")),
            ("--modes", args.modes, (lambda v: v in (*OPERAND_MODES, GEMV_MODE),
                                     "operand modes (" + ", ".join([*OPERAND_MODES, GEMV_MODE]) + ")"))):
        bad = [v for v in text.split(",") if v and not ok(v)]
        if bad:
            raise SystemExit(f"{option}: {bad} are not {what}")
    if args.silu and not args.sweep:
        raise SystemExit("--silu selects the sweep's SiLU*mul epilogue: give --sweep too")
    if args.silu and set(_items(args.shapes)) - set(SILU_SHAPES):
        raise SystemExit(f"--silu: the SiLU*mul epilogue runs on {', '.join(SILU_SHAPES)} only, got {args.shapes}")
    if args.precompile < 0 or not args.sweep_budget_s > 0:
        raise SystemExit("--precompile must be >= 0 and --sweep-budget-s > 0")


def run(args):
    """Returns ``(meta, records)``."""
    check_lists(args)
    if not torch.cuda.is_available():
        raise SystemExit("benchmark/gemm.py needs a CUDA GPU; none found")
    device = torch.device("cuda")
    if args.table_from:
        gemm.load_table(args.table_from)
    if args.check_blockwise:
        check_blockwise_views(device)
    if args.worker:
        _precompile_share(args, device)
        return {}, []
    if args.precompile:
        _precompile(args)
    meta = harness.bench_meta()
    copy_bw = harness.copy_bandwidth(device)
    meta["copy_bandwidth_Bps"] = copy_bw
    meta["copy_bandwidth_TBps"] = copy_bw / 1e12
    if args.sweep:
        meta["sweep"] = True
        meta["silu_mul_epilogue"] = args.silu
        return meta, run_sweep(args, device, copy_bw)

    from fp8chain_kernel import backends

    caps = backends.probe()
    meta["cublas_blockwise"] = caps.scaled_mm_blockwise or caps.scaled_mm_reason
    try:
        fp8_rate = harness.fp8_matmul_rate(device)
        meta["fp8_matmul_TFLOPs"] = fp8_rate / 1e12
    except RuntimeError as exc:  # no FP8 torch._scaled_mm here: the roofline counts bytes alone
        fp8_rate = None
        meta["fp8_matmul_rate_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    blockwise = backends.get_backend("torch_blockwise") if caps.scaled_mm_blockwise else None
    shapes = [s for s in args.shapes.split(",") if s]
    records = []
    points = [(name, m) for name in shapes for m in _ms(args)]
    weights_key, w32, w128 = None, None, None
    for name, m in harness.progress(points, desc="gemm"):
        n, k = SHAPES[name]
        g128 = k % 128 == 0
        if weights_key != name:
            copies = harness.copies_past_l2(n * k)
            w32 = _weights(n, k, 32, device, copies)
            w128 = _weights(n, k, 128, device, copies) if g128 else []
            derived = [blockwise.derive_weight_tensors(w, s, 128) if blockwise else None for w, s in w128]
            weights_key = name
        x = torch.randn(m, k, device=device).bfloat16()
        pair32 = quant.quantize(x, G32)
        pair128 = quant.quantize(x, G128) if g128 else None
        out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        rec = dict(shape=name, n=n, k=k, m=m)
        arms = {
            "pair_us": harness.rotating(lambda w, s: gemm.fp8_gemm(pair32, w, s, weight_block=32, out=out), w32),
            "bf16_quant_us": harness.rotating(
                lambda w, s: gemm.fp8_gemm(x, w, s, weight_block=32, fmt=G32, out=out), w32),
            "w8a16_us": harness.rotating(lambda w, s: gemm.w8a16_gemm(x, w, s, weight_block=32, out=out), w32),
        }
        rec["cublas_g128_us"] = rec["triton_g128_us"] = None
        if g128:
            arms["triton_g128_us"] = harness.rotating(
                lambda w, s: gemm.fp8_gemm(pair128, w, s, weight_block=128, out=out), w128)
        if blockwise is not None and g128:
            # K/128 % 4 != 0: torch 2.11 takes only a layout cuBLAS reads differently (wrong
            # result); its time is still recorded (same cuBLAS kernel), flagged cublas_valid=False.
            # Timed: _scaled_mm alone, its operands padded and laid out once outside the graph (the
            # backend's padding and its copy into out would charge cuBLAS launches of ours).
            reason = blockwise.rejection(G128, 128, n, k)
            view = None if reason is None else "contig"
            operands = [blockwise.scaled_mm_operands(pair128, w, s, d, _force_view=view)
                        for (w, s), d in zip(w128, derived)]
            arms["cublas_g128_us"] = harness.rotating(lambda a, kw: torch._scaled_mm(*a, **kw), operands)
            rec["cublas_valid"] = reason is None
        if name in SILU_SHAPES:
            arms.update(_silu_arms(pair32, w32, out, device))
            rec["silu_rule"] = ("epilogue" if gemm.silu_mul_epilogue_pays(gemm.gemm_config(m, n, k, 32, device))
                                else "launch")
        rec.update(_time_arms(arms, args))
        rec["floor_us"] = n * k / copy_bw * 1e6
        rec["bw_frac"] = rec["floor_us"] / rec["pair_us"]
        rec["roofline_us"] = roofline_us(m, n, k, 32, copy_bw, fp8_rate)
        rec["roofline_frac"] = rec["roofline_us"] / rec["pair_us"]
        if rec["cublas_g128_us"]:
            rec["pair_vs_cublas"] = rec["cublas_g128_us"] / rec["pair_us"]
            rec["g128_vs_cublas"] = rec["cublas_g128_us"] / rec["triton_g128_us"]
        gemv = select_gemv(m, n, k, 32)
        rec["kernel_g32"] = GEMV_MODE if gemv else "gemm"
        rec["config_g32"] = list(gemv or gemm.select_config(m, n, k, 32, device))
        records.append(rec)
    return meta, records


def _silu_arms(pair, weights, gate_up, device) -> dict:
    """The chained shared expert's gate_up + SiLU*mul, both ways (the module docstring), writing
    one pair buffer; ``gate_up`` is the plain GEMM's ``[M, 2I]`` output."""
    m, n = gate_up.shape
    k = pair.data.shape[1]
    h_pair = empty_pair(m, n // 2, G32, device)
    epilogue_config = gemm.select_config(m, n, k, 32, device)

    def epilogue(w, s):
        gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, limit=SWIGLU_LIMIT, out_format=G32, out=h_pair,
                               return_bf16=False, config=epilogue_config)

    def launch(w, s):
        gemm.fp8_gemm(pair, w, s, weight_block=32, out=gate_up)
        silu_mul(gate_up, limit=SWIGLU_LIMIT, out_format=G32, out=h_pair, return_bf16=False)

    return {"silu_epilogue_us": harness.rotating(epilogue, weights),
            "silu_launch_us": harness.rotating(launch, weights)}


COLUMNS = ["shape", "m", "pair_us", "bf16_quant_us", "w8a16_us", "cublas_g128_us", "triton_g128_us",
           "floor_us", "bw_frac", "roofline_us", "roofline_frac", "pair_vs_cublas", "g128_vs_cublas",
           "silu_epilogue_us", "silu_launch_us", "silu_rule"]


def roofline_us(m: int, n: int, k: int, group: int, copy_bw: float, fp8_rate: float | None) -> float:
    """The larger of the bytes a pair GEMM moves (e4m3 weights and their fp32 block scales, the
    pair in the format the group's weights take, the bf16 output) over ``copy_bw`` and its
    ``2 M N K`` flops over ``fp8_rate`` (None: bytes alone), in us."""
    blocks = -(-n // group) * -(-k // group)
    pair = harness.pair_bytes(m, k, gemm.input_format_for_block(group))
    return harness.roofline_us(n * k + 4 * blocks + pair + 2 * m * n, copy_bw, 2 * m * n * k, fp8_rate)


def report(meta, records, results_dir=None) -> str:
    """Save JSON (+ PNG for the timing run) under ``results_dir``; return the markdown table."""
    if meta.get("sweep"):
        path = harness.save_results("gemm_sweep", meta, records, results_dir)
        rows = [dict(shape=r["shape"], group=r["group"], m=r["m"], best_us=r["best_us"],
                     best=str(tuple(r["best"])), current_us=r["current_us"], floor_us=r["floor_us"])
                for r in records]
        return f"{path}\n" + harness.markdown_table(rows, ["shape", "group", "m", "best_us", "best", "current_us", "floor_us"])
    path = harness.save_results("gemm", meta, records, results_dir)
    try:
        harness.plot_records("gemm", records, "m", ["pair_us", "bf16_quant_us", "w8a16_us", "cublas_g128_us",
                                             "triton_g128_us", "silu_epilogue_us", "silu_launch_us", "floor_us"],
                     "us per call", group="shape",
                     results_dir=results_dir)
    except Exception as exc:  # noqa: BLE001 - a plot is not worth failing the run
        print(f"plot skipped: {exc}")
    return f"{path}\n" + harness.markdown_table(records, COLUMNS + ["cublas_valid"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    # the script's own outputs (`fp8chain bench gemm` always saves under --results-dir)
    parser.add_argument("--no-save", action="store_true", help="do not write JSON/PNG")
    parser.add_argument("--json-out", default=None, help="also write records to this JSON path")
    args = parser.parse_args(argv)
    meta, records = run(args)
    if args.worker:
        return
    print(json.dumps(meta))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    if args.no_save:
        if not args.sweep:
            print(harness.markdown_table(records, COLUMNS))
        return
    print(report(meta, records))


if __name__ == "__main__":
    main()
