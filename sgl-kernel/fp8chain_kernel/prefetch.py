"""L2 prefetch: bring a linear's weights into L2 while a launch that barely reads HBM runs.

A decode step alternates linears that stream their weights from HBM with launches that hardly
touch it (the attention core, RoPE, the mHC boundary). ``l2_prefetch(t)`` issues
``cp.async.bulk.prefetch.L2`` over ``t``'s bytes, 4 KB per instruction, one program per SM, and
its programs exit once the instructions are issued. Launched on a side stream beside such a
launch, it fetches the weights of the linear after it while HBM would otherwise idle. A hint:
nothing reads its result and no output depends on it.

Compiled kernels on GPUs of compute capability >= 9.0 only (the bulk prefetch is sm_90 PTX);
``prefetch_supported(device)`` says whether ``l2_prefetch`` launches anything there (it does
nothing on the CPU interpreter and on older GPUs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import compiled_for_gpu, sm_count

__all__ = ["PREFETCH_CHUNK", "l2_prefetch", "prefetch_supported"]

PREFETCH_CHUNK = 4096  # bytes per bulk prefetch instruction
_LANES = 128  # instructions each program issues per round (one per thread of 4 warps)

# Predicated: a lane past the tensor's end issues nothing. $0 is a dummy result (inline asm must
# have one); is_pure=False keeps the statement.
_BULK_PREFETCH = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $3, 0; "
                              "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Program ``p`` prefetches chunks ``p * LANES + i``, then those one grid's worth further on,
    so the first programs to start cover the tensor's start (what a consumer reads first)."""
    step = tl.num_programs(0).to(tl.int64) * (LANES * CHUNK)
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    for r in range(tl.cdiv(nbytes, step)):
        start = r * step + offs
        size = tl.minimum(nbytes - start, CHUNK).to(tl.int32)
        tl.inline_asm_elementwise(_BULK_PREFETCH, "=r,l,r,r", [ptr + start, size, (start < nbytes).to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


def prefetch_supported(device: torch.device) -> bool:
    """Whether ``l2_prefetch`` launches anything for tensors on ``device``."""
    device = torch.device(device)
    if not compiled_for_gpu(device):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def l2_prefetch(tensor: torch.Tensor) -> None:
    """Prefetch the bytes of ``tensor`` (contiguous, 16-byte aligned, a multiple of 16 bytes:
    any weight the caching allocator holds) into L2, on the current stream. Returns at once
    where ``prefetch_supported`` is false."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"l2_prefetch takes a tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"l2_prefetch needs a contiguous tensor, got strides {tensor.stride()}")
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.data_ptr() % 16 or nbytes % 16:
        raise ValueError(f"l2_prefetch needs 16-byte alignment and a multiple of 16 bytes, got address "
                         f"{tensor.data_ptr():#x} and {nbytes} bytes")
    if nbytes == 0 or not prefetch_supported(tensor.device):
        return
    programs = min(sm_count(tensor.device, 1), triton.cdiv(nbytes, PREFETCH_CHUNK * _LANES))
    _l2_prefetch_kernel[(programs,)](tensor.view(-1).view(torch.uint8), nbytes, CHUNK=PREFETCH_CHUNK,
                                     LANES=_LANES, num_warps=4)
