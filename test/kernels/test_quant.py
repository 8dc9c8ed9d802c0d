"""Triton standalone quantize == reference.quantize, bit for bit (CPU interpreter and GPU)."""

import pytest
import torch
import triton
import triton.language as tl

from fp8chain_kernel import quant
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import FP8_DTYPE, ActFormat, empty_pair
from fp8chain_kernel.fp8_tile import cast_to_e4m3, interpreting, round_bf16
from helpers import assert_padded_pair_equal, assert_pairs_equal, assert_rows_poisoned, poisoned_pair, row_padded_pair

ALL_FORMATS = list(ActFormat)


def _activation(rows, cols, device):
    """Fresh random rows of very different magnitudes, one all-zero row, a NaN and a negative NaN
    (one NaN in the last row below three rows, so one and two rows see it too), one huge value."""
    x = torch.randn(rows, cols, device=device) * torch.exp2(torch.randint(-12, 12, (rows, 1), device=device).float())
    if rows >= 3:
        x[1] = 0
        x[2, cols // 2] = float("nan")
    elif rows:
        x[rows - 1, cols // 2] = float("nan")
    if rows >= 4:
        x[3, 0] = 3.0e38  # beyond 448 * any scale of its group's neighbours
    x = x.bfloat16()
    if rows >= 3:  # a NaN with its sign bit set, written as bits (a cast may drop the sign)
        x.view(torch.int16)[2, 0] = -64  # 0xFFC0
    return x


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, EXACT_CAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, cast_to_e4m3(x, EXACT_CAST), mask=offs < n)


@pytest.mark.cpu
def test_cast_to_e4m3_matches_torch_on_every_region():
    """The cast used under the interpreter == torch's RNE cast with saturation, incl. ties,
    subnormals, carries into the exponent, NaN, values past 448 and +-inf (the kernel gets them
    as they are, torch's cast gets them clamped to +-448: the reference quantize clamps before
    it casts)."""
    n = 1 << 16
    bits = torch.randint(0, 2**31 - 1, (n,), dtype=torch.int64)
    # Aim at fp8's range: exponents 2^-12 .. 2^9, random mantissas, both signs.
    exponent = torch.randint(127 - 12, 127 + 9, (n,))
    bits = (exponent << 23) | (bits & 0x7FFFFF)
    values = bits.to(torch.int32).view(torch.float32) * torch.where(torch.rand(n) < 0.5, -1.0, 1.0)
    ties = torch.arange(0, 256, dtype=torch.uint8).view(FP8_DTYPE).float()
    ties = (ties[:-1] + ties[1:]) / 2  # exact midpoints between neighbouring fp8 codes
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10,
                            2.0**-6, 2.0**-6 - 2.0**-10, 1e-30, float("nan"), float("inf"), -float("inf"),
                            460.0, 464.0, -465.0, 480.0, 1e10, -3e38])
    x = torch.cat([values, ties[torch.isfinite(ties)], special]).contiguous()
    want = torch.where(torch.isnan(x), x, x.clamp(-448, 448)).to(FP8_DTYPE).view(torch.uint8)
    got = torch.full_like(want, 0x55).view(FP8_DTYPE)  # poisoned: an unwritten code fails
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), EXACT_CAST=True, BLOCK=1024)
    got = got.view(torch.uint8)
    assert torch.equal(got, want), f"{(got != want).sum()} codes differ"


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, EXACT_CAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, round_bf16(x, EXACT_CAST), mask=offs < n)


