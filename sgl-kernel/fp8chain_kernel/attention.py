"""Multi-query attention over a slotted KV cache, split over the key length (flash-decoding).

``mqa_attention(q, kv_cache, slots, positions, sink, scale, *, out=None) -> o``

* ``q``: fp32 ``[T, nh, D]`` (normed and roped queries), unit last stride;
* ``kv_cache``: bf16 ``[S, L, D]`` contiguous: one latent head, keys = values;
* ``slots``, ``positions``: int ``[T]``: token ``t`` attends to ``kv_cache[slots[t], 0..positions[t]]``;
* ``sink``: fp32 ``[nh]`` per-head attention sinks (probability mass, no value);
* ``o``: fp32 ``[T, nh, D]``.

Launch 1 spreads (token, head block, key split) over the GPU, each program an online softmax
over its share of the keys, fp32 throughout (IEEE dots); launch 2 merges the splits and the sink.
Equals ``reference.mqa_attention`` up to fp32 summation order. Decode and prefill alike: each
token reads only its own slot's keys up to its own position, straight from the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["mqa_attention"]

_BLOCK_H = 16  # heads per program (tl.dot needs >= 16 rows; fewer heads are masked)
_BLOCK_L = 16  # keys per step
_TARGET_PROGRAMS = 264  # ~2 waves on 132 SMs
_MIN_STEPS_PER_SPLIT = 4  # a split reads >= 64 keys: fewer, larger fp32 partials to merge


@triton.jit
def _mqa_split_kernel(q_ptr, kv_ptr, slot_ptr, pos_ptr, part_o_ptr, part_ml_ptr, NH, D, L, scale,
                      stride_qt, stride_qh, stride_ks, stride_kl,
                      SPLITS: tl.constexpr, STEPS: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < NH
    d_ok = offs_d < D
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    last = tl.load(pos_ptr + t)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    start = split * (STEPS * BLOCK_L)
    for step in range(STEPS):
        offs_l = start + step * BLOCK_L + tl.arange(0, BLOCK_L)
        l_ok = (offs_l <= last) & (offs_l < L)
        k = tl.load(kv_ptr + slot * stride_ks + offs_l[:, None].to(tl.int64) * stride_kl + offs_d[None, :],
                    mask=l_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(l_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # rows with no valid key yet keep m = -inf: use 0 as the shift so exp() stays 0, not NaN
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, k, input_precision="ieee")
        m_i = m_new
    base = (t * SPLITS + split).to(tl.int64) * NH
    tl.store(part_o_ptr + (base + offs_h[:, None]) * D + offs_d[None, :], acc,
             mask=h_ok[:, None] & d_ok[None, :])
    tl.store(part_ml_ptr + (base + offs_h) * 2, m_i, mask=h_ok)
    tl.store(part_ml_ptr + (base + offs_h) * 2 + 1, l_i, mask=h_ok)


@triton.jit
def _mqa_merge_kernel(part_o_ptr, part_ml_ptr, sink_ptr, o_ptr, NH, D, stride_ot, stride_oh,
                      SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < NH
    mask = h_ok[:, None] & (offs_d[None, :] < D)
    peak = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
    for split in range(SPLITS):
        base = (t * SPLITS + split).to(tl.int64) * NH
        peak = tl.maximum(peak, tl.load(part_ml_ptr + (base + offs_h) * 2, mask=h_ok, other=float("-inf")))
    denom = tl.exp(tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0) - peak)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for split in range(SPLITS):
        base = (t * SPLITS + split).to(tl.int64) * NH
        m_s = tl.load(part_ml_ptr + (base + offs_h) * 2, mask=h_ok, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + (base + offs_h) * 2 + 1, mask=h_ok, other=0.0)
        weight = tl.exp(m_s - peak)  # 0 for a split that saw no key (m_s = -inf)
        denom += l_s * weight
        acc += tl.load(part_o_ptr + (base + offs_h[:, None]) * D + offs_d[None, :], mask=mask,
                       other=0.0) * weight[:, None]
    tl.store(o_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             acc / denom[:, None], mask=mask)


def _splits(tokens: int, head_blocks: int, key_steps: int) -> int:
    """Key splits per (token, head block): enough programs for ~2 waves, each split at least
    ``_MIN_STEPS_PER_SPLIT`` steps of keys (partials cost a write and a read each)."""
    most = max(1, key_steps // _MIN_STEPS_PER_SPLIT)
    return max(1, min(most, triton.cdiv(_TARGET_PROGRAMS, max(1, tokens * head_blocks))))


def mqa_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                  sink: torch.Tensor, scale: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring for shapes, dtypes and numerics."""
    if q.dtype != torch.float32 or q.dim() != 3 or (q.numel() and q.stride(2) != 1):
        raise TypeError(f"q must be float32 [T, nh, D] with unit last stride, got {q.dtype} "
                        f"{tuple(q.shape)} strides {q.stride()}")
    tokens, heads, dim = q.shape
    if kv_cache.dtype != torch.bfloat16 or kv_cache.dim() != 3 or kv_cache.shape[2] != dim:
        raise TypeError(f"kv_cache must be bfloat16 [S, L, {dim}], got {kv_cache.dtype} {tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    for name, idx in (("slots", slots), ("positions", positions)):
        if idx.dtype not in (torch.int32, torch.int64) or tuple(idx.shape) != (tokens,):
            raise TypeError(f"{name} must be an int32/int64 [{tokens}] tensor, got {idx.dtype} {tuple(idx.shape)}")
    if sink.dtype != torch.float32 or tuple(sink.shape) != (heads,):
        raise TypeError(f"sink must be float32 [{heads}], got {sink.dtype} {tuple(sink.shape)}")
    if len({t.device for t in (q, kv_cache, slots, positions, sink)}) != 1:
        raise ValueError("q, kv_cache, slots, positions and sink must be on one device")
    if out is None:
        out = torch.empty_like(q)
    elif out.dtype != torch.float32 or out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be float32 {tuple(q.shape)} with unit last stride")
    if tokens == 0 or heads == 0:
        return out
    length = kv_cache.shape[1]
    head_blocks = triton.cdiv(heads, _BLOCK_H)
    key_steps = triton.cdiv(length, _BLOCK_L)
    splits = _splits(tokens, head_blocks, key_steps)
    steps = triton.cdiv(key_steps, splits)
    block_d = triton.next_power_of_2(dim)
    part_o = torch.empty((tokens, splits, heads, dim), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((tokens, splits, heads, 2), dtype=torch.float32, device=q.device)
    warps = 8 if block_d >= 512 else 4
    _mqa_split_kernel[(tokens, head_blocks, splits)](
        q, kv_cache, slots, positions, part_o, part_ml, heads, dim, length, float(scale),
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        SPLITS=splits, STEPS=steps, BLOCK_H=_BLOCK_H, BLOCK_L=_BLOCK_L, BLOCK_D=block_d, num_warps=warps,
    )
    _mqa_merge_kernel[(tokens, head_blocks)](
        part_o, part_ml, sink, out, heads, dim, out.stride(0), out.stride(1),
        SPLITS=splits, BLOCK_H=_BLOCK_H, BLOCK_D=block_d, num_warps=warps,
    )
    return out
