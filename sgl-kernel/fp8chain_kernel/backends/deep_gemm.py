"""DeepGEMM ``fp8_gemm_nt`` as a consumer (users' SGLang stacks where ``deep_gemm`` runs).

The argument contract fp8chain relies on (DeepGEMM's documented ``fp8_gemm_nt``):
``fp8_gemm_nt((a, sfa), (b, sfb), d, recipe=...)`` computes ``d = a @ b^T`` with

* ``a``: e4m3 ``[M, K]`` K-major (row-major, contiguous); ``b``: e4m3 ``[N, K]`` K-major;
  ``d``: bf16 ``[M, N]`` row-major, written in place;
* SM90 (Hopper): ``sfa`` fp32 ``[M, ceil(K/128)]`` MN-major and TMA-aligned, strides
  ``(1, align4(M))``; ``sfb`` fp32 ``[ceil(N/128), ceil(K/128)]`` (the checkpoint's block scales,
  contiguous); ``recipe=(1, 128, 128)``. Its SM90 scale layouts are fp32 in 128-column groups
  only (no (1, 32, 32) recipe there), so DSv4.1's 32x32 blocks run on the Triton GEMM on Hopper;
* SM100 (Blackwell): ``sfa`` int32 ``[M, ceil(K/128)]`` packed UE8M0 (4 per word), strides
  ``(1, align4(M))``; ``sfb`` the weight's per-row packed exponents, int32 ``[N, ceil(K/128)]``,
  strides ``(1, align4(N))`` (``weight_scale_inv_deepgemm``, derived at load); ``recipe=(1, 1, 32)``
  and ``disable_ue8m0_cast=True`` (the scales are already packed; DeepGEMM must not re-cast them).

fp8chain's H200 cannot run the DeepGEMM wheels (ABI mismatch with its torch 2.11), so this module is
tested on CPU against a fake ``deep_gemm`` that checks every dtype, shape, stride and recipe above
and computes with the reference (test/unit/test_backends.py).
"""

from __future__ import annotations

import torch

from ..formats import ActFormat, QuantizedActivation, align4, cdiv
from . import GemmBackend, _check_operands


def _arch():
    from . import probe

    return probe().arch


def _arch_format(arch: tuple[int, int] | None) -> tuple[ActFormat, int] | None:
    """The pair format and weight block DeepGEMM reads on ``arch``; None where it does not run."""
    if arch is None:
        return None
    if arch[0] == 9:  # fp32 scales in 128-column groups only
        return ActFormat.SM90_G128_FP32_MN, 128
    if arch[0] >= 10:
        return ActFormat.SM100_G32_UE8M0_PACKED_MN, 32
    return None


class DeepGemmBackend(GemmBackend):
    """SM90: ``sm90_g128_fp32_mn`` x 128x128 blocks; SM100: ``sm100_g32_ue8m0_packed_mn`` x 32x32
    power-of-two blocks. Shape constraint: K % 128 == 0."""

    name = "deep_gemm"

    def rejection(self, fmt: ActFormat, weight_block: int, n: int, k: int) -> str | None:
        from . import probe

        caps = probe()
        if not caps.deep_gemm:
            return caps.deep_gemm_reason or "deep_gemm unavailable"
        fmt = ActFormat(fmt)
        arch = caps.arch
        reads = _arch_format(arch)
        if reads is None:
            return f"DeepGEMM runs on SM90/SM100, this is sm{arch[0]}{arch[1]}"
        if (fmt, weight_block) != reads:
            return f"on sm{arch[0]}{arch[1]} it does not read {fmt.value} with {weight_block}x{weight_block} blocks"
        if k % 128:
            return f"K={k} is not a multiple of 128"
        return None

    def derive_weight_tensors(self, weight, weight_scale, weight_block) -> dict[str, torch.Tensor]:
        arch = _arch()
        if arch is not None and arch[0] >= 10 and weight_block == 32:
            from ..reference import pack_weight_scale_for_deepgemm

            n, k = weight.shape
            return {"weight_scale_inv_deepgemm": pack_weight_scale_for_deepgemm(weight_scale, n, k)}
        return {}

    def gemm(self, pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
             derived: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        import deep_gemm

        arch = _arch()
        reads = _arch_format(arch)
        if reads is None:
            raise RuntimeError(f"DeepGEMM runs on SM90/SM100, this is {'no CUDA device' if arch is None else arch}")
        fmt, block = reads
        if not isinstance(pair, QuantizedActivation) or pair.fmt is not fmt:
            got = pair.fmt.value if isinstance(pair, QuantizedActivation) else type(pair).__name__
            raise TypeError(f"deep_gemm on sm{arch[0]}{arch[1]} reads {fmt.value}, got {got}")
        m, n, k = _check_operands(pair, weight, weight_scale, block, out)
        if not weight.is_contiguous() or weight.data_ptr() % 16:
            raise ValueError(f"weight must be K-major contiguous and 16-byte aligned (DeepGEMM's TMA), got "
                             f"strides {weight.stride()}, address % 16 = {weight.data_ptr() % 16}")
        if out is None:
            out = torch.empty((m, n), dtype=torch.bfloat16, device=weight.device)
        if m == 0:
            return out
        data, scale = pair.data, pair.scale
        if data.stride(0) != k or data.data_ptr() % 16:  # TMA reads from 16-byte aligned addresses
            data = data.clone(memory_format=torch.contiguous_format)
        if (scale.shape[1] > 1 and scale.stride(1) != align4(m)) or scale.stride(0) != 1 or scale.data_ptr() % 16:
            # A row slice of a buffer captured for more rows: DeepGEMM wants the column stride
            # align4(M) exactly, so the (few) scales are re-laid out; the FP8 data is untouched.
            fresh = torch.zeros((scale.shape[1], align4(m)), dtype=scale.dtype, device=scale.device).t()[:m]
            fresh.copy_(scale)
            scale = fresh
        aligned = out.is_contiguous() and out.data_ptr() % 16 == 0
        dense = out if aligned else torch.empty((m, n), dtype=torch.bfloat16, device=out.device)
        if pair.fmt is ActFormat.SM100_G32_UE8M0_PACKED_MN:
            packed_w = derived.get("weight_scale_inv_deepgemm")
            if packed_w is None:
                raise ValueError("the SM100 DeepGEMM path needs derived['weight_scale_inv_deepgemm'] "
                                 "(derive_weight_tensors at load)")
            if packed_w.dtype != torch.int32 or tuple(packed_w.shape) != (n, cdiv(k, 128)):
                raise ValueError(f"weight_scale_inv_deepgemm must be int32 {(n, cdiv(k, 128))} for this weight, got "
                                 f"{packed_w.dtype} {tuple(packed_w.shape)}: derive it again (process_weights_after_loading)")
            if packed_w.shape[1] > 1 and packed_w.stride() != (1, align4(n)):
                # a deepcopy or .to() of the layer makes the padded view dense (N % 4 != 0)
                raise ValueError(f"weight_scale_inv_deepgemm has strides {packed_w.stride()}, DeepGEMM reads "
                                 f"(1, {align4(n)}): derive it again (process_weights_after_loading)")
            deep_gemm.fp8_gemm_nt((data, scale), (weight, packed_w), dense, recipe=(1, 1, 32),
                                  disable_ue8m0_cast=True)
        else:
            deep_gemm.fp8_gemm_nt((data, scale), (weight, weight_scale.contiguous()), dense,
                                  recipe=(1, block, block))
        if dense is not out:
            out.copy_(dense)
        return out
