"""wo_a grouped einsum producer (``einsum.wo_a_einsum``) against ``reference.wo_a_einsum``: CPU
interpreter at small G/R/D, GPU at DSv4.1 shapes (G = 8 at TP1 and G = 2 at TP4, R = 1024,
D = 4096).

Bounds and identities checked:
* the FP8 pair == ``reference.quantize(kernel's own bf16 output)`` bit for bit, for every ActFormat,
  and ``return_bf16=False`` writes the same bytes;
* the bf16 output against the fp64 einsum: ``||y - y64|| / ||y64|| < 2.5e-3`` (the bf16 rounding
  alone is at most 2^-9 = 1.95e-3 relative per element; fp32 accumulation adds ~1e-6);
* ``o`` given as a strided view (row-padded, or the transpose of a ``[G, T, D]`` buffer).
"""

import pytest
import torch

from fp8chain_kernel import einsum, launch
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat, empty_pair
from fp8chain_kernel.reference.einsum import wo_a_einsum_fp
from helpers import assert_captured_rest_untouched, assert_pairs_equal, poisoned_pair, rel_error

ALL_FORMATS = list(ActFormat)
CPU_T = [1, 2, 3, 4, 16, 64, 127]
GPU_T = [1, 2, 3, 4, 16, 64, 127, 256, 2048]
REL_BOUND = 2.5e-3


def _inputs(rows, groups, r, d, device, layout="padded"):
    """o as a strided view ([T, G, D+16] sliced, or [G, T, D] transposed), wo_a ~ 1/sqrt(D)."""
    scale = torch.exp2(torch.randint(-4, 4, (rows, 1, 1), device=device).float())
    if layout == "padded":
        o = (torch.randn(rows, groups, d + 16, device=device) * scale).bfloat16()[:, :, :d]
    else:
        o = (torch.randn(groups, rows, d, device=device) * scale.view(1, rows, 1)).bfloat16().transpose(0, 1)
    w = (torch.randn(groups, r, d, device=device) / d ** 0.5).bfloat16()
    return o, w


def _nan_bf16(rows, cols, device):
    return torch.full((rows, cols), float("nan"), dtype=torch.bfloat16, device=device)


def check_wo_a(rows, groups, r, d, fmt, device, layout="padded"):
    o, w = _inputs(rows, groups, r, d, device, layout)
    cols = groups * r
    out = poisoned_pair(rows, cols, fmt, device)
    y, pair = einsum.wo_a_einsum(o, w, out_format=fmt, out=out, out_bf16=_nan_bf16(rows, cols, device))
    assert pair is out
    err = rel_error(y, wo_a_einsum_fp(o, w, torch.float64))
    assert err < REL_BOUND, f"relative error {err:.3g} vs fp64 >= {REL_BOUND}"
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    only = einsum.wo_a_einsum(o, w, out_format=fmt, out=poisoned_pair(rows, cols, fmt, device), return_bf16=False)
    assert_pairs_equal(only, pair)
    y_plain = einsum.wo_a_einsum(o, w, tile_group=fmt.group_size)
    assert torch.equal(y_plain, y)  # the chain switched off: the same bf16 bits as with the pair


@pytest.mark.cpu
@pytest.mark.parametrize("rows", CPU_T)
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_wo_a_cpu(rows, fmt, device):
    check_wo_a(rows, 2, 128, 64, fmt, device, layout="padded" if rows % 2 else "transposed")


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", [ActFormat.SM90_G32_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN])
@pytest.mark.parametrize("rows", [3, 70])
def test_wo_a_cpu_ragged(rows, fmt, device):
    """G*R/32 = 15 groups (a partial packed word, tail bytes zero), D not a multiple of the K tile,
    R not a multiple of the N tile."""
    check_wo_a(rows, 3, 160, 80, fmt, device)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", GPU_T)
@pytest.mark.parametrize("groups", [8, 2])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_wo_a_gpu(rows, groups, fmt):
    check_wo_a(rows, groups, 1024, 4096, fmt, torch.device("cuda"),
               layout="padded" if rows % 2 else "transposed")


