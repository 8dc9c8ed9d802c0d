"""FP8 GEMV for one token: a ``QuantizedActivation`` row times block-scaled FP8 weights, bf16 out.

``gemm.fp8_gemm`` runs this kernel in place of its tensor-core GEMM when M = 1 and
``GEMV_TABLE`` holds the problem (N, K, group): the shapes where the H200 measured it faster
(docs/gemm.md). The operands are ``fp8_gemm``'s:

* activation: e4m3 ``[1, K]`` and its fp32 scales, one per ``group`` columns, scale ``g`` at
  ``g * stride_asg`` (``SM90_G32_FP32_MN`` for 32-groups, ``SM90_G128_FP32_MN`` for 128);
* weight: e4m3 ``[N, K]`` with unit column stride, fp32 scales ``[N / group, K / group]``;
* out: bf16 ``[1, N]``, unit column stride.

One program reads ``BLOCK_N`` whole weight rows in ``BLOCK_K``-column steps. ``BLOCK_N`` divides
``group``, so the rows of a program share one row of weight blocks and both scales of a column
group fold into the activation: ``a'[k] = a[k] * (s_a[g] * s_w[n // group, g])``, one fp32
product per group. Each weight then costs one conversion and one FMA on the CUDA cores (at M = 1
a tensor-core tile would be 1/16 full); each lane sums its columns over K in fp32 and one tree
per row finishes (deterministic). Small programs (``BLOCK_N`` of 4-16 rows: 288-1280 programs
for the DSv4.1 shapes) keep enough loads in flight to stream the weights, which a decode GEMM's
K loop of dependent steps does not (docs/gemm.md). Reference: ``reference.fp8_gemm``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .formats import is_int
from .fp8_tile import e4m3_to_f32_exact, interpreting, round_bf16
from .launch import await_producer, pdl_options

__all__ = ["GemvConfig", "GEMV_TABLE", "select_gemv", "launch_gemv"]


class GemvConfig(NamedTuple):
    """One GEMV launch: weight rows and columns per step of a program, warps, load pipeline depth."""

    block_n: int
    block_k: int
    warps: int = 2
    stages: int = 3


# (N, K, group) -> config, from the H200 sweep (benchmark/gemm.py --sweep --ms 1 --modes gemv,block_diag,
# which times the candidates beside the tensor-core GEMM's; docs/benchmarks.md, GEMM section); a
# problem not listed (wq_b at TP1, where the GEMM measured faster) runs the GEMM. us at M = 1,
# GEMV against the GEMM's best:
GEMV_TABLE: dict[tuple[int, int, int], GemvConfig] = {
    (1792, 5120, 32): GemvConfig(4, 1024, 2, 3),  # wqkv_a: 4.6-5.0 against 6.5
    (5120, 8192, 32): GemvConfig(4, 512, 2, 3),  # wo_b: 12.6-13.3 against 14.6
    (4608, 5120, 32): GemvConfig(8, 512, 2, 3),  # shared gate_up: 8.8-9.1 against 9.8
    (5120, 2304, 32): GemvConfig(16, 512, 4, 3),  # shared down: 5.4-5.8 against 7.0
    (5120, 2048, 32): GemvConfig(4, 2048, 4, 3),  # wo_b, TP4 shard: 4.8 against 6.7
    (8192, 1280, 32): GemvConfig(8, 256, 2, 3),  # wq_b, TP4 shard: 4.8 against 6.7
    (1152, 5120, 32): GemvConfig(4, 1024, 4, 3),  # shared gate_up, TP4 shard: 3.7 against 5.2
    (5120, 576, 32): GemvConfig(8, 256, 2, 1),  # shared down, TP4 shard: 2.5 against 6.4
}


def select_gemv(m: int, n: int, k: int, group: int) -> GemvConfig | None:
    """The GEMV config for an ``m x n x k`` problem in ``group``-column groups, or None where the
    tensor-core GEMM runs (M != 1, or a problem outside ``GEMV_TABLE``)."""
    return GEMV_TABLE.get((n, k, group)) if m == 1 else None


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


@triton.jit
def _gemv_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, y_ptr, N, stride_asg, stride_wn, stride_wsn,
                 K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr, EXACT_CAST: tl.constexpr, PDL: tl.constexpr):
    await_producer(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    w_scale_row = w_scale_ptr + ((pid * BLOCK_N) // GROUP) * stride_wsn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for it in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        offs_k = it * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        offs_g = it * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
        g_ok = offs_g < K // GROUP
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptr + offs_k, mask=k_ok, other=0.0)
        scale = (tl.load(a_scale_ptr + offs_g * stride_asg, mask=g_ok, other=0.0)
                 * tl.load(w_scale_row + offs_g, mask=g_ok, other=0.0))
        if EXACT_CAST:
            a, w = e4m3_to_f32_exact(a), e4m3_to_f32_exact(w)
        else:
            a, w = a.to(tl.float32), w.to(tl.float32)
        a = tl.reshape(tl.reshape(a, (BLOCK_K // GROUP, GROUP)) * scale[:, None], (BLOCK_K,))
        acc += w * a[None, :]
    tl.store(y_ptr + offs_n, round_bf16(tl.sum(acc, axis=1), EXACT_CAST), mask=n_ok)


def launch_gemv(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                out: torch.Tensor, group: int, cfg: GemvConfig) -> torch.Tensor:
    """``out [1, N]`` = the one token ``a [1, K]`` (e4m3, scales ``a_scale [1, K / group]``) times
    ``weight`` and its block scales; the operands as ``gemm.fp8_gemm`` has validated them."""
    check_gemv_config(cfg, group)
    n, k = weight.shape
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        a, a_scale, weight, weight_scale, out, n, a_scale.stride(1), weight.stride(0), weight_scale.stride(0),
        K=k, GROUP=group, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.stages,
        EXACT_CAST=interpreting(), num_warps=cfg.warps, **pdl_options(),
    )
    return out
