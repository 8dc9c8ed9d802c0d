"""Reference for ``fp8chain_kernel.einsum``: the wo_a grouped einsum.

``o [T, G, D]`` bf16, ``wo_a [G, R, D]`` bf16 -> ``y [T, G*R]`` bf16 with
``y[t, g*R + r] = bf16(sum_d o[t, g, d] * wo_a[g, r, d])`` accumulated in fp32 (rounded once);
with ``out_format`` the pair is ``reference.quantize(y, out_format)`` of the flattened matrix.
Returns ``y``, ``(y, pair)`` or ``pair`` (``return_bf16=False``). An e4m3 ``wo_a`` with
``weight_scale`` (fp32 ``[G, ceil(R/b), ceil(D/b)]``, ``b = weight_block``) is first dequantized to
bf16 per element, ``bf16(w * scale)`` (``dequantize_wo_a``), as a bf16 copy of the checkpoint's FP8
wo_a holds it.
"""

from __future__ import annotations

import torch

from ..formats import ActFormat
from .norm import finish
from .quant import dequantize_weight, random_fp8_weight

__all__ = ["dequantize_wo_a", "random_fp8_wo_a", "wo_a_einsum"]


def random_fp8_wo_a(groups: int, r: int, d: int, block: int = 32, device=None, log2_scale: int = -10):
    """A random e4m3 wo_a ``[G, R, D]`` and its ``[G, R/b, ceil(D/b)]`` block scales as a checkpoint
    stores them (``random_fp8_weight`` of the ``[G*R, D]`` matrix viewed per group; ``R`` a
    multiple of the block ``b``), for tests and benchmarks."""
    weight, scale = random_fp8_weight(groups * r, d, block, device, log2_scale)
    return weight.view(groups, r, d), scale.view(groups, r // block, -1)


def dequantize_wo_a(wo_a: torch.Tensor, weight_scale: torch.Tensor, weight_block: int = 32) -> torch.Tensor:
    """e4m3 ``[G, R, D]`` with fp32 ``[G, ceil(R/b), ceil(D/b)]`` block scales -> bf16 ``[G, R, D]``."""
    return torch.stack([dequantize_weight(w, s, weight_block) for w, s in zip(wo_a, weight_scale)]).to(torch.bfloat16)


def wo_a_einsum_fp(o: torch.Tensor, wo_a: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[T, G*R]`` in ``dtype`` (fp32 for the reference, fp64 for error bounds), unrounded."""
    out = torch.einsum("tgd,grd->tgr", o.to(dtype), wo_a.to(dtype))
    return out.reshape(o.shape[0], -1)


def wo_a_einsum(o: torch.Tensor, wo_a: torch.Tensor, *, weight_scale: torch.Tensor | None = None,
                weight_block: int = 32, out_format: ActFormat | str | None = None, return_bf16: bool = True):
    """Reference grouped einsum ``o [T, G, D] x wo_a [G, R, D] -> [T, G*R]``; see the module docstring."""
    if weight_scale is not None:
        wo_a = dequantize_wo_a(wo_a, weight_scale, weight_block)
    y = wo_a_einsum_fp(o, wo_a).to(torch.bfloat16)
    return finish(y, out_format, return_bf16)
