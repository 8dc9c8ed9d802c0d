"""mHC (manifold-constrained hyper-connections) kernels, DSv4.1 shifted ordering (equations: ``reference.mhc``).

* ``mhc_stats``: per-token mixes ``(pre, post, comb)`` from the residual entering a sublayer.
  Two launches: a split-K GEMV (``flatten(R) @ fn^T`` and the sum of squares, the 4H reduction
  spread over many programs even for one token) writing fp32 partials, then a finishing kernel
  that sums them in a fixed order (deterministic), applies the sigmoids, the softmax and the
  Sinkhorn normalisations.
* ``mhc_post``: ``R'[o] = bf16(post[o]*y + sum_i comb[i][o]*R[i])``.
* ``mhc_combine_norm``: ``x = bf16(RMSNorm(bf16(sum_k pre[k]*R[k])))`` (+ the FP8 pair of x); a
  row whose sum of squares overflows fp32 gives NaN (``_rms_scale``), not zeros.
* ``mhc_mega_boundary``: post of the finished sublayer + combine with the carried ``pre`` +
  RMSNorm of the next sublayer (+ the FP8 pair of x), one launch.

All three boundary entry points run one kernel. A program owns ``BM`` rows and one slice of
``SLICE`` columns (a multiple of 128, so FP8 groups never straddle programs): it writes its slice
of ``R'`` and computes its slice of ``v = bf16(sum_k pre[k]*R'[k])``, so a decode batch of a few
tokens still spreads over ~2 programs per SM, in one launch. When the RMSNorm is needed and a row
is split over programs, the row is finished in one of two ways:

* the row barrier (``ROW_BARRIER``; decode, compiled, the grid at most one program per SM, and no
  ``row_barrier_off_reason``): each program stores its slice's sum of squares, arrives on the
  counter of its (row, slice count) and waits until every program of the row has arrived, then
  adds the slices' sums in slice order and writes ``x`` and its FP8 data and scales for its own
  slice (a power-of-two multiple of 128 columns, held in registers);
* otherwise each stores its slice of ``v`` (bf16, exact) and its sum of squares, then bumps the
  row block's arrival counter (``launch.arrival_counters``); the last program to arrive adds the
  slices' sums in slice order (the same bits whatever the arrival order) and writes ``x`` and its
  pair for the whole row as one tile.

A program that owns whole rows (large ``T``) normalizes them itself, recombining ``v`` from the
``R'`` it has just written.
Boundary launches share their counters and barrier workspace per device, so two must not run
concurrently on two streams of one device (the stats, on the side stream, use none).
Programs write their slices while others still read theirs, so the outputs must not overlap
the inputs (checked).

Batch invariance: ``R'`` of a token is the same for any ``T``. ``x`` and its pair can differ in
the last bit between batch sizes that split rows differently (the sum of squares is then added in
another order); for a given ``T`` they are deterministic. The stats GEMV's split count follows
``T`` too, so a token's mixes can differ in the last fp32 bits between batch sizes.

Numerics of the boundary kernels follow ``reference.mhc`` operation for operation: sums left to
right in fp32, compiled without fused multiply-add (``enable_fp_fusion=False``), so ``R'`` and
``v`` equal the torch reference bit for bit, and the FP8 pair equals ``reference.quantize`` of the
kernel's own bf16 ``x`` bit for bit (``fp8_tile.quantize_tile``). The stats are held to the fp64
reference within 1e-5 instead (their launches may fuse multiply-adds).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .formats import (ActFormat, QuantizedActivation, cdiv, check_disjoint, check_distinct_elements, check_no_overlap,
                      is_int)
from .fp8_tile import add_rn, format_constexprs, fp8_offsets, interpreting, round_bf16, store_pair_tile
from .launch import (ARRIVAL_SLOTS, H200_SMS, arrival_counters, arrive_last, await_arrivals, await_producer,
                     SWEPT_RELEASE, compiled_for_gpu, pdl_options, rearm, sm_count, triton_release,
                     zeroed_workspace)
from .norm import check_eps, check_rows, produced
from .quant import prepare_out

__all__ = ["HC", "mhc_stats", "mhc_post", "mhc_combine_norm", "mhc_mega_boundary", "row_barrier_off_reason"]

HC = 4                      # hyper-connection streams
NMIX = HC * (2 + HC)        # 24 mix values per token: pre 4, post 4, comb 16
HC_STREAMS: tl.constexpr = tl.constexpr(HC)


# ----------------------------------------------------------------------------- stats kernels


@triton.jit
def _rms_scale(sum_sq, H, eps, BM: tl.constexpr):
    """``1 / sqrt(sum_sq / H + eps)`` per row as a ``[BM, 1]`` column (correctly rounded steps),
    NaN where the sum of squares overflows fp32 (the scale would be 0: a finite row normed to
    zeros, or a token's mixes those of the bases alone, silently wrong)."""
    mean = tl.math.div_rn(sum_sq, tl.zeros((BM,), tl.float32) + H)
    scale = tl.math.div_rn(tl.full((BM,), 1.0, tl.float32), tl.sqrt_rn(mean + eps))
    return tl.where(sum_sq < float("inf"), scale, float("nan"))[:, None]


@triton.jit
def _stats_partial_kernel(r_ptr, fn_ptr, part_ptr, T, H, stride_rt, stride_rs, stride_fn,
                          CHUNKS_PER_SPLIT: tl.constexpr, NMIX: tl.constexpr, NP: tl.constexpr,
                          BT: tl.constexpr, BK: tl.constexpr, UPCAST_DOT: tl.constexpr, PDL: tl.constexpr):
    """Partial ``flatten(R) @ fn^T`` and ``sum(X^2)`` over one range of 4H for BT tokens: one
    row of ``NP`` fp32 per (split, token), the 24 mix columns then the sum of squares.

    ``X`` is bf16, so with ``fn = hi + mid + lo`` split exactly into three bf16 parts the three
    bf16 dots (fp32 accumulate) give the fp32 product on the tensor cores. ``UPCAST_DOT`` (the
    CPU interpreter, whose dot does not read bf16) runs the same three dots on the parts upcast
    to fp32: every product is exact either way."""
    await_producer(PDL)
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    t_ok = offs_t < T
    rows = offs_t.to(tl.int64)
    offs_n = tl.arange(0, NP)
    n_ok = offs_n < NMIX
    h_chunks = tl.cdiv(H, BK)
    c_begin = pid_s * CHUNKS_PER_SPLIT
    num_chunks = HC_STREAMS * h_chunks
    acc = tl.zeros((BT, NP), dtype=tl.float32)
    sq = tl.zeros((BT, BK), dtype=tl.float32)
    for i in range(0, CHUNKS_PER_SPLIT):  # constant trip counts (the interpreter needs them)
        c = c_begin + i
        stream = c // h_chunks
        offs_h = (c - stream * h_chunks) * BK + tl.arange(0, BK)
        h_ok = (offs_h < H) & (c < num_chunks)
        x = tl.load(r_ptr + rows[:, None] * stride_rt + stream * stride_rs + offs_h[None, :],
                    mask=t_ok[:, None] & h_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        sq += xf * xf
        f = tl.load(fn_ptr + offs_n[None, :] * stride_fn + (stream * H + offs_h)[:, None],
                    mask=h_ok[:, None] & n_ok[None, :], other=0.0)
        f_hi = f.to(tl.bfloat16)
        rest = f - f_hi.to(tl.float32)
        f_mid = rest.to(tl.bfloat16)
        f_lo = (rest - f_mid.to(tl.float32)).to(tl.bfloat16)
        if UPCAST_DOT:
            acc = tl.dot(xf, f_lo.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(xf, f_mid.to(tl.float32), acc, input_precision="ieee")
            acc = tl.dot(xf, f_hi.to(tl.float32), acc, input_precision="ieee")
        else:
            xb = x.to(tl.bfloat16)
            acc = tl.dot(xb, f_lo, acc)
            acc = tl.dot(xb, f_mid, acc)
            acc = tl.dot(xb, f_hi, acc)
    acc = tl.where(offs_n[None, :] == NMIX, tl.sum(sq, axis=1)[:, None], acc)
    out = part_ptr + (pid_s * T + rows)[:, None] * NP + offs_n[None, :]
    tl.store(out, acc, mask=t_ok[:, None] & (offs_n <= NMIX)[None, :])


@triton.jit
def _split_sums(part_ptr, rows, t_ok, offs_s, NSPLIT: tl.constexpr, T, NMIX: tl.constexpr, NP: tl.constexpr):
    """The partials summed over the splits for BT tokens, read into the tiles that use them: the
    sum of squares ``[BT]``, pre / post ``[BT, 4, 4]`` (``[t, 0|1, k]``; rows 2 and 3 repeat post)
    and the comb mixes ``[BT, 4, 4]`` (``[t, i, j]``). One contiguous load per tile, fixed
    reduction trees: deterministic."""
    ok = t_ok[:, None] & (offs_s < NSPLIT)[None, :]
    split_rows = part_ptr + ((offs_s * T)[None, :] + rows[:, None]) * NP      # [BT, SP]
    sumsq = tl.sum(tl.load(split_rows + NMIX, mask=ok, other=0.0), axis=1)
    a4 = tl.arange(0, 4)
    pre_post = tl.minimum(a4, 1)[:, None] * 4 + a4[None, :]                    # [4, 4]
    comb = 8 + a4[:, None] * 4 + a4[None, :]
    ok4 = ok[:, :, None, None]
    rows4 = split_rows[:, :, None, None]
    mp = tl.sum(tl.load(rows4 + pre_post[None, None, :, :], mask=ok4, other=0.0), axis=1)
    mc = tl.sum(tl.load(rows4 + comb[None, None, :, :], mask=ok4, other=0.0), axis=1)
    return sumsq, mp, mc


@triton.jit
def _stats_finish_kernel(part_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
                         T, K, rms_eps, hc_eps, NSPLIT: tl.constexpr, SP: tl.constexpr,
                         SINKHORN_ITERS: tl.constexpr, NMIX: tl.constexpr, NP: tl.constexpr,
                         BT: tl.constexpr, PDL: tl.constexpr):
    """Sum the split partials, then the sigmoids, softmax and Sinkhorn normalisations for BT
    tokens.

    The split sums are read straight into the tiles that use them (``[BT, 4, 4]``: comb[i][j] at
    ``[t, i, j]``, pre and post as ``[t, 0|1, k]``) with one contiguous load per tile, so each
    Sinkhorn half step costs each lane one division and a four-lane sum: the divisions of a token
    run side by side rather than one after another. The softmax and Sinkhorn divisions are the
    fast ones (``div.full``, 2 ulp): 20 rounds of IEEE divisions measured 2.4 us of the kernel's
    6.8 at T = 1 on the H200, and the result stays within the reference's 1e-5."""
    await_producer(PDL)
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = offs_t < T
    rows = offs_t.to(tl.int64)
    offs_s = tl.arange(0, SP)
    a4 = tl.arange(0, 4)
    i3 = a4[None, :, None]                                               # [1, 4, 1]
    j3 = a4[None, None, :]                                               # [1, 1, 4]
    t3 = rows[:, None, None]
    ok3 = t_ok[:, None, None]
    sumsq, mp, m = _split_sums(part_ptr, rows, t_ok, offs_s, NSPLIT, T, NMIX, NP)
    r3 = _rms_scale(sumsq, K, rms_eps, BT)[:, :, None]  # NaN where the sum of squares overflows

    # pre (i = 0) and post (i = 1), one value per lane; rows 2 and 3 repeat post and are not stored.
    i_pp = tl.minimum(i3, 1)
    sp_ = tl.where(i3 == 0, tl.load(scale_ptr), tl.load(scale_ptr + 1))
    z = (mp * r3) * sp_ + tl.load(base_ptr + i_pp * 4 + j3)
    sig = tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + tl.exp(-z))
    k3 = t3 * 4 + (j3 + 0 * i3)                                           # [BT, 4, 4]
    tl.store(pre_ptr + k3, sig + hc_eps, mask=ok3 & (i3 == 0))
    tl.store(post_ptr + k3, 2.0 * sig, mask=ok3 & (i3 == 1))

    logits = (m * r3) * tl.load(scale_ptr + 2) + tl.load(base_ptr + 8 + i3 * 4 + j3)
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    c = tl.fdiv(e, tl.broadcast_to(tl.sum(e, axis=2)[:, :, None], e.shape)) + hc_eps
    c = tl.fdiv(c, tl.broadcast_to(tl.sum(c, axis=1)[:, None, :] + hc_eps, c.shape))
    for _ in range(SINKHORN_ITERS - 1):
        c = tl.fdiv(c, tl.broadcast_to(tl.sum(c, axis=2)[:, :, None] + hc_eps, c.shape))
        c = tl.fdiv(c, tl.broadcast_to(tl.sum(c, axis=1)[:, None, :] + hc_eps, c.shape))
    tl.store(comb_ptr + t3 * 16 + i3 * 4 + j3, c, mask=ok3)


# -------------------------------------------------------------------------- boundary kernel


@triton.jit
def _load_col(ptr, rows, m_ok, stride_t, offset):
    """One fp32 mix value per row, as a [BM, 1] column."""
    return tl.load(ptr + rows * stride_t + offset, mask=m_ok, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _post_stream(y, r0, r1, r2, r3, q, c0, c1, c2, c3, EXACT_CAST: tl.constexpr):
    """bf16-rounded (kept in fp32) ``post[o]*y + c0o*R0 + c1o*R1 + c2o*R2 + c3o*R3``, summed left
    to right (``add_rn``)."""
    acc = add_rn(q * y, c0 * r0, EXACT_CAST)
    acc = add_rn(acc, c1 * r1, EXACT_CAST)
    acc = add_rn(acc, c2 * r2, EXACT_CAST)
    acc = add_rn(acc, c3 * r3, EXACT_CAST)
    return round_bf16(acc, EXACT_CAST).to(tl.float32)


@triton.jit
def _load_streams(base, mask, stride_s, CACHE: tl.constexpr):
    """The four bf16 residual streams of a tile (``base`` points at stream 0), as fp32."""
    r0 = tl.load(base, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    r1 = tl.load(base + stride_s, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    r2 = tl.load(base + 2 * stride_s, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    r3 = tl.load(base + 3 * stride_s, mask=mask, other=0.0, cache_modifier=CACHE).to(tl.float32)
    return r0, r1, r2, r3


@triton.jit
def _combine(n0, n1, n2, n3, p0, p1, p2, p3, EXACT_CAST: tl.constexpr):
    """``v = bf16(pre0*n0 + pre1*n1 + pre2*n2 + pre3*n3)`` left to right (``add_rn``), kept in fp32."""
    v = add_rn(p0 * n0, p1 * n1, EXACT_CAST)
    v = add_rn(v, p2 * n2, EXACT_CAST)
    v = add_rn(v, p3 * n3, EXACT_CAST)
    return round_bf16(v, EXACT_CAST).to(tl.float32)


@triton.jit
def _store_x(v, rs, w, offs_h, group0, mask, rows, offs_m, T, H, x_ptr, q_ptr, s_ptr, stride_xt, stride_qt,
             stride_sm, stride_sg, STORE_X: tl.constexpr, QUANT: tl.constexpr, BM: tl.constexpr,
             BLOCK: tl.constexpr, GROUP: tl.constexpr, POW2: tl.constexpr, PACKED: tl.constexpr,
             EXACT_CAST: tl.constexpr):
    """``x = bf16(v * rs * w)`` of a ``[BM, BLOCK]`` tile whose first FP8 group is ``group0``, and
    its pair."""
    x = round_bf16((v * rs) * w, EXACT_CAST).to(tl.float32)
    if STORE_X:
        tl.store(x_ptr + fp8_offsets(rows[:, None], stride_xt, offs_h), x.to(tl.bfloat16), mask=mask)
    if QUANT:
        store_pair_tile(q_ptr + fp8_offsets(rows[:, None], stride_qt, offs_h), s_ptr, x, mask, offs_m, group0,
                        T, tl.cdiv(H, GROUP), stride_sm, stride_sg, BM, BLOCK, GROUP, POW2, PACKED, EXACT_CAST)


@triton.jit
def _boundary_kernel(
    y_ptr, r_ptr, pre_ptr, post_ptr, comb_ptr, w_ptr,
    rout_ptr, x_ptr, q_ptr, s_ptr, v_ptr, part_ptr, count_ptr,
    T, H, eps,
    stride_yt, stride_rt, stride_rs, stride_et, stride_ek, stride_pt, stride_pk,
    stride_ct, stride_ci, stride_cj, stride_ot, stride_os, stride_xt, stride_qt,
    stride_sm, stride_sg,
    DO_POST: tl.constexpr, DO_NORM: tl.constexpr, STORE_X: tl.constexpr, QUANT: tl.constexpr,
    SPLIT_ROW: tl.constexpr, ROW_BARRIER: tl.constexpr, SPLITS: tl.constexpr,
    BM: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr, ROW_BLOCK: tl.constexpr,
    ROW_CHUNKS: tl.constexpr,
    GROUP: tl.constexpr, POW2: tl.constexpr, PACKED: tl.constexpr, EXACT_CAST: tl.constexpr,
    PDL: tl.constexpr,
):
    await_producer(PDL)
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = offs_m < T
    rows = offs_m.to(tl.int64)
    h_begin = tl.program_id(1) * SLICE

    # The 24 mix values of each row, loaded once ([BM, 1] columns; unused ones are zero).
    zero = tl.zeros((BM, 1), dtype=tl.float32)
    p0 = zero
    p1 = zero
    p2 = zero
    p3 = zero
    if DO_NORM:
        p0 = _load_col(pre_ptr, rows, m_ok, stride_et, 0)
        p1 = _load_col(pre_ptr, rows, m_ok, stride_et, stride_ek)
        p2 = _load_col(pre_ptr, rows, m_ok, stride_et, 2 * stride_ek)
        p3 = _load_col(pre_ptr, rows, m_ok, stride_et, 3 * stride_ek)
    q0 = zero
    q1 = zero
    q2 = zero
    q3 = zero
    c00 = zero
    c01 = zero
    c02 = zero
    c03 = zero
    c10 = zero
    c11 = zero
    c12 = zero
    c13 = zero
    c20 = zero
    c21 = zero
    c22 = zero
    c23 = zero
    c30 = zero
    c31 = zero
    c32 = zero
    c33 = zero
    if DO_POST:
        q0 = _load_col(post_ptr, rows, m_ok, stride_pt, 0)
        q1 = _load_col(post_ptr, rows, m_ok, stride_pt, stride_pk)
        q2 = _load_col(post_ptr, rows, m_ok, stride_pt, 2 * stride_pk)
        q3 = _load_col(post_ptr, rows, m_ok, stride_pt, 3 * stride_pk)
        c00 = _load_col(comb_ptr, rows, m_ok, stride_ct, 0)
        c01 = _load_col(comb_ptr, rows, m_ok, stride_ct, stride_cj)
        c02 = _load_col(comb_ptr, rows, m_ok, stride_ct, 2 * stride_cj)
        c03 = _load_col(comb_ptr, rows, m_ok, stride_ct, 3 * stride_cj)
        c10 = _load_col(comb_ptr, rows, m_ok, stride_ct, stride_ci)
        c11 = _load_col(comb_ptr, rows, m_ok, stride_ct, stride_ci + stride_cj)
        c12 = _load_col(comb_ptr, rows, m_ok, stride_ct, stride_ci + 2 * stride_cj)
        c13 = _load_col(comb_ptr, rows, m_ok, stride_ct, stride_ci + 3 * stride_cj)
        c20 = _load_col(comb_ptr, rows, m_ok, stride_ct, 2 * stride_ci)
        c21 = _load_col(comb_ptr, rows, m_ok, stride_ct, 2 * stride_ci + stride_cj)
        c22 = _load_col(comb_ptr, rows, m_ok, stride_ct, 2 * stride_ci + 2 * stride_cj)
        c23 = _load_col(comb_ptr, rows, m_ok, stride_ct, 2 * stride_ci + 3 * stride_cj)
        c30 = _load_col(comb_ptr, rows, m_ok, stride_ct, 3 * stride_ci)
        c31 = _load_col(comb_ptr, rows, m_ok, stride_ct, 3 * stride_ci + stride_cj)
        c32 = _load_col(comb_ptr, rows, m_ok, stride_ct, 3 * stride_ci + 2 * stride_cj)
        c33 = _load_col(comb_ptr, rows, m_ok, stride_ct, 3 * stride_ci + 3 * stride_cj)

    # Phase 1: this program's slice: R' and the slice's sum of squares of v.
    sq = tl.zeros((BM, BLOCK), dtype=tl.float32)
    for i in tl.static_range(0, SLICE, BLOCK):
        offs_h = h_begin + i + tl.arange(0, BLOCK)
        mask = m_ok[:, None] & (offs_h[None, :] < H)
        n0, n1, n2, n3 = _load_streams(r_ptr + rows[:, None] * stride_rt + offs_h[None, :], mask, stride_rs, "")
        if DO_POST:
            y = tl.load(y_ptr + rows[:, None] * stride_yt + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
            m0 = _post_stream(y, n0, n1, n2, n3, q0, c00, c10, c20, c30, EXACT_CAST)
            m1 = _post_stream(y, n0, n1, n2, n3, q1, c01, c11, c21, c31, EXACT_CAST)
            m2 = _post_stream(y, n0, n1, n2, n3, q2, c02, c12, c22, c32, EXACT_CAST)
            m3 = _post_stream(y, n0, n1, n2, n3, q3, c03, c13, c23, c33, EXACT_CAST)
            n0, n1, n2, n3 = m0, m1, m2, m3
            out = rout_ptr + rows[:, None] * stride_ot + offs_h[None, :]
            tl.store(out, n0.to(tl.bfloat16), mask=mask)
            tl.store(out + stride_os, n1.to(tl.bfloat16), mask=mask)
            tl.store(out + 2 * stride_os, n2.to(tl.bfloat16), mask=mask)
            tl.store(out + 3 * stride_os, n3.to(tl.bfloat16), mask=mask)
        if DO_NORM:
            v = _combine(n0, n1, n2, n3, p0, p1, p2, p3, EXACT_CAST)
            sq += v * v
            if SPLIT_ROW and not ROW_BARRIER:
                tl.store(v_ptr + rows[:, None] * H + offs_h[None, :], v.to(tl.bfloat16), mask=mask)

    if DO_NORM:
        # Phase 2: x and its pair, in one of three forms (the module docstring).
        partial = tl.sum(sq, axis=1)
        if ROW_BARRIER:
            # Every program of the row stores its slice's sum, waits until all of the row's
            # programs have arrived on the counter of (row, slice count) (int64, never re-armed:
            # ``launch.await_arrivals``), and normalizes its own slice (one chunk: v and offs_h
            # are still those of the loop above), so no program quantizes the whole row alone.
            w = tl.load(w_ptr + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)[None, :]
            n_split = tl.num_programs(1)
            offs_s = tl.arange(0, SPLITS)
            row_sums = part_ptr + tl.program_id(0) * SPLITS
            tl.store(row_sums + tl.program_id(1) + tl.zeros((BM,), tl.int32), partial)
            await_arrivals(count_ptr, tl.program_id(0) * SPLITS + n_split, n_split)
            parts = tl.load(row_sums + offs_s[None, :], mask=offs_s[None, :] < n_split, other=0.0, cache_modifier=".cg")
            rs = _rms_scale(tl.sum(parts, axis=1), H, eps, BM)
            _store_x(v, rs, w, offs_h, h_begin // GROUP, mask, rows, offs_m, T, H, x_ptr, q_ptr, s_ptr,
                     stride_xt, stride_qt, stride_sm, stride_sg, STORE_X, QUANT, BM, BLOCK, GROUP,
                     POW2, PACKED, EXACT_CAST)
        elif SPLIT_ROW:
            # Each program has stored its slice's v (bf16, exact) and sum of squares; the last of
            # the row block to arrive (``launch.arrive_last``) sums the partials in slice order
            # (deterministic whatever the arrival order) and normalizes the whole row as one tile:
            # one round trip for v, w loaded before the atomic.
            offs_v = tl.arange(0, ROW_BLOCK)
            v_ok = offs_v < H
            w_row = tl.load(w_ptr + offs_v, mask=v_ok, other=0.0).to(tl.float32)[None, :]
            n_split = tl.num_programs(1)
            tl.store(part_ptr + rows * n_split + tl.program_id(1), partial, mask=m_ok)
            if arrive_last(count_ptr, tl.program_id(0), n_split):
                offs_s = tl.arange(0, SPLITS)
                parts = tl.load(part_ptr + rows[:, None] * n_split + offs_s[None, :],
                                mask=m_ok[:, None] & (offs_s[None, :] < n_split), other=0.0,
                                cache_modifier=".cg")
                row_mask = m_ok[:, None] & v_ok[None, :]
                v_row = tl.load(v_ptr + fp8_offsets(rows[:, None], H, offs_v), mask=row_mask, other=0.0,
                                cache_modifier=".cg").to(tl.float32)
                rs = _rms_scale(tl.sum(parts, axis=1), H, eps, BM)
                _store_x(v_row, rs, w_row, offs_v, 0, row_mask, rows, offs_m, T, H, x_ptr, q_ptr, s_ptr,
                         stride_xt, stride_qt, stride_sm, stride_sg, STORE_X, QUANT, BM, ROW_BLOCK, GROUP,
                         POW2, PACKED, EXACT_CAST)
                rearm(count_ptr, tl.program_id(0))
        else:  # a whole-row program recombines v from the streams it just wrote (R') or read (R)
            if DO_POST:
                src_ptr, stride_src_t, stride_src_s = rout_ptr, stride_ot, stride_os
            else:
                src_ptr, stride_src_t, stride_src_s = r_ptr, stride_rt, stride_rs
            rs = _rms_scale(partial, H, eps, BM)
            tl.debug_barrier()  # this program's own R' stores, read back by other threads
            for i in tl.static_range(ROW_CHUNKS):
                offs_h = i * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
                h_ok = offs_h < H
                mask = m_ok[:, None] & h_ok[None, :]
                n0, n1, n2, n3 = _load_streams(src_ptr + rows[:, None] * stride_src_t + offs_h[None, :], mask,
                                               stride_src_s, ".cg")
                w = tl.load(w_ptr + offs_h, mask=h_ok, other=0.0).to(tl.float32)[None, :]
                _store_x(_combine(n0, n1, n2, n3, p0, p1, p2, p3, EXACT_CAST), rs, w, offs_h,
                         i * (ROW_BLOCK // GROUP), mask, rows, offs_m, T, H, x_ptr, q_ptr, s_ptr, stride_xt,
                         stride_qt, stride_sm, stride_sg, STORE_X, QUANT, BM, ROW_BLOCK, GROUP, POW2, PACKED,
                         EXACT_CAST)


# ------------------------------------------------------------------------------ host side


def _target_programs(device: torch.device) -> int:
    """About two programs per SM on a GPU; a small count on the CPU interpreter."""
    return 2 * sm_count(device, interpreter=8)


def _max_rows_per_program(device: torch.device) -> int:
    """One row per program on a GPU; the interpreter's cost is per program, so it takes 64."""
    return 1 if compiled_for_gpu(device) else 64


def _boundary_config(rows: int, cols: int, device: torch.device, norm: bool = True) -> dict:
    """Grid, rows per program, columns per program (a multiple of 128), chunk sizes, warps, and
    whether a normalized row is split over programs (``SPLIT_ROW``: the row's last program to
    finish normalizes it as one ``[BM, ROW_BLOCK]`` tile)."""
    target = _target_programs(device)
    bm = min(_max_rows_per_program(device), triton.next_power_of_2(rows))
    row_blocks = cdiv(rows, bm)
    n128 = cdiv(cols, 128)
    splits = max(1, min(n128, cdiv(target, row_blocks)))
    whole_row = max(128, triton.next_power_of_2(cols))
    if norm and (row_blocks > ARRIVAL_SLOTS or bm * whole_row > 16384):
        splits = 1  # one arrival counter per row block; a whole-row tile must fit in registers
    slice_ = cdiv(n128, splits) * 128
    splits = cdiv(cols, slice_)
    block = 128
    while block < 1024 and slice_ % (2 * block) == 0:
        block *= 2
    split_row = norm and splits > 1
    barrier = _row_barrier_slice(rows, cols, bm, device) if split_row else None
    if barrier is not None:
        slice_ = block = barrier
        splits = cdiv(cols, slice_)
        # warps from an H200 sweep of 1 / 2 / 4 / 8 (H = 5120): 4 fastest up to 512-column slices,
        # 8 from 1024 (T = 16: 3.65 / 3.82 -> 3.41 / 3.52 us bf16-only / FP8); bytes equal for both
        return dict(grid=(row_blocks, splits), BM=bm, SLICE=slice_, BLOCK=block, ROW_BLOCK=block, ROW_CHUNKS=1,
                    SPLITS=_BARRIER_SPLITS, SPLIT_ROW=True, ROW_BARRIER=True, num_warps=4 if block <= 512 else 8)
    if split_row:
        row_block = whole_row
        # ~32 values of the last program's row tile per thread up to 64 rows, ~64 above: measured
        # faster on the H200 at H = 5120 (8 warps at T <= 64, 4 at T = 256).
        per_thread = 32 if rows <= 64 else 64
        warps = max(4, min(16, bm * row_block // (32 * per_thread)))
    else:
        row_block = max(128, min(1024, triton.next_power_of_2(cols)))
        if bm * row_block > 4096:
            row_block = max(128, 4096 // bm)
        warps = 4
    return dict(grid=(row_blocks, splits), BM=bm, SLICE=slice_, BLOCK=block, ROW_BLOCK=row_block,
                ROW_CHUNKS=cdiv(cols, row_block), SPLITS=triton.next_power_of_2(splits), SPLIT_ROW=split_row,
                ROW_BARRIER=False, num_warps=warps)


_BARRIER_SPLITS = 64  # slices per row in row-barrier mode, fewer: a row's counters and sums
_BARRIER_ROWS = 256   # row blocks in row-barrier mode, at most: the rows of its counters


def row_barrier_off_reason() -> str | None:
    """Why decode rows may not take the row barrier now, or None. Its programs wait for each other,
    so all of a row's programs must be resident at once; the grid is sized to one program per SM
    of the device, which holds when the process has the whole GPU. Off with
    ``FP8CHAIN_ROW_BARRIER=0`` (set it under MPS with an SM limit from the control daemon, or in a
    green context: fewer SMs than the device reports), and where this process's own
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` is below 100. Every row then takes the last-arrival
    form."""
    if os.environ.get("FP8CHAIN_ROW_BARRIER", "1") == "0":
        return "FP8CHAIN_ROW_BARRIER=0"
    mps = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if mps is not None:
        try:
            limited = float(mps) < 100.0
        except ValueError:
            limited = True
        if limited:
            return f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={mps}: an MPS client may have fewer SMs than the device"
    return None


def _row_barrier_slice(rows: int, cols: int, bm: int, device: torch.device) -> int | None:
    """The slice width of a row-barrier launch (``ROW_BARRIER``: every program of a row waits for
    the row's sums of squares and normalizes its own slice), or None. Only compiled (the
    interpreter runs programs one after another: a waiting program would never see the next
    one's sum), one row per program, and at most one program per SM, so that every program of a
    row runs at once: the narrowest power-of-two multiple of 128 that fits the grid."""
    if not (row_barrier_off_reason() is None and compiled_for_gpu(device) and bm == 1 and rows <= _BARRIER_ROWS):
        return None
    sms = sm_count(device, interpreter=H200_SMS)
    width = 128
    while width < cols:
        splits = cdiv(cols, width)
        if splits < _BARRIER_SPLITS and rows * splits <= sms:
            return width
        width *= 2
    return None


# Most 128-column chunks one split of the stats GEMV sums in its fp32 chain, which sets the stats'
# error against the fp64 reference (H200, H = 5120, T = 2: largest error 1.5e-6 with 32 splits of
# 5 chunks, 7e-6 with 5 splits of 32, 4e-5 with one split of all 160; T = 8448, 5 splits of 32:
# 2.2e-5, where two programs per SM alone would take 2 splits of 80). The tests hold the stats to
# 1e-5 up to 2048 tokens.
_MAX_CHUNKS_PER_SPLIT = 32

# Tokens per program of the stats partial-sum launch at decode (T <= 64): ``_stats_config``
# picks it, ``stats_partial_stages`` keys its launch options on it.
DECODE_STATS_TILE = 16


def _stats_config(rows: int, cols: int, device: torch.device,
                  max_splits: int | None = None) -> tuple[int, int, int, int]:
    """(BT, BK, chunks per split, splits) for the split-K GEMV over ``cols = 4H``: about two
    programs per SM over the token blocks, at most ``max_splits`` splits when given, and never
    more than ``_MAX_CHUNKS_PER_SPLIT`` chunks per split (whatever the cap or the token count).

    Decode batches (up to 64 rows) take 16-token tiles: such a program needs 99 registers per
    thread and 16 KB of shared memory on sm_90, so it fits on an SM beside two programs of the
    decode GEMM it overlaps on the main stream; a 32- or 64-token tile (up to 252 registers,
    88 KB) waits until the GEMM's programs leave. Measured on the H200 (docs/benchmarks.md), the
    chained layer step at T = 32 / 64: 196 -> 186 / 256 -> 249 us, though the stats alone take
    longer (10.5 -> 14.0 us at T = 64: each 16-token block re-reads fn)."""
    bk = 128
    bt = DECODE_STATS_TILE if rows <= 64 else 64
    chunks = HC * cdiv(cols // HC, bk)
    want = max(1, min(chunks, cdiv(_target_programs(device), cdiv(rows, bt))))
    if max_splits is not None:
        want = min(want, max_splits)
    want = max(want, cdiv(chunks, _MAX_CHUNKS_PER_SPLIT))  # long prefills would get 1-4 splits
    per_split = cdiv(chunks, want)
    return bt, bk, per_split, cdiv(chunks, per_split)


def stats_partial_stages(bt: int, triton_version: str = triton.__version__) -> dict:
    """Launch options of the stats partial-sum launch. Under Triton >= 3.7 decode's 16-token tiles
    load their chunks without a cp.async pipeline (``num_stages=1``): 3.8's pipelined program takes
    56 KB of shared memory at T = 64 (20 KB unpipelined) and the launch alone measured 7.4 -> 4.9 /
    10.0 -> 6.0 us at T = 32 / 64 (an H100). Under 3.6 every tile keeps Triton's default: unpipelined,
    the stats (both launches, H = 4096) measured no faster alone at T <= 32 and 0.9 us faster at
    T = 64, and in the layer step (the stats on the side stream) the chained step moved by at most
    0.5 us at TP1 and at T <= 16, was 0.5-1.1 us faster at TP4 T = 32 and 1-4 us slower at TP4
    T = 48 / 64 (docs/benchmarks.md, "Triton 3.8"). The prefill's 64-token tiles keep the default
    under both (one stage, the stats at T = 2048 under 3.6: 116 against 66 us). The same sums
    either way."""
    if bt == DECODE_STATS_TILE and triton_release(triton_version) > SWEPT_RELEASE:
        return {"num_stages": 1}
    return {}


def stats_finish_tokens(rows: int, split_tile: int, triton_version: str = triton.__version__) -> int:
    """Tokens per program of the stats finish launch. Under Triton <= 3.6, ``[BT, SP]`` split-sum
    tiles of at most 256 values (``split_tile`` = SP, the split count rounded up to a power of
    two). Triton 3.8 lays a several-token Sinkhorn tile out with each token's rows across lanes,
    so every column sum becomes lane shuffles: one token a program there, at every T
    (docs/benchmarks.md, "Triton 3.8": at T = 64 the finish launch 9.0 -> 5.0 us on an H100,
    at T = 2048 15.8 -> 12.6)."""
    if triton_release(triton_version) > SWEPT_RELEASE:
        return 1
    return max(1, min(triton.next_power_of_2(rows), 256 // split_tile))


def _check_tensor(t, name: str, dtypes, shape, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must be {names}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _check_residual(residual) -> tuple[int, int]:
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.dtype != torch.bfloat16:
        raise TypeError(f"residual must be torch.bfloat16, got {residual.dtype}")
    if residual.dim() != 3 or residual.shape[1] != HC:
        raise ValueError(f"residual must be [T, {HC}, H], got shape {tuple(residual.shape)}")
    if residual.numel() and residual.stride(2) != 1:
        raise ValueError(f"residual must have unit stride along H, got strides {residual.stride()}")
    _check_int32_offsets(residual, "residual")
    return residual.shape[0], residual.shape[2]


def _check_int32_offsets(t: torch.Tensor, name: str, first_dim: int = 1) -> None:
    """The kernels address ``t`` from a row's start (``first_dim=1``; 0: from the tensor's) in
    int32: the elements they reach from there must lie within 2**31 of it, else the offsets wrap
    and the kernel reads or writes outside the tensor."""
    span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape[first_dim:], t.stride()[first_dim:]))
    if t.numel() and span > 2**31 - 1:
        raise ValueError(f"{name}'s elements lie too far apart (shape {tuple(t.shape)}, strides {t.stride()}): "
                         f"the kernels address them in int32, so they must span fewer than 2**31 elements")


def _check_rowmajor(t: torch.Tensor, name: str) -> None:
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along H, got strides {t.stride()}")


def _check_mixes(rows: int, device, pre=None, post=None, comb=None) -> None:
    for mix, name, shape in ((pre, "pre", (rows, HC)), (post, "post", (rows, HC)), (comb, "comb", (rows, HC, HC))):
        if mix is not None:
            _check_tensor(mix, name, (torch.float32,), shape, device)
            _check_int32_offsets(mix, name)


def _check_weight(norm_weight, cols: int, device) -> None:
    _check_tensor(norm_weight, "norm_weight", (torch.bfloat16, torch.float32), (cols,), device)
    if cols and norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be contiguous, got stride {norm_weight.stride()}")


def _prepare_residual_out(out, rows: int, cols: int, device, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty((rows, HC, cols), dtype=torch.bfloat16, device=device)
    _check_tensor(out, name, (torch.bfloat16,), (rows, HC, cols), device)
    _check_rowmajor(out, name)
    _check_int32_offsets(out, name)
    check_distinct_elements(out, name)
    return out


def _prepare_x_out(out_bf16, rows: int, cols: int, device) -> torch.Tensor:
    if out_bf16 is None:
        return torch.empty((rows, cols), dtype=torch.bfloat16, device=device)
    check_rows(out_bf16, "out_bf16", (rows, cols), device)
    return out_bf16


def _resolve_format(out_format, out, return_bf16: bool) -> ActFormat | None:
    if out_format is None and out is not None:
        if not isinstance(out, QuantizedActivation):
            raise TypeError(f"out must be a QuantizedActivation, got {type(out).__name__}")
        return out.fmt
    if out_format is None and not return_bf16:
        raise ValueError("return_bf16=False needs an out_format (or out pair)")
    return ActFormat(out_format) if out_format is not None else None


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return tuple(t.stride()) if t is not None else (0,) * n


def _launch(y, residual, pre, post, comb, norm_weight, norm_eps, new_residual, x, pair, fmt,
            *, do_post: bool, do_norm: bool, store_x: bool) -> None:
    """One boundary launch; absent tensors are replaced by ``residual`` (never dereferenced)."""
    rows, _, cols = residual.shape
    cfg = _boundary_config(rows, cols, residual.device, norm=do_norm)
    grid = cfg.pop("grid")
    quant = pair is not None
    q_data, q_scale = (pair.data, pair.scale) if quant else (None, None)
    if cfg["ROW_BARRIER"]:  # counters per (row, slice count), kept across launches, and the sums
        v = None
        counters = zeroed_workspace("mhc_boundary_barrier", residual.device, _BARRIER_ROWS * _BARRIER_SPLITS,
                                    torch.int64)
        part = torch.empty((rows, _BARRIER_SPLITS), dtype=torch.float32, device=residual.device)
    elif cfg["SPLIT_ROW"]:
        v = torch.empty((rows, cols), dtype=torch.bfloat16, device=residual.device)
        part = torch.empty((rows, grid[1]), dtype=torch.float32, device=residual.device)
        counters = arrival_counters("mhc_boundary", residual.device, grid[0])
    else:
        v = part = counters = None

    def ptr(t):
        return t if t is not None else residual

    consts = format_constexprs(fmt if fmt is not None else ActFormat.SM90_G32_FP32_MN)
    _boundary_kernel[grid](
        ptr(y), residual, ptr(pre), ptr(post), ptr(comb), ptr(norm_weight),
        ptr(new_residual), ptr(x), ptr(q_data), ptr(q_scale), ptr(v), ptr(part), ptr(counters),
        rows, cols, float(norm_eps),
        _strides(y, 2)[0], residual.stride(0), residual.stride(1), *_strides(pre, 2),
        *_strides(post, 2), *_strides(comb, 3), *_strides(new_residual, 3)[:2],
        _strides(x, 2)[0], _strides(q_data, 2)[0], *_strides(q_scale, 2),
        DO_POST=do_post, DO_NORM=do_norm, STORE_X=store_x, QUANT=quant, **cfg,
        enable_fp_fusion=False, **consts, **pdl_options(residual.device),
    )


# --------------------------------------------------------------------------------- public


def mhc_stats(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
              *, rms_eps: float = 1e-6, hc_eps: float = 1e-6, sinkhorn_iters: int = 20, out=None,
              max_splits: int | None = None):
    """``residual [T, 4, H]`` bf16 -> fp32 ``(pre [T, 4], post [T, 4], comb [T, 4, 4])``.

    ``fn [24, 4H]``, ``scale [3]``, ``base [24]`` fp32 (``reference.mhc``). Two launches.
    ``fn`` must be finite within bf16's range (it is multiplied as three bf16 parts: a value
    beyond splits into inf - inf, NaN for every token; the model's loader refuses such a
    checkpoint). A token holding NaN or inf, or whose sum of squares overflows fp32 (an RMS
    above ~1e17), gets NaN mixes; the other tokens are unaffected.
    ``out``: optional caller buffers ``(pre, post, comb)``, contiguous fp32 of those shapes.
    ``max_splits``: at most this many K splits (programs per token block) for the partial
    launch, which otherwise takes about two programs per SM. Fewer programs take longer alone
    but leave more of the GPU to the launches they overlap on another stream (docs/benchmarks.md,
    layer). The split count sets the order of the fp32 sums, so results differ in the last bits
    between split counts and are reproducible for each; a cap that would leave a split more than
    32 chunks of 128 columns to sum is raised (``_MAX_CHUNKS_PER_SPLIT``: the longer a split's
    fp32 chain, the larger the error against the fp64 reference).
    """
    rows, cols = _check_residual(residual)
    device = residual.device
    _check_tensor(fn, "fn", (torch.float32,), (NMIX, HC * cols), device)
    if fn.numel() and fn.stride(1) != 1:
        raise ValueError(f"fn must have unit stride along 4H, got strides {fn.stride()}")
    _check_int32_offsets(fn, "fn", first_dim=0)
    _check_tensor(scale, "scale", (torch.float32,), (3,), device)
    _check_tensor(base, "base", (torch.float32,), (NMIX,), device)
    check_eps(rms_eps, "rms_eps")
    check_eps(hc_eps, "hc_eps")
    if not is_int(sinkhorn_iters) or sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be a positive int, got {sinkhorn_iters!r}")
    if max_splits is not None and (not is_int(max_splits) or max_splits < 1):
        raise ValueError(f"max_splits must be a positive int or None, got {max_splits!r}")
    if out is None:
        pre = torch.empty((rows, HC), dtype=torch.float32, device=device)
        post = torch.empty((rows, HC), dtype=torch.float32, device=device)
        comb = torch.empty((rows, HC, HC), dtype=torch.float32, device=device)
    else:
        if not isinstance(out, (tuple, list)) or len(out) != 3 or not all(isinstance(t, torch.Tensor) for t in out):
            raise TypeError(f"out must be a tuple of tensors (pre, post, comb), got {out!r:.200}")
        pre, post, comb = out
        _check_mixes(rows, device, pre, post, comb)
        if not (pre.is_contiguous() and post.is_contiguous() and comb.is_contiguous()):
            raise ValueError("out=(pre, post, comb) must be contiguous")
        outputs = [("out pre", pre), ("out post", post), ("out comb", comb)]
        check_disjoint(outputs)
        check_no_overlap(outputs, [("residual", residual), ("fn", fn), ("scale", scale), ("base", base)])
    if rows == 0:
        return pre, post, comb
    if cols == 0:
        raise ValueError("residual has H = 0")
    scale = scale.contiguous()
    base = base.contiguous()
    bt, bk, per_split, splits = _stats_config(rows, HC * cols, device, max_splits)
    np_ = triton.next_power_of_2(NMIX + 1)  # the 24 mixes, then the sum of squares
    part = torch.empty((splits, rows, np_), dtype=torch.float32, device=device)
    _stats_partial_kernel[(cdiv(rows, bt), splits)](
        residual, fn, part, rows, cols, residual.stride(0), residual.stride(1), fn.stride(0),
        per_split, NMIX=NMIX, NP=np_, BT=bt, BK=bk, UPCAST_DOT=interpreting(), num_warps=4,
        **stats_partial_stages(bt), **pdl_options(device),
    )
    sp = triton.next_power_of_2(splits)
    bt2 = stats_finish_tokens(rows, sp)
    _stats_finish_kernel[(cdiv(rows, bt2),)](
        part, scale, base, pre, post, comb, rows, HC * cols, float(rms_eps), float(hc_eps),
        NSPLIT=splits, SP=sp, SINKHORN_ITERS=sinkhorn_iters, NMIX=NMIX, NP=np_, BT=bt2, num_warps=4,
        **pdl_options(device),
    )
    return pre, post, comb


def mhc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``R'[o] = bf16(post[o]*y + sum_i comb[i][o]*R[i])`` ``[T, 4, H]`` bf16.

    ``out`` may be ``residual`` itself (every element is read and written by the same program).
    """
    rows, cols = _check_residual(residual)
    device = residual.device
    _check_tensor(y, "y", (torch.bfloat16,), (rows, cols), device)
    _check_rowmajor(y, "y")
    _check_mixes(rows, device, post=post, comb=comb)
    same = (out is not None and isinstance(out, torch.Tensor) and out.data_ptr() == residual.data_ptr()
            and out.stride() == residual.stride() and out.shape == residual.shape)
    out = _prepare_residual_out(out, rows, cols, device, "out")
    inputs = [("y", y), ("post", post), ("comb", comb)] + ([] if same else [("residual", residual)])
    check_no_overlap([("out", out)], inputs)
    if rows == 0 or cols == 0:
        return out
    _launch(y, residual, None, post, comb, None, 0.0, out, None, None, None,
            do_post=True, do_norm=False, store_x=False)
    return out


def mhc_combine_norm(residual: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor,
                     norm_eps: float, *, out_format=None, out: QuantizedActivation | None = None,
                     out_bf16: torch.Tensor | None = None, return_bf16: bool = True):
    """``x = bf16(RMSNorm(bf16(sum_k pre[k]*R[k]), norm_weight))`` ``[T, H]``.

    Returns ``x``; ``(x, pair)`` with ``out_format`` (or ``out``); only ``pair`` with
    ``return_bf16=False`` (``x`` is then still written when ``out_bf16`` is given). The
    combine + norm half of ``mhc_mega_boundary`` for a caller that holds ``pre`` and no
    finished sublayer (fp8chain's model needs none: layer 0 normalizes ``R[:, 0]`` with
    ``norm.rms_norm``, the final norm is the last boundary).
    """
    rows, cols = _check_residual(residual)
    device = residual.device
    _check_mixes(rows, device, pre=pre)
    _check_weight(norm_weight, cols, device)
    check_eps(norm_eps, "norm_eps")
    fmt = _resolve_format(out_format, out, return_bf16)
    pair = prepare_out(out, rows, cols, fmt, device) if fmt is not None else None
    store_x = return_bf16 or out_bf16 is not None
    x = _prepare_x_out(out_bf16, rows, cols, device) if store_x else None
    outputs = produced(pair, x)
    check_disjoint(outputs)
    check_no_overlap(outputs, [("residual", residual), ("pre", pre), ("norm_weight", norm_weight)])
    if rows and cols:
        _launch(None, residual, pre, None, None, norm_weight, norm_eps, None, x, pair, fmt,
                do_post=False, do_norm=True, store_x=store_x)
    if fmt is None:
        return x
    return (x, pair) if return_bf16 else pair


def mhc_mega_boundary(y: torch.Tensor, residual: torch.Tensor, pre: torch.Tensor,
                      post: torch.Tensor, comb: torch.Tensor, norm_weight: torch.Tensor,
                      norm_eps: float, *, out_format=None, out_residual: torch.Tensor | None = None,
                      out: QuantizedActivation | None = None, out_bf16: torch.Tensor | None = None,
                      return_bf16: bool = True):
    """One launch: ``R' = post(y, R, post, comb)`` of the finished sublayer, then the next
    sublayer's ``x = bf16(RMSNorm(bf16(sum_k pre[k]*R'[k]), norm_weight))`` with the carried
    ``pre``, and the FP8 pair of ``x`` in ``out_format``.

    Returns ``(R', x, pair)``: ``x`` is None when ``return_bf16=False`` (which needs an
    ``out_format``/``out``; ``x`` is still written into ``out_bf16`` when given), ``pair`` None
    without ``out_format``/``out``. Writes into ``out_residual`` / ``out_bf16`` / ``out`` when
    given (CUDA graphs); they must not overlap each other or the inputs.
    """
    rows, cols = _check_residual(residual)
    device = residual.device
    _check_tensor(y, "y", (torch.bfloat16,), (rows, cols), device)
    _check_rowmajor(y, "y")
    _check_mixes(rows, device, pre=pre, post=post, comb=comb)
    _check_weight(norm_weight, cols, device)
    check_eps(norm_eps, "norm_eps")
    fmt = _resolve_format(out_format, out, return_bf16)
    pair = prepare_out(out, rows, cols, fmt, device) if fmt is not None else None
    new_residual = _prepare_residual_out(out_residual, rows, cols, device, "out_residual")
    store_x = return_bf16 or out_bf16 is not None
    x = _prepare_x_out(out_bf16, rows, cols, device) if store_x else None
    outputs = [("out_residual", new_residual)] + produced(pair, x)
    check_disjoint(outputs)
    check_no_overlap(outputs, [("y", y), ("residual", residual), ("pre", pre), ("post", post),
                               ("comb", comb), ("norm_weight", norm_weight)])
    if rows and cols:
        _launch(y, residual, pre, post, comb, norm_weight, norm_eps, new_residual, x, pair, fmt,
                do_post=True, do_norm=True, store_x=store_x)
    return new_residual, (x if return_bf16 else None), pair
