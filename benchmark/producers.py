"""FP8-emitting producers: what writing the pair in the producer costs, against the launch it saves.

Producers (DSv4.1 shapes): ``rms_norm`` H=5120 (with the fused residual add) and q_norm H=1280,
``silu_mul`` I=2304 with the swiglu clamp, ``wo_a_einsum`` G=8 (TP1) and G=2 (TP4) with R=1024,
D=4096 (bf16 weights; ``wo_a_g8_fp8w`` / ``wo_a_g2_fp8w``: the checkpoint's FP8 weights with their
32x32 block scales, dequantized in the kernel, the same products), and the mHC boundary
(``mhc.mhc_mega_boundary``, post + combine + RMSNorm) when it is importable. For each producer and T, four timings in one process (CUDA-graph replay, median):

- ``bf16_us``: the bf16-only producer;
- ``bf16_quant_us``: the bf16 producer followed by the standalone ``quant.quantize`` (two launches:
  the unchained baseline);
- ``fp8_us``: the FP8-emitting producer (one launch). It writes only the pair
  (``return_bf16=False``) where the model reads only the pair (q_norm -> wq_b, SiLU*mul -> shared
  down, wo_a -> wo_b) and bf16 + pair where the model also reads bf16 (H=5120 norm and the mHC
  boundary: the indexer, compressor and router read bf16 x); ``fp8_returns_bf16`` says which;
- ``compiled_peer_us``: ``torch.compile`` of the torch reference producer followed by
  ``reference.quantize``. For ``wo_a`` the peer is the bf16 ``torch.einsum`` (cuBLAS, fp32
  accumulation, one bf16 rounding: the same contract as the kernel) rather than the fp32-upcast
  reference, which is a specification, not a competitor.

``--sweep-wo-a`` instead times candidate launch configs of the FP8-emitting ``wo_a_einsum`` (the
``wo_a*`` producers ``--producers`` selects, bf16 or FP8 weights, the given T: decode tiles up to
T = 64, ``--splits`` narrowing them to one-group tiles; compute tiles above, ``--splits`` setting
their K splits) against the table's choice, with the weights rotating through copies past L2
(``harness.copies_past_l2``), and writes ``producers_wo_a_sweep.json`` (the source of
``einsum._launch_config``). Each config first runs once and is checked (``check_wo_a_launch``: bf16
within ``verify.WO_A_REL_BOUND`` of the fp64 einsum, pair bitwise); a wrong one is skipped, named.

``--sweep-launch`` instead times candidate program shapes (rows per program, tile width, warps)
of the row-tiled producers (RMSNorm, q_norm, SiLU*mul; ``config=``), each shape's bf16-only and
FP8 launch and the launch rule's in graphs replayed in turn, and writes
``producers_launch_sweep.json`` (the source of ``norm._launch_config`` and ``act._launch_config``).

Next to each figure: the bytes-moved floor of each arm (bytes / copy bandwidth measured in the
same run; for the wo_a einsum also ``floor_compute_us``, its flops / the bf16 matmul rate measured
in the same run, and ``fp8_roofline_fraction``, the larger floor over the FP8 arm's time), and the
ratios fp8/bf16-only and fp8/(bf16+quant). ``fp8_launches`` counts kernel
launches of the FP8 arm (torch.profiler).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sgl-kernel"))

from fp8chain.argtypes import output_dir, positive_int  # noqa: E402
from fp8chain import verify  # noqa: E402
from fp8chain.bench import harness  # noqa: E402
from fp8chain_kernel import act, einsum, norm, quant, reference  # noqa: E402
from fp8chain_kernel.formats import ActFormat, empty_pair  # noqa: E402
from fp8chain_kernel.reference.einsum import wo_a_einsum_fp  # noqa: E402

ROWS = [1, 4, 16, 64, 256, 2048]
QUICK_ROWS = [1, 64, 2048]
PRODUCERS = ["rms_norm", "q_norm", "silu_mul", "wo_a_g8", "wo_a_g2", "wo_a_g8_fp8w", "wo_a_g2_fp8w", "mhc_boundary"]
EPS = 1e-6
DEVICE = "cuda"
SWIGLU_LIMIT = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", nargs="+", type=positive_int, help="token counts T")
    harness.add_quick(parser, rows=(ROWS, QUICK_ROWS))
    parser.add_argument("--producers", nargs="+", default=PRODUCERS, choices=PRODUCERS, help="producers to time")
    parser.add_argument("--formats", nargs="+", default=[ActFormat.SM90_G32_FP32_MN.value],
                        choices=[f.value for f in ActFormat],
                        help="FP8 formats (default: the DSv4.1 Hopper format)")
    parser.add_argument("--no-peer", action="store_true", help="skip the torch.compile peer")
    parser.add_argument("--iters", type=positive_int, default=50, help="calls per captured graph")
    parser.add_argument("--results-dir", default=None, type=output_dir,
                        help="where JSON/PNG go (default benchmark/results)")
    sweeps = parser.add_mutually_exclusive_group()
    sweeps.add_argument("--sweep-wo-a", action="store_true",
                        help="time candidate wo_a_einsum launch configs (FP8 out) instead of the four arms")
    parser.add_argument("--splits", nargs="+", type=positive_int, default=None,
                        help="with --sweep-wo-a: these K splits only (and at T <= 64 one-scale-group tiles only)")
    sweeps.add_argument("--sweep-launch", action="store_true",
                        help="time candidate program shapes of RMSNorm, q_norm and SiLU*mul instead of the four arms")


def _peer_quantize(x: torch.Tensor, fmt: ActFormat):
    """``reference.quantize`` as a plain ``(data, scale)`` tuple, what the compiled peer returns."""
    return tuple(reference.quantize(x, fmt))


def peer_function(name: str, fmt: ActFormat):
    """The compiled peer's eager body: torch reference producer + reference quantize."""
    if name == "rms_norm":  # the bf16 x too, as the FP8 arm writes it (DSv4.1's router reads it)
        def norm_with_x(x, w, res):
            y = reference.rms_norm(x, w, EPS, residual=res)
            return y, *_peer_quantize(y, fmt)
        return norm_with_x
    if name == "q_norm":  # the pair alone, as the FP8 arm (wq_b reads nothing else)
        return lambda x, w, res: _peer_quantize(reference.rms_norm(x, w, EPS, residual=res), fmt)
    if name == "silu_mul":
        return lambda gu: _peer_quantize(reference.silu_mul(gu, limit=SWIGLU_LIMIT), fmt)
    if name.startswith("wo_a"):  # the peer reads bf16 weights (an FP8 wo_a dequantized once)
        return lambda o, wo_a: _peer_quantize(torch.einsum("tgd,grd->tgr", o, wo_a).flatten(1), fmt)
    if name == "mhc_boundary":
        def boundary(*a):
            new_residual, x, _ = reference.mhc_mega_boundary(*a, EPS)
            return new_residual, x, _peer_quantize(x, fmt)
        return boundary
    raise ValueError(name)


