"""FP8 GEMV for one to four tokens: ``QuantizedActivation`` rows times block-scaled FP8 weights, bf16 out.

``gemm.fp8_gemm`` runs this kernel in place of its tensor-core GEMM when M <= ``MAX_GEMV_TOKENS``
and ``GEMV_TABLE`` holds the problem (token tile, N, K, group): the shapes where the H200 measured
it faster (docs/gemm.md). The token tile is M rounded up to a power of two (1, 2 or 4; rows past
M are masked). The operands are ``fp8_gemm``'s:

* activation: e4m3 ``[M, K]`` with unit column stride and its fp32 scales, one per ``group``
  columns (``SM90_G32_FP32_MN`` for 32-groups, ``SM90_G128_FP32_MN`` for 128);
* weight: e4m3 ``[N, K]`` with unit column stride, fp32 scales ``[N / group, K / group]``;
* out: bf16 ``[M, N]``, unit column stride.

One program reads ``BLOCK_N`` whole weight rows in ``BLOCK_K``-column steps, for every token.
``BLOCK_N`` divides ``group``, so the rows of a program share one row of weight blocks. Each lane
holds ``CHUNK`` (16) consecutive columns of a row: it sums their 16 products ``w * a`` (exact in
fp32: two e4m3 values) and adds that sum times the column group's ``s_a[m, g] * s_w[n // group,
g]`` to its accumulator, so a weight costs one conversion and one FMA per token on the CUDA cores
(at M <= 4 a tensor-core tile would be at most 1/4 full), a chunk of 16 one scaled FMA per row and
token, and an activation its conversion only. One tree per output sums the lanes' accumulators
(deterministic). Small programs (``BLOCK_N`` of 2-32 rows: 320-2560 programs for the DSv4.1 shapes)
keep enough loads in flight to stream the weights, which a decode GEMM's K loop of dependent steps
does not (docs/gemm.md). Reference: ``reference.fp8_gemm``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .formats import is_int
from .fp8_tile import e4m3_to_f32_exact, interpreting, round_bf16
from .launch import await_producer, pdl_options

__all__ = ["GemvConfig", "GEMV_TABLE", "MAX_GEMV_TOKENS", "gemv_token_tile", "select_gemv", "launch_gemv"]

MAX_GEMV_TOKENS = 4


class GemvConfig(NamedTuple):
    """One GEMV launch: weight rows and columns per step of a program, warps, load pipeline depth."""

    block_n: int
    block_k: int
    warps: int = 2
    stages: int = 3


# (token tile, N, K, group) -> config, from the H200 sweep of the chunked kernel
# (benchmark/results/gemm_sweep_gemv_chunked_2cb3a7b.json: benchmark/gemm.py --sweep --ms 1,2,4 --modes
# gemv,block_diag, which times the candidates beside the tensor-core GEMM's; docs/gemm.md), the fastest
# config with pipelined loads where one is within ~0.4 us of the fastest; a problem not listed runs the
# GEMM: at two tokens wq_b and the shared gate_up (whose GEMM writes SiLU*mul in its epilogue, which
# the GEMV does not: docs/gemm.md), at four tokens all (the TP4 down shard since its GEMM table
# entry: 3.1 against 4.4 us). us, GEMV against the GEMM's best:
GEMV_TABLE: dict[tuple[int, int, int, int], GemvConfig] = {
    (1, 1792, 5120, 32): GemvConfig(2, 1024, 2, 3),  # wqkv_a: 4.9 against 6.5
    (1, 32768, 1280, 32): GemvConfig(32, 256, 2, 3),  # wq_b: 12.8 against 13.4
    (1, 5120, 8192, 32): GemvConfig(8, 1024, 4, 3),  # wo_b: 12.7 against 14.7
    (1, 4608, 5120, 32): GemvConfig(8, 1024, 4, 3),  # shared gate_up: 8.4 against 9.9
    (1, 5120, 2304, 32): GemvConfig(4, 512, 2, 3),  # shared down: 5.9 against 6.9
    (1, 5120, 2048, 32): GemvConfig(2, 2048, 4, 3),  # wo_b, TP4 shard: 4.8 against 6.7
    (1, 8192, 1280, 32): GemvConfig(8, 256, 2, 3),  # wq_b, TP4 shard: 4.9 against 6.8
    (1, 1152, 5120, 32): GemvConfig(4, 1024, 4, 3),  # shared gate_up, TP4 shard: 3.5 against 5.1
    # shared down, TP4 shard: 3.0 from HBM (two sweeps, 8673d4a and 9fd5e66; 16 x 1024: 3.2; the GEMM: 6.4)
    (1, 5120, 576, 32): GemvConfig(8, 1024, 8, 3),
    (2, 1792, 5120, 32): GemvConfig(4, 1024, 2, 3),  # wqkv_a: 5.6 against 6.6
    (2, 5120, 8192, 32): GemvConfig(8, 1024, 4, 3),  # wo_b: 14.2 against 15.0
    (2, 5120, 2304, 32): GemvConfig(8, 512, 2, 3),  # shared down: 6.6 against 7.0
    (2, 5120, 2048, 32): GemvConfig(4, 512, 2, 3),  # wo_b, TP4 shard: 5.5 against 6.6
    (2, 8192, 1280, 32): GemvConfig(16, 256, 2, 3),  # wq_b, TP4 shard: 5.8 against 7.0
    (2, 1152, 5120, 32): GemvConfig(2, 1024, 2, 3),  # shared gate_up, TP4 shard: 4.5 against 5.1
    # shared down, TP4 shard: 3.5 from HBM (the same two sweeps; unpipelined: 4.0; the GEMM: 6.2)
    (2, 5120, 576, 32): GemvConfig(8, 256, 2, 3),
}


def gemv_token_tile(m: int) -> int:
    """The kernel's token tile for M tokens, 1 <= M <= ``MAX_GEMV_TOKENS``: M up to a power of two."""
    if not is_int(m) or not 1 <= m <= MAX_GEMV_TOKENS:
        raise ValueError(f"the GEMV runs 1 to {MAX_GEMV_TOKENS} tokens, got M = {m}")
    return triton.next_power_of_2(m)


