"""Programmatic dependent launch (PDL) for every fp8chain kernel, Hopper and later.

A decode step is a chain of small dependent launches; between two of them the GPU idles for the
next grid's launch. With PDL every fp8chain kernel is launched with the
programmatic-stream-serialization attribute (``launch_pdl``): the GPU may launch it before the
kernel ahead of it in the stream has fully completed, and each of its programs first executes
``griddepcontrol.wait`` (``await_producer``), which returns once that kernel has completed and
its writes are visible, before it touches memory. The launch thus overlaps the previous kernel's
last programs instead of following its completion. Numerics do not change: every read and write
still happens after the previous kernel finished (the layer step is bitwise identical with and
without, eagerly and in CUDA graphs; docs/benchmarks.md). Works inside CUDA-graph capture (the
edge becomes a programmatic dependency).

On by default on GPUs of compute capability >= 9.0; off on older GPUs and the CPU interpreter
(``PDL=False`` compiles without the wait). ``FP8CHAIN_PDL=0`` in the environment
turns it off for the process, ``programmatic_launches(False)`` for a block.

Also here, for every kernel family that sizes or finishes its launches: ``sm_count`` (the SM
count launch shapes are sized against) and the last-arrival protocol for the programs of one
launch that finish an output together (split-K GEMM, the row-split mHC boundary):
``arrival_counters`` on the host, ``arrive_last`` and ``rearm`` in the kernels.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .fp8_tile import interpreting

__all__ = ["ARRIVAL_SLOTS", "H200_SMS", "arrival_counters", "arrive_last", "await_producer", "compiled_for_gpu",
           "enabled", "programmatic_launches", "pdl_options", "rearm", "sm_count", "supported"]

_override: list[bool] = []  # innermost programmatic_launches() block last


@triton.jit
def await_producer(PDL: tl.constexpr):
    """First statement of every kernel: with PDL, wait for the previous kernel. The next kernel is
    released as this one's programs exit (no ``griddepcontrol.launch_dependents``: released at
    program start, the next kernel's programs wait on SMs beside the running ones, which measured
    slower wherever a kernel has more programs than SMs)."""
    if PDL:
        gdc_wait()


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


H200_SMS = 132  # the GPU the launch shapes were tuned on: the stand-in where none is present


def compiled_for_gpu(device: torch.device) -> bool:
    """Whether kernels on ``device`` run compiled on a GPU (not on the Triton CPU interpreter)."""
    return device.type == "cuda" and not interpreting()


def sm_count(device: torch.device, interpreter: int) -> int:
    """Streaming multiprocessors of ``device``'s GPU, which launch shapes are sized against;
    ``interpreter`` where kernels run on the Triton CPU interpreter (a stand-in each caller picks
    for the shapes its CPU tests should take)."""
    if not compiled_for_gpu(device):
        return interpreter
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def supported() -> bool:
    """PDL needs compiled kernels on a CUDA GPU of compute capability 9.0 or later (the current
    device)."""
    if interpreting() or not torch.cuda.is_available():
        return False
    return _capability_major(torch.cuda.current_device()) >= 9


@contextlib.contextmanager
def programmatic_launches(enabled: bool = True):
    """Launch fp8chain kernels with (or without) PDL inside this block, where ``supported``."""
    _override.append(enabled)
    try:
        yield
    finally:
        _override.pop()


def enabled() -> bool:
    """Whether kernels launched now use PDL (the innermost block, else ``FP8CHAIN_PDL``, else on)."""
    wanted = _override[-1] if _override else os.environ.get("FP8CHAIN_PDL", "1") != "0"
    return wanted and supported()


def pdl_options() -> dict:
    """Launch keywords for a kernel that starts with ``await_producer(PDL)`` (pass with ``**``)."""
    return {"PDL": True, "launch_pdl": True} if enabled() else {"PDL": False}


@triton.jit
def arrive_last(count_ptr, slot, programs):
    """Call after this program's partial stores: true in the last of the ``programs`` programs
    sharing counter ``slot`` to arrive, which then finishes their output. The CTA barrier orders
    every thread's stores before the one acq_rel atomic, whose acquire side makes the other
    programs' stores visible to the last one."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr + slot, 1, sem="acq_rel") == programs - 1


@triton.jit
def rearm(count_ptr, slot):
    """The last program's final act: zero the counter for the next launch."""
    tl.atomic_xchg(count_ptr + slot, 0)


ARRIVAL_SLOTS = 1 << 14
_arrival: dict[tuple[str, torch.device], torch.Tensor] = {}


def arrival_counters(user: str, device: torch.device, slots: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the "last program to arrive finishes" kernels (split-K
    GEMM, the row-split mHC boundary): each program bumps its counter once; the one that sees the
    final count does the finishing work and re-arms the counter to zero for the next call.

    One ``ARRIVAL_SLOTS`` buffer per (``user``, device), allocated on first eager use: launches of
    one user on one device must not run concurrently on two streams. A first use inside CUDA-graph
    capture gets its own zeroed ``slots`` buffer (allocated from, and zeroed by, the graph), so the
    cached buffer never lives in a graph's private memory pool.
    """
    buf = _arrival.get((user, device))
    if buf is not None:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(slots, dtype=torch.int32, device=device)
    buf = torch.zeros(ARRIVAL_SLOTS, dtype=torch.int32, device=device)
    _arrival[(user, device)] = buf
    return buf