def wo_a_weight_copies(g: int, r: int, d: int, fp8_weights: bool, device) -> tuple[list, int]:
    """Random wo_a weights ``[(weight, block scales or None)]`` in as many copies as take the
    bytes past L2 (a decode step streams wo_a from HBM), and one copy's bytes: bf16 ``[G, R, D]``,
    or the checkpoint's e4m3 with its fp32 32x32 block scales."""
    if fp8_weights:
        make = lambda: reference.random_fp8_wo_a(g, r, d, device=device, log2_scale=-12)  # noqa: E731
    else:
        make = lambda: ((torch.randn(g, r, d, device=device) / d ** 0.5).bfloat16(), None)  # noqa: E731
    weights = [make()]
    weight_bytes = sum(t.numel() * t.element_size() for t in weights[0] if t is not None)
    return weights + [make() for _ in range(harness.copies_past_l2(weight_bytes) - 1)], weight_bytes


class Case:
    """One producer at one T: the three arms as closures over preallocated buffers, the peer's
    argument sets (``peer_arg_sets``: one per weight copy, which wo_a's arms rotate through past
    L2), and the bytes each arm must move (``in_bytes`` read + written besides the output).
    ``config``: a launch config for the row-tiled producers (``--sweep-launch``)."""

    def __init__(self, name, rows, fmt, device, config=None):
        self.name, self.rows, self.fmt = name, rows, fmt
        t = rows
        quant_out = None
        if name in ("rms_norm", "q_norm"):
            h = 5120 if name == "rms_norm" else 1280
            self.shape, cols = f"H={h}", h
            x = torch.randn(t, h, device=device).bfloat16()
            w = (1 + 0.1 * torch.randn(h, device=device)).bfloat16()
            res = torch.randn(t, h, device=device).bfloat16() if name == "rms_norm" else None
            self.fp8_bf16 = name == "rms_norm"
            self.in_bytes = t * h * 2 + h * 2 + (2 * t * h * 2 if res is not None else 0)
            y = torch.empty(t, h, device=device, dtype=torch.bfloat16)
            pair = empty_pair(t, h, fmt, device)
            self.bf16 = lambda: norm.rms_norm(x, w, EPS, residual=res, out_bf16=y, config=config)
            self.fp8 = lambda: norm.rms_norm(x, w, EPS, residual=res, out_format=fmt, out=pair,
                                             out_bf16=y if self.fp8_bf16 else None, return_bf16=self.fp8_bf16,
                                             config=config)
            self.peer_arg_sets = [(x, w, res)]
        elif name == "silu_mul":
            i = 2304
            self.shape, cols = f"I={i}", i
            gu = (4 * torch.randn(t, 2 * i, device=device)).bfloat16()
            self.fp8_bf16 = False
            self.in_bytes = t * 2 * i * 2
            y = torch.empty(t, i, device=device, dtype=torch.bfloat16)
            pair = empty_pair(t, i, fmt, device)
            self.bf16 = lambda: act.silu_mul(gu, limit=SWIGLU_LIMIT, out_bf16=y, config=config)
            self.fp8 = lambda: act.silu_mul(gu, limit=SWIGLU_LIMIT, out_format=fmt, out=pair, return_bf16=False,
                                            config=config)
            self.peer_arg_sets = [(gu,)]
        elif name.startswith("wo_a"):
            g, r, d = (8 if name.startswith("wo_a_g8") else 2), 1024, 4096
            fp8_weights = name.endswith("_fp8w")  # the checkpoint's FP8 wo_a, dequantized in the kernel
            self.shape, cols = f"G={g} R={r} D={d}" + (" FP8 weights" if fp8_weights else ""), g * r
            # o as the attention output's view: [T, 64 heads / (8/G), 512] seen as [T, G, 4096]
            o = torch.randn(t, g, d, device=device).bfloat16()
            # every arm rotates through weight copies past L2, as a decode step streams wo_a from HBM
            weights, weight_bytes = wo_a_weight_copies(g, r, d, fp8_weights, device)
            peer_weights = [reference.dequantize_wo_a(w, ws) if fp8_weights else w for w, ws in weights]
            self.fp8_bf16 = False
            self.in_bytes = t * g * d * 2 + weight_bytes
            self.flops = 2 * t * g * r * d
            y = torch.empty(t, cols, device=device, dtype=torch.bfloat16)
            pair = empty_pair(t, cols, fmt, device)
            # the bf16-only arm tiles as the model's unchained call does (wo_b's scale group)
            self.bf16 = harness.rotating(lambda w, ws: einsum.wo_a_einsum(o, w, weight_scale=ws, out_bf16=y,
                                                                          tile_group=fmt.group_size), weights)
            self.fp8 = harness.rotating(lambda w, ws: einsum.wo_a_einsum(
                o, w, weight_scale=ws, out_format=fmt, out=pair, return_bf16=False), weights)
            self.peer_arg_sets = [(o, w) for w in peer_weights]
        elif name == "mhc_boundary":
            from fp8chain_kernel import mhc  # lazily: the boundary kernel may not exist yet
            h = 5120
            self.shape, cols = f"H={h} hc=4", h
            yin = torch.randn(t, h, device=device).bfloat16()
            res = torch.randn(t, 4, h, device=device).bfloat16()
            pre = torch.rand(t, 4, device=device)
            post = 2 * torch.rand(t, 4, device=device)
            comb = torch.softmax(torch.randn(t, 4, 4, device=device), dim=-1)
            w = (1 + 0.1 * torch.randn(h, device=device)).bfloat16()
            new_res = torch.empty_like(res)
            self.fp8_bf16 = True
            self.in_bytes = t * h * 2 + 2 * t * 4 * h * 2 + h * 2 + t * 24 * 4
            y = torch.empty(t, h, device=device, dtype=torch.bfloat16)
            pair = empty_pair(t, h, fmt, device)
            self.bf16 = lambda: mhc.mhc_mega_boundary(yin, res, pre, post, comb, w, EPS, out_residual=new_res,
                                                      out_bf16=y)
            self.fp8 = lambda: mhc.mhc_mega_boundary(yin, res, pre, post, comb, w, EPS, out_format=fmt, out=pair,
                                                     out_residual=new_res, out_bf16=y)
            self.peer_arg_sets = [(yin, res, pre, post, comb, w)]
        else:
            raise ValueError(name)
        self.cols = cols
        quant_out = empty_pair(t, cols, fmt, device)
        self.bf16_quant = harness.followed_by(self.bf16, lambda: quant.quantize(y, fmt, out=quant_out))
        bf16_out = t * cols * 2
        fp8_out = harness.pair_bytes(t, cols, fmt)
        self.bytes_bf16 = self.in_bytes + bf16_out
        self.bytes_fp8 = self.in_bytes + fp8_out + (bf16_out if self.fp8_bf16 else 0)
        # the unchained pair re-reads the bf16 output to quantize it
        self.bytes_bf16_quant = self.bytes_bf16 + bf16_out + fp8_out