def select_gemv(m: int, n: int, k: int, group: int) -> GemvConfig | None:
    """The GEMV config for an ``m x n x k`` problem in ``group``-column groups, or None where the
    tensor-core GEMM runs (M outside 1..``MAX_GEMV_TOKENS``, or a problem outside ``GEMV_TABLE``)."""
    if not 1 <= m <= MAX_GEMV_TOKENS:
        return None
    return GEMV_TABLE.get((gemv_token_tile(m), n, k, group))


def check_gemv_config(cfg: GemvConfig, group: int) -> None:
    """A config the kernel can run for ``group``-column groups (ValueError otherwise)."""
    if not isinstance(cfg, GemvConfig):
        raise TypeError(f"config must be a GemvConfig, got {type(cfg).__name__}")
    bn, bk, warps, _ = cfg
    if any(not is_int(v) or v < 1 for v in cfg):
        raise ValueError(f"GemvConfig fields must be positive ints, got {cfg}")
    if group % bn or bn & (bn - 1) or bk % group or bk & (bk - 1) or warps & (warps - 1):
        raise ValueError(f"GemvConfig needs block_n a power of two dividing {group}, block_k a power of two "
                         f"multiple of {group} and a power-of-two warp count, got {cfg}")


# Columns each lane sums before applying their group's two scales: one 16-byte FP8 load per lane.
CHUNK = tl.constexpr(16)


@triton.jit
def _token_exists(t: tl.constexpr, M):
    """Whether token ``t`` is one of the M rows (token 0 always is: no predicate for it)."""
    return (t == 0) or (t < M)


