"""RMSNorm producer (``norm.rms_norm``) against ``reference.rms_norm``: CPU interpreter at small
H, GPU at DSv4.1 shapes (H = 5120 hidden, 1280 q_norm).

Bounds and identities checked:
* the FP8 pair == ``reference.quantize(kernel's own bf16 output)`` bit for bit, for every ActFormat,
  and ``return_bf16=False`` writes the same bytes;
* the bf16 output is within half a bf16 ulp and a little (``verify.ROUNDED_FROM_FP32``, in the
  ulp of each value's binade) of the fp32 reference ``h * rsqrt(mean(h^2) + eps) * weight``: the
  rounding of an fp32 value that differs from the reference's by its reduction order and rsqrt;
* with ``residual``: the residual is updated in place to ``bf16(x + residual)`` bit for bit;
* the bf16-only variant writes the same bf16 bytes as the FP8-emitting one.
"""

import pytest
import torch

from fp8chain_kernel import norm
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat, empty_pair
from fp8chain_kernel.reference.norm import add_residual, rms_norm_fp32
from helpers import (
    assert_captured_rest_untouched, assert_close_bf16, assert_other_rows_unchanged, assert_padded_pair_equal,
    assert_pairs_equal, poisoned_pair, row_padded_pair,
)

ALL_FORMATS = list(ActFormat)
EPS = 1e-6
CPU_T = [1, 2, 3, 4, 16, 64, 127]
GPU_T = [1, 2, 3, 4, 16, 64, 127, 256, 2048]


def _inputs(rows, cols, device, residual):
    """Random rows of different magnitudes; x as a row-strided view (row stride > cols)."""
    scale = torch.exp2(torch.randint(-6, 6, (rows, 1), device=device).float())
    x = (torch.randn(rows, cols + 16, device=device) * scale).bfloat16()[:, :cols]
    w = (1.0 + 0.5 * torch.randn(cols, device=device)).bfloat16()
    r = (torch.randn(rows, cols, device=device) * scale).bfloat16() if residual else None
    return x, w, r


def _nan_bf16(rows, cols, device):
    return torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device=device)


def check_rms_norm(rows, cols, fmt, device, residual, eps=EPS, magnitude=None):
    """``magnitude``: every row at this scale (default: rows of 2^-6 .. 2^5)."""
    x, w, r = _inputs(rows, cols, device, residual)
    if magnitude is not None:
        x = (x.float() / x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-30) * magnitude).bfloat16()
    r_kernel = r.clone() if residual else None
    out = poisoned_pair(rows, cols, fmt, device)
    y, pair = norm.rms_norm(x, w, eps, residual=r_kernel, out_format=fmt, out=out,
                            out_bf16=_nan_bf16(rows, cols, device))
    assert pair is out
    h = add_residual(x, r) if residual else x
    if residual:
        assert torch.equal(r_kernel, h), "residual not updated to bf16(x + residual)"
    assert_close_bf16(y, rms_norm_fp32(h, w, eps))
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    # FP8 only: same bytes, no bf16 written; the residual update still happens.
    r_only = r.clone() if residual else None
    only = norm.rms_norm(x, w, eps, residual=r_only, out_format=fmt, out=poisoned_pair(rows, cols, fmt, device),
                         return_bf16=False)
    assert_pairs_equal(only, pair)
    if residual:
        assert torch.equal(r_only, h)
    # bf16 only: another compiled variant with the same layout and reduction order, so bitwise
    # equal (the unchained model must see the very values the chained one quantizes)
    assert torch.equal(norm.rms_norm(h, w, eps), y)


@pytest.mark.cpu
@pytest.mark.parametrize("eps", [1e-2, 1e-5])
def test_rms_norm_cpu_eps_comparable_to_the_mean_square(eps, device):
    """Rows whose mean square is about eps: where eps enters (inside the square root, added to
    the mean square) decides the output here, not a last-bit difference."""
    check_rms_norm(5, 256, ActFormat.SM90_G32_FP32_MN, device, residual=False, eps=eps,
                   magnitude=(3 * eps) ** 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 64, 2048])
@pytest.mark.parametrize("cols", [5120, 1280])
@pytest.mark.parametrize("eps", [1e-2, 1e-5])
def test_rms_norm_eps_comparable_to_the_mean_square_gpu(rows, cols, eps):
    """The compiled kernels at DSv4.1 widths (the sublayer input, q_norm), eps of the rows' mean
    square's order."""
    check_rms_norm(rows, cols, ActFormat.SM100_G32_UE8M0_PACKED_MN, torch.device("cuda"), residual=False, eps=eps,
                   magnitude=(3 * eps) ** 0.5)


