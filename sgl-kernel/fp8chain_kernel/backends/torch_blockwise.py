"""cuBLAS blockwise FP8 through torch: ``torch._scaled_mm`` with 1x128 activation scales and
128x128 weight-block scales (Hopper), reading ``sm90_g128_fp32_mn`` pairs as written.

torch's contract (PyTorch's blockwise ``_scaled_mm``; the recipe follows from the scale shapes):

* ``mat_a``: e4m3 ``[M, K]`` row-major; ``scale_a``: fp32 ``[M, K/128]`` "outer-dim-major", i.e.
  strides ``(1, M)``: exactly the MN-major pair layout when ``M`` is a multiple of 4 (so M is
  padded to a multiple of 4 here, the padded rows zero);
* ``mat_b``: e4m3 ``[K, N]`` column-major (the ``[N, K]`` weight transposed, a view);
  ``scale_b``: fp32 ``[K/128, N/128]`` with the K-block index contiguous: torch 2.11 checks
  ``scale_b.t()`` to be the contiguous ``[N/128, K/128]`` checkpoint tensor (strides
  ``(K/128, 1)``), so the checkpoint's scales are passed as they are (a transposed view). cuBLAS's
  documentation pads that stride to ``L4 = round_up(K/128, 4)``; torch versions that check for the
  padded layout get the zero-padded copy made at load (``weight_scale_blockwise``). Which layout
  this torch takes and computes right with is found once per class of K (``calibrate``, run by
  ``backends.probe`` or else by the first GEMM), never guessed from what torch accepts.
* scales are dequantization multipliers (``out = (a * scale_a) @ (b * scale_b)``), as fp8chain's.
"""

from __future__ import annotations

import torch

from ..formats import ActFormat, QuantizedActivation, align4, cdiv
from . import GemmBackend, _check_operands


