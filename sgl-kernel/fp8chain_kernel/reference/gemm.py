"""Reference for fp8chain_kernel.gemm: block-scaled FP8 GEMMs computed in fp64 on the
dequantized operands."""

from __future__ import annotations

import torch

from ..formats import ActFormat, QuantizedActivation
from .act import silu_mul
from .quant import dequantize, dequantize_weight

__all__ = ["fp8_gemm", "fp8_gemm_silu_mul", "w8a16_gemm"]


def fp8_gemm(pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
             weight_block: int | tuple[int, int]) -> torch.Tensor:
    """fp64 ``[M, N]`` = dequantize(pair) @ dequantize_weight(weight, weight_scale, block)^T."""
    a = dequantize(pair).double()
    w = dequantize_weight(weight, weight_scale, weight_block).double()
    return a @ w.t()


def fp8_gemm_silu_mul(pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_block: int | tuple[int, int], *, limit: float | None = None,
                      out_format: ActFormat | str | None = None, return_bf16: bool = True):
    """``silu_mul`` (with ``limit``, ``out_format``, ``return_bf16``) of the gate_up GEMM rounded to
    bf16: ``weight`` is ``[2I, K]``, gate rows then up rows. The kernel accumulates in fp32, so its
    bf16 gate_up can differ from this fp64 product's by one rounding."""
    gate_up = fp8_gemm(pair, weight, weight_scale, weight_block).to(torch.bfloat16)
    return silu_mul(gate_up, limit=limit, out_format=out_format, return_bf16=return_bf16)


def w8a16_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               weight_block: int | tuple[int, int]) -> torch.Tensor:
    """fp64 ``[M, N]`` = x @ dequantize_weight(weight, weight_scale, block)^T."""
    w = dequantize_weight(weight, weight_scale, weight_block).double()
    return x.double() @ w.t()