def check_special_rows(rows, groups, r, d, fmt, device):
    """An all-zero row -> zero data, finite positive scales. NaN in o[2, 1] turns that group's
    columns of row 2 into NaN (bf16 and FP8 0x7F/0xFF) and nothing else."""
    o, w = _inputs(rows, groups, r, d, device)
    o = o.contiguous()
    o[1] = 0
    clean_y, clean_pair = einsum.wo_a_einsum(o, w, out_format=fmt)
    assert (clean_y[1] == 0).all() and (clean_pair.data[1].float() == 0).all()
    s = ref.scales_as_float(clean_pair)[1]
    assert torch.isfinite(s).all() and (s > 0).all()
    o[2, 1, d // 2] = float("nan")
    y, pair = einsum.wo_a_einsum(o, w, out_format=fmt, out=poisoned_pair(rows, groups * r, fmt, device))
    assert torch.isnan(y[2, r:2 * r]).all()
    assert ((pair.data[2, r:2 * r].view(torch.uint8) & 0x7F) == 0x7F).all()
    nan_mask = torch.zeros_like(y, dtype=torch.bool)
    nan_mask[2, r:2 * r] = True
    assert torch.equal(y[~nan_mask], clean_y[~nan_mask])
    keep = [i for i in range(rows) if i != 2]
    assert torch.equal(pair.data[keep].view(torch.uint8), clean_pair.data[keep].view(torch.uint8))
    assert_pairs_equal(pair, ref.quantize(y, fmt))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_wo_a_zero_and_nan_rows_cpu(fmt, device):
    check_special_rows(5, 2, 128, 64, fmt, device)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_wo_a_zero_and_nan_rows_gpu(fmt):
    check_special_rows(7, 8, 1024, 4096, fmt, torch.device("cuda"))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_wo_a_empty(fmt, device):
    o = torch.empty(0, 2, 64, dtype=torch.bfloat16, device=device)
    w = torch.randn(2, 128, 64, device=device).bfloat16()
    assert einsum.wo_a_einsum(o, w).shape == (0, 256)
    y, pair = einsum.wo_a_einsum(o, w, out_format=fmt)
    assert y.shape == (0, 256) and pair.data.shape == (0, 256) and pair.fmt is fmt
    assert einsum.wo_a_einsum(o, w, out_format=fmt, return_bf16=False).data.shape == (0, 256)


def check_captured_buffers(groups, r, d, fmt, device):
    cols = groups * r
    big = poisoned_pair(64, cols, fmt, device)
    out = big.rows(3)
    assert out.scale.stride(1) == 64
    big_y = _nan_bf16(8, cols + 64, device)
    out_y = big_y[:3, :cols]
    o, w = _inputs(3, groups, r, d, device)
    y, pair = einsum.wo_a_einsum(o, w, out_format=fmt, out=out, out_bf16=out_y)
    assert y.data_ptr() == out_y.data_ptr() and pair.data.data_ptr() == big.data.data_ptr()
    assert rel_error(y, wo_a_einsum_fp(o, w, torch.float64)) < REL_BOUND
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    assert_captured_rest_untouched(big, big_y, 3, cols)


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_wo_a_captured_buffers_cpu(fmt, device):
    check_captured_buffers(2, 128, 64, fmt, device)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_wo_a_captured_buffers_gpu(fmt):
    check_captured_buffers(2, 1024, 4096, fmt, torch.device("cuda"))


@pytest.mark.cpu
def test_wo_a_bad_inputs(device):
    o, w = _inputs(3, 2, 128, 64, device)
    fmt = ActFormat.SM90_G32_FP32_MN
    with pytest.raises(TypeError):
        einsum.wo_a_einsum(o.float(), w)
    with pytest.raises(TypeError):
        einsum.wo_a_einsum(o, w.half())
    with pytest.raises(ValueError):
        einsum.wo_a_einsum(o[:, 0], w)
    with pytest.raises(ValueError):
        einsum.wo_a_einsum(o, w[:1])
    with pytest.raises(ValueError):
        einsum.wo_a_einsum(o, w[:, :, :32])
    with pytest.raises(ValueError):
        einsum.wo_a_einsum(o.transpose(1, 2).contiguous().transpose(1, 2), w)  # D not unit stride
    with pytest.raises(ValueError):
        einsum.wo_a_einsum(o, w.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(TypeError):
        einsum.wo_a_einsum(o, w, out_format=fmt, out=empty_pair(3, 256, ActFormat.SM90_G128_FP32_MN, device))
    with pytest.raises(ValueError):
        einsum.wo_a_einsum(o, w, out_format=fmt, out=empty_pair(3, 128, fmt, device))
    with pytest.raises(ValueError):
        einsum.wo_a_einsum(o, w, out_bf16=torch.empty(3, 2, 128, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError):
        einsum.wo_a_einsum(o, w, return_bf16=False)
    o2, w2 = _inputs(3, 2, 96, 64, device)
    with pytest.raises(ValueError):  # a 128-column scale group would straddle two einsum groups
        einsum.wo_a_einsum(o2, w2, out_format=ActFormat.SM90_G128_FP32_MN)


@pytest.mark.cpu
def test_wo_a_config_override(device):
    """config= (sweeps): another tiling still writes the pair of its own bf16 output; a config that
    would let a scale group straddle two tiles, or a malformed one, is refused."""
    o, w = _inputs(5, 2, 128, 64, device)
    fmt = ActFormat.SM90_G32_FP32_MN
    config = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)
    y, pair = einsum.wo_a_einsum(o, w, out_format=fmt, out=poisoned_pair(5, 256, fmt, device),
                                 out_bf16=_nan_bf16(5, 256, device), config=config)
    assert rel_error(y, wo_a_einsum_fp(o, w, torch.float64)) < REL_BOUND
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    with pytest.raises(ValueError, match="BLOCK_N"):
        einsum.wo_a_einsum(o, w, out_format=fmt, config=dict(config, BLOCK_N=16))
    with pytest.raises(ValueError, match="config"):
        einsum.wo_a_einsum(o, w, config=dict(BLOCK_M=16))
    with pytest.raises(ValueError, match="powers of two"):
        einsum.wo_a_einsum(o, w, config=dict(config, BLOCK_K=48))
    with pytest.raises(ValueError, match="optionally SPLIT"):
        einsum.wo_a_einsum(o, w, config=dict(config, SPLITS=2))
    with pytest.raises(ValueError, match="positive ints"):
        einsum.wo_a_einsum(o, w, config=dict(config, SPLIT=0))
    with pytest.raises(ValueError, match="num_warps must be a power of two <= 16"):  # 32 warps per block at most
        einsum.wo_a_einsum(o, w, config=dict(config, num_warps=64))
    with pytest.raises(ValueError, match="at most 1048576 values"):  # Triton's largest tensor
        einsum.wo_a_einsum(o, w, config=dict(config, BLOCK_M=2048, BLOCK_N=1024))


@pytest.mark.cpu
@pytest.mark.parametrize("split, d, block_k", [(2, 256, 64), (4, 256, 32), (2, 80, 32), (3, 96, 16)])
@pytest.mark.parametrize("fmt", [ActFormat.SM90_G32_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN])
def test_wo_a_split_k_cpu(split, d, block_k, fmt, device):
    """D split into K slices (even, and uneven: 80 = 3 tiles of 32 in 2 slices, the last slice past
    D): the pair still equals ``reference.quantize`` of the bf16 output, the bf16 output is within
    the bound, the same bytes on a second call (deterministic slice-order sum), and the arrival
    counters are re-armed."""
    rows, groups, r = 5, 2, 96
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, num_warps=4, num_stages=2, SPLIT=split)
    o, w = _inputs(rows, groups, r, d, device)
    cols = groups * r
    y, pair = einsum.wo_a_einsum(o, w, out_format=fmt, out=poisoned_pair(rows, cols, fmt, device),
                                 out_bf16=_nan_bf16(rows, cols, device), config=config)
    assert rel_error(y, wo_a_einsum_fp(o, w, torch.float64)) < REL_BOUND
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    unsplit = einsum.wo_a_einsum(o, w, config={**config, "SPLIT": 1})
    assert rel_error(y, unsplit) < REL_BOUND
    again = einsum.wo_a_einsum(o, w, out_format=fmt, out=poisoned_pair(rows, cols, fmt, device),
                               return_bf16=False, config=config)
    assert_pairs_equal(again, pair)
    assert not launch.arrival_counters("wo_a", device, 1).any()


def check_bf16_bits_do_not_depend_on_the_format(rows, groups, r, d, device):
    """The model switches the chain off by asking for no pair: with the tiles of the chained call's
    scale group (``tile_group``), the bf16 output is the same bits as with the pair, for every
    format; without, the same as the 32-column formats' (DSv4.1's)."""
    o, w = _inputs(rows, groups, r, d, device, "padded")
    for fmt in ALL_FORMATS:
        y, pair = einsum.wo_a_einsum(o, w, out_format=fmt)
        assert torch.equal(y, einsum.wo_a_einsum(o, w, tile_group=fmt.group_size)), fmt
        assert_pairs_equal(pair, ref.quantize(y, fmt))
    assert torch.equal(einsum.wo_a_einsum(o, w), einsum.wo_a_einsum(o, w, tile_group=32))
    for bad in (64, 0, True, 48, 32.0):
        for rows_of_o in (o, o[:0]):  # refused before the empty batch returns
            with pytest.raises(ValueError, match="tile_group must be 32 or 128"):
                einsum.wo_a_einsum(rows_of_o, w, tile_group=bad)
    with pytest.raises(ValueError, match="tile_group=128 but out_format sm90_g32_fp32_mn"):
        einsum.wo_a_einsum(o, w, out_format=ActFormat.SM90_G32_FP32_MN, tile_group=128)


@pytest.mark.cpu
def test_wo_a_bf16_bits_do_not_depend_on_the_format(device):
    """A narrow grid split in K at 32-column tiles, another K step at 128-column tiles."""
    check_bf16_bits_do_not_depend_on_the_format(17, 2, 256, 1024, device)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 17, 64, 256])
