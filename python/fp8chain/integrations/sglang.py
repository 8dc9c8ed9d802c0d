"""The SGLang plugin: on Hopper, SGLang's FP8 linears read the pairs fp8chain's producers write.

SGLang discovers general plugins through the entry point group ``sglang.srt.plugins`` in every
process, calls each plugin's function, then applies the hooks it registered
(``sglang.srt.plugins.hook_registry.HookRegistry``). fp8chain registers itself there as
``fp8chain`` (pyproject.toml); with ``SGLANG_PLUGINS`` set, name it in that list.

``install()`` registers three hooks on the FP8 linears:

* after ``Fp8Config.get_quant_method(layer, prefix)``: the layer's checkpoint name, kept as
  ``layer.fp8chain_prefix`` for log lines and errors (upstream's ``LinearBase`` does not keep it);
* around ``Fp8LinearMethod.process_weights_after_loading(layer)``: a layer whose model asked for
  a pre-quantized input (``LinearBase.deepgemm_mxfp8_input = True`` before the weights load) on
  Hopper, where upstream has no such path, becomes an fp8chain consumer (``prepare_consumer``):
  backend chosen for the arch and shape, derived weight tensors written in place,
  ``layer.input_format`` set, the flag True again; or the request is refused (flag False, reason
  logged) and the layer keeps upstream's bf16 path. The request is read before upstream's
  processing runs: SGLang 0.5.23's sets the flag to what its own preparation achieved, False
  off Blackwell. Before fp8chain prepares the layer, its weight and scales pass the checks
  fp8chain's own ``Fp8LinearMethod`` runs (``check_weights``), which raise at load rather than
  at the first forward. Before Hopper, on ROCm and where the method repacked the weights for
  Marlin (``use_marlin``, e.g. ``SGLANG_FORCE_FP8_MARLIN``) or for Intel AMX on the CPU
  (``layer.use_intel_amx_backend``) the request is refused without reading them as e4m3;
  Blackwell and later are upstream's. SGLang 0.5.23's DeepSeek-V4 attention asks (on ``wqkv_a``
  and ``wo_b``) only with its mega attention, which runs on Blackwell: on Hopper only the
  ``MQALayer`` and ``DeepseekV2MoE`` hooks below ask (on ``wqkv_a``, ``wq_b``, ``wo_b`` and the
  shared expert's ``gate_up_proj`` and ``down_proj``); where nothing asks, the plugin logs once
  that its consumers stay idle.
* around ``apply(layer, x, bias=None)``: a ``QuantizedActivation`` goes to that backend's GEMM,
  never re-quantized (a pair in another format, or for a layer that did not ask for one, raises
  ``TypeError``); any other input runs upstream's ``apply`` unchanged.

Upstream's weights stay where they are: the hook reads ``weight`` (e4m3 ``[N, K]``) and
``weight_scale_inv`` (fp32 block scales) as upstream's block-FP8 method leaves them, with the
method's square ``weight_block_size`` (32 or 128).

``install()`` also makes four producers of a DeepSeek-V4 layer write the pairs its FP8 linears
read: the mHC boundary (post, combine and RMSNorm in one launch) for ``wqkv_a`` and the shared
expert's ``gate_up_proj``, q_norm for ``wq_b`` and the ``wo_a`` einsum for ``wo_b`` in the attention
(``MQALayer``), SiLU*mul for the shared expert's ``down_proj`` (``DeepseekV2MLP``):

* after ``MQALayer.__init__``: where fp8chain's consumers run (Hopper, e4m3 weights), ``wqkv_a``
  (where fused: ``fuse_wqa_wkv``), ``wq_b`` and ``wo_b`` ask for a pre-quantized input (the
  request the process hook above serves or refuses at load). ``wq_b`` does not where upstream's
  own Hopper q_lora quantize is switched on (``SGLANG_OPT_DSV41_SM90_Q_LORA_QUANT``, SGLang after
  0.5.23): that path feeds ``wq_b`` itself.
* around ``HcReadCall.read(residual, norm)`` and the module function ``combine(hc, state,
  quantized)`` it calls (``deepseek_v4_boundary``, ``deepseek_v4_mhc``): for the attention's read
  in DSv4.1's shifted ordering (``boundary_pre_from_prev``), where ``wqkv_a`` became a consumer,
  one ``mhc.mhc_combine_norm`` launch (``norm.rms_norm`` of stream 0 where no ``pre`` is carried
  yet) returns the bf16 ``x = RMSNorm(sum_k pre[k] * R[k])`` (the indexer's and compressor's) and
  its pair in ``wqkv_a.input_format``, which the read leaves where upstream leaves its own
  Blackwell pair (``ReadState.quantized``): the decoder layer hands it to ``MQALayer.forward`` as
  ``x_quant`` and the forward to ``wqkv_a``. Upstream's Hopper read writes bf16 ``x`` and
  ``wqkv_a`` quantizes it. The bf16 rows are fp8chain's combine and RMSNorm (fp32, the combine
  rounded to bf16 before the norm as upstream's), which may differ from upstream's kernel in the
  last bit of an element. The FFN's read does the same where the shared expert's ``gate_up_proj``
  and ``down_proj`` became consumers, with ``gate_up_proj``'s format; its ``x`` also feeds the
  router and the routed experts, and the MoE forward takes no pair beside it, so the read leaves
  the pair with the shared expert together with the rows it quantizes, for the MLP hook below.
* around ``HcReadCall.update_and_read(update, value, residual, norm)`` and the module function
  ``_post_fusion(hc, y, residual, (pre, post, comb), next)`` its post calls: for both reads (the
  attention's and the FFN's) on a device fp8chain serves, one ``mhc.mhc_mega_boundary`` launch
  runs the finished sublayer's post, the read's combine + RMSNorm and, where the read feeds a
  linear that reads pairs (as above), the pair, and returns them as upstream's Blackwell fused
  boundary does (``HcState`` with an ``HcQuantized`` or ``HcNormed`` input), which the read takes
  as they are. Upstream's Hopper post writes only the residual, and the read's combine is a launch
  of its own. The residual ``R'`` is fp8chain's post (fp32, one rounding, the post term first and the
  streams in order), which may differ from upstream's in the last bit of an element. A post whose
  next norm upstream does not fuse, or that feeds the DeepGEMM mega MoE, stays upstream's.
* around ``MQALayer._normalize_q_lora(q)``: upstream returns ``(bf16 normed q, wq_b's input)``,
  the bf16 row for the indexer and the same row for ``wq_b``, which quantizes it. Where ``wq_b``
  became an fp8chain consumer, one ``norm.rms_norm`` launch returns the bf16 row and its pair in
  ``wq_b.input_format`` instead, so ``wq_b`` runs without a quantize launch. The bf16 row is
  fp8chain's RMSNorm (fp32, rounded once), which may differ from upstream's kernel in the last
  bit of an element.
* around ``MQALayer.forward``: upstream's forward, with the running layer known to the next hook.
* around ``_apply_wo_a_bf16_matmul(o, wo_a, ...)`` (a module function, handed the weight, not the
  layer): inside the forward of a layer whose ``wo_b`` became a consumer, and for that layer's own
  ``wo_a``, one ``einsum.wo_a_einsum`` launch returns the pair of the ``[T, G*R]`` product in
  ``wo_b.input_format``, which ``_project_wo_b`` hands to ``wo_b`` as it is. Its bf16 values are
  fp8chain's einsum (fp32 sums rounded once), which may differ from upstream's GEMM in the last bit.
* after ``DeepseekV2MoE.__init__``: in a DeepSeek-V4 layer (``is_deepseek_v4``), the shared
  expert's ``gate_up_proj`` and ``down_proj`` ask, as above.
* around ``DeepseekV2MLP.forward(x)``: where ``down_proj`` became a consumer, ``gate_up_proj`` on
  the pair the FFN's read left for this very ``x`` (the same tensor object: rows gathered, sliced
  or copied on the way read bf16, through upstream's path), then one ``act.silu_mul`` launch with
  the MLP's ``swiglu_limit`` returns the pair in ``down_proj.input_format``, and ``down_proj`` reads
  it. Upstream's forward writes the bf16 activation (``silu_and_mul_clamp``) and ``down_proj``
  quantizes it. fp8chain's SiLU*mul rounds once from fp32 and keeps a NaN gate NaN where
  upstream's clamp (a bf16 minimum) turns it into the limit.

Upstream's own method runs wherever no pair may be handed on: sequence parallelism (``wq_b``
all-gathers its input, ``wo_b`` and ``down_proj`` reduce-scatter their output, as tensors),
deterministic or batch-invariant inference (fp8chain's launches are chosen per row count), inputs
that are not bf16, a ``wo_a`` call that asks for upstream's own quantized output, an MLP call that
brings gate_up's input quantized (``gateup_pre_quant``) or fuses NVFP4 (not Hopper's), and calls
with arguments the hooks do not know.
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys

import torch

from fp8chain_kernel.act import silu_mul
from fp8chain_kernel.einsum import wo_a_einsum
from fp8chain_kernel.formats import QuantizedActivation
from fp8chain_kernel.fp8_tile import interpreting
from fp8chain_kernel.mhc import mhc_combine_norm, mhc_mega_boundary
from fp8chain_kernel.norm import rms_norm

from ..layers.quantization.fp8 import (Fp8LinearMethod, check_pair_input, check_weights, consumer_gemm,
                                       consumer_gemm_silu_mul, input_requested, prepare_consumer)

logger = logging.getLogger(__name__)

__all__ = ["install", "HOOKS", "why_idle", "after_get_quant_method", "around_process_weights", "around_apply",
           "after_mqa_init", "around_normalize_q_lora", "around_mqa_forward", "around_wo_a_bf16_matmul",
           "after_moe_init", "around_mlp_forward", "around_hc_read", "around_hc_combine",
           "around_hc_update_and_read", "around_post_fusion", "FP8_CONFIG", "FP8_LINEAR_METHOD", "MQA_LAYER",
           "WO_A_BF16_MATMUL", "MOE", "MLP", "HC_READ", "HC_COMBINE", "HC_POST_FUSION", "PLUGIN_GROUP"]

PLUGIN_GROUP = "sglang.srt.plugins"  # SGLang's entry point group of general plugins
FP8_LINEAR_METHOD = "sglang.srt.layers.quantization.fp8.Fp8LinearMethod"
FP8_CONFIG = "sglang.srt.layers.quantization.fp8.Fp8Config"
DEEPSEEK_V4 = "sglang.srt.models.deepseek_v4"
MQA_LAYER = f"{DEEPSEEK_V4}.MQALayer"
WO_A_BF16_MATMUL = f"{DEEPSEEK_V4}._apply_wo_a_bf16_matmul"  # o [T, G, D] x wo_a [G, R, D], bf16
MOE = "sglang.srt.models.deepseek_v2.DeepseekV2MoE"  # DeepSeek-V4's MoE too (is_deepseek_v4=True)
MLP = "sglang.srt.models.deepseek_v2.DeepseekV2MLP"  # its shared expert
HC_READ = "sglang.srt.models.deepseek_v4_boundary.HcReadCall"  # the mHC boundary's read of a sublayer's input
HC_COMBINE = "sglang.srt.models.deepseek_v4_mhc.combine"  # RMSNorm(sum_k pre[k] * R[k]), called by the read
HC_POST_FUSION = "sglang.srt.models.deepseek_v4_mhc._post_fusion"  # a sublayer's post (+ the next read's norm)
UPSTREAM_HOPPER_Q_LORA_QUANT = "SGLANG_OPT_DSV41_SM90_Q_LORA_QUANT"  # SGLang's own q_norm -> wq_b pair, after 0.5.23
_BLOCK_SIZES = (32, 128)


def install() -> None:
    """The entry point SGLang calls: register the hooks of ``HOOKS`` (applied by SGLang afterwards)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in HOOKS:
        HookRegistry.register(target, hook, HookType[kind])


