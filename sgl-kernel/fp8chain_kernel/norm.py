"""RMSNorm (with optional fused residual add) -> bf16, and in the same launch its FP8 pair.

``rms_norm(x, weight, eps, *, residual=None, out_format=None, out=None, out_bf16=None,
return_bf16=True, config=None)``

* ``x``: bf16 ``[T, H]``, unit column stride (any row stride); ``weight``: bf16 ``[H]``, contiguous.
* ``residual`` (optional): bf16 ``[T, H]``, unit column stride, one location per element (it is
  written). Then ``h = bf16(x + residual)``
  is written back into ``residual`` in place (fused add-norm convention) and normalised;
  otherwise ``h = x``.
* ``y = bf16(h * rsqrt(mean(h^2) + eps) * weight)``, computed in fp32 and rounded once; a row
  whose sum of squares overflows fp32 gives NaN (``fp8_tile.rms_rstd``), not zeros.
* ``out_format`` (an ``ActFormat``): the same launch quantizes the bf16-rounded ``y`` with
  ``fp8_tile.quantize_tile``, so the pair equals ``reference.quantize(y, out_format)`` bit for bit.
* Returns ``y`` (bf16 ``[T, H]``) without ``out_format``; ``(y, pair)`` with it; only ``pair``
  with ``return_bf16=False`` (then no bf16 store happens at all).
* ``out``: a caller-given pair (``[T, H]`` in ``out_format``; its scale column stride is honoured,
  so a row-slice of a buffer captured for more rows works); ``out`` alone implies its format.
  ``out_bf16``: a caller-given bf16 ``[T, H]`` buffer with unit column stride, one location per
  element (no expanded rows). The outputs (``out_bf16``, the pair's data and scales, ``residual``)
  share no memory with each other or with ``x`` and ``weight``.
* ``config`` (benchmarks' sweeps): ``{"BLOCK_M", "BLOCK_H", "num_warps"}`` in place of the launch
  rule (``_launch_config``), powers of two, ``BLOCK_H >= max(H, 128)``, at most ``2**20`` values
  per program (``H`` is bounded by that too: a program holds whole rows).

The same return convention (and the helpers ``resolve_outputs`` / ``producer_result`` below)
is shared by ``act.silu_mul`` and ``einsum.wo_a_einsum``.

Errors: ``TypeError`` for a wrong tensor type or dtype or a pair of another format; ``ValueError``
for a wrong shape, stride or device, a bad ``eps`` or ``config``, or outputs that overlap.
``T = 0`` launches nothing.
"""

from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from .formats import ActFormat, QuantizedActivation, check_distinct_elements, check_no_overlap, is_int, pair_parts
from .fp8_tile import format_constexprs, fp8_offsets, interpreting, rms_rstd, round_bf16, store_pair_tile
from .launch import await_producer, pdl_options
from .quant import prepare_out

__all__ = ["rms_norm"]


# ----------------------------------------------------------------------------------------------
# Host-side checks and the producers' shared output convention
# ----------------------------------------------------------------------------------------------

def check_tensor(t, name: str, dtype: torch.dtype, dim: int) -> None:
    """``t`` is a tensor of ``dtype`` with ``dim`` dimensions (TypeError / ValueError otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


def check_eps(eps, name: str = "eps") -> None:
    """An epsilon the kernels add in fp32 under a square root or a division: a non-negative number
    fp32 holds, 0 or from fp32's smallest subnormal 2^-149 to its largest (a bool, a string, a
    tensor, a negative value, NaN, inf, or a positive value fp32 rounds to 0, where the torch
    reference would still add it, raise ``ValueError``)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (eps == 0 or 2.0**-149 <= eps <= FP32_MAX):
        raise ValueError(f"{name} must be a non-negative number fp32 holds (0, or 2^-149 to its largest), "
                         f"got {eps!r}")


