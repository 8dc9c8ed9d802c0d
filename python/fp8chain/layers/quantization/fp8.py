"""FP8 block-quantized linear layers: ``Fp8Config`` (from a checkpoint's ``quantization_config``)
and ``Fp8LinearMethod`` (weights, load-time preparation, forward).

Checkpoint tensors (DeepSeek-V4.1 names): ``weight`` e4m3 ``[N, K]`` and ``weight_scale_inv``
fp32 ``[ceil(N/b), ceil(K/b)]`` with ``b`` the square block size (32 for DSv4.1 with power-of-two
``ue8m0`` scales, 128 for V3/V4 checkpoints with arbitrary scales). The GEMM computes
``y = dequant(x_pair) @ dequant(weight)^T`` in bf16 on the backend ``fp8chain_kernel.backends``
selects for the arch and shape.

Load-time preparation (``process_weights_after_loading``) always recomputes from the raw
``weight`` and ``weight_scale_inv``; derived tensors (e.g. DeepGEMM's packed
``weight_scale_inv_deepgemm``) have shapes fixed by the weight's shape and are written through
``copy_or_rebind_param``, so a reload lands in the same storage and running it twice equals
running it once.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from fp8chain_kernel import backends as gemm_backends
from fp8chain_kernel.formats import (FP8_DTYPE, ActFormat, QuantizedActivation, cdiv, check_pair, is_int,
                                     powers_of_two)
from fp8chain_kernel.gemm import check_block_scaled
from fp8chain_kernel.quant import quantize

from ..linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod, check_dense_input
from ..parameter import copy_or_rebind_param, set_param_attrs

logger = logging.getLogger(__name__)

E4M3_NAN_CODE = 0x7F  # e4m3fn's NaN, with either sign bit (0xFF)

__all__ = ["Fp8Config", "Fp8LinearMethod", "check_weights", "prepare_consumer", "check_pair_input",
           "consumer_gemm"]

_BLOCK_SIZES = (32, 128)
_SCALE_FMTS = (None, "ue8m0")


@dataclasses.dataclass
class Fp8Config:
    """FP8 block quantization of a checkpoint (``quant_method: "fp8"``).

    Args:
        weight_block_size: square weight block ``(b, b)`` of two ints, b in {32, 128}.
        scale_fmt: ``"ue8m0"`` when the checkpoint's weight scales are powers of two (DSv4.1),
            None for arbitrary fp32 scales.
        ignored_layers: a list or tuple of layer prefixes kept unquantized (bf16 weights).
        backend: the GEMM backend every layer must use (one of ``backends.BACKEND_NAMES``, for
            ``select_backend(prefer=...)``): a layer it rejects fails to load with the reason
            (``ValueError``) rather than run the torch fallback GEMM. None = automatic.
    """

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None
    activation_scheme: str = "dynamic"
    ignored_layers: tuple[str, ...] = ()
    backend: str | None = None

    def __post_init__(self):
        block = self.weight_block_size
        if not isinstance(block, (list, tuple)) or not all(is_int(b) for b in block):
            raise TypeError(f"fp8: weight_block_size must be a list or tuple of ints, got {block!r}")
        if len(block) != 2 or block[0] != block[1] or block[0] not in _BLOCK_SIZES:
            raise ValueError(f"fp8: weight_block_size must be [32, 32] or [128, 128], got {list(block)}")
        self.weight_block_size = tuple(block)
        if self.scale_fmt not in _SCALE_FMTS:
            raise ValueError(f"fp8: scale_fmt must be one of {_SCALE_FMTS}, got {self.scale_fmt!r}")
        if self.activation_scheme != "dynamic":
            raise ValueError(f"fp8: only dynamic activation scales are supported, got "
                             f"activation_scheme={self.activation_scheme!r}")
        ignored = self.ignored_layers or ()
        # a bare string would become a tuple of one-character prefixes (upstream does not wrap it)
        if not isinstance(ignored, (list, tuple)) or not all(isinstance(p, str) for p in ignored):
            raise TypeError(f"fp8: ignored_layers / modules_to_not_convert must be a list or tuple "
                            f"of layer prefixes, got {ignored!r}")
        self.ignored_layers = tuple(ignored)
        if self.backend is not None and self.backend not in gemm_backends.BACKEND_NAMES:
            raise ValueError(f"fp8: backend (fp8chain_backend) must be one of "
                             f"{', '.join(gemm_backends.BACKEND_NAMES)} or None, got {self.backend!r}")

    @property
    def block(self) -> int:
        return self.weight_block_size[0]

    @classmethod
    def get_name(cls) -> str:
        """The ``quant_method`` this config reads (upstream's ``QuantizationConfig.get_name``)."""
        return "fp8"

    @classmethod
    def from_config(cls, config: dict) -> "Fp8Config":
        """From a checkpoint's ``quantization_config`` dict (config.json)."""
        method = config.get("quant_method")
        if method != cls.get_name():
            raise ValueError(f"Fp8Config reads quant_method {cls.get_name()!r}, got {method!r}")
        if not config.get("is_checkpoint_fp8_serialized", True):
            raise ValueError("fp8: only FP8-serialized checkpoints are supported")
        if config.get("fmt", "e4m3") != "e4m3":  # the weights the consumers read are e4m3fn
            raise ValueError(f"fp8: fmt must be 'e4m3', got {config['fmt']!r}")
        block = config.get("weight_block_size")
        if block is None:
            raise ValueError("fp8: weight_block_size is required (block-wise FP8 checkpoints only)")
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert")
        return cls(weight_block_size=block, scale_fmt=config.get("scale_fmt"),
                   activation_scheme=config.get("activation_scheme", "dynamic"),
                   ignored_layers=ignored, backend=config.get("fp8chain_backend"))

    def is_ignored(self, prefix: str) -> bool:
        return any(prefix == p or prefix.startswith(p + ".") or prefix.endswith("." + p)
                   for p in self.ignored_layers)

    def get_quant_method(self, layer: nn.Module, prefix: str):
        if not isinstance(layer, LinearBase):
            return None
        if self.is_ignored(prefix):
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(self)


class Fp8LinearMethod(LinearMethodBase):
    """Block-FP8 weights; FP8 activations in the format of the selected GEMM backend. After
    ``process_weights_after_loading`` the layer carries the consumer state ``prepare_consumer``
    sets (``gemm_backend``, ``act_format``, ``derived_weight_names``, ``input_format``)."""

    def __init__(self, quant_config: Fp8Config):
        self.quant_config = quant_config

    # ---- weights ----------------------------------------------------------------------------
    def create_weights(self, layer, input_size_per_partition, output_size_per_partition,
                       params_dtype, device=None):
        b = self.quant_config.block
        n, k = output_size_per_partition, input_size_per_partition
        if layer.tp_size > 1 and layer.weight_shard_dim is not None:  # a replicated layer holds it whole
            sharded = n if layer.weight_shard_dim == 0 else k
            if sharded % b:
                raise ValueError(f"{layer.display_name}: per-rank size {sharded} is not a multiple "
                                 f"of the {b}x{b} weight block; block scales cannot be sharded")
        # NaN codes until loaded, as the scales: processing refuses them, so a first load missing
        # the weight fails instead of serving zeros
        weight = nn.Parameter(torch.full((n, k), E4M3_NAN_CODE, dtype=torch.uint8, device=device).view(FP8_DTYPE),
                              requires_grad=False)
        scale = nn.Parameter(torch.full((cdiv(n, b), cdiv(k, b)), float("nan"), dtype=torch.float32, device=device),
                             requires_grad=False)
        for p in (weight, scale):
            set_param_attrs(p, shard_dim=layer.weight_shard_dim, weight_loader=layer.weight_loader)
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale_inv", scale)
        layer.weight_block_size = self.quant_config.weight_block_size
        layer.gemm_backend = None
        layer.act_format = None
        layer.derived_weight_names = ()

    def process_weights_after_loading(self, layer) -> None:
        """Select the backend, derive its weight tensors in place, honour or refuse the request
        (``prepare_consumer``).

        Always recomputes from the raw ``weight``/``weight_scale_inv`` (nothing is latched), so
        running it again after a reload, or twice, gives the same result in the same storage.
        Any failure (refused weights, the configured backend rejecting the layer, an error while
        deriving, out of memory included) leaves the layer refusing to run (``invalidate``).
        """
        from ..warmup import linear_warmup, register_warmup

        try:
            check_weights(layer.weight, layer.weight_scale_inv, self.quant_config.block, self.quant_config.scale_fmt,
                          getattr(layer, "display_name", type(layer).__name__))
            prepare_consumer(layer, self.quant_config.block, prefer=self.quant_config.backend)
        except BaseException:
            # the raw weights are new: nothing derived from earlier ones may run with them
            self.invalidate(layer)
            raise
        register_warmup(layer, linear_warmup)

    @staticmethod
    def invalidate(layer) -> None:
        """The layer's raw weights changed without a successful processing (a load or a check that
        failed part-way): its derived tensors are poisoned and it refuses to run (``apply`` raises
        "weights not processed") until ``process_weights_after_loading`` succeeds. A request for a
        pre-quantized input stands for that processing."""
        for name in getattr(layer, "derived_weight_names", ()):
            _poison(getattr(layer, name))
        layer.fp8chain_refused_request = input_requested(layer)
        layer.deepgemm_mxfp8_input = False
        layer.input_format = None
        layer.act_format = None

    # ---- forward ----------------------------------------------------------------------------
    def apply(self, layer, x) -> torch.Tensor:
        n = layer.weight.shape[0]
        k = layer.weight.shape[1]
        if isinstance(x, QuantizedActivation):
            check_pair_input(layer, x, layer.display_name)
            pair, lead = x, x.data.shape[:-1]
        else:
            check_dense_input(layer, x)
            lead = x.shape[:-1]
            x2 = x.reshape(-1, k)
            if x2.numel() and x2.stride(1) != 1:
                x2 = x2.contiguous()
            fmt = layer.act_format
            if fmt is None:
                raise RuntimeError(f"{layer.display_name}: weights not processed; call "
                                   f"process_weights_after_loading (or load_weights) first")
            if x2.shape[0] == 0:
                pair = None
            else:
                pair = quantize(x2, fmt)
        rows = int(torch.Size(lead).numel())
        if rows == 0:
            device = x.data.device if isinstance(x, QuantizedActivation) else x.device
            out = torch.empty(0, n, dtype=torch.bfloat16, device=device)
        else:
            out = consumer_gemm(layer, pair, self.quant_config.block)
        bias = layer.forward_bias
        if bias is not None:
            out.add_(bias)  # ``out`` is the GEMM's fresh result
        return out.reshape(*lead, n)


def check_weights(weight: torch.Tensor, scale: torch.Tensor, block: int, scale_fmt: str | None,
                  name: str) -> None:
    """The checkpoint tensors a consumer reads, before anything is derived from them: ``weight``
    e4m3 ``[N, K]`` and its ``weight_scale_inv`` ``scale``, fp32 ``[ceil(N/b), ceil(K/b)]``, positive
    and finite, powers of two when the checkpoint says ``scale_fmt: "ue8m0"``, and no NaN code in
    ``weight`` (``TypeError`` / ``ValueError`` naming the tensor, the count and the first bad value)."""
    try:
        check_block_scaled(weight, scale, block)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{name}: {error}") from None
    nan = (weight.view(torch.uint8) & 0x7F) == E4M3_NAN_CODE
    if nan.any():
        idx = nan.nonzero()[0].tolist()
        raise ValueError(f"{name}.weight: {int(nan.sum())} of {weight.numel()} values are e4m3 NaN codes (a weight "
                         f"never loaded starts so); first at {idx}")
    if scale_fmt == "ue8m0":
        bad = ~powers_of_two(scale)
        need = "positive, finite powers of two (checkpoint scale_fmt='ue8m0')"
    else:
        bad = ~(torch.isfinite(scale) & (scale > 0))
        need = "positive and finite"
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise ValueError(f"{name}.weight_scale_inv: {int(bad.sum())} of {scale.numel()} scales are "
                         f"not {need}; first at {idx}: {scale[tuple(idx)].item()!r}")


def input_requested(layer) -> bool:
    """Whether ``layer`` asks for a pre-quantized input: its ``deepgemm_mxfp8_input`` flag, or a
    request an earlier processing refused (``prepare_consumer``)."""
    return bool(getattr(layer, "deepgemm_mxfp8_input", False) or getattr(layer, "fp8chain_refused_request", False))


def prepare_consumer(layer, block: int, prefer: str | None = None, name: str | None = None,
                     bf16_gemm: str = "the torch fallback GEMM") -> None:
    """Make ``layer`` (any module with ``weight`` e4m3 ``[N, K]``, ``weight_scale_inv`` fp32 block
    scales and a ``deepgemm_mxfp8_input`` request flag) an FP8 consumer: select the backend for
    this arch and shape, write its derived weight tensors through ``copy_or_rebind_param`` and set

    * ``gemm_backend``: the backend, or None (none can serve: ``consumer_gemm`` then runs a torch
      fallback on the same FP8 numerics);
    * ``act_format``: the activation format bf16 input is quantized into;
    * ``derived_weight_names``: the derived parameters handed to the backend;
    * ``input_format`` and ``deepgemm_mxfp8_input``: the pair format if the request was made and a
      backend honours it, else None / False (with a logged reason);
    * ``fp8chain_refused_request``: whether a request was refused. A refused request is made
      again at the next processing (a reload), so a load that cannot be served does not withdraw
      it for the weights after it: loads A, B (refused), A end as a fresh load of A does.

    ``bf16_gemm`` names, in the warning logged where no backend serves the layer, what runs its bf16
    input then (the SGLang plugin: upstream's GEMM).

    Derived tensors of an earlier load that this one does not derive again are poisoned (NaN,
    or all bits set: UE8M0 NaN), so that a CUDA graph captured before, which still calls the
    old backend with them, computes NaN instead of numbers from stale scales.
    """
    name = name or getattr(layer, "display_name", type(layer).__name__)
    requested = input_requested(layer)
    n, k = layer.weight.shape
    portable = ActFormat.SM90_G32_FP32_MN if block == 32 else ActFormat.SM90_G128_FP32_MN
    errors: list[ValueError] = []
    try:
        formats = list(dict.fromkeys([gemm_backends.input_format_for(block), portable]))
    except ValueError as exc:  # no format for this block: the fallback still needs one
        formats = []
        errors.append(exc)
    # the arch's format first (Blackwell's packed UE8M0 where DeepGEMM runs), then the one the
    # Triton GEMM reads on any arch, for a layer the first one's backends cannot serve (DeepGEMM
    # refuses K % 128 != 0: DSv4.1's TP4 shared down)
    backend, derived, reasons = None, {}, []
    for fmt in formats:
        try:
            backend = gemm_backends.select_backend(fmt, block, n, k, prefer=prefer)
            derived = backend.derive_weight_tensors(layer.weight, layer.weight_scale_inv, block)
            break
        except ValueError as exc:
            errors.append(exc)
            reason = str(exc).strip() or type(exc).__name__
            reasons.append(f"{backend.name}: {reason}" if backend is not None else reason)  # selected, not derived
            backend, derived = None, {}
    if backend is None:
        if prefer is not None:  # a configured backend is a requirement, not a hint
            raise errors[0]
        fmt = formats[0] if formats else portable
        reason = "; ".join(reasons) or str(errors[0])
    names = []
    for key, tensor in derived.items():
        copy_or_rebind_param(layer, key, tensor, match_strides=True)
        names.append(key)
    for stale in set(getattr(layer, "derived_weight_names", ())) - set(names):
        _poison(getattr(layer, stale))
    layer.gemm_backend = backend
    layer.act_format = fmt
    layer.derived_weight_names = tuple(names)
    honoured = requested and backend is not None
    layer.deepgemm_mxfp8_input = honoured
    layer.fp8chain_refused_request = requested and not honoured
    layer.input_format = fmt if honoured else None
    if backend is None:
        logger.warning("%s: %s; %susing %s", name, reason, "keeping bf16 input, " if requested else "", bf16_gemm)


def _poison(tensor: torch.Tensor) -> None:
    """Fill a derived weight tensor nothing reads any more (``prepare_consumer``): NaN for floats,
    all bits set for integers (packed UE8M0 scales: 255, its NaN)."""
    with torch.no_grad():
        tensor.fill_(float("nan") if tensor.is_floating_point() else -1)


def check_pair_input(layer, pair: QuantizedActivation, name: str) -> None:
    """A pair may only reach a layer whose request was honoured, in the format it reads, with K
    columns (``TypeError`` / ``ValueError`` otherwise)."""
    check_pair(pair)
    want = getattr(layer, "input_format", None)
    if want is None:
        raise TypeError(f"{name} reads bf16 input (no pre-quantized input was requested and "
                        f"honoured), got a pair in {pair.fmt.value}")
    if pair.fmt is not want:
        raise TypeError(f"{name} reads {want.value}, got a pair in {pair.fmt.value}")
    k = layer.weight.shape[1]
    if pair.data.shape[-1] != k:
        raise ValueError(f"{name}: input has {pair.data.shape[-1]} columns, weight expects K={k}")


def consumer_gemm(layer, pair: QuantizedActivation, block: int) -> torch.Tensor:
    """``pair`` times the layer's FP8 weight on the backend ``prepare_consumer`` chose, bf16
    ``[M, N]``."""
    backend = layer.gemm_backend
    if backend is None:
        return _fallback_gemm(pair, layer.weight, layer.weight_scale_inv, block)
    return backend.gemm(pair, layer.weight, layer.weight_scale_inv, _derived_tensors(layer))


def consumer_gemm_silu_mul(layer, pair: QuantizedActivation, limit: float | None, out_format,
                           name: str | None = None) -> QuantizedActivation | None:
    """The FP8 pair of ``act.silu_mul(layer(pair), limit=limit)`` in ``out_format`` from one launch,
    where the layer (a gate_up projection, no bias) runs on a backend with that epilogue; else None.
    ``layer`` is fp8chain's linear or another prepared by ``prepare_consumer`` (SGLang's, whose bias
    is ``bias``); ``name`` names it in errors (default: its ``display_name``)."""
    fused = getattr(layer.gemm_backend, "gemm_silu_mul", None)  # a backend need not have it
    bias = layer.forward_bias if hasattr(layer, "forward_bias") else getattr(layer, "bias", None)
    if fused is None or bias is not None:
        return None
    check_pair_input(layer, pair, name or layer.display_name)
    if layer.weight.shape[0] % (2 * pair.fmt.group_size):  # not gate and up halves of whole groups
        return None
    return fused(pair, layer.weight, layer.weight_scale_inv, _derived_tensors(layer), limit, out_format)


def _derived_tensors(layer) -> dict:
    """The load-time tensors ``prepare_consumer`` derived for the layer's backend, by name."""
    return {name: getattr(layer, name) for name in layer.derived_weight_names}


def _fallback_gemm(pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
                   block: int) -> torch.Tensor:
    """The reference GEMM on the dequantized operands (``reference.fp8_gemm``: fp64, so no TF32
    setting of the process rounds them), rounded to bf16: the same FP8 numerics as a backend, for
    shapes no backend serves."""
    from fp8chain_kernel.reference import fp8_gemm

    return fp8_gemm(pair, weight, weight_scale, block).to(torch.bfloat16)
