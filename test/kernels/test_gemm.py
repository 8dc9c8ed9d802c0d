"""FP8 GEMM consumers against the fp64 reference on dequantized operands, and the gate_up GEMM's
SiLU*mul epilogue against the two launches it replaces (bit for bit).

CPU: the Triton interpreter at small shapes (its fp8 tl.dot is exact in fp32, and the kernel's
bf16 rounding is done on the bits there). GPU: DSv4.1 shapes, both formats, many M.
"""

import pytest
import torch

from fp8chain_kernel import act, gemm, launch, quant
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat, cdiv, empty_pair
from helpers import assert_pairs_equal, poisoned_pair, rel_error

G32, G128 = ActFormat.SM90_G32_FP32_MN, ActFormat.SM90_G128_FP32_MN
FORMATS = [(G32, 32), (G128, 128)]
TOL = 5e-3

# Every DSv4.1 dense FP8 linear, TP1 and TP4 shards, at each weight block that divides its K (the
# down shard's K = 576 is no multiple of 128).
DSV41_SHAPES = [*gemm.DSV41_TP1_LINEARS.values(), *gemm.DSV41_TP4_SHARDS.values()]
GEMM_CASES = [(fmt, block, n, k) for fmt, block in FORMATS for n, k in DSV41_SHAPES if k % block == 0]
G128_SHAPES = [(n, k) for n, k in DSV41_SHAPES if k % 128 == 0]
GPU_MS = [1, 2, 3, 4, 16, 64, 127, 256, 2048]


def make_activation(m, k, device):
    """Rows of very different magnitudes; one all-zero row when there are a few rows."""
    x = torch.randn(m, k, device=device) * torch.exp2(torch.randint(-6, 6, (m, 1), device=device).float())
    if m >= 3:
        x[1] = 0
    return x.bfloat16()


def poisoned_out(m, n, device, value=float("nan")):
    """A bf16 out buffer no kernel writes by chance: NaN, or a finite sentinel where a NaN row is
    expected (an unwritten NaN row would otherwise pass)."""
    return torch.full((m, n), value, dtype=torch.bfloat16, device=device)


SENTINEL = 12345.0  # finite, far beyond any test product


def check_against_reference(out, pair, w, scale, block):
    want = ref.fp8_gemm(pair, w, scale, block)
    err = rel_error(out, want)
    assert err < TOL, f"relative error {err:.3g}"
    if pair.data.shape[0] >= 3:  # the all-zero row gives exact zeros
        assert torch.equal(out[1].float(), torch.zeros_like(out[1].float()))


# ------------------------------------------------------------------------------------------
# CPU (interpreter)
# ------------------------------------------------------------------------------------------

SPLIT_CFG = gemm.GemmConfig(block_n=64, block_m=16, block_k=128, split=2, stages=2, warps=4)


@pytest.mark.cpu
@pytest.mark.parametrize("fmt,block", FORMATS, ids=["g32", "g128"])
@pytest.mark.parametrize("m,n,k,config", [
    (1, 128, 512, None),
    (3, 192, 256, None),       # N not a multiple of the tile: masked
    (17, 128, 512, SPLIT_CFG),  # split-K: partials + last-arrival reduction
    (40, 256, 256, gemm.GemmConfig(64, 32, 128, 1, 2, 4, 2)),  # several M tiles, grouped order
    (5, 192, 512, gemm.GemmConfig(64, 16, 256, 2, 2, 4, 8, dequant=True)),  # bf16-dequantized operands
    (19, 192, 512, gemm.GemmConfig(64, 16, 128, 2, 2, 4, 8, block_diag=True)),  # block-diagonal tokens
    (3, 128, 512, gemm.GemmConfig(64, 16, 256, 1, 2, 4, 8, block_diag=True)),
])
def test_fp8_gemm_matches_reference_cpu(fmt, block, m, n, k, config, device):
    w, scale = ref.random_fp8_weight(n, k, block, device)
    pair = ref.quantize(make_activation(m, k, device), fmt)
    out = gemm.fp8_gemm(pair, w, scale, weight_block=block, out=poisoned_out(m, n, device), config=config)
    check_against_reference(out, pair, w, scale, block)


@pytest.mark.cpu
@pytest.mark.parametrize("fmt,block", FORMATS, ids=["g32", "g128"])
def test_pair_path_equals_bf16_path_bitwise(fmt, block, device):
    m, n, k = 5, 128, 256
    w, scale = ref.random_fp8_weight(n, k, block, device)
    x = make_activation(m, k, device)
    chained = gemm.fp8_gemm(quant.quantize(x, fmt), w, scale, weight_block=block)
    unchained = gemm.fp8_gemm(x, w, scale, weight_block=block, fmt=fmt)
    assert torch.equal(chained.view(torch.int16), unchained.view(torch.int16))


@pytest.mark.cpu
def test_split_k_is_deterministic_and_rearms(device):
    m, n, k = 4, 128, 512
    w, scale = ref.random_fp8_weight(n, k, 32, device)
    pairs = [ref.quantize(make_activation(m, k, device), G32) for _ in range(2)]
    first = gemm.fp8_gemm(pairs[0], w, scale, weight_block=32, config=SPLIT_CFG)
    other = gemm.fp8_gemm(pairs[1], w, scale, weight_block=32, config=SPLIT_CFG)  # counters re-armed
    again = gemm.fp8_gemm(pairs[0], w, scale, weight_block=32, config=SPLIT_CFG)
    assert torch.equal(first.view(torch.int16), again.view(torch.int16))
    check_against_reference(other, pairs[1], w, scale, 32)
    direct = gemm.fp8_gemm(pairs[0], w, scale, weight_block=32, config=SPLIT_CFG._replace(split=1))
    assert rel_error(first, direct) < TOL


