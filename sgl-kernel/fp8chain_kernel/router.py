"""The MoE router in two launches: fp32 logits on the tensor cores, then scores, top-k and weights.

``router_topk(x, weight, bias, top_k, scaling, renormalize=True, *, out=None) -> (idx, weights)``

* ``x``: bf16 ``[T, H]`` tokens, unit column stride (any row stride); ``weight``: bf16 ``[E, H]``,
  the router, unit column stride; ``bias``: fp32 ``[E]``, added for the choice only;
  1 <= ``top_k`` <= min(E, ``MAX_TOP_K``), E <= ``MAX_EXPERTS``.
* ``idx`` int64 ``[T, top_k]`` (best first) and ``weights`` fp32 ``[T, top_k]``, as
  ``reference.router_topk``: ``logits = x @ weight.T`` in fp32, ``scores = sqrt(softplus(logits))``,
  the ``top_k`` largest ``scores + bias`` (NaN counts as +inf, ties go to the lower index), their
  unbiased scores renormalized to sum 1 (``renormalize``) and times ``scaling`` (a number finite
  in fp32, else ``ValueError``). A token with a NaN logit gets NaN weights; a chosen expert whose
  key is NaN (a NaN bias too) weighs NaN. ``out``: ``(idx, weights)`` buffers of those shapes to write.

Launch 1 (``_router_logits_kernel``): each program sums bf16 products in fp32 (``dot_bf16``) for a
``[BLOCK_E experts, BLOCK_T tokens]`` tile over one slice of H and stores the partial logits in a
workspace ``[SPLIT, T, E]``. At decode 16 x 16 tiles leave Flash's 256 experts 16 programs, so H is
split into up to 8 slices (about two programs per SM); from 65 tokens on 64 x 64 tiles, split into
SMs // tiles slices (about one program per SM): only while the tiles number at most half the SMs.
Launch 2 (``_router_topk_kernel``): per token, the slices' partials summed in slice order
(the split depends on T alone, so the bits do too), the scores, ``top_k`` rounds of arg-max over
all experts (one tile: E <= ``MAX_EXPERTS``), the weights. Logits and scores differ from torch's
in the last bits (summation order; ``exp``/``log``), so the reference is matched to a tolerance and
the choice wherever the keys it compares are not within that tolerance of a tie.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import check_disjoint, check_no_overlap, is_int
from .fp8_tile import dot_bf16, interpreting
from .launch import H200_SMS, await_producer, pdl_options, sm_count
from .norm import check_finite, check_rows, check_tensor

__all__ = ["MAX_EXPERTS", "MAX_TOP_K", "router_topk"]

MAX_EXPERTS = 1024  # launch 2 holds a token's every score in one tile
MAX_TOP_K = 32
MAX_SPLIT = 8
BLOCK_K = 128


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, part_ptr, T, E, H, stride_xm, stride_we, stride_part,
                          SLICE_ITERS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_K: tl.constexpr, EXACT_CAST: tl.constexpr, PDL: tl.constexpr):
    await_producer(PDL)
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    part = tl.program_id(2)
    e_ok, t_ok = offs_e < E, offs_t < T
    w_rows = w_ptr + offs_e.to(tl.int64)[:, None] * stride_we
    x_cols = x_ptr + offs_t.to(tl.int64)[None, :] * stride_xm
    acc = tl.zeros([BLOCK_E, BLOCK_T], tl.float32)
    first_k = part * (SLICE_ITERS * BLOCK_K)
    for it in range(SLICE_ITERS):  # a constant trip count (the interpreter needs one)
        offs_k = first_k + it * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        w = tl.load(w_rows + offs_k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_cols + offs_k[:, None], mask=k_ok[:, None] & t_ok[None, :], other=0.0)
        acc = dot_bf16(w, x, acc, EXACT_CAST)
    out = part_ptr + part * stride_part + offs_t.to(tl.int64)[None, :] * E + offs_e[:, None]
    tl.store(out, acc, mask=e_ok[:, None] & t_ok[None, :])


@triton.jit
def _sqrt_softplus(logits):
    """``sqrt(softplus(l))``, softplus as torch's: ``l`` above 20, else ``log1p(exp(l))`` (log1p
    from ``log`` with its rounding corrected, so tiny ``exp(l)`` keep their value); NaN stays."""
    u = tl.exp(logits)
    v = 1.0 + u
    log1p = tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))
    return tl.sqrt_rn(tl.where(logits > 20.0, logits, log1p))


@triton.jit
def _router_topk_kernel(part_ptr, bias_ptr, idx_ptr, wt_ptr, T, E, stride_part, scaling, stride_im, stride_wm,
                        SPLIT: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    await_producer(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    t_ok, e_ok = offs_t < T, offs_e < E
    mask = t_ok[:, None] & e_ok[None, :]
    parts = part_ptr + offs_t.to(tl.int64)[:, None] * E + offs_e[None, :]
    logits = tl.load(parts, mask=mask, other=0.0)
    for part in range(1, SPLIT):  # in slice order: the bits do not depend on which slice ran first
        logits += tl.load(parts + part * stride_part, mask=mask, other=0.0)
    scores = _sqrt_softplus(logits)
    key = scores + tl.load(bias_ptr + offs_e, mask=e_ok, other=0.0)[None, :]
    # a NaN key (score or bias) is chosen first and weighs NaN: a NaN bias must not route every
    # token to its expert with finite weights
    scores = tl.where(key != key, float("nan"), scores)
    key = tl.where(key != key, float("inf"), key)
    taken = (offs_t[:, None] < 0) | ~e_ok[None, :]  # padding experts are never chosen
    cols = tl.arange(0, K_PAD)[None, :]
    chosen = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    weights = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), key), axis=1)
        pick = tl.min(tl.where((key == best[:, None]) & ~taken, offs_e[None, :], BLOCK_E), axis=1)
        hit = offs_e[None, :] == pick[:, None]
        chosen = tl.where(cols == j, pick[:, None], chosen)
        weights = tl.where(cols == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], weights)
        taken = taken | hit
    if RENORMALIZE:
        total = tl.maximum(tl.sum(weights, axis=1), 1e-20, propagate_nan=tl.PropagateNan.ALL)
        weights = tl.math.div_rn(weights, total[:, None])
    out_mask = t_ok[:, None] & (cols < TOP_K)
    rows = offs_t.to(tl.int64)[:, None]
    tl.store(idx_ptr + rows * stride_im + cols, chosen.to(tl.int64), mask=out_mask)
    tl.store(wt_ptr + rows * stride_wm + cols, weights * scaling, mask=out_mask)


def _check_out(out, tokens: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(f"out must be a pair (idx, weights), got {type(out).__name__}")
    check_rows(out[0], "out idx", (tokens, top_k), device, torch.int64)
    check_rows(out[1], "out weights", (tokens, top_k), device, torch.float32)
    return out[0], out[1]


def _logits_tiles(tokens: int, experts: int, hidden: int, device) -> tuple[int, int, int, int]:
    """(BLOCK_E, BLOCK_T, split, K iterations per slice) of launch 1 for this problem: H split
    until there are about two programs per SM with 16 x 16 tiles, one with 64 x 64 tiles (H200,
    E = 256, H = 5120: split 4 against 2 at T = 64, 7.6 against 9.7 us; split 2 against 1 at T =
    2048, 22.0 against 19.0 us; docs/benchmarks.md, the router)."""
    block = 16 if tokens <= 64 else 64
    tiles = triton.cdiv(experts, block) * triton.cdiv(tokens, block)
    iters = triton.cdiv(hidden, BLOCK_K)
    programs = sm_count(device, interpreter=H200_SMS) * (2 if block == 16 else 1)
    split = max(1, min(MAX_SPLIT, iters, programs // tiles))
    slice_iters = triton.cdiv(iters, split)
    return block, block, triton.cdiv(iters, slice_iters), slice_iters


def _topk_tiles(experts: int) -> tuple[int, int, int]:
    """(tokens per program, BLOCK_E, warps) of launch 2: one token per program and one warp per 256
    experts, so the ``top_k`` rounds of reductions stay within a warp (H200, E = 256: 5.8 against
    7.5 us at T = 1 with four tokens and four warps, 19.0 against 21.4 at T = 2048)."""
    block_all = max(16, triton.next_power_of_2(experts))
    return 1, block_all, max(1, block_all // 256)


def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                renormalize: bool = True, *, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` experts of each token of ``x`` and their weights; see the module docstring."""
    check_tensor(x, "x", torch.bfloat16, 2)
    check_tensor(weight, "weight", torch.bfloat16, 2)
    check_tensor(bias, "bias", torch.float32, 1)
    tokens, hidden = x.shape
    experts = weight.shape[0]
    if weight.shape[1] != hidden or hidden == 0:
        raise ValueError(f"weight must be [E, H] with H = x's {hidden} > 0, got {tuple(weight.shape)}")
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"the router runs 1 to {MAX_EXPERTS} experts, got E = {experts}")
    if tuple(bias.shape) != (experts,):
        raise ValueError(f"bias must have shape ({experts},), got {tuple(bias.shape)}")
    for t, name in ((x, "x"), (weight, "weight")):
        if t.numel() and t.stride(1) != 1:
            raise ValueError(f"{name} must have unit column stride, got strides {t.stride()}")
    if bias.stride(0) != 1:
        raise ValueError(f"bias must be contiguous, got stride {bias.stride()}")
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if not is_int(top_k) or not 1 <= top_k <= min(experts, MAX_TOP_K):
        raise ValueError(f"top_k must be an int in 1..{min(experts, MAX_TOP_K)}, got {top_k!r}")
    check_finite(scaling, "scaling")
    if out is None:
        idx = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
        weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    else:
        idx, weights = _check_out(out, tokens, top_k, x.device)
        check_no_overlap([("out idx", idx), ("out weights", weights)],
                         [("x", x), ("weight", weight), ("bias", bias)])
        check_disjoint([("out idx", idx), ("out weights", weights)])
    if tokens == 0:
        return idx, weights
    block_e, block_t, split, slice_iters = _logits_tiles(tokens, experts, hidden, x.device)
    partials = torch.empty(split, tokens, experts, dtype=torch.float32, device=x.device)
    _router_logits_kernel[(triton.cdiv(experts, block_e), triton.cdiv(tokens, block_t), split)](
        x, weight, partials, tokens, experts, hidden, x.stride(0), weight.stride(0), partials.stride(0),
        SLICE_ITERS=slice_iters, BLOCK_E=block_e, BLOCK_T=block_t, BLOCK_K=BLOCK_K, EXACT_CAST=interpreting(),
        num_warps=2 if block_e == 16 else 4, num_stages=4, **pdl_options(x.device),
    )
    rows, block_all, warps = _topk_tiles(experts)
    _router_topk_kernel[(triton.cdiv(tokens, rows),)](
        partials, bias, idx, weights, tokens, experts, partials.stride(0), float(scaling), idx.stride(0),
        weights.stride(0), SPLIT=split, TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)),
        RENORMALIZE=bool(renormalize), BLOCK_T=rows, BLOCK_E=block_all, num_warps=warps, **pdl_options(x.device),
    )
    return idx, weights