@pytest.mark.parametrize("groups", [2, 8])
def test_wo_a_bf16_bits_do_not_depend_on_the_format_gpu(rows, groups):
    check_bf16_bits_do_not_depend_on_the_format(rows, groups, 1024, 4096, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 17, 64])
def test_wo_a_split_k_is_reproducible_gpu(rows):
    """G = 2 at decode splits D (the narrow grid): the slice that arrives last sums the partials in
    slice order, so every call writes the same bytes whatever order the slices arrive in."""
    device = torch.device("cuda")
    assert einsum._launch_config(rows, 2, 1024, 4096, 32, launch.sm_count(device, interpreter=132))["SPLIT"] > 1
    o, w = _inputs(rows, 2, 1024, 4096, device)
    fmt = ActFormat.SM90_G32_FP32_MN
    first_y, first_pair = einsum.wo_a_einsum(o, w, out_format=fmt)
    for _ in range(20):
        y, pair = einsum.wo_a_einsum(o, w, out_format=fmt)
        assert torch.equal(y, first_y)
        assert_pairs_equal(pair, first_pair)


@pytest.mark.cpu
def test_wo_a_decode_split_config():
    """The narrow TP4 grid (G = 2) splits D as far as the whole grid stays resident (two 16-row
    programs per SM, one 64-row); the full TP1 grid (G = 8) and prefill do not."""
    narrow = einsum._launch_config(1, 2, 1024, 4096, 32, num_sms=132)
    assert narrow["SPLIT"] == 4 and 4096 // narrow["BLOCK_K"] // narrow["SPLIT"] >= 2
    assert einsum._launch_config(64, 2, 1024, 4096, 32, num_sms=132)["SPLIT"] == 2
    assert einsum._launch_config(1, 8, 1024, 4096, 32, num_sms=132)["SPLIT"] == 1
    assert einsum._launch_config(2048, 2, 1024, 4096, 32, num_sms=132)["SPLIT"] == 1



