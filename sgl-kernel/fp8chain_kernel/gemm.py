"""FP8 GEMM consumers: a ``QuantizedActivation`` as its producer wrote it, times block-scaled FP8
weights, bf16 out. Nothing here re-quantizes a pair.

``fp8_gemm(pair, weight, weight_scale, *, weight_block=32)`` (``weight_block`` has no default) reads ``SM90_G32_FP32_MN`` pairs against
DSv4.1 weights (e4m3 ``[N, K]``, power-of-two fp32 scales per 32x32 block);
``weight_block=128`` reads ``SM90_G128_FP32_MN`` pairs against V3/V4-style 128x128 blocks with
arbitrary fp32 scales. A bf16 ``[M, K]`` tensor plus ``fmt`` is quantized first with
``quant.quantize`` and then runs the very same GEMM (the unchained baseline).
``w8a16_gemm`` is the bf16-activation baseline (FP8 weights dequantized in the kernel).

One Triton kernel serves both, see docs/gemm.md:

* swap-AB tiles: the accumulator is ``[BLOCK_N, BLOCK_M]`` (weights on the MMA's M side, at least
  64 rows, tokens on its N side, 16..256), so a decode step with one token still runs full-size
  wgmma instructions on Hopper and reads the weights once;
* three operand modes per config. FP8 dot: per K group (32 or 128 columns) one ``tl.dot`` on
  the e4m3 operands, then ``acc += partial * (weight_scale[n // block, g] * act_scale[m, g])`` in
  fp32. Block-diagonal (32-groups, small M): one FP8 ``tl.dot`` per BLOCK_K against a token
  operand that holds each group's columns in its own block of BLOCK_M columns (zeros elsewhere),
  so the product holds every group's partial sum at once and is promoted the same way.
  Dequantized: both operands are scaled to bf16 in registers (exact when the scales are powers of
  two, as DSv4.1's 32x32 blocks and ``sm90_g32_fp32_mn`` are: e4m3 x 2^e is a bf16 value) and one
  bf16 ``tl.dot`` covers BLOCK_K columns with fp32 accumulation over all of K. The H200 sweep picks
  block-diagonal for 32-groups at M <= 16 (M <= 64 for the TP4 shards) and mostly dequantized
  above (per-32 FP8 dots pay one wgmma wait and one promotion per 32 columns; docs/gemm.md names
  the exceptions);
* split-K for decode shapes: each K slice stores its fp32 partial tile to a workspace and bumps a
  per-tile counter; the program that arrives last sums the partials in slice order (so the result
  is deterministic and independent of arrival order), writes bf16 and re-arms the counter;
* configs come from a static table keyed by (M bucket, N, K, group), measured on an H200, with a
  heuristic for shapes outside it. Nothing is autotuned at serving time.

One to four tokens of a problem in ``gemv.GEMV_TABLE`` run ``gemv``'s CUDA-core kernel instead,
the same product with another fp32 summation order (the H200 measured it faster there).

Scale values are read, not checked (checking them would take a host read per call, which CUDA-graph
capture forbids): 32x32 block scales that are not powers of two are refused where the weights are
prepared (``backends``' Triton backend, ``derive_weight_tensors``); passed here directly, they make
the dequantized mode inexact, so results would depend on the batch size's config.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .formats import (FP8_DTYPE, ActFormat, QuantizedActivation, cdiv, check_no_overlap, check_pair,
                      holds_padded_scale_rows, is_int, pair_parts)
from .act import check_limit, silu_mul, swiglu
from .gemv import GEMV_TABLE, GemvConfig, gemv_token_tile, launch_gemv, select_gemv
from .fp8_tile import dequantize_tile, e4m3_to_f32_exact, fp8_offsets, interpreting, round_bf16, store_pair_tile
from .launch import (await_producer, gather_partials, pdl_options, publish_partial, rearm, registers_per_thread,
                     sm_count, split_workspace, SWEPT_RELEASE, triton_release)
from .norm import check_rows, launch_args, produced, producer_result, resolve_outputs
from .quant import check_activation, quantize

__all__ = [
    "GemmConfig", "fp8_gemm", "fp8_gemm_silu_mul", "gemm_config", "silu_mul_epilogue_pays", "w8a16_gemm",
    "input_format_for_block", "check_block_scaled", "check_weight", "select_config", "CONFIG_TABLE",
    "DSV41_TP1_LINEARS", "DSV41_TP4_SHARDS",
]


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------

@triton.jit
def _iter_scales(ws_rows, as_rows, it, it_last, stride_wsk, stride_asg, n_ok, m_ok, SUB: tl.constexpr,
                 A_FP8: tl.constexpr):
    """The scales of K iteration ``min(it, it_last)``'s SUB groups: weights ``[BLOCK_N, SUB]`` (one
    row per weight row, repeating over its block) and tokens ``[BLOCK_M, SUB]`` (ones for W8A16)."""
    offs_s = tl.minimum(it, it_last) * SUB + tl.arange(0, SUB)
    w_s = tl.load(ws_rows[:, None] + offs_s[None, :] * stride_wsk, mask=n_ok[:, None], other=0.0)
    if A_FP8:
        a_s = tl.load(as_rows[:, None] + offs_s[None, :] * stride_asg, mask=m_ok[:, None], other=0.0)
    else:
        a_s = tl.full((m_ok.shape[0], SUB), 1.0, tl.float32)
    return w_s, a_s


@triton.jit
def _next_scales(w0, a0, w1, a1, w2, a2, w3, a3, ws_rows, as_rows, it, it_last, stride_wsk, stride_asg,
                 n_ok, m_ok, SUB: tl.constexpr, A_FP8: tl.constexpr, AHEAD: tl.constexpr):
    """Iteration ``it``'s scales and the prefetch ring advanced by one: the ring holds the scales of
    iterations ``it .. it + AHEAD - 1`` (slot 0 first); this loads those of ``it + AHEAD``. Plain
    loads are not staged by the software pipeliner, so a scale loaded at its use stalls the
    iteration for a full memory round trip; AHEAD iterations ahead the stall is gone once AHEAD
    iterations take longer than the round trip. AHEAD = 0 loads at use (no ring)."""
    if AHEAD == 0:
        w_s, a_s = _iter_scales(ws_rows, as_rows, it, it_last, stride_wsk, stride_asg, n_ok, m_ok, SUB, A_FP8)
    else:
        w_s, a_s = w0, a0
        w_new, a_new = _iter_scales(ws_rows, as_rows, it + AHEAD, it_last, stride_wsk, stride_asg, n_ok, m_ok,
                                    SUB, A_FP8)
        if AHEAD == 1:
            w0, a0 = w_new, a_new
        elif AHEAD == 2:
            w0, a0, w1, a1 = w1, a1, w_new, a_new
        elif AHEAD == 3:
            w0, a0, w1, a1, w2, a2 = w1, a1, w2, a2, w_new, a_new
        else:
            w0, a0, w1, a1, w2, a2, w3, a3 = w1, a1, w2, a2, w3, a3, w_new, a_new
    return w_s, a_s, w0, a0, w1, a1, w2, a2, w3, a3


@triton.jit
def _tile_coords(pid, tiles_n, tiles_m, TILE_GROUP: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` in grouped order: TILE_GROUP consecutive programs share
    one weight tile column band."""
    per_band = TILE_GROUP * tiles_n
    band = pid // per_band
    first_m = band * TILE_GROUP
    band_m = tl.minimum(tiles_m - first_m, TILE_GROUP)
    return first_m + (pid % per_band) % band_m, (pid % per_band) // band_m


