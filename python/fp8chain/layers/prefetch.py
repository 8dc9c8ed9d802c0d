"""Weight prefetch into L2 beside launches that barely read HBM (``fp8chain_kernel.prefetch``).

``prefetch_weight(w)`` launches an L2 prefetch of ``w`` on a side stream of ``w``'s device, after
the work the current stream has enqueued so far: it runs beside the current stream's next
launches. ``join_prefetches(device)`` makes the current stream wait for every prefetch forked
since the last join; each must be joined before a CUDA-graph capture ends (``run_sublayer`` joins
where it joins the mHC stats, the model at the end of its forward). Nothing reads a prefetch's
result, so where it may run does not change any output.

Where the model prefetches (each module's ``prefetch_points``, a subset of ``PREFETCH_POINTS``):
``boundary``: the next sublayer's first linear beside the mHC boundary that feeds it;
``wq_b``: beside wqkv_a and q_norm; ``wo_a``: beside RoPE and the attention core; ``down``: beside
the gate_up GEMM.
"""

from __future__ import annotations

import torch

from fp8chain_kernel.prefetch import l2_prefetch, prefetch_supported

__all__ = ["PREFETCH_POINTS", "check_points", "join_prefetches", "prefetch_weight"]

PREFETCH_POINTS = ("boundary", "wq_b", "wo_a", "down")

_streams: dict[torch.device, torch.cuda.Stream] = {}
_pending: set[torch.device] = set()


def check_points(points) -> frozenset[str]:
    """``points`` as a frozenset, refusing names that are not in ``PREFETCH_POINTS``."""
    points = frozenset(points)
    unknown = sorted(points - set(PREFETCH_POINTS))
    if unknown:
        raise ValueError(f"unknown prefetch points {unknown}; known: {', '.join(PREFETCH_POINTS)}")
    return points


def _device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def prefetch_weight(weight: torch.Tensor) -> None:
    """Fork an L2 prefetch of ``weight`` onto its device's prefetch stream (nothing where
    ``prefetch_supported`` is false)."""
    if not prefetch_supported(weight.device):
        return
    device = _device(weight.device)
    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        l2_prefetch(weight)
    _pending.add(device)


def join_prefetches(device) -> None:
    """The current stream of ``device`` waits for the prefetches forked there since the last join."""
    device = _device(device)
    if device in _pending:
        torch.cuda.current_stream(device).wait_stream(_streams[device])
        _pending.discard(device)