def _fp8_weight(groups, r, d, device, nan_at=None, block=32):
    """An e4m3 wo_a ``[G, R, D]`` with block scales in the checkpoint's form (powers of two for
    32x32 blocks, arbitrary for 128x128), optionally with a NaN code at ``nan_at``."""
    w, s = ref.random_fp8_wo_a(groups, r, d, block, device, log2_scale=-8)
    if nan_at is not None:
        w.view(torch.uint8)[nan_at] = 0x7F
    return w, s


def check_wo_a_fp8_weight(rows, groups, r, d, fmt, device, config=None, block=32):
    """An FP8 wo_a: the output within the bound of the fp64 einsum on its bf16 dequantization
    (``reference.dequantize_wo_a``), the pair ``reference.quantize`` of the launch's own bf16
    output. On the interpreter (exact dots) also bitwise the same launch on the bf16 copy: the
    dequantized values are the copy's; compiled, the sum order may differ (the module docstring)."""
    bitwise = device.type == "cpu"
    o, _ = _inputs(rows, groups, r, d, device)
    w8, s = _fp8_weight(groups, r, d, device, block=block)
    wb = ref.dequantize_wo_a(w8, s, block)
    cols = groups * r
    launch = {} if config is None else {"config": config}  # the same launch for both weights
    kw = dict(launch, weight_block=block)
    if fmt is None:
        y = einsum.wo_a_einsum(o, w8, weight_scale=s, out_bf16=_nan_bf16(rows, cols, device), **kw)
        if bitwise:
            same = einsum.wo_a_einsum(o, wb, **launch)
            assert torch.equal(y.view(torch.int16), same.view(torch.int16))
    else:
        y, pair = einsum.wo_a_einsum(o, w8, weight_scale=s, out_format=fmt, out=poisoned_pair(rows, cols, fmt, device),
                                     out_bf16=_nan_bf16(rows, cols, device), **kw)
        if bitwise:
            yb, pair_b = einsum.wo_a_einsum(o, wb, out_format=fmt, **launch)
            assert torch.equal(y.view(torch.int16), yb.view(torch.int16))
            assert_pairs_equal(pair, pair_b)
        assert_pairs_equal(pair, ref.quantize(y, fmt))
        only = einsum.wo_a_einsum(o, w8, weight_scale=s, out_format=fmt, return_bf16=False, **kw)
        assert_pairs_equal(only, pair)
    assert rel_error(y, wo_a_einsum_fp(o, wb, torch.float64)) < REL_BOUND
    assert rel_error(y, ref.wo_a_einsum(o, w8, weight_scale=s, weight_block=block)) < REL_BOUND


