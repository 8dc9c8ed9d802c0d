"""MQA over a slotted KV cache (split-key kernel) vs the torch reference."""

import pytest
import torch
import triton

from fp8chain_kernel import reference as ref
from fp8chain_kernel.attention import _splits, mqa_attention


def _problem(tokens, heads, dim, length, slots_count, device, positions=None):
    q = torch.randn(tokens, heads, dim, device=device)
    q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True))  # normed queries, as the model feeds them
    kv_cache = torch.randn(slots_count, length, dim, device=device).bfloat16()
    slots = torch.randint(0, slots_count, (tokens,), device=device)
    if positions is None:
        positions = torch.randint(0, length, (tokens,), device=device)
    sink = torch.randn(heads, device=device)
    return q, kv_cache, slots, positions, sink, dim ** -0.5


def _check(problem):
    q = problem[0]
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    got = mqa_attention(*problem, out=out)
    want = ref.mqa_attention(*problem)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got).all()
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 2e-5, f"relative error {err:.2e}"


@pytest.mark.cpu
@pytest.mark.parametrize("tokens,heads,dim,length", [(1, 2, 128, 16), (3, 17, 96, 160), (5, 16, 128, 50)])
def test_matches_reference_cpu(tokens, heads, dim, length):
    _check(_problem(tokens, heads, dim, length, 3, "cpu"))


@pytest.mark.cpu
def test_key_splits_are_merged():
    """A shape whose keys are split over several programs (merge path, empty splits included)."""
    assert _splits(1, 1, triton.cdiv(256, 16)) > 1
    positions = torch.tensor([3, 255])  # the first token's later splits see no key at all
    _check(_problem(2, 4, 128, 256, 2, "cpu", positions=positions))


@pytest.mark.cpu
def test_prefill_positions_and_first_token():
    """Causal prefill of one slot (positions 0..T-1, position 0 sees one key) and the sink."""
    tokens = 7
    problem = list(_problem(tokens, 4, 128, 128, 1, "cpu", positions=torch.arange(tokens)))
    _check(tuple(problem))
    problem[4] = torch.full((4,), 30.0)  # a sink that takes almost all the mass
    _check(tuple(problem))


@pytest.mark.cpu
def test_zero_tokens_and_bad_input():
    q, kv_cache, slots, positions, sink, scale = _problem(0, 4, 128, 16, 2, "cpu")
    assert mqa_attention(q, kv_cache, slots, positions, sink, scale).shape == (0, 4, 128)
    q, kv_cache, slots, positions, sink, scale = _problem(2, 4, 128, 16, 2, "cpu")
    with pytest.raises(TypeError, match="q must be float32"):
        mqa_attention(q.bfloat16(), kv_cache, slots, positions, sink, scale)
    with pytest.raises(TypeError, match="kv_cache must be bfloat16"):
        mqa_attention(q, kv_cache.float(), slots, positions, sink, scale)
    with pytest.raises(TypeError, match="slots"):
        mqa_attention(q, kv_cache, slots.float(), positions, sink, scale)
    with pytest.raises(TypeError, match="sink"):
        mqa_attention(q, kv_cache, slots, positions, sink[:2], scale)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 4, 64, 256])
@pytest.mark.parametrize("heads", [64, 16])
def test_matches_reference_gpu(tokens, heads):
    _check(_problem(tokens, heads, 512, 1024, max(tokens, 1), "cuda"))
