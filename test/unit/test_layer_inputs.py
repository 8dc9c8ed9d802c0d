"""The layer entry points refuse bad input before computing anything: the unquantized linear's
input and params_dtype, the SGLang hook's checkpoint tensors, Fp8Config's fields,
copy_or_rebind_param's storage, get_quantization_config's method name."""

import re

import pytest
import torch
from torch import nn

from fp8chain.integrations import sglang as plugin
from fp8chain.layers.linear import ReplicatedLinear
from fp8chain.layers.loading import load_weights
from fp8chain.layers.parameter import copy_or_rebind_param
from fp8chain.layers.quantization import get_quantization_config
from fp8chain.layers.quantization.fp8 import Fp8Config
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import FP8_DTYPE, ActFormat
from fp8chain_kernel.quant import quantize
from helpers import UpstreamLinear, upstream_method, upstream_process

pytestmark = pytest.mark.cpu

N, K = 64, 128


def unquantized_layer():
    layer = ReplicatedLinear(K, N, prefix="model.lm_head")
    load_weights(layer, [("weight", torch.randn(N, K).bfloat16())])
    return layer


def fp8_layer():
    layer = ReplicatedLinear(K, N, quant_config=Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0"),
                             prefix="model.wq_b")
    weight, scale = ref.random_fp8_weight(N, K, 32)
    load_weights(layer, [("weight", weight), ("weight_scale_inv", scale)])
    return layer


# ---- UnquantizedLinearMethod ------------------------------------------------------------------

def _pair():
    return quantize(torch.randn(3, K).bfloat16(), ActFormat.SM90_G32_FP32_MN)


@pytest.mark.parametrize("make_input,came", [
    (lambda: _pair().data, "torch.float8_e4m3fn"),  # a pair's FP8 bytes without their scales
    (lambda: torch.randint(-4, 4, (3, K)), "torch.int64"),
    (lambda: (_pair().data, _pair().scale), "tuple"),
], ids=["fp8-data", "int", "tuple"])
def test_unquantized_layer_refuses_what_it_would_cast(make_input, came):
    layer = unquantized_layer()
    with pytest.raises(TypeError, match=f"model.lm_head: expected a bfloat16 or float32 tensor, got {came}"):
        layer(make_input())
    assert layer(torch.randn(3, K)).shape == (3, N)  # fp32 is what the bf16 path computes on too


