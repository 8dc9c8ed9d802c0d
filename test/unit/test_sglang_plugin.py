"""The SGLang plugin: entry point, hook registration, and the hooks on an SGLang-shaped FP8
linear (a module carrying upstream's ``weight`` / ``weight_scale_inv`` and the request flag)."""

import enum
import importlib.metadata
import logging
import sys
import types

import pytest
import torch

from fp8chain.integrations import sglang as plugin
from fp8chain.layers.linear import ReplicatedLinear
from fp8chain.layers.loading import load_weights
from fp8chain.layers.quantization.fp8 import Fp8Config
from fp8chain_kernel import backends
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat
from fp8chain_kernel.quant import quantize
from helpers import DerivingBackend, UpstreamLinear, rel_error, upstream_method, upstream_process

pytestmark = pytest.mark.cpu


def upstream_apply(method, layer, x, bias=None):
    """Stands for upstream's bf16 path: records that it ran."""
    upstream_apply.calls += 1
    return torch.zeros(x.shape[0], layer.weight.shape[0], dtype=torch.bfloat16)


def test_entry_point_names_install():
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=plugin.PLUGIN_GROUP)}
    assert found.get("fp8chain") == "fp8chain.integrations.sglang:install"


def test_install_registers_both_hooks(monkeypatch):
    registered = []
    hook_type = enum.Enum("HookType", ["BEFORE", "AFTER", "AROUND", "REPLACE"])
    registry = types.SimpleNamespace(register=lambda target, hook, kind: registered.append((target, hook, kind)))
    module = types.ModuleType("sglang.srt.plugins.hook_registry")
    module.HookRegistry, module.HookType = registry, hook_type
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", module)
    plugin.install()
    method = "sglang.srt.layers.quantization.fp8.Fp8LinearMethod"
    assert registered == [
        ("sglang.srt.layers.quantization.fp8.Fp8Config.get_quant_method", plugin.after_get_quant_method,
         hook_type.AFTER),
        (f"{method}.process_weights_after_loading", plugin.around_process_weights, hook_type.AROUND),
        (f"{method}.apply", plugin.around_apply, hook_type.AROUND),
    ]


def test_a_request_outlives_upstreams_processing_and_layers_are_named(monkeypatch, caplog):
    """Upstream's processing resets the request flag off Blackwell: the hook reads it first and
    serves it (the flag True again, as upstream leaves a layer it prepared). The layer's name comes
    from get_quant_method's prefix (upstream's LinearBase keeps none). A layer that asks nothing is
    left alone, and that the consumers stay idle is logged once."""
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale, prefix=None)
    assert plugin.after_get_quant_method(None, object(), layer, prefix="model.layers.3.self_attn.wo_b") is None
    upstream_process.calls = 0
    plugin.around_process_weights(upstream_process, upstream_method(), layer)
    assert upstream_process.calls == 1
    assert layer.deepgemm_mxfp8_input is True and layer.input_format is backends.input_format_for(32)
    other = next(f for f in ActFormat if f is not layer.input_format)
    with pytest.raises(TypeError, match="model.layers.3.self_attn.wo_b reads"):
        plugin.around_apply(upstream_apply, upstream_method(), layer, quantize(torch.randn(2, 128).bfloat16(), other))
    monkeypatch.setattr(plugin, "_idle_noted", False)
    with caplog.at_level(logging.INFO, logger="fp8chain.integrations.sglang"):
        for i in range(3):
            idle = UpstreamLinear(weight.clone(), scale.clone(), request=False, prefix=f"layers.{i}.mlp.down_proj")
            plugin.around_process_weights(upstream_process, upstream_method(), idle)
            assert idle.deepgemm_mxfp8_input is False and not hasattr(idle, "input_format")
    assert caplog.text.count("asks no pre-quantized input") == 1 and "layers.0.mlp.down_proj" in caplog.text


@pytest.mark.parametrize("rows", [1, 5])
def test_requested_layer_reads_pairs_like_fp8chains_own_linear(rows):
    n, k = 128, 256
    weight, scale = ref.random_fp8_weight(n, k, 32)
    layer = UpstreamLinear(weight.clone(), scale.clone())
    assert plugin.around_process_weights(upstream_process, upstream_method(), layer) is None
    fmt = backends.input_format_for(32)
    assert layer.input_format is fmt and layer.deepgemm_mxfp8_input is True
    own = ReplicatedLinear(k, n, quant_config=Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0"))
    own.deepgemm_mxfp8_input = True
    load_weights(own, [("weight", weight), ("weight_scale_inv", scale)])
    pair = quantize(torch.randn(rows, k).bfloat16(), fmt)
    bias = torch.randn(n).bfloat16()
    upstream_apply.calls = 0
    out = plugin.around_apply(upstream_apply, upstream_method(), layer, pair, bias)
    assert upstream_apply.calls == 0
    want = own(pair) + bias
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert rel_error(out - bias, ref.fp8_gemm(pair, weight, scale, 32)) < 5e-3


def test_bf16_input_runs_upstream():
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale)
    plugin.around_process_weights(upstream_process, upstream_method(), layer)
    upstream_apply.calls = 0
    out = plugin.around_apply(upstream_apply, upstream_method(), layer, torch.randn(3, 128).bfloat16())
    assert upstream_apply.calls == 1 and out.shape == (3, 64)


