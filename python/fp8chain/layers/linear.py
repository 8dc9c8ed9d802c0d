"""Linear layers with SGLang's names and hooks: ``LinearBase`` and its tensor-parallel variants.

A layer owns its parameters; *how* they are created, prepared after loading and applied is its
``quant_method`` (``UnquantizedLinearMethod`` for bf16 weights, ``Fp8LinearMethod`` for FP8
block-quantized checkpoints). The producer -> consumer protocol (docs/layers.md):

1. construction: a model sets ``layer.deepgemm_mxfp8_input = True`` on a linear that follows an
   FP8-capable producer (the request; upstream's attribute name);
2. load: ``quant_method.process_weights_after_loading(layer)`` honours the request or refuses it
   with a logged reason, and sets ``layer.input_format`` (the ``ActFormat`` a producer writes);
3. forward: ``layer(pair)`` with a ``QuantizedActivation`` in ``layer.input_format`` goes
   straight to the GEMM; ``layer(bf16)`` quantizes first (the unchained path).

Tensor parallelism: ``ColumnParallelLinear`` shards N, ``RowParallelLinear`` shards K across
``tp_size`` ranks (and sums the ranks' partial products with an all-reduce over ``tp_group``,
``torch.distributed``). ``MergedColumnParallelLinear`` holds several column-parallel outputs in one
weight (gate and up) and shards each of them. Each parameter's ``weight_loader`` accepts a
checkpoint tensor either full (narrowed to this rank's shard) or already sharded, and copies it
into the existing storage.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import nn

from fp8chain_kernel.formats import ActFormat, QuantizedActivation, is_int

from .loading import check_loadable_dtype
from .parameter import set_param_attrs

logger = logging.getLogger(__name__)

__all__ = [
    "LinearMethodBase", "UnquantizedLinearMethod", "LinearBase", "ReplicatedLinear",
    "ColumnParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear", "divide", "check_tp",
    "check_dense_input",
]

# What the dense (bf16) path computes on: F.linear here, the activation quantizer in the FP8 method.
_DENSE_DTYPES = (torch.bfloat16, torch.float32)


def check_tp(tp_rank: int, tp_size: int) -> None:
    """``ValueError`` unless ``tp_size >= 1`` and ``0 <= tp_rank < tp_size`` (ints)."""
    if not (isinstance(tp_size, int) and isinstance(tp_rank, int)) or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"invalid tensor-parallel rank {tp_rank!r} of size {tp_size!r}")


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def check_dense_input(layer: "LinearBase", x) -> None:
    """``x`` is a bf16/fp32 tensor ``[..., K]`` for ``layer``'s weight ``[N, K]``: ``TypeError`` /
    ``ValueError`` naming what came otherwise (an FP8 or int tensor would be cast, not decoded)."""
    name = layer.display_name
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a bfloat16 or float32 tensor, got {type(x).__name__}")
    if x.dtype not in _DENSE_DTYPES:
        raise TypeError(f"{name}: expected a bfloat16 or float32 tensor, got {x.dtype}")
    k = layer.weight.shape[1]
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"{name}: input shape {tuple(x.shape)} does not end in the weight's K={k}")


class LinearMethodBase:
    """How a linear layer's weights are created, prepared after loading and applied."""

    def create_weights(self, layer: "LinearBase", input_size_per_partition: int,
                       output_size_per_partition: int, params_dtype: torch.dtype,
                       device=None) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Called after every (re)load; must be idempotent and keep derived storages."""

    def apply(self, layer: "LinearBase", x) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethodBase):
    """bf16 (``params_dtype``) weights and ``F.linear``; a pre-quantized input is refused."""

    def create_weights(self, layer, input_size_per_partition, output_size_per_partition,
                       params_dtype, device=None):
        weight = nn.Parameter(
            torch.zeros(output_size_per_partition, input_size_per_partition, dtype=params_dtype,
                        device=device), requires_grad=False)
        set_param_attrs(weight, shard_dim=layer.weight_shard_dim, weight_loader=layer.weight_loader)
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer):
        if layer.deepgemm_mxfp8_input:
            logger.info("%s: unquantized layer (bf16 weights); keeping bf16 input", layer.display_name)
        layer.deepgemm_mxfp8_input = False
        layer.input_format = None
        from .warmup import linear_warmup, register_warmup
        register_warmup(layer, linear_warmup)

    def apply(self, layer, x):
        if isinstance(x, QuantizedActivation):
            raise TypeError(f"{layer.display_name} reads bf16 input (unquantized layer), "
                            f"got a pair in {x.fmt.value}")
        check_dense_input(layer, x)
        weight = layer.weight
        return F.linear(x.to(weight.dtype), weight, layer.forward_bias)


class LinearBase(nn.Module):
    """A linear ``y = x W^T (+ b)`` with ``W [output_size, input_size]`` split over ``tp_size``.

    Attributes:
        deepgemm_mxfp8_input: the request for a pre-quantized input (set before loading); after
            ``process_weights_after_loading`` it is True only if the request was honoured.
        input_format: the ``ActFormat`` a producer should write for this layer, or None (not
            requested, refused, or weights not processed yet).
        quant_method: creates, prepares and applies the weights.
    """

    weight_shard_dim: int | None = None  # which dim of weight (and its block scales) is sharded

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False,
                 quant_config=None, prefix: str = "", tp_rank: int = 0, tp_size: int = 1,
                 params_dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        check_tp(tp_rank, tp_size)
        if params_dtype not in _DENSE_DTYPES:  # an unquantized layer's weights, any layer's bias
            raise TypeError(f"{prefix or type(self).__name__}: params_dtype (an unquantized layer's weights, the "
                            f"bias) must be bfloat16 or float32, got params_dtype={params_dtype}")
        self.input_size = input_size
        self.output_size = output_size
        self.prefix = prefix
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.params_dtype = params_dtype
        self.deepgemm_mxfp8_input: bool = False
        self.input_format: ActFormat | None = None
        self.input_size_per_partition, self.output_size_per_partition = self._partition_sizes()
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, self.input_size_per_partition,
                                         self.output_size_per_partition, params_dtype, device)
        if bias:
            shape = self._bias_size()
            b = nn.Parameter(torch.zeros(shape, dtype=params_dtype, device=device), requires_grad=False)
            # sharded with the output rows where the weight is (column-parallel, at any tp_size)
            set_param_attrs(b, shard_dim=0 if self.weight_shard_dim == 0 else None,
                            weight_loader=self.weight_loader)
            self.register_parameter("bias", b)
        else:
            self.register_parameter("bias", None)

    # ---- sharding -------------------------------------------------------------------------
    def _partition_sizes(self) -> tuple[int, int]:
        return self.input_size, self.output_size

    def _bias_size(self) -> int:
        return self.output_size_per_partition

    @property
    def display_name(self) -> str:
        return self.prefix or type(self).__name__

    @property
    def forward_bias(self) -> torch.Tensor | None:
        """The bias this rank adds (all of them except RowParallel ranks > 0)."""
        return self.bias

    def __deepcopy__(self, memo):
        """A deep copy whose parameters keep their loader metadata (torch's ``Parameter`` deep copy
        drops attributes such as ``weight_loader`` and ``shard_dim``), a loader that is a method of
        this layer bound to the copy: a copied tensor-parallel layer reloads its shard as this does."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        for name, param in self._parameters.items():
            copied = new._parameters[name]
            if param is None or copied is None:
                continue
            for attr, value in vars(param).items():
                if getattr(value, "__self__", None) is self:
                    value = getattr(new, value.__func__.__name__)
                setattr(copied, attr, value)
        return new

    def _param_name(self, param: torch.Tensor) -> str:
        for name, p in self._parameters.items():
            if p is param:
                return name
        return "<parameter>"

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy a checkpoint tensor into ``param`` in place (its storage is kept).

        ``loaded`` may be the full tensor (narrowed here to this rank's shard along the
        parameter's ``shard_dim``) or already this rank's shard.
        """
        name = f"{self.display_name}.{self._param_name(param)}"
        if not isinstance(loaded, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(loaded).__name__}")
        dim = getattr(param, "shard_dim", None)
        if (dim is not None and self.tp_size > 1 and loaded.dim() == param.dim()
                and loaded.shape[dim] == param.shape[dim] * self.tp_size):
            size = param.shape[dim]
            loaded = loaded.narrow(dim, self.tp_rank * size, size)
        shard = "" if dim is None or self.tp_size == 1 else \
            f" (rank {self.tp_rank} of {self.tp_size}, full size along dim {dim}: {param.shape[dim] * self.tp_size})"
        self._copy_checked(name, param, param.data, loaded,
                           f"checkpoint shape {tuple(loaded.shape)} does not match parameter shape "
                           f"{tuple(param.shape)}{shard}")

    @staticmethod
    def _copy_checked(name: str, param: nn.Parameter, target: torch.Tensor, loaded: torch.Tensor,
                      shape_mismatch: str) -> None:
        """Copy ``loaded`` into ``target`` (``param`` or a view of it) after the shape check
        (``shape_mismatch`` is the error's text) and the dtype check."""
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(f"{name}: {shape_mismatch}")
        check_loadable_dtype(param, loaded, f"{name}: checkpoint")
        with torch.no_grad():
            target.copy_(loaded)

    # ---- forward --------------------------------------------------------------------------
    def forward(self, x):
        return self.quant_method.apply(self, x)

    def extra_repr(self) -> str:
        fmt = self.input_format.value if self.input_format is not None else None
        return (f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
                f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}, "
                f"quant={type(self.quant_method).__name__}, input_format={fmt}")


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""


class ColumnParallelLinear(LinearBase):
    """Shards the output dimension N: rank r holds rows ``[r*N/tp, (r+1)*N/tp)`` of the weight
    (and of its block scales and bias). The output stays sharded (no gather)."""

    weight_shard_dim = 0

    def _partition_sizes(self):
        return self.input_size, divide(self.output_size, self.tp_size, "output_size")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one weight, ``output_sizes`` rows each (the shared
    expert's gate and up): rank r holds rows ``[r*n/tp, (r+1)*n/tp)`` of every part, in part order,
    so its output is ``[gate shard | up shard]``. A full checkpoint tensor (all parts, in order)
    is sharded part by part; its block scales and bias the same way."""

    def __init__(self, input_size: int, output_sizes: list[int], **kwargs):
        self.output_sizes = list(output_sizes)
        tp_size = kwargs.get("tp_size", 1)
        check_tp(kwargs.get("tp_rank", 0), tp_size)
        for size in self.output_sizes:
            divide(size, tp_size, "each merged output size")
        super().__init__(input_size, sum(self.output_sizes), **kwargs)
        block = getattr(self, "weight_block_size", None)  # set by a block-quantized method
        if block is not None and any(size // self.tp_size % block[0] for size in self.output_sizes):
            raise ValueError(f"{self.display_name}: per-rank part sizes {[size // self.tp_size for size in self.output_sizes]} "
                             f"are not multiples of the {block[0]}x{block[1]} weight block; block scales cannot be sharded")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, loaded_shard_id: int | None = None) -> None:
        """``loaded_shard_id=None``: the full merged tensor (every part, in order), sharded part by
        part (at ``tp_size`` 1, the whole parameter). ``loaded_shard_id=i``: part ``i`` alone, whole
        or this rank's rows of it, written into the part's rows. At ``tp_size`` > 1 a tensor of
        this rank's merged shape needs a part id: it could be this rank's rows of every part or a
        contiguous slice of the full tensor (or, with two equal parts at TP2, one whole part), which
        differ, so it is refused."""
        name = f"{self.display_name}.{self._param_name(param)}"
        sharded_rows = getattr(param, "shard_dim", None) == 0
        if loaded_shard_id is not None:
            if not sharded_rows or not is_int(loaded_shard_id) or not 0 <= loaded_shard_id < len(self.output_sizes):
                raise ValueError(f"{name}: loaded_shard_id must be a part index in [0, {len(self.output_sizes)}) of "
                                 f"a row-sharded parameter, got {loaded_shard_id!r}")
            if not isinstance(loaded, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor, got {type(loaded).__name__}")
            rows = self._local_rows(param)
            start, size = sum(rows[:loaded_shard_id]), rows[loaded_shard_id]
            if self.tp_size > 1 and loaded.dim() == param.dim() and loaded.shape[0] == size * self.tp_size:
                loaded = loaded.narrow(0, self.tp_rank * size, size)
            target = param.data.narrow(0, start, size)
            self._copy_checked(name, param, target, loaded,
                               f"part {loaded_shard_id} has shape {tuple(loaded.shape)}; this rank's rows of it are "
                               f"{tuple(target.shape)}, the whole part {(size * self.tp_size, *target.shape[1:])}")
            return
        if self.tp_size > 1 and sharded_rows and isinstance(loaded, torch.Tensor) and loaded.dim() == param.dim():
            if loaded.shape[0] == param.shape[0] * self.tp_size:
                rows = self._local_rows(param)
                parts = loaded.split([r * self.tp_size for r in rows], 0)
                loaded = torch.cat([part.narrow(0, self.tp_rank * r, r) for part, r in zip(parts, rows)], 0)
            elif tuple(loaded.shape) == tuple(param.shape):
                raise ValueError(f"{name}: a tensor of this rank's merged shape {tuple(param.shape)} is ambiguous "
                                 f"(this rank's rows of each part, a contiguous slice of the full tensor, or one "
                                 f"whole part); load the full tensor, or each part with loaded_shard_id")
        super().weight_loader(param, loaded)

    def _local_rows(self, param: nn.Parameter) -> list[int]:
        """This rank's rows of each part in ``param`` (weight rows, block-scale rows, bias): each
        part's share of the outputs (the constructor made every part's shard whole blocks)."""
        total = sum(self.output_sizes)
        return [param.shape[0] * size // total for size in self.output_sizes]


class RowParallelLinear(LinearBase):
    """Shards the input dimension K: rank r holds columns ``[r*K/tp, (r+1)*K/tp)`` and reads the
    matching slice of the input. The bias is whole on every rank and added by rank 0 only, so
    the sum over ranks (the all-reduce) adds it once.

    With ``tp_size > 1`` and ``reduce_results`` the forward sums the ranks' bf16 partial products
    with ``torch.distributed.all_reduce`` over ``tp_group`` (None: the default group, which must
    then have ``tp_size`` ranks); ``reduce_results=False`` returns this rank's partial sum.
    """

    weight_shard_dim = 1

    def __init__(self, input_size: int, output_size: int, *, reduce_results: bool = True, tp_group=None,
                 **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self.reduce_results = reduce_results
        self.tp_group = tp_group

    def _partition_sizes(self):
        return divide(self.input_size, self.tp_size, "input_size"), self.output_size

    def _bias_size(self) -> int:
        return self.output_size

    @property
    def forward_bias(self):
        return self.bias if self.tp_rank == 0 else None

    def forward(self, x):
        out = self.quant_method.apply(self, x)
        if self.tp_size > 1 and self.reduce_results:
            _all_reduce(out, self.tp_group, self.tp_rank, self.tp_size, self.display_name)
        return out


def _all_reduce(t: torch.Tensor, group, tp_rank: int, tp_size: int, name: str) -> None:
    """Sum ``t`` over the ``tp_size`` ranks of ``group`` in place; a clear error where no process
    group of that size is set up, where this process is not in it, or where it is another rank of
    it than the shard it holds (a partial sum, or one shard twice, must not pass for the whole sum)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name}: tp_size={tp_size} needs torch.distributed initialized (init_process_group) "
                           "for its all-reduce")
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:  # torch reports -1 (rank and size) to a process outside the group
        raise RuntimeError(f"{name}: this process is not a member of the tensor-parallel group it was given")
    if size != tp_size:
        raise RuntimeError(f"{name}: the tensor-parallel group has {size} ranks, the layer was built for "
                           f"tp_size={tp_size}")
    if rank != tp_rank:
        raise RuntimeError(f"{name}: holds rank {tp_rank}'s shard but this process is rank {rank} of the "
                           "tensor-parallel group")
    dist.all_reduce(t, group=group)