def wo_a_candidates(rows: int, d: int = 4096, splits: list[int] | None = None) -> list[dict]:
    """Tile configs for ``wo_a_einsum`` at ``rows`` tokens. Decode (<= 64 rows): 16-row, from 17
    rows also 32-row (mma.sync: operands from registers, so an FP8 wo_a's converted weights skip
    the round trip through shared memory that wgmma takes) or 64-row (wgmma) M tiles, one or two
    32-column scale groups per N tile, pipelines that fit the H200's shared memory, D unsplit; and
    one-group tiles with 128/256-wide K steps and 4 or 6 stages with D in 2, 4 or 8 slices (at
    least two K steps each). ``splits``: only the one-group tiles, with these splits. Larger
    batches: ``wo_a_compute_candidates``."""
    if rows > 64:
        return wo_a_compute_candidates(rows, d, splits)
    out = []
    for block_m in (16, 32, 64) if rows > 16 else (16, 64):
        for block_n in (32, 64):
            for block_k in (64, 128, 256):
                for stages in (3, 4, 5, 6):
                    for warps in ((4,) if block_m < 64 else (4, 8)):
                        if (block_m + block_n) * block_k * 2 * stages > 220 * 1024:
                            continue
                        one_group = block_n == 32 and block_k > 64 and stages in (4, 6)
                        for split in (1, 2, 4, 8) if splits is None else splits:
                            if ((split > 1 or splits is not None) and not one_group) or d // block_k < 2 * split:
                                continue
                            out.append(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                            num_warps=warps, num_stages=stages, SPLIT=split))
    return out