def test_layer_without_request_is_left_to_upstream():
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale, request=False)
    plugin.around_process_weights(upstream_process, upstream_method(), layer)
    assert not hasattr(layer, "input_format")
    pair = quantize(torch.randn(2, 128).bfloat16(), backends.input_format_for(32))
    with pytest.raises(TypeError, match="reads bf16 input"):
        plugin.around_apply(upstream_apply, upstream_method(), layer, pair)


def test_pair_in_another_format_raises_naming_both():
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale)
    plugin.around_process_weights(upstream_process, upstream_method(), layer)
    other = next(f for f in ActFormat if f is not layer.input_format)
    with pytest.raises(TypeError, match=f"reads {layer.input_format.value}, got a pair in {other.value}"):
        plugin.around_apply(upstream_apply, upstream_method(), layer, quantize(torch.randn(2, 128).bfloat16(), other))


def test_unsupported_block_refuses_the_request(caplog):
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale)
    with caplog.at_level(logging.WARNING, logger="fp8chain.integrations.sglang"):
        plugin.around_process_weights(upstream_process, upstream_method(block=64), layer)
    assert layer.deepgemm_mxfp8_input is False and layer.input_format is None
    assert "no fp8chain consumer for weight block [64, 64]" in caplog.text


@pytest.mark.parametrize("prepared", [True, False])
def test_blackwell_is_left_to_upstream(monkeypatch, prepared):
    """On Blackwell the flag ends as upstream's own preparation left it, fp8chain adds nothing."""
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale)
    monkeypatch.setattr(plugin, "_upstream_serves_request", lambda device: True)

    def upstream_on_blackwell(method, layer):
        layer.deepgemm_mxfp8_input = prepared

    plugin.around_process_weights(upstream_on_blackwell, upstream_method(), layer)
    assert layer.deepgemm_mxfp8_input is prepared and not hasattr(layer, "input_format")


@pytest.mark.parametrize("capability,hip,serves", [((9, 0), None, True), ((8, 0), None, False),
                                                  ((8, 9), None, False), ((9, 0), "6.2", False)])
