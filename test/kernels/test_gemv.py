"""The FP8 GEMV for one to four tokens (``fp8chain_kernel.gemv``) against ``reference.fp8_gemm``
and the tensor-core GEMM, and the dispatch of ``gemm.fp8_gemm`` to it.

CPU: the Triton interpreter at small shapes. GPU: every ``GEMV_TABLE`` problem (the DSv4.1
shapes) and the sweep's candidates at one of them.
"""

import json

import pytest
import torch

from fp8chain.cli import _load_benchmark
from fp8chain_kernel import act, gemm, gemv, quant
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat
from helpers import assert_pairs_equal, poisoned_pair, rel_error

G32, G128 = ActFormat.SM90_G32_FP32_MN, ActFormat.SM90_G128_FP32_MN
FORMATS = [(G32, 32), (G128, 128)]
TOL = 5e-3


def tokens(m, k, device):
    """Rows with values of very different magnitudes, as a decode step's activations."""
    return (torch.randn(m, k, device=device) * torch.exp2(torch.randint(-6, 6, (m, k), device=device).float())).bfloat16()


def one_token(k, device):
    return tokens(1, k, device)


def poisoned_out(n, device, m=1):
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)


def run_gemv(pair, w, s, block, config, device):
    """Into the first M rows of a poisoned buffer with spare rows, which no token tile may write."""
    m = pair.data.shape[0]
    big = poisoned_out(w.shape[0], device, m + 8)
    out = gemm.fp8_gemm(pair, w, s, weight_block=block, out=big[:m], config=config)
    assert torch.isnan(big[m:].float()).all(), "rows past M written"
    return out


# ------------------------------------------------------------------------------------------
# CPU (interpreter)
# ------------------------------------------------------------------------------------------

@pytest.mark.cpu
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("fmt,block", FORMATS, ids=["g32", "g128"])
@pytest.mark.parametrize("n,k,config", [
    (64, 512, gemv.GemvConfig(4, 256, 2, 3)),
    (96, 1280, gemv.GemvConfig(8, 512, 4, 1)),   # K not a multiple of BLOCK_K: masked last step
    (70, 384, gemv.GemvConfig(32, 128, 2, 3)),   # N not a multiple of BLOCK_N: masked rows
    (33, 256, gemv.GemvConfig(2, 1024, 2, 1)),   # BLOCK_K wider than K
])
def test_gemv_matches_reference_and_gemm_cpu(m, fmt, block, n, k, config, device):
    w, s = ref.random_fp8_weight(n, k, block, device)
    x = tokens(m, k, device)
    pair = quant.quantize(x, fmt)
    out = run_gemv(pair, w, s, block, config, device)
    err = rel_error(out, ref.fp8_gemm(pair, w, s, block))
    assert err < TOL, f"relative error {err:.3g}"
    tensor_cores = gemm.fp8_gemm(pair, w, s, weight_block=block, config=gemm.select_config(m, n, k, block, device))
    assert rel_error(out, tensor_cores) < TOL
    again = run_gemv(pair, w, s, block, config, device)
    assert torch.equal(out.view(torch.int16), again.view(torch.int16))  # deterministic
    if m < gemv.MAX_GEMV_TOKENS:  # a NaN token beside them reaches none of their outputs
        nan_row = torch.full((1, k), float("nan"), dtype=x.dtype, device=device)
        wide = run_gemv(quant.quantize(torch.cat([x, nan_row]), fmt), w, s, block, config, device)
        assert torch.isnan(wide[m]).all()
        if gemv.gemv_token_tile(m + 1) == gemv.gemv_token_tile(m):  # the same kernel: the same bits
            assert torch.equal(wide[:m].view(torch.int16), out.view(torch.int16))
        else:
            assert rel_error(wide[:m], out) < TOL