class TorchBlockwiseBackend(GemmBackend):
    """``sm90_g128_fp32_mn`` x 128x128 blocks on SM90 with a torch whose ``_scaled_mm`` runs the
    blockwise recipe (probed). Shape constraints: K % 128 == 0, N % 16 == 0, and, with torch 2.11,
    K/128 % 4 == 0: for other K torch accepts only the unpadded scale layout, which cuBLAS reads
    with the padded stride, so the result is wrong (measured on the H200: relative error 0.7-0.9
    at K = 1280 and 2304); ``calibrate`` finds that out and the backend then rejects those K."""

    name = "torch_blockwise"
    # Which scale_b view this torch takes and computes right with, per class of K (K/128 % 4 == 0
    # or not; set by ``calibrate``): "contig" = the checkpoint's [N/128, K/128] transposed;
    # "exact" = [K/128, N/128] with column stride L4; "padded" = [L4, N/128]. None: none works.
    _VIEWS = ("contig", "exact", "padded")
    _scale_b_view: dict[bool, str | None] = {}

    def calibrate(self, device) -> str:
        """Find, for each class of K, the first scale_b layout that torch accepts AND that gives
        the reference's result (a layout torch accepts but reads differently would be silently
        wrong). Returns '' when at least K/128 % 4 == 0 works, else the reason."""
        from . import _tiny_problem

        found, notes = {}, []
        for k in (512, 640):  # K/128 = 4 and 5
            aligned = (k // 128) % 4 == 0
            pair, weight, weight_scale, want = _tiny_problem(device, ActFormat.SM90_G128_FP32_MN, 128,
                                                             m=8, n=256, k=k)
            padded = self.derive_weight_tensors(weight, weight_scale, 128)["weight_scale_blockwise"]
            found[aligned] = None
            for view in self._VIEWS:
                try:
                    got = torch._scaled_mm(pair.data, weight.t(), scale_a=pair.scale,
                                           scale_b=self._scale_b(padded, k, view, weight_scale),
                                           out_dtype=torch.bfloat16)
                    err = ((got.double() - want).norm() / want.norm()).item()
                except (RuntimeError, ValueError, NotImplementedError) as exc:
                    notes.append(f"K={k} {view}: {type(exc).__name__}")
                    continue
                if err < 1e-2:
                    found[aligned] = view
                    break
                notes.append(f"K={k} {view}: wrong (rel err {err:.2g})")
        type(self)._scale_b_view = found
        if found.get(True) is None:
            return "torch._scaled_mm blockwise 1x128 x 128x128 did not compute right: " + "; ".join(notes)
        return ""

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
        aligned = (k // 128) % 4 == 0
        if aligned in self._scale_b_view and self._scale_b_view[aligned] is None:
            return f"torch._scaled_mm found no working 128x128 scale layout for K/128 = {k // 128} (not a multiple of 4)"
        return None

    def derive_weight_tensors(self, weight, weight_scale, weight_block) -> dict[str, torch.Tensor]:
        n, k = weight.shape
        blocks_k = cdiv(k, 128)
        padded = torch.zeros((cdiv(n, 128), align4(blocks_k)), dtype=torch.float32, device=weight.device)
        padded[:, :blocks_k] = weight_scale
        return {"weight_scale_blockwise": padded}

    @staticmethod
    def _scale_b(padded: torch.Tensor, k: int, view: str, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
        blocks_n, l4 = padded.shape
        if view == "contig":
            return weight_scale.contiguous().t()
        if view == "exact":
            return padded.as_strided((cdiv(k, 128), blocks_n), (1, l4))
        return padded.t()

    def gemm(self, pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
             derived: dict, out: torch.Tensor | None = None, _force_view: str | None = None) -> torch.Tensor:
        """``_force_view`` (benchmarks only) skips the calibration verdict and runs that layout."""
        m, n, k = _check_operands(pair, weight, weight_scale, 128, out)
        _check_g128(pair)
        if out is None:
            out = torch.empty((m, n), dtype=torch.bfloat16, device=weight.device)
        if m == 0:
            return out
        args, kwargs = self.scaled_mm_operands(pair, weight, weight_scale, derived, _force_view)
        result = torch._scaled_mm(*args, **kwargs)
        out.copy_(result[:m])
        return out

    def scaled_mm_operands(self, pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
                           derived: dict, _force_view: str | None = None) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of ``torch._scaled_mm`` for ``pair x weight^T``: the pair's rows
        padded to a multiple of 4 and its scales in the layout cuBLAS reads (copies where they are
        not already), the weight scales in the calibrated layout; the result has ``align4(M)`` rows.
        The benchmark times ``_scaled_mm`` alone on these, as a caller holding its operands in
        cuBLAS's layouts would run it."""
        m, n, k = _check_operands(pair, weight, weight_scale, 128, None)
        _check_g128(pair)
        mp = align4(m)
        data, scale = pair.data, pair.scale
        # cuBLAS reads its operands from 16-byte aligned addresses: a pair viewed at an odd offset
        # into a larger buffer is copied like a padded one
        if mp != m or data.stride(0) != k or data.data_ptr() % 16:
            padded = torch.zeros((mp, k), dtype=data.dtype, device=data.device)
            padded[:m] = data
            data = padded
        if mp != m or scale.stride() != (1, mp) or scale.data_ptr() % 16:
            fresh = torch.zeros((scale.shape[1], mp), dtype=torch.float32, device=scale.device).t()
            fresh[:m] = scale
            scale = fresh
        padded_b = derived.get("weight_scale_blockwise")
        if padded_b is None:
            padded_b = self.derive_weight_tensors(weight, weight_scale, 128)["weight_scale_blockwise"]
        aligned = (k // 128) % 4 == 0
        view = _force_view
        if view is None:
            if aligned not in self._scale_b_view:  # called before probe(): a layout torch merely
                self.calibrate(weight.device)     # accepts may be read with another stride
            view = self._scale_b_view.get(aligned)
            if view is None:
                raise ValueError(f"torch._scaled_mm has no working 128x128 scale layout for K/128 = {k // 128}")
        return (data, weight.t()), dict(scale_a=scale, scale_b=self._scale_b(padded_b, k, view, weight_scale),
                                        out_dtype=torch.bfloat16)


def _check_g128(pair: QuantizedActivation) -> None:
    if pair.fmt is not ActFormat.SM90_G128_FP32_MN:
        raise TypeError(f"torch_blockwise reads {ActFormat.SM90_G128_FP32_MN.value}, got a pair in {pair.fmt.value}")
