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
count launch shapes are sized against), ``triton_release`` (the compiler's version) and the
arrival protocols for the programs of one launch that finish an output together (split-K GEMM and
wo_a einsum, the row-split mHC boundary):
``arrival_counters`` / ``split_workspace`` / ``zeroed_workspace`` on the host; in the kernels
``arrive``, then either ``arrive_last`` (the last to arrive finishes; ``rearm``, and the split-K
partial tiles ``publish_partial`` / ``gather_partials``) or ``await_arrivals`` (every program
waits for all, the mHC boundary's row barrier).
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

__all__ = ["ARRIVAL_SLOTS", "H200_SMS", "arrival_counters", "arrive", "arrive_last", "await_arrivals", "await_producer",
           "compiled_for_gpu",
           "enabled", "gather_partials", "on_device", "programmatic_launches", "pdl_options", "publish_partial", "rearm",
           "registers_per_thread", "sm_count", "split_workspace", "supported", "SWEPT_RELEASE", "triton_release",
           "zeroed_workspace"]

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


# The Triton release the launch tables were swept with; later releases that compile some launches
# differently get their own rules (einsum.fp8_weight_tile_rows, gemm.m64_register_cap)
SWEPT_RELEASE = (3, 6)


def triton_release(version: str = triton.__version__) -> tuple[int, int]:
    """(major, minor) of a Triton version string ("3.8.0", "3.6.0+git1a2b"): launch tables whose
    best shapes depend on what the compiler can hold in registers read it."""
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def registers_per_thread(programs_per_sm: int, warps: int) -> int:
    """The most registers a thread may take (ptxas allocates them in steps of 8, at most 255) for
    ``programs_per_sm`` programs of ``warps`` warps to be resident on one SM of sm_90 (65536
    registers): the ``maxnreg`` cap that keeps a launch's occupancy when a compiler release takes
    more registers than the one its table was swept with."""
    return min(255, 65536 // (programs_per_sm * warps * 32) // 8 * 8)


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


def on_device(device: torch.device):
    """A block with ``device`` the current CUDA device (nothing for another device type): Triton
    launches on the current device's current stream, whatever device its tensors are on, and so do
    new streams, ``synchronize`` and graph capture."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


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


def pdl_options(device: torch.device) -> dict:
    """Launch keywords for a kernel that starts with ``await_producer(PDL)`` and reads and writes
    tensors on ``device`` (pass with ``**``).

    Every fp8chain launch asks for them, so this is also where a launch is refused (``ValueError``)
    when ``device`` is a CUDA device other than the current one: Triton launches on the current
    device's stream whatever device the tensors are on (a fault, or a race with that device's own
    work). Run such calls under ``on_device(device)``."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        raise ValueError(f"the tensors are on {device} but cuda:{torch.cuda.current_device()} is the current device, "
                         f"where Triton would launch: call under fp8chain_kernel.launch.on_device({device!s})")
    return {"PDL": True, "launch_pdl": True} if enabled() else {"PDL": False}


@triton.jit
def arrive(count_ptr, slot):
    """Call after this program's partial stores: bump counter ``slot`` once and return its count
    before. The CTA barrier orders every thread's stores before the one acq_rel atomic, whose
    acquire side makes the stores of the programs that arrived before visible to this one."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr + slot, 1, sem="acq_rel")


@triton.jit
def arrive_last(count_ptr, slot, programs):
    """``arrive``; true in the last of the ``programs`` programs sharing counter ``slot`` to
    arrive, which then finishes their output."""
    return arrive(count_ptr, slot) == programs - 1


@triton.jit
def await_arrivals(count_ptr, slot, programs):
    """``arrive``, then wait until all ``programs`` programs of this launch sharing counter ``slot``
    have arrived; their stores are then visible to every thread of this one. The counter is never
    re-armed: every launch on ``slot`` adds exactly ``programs`` arrivals, so this launch's end at
    the next multiple of ``programs``. Every program sharing the counter must be resident at once
    (a waiting program holds its SM). The counters must be int64: never re-armed, int32 ones would
    wrap after 2^31 arrivals and break the multiple-of-``programs`` count."""
    done = (arrive(count_ptr, slot) // programs + 1) * programs
    while tl.atomic_add(count_ptr + slot, 0, sem="acquire") < done:
        pass
    tl.debug_barrier()  # the acquire before any thread's loads


@triton.jit
def rearm(count_ptr, slot):
    """The last program's final act: zero the counter for the next launch."""
    tl.atomic_xchg(count_ptr + slot, 0)


@triton.jit
def _partial_offsets(part_ptr, tile, tiles, pid_k, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Where K slice ``pid_k``'s fp32 ``[ROWS, COLS]`` partial of output tile ``tile`` (of
    ``tiles``) lives in the split-K workspace: slice-major, one dense tile each."""
    local = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    return part_ptr + (pid_k * tiles + tile).to(tl.int64) * (ROWS * COLS) + local


@triton.jit
def publish_partial(acc, part_ptr, count_ptr, tile, tiles, pid_k, SPLIT: tl.constexpr, ROWS: tl.constexpr,
                    COLS: tl.constexpr):
    """Deterministic split-K, first half: store this K slice's fp32 partial tile to the workspace
    and arrive on the tile's counter; true in the slice that arrives last (it finishes the tile)."""
    tl.store(_partial_offsets(part_ptr, tile, tiles, pid_k, ROWS, COLS), acc)
    return arrive_last(count_ptr, tile, SPLIT)


@triton.jit
def gather_partials(part_ptr, tile, tiles, SPLIT: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Second half, in the last slice: the sum of all partial tiles in slice order, independent of
    the arrival order, so the result is reproducible. The caller re-arms the tile's counter after
    its own stores (re-armed before them, the sm_90 GEMM build spills at 64x64 tiles)."""
    total = tl.zeros((ROWS, COLS), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(_partial_offsets(part_ptr, tile, tiles, s, ROWS, COLS), cache_modifier=".cg")
    return total


ARRIVAL_SLOTS = 1 << 14
_workspaces: dict[tuple[str, torch.device], torch.Tensor] = {}


def zeroed_workspace(user: str, device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed buffer that kernels keep state in across launches (arrival counters, the
    boundary's row-barrier counters): one per (``user``, device), allocated on first eager use,
    so launches of one user on one device must not run concurrently on two streams. A first use
    inside CUDA-graph capture gets a buffer of its own, allocated from and zeroed by the graph
    (at every replay), so the cached buffer never lives in a graph's private memory pool."""
    buf = _workspaces.get((user, device))
    if buf is not None:
        if buf.dtype != dtype or buf.numel() < numel:  # two callers disagree on one user's buffer
            raise RuntimeError(f"workspace {user!r} on {device} is {buf.dtype} x {buf.numel()}, asked for "
                               f"{dtype} x {numel}")
        return buf
    buf = torch.zeros(numel, dtype=dtype, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _workspaces[(user, device)] = buf
    return buf


def arrival_counters(user: str, device: torch.device, slots: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the "last program to arrive finishes" kernels (split-K
    GEMM and wo_a einsum, the row-split mHC boundary): each program bumps its counter once; the
    one that sees the final count does the finishing work and re-arms the counter to zero for the
    next call. ``ARRIVAL_SLOTS`` of them per (``user``, device) (``zeroed_workspace``; ``slots``
    where first used inside graph capture)."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return zeroed_workspace(user, device, slots if capturing else ARRIVAL_SLOTS, torch.int32)


def split_workspace(user: str, split: int, tiles: int, tile_elems: int, device: torch.device):
    """``(split, partials, counters)`` for a launch of ``tiles`` output tiles of ``tile_elems`` fp32
    each whose K is split ``split`` ways (``publish_partial`` / ``gather_partials``). Unsplit, or
    with more tiles than arrival counters (then it runs unsplit): ``(1, None, None)``."""
    if split == 1 or tiles > ARRIVAL_SLOTS:
        return 1, None, None
    part = torch.empty(split * tiles * tile_elems, dtype=torch.float32, device=device)
    return split, part, arrival_counters(user, device, tiles)
