"""Last-arrival counters: a deterministic reduction inside the launch that made the partials.

A kernel that splits one output tile over ``n`` programs (split-K GEMM slices, attention key
splits) stores each program's fp32 partial, then calls ``arrive``: a CTA barrier (every thread's
stores issued) and one acq_rel, GPU-scope ``atomic_add`` on the tile's counter. The program that
sees ``n - 1`` is the last: every partial is visible to it (read them with ``.cg`` loads, from L2,
in a fixed order, so the result never depends on which program came last), and it calls
``rearm`` so the next launch, or the next CUDA-graph replay, starts from zero.

``counters(device, owner, count)`` is the int32 buffer of one kernel family on one device, zero
between launches. Launches of one family on one device must not run concurrently on two streams.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["arrive", "rearm", "counters"]

_SLOTS = 1 << 14  # counters allocated per (device, owner) at first use; more when a launch needs them
_buffers: dict[tuple[torch.device, str], torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # kept alive: CUDA graphs captured with them still point there


@triton.jit
def arrive(count_ptr, index, ARRIVALS: tl.constexpr):
    """True in the last of the ``ARRIVALS`` programs that share counter ``index``."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr + index, 1, sem="acq_rel") == ARRIVALS - 1


@triton.jit
def rearm(count_ptr, index):
    tl.atomic_xchg(count_ptr + index, 0)


def counters(device: torch.device, owner: str, count: int) -> torch.Tensor:
    """At least ``count`` zeroed counters for kernel family ``owner`` on ``device``.

    A buffer first needed inside CUDA-graph capture is the graph's own (allocated from, and zeroed
    by, the graph), so the cached buffer never lives in a graph's private memory pool.
    """
    key = (torch.device(device), owner)
    buf = _buffers.get(key)
    if buf is not None and buf.numel() >= count:
        return buf
    if key[0].type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(count, dtype=torch.int32, device=device)
    if buf is not None:
        _outgrown.append(buf)
    buf = torch.zeros(max(count, _SLOTS), dtype=torch.int32, device=device)
    _buffers[key] = buf
    return buf