def wo_a_compute_candidates(rows: int, d: int = 4096, splits: list[int] | None = None) -> list[dict]:
    """Compute tiles for ``rows`` > 64 (wgmma): M tiles of 64, 128 or 256 rows (no taller than
    ``rows`` needs; a taller tile converts an FP8 wo_a's weights fewer times), 64 or 128 columns
    (at most 128 x 128 outputs: 256 x 128 spills registers on sm_90), K steps of 64, 3 or 4
    stages, 4 warps for 64-row tiles (as the bf16 table's) and 8 for taller, D in ``splits``
    slices (default 1, 2 or 4: the grid of a G = 2 shard fills few SMs), at least two K steps
    each."""
    out = []
    for block_m in (64, 128, 256):
        if block_m > triton.next_power_of_2(rows):
            continue
        for block_n in (64, 128):
            for stages in (3, 4):
                if block_m * block_n > einsum.FP8_WEIGHT_TILE_OUTPUTS:  # every other tile's stages fit in 160 KiB
                    continue
                for split in (1, 2, 4) if splits is None else splits:
                    if d // 64 >= 2 * split:
                        out.append(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
                                        num_warps=4 if block_m == 64 else 8, num_stages=stages,
                                        SPLIT=split))
    return out


def wo_a_reference_fp64(o: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> torch.Tensor:
    """The einsum in fp64 on the values a wo_a launch multiplies (an FP8 weight dequantized as the
    kernel dequantizes it)."""
    if weight_scale is not None:
        weight = reference.dequantize_wo_a(weight, weight_scale, 32)
    return wo_a_einsum_fp(o, weight, torch.float64)


def check_wo_a_launch(o: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, fmt: ActFormat,
                      config: dict | None, want: torch.Tensor) -> None:
    """A swept launch must be a correct producer before its time counts: run once, its bf16 output
    within ``verify.WO_A_REL_BOUND`` of ``want`` (the fp64 einsum; NaN fails), its pair
    ``reference.quantize`` of that output bit for bit. Raises ``AssertionError`` naming what is wrong."""
    y, pair = einsum.wo_a_einsum(o, weight, weight_scale=weight_scale, out_format=fmt, config=config)
    err = verify.relative_error(y, want)
    if not err < verify.WO_A_REL_BOUND:
        raise AssertionError(f"wrong output: relative error {err:.3g} (bound {verify.WO_A_REL_BOUND})")
    if not verify.pairs_equal(pair, reference.quantize(y, fmt)):
        raise AssertionError("wrong output: the pair is not the quantization of the launch's own bf16 output")


def wo_a_sweep_cases(args) -> list[tuple[str, int]]:
    """``--sweep-wo-a``'s (producer, T): the wo_a producers among ``--producers``, each T."""
    return [(name, t) for name in args.producers if name.startswith("wo_a") for t in args.rows]


def run_wo_a_sweep(args) -> tuple[dict, list[dict]]:
    meta = harness.bench_meta()
    meta["copy_bandwidth_TBps"] = harness.copy_bandwidth() / 1e12
    meta["sweep"] = "wo_a"
    fmt = ActFormat(args.formats[0])
    records = []
    for name, rows in harness.progress(wo_a_sweep_cases(args), "wo_a configs"):
        g, r, d = (8 if name.startswith("wo_a_g8") else 2), 1024, 4096
        fp8_weights = name.endswith("_fp8w")
        weights, weight_bytes = wo_a_weight_copies(g, r, d, fp8_weights, DEVICE)
        o = torch.randn(rows, g, d, device=DEVICE).bfloat16()
        pair = empty_pair(rows, g * r, fmt, DEVICE)

        floor_us = ((weight_bytes + rows * g * d * 2 + harness.pair_bytes(rows, g * r, fmt))
                    / (meta["copy_bandwidth_TBps"] * 1e12) * 1e6)
        want = wo_a_reference_fp64(o, *weights[0])
        mine = []
        for config in [None] + wo_a_candidates(rows, d, args.splits):
            call = harness.rotating(lambda w, ws, c=config: einsum.wo_a_einsum(
                o, w, weight_scale=ws, out_format=fmt, out=pair, return_bf16=False, config=c), weights)
            try:
                check_wo_a_launch(o, *weights[0], fmt, config, want)
                us = harness.graph_time_us(call, iters=args.iters, repeats=3)
            except Exception as exc:
                if config is None:  # the table's own choice failing is a bug to report, not a skip
                    raise
                print(f"skip {name} T={rows} {config}: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            mine.append({"producer": name, "G": g, "T": rows, "config": config or "table", "fp8_us": us,
                         "floor_us": floor_us})
        records += mine
        best = min(mine, key=lambda x: x["fp8_us"])
        table = mine[0]
        print(f"{name} T={rows}: table {table['fp8_us']:.2f} us, best {best['fp8_us']:.2f} us {best['config']}, "
              f"floor {floor_us:.2f} us", flush=True)
        harness.save_results("producers_wo_a_sweep", meta, records, args.results_dir)
        del weights
    return meta, records


