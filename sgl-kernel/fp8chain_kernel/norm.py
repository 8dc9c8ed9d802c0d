"""RMSNorm (with optional fused residual add) -> bf16, and in the same launch its FP8 pair.

``rms_norm(x, weight, eps, *, residual=None, out_format=None, out=None, out_bf16=None,
return_bf16=True)``

* ``x``: bf16 ``[T, H]``, unit column stride (any row stride); ``weight``: bf16 ``[H]``, contiguous.
* ``residual`` (optional): bf16 ``[T, H]``, unit column stride. Then ``h = bf16(x + residual)``
  is written back into ``residual`` in place (fused add-norm convention) and normalised;
  otherwise ``h = x``.
* ``y = bf16(h * rsqrt(mean(h^2) + eps) * weight)``, computed in fp32 and rounded once.
* ``out_format`` (an ``ActFormat``): the same launch quantizes the bf16-rounded ``y`` with
  ``fp8_tile.quantize_tile``, so the pair equals ``reference.quantize(y, out_format)`` bit for bit.
* Returns ``y`` (bf16 ``[T, H]``) without ``out_format``; ``(y, pair)`` with it; only ``pair``
  with ``return_bf16=False`` (then no bf16 store happens at all).
* ``out``: a caller-given pair (``[T, H]`` in ``out_format``; its scale column stride is honoured,
  so a row-slice of a buffer captured for more rows works); ``out`` alone implies its format.
  ``out_bf16``: a caller-given bf16 ``[T, H]`` buffer with unit column stride.

The same return convention (and the helpers ``resolve_outputs`` / ``producer_result`` below)
is shared by ``act.silu_mul`` and ``einsum.wo_a_einsum``.

Launch: one kernel. At decode sizes (fewer rows than SMs) and without ``residual``, each row is
split into column slices over several programs, each of which re-reads the whole row for its sum
of squares; otherwise a program owns whole rows (see the notes above ``_rms_norm_kernel``). The
configuration depends on ``T``, ``H`` and whether there is a residual or an output overlapping
``x``, never on ``out_format``: the bf16-only and the FP8-emitting launch of the same rows give
the same ``y`` bit for bit. (The sum of squares uses the same tiles in every configuration; on a
GPU the reduction tree inside a tile follows the warp count, so ``y`` of a split and a whole-row
launch may differ by rounding, within the bound above.)

Errors: ``TypeError`` for a wrong type or dtype or a pair of another format; ``ValueError`` for
a wrong shape, stride or device. ``T = 0`` launches nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .formats import ActFormat, QuantizedActivation
from .fp8_tile import format_constexprs, interpreting, round_bf16, store_pair_tile
from .quant import prepare_out

__all__ = ["rms_norm"]

H200_SMS = 132  # the GPU whose configuration is compiled when there is none (sm90_compile)


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


def check_rows(t: torch.Tensor, name: str, shape: tuple[int, int], device) -> None:
    """A bf16 2-D ``shape`` matrix with unit column stride on ``device``."""
    check_tensor(t, name, torch.bfloat16, 2)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.numel() and t.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride, got strides {t.stride()}")
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
    return fmt, pair, y


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
#
# A program owns BLOCK_M rows. It first loads its rows whole, as two register tiles: a head of
# HEAD columns (the largest power of two <= H, at least 128) and, when H is not a power of two,
# a tail of TAIL columns (the next power of two >= H - HEAD) - 5120 = 4096 + 1024 and
# 1280 = 1024 + 256 leave no lane idle - and sums their squares (the same tiles, hence the same
# fp32 summation order, in every configuration). Then either
#
# * SLICE == 0 (whole rows): it normalises and stores those registers; or
# * SLICE > 0 (split rows, grid axis 1): it normalises only its slice of SLICE columns (a multiple
#   of 128, so FP8 groups and packed scale words never straddle programs), reloading that slice
#   (just read, so from L1/L2) in chunks of BLOCK columns. Every program of a row runs the same
#   code on the same data, so they all get the same rstd bit for bit. Other programs read the
#   whole row while one writes its slice, so this mode is never used with an in-place residual
#   nor with an output that overlaps x (the host checks).
#
# The launch configuration keeps every stored tile at <= 8 values per thread (HEAD / BLOCK vs
# num_warps): the bf16 loads and stores then vectorise to 16 bytes and the FP8 data to 8 bytes
# in one register layout, with no shared-memory layout conversion between them.


@triton.jit
def _load_h(x_ptr, res_ptr, rows, m_ok, offs_h, H, stride_xm, stride_rm,
            HAS_RESIDUAL: tl.constexpr, EXACT_CAST: tl.constexpr):
    """``h`` (``x``, or ``bf16(x + residual)``) of columns ``offs_h``, fp32, 0 where masked."""
    mask = m_ok[:, None] & (offs_h < H)[None, :]
    h = tl.load(x_ptr + rows[:, None] * stride_xm + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_rm + offs_h[None, :], mask=mask, other=0.0)
        h = round_bf16(h + r.to(tl.float32), EXACT_CAST).to(tl.float32)
    return h


@triton.jit
def _row_sum_sq(h, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Per-row sum of squares of a ``[BLOCK_M, BLOCK]`` tile: ``[BLOCK_M, 1]``.

    One row (every GPU configuration) sums to a scalar first: the head and tail sums then add
    without a layout conversion (a per-row vector of each tile's layout makes the compiler
    convert a whole tile instead)."""
    if BLOCK_M == 1:
        return tl.zeros((1, 1), tl.float32) + tl.sum(tl.reshape(h * h, (BLOCK,)), axis=0)
    else:
        return tl.sum(h * h, axis=1, keep_dims=True)


