"""mHC kernels (fp8chain_kernel.mhc) against the torch references (fp8chain_kernel.reference.mhc).

Bounds checked here:

* stats: ``pre``, ``post``, ``comb`` within 1e-5 (absolute; all three live in [0, 2]) of the
  reference, whose GEMV and mean square are exact (fp64); the kernel's fp32 split-K GEMV is off
  by ~1e-7 relative, which the mixes see as ~1e-6 at most. Columns of ``comb`` sum to one within
  1e-5 (the last Sinkhorn step normalises columns: they sum to ``S/(S+hc_eps)``); rows sum to
  one only as far as the iteration has converged, so rows are checked against the reference's
  row sums (1e-5) and, for well-conditioned logits, against one.
* post / mega boundary: ``R'`` within one bf16 ulp of the unrounded fp32 reference; ``x`` within
  one bf16 ulp of the fp32 RMSNorm of ``bf16(sum_k pre[k] R'[k])`` computed from the kernel's own
  ``R'`` (so a rounding tie of ``R'`` cannot be counted twice); the FP8 pair equals
  ``reference.quantize`` of the kernel's own ``x`` bit for bit, for every ActFormat. The
  kernels sum in the reference's order without fused multiply-add, so ``R'`` is also checked
  bit for bit against the reference.
"""

from __future__ import annotations

import pytest
import torch

from fp8chain_kernel import mhc, reference
from fp8chain_kernel.formats import ActFormat, QuantizedActivation, empty_pair
from fp8chain_kernel.reference import mhc as ref_mhc

from helpers import assert_close_bf16, assert_pairs_equal, assert_rows_poisoned, poisoned_pair, rel_error

CPU_H = 256
GPU_H = 5120
CPU_TS = [1, 2, 3, 4, 16, 64, 127]
GPU_TS = [1, 2, 3, 4, 16, 64, 127, 256, 2048]
FORMATS = list(ActFormat)
EPS = 1e-6
STATS_TOL = 1e-5

cpu = pytest.mark.cpu
gpu = pytest.mark.gpu


def _dev(kind: str) -> torch.device:
    return torch.device("cuda" if kind == "gpu" else "cpu")


def _suite(ts_cpu, ts_gpu):
    """(suite, T) parameters: CPU interpreter at small H, GPU at DSv4.1 H."""
    return ([pytest.param("cpu", t, marks=cpu, id=f"cpu-T{t}") for t in ts_cpu]
            + [pytest.param("gpu", t, marks=gpu, id=f"gpu-T{t}") for t in ts_gpu])


def _hidden(kind: str) -> int:
    return GPU_H if kind == "gpu" else CPU_H


def make_stats_params(h: int, device, comb_scale: float = 1.0):
    fn = torch.randn(ref_mhc.HC * (2 + ref_mhc.HC), ref_mhc.HC * h, device=device) / (4 * h) ** 0.5
    scale = (torch.rand(3, device=device) + 0.5)
    scale[2] *= comb_scale
    base = torch.randn(24, device=device) * 0.5
    return fn, scale, base


def make_mixes(t: int, device):
    pre = torch.sigmoid(torch.randn(t, 4, device=device)) + EPS
    post = 2 * torch.sigmoid(torch.randn(t, 4, device=device))
    comb = torch.softmax(torch.randn(t, 4, 4, device=device), dim=2)
    comb = comb / comb.sum(dim=1, keepdim=True)
    return pre, post, comb


def make_inputs(t: int, h: int, device):
    residual = torch.randn(t, 4, h, device=device).bfloat16()
    y = torch.randn(t, h, device=device).bfloat16()
    weight = (1 + 0.3 * torch.randn(h, device=device)).bfloat16()
    return (residual, y, weight) + make_mixes(t, device)


def nan_poison(shape, device, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def sentinel_poison(shape, device):
    """A finite poison for outputs whose rows may rightly be NaN."""
    return torch.full(shape, 12345.0, dtype=torch.bfloat16, device=device)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    a, b = got.contiguous().view(torch.int16).cpu(), want.contiguous().view(torch.int16).cpu()
    bad = (a != b).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} elements differ, first at {bad[:5].tolist()}"


def check_boundary_outputs(y, residual, pre, post, comb, weight, new_residual, x, pair, fmt, eps=EPS):
    """R' and x correctly rounded (``verify.ROUNDED_FROM_FP32``) from the fp32 post and the fp32
    norm of the kernel's own R', R' bitwise the reference's, pair exact."""
    if y is not None:
        assert_close_bf16(new_residual, ref_mhc.mhc_post_fp32(y, residual, post, comb))
        assert_bitwise(new_residual, ref_mhc.mhc_post(y, residual, post, comb))
        source = new_residual
    else:
        source = residual
    if x is not None:
        want = ref_mhc.mhc_norm_fp32(ref_mhc.mhc_combine(source, pre), weight, eps)
        assert_close_bf16(x, want)
    if fmt is not None:
        assert pair is not None and pair.fmt is ActFormat(fmt)
        assert_pairs_equal(pair, reference.quantize(x, fmt))


# ---------------------------------------------------------------------------------- stats


def check_stats(got, want, residual, hc_eps=EPS, col_tol=1e-5):
    pre, post, comb = got
    rpre, rpost, rcomb = want
    t = residual.shape[0]
    assert pre.shape == (t, 4) and post.shape == (t, 4) and comb.shape == (t, 4, 4)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    for name, a, b in (("pre", pre, rpre), ("post", post, rpost), ("comb", comb, rcomb)):
        assert torch.isfinite(a).all(), f"{name} not finite"
        err = (a - b).abs().max().item() if a.numel() else 0.0
        assert err <= STATS_TOL, f"{name} max abs error {err:.3g} > {STATS_TOL}"
    if t:
        assert (pre >= hc_eps).all() and (pre <= 1 + 2 * hc_eps).all()
        assert (post >= 0).all() and (post <= 2).all()
        assert (comb >= 0).all() and (comb <= 1).all()
        # columns after the final column normalisation sum to S / (S + hc_eps), S ~ 1
        col = comb.sum(dim=1)
        assert (col <= 1 + 1e-6).all()
        assert (col - 1).abs().max().item() <= col_tol, "comb columns do not sum to one"
        assert (comb.sum(dim=2) - rcomb.sum(dim=2)).abs().max().item() <= STATS_TOL


@pytest.mark.parametrize("kind,t", _suite([1, 3, 16, 127], GPU_TS))
def test_stats_matches_reference(kind, t):
    device = _dev(kind)
    h = _hidden(kind)
    residual = torch.randn(t, 4, h, device=device).bfloat16()
    if t >= 3:
        residual[1] = 0  # an all-zero token: r = rsqrt(eps), m = 0, finite mixes
    params = make_stats_params(h, device)
    got = mhc.mhc_stats(residual, *params)
    want = reference.mhc_stats(residual, *params)
    check_stats(got, want, residual)
    # deterministic: a second launch is bit-identical
    again = mhc.mhc_stats(residual, *params)
    for a, b in zip(got, again):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("kind,t", _suite([3, 16, 127], [16, 64, 127, 2048]))
