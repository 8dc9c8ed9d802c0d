"""SiLU*mul producer (``act.silu_mul``) against ``reference.silu_mul``: CPU interpreter at small
I, GPU at the DSv4.1 shared-expert width I = 2304.

Bounds and identities checked:
* the FP8 pair == ``reference.quantize(kernel's own bf16 output)`` bit for bit, for every ActFormat,
  and ``return_bf16=False`` writes the same bytes;
* the bf16 output is within half a bf16 ulp and a little (``verify.ROUNDED_FROM_FP32``, in the
  ulp of each value's binade) of the fp32 reference ``silu(gate) * up``: the rounding of an fp32
  value that differs from the reference's by its exp and division;
* the swiglu clamp (``limit``) keeps NaN.
"""

import pytest
import torch

from fp8chain_kernel import act
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat, empty_pair
from fp8chain_kernel.reference.act import silu_mul_fp32
from helpers import (
    assert_captured_rest_untouched, assert_close_bf16, assert_other_rows_unchanged, assert_padded_pair_equal,
    assert_pairs_equal, poisoned_pair, row_padded_pair,
)

ALL_FORMATS = list(ActFormat)
CPU_T = [1, 2, 3, 4, 16, 64, 127]
GPU_T = [1, 2, 3, 4, 16, 64, 127, 256, 2048]
LIMIT = 7.0


def _gate_up(rows, inter, device):
    """Random rows (|x| up to ~4 sigma * 4, so the clamp at 7 bites; far from the |gate| > 87
    range where exp overflows and silu underflows to a subnormal), gate_up as a row-strided view."""
    scale = torch.exp2(torch.randint(-3, 1, (rows, 1), device=device).float())
    return (torch.randn(rows, 2 * inter + 32, device=device) * 4 * scale).bfloat16()[:, :2 * inter]


def _nan_bf16(rows, cols, device):
    return torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device=device)


def check_silu_mul(rows, inter, fmt, device, limit):
    gu = _gate_up(rows, inter, device)
    out = poisoned_pair(rows, inter, fmt, device)
    y, pair = act.silu_mul(gu, limit=limit, out_format=fmt, out=out, out_bf16=_nan_bf16(rows, inter, device))
    assert pair is out
    assert_close_bf16(y, silu_mul_fp32(gu, limit))
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    only = act.silu_mul(gu, limit=limit, out_format=fmt, out=poisoned_pair(rows, inter, fmt, device),
                        return_bf16=False)
    assert_pairs_equal(only, pair)
    # bf16 only: the unchained model must see the very values the chained one quantizes
    assert torch.equal(act.silu_mul(gu, limit=limit), y)


@pytest.mark.cpu
@pytest.mark.parametrize("rows", CPU_T)
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_silu_mul_cpu(rows, fmt, device):
    check_silu_mul(rows, 384, fmt, device, LIMIT if rows % 2 else None)


@pytest.mark.cpu
def test_silu_mul_cpu_ragged_width(device):
    """I not a multiple of 128: masked tail columns, a partial packed word."""
    for fmt in (ActFormat.SM90_G32_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN):
        check_silu_mul(3, 160, fmt, device, LIMIT)


@pytest.mark.cpu
@pytest.mark.parametrize("rows,cols,config", [
    (1, 2304, (1, 256, 4)), (16, 2304, (2, 256, 4)), (64, 2304, (2, 256, 4)), (65, 2304, (4, 256, 4)),
    (2048, 2304, (4, 256, 4)), (3, 384, (4, 128, 4)), (2, 160, (2, 256, 4)), (1, 576, (1, 256, 4)),
])
def test_silu_mul_launch_config(rows, cols, config):
    """512 outputs a program up to 64 rows, 1024 beyond, in tiles 128 or 256 wide (the H200 sweep
    in docs/benchmarks.md)."""
    assert act._launch_config(rows, cols) == config


@pytest.mark.cpu
@pytest.mark.parametrize("config", [dict(BLOCK_M=1, BLOCK_N=128, num_warps=2), dict(BLOCK_M=8, BLOCK_N=512, num_warps=8)])
def test_silu_mul_launch_config_override(config, device):
    """``config=`` (the benchmark's sweep) sets the tile; the outputs equal the launch rule's (an
    elementwise op), the masked tail columns included (I = 320)."""
    gu = _gate_up(5, 320, device)
    fmt = ActFormat.SM90_G128_FP32_MN
    want_y, want_pair = act.silu_mul(gu, limit=LIMIT, out_format=fmt)
    y, pair = act.silu_mul(gu, limit=LIMIT, out_format=fmt, out=poisoned_pair(5, 320, fmt, device),
                           out_bf16=_nan_bf16(5, 320, device), config=config)
    assert torch.equal(y, want_y)
    assert_pairs_equal(pair, want_pair)
    with pytest.raises(ValueError, match="config"):
        act.silu_mul(gu, config=dict(BLOCK_M=1, BLOCK_N=64, num_warps=4))


