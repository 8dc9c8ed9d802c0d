"""Reference for fp8chain_kernel.attention: RoPE'd multi-query attention over a slotted KV cache.

DSv4.1 attention keeps one ``D``-wide latent head (keys = values) shared by every query head;
RoPE acts on the last ``rd`` dims as interleaved pairs ``(x[2i], x[2i+1])``, and the output's
last ``rd`` dims are rotated back (inverse RoPE) before ``wo_a``.
"""

from __future__ import annotations

import torch

from .norm import rms_norm, rms_rsqrt

__all__ = ["rope_cos_sin", "apply_rope", "rope_tables", "check_cache_indices", "rope_qkv", "mqa_attention",
           "attention_with_sinks"]


def rope_cos_sin(positions: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, sin)`` ``[T, rope_dim/2]`` for integer ``positions [T]`` (angles in fp64)."""
    inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=positions.device)
                         / rope_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return torch.cos(angles).float(), torch.sin(angles).float()


def rope_tables(length: int, rope_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_cos_sin`` of positions ``0..length-1``: row ``p`` is position ``p``'s values."""
    return rope_cos_sin(torch.arange(length, device=device), rope_dim, theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` of fp32 ``x [T, ..., R]`` by the angle of
    each row's position (``inverse``: by minus it)."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def _rope_last(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    rd = 2 * cos.shape[-1]
    d = x.shape[-1]
    return torch.cat([x[..., :d - rd], apply_rope(x[..., d - rd:], cos, sin, inverse)], dim=-1)


def check_cache_indices(kv_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                        writes: bool = False) -> None:
    """``IndexError`` for a slot outside ``[0, S)`` or a position outside ``[0, L)`` of ``kv_cache
    [S, L, D]`` (torch indexing would wrap a negative one around), and with ``writes`` for two
    tokens at one (slot, position). Skipped inside ``torch.compile`` and CUDA-graph capture, which
    forbid the host read it takes."""
    if torch.compiler.is_compiling() or (kv_cache.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    num_slots, length = kv_cache.shape[:2]
    for name, t, bound in (("slots", slots, num_slots), ("positions", positions, length)):
        if t.numel() and ((t < 0) | (t >= bound)).any():
            raise IndexError(f"{name} must be in [0, {bound}), got values in [{t.min().item()}, {t.max().item()}]")
    if writes and torch.unique(slots.long() * length + positions.long()).numel() < slots.numel():
        raise IndexError("two tokens write one (slot, position) of the KV cache")


def rope_qkv(q: torch.Tensor, kv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
             kv_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, eps: float, *,
             kv_weight: torch.Tensor | None = None) -> torch.Tensor:
    """``q [T, nh*D]`` bf16 (wq_b's output) -> bf16 ``[T, nh, D]``: per-head RMS-normalized (no
    weight), RoPE on the last ``rd`` dims, in fp32, rounded once. ``kv [T, D]`` bf16 (normed latent,
    or the raw latent normed here by ``rms_norm(kv, kv_weight, eps)``) gets the same RoPE and is
    written to ``kv_cache[slots[t], positions[t]]`` in bf16 (``check_cache_indices``)."""
    check_cache_indices(kv_cache, slots, positions, writes=True)
    if kv_weight is not None:
        kv = rms_norm(kv, kv_weight, eps)
    t, d = kv.shape
    cos, sin = cos_table[positions], sin_table[positions]
    q = q.float().view(t, q.shape[1] // d, d)  # explicit heads: T = 0 too
    q = q * rms_rsqrt(q, eps)
    kv_cache[slots, positions] = _rope_last(kv.float(), cos, sin).to(kv_cache.dtype)
    return _rope_last(q, cos, sin).to(torch.bfloat16)


def attention_with_sinks(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """``q [T, nh, D]``, ``keys [T, L, D]`` (keys = values), ``valid [T, L]`` bool, ``sink [nh]``
    -> ``o [T, nh, D]``: ``softmax([q.k * scale, sink]) @ [keys, 0]``, fp32. The two products
    run in the dtype of ``q`` and ``keys`` (fp32: the specification; bf16: tensor-core products with
    bf16 results, the softmax in fp32 and its probabilities rounded to bf16). Keys outside ``valid``
    are not read: a NaN left in a reused cache row would otherwise reach the token as 0 * NaN."""
    keys = keys.masked_fill(~valid[:, :, None], 0)
    scores = torch.einsum("thd,tld->thl", q, keys).float() * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sink.float().view(1, -1, 1)
    peak = torch.cat((scores, sink.expand(*scores.shape[:2], 1)), dim=-1).amax(dim=-1, keepdim=True)  # L = 0 too
    probs = torch.exp(scores - peak)
    denom = probs.sum(dim=-1, keepdim=True) + torch.exp(sink - peak)
    return torch.einsum("thl,tld->thd", probs.to(keys.dtype), keys).float() / denom


def mqa_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                  sink: torch.Tensor, scale: float, cos_table: torch.Tensor, sin_table: torch.Tensor, *,
                  matmul_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [T, nh, D]`` bf16, ``kv_cache [S, L, D]`` bf16 -> bf16 ``[T, nh, D]``: token ``t``
    attends to ``kv_cache[slots[t], :positions[t] + 1]`` (``attention_with_sinks``, its products in
    ``matmul_dtype``: fp32 is the specification, bf16 what a plain-torch serving implementation
    runs, the benchmarks' compiled peer), then the last ``rd`` dims are rotated back by the
    token's angle (inverse RoPE). Indices as ``check_cache_indices`` checks them."""
    check_cache_indices(kv_cache, slots, positions)
    keys = kv_cache[slots].to(matmul_dtype)
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] <= positions[:, None]
    o = attention_with_sinks(q.to(matmul_dtype), keys, valid, sink, scale)
    return _rope_last(o, cos_table[positions], sin_table[positions], inverse=True).to(torch.bfloat16)