@pytest.mark.parametrize("tokens", ["one", "tile"])
def test_stats_finish_tokens_either_way(kind, t, tokens, monkeypatch):
    """Both finish launches ``stats_finish_tokens`` picks between, one token a program (Triton
    3.8) and the split-sum tile (3.6), stay within the reference's bound, whichever Triton runs."""
    rule = mhc.stats_finish_tokens
    monkeypatch.setattr(mhc, "stats_finish_tokens",
                        lambda rows, split_tile: 1 if tokens == "one" else rule(rows, split_tile, "3.6.0"))
    device = _dev(kind)
    h = _hidden(kind)
    residual = torch.randn(t, 4, h, device=device).bfloat16()
    residual[1] = 0
    params = make_stats_params(h, device)
    check_stats(mhc.mhc_stats(residual, *params), reference.mhc_stats(residual, *params), residual)


@gpu
@pytest.mark.parametrize("t", [16, 33, 64])
def test_stats_partial_stages_either_way(t, monkeypatch):
    """The partial-sum launch at decode tiles as each Triton gets it (``stats_partial_stages``:
    unpipelined from 3.7 on, Triton's default stages under 3.6) gives the same bits, within the
    reference's bound, whichever Triton compiles it (the interpreter ignores stages: GPU only)."""
    rule = mhc.stats_partial_stages
    residual = torch.randn(t, 4, GPU_H, device="cuda").bfloat16()
    residual[1] = 0
    params = make_stats_params(GPU_H, "cuda")
    results = []
    for version in ("3.6.0", "3.8.0"):
        monkeypatch.setattr(mhc, "stats_partial_stages", lambda bt, v=version: rule(bt, v))
        results.append(mhc.mhc_stats(residual, *params))
        check_stats(results[-1], reference.mhc_stats(residual, *params), residual)
    for a, b in zip(*results):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@cpu
@pytest.mark.parametrize("version, rows, split_tile, tokens", [
    ("3.6.0", 1, 256, 1), ("3.6.0", 3, 8, 4), ("3.6.0", 64, 64, 4), ("3.6.0", 2048, 16, 16), ("3.5.1", 64, 4, 64),
    ("3.8.0", 64, 64, 1), ("3.8.0", 3, 8, 1), ("3.8.0", 65, 16, 1), ("3.8.0", 2048, 16, 1),
    ("4.0.0+git1a2b", 64, 4, 1)])
def test_stats_finish_tokens_by_triton(version, rows, split_tile, tokens):
    assert mhc.stats_finish_tokens(rows, split_tile, version) == tokens


@cpu
def test_reference_stats_in_fp32():
    """``dtype=float32`` (the compiled peer's stats) stays within the kernels' bound of the fp64
    specification."""
    residual = torch.randn(5, 4, CPU_H).bfloat16()
    residual[2] = 0
    params = make_stats_params(CPU_H, "cpu")
    got, want = reference.mhc_stats(residual, *params, dtype=torch.float32), reference.mhc_stats(residual, *params)
    check_stats(got, want, residual)
    assert not all(torch.equal(a, b) for a, b in zip(got, want))  # computed in fp32, not fp64


@pytest.mark.parametrize("kind", [pytest.param("cpu", marks=cpu), pytest.param("gpu", marks=gpu)])
def test_stats_well_conditioned_rows_converge(kind):
    """With small comb logits 19 Sinkhorn rounds converge: rows sum to one as well."""
    device = _dev(kind)
    h = _hidden(kind)
    residual = torch.randn(5, 4, h, device=device).bfloat16()
    fn, scale, base = make_stats_params(h, device, comb_scale=0.1)
    base[8:] *= 0.1
    pre, post, comb = mhc.mhc_stats(residual, fn, scale, base)
    check_stats((pre, post, comb), reference.mhc_stats(residual, fn, scale, base), residual)
    assert (comb.sum(dim=2) - 1).abs().max().item() <= 1e-5
    assert (comb.sum(dim=1) - 1).abs().max().item() <= 1e-5


@cpu
@pytest.mark.parametrize("iters", [1, 2, 7])
def test_stats_options(iters):
    """sinkhorn_iters, hc_eps, rms_eps are honoured; strided residual; H not a multiple of 128."""
    h = 160
    big = torch.randn(6, 4, h + 32).bfloat16()
    residual = big[:, :, :h]
    params = make_stats_params(h, "cpu")
    kw = dict(rms_eps=1e-3, hc_eps=1e-4, sinkhorn_iters=iters)
    check_stats(mhc.mhc_stats(residual, *params, **kw),
                reference.mhc_stats(residual, *params, **kw), residual, hc_eps=1e-4,
                col_tol=1e-3)  # 1 - S/(S + 1e-4) for column sums S down to ~0.1


@pytest.mark.parametrize("kind", [pytest.param("cpu", marks=cpu), pytest.param("gpu", marks=gpu)])
def test_stats_max_splits(kind, monkeypatch):
    """``max_splits`` caps the partial launch's K splits (the GPU's 160 at H = 5120 down to 32 and
    8; a cap of 1 is raised to 5 splits of 32 chunks, as one fp32 chain over all 160 chunks would
    leave the 1e-5 bound); each cap stays within the reference's bound and is reproducible, and
    the split count shows in the last bits."""
    device = _dev(kind)
    h = GPU_H
    if kind == "cpu":
        monkeypatch.setattr(mhc, "_target_programs", lambda device: 264)  # the GPU's split counts
    t = 2
    residual = torch.randn(t, 4, h, device=device).bfloat16()
    params = make_stats_params(h, device)
    want = reference.mhc_stats(residual, *params)
    default = mhc.mhc_stats(residual, *params)
    splits = mhc._stats_config(t, 4 * h, residual.device)[3]
    assert splits > 32
    results = []
    assert mhc._stats_config(t, 4 * h, residual.device, 1)[2:] == (32, 5)
    # long prefills too, where two programs per SM would leave 1-4 splits per token block
    assert mhc._stats_config(2048, 4 * h, residual.device)[2:] == (18, 9)
    assert mhc._stats_config(20000, 4 * h, residual.device)[2:] == (32, 5)
    for cap in (32, 8, 1):
        assert mhc._stats_config(t, 4 * h, residual.device, cap)[3] == max(cap, 5)
        got = mhc.mhc_stats(residual, *params, max_splits=cap)
        check_stats(got, want, residual)
        again = mhc.mhc_stats(residual, *params, max_splits=cap)
        assert all(torch.equal(a, b) for a, b in zip(got, again))
        results.append(got)
    capped_above = mhc.mhc_stats(residual, *params, max_splits=splits + 7)  # above the default: the default
    assert all(torch.equal(a, b) for a, b in zip(capped_above, default))
    assert not all(torch.equal(a, b) for got in results for a, b in zip(got, default))
    for bad in (0, -3, 2.0, True, "8"):
        with pytest.raises(ValueError, match="max_splits"):
            mhc.mhc_stats(residual, *params, max_splits=bad)


