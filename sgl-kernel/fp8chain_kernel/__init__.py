"""fp8chain kernels: FP8 activation formats, producers that write them, GEMMs that read them."""

from .formats import (
    AMAX_FLOOR, FP8_DTYPE, FP8_MAX, ActFormat, QuantizedActivation, align4, check_pair, empty_pair,
)

__all__ = [
    "AMAX_FLOOR", "FP8_DTYPE", "FP8_MAX", "ActFormat", "QuantizedActivation", "align4",
    "check_pair", "empty_pair",
]
