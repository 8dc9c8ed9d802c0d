"""Reference for ``fp8chain_kernel.act``: SiLU*mul with the optional swiglu clamp.

``gate_up [T, 2I]`` bf16: ``gate = gate_up[:, :I]``, ``up = gate_up[:, I:]``. With ``limit``:
``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)`` (NaN stays NaN). Then
``y = bf16(silu(gate) * up)`` in fp32, one rounding; with ``out_format`` the pair is
``reference.quantize(y, out_format)``. Returns ``y``, ``(y, pair)`` or ``pair`` (``return_bf16=False``).
"""

from __future__ import annotations

import torch

from ..formats import ActFormat
from .norm import finish

__all__ = ["silu_mul"]


def silu_mul_fp32(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """fp32 ``silu(gate) * up`` before the bf16 rounding (for error bounds)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    if limit is not None:
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


def silu_mul(gate_up: torch.Tensor, *, limit: float | None = None, out_format: ActFormat | str | None = None,
             return_bf16: bool = True):
    """Reference SiLU*mul of ``gate_up [T, 2I]`` -> ``[T, I]``; see the module docstring."""
    y = silu_mul_fp32(gate_up, limit).to(torch.bfloat16)
    return finish(y, out_format, return_bf16)