@triton.jit
def _store_tile(h, rstd, h0, offs_m, rows, m_ok, M, H, w_ptr, res_ptr, y_ptr, data_ptr, scale_ptr,
                stride_rm, stride_ym, stride_dm, stride_sm, stride_sg,
                STORE_RESIDUAL: tl.constexpr, STORE_BF16: tl.constexpr, QUANT: tl.constexpr,
                GROUP: tl.constexpr, POW2: tl.constexpr, PACKED: tl.constexpr, EXACT_CAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Normalise the ``[BLOCK_M, BLOCK]`` tile ``h`` of columns ``h0..`` and store its outputs."""
    offs_h = h0 + tl.arange(0, BLOCK)
    h_ok = offs_h < H
    mask = m_ok[:, None] & h_ok[None, :]
    if STORE_RESIDUAL:  # h is a bf16 value: the cast is exact
        tl.store(res_ptr + rows[:, None] * stride_rm + offs_h[None, :], h.to(tl.bfloat16), mask=mask)
    w = tl.load(w_ptr + offs_h[None, :], mask=h_ok[None, :], other=0.0).to(tl.float32)
    yb = round_bf16(h * rstd * w, EXACT_CAST)
    if STORE_BF16:
        tl.store(y_ptr + rows[:, None] * stride_ym + offs_h[None, :], yb, mask=mask)
    if QUANT:
        store_pair_tile(data_ptr + rows[:, None] * stride_dm + offs_h[None, :], scale_ptr, yb.to(tl.float32), mask,
                        offs_m, h0 // GROUP, M, tl.cdiv(H, GROUP), stride_sm, stride_sg,
                        BLOCK_M, BLOCK, GROUP, POW2, PACKED, EXACT_CAST)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, data_ptr, scale_ptr, M, H, eps,
                     stride_xm, stride_rm, stride_ym, stride_dm, stride_sm, stride_sg,
                     HAS_RESIDUAL: tl.constexpr, STORE_BF16: tl.constexpr, QUANT: tl.constexpr,
                     GROUP: tl.constexpr, POW2: tl.constexpr, PACKED: tl.constexpr,
                     EXACT_CAST: tl.constexpr, BLOCK_M: tl.constexpr, HEAD: tl.constexpr,
                     TAIL: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr):
    tl.static_assert(SLICE == 0 or not HAS_RESIDUAL, "split rows cannot update the residual in place")
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    rows = offs_m.to(tl.int64)
    # The whole rows' sum of squares: head tile, then tail tile (same order in every configuration).
    h_head = _load_h(x_ptr, res_ptr, rows, m_ok, tl.arange(0, HEAD), H, stride_xm, stride_rm,
                     HAS_RESIDUAL, EXACT_CAST)
    sum_sq = _row_sum_sq(h_head, BLOCK_M, HEAD)
    if TAIL > 0:
        h_tail = _load_h(x_ptr, res_ptr, rows, m_ok, HEAD + tl.arange(0, TAIL), H, stride_xm, stride_rm,
                         HAS_RESIDUAL, EXACT_CAST)
        sum_sq += _row_sum_sq(h_tail, BLOCK_M, TAIL)
    mean_sq = sum_sq / H
    rstd = 1.0 / tl.sqrt_rn(mean_sq + eps)
    if SLICE == 0:
        _store_tile(h_head, rstd, 0, offs_m, rows, m_ok, M, H, w_ptr, res_ptr, y_ptr, data_ptr, scale_ptr,
                    stride_rm, stride_ym, stride_dm, stride_sm, stride_sg, HAS_RESIDUAL, STORE_BF16, QUANT,
                    GROUP, POW2, PACKED, EXACT_CAST, BLOCK_M, HEAD)
        if TAIL > 0:
            _store_tile(h_tail, rstd, HEAD, offs_m, rows, m_ok, M, H, w_ptr, res_ptr, y_ptr, data_ptr,
                        scale_ptr, stride_rm, stride_ym, stride_dm, stride_sm, stride_sg, HAS_RESIDUAL,
                        STORE_BF16, QUANT, GROUP, POW2, PACKED, EXACT_CAST, BLOCK_M, TAIL)
    else:
        h_begin = tl.program_id(1) * SLICE
        for i in tl.static_range(0, SLICE, BLOCK):
            h = _load_h(x_ptr, res_ptr, rows, m_ok, h_begin + i + tl.arange(0, BLOCK), H, stride_xm,
                        stride_rm, HAS_RESIDUAL, EXACT_CAST)
            _store_tile(h, rstd, h_begin + i, offs_m, rows, m_ok, M, H, w_ptr, res_ptr, y_ptr, data_ptr,
                        scale_ptr, stride_rm, stride_ym, stride_dm, stride_sm, stride_sg, False, STORE_BF16,
                        QUANT, GROUP, POW2, PACKED, EXACT_CAST, BLOCK_M, BLOCK)


@functools.lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    """SMs of the GPU a launch runs on; an H200's 132 when compiling without one (sm90_compile)."""
    if device.type == "cuda":
        return _device_sms(device.index if device.index is not None else torch.cuda.current_device())
    return H200_SMS


def _row_tiles(cols: int) -> tuple[int, int]:
    """(HEAD, TAIL): the register tiles that hold a row of ``cols`` (TAIL 0: none)."""
    head = max(128, 1 << (cols.bit_length() - 1))
    tail = max(128, triton.next_power_of_2(cols - head)) if cols > head else 0
    return head, tail


def _launch_config(rows: int, cols: int, split_ok: bool, device: torch.device) -> dict:
    """Rows per program, row tiles, column slice, chunk, warps and grid of one launch.

    GPU: one row per program. While the rows alone give fewer programs than SMs (decode) and
    ``split_ok``, each row is split into slices (multiples of 128 columns) so that there are about
    two programs per SM, with 4 warps (more past H = 8191, so the whole-row read stays at <= 32
    values per thread). Otherwise whole rows, with warps so that the head tile is
    8 values per thread (H = 5120: 16 warps, H = 1280: 4). The CPU interpreter's cost is per
    program: up to 64 rows per program there, and splits aimed at a 16-program grid.
    """
    head, tail = _row_tiles(cols)
    if interpreting():
        block_m, sms = min(64, triton.next_power_of_2(rows)), 8
    else:
        block_m, sms = 1, _num_sms(device)
    row_blocks = triton.cdiv(rows, block_m)
    n128 = triton.cdiv(cols, 128)
    splits = min(n128, triton.cdiv(2 * sms, row_blocks)) if split_ok and row_blocks < sms else 1
    if splits > 1:
        slice_ = triton.cdiv(n128, splits) * 128
        block = 128
        while block < 1024 and slice_ % (2 * block) == 0:
            block *= 2
        return dict(grid=(row_blocks, triton.cdiv(cols, slice_)), BLOCK_M=block_m, HEAD=head, TAIL=tail,
                    SLICE=slice_, BLOCK=block, num_warps=max(4, min(16, head // 1024)))
    num_warps = max(4, min(16, block_m * head // 256))
    return dict(grid=(row_blocks, 1), BLOCK_M=block_m, HEAD=head, TAIL=tail, SLICE=0, BLOCK=head,
                num_warps=num_warps)


def _span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, residual: torch.Tensor | None = None,
             out_format: ActFormat | str | None = None, out: QuantizedActivation | None = None,
             out_bf16: torch.Tensor | None = None, return_bf16: bool = True):
    """RMSNorm of ``x [T, H]`` bf16 (optionally after ``residual += x`` in place); see the module
    docstring for shapes, layouts, numerics and the return convention."""
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
    if residual is not None:
        check_rows(residual, "residual", (rows, cols), x.device)
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    fmt, pair, y = resolve_outputs(rows, cols, x.device, out_format, out, out_bf16, return_bf16)
    if rows == 0 or cols == 0:
        return producer_result(y, pair)
    a = launch_args(fmt, pair, y, x)
    # Split rows read the whole of x while other programs write: only without an in-place
    # residual and with outputs apart from x.
    outputs = [t for t in (y, *(pair or ())) if t is not None]
    split_ok = residual is None and not any(_overlaps(t, x) for t in outputs)
    cfg = _launch_config(rows, cols, split_ok, x.device)
    res = residual if residual is not None else x
    _rms_norm_kernel[cfg.pop("grid")](
        x, res, weight, a["y"], a["data"], a["scale"], rows, cols, float(eps),
        x.stride(0), res.stride(0), a["y_stride"], *a["strides"],
        HAS_RESIDUAL=residual is not None, STORE_BF16=a["STORE_BF16"], QUANT=a["QUANT"],
        **cfg, **a["consts"],
    )
    return producer_result(y, pair)
