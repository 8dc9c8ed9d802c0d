"""Reference for fp8chain_kernel.attention: multi-query attention over a slotted KV cache."""

from __future__ import annotations

import torch

__all__ = ["mqa_attention", "attention_with_sinks"]


def mqa_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                  sink: torch.Tensor, scale: float) -> torch.Tensor:
    """One latent head shared by every query head (keys = values), per-head attention sinks.

    ``q [T, nh, D]`` fp32, ``kv_cache [S, L, D]`` bf16, ``slots``/``positions [T]`` int ->
    ``o [T, nh, D]`` fp32: token ``t`` attends to ``kv_cache[slots[t], :positions[t] + 1]`` with
    ``softmax([q.k * scale, sink]) @ [keys, 0]`` (the sink takes probability mass, adds no value).
    """
    keys = kv_cache[slots].float()
    valid = torch.arange(keys.shape[1], device=q.device)[None, :] <= positions[:, None]
    return attention_with_sinks(q.float(), keys, valid, sink, scale)


def attention_with_sinks(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """``q [T, nh, D]``, ``keys [T, L, D]`` (keys = values), ``valid [T, L]`` bool, ``sink [nh]``
    -> ``o [T, nh, D]``: ``softmax([q.k * scale, sink]) @ [keys, 0]``, fp32."""
    scores = torch.einsum("thd,tld->thl", q, keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sink.float().view(1, -1, 1)
    peak = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    probs = torch.exp(scores - peak)
    denom = probs.sum(dim=-1, keepdim=True) + torch.exp(sink - peak)
    return torch.einsum("thl,tld->thd", probs, keys) / denom