@pytest.mark.cpu
@pytest.mark.parametrize("config", [None, SPLIT_CFG], ids=["direct", "splitk"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_nan_row_stays_in_its_row(config, bad, device):
    """A NaN or an infinity in a token makes its whole output row NaN (an infinity's group
    quantizes to NaN: ``reference.quant``), never a finite value; the other rows are written and
    equal the reference."""
    m, n, k = 6, 128, 256
    w, scale = ref.random_fp8_weight(n, k, 32, device)
    x = make_activation(m, k, device)
    x[4, 77] = float(bad)
    out = gemm.fp8_gemm(x, w, scale, weight_block=32, fmt=G32, config=config,
                        out=poisoned_out(m, n, device, SENTINEL))
    assert torch.isnan(out[4]).all()
    keep = [r for r in range(m) if r != 4]  # written (the poison is finite) and right: rows quantize alone
    assert rel_error(out[keep], ref.fp8_gemm(ref.quantize(x[keep], G32), w, scale, 32)) < TOL


@pytest.mark.cpu
@pytest.mark.parametrize("mode", ["dequant", "block_diag"])
def test_scale_prefetch_depth_changes_no_bit_cpu(mode, device):
    """Reading the scales 0..4 K iterations ahead gives the same bits, on the pair path and
    (dequantized) on W8A16: K slices of 6 iterations, and of 2 (fewer than the prefetch depth)."""
    for k in (1536, 512):
        _check_scale_prefetch(mode, 5, 128, k, device)


def _check_scale_prefetch(mode, m, n, k, device):
    w, scale = ref.random_fp8_weight(n, k, 32, device)
    x = make_activation(m, k, device)
    pair = ref.quantize(x, G32)
    base = gemm.GemmConfig(64, 16, 128, 2, 2, 4, 8, **{mode: True})
    outs = [gemm.fp8_gemm(pair, w, scale, weight_block=32, out=poisoned_out(m, n, device),
                          config=base._replace(scale_ahead=ahead)) for ahead in range(5)]
    check_against_reference(outs[0], pair, w, scale, 32)
    for ahead, out in enumerate(outs[1:], 1):
        assert torch.equal(out.view(torch.int16), outs[0].view(torch.int16)), f"scale_ahead={ahead}"
    if mode == "dequant":
        w8a16 = [gemm.w8a16_gemm(x, w, scale, weight_block=32, config=base._replace(scale_ahead=ahead))
                 for ahead in (0, 3)]
        assert torch.equal(w8a16[0].view(torch.int16), w8a16[1].view(torch.int16))
        assert rel_error(w8a16[0], x.double() @ ref.dequantize_weight(w, scale, 32).double().t()) < TOL
    with pytest.raises(ValueError, match="scale_ahead"):
        gemm.fp8_gemm(pair, w, scale, weight_block=32, config=base._replace(scale_ahead=5))


@pytest.mark.cpu
def test_mismatched_format_raises_type_error_naming_both(device):
    w32, s32 = ref.random_fp8_weight(128, 256, 32, device)
    w128, s128 = ref.random_fp8_weight(128, 256, 128, device)
    x = make_activation(2, 256, device)
    with pytest.raises(TypeError, match="sm90_g32_fp32_mn.*sm90_g128_fp32_mn"):
        gemm.fp8_gemm(ref.quantize(x, G128), w32, s32, weight_block=32)
    with pytest.raises(TypeError, match="sm90_g128_fp32_mn.*sm90_g32_fp32_mn"):
        gemm.fp8_gemm(ref.quantize(x, G32), w128, s128, weight_block=128)
    with pytest.raises(TypeError, match="sm90_g32_fp32_mn.*sm100_g32_ue8m0_packed_mn"):
        gemm.fp8_gemm(ref.quantize(x, ActFormat.SM100_G32_UE8M0_PACKED_MN), w32, s32, weight_block=32)
    with pytest.raises(TypeError, match="sm90_g32_fp32_mn.*sm90_g128_fp32_mn"):
        gemm.fp8_gemm(x, w32, s32, weight_block=32, fmt=G128)
    with pytest.raises(TypeError, match="fmt="):
        gemm.fp8_gemm(x, w32, s32, weight_block=32)


@pytest.mark.cpu
def test_bad_weights_and_out_are_rejected(device):
    w, s = ref.random_fp8_weight(128, 256, 32, device)
    pair = ref.quantize(make_activation(2, 256, device), G32)
    with pytest.raises(ValueError, match="needs scales"):
        gemm.fp8_gemm(pair, w, s[:, :-1], weight_block=32)
    with pytest.raises(TypeError, match="weight must be"):
        gemm.fp8_gemm(pair, w.float(), s, weight_block=32)
    with pytest.raises(ValueError, match="out must have shape"):
        gemm.fp8_gemm(pair, w, s, weight_block=32, out=torch.empty(2, 127, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="K="):
        gemm.fp8_gemm(ref.quantize(make_activation(2, 128, device), G32), w, s, weight_block=32)
    # K = 0: refused before a launch (the kernels prefetch the first K block's scales)
    w0, s0 = w[:, :0], s[:, :0]
    for call in (lambda: gemm.fp8_gemm(ref.quantize(make_activation(2, 0, device), G32), w0, s0, weight_block=32),
                 lambda: gemm.fp8_gemm_silu_mul(ref.quantize(make_activation(2, 0, device), G32), w0, s0,
                                                weight_block=32),
                 lambda: gemm.w8a16_gemm(make_activation(2, 0, device), w0, s0, weight_block=32)):
        with pytest.raises(ValueError, match="K=0"):
            call()
    with pytest.raises(ValueError, match="the int 32 or 128"):
        gemm.w8a16_gemm(make_activation(2, 256, device), w, s, weight_block=32.0)
    both_modes = gemm.GemmConfig(64, 16, 128, 1, 2, 4, 8, dequant=True, block_diag=True)
    with pytest.raises(ValueError, match="block_diag"):
        gemm.fp8_gemm(pair, w, s, weight_block=32, config=both_modes)
    with pytest.raises(ValueError, match="block_diag"):
        gemm.w8a16_gemm(make_activation(2, 256, device), w, s, weight_block=32,
                        config=both_modes._replace(dequant=False))
    # a zero tile_group divides by zero in the tile order (rows left unwritten); tiles are aranges
    plain = gemm.GemmConfig(64, 16, 128, 1, 2, 4, 8)
    for bad in (plain._replace(tile_group=0), plain._replace(split=0), plain._replace(block_n=48),
                plain._replace(warps=3), plain._replace(stages=True), plain._replace(block_m=16.0),
                plain._replace(dequant=1)):
        with pytest.raises(ValueError, match="GemmConfig"):
            gemm.fp8_gemm(pair, w, s, weight_block=32, config=bad)


@pytest.mark.cpu
def test_configs_the_kernel_cannot_run_are_refused(device):
    """block_m and block_k powers of two, block_k a multiple of the group that divides K,
    scale_ahead in 0..4 and max_regs in 24..255: refused before a launch otherwise (fp8_gemm, w8a16
    and the SiLU*mul entry)."""
    w, s = ref.random_fp8_weight(128, 384, 32, device)
    x = make_activation(2, 384, device)
    pair = ref.quantize(x, G32)
    plain = gemm.GemmConfig(64, 16, 128, 1, 2, 4, 8)
    for bad, match in ((plain._replace(block_m=24), "GemmConfig"), (plain._replace(block_k=96), "GemmConfig"),
                       (plain._replace(block_k=16), "multiple of 32"), (plain._replace(block_k=256), "divide K=384"),
                       (plain._replace(dequant=True, scale_ahead=-1), "scale_ahead"),
                       (plain._replace(max_regs=16), "max_regs"), (plain._replace(max_regs=256), "max_regs"),
                       (plain._replace(max_regs=168.0), "max_regs")):
        for call in (lambda: gemm.fp8_gemm(pair, w, s, weight_block=32, config=bad),
                     lambda: gemm.w8a16_gemm(x, w, s, weight_block=32, config=bad),
                     lambda: gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, config=bad)):
            with pytest.raises(ValueError, match=match):
                call()


@pytest.mark.cpu
def test_a_register_cap_reaches_the_compiler(monkeypatch):
    """``max_regs`` becomes Triton's ``maxnreg`` beside ``num_stages`` when compiling; the
    interpreter takes neither. The cap keeps three 4-warp programs per SM. The table's three M = 64
    dequantized entries hold that residency (``residency_cap``): capped from Triton 3.7 on, and
    under 3.6 where the token scales' column stride is not a multiple of 16 (M = 40: 171 registers
    uncapped, two programs per SM), not at M = 48 / 64 (168, as swept). The two per-group M-bucket-256
    entries read the scales padded to align4(M) and are capped where M is not a multiple of 16 and
    their programs pass two per SM (M = 200 on 132 SMs, not M = 150 or 208, nor where the scales'
    storage ends before align4(M)): both under Triton 3.6, which compiles them in 170-172 registers.
    From Triton 3.7 on the gate_up with the SiLU*mul epilogue is capped at every M of the bucket (it
    reads faster in 168 registers than in 3.8's 136-144) and the pair GEMM nowhere (capped it
    spills). An explicit ``max_regs`` wins."""
    monkeypatch.setattr(gemm, "sm_count", lambda device, interpreter: 132)
    scales = {m: quant.quantize(torch.randn(m, 2304, dtype=torch.bfloat16), G32).scale for m in (40, 64, 150, 200, 201, 208)}
    capped = gemm.GemmConfig(64, 64, 128, 4, 3, 4, 8, True, False, 2, max_regs=gemm.THREE_PROGRAMS_PER_SM)
    monkeypatch.setattr(gemm, "interpreting", lambda: False)
    assert gemm._launch_residency(capped, scales[64], 320) == ({"num_stages": 3, "maxnreg": 168}, False)
    assert gemm._launch_residency(capped._replace(max_regs=None), scales[40], 320) == ({"num_stages": 3}, False)
    resident = capped._replace(max_regs=None, residency_cap=True)
    assert gemm._launch_residency(resident, scales[40], 320) == ({"num_stages": 3, "maxnreg": 168}, False)
    aligned = gemm._launch_residency(resident, scales[64], 320)
    assert aligned == ({"num_stages": 3, "maxnreg": 168} if gemm.m64_register_cap(64) else {"num_stages": 3}, False)
    assert gemm._launch_residency(resident._replace(max_regs=200), scales[40], 320) == \
        ({"num_stages": 3, "maxnreg": 200}, False)
    per_group = gemm.CONFIG_TABLE[(256, 5120, 2304, 32)]

    def options(padded_rows, silu_mul_epilogue=False):
        cap = gemm.bucket256_register_cap(padded_rows, silu_mul_epilogue)
        return {"num_stages": 4, **({"maxnreg": cap} if cap else {})}

    assert gemm._launch_residency(per_group, scales[200], 320) == (options(True), True)
    assert gemm._launch_residency(per_group, scales[200], 320, silu_mul_epilogue=True) == \
        ({"num_stages": 4, "maxnreg": 168}, True)
    for m, programs in ((208, 320), (150, 240)):
        assert gemm._launch_residency(per_group, scales[m], programs) == (options(False), False), m
        assert gemm._launch_residency(per_group, scales[m], programs, silu_mul_epilogue=True) == \
            (options(False, True), False), m
    assert gemm._launch_residency(per_group, scales[201], 320)[1]
    tight = torch.empty_strided(scales[201].shape, scales[201].stride())  # storage ends at row 200 of 204
    assert gemm._launch_residency(per_group, tight, 320) == ({"num_stages": 4}, False)
    monkeypatch.setattr(gemm, "interpreting", lambda: True)
    assert gemm._launch_residency(capped, scales[64], 320) == ({}, False)
    assert gemm._launch_residency(per_group, scales[200], 320) == ({}, True)
    monkeypatch.setattr(gemm, "interpreting", lambda: False)  # W8A16 (no token scales): the config's options
    assert gemm._launch_residency(capped, None, 320) == ({"num_stages": 3, "maxnreg": 168}, False)
    assert gemm._launch_residency(per_group, None, 320) == ({"num_stages": 4}, False)
    assert 3 * 4 * 32 * gemm.THREE_PROGRAMS_PER_SM <= 65536 < 3 * 4 * 32 * (gemm.THREE_PROGRAMS_PER_SM + 8)
    for version in ("3.6.0", "3.5.1"):
        assert gemm.m64_register_cap(48, version) is None and gemm.m64_register_cap(64, version) is None
        assert gemm.m64_register_cap(40, version) == gemm.m64_register_cap(36, version) == 168
        for silu_mul_epilogue in (False, True):
            assert gemm.bucket256_register_cap(True, silu_mul_epilogue, version) == 168
            assert gemm.bucket256_register_cap(False, silu_mul_epilogue, version) is None
    for version in ("3.8.0", "3.8.1+git1a2b"):
        assert gemm.m64_register_cap(64, version) == gemm.m64_register_cap(40, version) == 168
        for padded_rows in (False, True):
            assert gemm.bucket256_register_cap(padded_rows, False, version) is None
            assert gemm.bucket256_register_cap(padded_rows, True, version) == 168
    resident = {key for key, cfg in gemm.CONFIG_TABLE.items() if cfg.residency_cap}
    assert resident == {(64, 4608, 5120, 32), (64, 5120, 8192, 32), (64, 5120, 2048, 32),
                        (256, 4608, 5120, 32), (256, 5120, 2304, 32)}
    assert not any(cfg.max_regs for cfg in gemm.CONFIG_TABLE.values())


@pytest.mark.cpu
def test_padded_scale_rows_change_no_bit(device):
    """A per-group residency launch reading the token scales padded to align4(M) (M = 37: rows 37-39
    of each scale column, NaN here) writes the bits of the same launch masking them at M, the GEMM
    and the gate_up with its SiLU*mul epilogue: the padding rows' products are never stored."""
    torch.manual_seed(0)
    m, n, k = 37, 256, 256
    w, s = ref.random_fp8_weight(n, k, 32, device)
    x = make_activation(m, k, device)
    x[5] = float("nan")
    pair = quant.quantize(x, G32)
    groups, stride = pair.scale.shape[1], pair.scale.stride(1)
    pair.scale.as_strided((groups, stride), (stride, 1))[:, m:].fill_(float("nan"))
    padded = gemm.GemmConfig(64, 16, 128, 1, 4, 4, residency_cap=True)
    masked = padded._replace(residency_cap=False)
    assert gemm._launch_residency(padded, pair.scale, 4 * 3)[1] and not gemm._launch_residency(masked, pair.scale, 12)[1]
    outs = [gemm.fp8_gemm(pair, w, s, weight_block=32, config=c) for c in (padded, masked)]
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert outs[0][5].isnan().all() and not outs[0][torch.arange(m) != 5].isnan().any()
    pairs = [gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, limit=10.0, out_format=G32, return_bf16=False,
                                    config=c) for c in (padded, masked)]
    assert_pairs_equal(*pairs)


@pytest.mark.cpu
def test_split_k_slices_are_equal(device):
    """A config's split that does not divide the K iterations runs the largest one that does (3 of
    4 iterations: 2 slices of 2), every K column summed once."""
    m, n, k = 3, 128, 512
    w, scale = ref.random_fp8_weight(n, k, 32, device)
    pair = ref.quantize(make_activation(m, k, device), G32)
    cfg = SPLIT_CFG._replace(split=3)
    assert gemm._split_plan(2, k, cfg, torch.device(device))[:2] == (2, 2)
    out = gemm.fp8_gemm(pair, w, scale, weight_block=32, out=poisoned_out(m, n, device), config=cfg)
    check_against_reference(out, pair, w, scale, 32)


@pytest.mark.cpu
def test_zero_rows_and_caller_buffers(device):
    n, k = 128, 256
    w, s = ref.random_fp8_weight(n, k, 32, device)
    empty = gemm.fp8_gemm(empty_pair(0, k, G32, device), w, s, weight_block=32)
    assert empty.shape == (0, n)
    # A pair that is a row slice of a buffer captured for more rows (scale column stride 12 > 8),
    # written into the first rows and columns of a larger, poisoned output buffer: no token tile
    # writes a row past M, no column past N.
    big = ref.quantize(make_activation(11, k, device), G32)
    pair = big.rows(7)
    assert pair.scale.stride(1) == 12
    wide = torch.full((64, n + 64), float("nan"), dtype=torch.bfloat16, device=device)
    out = gemm.fp8_gemm(pair, w, s, weight_block=32, out=wide[:7, :n])
    assert out.data_ptr() == wide.data_ptr()
    check_against_reference(out, pair, w, s, 32)
    assert torch.isnan(wide[:, n:].float()).all() and torch.isnan(wide[7:].float()).all()


@pytest.mark.cpu
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("dequant", [False, True])
def test_w8a16_matches_reference_cpu(block, dequant, device):
    """M = 1, 3 (an all-zero row) and 21 (two token tiles, the second partial; a NaN token whose
    row comes out NaN, the others finite and right); M = 0 writes nothing."""
    n, k = 192, 256
    w, s = ref.random_fp8_weight(n, k, block, device)
    cfg = gemm.GemmConfig(64, 16, 128, 1, 2, 4, 8, dequant=dequant)
    for m in (1, 3, 21):
        x = make_activation(m, k, device)
        nan_row = 19 if m == 21 else None
        if nan_row is not None:
            x[nan_row, 100] = float("nan")
        out = gemm.w8a16_gemm(x, w, s, weight_block=block, out=poisoned_out(m, n, device, SENTINEL), config=cfg)
        rows = [r for r in range(m) if r != nan_row]
        err = rel_error(out[rows], ref.w8a16_gemm(x[rows], w, s, block))
        assert err < TOL, (m, err)
        if nan_row is not None:
            assert torch.isnan(out[nan_row]).all()
    assert gemm.w8a16_gemm(make_activation(0, k, device), w, s, weight_block=block, config=cfg).shape == (0, n)
    with pytest.raises(TypeError, match="bfloat16"):
        gemm.w8a16_gemm(make_activation(3, k, device).float(), w, s, weight_block=block)


# ------------------------------------------------------------------------------------------
# The gate_up GEMM with the SiLU*mul epilogue (fp8_gemm_silu_mul)
# ------------------------------------------------------------------------------------------

def check_gemm_silu_mul(m, inter, k, config, out_fmt, limit, device, x=None):
    """The fused launch against the two launches it replaces (the bf16 gate_up GEMM with the same
    config, then ``act.silu_mul``; for tokens of a GEMV table problem, the GEMV): the bf16
    output bit for bit, the pair equal to the standalone quantization of that output, both
    outputs fully written; and near the fp64 reference."""
    w, s = ref.random_fp8_weight(2 * inter, k, 32, device)
    pair = ref.quantize(make_activation(m, k, device) if x is None else x, G32)
    cfg = config or gemm.gemm_config(m, 2 * inter, k, 32, device)
    if isinstance(cfg, gemm.GemmConfig):  # what the fused launch runs (on the GEMV: the GEMV)
        cfg = cfg._replace(block_n=max(cfg.block_n, 2 * out_fmt.group_size))
    out = poisoned_pair(m, inter, out_fmt, device)
    y, got = gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, limit=limit, out_format=out_fmt, out=out,
                                    out_bf16=poisoned_out(m, inter, device), config=config)
    assert got is out
    gate_up = gemm.fp8_gemm(pair, w, s, weight_block=32, config=cfg)
    assert torch.equal(y.view(torch.int16), act.silu_mul(gate_up, limit=limit).view(torch.int16))
    assert_pairs_equal(got, ref.quantize(y, out_fmt))
    only = gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, limit=limit, out_format=out_fmt,
                                  out=poisoned_pair(m, inter, out_fmt, device), return_bf16=False, config=config)
    assert_pairs_equal(only, got)
    return y, ref.fp8_gemm_silu_mul(pair, w, s, 32, limit=limit)


