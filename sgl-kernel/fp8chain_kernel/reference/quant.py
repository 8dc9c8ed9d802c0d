"""Torch-only reference numerics: the specification every fp8chain kernel is tested against.

Quantization of one group, in fp32 on the given values:

* ``amax = max(|x|)`` over the group, NaN ignored (a NaN element stays NaN in the data, so it is
  never hidden, while the group keeps a finite, valid scale), floored at ``AMAX_FLOOR``.
* power-of-two formats: UE8M0 exponent ``e = ceil(log2(amax / 448)) + 127`` from the fp32 bits,
  scale ``2^(e-127)``, multiplier ``2^(127-e)`` (both exact).
* continuous formats: scale ``amax / 448``, multiplier ``448 / amax`` (each one IEEE fp32
  division); the kernels compute exactly these two divisions.
* data ``= e4m3(clamp(x * multiplier, -448, 448))``: round to nearest even, saturating, NaN kept.
  An infinite input makes its group's scale infinite in every format (no finite scale holds it;
  the packed UE8M0 byte is 0xFF, E8M0's NaN) and its multiplier 0, so the infinite input becomes
  NaN (inf * 0) and the finite ones 0: the group dequantizes to NaN and every GEMM output reading
  it is NaN, never a finite value.
"""

from __future__ import annotations

import torch

from ..formats import (
    AMAX_FLOOR, FP8_DTYPE, FP8_MAX, ActFormat, QuantizedActivation, cdiv, empty_scale, powers_of_two,
)

__all__ = [
    "group_amax", "ue8m0_exponent", "pow2_scale_multiplier", "quantize_groups", "quantize", "dequantize",
    "pack_ue8m0", "unpack_ue8m0", "dequantize_weight", "random_fp8_weight", "pack_weight_scale_for_deepgemm",
    "scales_as_float",
]

_MANTISSA_1_75 = 0x600000  # fp32 mantissa bits of 1.75 = 448 / 2^8
_INF_BITS = 0x7F800000


def group_amax(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[rows, cols]`` -> fp32 ``[rows, ceil(cols/group)]`` NaN-ignoring amax, floored."""
    rows, cols = x.shape
    padded = torch.zeros(rows, cdiv(cols, group) * group, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x.float()
    mag = padded.abs()
    mag = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag)
    return mag.view(rows, cdiv(cols, group), group).amax(dim=-1).clamp_min(AMAX_FLOOR)


def ue8m0_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Biased exponent (int32) of the smallest power of two ``s`` with ``amax / s <= 448``.

    ``amax = m * 2^E`` with ``1 <= m < 2``; ``448 = 1.75 * 2^8``, so ``s = 2^(E-8)`` when
    ``m <= 1.75`` and ``2^(E-7)`` otherwise. Exact at every boundary (pure bit arithmetic). An
    infinite amax gives 255: the scale inf.
    """
    bits = amax.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > _MANTISSA_1_75).to(torch.int32)
    return torch.where(bits >= _INF_BITS, 255, exponent)