def test_fp8chain_takes_requests_on_hopper_only(monkeypatch, capability, hip, serves):
    """Before Hopper (upstream may have repacked the weights for Marlin) and on ROCm (e4m3fnuz)
    the hook leaves the layer to upstream: it refuses the request without reading the weights."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    reason = plugin._why_not_fp8chain(torch.device("cuda", 0))
    assert (reason is None) is serves
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert plugin._why_not_fp8chain(torch.device("cpu")) is None  # the interpreter (these tests)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "without the Triton interpreter" in plugin._why_not_fp8chain(torch.device("cpu"))


def test_a_device_fp8chain_does_not_serve_keeps_upstreams_weights(monkeypatch, caplog):
    marlin_packed = torch.zeros(128 // 8, 64, dtype=torch.int32)  # not an e4m3 [N, K] weight
    layer = UpstreamLinear(marlin_packed, torch.ones(2, 4))
    monkeypatch.setattr(plugin, "_why_not_fp8chain", lambda device: "sm_80 (test)")
    with caplog.at_level(logging.WARNING, logger="fp8chain.integrations.sglang"):
        plugin.around_process_weights(upstream_process, upstream_method(), layer)  # no TypeError: not read
    assert layer.deepgemm_mxfp8_input is False and layer.input_format is None
    assert "no fp8chain consumer on sm_80 (test); keeping bf16 input" in caplog.text
    assert layer.weight.dtype == torch.int32 and layer.weight.data_ptr() == marlin_packed.data_ptr()


def test_weights_repacked_for_amx_are_not_read(caplog):
    """Upstream's CPU path repacks the weights for Intel AMX (``use_intel_amx_backend``): the CPU
    under the interpreter is served, but such a layer is refused without reading them as e4m3."""
    amx_packed = torch.zeros(64, 128, dtype=torch.float8_e4m3fn)  # the right dtype and shape, another layout
    layer = UpstreamLinear(amx_packed, torch.ones(2, 4))
    layer.use_intel_amx_backend = True
    with caplog.at_level(logging.WARNING, logger="fp8chain.integrations.sglang"):
        plugin.around_process_weights(upstream_process, upstream_method(), layer)
    assert layer.deepgemm_mxfp8_input is False and layer.input_format is None
    assert "no fp8chain consumer for weights repacked for Intel AMX" in caplog.text
    assert not getattr(layer, "derived_weight_names", None)


def test_reprocessing_after_a_reload_keeps_derived_storage(monkeypatch):
    """A reload runs the hook again: the derived tensors keep their storage (captured graphs still
    read them) and hold the new weights' values, so the GEMM after the reload is that of the new
    weights (the deriving backend runs on its derived copy only: stale values would show)."""
    real = backends.select_backend
    monkeypatch.setattr(backends, "select_backend",
                        lambda fmt, block, n, k, prefer=None: DerivingBackend(real(fmt, block, n, k)))
    weight, scale = ref.random_fp8_weight(128, 256, 32)
    layer = UpstreamLinear(weight, scale)
    plugin.around_process_weights(upstream_process, upstream_method(), layer)
    assert layer.derived_weight_names  # the deriving backend wrote one
    before = {name: getattr(layer, name).data_ptr() for name in layer.derived_weight_names}
    new_weight, new_scale = ref.random_fp8_weight(128, 256, 32)
    layer.weight.data.copy_(new_weight)
    layer.weight_scale_inv.data.copy_(new_scale)
    layer.deepgemm_mxfp8_input = True
    plugin.around_process_weights(upstream_process, upstream_method(), layer)
    assert {name: getattr(layer, name).data_ptr() for name in layer.derived_weight_names} == before
    pair = quantize(torch.randn(5, 256).bfloat16(), layer.input_format)
    out = plugin.around_apply(upstream_apply, upstream_method(), layer, pair)
    assert rel_error(out, ref.fp8_gemm(pair, new_weight, new_scale, 32)) < 5e-3

def test_a_layer_no_backend_serves_keeps_upstreams_bf16_path(monkeypatch, caplog):
    """Where no fp8chain backend serves the layer, the request is refused and the warning names
    what runs its bf16 input in SGLang: upstream's GEMM (not fp8chain's torch fallback)."""
    def none_serves(fmt, block, n, k, prefer=None):
        raise ValueError("no backend reads this (test)")

    monkeypatch.setattr(backends, "select_backend", none_serves)
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale)
    with caplog.at_level(logging.WARNING, logger="fp8chain.layers.quantization.fp8"):
        plugin.around_process_weights(upstream_process, upstream_method(), layer)
    assert layer.deepgemm_mxfp8_input is False and layer.input_format is None
    assert "keeping bf16 input, using upstream's GEMM" in caplog.text
    upstream_apply.calls = 0
    plugin.around_apply(upstream_apply, upstream_method(), layer, torch.randn(2, 128).bfloat16())
    assert upstream_apply.calls == 1


@pytest.mark.parametrize("capability,upstream", [((9, 0), False), ((10, 0), True), ((12, 0), True)])
def test_upstream_serves_the_request_from_blackwell_on(monkeypatch, capability, upstream):
    """sm_100 and later: SGLang's own producers and DeepGEMM take the request (the plugin must not
    refuse it there); Hopper: fp8chain's."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    assert plugin._upstream_serves_request(torch.device("cuda", 0)) is upstream


def test_a_non_square_weight_block_is_refused_with_a_warning(caplog):
    """A [32, 128] weight block is no format fp8chain reads: the request is refused (bf16 input, a
    WARNING naming the block), not taken as 32-blocks that fail the weight check at load."""
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale)
    method = upstream_method()
    method.quant_config.weight_block_size = [32, 128]
    with caplog.at_level(logging.WARNING, logger="fp8chain.integrations.sglang"):
        plugin.around_process_weights(upstream_process, method, layer)
    assert layer.deepgemm_mxfp8_input is False and layer.input_format is None
    assert "for weight block [32, 128]" in caplog.text


def test_a_positional_prefix_names_the_layer():
    """``get_quant_method(layer, prefix)`` called positionally still names the layer in logs."""
    layer = torch.nn.Linear(2, 2)
    plugin.after_get_quant_method(None, object(), layer, "model.layers.0.mlp.down_proj")
    assert layer.fp8chain_prefix == "model.layers.0.mlp.down_proj"