def _upstream_serves_request(device: torch.device) -> bool:
    """Blackwell and later: upstream's own producers and DeepGEMM path handle the request."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 10


def _why_not_fp8chain(device: torch.device) -> str | None:
    """Why fp8chain's consumers do not take a request on ``device`` (None: they do: NVIDIA Hopper,
    or the CPU under the Triton interpreter). Elsewhere upstream's block-FP8 method may already
    have rewritten the weights (Marlin repacking before Ada, e4m3fnuz on ROCm), so the hook must
    not read them as e4m3."""
    if device.type == "cpu":
        return None if interpreting() else "the CPU without the Triton interpreter"
    if device.type != "cuda":
        return f"a {device.type} device"
    if torch.version.hip is not None:
        return "ROCm (fp8chain's FP8 consumers are NVIDIA Hopper kernels)"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"sm_{major}{minor} (fp8chain's FP8 consumers run on Hopper, sm_90)"
    return None


def _layer_name(layer) -> str:
    return getattr(layer, "prefix", None) or getattr(layer, "fp8chain_prefix", None) or type(layer).__name__


def _block_size(method) -> int | None:
    block = getattr(getattr(method, "quant_config", None), "weight_block_size", None)
    if block is None or len(block) != 2 or block[0] != block[1] or int(block[0]) not in _BLOCK_SIZES:
        return None
    return int(block[0])


def _refuse(layer, name: str, why: str) -> None:
    """The request is not taken: one WARNING line, the flag back to False, bf16 input."""
    logger.warning("%s: no fp8chain consumer %s; keeping bf16 input", name, why)
    layer.deepgemm_mxfp8_input = False
    layer.input_format = None


def after_get_quant_method(result, config, layer, *args, prefix: str = "", **kwargs):
    """AFTER hook of ``Fp8Config.get_quant_method``: keep the layer's checkpoint name."""
    name = prefix or (args[0] if args and isinstance(args[0], str) else "")
    if name and isinstance(layer, torch.nn.Module):
        layer.fp8chain_prefix = name
    return None