@pytest.mark.cpu
@pytest.mark.parametrize("rows", CPU_T)
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_rms_norm_cpu(rows, fmt, device):
    check_rms_norm(rows, 256, fmt, device, residual=rows % 2 == 1)


@pytest.mark.cpu
@pytest.mark.parametrize("cols", [96, 320])
def test_rms_norm_cpu_ragged_width(cols, device):
    """H not a multiple of 128 (partial packed word) nor of 64: masked tail groups."""
    for fmt in (ActFormat.SM90_G32_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN):
        check_rms_norm(5, cols, fmt, device, residual=True)


@pytest.mark.cpu
@pytest.mark.parametrize("rows,cols,config", [
    (1, 256, (1, 256, 4)), (16, 256, (8, 256, 4)), (3, 1280, (1, 2048, 8)), (1023, 1280, (1, 2048, 8)),
    (1024, 1280, (2, 2048, 4)), (1, 5120, (1, 8192, 8)), (2048, 5120, (1, 8192, 8)), (4, 10000, (1, 16384, 16)),
])
def test_rms_norm_launch_config(rows, cols, config):
    """Programs of whole rows: narrow rows share one, a row of up to 8192 values gets 8 warps, two
    rows of 1280 share one from 1024 rows on (the H200 sweep in docs/benchmarks.md)."""
    assert norm._launch_config(rows, cols) == config


@pytest.mark.cpu
@pytest.mark.parametrize("config", [dict(BLOCK_M=1, BLOCK_H=256, num_warps=2), dict(BLOCK_M=4, BLOCK_H=512, num_warps=8)])
def test_rms_norm_launch_config_override(config, device):
    """``config=`` (the benchmark's sweep) sets the program shape; every row is still written and
    the pair is the quantization of the bf16 output."""
    x, w, _ = _inputs(5, 160, device, False)
    fmt = ActFormat.SM100_G32_UE8M0_PACKED_MN
    y, pair = norm.rms_norm(x, w, EPS, out_format=fmt, out=poisoned_pair(5, 160, fmt, device),
                            out_bf16=_nan_bf16(5, 160, device), config=config)
    assert_close_bf16(y, rms_norm_fp32(x, w, EPS))
    assert_pairs_equal(pair, ref.quantize(y, fmt))


@pytest.mark.cpu
@pytest.mark.parametrize("config", [
    dict(BLOCK_M=1, BLOCK_H=128, num_warps=4), dict(BLOCK_M=3, BLOCK_H=256, num_warps=4),
    dict(BLOCK_M=1, BLOCK_H=256, num_warps=32), dict(BLOCK_M=1, BLOCK_N=256, num_warps=4), (1, 256, 4),
    dict(BLOCK_M=True, BLOCK_H=256, num_warps=4),
])
def test_rms_norm_rejects_bad_launch_config(config, device):
    """A tile narrower than the row, a non-power of two, too many warps, wrong keys or type."""
    x, w, _ = _inputs(2, 160, device, False)
    with pytest.raises(ValueError, match="config"):
        norm.rms_norm(x, w, EPS, config=config)
    with pytest.raises(ValueError, match="config"):  # checked before the empty-batch shortcut
        norm.rms_norm(x[:0], w, EPS, config=config)