LAUNCH_SWEEP = ("rms_norm", "q_norm", "silu_mul")


def launch_candidates(name: str, rows: int) -> list[dict]:
    """Program shapes for ``--sweep-launch``: RMSNorm whole rows (1-8 per program, 2-16 warps);
    SiLU*mul tiles 128 or 256 wide of 1-32 rows, 64-8192 outputs, 2-8 warps (at least one output
    per thread)."""
    if name in ("rms_norm", "q_norm"):
        width = triton.next_power_of_2(5120 if name == "rms_norm" else 1280)
        return [dict(BLOCK_M=m, BLOCK_H=width, num_warps=w) for m in (1, 2, 4, 8) if m <= rows
                for w in ((4, 8, 16) if width > 2048 else (2, 4, 8))]
    if name == "silu_mul":
        return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w) for n in (128, 256) for m in (1, 2, 4, 8, 16, 32)
                for w in (2, 4, 8) if m <= rows and 32 * w <= m * n <= 8192]
    raise ValueError(f"--sweep-launch covers {LAUNCH_SWEEP}, not {name}")


def launch_sweep_cases(args) -> list[tuple[str, int]]:
    """``--sweep-launch``'s (producer, T): those of ``LAUNCH_SWEEP`` among ``--producers``."""
    return [(p, t) for p in args.producers if p in LAUNCH_SWEEP for t in args.rows]