_idle_noted = False  # the once-per-process note that no layer asked for a pre-quantized input


def _note_idle(name: str) -> None:
    global _idle_noted
    if not _idle_noted:
        _idle_noted = True
        logger.info("%s asks no pre-quantized input; fp8chain's consumers take only layers whose model asks "
                    "(in SGLang on Hopper: DeepSeek-V4's wqkv_a, wq_b, wo_b and shared-expert gate_up_proj and "
                    "down_proj, fed by fp8chain's producers). Logged once.", name)


def around_process_weights(original, method, layer, *args, **kwargs):
    """AROUND hook of ``Fp8LinearMethod.process_weights_after_loading``: upstream's processing,
    then fp8chain's for a layer that asked before it (the module docstring)."""
    requested = input_requested(layer)  # upstream's processing may reset the flag
    result = original(method, layer, *args, **kwargs)
    if _upstream_serves_request(layer.weight.device):
        return result
    name = _layer_name(layer)
    if not requested:
        if _why_not_fp8chain(layer.weight.device) is None:
            _note_idle(name)
        return result
    layer.deepgemm_mxfp8_input = True  # the model's request, which fp8chain serves or refuses below
    _prepare(method, layer, name)
    return result


def _prepare(method, layer, name: str) -> None:
    reason = _why_not_fp8chain(layer.weight.device)
    if reason is not None:  # upstream's weights and bf16 path stay as they are
        return _refuse(layer, name, f"on {reason}")
    if getattr(method, "use_marlin", False):  # SGLANG_FORCE_FP8_MARLIN: the weights were repacked
        return _refuse(layer, name, "for weights repacked for Marlin")
    if getattr(layer, "use_intel_amx_backend", False):  # upstream's CPU path repacked them for AMX
        return _refuse(layer, name, "for weights repacked for Intel AMX")
    block = _block_size(method)
    if block is None or layer.weight.dim() != 2:
        return _refuse(layer, name, "for weight block "
                       f"{getattr(getattr(method, 'quant_config', None), 'weight_block_size', None)}")
    # the checks fp8chain's own Fp8LinearMethod runs: a corrupt checkpoint fails here, at load,
    # not at the first forward (possibly inside graph capture)
    try:
        check_weights(layer.weight, layer.weight_scale_inv, block, getattr(method.quant_config, "scale_fmt", None),
                      name)
        prepare_consumer(layer, block, name=name, bf16_gemm="upstream's GEMM")
    except BaseException:
        Fp8LinearMethod.invalidate(layer)  # no pair may reach tensors derived from earlier weights
        raise


