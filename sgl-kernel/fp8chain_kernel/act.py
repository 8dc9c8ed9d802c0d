"""SiLU*mul (with the optional swiglu clamp) -> bf16, and in the same launch its FP8 pair.

``silu_mul(gate_up, *, limit=None, out_format=None, out=None, out_bf16=None, return_bf16=True, config=None)``

* ``gate_up``: bf16 ``[T, 2I]``, unit column stride (any row stride); ``gate = gate_up[:, :I]``,
  ``up = gate_up[:, I:]``.
* ``limit`` (``swiglu_limit``): ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``;
  NaN stays NaN.
* ``y = bf16(silu(gate) * up)`` in fp32, one rounding: bf16 ``[T, I]``.
* ``out_format`` / ``out`` / ``out_bf16`` / ``return_bf16``: as ``norm.rms_norm`` (the pair equals
  ``reference.quantize(y, out_format)`` bit for bit; ``return_bf16=False`` stores no bf16); no
  output shares memory with another or with ``gate_up``.

Tiles: ``[BLOCK_M, BLOCK_N]`` of output columns, ``BLOCK_N`` a multiple of 128 (whole quantization
groups and whole packed scale words per program), row tiles on grid axis 0 (up to 2^31 - 1, so any
row count) and column tiles on axis 1 (up to 65535, so ``I <= 65535 * BLOCK_N``); ``config`` sets
them in place of the launch rule (benchmarks' sweeps).
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from .formats import ActFormat, QuantizedActivation, check_no_overlap
from .fp8_tile import fp8_offsets, round_bf16, store_pair_tile
from .launch import await_producer, pdl_options
from .norm import check_launch_config, check_tensor, launch_args, produced, producer_result, resolve_outputs

__all__ = ["silu_mul", "swiglu", "check_limit"]


@triton.jit
def swiglu(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """fp32 ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` (NaN kept), before rounding: the one
    expression ``silu_mul`` and the gate_up GEMM's SiLU*mul epilogue (``gemm.fp8_gemm_silu_mul``)
    share, so the two round alike."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.clamp(up, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, data_ptr, scale_ptr, M, I, limit,
                     stride_gm, stride_ym, stride_dm, stride_sm, stride_sg,
                     HAS_LIMIT: tl.constexpr, STORE_BF16: tl.constexpr, QUANT: tl.constexpr,
                     GROUP: tl.constexpr, POW2: tl.constexpr, PACKED: tl.constexpr,
                     EXACT_CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    await_producer(PDL)
    # rows on axis 0 (a CUDA grid's axes 1 and 2 stop at 65535), and no division by a runtime tile
    # count: deriving both tiles from one axis measured 2-13 % slower (docs/benchmarks.md, producers)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m.to(tl.int64)[:, None]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < I)
    g_ptrs = gu_ptr + rows * stride_gm + offs_n[None, :]
    gate = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(g_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    yb = round_bf16(swiglu(gate, up, limit, HAS_LIMIT), EXACT_CAST)
    if STORE_BF16:
        tl.store(y_ptr + rows * stride_ym + offs_n[None, :], yb, mask=mask)
    if QUANT:
        store_pair_tile(data_ptr + fp8_offsets(rows, stride_dm, offs_n), scale_ptr, yb.to(tl.float32), mask,
                        offs_m, pid_n * (BLOCK_N // GROUP), M, tl.cdiv(I, GROUP), stride_sm,
                        stride_sg, BLOCK_M, BLOCK_N, GROUP, POW2, PACKED, EXACT_CAST)


def _launch_config(rows: int, cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): the widest power-of-two tile in 128..256 that divides the
    columns (I = 2304 -> 256, 9 column programs even for one row), 512 outputs per program up to 64
    rows and 1024 beyond, 4 warps. Small programs keep the latency-bound decode launch spread over
    the SMs: on the H200 (docs/benchmarks.md, producers) at T = 16 this takes the FP8 launch from
    1.81 us (16 x 256 tiles, 8 warps) to 1.20 and the bf16 one from 1.58 to 1.12; at T = 2048 it ties."""
    block_n = next((b for b in (256, 128) if cols % b == 0 and b <= cols), None)
    if block_n is None:
        block_n = max(128, min(256, triton.next_power_of_2(cols)))
    outputs = 512 if rows <= 64 else 1024
    block_m = max(1, min(triton.next_power_of_2(rows), outputs // block_n))
    return block_m, block_n, 4


_FP32 = torch.finfo(torch.float32)
_GRID_AXIS_1_MAX = 65535


def check_limit(limit) -> None:
    """``swiglu_limit``: a positive number or None (ValueError otherwise), a normal fp32 value or
    inf: Triton passes a float argument as fp32, so a larger finite value would arrive as inf (no
    clamp) and a tinier one as a subnormal or 0 (every gate clamped to about 0), not the limit given."""
    if limit is not None:
        if not isinstance(limit, numbers.Real) or isinstance(limit, bool) or not limit > 0:
            raise ValueError(f"limit must be a positive number or None, got {limit!r}")
        if limit < _FP32.tiny or _FP32.max < limit < float("inf"):
            raise ValueError(f"limit must be a normal fp32 number ({_FP32.tiny:.3g} .. {_FP32.max:.3g}) or inf, "
                             f"got {limit!r}")


def silu_mul(gate_up: torch.Tensor, *, limit: float | None = None, out_format: ActFormat | str | None = None,
             out: QuantizedActivation | None = None, out_bf16: torch.Tensor | None = None,
             return_bf16: bool = True, config: dict | None = None):
    """``silu(gate) * up`` of ``gate_up [T, 2I]`` bf16 -> ``[T, I]``; see the module docstring.
    ``config``: ``BLOCK_M``, ``BLOCK_N`` (>= 128: whole FP8 groups of every format per program)
    and ``num_warps`` in place of ``_launch_config``'s (benchmarks' sweeps)."""
    check_tensor(gate_up, "gate_up", torch.bfloat16, 2)
    rows, cols2 = gate_up.shape
    if cols2 % 2:
        raise ValueError(f"gate_up must have an even number of columns [T, 2I], got {tuple(gate_up.shape)}")
    if gate_up.numel() and gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must have unit column stride, got strides {gate_up.stride()}")
    check_limit(limit)
    cols = cols2 // 2
    if config is None:
        block_m, block_n, num_warps = _launch_config(rows, cols)
    else:
        block_m, block_n, num_warps = check_launch_config(config, "BLOCK_N", 128)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))
    if grid[1] > _GRID_AXIS_1_MAX:
        raise ValueError(f"silu_mul takes at most {_GRID_AXIS_1_MAX} column tiles of {block_n} "
                         f"(I <= {_GRID_AXIS_1_MAX * block_n}), got I = {cols}")
    fmt, pair, y = resolve_outputs(rows, cols, gate_up.device, out_format, out, out_bf16, return_bf16)
    check_no_overlap(produced(pair, y), [("gate_up", gate_up)])
    if rows == 0 or cols == 0:
        return producer_result(y, pair)
    a = launch_args(fmt, pair, y, gate_up)
    _silu_mul_kernel[grid](
        gate_up, a["y"], a["data"], a["scale"], rows, cols, float(limit) if limit is not None else 0.0,
        gate_up.stride(0), a["y_stride"], *a["strides"],
        HAS_LIMIT=limit is not None, STORE_BF16=a["STORE_BF16"], QUANT=a["QUANT"],
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **a["consts"], **pdl_options(gate_up.device),
    )
    return producer_result(y, pair)