@pytest.mark.cpu
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("fmt", [None] + ALL_FORMATS)
def test_wo_a_fp8_weight_cpu(rows, fmt, device):
    # D not a multiple of the K tile; R not of the N tile where the format allows (128-groups)
    check_wo_a_fp8_weight(rows, 2, 128 if fmt is ActFormat.SM90_G128_FP32_MN else 96, 80, fmt, device)


@pytest.mark.cpu
def test_wo_a_fp8_weight_128_blocks_cpu(device):
    """128x128 blocks with arbitrary scales (V3-style checkpoints), D not a multiple of 128. Past 64
    rows the launch widens its 64-column K steps to whole blocks: the bf16 copy is compared at
    that config, the launch's own choice against the reference."""
    fmt = ActFormat.SM90_G128_FP32_MN
    check_wo_a_fp8_weight(1, 2, 256, 200, fmt, device, block=128)
    check_wo_a_fp8_weight(70, 2, 256, 200, fmt, device, block=128,
                          config=dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=2))
    o, _ = _inputs(70, 2, 256, 200, device)
    w8, s = _fp8_weight(2, 256, 200, device, block=128)
    y, pair = einsum.wo_a_einsum(o, w8, weight_scale=s, weight_block=128, out_format=fmt)
    assert rel_error(y, ref.wo_a_einsum(o, w8, weight_scale=s, weight_block=128)) < REL_BOUND
    assert_pairs_equal(pair, ref.quantize(y, fmt))


@pytest.mark.cpu
@pytest.mark.parametrize("rows, block_m, split, d, block_k", [(5, 16, 2, 256, 64), (5, 16, 2, 80, 32),
                                                               (5, 16, 3, 96, 32), (70, 128, 2, 256, 64)])
def test_wo_a_fp8_weight_split_k_cpu(rows, block_m, split, d, block_k, device):
    """K slices read their own scale columns (uneven slices, a slice past D), also under a compute
    tile taller than the batch (the table's FP8-weight tiles past 64 rows)."""
    config = dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=block_k, num_warps=4, num_stages=2, SPLIT=split)
    check_wo_a_fp8_weight(rows, 2, 96, d, ActFormat.SM90_G32_FP32_MN, device, config)


@pytest.mark.cpu
def test_wo_a_fp8_weight_compute_config():
    """Past 64 rows an FP8 wo_a with 32x32 blocks takes the tallest tile the batch needs, up to
    256 x 64 (128 x 128 for 128-column scale groups; each weight tile is converted once per M
    tile), and splits D where the grid leaves SMs idle (G = 2, one program per SM); bf16 weights
    and 128x128 weight blocks keep the bf16 table's tiles."""
    fp8 = dict(num_sms=132, min_k=32, w_fp8=True, fp8_tile_rows=256)  # the tiles Triton 3.6 compiles unspilled
    for rows, block_m, stages in ((65, 128, 4), (256, 256, 4), (257, 256, 3), (2048, 256, 3)):
        cfg = einsum._launch_config(rows, 8, 1024, 4096, 32, **fp8)
        assert cfg == dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=stages, SPLIT=1)
    g128 = einsum._launch_config(2048, 8, 1024, 4096, 128, **fp8)
    assert (g128["BLOCK_M"], g128["BLOCK_N"]) == (128, 128)
    assert einsum._launch_config(256, 2, 1024, 4096, 32, **fp8)["SPLIT"] == 4  # 32 tiles x 4 slices
    assert einsum._launch_config(2048, 2, 1024, 4096, 32, **fp8)["SPLIT"] == 1  # 256 tiles fill the SMs
    bf16_table = dict(num_sms=132, min_k=32)
    assert einsum._launch_config(64, 8, 1024, 4096, 32, **fp8) == einsum._launch_config(64, 8, 1024, 4096, 32,
                                                                                         **bf16_table)
    assert einsum._launch_config(256, 2, 1024, 4096, 32, **bf16_table)["BLOCK_M"] == 64
    blocks_128 = dict(num_sms=132, min_k=128)
    assert (einsum._launch_config(256, 8, 1024, 4096, 32, w_fp8=True, **blocks_128)
            == einsum._launch_config(256, 8, 1024, 4096, 32, **blocks_128))