def around_apply(original, method, layer, x, bias=None, *args, **kwargs):
    """AROUND hook of ``Fp8LinearMethod.apply``: pairs to fp8chain's GEMM, the rest upstream."""
    if not isinstance(x, QuantizedActivation):
        return original(method, layer, x, bias, *args, **kwargs)
    check_pair_input(layer, x, _layer_name(layer))
    out = consumer_gemm(layer, x, _block_size(method))
    if bias is not None:
        out.add_(bias)  # ``out`` is the GEMM's fresh result
    return out


def _upstream_feeds_wq_b() -> bool:
    """Whether upstream's own Hopper q_lora quantize (SGLang after 0.5.23) is switched on."""
    return os.environ.get(UPSTREAM_HOPPER_Q_LORA_QUANT, "").strip().lower() in ("1", "true", "yes", "on")


def _fp8chain_serves_weight(weight) -> bool:
    """Whether fp8chain's consumers read ``weight``: e4m3, where they run (for meta weights: the
    current GPU, where they will be materialized)."""
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn:  # e.g. bf16, FP4 packed
        return False
    device = weight.device
    if device.type == "meta" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return why_idle(device) is None


def why_idle(device: torch.device) -> str | None:
    """Why the plugin leaves every layer on ``device`` to upstream (None: its requests, consumers
    and producer hooks act there)."""
    if _upstream_serves_request(device):
        return "upstream's own producers and GEMMs serve pre-quantized inputs from Blackwell on"
    return _why_not_fp8chain(device)


def _ask_for_pair(linear) -> None:
    """``linear`` asks for a pre-quantized input (before its weights load) where fp8chain's consumers
    read its weight."""
    if _fp8chain_serves_weight(getattr(linear, "weight", None)):
        linear.deepgemm_mxfp8_input = True


def after_mqa_init(result, attn, *args, **kwargs):
    """AFTER hook of ``MQALayer.__init__``: ``wq_b``, ``wo_b`` and a fused ``wqkv_a`` ask for a
    pre-quantized input where fp8chain's consumers run, before their weights load (the module
    docstring)."""
    for name in ("wqkv_a", "wq_b", "wo_b"):
        if ((name == "wq_b" and _upstream_feeds_wq_b())
                or (name == "wqkv_a" and not getattr(attn, "fuse_wqa_wkv", False))):  # wq_a and wkv read bf16
            continue
        _ask_for_pair(getattr(attn, name, None))
    return None


