"""DSv4.1 attention between ``wq_b`` and ``wo_a``: RoPE, MQA over a slotted KV cache, inverse RoPE.

``rope_qkv(q, kv, cos_table, sin_table, kv_cache, slots, positions, eps, *, kv_weight=None) -> q_roped``
    ``q`` bf16 ``[T, nh*D]`` (wq_b's output) -> bf16 ``[T, nh, D]``, each head RMS-normalized
    (no weight) and RoPE'd on its last ``rd`` dims in fp32, rounded once; ``kv`` bf16 ``[T, D]``
    is RoPE'd the same way and written to ``kv_cache[slots[t], positions[t]]``. With
    ``kv_weight`` (bf16 ``[D]``, the model's ``kv_norm``), ``kv`` is the raw latent and is first
    RMS-normalized with that weight and ``eps`` and rounded to bf16, exactly as ``norm.rms_norm``
    would, so the kv norm needs no launch of its own. One launch.

``mqa_attention(q, kv_cache, slots, positions, sink, scale, cos_table, sin_table, *, out=None) -> o``
    ``q`` bf16 ``[T, nh, D]``, ``kv_cache`` bf16 ``[S, L, D]`` contiguous (one latent head, keys =
    values), ``sink`` fp32 ``[nh]``, ``scale`` the logits' factor (a number finite in fp32, else
    ``ValueError``) -> ``o`` bf16 ``[T, nh, D]``: token ``t`` attends to
    ``kv_cache[slots[t], 0..positions[t]]`` with per-head sinks, then the last ``rd`` dims are
    rotated back (inverse RoPE). Launch 1 spreads (token, head block, key split) over the GPU,
    each program an online softmax over its share of the keys on the tensor cores: ``q.k`` from
    bf16 operands into fp32 (exact products), the probabilities rounded to bf16 for ``p @ v``
    (relative error <= 2^-9 per term, as in FlashAttention), softmax statistics in fp32.
    Launch 2 merges the fp32 partials and the sink and applies the inverse RoPE; where one split
    holds all of a token's keys (many tokens: the programs fill the GPU without splitting keys)
    launch 1 does that itself and there is no launch 2.

RoPE acts on interleaved pairs ``(x[2i], x[2i+1])``; ``cos_table``/``sin_table`` are fp32
``[L, rd/2]`` rows per position (``reference.rope_tables``). Both functions equal their
``fp8chain_kernel.reference`` namesakes up to that rounding (``rope_qkv`` within one bf16 ulp).
Decode and prefill alike: each token reads only its own slot's keys up to its own position,
straight from the cache. The tables need a row per cache position (``L`` rows at least), and
the cache at least one position (``L >= 1``, else ``ValueError``).
What a launch writes (``out``, the cache in ``rope_qkv``) shares no memory with what it reads.

Index contract: ``0 <= slots[t] < S`` and ``0 <= positions[t] < L``, and no two tokens of one
``rope_qkv`` call at the same (slot, position). Raising for a value would take a device-to-host
copy per call, which CUDA-graph capture forbids, so the kernels check on the GPU instead: a token
whose slot or position is out of range reads and writes no cache row and gets NaN in every
column of its output (``rope_qkv``'s query rows, ``mqa_attention``'s ``o``), so it shows
downstream; the other tokens are unaffected. Two tokens at one row race for it (not detected).
The references raise ``IndexError`` for either when run eagerly (``reference.check_cache_indices``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import check_distinct_elements, check_no_overlap, is_int
from .fp8_tile import dot_bf16, interpreting, rms_rstd, round_bf16
from .launch import H200_SMS, await_producer, pdl_options, sm_count
from .norm import check_eps, check_finite

__all__ = ["INDEX_DTYPES", "rope_qkv", "mqa_attention", "key_splits"]

_BLOCK_H = 16  # query heads per program (tl.dot needs >= 16 rows)
# rope_qkv: query heads per program and warps. From an H200 sweep of 1-16 heads on 1-8 warps (64
# heads x 512, docs/benchmarks.md, attention): 4 heads on 4 warps took 1.73 / 1.75 / 1.96 / 3.34 us
# at T = 1 / 4 / 16 / 64, within 0.15 us of the best shape at T <= 16, against 2.82 / 2.90 / 3.15 /
# 5.46 with 16 heads on 8 warps; its outputs were bitwise those of the 16-head launch.
_ROPE_HEADS = 4
_ROPE_WARPS = 4
_BLOCK_L = 64  # keys per step
# The split kernel's (heads per program, keys per step) by work. Compiled for sm_90 at D = 512
# with 8 warps: 16 x 64 runs mma.sync in 80 registers, 32 x 64 in 133, 64 x 64 wgmma in 255 at
# two pipeline stages (three stages of 64 keys would need 256 KB of shared memory). On the H200
# (docs/benchmarks.md, attention) 16 x 64 is fastest below 1024 (token, head) rows, 32 x 64 from
# there, and 64 x 64 (each token's keys read once for all 64 heads, on wgmma) from 64K (token,
# key) pairs: 64 heads, M = 64, context 1024: 68.7 vs 83.2 us; context 4096: 172 vs 231 us; M = 16,
# context 4096: 57.1 vs 62.6 us (M = 16, context 1024: 25.8 vs 24.6; M = 32, context 1024: a tie).
# With one split (M > 264 tokens, prefill) its epilogue (sink, normalisation, inverse RoPE of a
# 64 x 512 fp32 accumulator in the split kernel) spills about 600 bytes of registers on sm_90 and is
# still faster: M = 300 / 512: 381 / 537 vs 406 / 642 us, a 2048-token prefill 1860 vs 2400 us.
# ``tile=`` overrides.
_WIDE_TILE = (64, 64)
_WIDE_TILE_PAIRS = 1 << 16  # (token, key) pairs from which the wide tile pays
# Below those pairs 64 heads still take the wide tile where the 32 x 64 tile's split programs (two
# head blocks a token, at least two key splits) would not fit in one wave of one program per SM:
# from 34 tokens on 132 SMs, where the 32 x 64 launch runs a second, mostly empty wave. Measured
# on an H100 (docs/benchmarks.md, attention, ffa8c04), 64 heads, M = 40 / 48 / 56: context 512
# 40.9 / 46.0 / 49.4 against 49.6 / 52.8 / 55.8 us, context 1024 56.1 / 64.7 / 68.1 against
# 74.5 / 77.4 / 80.8 (and M = 96, context 512: 83.7 against 88.9); M = 24 / 32 keep 32 x 64.
_ROWS_TILES = ((1024, (32, 64)), (0, (_BLOCK_H, _BLOCK_L)))  # (least token x head rows, tile)
_SMEM_BYTES = 227 << 10  # an H200 program's shared memory
# columns per merge program: 16 at every batch. From H200 sweeps of 16-256 columns, 16-64 heads
# and 2-8 warps per program (docs/benchmarks.md, attention): 16 columns of 16 heads beat the 64
# columns taken before from 132 (token, head block)s on (64 heads, M = 64: 17.3 against 19.5 us;
# M = 256: 64.6 against 71.8). Its warps by key splits (``_MERGE_WARPS``): 16 partials per thread
# where the tile holds 4 or more splits (16 splits on 8 warps: 64 heads, M = 1: 2.76 against 3.04
# us on 4; 4 splits on 2: M = 16, 6.16 against 6.97), 4 warps for 2 splits (M = 64: 17.3 against
# 17.6 on 2).
_MERGE_COLUMNS = 16
_MERGE_ELEMS = 8192  # at most this many partial elements per merge program: 64 registers at 4 warps
# most key splits the merge takes: a merge program holds at least one column pair (the inverse RoPE)
_MERGE_MAX_SPLITS = _MERGE_ELEMS // (_BLOCK_H * 2)
_MERGE_WARPS = {2: 4, 4: 2, 8: 4, 16: 8}  # by key splits rounded up to a power of two; else 4
# Key splits per (token, head block), from an H200 sweep (`fp8chain bench attention --splits`,
# docs/benchmarks.md): as many as one wave of split programs holds (one per SM: 150-168 KB of
# shared memory each), at least 2 while the unsplit programs fit in two waves, at most
# _MAX_SPLITS and one per step of keys. Programs past one wave cost more than their shorter
# splits gain (64 heads, M = 16, context 1024: 4 splits 26.5 us, 8 splits 32.9 us); below two
# waves a second split still pays (M = 64: 2 splits 85.1 us, 1 split 99.7 us); a one-step split
# pays where it fills the wave (16 heads, M = 1, context 1024: 16 splits 9.8 us, 8 splits 11.7 us).
_MAX_SPLITS = 16


@triton.jit
def _rotate_pairs(even, odd, cos, sin, INVERSE: tl.constexpr):
    """(x[2i], x[2i+1]) rotated by +angle (or -angle): returns the new (even, odd)."""
    if INVERSE:
        return even * cos + odd * sin, odd * cos - even * sin
    else:
        return even * cos - odd * sin, even * sin + odd * cos


@triton.jit
def _cache_row_in_range(slot, pos, S, L):
    """Whether ``(slot, pos)`` names a row of an ``[S, L, D]`` cache (the module's index contract)."""
    return (slot >= 0) & (slot < S) & (pos >= 0) & (pos < L)


@triton.jit
def _latent(src, w_ptr, offs, mask, rstd, KV_NORM: tl.constexpr, EXACT_CAST: tl.constexpr):
    """Latent columns ``offs`` in fp32: as stored, or ``bf16(h * rstd * w)`` (``norm.rms_norm``'s
    arithmetic, so the fused norm rounds exactly as a separate RMSNorm launch would)."""
    h = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    if KV_NORM:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = round_bf16(h * rstd * w, EXACT_CAST).to(tl.float32)
    return h


@triton.jit
def _rope_qkv_kernel(q_ptr, kv_ptr, kv_w_ptr, cos_ptr, sin_ptr, out_ptr, cache_ptr, slot_ptr, pos_ptr,
                     NH, D, S, L, eps, stride_qt, stride_kvt, stride_ot, stride_oh, stride_cs, stride_cl,
                     KV_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, EXACT_CAST: tl.constexpr, PDL: tl.constexpr):
    # Programs (t, 0..heads/BLOCK_H-1) rope the query heads; program (t, last) the latent kv.
    await_producer(PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    in_range = _cache_row_in_range(slot, pos, S, L)
    pos = tl.where(in_range, pos, 0)  # the tables' row (the output is NaN out of range)
    offs_d = tl.arange(0, BLOCK_D)
    offs_i = tl.arange(0, BLOCK_HALF)
    i_ok = offs_i < HALF
    cos = tl.load(cos_ptr + pos * HALF + offs_i, mask=i_ok, other=1.0)
    sin = tl.load(sin_ptr + pos * HALF + offs_i, mask=i_ok, other=0.0)
    nope = D - 2 * HALF
    even_d = nope + 2 * offs_i
    if hb < tl.num_programs(1) - 1:
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs_h < NH
        row = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * D
        q = tl.load(row + offs_d[None, :], mask=h_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        rstd = tl.where(in_range, rms_rstd(tl.sum(q * q, axis=1), D, eps), float("nan"))
        pair_mask = h_ok[:, None] & i_ok[None, :]
        q_even = tl.load(row + even_d[None, :], mask=pair_mask, other=0.0).to(tl.float32) * rstd[:, None]
        q_odd = tl.load(row + even_d[None, :] + 1, mask=pair_mask, other=0.0).to(tl.float32) * rstd[:, None]
        q_even, q_odd = _rotate_pairs(q_even, q_odd, cos[None, :], sin[None, :], False)
        out = out_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
        tl.store(out + offs_d[None, :], round_bf16(q * rstd[:, None], EXACT_CAST),
                 mask=h_ok[:, None] & (offs_d[None, :] < nope))
        tl.store(out + even_d[None, :], round_bf16(q_even, EXACT_CAST), mask=pair_mask)
        tl.store(out + even_d[None, :] + 1, round_bf16(q_odd, EXACT_CAST), mask=pair_mask)
    else:
        src = kv_ptr + t.to(tl.int64) * stride_kvt
        dst = cache_ptr + tl.where(in_range, slot, 0) * stride_cs + pos * stride_cl
        kv_rstd = 0.0
        if KV_NORM:
            h = tl.load(src + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
            kv_rstd = rms_rstd(tl.sum(h * h, axis=0), D, eps)
        kv = _latent(src, kv_w_ptr, offs_d, offs_d < nope, kv_rstd, KV_NORM, EXACT_CAST)
        tl.store(dst + offs_d, kv.to(tl.bfloat16), mask=(offs_d < nope) & in_range)
        kv_even = _latent(src, kv_w_ptr, even_d, i_ok, kv_rstd, KV_NORM, EXACT_CAST)
        kv_odd = _latent(src, kv_w_ptr, even_d + 1, i_ok, kv_rstd, KV_NORM, EXACT_CAST)
        kv_even, kv_odd = _rotate_pairs(kv_even, kv_odd, cos, sin, False)
        tl.store(dst + even_d, round_bf16(kv_even, EXACT_CAST), mask=i_ok & in_range)
        tl.store(dst + even_d + 1, round_bf16(kv_odd, EXACT_CAST), mask=i_ok & in_range)


@triton.jit
def _store_rotated_back(o_rows, tile, first_col, denom, h_ok, cos_ptr, sin_ptr, pos, D, HALF: tl.constexpr,
                        EXACT_CAST: tl.constexpr):
    """Output columns ``first_col ..`` of a head tile (fp32 ``[heads, columns]``, columns even): the
    column pairs ``(2i, 2i+1)`` divided by the heads' softmax denominators, the RoPE'd tail pairs
    rotated back (the others by angle 0: cos 1, sin 0), stored bf16 at ``o_rows`` (``[heads, 1]``
    pointers to column 0)."""
    even, odd = tl.split(tl.reshape(tile, (tile.shape[0], tile.shape[1] // 2, 2)))
    even_d = first_col + 2 * tl.arange(0, tile.shape[1] // 2)
    out = o_rows + even_d[None, :]
    mask = h_ok[:, None] & (even_d < D)[None, :]
    pair = (even_d - (D - 2 * HALF)) // 2  # RoPE pair index, negative outside the tail
    rope = (pair >= 0) & (even_d < D)
    cos = tl.load(cos_ptr + pos * HALF + pair, mask=rope, other=1.0)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + pair, mask=rope, other=0.0)[None, :]
    even, odd = _rotate_pairs(even / denom[:, None], odd / denom[:, None], cos, sin, True)
    tl.store(out, round_bf16(even, EXACT_CAST), mask=mask)
    tl.store(out + 1, round_bf16(odd, EXACT_CAST), mask=mask)


@triton.jit
def _attend_block(q, kv_ptr, slot, first, last, L, m_i, l_i, acc, scale, stride_kl, offs_d, d_ok,
                  BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, EXACT_CAST: tl.constexpr):
    """One online-softmax step over keys ``first .. first + BLOCK_L - 1`` (those <= ``last``)."""
    offs_l = first + tl.arange(0, BLOCK_L)
    l_ok = (offs_l <= last) & (offs_l < L)
    k = tl.load(kv_ptr + slot + offs_l[:, None].to(tl.int64) * stride_kl + offs_d[None, :],
                mask=l_ok[:, None] & d_ok[None, :], other=0.0)
    s = dot_bf16(q, tl.trans(k), tl.zeros((BLOCK_H, BLOCK_L), tl.float32), EXACT_CAST) * scale
    s = tl.where(l_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # rows with no valid key yet keep m = -inf: use 0 as the shift so exp() stays 0, not NaN
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - shift[:, None])
    alpha = tl.exp(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = dot_bf16(round_bf16(p, EXACT_CAST), k, acc * alpha[:, None], EXACT_CAST)
    return m_new, l_i, acc


@triton.jit
def _mqa_split_kernel(q_ptr, kv_ptr, slot_ptr, pos_ptr, part_o_ptr, part_ml_ptr,
                      sink_ptr, cos_ptr, sin_ptr, o_ptr, NH, D, S, L, scale,
                      stride_qt, stride_qh, stride_ks, stride_kl, stride_ot, stride_oh,
                      SPLITS: tl.constexpr, STEPS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, EXACT_CAST: tl.constexpr,
                      PDL: tl.constexpr):
    # With SPLITS == 1 the program holds all of its token's keys and writes the final output itself
    # (sink, normalisation, inverse RoPE: the merge's arithmetic); otherwise fp32 partials.
    await_producer(PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < NH
    d_ok = offs_d < D
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    last = tl.load(pos_ptr + t)
    # out of range: no key read, the output NaN below (last < 0 marks it: no register more is kept
    # live through the key loop, where the wide tile has none to spare on sm_90)
    last = tl.where(_cache_row_in_range(slot, last, S, L), last, -1)
    slot = slot * stride_ks
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    start = split * (STEPS * BLOCK_L)
    # only keys 0..last: a causal prefill split past its token's position does no work
    end = tl.minimum(tl.minimum(last + 1, L), start + STEPS * BLOCK_L)
    if EXACT_CAST:  # the interpreter needs constant trip counts
        for step in range(STEPS):
            if start + step * BLOCK_L < end:
                m_i, l_i, acc = _attend_block(q, kv_ptr, slot, start + step * BLOCK_L, last, L, m_i, l_i, acc,
                                              scale, stride_kl, offs_d, d_ok, BLOCK_H, BLOCK_L, EXACT_CAST)
    else:
        for first in range(start, end, BLOCK_L):
            m_i, l_i, acc = _attend_block(q, kv_ptr, slot, first, last, L, m_i, l_i, acc,
                                          scale, stride_kl, offs_d, d_ok, BLOCK_H, BLOCK_L, EXACT_CAST)
    if SPLITS == 1:
        sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
        peak = tl.maximum(sink, m_i)
        weight = tl.exp(m_i - peak)
        denom = tl.where(last >= 0, tl.exp(sink - peak) + l_i * weight, float("nan"))
        o_rows = o_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
        _store_rotated_back(o_rows, acc * weight[:, None], 0, denom, h_ok, cos_ptr, sin_ptr,
                            tl.maximum(last, 0).to(tl.int64), D, HALF, EXACT_CAST)
    else:
        base = (t * SPLITS + split).to(tl.int64) * NH
        tl.store(part_o_ptr + (base + offs_h[:, None]) * D + offs_d[None, :], acc,
                 mask=h_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + (base + offs_h) * 2, m_i, mask=h_ok)
        # a NaN sum makes the merge's denominator, so the token's output, NaN
        tl.store(part_ml_ptr + (base + offs_h) * 2 + 1, tl.where(last >= 0, l_i, float("nan")), mask=h_ok)


@triton.jit
def _mqa_merge_kernel(part_o_ptr, part_ml_ptr, sink_ptr, cos_ptr, sin_ptr, pos_ptr, o_ptr, NH, D, L,
                      stride_ot, stride_oh, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HALF: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, EXACT_CAST: tl.constexpr,
                      PDL: tl.constexpr):
    # Program (t, head block, column chunk): BLOCK_C columns of BLOCK_H heads. Every split's
    # softmax state and partial is loaded at once ([SPLITS_P2, BLOCK_H(, BLOCK_C)] tiles, one
    # round trip each) and reduced over the splits in registers.
    await_producer(PDL)
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_s = tl.arange(0, SPLITS_P2)
    h_ok = offs_h < NH
    rows = (t * SPLITS).to(tl.int64) * NH + offs_s[:, None] * NH + offs_h[None, :]  # [SPLITS_P2, BLOCK_H]
    row_ok = (offs_s < SPLITS)[:, None] & h_ok[None, :]
    m_s = tl.load(part_ml_ptr + rows * 2, mask=row_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + rows * 2 + 1, mask=row_ok, other=0.0)
    part = tl.load(part_o_ptr + rows[:, :, None] * D + cols[None, None, :],
                   mask=row_ok[:, :, None] & (cols < D)[None, None, :], other=0.0)
    sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
    peak = tl.maximum(sink, tl.max(m_s, axis=0))
    weight = tl.exp(m_s - peak[None, :])  # 0 for a split that saw no key (m_s = -inf)
    denom = tl.exp(sink - peak) + tl.sum(l_s * weight, axis=0)
    total = tl.sum(part * weight[:, :, None], axis=0)
    o_rows = o_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
    pos = tl.load(pos_ptr + t).to(tl.int64)
    # an out-of-range token's denominator is NaN (the split kernel): any table row will do
    pos = tl.where((pos >= 0) & (pos < L), pos, 0)
    _store_rotated_back(o_rows, total, tl.program_id(2) * BLOCK_C, denom, h_ok, cos_ptr, sin_ptr, pos, D, HALF,
                        EXACT_CAST)


def _splits(tokens: int, heads: int, block_h: int, key_steps: int, sms: int) -> int:
    """Key splits per (token, head block) for a tile of ``block_h`` heads on a GPU of ``sms`` SMs
    (see ``_MAX_SPLITS``)."""
    programs = tokens * triton.cdiv(heads, block_h)  # per split
    if programs > 2 * sms:
        return 1
    most = max(1, min(_MAX_SPLITS, key_steps))
    return min(most, max(2, sms // programs))


def _split_tile(tile: tuple[int, int] | None, tokens: int, heads: int, length: int, sms: int) -> tuple[int, int]:
    """``tile`` checked, or the default for ``tokens`` x ``heads`` query rows over ``length`` keys
    on a GPU of ``sms`` SMs (``_WIDE_TILE``, ``_ROWS_TILES``)."""
    if tile is None:
        wide = heads >= _WIDE_TILE[0]
        if wide and tokens * length >= _WIDE_TILE_PAIRS:
            return _WIDE_TILE
        # never more heads per program than there are heads: the rest would be masked
        block_h, block_l = next(t for least, t in _ROWS_TILES
                                if tokens * heads >= least and t[0] <= max(heads, _BLOCK_H))
        programs = tokens * triton.cdiv(heads, block_h)
        if wide and programs * _splits(tokens, heads, block_h, triton.cdiv(length, block_l), sms) > sms:
            return _WIDE_TILE  # the narrower tile would need a second wave (see _WIDE_TILE_PAIRS)
        return block_h, block_l
    block_h, block_l = tile
    if any(v < 16 or v & (v - 1) for v in (block_h, block_l)):
        raise ValueError(f"tile must be two powers of two >= 16, got {tile}")
    return block_h, block_l


def _pipeline_stages(block_h: int, block_l: int, block_d: int) -> int:
    """Key tiles the split kernel keeps in flight: three where they fit beside the query tile in
    shared memory (bf16), else two (64 x 64 at D = 512)."""
    return 3 if (3 * block_l + block_h) * block_d * 2 <= _SMEM_BYTES else 2


def key_splits(tokens: int, heads: int, length: int, tile: tuple[int, int] | None = None,
               device: torch.device | None = None) -> int:
    """How many split-kernel programs share one token's keys for a cache of ``length`` positions
    (1: the split kernel writes the output itself, no merge launch) on ``device`` (None: an H200)."""
    if not all(is_int(v) and v >= 1 for v in (tokens, heads, length)):
        raise ValueError(f"tokens, heads and length must be positive ints, got {(tokens, heads, length)}")
    sms = H200_SMS if device is None else sm_count(device, interpreter=H200_SMS)
    block_h, block_l = _split_tile(tile, tokens, heads, length, sms)
    return _splits(tokens, heads, block_h, triton.cdiv(length, block_l), sms)


def _check_tables(cos_table: torch.Tensor, sin_table: torch.Tensor, dim: int, length: int, device) -> int:
    """fp32 contiguous ``[>= length, rd/2]`` tables with ``rd <= dim``; returns ``rd/2``."""
    for name, table in (("cos_table", cos_table), ("sin_table", sin_table)):
        if table.dtype != torch.float32 or table.dim() != 2 or not table.is_contiguous():
            raise TypeError(f"{name} must be a contiguous float32 [L, rd/2] tensor, got {table.dtype} "
                            f"{tuple(table.shape)}")
        if table.device != device:
            raise ValueError(f"{name} is on {table.device}, the activations on {device}")
    if cos_table.shape != sin_table.shape or 2 * cos_table.shape[1] > dim:
        raise ValueError(f"cos/sin tables {tuple(cos_table.shape)}/{tuple(sin_table.shape)} do not fit head dim {dim}")
    if cos_table.shape[0] < length:
        raise ValueError(f"cos/sin tables have {cos_table.shape[0]} rows, the cache {length} positions: "
                         f"a row per position is needed")
    return cos_table.shape[1]


def _check_device(device, **tensors) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}")


#: The integer types the kernels read token indices (slots, positions) in.
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_index(idx: torch.Tensor, name: str, tokens: int) -> None:
    if idx.dtype not in INDEX_DTYPES or tuple(idx.shape) != (tokens,):
        raise TypeError(f"{name} must be an int32/int64 [{tokens}] tensor, got {idx.dtype} {tuple(idx.shape)}")
    if tokens > 1 and idx.stride(0) != 1:  # the kernels read token t at idx_ptr + t
        raise ValueError(f"{name} must be contiguous, got stride {idx.stride(0)}")


def _check_cache(kv_cache: torch.Tensor, dim: int, tokens: int) -> None:
    if kv_cache.dtype != torch.bfloat16 or kv_cache.dim() != 3 or kv_cache.shape[2] != dim:
        raise TypeError(f"kv_cache must be bfloat16 [S, L, {dim}], got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if kv_cache.shape[1] == 0 and tokens:  # an out-of-range token still reads table row 0
        raise ValueError("kv_cache has no positions (L = 0): no token can be written or attend")


def rope_qkv(q: torch.Tensor, kv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
             kv_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, eps: float, *,
             kv_weight: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring."""
    if kv.dtype != torch.bfloat16 or kv.dim() != 2 or (kv.numel() and kv.stride(1) != 1):
        raise TypeError(f"kv must be bfloat16 [T, D] with unit column stride, got {kv.dtype} {tuple(kv.shape)}")
    tokens, dim = kv.shape
    if q.dtype != torch.bfloat16 or q.dim() != 2 or q.shape[0] != tokens or q.shape[1] % max(dim, 1) \
            or (q.numel() and q.stride(1) != 1):
        raise TypeError(f"q must be bfloat16 [{tokens}, heads*{dim}] with unit column stride, got "
                        f"{q.dtype} {tuple(q.shape)}")
    if dim == 0 or q.shape[1] == 0:  # the launch that writes the kv cache runs beside the heads'
        raise ValueError(f"q and kv need columns: q {tuple(q.shape)}, kv {tuple(kv.shape)}")
    _check_cache(kv_cache, dim, tokens)
    _check_index(slots, "slots", tokens)
    _check_index(positions, "positions", tokens)
    check_eps(eps)
    _check_device(q.device, kv=kv, kv_cache=kv_cache, slots=slots, positions=positions)
    half = _check_tables(cos_table, sin_table, dim, kv_cache.shape[1], q.device)
    if kv_weight is not None and (kv_weight.dtype != torch.bfloat16 or tuple(kv_weight.shape) != (dim,)
                                  or not kv_weight.is_contiguous() or kv_weight.device != q.device):
        raise TypeError(f"kv_weight must be a contiguous bfloat16 [{dim}] tensor on {q.device}, got "
                        f"{kv_weight.dtype} {tuple(kv_weight.shape)} on {kv_weight.device}")
    # the cache is written while other programs read the token's inputs
    check_no_overlap([("kv_cache", kv_cache)], [("q", q), ("kv", kv), ("kv_weight", kv_weight), ("slots", slots),
                                                ("positions", positions), ("cos_table", cos_table),
                                                ("sin_table", sin_table)])
    heads = q.shape[1] // dim
    out = torch.empty((tokens, heads, dim), dtype=torch.bfloat16, device=q.device)
    if tokens == 0:
        return out
    _rope_qkv_kernel[(tokens, triton.cdiv(heads, _ROPE_HEADS) + 1)](
        q, kv, kv_weight if kv_weight is not None else kv, cos_table, sin_table, out, kv_cache, slots, positions,
        heads, dim, kv_cache.shape[0], kv_cache.shape[1], float(eps),
        q.stride(0), kv.stride(0), out.stride(0), out.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        KV_NORM=kv_weight is not None, HALF=half, BLOCK_H=_ROPE_HEADS, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_HALF=triton.next_power_of_2(max(half, 1)), EXACT_CAST=interpreting(),
        num_warps=_ROPE_WARPS, **pdl_options(q.device),
    )
    return out


def mqa_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                  sink: torch.Tensor, scale: float, cos_table: torch.Tensor, sin_table: torch.Tensor, *,
                  out: torch.Tensor | None = None, tile: tuple[int, int] | None = None,
                  splits: int | None = None) -> torch.Tensor:
    """See the module docstring for shapes, dtypes and numerics.

    ``tile``: (query heads per program, keys per step) of the split kernel, powers of two >= 16;
    ``splits``: programs sharing one token's keys, 1 .. key steps and at most 256 (benchmarks, tests; default: by
    tokens x heads, ``key_splits``). Both change the bits but not the bound: each split rounds its
    probabilities to bf16 against its own running maximum (relative error <= 2^-9 per term, the
    module docstring), and fp32 sums run in another order.
    """
    check_finite(scale, "scale")
    if q.dtype != torch.bfloat16 or q.dim() != 3 or (q.numel() and q.stride(2) != 1):
        raise TypeError(f"q must be bfloat16 [T, nh, D] with unit last stride, got {q.dtype} "
                        f"{tuple(q.shape)} strides {q.stride()}")
    tokens, heads, dim = q.shape
    _check_cache(kv_cache, dim, tokens)
    sms = sm_count(q.device, interpreter=H200_SMS)
    block_h, block_l = _split_tile(tile, tokens, heads, kv_cache.shape[1], sms)
    _check_index(slots, "slots", tokens)
    _check_index(positions, "positions", tokens)
    if sink.dtype != torch.float32 or tuple(sink.shape) != (heads,):
        raise TypeError(f"sink must be float32 [{heads}], got {sink.dtype} {tuple(sink.shape)}")
    if heads > 1 and sink.stride(0) != 1:  # read at sink_ptr + head
        raise ValueError(f"sink must be contiguous, got stride {sink.stride(0)}")
    _check_device(q.device, kv_cache=kv_cache, slots=slots, positions=positions, sink=sink)
    half = _check_tables(cos_table, sin_table, dim, kv_cache.shape[1], q.device)
    if dim % 2 or dim == 0:
        raise ValueError(f"head dim must be even (column pairs) and positive, got {dim}")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    else:
        if out.dtype != torch.bfloat16 or out.shape != q.shape:
            raise TypeError(f"out must be bfloat16 {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
        if out.numel() and out.stride(2) != 1:
            raise ValueError(f"out must have unit last stride, got strides {out.stride()}")
        check_distinct_elements(out, "out")
        _check_device(q.device, out=out)
        check_no_overlap([("out", out)], [("q", q), ("kv_cache", kv_cache), ("slots", slots), ("positions", positions),
                                          ("sink", sink), ("cos_table", cos_table), ("sin_table", sin_table)])
    if tokens == 0 or heads == 0:
        return out
    length = kv_cache.shape[1]
    head_blocks = triton.cdiv(heads, block_h)
    key_steps = triton.cdiv(length, block_l)
    if splits is None:
        splits = _splits(tokens, heads, block_h, key_steps, sms)
    elif not is_int(splits) or not 1 <= splits <= min(key_steps, _MERGE_MAX_SPLITS):
        raise ValueError(f"splits must be an int in 1..{min(key_steps, _MERGE_MAX_SPLITS)} (steps of {block_l} keys, "
                         f"at most {_MERGE_MAX_SPLITS} for the merge), got {splits!r}")
    steps = triton.cdiv(key_steps, splits)
    block_d = triton.next_power_of_2(dim)
    if splits == 1:  # the split kernel writes ``out`` itself: no partials, no merge launch
        part_o = part_ml = out
    else:
        part_o = torch.empty((tokens, splits, heads, dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((tokens, splits, heads, 2), dtype=torch.float32, device=q.device)
    warps = 8 if block_d >= 512 else 4  # 64 keys x 512 columns: 4 warps spill registers
    stages = {} if interpreting() else {"num_stages": _pipeline_stages(block_h, block_l, block_d)}
    _mqa_split_kernel[(tokens, head_blocks, splits)](
        q, kv_cache, slots, positions, part_o, part_ml, sink, cos_table, sin_table, out,
        heads, dim, kv_cache.shape[0], length, float(scale),
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), out.stride(0), out.stride(1),
        SPLITS=splits, STEPS=steps, HALF=half, BLOCK_H=block_h, BLOCK_L=block_l, BLOCK_D=block_d,
        EXACT_CAST=interpreting(), num_warps=warps, **stages, **pdl_options(q.device),
    )
    if splits == 1:
        return out
    merge_blocks = triton.cdiv(heads, _BLOCK_H)
    splits_p2 = triton.next_power_of_2(splits)
    columns = min(_MERGE_COLUMNS, _MERGE_ELEMS // (_BLOCK_H * splits_p2))
    _mqa_merge_kernel[(tokens, merge_blocks, triton.cdiv(dim, columns))](
        part_o, part_ml, sink, cos_table, sin_table, positions, out, heads, dim, length, out.stride(0), out.stride(1),
        SPLITS=splits, SPLITS_P2=splits_p2, HALF=half, BLOCK_H=_BLOCK_H, BLOCK_C=columns,
        EXACT_CAST=interpreting(), num_warps=_MERGE_WARPS.get(splits_p2, 4), **pdl_options(q.device),
    )
    return out
