"""cuBLAS blockwise FP8 through torch: ``torch._scaled_mm`` with 1x128 activation scales and
128x128 weight-block scales (Hopper), reading ``sm90_g128_fp32_mn`` pairs as written.

torch's contract (PyTorch's blockwise ``_scaled_mm``; the recipe follows from the scale shapes):

* ``mat_a``: e4m3 ``[M, K]`` row-major; ``scale_a``: fp32 ``[M, K/128]`` "outer-dim-major", i.e.
  strides ``(1, M)``: exactly the MN-major pair layout when ``M`` is a multiple of 4 (so M is
  padded to a multiple of 4 here, the padded rows zero);
* ``mat_b``: e4m3 ``[K, N]`` column-major (the ``[N, K]`` weight transposed, a view);
  ``scale_b``: fp32 ``[K/128, N/128]`` with the K-block index contiguous and its column stride
  ``L4 = round_up(K/128, 4)`` (cuBLAS's padding of 128x128 block scales). The weight's scales are
  re-laid out once at load into that padded buffer (``weight_scale_blockwise``).
* scales are dequantization multipliers (``out = (a * scale_a) @ (b * scale_b)``), as fp8chain's.
"""

from __future__ import annotations

import torch

from ..formats import ActFormat, QuantizedActivation, align4, cdiv
from . import GemmBackend, _check_operands


class TorchBlockwiseBackend(GemmBackend):
    """``sm90_g128_fp32_mn`` x 128x128 blocks on SM90 with a torch whose ``_scaled_mm`` runs the
    blockwise recipe (probed). Shape constraint: K % 128 == 0 and N % 16 == 0."""

    name = "torch_blockwise"
    # Which scale_b view this torch accepts: "exact" = [K/128, N/128] with column stride L4,
    # "padded" = [L4, N/128]. Found by the first call that succeeds.
    _scale_b_view: str | None = None

    def rejection(self, fmt: ActFormat, weight_block: int, n: int, k: int) -> str | None:
        from . import probe

        caps = probe()
        if not caps.scaled_mm_blockwise and caps.scaled_mm_reason != "probing":
            return caps.scaled_mm_reason
        if weight_block != 128 or ActFormat(fmt) is not ActFormat.SM90_G128_FP32_MN:
            return (f"cuBLAS blockwise reads sm90_g128_fp32_mn with 128x128 weight blocks, not "
                    f"{ActFormat(fmt).value} with {weight_block}x{weight_block}")
        if k % 128 or n % 16:
            return f"needs K % 128 == 0 and N % 16 == 0, got N={n} K={k}"
        return None

    def derive_weight_tensors(self, weight, weight_scale, weight_block) -> dict[str, torch.Tensor]:
        n, k = weight.shape
        blocks_k = cdiv(k, 128)
        padded = torch.zeros((cdiv(n, 128), align4(blocks_k)), dtype=torch.float32, device=weight.device)
        padded[:, :blocks_k] = weight_scale
        return {"weight_scale_blockwise": padded}

    @staticmethod
    def _scale_b(padded: torch.Tensor, k: int, view: str) -> torch.Tensor:
        blocks_n, l4 = padded.shape
        if view == "exact":
            return padded.as_strided((cdiv(k, 128), blocks_n), (1, l4))
        return padded.t()

    def gemm(self, pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
             derived: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        m, n, k = _check_operands(pair, weight, weight_scale, 128, out)
        if pair.fmt is not ActFormat.SM90_G128_FP32_MN:
            raise TypeError(f"torch_blockwise reads {ActFormat.SM90_G128_FP32_MN.value}, got a pair in {pair.fmt.value}")
        if out is None:
            out = torch.empty((m, n), dtype=torch.bfloat16, device=weight.device)
        if m == 0:
            return out
        mp = align4(m)
        data, scale = pair.data, pair.scale
        if mp != m or data.stride(0) != k:
            padded = torch.zeros((mp, k), dtype=data.dtype, device=data.device)
            padded[:m] = data
            data = padded
        if mp != m or scale.stride() != (1, mp):
            fresh = torch.zeros((scale.shape[1], mp), dtype=torch.float32, device=scale.device).t()
            fresh[:m] = scale
            scale = fresh
        padded_b = derived.get("weight_scale_blockwise")
        if padded_b is None:
            padded_b = self.derive_weight_tensors(weight, weight_scale, 128)["weight_scale_blockwise"]
        views = [self._scale_b_view] if self._scale_b_view else ["exact", "padded"]
        error = None
        for view in views:
            try:
                result = torch._scaled_mm(data, weight.t(), scale_a=scale,
                                          scale_b=self._scale_b(padded_b, k, view),
                                          out_dtype=torch.bfloat16)
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                error = exc
                continue
            type(self)._scale_b_view = view
            out.copy_(result[:m])
            return out
        raise error