@pytest.mark.cpu
@pytest.mark.parametrize("rows", [3, 1030])
def test_rms_norm_cpu_q_lora_width(rows, device):
    """q_norm's width (1280 of a 2048 tile): a row per 8-warp program, two rows a program past 1024."""
    check_rms_norm(rows, 1280, ActFormat.SM90_G32_FP32_MN, device, residual=rows % 2 == 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", GPU_T)
@pytest.mark.parametrize("cols", [5120, 1280])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_rms_norm_gpu(rows, cols, fmt):
    check_rms_norm(rows, cols, fmt, torch.device("cuda"), residual=cols == 5120)


def check_special_rows(rows, cols, fmt, device):
    """All-zero rows: zero output, zero data, finite positive scales. A NaN row stays NaN in bf16
    and in the FP8 data (0x7F/0xFF); so does a row of finite values whose sum of squares
    overflows fp32 (its rsqrt would be 0: zeros, silently wrong); the other rows equal a run
    without them."""
    x, w, _ = _inputs(rows, cols, device, False)
    x = x.contiguous()
    x[1] = 0
    clean_y, clean_pair = norm.rms_norm(x, w, EPS, out_format=fmt)
    assert torch.equal(clean_y[1], torch.zeros_like(clean_y[1]))
    assert (clean_pair.data[1].float() == 0).all()  # +-0 (a negative weight gives -0)
    s = ref.scales_as_float(clean_pair)[1]
    assert torch.isfinite(s).all() and (s > 0).all()
    clean_x_row = x[2].clone()
    x[2, cols // 3] = float("nan")
    y, pair = norm.rms_norm(x, w, EPS, out_format=fmt, out=poisoned_pair(rows, cols, fmt, device))
    assert torch.isnan(y[2]).all()
    assert ((pair.data[2].view(torch.uint8) & 0x7F) == 0x7F).all()
    assert_other_rows_unchanged(y, pair, clean_y, clean_pair, changed_row=2)
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    x[2] = clean_x_row
    x[3] = x[3] * 1e20
    assert torch.isfinite(x[3].float()).all() and not torch.isfinite(x[3].float().square().sum())
    y, pair = norm.rms_norm(x, w, EPS, out_format=fmt, out=poisoned_pair(rows, cols, fmt, device))
    assert torch.isnan(y[3]).all() and torch.isnan(ref.rms_norm(x, w, EPS)[3]).all()
    assert ((pair.data[3].view(torch.uint8) & 0x7F) == 0x7F).all()
    assert_other_rows_unchanged(y, pair, clean_y, clean_pair, changed_row=3)
    assert_pairs_equal(pair, ref.quantize(y, fmt))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_rms_norm_zero_and_nan_rows_cpu(fmt, device):
    check_special_rows(5, 256, fmt, device)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_rms_norm_zero_and_nan_rows_gpu(fmt):
    check_special_rows(7, 5120, fmt, torch.device("cuda"))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_rms_norm_empty(fmt, device):
    x = torch.empty(0, 256, dtype=torch.bfloat16, device=device)
    w = torch.ones(256, dtype=torch.bfloat16, device=device)
    assert norm.rms_norm(x, w, EPS).shape == (0, 256)
    y, pair = norm.rms_norm(x, w, EPS, out_format=fmt, residual=torch.empty_like(x))
    assert y.shape == (0, 256) and pair.data.shape == (0, 256) and pair.fmt is fmt
    assert norm.rms_norm(x, w, EPS, out_format=fmt, return_bf16=False).data.shape == (0, 256)


def check_captured_buffers(cols, fmt, device):
    """A pair sliced from a buffer captured for 64 rows (scale column stride 64) and a bf16 out
    that is a row-strided view: both honoured, the rows past 3 untouched."""
    big = poisoned_pair(64, cols, fmt, device)
    out = big.rows(3)
    assert out.scale.stride(1) == 64
    big_y = _nan_bf16(8, cols + 64, device)
    out_y = big_y[:3, :cols]
    x, w, r = _inputs(3, cols, device, True)
    r_kernel = r.clone()
    y, pair = norm.rms_norm(x, w, EPS, residual=r_kernel, out_format=fmt, out=out, out_bf16=out_y)
    assert y.data_ptr() == out_y.data_ptr() and pair.data.data_ptr() == big.data.data_ptr()
    h = add_residual(x, r)
    assert_close_bf16(y, rms_norm_fp32(h, w, EPS))
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    assert_captured_rest_untouched(big, big_y, 3, cols)


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_rms_norm_captured_buffers_cpu(fmt, device):
    check_captured_buffers(256, fmt, device)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_rms_norm_captured_buffers_gpu(fmt):
    check_captured_buffers(5120, fmt, torch.device("cuda"))


@pytest.mark.cpu
def test_rms_norm_out_implies_format(device):
    x, w, _ = _inputs(3, 256, device, False)
    out = poisoned_pair(3, 256, ActFormat.SM100_G32_UE8M0_PACKED_MN, device)
    y, pair = norm.rms_norm(x, w, EPS, out=out)
    assert pair is out
    assert_pairs_equal(pair, ref.quantize(y, out.fmt))


@pytest.mark.cpu
def test_rms_norm_reference_structure(device):
    x, w, r = _inputs(3, 256, device, True)
    r_ref = r.clone()
    y, pair = ref.rms_norm(x, w, EPS, residual=r_ref, out_format=ActFormat.SM90_G32_FP32_MN)
    assert torch.equal(r_ref, add_residual(x, r))
    assert torch.equal(y, rms_norm_fp32(r_ref, w, EPS).bfloat16())
    assert_pairs_equal(pair, ref.quantize(y, pair.fmt))
    only = ref.rms_norm(x, w, EPS, out_format=ActFormat.SM90_G32_FP32_MN, return_bf16=False)
    assert only.fmt is ActFormat.SM90_G32_FP32_MN
    with pytest.raises(ValueError):
        ref.rms_norm(x, w, EPS, return_bf16=False)


@pytest.mark.cpu
def test_rms_norm_bad_inputs(device):
    x, w, r = _inputs(3, 256, device, True)
    fmt = ActFormat.SM90_G32_FP32_MN
    with pytest.raises(TypeError):
        norm.rms_norm(x.float(), w, EPS)
    with pytest.raises(TypeError):
        norm.rms_norm(x, w.float(), EPS)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):
        norm.rms_norm(x.float().cpu().numpy(), w, EPS)
    with pytest.raises(ValueError):
        norm.rms_norm(x[0], w, EPS)
    with pytest.raises(ValueError):
        norm.rms_norm(x, w[:128], EPS)
    with pytest.raises(ValueError):
        norm.rms_norm(x.t().contiguous().t(), w, EPS)  # column-major
    with pytest.raises(ValueError):
        norm.rms_norm(x, w, EPS, residual=r[:2])
    with pytest.raises(TypeError):
        norm.rms_norm(x, w, EPS, residual=r.float())
    with pytest.raises(TypeError):  # out pair of another format
        norm.rms_norm(x, w, EPS, out_format=fmt, out=empty_pair(3, 256, ActFormat.SM90_G128_FP32_MN, device))
    with pytest.raises(ValueError):  # out pair of another shape
        norm.rms_norm(x, w, EPS, out_format=fmt, out=empty_pair(4, 256, fmt, device))
    with pytest.raises(TypeError):
        norm.rms_norm(x, w, EPS, out_format=fmt, out=(torch.empty(3, 256), torch.empty(3, 8)))
    with pytest.raises(TypeError):
        norm.rms_norm(x, w, EPS, out_bf16=torch.empty(3, 256, device=device))
    with pytest.raises(ValueError):
        norm.rms_norm(x, w, EPS, out_bf16=torch.empty(3, 128, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError):
        norm.rms_norm(x, w, EPS, return_bf16=False)
    with pytest.raises(ValueError):
        norm.rms_norm(x, w, EPS, out_format=fmt, return_bf16=False,
                      out_bf16=torch.empty(3, 256, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError):
        norm.rms_norm(x, w, EPS, out_format="sm90_g64_nonsense")
    with pytest.raises(ValueError):
        norm.rms_norm(x, w, -1.0)


@pytest.mark.cpu
def test_rms_norm_refuses_strided_weight(device):
    """The kernel reads the weight at unit stride: a strided weight view is refused."""
    x = torch.randn(3, 256, device=device).bfloat16()
    w = torch.randn(512, device=device).bfloat16()[::2]
    with pytest.raises(ValueError, match="weight must be contiguous"):
        norm.rms_norm(x, w, EPS)


@pytest.mark.cpu
def test_rms_norm_takes_rows_of_exactly_one_tile():
    """H = 2^20 (MAX_TILE_ELEMS) still fits one program: accepted (zero rows: nothing runs)."""
    cols = norm.MAX_TILE_ELEMS
    y = norm.rms_norm(torch.empty(0, cols, dtype=torch.bfloat16), torch.ones(cols, dtype=torch.bfloat16), EPS)
    assert y.shape == (0, cols)


@pytest.mark.cpu
def test_rms_norm_refuses_weight_on_another_device():
    """A weight on another device than x is refused on the host (meta: no memory)."""
    x = torch.randn(3, 256).bfloat16()
    with pytest.raises(ValueError, match="weight is on meta"):
        norm.rms_norm(x, torch.empty(256, dtype=torch.bfloat16, device="meta"), EPS)


@pytest.mark.cpu
def test_rms_norm_refuses_residual_over_weight():
    """residual is written in place: it may not share memory with the weight the launch reads."""
    storage = torch.randn(4 * 256).bfloat16()
    x = torch.randn(3, 256).bfloat16()
    with pytest.raises(ValueError, match="residual overlaps weight"):
        norm.rms_norm(x, storage[3 * 256 - 128:][:256], EPS, residual=storage[:3 * 256].view(3, 256))


@pytest.mark.cpu
def test_rms_norm_eps_range_bounds(device):
    """eps = 0, fp32's smallest subnormal 2^-149 and its largest value are taken, each giving the
    reference's output at that eps; 2^-150 (0 once passed as fp32, where torch would add it), a
    negative value and a finite value past fp32's largest are refused before anything runs."""
    x, w, _ = _inputs(3, 128, device, False)
    for eps in (0, 0.0, 2.0**-149, norm.FP32_MAX):
        assert_close_bf16(norm.rms_norm(x, w, eps), rms_norm_fp32(x, w, eps))
    for eps in (2.0**-150, -(2.0**-149), 2.0 * norm.FP32_MAX):
        with pytest.raises(ValueError, match="eps must be a non-negative number"):
            norm.rms_norm(x, w, eps)


@pytest.mark.cpu
def test_rms_norm_refuses_outputs_without_unit_column_stride(device):
    """A column-major out_bf16 or residual (one location per element, so only the stride check
    stands in the way) is refused: the kernel writes them at unit column stride."""
    x, w, r = _inputs(3, 128, device, True)
    with pytest.raises(ValueError, match="out_bf16 must have unit column stride"):
        norm.rms_norm(x, w, EPS, out_bf16=torch.empty(128, 3, dtype=torch.bfloat16, device=device).t())
    with pytest.raises(ValueError, match="residual must have unit column stride"):
        norm.rms_norm(x, w, EPS, residual=r.t().contiguous().t())


@pytest.mark.cpu
def test_rms_norm_out_that_is_not_a_pair(device):
    """``out`` without ``out_format`` must be a QuantizedActivation (its format is read from it):
    a bare (data, scale) tuple is a TypeError, not an AttributeError."""
    x, w, _ = _inputs(3, 128, device, False)
    pair = empty_pair(3, 128, ActFormat.SM90_G32_FP32_MN, device)
    with pytest.raises(TypeError, match="out must be a QuantizedActivation, got tuple"):
        norm.rms_norm(x, w, EPS, out=(pair.data, pair.scale))


@pytest.mark.cpu
def test_rms_norm_launch_config_bounds(device):
    """A config at the limits is taken: BLOCK_H equal to the row width when that is 128 (whole
    rows; the rows equal the launch rule's, an identical reduction), and a tile of exactly 2^20
    values (checked before the empty batch returns)."""
    x, w, _ = _inputs(3, 128, device, False)
    fmt = ActFormat.SM90_G32_FP32_MN
    y, pair = norm.rms_norm(x, w, EPS, out_format=fmt, config=dict(BLOCK_M=4, BLOCK_H=128, num_warps=4))
    assert torch.equal(y, norm.rms_norm(x, w, EPS))
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    big = dict(BLOCK_M=norm.MAX_TILE_ELEMS // 128, BLOCK_H=128, num_warps=4)
    assert norm.rms_norm(x[:0], w, EPS, config=big).shape == (0, 128)


@pytest.mark.cpu
def test_rms_norm_into_row_padded_data(device):
    """An out pair whose data rows are padded (data.stride(0) > H, which check_pair allows): rows
    are written at the data's own row stride and the padding is left untouched."""
    rows, cols, fmt = 3, 128, ActFormat.SM100_G32_UE8M0_PACKED_MN
    out, buf = row_padded_pair(rows, cols, fmt, device)
    x, w, _ = _inputs(rows, cols, device, False)
    y, pair = norm.rms_norm(x, w, EPS, out=out)
    assert_padded_pair_equal(pair, ref.quantize(y, fmt), buf)


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_rms_norm_cpu_width_not_a_multiple_of_the_group(fmt, device):
    """H = 100: the last scale group (of 32 or 128 columns) is partial and must still be written."""
    check_rms_norm(3, 100, fmt, device, residual=True)


@pytest.mark.cpu
def test_rms_norm_refuses_a_config_narrower_than_128(device):
    """BLOCK_H below 128 is refused even where it holds the whole row (H = 64): a program must
    hold whole 128-column scale groups of every format."""
    x, w, _ = _inputs(2, 64, device, False)
    with pytest.raises(ValueError, match="BLOCK_H >= 128"):
        norm.rms_norm(x, w, EPS, config=dict(BLOCK_M=1, BLOCK_H=64, num_warps=4))