@cpu
def test_stats_into_caller_buffers():
    """out=(pre, post, comb) gets the bits of the allocating call; wrong buffers are refused."""
    t = 3
    residual = torch.randn(t, 4, CPU_H).bfloat16()
    params = make_stats_params(CPU_H, "cpu")
    want = mhc.mhc_stats(residual, *params)
    out = (torch.full((t, 4), float("nan")), torch.full((t, 4), float("nan")), torch.full((t, 4, 4), float("nan")))
    got = mhc.mhc_stats(residual, *params, out=out)
    for a, b, buf in zip(want, got, out):
        assert b is buf and torch.equal(a.view(torch.int32), b.view(torch.int32))
    with pytest.raises(ValueError, match="comb"):
        mhc.mhc_stats(residual, *params, out=(out[0], out[1], torch.empty(t, 4, 3)))
    with pytest.raises(TypeError, match="pre"):
        mhc.mhc_stats(residual, *params, out=(out[0].double(), out[1], out[2]))
    with pytest.raises(ValueError, match="contiguous"):
        mhc.mhc_stats(residual, *params, out=(torch.empty(4, t).t(), out[1], out[2]))


@cpu
@pytest.mark.parametrize("t,bad", [(4, 2), (5, 4), (33, 32)])
@pytest.mark.parametrize("value", [float("nan"), "huge"])
def test_stats_nan_token_isolated(t, bad, value):
    """A NaN in one token makes all 24 of its mixes NaN and leaves the others' bits alone, also
    for the last token of a partly filled block of the finishing kernel (T = 5, 33). So does a
    token whose sum of squares overflows fp32 (finite values around 1e20: its RMS scale would be 0
    and its mixes those of the bases alone)."""
    residual = torch.randn(t, 4, CPU_H).bfloat16()
    params = make_stats_params(CPU_H, "cpu")
    clean = mhc.mhc_stats(residual, *params)
    if value == "huge":
        residual[bad] = residual[bad] * 1e20
        assert torch.isfinite(residual[bad].float()).all()
    else:
        residual[bad, 1, 7] = value
    dirty = mhc.mhc_stats(residual, *params)
    keep = [i for i in range(t) if i != bad]
    for a, b in zip(clean, dirty):
        assert torch.isnan(b[bad]).all()
        assert torch.equal(a[keep].view(torch.int32), b[keep].view(torch.int32))


# ------------------------------------------------------------------------------ post


@pytest.mark.parametrize("kind,t", _suite(CPU_TS, GPU_TS))
def test_post(kind, t):
    device = _dev(kind)
    h = _hidden(kind)
    residual, y, _, _, post, comb = make_inputs(t, h, device)
    out = nan_poison((t, 4, h), device)
    got = mhc.mhc_post(y, residual, post, comb, out=out)
    assert got.data_ptr() == out.data_ptr()
    check_boundary_outputs(y, residual, None, post, comb, None, got, None, None, None)
    fresh = mhc.mhc_post(y, residual, post, comb)
    assert_bitwise(fresh, got)
    # in place over the residual is allowed for post
    inplace = residual.clone()
    mhc.mhc_post(y, inplace, post, comb, out=inplace)
    assert_bitwise(inplace, got)


# ---------------------------------------------------------------------- combine + norm


@pytest.mark.parametrize("kind,t", _suite([1, 3, 16, 127], [1, 3, 64, 2048]))
def test_combine_norm(kind, t):
    device = _dev(kind)
    h = _hidden(kind)
    residual, _, weight, pre, _, _ = make_inputs(t, h, device)
    x = mhc.mhc_combine_norm(residual, pre, weight, EPS)
    check_boundary_outputs(None, residual, pre, None, None, weight, None, x, None, None)
    for fmt in FORMATS:
        out = poisoned_pair(t, h, fmt, device)
        out_bf16 = nan_poison((t, h), device)
        got_x, pair = mhc.mhc_combine_norm(residual, pre, weight, EPS, out_format=fmt, out=out,
                                           out_bf16=out_bf16)
        assert got_x.data_ptr() == out_bf16.data_ptr() and pair.data.data_ptr() == out.data.data_ptr()
        assert_bitwise(got_x, x)
        assert_pairs_equal(pair, reference.quantize(x, fmt))
    only = mhc.mhc_combine_norm(residual, pre, weight, EPS, out_format=FORMATS[0], return_bf16=False)
    assert isinstance(only, QuantizedActivation)
    assert_pairs_equal(only, reference.quantize(x, FORMATS[0]))
    want = reference.mhc_combine_norm(residual, pre, weight, EPS, out_format=FORMATS[0])
    assert_close_bf16(x, want[0].float(), ulps=1.0)


@pytest.mark.cpu
@pytest.mark.parametrize("t", [1, 3, 70])  # split rows (last-arrival on the interpreter) and whole-row programs
def test_boundary_norm_eps_comparable_to_the_mean_square(t):
    check_boundary_norm_eps(t, 256, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 16, 127, 2048])  # row barrier, last arrival, whole rows
def test_boundary_norm_eps_comparable_to_the_mean_square_gpu(t):
    check_boundary_norm_eps(t, 5120, "cuda")


def check_boundary_norm_eps(t, h, device):
    """Residuals whose combined rows have a mean square about norm_eps: where the eps enters the
    RMSNorm (inside the square root, added to the mean square) decides x here."""
    residual, y, weight, pre, post, comb = make_inputs(t, h, device)
    eps = 1e-2
    residual, y = (residual.float() * 0.05).bfloat16(), (y.float() * 0.05).bfloat16()
    new_r, x, pair = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, eps,
                                           out_format=ActFormat.SM90_G32_FP32_MN)
    check_boundary_outputs(y, residual, pre, post, comb, weight, new_r, x, pair, ActFormat.SM90_G32_FP32_MN, eps)
    ms = ref_mhc.mhc_combine(new_r, pre).float().pow(2).mean(dim=1)
    assert (ms > eps / 10).all() and (ms < eps * 10).all()  # eps is of the mean square's order
    x2 = mhc.mhc_combine_norm(residual, pre, weight, eps)
    check_boundary_outputs(None, residual, pre, None, None, weight, None, x2, None, None, eps)