@pytest.mark.cpu
@pytest.mark.parametrize("out_fmt", list(ActFormat), ids=lambda f: f.value)
@pytest.mark.parametrize("m,inter,k,config", [
    (1, 128, 512, None),                  # the heuristic: split-K
    (3, 96, 256, None),                   # I not a multiple of the tile: masked columns
    (17, 64, 512, SPLIT_CFG),
    (40, 128, 256, gemm.GemmConfig(64, 32, 128, 1, 2, 4, 2)),  # several M tiles, grouped order
    (5, 96, 512, gemm.GemmConfig(128, 16, 256, 2, 2, 4, 8, dequant=True)),
    (19, 64, 512, gemm.GemmConfig(64, 16, 128, 2, 2, 4, 8, block_diag=True)),
])
def test_gemm_silu_mul_equals_the_two_launches_cpu(out_fmt, m, inter, k, config, device):
    y, want = check_gemm_silu_mul(m, inter, k, config, out_fmt, 7.0 if m % 2 else None, device)
    assert rel_error(y, want) < TOL
    if m >= 3:  # the all-zero activation row
        assert torch.equal(y[1].float(), torch.zeros_like(y[1].float()))


@pytest.mark.cpu
@pytest.mark.parametrize("config", [None, SPLIT_CFG._replace(split=1)], ids=["splitk", "direct"])
def test_gemm_silu_mul_nan_row_stays_in_its_row(config, device):
    m, inter, k = 6, 64, 256
    x = make_activation(m, k, device)
    x[4, 100] = float("nan")
    y, _ = check_gemm_silu_mul(m, inter, k, config, G32, None, device, x=x)
    assert not torch.isfinite(y[4]).any()
    assert torch.isfinite(y[[0, 1, 2, 3, 5]]).all()


