"""ActFormat layouts, empty_pair, check_pair and the reference numerics (CPU, torch only)."""

import copy

import pytest
import torch

from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import (
    FP8_DTYPE, ActFormat, QuantizedActivation, align4, check_no_overlap, check_pair, empty_pair, is_int, overlaps,
    powers_of_two,
)

pytestmark = pytest.mark.cpu

ALL_FORMATS = list(ActFormat)


def test_format_keys_and_properties():
    assert ActFormat("sm90_g32_fp32_mn") is ActFormat.SM90_G32_FP32_MN
    assert ActFormat.SM90_G32_FP32_MN.group_size == 32 and ActFormat.SM90_G32_FP32_MN.pow2_scales
    assert ActFormat.SM90_G128_FP32_MN.group_size == 128 and not ActFormat.SM90_G128_FP32_MN.pow2_scales
    packed = ActFormat.SM100_G32_UE8M0_PACKED_MN
    assert packed.group_size == 32 and packed.pow2_scales and packed.packed
    assert packed.scale_dtype == torch.int32
    assert ActFormat.SM90_G128_FP32_MN.scale_dtype == torch.float32


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 64, 257])
@pytest.mark.parametrize("cols", [32, 128, 1280, 5120, 2304])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_shapes_and_strides(rows, cols, fmt):
    pair = empty_pair(rows, cols, fmt, "cpu")
    groups = -(-cols // fmt.group_size)
    expected_cols = -(-groups // 4) if fmt.packed else groups
    assert pair.data.shape == (rows, cols) and pair.data.dtype == FP8_DTYPE
    assert pair.scale.shape == (rows, expected_cols) == fmt.scale_shape(rows, cols)
    assert pair.scale.dtype == fmt.scale_dtype
    if rows:
        assert pair.scale.stride() == (1, align4(rows))
        # element (m, j) at j * align4(M) + m of one [cols, align4(M)] allocation
        backing = pair.scale.as_strided((expected_cols, align4(rows)), (align4(rows), 1))
        assert backing.untyped_storage().nbytes() >= backing.numel() * backing.element_size()
    check_pair(pair, fmt)
    data, scale = pair  # still unpacks like (fp8, scale)
    assert isinstance(pair, QuantizedActivation) and data is pair.data and scale is pair.scale


def test_align4():
    assert [align4(m) for m in (0, 1, 3, 4, 5, 8, 257)] == [0, 4, 4, 4, 8, 8, 260]


def test_powers_of_two_reads_fp32_only():
    scales = torch.tensor([[0.5, 0.25], [3.0, -0.5], [0.0, float("inf")]])
    assert powers_of_two(scales).tolist() == [[True, True], [False, False], [False, False]]
    for dtype in (torch.float64, torch.bfloat16):  # their bits mean something else
        with pytest.raises(TypeError, match="float32"):
            powers_of_two(scales.to(dtype))


def test_is_int_refuses_bools_floats_and_strings():
    assert [is_int(v) for v in (0, 7, -3, 1 << 40)] == [True] * 4
    assert [is_int(v) for v in (True, False, 2.0, "8", None)] == [False] * 5


def test_check_pair_rejects_bad_pairs():
    good = empty_pair(5, 256, ActFormat.SM90_G32_FP32_MN, "cpu")
    with pytest.raises(TypeError, match="sm90_g128_fp32_mn.*sm90_g32_fp32_mn"):
        check_pair(good, ActFormat.SM90_G128_FP32_MN)
    with pytest.raises(TypeError, match="QuantizedActivation"):
        check_pair((good.data, good.scale))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        check_pair(good._replace(data=torch.zeros(5, 256, dtype=torch.bfloat16)))
    with pytest.raises(TypeError, match="float32"):
        check_pair(good._replace(scale=good.scale.double()))
    with pytest.raises(ValueError, match="shape"):
        check_pair(good._replace(scale=empty_pair(5, 512, good.fmt, "cpu").scale))
    with pytest.raises(ValueError, match="MN-major"):
        check_pair(good._replace(scale=torch.zeros(5, 8)))  # K-major (row-major) scales
    with pytest.raises(ValueError, match="MN-major"):
        check_pair(good._replace(scale=torch.zeros(8, 6).t()[:5]))  # column stride 6 not % 4
    with pytest.raises(ValueError, match="row-major"):
        check_pair(good._replace(data=torch.zeros(256, 5, dtype=FP8_DTYPE).t()))
    assert good._replace(fmt="sm90_g32_fp32_mn").fmt is ActFormat.SM90_G32_FP32_MN  # a name reads as the format
    with pytest.raises(ValueError, match="ActFormat"):
        good._replace(fmt="sm90_g64")
    relabelled = good._replace()
    relabelled.fmt = "sm90_g32_fp32_mn"  # the attribute set by hand
    with pytest.raises(TypeError, match="ActFormat"):
        check_pair(relabelled)


@pytest.mark.parametrize("fmt", list(ActFormat))
def test_a_pair_keeps_its_format_where_its_fields_are_rebuilt(fmt):
    """torch's pytree rebuilds a NamedTuple as ``type(pair)(*leaves)`` (tree_map, torch.compile):
    each format's subclass carries the format, so the rebuilt pair keeps it; the base class still
    refuses a pair without one."""
    import torch.utils._pytree as pytree

    pair = empty_pair(3, 256, fmt, "cpu")
    leaves, spec = pytree.tree_flatten({"x": pair})
    assert len(leaves) == 2 and leaves[0] is pair.data and leaves[1] is pair.scale
    rebuilt = pytree.tree_map(lambda t: t[:2], {"x": pair})["x"]  # views: the scales keep their stride
    assert isinstance(rebuilt, QuantizedActivation) and rebuilt.fmt is fmt and rebuilt.shape == (2, 256)
    check_pair(rebuilt, fmt)
    assert type(pair)._make([pair.data, pair.scale]).fmt is fmt and copy.deepcopy(pair).fmt is fmt
    data, scale = pair  # still unpacks as upstream's tuples
    for make in (lambda: QuantizedActivation(data, scale), lambda: QuantizedActivation._make([data, scale])):
        with pytest.raises(TypeError, match="needs its format"):
            make()


def test_check_pair_accepts_rows_of_a_larger_buffer():
    captured = empty_pair(64, 512, ActFormat.SM100_G32_UE8M0_PACKED_MN, "cpu")
    view = captured.rows(3)
    assert view.scale.stride() == (1, 64)
    check_pair(view, ActFormat.SM100_G32_UE8M0_PACKED_MN)


def test_rows_takes_only_rows_the_pair_has():
    """A slice would give 5 rows for rows(10) of a 5-row pair and 4 for rows(-1)."""
    pair = empty_pair(5, 256, ActFormat.SM90_G32_FP32_MN, "cpu")
    assert pair.rows(0).shape == (0, 256) and pair.rows(5).shape == (5, 256)
    for bad in (6, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"rows\(count\) takes an int in 0..5"):
            pair.rows(bad)


@pytest.mark.parametrize("fmt", [ActFormat.SM90_G32_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN])
def test_check_pair_wants_the_column_stride_of_a_single_scale_column(fmt):
    """With one scale column (K <= one group, or one packed word) the consumers still address the
    scales with the column stride S >= align4(rows): a contiguous [rows, 1] scale is refused."""
    pair = empty_pair(6, 32 if fmt.group_size == 32 and not fmt.packed else 128, fmt, "cpu")
    assert pair.scale.shape[1] == 1 and pair.scale.stride() == (1, 8)
    check_pair(pair, fmt)
    with pytest.raises(ValueError, match=r"strides \(1, S\), S >= align4\(rows\)=8"):
        check_pair(pair._replace(scale=torch.empty_strided((6, 1), (1, 1), dtype=pair.scale.dtype)), fmt)


@pytest.mark.parametrize("k", [-3, 0, 1, 5])
def test_pow2_exponent_exact_at_boundaries(k):
    # amax exactly 448 * 2^k -> scale 2^k; just above -> 2^(k+1)
    at = torch.tensor([448.0 * 2.0**k])
    above = torch.nextafter(at, torch.tensor([float("inf")]))
    assert ref.ue8m0_exponent(at).item() - 127 == k
    assert ref.ue8m0_exponent(above).item() - 127 == k + 1
    # amax exactly 1.75 * 2^k -> scale 2^(k-8); 1.75 is the mantissa boundary
    b = torch.tensor([1.75 * 2.0**k])
    assert ref.ue8m0_exponent(b).item() - 127 == k - 8
    assert ref.ue8m0_exponent(torch.nextafter(b, torch.tensor([9e9]))).item() - 127 == k - 7
    # and it matches the float definition ceil(log2(amax / 448)) on random values
    x = torch.rand(10000) * 2.0 ** torch.randint(-10, 20, (10000,)).float() + 1e-3
    want = torch.ceil(torch.log2(x.double() / 448)).int()
    assert torch.equal(ref.ue8m0_exponent(x) - 127, want)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_boundary_values_quantize_exactly(fmt):
    row = torch.zeros(2, 128)
    row[0, 0], row[0, 1] = 448.0 * 4, -448.0 * 2
    row[1, 0] = 1.75 * 2**-3
    pair = ref.quantize(row, fmt)
    scales = ref.scales_as_float(pair)
    if fmt.pow2_scales:
        assert scales[0, 0].item() == 4.0
        assert scales[1, 0].item() == 2.0 ** -11
    out = ref.dequantize(pair)
    assert out[0, 0].item() == 448.0 * 4 and out[0, 1].item() == -448.0 * 2
    assert out[1, 0].item() == 1.75 * 2**-3


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_zero_rows_give_finite_scale_and_zero_data(fmt):
    x = torch.randn(5, 256).bfloat16()
    x[2] = 0
    pair = ref.quantize(x, fmt)
    assert (pair.data[2].view(torch.uint8) == 0).all()
    scales = ref.scales_as_float(pair)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    if fmt.pow2_scales:  # UE8M0 consumers reject non-powers of two, also for zero rows
        assert (scales.view(torch.int32) & 0x7FFFFF == 0).all()


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_saturation_and_nan(fmt):
    x = torch.randn(3, 256) * 10
    x[0, 5] = float("nan")
    x[1, 7] = float("inf")
    x[1, 8] = -float("inf")
    pair = ref.quantize(x, fmt)
    codes = pair.data.view(torch.uint8)
    assert codes[0, 5].item() & 0x7F == 0x7F, "NaN must stay NaN"
    assert torch.isnan(ref.dequantize(pair)[0, 5])
    assert torch.isfinite(ref.dequantize(pair)[0, 6:]).all(), "other elements unaffected"
    # +-inf: scale inf (no finite scale holds it), multiplier 0, so inf * 0 = NaN and the group
    # turns NaN, visibly; the row's other groups are unaffected
    group = fmt.group_size
    assert torch.isinf(ref.scales_as_float(pair)[1, 0]) and (codes[1, [7, 8]] & 0x7F == 0x7F).all()
    assert (codes[1, :group] & 0x7F == 0x7F).sum() == 2  # the group's finite values quantize to 0
    assert torch.isnan(ref.dequantize(pair)[1, :group]).all()
    assert torch.isfinite(ref.dequantize(pair)[1, group:]).all()
    if fmt.packed:
        assert ref.unpack_ue8m0(pair.scale, 8)[1, 0] == 0xFF  # E8M0's NaN byte
    assert torch.isfinite(ref.dequantize(pair)[2]).all()


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("rows,cols", [(1, 32), (3, 128), (5, 1280), (64, 5120), (257, 160)])
def test_quantize_roundtrip_error(fmt, rows, cols):
    x = (torch.randn(rows, cols) * torch.rand(rows, 1) * 100).bfloat16()
    out = ref.dequantize(ref.quantize(x, fmt))
    err = (out - x.float()).abs()
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the group's scale * 448
    bound = ref.scales_as_float(ref.quantize(x, fmt)).repeat_interleave(fmt.group_size, 1)[:, :cols] * 448 * 2**-4
    assert torch.isfinite(out).all()
    assert (err <= bound + 2**-9 * bound / 448).all()


def test_pack_unpack_ue8m0_roundtrip_and_tail_bytes():
    exps = torch.randint(100, 140, (7, 5), dtype=torch.int32)
    packed = ref.pack_ue8m0(exps)
    assert packed.shape == (7, 2) and packed.stride() == (1, 8)
    assert torch.equal(ref.unpack_ue8m0(packed, 5), exps)
    raw = packed.contiguous().view(torch.uint8).view(7, 2, 4)
    assert (raw[:, 1, 1:] == 0).all(), "tail bytes past ceil(K/32) are zero"
    assert torch.equal(raw[:, 0, 0].int(), exps[:, 0])  # little-endian: group 0 in byte 0


@pytest.mark.parametrize("block", [32, 128])
def test_dequantize_weight(block):
    n, k = 200, 300
    w = (torch.randn(n, k) * 50).clamp(-448, 448).to(FP8_DTYPE)
    scale = torch.rand(-(-n // block), -(-k // block)) + 0.5
    full = ref.dequantize_weight(w, scale, block)
    assert full[block + 1, 2 * block - 1] == w[block + 1, 2 * block - 1].float() * scale[1, 1]
    with pytest.raises(ValueError, match="needs scales"):
        ref.dequantize_weight(w, scale[:1], block)


def test_pack_weight_scale_for_deepgemm():
    n, k = 100, 300
    exps = torch.randint(110, 130, (-(-n // 32), -(-k // 32)), dtype=torch.int32)
    scale = (exps << 23).view(torch.float32)
    packed = ref.pack_weight_scale_for_deepgemm(scale, n, k)
    assert packed.shape == (n, -(-k // 128)) and packed.stride() == (1, align4(n))
    rows = ref.unpack_ue8m0(packed, -(-k // 32))
    assert torch.equal(rows, exps.repeat_interleave(32, 0)[:n])
    with pytest.raises(ValueError, match="power-of-two"):
        ref.pack_weight_scale_for_deepgemm(scale * 1.5, n, k)


def test_check_pair_refuses_data_rows_that_share_memory():
    """Data whose row stride is below cols (expanded or overlapping rows) is not a row-major pair."""
    good = empty_pair(5, 256, ActFormat.SM90_G32_FP32_MN, "cpu")
    shared = torch.zeros(1, 256, dtype=FP8_DTYPE).expand(5, 256)
    with pytest.raises(ValueError, match="row-major"):
        check_pair(good._replace(data=shared))
    overlapping = torch.zeros(5 * 128 + 128, dtype=FP8_DTYPE).as_strided((5, 256), (128, 1))
    with pytest.raises(ValueError, match="row-major"):
        check_pair(good._replace(data=overlapping))


def test_check_pair_refuses_data_and_scales_on_different_devices():
    """Data on one device and scales on another is refused, naming both devices."""
    good = empty_pair(5, 256, ActFormat.SM90_G32_FP32_MN, "cpu")
    meta_scale = empty_pair(5, 256, ActFormat.SM90_G32_FP32_MN, "meta").scale
    with pytest.raises(ValueError, match="pair data on cpu but scales on meta"):
        check_pair(good._replace(scale=meta_scale))


@pytest.mark.parametrize("fmt", list(ActFormat))
def test_check_pair_wants_mn_major_scales_for_a_single_row(fmt):
    """A decode step's one-row pair still needs scales of column stride S >= 4 (consumers read j * S)."""
    pair = empty_pair(1, 1024, fmt, "cpu")
    assert pair.scale.stride() == (1, 4)
    check_pair(pair, fmt)
    k_major = torch.zeros(pair.scale.shape, dtype=pair.scale.dtype)  # strides (G, 1)
    with pytest.raises(ValueError, match="MN-major"):
        check_pair(pair._replace(scale=k_major), fmt)


def test_overlaps_does_not_count_adjacent_ranges():
    """Two halves of one buffer touch but do not share a byte: not an overlap."""
    buf = torch.zeros(8)
    assert not overlaps(buf[:4], buf[4:]) and not overlaps(buf[4:], buf[:4])
    check_no_overlap([("out", buf[:4])], [("x", buf[4:])])


def test_overlaps_counts_a_single_shared_element():
    """Ranges sharing only their last / first element overlap; so do two one-element views of it."""
    buf = torch.zeros(8)
    assert overlaps(buf[:4], buf[3:]) and overlaps(buf[2:3], buf[2:3])
    with pytest.raises(ValueError, match="out overlaps x"):
        check_no_overlap([("out", buf[2:3])], [("x", buf[2:3])])


@pytest.mark.parametrize("fmt", list(ActFormat))
def test_reference_quantize_zeroes_the_scale_padding_rows(fmt, monkeypatch):
    """ref.quantize's scale storage reads zero in the align4 padding rows, whatever torch.empty held."""
    real_empty = torch.empty

    def garbage_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        t.view(torch.uint8).fill_(0xFF) if t.is_contiguous() and t.numel() else None
        return t

    monkeypatch.setattr(torch, "empty", garbage_empty)
    rows, cols = 5, 1024
    pair = ref.quantize(torch.randn(rows, cols), fmt)
    scols = pair.scale.shape[1]
    backing = pair.scale.as_strided((scols, align4(rows)), (align4(rows), 1))
    assert (backing[:, rows:].view(torch.int32) == 0).all()