@pytest.mark.parametrize("kind", [pytest.param("cpu", marks=cpu), pytest.param("gpu", marks=gpu)])
def test_combine_norm_layer0_and_fp32_weight(kind):
    """pre = (1, 0, 0, 0) gives RMSNorm(R[:, 0]) (layer 0's attention input); fp32 weight."""
    device = _dev(kind)
    h = _hidden(kind)
    t = 5
    residual = torch.randn(t, 4, h, device=device).bfloat16()
    pre = torch.zeros(t, 4, device=device)
    pre[:, 0] = 1
    weight = 1 + 0.3 * torch.randn(h, device=device)
    x = mhc.mhc_combine_norm(residual, pre, weight, EPS)
    assert_close_bf16(x, ref_mhc.mhc_norm_fp32(residual[:, 0], weight, EPS))


# ------------------------------------------------------------------------ mega boundary


@pytest.mark.parametrize("kind,t", _suite(CPU_TS, GPU_TS))
def test_mega_boundary(kind, t):
    device = _dev(kind)
    h = _hidden(kind)
    residual, y, weight, pre, post, comb = make_inputs(t, h, device)
    # no pair
    new_r, x, pair = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS)
    assert pair is None
    check_boundary_outputs(y, residual, pre, post, comb, weight, new_r, x, None, None)
    for fmt in FORMATS:
        out_r = nan_poison((t, 4, h), device)
        out_x = nan_poison((t, h), device)
        out = poisoned_pair(t, h, fmt, device)
        got_r, got_x, got_pair = mhc.mhc_mega_boundary(
            y, residual, pre, post, comb, weight, EPS, out_format=fmt, out_residual=out_r,
            out=out, out_bf16=out_x)
        assert got_r.data_ptr() == out_r.data_ptr() and got_x.data_ptr() == out_x.data_ptr()
        assert got_pair.data.data_ptr() == out.data.data_ptr()
        check_boundary_outputs(y, residual, pre, post, comb, weight, got_r, got_x, got_pair, fmt)
        assert_bitwise(got_r, new_r)
        assert_bitwise(got_x, x)
    # pair only
    got_r, none_x, only = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS,
                                                out_format=FORMATS[0], return_bf16=False)
    assert none_x is None
    assert_bitwise(got_r, new_r)
    assert_pairs_equal(only, reference.quantize(x, FORMATS[0]))


@pytest.mark.parametrize("kind", [pytest.param("cpu", marks=cpu), pytest.param("gpu", marks=gpu)])
def test_mega_boundary_matches_reference_composition(kind):
    """The reference mega boundary is post then combine+norm; kernel agrees to 1 ulp; strided
    residual input; bf16 and fp32 norm weights."""
    device = _dev(kind)
    h = _hidden(kind)
    t = 7
    residual, y, weight, pre, post, comb = make_inputs(t, h, device)
    strided = torch.empty(t, 4, h + 128, dtype=torch.bfloat16, device=device)[:, :, :h]
    strided.copy_(residual)
    for w in (weight, weight.float()):
        got_r, got_x, got_pair = mhc.mhc_mega_boundary(y, strided, pre, post, comb, w, EPS,
                                                       out_format="sm90_g32_fp32_mn")
        want_r, want_x, want_pair = reference.mhc_mega_boundary(
            y, residual, pre, post, comb, w, EPS, out_format="sm90_g32_fp32_mn")
        assert_bitwise(got_r, want_r)
        assert_close_bf16(got_x, want_x.float(), ulps=1.0)
        check_boundary_outputs(y, residual, pre, post, comb, w, got_r, got_x, got_pair,
                               "sm90_g32_fp32_mn")


@pytest.mark.parametrize("kind", [pytest.param("cpu", marks=cpu), pytest.param("gpu", marks=gpu)])
def test_zero_rows(kind):
    device = _dev(kind)
    h = _hidden(kind)
    t = 5
    residual, y, weight, pre, post, comb = make_inputs(t, h, device)
    zero = [0, 3]
    residual[zero] = 0
    y[zero] = 0
    for fmt in FORMATS:
        new_r, x, pair = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS,
                                               out_format=fmt, out=poisoned_pair(t, h, fmt, device),
                                               out_residual=nan_poison((t, 4, h), device),
                                               out_bf16=nan_poison((t, h), device))
        check_boundary_outputs(y, residual, pre, post, comb, weight, new_r, x, pair, fmt)
        assert (new_r[zero].float() == 0).all() and (x[zero].float() == 0).all()
        assert (pair.data[zero].view(torch.uint8) & 0x7F == 0).all()
        scales = reference.scales_as_float(pair)
        assert torch.isfinite(scales).all() and (scales > 0).all()
    # empty batch everywhere
    e_r, e_y, e_w, e_pre, e_post, e_comb = make_inputs(0, h, device)
    r0, x0, p0 = mhc.mhc_mega_boundary(e_y, e_r, e_pre, e_post, e_comb, e_w, EPS,
                                       out_format=FORMATS[0])
    assert r0.shape == (0, 4, h) and x0.shape == (0, h) and p0.data.shape == (0, h)
    assert mhc.mhc_post(e_y, e_r, e_post, e_comb).shape == (0, 4, h)
    assert mhc.mhc_combine_norm(e_r, e_pre, e_w, EPS).shape == (0, h)
    s = mhc.mhc_stats(e_r, *make_stats_params(h, device))
    assert [tuple(a.shape) for a in s] == [(0, 4), (0, 4), (0, 4, 4)]


@pytest.mark.parametrize("kind", [pytest.param("cpu", marks=cpu), pytest.param("gpu", marks=gpu)])
def test_nan_token_stays_visible(kind):
    device = _dev(kind)
    h = _hidden(kind)
    t, bad, col = 6, 2, 37
    residual, y, weight, pre, post, comb = make_inputs(t, h, device)
    fmt = ActFormat.SM90_G32_FP32_MN
    clean = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS, out_format=fmt)
    y[bad, col] = float("nan")
    for f in FORMATS:
        new_r, x, pair = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS,
                                               out_format=f)
        assert torch.isnan(new_r[bad, :, col].float()).all()
        assert torch.isfinite(new_r[bad, :, :col].float()).all()
        assert torch.isnan(x[bad].float()).all()  # the row's norm is NaN
        data = pair.data[bad].float()
        assert torch.isnan(data).all()
        assert_pairs_equal(pair, reference.quantize(x, f))
        others = [i for i in range(t) if i != bad]
        assert_bitwise(new_r[others], clean[0][others])
        assert_bitwise(x[others], clean[1][others])
        if f is fmt:
            assert torch.equal(pair.data[others].view(torch.uint8),
                               clean[2].data[others].view(torch.uint8))