@pytest.mark.cpu
def test_silu_mul_refuses_more_column_tiles_than_a_grid_axis(device):
    """Column tiles ride grid axis 1 (65535 at most): one more is refused before anything runs, at
    either tile width; 65535 tiles of 128 pass the check (zero rows: nothing to launch)."""
    wide = 65535 * 256 + 1
    with pytest.raises(ValueError, match="65535 column tiles"):
        act.silu_mul(torch.empty(0, 2 * wide, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="65535 column tiles"):
        act.silu_mul(torch.empty(0, 2 * (65535 * 128 + 128), dtype=torch.bfloat16, device=device),
                     config=dict(BLOCK_M=1, BLOCK_N=128, num_warps=4))
    y = act.silu_mul(torch.empty(0, 2 * 65535 * 128, dtype=torch.bfloat16, device=device),
                     config=dict(BLOCK_M=1, BLOCK_N=128, num_warps=4))
    assert y.shape == (0, 65535 * 128)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", GPU_T)
@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("limit", [LIMIT, None])
def test_silu_mul_gpu(rows, fmt, limit):
    check_silu_mul(rows, 2304, fmt, torch.device("cuda"), limit)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [ActFormat.SM90_G32_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN])
def test_silu_mul_more_row_tiles_than_a_grid_axis_gpu(fmt):
    """65537 row tiles of 4 rows (I = 256): more than grid axes 1 and 2 take (65535); rows ride axis 0."""
    rows = 4 * 65537 - 3
    assert act._launch_config(rows, 256)[0] == 4
    check_silu_mul(rows, 256, fmt, torch.device("cuda"), LIMIT)


def check_special_rows(rows, inter, fmt, device):
    """All-zero rows -> zero data, finite positive scales. NaN in gate (and in up) stays NaN in
    bf16 and FP8 (0x7F/0xFF), through the clamp; the other rows equal a run without it."""
    gu = _gate_up(rows, inter, device).contiguous()
    gu[1] = 0
    clean_y, clean_pair = act.silu_mul(gu, limit=LIMIT, out_format=fmt)
    assert (clean_y[1] == 0).all() and (clean_pair.data[1].float() == 0).all()
    s = ref.scales_as_float(clean_pair)[1]
    assert torch.isfinite(s).all() and (s > 0).all()
    gu[2, 5] = float("nan")               # gate
    gu[2, inter + 40] = float("nan")      # up
    y, pair = act.silu_mul(gu, limit=LIMIT, out_format=fmt, out=poisoned_pair(rows, inter, fmt, device))
    assert torch.isnan(y[2, 5]) and torch.isnan(y[2, 40])
    assert (pair.data[2, [5, 40]].view(torch.uint8) & 0x7F == 0x7F).all()
    assert_other_rows_unchanged(y, pair, clean_y, clean_pair, changed_row=2)
    assert_pairs_equal(pair, ref.quantize(y, fmt))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_silu_mul_zero_and_nan_rows_cpu(fmt, device):
    check_special_rows(5, 256, fmt, device)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_silu_mul_zero_and_nan_rows_gpu(fmt):
    check_special_rows(7, 2304, fmt, torch.device("cuda"))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_silu_mul_empty(fmt, device):
    gu = torch.empty(0, 512, dtype=torch.bfloat16, device=device)
    assert act.silu_mul(gu).shape == (0, 256)
    y, pair = act.silu_mul(gu, limit=LIMIT, out_format=fmt)
    assert y.shape == (0, 256) and pair.data.shape == (0, 256) and pair.fmt is fmt
    assert act.silu_mul(gu, out_format=fmt, return_bf16=False).data.shape == (0, 256)