@pytest.mark.cpu
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_reads_column_major_weight_scales_cpu(m, device):
    """Block scales stored column-major (the same values, strides (1, N / group)) give the very
    bits of the row-major ones, through the GEMV and through its SiLU*mul epilogue's path."""
    n, k, config = 64, 512, gemv.GemvConfig(4, 256, 2, 3)
    w, s = ref.random_fp8_weight(n, k, 32, device)
    column_major = s.t().contiguous().t()
    assert column_major.stride(1) != 1
    pair = quant.quantize(tokens(m, k, device), G32)
    rows = run_gemv(pair, w, s, 32, config, device)
    assert rel_error(rows, ref.fp8_gemm(pair, w, s, 32)) < TOL
    assert torch.equal(run_gemv(pair, w, column_major, 32, config, device).view(torch.int16), rows.view(torch.int16))
    assert torch.equal(gemm.fp8_gemm_silu_mul(pair, w, column_major, weight_block=32, config=config).view(torch.int16),
                       gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, config=config).view(torch.int16))


@pytest.mark.cpu
def test_gemv_nan_zero_and_weight_nan_cpu(device):
    n, k, config = 64, 512, gemv.GemvConfig(4, 256, 2, 3)
    w, s = ref.random_fp8_weight(n, k, 32, device)
    zero = quant.quantize(torch.zeros(1, k, dtype=torch.bfloat16, device=device), G32)
    assert torch.equal(run_gemv(zero, w, s, 32, config, device).float(), torch.zeros(1, n, device=device))
    x = one_token(k, device)
    for bad in ("nan", "inf", "-inf"):  # an infinity's group quantizes to NaN (reference.quant)
        x[0, 300] = float(bad)
        assert torch.isnan(run_gemv(quant.quantize(x, G32), w, s, 32, config, device)).all()  # every output
    bad_w = w.clone()
    bad_w.view(torch.uint8)[5, 17] = 0x7F  # the e4m3 NaN code in weight row 5
    out = run_gemv(quant.quantize(one_token(k, device), G32), bad_w, s, 32, config, device)
    assert torch.isnan(out[0, 5]) and torch.isfinite(out[0, [r for r in range(n) if r != 5]]).all()


@pytest.mark.cpu
def test_fp8_gemm_runs_the_gemv_for_tokens_of_a_table_problem(device, monkeypatch):
    n, k = 64, 512
    config, config4 = gemv.GemvConfig(8, 256, 2, 3), gemv.GemvConfig(4, 256, 2, 1)
    monkeypatch.setitem(gemv.GEMV_TABLE, (1, n, k, 32), config)
    monkeypatch.setitem(gemv.GEMV_TABLE, (4, n, k, 32), config4)
    launched = []
    real = gemm.launch_gemv
    monkeypatch.setattr(gemm, "launch_gemv", lambda *a: launched.append(a[-1]) or real(*a))
    w, s = ref.random_fp8_weight(n, k, 32, device)
    x = one_token(k, device)
    chained = gemm.fp8_gemm(quant.quantize(x, G32), w, s, weight_block=32)
    unchained = gemm.fp8_gemm(x, w, s, weight_block=32, fmt=G32)
    assert torch.equal(chained.view(torch.int16), unchained.view(torch.int16))
    assert torch.equal(chained.view(torch.int16), run_gemv(quant.quantize(x, G32), w, s, 32, config, device).view(torch.int16))
    assert launched == [config] * 3
    three = tokens(3, k, device)
    chained = gemm.fp8_gemm(quant.quantize(three, G32), w, s, weight_block=32)  # the 4-token tile
    assert torch.equal(chained.view(torch.int16), gemm.fp8_gemm(three, w, s, weight_block=32, fmt=G32).view(torch.int16))
    assert launched == [config] * 3 + [config4] * 2
    gemm.fp8_gemm(tokens(2, k, device), w, s, weight_block=32, fmt=G32)  # M = 2: no 2-token entry, the GEMM
    gemm.fp8_gemm(tokens(5, k, device), w, s, weight_block=32, fmt=G32)  # past the GEMV's tokens
    gemm.fp8_gemm(quant.quantize(x, G128), *ref.random_fp8_weight(n, k, 128, device), weight_block=128)  # not in the table
    assert len(launched) == 5
    assert [gemv.select_gemv(m, n, k, 32) for m in range(6)] == [None, config, None, config4, config4, None]