@pytest.mark.parametrize("make_layer,shape", [
    (unquantized_layer, (3, K // 2)),
    (unquantized_layer, ()),
    (fp8_layer, ()),  # the FP8 method shares the check (a wrong K there was already a ValueError)
], ids=["unquantized-wrong-K", "unquantized-scalar", "fp8-scalar"])
def test_input_not_ending_in_k_is_a_value_error(make_layer, shape):
    message = f"input shape {tuple(shape)} does not end in the weight's K={K}"
    with pytest.raises(ValueError, match=re.escape(message)):
        make_layer()(torch.zeros(shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("quantized", [False, True], ids=["unquantized", "fp8"])
@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.int32])
def test_a_non_dense_params_dtype_is_refused(dtype, quantized):
    """An unquantized layer's weights and any layer's bias are held in params_dtype: an FP8 layer's
    int32 bias would truncate the checkpoint's bias (0.75 -> 0) without a word."""
    config = Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0") if quantized else None
    with pytest.raises(TypeError, match=re.escape(f"model.lm_head: params_dtype (an unquantized layer's weights, "
                                                  f"the bias) must be bfloat16 or float32, got params_dtype={dtype}")):
        ReplicatedLinear(K, N, prefix="model.lm_head", params_dtype=dtype, bias=True, quant_config=config)


# ---- the SGLang hook --------------------------------------------------------------------------

def _with_scale(value):
    def edit(weight, scale):
        scale[1, 2] = value
        return weight, scale
    return edit


NOT_POSITIVE = r"\.weight_scale_inv: 1 of 8 scales are not positive and finite; first at \[1, 2\]: "


@pytest.mark.parametrize("edit,error,message", [
    (_with_scale(float("nan")), ValueError, NOT_POSITIVE + "nan"),
    (_with_scale(-2.0 ** -8), ValueError, NOT_POSITIVE + "-0.00390625"),
    (_with_scale(float("inf")), ValueError, NOT_POSITIVE + "inf"),
    (lambda w, s: (w, s.bfloat16()), TypeError, ": weight_scale must be float32, got torch.bfloat16"),
    (lambda w, s: (w, s.t().contiguous()), ValueError, r": weight 64x128 .* needs scales \(2, 4\), got \(4, 2\)"),
    (lambda w, s: (w.bfloat16(), s), TypeError, ": weight must be torch.float8_e4m3fn, got torch.bfloat16"),
    (lambda w, s: (w.to(torch.float8_e5m2), s), TypeError, ": weight must be .*, got torch.float8_e5m2"),
], ids=["nan-scale", "negative-scale", "inf-scale", "bf16-scales", "transposed-scales", "bf16-weight",
        "e5m2-weight"])
def test_hook_runs_fp8chains_weight_checks_at_load(edit, error, message):
    weight, scale = edit(*ref.random_fp8_weight(N, K, 32))
    layer = UpstreamLinear(weight, scale)
    with pytest.raises(error, match=f"model\\.layers\\.0\\.self_attn\\.wq_b{message}"):
        plugin.around_process_weights(upstream_process, upstream_method(), layer)
    # no pair is taken until a processing succeeds; the request stands for it
    assert layer.input_format is None and layer.deepgemm_mxfp8_input is False
    assert layer.fp8chain_refused_request is True


def test_hook_refuses_weights_repacked_for_marlin(caplog):
    """Upstream's method repacks the weights for Marlin (use_marlin, e.g. SGLANG_FORCE_FP8_MARLIN):
    they are no e4m3 [N, K] any more, so the request is refused before they are read."""
    layer = UpstreamLinear(torch.zeros(N // 2, K, dtype=torch.int32), torch.ones(2, 4).bfloat16())
    method = upstream_method()
    method.use_marlin = True
    with caplog.at_level("WARNING", logger="fp8chain.integrations.sglang"):
        plugin.around_process_weights(upstream_process, method, layer)
    assert layer.deepgemm_mxfp8_input is False and layer.input_format is None
    assert "repacked for Marlin" in caplog.text


def test_hook_checks_powers_of_two_when_the_config_says_ue8m0():
    weight, scale = ref.random_fp8_weight(N, K, 32)
    scale[0, 3] = 0.3
    plugin.around_process_weights(upstream_process, upstream_method(), UpstreamLinear(weight, scale))  # arbitrary scales
    with pytest.raises(ValueError, match=r"not positive, finite powers of two .*first at \[0, 3\]"):
        plugin.around_process_weights(upstream_process, upstream_method(scale_fmt="ue8m0"), UpstreamLinear(weight, scale))


# ---- Fp8Config --------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["ignored_layers", "modules_to_not_convert"])
def test_ignored_layers_as_a_string_is_refused(key):
    with pytest.raises(TypeError, match="fp8: ignored_layers / modules_to_not_convert must be a list or "
                                        "tuple of layer prefixes, got 'lm_head'"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [32, 32], key: "lm_head"})
    with pytest.raises(TypeError, match="list or tuple of layer prefixes"):
        Fp8Config(ignored_layers="lm_head")
    assert Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [32, 32],
                                  key: ["lm_head"]}).ignored_layers == ("lm_head",)


@pytest.mark.parametrize("block", [128, (128.9, 128.9), [128, 128.0]], ids=["bare-int", "fractional", "float"])
def test_weight_block_size_must_be_two_ints(block):
    with pytest.raises(TypeError, match=r"fp8: weight_block_size must be a list or tuple of ints, got "):
        Fp8Config(weight_block_size=block)
    with pytest.raises(TypeError, match="weight_block_size must be a list or tuple of ints"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": block})


def test_unknown_backend_is_refused_at_construction():
    with pytest.raises(ValueError, match="fp8: backend .* must be one of deep_gemm, triton, torch_blockwise "
                                         "or None, got 'trtion'"):
        Fp8Config(backend="trtion")
    with pytest.raises(ValueError, match="got 'trtion'"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [32, 32],
                               "fp8chain_backend": "trtion"})
    assert Fp8Config(backend="triton").backend == "triton"


# ---- copy_or_rebind_param ---------------------------------------------------------------------

def _module():
    m = nn.Module()
    m.weight = nn.Parameter(torch.randn(4, 6), requires_grad=False)
    m.register_buffer("table", torch.randn(6, 4))
    return m


@pytest.mark.parametrize("name", ["derived", "weight_t"], ids=["register", "rebind"])
@pytest.mark.parametrize("make_view,other", [
    (lambda m: m.weight.t(), "weight"),
    (lambda m: m.table[:, :2].t(), "table"),
], ids=["parameter-view", "buffer-view"])
def test_taking_a_view_of_another_parameter_is_refused(name, make_view, other):
    m = _module()
    if name == "weight_t":  # a parameter of another shape: the rebind branch takes the storage
        m.weight_t = nn.Parameter(torch.zeros(2, 2), requires_grad=False)
    before = m.weight.clone()
    with pytest.raises(ValueError, match=f"Module.{name}: the tensor shares memory with {other}"):
        copy_or_rebind_param(m, name, make_view(m))
    assert torch.equal(m.weight, before)
    copy_or_rebind_param(m, name, make_view(m).clone())  # a clone owns its storage


def test_taking_an_expanded_tensor_is_refused():
    m = _module()
    with pytest.raises(ValueError, match=r"Module.derived has elements sharing memory \(shape \(3, 4\), "
                                         r"strides \(0, 1\)\)"):
        copy_or_rebind_param(m, "derived", torch.ones(1, 4).expand(3, 4))
    # copying an expanded tensor's values into a parameter of that shape is fine
    p = copy_or_rebind_param(m, "derived", torch.zeros(3, 4))
    copy_or_rebind_param(m, "derived", torch.ones(1, 4).expand(3, 4))
    assert torch.equal(p, torch.ones(3, 4)) and p.stride() == (4, 1)


# ---- get_quantization_config ------------------------------------------------------------------

def test_get_quantization_config_by_name():
    assert get_quantization_config("fp8") is Fp8Config  # upstream's signature: name -> config class
    with pytest.raises(ValueError, match=r"unsupported quant_method 'fp9'; supported: \['fp8'\]"):
        get_quantization_config("fp9")