def _why_no_pair() -> str | None:
    """Why this forward must hand SGLang's linears bf16 (None: a pair may go): SGLang's runtime
    modes in which a pair cannot pass or fp8chain's launches do not fit."""
    from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled
    from sglang.srt.runtime_context import get_exec, get_forward

    if get_forward().sp_active:
        return "sequence parallelism (the parallel linears all-gather or reduce-scatter tensors)"
    if is_batch_invariant_mode_enabled() or get_exec().deterministic.enable_deterministic_inference:
        return "deterministic inference (fp8chain's launches are chosen per row count)"
    return None


def around_normalize_q_lora(original, attn, q, *args, **kwargs):
    """AROUND hook of ``MQALayer._normalize_q_lora(q)``: ``(bf16 q_lora, wq_b's input)``, the
    input being the FP8 pair of that bf16 row from the same launch where ``wq_b`` reads pairs."""
    fmt = getattr(attn.wq_b, "input_format", None)
    weight = attn.q_norm.weight
    if (fmt is None or args or kwargs or not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16 or q.dim() != 2
            or (q.numel() and q.stride(1) != 1) or weight.dtype != torch.bfloat16 or weight.device != q.device
            or _why_no_pair() is not None):
        return original(attn, q, *args, **kwargs)
    return rms_norm(q, weight, attn.q_norm.variance_epsilon, out_format=fmt)


# the MQALayer whose forward is running: SGLang computes its wo_a product in a module function
# that is handed the weight, not the layer, and the pair's format is the layer's wo_b's
_running_attention: contextvars.ContextVar = contextvars.ContextVar("fp8chain_running_mqa_layer", default=None)


def around_mqa_forward(original, attn, *args, **kwargs):
    """AROUND hook of ``MQALayer.forward``: upstream's forward, the layer known to the wo_a hook."""
    token = _running_attention.set(attn)
    try:
        return original(attn, *args, **kwargs)
    finally:
        _running_attention.reset(token)


def _asks_upstream(reads_flags, args, kwargs) -> bool:
    """Whether a hooked call's arguments after its tensors ask for upstream's own path:
    ``reads_flags`` reads them by SGLang 0.5.23's signature; arguments it does not know count as
    asking (a later SGLang's, whose meaning the hook cannot tell)."""
    try:
        return reads_flags(*args, **kwargs)
    except TypeError:
        return True


def _wo_a_output_asked(is_decode=False, is_target_verify=False, fuse_mxfp8_quant=False, is_prefill=False,
                       fast_path=False, fp8_grid=False, emit_fp8=False) -> bool:
    """Whether a ``_apply_wo_a_bf16_matmul`` call asks for upstream's own quantized output (its
    SGLang 0.5.23 signature after ``o, wo_a``)."""
    return bool(fuse_mxfp8_quant or fp8_grid or emit_fp8)


def around_wo_a_bf16_matmul(original, o, wo_a, *args, **kwargs):
    """AROUND hook of ``_apply_wo_a_bf16_matmul(o, wo_a, ...)``: inside an ``MQALayer`` forward
    whose ``wo_b`` reads pairs, the FP8 pair of the einsum's ``[T, G*R]`` result from one
    ``einsum.wo_a_einsum`` launch, which ``_project_wo_b`` hands to ``wo_b`` as it is."""
    attn = _running_attention.get()
    fmt = getattr(getattr(attn, "wo_b", None), "input_format", None)
    own = getattr(getattr(attn, "wo_a", None), "weight", None)
    if (fmt is None or _asks_upstream(_wo_a_output_asked, args, kwargs)
            or not isinstance(o, torch.Tensor) or not isinstance(wo_a, torch.Tensor)
            or not isinstance(own, torch.Tensor) or wo_a.data_ptr() != own.data_ptr()  # the layer's own wo_a
            or o.dtype != torch.bfloat16 or wo_a.dtype != torch.bfloat16 or o.dim() != 3 or wo_a.dim() != 3
            or (o.numel() and o.stride(2) != 1) or (wo_a.numel() and wo_a.stride(2) != 1)
            or wo_a.shape[1] % fmt.group_size or _why_no_pair() is not None):
        return original(o, wo_a, *args, **kwargs)
    return wo_a_einsum(o, wo_a, out_format=fmt, return_bf16=False)


# (wqkv_a's input format, the list the combine's pair goes to) while an attention read of the
# mHC boundary runs: SGLang's read calls the module function ``combine``, which is handed the
# sublayer's hyper-connection, not the layer whose wqkv_a reads the result
_boundary_pair_sink: contextvars.ContextVar = contextvars.ContextVar("fp8chain_boundary_pair_sink", default=None)