def _check_round_bf16(device, exact_cast):
    """``round_bf16`` == torch's round to nearest even, incl. fp32 subnormals, ties, carries into
    the exponent, overflow to inf, NaN (any NaN for a NaN)."""
    n = 1 << 16
    mantissa = torch.randint(0, 1 << 23, (n,), dtype=torch.int64)
    exponent = torch.randint(0, 255, (n,))  # 0: subnormals; 254: rounds up to inf near the top
    bits = (exponent << 23) | mantissa
    ties = (torch.randint(0, 255, (1024,)) << 23) | (torch.randint(0, 1 << 7, (1024,)) << 16) | 0x8000
    bits = torch.cat([bits, ties, torch.tensor([0x7F7FFFFF, 0x00007FFF, 0x00008000, 0x00018000, 0x7FC00001])])
    x = bits.to(torch.int32).view(torch.float32) * torch.where(torch.rand(bits.numel()) < 0.5, -1.0, 1.0)
    # NaNs whose low half would carry when rounded as a number (signalling 0x7F800001 to inf,
    # 0x7FFFFFFF to -0), put in by bits: a multiplication would quiet them
    payloads = torch.tensor([0x7F800001, 0x7FFFFFFF, -0x7FFFFF, -1], dtype=torch.int32).view(torch.float32)
    x = torch.cat([x, payloads, torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])]).to(device)
    got = torch.empty(x.numel(), dtype=torch.bfloat16, device=device)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), EXACT_CAST=exact_cast, BLOCK=1024)
    want = x.cpu().to(torch.bfloat16)
    got = got.cpu()
    same = (got.view(torch.int16) == want.view(torch.int16)) | (torch.isnan(got) & torch.isnan(want))
    assert bool(same.all()), f"{int((~same).sum())} values differ, e.g. {x.cpu()[~same][:4].tolist()}"


@pytest.mark.cpu
def test_round_bf16_matches_torch_on_every_region():
    """The bit-level rounding used under the interpreter (its own conversion garbles subnormals)."""
    _check_round_bf16("cpu", True)


@pytest.mark.gpu
def test_round_bf16_matches_torch_on_every_region_gpu():
    """The native conversion the compiled producers use."""
    _check_round_bf16("cuda", False)


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64, 257])
@pytest.mark.parametrize("cols", [32, 128, 1280, 5120])
def test_quantize_matches_reference_cpu(fmt, rows, cols):
    if rows * cols > 64 * 1280 and rows > 64:
        cols = 128  # keep the interpreter fast: 257 rows only at narrow widths
    x = _activation(rows, cols, "cpu")
    out = poisoned_pair(rows, cols, fmt, "cpu")
    got = quant.quantize(x, fmt, out=out)
    assert got.data.data_ptr() == out.data.data_ptr()
    assert_pairs_equal(got, ref.quantize(x, fmt))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantize_fp32_input_and_zero_rows(fmt):
    x = torch.randn(7, 384)
    assert_pairs_equal(quant.quantize(x, fmt), ref.quantize(x, fmt))
    empty = quant.quantize(torch.empty(0, 384, dtype=torch.bfloat16), fmt)
    assert empty.data.shape == (0, 384) and empty.scale.shape == fmt.scale_shape(0, 384)
    zeros = torch.zeros(5, 256, dtype=torch.bfloat16)
    got = quant.quantize(zeros, fmt, out=poisoned_pair(5, 256, fmt, "cpu"))
    assert_pairs_equal(got, ref.quantize(zeros, fmt))
    assert (got.data.view(torch.uint8) == 0).all()
    assert torch.isfinite(ref.scales_as_float(got)).all()


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantize_into_rows_of_a_captured_buffer(fmt):
    """A producer writing 3 rows into a buffer captured for 64 uses that buffer's column stride."""
    captured = poisoned_pair(64, 512, fmt, "cpu")
    x = _activation(3, 512, "cpu")
    got = quant.quantize(x, fmt, out=captured.rows(3))
    assert got.scale.stride(1) == 64
    assert_pairs_equal(got, ref.quantize(x, fmt))
    # rows past 3 stay untouched
    assert_rows_poisoned(captured, 3)


@pytest.mark.cpu
def test_quantize_rejects_bad_input():
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        quant.quantize(x.half(), ActFormat.SM90_G32_FP32_MN)
    with pytest.raises(ValueError, match="2-D"):
        quant.quantize(x.view(2, 2, 256), ActFormat.SM90_G32_FP32_MN)
    with pytest.raises(ValueError, match="unit column stride"):
        quant.quantize(torch.randn(256, 4, dtype=torch.bfloat16).t(), ActFormat.SM90_G32_FP32_MN)
    with pytest.raises(TypeError, match="sm90_g32_fp32_mn.*sm90_g128_fp32_mn"):
        quant.quantize(x, ActFormat.SM90_G32_FP32_MN, out=empty_pair(4, 256, ActFormat.SM90_G128_FP32_MN))
    with pytest.raises(ValueError, match="shape"):
        quant.quantize(x, ActFormat.SM90_G32_FP32_MN, out=empty_pair(5, 256, ActFormat.SM90_G32_FP32_MN))
    with pytest.raises(ValueError, match="sm9"):
        quant.quantize(x, "sm90_g64")


