"""Reference for ``fp8chain_kernel.norm``: RMSNorm with an optional fused residual add.

Numerics (the spec the Triton kernel is tested against):

* with ``residual``: ``h = bf16(x + residual)`` (one rounding of the fp32 sum), written back into
  ``residual`` in place (the fused add-norm convention); without it ``h = x``;
* ``y = bf16(h * rsqrt(mean(h^2) + eps) * weight)``, all in fp32, rounded to bf16 once; a row
  whose mean square overflows fp32 (finite values, an RMS above ~2.6e17 at 5120 columns) gives NaN, not zeros
  (``rms_rsqrt``);
* with ``out_format``, the pair is ``reference.quantize(y, out_format)``.

The return structure is the kernel's: ``y``; ``(y, pair)`` with ``out_format``; ``pair`` alone
with ``return_bf16=False``. The updated residual is reported the way the kernel reports it: in
place, in the caller's ``residual`` tensor (neither returns it).
"""

from __future__ import annotations

import torch

from ..formats import ActFormat
from .quant import quantize

__all__ = ["rms_norm", "rms_rsqrt"]


def rms_rsqrt(h: torch.Tensor, eps: float, dim: int = -1) -> torch.Tensor:
    """``rsqrt(mean(h^2) + eps)`` along ``dim`` (kept), in ``h``'s dtype; NaN where the mean square
    overflows that dtype: its rsqrt would be 0 and norm a row of finite values to zeros, silently
    wrong (the kernels do the same)."""
    mean_sq = h.square().mean(dim=dim, keepdim=True)
    return torch.where(mean_sq < torch.inf, torch.rsqrt(mean_sq + eps), torch.nan)


def rms_norm_fp32(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``h * rsqrt(mean(h^2) + eps) * weight`` before the bf16 rounding (for error bounds)."""
    h = h.float()
    return h * rms_rsqrt(h, eps) * weight.float()


def add_residual(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``bf16(x + residual)`` computed in fp32 and rounded once."""
    return (x.float() + residual.float()).to(torch.bfloat16)


def finish(y: torch.Tensor, out_format, return_bf16: bool):
    """The producers' return convention: ``y``, ``(y, pair)`` or ``pair``."""
    if out_format is None:
        if not return_bf16:
            raise ValueError("return_bf16=False needs an out_format")
        return y
    pair = quantize(y, ActFormat(out_format))
    return (y, pair) if return_bf16 else pair


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             out_format: ActFormat | str | None = None, return_bf16: bool = True):
    """Reference RMSNorm of ``x [T, H]`` bf16 with ``weight [H]``; see the module docstring."""
    if residual is not None:
        h = add_residual(x, residual)
        residual.copy_(h)
    else:
        h = x
    y = rms_norm_fp32(h, weight, eps).to(torch.bfloat16)
    return finish(y, out_format, return_bf16)