def _shared_expert_reading_pairs(layer):
    """The shared expert (``DeepseekV2MLP``) of a DeepSeek-V4 layer whose ``gate_up_proj`` and
    ``down_proj`` both read pairs (None otherwise): the MLP hook chains the two only then, and a
    shared expert fused into the DeepGEMM mega MoE (``mega_shared_l1_weights``, None otherwise)
    does not run as a ``DeepseekV2MLP``."""
    moe = getattr(layer, "mlp", None)
    shared = getattr(moe, "shared_experts", None)
    if (not getattr(moe, "is_deepseek_v4", False) or getattr(moe, "mega_shared_l1_weights", None) is not None
            or getattr(getattr(shared, "gate_up_proj", None), "input_format", None) is None
            or getattr(getattr(shared, "down_proj", None), "input_format", None) is None):
        return None
    return shared


def _boundary_consumer_format(read):
    """The input format of the linear an mHC read feeds where it reads pairs (None: upstream's
    read), in DSv4.1's shifted ordering: for the attention's read a fused ``wqkv_a`` without a
    pre-quantized input of upstream's own (Blackwell's swizzled MXFP8), for the FFN's read the
    shared expert's ``gate_up_proj``."""
    layer = getattr(read, "layer", None)
    if not getattr(layer, "boundary_pre_from_prev", False):
        return None
    if not getattr(read, "attention", False):
        shared = _shared_expert_reading_pairs(layer)
        return None if shared is None else shared.gate_up_proj.input_format
    attn = getattr(layer, "self_attn", None)
    if not getattr(attn, "fuse_wqa_wkv", False):
        return None
    swizzled = getattr(attn, "accepts_mxfp8_swizzled_input", None)
    if swizzled is None or swizzled():
        return None
    return getattr(getattr(attn, "wqkv_a", None), "input_format", None)


def _read_asks_format(quant_format="", post_residual_addition=None) -> bool:
    """Whether an ``HcReadCall.read`` call asks for a projection format or a residual addition of
    its own (its SGLang 0.5.23 signature after ``residual, norm``; the layer-boundary framework
    passes the defaults, and upstream's mHC read refuses anything else)."""
    return bool(quant_format) or post_residual_addition is not None


def around_hc_read(original, read, residual, norm, *args, **kwargs):
    """AROUND hook of ``HcReadCall.read(residual, norm)``: upstream's read; where the linear it feeds
    reads pairs, its combine (the hook below) also writes the pair of the normed rows. The attention
    read's pair goes where upstream puts its own pre-quantized input (``ReadState.quantized``, handed
    to ``MQALayer.forward`` as ``x_quant`` and from there to ``wqkv_a``); the FFN read's goes to the
    shared expert with the rows it quantizes (``fp8chain_gate_up_input``), for the MLP hook."""
    fmt = _boundary_consumer_format(read)
    if fmt is None or _asks_upstream(_read_asks_format, args, kwargs) or _why_no_pair() is not None:
        return original(read, residual, norm, *args, **kwargs)
    folded = getattr(getattr(residual, "input", None), "pair", None)  # the post's fold (around_post_fusion)
    sink = [folded] if isinstance(folded, QuantizedActivation) and folded.fmt is fmt else []
    token = _boundary_pair_sink.set((fmt, sink))
    try:
        x, state = original(read, residual, norm, *args, **kwargs)
    finally:
        _boundary_pair_sink.reset(token)
    if not read.attention:
        _shared_expert_reading_pairs(read.layer).fp8chain_gate_up_input = (x, sink[0]) if sink else None
    elif sink and getattr(state, "quantized", False) is None:
        state.quantized = sink[0]
    return x, state


def _bf16_streams(residual) -> bool:
    """Whether ``residual`` holds mHC streams fp8chain's boundary launches read: bf16 ``[T, 4, H]``,
    unit stride along H."""
    return (isinstance(residual, torch.Tensor) and residual.dtype == torch.bfloat16 and residual.dim() == 3
            and residual.shape[1] == 4 and not (residual.numel() and residual.stride(2) != 1))


def _fp32_on(t, shape, device) -> bool:
    """Whether ``t`` is an fp32 tensor of ``shape`` on ``device`` (the mHC coefficients)."""
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == shape and t.device == device


def _norm_weight(norm, cols: int, device):
    """``norm.weight`` as fp8chain's norm launches read it (bf16, contiguous, ``[cols]`` on
    ``device``), or None."""
    weight = getattr(norm, "weight", None)
    if (not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16 or weight.shape != (cols,)
            or not weight.is_contiguous() or weight.device != device):
        return None
    return weight


def _combine_operands(hc, state, fmt):
    """``(R, pre, norm)`` of a combine fp8chain's launch computes as upstream's does, or None:
    bf16 streams ``[T, 4, H]`` with fp32 ``pre [T, 4]`` (None: the first layer, which normalizes
    ``R[:, 0]``), a plain bf16 RMSNorm over H, H a multiple of the pair's group."""
    residual, pre, norm = getattr(state, "streams", None), getattr(state, "pre", None), getattr(hc, "norm", None)
    if (getattr(state, "input", None) is not None or not _bf16_streams(residual)
            or _norm_weight(norm, residual.shape[2], residual.device) is None
            or residual.shape[2] % fmt.group_size or getattr(norm, "cast_x_before_out_mul", False)
            or getattr(norm, "variance_size_override", None) is not None
            or (pre is not None and not _fp32_on(pre, residual.shape[:2], residual.device))):
        return None
    return residual, pre, norm


