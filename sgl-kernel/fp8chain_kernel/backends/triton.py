"""The Triton backend: fp8chain's own block-scaled FP8 GEMM (``fp8chain_kernel.gemm``)."""

from __future__ import annotations

import torch

from ..formats import ActFormat, QuantizedActivation, powers_of_two
from .. import gemm as _gemm
from . import GemmBackend


class TritonBackend(GemmBackend):
    """Reads ``sm90_g32_fp32_mn`` with 32x32 weight blocks (power-of-two scales, as DSv4.1's) or
    ``sm90_g128_fp32_mn`` with 128x128 blocks (any scales). Shape constraint: K a multiple of the
    block (32 / 128); any M and N (N is masked)."""

    name = "triton"

    def rejection(self, fmt: ActFormat, weight_block: int, n: int, k: int) -> str | None:
        from . import probe

        caps = probe()
        if not caps.cuda and not caps.triton_interpreter:
            return "no CUDA device and TRITON_INTERPRET is not set"
        if caps.arch is not None and caps.arch < (8, 9):
            return f"FP8 tl.dot needs sm89 or newer, this is sm{caps.arch[0]}{caps.arch[1]}"
        try:
            want = _gemm.input_format_for_block(weight_block)
        except ValueError as exc:
            return str(exc)
        if ActFormat(fmt) is not want:
            return f"with {weight_block}x{weight_block} weight blocks it reads {want.value}, not {ActFormat(fmt).value}"
        if k % weight_block:
            return f"K={k} is not a multiple of the {weight_block}-column group"
        if n <= 0 or k <= 0:
            return f"empty weight {n}x{k}"
        return None

    def derive_weight_tensors(self, weight, weight_scale, weight_block) -> dict[str, torch.Tensor]:
        # The GEMM's dequantized mode (32x32 blocks, from 17 tokens) rounds weight x scale to bf16:
        # exact for power-of-two scales only, else a token's output would depend on its batch size.
        if weight_block == 32 and not powers_of_two(weight_scale).all():
            raise ValueError("32x32 weight blocks need power-of-two scales (the GEMM dequantizes them to bf16)")
        return {}

    def gemm(self, pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
             derived: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        return _gemm.fp8_gemm(pair, weight, weight_scale, weight_block=pair.fmt.group_size, out=out)

    def gemm_silu_mul(self, pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
                      derived: dict, limit: float | None, out_format: ActFormat) -> QuantizedActivation | None:
        n, k = weight.shape
        m = pair.data.shape[0]
        config = _gemm.gemm_config(m, n, k, pair.fmt.group_size, weight.device)
        if not _gemm.silu_mul_epilogue_pays(config):
            return None
        return _gemm.fp8_gemm_silu_mul(pair, weight, weight_scale, weight_block=pair.fmt.group_size, limit=limit,
                                       out_format=out_format, return_bf16=False, config=config)
