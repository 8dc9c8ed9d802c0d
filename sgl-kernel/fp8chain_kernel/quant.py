"""Standalone activation quantize: bf16/fp32 ``[M, K]`` -> FP8 pair of any ``ActFormat``.

This is the launch the chain removes, and the baseline every comparison uses, so it is kept
strong: one pass over the input, 2-D tiles of several groups per program, a grid that spreads
even one row over several programs. Bit-identical to ``reference.quantize``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import (ActFormat, QuantizedActivation, check_disjoint, check_no_overlap, check_pair, empty_pair,
                      pair_parts)
from .fp8_tile import format_constexprs, quantize_tile, store_scale_tile
from .launch import await_producer, pdl_options


@triton.jit
def _quantize_kernel(x_ptr, data_ptr, scale_ptr, M, K, stride_xm, stride_dm, stride_sm, stride_sg,
                     GROUP: tl.constexpr, POW2: tl.constexpr, PACKED: tl.constexpr,
                     EXACT_CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    await_producer(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_m.to(tl.int64)[:, None]
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    data, scale = quantize_tile(x, BLOCK_M, BLOCK_K, GROUP, POW2, EXACT_CAST)
    tl.store(data_ptr + rows * stride_dm + offs_k[None, :], data, mask=mask)
    store_scale_tile(scale_ptr, scale, offs_m, tl.program_id(1) * (BLOCK_K // GROUP), M,
                     tl.cdiv(K, GROUP), stride_sm, stride_sg, BLOCK_K // GROUP, PACKED)


def _launch_config(rows: int, cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps): ~8K elements per program, at most 1024 columns wide, so a
    single 5120-wide row still spreads over 5 programs."""
    block_k = max(128, min(1024, triton.next_power_of_2(cols)))
    block_m = max(1, min(triton.next_power_of_2(rows), 8192 // block_k))
    num_warps = 4 if block_m * block_k <= 4096 else 8
    return block_m, block_k, num_warps


def check_activation(x: torch.Tensor, name: str = "x") -> None:
    """A 2-D bf16/fp32 activation with unit column stride, as every kernel here reads it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{name} must be bfloat16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    if x.numel() and x.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride, got strides {x.stride()}")


def prepare_out(out: QuantizedActivation | None, rows: int, cols: int, fmt: ActFormat,
                device) -> QuantizedActivation:
    """A caller-given out pair checked against ``fmt`` and ``rows x cols``, or a fresh one."""
    if out is None:
        return empty_pair(rows, cols, fmt, device)
    check_pair(out, fmt)
    if tuple(out.data.shape) != (rows, cols):
        raise ValueError(f"out pair has shape {tuple(out.data.shape)}, expected {(rows, cols)}")
    if out.data.device != torch.device(device):
        raise ValueError(f"out pair is on {out.data.device}, input on {device}")
    check_disjoint(pair_parts(out))
    return out


def quantize(x: torch.Tensor, fmt: ActFormat | str, out: QuantizedActivation | None = None) -> QuantizedActivation:
    """Quantize ``x [M, K]`` (bf16 or fp32) into ``fmt``; writes into ``out`` when given.

    Returns the pair; padding rows of the scale buffer are left as they are.
    """
    fmt = ActFormat(fmt)
    check_activation(x)
    rows, cols = x.shape
    out = prepare_out(out, rows, cols, fmt, x.device)
    check_no_overlap(pair_parts(out), [("x", x)])
    if rows == 0 or cols == 0:
        return out
    block_m, block_k, num_warps = _launch_config(rows, cols)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_k))
    _quantize_kernel[grid](
        x, out.data, out.scale, rows, cols, x.stride(0), out.data.stride(0),
        out.scale.stride(0), out.scale.stride(1),
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=num_warps, **format_constexprs(fmt),
        **pdl_options(x.device),
    )
    return out
