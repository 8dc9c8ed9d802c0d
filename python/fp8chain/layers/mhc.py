"""mHC (manifold-constrained hyper-connections) modules, in DSv4.1's shifted ordering.

The residual is ``R [T, hc, H]`` bf16 (``hc`` = 4 streams). Each sublayer ``s`` owns
``fn [(2+hc)*hc, hc*H]``, ``scale [3]`` and ``base [(2+hc)*hc]`` (all fp32). A sublayer entering
with ``(R, p_prev)`` runs on ``x_s = RMSNorm(sum_k p_prev[k] R[k])``; its own stats
``(pre_s, post_s, comb_s)`` come from the ``R`` entering it; the boundary after it writes
``R' = post_s * y_s + comb_s^T R`` and the next sublayer's input
``x = RMSNorm(sum_k pre_s[k] R'[k])`` in one ``mhc_mega_boundary`` launch, which may also write
the FP8 pair of ``x`` for the next linear (numerics: ``fp8chain_kernel.reference.mhc``).
"""

from __future__ import annotations

import torch
from torch import nn

from fp8chain_kernel import mhc as mhc_kernels
from fp8chain_kernel.formats import QuantizedActivation
from fp8chain_kernel.fp8_tile import interpreting

from .norm import RMSNorm

__all__ = ["HyperConnection", "MHCStats", "at_start", "mhc_boundary", "run_sublayer", "stats_stream",
           "expand_streams"]


class MHCStats(tuple):
    """``(pre [T, hc], post [T, hc], comb [T, hc, hc])`` of one sublayer, fp32."""

    __slots__ = ()

    def __new__(cls, pre, post, comb):
        return super().__new__(cls, (pre, post, comb))

    def __getnewargs__(self):  # copy and pickle call __new__ with these
        return tuple(self)

    @property
    def pre(self):
        return self[0]

    @property
    def post(self):
        return self[1]

    @property
    def comb(self):
        return self[2]


class HyperConnection(nn.Module):
    """One sublayer's mHC parameters and its stats launch."""

    def __init__(self, hidden_size: int, hc_mult: int = 4, *, rms_eps: float = 1e-6,
                 hc_eps: float = 1e-6, sinkhorn_iters: int = 20):
        super().__init__()
        self.hidden_size = hidden_size
        self.hc_mult = hc_mult
        self.mix = (2 + hc_mult) * hc_mult
        self.rms_eps = rms_eps
        self.hc_eps = hc_eps
        self.sinkhorn_iters = sinkhorn_iters
        self.fn = nn.Parameter(torch.zeros(self.mix, hc_mult * hidden_size, dtype=torch.float32),
                               requires_grad=False)
        self.base = nn.Parameter(torch.zeros(self.mix, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32), requires_grad=False)
        self.max_stats_splits: int | None = None  # ``mhc_stats(max_splits=...)``: None = its default

    def stats(self, residual: torch.Tensor, *, side_stream: torch.cuda.Stream | None = None) -> MHCStats:
        """``(pre, post, comb)`` from the residual ``[T, hc, H]`` entering this sublayer.

        With ``side_stream`` the launches run there, after the current stream's work so far, so
        they overlap what the current stream does next (the sublayer: the stats are needed only
        at the boundary after it). Read the result only after
        ``torch.cuda.current_stream().wait_stream(side_stream)``, and keep ``residual`` alive
        until then (the side stream reads it; ``run_sublayer`` does both).
        """
        kwargs = dict(rms_eps=self.rms_eps, hc_eps=self.hc_eps, sinkhorn_iters=self.sinkhorn_iters,
                      max_splits=self.max_stats_splits)
        if side_stream is None:
            return MHCStats(*mhc_kernels.mhc_stats(residual, self.fn, self.scale, self.base, **kwargs))
        # The outputs belong to the current stream (allocated here, before the switch): the
        # caching allocator then never recycles them for the side stream while the current
        # stream may still read them.
        rows = residual.shape[0]
        out = (residual.new_empty((rows, self.hc_mult), dtype=torch.float32),
               residual.new_empty((rows, self.hc_mult), dtype=torch.float32),
               residual.new_empty((rows, self.hc_mult, self.hc_mult), dtype=torch.float32))
        side_stream.wait_stream(torch.cuda.current_stream(residual.device))
        with torch.cuda.stream(side_stream):
            mhc_kernels.mhc_stats(residual, self.fn, self.scale, self.base, out=out, **kwargs)
        return MHCStats(*out)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, hc={self.hc_mult}, iters={self.sinkhorn_iters}, "
                f"hc_eps={self.hc_eps}")


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def stats_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream the mHC stats run on beside a sublayer on ``device`` (one per device),
    or None where launches are not asynchronous (CPU, the Triton interpreter)."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def run_sublayer(hc: HyperConnection, sublayer, residual: torch.Tensor, next_norm: RMSNorm,
                 out_format=None, overlap_stats: bool = True):
    """One sublayer between mHC boundaries: its stats (from the ``residual`` entering it), the
    sublayer ``y = sublayer(fork_stats)``, then the boundary after it (see ``mhc_boundary``).

    The sublayer calls ``fork_stats()`` once, where its stats should start (``at_start`` for one
    with no better place). With ``overlap_stats`` they run on ``stats_stream`` from there, beside
    the rest of the sublayer (they are off its FP8 path), and the boundary waits for them;
    without, they run in line at that point. The results are the same bits either way.
    """
    side = stats_stream(residual.device) if overlap_stats else None
    forked: list[MHCStats] = []

    def fork_stats() -> None:
        if forked:
            raise RuntimeError("the sublayer forked its mHC stats twice")
        forked.append(None)  # the side stream may wait on this one from here: joined below even if stats raises
        forked[0] = hc.stats(residual, side_stream=side)

    try:
        y = sublayer(fork_stats)
    finally:
        # Joined even when the sublayer raises: a capture would otherwise also fail on the
        # unjoined side stream, and later work on the current stream could race the stats.
        if side is not None and forked:
            torch.cuda.current_stream(residual.device).wait_stream(side)
    if not forked:
        raise RuntimeError("the sublayer never forked its mHC stats (call fork_stats once)")
    return mhc_boundary(y, residual, forked[0], next_norm, out_format)


def at_start(sublayer):
    """``sublayer()`` as a ``run_sublayer`` sublayer that forks its stats before it starts."""
    def run(fork_stats):
        fork_stats()
        return sublayer()
    return run


def mhc_boundary(y: torch.Tensor, residual: torch.Tensor, stats: MHCStats, next_norm: RMSNorm,
                 out_format=None) -> tuple[torch.Tensor, torch.Tensor, QuantizedActivation | None]:
    """Post of sublayer ``s`` + the next sublayer's combine + RMSNorm, one launch.

    Returns ``(new_residual [T, hc, H], x [T, H] bf16, pair or None)``; the pair (of ``x``, in
    ``out_format``) is written only when ``out_format`` is given.
    """
    pre, post, comb = stats
    new_residual, x, pair = mhc_kernels.mhc_mega_boundary(
        y, residual, pre, post, comb, next_norm.weight, next_norm.eps, out_format=out_format)
    return new_residual, x, (pair if out_format is not None else None)


def expand_streams(hidden: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """The initial residual: the embedding ``[T, H]`` copied into ``hc`` streams ``[T, hc, H]``."""
    return hidden.unsqueeze(1).expand(hidden.shape[0], hc_mult, hidden.shape[1]).contiguous()