def check_infinite_groups(fmt, device):
    """+-inf: its group's scale is inf and its data NaN codes (the finite values 0), the same bytes
    as the reference; a row's other groups and the other rows are quantized as without it."""
    x = _activation(6, 512, device)
    clean = ref.quantize(x, fmt)
    x[1, 5], x[1, 40], x[4, 300] = float("inf"), -float("inf"), -float("inf")
    got = quant.quantize(x, fmt, out=poisoned_pair(6, 512, fmt, device))
    assert_pairs_equal(got, ref.quantize(x, fmt))
    scales, clean_scales = ref.scales_as_float(got), ref.scales_as_float(clean)
    g = fmt.group_size
    hit = torch.zeros_like(scales, dtype=torch.bool)
    hit[1, 5 // g] = hit[1, 40 // g] = hit[4, 300 // g] = True
    assert torch.isinf(scales[hit]).all() and torch.equal(scales[~hit], clean_scales[~hit])
    dequantized = ref.dequantize(got)
    assert torch.isnan(dequantized[1, :g]).all() and torch.isnan(dequantized[4, 300 // g * g:][:g]).all()
    codes, clean_codes = got.data.view(torch.uint8), clean.data.view(torch.uint8)
    groups = torch.arange(512, device=device) // g
    untouched = ~hit[torch.arange(6, device=device)[:, None], groups[None, :]]
    assert torch.equal(codes[untouched], clean_codes[untouched])


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_infinite_groups_quantize_to_nan_cpu(fmt):
    check_infinite_groups(fmt, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_infinite_groups_quantize_to_nan_gpu(fmt):
    check_infinite_groups(fmt, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 16, 64, 127, 256, 2048, 8192])
@pytest.mark.parametrize("cols", [1280, 2048, 2304, 5120, 8192])
def test_quantize_matches_reference_gpu(fmt, rows, cols):
    assert not interpreting()
    x = _activation(rows, cols, "cuda")
    out = poisoned_pair(rows, cols, fmt, "cuda")
    got = quant.quantize(x, fmt, out=out)
    assert_pairs_equal(got, ref.quantize(x, fmt))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantize_row_strided_input(fmt):
    """x as a row-padded view (row stride > cols): the kernel walks rows by x.stride(0)."""
    full = torch.randn(5, 256 + 64) * torch.exp2(torch.randint(-8, 8, (5, 1)).float())
    x = full.bfloat16()[:, :256]
    assert x.stride(0) == 320
    got = quant.quantize(x, fmt, out=poisoned_pair(5, 256, fmt, "cpu"))
    assert_pairs_equal(got, ref.quantize(x.contiguous(), fmt))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_quantize_into_row_padded_data(fmt):
    """An out pair whose data rows are padded (data.stride(0) > cols, which check_pair allows):
    rows are written at the data's own row stride and the padding is left untouched."""
    rows, cols = 5, 256
    out, buf = row_padded_pair(rows, cols, fmt, "cpu")
    x = (torch.randn(rows, cols) * torch.exp2(torch.randint(-8, 8, (rows, 1)).float())).bfloat16()
    got = quant.quantize(x, fmt, out=out)
    assert_padded_pair_equal(got, ref.quantize(x, fmt), buf)


@pytest.mark.cpu
def test_quantize_refuses_out_on_another_device():
    """An out pair on another device than x is refused on the host (meta: no memory)."""
    x = torch.randn(4, 256).bfloat16()
    fmt = ActFormat.SM90_G32_FP32_MN
    with pytest.raises(ValueError, match="out pair is on meta"):
        quant.quantize(x, fmt, out=empty_pair(4, 256, fmt, "meta"))


@pytest.mark.cpu
def test_quantize_refuses_a_non_tensor():
    """A numpy array (or a list) is a TypeError naming the type, not an AttributeError."""
    x = torch.randn(4, 256)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):
        quant.quantize(x.numpy(), ActFormat.SM90_G32_FP32_MN)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        quant.quantize(x.tolist(), ActFormat.SM90_G32_FP32_MN)