@pytest.mark.cpu
def test_silu_mul_epilogue_only_where_it_pays(device):
    """DSv4.1 gate_up: the fused launch at decode tiles of 4, 8 and 64 tokens and M = 256; the two
    launches at 16-token tiles (M = 9..16, measured faster in the layer step), where the fused
    tile needs 8 warps (M = 2048; measured slower there), and at one token, where the plain
    GEMM is the GEMV; the backend follows."""
    from fp8chain_kernel.backends import get_backend

    n, k = 4608, 5120
    assert [gemm.silu_mul_epilogue_pays(gemm.gemm_config(m, n, k, 32, device))
            for m in (1, 4, 8, 9, 16, 32, 64, 256, 2048)] == \
        [False, True, True, False, False, True, True, True, False]
    w = torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=device)
    s = torch.ones(n // 32, k // 32, device=device)
    pair = ref.quantize(make_activation(2048, k, device), G32)
    assert get_backend("triton").gemm_silu_mul(pair, w, s, {}, 10.0, G32) is None
    one = ref.quantize(make_activation(1, k, device), G32)  # one token: fp8_gemm runs the GEMV
    assert get_backend("triton").gemm_silu_mul(one, w, s, {}, 10.0, G32) is None


@pytest.mark.cpu
def test_silu_mul_epilogue_pays_below_the_wide_tile_only():
    """A tile of exactly ``SILU_MUL_WIDE_TILE`` accumulator elements (128 x 64: the 128-group
    gate_up's prefill entry) runs 8 warps and does not pay; one element column narrower does."""
    assert gemm.SILU_MUL_WIDE_TILE == 128 * 64
    pays = gemm.silu_mul_epilogue_pays
    assert not pays(gemm.GemmConfig(128, 64, 128)) and not pays(gemm.GemmConfig(64, 128, 128))
    assert pays(gemm.GemmConfig(128, 32, 128)) and pays(gemm.GemmConfig(64, 64, 128))
    assert not pays(gemm.CONFIG_TABLE[(1 << 30, 4608, 5120, 128)])


@pytest.mark.cpu
def test_gemm_silu_mul_rejects_bad_input(device):
    w, s = ref.random_fp8_weight(128, 256, 32, device)
    x = make_activation(2, 256, device)
    with pytest.raises(TypeError, match="FP8 pair"):
        gemm.fp8_gemm_silu_mul(x, w, s, weight_block=32, out_format=G32)
    with pytest.raises(TypeError, match="sm90_g32_fp32_mn.*sm90_g128_fp32_mn"):
        gemm.fp8_gemm_silu_mul(ref.quantize(x, G128), w, s, weight_block=32, out_format=G32)
    pair = ref.quantize(x, G32)
    w96, s96 = ref.random_fp8_weight(96, 256, 32, device)
    with pytest.raises(ValueError, match="2I rows"):
        gemm.fp8_gemm_silu_mul(pair, w96, s96, weight_block=32, out_format=G32)
    with pytest.raises(ValueError, match="limit"):
        gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, limit=-1.0)
    with pytest.raises(TypeError):
        gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, out_format=G32,
                               out=poisoned_pair(2, 64, G128, device))
    with pytest.raises(ValueError, match="return_bf16=False"):
        gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, return_bf16=False)
    y, empty = gemm.fp8_gemm_silu_mul(empty_pair(0, 256, G32, device), w, s, weight_block=32, out_format=G32)
    assert y.shape == (0, 64) and empty.data.shape == (0, 64)
    y, empty = gemm.fp8_gemm_silu_mul(pair, w[:0], s[:0], weight_block=32, out_format=G32)  # I = 0
    assert y.shape == (2, 0) and empty.data.shape == (2, 0)