def check_captured_buffers(inter, fmt, device):
    big = poisoned_pair(64, inter, fmt, device)
    out = big.rows(3)
    assert out.scale.stride(1) == 64
    big_y = _nan_bf16(8, inter + 64, device)
    out_y = big_y[:3, :inter]
    gu = _gate_up(3, inter, device)
    y, pair = act.silu_mul(gu, limit=LIMIT, out_format=fmt, out=out, out_bf16=out_y)
    assert y.data_ptr() == out_y.data_ptr() and pair.data.data_ptr() == big.data.data_ptr()
    assert_close_bf16(y, silu_mul_fp32(gu, LIMIT))
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    assert_captured_rest_untouched(big, big_y, 3, inter)


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_silu_mul_captured_buffers_cpu(fmt, device):
    check_captured_buffers(384, fmt, device)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_silu_mul_captured_buffers_gpu(fmt):
    check_captured_buffers(2304, fmt, torch.device("cuda"))


@pytest.mark.cpu
def test_silu_mul_reference_clamp(device):
    gu = torch.tensor([[10.0, -10.0, float("nan"), 1.0, 20.0, -20.0, 3.0, float("nan")]],
                      dtype=torch.bfloat16, device=device)
    want = silu_mul_fp32(gu, LIMIT)
    gate = torch.tensor([7.0, -10.0, float("nan"), 1.0])
    up = torch.tensor([7.0, -7.0, 3.0, float("nan")])
    expect = (torch.nn.functional.silu(gate) * up)[None]
    assert torch.equal(want.isnan().cpu(), expect.isnan())
    assert torch.allclose(want.cpu().nan_to_num(), expect.nan_to_num())
    y = act.silu_mul(gu, limit=LIMIT)
    assert torch.equal(y.isnan(), want.isnan())
    assert_close_bf16(y[~y.isnan()], want[~want.isnan()])


@pytest.mark.cpu
def test_silu_mul_bad_inputs(device):
    gu = _gate_up(3, 256, device)
    fmt = ActFormat.SM90_G32_FP32_MN
    with pytest.raises(TypeError):
        act.silu_mul(gu.float())
    with pytest.raises(ValueError):
        act.silu_mul(gu[:, :511])  # odd width
    with pytest.raises(ValueError):
        act.silu_mul(gu[0])
    with pytest.raises(ValueError):
        act.silu_mul(gu.t().contiguous().t())
    with pytest.raises(ValueError):
        act.silu_mul(gu, limit=-1.0)
    with pytest.raises(TypeError):
        act.silu_mul(gu, out_format=fmt, out=empty_pair(3, 256, ActFormat.SM100_G32_UE8M0_PACKED_MN, device))
    with pytest.raises(ValueError):
        act.silu_mul(gu, out_format=fmt, out=empty_pair(3, 512, fmt, device))
    with pytest.raises(TypeError):
        act.silu_mul(gu, out_bf16=torch.empty(3, 256, dtype=torch.float16, device=device))
    with pytest.raises(ValueError):
        act.silu_mul(gu, return_bf16=False)


@pytest.mark.cpu
def test_silu_mul_refuses_nan_limit():
    """A NaN swiglu limit is not a positive number: refused (it would pass the fp32-range test)."""
    with pytest.raises(ValueError, match="positive number"):
        act.check_limit(float("nan"))
    with pytest.raises(ValueError, match="positive number"):
        act.silu_mul(torch.randn(2, 256).bfloat16(), limit=float("nan"))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_silu_mul_cpu_width_not_a_multiple_of_the_group(fmt, device):
    """I = 100: the last scale group (of 32 or 128 columns) is partial and must still be written."""
    check_silu_mul(3, 100, fmt, device, LIMIT)


@pytest.mark.cpu
def test_silu_mul_limit_bounds(device):
    """fp32's largest value is a limit like inf (nothing clamped: the same bits); 0, -0, a bool and
    a negative limit are refused (not a positive number)."""
    gu = _gate_up(3, 128, device)
    assert torch.equal(act.silu_mul(gu, limit=torch.finfo(torch.float32).max).view(torch.int16),
                       act.silu_mul(gu, limit=float("inf")).view(torch.int16))
    for limit in (0.0, -0.0, 0, True, -7.0):
        with pytest.raises(ValueError, match="limit must be a positive number or None"):
            act.silu_mul(gu, limit=limit)


@pytest.mark.cpu
def test_silu_mul_into_row_padded_data(device):
    """An out pair whose data rows are padded (data.stride(0) > I, which check_pair allows): rows
    are written at the data's own row stride and the padding is left untouched."""
    rows, inter, fmt = 3, 128, ActFormat.SM90_G32_FP32_MN
    out, buf = row_padded_pair(rows, inter, fmt, device)
    y, pair = act.silu_mul(_gate_up(rows, inter, device), limit=LIMIT, out=out)
    assert_padded_pair_equal(pair, ref.quantize(y, fmt), buf)