def run_launch_sweep(args) -> tuple[dict, list[dict]]:
    meta = harness.bench_meta()
    meta["copy_bandwidth_TBps"] = harness.copy_bandwidth() / 1e12  # the report's device line
    meta["sweep"] = "launch"
    fmt = ActFormat(args.formats[0])
    records = []
    for name, rows in harness.progress(launch_sweep_cases(args), "launch shapes"):
        configs = [None] + launch_candidates(name, rows)
        # every shape's two arms replay in turn: differences are fractions of a microsecond. The
        # units own the buffers the graphs read and write: alive until the replays are done.
        units = [Case(name, rows, fmt, DEVICE, config=config) for config in configs]
        iters = harness.graph_calls(units[0].fp8, args.iters)
        graphs = {(index, arm): harness.capture_graph(getattr(unit, arm), iters)
                  for index, unit in enumerate(units) for arm in ("bf16", "fp8")}
        for (index, arm), us in harness.replay_times_us(graphs, iters).items():
            records.append({"producer": name, "T": rows, "config": configs[index] or "rule", "arm": arm, "us": us})
        del graphs, units
        harness.save_results("producers_launch_sweep", meta, records, args.results_dir)
    return meta, records


def best_launches(records: list[dict]) -> list[dict]:
    """Per producer and T: the rule's bf16 / FP8 times and the fastest shape of each arm."""
    rows = {}
    for rec in records:
        row = rows.setdefault((rec["producer"], rec["T"]), {"producer": rec["producer"], "T": rec["T"]})
        arm = rec["arm"]
        if rec["config"] == "rule":
            row[f"rule_{arm}_us"] = rec["us"]
        elif rec["us"] < row.get(f"best_{arm}_us", float("inf")):
            row[f"best_{arm}_us"], row[f"best_{arm}_config"] = rec["us"], rec["config"]
    return list(rows.values())