@triton.jit
def _tile_product(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, offs_n, n_ok, m0, M, it_begin,
                  stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_wsk,
                  GROUP: tl.constexpr, A_FP8: tl.constexpr, ITERS: tl.constexpr, DEQUANT: tl.constexpr,
                  BLOCK_DIAG: tl.constexpr, SCALE_AHEAD: tl.constexpr, FP32_DOT: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                  PADDED_SCALE_ROWS: tl.constexpr):
    """fp32 ``[BLOCK_N, BLOCK_M]``: weight rows ``offs_n`` (any rows; ``n_ok`` masks them) times
    tokens ``m0 .. m0 + BLOCK_M`` over the ITERS K iterations from ``it_begin``, scaled per group:
    ``sum_g (sum_{k in g} a[m, k] w[n, k]) * a_scale[m, g] * w_scale[n // GROUP, g]``. The
    dequantized and block-diagonal modes read each iteration's scales SCALE_AHEAD iterations
    ahead (``_next_scales``); the result does not depend on it. PADDED_SCALE_ROWS reads the token
    scales of rows up to align4(M) (``_launch_residency``); rows from M on are never stored."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    scale_ok = m_ok
    if PADDED_SCALE_ROWS:
        # A scale column holds align4(M) addressable rows and S % 4 == 0 (formats): masked at
        # align4(M), with S known a multiple of 4, the scales load in whole 4-row pieces, where a
        # mask at an M the launcher does not know to be a multiple of 16 splits them (registers)
        scale_ok = offs_m < (M + 3) // 4 * 4
        stride_asg = stride_asg // 4 * 4
    rows_n = offs_n.to(tl.int64)
    rows_m = offs_m.to(tl.int64)
    ws_rows = w_scale_ptr + (offs_n // GROUP).to(tl.int64) * stride_wsn
    as_rows = a_scale_ptr + rows_m * stride_asm
    SUB: tl.constexpr = BLOCK_K // GROUP  # scale groups per K iteration
    offs_k = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
    a_tile = a_ptr + rows_m[:, None] * stride_am + offs_k[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # the scale prefetch ring (_next_scales), filled with iterations it_begin .. + SCALE_AHEAD - 1
    it_last = it_begin + ITERS - 1
    w0 = tl.zeros((BLOCK_N, SUB), tl.float32)
    a0 = tl.zeros((BLOCK_M, SUB), tl.float32)
    w1, a1, w2, a2, w3, a3 = w0, a0, w0, a0, w0, a0
    for j in tl.static_range(SCALE_AHEAD):  # push iterations it_begin + j: advancing from it_begin - AHEAD + j
        _, _, w0, a0, w1, a1, w2, a2, w3, a3 = _next_scales(
            w0, a0, w1, a1, w2, a2, w3, a3, ws_rows, as_rows, it_begin - SCALE_AHEAD + j, it_last, stride_wsk,
            stride_asg, n_ok, scale_ok, SUB, A_FP8, SCALE_AHEAD)
    if DEQUANT:
        # Dequantize both operands to bf16 in registers (exact for power-of-two scales: an e4m3
        # value times 2^e is a bf16 value), then one bf16 dot over BLOCK_K with fp32
        # accumulation across all of K: no per-group promotion, no waits between small dots.
        for i in range(ITERS):
            it = it_begin + i
            w = tl.load(w_tile + it * BLOCK_K, mask=n_ok[:, None], other=0.0)
            a = tl.load(a_tile + it * BLOCK_K, mask=m_ok[:, None], other=0.0)
            w_s, a_s, w0, a0, w1, a1, w2, a2, w3, a3 = _next_scales(
                w0, a0, w1, a1, w2, a2, w3, a3, ws_rows, as_rows, it, it_last, stride_wsk, stride_asg, n_ok, scale_ok,
                SUB, A_FP8, SCALE_AHEAD)
            wd = dequantize_tile(w, w_s, BLOCK_N, SUB, GROUP, FP32_DOT)
            if A_FP8:
                ad = dequantize_tile(a, a_s, BLOCK_M, SUB, GROUP, FP32_DOT)
            else:
                ad = a
            if FP32_DOT:
                acc = tl.dot(wd.to(tl.float32), tl.trans(ad.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(wd, tl.trans(ad), acc)
    elif BLOCK_DIAG:
        # One FP8 dot per BLOCK_K for all its SUB groups: the token operand is block diagonal
        # (column j * BLOCK_M + t holds token t's group j, zeros in the other groups' rows), so
        # product column j * BLOCK_M + t is token t's group-j partial sum, scaled in fp32 like the
        # per-group dots but with one wgmma and one wait per BLOCK_K instead of SUB.
        offs_c = tl.arange(0, SUB * BLOCK_M)
        c_row = m0 + offs_c % BLOCK_M
        b_tile = a_ptr + c_row.to(tl.int64)[None, :] * stride_am + offs_k[:, None]
        b_mask = (c_row < M)[None, :] & ((offs_k // GROUP)[:, None] == (offs_c // BLOCK_M)[None, :])
        acc3 = tl.zeros((BLOCK_N, SUB, BLOCK_M), dtype=tl.float32)
        for i in range(ITERS):
            it = it_begin + i
            w_s, a_s, w0, a0, w1, a1, w2, a2, w3, a3 = _next_scales(
                w0, a0, w1, a1, w2, a2, w3, a3, ws_rows, as_rows, it, it_last, stride_wsk, stride_asg, n_ok, scale_ok,
                SUB, A_FP8, SCALE_AHEAD)
            w = tl.load(w_tile + it * BLOCK_K, mask=n_ok[:, None], other=0.0)
            b = tl.load(b_tile + it * BLOCK_K, mask=b_mask, other=0.0)
            if FP32_DOT:
                part = tl.dot(e4m3_to_f32_exact(w), e4m3_to_f32_exact(b), input_precision="ieee")
            else:
                part = tl.dot(w, b)
            acc3 += tl.reshape(part, (BLOCK_N, SUB, BLOCK_M)) * (w_s[:, :, None] * tl.trans(a_s)[None, :, :])
        acc = tl.sum(acc3, axis=1)
    else:
        offs_g = tl.arange(0, GROUP)
        w_rows = w_ptr + rows_n[:, None] * stride_wn + offs_g[None, :]
        a_rows = a_ptr + rows_m[:, None] * stride_am + offs_g[None, :]
        for i in range(ITERS):
            it = it_begin + i
            for sub in tl.static_range(SUB):
                g = it * SUB + sub
                k0 = g * GROUP
                w = tl.load(w_rows + k0, mask=n_ok[:, None], other=0.0)
                a = tl.load(a_rows + k0, mask=m_ok[:, None], other=0.0)
                w_s = tl.load(ws_rows + g * stride_wsk, mask=n_ok, other=0.0)
                if A_FP8:
                    a_s = tl.load(as_rows + g * stride_asg, mask=scale_ok, other=0.0)
                    if FP32_DOT:
                        part = tl.dot(e4m3_to_f32_exact(w), tl.trans(e4m3_to_f32_exact(a)),
                                      input_precision="ieee")
                    else:
                        part = tl.dot(w, tl.trans(a))
                    acc += part * (w_s[:, None] * a_s[None, :])
                else:
                    if FP32_DOT:  # the interpreter's bf16 tl.dot is wrong; fp32 is exact there
                        part = tl.dot(e4m3_to_f32_exact(w), tl.trans(a.to(tl.float32)), input_precision="ieee")
                    else:
                        part = tl.dot(w.to(tl.bfloat16), tl.trans(a))
                    acc += part * w_s[:, None]
    return acc


@triton.jit
def _block_scaled_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K,
    stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_wsk, stride_om,
    GROUP: tl.constexpr, A_FP8: tl.constexpr, SPLIT: tl.constexpr, ITERS: tl.constexpr,
    DEQUANT: tl.constexpr, BLOCK_DIAG: tl.constexpr, SCALE_AHEAD: tl.constexpr,
    FP32_DOT: tl.constexpr,  # the CPU interpreter: fp32 dots and bit-exact bf16 rounding
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TILE_GROUP: tl.constexpr,
    PADDED_SCALE_ROWS: tl.constexpr, PDL: tl.constexpr,
):
    """out[m, n] = sum_g (sum_{k in g} a[m, k] w[n, k]) * a_scale[m, g] * w_scale[n // GROUP, g].

    Grid: (tiles, SPLIT); slice ``pid_k`` covers K iterations ``[pid_k * ITERS, (pid_k + 1) * ITERS)``
    of BLOCK_K columns each. The weight block along N equals GROUP (32x32 or 128x128 blocks).
    With A_FP8 = False, ``a`` is bf16 and carries no scales (W8A16).
    """
    await_producer(PDL)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(tl.program_id(0), tiles_n, tl.cdiv(M, BLOCK_M), TILE_GROUP)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n.to(tl.int64)[:, None]
    out_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    acc = _tile_product(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, offs_n, offs_n < N, pid_m * BLOCK_M, M,
                        pid_k * ITERS, stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_wsk,
                        GROUP, A_FP8, ITERS, DEQUANT, BLOCK_DIAG, SCALE_AHEAD, FP32_DOT, BLOCK_N, BLOCK_M, BLOCK_K,
                        PADDED_SCALE_ROWS)
    if SPLIT == 1:
        tl.store(out_ptrs, round_bf16(acc, FP32_DOT), mask=out_mask)
    else:
        tile = pid_m * tiles_n + pid_n
        if publish_partial(acc, part_ptr, count_ptr, tile, tl.num_programs(0), pid_k, SPLIT, BLOCK_N, BLOCK_M):
            total = gather_partials(part_ptr, tile, tl.num_programs(0), SPLIT, BLOCK_N, BLOCK_M)
            tl.store(out_ptrs, round_bf16(total, FP32_DOT), mask=out_mask)
            rearm(count_ptr, tile)


@triton.jit
def _silu_mul_epilogue(acc, y_ptr, data_ptr, scale_ptr, pid_m, pid_n, M, I, limit,
                       stride_ym, stride_dm, stride_sm, stride_sg,
                       HAS_LIMIT: tl.constexpr, STORE_BF16: tl.constexpr, QUANT: tl.constexpr,
                       QGROUP: tl.constexpr, POW2: tl.constexpr, PACKED: tl.constexpr, EXACT_CAST: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_M]`` holds gate rows then the matching up rows: round both to bf16
    (the gate_up GEMM's output), apply ``act.swiglu``, round, store bf16 and / or the FP8 pair of
    output columns ``pid_n * BLOCK_N / 2 ..`` (tokens on rows, as every producer writes them)."""
    HALF: tl.constexpr = BLOCK_N // 2
    gate_up = round_bf16(acc, EXACT_CAST).to(tl.float32)
    gate, up = tl.split(tl.permute(tl.reshape(gate_up, (2, HALF, BLOCK_M)), (1, 2, 0)))
    y = tl.trans(round_bf16(swiglu(gate, up, limit, HAS_LIMIT), EXACT_CAST))  # [BLOCK_M, HALF]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = pid_n * HALF + tl.arange(0, HALF)
    rows = offs_m.to(tl.int64)[:, None]
    mask = (offs_m < M)[:, None] & (offs_c < I)[None, :]
    if STORE_BF16:
        tl.store(y_ptr + rows * stride_ym + offs_c[None, :], y, mask=mask)
    if QUANT:
        store_pair_tile(data_ptr + fp8_offsets(rows, stride_dm, offs_c), scale_ptr, y.to(tl.float32), mask,
                        offs_m, pid_n * (HALF // QGROUP), M, tl.cdiv(I, QGROUP), stride_sm, stride_sg,
                        BLOCK_M, HALF, QGROUP, POW2, PACKED, EXACT_CAST)


@triton.jit
def _gemm_silu_mul_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, y_ptr, data_ptr, scale_ptr, part_ptr, count_ptr,
    M, I, K, limit,
    stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_wsk, stride_ym, stride_dm, stride_sm, stride_sg,
    GROUP: tl.constexpr, SPLIT: tl.constexpr, ITERS: tl.constexpr, DEQUANT: tl.constexpr, BLOCK_DIAG: tl.constexpr,
    SCALE_AHEAD: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    TILE_GROUP: tl.constexpr, HAS_LIMIT: tl.constexpr, STORE_BF16: tl.constexpr, QUANT: tl.constexpr,
    QGROUP: tl.constexpr, POW2: tl.constexpr, PACKED: tl.constexpr, PADDED_SCALE_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """``y = swiglu(gate_up)`` of ``gate_up = a @ w^T`` (``w = [gate; up]``, ``[2I, K]``), one launch:
    a tile's first BLOCK_N / 2 weight rows are gate rows, its last the up rows of the same output
    columns, so the GEMM epilogue has both halves of its BLOCK_N / 2 outputs."""
    await_producer(PDL)
    HALF: tl.constexpr = BLOCK_N // 2
    tiles_n = tl.cdiv(I, HALF)
    pid_m, pid_n = _tile_coords(tl.program_id(0), tiles_n, tl.cdiv(M, BLOCK_M), TILE_GROUP)
    pid_k = tl.program_id(1)
    local = tl.arange(0, BLOCK_N)
    cols = pid_n * HALF + local % HALF
    acc = _tile_product(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, cols + (local // HALF) * I, cols < I,
                        pid_m * BLOCK_M, M, pid_k * ITERS, stride_am, stride_asm, stride_asg, stride_wn,
                        stride_wsn, stride_wsk, GROUP, True, ITERS, DEQUANT, BLOCK_DIAG, SCALE_AHEAD, FP32_DOT,
                        BLOCK_N, BLOCK_M, BLOCK_K, PADDED_SCALE_ROWS)
    if SPLIT == 1:
        _silu_mul_epilogue(acc, y_ptr, data_ptr, scale_ptr, pid_m, pid_n, M, I, limit, stride_ym, stride_dm,
                           stride_sm, stride_sg, HAS_LIMIT, STORE_BF16, QUANT, QGROUP, POW2, PACKED, FP32_DOT,
                           BLOCK_N, BLOCK_M)
    else:
        tile = pid_m * tiles_n + pid_n
        if publish_partial(acc, part_ptr, count_ptr, tile, tl.num_programs(0), pid_k, SPLIT, BLOCK_N, BLOCK_M):
            total = gather_partials(part_ptr, tile, tl.num_programs(0), SPLIT, BLOCK_N, BLOCK_M)
            _silu_mul_epilogue(total, y_ptr, data_ptr, scale_ptr, pid_m, pid_n, M, I, limit, stride_ym,
                               stride_dm, stride_sm, stride_sg, HAS_LIMIT, STORE_BF16, QUANT, QGROUP, POW2,
                               PACKED, FP32_DOT, BLOCK_N, BLOCK_M)
            rearm(count_ptr, tile)


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------

class GemmConfig(NamedTuple):
    """One launch shape: tile sizes, K split, pipeline depth, warps, grouped tile order."""

    block_n: int
    block_m: int
    block_k: int
    split: int = 1
    stages: int = 4
    warps: int = 4
    tile_group: int = 8
    dequant: bool = False  # bf16-dequantized operands, one dot per BLOCK_K (see the kernel)
    block_diag: bool = False  # FP8 dot over a block-diagonal token operand, one per BLOCK_K
    # K iterations the scales are read ahead in those two modes, 0..4 (None: 1 block-diagonal,
    # 0 dequantized); the per-group FP8 dot reads them at use
    scale_ahead: int | None = None
    # registers per thread ptxas may use (Triton's maxnreg; None: its own choice)
    max_regs: int | None = None
    # keep three 4-warp programs resident per SM where a launch's compile would pass that line and
    # cost a wave (``_launch_residency``: the table's M = 64 and M-bucket-256 32-group entries)
    residency_cap: bool = False

    def scale_prefetch(self) -> int:
        """The kernel's SCALE_AHEAD for this config."""
        if not (self.dequant or self.block_diag):
            return 0
        return self.scale_ahead if self.scale_ahead is not None else int(self.block_diag)


# The DSv4.1-Flash dense FP8 linears, (N, K) by name, that this table and ``gemv.GEMV_TABLE`` were
# swept on: TP1, and the shards one rank holds at TP4 (wqkv_a is replicated at every degree).
DSV41_TP1_LINEARS = {"wqkv_a": (1792, 5120), "wq_b": (32768, 1280), "wo_b": (5120, 8192),
                     "gate_up": (4608, 5120), "down": (5120, 2304)}
DSV41_TP4_SHARDS = {"wq_b_tp4": (8192, 1280), "wo_b_tp4": (5120, 2048), "gate_up_tp4": (1152, 5120),
                    "down_tp4": (5120, 576)}


# Registers per thread for three 4-warp programs per SM (168)
THREE_PROGRAMS_PER_SM = registers_per_thread(3, 4)
# Triton's launcher specializes an integer argument divisible by 16 as aligned: token-scale
# column strides that are multiples of this compile with aligned scale loads
ALIGNED_SCALE_STRIDE = 16


def m64_register_cap(scale_stride: int, triton_version: str = triton.__version__) -> int | None:
    """The register cap of a launch of a ``residency_cap`` entry (the 32-group M = 64 entries with
    bf16-dequantized 64 x 64 tiles: gate_up, wo_b, its TP4 shard; M = 33-64 runs them) whose token
    scales have column stride ``scale_stride``. Their 288-320 programs run in one wave on 132 SMs
    at three programs per SM, in two at two (docs/gemm.md, "Register caps"). Triton 3.6 compiles
    wo_b in 168 registers where the stride is a multiple of 16 (the launcher then knows the scale
    loads' alignment: M = 45-48 and 61-64 from fp8chain's producers, as swept), so none there (a cap
    changes the schedule), and in 171 where it is not (the other M from 33: wo_b alone 64.0 / 66.0
    us at M = 40 / 56 against 38.7 / 39.4 at 48 / 64 on an H100), so THREE_PROGRAMS_PER_SM there;
    3.8 takes 173 (183 with the SiLU*mul epilogue) at any stride, so THREE_PROGRAMS_PER_SM from 3.7
    on."""
    if triton_release(triton_version) > SWEPT_RELEASE or scale_stride % ALIGNED_SCALE_STRIDE:
        return THREE_PROGRAMS_PER_SM
    return None


def bucket256_register_cap(padded_rows: bool, silu_mul_epilogue: bool,
                           triton_version: str = triton.__version__) -> int | None:
    """The register cap of a launch of an M-bucket-256 ``residency_cap`` entry (the per-group
    gate_up and down, M = 129-256; ``_launch_residency``). Triton 3.6 compiles the launches on
    padded token-scale rows (``padded_rows``: M = 193-255 not a multiple of 16) in 170-172 registers
    (two programs per SM), so THREE_PROGRAMS_PER_SM there and nothing elsewhere (at M = 224 / 256
    the gate_up with the SiLU*mul epilogue reads the same capped or not). Triton 3.8 compiles the
    plain GEMM in 140 registers and the SiLU*mul epilogue launch in 136-144 at any M (three per SM
    already); capped, the plain GEMM spills 48 bytes a thread and reads slower (down 39.2-39.5
    against 36.8-37.0 us on an H100), the epilogue launch takes the 168 registers without a spill
    and reads faster (74.4-74.9 against 75.8-79.1 us at M = 200-256): from 3.7 on the epilogue
    launch is capped at every M of the bucket, the plain GEMM nowhere (docs/gemm.md, "Register
    caps")."""
    if triton_release(triton_version) <= SWEPT_RELEASE:
        return THREE_PROGRAMS_PER_SM if padded_rows else None
    return THREE_PROGRAMS_PER_SM if silu_mul_epilogue else None


# Static table, (M bucket, N, K, group) -> config, filled from H200 sweeps (benchmark/gemm.py
# --sweep, which verifies each candidate against the reference before timing it). M buckets: 4,
# 8, 16, 32, 64, 128, 256, 1 << 30 (anything larger). Shapes not listed fall back to
# ``_heuristic_config``. ``group`` is 32 (DSv4.1 weights) or 128; W8A16 uses the heuristic.
_C = GemmConfig
CONFIG_TABLE: dict[tuple[int, int, int, int], GemmConfig] = {
    # H200 sweep 2026-11-29 11:10 UTC (benchmark/gemm.py --sweep): fastest verified candidate, its
    # CUDA-graph median per call (weights streamed from HBM). The block_diag entries (32-groups at
    # M <= 16) come from the sweep of 2026-11-29 14:36 UTC that added the mode;
    # their pipeline depth at M <= 16 from the sweep of 2026-11-30 01:41 UTC (--stages 3,4,6,8:
    # 3 stages fastest, 6 and 8 no faster; the times quoted there are at M = 16). The 32-group
    # M = 64 entries from the sweep of 2026-11-30 01:57 UTC (--modes dequant --stages 3,4
    # --scale-ahead 0,1,2,3): reading the scales 2 iterations ahead pays for the long-K shapes;
    # for the block-diagonal mode at M <= 16 1 stays best (2-4 ahead: 1-10 us slower per GEMM).
    # Buckets 4 and 8 from the sweep of 2026-11-30 03:52 UTC (--ms 1,4,8 --modes block_diag): a token
    # tile of 4 or 8 columns per group (a 16- or 32-column block-diagonal operand) shortens every
    # K step's promotion and copies, 0.4-2.7 us per GEMM against the 16-token tile.
    # The three M = 64 entries and the two per-group M-bucket-256 32-group entries with
    # residency_cap=True: capped per launch (_launch_residency).
    # wqkv_a 1792x5120
    (4, 1792, 5120, 32): _C(64, 4, 128, 8, 3, 4, block_diag=True),  # 6.6 us (M = 1), 6.7 (M = 4)
    (8, 1792, 5120, 32): _C(64, 8, 128, 8, 3, 4, block_diag=True),  # 7.0 us
    (16, 1792, 5120, 32): _C(64, 16, 128, 8, 3, 4, block_diag=True),  # 7.7 us (3 stages, 2026-11-30)
    (64, 1792, 5120, 32): _C(64, 64, 128, 8, 3, 4, dequant=True, scale_ahead=0),  # 13.3 us (2026-11-30)
    (256, 1792, 5120, 32): _C(128, 64, 128, 8, 4, 4, dequant=True),  # 35.5 us (sweep 2026-12-05; 39.9 split 2 FP8 dot)
    (1 << 30, 1792, 5120, 32): _C(128, 256, 64, 1, 3, 8, dequant=True),  # 118.9 us
    (16, 1792, 5120, 128): _C(64, 16, 128, 8, 4, 4),  # 7.3 us
    (64, 1792, 5120, 128): _C(64, 64, 128, 4, 4, 4),  # 9.9 us
    (256, 1792, 5120, 128): _C(128, 64, 128, 2, 4, 4),  # 17.8 us
    (1 << 30, 1792, 5120, 128): _C(128, 128, 128, 1, 3, 8),  # 63.3 us
    # wq_b 32768x1280
    (4, 32768, 1280, 32): _C(128, 4, 128, 1, 3, 4, block_diag=True),  # 13.5 us (M = 1), 12.9 (M = 4)
    (8, 32768, 1280, 32): _C(128, 8, 128, 1, 3, 4, block_diag=True),  # 14.0 us
    (16, 32768, 1280, 32): _C(128, 16, 128, 1, 3, 4, block_diag=True),  # 14.6 us (3 stages, 2026-11-30)
    (64, 32768, 1280, 32): _C(128, 64, 128, 1, 3, 4, dequant=True, scale_ahead=0),  # 27.2 us (2026-11-30)
    (256, 32768, 1280, 32): _C(128, 128, 128, 1, 3, 8, dequant=True),  # 84.2 us
    (1 << 30, 32768, 1280, 32): _C(128, 256, 64, 1, 3, 8, dequant=True),  # 500.4 us
    (16, 32768, 1280, 128): _C(128, 16, 128, 1, 4, 4),  # 13.9 us
    (64, 32768, 1280, 128): _C(128, 64, 128, 1, 4, 4),  # 16.0 us
    (256, 32768, 1280, 128): _C(128, 128, 128, 1, 3, 8),  # 42.2 us
    (1 << 30, 32768, 1280, 128): _C(128, 64, 128, 1, 4, 4),  # 299.8 us
    # wo_b 5120x8192
    (4, 5120, 8192, 32): _C(64, 4, 128, 8, 3, 4, block_diag=True),  # 14.5 us (M = 1), 15.0 (M = 4)
    (8, 5120, 8192, 32): _C(64, 8, 128, 4, 3, 4, block_diag=True),  # 15.9 us
    (16, 5120, 8192, 32): _C(64, 16, 128, 4, 3, 4, block_diag=True),  # 18.0 us (3 stages, 2026-11-30)
    (64, 5120, 8192, 32): _C(64, 64, 128, 4, 4, 4, dequant=True, scale_ahead=2, residency_cap=True),  # 37.0 us (2026-11-30)
    (256, 5120, 8192, 32): _C(128, 128, 128, 1, 3, 8, dequant=True),  # 117.7 us
    (1 << 30, 5120, 8192, 32): _C(128, 128, 128, 1, 3, 8, dequant=True),  # 559.3 us
    (16, 5120, 8192, 128): _C(64, 16, 128, 4, 4, 4),  # 16.1 us
    (64, 5120, 8192, 128): _C(64, 64, 128, 4, 4, 4),  # 20.5 us
    (256, 5120, 8192, 128): _C(64, 64, 128, 1, 4, 4),  # 43.9 us
    (1 << 30, 5120, 8192, 128): _C(128, 64, 128, 1, 4, 4),  # 244.9 us
    # wo_b_tp4 5120x2048
    (4, 5120, 2048, 32): _C(64, 4, 128, 4, 3, 4, block_diag=True),  # 6.6 us (M = 1), 6.6 (M = 4)
    (8, 5120, 2048, 32): _C(64, 8, 128, 4, 3, 4, block_diag=True),  # 7.1 us
    (16, 5120, 2048, 32): _C(64, 16, 128, 4, 3, 4, block_diag=True),  # 8.2 us (3 stages, 2026-11-30)
    (64, 5120, 2048, 32): _C(64, 64, 128, 4, 4, 4, dequant=True, scale_ahead=2, residency_cap=True),  # 13.5 us (2026-11-30)
    (256, 5120, 2048, 32): _C(128, 128, 128, 1, 3, 8, dequant=True),  # 33.7 us
    (1 << 30, 5120, 2048, 32): _C(128, 128, 128, 1, 3, 8, dequant=True),  # 152.2 us
    (16, 5120, 2048, 128): _C(64, 16, 128, 4, 4, 4),  # 7.7 us
    (64, 5120, 2048, 128): _C(64, 64, 128, 1, 4, 4),  # 9.9 us
    (256, 5120, 2048, 128): _C(64, 64, 128, 1, 4, 4),  # 14.0 us
    (1 << 30, 5120, 2048, 128): _C(128, 128, 128, 1, 3, 8),  # 71.1 us
    # gate_up 4608x5120
    (4, 4608, 5120, 32): _C(64, 4, 128, 8, 3, 4, block_diag=True),  # 9.9 us (M = 1), 10.0 (M = 4)
    (8, 4608, 5120, 32): _C(64, 8, 128, 5, 3, 4, block_diag=True),  # 10.5 us
    (16, 4608, 5120, 32): _C(64, 16, 128, 5, 3, 4, block_diag=True),  # 11.4 us (3 stages, 2026-11-30)
    (64, 4608, 5120, 32): _C(64, 64, 128, 4, 3, 4, dequant=True, scale_ahead=2, residency_cap=True),  # 24.1 us (2026-11-30)
    (256, 4608, 5120, 32): _C(64, 64, 128, 1, 4, 4, residency_cap=True),  # 72.9 us
    (1 << 30, 4608, 5120, 32): _C(128, 128, 128, 1, 3, 8, dequant=True),  # 359.6 us
    (16, 4608, 5120, 128): _C(64, 16, 128, 5, 4, 4),  # 11.2 us
    (64, 4608, 5120, 128): _C(64, 64, 128, 4, 4, 4),  # 15.1 us
    (256, 4608, 5120, 128): _C(64, 64, 128, 1, 4, 4),  # 28.6 us
    (1 << 30, 4608, 5120, 128): _C(128, 64, 128, 1, 4, 4),  # 158.2 us
    # down 5120x2304
    (4, 5120, 2304, 32): _C(64, 4, 128, 6, 3, 4, block_diag=True),  # 7.0 us (M = 1), 7.1 (M = 4)
    (8, 5120, 2304, 32): _C(64, 8, 128, 3, 3, 4, block_diag=True),  # 7.8 us
    (16, 5120, 2304, 32): _C(64, 16, 128, 3, 3, 4, block_diag=True),  # 8.2 us (3 stages, 2026-11-30)
    (64, 5120, 2304, 32): _C(64, 64, 128, 3, 3, 4, dequant=True, scale_ahead=1),  # 13.5 us (2026-11-30)
    (256, 5120, 2304, 32): _C(64, 64, 128, 1, 4, 4, residency_cap=True),  # 36.1 us
    (1 << 30, 5120, 2304, 32): _C(128, 256, 64, 1, 3, 8, dequant=True),  # 166.9 us
    (16, 5120, 2304, 128): _C(64, 16, 128, 3, 4, 4),  # 7.9 us
    (64, 5120, 2304, 128): _C(64, 64, 128, 3, 4, 4),  # 10.4 us
    (256, 5120, 2304, 128): _C(64, 64, 128, 1, 4, 4),  # 15.1 us
    (1 << 30, 5120, 2304, 128): _C(128, 64, 128, 1, 4, 4),  # 79.7 us
    # TP4 shards (32-groups), H200 sweep 2026-12-03 10:14 UTC (--shapes gate_up_tp4,wq_b_tp4,down_tp4
    # --ms 64,16,8,4,256,2048 --stages 3,4, every mode; benchmark/results/gemm_sweep_tp4_shards_4a8accb.json):
    # until then the heuristic ran them (in brackets). At M = 64 block-diagonal dots on 16- or 32-token
    # tiles beat the dequantized 64-token tile: more programs for these narrow N / short K problems.
    # gate_up_tp4 1152x5120 (M = 256: the heuristic's 30.5 us beat every candidate)
    (4, 1152, 5120, 32): _C(64, 4, 128, 10, 4, 4, block_diag=True),  # 5.2 us (5.4)
    (8, 1152, 5120, 32): _C(64, 8, 128, 10, 3, 4, block_diag=True),  # 5.5 us (6.4)
    (16, 1152, 5120, 32): _C(64, 16, 128, 10, 4, 4, block_diag=True),  # 6.8 us (7.3)
    (64, 1152, 5120, 32): _C(64, 16, 128, 5, 3, 4, block_diag=True),  # 10.2 us (13.7)
    (1 << 30, 1152, 5120, 32): _C(128, 256, 64, 1, 3, 8, dequant=True),  # 127.1 us (128.9)
    # wq_b_tp4 8192x1280
    (4, 8192, 1280, 32): _C(64, 4, 256, 1, 4, 4, block_diag=True),  # 5.9 us (6.7)
    (8, 8192, 1280, 32): _C(64, 8, 256, 1, 3, 4, block_diag=True),  # 6.3 us (7.5)
    (16, 8192, 1280, 32): _C(64, 16, 256, 1, 3, 4, block_diag=True),  # 7.2 us (8.5)
    (64, 8192, 1280, 32): _C(64, 32, 128, 1, 4, 4, block_diag=True),  # 10.8 us (12.8)
    (256, 8192, 1280, 32): _C(128, 128, 128, 1, 3, 8, dequant=True),  # 23.0 us (31.7)
    (1 << 30, 8192, 1280, 32): _C(128, 256, 64, 1, 3, 8, dequant=True),  # 130.5 us (163.6)
    # down_tp4 5120x576 (K = 9 x 64: 64-column K steps, sweep 2026-12-03 11:54 UTC, --block-k 32,64,
    # benchmark/results/gemm_sweep_down_tp4_9e1e28c.json; M <= 4: the GEMV's 4.4 us at M = 4; M = 256:
    # no candidate)
    (4, 5120, 576, 32): _C(64, 8, 64, 1, 4, 4, block_diag=True),  # 3.1 us (GEMV 4.4)
    (8, 5120, 576, 32): _C(64, 8, 64, 1, 4, 4, block_diag=True),  # 3.0 us (6.4)
    (16, 5120, 576, 32): _C(64, 16, 64, 1, 4, 4, block_diag=True),  # 3.8 us (6.4)
    # M = 64 from HBM (sweeps 8673d4a, 9fd5e66): 6.1 / 5.8 us, the 128 x 32 tile of 11:54 UTC 6.5 / 6.5
    (64, 5120, 576, 32): _C(64, 16, 64, 1, 3, 4, block_diag=True),
    (1 << 30, 5120, 576, 32): _C(128, 256, 64, 1, 3, 8, dequant=True),  # 49.9 us (53.3)
}

_M_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 1 << 30)
# a bucket without a table entry takes this bucket's, its M tile narrowed to the bucket (never
# below 16: only the block-diagonal mode runs narrower tiles, and those have entries of their own)
_BORROWED = {4: 16, 8: 16, 32: 64, 128: 256}


def _m_bucket(m: int) -> int:
    for bucket in _M_BUCKETS:
        if m <= bucket:
            return bucket
    return _M_BUCKETS[-1]


def _heuristic_config(m: int, n: int, k: int, group: int, sms: int, a_fp8: bool = True) -> GemmConfig:
    """For shapes outside the table; shaped after what won the H200 sweeps: 32-groups (power-of-two
    scales) run block-diagonal FP8 dots for FP8 tokens at M <= 16 (token tiles as narrow as M, at
    least 4) and bf16-dequantized operands otherwise, 128-groups the FP8 dot; small M splits K."""
    bk = 128 if k % 128 == 0 else group
    block_diag = group == 32 and a_fp8 and m <= 16 and bk == 128
    dequant = group == 32 and not block_diag
    if m <= 64:
        # the block-diagonal dot is SUB x block_m >= 16 columns wide: 4-token tiles suffice
        block_m, block_n, stages, warps = max(4 if block_diag else 16, triton.next_power_of_2(m)), 64, 4, 4
    elif m <= 256:
        block_m, block_n, stages, warps = 64, 64, 4, 4
    elif dequant:
        block_m, block_n, stages, warps = 128, 128, 3, 8
    else:
        block_m, block_n, stages, warps = 64, 128, 4, 4
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    iters = cdiv(k, bk)
    split = 1
    # Split K until there are about two programs per SM, keeping >= 4 K iterations per slice.
    while tiles * split < 2 * sms and iters // (split * 2) >= 4 and split < 8:
        split *= 2
    return GemmConfig(block_n, block_m, bk, split, stages, warps, 8, dequant=dequant, block_diag=block_diag)


def select_config(m: int, n: int, k: int, group: int, device: torch.device, a_fp8: bool = True) -> GemmConfig:
    """The launch config for an ``m x n x k`` problem with K groups of ``group`` columns: the
    table entry of M's bucket (``_BORROWED``: buckets without entries take a larger bucket's),
    else the heuristic."""
    if a_fp8:
        bucket = _m_bucket(m)
        hit = CONFIG_TABLE.get((bucket, n, k, group))
        if hit is None and bucket in _BORROWED:
            hit = CONFIG_TABLE.get((_BORROWED[bucket], n, k, group))
            if hit is not None:
                # the narrowed tile takes the entry's cap at an aligned stride, whatever its stride
                # (none under Triton 3.6: 137 registers at 32 rows, far from the residency line);
                # a per-group entry's two row tiles at M <= 128 fit one wave at two programs per SM
                cap = m64_register_cap(ALIGNED_SCALE_STRIDE) if hit.residency_cap and hit.dequant else hit.max_regs
                hit = hit._replace(block_m=min(hit.block_m, max(bucket, 16)), max_regs=cap, residency_cap=False)
        if hit is not None and k % hit.block_k == 0:
            return hit
    return _heuristic_config(m, n, k, group, sm_count(device, interpreter=4), a_fp8)  # CPU tests: split-K


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

def input_format_for_block(weight_block: int) -> ActFormat:
    """The SM90 activation format the Triton GEMM reads for ``weight_block`` x ``weight_block``
    weight blocks."""
    if is_int(weight_block) and weight_block == 32:
        return ActFormat.SM90_G32_FP32_MN
    if is_int(weight_block) and weight_block == 128:
        return ActFormat.SM90_G128_FP32_MN
    raise ValueError(f"weight_block must be the int 32 or 128, got {weight_block!r}")


def check_block_scaled(weight: torch.Tensor, weight_scale: torch.Tensor, weight_block: int) -> tuple[int, int]:
    """An e4m3 ``[N, K]`` weight with fp32 ``[ceil(N/b), ceil(K/b)]`` block scales (the checkpoint
    format, whatever reads it); returns ``(N, K)``."""
    if weight.dtype != FP8_DTYPE:
        raise TypeError(f"weight must be {FP8_DTYPE}, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if weight_scale.dtype != torch.float32:
        raise TypeError(f"weight_scale must be float32, got {weight_scale.dtype}")
    n, k = weight.shape
    want = (cdiv(n, weight_block), cdiv(k, weight_block))
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"weight {n}x{k} with {weight_block}x{weight_block} blocks needs scales {want}, "
                         f"got {tuple(weight_scale.shape)}")
    return n, k


def check_weight(weight: torch.Tensor, weight_scale: torch.Tensor, weight_block: int) -> tuple[int, int]:
    """Validate an e4m3 ``[N, K]`` weight and its fp32 block scales as this kernel reads them;
    return ``(N, K)``."""
    n, k = check_block_scaled(weight, weight_scale, weight_block)
    if weight.numel() and weight.stride(1) != 1:
        raise ValueError(f"weight must have unit column stride, got strides {weight.stride()}")
    if weight_scale.device != weight.device:
        raise ValueError(f"weight on {weight.device} but weight_scale on {weight_scale.device}")
    if k % weight_block:
        raise ValueError(f"K={k} must be a multiple of the {weight_block}-column group")
    if k == 0:  # the kernels prefetch the first K block's scales unconditionally
        raise ValueError("K=0: the weight has no columns to multiply")
    return n, k


def _prepare_out(out: torch.Tensor | None, m: int, n: int, device, inputs) -> torch.Tensor:
    """A caller's bf16 ``[m, n]`` output (unit column stride, one location per element, apart from
    the named ``inputs``) or a fresh one."""
    if out is None:
        return torch.empty((m, n), dtype=torch.bfloat16, device=device)
    check_rows(out, "out", (m, n), torch.device(device))
    check_no_overlap([("out", out)], inputs)
    return out


def _operands(pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor) -> list:
    """A GEMM's named inputs, which its outputs must not overlap."""
    return pair_parts(pair, "a") + [("weight", weight), ("weight_scale", weight_scale)]


def _split_plan(tiles: int, k: int, cfg: GemmConfig, device):
    """``(split, iters_per_split, workspace, counters)`` for ``tiles`` output tiles: the largest
    divisor of the K iterations up to the config's split (``launch.split_workspace``: 1 where
    there are more tiles than arrival counters); workspace and counters are None without a split."""
    iters = k // cfg.block_k
    split = max(1, min(cfg.split, iters))
    while iters % split:  # equal slices
        split -= 1
    split, part, counters = split_workspace("gemm", split, tiles, cfg.block_n * cfg.block_m, device)
    return split, iters // split, part, counters


def _check_config(cfg: GemmConfig, k: int, group: int, a_fp8: bool) -> None:
    """A config the kernels can run for K in groups of ``group`` (ValueError otherwise; TypeError
    for anything but a ``GemmConfig``)."""
    if not isinstance(cfg, GemmConfig):
        gemv_note = " (the GEMV reads FP8 pairs only)" if isinstance(cfg, GemvConfig) else ""
        raise TypeError(f"config must be a GemmConfig{gemv_note}, got {type(cfg).__name__}")
    counts = (cfg.block_n, cfg.block_m, cfg.block_k, cfg.split, cfg.stages, cfg.warps, cfg.tile_group)
    # a zero tile_group would divide by zero in the tile order; the tiles and warps are aranges
    powers = (cfg.block_n, cfg.block_m, cfg.block_k, cfg.warps)
    if any(not is_int(v) or v < 1 for v in counts) or any(v & (v - 1) for v in powers):
        raise ValueError(f"GemmConfig needs positive ints for block_n .. tile_group, with block_n, block_m, "
                         f"block_k and warps powers of two, got {cfg}")
    if not all(isinstance(flag, bool) for flag in (cfg.dequant, cfg.block_diag, cfg.residency_cap)):
        raise ValueError(f"GemmConfig dequant, block_diag and residency_cap must be bools, got {cfg}")
    if k % cfg.block_k or cfg.block_k % group:
        raise ValueError(f"config block_k={cfg.block_k} must divide K={k} and be a multiple of {group}")
    if cfg.block_diag and (cfg.dequant or not a_fp8):
        raise ValueError("a block_diag config runs FP8 dots on an FP8 pair: not with dequant=True or W8A16")
    if cfg.scale_ahead is not None and not 0 <= cfg.scale_ahead <= 4:
        raise ValueError(f"config scale_ahead must be None or 0..4, got {cfg.scale_ahead}")
    if cfg.max_regs is not None and not (is_int(cfg.max_regs) and 24 <= cfg.max_regs <= 255):
        raise ValueError(f"config max_regs must be None or 24..255 registers per thread, got {cfg.max_regs}")


def _launch_residency(cfg: GemmConfig, a_scale: torch.Tensor | None, programs: int,
                      silu_mul_epilogue: bool = False) -> tuple[dict, bool]:
    """The compile options a config sets beyond its warps (none under the interpreter) and the
    kernel's PADDED_SCALE_ROWS, for a launch of ``programs`` programs over the token scales
    ``a_scale`` ``[M, groups]`` (None: W8A16, no token scales). A ``residency_cap`` entry keeps three 4-warp programs per SM
    (docs/gemm.md, "Register caps"): a bf16-dequantized one (the M = 64 entries) where
    ``m64_register_cap`` caps it; a per-group FP8 one (the M-bucket-256 entries) reads the token
    scales padded to align4(M) where M is not a multiple of 16 and its programs would need a second
    wave at two per SM (M = 193-255, where it compiles in 182-255 registers otherwise) and their
    storage holds those rows, and takes ``bucket256_register_cap``'s cap for the launch
    (``silu_mul_epilogue``: the gate_up GEMM writing SiLU*mul)."""
    scale_stride = 0 if a_scale is None else a_scale.stride(1)
    per_group = a_scale is not None and cfg.residency_cap and not (cfg.dequant or cfg.block_diag)
    padded = (per_group and a_scale.shape[0] % 16 != 0 and programs > 2 * sm_count(a_scale.device, interpreter=4)
              and holds_padded_scale_rows(a_scale))
    if interpreting():
        return {}, padded
    cap = cfg.max_regs
    if cap is None and cfg.residency_cap:
        if cfg.dequant:
            cap = m64_register_cap(scale_stride)
        elif per_group:
            cap = bucket256_register_cap(padded, silu_mul_epilogue)
    return {"num_stages": cfg.stages, **({} if cap is None else {"maxnreg": cap})}, padded


def _launch(a, a_scale, weight, weight_scale, out, group: int, a_fp8: bool, config: GemmConfig | None):
    m, k = a.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return out
    cfg = config or select_config(m, n, k, group, a.device, a_fp8)
    _check_config(cfg, k, group, a_fp8)
    tiles = cdiv(n, cfg.block_n) * cdiv(m, cfg.block_m)
    split, iters_per_split, part, counters = _split_plan(tiles, k, cfg, a.device)
    extra, padded = _launch_residency(cfg, a_scale, tiles * split)
    if a_scale is None:
        a_scale, stride_asm, stride_asg = a, 0, 0
    else:
        stride_asm, stride_asg = a_scale.stride(0), a_scale.stride(1)
    _block_scaled_gemm_kernel[(tiles, split)](
        a, a_scale, weight, weight_scale, out, out if part is None else part, out if counters is None else counters,
        m, n, k,
        a.stride(0), stride_asm, stride_asg, weight.stride(0),
        weight_scale.stride(0), weight_scale.stride(1), out.stride(0),
        GROUP=group, A_FP8=a_fp8, SPLIT=split, ITERS=iters_per_split, DEQUANT=cfg.dequant,
        BLOCK_DIAG=cfg.block_diag, SCALE_AHEAD=cfg.scale_prefetch(), FP32_DOT=interpreting(),
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, TILE_GROUP=cfg.tile_group,
        PADDED_SCALE_ROWS=padded, num_warps=cfg.warps, **extra, **pdl_options(a.device),
    )
    return out


def _pair_operand(a, weight_block: int, fmt) -> QuantizedActivation:
    """The GEMM's activation as a pair in the format ``weight_block`` reads: ``a`` itself, or a bf16
    ``a`` quantized into ``fmt`` (which must be that format)."""
    want = input_format_for_block(weight_block)
    if isinstance(a, QuantizedActivation):
        check_pair(a)
        if fmt is not None and ActFormat(fmt) is not a.fmt:
            raise TypeError(f"fmt={ActFormat(fmt).value} given with a pair in {a.fmt.value}")
        if a.fmt is not want:
            raise TypeError(f"fp8_gemm with {weight_block}x{weight_block} weight blocks reads "
                            f"{want.value}, got a pair in {a.fmt.value}")
        return a
    if fmt is None:
        raise TypeError("fp8_gemm on a plain tensor needs fmt= (the format to quantize into)")
    if ActFormat(fmt) is not want:
        raise TypeError(f"fp8_gemm with {weight_block}x{weight_block} weight blocks reads "
                        f"{want.value}, got fmt={ActFormat(fmt).value}")
    check_activation(a, "a")
    return quantize(a, want)


def _check_operands(pair: QuantizedActivation, weight, weight_scale, weight_block: int) -> tuple[int, int, int]:
    """``(M, N, K)`` of ``pair`` times ``weight`` (ValueError / TypeError on a mismatch)."""
    n, k = check_weight(weight, weight_scale, weight_block)
    m, ka = pair.data.shape
    if ka != k:
        raise ValueError(f"activation has K={ka}, weight has K={k}")
    if pair.data.device != weight.device:
        raise ValueError(f"activation on {pair.data.device}, weight on {weight.device}")
    return m, n, k


def fp8_gemm(a: QuantizedActivation | torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
             weight_block: int, fmt: ActFormat | str | None = None, out: torch.Tensor | None = None,
             config: GemmConfig | None = None) -> torch.Tensor:
    """bf16 ``[M, N]`` = dequant(a) @ dequant(weight)^T.

    ``a``: a ``QuantizedActivation`` in the format ``weight_block`` reads (32 ->
    ``sm90_g32_fp32_mn``, 128 -> ``sm90_g128_fp32_mn``), used exactly as written; or a bf16/fp32
    ``[M, K]`` tensor together with ``fmt``, quantized first (the unchained baseline).
    A pair (or ``fmt``) of another format raises ``TypeError`` naming both formats.
    ``out``: optional caller buffer (bf16 ``[M, N]``, unit column stride). ``config``: override
    the tables (benchmarks, tests): a ``GemmConfig``, or a ``gemv.GemvConfig`` for 1 to
    ``gemv.MAX_GEMV_TOKENS`` tokens. Those M run ``gemv`` where ``gemv.GEMV_TABLE`` holds the problem.
    """
    pair = _pair_operand(a, weight_block, fmt)
    m, n, k = _check_operands(pair, weight, weight_scale, weight_block)
    out = _prepare_out(out, m, n, weight.device, _operands(pair, weight, weight_scale))
    cfg = config or gemm_config(m, n, k, weight_block, weight.device)
    if isinstance(cfg, GemvConfig):  # launch_gemv refuses M outside 1..MAX_GEMV_TOKENS
        return launch_gemv(pair.data, pair.scale, weight, weight_scale, out, weight_block, cfg)
    return _launch(pair.data, pair.scale, weight, weight_scale, out, weight_block, True, cfg)


# From this many accumulator elements per tile up, the SiLU*mul epilogue runs 8 warps (see
# fp8_gemm_silu_mul); with them the DSv4.1 gate_up took longer than the GEMM plus act.silu_mul on
# the H200 (M = 64: 30.8 vs 26.7 us, M = 2048: 368 vs 364 us; smaller tiles 0.7-1.7 us faster).
SILU_MUL_WIDE_TILE = 128 * 64
# Token tiles of 16 columns (M = 9..16): in the DSv4.1 layer step the GEMM plus the SiLU*mul launch
# measured 1.0-1.5 us faster than the epilogue (TP1 and TP4, each variant captured twice, H200,
# 2026-12-01), though alone the epilogue is faster; at 4, 8 and 32-64 columns the epilogue was
# 0.3-1.5 us faster in the step. Both kernels take 160-162 registers per thread there; the cause
# was not measured (likely: the epilogue keeps each tile's last program on its SM longer while the
# mHC stats on the side stream wait for room).
SILU_MUL_LAUNCH_TOKEN_TILES = (16,)


def gemm_config(m: int, n: int, k: int, group: int, device: torch.device) -> GemmConfig | GemvConfig:
    """The launch ``fp8_gemm`` runs for an ``m x n x k`` problem on an FP8 pair: the GEMV's
    config where ``select_gemv`` holds the problem, else the tensor-core GEMM's (``select_config``)."""
    return select_gemv(m, n, k, group) or select_config(m, n, k, group, device)


def silu_mul_epilogue_pays(config: GemmConfig | GemvConfig) -> bool:
    """Whether ``fp8_gemm_silu_mul`` with ``config`` (``gemm_config`` of the gate_up problem) beats
    ``fp8_gemm`` + ``act.silu_mul``: never on the GEMV (there it is those two calls), on the GEMM
    where its tile is narrower than ``SILU_MUL_WIDE_TILE`` and its token tile not one of
    ``SILU_MUL_LAUNCH_TOKEN_TILES``."""
    if isinstance(config, GemvConfig):
        return False
    return (config.block_n * config.block_m < SILU_MUL_WIDE_TILE
            and config.block_m not in SILU_MUL_LAUNCH_TOKEN_TILES)


def fp8_gemm_silu_mul(a: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor, *,
                      weight_block: int, limit: float | None = None, out_format: ActFormat | str | None = None,
                      out: QuantizedActivation | None = None, out_bf16: torch.Tensor | None = None,
                      return_bf16: bool = True, config: GemmConfig | GemvConfig | None = None):
    """``act.silu_mul(fp8_gemm(a, weight, ...), limit=limit, out_format=...)``, bit for bit: the
    gate_up sums are the ones ``fp8_gemm`` writes with the same config (``config``, else
    ``gemm_config``'s). On the tensor-core GEMM in one launch; on the GEMV (a ``GemvConfig``) in two,
    the GEMV, then ``act.silu_mul`` (a one-token GEMV epilogue measured slower than the two
    launches: docs/gemm.md).

    ``weight`` is a gate_up projection, e4m3 ``[2I, K]``: gate rows ``0 .. I``, up rows
    ``I .. 2I`` (32- or 128-row weight blocks, so I a multiple of the block). ``a`` is an FP8 pair
    as for ``fp8_gemm``. Each program's tile takes BLOCK_N / 2 gate rows and the matching up rows,
    so its epilogue rounds the gate_up product to bf16 (the bf16 GEMM's output, bit for bit: the
    same per-element sums), applies ``act.swiglu``, rounds ``y [M, I]`` and writes it the way
    ``act.silu_mul`` does: bf16 ``y``, ``(y, pair)`` or the pair alone (``return_bf16=False``), the
    pair in ``out_format`` equal to ``reference.quantize(y)``. The outputs and their buffers
    (``out``, ``out_bf16``) follow ``norm.rms_norm``'s convention.
    """
    if not isinstance(a, QuantizedActivation):
        raise TypeError(f"fp8_gemm_silu_mul reads an FP8 pair, got {type(a).__name__}")
    pair = _pair_operand(a, weight_block, None)
    m, n, k = _check_operands(pair, weight, weight_scale, weight_block)
    if n % (2 * weight_block):
        raise ValueError(f"gate_up weight must have 2I rows with I a multiple of the {weight_block}-row "
                         f"block, got N={n}")
    check_limit(limit)
    inter = n // 2
    fmt, out_pair, y = resolve_outputs(m, inter, weight.device, out_format, out, out_bf16, return_bf16)
    check_no_overlap(produced(out_pair, y), _operands(pair, weight, weight_scale))
    if m == 0 or inter == 0:
        return producer_result(y, out_pair)
    cfg = config or gemm_config(m, n, k, weight_block, weight.device)
    if isinstance(cfg, GemvConfig):  # the operands are checked: fp8_gemm's GEMV launch itself
        gate_up = torch.empty((m, n), dtype=torch.bfloat16, device=weight.device)
        launch_gemv(pair.data, pair.scale, weight, weight_scale, gate_up, weight_block, cfg)
        return silu_mul(gate_up, limit=limit, out_format=fmt, out=out_pair, out_bf16=y, return_bf16=y is not None)
    _check_config(cfg, k, weight_block, True)
    if fmt is not None and cfg.block_n < 2 * fmt.group_size:  # whole quantization groups per tile
        cfg = cfg._replace(block_n=2 * fmt.group_size)
    if cfg.block_n * cfg.block_m >= SILU_MUL_WIDE_TILE:  # the epilogue's registers: no spill on sm_90
        cfg = cfg._replace(warps=max(cfg.warps, 8))  # with 8 warps (each sum is the same for any count)
    tiles = cdiv(inter, cfg.block_n // 2) * cdiv(m, cfg.block_m)
    split, iters_per_split, part, counters = _split_plan(tiles, k, cfg, weight.device)
    args = launch_args(fmt, out_pair, y, pair.data)
    extra, padded = _launch_residency(cfg, pair.scale, tiles * split, silu_mul_epilogue=True)
    consts = args["consts"]
    _gemm_silu_mul_kernel[(tiles, split)](
        pair.data, pair.scale, weight, weight_scale, args["y"], args["data"], args["scale"],
        pair.data if part is None else part, pair.data if counters is None else counters,
        m, inter, k, float(limit) if limit is not None else 0.0,
        pair.data.stride(0), pair.scale.stride(0), pair.scale.stride(1), weight.stride(0),
        weight_scale.stride(0), weight_scale.stride(1), args["y_stride"], *args["strides"],
        GROUP=weight_block, SPLIT=split, ITERS=iters_per_split, DEQUANT=cfg.dequant, BLOCK_DIAG=cfg.block_diag,
        SCALE_AHEAD=cfg.scale_prefetch(), FP32_DOT=interpreting(), BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k,
        TILE_GROUP=cfg.tile_group, HAS_LIMIT=limit is not None, STORE_BF16=args["STORE_BF16"],
        QUANT=args["QUANT"], QGROUP=consts["GROUP"], POW2=consts["POW2"], PACKED=consts["PACKED"],
        PADDED_SCALE_ROWS=padded, num_warps=cfg.warps, **extra, **pdl_options(weight.device),
    )
    return producer_result(y, out_pair)


def w8a16_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *, weight_block: int,
               out: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """bf16 ``[M, N]`` = x @ dequant(weight)^T with bf16 ``x`` (the FP8 weights are widened to bf16
    in the kernel: each K block's partial product scaled by its weight scale in fp32, or, in the
    dequantized mode the 32x32 blocks take, each weight scaled to bf16 before the product, exact
    for their power-of-two scales)."""
    check_activation(x, "x")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"w8a16_gemm reads bfloat16 activations, got {x.dtype}")
    if not is_int(weight_block) or weight_block not in (32, 128):
        raise ValueError(f"weight_block must be the int 32 or 128, got {weight_block!r}")
    n, k = check_weight(weight, weight_scale, weight_block)
    m, kx = x.shape
    if kx != k:
        raise ValueError(f"x has K={kx}, weight has K={k}")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}")
    out = _prepare_out(out, m, n, weight.device, [("x", x), ("weight", weight), ("weight_scale", weight_scale)])
    return _launch(x, None, weight, weight_scale, out, weight_block, False, config)


def load_table(path) -> None:
    """Replace ``CONFIG_TABLE`` and ``gemv.GEMV_TABLE`` with the best configs of a
    ``benchmark/gemm.py --sweep`` JSON (records of ``kind`` "gemv" go to the GEMV table)."""
    import json

    records = json.loads(open(path).read())["records"]
    CONFIG_TABLE.clear()
    GEMV_TABLE.clear()
    for r in records:
        if r.get("kind") == "gemv":
            GEMV_TABLE[(gemv_token_tile(r["m"]), r["n"], r["k"], r["group"])] = GemvConfig(*r["best"])
        else:
            CONFIG_TABLE[(_m_bucket(r["m"]), r["n"], r["k"], r["group"])] = GemmConfig(*r["best"])


if os.environ.get("FP8CHAIN_GEMM_NO_TABLE") == "1":  # benchmarks: measure the heuristic alone
    CONFIG_TABLE.clear()
    GEMV_TABLE.clear()
elif os.environ.get("FP8CHAIN_GEMM_TABLE"):  # a sweep's JSON (benchmark/gemm.py --sweep --json-out)
    load_table(os.environ["FP8CHAIN_GEMM_TABLE"])