def pow2_scale_multiplier(exponent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(2^(e-127), 2^(127-e))`` of biased exponents ``e`` (both exact); for 255 (an infinite
    amax) ``(inf, 0)``."""
    return _pow2_from_exponent(exponent), _pow2_from_exponent((254 - exponent).clamp_min(0))


def _pow2_from_exponent(biased: torch.Tensor) -> torch.Tensor:
    return (biased.to(torch.int32) << 23).view(torch.float32)


def quantize_groups(x: torch.Tensor, fmt: ActFormat):
    """The group math of ``quantize`` without the scale layout: ``(fp8 data [rows, cols], fp32
    scales [rows, G] contiguous, UE8M0 exponents or None)``."""
    rows, cols = x.shape
    g = fmt.group_size
    amax = group_amax(x, g)
    if fmt.pow2_scales:
        exponent = ue8m0_exponent(amax)
        scale, multiplier = pow2_scale_multiplier(exponent)
    else:
        exponent = None
        # Tensor / tensor on purpose: torch evaluates `scalar / t` as `t.reciprocal() * scalar`
        # and (on CUDA) `t / scalar` as `t * (1 / scalar)`, both off by an ulp at times.
        fp8_max = torch.full_like(amax, FP8_MAX)
        scale = amax / fp8_max
        multiplier = fp8_max / amax
    mult_cols = multiplier.repeat_interleave(g, dim=1)[:, :cols]
    scaled = (x.float() * mult_cols).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(FP8_DTYPE), scale, exponent


def pack_ue8m0(exponent: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """UE8M0 bytes ``[rows, G]`` -> int32 ``[rows, ceil(G/4)]``, strides ``(1, align4(rows))``.

    Byte ``j % 4`` of word ``j // 4`` holds group ``j``; tail bytes are zero.
    """
    rows, groups = exponent.shape
    words = cdiv(groups, 4)
    padded = torch.zeros(rows, words * 4, dtype=torch.int64, device=exponent.device)
    padded[:, :groups] = exponent.to(torch.int64) & 0xFF
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=exponent.device)
    packed = (padded.view(rows, words, 4) << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    if out is None:
        out = empty_scale(rows, groups * 32, ActFormat.SM100_G32_UE8M0_PACKED_MN, exponent.device, zero=True)
    out.copy_(packed)
    return out


def unpack_ue8m0(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 ``[rows, W]`` -> int32 exponent bytes ``[rows, groups]``."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=packed.device)
    bytes_ = (words.unsqueeze(-1) >> shifts) & 0xFF
    return bytes_.reshape(packed.shape[0], -1)[:, :groups].to(torch.int32)


def quantize(x: torch.Tensor, fmt: ActFormat | str) -> QuantizedActivation:
    """Quantize a 2-D bf16/fp32 tensor into a fresh pair of ``fmt`` (exact layout, pads zero)."""
    fmt = ActFormat(fmt)
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D [rows, cols] tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"quantize expects bfloat16 or float32, got {x.dtype}")
    rows, cols = x.shape
    data, scale, exponent = quantize_groups(x, fmt)
    out_scale = empty_scale(rows, cols, fmt, x.device, zero=True)  # padding rows read zero
    if fmt.packed:
        pack_ue8m0(exponent, out=out_scale)
    else:
        out_scale.copy_(scale)
    return QuantizedActivation(data, out_scale, fmt)


def scales_as_float(pair: QuantizedActivation) -> torch.Tensor:
    """fp32 ``[rows, G]`` scale per group, whatever the encoding."""
    data, scale, fmt = pair.data, pair.scale, pair.fmt
    if fmt.packed:
        return _pow2_from_exponent(unpack_ue8m0(scale, fmt.num_groups(data.shape[1])))
    return scale.float()


def dequantize(pair: QuantizedActivation) -> torch.Tensor:
    """fp32 ``[rows, cols]`` values of a pair."""
    data, fmt = pair.data, pair.fmt
    cols = data.shape[1]
    scale = scales_as_float(pair).repeat_interleave(fmt.group_size, dim=1)[:, :cols]
    return data.float() * scale


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, block: int | tuple[int, int]) -> torch.Tensor:
    """FP8 weight ``[N, K]`` with block scales ``[ceil(N/bn), ceil(K/bk)]`` -> fp32 ``[N, K]``."""
    bn, bk = (block, block) if isinstance(block, int) else block
    n, k = weight.shape
    if tuple(scale.shape) != (cdiv(n, bn), cdiv(k, bk)):
        raise ValueError(
            f"weight {n}x{k} with {bn}x{bk} blocks needs scales {(cdiv(n, bn), cdiv(k, bk))}, "
            f"got {tuple(scale.shape)}"
        )
    full = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return weight.float() * full


def random_fp8_weight(n: int, k: int, block: int, device=None, log2_scale: int = -10):
    """A random e4m3 ``[n, k]`` weight with block scales as checkpoints store them, for tests and
    benchmarks: power-of-two scales for 32x32 blocks (DSv4.1), arbitrary positive fp32 ones for
    128x128 blocks (V3/V4), both around ``2^log2_scale``."""
    weight = (torch.randn(n, k, device=device) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    blocks = (cdiv(n, block), cdiv(k, block))
    if block == 32:
        scale = torch.exp2(torch.randint(log2_scale - 4, log2_scale + 4, blocks, device=device).float())
    else:
        scale = (torch.rand(blocks, device=device) + 0.5) * 2.0 ** log2_scale
    return weight, scale


def pack_weight_scale_for_deepgemm(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Power-of-two fp32 32x32 block scales ``[ceil(n/32), ceil(k/32)]`` -> Blackwell DeepGEMM
    int32 ``[n, ceil(k/128)]``, strides ``(1, align4(n))``: each row's per-32 exponents packed."""
    if tuple(scale.shape) != (cdiv(n, 32), cdiv(k, 32)):
        raise ValueError(f"expected 32x32 block scales {(cdiv(n, 32), cdiv(k, 32))}, got {tuple(scale.shape)}")
    scale = scale.float()
    if not powers_of_two(scale).all():
        raise ValueError("DeepGEMM UE8M0 packing needs positive, finite power-of-two weight scales")
    exponent = (scale.contiguous().view(torch.int32) >> 23).repeat_interleave(32, 0)[:n]
    return pack_ue8m0(exponent)