def around_hc_combine(original, hc, state, quantized=None, *args, **kwargs):
    """AROUND hook of the module function ``combine(hc, state, quantized)``: inside an attention
    read whose ``wqkv_a`` reads pairs (``around_hc_read``), one fp8chain launch returns the bf16
    ``x = RMSNorm(sum_k pre[k] * R[k])`` and leaves its pair in ``wqkv_a.input_format`` for the read."""
    want = _boundary_pair_sink.get()
    operands = (None if want is None or quantized is not None or args or kwargs
                else _combine_operands(hc, state, want[0]))
    if operands is None:
        return original(hc, state, quantized, *args, **kwargs)
    (fmt, sink), (residual, pre, norm) = want, operands
    if pre is None:
        x, pair = rms_norm(residual[:, 0], norm.weight, norm.variance_epsilon, out_format=fmt)
    else:
        x, pair = mhc_combine_norm(residual, pre, norm.weight, norm.variance_epsilon, out_format=fmt)
    sink.append(pair)
    return x


# the mHC read (``HcReadCall``) whose ``update_and_read`` runs: the post it calls is handed the next
# boundary's norm, not the layer whose wqkv_a reads the result
_folding_read: contextvars.ContextVar = contextvars.ContextVar("fp8chain_folding_mhc_read", default=None)


def around_hc_update_and_read(original, read, *args, **kwargs):
    """AROUND hook of ``HcReadCall.update_and_read(update, value, residual, norm)``: upstream's, the
    read known to the post hook below (the finished sublayer's post, then this read)."""
    token = _folding_read.set(read)
    try:
        return original(read, *args, **kwargs)
    finally:
        _folding_read.reset(token)


def _fold_operands(y, residual, coefficients, next):
    """``(pre, post, comb, norm)`` of a post fp8chain's boundary launch folds with the next
    sublayer's combine + RMSNorm, or None: bf16 ``y [T, H]`` and streams ``[T, 4, H]`` with unit
    stride along H, fp32 ``pre``, ``post [T, 4]`` and ``comb [T, 4, 4]``, and a next boundary whose
    norm upstream deems fusable and which feeds no DeepGEMM mega-MoE input."""
    norm = getattr(next, "norm", None)
    if (not getattr(next, "norm_fusable", False) or getattr(next, "mega_moe_input", None) is not None
            or not isinstance(y, torch.Tensor) or y.dtype != torch.bfloat16 or y.dim() != 2
            or (y.numel() and y.stride(1) != 1) or not _bf16_streams(residual)
            or residual.shape != (y.shape[0], 4, y.shape[1]) or residual.device != y.device
            or _norm_weight(norm, y.shape[1], y.device) is None
            or not isinstance(coefficients, tuple) or len(coefficients) != 3):
        return None
    rows = y.shape[0]
    shapes = ((rows, 4), (rows, 4), (rows, 4, 4))
    if not all(_fp32_on(mix, shape, y.device) for mix, shape in zip(coefficients, shapes)):
        return None
    return (*coefficients, norm)


def around_post_fusion(original, hc, y, residual, coefficients, next, *args, **kwargs):
    """AROUND hook of the module function ``_post_fusion(hc, y, residual, (pre, post, comb), next)``
    (``deepseek_v4_mhc``): inside an mHC read's ``update_and_read`` on a device fp8chain serves, the
    post, the next sublayer's combine + RMSNorm and, where the read feeds a linear that reads pairs
    (``_boundary_consumer_format``), that pair, in one ``mhc.mhc_mega_boundary`` launch, returned
    as upstream's Blackwell fused boundary returns them (``HcState`` with ``HcQuantized`` or
    ``HcNormed`` input). Upstream's Hopper post writes only the residual; the read's combine
    follows as its own launch."""
    read = _folding_read.get()
    operands = None if read is None or args or kwargs else _fold_operands(y, residual, coefficients, next)
    if operands is None or why_idle(y.device) is not None or _why_no_pair() is not None:
        return original(hc, y, residual, coefficients, next, *args, **kwargs)
    pre, post, comb, norm = operands
    fmt = _boundary_consumer_format(read)
    if fmt is not None and y.shape[1] % fmt.group_size:
        fmt = None
    new_residual, x, pair = mhc_mega_boundary(y, residual, pre, post, comb, norm.weight, norm.variance_epsilon,
                                              out_format=fmt)
    mhc = sys.modules[original.__module__]  # SGLang's deepseek_v4_mhc, whose types the read expects
    return mhc.HcState(new_residual, pre, mhc.HcNormed(x) if pair is None else mhc.HcQuantized(x, pair))


