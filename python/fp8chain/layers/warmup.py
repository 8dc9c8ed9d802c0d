"""Warmup: run every shape a CUDA graph will capture once, eagerly, before capture.

Triton compiles (and autotunes) a kernel the first time it sees a new specialization (dtypes,
constexprs, which integer arguments are 1 or multiples of 16). Compiling inside
``torch.cuda.graph`` capture fails or captures the compile's own launches, so every linear's
paths are run first at each batch size that will be captured (the producers register none: the
graph runner's eager run of each bucket compiles them).

Layers register a provider when their weights are processed (so a reload re-registers it):

    register_warmup(module, fn, key="default")
    fn(module, rows: int, fill: str, capacity: int) -> [(what, output tensor), ...]

``fn`` runs the module's paths for ``rows`` rows of input filled with ``fill`` (``"zeros"`` or
``"random"``) and returns, for each path it ran, a short description and the tensor it produced.
``capacity`` is the largest batch size being warmed: a graph runner captures every batch size
on row-slices of buffers allocated for that many rows, so paths whose kernels read strides
should also run on such slices. ``fn`` takes the module as an argument (rather than closing
over it), so a deep-copied model warms its own copy.
All-zero inputs are always part of a warmup: zero rows are where scale derivation and packing
break (a zero amax must still give a finite, valid power-of-two scale), and ``warmup`` checks
that every output is finite, so such a failure surfaces here rather than as NaN in a replay.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable

import torch
from torch import nn

from fp8chain_kernel.formats import is_int

logger = logging.getLogger(__name__)

__all__ = ["WarmupRun", "register_warmup", "warmup_providers", "warmup", "linear_warmup",
           "make_input"]

_ATTR = "_fp8chain_warmup"
FILLS = ("zeros", "random")

WarmupFn = Callable[[nn.Module, int, str, int], "list[tuple[str, torch.Tensor]]"]


@dataclasses.dataclass(frozen=True)
class WarmupRun:
    """One path run by ``warmup``."""

    module: str  # qualified name inside the warmed module ("" for the root)
    key: str     # provider key
    what: str    # the path, e.g. "bf16 -> quantize sm90_g32_fp32_mn -> triton gemm"
    rows: int
    fill: str


def register_warmup(module: nn.Module, fn: WarmupFn, key: str = "default") -> None:
    """Register (or replace) ``module``'s warmup provider under ``key``."""
    providers = module.__dict__.setdefault(_ATTR, {})
    providers[key] = fn


def warmup_providers(module: nn.Module) -> list[tuple[str, str, WarmupFn]]:
    """``(qualified name, key, fn)`` of every provider in ``module`` and its submodules."""
    found = []
    for name, sub in module.named_modules():
        for key, fn in sub.__dict__.get(_ATTR, {}).items():
            found.append((name, key, fn))
    return found


def make_input(rows: int, cols: int, fill: str, *, dtype=torch.bfloat16, device=None) -> torch.Tensor:
    """A warmup input: all zeros, or standard-normal values."""
    if fill == "zeros":
        return torch.zeros(rows, cols, dtype=dtype, device=device)
    if fill == "random":
        return torch.randn(rows, cols, device=device).to(dtype)
    raise ValueError(f"unknown warmup fill {fill!r}; expected one of {FILLS}")


@torch.no_grad()
def warmup(module: nn.Module, batch_sizes: Iterable[int], *, fills: Iterable[str] = FILLS) -> list[WarmupRun]:
    """Run every registered provider at every batch size and fill; return what ran.

    ``"zeros"`` is always included. Raises ``RuntimeError`` naming the module, path, rows and
    fill when an output is not finite (e.g. zero rows producing NaN scales).
    """
    batch_sizes = list(batch_sizes)
    if any(not is_int(b) or b < 0 for b in batch_sizes):
        raise ValueError(f"batch sizes must be ints >= 0, got {batch_sizes}")
    sizes = sorted(set(batch_sizes))
    fills = list(dict.fromkeys(["zeros", *fills]))
    runs: list[WarmupRun] = []
    providers = warmup_providers(module)
    subs = dict(module.named_modules())
    capacity = max(sizes, default=0)
    for rows in sizes:
        for fill in fills:
            for name, key, fn in providers:
                for what, out in fn(subs[name], rows, fill, capacity):
                    tensors = [out] if isinstance(out, torch.Tensor) else list(out)
                    for t in tensors:
                        if t.is_floating_point() and not torch.isfinite(t).all():
                            raise RuntimeError(
                                f"warmup: {name or type(module).__name__} [{what}] produced "
                                f"non-finite values for {rows} rows of {fill} input")
                    runs.append(WarmupRun(name, key, what, rows, fill))
    if any(p.is_cuda for p in module.parameters()):
        torch.cuda.synchronize()
    logger.info("warmup: %d paths over batch sizes %s", len(runs), sizes)
    return runs


def linear_warmup(layer, rows: int, fill: str, capacity: int) -> list[tuple[str, torch.Tensor]]:
    """A linear's paths: bf16 input (quantized by the layer), and, when the layer publishes an
    ``input_format``, a pre-quantized pair both freshly allocated and as a row-slice of a
    ``capacity``-row buffer (a graph runner's static buffer keeps the larger scale stride)."""
    from fp8chain_kernel.formats import empty_pair
    from fp8chain_kernel.quant import quantize

    weight = layer.weight
    k = layer.input_size_per_partition
    x = make_input(rows, k, fill, device=weight.device)
    ran = [(f"bf16 -> {type(layer.quant_method).__name__}", layer(x))]
    fmt = layer.input_format
    if fmt is not None:
        pair = quantize(x, fmt)
        ran.append((f"pair {fmt.value}", layer(pair)))
        if capacity > rows:
            big = empty_pair(capacity, k, fmt, weight.device)
            sliced = quantize(x, fmt, out=big.rows(rows))
            ran.append((f"pair {fmt.value} (rows of a {capacity}-row buffer)", layer(sliced)))
    return ran