@pytest.mark.parametrize("kind", [pytest.param("cpu", marks=cpu), pytest.param("gpu", marks=gpu)])
def test_captured_buffers(kind):
    """Outputs into slices of buffers allocated for more rows (as a captured CUDA graph has)."""
    device = _dev(kind)
    h = _hidden(kind)
    t, cap = 3, 64
    residual, y, weight, pre, post, comb = make_inputs(t, h, device)
    for fmt in FORMATS:
        big_pair = poisoned_pair(cap, h, fmt, device)
        big_r = nan_poison((cap, 4, h), device)
        big_x = nan_poison((cap, h), device)
        new_r, x, pair = mhc.mhc_mega_boundary(
            y, residual, pre, post, comb, weight, EPS, out_format=fmt,
            out_residual=big_r[:t], out=big_pair.rows(t), out_bf16=big_x[:t])
        check_boundary_outputs(y, residual, pre, post, comb, weight, new_r, x, pair, fmt)
        assert torch.isnan(big_r[t:].float()).all() and torch.isnan(big_x[t:].float()).all()
        assert_rows_poisoned(big_pair, t)
        assert pair.scale.stride() == big_pair.scale.stride()
        # the same through combine_norm with a sliced pair
        big_pair2 = poisoned_pair(cap, h, fmt, device)
        x2, pair2 = mhc.mhc_combine_norm(new_r, pre, weight, EPS, out=big_pair2.rows(t))
        assert_bitwise(x2, x)
        assert_pairs_equal(pair2, reference.quantize(x, fmt))


@gpu
def test_mega_boundary_cuda_graph():
    device = torch.device("cuda")
    h, t = GPU_H, 16
    fmt = ActFormat.SM90_G32_FP32_MN
    residual, y, weight, pre, post, comb = make_inputs(t, h, device)
    out_r = torch.empty(t, 4, h, dtype=torch.bfloat16, device=device)
    out_x = torch.empty(t, h, dtype=torch.bfloat16, device=device)
    out = empty_pair(t, h, fmt, device)

    def step():
        mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS, out_format=fmt,
                              out_residual=out_r, out=out, out_bf16=out_x)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new = make_inputs(t, h, device)
    for dst, src in zip((residual, y, weight, pre, post, comb), new):
        dst.copy_(src)
    out_r.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_boundary_outputs(y, residual, pre, post, comb, weight, out_r, out_x, out, fmt)


@cpu
def test_gpu_launch_configs_on_interpreter(monkeypatch):
    """The GPU's launch shapes (264 target programs, one row per program, 160 GEMV splits at
    H = 5120) run through the interpreter too."""
    monkeypatch.setattr(mhc, "_target_programs", lambda device: 264)
    monkeypatch.setattr(mhc, "_max_rows_per_program", lambda device: 1)
    residual = torch.randn(2, 4, GPU_H).bfloat16()
    params = make_stats_params(GPU_H, "cpu")
    assert mhc._stats_config(2, 4 * GPU_H, residual.device)[3] == 160
    check_stats(mhc.mhc_stats(residual, *params), reference.mhc_stats(residual, *params), residual)
    h, t = 1280, 3
    residual, y, weight, pre, post, comb = make_inputs(t, h, "cpu")
    cfg = mhc._boundary_config(t, h, residual.device)
    assert cfg["grid"] == (3, 10) and cfg["BM"] == 1 and cfg["SLICE"] == 128 and cfg["SPLIT_ROW"]
    for fmt in (ActFormat.SM90_G128_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN):
        new_r, x, pair = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS,
                                               out_format=fmt, out=poisoned_pair(t, h, fmt, "cpu"))
        check_boundary_outputs(y, residual, pre, post, comb, weight, new_r, x, pair, fmt)


@cpu
def test_row_barrier_launch_shapes(monkeypatch):
    """Compiled, one row per program: a split row takes the row barrier with the narrowest
    power-of-two slice that keeps the grid at one program per SM (H200: 132); past that, and on
    the interpreter (programs run one after another), the last program to arrive normalizes."""
    monkeypatch.setattr(mhc, "_max_rows_per_program", lambda device: 1)
    monkeypatch.setattr(mhc, "_target_programs", lambda device: 264)
    cpu = torch.device("cpu")
    assert not mhc._boundary_config(1, GPU_H, cpu)["ROW_BARRIER"]  # the interpreter
    monkeypatch.setattr(mhc, "compiled_for_gpu", lambda device: True)
    shapes = {t: mhc._boundary_config(t, GPU_H, cpu) for t in (1, 3, 4, 16, 64, 127)}
    for t, slice_, splits in ((1, 128, 40), (3, 128, 40), (4, 256, 20), (16, 1024, 5), (64, 4096, 2)):
        cfg = shapes[t]
        assert cfg["ROW_BARRIER"] and cfg["SLICE"] == cfg["BLOCK"] == slice_ and cfg["grid"] == (t, splits)
        assert t * splits <= 132 and cfg["SPLITS"] == mhc._BARRIER_SPLITS
        assert cfg["num_warps"] == (4 if slice_ <= 512 else 8)
    assert not shapes[127]["ROW_BARRIER"] and shapes[127]["SPLIT_ROW"]
    monkeypatch.setenv("FP8CHAIN_ROW_BARRIER", "0")  # the opt-out: the last program normalizes
    cfg = mhc._boundary_config(1, GPU_H, cpu)
    assert not cfg["ROW_BARRIER"] and cfg["SPLIT_ROW"] and cfg["grid"] == (1, 40)
    assert mhc.row_barrier_off_reason() == "FP8CHAIN_ROW_BARRIER=0"


@cpu
@pytest.mark.parametrize("percentage,barrier", [(None, True), ("100", True), ("50", False), ("12.5", False),
                                                ("lots", False)])
def test_row_barrier_off_for_mps_clients_with_fewer_threads(monkeypatch, percentage, barrier):
    """A process whose own CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is below 100 (or unreadable) may get
    fewer SMs than the device reports: its decode rows take the last-arrival form, which needs no
    program to wait for another, and the reason is given."""
    monkeypatch.setattr(mhc, "_max_rows_per_program", lambda device: 1)
    monkeypatch.setattr(mhc, "compiled_for_gpu", lambda device: True)
    monkeypatch.delenv("FP8CHAIN_ROW_BARRIER", raising=False)
    if percentage is None:
        monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    else:
        monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", percentage)
    assert mhc._boundary_config(1, GPU_H, torch.device("cpu"))["ROW_BARRIER"] is barrier
    reason = mhc.row_barrier_off_reason()
    assert (reason is None) is barrier
    if not barrier:
        assert f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percentage}" in reason