@triton.jit
def _token_fma(acc, w, w_scale, a_ptr, a_scale_ptr, t: tl.constexpr, M, stride_am, stride_asm, stride_asg,
               offs_k, k_ok, offs_g, g_ok, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EXACT_CAST: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_K / CHUNK]`` plus token ``t``'s step (nothing past M): each ``CHUNK``
    of ``w * a`` summed (exact products of two e4m3 values), times its column group's ``s_a * s_w``."""
    row_ok = _token_exists(t, M)
    a = tl.load(a_ptr + t * stride_am + offs_k, mask=k_ok & row_ok, other=0.0)
    scale = tl.load(a_scale_ptr + t * stride_asm + offs_g * stride_asg, mask=g_ok & row_ok, other=0.0) * w_scale
    a = e4m3_to_f32_exact(a) if EXACT_CAST else a.to(tl.float32)
    chunks = tl.sum(tl.reshape(w * a[None, :], (BLOCK_N, BLOCK_K // CHUNK, CHUNK)), axis=2)
    chunk_scale = tl.reshape(tl.broadcast_to(scale[:, None], (BLOCK_K // GROUP, GROUP // CHUNK)), (BLOCK_K // CHUNK,))
    return acc + chunks * chunk_scale[None, :]


@triton.jit
def _store_token(y_ptr, acc, t: tl.constexpr, M, stride_ym, offs_n, n_ok, EXACT_CAST: tl.constexpr):
    """Token ``t``'s outputs (the sum over the accumulator's lanes, rounded to bf16) if ``t < M``."""
    row_ok = _token_exists(t, M)
    tl.store(y_ptr + t * stride_ym + offs_n, round_bf16(tl.sum(acc, axis=1), EXACT_CAST), mask=n_ok & row_ok)


@triton.jit
def _gemv_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, y_ptr, M, N, stride_am, stride_asm, stride_asg,
                 stride_wn, stride_wsn, stride_ym, K: tl.constexpr, GROUP: tl.constexpr, TOKENS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, EXACT_CAST: tl.constexpr,
                 PDL: tl.constexpr):
    # one 2-D accumulator per token (not one 3-D tile: broadcasting the weight tile over a token
    # axis cost a layout change per step, and 1.3-1.9x the time at one token on the H200)
    await_producer(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    w_scale_row = w_scale_ptr + ((pid * BLOCK_N) // GROUP) * stride_wsn
    acc0 = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], tl.float32)
    for it in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        offs_g = it * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
        g_ok = offs_g < K // GROUP
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w = e4m3_to_f32_exact(w) if EXACT_CAST else w.to(tl.float32)
        w_scale = tl.load(w_scale_row + offs_g, mask=g_ok, other=0.0)
        acc0 = _token_fma(acc0, w, w_scale, a_ptr, a_scale_ptr, 0, M, stride_am, stride_asm, stride_asg,
                          offs_k, k_ok, offs_g, g_ok, GROUP, BLOCK_N, BLOCK_K, EXACT_CAST)
        if TOKENS > 1:
            acc1 = _token_fma(acc1, w, w_scale, a_ptr, a_scale_ptr, 1, M, stride_am, stride_asm, stride_asg,
                              offs_k, k_ok, offs_g, g_ok, GROUP, BLOCK_N, BLOCK_K, EXACT_CAST)
        if TOKENS > 2:
            acc2 = _token_fma(acc2, w, w_scale, a_ptr, a_scale_ptr, 2, M, stride_am, stride_asm, stride_asg,
                              offs_k, k_ok, offs_g, g_ok, GROUP, BLOCK_N, BLOCK_K, EXACT_CAST)
            acc3 = _token_fma(acc3, w, w_scale, a_ptr, a_scale_ptr, 3, M, stride_am, stride_asm, stride_asg,
                              offs_k, k_ok, offs_g, g_ok, GROUP, BLOCK_N, BLOCK_K, EXACT_CAST)
    _store_token(y_ptr, acc0, 0, M, stride_ym, offs_n, n_ok, EXACT_CAST)
    if TOKENS > 1:
        _store_token(y_ptr, acc1, 1, M, stride_ym, offs_n, n_ok, EXACT_CAST)
    if TOKENS > 2:
        _store_token(y_ptr, acc2, 2, M, stride_ym, offs_n, n_ok, EXACT_CAST)
        _store_token(y_ptr, acc3, 3, M, stride_ym, offs_n, n_ok, EXACT_CAST)


def launch_gemv(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                out: torch.Tensor, group: int, cfg: GemvConfig) -> torch.Tensor:
    """``out [M, N]`` = the tokens ``a [M, K]`` (e4m3, scales ``a_scale [M, K / group]``) times
    ``weight`` and its block scales, 1 <= M <= ``MAX_GEMV_TOKENS``; the operands as
    ``gemm.fp8_gemm`` has validated them."""
    check_gemv_config(cfg, group)
    if weight_scale.stride(1) != 1:  # the kernel reads each scale row as contiguous
        weight_scale = weight_scale.contiguous()
    m = a.shape[0]
    tokens = gemv_token_tile(m)
    n, k = weight.shape
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        a, a_scale, weight, weight_scale, out, m, n, a.stride(0), a_scale.stride(0), a_scale.stride(1),
        weight.stride(0), weight_scale.stride(0), out.stride(0),
        K=k, GROUP=group, TOKENS=tokens, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages,
        EXACT_CAST=interpreting(), num_warps=cfg.warps, **pdl_options(a.device),
    )
    return out