@pytest.mark.cpu
@pytest.mark.parametrize("out_fmt", [None, G32, ActFormat.SM100_G32_UE8M0_PACKED_MN], ids=lambda f: str(f))
@pytest.mark.parametrize("m, explicit", [(1, False), (3, True)])
def test_gemm_silu_mul_on_the_gemv_is_the_two_calls(out_fmt, m, explicit, device, monkeypatch):
    """``fp8_gemm_silu_mul`` where ``fp8_gemm`` runs the GEMV (a table problem, or a ``GemvConfig``
    given): the GEMV, then ``act.silu_mul``, the bytes of ``act.silu_mul(fp8_gemm(...))`` (the
    tensor-core epilogue sums in another order)."""
    n, k = 128, 512  # gate_up [2I, K], I = 64
    config = gemv.GemvConfig(4, 256)
    if not explicit:
        monkeypatch.setitem(gemv.GEMV_TABLE, (1, n, k, 32), config)
    launched = []
    real = gemm.launch_gemv
    monkeypatch.setattr(gemm, "launch_gemv", lambda *a: launched.append(a[-1]) or real(*a))
    w, s = ref.random_fp8_weight(n, k, 32, device)
    pair = quant.quantize(tokens(m, k, device), G32)
    given = config if explicit else None
    want_y = act.silu_mul(gemm.fp8_gemm(pair, w, s, weight_block=32, config=given), limit=10.0)
    y = torch.full((m, n // 2), float("nan"), dtype=torch.bfloat16, device=device)
    if out_fmt is None:
        got = gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, limit=10.0, out_bf16=y, config=given)
        assert got is y
    else:
        out = poisoned_pair(m, n // 2, out_fmt, device)
        got_y, got_pair = gemm.fp8_gemm_silu_mul(pair, w, s, weight_block=32, limit=10.0, out_format=out_fmt,
                                                 out=out, out_bf16=y, config=given)
        assert got_y is y and got_pair.data is out.data
        assert_pairs_equal(got_pair, ref.quantize(want_y, out_fmt))
    assert torch.equal(y.view(torch.int16), want_y.view(torch.int16))
    assert launched == [config, config]  # the reference's fp8_gemm and the fused call's


@pytest.mark.cpu
def test_gemv_config_errors(device):
    n, k = 64, 512
    w, s = ref.random_fp8_weight(n, k, 32, device)
    x = one_token(k, device)
    with pytest.raises(ValueError, match="1 to 4 tokens"):
        gemm.fp8_gemm(tokens(5, k, device), w, s, weight_block=32, fmt=G32, config=gemv.GemvConfig(4, 256))
    for m in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match="1 to 4 tokens"):
            gemv.gemv_token_tile(m)
    for bad in (gemv.GemvConfig(3, 256), gemv.GemvConfig(64, 256), gemv.GemvConfig(4, 48),
                gemv.GemvConfig(4, 384), gemv.GemvConfig(4, 256, 3), gemv.GemvConfig(4, 256, 2, 0),
                gemv.GemvConfig(4, 256, True)):
        with pytest.raises(ValueError, match="GemvConfig"):
            gemm.fp8_gemm(x, w, s, weight_block=32, fmt=G32, config=bad)


@pytest.mark.cpu
def test_gemv_config_checks_refuse_short_k_steps_and_other_types():
    """block_k a multiple of the group (16 columns < a 32-group: no whole group per step, though a
    power of two); a config that is no ``GemvConfig`` is a TypeError."""
    for group in (32, 128):
        with pytest.raises(ValueError, match="GemvConfig"):
            gemv.check_gemv_config(gemv.GemvConfig(4, group // 2), group)
        gemv.check_gemv_config(gemv.GemvConfig(4, group), group)
    with pytest.raises(TypeError, match="config must be a GemvConfig, got tuple"):
        gemv.check_gemv_config((4, 256, 2, 3), 32)


@pytest.mark.cpu
def test_load_table_fills_both_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm, "CONFIG_TABLE", dict(gemm.CONFIG_TABLE))
    monkeypatch.setattr(gemv, "GEMV_TABLE", dict(gemv.GEMV_TABLE))
    monkeypatch.setattr(gemm, "GEMV_TABLE", gemv.GEMV_TABLE)
    records = [dict(n=1792, k=5120, group=32, m=1, kind="gemv", best=[8, 512, 4, 1]),
               dict(n=1792, k=5120, group=32, m=3, kind="gemv", best=[4, 512, 4, 3]),
               dict(n=1792, k=5120, group=32, m=16, kind="gemm", best=list(gemm.GemmConfig(64, 16, 128, 5)))]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"records": records}))
    gemm.load_table(path)
    assert gemv.GEMV_TABLE == {(1, 1792, 5120, 32): gemv.GemvConfig(8, 512, 4, 1),
                               (4, 1792, 5120, 32): gemv.GemvConfig(4, 512, 4, 3)}
    assert gemm.CONFIG_TABLE == {(16, 1792, 5120, 32): gemm.GemmConfig(64, 16, 128, 5)}