def check_finite(value, name: str) -> None:
    """A real number a kernel receives as a finite fp32 value (a bool, a string, a tensor, NaN,
    +-inf or a magnitude past fp32's largest raise ``ValueError``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not abs(value) <= FP32_MAX:
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def check_rows(t: torch.Tensor, name: str, shape: tuple[int, int], device,
               dtype: torch.dtype = torch.bfloat16) -> None:
    """A 2-D ``shape`` matrix of ``dtype`` the launch writes: unit column stride, one location per
    element, on ``device``."""
    check_tensor(t, name, dtype, 2)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.numel() and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride, got strides {t.stride()}")
    check_distinct_elements(t, name)
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def resolve_outputs(rows: int, cols: int, device, out_format, out, out_bf16, return_bf16: bool):
    """Validate/allocate a producer's outputs: ``(fmt or None, pair or None, y or None)``.

    ``out`` without ``out_format`` implies ``out.fmt``; ``out`` in another format than
    ``out_format`` raises ``TypeError`` (from ``quant.prepare_out``).
    """
    if out_format is None and out is not None:
        if not isinstance(out, QuantizedActivation):
            raise TypeError(f"out must be a QuantizedActivation, got {type(out).__name__}")
        out_format = out.fmt
    fmt = None
    if out_format is not None:
        if not isinstance(out_format, (ActFormat, str)):
            raise TypeError(f"out_format must be an ActFormat, got {type(out_format).__name__}")
        try:
            fmt = ActFormat(out_format)
        except ValueError:
            raise ValueError(f"unknown out_format {out_format!r}; one of {[f.value for f in ActFormat]}") from None
    if fmt is None and not return_bf16:
        raise ValueError("return_bf16=False needs an out_format (there would be no output)")
    pair = prepare_out(out, rows, cols, fmt, device) if fmt is not None else None
    if return_bf16:
        if out_bf16 is None:
            y = torch.empty((rows, cols), dtype=torch.bfloat16, device=device)
        else:
            check_rows(out_bf16, "out_bf16", (rows, cols), device)
            y = out_bf16
    else:
        if out_bf16 is not None:
            raise ValueError("out_bf16 was given but return_bf16=False (no bf16 output is written)")
        y = None
    check_no_overlap([("out_bf16", y)], pair_parts(pair))  # the pair's own parts: prepare_out
    return fmt, pair, y


def produced(pair, y) -> list:
    """The named outputs of a producer (``check_no_overlap`` against its inputs)."""
    return [("out_bf16", y)] + pair_parts(pair)


FP32_MAX = torch.finfo(torch.float32).max
MAX_TILE_ELEMS = 1 << 20  # the most elements Triton allows in one tensor (one program's tile)


def check_launch_config(config, width_key: str, min_width: int) -> tuple[int, int, int]:
    """A caller's launch config for a row-tiled producer (benchmarks' sweeps): a dict with
    ``BLOCK_M`` (rows per program), ``width_key`` (columns per program) and ``num_warps``, all
    powers of two, the width at least ``min_width``; returned as ``(BLOCK_M, width, num_warps)``."""
    keys = {"BLOCK_M", width_key, "num_warps"}
    if not isinstance(config, dict) or set(config) != keys:
        raise ValueError(f"config must be a dict with keys {sorted(keys)}, got {config!r}")
    values = (config["BLOCK_M"], config[width_key], config["num_warps"])
    if any(not is_int(v) or v < 1 or v & (v - 1) for v in values):
        raise ValueError(f"config values must be powers of two, got {config!r}")
    if values[1] < min_width or values[2] > 16 or values[0] * values[1] > MAX_TILE_ELEMS:
        raise ValueError(f"config needs {width_key} >= {min_width}, num_warps <= 16 and BLOCK_M * {width_key} "
                         f"<= {MAX_TILE_ELEMS}, got {config!r}")
    return values


def producer_result(y, pair):
    """``y``, ``(y, pair)`` or ``pair``: the return convention of every producer."""
    if pair is None:
        return y
    return pair if y is None else (y, pair)


def launch_args(fmt, pair, y, dummy: torch.Tensor) -> dict:
    """Pointer/stride arguments for a pair and bf16 output either of which may be absent."""
    if pair is not None:
        consts = format_constexprs(fmt)
        data, scale = pair.data, pair.scale
        strides = (data.stride(0), scale.stride(0), scale.stride(1))
    else:
        consts = dict(GROUP=32, POW2=True, PACKED=False, EXACT_CAST=interpreting())
        data = scale = dummy
        strides = (0, 0, 0)
    y_arg = y if y is not None else dummy
    y_stride = y.stride(0) if y is not None else 0
    return dict(y=y_arg, y_stride=y_stride, data=data, scale=scale, strides=strides, consts=consts,
                QUANT=pair is not None, STORE_BF16=y is not None)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, data_ptr, scale_ptr, M, H, eps,
                     stride_xm, stride_rm, stride_ym, stride_dm, stride_sm, stride_sg,
                     HAS_RESIDUAL: tl.constexpr, STORE_BF16: tl.constexpr, QUANT: tl.constexpr,
                     GROUP: tl.constexpr, POW2: tl.constexpr, PACKED: tl.constexpr,
                     EXACT_CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    # One program normalises BLOCK_M whole rows held in registers (BLOCK_H >= H).
    await_producer(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    rows = offs_m.to(tl.int64)[:, None]
    mask = (offs_m[:, None] < M) & (offs_h[None, :] < H)
    h = tl.load(x_ptr + rows * stride_xm + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = res_ptr + rows * stride_rm + offs_h[None, :]
        r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        hb = round_bf16(h + r, EXACT_CAST)
        tl.store(r_ptrs, hb, mask=mask)
        h = hb.to(tl.float32)
    rstd = rms_rstd(tl.sum(h * h, axis=1), H, eps)
    w = tl.load(w_ptr + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)
    yb = round_bf16(h * rstd[:, None] * w[None, :], EXACT_CAST)
    if STORE_BF16:
        tl.store(y_ptr + rows * stride_ym + offs_h[None, :], yb, mask=mask)
    if QUANT:
        store_pair_tile(data_ptr + fp8_offsets(rows, stride_dm, offs_h), scale_ptr, yb.to(tl.float32), mask,
                        offs_m, 0, M, tl.cdiv(H, GROUP), stride_sm, stride_sg,
                        BLOCK_M, BLOCK_H, GROUP, POW2, PACKED, EXACT_CAST)


def _launch_config(rows: int, cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_H, num_warps): whole rows per program. Narrow rows share a program (2048
    values, ~16 per thread); a row of 1025..8192 values has a program of 8 warps to itself, two
    rows of 1025..2048 from 1024 rows on (4 warps). The bf16-only and the FP8 launch must take the
    same configuration: the warps set the order of the row's sum of squares, and the unchained
    model has to see the very bf16 values the chained one quantizes. From an H200 sweep
    (docs/benchmarks.md, producers), bf16 / FP8 us: H = 1280, T = 1: 1.33 / 1.49 with 8 warps
    against 1.32 / 1.59 with 4; H = 5120, T = 1: 1.96 / 2.03 against 1.83 / 2.22 with 16; two rows
    of 1280 a program at T = 2048: 2.96 / 4.22 against 3.11 / 4.50 with one."""
    block_h = max(128, triton.next_power_of_2(cols))
    block_m = max(1, min(triton.next_power_of_2(rows), 2048 // block_h))
    if block_h == 2048 and rows >= 1024:
        return 2, block_h, 4
    if 2048 <= block_h <= 8192:
        return 1, block_h, 8
    return block_m, block_h, max(4, min(16, block_m * block_h // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             out_format: ActFormat | str | None = None, out: QuantizedActivation | None = None,
             out_bf16: torch.Tensor | None = None, return_bf16: bool = True, config: dict | None = None):
    """RMSNorm of ``x [T, H]`` bf16 (optionally after ``residual += x`` in place); see the module
    docstring for shapes, layouts, numerics and the return convention. ``config``: ``BLOCK_M``,
    ``BLOCK_H`` (>= max(H, 128)) and ``num_warps`` in place of ``_launch_config``'s (benchmarks'
    sweeps)."""
    check_tensor(x, "x", torch.bfloat16, 2)
    rows, cols = x.shape
    if x.numel() and x.stride(1) != 1:
        raise ValueError(f"x must have unit column stride, got strides {x.stride()}")
    check_tensor(weight, "weight", torch.bfloat16, 1)
    if weight.shape[0] != cols:
        raise ValueError(f"weight must have shape ({cols},), got {tuple(weight.shape)}")
    if cols and weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous, got stride {weight.stride()}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if cols > MAX_TILE_ELEMS:  # a program holds whole rows
        raise ValueError(f"rows of H = {cols} are wider than one program's tile ({MAX_TILE_ELEMS} values)")
    if residual is not None:
        check_rows(residual, "residual", (rows, cols), x.device)
    check_eps(eps)
    if config is None:
        block_m, block_h, num_warps = _launch_config(rows, cols)
    else:  # whole rows per program, as the rule's, at least 128 wide
        block_m, block_h, num_warps = check_launch_config(config, "BLOCK_H", max(cols, 128))
    fmt, pair, y = resolve_outputs(rows, cols, x.device, out_format, out, out_bf16, return_bf16)
    # residual is written too (x + residual): no output may share it, nor x or the weight
    check_no_overlap(produced(pair, y), [("x", x), ("weight", weight), ("residual", residual)])
    check_no_overlap([("residual", residual)], [("x", x), ("weight", weight)])
    if rows == 0 or cols == 0:
        return producer_result(y, pair)
    a = launch_args(fmt, pair, y, x)
    res = residual if residual is not None else x
    _rms_norm_kernel[(triton.cdiv(rows, block_m),)](
        x, res, weight, a["y"], a["data"], a["scale"], rows, cols, float(eps),
        x.stride(0), res.stride(0), a["y_stride"], *a["strides"],
        HAS_RESIDUAL=residual is not None, STORE_BF16=a["STORE_BF16"], QUANT=a["QUANT"],
        BLOCK_M=block_m, BLOCK_H=block_h, num_warps=num_warps, **a["consts"], **pdl_options(x.device),
    )
    return producer_result(y, pair)
