"""Parameters that survive weight reloads under captured CUDA graphs.

A captured CUDA graph reads tensors through the device addresses it saw at capture. A reload
that writes new values into the *same* storage is seen by every later replay; one that swaps a
parameter's storage is not (the graph keeps reading the old buffer). ``copy_or_rebind_param``
is the one place that decides which of the two happens, and says so when it has to rebind.
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch import nn

from fp8chain_kernel.formats import check_distinct_elements, overlaps

logger = logging.getLogger(__name__)

__all__ = ["copy_or_rebind_param", "set_param_attrs"]


def set_param_attrs(param: nn.Parameter, **attrs) -> nn.Parameter:
    """Attach loader metadata (``weight_loader``, ``shard_dim``...) to a parameter; returns it."""
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


def copy_or_rebind_param(module: nn.Module, name: str, tensor: torch.Tensor, *,
                         match_strides: bool = False) -> nn.Parameter:
    """Put ``tensor``'s values into ``module.<name>``, keeping its storage whenever possible.

    * ``module.<name>`` is a Parameter of the same shape and dtype: copy in place. The storage
      (``data_ptr``) and the strides stay, so captured CUDA graphs read the new values.
    * a Parameter of another shape or dtype, or with ``match_strides`` of other strides: rebind
      ``.data`` to ``tensor`` (new storage) and log a warning: captured graphs that read it keep
      reading the old storage and must be re-captured. Attributes on the Parameter
      (``weight_loader`` ...) are kept. ``match_strides`` is for tensors whose layout is part of
      their contract (a derived tensor a GEMM reads with padded strides: ``copy.deepcopy`` and
      ``.to()`` of a module make such a padded parameter dense).
    * absent: register ``tensor`` as a new Parameter (``requires_grad=False``), strides as given.

    The last two take ``tensor``'s own storage (no copy), which later reloads write in place, so
    ``tensor`` must own it: a view of another parameter or buffer of the module, or one with
    elements sharing memory (expanded, stride 0) is a ``ValueError``; pass a clone.

    Returns the parameter. A buffer or a non-parameter attribute of that name is a ``TypeError``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    param = module._parameters.get(name)
    if param is not None and param.shape == tensor.shape and param.dtype == tensor.dtype \
            and not (match_strides and param.stride() != tensor.stride()):
        with torch.no_grad():
            param.copy_(tensor)
        return param
    if param is None and (name in module._buffers or name in module.__dict__ or name in module._modules):
        raise TypeError(f"{type(module).__name__}.{name} exists and is not a Parameter")
    _check_owns_storage(module, name, tensor)
    if param is not None:
        logger.warning(
            "%s.%s: rebinding storage (%s %s strides %s -> %s %s strides %s); CUDA graphs captured "
            "reading it are stale and must be re-captured", type(module).__name__, name, param.dtype,
            tuple(param.shape), param.stride(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        param.data = tensor
        return param
    param = nn.Parameter(tensor, requires_grad=False)
    module.register_parameter(name, param)
    return param


def _check_owns_storage(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """``tensor`` may become ``module.<name>``'s storage: a later in-place copy into it must write
    each element once and touch no other parameter or buffer of the module."""
    where = f"{type(module).__name__}.{name}"
    check_distinct_elements(tensor, where)
    for other, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if other != name and t.device == tensor.device and overlaps(t, tensor):
            raise ValueError(f"{where}: the tensor shares memory with {other}, so writing one would "
                             f"overwrite the other; pass a clone")