# ------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------

def _table_token_counts():
    """Every GEMV_TABLE problem at each token count its tile serves."""
    return [(m, n, k, group) for tile, n, k, group in sorted(gemv.GEMV_TABLE)
            for m in range(1, tile + 1) if gemv.gemv_token_tile(m) == tile]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,group", _table_token_counts(), ids=lambda v: str(v))
def test_gemv_table_problems_gpu(m, n, k, group):
    fmt = gemm.input_format_for_block(group)
    w, s = ref.random_fp8_weight(n, k, group, "cuda")
    x = tokens(m, k, "cuda")
    pair = quant.quantize(x, fmt)
    out = gemm.fp8_gemm(pair, w, s, weight_block=group, out=poisoned_out(n, "cuda", m))  # the table's GEMV
    want = ref.dequantize(pair).double() @ ref.dequantize_weight(w, s, group).double().t()
    assert rel_error(out, want) < TOL
    unchained = gemm.fp8_gemm(x, w, s, weight_block=group, fmt=fmt)
    assert torch.equal(out.view(torch.int16), unchained.view(torch.int16))
    for bad in ("nan", "-inf"):
        x[m - 1, k // 3] = float(bad)
        nan_out = gemm.fp8_gemm(x, w, s, weight_block=group, fmt=fmt)
        assert torch.isnan(nan_out[m - 1]).all()
        assert torch.equal(nan_out[:m - 1].view(torch.int16), out[:m - 1].view(torch.int16))  # the other tokens' bits
    zero = quant.quantize(torch.zeros_like(x), fmt)
    assert torch.equal(gemm.fp8_gemm(zero, w, s, weight_block=group).float(), torch.zeros(m, n, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block", FORMATS, ids=["g32", "g128"])
def test_gemv_sweep_candidates_gpu(fmt, block):
    gemv_candidates = _load_benchmark("gemm").gemv_candidates
    n, k = 5120, 2304
    w, s = ref.random_fp8_weight(n, k, block, "cuda")
    for m in (1, 3):  # the 1- and 4-token tiles
        pair = quant.quantize(tokens(m, k, "cuda"), fmt)
        want = ref.dequantize(pair).double() @ ref.dequantize_weight(w, s, block).double().t()
        for config in gemv_candidates(block):
            out = run_gemv(pair, w, s, block, config, "cuda")
            assert rel_error(out, want) < TOL, (m, config)
