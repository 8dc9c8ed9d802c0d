"""Programmatic dependent launch (PDL) for every fp8chain kernel, Hopper and later.

A decode step is a chain of small dependent launches; between two of them the GPU idles for the
next grid's launch. Under ``programmatic_launches()`` every fp8chain kernel is launched with the
programmatic-stream-serialization attribute (``launch_pdl``): its programs may be scheduled while
the kernel before it in the stream still runs, and each program first executes
``griddepcontrol.wait`` (``await_producer``), which returns once that kernel has completed and its
writes are visible, before it touches memory. Right after, it lets the next kernel's programs be
scheduled behind its own (``griddepcontrol.launch_dependents``), so the launch overlaps this
kernel's work. Numerics do not change: every read and write still happens after the previous
kernel finished. Works inside CUDA-graph capture (the edge becomes a programmatic dependency).

Outside the context, or on the CPU interpreter or a GPU before sm_90, kernels launch as usual
(``PDL=False`` compiles without the two instructions).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .fp8_tile import interpreting

__all__ = ["await_producer", "programmatic_launches", "pdl_options"]

_enabled = False


@triton.jit
def await_producer(PDL: tl.constexpr):
    """First statement of every kernel: with PDL, wait for the previous kernel, then release the
    next one."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def supported(device: torch.device | None = None) -> bool:
    """PDL needs a CUDA GPU of compute capability 9.0 or later (and compiled kernels)."""
    if interpreting() or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@contextlib.contextmanager
def programmatic_launches(enabled: bool = True):
    """Launch fp8chain kernels with PDL inside this block (where ``supported``); nests."""
    global _enabled
    previous = _enabled
    _enabled = enabled and supported()
    try:
        yield
    finally:
        _enabled = previous


def pdl_options() -> dict:
    """Launch keywords for a kernel that starts with ``await_producer(PDL)`` (pass with ``**``)."""
    return {"PDL": True, "launch_pdl": True} if _enabled else {"PDL": False}