@gpu
def test_row_barrier_interleaved_launches(monkeypatch):
    """The row barrier's arrival counters persist across launches (never re-armed): launches of
    different T (different slice counts on the same rows), eagerly and replayed from a graph,
    each give the very bytes of their first run (400 rounds), and x agrees with the last-arrival
    tail's within one bf16 ulp (another order of the row's sum of squares)."""
    fmt = ActFormat.SM90_G32_FP32_MN
    cases = {t: make_inputs(t, GPU_H, "cuda") for t in (1, 3, 16, 2, 64)}
    first = {t: mhc.mhc_mega_boundary(y, r, pre, post, comb, w, EPS, out_format=fmt)
             for t, (r, y, w, pre, post, comb) in cases.items()}
    for t, (r, y, w, pre, post, comb) in cases.items():
        assert mhc._boundary_config(t, GPU_H, r.device)["ROW_BARRIER"]
    outs = {t: (torch.empty_like(first[t][0]), torch.empty_like(first[t][1]), empty_pair(t, GPU_H, fmt, "cuda"))
            for t in cases}

    def run_all():
        for t, (r, y, w, pre, post, comb) in cases.items():
            new_r, x, pair = outs[t]
            mhc.mhc_mega_boundary(y, r, pre, post, comb, w, EPS, out_format=fmt, out_residual=new_r,
                                  out_bf16=x, out=pair)

    graph = torch.cuda.CUDAGraph()
    run_all()
    with torch.cuda.graph(graph):
        run_all()
    # a race shows rarely (a stale sum once in ~300 rounds of an earlier protocol): many rounds,
    # mismatches counted on the device, checked once
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    for replay in (run_all, graph.replay) * 200:
        for new_r, x, pair in outs.values():
            new_r.fill_(float("nan"))
            x.fill_(float("nan"))
            pair.data.fill_(0)
        replay()
        for t, (new_r, x, pair) in outs.items():
            mismatches += (new_r.view(torch.int16) != first[t][0].view(torch.int16)).any()
            mismatches += (x.view(torch.int16) != first[t][1].view(torch.int16)).any()
            mismatches += (pair.data.view(torch.uint8) != first[t][2].data.view(torch.uint8)).any()
            mismatches += (pair.scale.view(torch.int32) != first[t][2].scale.view(torch.int32)).any()
    assert mismatches.item() == 0, f"{mismatches.item()} outputs differ from their first run"
    for t, (new_r, x, pair) in outs.items():  # and the last round in full
        assert_bitwise(new_r, first[t][0])
        assert_bitwise(x, first[t][1])
        assert_pairs_equal(pair, first[t][2])
    monkeypatch.setenv("FP8CHAIN_ROW_BARRIER", "0")
    for t, (r, y, w, pre, post, comb) in cases.items():
        assert not mhc._boundary_config(t, GPU_H, r.device)["ROW_BARRIER"]
        _, x_last, _ = mhc.mhc_mega_boundary(y, r, pre, post, comb, w, EPS, out_format=fmt)
        assert_close_bf16(first[t][1], x_last.float(), ulps=1.0)


@cpu
@pytest.mark.parametrize("h", [512, 320])  # 320: a last column chunk of a row that is not whole
@pytest.mark.parametrize("targets", [1, 16], ids=["whole-rows", "split-rows"])
def test_row_split_and_whole_row_programs(monkeypatch, targets, h):
    """A normalized row owned by one program, or split over programs whose last arrival normalizes
    it: both within the bounds, every output written (poisoned buffers), and the arrival counters
    re-armed (the second call would otherwise normalize nothing). At H = 320 and 16 rows a
    whole-row program's last column chunk is partial. The mixes are strided views (the kernel
    reads them through their strides)."""
    monkeypatch.setattr(mhc, "_target_programs", lambda device: targets)
    t = 5 if h == 512 else 16
    assert mhc._boundary_config(t, h, torch.device("cpu"))["SPLIT_ROW"] == (targets > 1)
    residual, y, weight, pre, post, comb = make_inputs(t, h, "cpu")
    residual[2] = float("nan")
    pre_view = torch.zeros(t, 8)[:, ::2].copy_(pre)
    post_view = torch.zeros(t, 4, 3)[:, :, 1].copy_(post)
    comb_view = comb.transpose(1, 2).contiguous().transpose(1, 2)
    assert not (pre_view.is_contiguous() or post_view.is_contiguous() or comb_view.is_contiguous())
    ok = [i for i in range(t) if i != 2]
    for _ in range(2):
        for fmt in (FORMATS[0], FORMATS[-1]):
            # finite poison: row 2 must come out NaN, which a NaN poison left unwritten would fake
            out_r, out_x = sentinel_poison((t, 4, h), "cpu"), sentinel_poison((t, h), "cpu")
            new_r, x, pair = mhc.mhc_mega_boundary(y, residual, pre_view, post_view, comb_view, weight, EPS,
                                                   out_format=fmt, out_residual=out_r, out_bf16=out_x,
                                                   out=poisoned_pair(t, h, fmt, "cpu"))
            assert torch.isnan(x[2]).all() and torch.isnan(new_r[2]).all()
            check_boundary_outputs(y[ok], residual[ok], pre[ok], post[ok], comb[ok], weight, new_r[ok], x[ok],
                                   reference.quantize(x[ok], fmt), fmt)
            assert_pairs_equal(pair, reference.quantize(x, fmt))
            out_x = sentinel_poison((t, h), "cpu")
            x_only = mhc.mhc_combine_norm(new_r, pre_view, weight, EPS, out_bf16=out_x)
            assert torch.isnan(x_only[2]).all()
            assert_close_bf16(x_only[ok], ref_mhc.mhc_norm_fp32(ref_mhc.mhc_combine(new_r[ok], pre[ok]), weight, EPS))


@cpu
@pytest.mark.parametrize("targets", [1, 16], ids=["whole-rows", "split-rows"])
def test_row_whose_sum_of_squares_overflows_is_nan(monkeypatch, targets):
    """Finite values whose sum of squares overflows fp32 (an RMS above ~8e17 at H = 512) give a NaN row of
    x and NaN FP8 data, not zeros, in whole-row and split-row programs alike, as the reference
    does; R' keeps its finite values and the other rows are untouched."""
    monkeypatch.setattr(mhc, "_target_programs", lambda device: targets)
    t, h, bad = 5, 512, 3
    residual, y, weight, pre, post, comb = make_inputs(t, h, "cpu")
    clean = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS)
    residual[bad] = residual[bad] * 1e20
    y[bad] = y[bad] * 1e20
    fmt = FORMATS[0]
    new_r, x, pair = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS, out_format=fmt,
                                           out_residual=sentinel_poison((t, 4, h), "cpu"),
                                           out_bf16=sentinel_poison((t, h), "cpu"),
                                           out=poisoned_pair(t, h, fmt, "cpu"))
    assert torch.isfinite(new_r[bad].float()).all()
    v = ref_mhc.mhc_combine(new_r[bad:bad + 1], pre[bad:bad + 1])
    assert not torch.isfinite(v.float().square().sum())
    assert torch.isnan(x[bad]).all() and torch.isnan(ref_mhc.mhc_norm_fp32(v, weight, EPS)).all()
    assert torch.isnan(pair.data[bad].float()).all()
    assert_pairs_equal(pair, reference.quantize(x, fmt))
    ok = [i for i in range(t) if i != bad]
    assert_bitwise(new_r[ok], clean[0][ok])
    assert_bitwise(x[ok], clean[1][ok])
    assert torch.isnan(mhc.mhc_combine_norm(new_r, pre, weight, EPS)[bad]).all()


