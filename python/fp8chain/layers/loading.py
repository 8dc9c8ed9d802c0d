"""Loading (and reloading) named checkpoint tensors into a model or a single layer.

``load_weights`` copies every tensor into its parameter in place (the parameter's
``weight_loader``: sharding, shape and dtype checks) and then runs
``quant_method.process_weights_after_loading`` on every layer that has a ``quant_method`` (a
module's own ``process_weights_after_loading`` where it has none).
Running it again on a live model is a reload: loader targets and derived tensors keep their
storage (``data_ptr``), so CUDA graphs captured before the reload read the new weights.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: torch's element type of packed e2m1 pairs (MXFP4 data), where this torch has one
PACKED_E2M1_DTYPES = tuple(getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n))
#: element types whose bytes a uint8 parameter takes as they are (UE8M0 scales, packed e2m1 pairs)
_BYTE_DTYPES = (torch.float8_e8m0fnu,) + PACKED_E2M1_DTYPES

__all__ = ["PACKED_E2M1_DTYPES", "check_loadable_dtype", "default_weight_loader", "invalidate_processed",
           "load_weights", "process_weights_after_loading"]


def _is_narrow_float(dtype: torch.dtype) -> bool:
    """An 8-bit float (or packed 4-bit pairs): FP8 data in any encoding, or UE8M0 scales."""
    return dtype.is_floating_point and dtype.itemsize == 1


def check_loadable_dtype(param: nn.Parameter, loaded: torch.Tensor, what: str = "checkpoint") -> None:
    """An 8-bit float only into a parameter of its own dtype: FP8 values mean nothing without
    their scales, and an e5m2 or fnuz tensor is not e4m3 (UE8M0 scales, ``float8_e8m0fnu``, may go
    into fp32 ones: the powers of two convert exactly). Integer tensors only into integer
    parameters and back: an int8 / uint8 tensor copied into a float parameter (e.g. UE8M0 scale
    bytes into fp32 scales) would be read as numbers (byte 128, the scale 2.0, would become
    128.0), a float tensor copied into a byte parameter converted by value (an e8m0 scale 2^-4
    would become byte 0, not 123)."""
    narrow = _is_narrow_float(param.dtype) or _is_narrow_float(loaded.dtype)
    exact_scales = loaded.dtype == torch.float8_e8m0fnu and param.dtype == torch.float32
    if (narrow and loaded.dtype != param.dtype and not exact_scales) or (
            param.dtype.is_floating_point != loaded.dtype.is_floating_point):
        raise TypeError(f"{what} dtype {loaded.dtype} cannot be loaded into a {param.dtype} parameter")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``param`` in place; shapes must match (``check_loadable_dtype``). UE8M0
    scales stored as ``float8_e8m0fnu`` and packed e2m1 pairs stored as ``float4_e2m1fn_x2`` go
    into a uint8 parameter as their bytes (the model's own loader takes both)."""
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not match parameter shape "
                         f"{tuple(param.shape)}")
    if loaded.dtype in _BYTE_DTYPES and param.dtype == torch.uint8:
        loaded = loaded.view(torch.uint8)
    check_loadable_dtype(param, loaded)
    with torch.no_grad():
        param.data.copy_(loaded)


def process_weights_after_loading(model: nn.Module) -> int:
    """Run ``process_weights_after_loading`` of every submodule's ``quant_method``, or the
    module's own where it derives tensors itself (the routed experts' bf16 copies); returns the
    number of layers processed. Every module is processed even where one fails (the valid ones
    must not keep tensors derived from earlier weights); the first error is raised at the end."""
    count, errors = 0, []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        try:
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                count += 1
            elif method is None and callable(getattr(module, "process_weights_after_loading", None)):
                module.process_weights_after_loading()
                count += 1
        except Exception as exc:  # noqa: BLE001 - raised below, after the other modules
            errors.append(exc)
    if errors:
        raise errors[0]
    return count


def invalidate_processed(model: nn.Module) -> None:
    """Every processed module of ``model`` refuses to run until it is processed again (a quantized
    layer's ``quant_method.invalidate``, the module's own ``invalidate`` where it derives tensors
    itself): after a load that wrote some tensors and then failed."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            if hasattr(method, "invalidate"):
                method.invalidate(module)
        elif callable(getattr(module, "invalidate", None)):
            module.invalidate()


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                 strict: bool = True) -> set[str]:
    """Load ``(name, tensor)`` pairs (names as in ``model.named_parameters()``), then process.

    Each tensor goes through its parameter's ``weight_loader`` (``default_weight_loader`` when
    the parameter has none), in place. A name with no parameter raises ``KeyError`` when
    ``strict``, else it is logged and skipped. A partial set of tensors is fine (reloading some
    layers); every quantized layer is re-processed, which is idempotent.

    Returns the names loaded.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    skipped: list[str] = []
    try:
        for name, tensor in weights:
            if name in loaded:  # the second copy would silently win
                raise ValueError(f"checkpoint tensor {name!r} is given twice")
            param = params.get(name)
            if param is None:
                if strict:
                    raise KeyError(f"checkpoint tensor {name!r} has no parameter in "
                                   f"{type(model).__name__}")
                skipped.append(name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor)
            loaded.add(name)
    except BaseException:  # an interrupt part-way through a streamed checkpoint too
        if loaded:  # some parameters hold the new checkpoint, the rest the old one
            invalidate_processed(model)
        raise
    if skipped:
        logger.warning("load_weights: skipped %d tensors with no parameter (first: %s)",
                       len(skipped), skipped[0])
    process_weights_after_loading(model)
    return loaded
