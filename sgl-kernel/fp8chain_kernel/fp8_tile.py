"""Triton device functions every FP8 producer shares: quantize a tile, store its scales.

These are the Triton twin of ``reference.quantize_groups`` (same amax, same exponent bit
arithmetic, same two fp32 divisions, the clamp as the conversion's saturation), so any kernel
that calls ``quantize_tile`` on its bf16-rounded output writes bytes and scales equal to
``reference.quantize`` of that output.

fp32 -> e4m3: compiled for a GPU, the native conversion (``cvt.rn.satfinite``) is used. The Triton
CPU interpreter's native conversion is wrong for a few percent of values (triton issue #8322), so
under the interpreter the conversion is done with integer bit operations (round to nearest even,
saturate, NaN -> 0x7F), which matches torch byte for byte. See docs/formats.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .formats import ActFormat


def interpreting() -> bool:
    """True when Triton kernels run on the CPU interpreter: ``TRITON_INTERPRET`` set to what Triton
    reads as true (1, true, on, yes), as Triton itself decides it."""
    return bool(triton.knobs.runtime.interpret)


def format_constexprs(fmt: ActFormat) -> dict:
    """Compile-time arguments a kernel needs to write ``fmt`` (pass with ``**``)."""
    return dict(GROUP=fmt.group_size, POW2=fmt.pow2_scales, PACKED=fmt.packed,
                EXACT_CAST=interpreting())


@triton.jit
def cast_to_e4m3(x, EXACT_CAST: tl.constexpr):
    """fp32 tile -> float8e4nv tile, round to nearest even, saturating, NaN kept."""
    if EXACT_CAST:
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        finite_mag = tl.minimum(mag, 0x7F800000)
        # Normal e4m3 (|x| >= 2^-6): keep 3 mantissa bits (round half to even), rebias 127 -> 7.
        normal = ((finite_mag + 0x7FFFF + ((finite_mag >> 20) & 1)) >> 20) - (120 << 3)
        normal = tl.minimum(normal, 0x7E)
        # Subnormal e4m3: |x| * 2^9 rounded half to even to an integer.
        shift = tl.minimum(tl.maximum(141 - (finite_mag >> 23), 21), 31)
        mantissa = (finite_mag & 0x7FFFFF) | 0x800000
        whole = mantissa >> shift
        rest = mantissa & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        sub = whole + ((rest > half) | ((rest == half) & ((whole & 1) == 1))).to(tl.int32)
        code = tl.where(finite_mag < (121 << 23), sub, normal)
        code = tl.where(mag > 0x7F800000, 0x7F, code) | sign
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def e4m3_to_f32_exact(x):
    """e4m3fn -> fp32 as the GPU converts, for the interpreter, whose native conversion reads the
    NaN code 0x7F as 480."""
    code = x.to(tl.uint8, bitcast=True)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), x.to(tl.float32))


@triton.jit
def dequantize_tile(x, scales, ROWS: tl.constexpr, SUB: tl.constexpr, GROUP: tl.constexpr, EXACT_CAST: tl.constexpr):
    """e4m3 ``[ROWS, SUB * GROUP]`` tile times its fp32 ``[ROWS, SUB]`` group scales, rounded to bf16
    once: ``bf16(x * scale)`` per element, exact for power-of-two scales (an e4m3 value times 2^e
    is a bf16 value), so a bf16 copy dequantized the same way holds the very same values."""
    if EXACT_CAST:
        xf = e4m3_to_f32_exact(x)
    else:
        xf = x.to(tl.float32)
    return round_bf16(tl.reshape(tl.reshape(xf, (ROWS, SUB, GROUP)) * scales[:, :, None], (ROWS, SUB * GROUP)),
                      EXACT_CAST)


@triton.jit
def dot_bf16(a, b, acc, EXACT_CAST: tl.constexpr):
    """``acc + a @ b`` for bf16 tiles, fp32 accumulation on the tensor cores.

    The Triton CPU interpreter's bf16 ``tl.dot`` is wrong (it takes the operands as raw 16-bit
    integers); there the operands are upcast first, which is the same math (bf16 products are
    exact in fp32).
    """
    if EXACT_CAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def rms_rstd(sum_sq, n, eps):
    """RMSNorm's ``1 / sqrt(sum_sq / n + eps)`` in fp32 (the square root correctly rounded; the
    divisions, compiled, as Triton divides), the one
    expression ``norm.rms_norm`` and the attention's q and kv norms share, so they round alike.
    The mHC boundary keeps ``reference.mhc``'s own rounding instead (``mhc._rms_scale``).
    A sum of squares past fp32's range (an RMS above ~2.6e17 at 5120 columns) gives NaN: its
    ``1 / sqrt`` would be 0, normalising a finite row to zeros, silently wrong."""
    return tl.where(sum_sq < float("inf"), 1.0 / tl.sqrt_rn(sum_sq / n + eps), float("nan"))


@triton.jit
def add_rn(a, b, EXACT_CAST: tl.constexpr):
    """fp32 ``a + b``, rounded once, as its own operation: a chain of ``add_rn`` sums in the order
    written, which a bitwise contract with a torch reference needs.

    Compiled, the sum is one inline ``add.rn.f32`` (PTX: NVIDIA GPUs, which these kernels target),
    an operation no compiler pass reassociates.
    Plain ``+`` chains are not safe: Triton 3.8's LLVM folds ``a*p + b*q + c*r + d*s + e*t``
    (the mHC post) into a vector reduction that adds the terms in another order
    (docs/architecture.md, "Summation order"). The interpreter adds as written.
    """
    if EXACT_CAST:
        return a + b
    else:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def round_bf16(x, EXACT_CAST: tl.constexpr):
    """fp32 tile -> bf16 tile, round to nearest even (NaN kept, overflow to inf).

    Compiled, the native conversion rounds to nearest even (subnormals included, as torch does).
    The Triton CPU interpreter's native conversion truncates and garbles subnormals, so there the
    rounding is done on the fp32 bits and the bf16 bits are their top half.
    """
    if EXACT_CAST:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = tl.where(x == x, bits + 0x7FFF + ((bits >> 16) & 1), bits | 0x400000)
        return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def quantize_tile(y, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                  POW2: tl.constexpr, EXACT_CAST: tl.constexpr):
    """fp32 ``[BLOCK_M, BLOCK_K]`` (masked elements 0) -> (e4m3 tile, fp32 scale per group).

    The scale tile is ``[BLOCK_M, BLOCK_K // GROUP]``.
    """
    grouped = tl.reshape(y, (BLOCK_M, BLOCK_K // GROUP, GROUP))
    mag = tl.abs(grouped)
    if EXACT_CAST:
        # NaN is ignored by amax and kept in the data. Compiled, tl.max lowers to max.f32, which
        # already returns the non-NaN operand; whether the interpreter's reduction does depends
        # on the Triton version (3.6's does), so NaN is dropped here explicitly.
        mag = tl.where(mag == mag, mag, 0.0)
    amax = tl.maximum(tl.max(mag, axis=2), 1e-4)
    if POW2:
        bits = amax.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        exponent = tl.where(bits >= 0x7F800000, 255, exponent)  # amax inf: scale inf, multiplier 0
        scale = (exponent << 23).to(tl.float32, bitcast=True)
        multiplier = (tl.maximum(254 - exponent, 0) << 23).to(tl.float32, bitcast=True)
    else:
        fp8_max = tl.full(amax.shape, 448.0, tl.float32)
        # The interpreter divides in fp64; rounding that to fp32 is still the exactly rounded
        # fp32 quotient (53 >= 2 * 24 + 2), and keeps the multiply below in fp32.
        scale = tl.math.div_rn(amax, fp8_max).to(tl.float32)
        multiplier = tl.math.div_rn(fp8_max, amax).to(tl.float32)
    # The reference's clamp to +-448 is the saturation of cast_to_e4m3 (both paths).
    scaled = grouped * tl.expand_dims(multiplier, 2)
    data = cast_to_e4m3(tl.reshape(scaled, (BLOCK_M, BLOCK_K)), EXACT_CAST)
    return data, scale


@triton.jit
def store_scale_tile(scale_ptr, scale, offs_m, group0, M, num_groups, stride_sm, stride_sg,
                     GROUPS: tl.constexpr, PACKED: tl.constexpr):
    """Store a ``[BLOCK_M, GROUPS]`` scale tile whose first group is ``group0``.

    fp32 formats: one float per group at ``m * stride_sm + j * stride_sg``. Packed UE8M0: byte
    ``j % 4`` of int32 word ``j // 4`` holds group ``j``'s exponent; bytes of groups at or past
    ``num_groups`` (the tail of the last word) are written as zero. Tiles of whole words (``GROUPS``
    and ``group0`` multiples of 4) store words; narrower tiles store bytes, and the program holding
    the last group zeroes the tail bytes.
    """
    offs_g = group0 + tl.arange(0, GROUPS)
    row_ok = offs_m[:, None] < M
    if PACKED:
        exponent = scale.to(tl.int32, bitcast=True) >> 23
        if GROUPS % 4 == 0:
            exponent = tl.where(offs_g[None, :] < num_groups, exponent, 0)
            shifted = tl.reshape(exponent, (exponent.shape[0], GROUPS // 4, 4)) << (tl.arange(0, 4) * 8)[None, None, :]
            words = tl.sum(shifted, axis=2)  # disjoint bytes: the sum is their bitwise or
            offs_w = group0 // 4 + tl.arange(0, GROUPS // 4)
            mask = row_ok & (offs_w[None, :] < (num_groups + 3) // 4)
            tl.store(scale_ptr + offs_m[:, None] * stride_sm + offs_w[None, :] * stride_sg,
                     words.to(tl.int32), mask=mask)
        else:
            byte_ptr = scale_ptr.to(tl.pointer_type(tl.uint8))
            words_m = offs_m.to(tl.int64)[:, None] * stride_sm
            addr = (words_m + (offs_g // 4)[None, :] * stride_sg) * 4 + (offs_g % 4)[None, :]
            tl.store(byte_ptr + addr, exponent.to(tl.uint8), mask=row_ok & (offs_g[None, :] < num_groups))
            tail = num_groups + tl.arange(0, 4)
            tail_ok = row_ok & (tail[None, :] < ((num_groups + 3) // 4) * 4) & (group0 + GROUPS >= num_groups)
            tail_addr = (words_m + (tail // 4)[None, :] * stride_sg) * 4 + (tail % 4)[None, :]
            tl.store(byte_ptr + tail_addr, tl.zeros((offs_m.shape[0], 4), tl.uint8), mask=tail_ok)
    else:
        mask = row_ok & (offs_g[None, :] < num_groups)
        tl.store(scale_ptr + offs_m[:, None] * stride_sm + offs_g[None, :] * stride_sg,
                 scale, mask=mask)


@triton.jit
def fp8_offsets(rows, stride, cols):
    """Offsets ``rows[:, None] * stride + cols[None, :]`` of a tile's FP8 data, declared
    8-contiguous: 8 bytes per thread, as many elements as the 16-byte bf16 loads and stores of the
    same tile. With 16 the compiler gives the FP8 store its own layout and shuffles the tile (or
    the RMSNorm weight) through shared memory to reach it: 16 KiB for a 5120-wide row. The hint
    is set here, on the op that computes the offsets: a hint on a function argument is lost."""
    return tl.max_contiguous(rows * stride + cols[None, :], [1, 8])


@triton.jit
def store_pair_tile(data_ptrs, scale_ptr, y, mask, offs_m, group0, M, num_groups, stride_sm, stride_sg,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, POW2: tl.constexpr,
                    PACKED: tl.constexpr, EXACT_CAST: tl.constexpr):
    """The FP8 epilogue every producer shares: quantize the fp32 tile ``y`` (elements outside
    ``mask`` ignored) and store its data at ``data_ptrs`` and its scales (first group ``group0``).

    The standalone quantize calls ``quantize_tile`` directly: its masked loads are already zero,
    and the select here would cost it registers."""
    data, scale = quantize_tile(tl.where(mask, y, 0.0), BLOCK_M, BLOCK_N, GROUP, POW2, EXACT_CAST)
    tl.store(data_ptrs, data, mask=mask)
    store_scale_tile(scale_ptr, scale, offs_m, group0, M, num_groups, stride_sm, stride_sg,
                     BLOCK_N // GROUP, PACKED)