@cpu
def test_stats_strided_scale_and_base():
    """``scale`` and ``base`` given as strided views give the bits of contiguous ones (the kernel
    reads them densely)."""
    residual = torch.randn(3, 4, CPU_H).bfloat16()
    fn, scale, base = make_stats_params(CPU_H, "cpu")
    strided_scale = torch.zeros(3, 2)[:, 1].copy_(scale)
    strided_base = torch.zeros(24, 3)[:, 0].copy_(base)
    want = mhc.mhc_stats(residual, fn, scale, base)
    for s, b in ((strided_scale, base), (scale, strided_base)):
        for a, g in zip(want, mhc.mhc_stats(residual, fn, s, b)):
            assert torch.equal(a.view(torch.int32), g.view(torch.int32))


@cpu
def test_boundary_writes_out_bf16_without_returning_it():
    """``return_bf16=False`` with ``out_bf16`` given: x is not returned but still written there."""
    t, h = 3, CPU_H
    residual, y, weight, pre, post, comb = make_inputs(t, h, "cpu")
    fmt = FORMATS[0]
    new_r, x, pair = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS, out_format=fmt)
    out_x = nan_poison((t, h), "cpu")
    got_r, none_x, got_pair = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS, out_format=fmt,
                                                    out_bf16=out_x, return_bf16=False)
    assert none_x is None
    assert_bitwise(out_x, x)
    assert_pairs_equal(got_pair, pair)
    x2 = mhc.mhc_combine_norm(new_r, pre, weight, EPS)
    out_x = nan_poison((t, h), "cpu")
    only = mhc.mhc_combine_norm(new_r, pre, weight, EPS, out_format=fmt, out_bf16=out_x, return_bf16=False)
    assert isinstance(only, QuantizedActivation)
    assert_bitwise(out_x, x2)


@cpu
def test_boundary_with_no_columns():
    """H = 0: the boundary entry points return empty outputs without a launch."""
    t = 3
    residual, y, weight, pre, post, comb = make_inputs(t, 0, "cpu")
    assert mhc.mhc_post(y, residual, post, comb).shape == (t, 4, 0)
    assert mhc.mhc_combine_norm(residual, pre, weight, EPS).shape == (t, 0)
    new_r, x, _ = mhc.mhc_mega_boundary(y, residual, pre, post, comb, weight, EPS)
    assert new_r.shape == (t, 4, 0) and x.shape == (t, 0)


@cpu
def test_stats_config_tiles_and_splits(monkeypatch):
    """Decode batches up to 64 rows take 16-token tiles (loaded unpipelined under Triton >= 3.7),
    larger ones 64 (Triton's default stages); for every cap the split count is what the chunks
    per split give: every split sums at least one chunk, none is empty."""
    monkeypatch.setattr(mhc, "_target_programs", lambda device: 264)
    cpu_dev = torch.device("cpu")
    assert mhc._stats_config(64, 4 * GPU_H, cpu_dev)[0] == 16
    assert mhc._stats_config(65, 4 * GPU_H, cpu_dev)[0] == 64
    decode_tile = mhc.DECODE_STATS_TILE
    assert mhc.stats_partial_stages(decode_tile, "3.8.0") == {"num_stages": 1}
    assert mhc.stats_partial_stages(decode_tile, "3.6.0") == {} and mhc.stats_partial_stages(64, "3.8.0") == {}
    chunks = 4 * GPU_H // 128
    for rows in (1, 2, 64, 65, 2048):
        for cap in (None, *range(1, chunks + 2)):
            _, _, per_split, splits = mhc._stats_config(rows, 4 * GPU_H, cpu_dev, cap)
            assert (splits - 1) * per_split < chunks <= splits * per_split, (rows, cap, per_split, splits)
            assert per_split <= mhc._MAX_CHUNKS_PER_SPLIT


@cpu
def test_boundary_config_limits_of_split_rows(monkeypatch):
    """A normalized row is split over programs only while its whole-row tile fits (BM x row width
    <= 16384: 64 rows of 256 columns on the interpreter, not of 512) and its row block has an
    arrival counter (at most mhc.ARRIVAL_SLOTS row blocks)."""
    cpu_dev = torch.device("cpu")
    assert mhc._boundary_config(64, 256, cpu_dev)["SPLIT_ROW"]
    assert not mhc._boundary_config(64, 512, cpu_dev)["SPLIT_ROW"]
    monkeypatch.setattr(mhc, "_target_programs", lambda device: 1 << 20)
    monkeypatch.setattr(mhc, "_max_rows_per_program", lambda device: 1)
    assert mhc._boundary_config(mhc.ARRIVAL_SLOTS, 256, cpu_dev)["SPLIT_ROW"]
    assert not mhc._boundary_config(mhc.ARRIVAL_SLOTS + 1, 256, cpu_dev)["SPLIT_ROW"]
    assert mhc._boundary_config(mhc.ARRIVAL_SLOTS + 1, 256, cpu_dev, norm=False)["grid"] == (mhc.ARRIVAL_SLOTS + 1, 2)


@cpu
def test_boundary_config_every_program_has_columns(monkeypatch):
    """The slice count follows the slice width: no program of the grid starts past H."""
    cpu_dev = torch.device("cpu")
    for targets in range(1, 41):
        monkeypatch.setattr(mhc, "_target_programs", lambda device: targets)
        for cols in (256, 320, 1280, GPU_H):
            cfg = mhc._boundary_config(1, cols, cpu_dev)
            assert (cfg["grid"][1] - 1) * cfg["SLICE"] < cols <= cfg["grid"][1] * cfg["SLICE"], (targets, cols, cfg)


@cpu
def test_row_barrier_up_to_one_program_per_sm(monkeypatch):
    """The row barrier takes a grid of exactly one program per SM (T = 66 at H = 5120: 66 x 2 on
    the H200's 132 SMs), not one more (T = 67), and fewer than _BARRIER_SPLITS slices a row (one
    row of 8192 columns: 32 slices of 256, not 64 of 128)."""
    monkeypatch.setattr(mhc, "_max_rows_per_program", lambda device: 1)
    monkeypatch.setattr(mhc, "_target_programs", lambda device: 264)
    monkeypatch.setattr(mhc, "compiled_for_gpu", lambda device: True)
    monkeypatch.delenv("FP8CHAIN_ROW_BARRIER", raising=False)
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    cpu_dev = torch.device("cpu")
    cfg = mhc._boundary_config(66, GPU_H, cpu_dev)
    assert cfg["ROW_BARRIER"] and cfg["grid"] == (66, 2)
    assert not mhc._boundary_config(67, GPU_H, cpu_dev)["ROW_BARRIER"]
    cfg = mhc._boundary_config(1, 8192, cpu_dev)
    assert cfg["ROW_BARRIER"] and cfg["grid"] == (1, 32) and cfg["SLICE"] == 256


