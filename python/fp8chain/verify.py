"""``fp8chain verify``: the kernels' correctness contract, checked on the hardware present.

On a GPU the checks run at DSv4.1 sizes with the compiled kernels; on a CPU at small sizes
through the Triton interpreter. Each FP8 producer's bf16 output must match the reference (rounded
from its fp32 value: ``ROUNDED_FROM_FP32``; the mHC residual bit for bit; the wo_a einsum and the
attention within their error bounds) and its pair must equal the reference quantization of that
bf16 output bit for bit; GEMMs must match an fp64 reference on the dequantized operands within
bf16 output rounding; the router must pick the reference's experts where no two keys nearly tie.
NaN and infinite inputs must stay visible in the rows that hold them.
"""

from __future__ import annotations

import time
import warnings
from typing import Callable

import torch

from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat

Check = Callable[[torch.device, bool], str]


def pairs_equal(got, want) -> bool:
    same_data = torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
    same_scale = torch.equal(got.scale.contiguous().view(torch.int32), want.scale.contiguous().view(torch.int32))
    return same_data and same_scale


#: wo_a_einsum's bf16 output against the fp64 einsum (relative Frobenius error): one bf16 rounding
#: (2^-9 relative at most per element) and fp32 accumulation over D = 4096.
WO_A_REL_BOUND = 2.5e-3


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


#: A bf16 output rounded to nearest from an fp32 value a few hundred fp32 ulps off the reference's
#: (another summation order, approximate divisions on the GPU): half a bf16 ulp and a little.
ROUNDED_FROM_FP32 = 0.5 + 2.0**-6


