"""RMSNorm module: a producer of bf16 and, on request, of the FP8 pair its consumer reads.

The module owns the weight; the work is one ``fp8chain_kernel.norm.rms_norm`` launch. With
``out_format`` set the same launch also writes the FP8 data + scales of its bf16 output (bit
for bit ``reference.quantize(bf16_out, out_format)``), so the linear that follows runs without
a standalone quantize.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8chain_kernel import norm as norm_kernels
from fp8chain_kernel.formats import QuantizedActivation

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``y = x * rsqrt(mean(x^2) + eps) * weight`` on bf16 rows; optional FP8 pair output. The
    weight is bf16, as DSv4.1 checkpoints store norms and as ``norm.rms_norm`` reads it."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor, out_format=None, *, out: QuantizedActivation | None = None,
                out_bf16: torch.Tensor | None = None) -> tuple[torch.Tensor, QuantizedActivation | None]:
        """``(bf16 y, pair)``; the pair is ``None`` unless ``out_format`` or ``out`` (whose format
        it then implies) is given. ``out`` / ``out_bf16``: caller-given buffers (``norm.rms_norm``)."""
        result = norm_kernels.rms_norm(x, self.weight, self.eps, out_format=out_format, out=out, out_bf16=out_bf16)
        return (result, None) if isinstance(result, torch.Tensor) else result

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
