"""Reference for fp8chain_kernel.gemm: block-scaled FP8 GEMMs computed in fp64 on the
dequantized operands."""

from __future__ import annotations

import torch

from ..formats import QuantizedActivation
from .quant import dequantize, dequantize_weight

__all__ = ["fp8_gemm", "w8a16_gemm"]


def fp8_gemm(pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
             weight_block: int | tuple[int, int]) -> torch.Tensor:
    """fp64 ``[M, N]`` = dequantize(pair) @ dequantize_weight(weight, weight_scale, block)^T."""
    a = dequantize(pair).double()
    w = dequantize_weight(weight, weight_scale, weight_block).double()
    return a @ w.t()


def w8a16_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               weight_block: int | tuple[int, int]) -> torch.Tensor:
    """fp64 ``[M, N]`` = x @ dequantize_weight(weight, weight_scale, block)^T."""
    w = dequantize_weight(weight, weight_scale, weight_block).double()
    return x.double() @ w.t()