def run(args) -> tuple[dict, list[dict]]:
    if (args.sweep_wo_a or args.sweep_launch) and len(args.formats) > 1:
        raise SystemExit("--sweep-wo-a and --sweep-launch time one format; pass one --formats value")
    if args.splits is not None and not args.sweep_wo_a:
        raise SystemExit("--splits narrows the --sweep-wo-a candidates; pass --sweep-wo-a too")
    if args.sweep_wo_a and not wo_a_sweep_cases(args):
        raise SystemExit("--sweep-wo-a: --producers names no wo_a producer")
    if args.sweep_launch and not launch_sweep_cases(args):
        raise SystemExit(f"--sweep-launch: --producers names none of {', '.join(LAUNCH_SWEEP)}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmark producers needs a CUDA GPU (kernel logic is tested on CPU instead)")
    if args.sweep_wo_a:
        return run_wo_a_sweep(args)
    if args.sweep_launch:
        return run_launch_sweep(args)
    meta = harness.bench_meta()
    bandwidth = harness.copy_bandwidth()
    meta["copy_bandwidth_TBps"] = bandwidth / 1e12
    matmul_rate = harness.bf16_matmul_rate() if any(p.startswith("wo_a") for p in args.producers) else None
    meta["bf16_matmul_TFLOPs"] = matmul_rate / 1e12 if matmul_rate else None
    meta["notes"] = ("fp8_us writes the pair only where fp8_returns_bf16 is false; compiled_peer_us is "
                     "torch.compile(reference producer + reference.quantize); wo_a peer: bf16 torch.einsum")
    producers = list(args.producers)
    cases = [(p, ActFormat(f), t) for p in producers for f in args.formats for t in args.rows]
    records = []
    # Pass 1: the three kernel arms of every case; pass 2: the compiled peers (their compiles are
    # the slow part, so a time-limited run still records every kernel figure); pass 3: launches
    # (torch.profiler, after which no timing may follow: the harness docstring).
    for name, fmt, rows in harness.progress(cases, "producers"):
        case = Case(name, rows, fmt, DEVICE)
        rec = {"case": f"{name} {case.shape}", "producer": name, "shape": case.shape, "format": fmt.value,
               "T": rows, "fp8_returns_bf16": case.fp8_bf16}
        # the arms' differences are fractions of a microsecond: their replays alternate; a graph
        # reads every weight copy the arms rotate through (wo_a)
        iters = harness.graph_calls(case.fp8, args.iters)
        graphs = {arm: harness.capture_graph(getattr(case, arm), iters) for arm in ("bf16", "bf16_quant", "fp8")}
        for arm, us in harness.replay_times_us(graphs, iters).items():
            rec[f"{arm}_us"] = us
        del graphs
        rec["compiled_peer_us"] = None
        rec["floor_bf16_us"] = case.bytes_bf16 / bandwidth * 1e6
        rec["floor_bf16_quant_us"] = case.bytes_bf16_quant / bandwidth * 1e6
        rec["floor_fp8_us"] = case.bytes_fp8 / bandwidth * 1e6
        rec["fp8_over_bf16"] = rec["fp8_us"] / rec["bf16_us"]
        rec["fp8_over_bf16_quant"] = rec["fp8_us"] / rec["bf16_quant_us"]
        rec["fp8_over_peer"] = None
        rec["fp8_bw_fraction"] = rec["floor_fp8_us"] / rec["fp8_us"]
        if hasattr(case, "flops"):  # the einsum's bf16 tensor-core products
            rec["fp8_tflops"] = case.flops / (rec["fp8_us"] * 1e-6) / 1e12
            rec["floor_compute_us"] = case.flops / matmul_rate * 1e6
            rec["fp8_roofline_fraction"] = (harness.roofline_us(case.bytes_fp8, bandwidth, case.flops, matmul_rate)
                                            / rec["fp8_us"])
        records.append(rec)
        harness.save_results("producers", meta, records, args.results_dir)  # partial results survive
        del case
    if not args.no_peer:
        peers = {}
        for (name, fmt, rows), rec in harness.progress(list(zip(cases, records)), "compiled peers"):
            key = (name, fmt)
            if key not in peers:  # one compile per producer (dynamic T), not one per T
                peers[key] = torch.compile(peer_function(name, fmt), dynamic=True)
            peer_call = harness.rotating(peers[key], Case(name, rows, fmt, DEVICE).peer_arg_sets)
            try:
                rec["compiled_peer_us"] = harness.graph_time_us(peer_call, iters=args.iters)
                rec["fp8_over_peer"] = rec["fp8_us"] / rec["compiled_peer_us"]
            except Exception as exc:  # a compile failure must not lose the other figures
                print(f"note: compiled peer failed for {name} T={rows}: {type(exc).__name__}: {exc}")
            harness.save_results("producers", meta, records, args.results_dir)
    for (name, fmt, rows), rec in harness.progress(list(zip(cases, records)), "launches (torch.profiler)"):
        rec["fp8_launches"] = sum(harness.count_launches(Case(name, rows, fmt, DEVICE).fp8).values())
    return meta, records


