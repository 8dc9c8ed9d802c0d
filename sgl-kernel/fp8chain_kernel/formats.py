"""Activation formats: the contract between an FP8 producer and the GEMM that reads it.

Every layout is stated once, here. For an activation of ``rows x cols``:

* data: ``float8_e4m3fn [rows, cols]``, unit column stride (row stride >= cols).
* ``SM90_G32_FP32_MN`` / ``SM90_G128_FP32_MN``: ``float32 [rows, ceil(cols/g)]``, MN-major,
  strides ``(1, S)`` with ``S >= align4(rows)`` and ``S % 4 == 0`` (element ``(m, j)`` at
  ``j * S + m``; a freshly allocated buffer has ``S = align4(rows)``, a row-slice of a buffer
  captured for more rows keeps the larger ``S``).
* ``SM100_G32_UE8M0_PACKED_MN``: ``int32 [rows, ceil(cols/128)]``, strides ``(1, S)`` as above;
  byte ``j % 4`` (little-endian) of word ``j // 4`` is the UE8M0 exponent of group ``j``
  (value ``2^(byte - 127)``); bytes past ``ceil(cols/32)`` are zero.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_int(value) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` passes ``isinstance(value, int)``): the check
    behind every count argument (splits, iterations, tile sizes)."""
    return isinstance(value, int) and not isinstance(value, bool)


def powers_of_two(scale: torch.Tensor) -> torch.Tensor:
    """Elementwise: the fp32 ``scale`` is a positive, finite power of two (what a UE8M0 byte holds
    exactly, and what scales a bf16 value without rounding)."""
    if scale.dtype != torch.float32:  # the test reads the fp32 bit pattern
        raise TypeError(f"scales must be float32, got {scale.dtype}")
    return ((scale.contiguous().view(torch.int32) & 0x7FFFFF) == 0) & (scale > 0) & torch.isfinite(scale)


def align4(rows: int) -> int:
    """Rows rounded up to 4: 16-byte alignment of a column of 4-byte scales (TMA)."""
    return cdiv(rows, 4) * 4


def holds_padded_scale_rows(scale: torch.Tensor) -> bool:
    """Whether an MN-major scale tensor's storage reaches align4(rows) rows in every column (a
    buffer ``empty_pair`` allocates does; one made by ``torch.empty_strided`` may end at the last
    row), so a consumer may read those padding rows."""
    rows, cols = scale.shape
    spans = (cols - 1) * scale.stride(1) + align4(rows)
    return scale.untyped_storage().nbytes() // scale.element_size() - scale.storage_offset() >= spans


class ActFormat(str, enum.Enum):
    """One activation format: group size along K, scale encoding and scale layout."""

    SM90_G32_FP32_MN = "sm90_g32_fp32_mn"
    SM90_G128_FP32_MN = "sm90_g128_fp32_mn"
    SM100_G32_UE8M0_PACKED_MN = "sm100_g32_ue8m0_packed_mn"

    @property
    def group_size(self) -> int:
        return 128 if self is ActFormat.SM90_G128_FP32_MN else 32

    @property
    def pow2_scales(self) -> bool:
        """Scales are exact powers of two (UE8M0 semantics)."""
        return self is not ActFormat.SM90_G128_FP32_MN

    @property
    def packed(self) -> bool:
        """Scales are UE8M0 bytes, four per int32 word."""
        return self is ActFormat.SM100_G32_UE8M0_PACKED_MN

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.int32 if self.packed else torch.float32

    def num_groups(self, cols: int) -> int:
        return cdiv(cols, self.group_size)

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        groups = self.num_groups(cols)
        return (rows, cdiv(groups, 4) if self.packed else groups)

    def __str__(self) -> str:
        return self.value


class _DataScale(NamedTuple):
    data: torch.Tensor
    scale: torch.Tensor


class QuantizedActivation(_DataScale):
    """FP8 data plus scales in ``fmt``.

    A NamedTuple of ``(data, scale)`` carrying ``fmt`` as an attribute, so code written for
    upstream's plain tuples keeps working: ``fp8, scale = pair``. Each pair is an instance of
    its format's subclass (``QuantizedActivation.SM90_G32_FP32_MN``, ...), which carries ``fmt``:
    code that rebuilds a NamedTuple from its fields, ``type(pair)(data, scale)`` (torch's pytree:
    ``tree_map``, ``torch.compile``), keeps the format.
    """

    fmt: ActFormat  # each format's subclass sets it

    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, fmt: ActFormat | str | None = None):
        if fmt is None:
            if cls is QuantizedActivation:
                raise TypeError("a QuantizedActivation needs its format: QuantizedActivation(data, scale, fmt)")
            fmt = cls.fmt
        return super().__new__(getattr(QuantizedActivation, ActFormat(fmt).name), data, scale)

    @classmethod
    def _make(cls, iterable):
        data, scale = iterable
        return cls(data, scale)

    def __getnewargs__(self):
        return (self.data, self.scale, self.fmt)

    def __repr__(self) -> str:
        return (f"QuantizedActivation(data={tuple(self.data.shape)} {self.data.dtype}, "
                f"scale={tuple(self.scale.shape)} {self.scale.dtype}, fmt={self.fmt.value})")

    def _replace(self, **changes) -> "QuantizedActivation":
        fields = {"data": self.data, "scale": self.scale, "fmt": self.fmt, **changes}
        return QuantizedActivation(fields["data"], fields["scale"], fields["fmt"])

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def rows(self, count: int) -> "QuantizedActivation":
        """The first ``count`` rows (views; the scale keeps its column stride), ``0 <= count <= rows``
        (a slice would silently give fewer rows past the end, or drop rows for a negative count)."""
        if not is_int(count) or not 0 <= count <= self.data.shape[0]:
            raise ValueError(f"rows(count) takes an int in 0..{self.data.shape[0]}, got {count!r}")
        return QuantizedActivation(self.data[:count], self.scale[:count], self.fmt)