@pytest.mark.cpu
@pytest.mark.parametrize("version, tile_rows", [("3.4.0", 256), ("3.6.0", 256), ("3.8.0", 128), ("3.10.1", 128),
                                                ("4.0.0+git1a2b", 128)])
def test_wo_a_fp8_weight_tile_rows_by_triton(version, tile_rows):
    assert einsum.fp8_weight_tile_rows(version) == tile_rows


@pytest.mark.cpu
def test_wo_a_fp8_weight_compute_config_128_row_cap():
    """Where the compiler spills a 256-row FP8-weight tile (Triton 3.8) the tiles stop at 128 rows:
    128 x 64 up to 256 rows, 128 x 128 (three stages) past them; 128-column groups unchanged."""
    capped = dict(num_sms=132, min_k=32, w_fp8=True, fp8_tile_rows=128)
    for rows, block_n, stages in ((65, 64, 4), (256, 64, 4), (257, 128, 3), (2048, 128, 3)):
        cfg = einsum._launch_config(rows, 8, 1024, 4096, 32, **capped)
        assert cfg == dict(BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=64, num_warps=8, num_stages=stages, SPLIT=1)
    for rows in (65, 256, 2048):
        assert (einsum._launch_config(rows, 8, 1024, 4096, 128, **capped)
                == einsum._launch_config(rows, 8, 1024, 4096, 128, num_sms=132, min_k=32, w_fp8=True,
                                         fp8_tile_rows=256))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", [ActFormat.SM90_G32_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN])
def test_wo_a_fp8_weight_capped_tile_cpu(fmt, device):
    """The 128 x 128 tile the 128-row cap gives past 256 rows (Triton 3.8), over a batch that
    leaves its last tile mostly empty; 32-column scale groups, pairs bitwise."""
    config = einsum._launch_config(257, 2, 128, 128, 32, min_k=32, w_fp8=True, fp8_tile_rows=128)
    assert (config["BLOCK_M"], config["BLOCK_N"]) == (128, 128)
    check_wo_a_fp8_weight(257, 2, 128, 128, fmt, device, config)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", GPU_T)
@pytest.mark.parametrize("groups", [8, 2])
@pytest.mark.parametrize("fmt", [None, ActFormat.SM90_G32_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN])
def test_wo_a_fp8_weight_gpu(rows, groups, fmt):
    check_wo_a_fp8_weight(rows, groups, 1024, 4096, fmt, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, config", [(1, None), (64, None),
                                          (2048, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8,
                                                      num_stages=3))])
def test_wo_a_fp8_weight_128_blocks_gpu(rows, config):
    check_wo_a_fp8_weight(rows, 8, 1024, 4096, ActFormat.SM90_G128_FP32_MN, torch.device("cuda"), config=config,
                          block=128)


@pytest.mark.cpu
def test_wo_a_fp8_weight_nan(device):
    """A NaN weight code turns its output column into NaN in every row, nothing else."""
    rows, groups, r, d = 3, 2, 64, 64
    o, _ = _inputs(rows, groups, r, d, device)
    w8, s = _fp8_weight(groups, r, d, device, nan_at=(1, 5, 7))
    y = einsum.wo_a_einsum(o, w8, weight_scale=s)
    assert torch.isnan(y[:, r + 5]).all()
    assert not torch.isnan(y[:, [c for c in range(groups * r) if c != r + 5]]).any()


