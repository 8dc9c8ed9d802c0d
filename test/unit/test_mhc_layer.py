"""The mHC layer glue (``fp8chain.layers.mhc``): the settings it hands the kernels (eps, Sinkhorn
iterations, the next norm's eps), the stats' side stream and where it is joined, the initial
residual streams. The kernels themselves are tested in test/kernels/test_mhc.py."""

import contextlib
import types

import pytest
import torch

from fp8chain.layers import mhc
from fp8chain.layers.mhc import HyperConnection, at_start, expand_streams
from fp8chain.layers.norm import RMSNorm
from fp8chain_kernel import mhc as mhc_kernels

pytestmark = pytest.mark.cpu


def _hyper_connection(h=64, **kwargs):
    hc = HyperConnection(h, hc_mult=4, **kwargs)
    with torch.no_grad():
        hc.fn.copy_(torch.randn_like(hc.fn) / (4 * h) ** 0.5)
        hc.scale.copy_(torch.rand(3) + 0.5)
        hc.base.copy_(torch.randn(hc.mix) * 0.5)
    return hc


def test_hyper_connection_stats_use_its_own_eps_and_sinkhorn_iterations():
    """``HyperConnection.stats`` passes its rms_eps, hc_eps and sinkhorn_iters to the stats launch."""
    hc = _hyper_connection(rms_eps=0.5, hc_eps=1e-3, sinkhorn_iters=2)
    residual = (torch.randn(3, 4, 64) * 0.3).bfloat16()
    params = (residual, hc.fn, hc.scale, hc.base)
    want = mhc_kernels.mhc_stats(*params, rms_eps=0.5, hc_eps=1e-3, sinkhorn_iters=2)
    got = hc.stats(residual)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for other in (dict(rms_eps=1e-3, hc_eps=0.5, sinkhorn_iters=2), dict(rms_eps=0.5, hc_eps=1e-3)):
        assert not all(torch.equal(a, b) for a, b in zip(got, mhc_kernels.mhc_stats(*params, **other))), other