# ------------------------------------------------------------------------------------------
# GPU (DSv4.1 shapes)
# ------------------------------------------------------------------------------------------

_weights_cache = {}


def _gpu_weight(n, k, block):
    key = (n, k, block)
    if key not in _weights_cache:
        _weights_cache.clear()
        w, s = ref.random_fp8_weight(n, k, block, "cuda")
        _weights_cache[key] = (w, s, ref.dequantize_weight(w, s, block).double())
    return _weights_cache[key]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block,n,k", GEMM_CASES, ids=[f"g{b}-{n}x{k}" for _, b, n, k in GEMM_CASES])
def test_fp8_gemm_dsv41_shapes_gpu(fmt, block, n, k):
    w, s, w_ref = _gpu_weight(n, k, block)
    for m in GPU_MS:
        x = make_activation(m, k, "cuda")
        if m >= 4:
            x[m - 1, k // 3] = float("nan")
        pair = quant.quantize(x, fmt)
        out = gemm.fp8_gemm(pair, w, s, weight_block=block, out=poisoned_out(m, n, "cuda", SENTINEL))
        want = ref.dequantize(pair).double() @ w_ref.t()
        finite = [r for r in range(m) if not (m >= 4 and r == m - 1)]
        err = rel_error(out[finite], want[finite])
        assert err < TOL, f"M={m}: relative error {err:.3g}"
        if m >= 4:
            assert torch.isnan(out[m - 1]).all(), f"M={m}: NaN row lost or not written"
        if m >= 3:
            assert torch.equal(out[1].float(), torch.zeros_like(out[1].float()))
        if m in (3, 64, 2048):
            unchained = gemm.fp8_gemm(x, w, s, weight_block=block, fmt=fmt)
            assert torch.equal(out.view(torch.int16), unchained.view(torch.int16)), f"M={m}"


BLOCK_DIAG_CONFIGS = [gemm.GemmConfig(64, 16, 128, 5, 4, 4, 8, block_diag=True),
                      gemm.GemmConfig(128, 16, 256, 1, 2, 4, 8, block_diag=True),
                      gemm.GemmConfig(64, 32, 128, 2, 4, 4, 8, block_diag=True)]
DEQUANT_CONFIGS = [gemm.GemmConfig(64, 16, 128, 4, 4, 4, 8, True), gemm.GemmConfig(128, 64, 128, 2, 4, 4, 8, True),
                   gemm.GemmConfig(128, 128, 128, 1, 3, 8, 8, True), gemm.GemmConfig(64, 128, 128, 1, 4, 4, 8, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block", FORMATS, ids=["g32", "g128"])
@pytest.mark.parametrize("n,k", [(1792, 5120), (32768, 1280), (5120, 2304)])
def test_fp8_gemm_dequant_and_split_configs_gpu(fmt, block, n, k):
    """Configs the sweep may pick beyond the table's: bf16-dequantized operands, block-diagonal
    token operands, splits."""
    w, s, w_ref = _gpu_weight(n, k, block)
    for m, cfg in [(1, DEQUANT_CONFIGS[0]), (13, DEQUANT_CONFIGS[0]), (64, DEQUANT_CONFIGS[1]),
                   (300, DEQUANT_CONFIGS[2]), (2048, DEQUANT_CONFIGS[3]),
                   (16, gemm.GemmConfig(64, 16, 256, 8, 4, 4, 8)), (64, gemm.GemmConfig(128, 64, 128, 5, 4, 4, 8)),
                   (1, BLOCK_DIAG_CONFIGS[0]), (13, BLOCK_DIAG_CONFIGS[1]), (64, BLOCK_DIAG_CONFIGS[2]),
                   (3, BLOCK_DIAG_CONFIGS[0]._replace(scale_ahead=3)), (64, DEQUANT_CONFIGS[1]._replace(scale_ahead=2))]:
        x = make_activation(m, k, "cuda")
        pair = quant.quantize(x, fmt)
        out = gemm.fp8_gemm(pair, w, s, weight_block=block, out=poisoned_out(m, n, "cuda"), config=cfg)
        err = rel_error(out, ref.dequantize(pair).double() @ w_ref.t())
        assert err < TOL, f"M={m} {cfg}: relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("n,k", [(1792, 5120), (5120, 2304)])
def test_w8a16_dsv41_shapes_gpu(block, n, k):
    w, s, w_ref = _gpu_weight(n, k, block)
    for m in (1, 3, 64, 256):
        x = make_activation(m, k, "cuda")
        out = gemm.w8a16_gemm(x, w, s, weight_block=block, out=poisoned_out(m, n, "cuda"))
        err = rel_error(out, x.double() @ w_ref.t())
        assert err < TOL, f"M={m}: relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", G128_SHAPES, ids=[f"{n}x{k}" for n, k in G128_SHAPES])
def test_torch_blockwise_dsv41_shapes_gpu(n, k):
    from fp8chain_kernel import backends

    caps = backends.probe()
    if not caps.scaled_mm_blockwise:
        pytest.skip(caps.scaled_mm_reason)
    backend = backends.get_backend("torch_blockwise")
    reason = backend.rejection(G128, 128, n, k)
    if reason is not None:  # torch 2.11: K/128 not a multiple of 4 computes wrong, so rejected
        # the refusal is this shape's contract: a clear ValueError at the call, never a wrong product
        assert (k // 128) % 4 != 0, reason
        with pytest.raises(ValueError, match="no working 128x128 scale layout"):
            backend.gemm(quant.quantize(make_activation(4, k, "cuda"), G128), *_gpu_weight(n, k, 128)[:2], {})
        return
    w, s, w_ref = _gpu_weight(n, k, 128)
    derived = backend.derive_weight_tensors(w, s, 128)
    for m in (1, 3, 64, 127, 2048):
        pair = quant.quantize(make_activation(m, k, "cuda"), G128)
        out = backend.gemm(pair, w, s, derived, out=poisoned_out(m, n, "cuda"))
        err = rel_error(out, ref.dequantize(pair).double() @ w_ref.t())
        assert err < TOL, f"M={m}: relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 5120), (5120, 8192), (5120, 2048)])
def test_a_register_cap_changes_no_bit_gpu(n, k):
    """The M = 64 entries write the same bits capped (as at M = 33 under every Triton, at M = 64
    from 3.7 on) and uncapped (the cap moves registers, not arithmetic), the gate_up with its
    SiLU*mul epilogue too."""
    torch.manual_seed(0)
    w, s, _ = _gpu_weight(n, k, 32)
    for m in (33, 64):
        pair = quant.quantize(make_activation(m, k, "cuda"), G32)
        table = gemm.gemm_config(m, n, k, 32, pair.data.device)
        assert table.residency_cap and table.max_regs is None
        capped = table._replace(max_regs=gemm.THREE_PROGRAMS_PER_SM)
        uncapped = table._replace(residency_cap=False)
        outs = [gemm.fp8_gemm(pair, w, s, weight_block=32, config=c).view(torch.int16) for c in (capped, uncapped)]
        assert torch.equal(*outs), f"M={m}"
        if n == 4608:
            pairs = [gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, limit=10.0, out_format=G32,
                                            return_bf16=False, config=c) for c in (capped, uncapped)]
            assert_pairs_equal(*pairs)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 5120), (5120, 2304)])