@pytest.mark.cpu
def test_wo_a_fp8_weight_bad_inputs(device):
    o, _ = _inputs(3, 2, 64, 64, device)
    w8, s = _fp8_weight(2, 64, 64, device)
    wb = ref.dequantize_wo_a(w8, s)
    with pytest.raises(TypeError, match="needs weight_scale"):
        einsum.wo_a_einsum(o, w8)
    with pytest.raises(TypeError, match="bfloat16 wo_a"):
        einsum.wo_a_einsum(o, wb, weight_scale=s)
    with pytest.raises(TypeError, match="float32"):
        einsum.wo_a_einsum(o, w8, weight_scale=s.bfloat16())
    with pytest.raises(ValueError, match="needs weight_scale"):
        einsum.wo_a_einsum(o, w8, weight_scale=s[:, :1])
    with pytest.raises(ValueError, match="3-D"):
        einsum.wo_a_einsum(o, w8, weight_scale=s.flatten(0, 1))
    with pytest.raises(TypeError, match="wo_a must be"):
        einsum.wo_a_einsum(o, w8.view(torch.uint8), weight_scale=s)
    with pytest.raises(ValueError, match="weight_block"):
        einsum.wo_a_einsum(o, w8, weight_scale=s, weight_block=64)
    with pytest.raises(ValueError, match="needs weight_scale"):  # the scales of 32-blocks read as 128-blocks
        einsum.wo_a_einsum(o, w8, weight_scale=s, weight_block=128)
    with pytest.raises(ValueError, match="BLOCK_K"):
        einsum.wo_a_einsum(o, w8, weight_scale=s,
                           config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2))


@pytest.mark.cpu
@pytest.mark.parametrize("fmt", [ActFormat.SM90_G32_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN])
def test_wo_a_split_k_last_slice_past_d(fmt, device):
    """D a multiple of BLOCK_K but not of BLOCK_K * SPLIT (96 = 3 tiles of 32 in 2 slices): the
    last slice's second tile lies past D and must be masked (EVEN_K is per slice span)."""
    rows, groups, r, d = 5, 2, 96, 96
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2, SPLIT=2)
    o, w = _inputs(rows, groups, r, d, device)
    cols = groups * r
    y, pair = einsum.wo_a_einsum(o, w, out_format=fmt, out=poisoned_pair(rows, cols, fmt, device),
                                 out_bf16=torch.full((rows, cols), float("nan"), dtype=torch.bfloat16,
                                                     device=device), config=config)
    assert rel_error(y, wo_a_einsum_fp(o, w, torch.float64)) < REL_BOUND
    assert_pairs_equal(pair, ref.quantize(y, fmt))


@pytest.mark.cpu
def test_wo_a_fp8_weight_scale_columns_past_d_never_read(device):
    """weight_scale as a view of a wider buffer (its strides are honoured): the scale column past
    ceil(D/b), inf here, is masked off for the K step past D (D = 80, a 128-wide K step)."""
    rows, groups, r, d = 3, 2, 64, 80
    o, _ = _inputs(rows, groups, r, d, device)
    w8, s = ref.random_fp8_wo_a(groups, r, d, 32, device, log2_scale=-8)
    wide = torch.full((groups, s.shape[1], s.shape[2] + 1), float("inf"), device=device)
    wide[:, :, :s.shape[2]] = s
    s_view = wide[:, :, :s.shape[2]]
    y = einsum.wo_a_einsum(o, w8, weight_scale=s_view)
    assert torch.equal(y.view(torch.int16), einsum.wo_a_einsum(o, w8, weight_scale=s).view(torch.int16))
    assert rel_error(y, ref.wo_a_einsum(o, w8, weight_scale=s)) < REL_BOUND


@pytest.mark.cpu
def test_wo_a_refuses_empty_d(device):
    """D = 0 with rows and columns to write is refused (nothing would be written into y)."""
    o = torch.empty(3, 2, 0, dtype=torch.bfloat16, device=device)
    w = torch.empty(2, 128, 0, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="D = 0"):
        einsum.wo_a_einsum(o, w)


@pytest.mark.cpu
def test_wo_a_config_block_n_16_without_a_format(device):
    """Without out_format or tile_group the tiles hold no scale group: BLOCK_N = 16 is taken."""
    o, w = _inputs(3, 2, 48, 64, device)
    config = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)
    y = einsum.wo_a_einsum(o, w, config=config)
    assert rel_error(y, wo_a_einsum_fp(o, w, torch.float64)) < REL_BOUND