# --------------------------------------------------------------------------- validation


@cpu
def test_validation_errors():
    t, h = 3, 128
    residual, y, weight, pre, post, comb = make_inputs(t, h, "cpu")
    fn, scale, base = make_stats_params(h, "cpu")
    mega = mhc.mhc_mega_boundary
    with pytest.raises(TypeError, match="residual"):
        mega(y, residual.float(), pre, post, comb, weight, EPS)
    with pytest.raises(TypeError, match="y"):
        mega(y.float(), residual, pre, post, comb, weight, EPS)
    with pytest.raises(TypeError, match="pre"):
        mega(y, residual, pre.bfloat16(), post, comb, weight, EPS)
    with pytest.raises(ValueError, match="comb"):
        mega(y, residual, pre, post, comb[:, :3], weight, EPS)
    with pytest.raises(ValueError, match="residual"):
        mega(y, residual[:, :3], pre, post, comb, weight, EPS)
    with pytest.raises(ValueError, match="y"):
        mega(y[:2], residual, pre, post, comb, weight, EPS)
    with pytest.raises(ValueError, match="norm_weight"):
        mega(y, residual, pre, post, comb, weight[:-1], EPS)
    with pytest.raises(TypeError, match="sm90_g128"):
        mega(y, residual, pre, post, comb, weight, EPS, out_format="sm90_g32_fp32_mn",
             out=empty_pair(t, h, "sm90_g128_fp32_mn"))
    with pytest.raises(ValueError, match="shape"):
        mega(y, residual, pre, post, comb, weight, EPS, out=empty_pair(t + 1, h, "sm90_g32_fp32_mn"))
    with pytest.raises(ValueError, match="overlaps"):
        mega(y, residual, pre, post, comb, weight, EPS, out_residual=residual)
    with pytest.raises(ValueError, match="out_residual"):
        mega(y, residual, pre, post, comb, weight, EPS,
             out_residual=torch.empty(t, 4, h + 1, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out_bf16"):
        mega(y, residual, pre, post, comb, weight, EPS, out_bf16=torch.empty(t, h))
    with pytest.raises(ValueError, match="return_bf16"):
        mhc.mhc_combine_norm(residual, pre, weight, EPS, return_bf16=False)
    with pytest.raises(TypeError, match="post"):
        mhc.mhc_post(y, residual, post.double(), comb)
    buf = torch.zeros(t * 4 * h + 8, dtype=torch.bfloat16)
    shifted_residual = buf[4:4 + t * 4 * h].view(t, 4, h)
    with pytest.raises(ValueError, match="overlaps"):
        mhc.mhc_post(y, shifted_residual, post, comb, out=buf[:t * 4 * h].view(t, 4, h))
    with pytest.raises(ValueError, match="fn"):
        mhc.mhc_stats(residual, fn[:, :-1], scale, base)
    with pytest.raises(TypeError, match="fn"):
        mhc.mhc_stats(residual, fn.bfloat16(), scale, base)
    with pytest.raises(ValueError, match="base"):
        mhc.mhc_stats(residual, fn, scale, base[:-1])
    for iters in (0, 2.5, True):
        with pytest.raises(ValueError, match="sinkhorn_iters"):
            mhc.mhc_stats(residual, fn, scale, base, sinkhorn_iters=iters)
    with pytest.raises(TypeError, match="residual"):
        mhc.mhc_stats(residual.float(), fn, scale, base)
    for eps in (-1e-6, "1e-6", True, torch.tensor(1e-6), 1e-50, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="norm_eps must be a non-negative number"):
            mega(y, residual, pre, post, comb, weight, eps)
        with pytest.raises(ValueError, match="norm_eps must be a non-negative number"):
            mhc.mhc_combine_norm(residual, pre, weight, eps)
        for name in ("rms_eps", "hc_eps"):
            with pytest.raises(ValueError, match=f"{name} must be a non-negative number"):
                mhc.mhc_stats(residual, fn, scale, base, **{name: eps})


# ------------------------------------------------------------- shifted ordering, 2 sublayers


def _sublayer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w).bfloat16()


def _two_sublayers(embed, params, mats, weights, fmt, kernels: bool, shifted: bool = True):
    """Layer-0 attention input, two sublayers, the final norm (``reference.mhc``'s orderings).

    Shifted (DSv4.1): the boundary after sublayer s carries ``pre_s`` (from the residual that
    entered s) into the next combine. ``shifted=False`` is the ordering this must not be
    confused with: each combine uses the pre computed from the residual it reads.
    """
    k = mhc if kernels else reference
    t, h = embed.shape
    residual = embed[:, None, :].expand(t, 4, h).contiguous()
    first = torch.zeros(t, 4, device=embed.device)
    first[:, 0] = 1
    x = k.mhc_combine_norm(residual, first, weights[0], EPS)
    pairs = []
    for s in range(2):
        y = _sublayer(x, mats[s])
        pre, post, comb = k.mhc_stats(residual, *params[s])
        if shifted:
            new_r, x, pair = k.mhc_mega_boundary(y, residual, pre, post, comb, weights[s + 1],
                                                 EPS, out_format=fmt)
        else:
            new_r = k.mhc_post(y, residual, post, comb)
            own_pre = k.mhc_stats(new_r, *params[1 - s])[0]
            x, pair = k.mhc_combine_norm(new_r, own_pre, weights[s + 1], EPS, out_format=fmt)
        pairs.append(pair)
        residual = new_r
    return residual, x, pairs


@pytest.mark.parametrize("kind", [pytest.param("cpu", marks=cpu), pytest.param("gpu", marks=gpu)])
def test_shifted_ordering_two_sublayers(kind):
    device = _dev(kind)
    h = _hidden(kind)
    t = 5
    fmt = ActFormat.SM90_G32_FP32_MN
    embed = torch.randn(t, h, device=device).bfloat16()
    params = [make_stats_params(h, device) for _ in range(2)]
    mats = [torch.randn(h, h, device=device) / h ** 0.5 for _ in range(2)]
    weights = [(1 + 0.3 * torch.randn(h, device=device)).bfloat16() for _ in range(3)]
    k_r, k_x, k_pairs = _two_sublayers(embed, params, mats, weights, fmt, kernels=True)
    r_r, r_x, _ = _two_sublayers(embed, params, mats, weights, fmt, kernels=False)
    err_r, err_x = rel_error(k_r, r_r), rel_error(k_x, r_x)
    assert err_r < 1e-2 and err_x < 1e-2, (err_r, err_x)
    assert_pairs_equal(k_pairs[-1], reference.quantize(k_x, fmt))
    # the test can tell the orderings apart: carrying the next sublayer's own pre is far off
    w_r, w_x, _ = _two_sublayers(embed, params, mats, weights, fmt, kernels=True, shifted=False)
    assert rel_error(w_x, r_x) > 10 * max(err_x, 1e-3)