def bf16_ulp_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``|got - want|`` in bf16 ulps of each reference value's own binade
    (``2^(floor(log2 |want|) - 7)``; bf16's subnormal step below its normal range); inf where
    ``got`` is not finite."""
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    want = want.float()
    _, exponent = torch.frexp(want.abs().clamp_min(2.0**-126))  # |want| = m * 2^exponent, m in [0.5, 1)
    ulp = torch.ldexp(torch.ones_like(want), exponent - 8)
    return ((got.float() - want).abs() / ulp).max().item() if want.numel() else 0.0


def rotated_rows_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Two bf16 roundings of one fp32 RoPE computation done in different orders: the largest
    ``|got - want|`` in units of one bf16 ulp of ``want`` (``|want| * 2^-7``) plus 2^-16 of its
    row's largest value (a rotation that cancels leaves fp32 reordering error on a small result);
    at most 1 where they agree, inf where ``got`` is not finite."""
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    got, want = got.float(), want.float()
    allowed = want.abs() * 2.0**-7 + want.abs().amax(dim=-1, keepdim=True) * 2.0**-16
    return ((got - want).abs() / allowed).max().item() if want.numel() else 0.0


def _require_rounded(got: torch.Tensor, want_fp32: torch.Tensor, what: str, ulps: float = ROUNDED_FROM_FP32) -> None:
    err = bf16_ulp_error(got, want_fp32)
    _require(err <= ulps, f"{what}: {err:.3g} bf16 ulps from the fp32 reference (at most {ulps:.3g})")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in fp64; inf where ``got`` is not finite."""
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _random_rows(rows: int, cols: int, device) -> torch.Tensor:
    x = torch.randn(rows, cols, device=device) * torch.exp2(torch.randint(-8, 8, (rows, 1), device=device).float())
    if rows > 2:
        x[1] = 0
    return x.bfloat16()


def _special_rows(rows: int, cols: int, device) -> torch.Tensor:
    """``_random_rows`` (row 1 zero) with a NaN in row 2 and +-inf in row 3 (rows >= 4)."""
    return _with_special_values(_random_rows(rows, cols, device))


def _with_special_values(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x [rows >= 4, cols]`` with a NaN in row 2 and +-inf in row 3."""
    x = x.clone()
    cols = x.shape[1]
    x[2, cols // 3] = float("nan")
    x[3, 5], x[3, cols - 1] = float("inf"), -float("inf")
    return x


#: the rows ``_with_special_values`` leaves alone
CLEAN_ROWS = [0, 1, 4]


def _require_special_rows_visible(what: str, produce, x: torch.Tensor, fmt: ActFormat, normed: bool) -> None:
    """``produce(x) -> (y, pair)`` on ``x`` and on ``_with_special_values(x)``: the NaN row keeps a
    NaN in y and in the pair's data (a normalised row: rows 2 and 3 NaN throughout, the infinity
    too; elementwise or per group, an infinity may be clamped), the other rows are bitwise the
    clean run's, and the pair is ``reference.quantize(y)``."""
    y0, pair0 = produce(x)
    y, pair = produce(_with_special_values(x))
    bad = slice(2, 4) if normed else slice(2, 3)
    _require(bool(torch.isnan(y[bad]).all() if normed else torch.isnan(y[bad]).any()),
             f"{what} {fmt.value}: a NaN / inf row came out finite")
    _require(bool(torch.isnan(pair.data[bad].float()).any()), f"{what} {fmt.value}: the NaN row's FP8 data is finite")
    same = torch.equal(y[CLEAN_ROWS].view(torch.int16), y0[CLEAN_ROWS].view(torch.int16)) and torch.equal(
        pair.data[CLEAN_ROWS].view(torch.uint8), pair0.data[CLEAN_ROWS].view(torch.uint8))
    _require(same, f"{what} {fmt.value}: rows without NaN / inf changed beside one that has them")
    _require(pairs_equal(pair, ref.quantize(y, fmt)), f"{what} pair {fmt.value}: NaN / inf rows")


def _token_counts(quick) -> tuple[int, ...]:
    """The token counts a check runs: 1, 3 and 64 (a tile of many rows), without 64 with ``--quick``."""
    return (1, 3) if quick else (1, 3, 64)


def check_quantize(device, quick) -> str:
    from fp8chain_kernel import quant

    sizes = [(1, 5120), (3, 1280), (64, 5120), (2048, 8192)] if device.type == "cuda" else [(1, 256), (3, 128), (17, 512)]
    sizes = sizes[:2] if quick else sizes
    for fmt in ActFormat:
        for rows, cols in sizes:
            x = _random_rows(rows, cols, device)
            _require(pairs_equal(quant.quantize(x, fmt), ref.quantize(x, fmt)), f"{fmt.value} {rows}x{cols}")
        x = _special_rows(5, sizes[0][1], device)
        _require(pairs_equal(quant.quantize(x, fmt), ref.quantize(x, fmt)), f"{fmt.value} NaN / inf rows")
    return f"{len(sizes)} shapes and NaN / +-inf rows x {len(ActFormat)} formats bitwise"


def check_producers(device, quick) -> str:
    from fp8chain_kernel import act, norm
    from fp8chain_kernel.reference.act import silu_mul_fp32
    from fp8chain_kernel.reference.norm import rms_norm_fp32

    hidden, inter = (5120, 2304) if device.type == "cuda" else (256, 128)
    rows_list = _token_counts(quick)
    for fmt in ActFormat:
        for rows in rows_list:
            x = _random_rows(rows, hidden, device)
            weight = (torch.rand(hidden, device=device) + 0.5).bfloat16()
            y, pair = norm.rms_norm(x, weight, 1e-6, out_format=fmt)
            _require_rounded(y, rms_norm_fp32(x, weight, 1e-6), f"rms_norm {fmt.value} T={rows}")
            _require(pairs_equal(pair, ref.quantize(y, fmt)), f"rms_norm pair {fmt.value} T={rows}")
            gate_up = _random_rows(rows, 2 * inter, device)
            y, pair = act.silu_mul(gate_up, limit=10.0, out_format=fmt)
            _require_rounded(y, silu_mul_fp32(gate_up, 10.0), f"silu_mul {fmt.value} T={rows}")
            _require(pairs_equal(pair, ref.quantize(y, fmt)), f"silu_mul pair {fmt.value} T={rows}")
        weight = (torch.rand(hidden, device=device) + 0.5).bfloat16()
        _require_special_rows_visible("rms_norm", lambda x: norm.rms_norm(x, weight, 1e-6, out_format=fmt),
                                      _random_rows(5, hidden, device), fmt, normed=True)
        _require_special_rows_visible("silu_mul", lambda x: act.silu_mul(x, limit=10.0, out_format=fmt),
                                      _random_rows(5, 2 * inter, device), fmt, normed=False)
    return (f"rms_norm, silu_mul: T in {list(rows_list)} x {len(ActFormat)} formats, bf16 correctly rounded "
            f"from the fp32 reference, pairs bitwise, NaN / inf rows visible")


def check_wo_a_and_mhc(device, quick) -> str:
    from fp8chain_kernel import einsum, mhc
    from fp8chain_kernel.reference.einsum import wo_a_einsum_fp

    groups, rank, width, hidden = (8, 1024, 4096, 5120) if device.type == "cuda" else (2, 128, 128, 256)
    wo_a = (torch.randn(groups, rank, width, device=device) * width ** -0.5).bfloat16()
    norm_weight = (torch.rand(hidden, device=device) + 0.5).bfloat16()
    worst = 0.0
    for fmt in ActFormat:
        for rows in _token_counts(quick):
            o = torch.randn(rows, groups, width, device=device).bfloat16()
            y, pair = einsum.wo_a_einsum(o, wo_a, out_format=fmt)
            err = relative_error(y, wo_a_einsum_fp(o, wo_a, torch.float64))
            _require(err < WO_A_REL_BOUND, f"wo_a_einsum {fmt.value} T={rows}: relative error {err:.2e}")
            worst = max(worst, err)
            _require(pairs_equal(pair, ref.quantize(y, fmt)), f"wo_a_einsum pair {fmt.value} T={rows}")
            y_in = _random_rows(rows, hidden, device)
            residual = _random_rows(rows, 4 * hidden, device).view(rows, 4, hidden)
            pre = torch.rand(rows, 4, device=device)
            post = 2 * torch.rand(rows, 4, device=device)
            comb = torch.rand(rows, 4, 4, device=device)
            new_residual, x, pair = mhc.mhc_mega_boundary(y_in, residual, pre, post, comb, norm_weight, 1e-6,
                                                          out_format=fmt)
            _require(torch.equal(new_residual.view(torch.int16), ref.mhc_post(y_in, residual, post, comb)
                                 .view(torch.int16)), f"mhc_mega_boundary residual {fmt.value} T={rows}")
            _require_rounded(x, ref.mhc_norm_fp32(ref.mhc_combine(new_residual, pre), norm_weight, 1e-6),
                             f"mhc_mega_boundary x {fmt.value} T={rows}")
            _require(pairs_equal(pair, ref.quantize(x, fmt)), f"mhc_mega_boundary pair {fmt.value} T={rows}")
        _require_special_rows_visible(
            "wo_a_einsum", lambda o: einsum.wo_a_einsum(o.view(-1, groups, width), wo_a, out_format=fmt),
            torch.randn(5, groups * width, device=device).bfloat16(), fmt, normed=False)
        residual = _random_rows(5, 4 * hidden, device).view(5, 4, hidden)
        pre, post, comb = torch.rand(5, 4, device=device), 2 * torch.rand(5, 4, device=device), \
            torch.rand(5, 4, 4, device=device)
        _require_special_rows_visible(
            "mhc_mega_boundary",
            lambda y_in: mhc.mhc_mega_boundary(y_in, residual, pre, post, comb, norm_weight, 1e-6, out_format=fmt)[1:],
            _random_rows(5, hidden, device), fmt, normed=True)
    return (f"wo_a_einsum G={groups} (worst relative error {worst:.1e}), mhc_mega_boundary H={hidden} (the "
            f"residual bitwise, x correctly rounded): {len(ActFormat)} formats, pairs bitwise, NaN / inf rows visible")


def check_attention(device, quick) -> str:
    from fp8chain_kernel import attention

    heads, dim, length = (64, 512, 1024) if device.type == "cuda" else (4, 128, 64)
    cos, sin = ref.rope_tables(length, 64, 10000.0, device)
    worst = 0.0
    for rows in _token_counts(quick):
        q_in = torch.randn(rows, heads * dim, device=device).bfloat16()
        kv = torch.randn(rows, dim, device=device).bfloat16()
        kv_weight = (torch.rand(dim, device=device) + 0.5).bfloat16()  # the model's kv_norm, fused
        cache = torch.randn(rows, length, dim, device=device).bfloat16()
        want_cache = cache.clone()
        slots, positions = torch.arange(rows, device=device), torch.randint(0, length, (rows,), device=device)
        q = attention.rope_qkv(q_in, kv, cos, sin, cache, slots, positions, 1e-6, kv_weight=kv_weight)
        want_q = ref.rope_qkv(q_in, kv, cos, sin, want_cache, slots, positions, 1e-6, kv_weight=kv_weight)
        err = rotated_rows_error(cache[slots, positions], want_cache[slots, positions])
        _require(err <= 1.0 and torch.equal(cache, want_cache.index_put((slots, positions), cache[slots, positions])),
                 f"rope_qkv T={rows}: the cache rows written are {err:.3g}x the rounding bound off, or another "
                 f"row changed")
        sink = torch.randn(heads, device=device)
        o = attention.mqa_attention(q, cache, slots, positions, sink, dim ** -0.5, cos, sin).float()
        want = ref.mqa_attention(want_q, want_cache, slots, positions, sink, dim ** -0.5, cos, sin).float()
        _require(bool(torch.isfinite(o).all()), f"non-finite attention output T={rows}")
        err = relative_error(o, want)
        _require(err < 1e-2, f"attention T={rows}: relative error {err:.2e}")
        worst = max(worst, err)
    return (f"rope_qkv (kv norm fused) + mqa_attention {heads} heads x {dim}, context {length}: cache rows as "
            f"rounded alike, worst relative error {worst:.1e}")


def check_gemm(device, quick) -> str:
    from fp8chain_kernel import gemm, quant

    n, k = (1792, 5120) if device.type == "cuda" else (128, 256)
    worst = 0.0
    for fmt, block in ((ActFormat.SM90_G32_FP32_MN, 32), (ActFormat.SM90_G128_FP32_MN, 128)):
        weight, scale = ref.random_fp8_weight(n, k, block, device, log2_scale=-8)
        for rows in _token_counts(quick):
            pair = quant.quantize(_random_rows(rows, k, device), fmt)
            out = gemm.fp8_gemm(pair, weight, scale, weight_block=block)
            want = ref.fp8_gemm(pair, weight, scale, block).double()
            _require(bool(torch.isfinite(out).all()), f"non-finite GEMM output {fmt.value} M={rows}")
            err = relative_error(out, want)
            _require(err < 5e-3, f"GEMM {fmt.value} M={rows}: relative error {err:.2e}")
            worst = max(worst, err)
        # a NaN or an infinity in a token: its output row is NaN (never finite), the others finite
        out = gemm.fp8_gemm(quant.quantize(_special_rows(5, k, device), fmt), weight, scale, weight_block=block)
        _require(bool(torch.isnan(out[2:4]).all() and torch.isfinite(out[[0, 1, 4]]).all()),
                 f"GEMM {fmt.value}: a NaN / inf token's row is not NaN, or another row is not finite")
    # the gate_up GEMM's SiLU*mul epilogue: the bytes of the GEMM followed by act.silu_mul
    from fp8chain_kernel import act

    fmt = ActFormat.SM90_G32_FP32_MN
    weight, scale = ref.random_fp8_weight(2 * n, k, 32, device, log2_scale=-8)
    for rows in _token_counts(quick):
        pair = quant.quantize(_random_rows(rows, k, device), fmt)
        y, h_pair = gemm.fp8_gemm_silu_mul(pair, weight, scale, weight_block=32, limit=10.0, out_format=fmt)
        want_y = act.silu_mul(gemm.fp8_gemm(pair, weight, scale, weight_block=32), limit=10.0)
        _require(torch.equal(y.view(torch.int16), want_y.view(torch.int16)), f"fp8_gemm_silu_mul bf16 M={rows}")
        _require(pairs_equal(h_pair, ref.quantize(y, fmt)), f"fp8_gemm_silu_mul pair M={rows}")
        # and the reference's (its fp64 gate_up rounded once to bf16, as the kernel's fp32 one is)
        err = relative_error(y, ref.fp8_gemm_silu_mul(pair, weight, scale, 32, limit=10.0))
        _require(err < 1e-2, f"fp8_gemm_silu_mul M={rows}: relative error {err:.2e} from the reference")
    return (f"fp8_gemm {n}x{k}, both Hopper formats, worst relative error {worst:.1e}, NaN / inf rows NaN; "
            f"fp8_gemm_silu_mul {2 * n}x{k} bitwise")


def check_router(device, quick) -> str:
    from fp8chain_kernel import router

    experts, hidden = (256, 5120) if device.type == "cuda" else (64, 256)
    weight = (torch.randn(experts, hidden, device=device) * 2 / hidden ** 0.5).bfloat16()
    bias = torch.randn(experts, device=device) * 0.1
    worst, untied = 0.0, 0
    for rows in _token_counts(quick):
        x = torch.randn(rows, hidden, device=device).bfloat16()
        idx, weights = router.router_topk(x, weight, bias, 6, 1.5)
        want_idx, want_weights = ref.router_topk(x, weight, bias, 6, 1.5)
        clear = ref.router_untied(ref.router_keys(x, weight, bias), 6, 1e-4)
        _require(torch.equal(idx[clear], want_idx[clear]), f"router T={rows}: another expert choice")
        _require(bool(torch.isfinite(weights).all()), f"router T={rows}: non-finite weights")
        err = (weights[clear].double() - want_weights[clear].double()).abs().max().item() if clear.any() else 0.0
        _require(err < 1e-5, f"router T={rows}: weights off by {err:.1e}")
        worst, untied = max(worst, err), untied + int(clear.sum())
    x = _special_rows(5, hidden, device)  # NaN in row 2, +-inf in row 3: their weights NaN
    weights = router.router_topk(x, weight, bias, 6, 1.5)[1]
    _require(bool(torch.isnan(weights[2:4]).all() and torch.isfinite(weights[[0, 1, 4]]).all()),
             "router: a NaN / inf token's weights are not NaN, or another token's are not finite")
    return (f"router_topk {experts} experts x {hidden}, top 6: the reference's choice on {untied} tokens without "
            f"a near tie, weights within {worst:.1e}, NaN / inf rows NaN")


CHECKS: dict[str, Check] = {
    "quantize": check_quantize,
    "producers": check_producers,
    "wo_a + mhc": check_wo_a_and_mhc,
    "attention": check_attention,
    "gemm": check_gemm,
    "router": check_router,
}


def run_checks(quick: bool = False) -> bool:
    """Run every check; print one line each; True when all pass."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"verifying on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (Triton interpreter)'}")
    all_ok = True
    for name, check in CHECKS.items():
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                # the interpreter evaluates in numpy, which warns where exp overflows to inf (SiLU of
                # a large negative gate), where inf * 0 gives NaN (an infinity's group, multiplier
                # 0) and where an infinite token's router logits meet (inf - inf, inf / inf, x / 0):
                # all by design, as on the GPU
                warnings.filterwarnings("ignore", "overflow encountered in exp", RuntimeWarning)
                warnings.filterwarnings("ignore", "invalid value encountered in (multiply|add|divide)", RuntimeWarning)
                warnings.filterwarnings("ignore", "divide by zero encountered in divide", RuntimeWarning)
                detail = check(device, quick)
            status = "ok  "
        except ImportError as exc:
            detail, status, all_ok = f"kernel module missing: {exc}", "FAIL", False
        except AssertionError as exc:
            detail, status, all_ok = f"mismatch: {exc}", "FAIL", False
        except Exception as exc:  # a launch, compile or input error: this check fails, the next still runs
            detail, status, all_ok = f"error: {type(exc).__name__}: {exc}", "FAIL", False
        print(f"[{status}] {name:10s} {detail} ({time.perf_counter() - start:.1f} s)")
    return all_ok