def test_padded_scale_rows_change_no_bit_gpu(n, k):
    """The M-bucket-256 per-group entries at M = 200 (scales read padded to align4(M), capped where
    ``gemm.bucket256_register_cap`` says: under 3.8 the pair GEMM uncapped, the gate_up with its
    SiLU*mul epilogue capped) write the bits of the same entry masking at M uncapped."""
    torch.manual_seed(0)
    w, s, _ = _gpu_weight(n, k, 32)
    pair = quant.quantize(make_activation(200, k, "cuda"), G32)
    table = gemm.gemm_config(200, n, k, 32, pair.data.device)
    assert table.residency_cap and gemm._launch_residency(table, pair.scale, 320 if n == 5120 else 288)[1]
    plain = table._replace(residency_cap=False)
    outs = [gemm.fp8_gemm(pair, w, s, weight_block=32, config=c).view(torch.int16) for c in (table, plain)]
    assert torch.equal(*outs)
    if n == 4608:
        pairs = [gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, limit=10.0, out_format=G32,
                                        return_bf16=False, config=c) for c in (table, plain)]
        assert_pairs_equal(*pairs)


@pytest.mark.gpu
def test_bucket256_silu_mul_cap_changes_no_bit_gpu():
    """The gate_up with its SiLU*mul epilogue at M = 160 and 256 (the M-bucket-256 entry on unpadded
    scale rows, capped from Triton 3.7 on: ``gemm.bucket256_register_cap``) writes the bits of the
    same entry capped at 168 and uncapped."""
    torch.manual_seed(0)
    n, k = 4608, 5120
    w, s, _ = _gpu_weight(n, k, 32)
    for m in (160, 256):
        pair = quant.quantize(make_activation(m, k, "cuda"), G32)
        table = gemm.gemm_config(m, n, k, 32, pair.data.device)
        assert table.residency_cap and not gemm._launch_residency(table, pair.scale, 72 * cdiv(m, 64))[1]
        arms = (table._replace(max_regs=gemm.THREE_PROGRAMS_PER_SM), table._replace(residency_cap=False))
        pairs = [gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, limit=10.0, return_bf16=False,
                                        out=poisoned_pair(m, n // 2, G32, "cuda"), config=c) for c in arms]
        assert_pairs_equal(*pairs)


@pytest.mark.gpu
@pytest.mark.parametrize("out_fmt", [G32, ActFormat.SM100_G32_UE8M0_PACKED_MN], ids=lambda f: f.value)
def test_gemm_silu_mul_dsv41_gate_up_gpu(out_fmt):
    """The shared expert's gate_up (I = 2304, K = 5120) with DSv4.1's swiglu clamp, table configs
    (the fused launch may run more warps than the bf16 GEMM it must match bit for bit)."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    for m in GPU_MS:
        y, want = check_gemm_silu_mul(m, 2304, 5120, None, out_fmt, 10.0 if m % 2 else None, device)
        assert rel_error(y, want) < TOL, m


@pytest.mark.gpu
def test_split_k_under_cuda_graph_replay_gpu():
    """Captured once, replayed with new inputs: split-K counters re-arm on every replay."""
    n, k, m = 1792, 5120, 16
    w, s, w_ref = _gpu_weight(n, k, 32)
    cfg = gemm.GemmConfig(64, 16, 128, 8, 4, 4, 8, dequant=True)
    static_x = make_activation(m, k, "cuda")
    pair = quant.quantize(static_x, G32)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm.fp8_gemm(pair, w, s, weight_block=32, out=out, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quant.quantize(static_x, G32, out=pair)
        gemm.fp8_gemm(pair, w, s, weight_block=32, out=out, config=cfg)
    for _ in range(3):
        static_x.copy_(make_activation(m, k, "cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = rel_error(out, ref.dequantize(pair).double() @ w_ref.t())
        assert err < TOL, f"relative error {err:.3g}"


@pytest.mark.cpu
def test_config_choice_by_group_and_m(device):
    """What the table and the heuristic pick: block-diagonal FP8 dots for FP8 tokens with 32-groups
    at M <= 16, bf16-dequantized operands above in the heuristic (the table may keep block-diagonal
    dots up to M = 64), always dequantized for W8A16, the FP8 dot for 128-groups."""
    for (bucket, n, k, group), cfg in gemm.CONFIG_TABLE.items():
        assert not (cfg.dequant and cfg.block_diag)
        if group == 128:
            assert not cfg.dequant and not cfg.block_diag, (n, k, bucket)
        elif bucket <= 16:
            assert cfg.block_diag, (n, k, bucket)
        # the token tile covers the bucket's M at once (the weights are read once per call), and
        # narrower than 16 only block-diagonal, whose dot is SUB x block_m >= 16 columns wide
        assert cfg.block_m >= min(bucket, 16) or bucket > 64, (n, k, bucket)
        assert cfg.block_m >= 16 or (cfg.block_diag and cfg.block_k // group * cfg.block_m >= 16), (n, k, bucket)
        assert k % cfg.block_k == 0
    for m in (1, 7, 16):
        picked = gemm._heuristic_config(m, 3072, 4096, 32, sms=132)
        assert picked.block_diag and not picked.dequant
        assert gemm._heuristic_config(m, 3072, 4096, 32, sms=132, a_fp8=False).dequant
        assert not gemm._heuristic_config(m, 3072, 4096, 128, sms=132).block_diag
    assert gemm._heuristic_config(64, 3072, 4096, 32, sms=132).dequant
    for m, tile in ((1, 4), (4, 4), (5, 8), (8, 8), (9, 16), (16, 16)):  # table, M buckets 4 / 8 / 16
        picked = gemm.select_config(m, 5120, 8192, 32, torch.device(device))
        assert picked.block_diag and picked.block_m == tile, (m, picked)
        assert gemm.select_config(m, 5120, 8192, 128, torch.device(device)) == \
            gemm.CONFIG_TABLE[(16, 5120, 8192, 128)]  # 128-groups: bucket 16's FP8-dot entry
        assert gemm._heuristic_config(m, 3072, 4096, 32, sms=132).block_m == tile
    assert not gemm.select_config(5, 5120, 8192, 32, torch.device(device), a_fp8=False).block_diag  # W8A16


@pytest.mark.cpu
def test_buckets_without_entries_borrow_the_larger_buckets(device, monkeypatch):
    """M = 17..32 (bucket 32) runs bucket 64's entry on a 32-token tile, which stays far below the
    residency line: with the cap the entry has at an aligned stride (none under Triton 3.6, 168
    from 3.7 on), at any stride. M = 65..128 bucket 256's (its tile is no wider than 128; the
    per-group entries without their residency rule); a table entry whose block_k does not divide K
    is skipped."""
    dev = torch.device(device)
    entry64 = gemm.CONFIG_TABLE[(64, 5120, 8192, 32)]
    for version, cap in (("3.6.0", None), ("3.8.0", 168)):
        monkeypatch.setattr(gemm, "triton_release", lambda v=None, version=version: launch.triton_release(version))
        narrowed = entry64._replace(block_m=32, max_regs=cap, residency_cap=False)
        for m in (17, 24, 32):
            assert gemm.select_config(m, 5120, 8192, 32, dev) == narrowed, (version, m)
    assert gemm.select_config(33, 5120, 8192, 32, dev) == entry64
    # the per-group residency entries' two row tiles fit one wave: no cap, no padded rows
    down = gemm.CONFIG_TABLE[(256, 5120, 2304, 32)]
    for m in (65, 128):
        assert gemm.select_config(m, 5120, 8192, 32, dev) == gemm.CONFIG_TABLE[(256, 5120, 8192, 32)], m
        assert gemm.select_config(m, 5120, 2304, 32, dev) == down._replace(residency_cap=False), m
    bad = gemm.GemmConfig(64, 16, 256, 1, 2, 4, 8)
    monkeypatch.setitem(gemm.CONFIG_TABLE, (16, 192, 384, 32), bad)
    picked = gemm.select_config(16, 192, 384, 32, dev)
    assert picked != bad and 384 % picked.block_k == 0


@pytest.mark.cpu
def test_heuristic_k_step_token_tile_and_split():
    """Outside the table: 128-column K steps wherever 128 divides K (block-diagonal at M <= 16 for
    32-groups), else one group's (then dequantized, 16-token tiles); 64 x 64 tiles up to M = 256;
    K split in powers of two while there are fewer than two programs per SM, slices of >= 4 K
    steps, at most 8 slices."""
    for k in (384, 1280):
        picked = gemm._heuristic_config(4, 3072, k, 32, sms=132)
        assert picked.block_k == 128 and picked.block_diag, k
    picked = gemm._heuristic_config(1, 3072, 160, 32, sms=132)
    assert (picked.block_k, picked.block_m, picked.block_diag, picked.dequant) == (32, 16, False, True)
    for group, wide in ((32, (128, 128)), (128, (128, 64))):
        assert gemm._heuristic_config(256, 3072, 4096, group, sms=132)[:2] == (64, 64)
        assert gemm._heuristic_config(257, 3072, 4096, group, sms=132)[:2] == wide
    split = lambda m, n, k, sms=132: gemm._heuristic_config(m, n, k, 32, sms=sms).split  # noqa: E731
    assert split(1, 64, 512) == 1  # 4 K steps: no two slices of 4
    assert split(1, 64, 1024) == 2 and split(1, 64, 2048) == 4
    assert split(1, 64, 16384) == 8  # at most 8 slices
    assert split(1, 6400, 4096) == 4  # 100 tiles: 4 slices make 400 programs >= 2 x 132
    assert split(64, 512, 4096, sms=4) == 1  # 8 tiles: already two programs per SM
    assert split(64, 512, 4096, sms=5) == 2
