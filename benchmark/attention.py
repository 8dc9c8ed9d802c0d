"""The MQA attention core (``rope_qkv`` + ``mqa_attention``) at DSv4.1 shapes, against its roofline.

Per case (query heads, M tokens, context), median microseconds per call under CUDA-graph replay:

* ``rope_us``: ``rope_qkv`` (per-head RMS + RoPE of q, the RoPE'd latent written into the cache);
* ``attention_us``: ``mqa_attention`` (the split kernel, plus the merge where a token's keys are
  split over several programs); ``split_us`` / ``merge_us``: the GPU time of each kernel
  (torch.profiler, eager), ``key_splits`` how many programs share a token's keys;
* with ``--tiles``, ``attention_us[HxL]`` and ``key_splits[HxL]`` for each other split-kernel
  tile (H query heads per program, L keys per step), in the same run;
* with ``--splits``, ``attention_us[splits=N]`` for other key-split counts of the default tile
  (counts past a case's key steps are skipped), in the same run: the sweep behind
  ``attention._splits``.

Roofline, both rates measured in this run: ``bytes`` = the cache rows read (every decode token
has its own slot; a prefill sequence's keys are read once) + q + o in bf16; ``flops`` = 4 x heads
x head_dim per (token, key) pair (``q.k`` and ``p @ v``); ``floor_us`` = the larger of
bytes / copy bandwidth and flops / bf16 matmul rate; ``floor_fraction`` = floor_us / attention_us.

Decode: M sequences, each at position ``context - 1`` of its own slot. Prefill: one sequence of M
tokens at positions 0..M-1 (causal: token t attends to keys 0..t). The calls of a captured graph
take turns over copies of the KV cache that add up to 160 MB (``harness.copies_past_l2``, at most
256 copies: a cache under 640 KB, only at sizes below the defaults, stays partly in L2), so every
call reads its keys from HBM as a serving step does (until 2026-12-05 one cache was replayed: a
decode cache of a few MB stayed in L2 between calls).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sgl-kernel"))

from fp8chain.argtypes import positive_int, non_negative_int  # noqa: E402
from fp8chain.bench import harness  # noqa: E402
from fp8chain_kernel import attention, reference  # noqa: E402

HEAD_DIM = 512  # DSv4.1: one 512-wide latent head, keys = values
ROPE_DIM = 64
ROPE_THETA = 10000.0
ROWS = [1, 4, 16, 64, 256]
CONTEXTS = [1024, 4096]
HEADS = [64, 16]  # TP1, one TP4 rank
PREFILL = 2048


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", nargs="+", type=positive_int, help="decode batch sizes M")
    parser.add_argument("--contexts", nargs="+", type=positive_int, help="KV-cache lengths per decode token")
    parser.add_argument("--heads", nargs="+", type=positive_int, help="query heads (64: TP1, 16: a TP4 rank)")
    parser.add_argument("--prefill", type=non_negative_int, help="causal prefill tokens (0: skip)")
    harness.add_quick(parser, rows=(ROWS, [1, 16, 64]), contexts=(CONTEXTS, [1024]), heads=(HEADS, [64]),
                      prefill=(PREFILL, 0))
    parser.add_argument("--iters", type=positive_int, default=50, help="calls per captured graph")
    parser.add_argument("--tiles", nargs="+", type=parse_tile, default=[],
                        help="other split-kernel tiles to time beside the default, as HEADSxKEYS (e.g. 32x64 64x32)")
    parser.add_argument("--splits", nargs="+", type=positive_int, default=[],
                        help="other key-split counts to time beside the default (e.g. 1 2 4 8 16)")


def parse_tile(text: str) -> tuple[int, int]:
    """``"64x32"`` -> ``(64, 32)``: query heads per program x keys per step."""
    try:
        heads, keys = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tile is HEADSxKEYS, e.g. 64x32; got {text!r}") from None
    if any(v < 16 or v & (v - 1) for v in (heads, keys)):  # mqa_attention's own rule
        raise argparse.ArgumentTypeError(f"a tile's heads and keys are powers of two >= 16; got {text!r}")
    return heads, keys


def roofline(phase: str, tokens: int, heads: int, dim: int, context: int) -> tuple[int, int]:
    """``(bytes, flops)`` one call must move and compute (see the module docstring)."""
    if phase == "decode":
        cache_rows, pairs = tokens * context, tokens * context
    else:
        cache_rows, pairs = tokens, tokens * (tokens + 1) // 2
    return (cache_rows + 2 * tokens * heads) * dim * 2, 4 * heads * dim * pairs


def plan(args) -> list[tuple[str, int, int, int]]:
    """The ``(phase, heads, M, context)`` cases of a run."""
    cases = [("decode", h, m, c) for h in args.heads for c in args.contexts for m in args.rows]
    if args.prefill:
        cases += [("prefill", h, args.prefill, args.prefill) for h in args.heads]
    return cases


def _inputs(phase: str, heads: int, tokens: int, context: int, device="cuda"):
    q = torch.randn(tokens, heads * HEAD_DIM, device=device).bfloat16()
    kv = torch.randn(tokens, HEAD_DIM, device=device).bfloat16()
    if phase == "decode":
        cache = torch.randn(tokens, context, HEAD_DIM, device=device).bfloat16()
        slots = torch.arange(tokens, device=device)
        positions = torch.full((tokens,), context - 1, dtype=torch.long, device=device)
    else:
        cache = torch.randn(1, tokens, HEAD_DIM, device=device).bfloat16()
        slots = torch.zeros(tokens, dtype=torch.long, device=device)
        positions = torch.arange(tokens, device=device)
    cos, sin = reference.rope_tables(cache.shape[1], ROPE_DIM, ROPE_THETA, device)
    sink = torch.randn(heads, device=device)
    return q, kv, cache, slots, positions, cos, sin, sink


def run(args) -> tuple[dict, list[dict]]:
    if not torch.cuda.is_available():
        raise SystemExit("benchmark attention needs a CUDA GPU (kernel logic is tested on CPU instead)")
    meta = harness.bench_meta()
    bandwidth = harness.copy_bandwidth()
    matmul_rate = harness.bf16_matmul_rate()
    meta.update(copy_bandwidth_TBps=bandwidth / 1e12, bf16_matmul_TFLOPs=matmul_rate / 1e12,
                head_dim=HEAD_DIM, rope_dim=ROPE_DIM)
    records = []
    # Pass 1 times every case, pass 2 profiles them (split / merge kernel times): no timing may
    # follow torch.profiler in a process (the harness docstring).
    for phase, heads, tokens, context in harness.progress(plan(args), "attention"):
        rope, attend, cache = _calls(phase, heads, tokens, context)
        rope_us = harness.graph_time_us(rope, iters=args.iters)
        attention_us = harness.graph_time_us(attend(), iters=args.iters)
        nbytes, flops = roofline(phase, tokens, heads, HEAD_DIM, context)
        floor_us = harness.roofline_us(nbytes, bandwidth, flops, matmul_rate)
        record = {
            "phase": phase, "heads": heads, "M": tokens, "context": context,
            "rope_us": rope_us, "attention_us": attention_us,
            "key_splits": attention.key_splits(tokens, heads, cache.shape[1], device=cache.device),
            "bytes": nbytes, "flops": flops, "floor_us": floor_us, "floor_fraction": floor_us / attention_us,
        }
        for tile in args.tiles:
            name = f"{tile[0]}x{tile[1]}"
            record[f"attention_us[{name}]"] = harness.graph_time_us(attend(tile), iters=args.iters)
            record[f"key_splits[{name}]"] = attention.key_splits(tokens, heads, cache.shape[1], tile, cache.device)
        for count in args.splits:
            try:
                record[f"attention_us[splits={count}]"] = harness.graph_time_us(attend(splits=count),
                                                                                iters=args.iters)
            except ValueError:  # more splits than the case has key steps (mqa_attention's own check)
                print(f"  {phase} heads {heads} M {tokens} context {context}: skipping {count} key splits "
                      f"(more than its steps of keys)")
        records.append(record)
    for record in harness.progress(records, "kernels (torch.profiler)"):
        _, attend, _ = _calls(record["phase"], record["heads"], record["M"], record["context"])
        kernels = harness.kernel_profile(attend())
        record["split_us"] = kernels.get("_mqa_split_kernel", {}).get("us", 0.0)
        record["merge_us"] = kernels.get("_mqa_merge_kernel", {}).get("us", 0.0)
        record["kernels"] = kernels
    return meta, records


def _calls(phase: str, heads: int, tokens: int, context: int, device="cuda"):
    """``(rope, attend, cache)`` of one case: ``rope`` a call of the ``rope_qkv`` launch,
    ``attend(tile=None, splits=None)`` a call of the attention over its roped queries; each call
    takes the next of the cache's copies (``harness.rotating``: the module docstring)."""
    q2d, kv, cache, slots, positions, cos, sin, sink = _inputs(phase, heads, tokens, context, device)
    q = attention.rope_qkv(q2d, kv, cos, sin, cache, slots, positions, 1e-6)
    copies = harness.copies_past_l2(cache.numel() * cache.element_size(), most=256)  # a 1 MB cache takes 160
    caches = [(cache,)] + [(cache.clone(),) for _ in range(copies - 1)]  # each holds the roped rows
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    rope = harness.rotating(lambda c: attention.rope_qkv(q2d, kv, cos, sin, c, slots, positions, 1e-6), caches)

    def attend(tile=None, splits=None):
        return harness.rotating(lambda c: attention.mqa_attention(q, c, slots, positions, sink, scale, cos, sin,
                                                                  out=out, tile=tile, splits=splits), caches)

    return rope, attend, cache


COLUMNS = ["phase", "heads", "M", "context", "rope_us", "attention_us", "split_us", "merge_us", "key_splits",
           "floor_us", "floor_fraction"]


def report(meta: dict, records: list[dict], results_dir=None) -> str:
    json_path = harness.save_results("attention", meta, records, results_dir)
    tile_columns = sorted({key for r in records for key in r if key.endswith("]")})
    decode = [dict(r, panel=f"{r['heads']} heads, context {r['context']}") for r in records if r["phase"] == "decode"]
    if decode:
        harness.plot_records("attention", decode, "M",
                             ["attention_us", "split_us", "merge_us", "floor_us"]
                             + [c for c in tile_columns if c.startswith("attention_us")],
                             "us per call", group="panel", results_dir=results_dir)
    return f"{json_path}\n" + harness.markdown_table(records, COLUMNS + tile_columns)


if __name__ == "__main__":
    harness.benchmark_main(__doc__, add_arguments, run, report)