def test_stats_on_a_side_stream_equal_the_stats_in_line(monkeypatch):
    """Stats launched on a side stream return the same (pre, post, comb) bits, in that order, as in
    line (CPU stand-in: the stream switch is a no-op)."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    side = types.SimpleNamespace(wait_stream=lambda stream: None)
    hc = _hyper_connection(sinkhorn_iters=3)
    residual = torch.randn(3, 4, 64).bfloat16()
    in_line, beside = hc.stats(residual), hc.stats(residual, side_stream=side)
    assert [tuple(t.shape) for t in beside] == [(3, 4), (3, 4), (3, 4, 4)]
    assert all(torch.equal(a, b) for a, b in zip(beside, in_line))


def test_run_sublayer_without_overlap_keeps_the_stats_in_line(monkeypatch):
    """``overlap_stats=False`` runs the stats on the current stream (no side stream, nothing to join);
    with it they go to ``stats_stream`` and are joined; the outputs are the same bits either way."""
    side, joined, used = object(), [], []
    monkeypatch.setattr(mhc, "stats_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(wait_stream=joined.append))
    hc, norm = _hyper_connection(sinkhorn_iters=3), RMSNorm(64)
    real = hc.stats
    monkeypatch.setattr(hc, "stats", lambda residual, side_stream: (used.append(side_stream), real(residual))[1])
    residual, y = torch.randn(2, 4, 64).bfloat16(), torch.randn(2, 64).bfloat16()
    in_line = mhc.run_sublayer(hc, mhc.at_start(lambda: y), residual, norm, overlap_stats=False)
    assert used == [None] and joined == []
    overlapped = mhc.run_sublayer(hc, mhc.at_start(lambda: y), residual, norm, overlap_stats=True)
    assert used == [None, side] and joined == [side]
    assert all(torch.equal(a, b) for a, b in zip(in_line[:2], overlapped[:2]))


def test_no_side_stream_under_the_interpreter(monkeypatch):
    """Under the Triton interpreter a CUDA device gets no side stream (its launches are synchronous)."""
    monkeypatch.setattr(mhc, "interpreting", lambda: True)
    assert mhc.stats_stream(torch.device("cuda", 0)) is None
    assert mhc.stats_stream("cpu") is None


def test_boundary_normalizes_with_the_next_norms_eps():
    """``mhc_boundary`` applies the next RMSNorm's own eps (and weight), as the fused launch given them."""
    hc = _hyper_connection(sinkhorn_iters=3)
    residual = (torch.randn(3, 4, 64) * 0.05).bfloat16()  # small RMS: eps 0.5 changes x
    y = (torch.randn(3, 64) * 0.05).bfloat16()
    norm = RMSNorm(64, 0.5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    stats = hc.stats(residual)
    new_residual, x, pair = mhc.mhc_boundary(y, residual, stats, norm)
    want = mhc_kernels.mhc_mega_boundary(y, residual, *stats, norm.weight, 0.5)
    assert pair is None and torch.equal(new_residual, want[0]) and torch.equal(x, want[1])
    assert not torch.equal(x, mhc_kernels.mhc_mega_boundary(y, residual, *stats, norm.weight, 1e-6)[1])


def test_at_start_forks_the_stats_before_the_sublayer_runs():
    """``at_start`` forks the stats first, so they can overlap the whole sublayer."""
    order = []
    assert at_start(lambda: order.append("sublayer") or "y")(lambda: order.append("fork")) == "y"
    assert order == ["fork", "sublayer"]


def test_expand_streams_copies_the_embedding_into_independent_streams():
    """The initial residual holds hc contiguous copies of the embedding: writing one stream (an
    in-place consumer) changes neither the others nor the embedding."""
    hidden = torch.randn(3, 64).bfloat16()
    residual = expand_streams(hidden, 4)
    assert residual.shape == (3, 4, 64) and residual.is_contiguous()
    assert all(torch.equal(residual[:, s], hidden) for s in range(4))
    residual[:, 0] += 1
    assert torch.equal(residual[:, 1], hidden) and not torch.equal(residual[:, 0], hidden)


def test_run_sublayer_requires_exactly_one_stats_fork():
    hc, norm = HyperConnection(64, hc_mult=4, sinkhorn_iters=3), RMSNorm(64)
    residual, y = torch.randn(2, 4, 64).bfloat16(), torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="never forked"):
        mhc.run_sublayer(hc, lambda fork: y, residual, norm)
    with pytest.raises(RuntimeError, match="twice"):
        mhc.run_sublayer(hc, lambda fork: (fork(), fork(), y)[-1], residual, norm)
    new_residual, x, pair = mhc.run_sublayer(hc, lambda fork: (fork(), y)[-1], residual, norm)
    assert new_residual.shape == residual.shape and x.shape == y.shape and pair is None


def test_run_sublayer_joins_the_stats_stream_when_the_sublayer_raises(monkeypatch):
    """A sublayer that fails after forking its stats, or stats that fail once forked, still leave
    the current stream waiting on the side stream (no unjoined stream in a capture, no race with
    later work); a sublayer that fails before forking has nothing to join."""
    side, joined = object(), []
    monkeypatch.setattr(mhc, "stats_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(wait_stream=joined.append))
    hc, norm = HyperConnection(64, hc_mult=4, sinkhorn_iters=3), RMSNorm(64)
    monkeypatch.setattr(hc, "stats", lambda residual, side_stream: mhc.MHCStats(None, None, None))
    residual = torch.randn(2, 4, 64).bfloat16()

    def failing_sublayer(fork_first: bool):
        def run(fork):
            if fork_first:
                fork()
            raise ValueError("sublayer failed")
        return run

    with pytest.raises(ValueError, match="sublayer failed"):
        mhc.run_sublayer(hc, failing_sublayer(fork_first=True), residual, norm)
    assert joined == [side]
    with pytest.raises(ValueError, match="sublayer failed"):
        mhc.run_sublayer(hc, failing_sublayer(fork_first=False), residual, norm)
    assert joined == [side]

    def stats_failing_on_the_side_stream(residual, side_stream):  # e.g. out of memory for its partials
        raise RuntimeError("stats launch failed")

    monkeypatch.setattr(hc, "stats", stats_failing_on_the_side_stream)
    with pytest.raises(RuntimeError, match="stats launch failed"):
        mhc.run_sublayer(hc, lambda fork: (fork(), None)[-1], residual, norm)
    assert joined == [side, side]  # the side stream may have waited on this one: joined all the same