for _fmt in ActFormat:  # one subclass per format (pickle finds them by their qualified names)
    _pair_type = type(_fmt.name, (QuantizedActivation,), {"fmt": _fmt, "__slots__": (), "__module__": __name__,
                                                          "__qualname__": f"QuantizedActivation.{_fmt.name}"})
    setattr(QuantizedActivation, _fmt.name, _pair_type)
del _fmt, _pair_type


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[first, last + 1)`` a tensor's elements lie in."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of ``a`` and ``b`` intersect (interleaved views of one buffer count
    as overlapping: a kernel's output must not share a range with what it reads)."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def check_no_overlap(outputs, inputs) -> None:
    """No ``(name, tensor)`` of ``outputs`` overlaps one of ``inputs`` (None entries skipped):
    a launch's programs write their outputs while others still read the inputs."""
    for out_name, out in outputs:
        for in_name, t in inputs:
            if out is not None and t is not None and overlaps(out, t):
                raise ValueError(f"{out_name} overlaps {in_name}: a launch's programs write one while "
                                 f"others still read or write the other, so they must not share memory")


def check_disjoint(outputs) -> None:
    """No two ``(name, tensor)`` of ``outputs`` (None entries skipped) share memory: one launch
    writes them all, so an overlap leaves whichever store lands last."""
    for index, (name, t) in enumerate(outputs):
        check_no_overlap([(name, t)], outputs[index + 1:])


def pair_parts(pair, name: str = "out") -> list:
    """``[(name.data, data), (name.scale, scale)]`` of a pair, ``[]`` for None: the named tensors
    the overlap checks take."""
    return [] if pair is None else [(f"{name}.data", pair.data), (f"{name}.scale", pair.scale)]


def check_distinct_elements(t: torch.Tensor, name: str) -> None:
    """An output's elements are distinct memory (no expanded or self-overlapping view): sorted by
    stride, each dimension steps past the span of the ones before it."""
    span = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride < span:
            raise ValueError(f"{name} has elements sharing memory (shape {tuple(t.shape)}, strides "
                             f"{t.stride()}): an output needs one location per element")
        span += (size - 1) * stride


def empty_scale(rows: int, cols: int, fmt: ActFormat, device, zero: bool = False) -> torch.Tensor:
    """Scale buffer of ``fmt``: a row-major ``[cols_of_scales, align4(rows)]`` allocation viewed
    transposed, so the padding rows are part of the storage (all zero with ``zero``)."""
    scale_cols = fmt.scale_shape(rows, cols)[1]
    allocate = torch.zeros if zero else torch.empty
    return allocate((scale_cols, align4(rows)), dtype=fmt.scale_dtype, device=device).t()[:rows]


def empty_pair(rows: int, cols: int, fmt: ActFormat | str, device=None) -> QuantizedActivation:
    """Producer out-buffers with the exact dtypes, shapes and strides of ``fmt``."""
    fmt = ActFormat(fmt)
    data = torch.empty((rows, cols), dtype=FP8_DTYPE, device=device)
    return QuantizedActivation(data, empty_scale(rows, cols, fmt, device), fmt)


def check_pair(pair, fmt: ActFormat | str | None = None) -> QuantizedActivation:
    """Validate a pair against its own format (and ``fmt`` if given); return it.

    Raises ``TypeError`` for a wrong type, dtype or format and ``ValueError`` for a wrong
    shape, stride or device, each naming what was expected and what came.
    """
    if not isinstance(pair, QuantizedActivation):
        raise TypeError(f"expected a QuantizedActivation, got {type(pair).__name__}")
    data, scale, own = pair.data, pair.scale, pair.fmt
    if not isinstance(data, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise TypeError(f"pair data and scale must be tensors, got {type(data).__name__} / {type(scale).__name__}")
    if not isinstance(own, ActFormat):
        raise TypeError(f"pair.fmt must be an ActFormat, got {own!r}")
    if fmt is not None and ActFormat(fmt) is not own:
        raise TypeError(f"consumer reads {ActFormat(fmt).value}, got a pair in {own.value}")
    if data.dtype != FP8_DTYPE:
        raise TypeError(f"pair data must be {FP8_DTYPE}, got {data.dtype}")
    if scale.dtype != own.scale_dtype:
        raise TypeError(f"{own.value} scales must be {own.scale_dtype}, got {scale.dtype}")
    if data.dim() != 2:
        raise ValueError(f"pair data must be 2-D [rows, cols], got shape {tuple(data.shape)}")
    if data.device != scale.device:
        raise ValueError(f"pair data on {data.device} but scales on {scale.device}")
    rows, cols = data.shape
    expected = own.scale_shape(rows, cols)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{own.value} scales for data {rows}x{cols} must have shape {expected}, "
            f"got {tuple(scale.shape)}"
        )
    if data.numel() and (data.stride(1) != 1 or data.stride(0) < cols):
        raise ValueError(f"pair data must be row-major with unit column stride, got strides {data.stride()}")
    if scale.numel():
        row_stride, col_stride = scale.stride()
        # one scale column too: consumers address the scales with S (DeepGEMM's TMA with align4(rows))
        if row_stride != 1 or col_stride < align4(rows) or col_stride % 4:
            raise ValueError(
                f"{own.value} scales must be MN-major with strides (1, S), S >= align4(rows)="
                f"{align4(rows)} and S % 4 == 0, got strides {scale.stride()}"
            )
    return pair