def after_moe_init(result, moe, *args, **kwargs):
    """AFTER hook of ``DeepseekV2MoE.__init__``: in a DeepSeek-V4 layer, the shared expert's
    ``gate_up_proj`` and ``down_proj`` ask for a pre-quantized input where fp8chain's consumers run
    (the module docstring). A shared expert fused into the routed experts has no ``shared_experts``."""
    if not getattr(moe, "is_deepseek_v4", False):
        return None
    for name in ("gate_up_proj", "down_proj"):
        _ask_for_pair(getattr(getattr(moe, "shared_experts", None), name, None))
    return None


def _mlp_input_prequantized(forward_batch=None, gemm_output_zero_allocator=None, gateup_pre_quant=None) -> bool:
    """Whether a ``DeepseekV2MLP.forward`` call brings gate_up's input already quantized (its
    SGLang 0.5.23 signature after ``x``; the allocator only places uint8-weight outputs)."""
    return gateup_pre_quant is not None


def _gate_up_input(mlp, x):
    """What ``gate_up_proj`` reads for ``x``: the pair the FFN's mHC read left with these very rows
    (``around_hc_read``), else ``x``. The pair is taken once; a row gather, a slice or a copy of the
    read's rows between the read and the shared expert makes another tensor, which reads bf16."""
    carried = getattr(mlp, "fp8chain_gate_up_input", None)
    mlp.fp8chain_gate_up_input = None
    if carried is None or carried[0] is not x:
        return x
    pair = carried[1]
    if x.is_cuda:  # the shared expert may run on a side stream, the read wrote the pair on its own
        for t in pair:
            t.record_stream(torch.cuda.current_stream(x.device))
    return pair


def around_mlp_forward(original, mlp, x, *args, **kwargs):
    """AROUND hook of ``DeepseekV2MLP.forward``: where ``down_proj`` reads pairs, gate_up (on the
    pair of ``x`` the FFN's mHC read wrote, where there is one, else upstream's bf16 path), then one
    ``act.silu_mul`` launch writing the pair of the clamped SiLU*mul in ``down_proj.input_format``,
    then ``down_proj`` on that pair. On a pair, where gate_up's GEMM has the SiLU*mul epilogue and it
    pays (``consumer_gemm_silu_mul``), the two are one launch, bit for bit the same pair."""
    fmt = getattr(getattr(mlp, "down_proj", None), "input_format", None)
    if (fmt is None or _asks_upstream(_mlp_input_prequantized, args, kwargs)
            or not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2
            or x.shape[0] == 0 or getattr(mlp, "_enable_nvfp4_gemm_swiglu_fusion", False)
            or _why_no_pair() is not None):
        return original(mlp, x, *args, **kwargs)
    gate_up_input, limit = _gate_up_input(mlp, x), getattr(mlp, "swiglu_limit", None)
    pair = None
    if isinstance(gate_up_input, QuantizedActivation):  # gate_up with the SiLU*mul epilogue, where it pays
        gate_up_proj = mlp.gate_up_proj
        pair = consumer_gemm_silu_mul(gate_up_proj, gate_up_input, limit, fmt, _layer_name(gate_up_proj))
    if pair is None:
        gate_up, _ = mlp.gate_up_proj(gate_up_input)
        pair = silu_mul(gate_up, limit=limit, out_format=fmt, return_bf16=False)
    out, _ = mlp.down_proj(pair)
    return out


# every hook ``install`` registers: (SGLang's dotted target, the hook, SGLang's ``HookType`` name)
HOOKS = (
    (f"{FP8_CONFIG}.get_quant_method", after_get_quant_method, "AFTER"),
    (f"{FP8_LINEAR_METHOD}.process_weights_after_loading", around_process_weights, "AROUND"),
    (f"{FP8_LINEAR_METHOD}.apply", around_apply, "AROUND"),
    (f"{MQA_LAYER}.__init__", after_mqa_init, "AFTER"),
    (f"{MQA_LAYER}._normalize_q_lora", around_normalize_q_lora, "AROUND"),
    (f"{MQA_LAYER}.forward", around_mqa_forward, "AROUND"),
    (WO_A_BF16_MATMUL, around_wo_a_bf16_matmul, "AROUND"),
    (f"{MOE}.__init__", after_moe_init, "AFTER"),
    (f"{MLP}.forward", around_mlp_forward, "AROUND"),
    (f"{HC_READ}.read", around_hc_read, "AROUND"),
    (HC_COMBINE, around_hc_combine, "AROUND"),
    (f"{HC_READ}.update_and_read", around_hc_update_and_read, "AROUND"),
    (HC_POST_FUSION, around_post_fusion, "AROUND"),
)