@pytest.mark.cpu
def test_wo_a_refuses_output_over_weight_scale():
    """An output sharing memory with an FP8 wo_a's block scales (which the launch reads) is refused."""
    o, _ = _inputs(3, 2, 64, 64, "cpu")
    w8, s = ref.random_fp8_wo_a(2, 64, 64, 32, "cpu", log2_scale=-8)
    buf = torch.empty(200)
    s_in = buf[:s.numel()].view(s.shape)
    s_in.copy_(s)
    out_y = buf.view(torch.bfloat16)[:3 * 128].view(3, 128)
    with pytest.raises(ValueError, match="out_bf16 overlaps weight_scale"):
        einsum.wo_a_einsum(o, w8, weight_scale=s_in, out_bf16=out_y)


@pytest.mark.cpu
def test_wo_a_refuses_weight_scale_on_another_device():
    """FP8 block scales on another device than wo_a are refused on the host (meta: no memory)."""
    o, _ = _inputs(3, 2, 64, 64, "cpu")
    w8, s = ref.random_fp8_wo_a(2, 64, 64, 32, "cpu", log2_scale=-8)
    with pytest.raises(ValueError, match="weight_scale is on meta"):
        einsum.wo_a_einsum(o, w8, weight_scale=s.to("meta"))


@pytest.mark.cpu
@pytest.mark.parametrize("rows", [3, 70])
def test_wo_a_r_not_a_multiple_of_the_n_tile(rows, device):
    """R = 40 without a format: 16-column tiles, the last one of each group partial (EVEN_N off).
    Every column is written, none past G*R (the bf16 out a view of a wider NaN buffer), and the
    weight rows past R (a view of a taller buffer, inf there) are never read into the output."""
    groups, r, d = 2, 40, 64
    o, _ = _inputs(rows, groups, r, d, device)
    tall = torch.full((groups, r + 8, d), float("inf"), device=device).bfloat16()
    tall[:, :r] = (torch.randn(groups, r, d, device=device) / d ** 0.5).bfloat16()
    w = tall[:, :r]
    cols = groups * r
    big_y = _nan_bf16(rows, cols + 16, device)
    y = einsum.wo_a_einsum(o, w, out_bf16=big_y[:, :cols])
    assert rel_error(y, wo_a_einsum_fp(o, w, torch.float64)) < REL_BOUND
    assert torch.isnan(big_y[:, cols:]).all()


@pytest.mark.cpu
def test_wo_a_config_bounds_refused(device):
    """A config whose BLOCK_N is a multiple of the format's group but does not divide R (a tile would
    straddle two einsum groups and write a scale of the next one), a 32-warp config and a block
    under 16 (the smallest dot) are refused; every check runs before a launch."""
    o, w = _inputs(3, 2, 96, 64, device)
    fmt = ActFormat.SM90_G32_FP32_MN
    config = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    y, pair = einsum.wo_a_einsum(o, w, out_format=fmt, config=config)  # the valid base config
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    with pytest.raises(ValueError, match="BLOCK_N=64 must be a multiple of 32 that divides R=96"):
        einsum.wo_a_einsum(o, w, out_format=fmt, config=dict(config, BLOCK_N=64))
    with pytest.raises(ValueError, match="num_warps must be a power of two <= 16"):
        einsum.wo_a_einsum(o, w, config=dict(config, num_warps=32))
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        with pytest.raises(ValueError, match="powers of two >= 16"):
            einsum.wo_a_einsum(o, w, config=dict(config, **{key: 8}))


@pytest.mark.cpu
def test_wo_a_split_keeps_two_k_tiles_a_slice():
    """The narrow grid's split stops where a slice would hold fewer than two K tiles (D = 256: two
    128-wide K tiles, no split), and never exceeds the grid's residency."""
    assert einsum._launch_config(1, 2, 1024, 256, 32, num_sms=132)["SPLIT"] == 1
    assert einsum._launch_config(1, 2, 1024, 512, 32, num_sms=132)["SPLIT"] == 2
    assert einsum._narrow_split(64, 32, 264) == 4


@pytest.mark.cpu
def test_wo_a_refuses_a_tile_group_that_does_not_divide_r(device):
    """tile_group 128 with R = 96: a 128-column group cannot be held whole by tiles of one einsum
    group, so it is refused (32 divides 96 and is taken)."""
    o, w = _inputs(2, 2, 96, 64, device)
    with pytest.raises(ValueError, match="tile_group must be 32 or 128 and divide R=96"):
        einsum.wo_a_einsum(o, w, tile_group=128)
    assert torch.equal(einsum.wo_a_einsum(o, w, tile_group=32), einsum.wo_a_einsum(o, w))