COLUMNS = ["case", "format", "T", "bf16_us", "bf16_quant_us", "fp8_us", "compiled_peer_us", "floor_fp8_us",
           "fp8_over_bf16", "fp8_over_bf16_quant", "fp8_over_peer", "fp8_returns_bf16", "fp8_launches"]


def report(meta: dict, records: list[dict], results_dir=None) -> str:
    if meta.get("sweep") == "launch":
        json_path = harness.save_results("producers_launch_sweep", meta, records, results_dir)
        columns = ["producer", "T", "rule_bf16_us", "rule_fp8_us", "best_bf16_us", "best_bf16_config", "best_fp8_us",
                   "best_fp8_config"]
        return f"{json_path}\n" + harness.markdown_table(best_launches(records), columns)
    if meta.get("sweep") == "wo_a":
        json_path = harness.save_results("producers_wo_a_sweep", meta, records, results_dir)
        best = {}
        for rec in records:
            key = (rec["producer"], rec["T"])
            if key not in best or rec["fp8_us"] < best[key]["fp8_us"]:
                best[key] = rec
        return f"{json_path}\n" + harness.markdown_table(list(best.values()),
                                                         ["producer", "T", "fp8_us", "floor_us", "config"])
    json_path = harness.save_results("producers", meta, records, results_dir)
    if records:  # a panel per case, and per format where several were timed
        several = len({r["format"] for r in records}) > 1
        panels = [{**r, "case": f"{r['case']} {r['format']}"} for r in records] if several else records
        harness.plot_records("producers", panels, "T",
                             ["bf16_us", "bf16_quant_us", "fp8_us", "compiled_peer_us", "floor_fp8_us"],
                             "us per call", group="case", results_dir=results_dir)
    return f"{json_path}\n" + harness.markdown_table(records, COLUMNS)


if __name__ == "__main__":
    harness.benchmark_main(__doc__, add_arguments, run, report)
