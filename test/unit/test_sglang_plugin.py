"""The SGLang plugin: entry point, hook registration, and the hooks on an SGLang-shaped FP8
linear (a module carrying upstream's ``weight`` / ``weight_scale_inv`` and the request flag)."""

import dataclasses
import enum
import importlib.metadata
import logging
import sys
import types
from typing import NamedTuple

import pytest
import torch

from fp8chain.integrations import sglang as plugin
from fp8chain.layers.linear import ReplicatedLinear
from fp8chain.layers.loading import load_weights
from fp8chain.layers.quantization.fp8 import Fp8Config, consumer_gemm_silu_mul
from fp8chain_kernel import act, backends, einsum
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat
from fp8chain_kernel.quant import quantize
from fp8chain_kernel.reference.einsum import wo_a_einsum_fp
from fp8chain_kernel.reference.norm import rms_norm_fp32
from helpers import (DerivingBackend, UpstreamLinear, assert_close_bf16, assert_pairs_equal, rel_error,
                     upstream_method, upstream_process)


def upstream_apply(method, layer, x, bias=None):
    """Stands for upstream's bf16 path: records that it ran."""
    upstream_apply.calls += 1
    return torch.zeros(x.shape[0], layer.weight.shape[0], dtype=torch.bfloat16)


@pytest.mark.cpu
def test_entry_point_names_install():
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=plugin.PLUGIN_GROUP)}
    assert found.get("fp8chain") == "fp8chain.integrations.sglang:install"


@pytest.mark.cpu
def test_install_registers_the_hooks(monkeypatch):
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
    mqa = "sglang.srt.models.deepseek_v4.MQALayer"
    assert registered == [
        ("sglang.srt.layers.quantization.fp8.Fp8Config.get_quant_method", plugin.after_get_quant_method,
         hook_type.AFTER),
        (f"{method}.process_weights_after_loading", plugin.around_process_weights, hook_type.AROUND),
        (f"{method}.apply", plugin.around_apply, hook_type.AROUND),
        (f"{mqa}.__init__", plugin.after_mqa_init, hook_type.AFTER),
        (f"{mqa}._normalize_q_lora", plugin.around_normalize_q_lora, hook_type.AROUND),
        (f"{mqa}.forward", plugin.around_mqa_forward, hook_type.AROUND),
        ("sglang.srt.models.deepseek_v4._apply_wo_a_bf16_matmul", plugin.around_wo_a_bf16_matmul, hook_type.AROUND),
        ("sglang.srt.models.deepseek_v2.DeepseekV2MoE.__init__", plugin.after_moe_init, hook_type.AFTER),
        ("sglang.srt.models.deepseek_v2.DeepseekV2MLP.forward", plugin.around_mlp_forward, hook_type.AROUND),
        ("sglang.srt.models.deepseek_v4_boundary.HcReadCall.read", plugin.around_hc_read, hook_type.AROUND),
        ("sglang.srt.models.deepseek_v4_mhc.combine", plugin.around_hc_combine, hook_type.AROUND),
        ("sglang.srt.models.deepseek_v4_boundary.HcReadCall.update_and_read", plugin.around_hc_update_and_read,
         hook_type.AROUND),
        ("sglang.srt.models.deepseek_v4_mhc._post_fusion", plugin.around_post_fusion, hook_type.AROUND),
    ]


@pytest.mark.cpu
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


@pytest.mark.cpu
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


@pytest.mark.cpu
def test_bf16_input_runs_upstream():
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale)
    plugin.around_process_weights(upstream_process, upstream_method(), layer)
    upstream_apply.calls = 0
    out = plugin.around_apply(upstream_apply, upstream_method(), layer, torch.randn(3, 128).bfloat16())
    assert upstream_apply.calls == 1 and out.shape == (3, 64)


@pytest.mark.cpu
def test_layer_without_request_is_left_to_upstream():
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale, request=False)
    plugin.around_process_weights(upstream_process, upstream_method(), layer)
    assert not hasattr(layer, "input_format")
    pair = quantize(torch.randn(2, 128).bfloat16(), backends.input_format_for(32))
    with pytest.raises(TypeError, match="reads bf16 input"):
        plugin.around_apply(upstream_apply, upstream_method(), layer, pair)


@pytest.mark.cpu
def test_pair_in_another_format_raises_naming_both():
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale)
    plugin.around_process_weights(upstream_process, upstream_method(), layer)
    other = next(f for f in ActFormat if f is not layer.input_format)
    with pytest.raises(TypeError, match=f"reads {layer.input_format.value}, got a pair in {other.value}"):
        plugin.around_apply(upstream_apply, upstream_method(), layer, quantize(torch.randn(2, 128).bfloat16(), other))


@pytest.mark.cpu
def test_unsupported_block_refuses_the_request(caplog):
    weight, scale = ref.random_fp8_weight(64, 128, 32)
    layer = UpstreamLinear(weight, scale)
    with caplog.at_level(logging.WARNING, logger="fp8chain.integrations.sglang"):
        plugin.around_process_weights(upstream_process, upstream_method(block=64), layer)
    assert layer.deepgemm_mxfp8_input is False and layer.input_format is None
    assert "no fp8chain consumer for weight block [64, 64]" in caplog.text


@pytest.mark.cpu
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


@pytest.mark.cpu
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


@pytest.mark.cpu
def test_a_device_fp8chain_does_not_serve_keeps_upstreams_weights(monkeypatch, caplog):
    marlin_packed = torch.zeros(128 // 8, 64, dtype=torch.int32)  # not an e4m3 [N, K] weight
    layer = UpstreamLinear(marlin_packed, torch.ones(2, 4))
    monkeypatch.setattr(plugin, "_why_not_fp8chain", lambda device: "sm_80 (test)")
    with caplog.at_level(logging.WARNING, logger="fp8chain.integrations.sglang"):
        plugin.around_process_weights(upstream_process, upstream_method(), layer)  # no TypeError: not read
    assert layer.deepgemm_mxfp8_input is False and layer.input_format is None
    assert "no fp8chain consumer on sm_80 (test); keeping bf16 input" in caplog.text
    assert layer.weight.dtype == torch.int32 and layer.weight.data_ptr() == marlin_packed.data_ptr()


@pytest.mark.cpu
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


@pytest.mark.cpu
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

@pytest.mark.cpu
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


@pytest.mark.cpu
@pytest.mark.parametrize("capability,upstream", [((9, 0), False), ((10, 0), True), ((12, 0), True)])
def test_upstream_serves_the_request_from_blackwell_on(monkeypatch, capability, upstream):
    """sm_100 and later: SGLang's own producers and DeepGEMM take the request (the plugin must not
    refuse it there); Hopper: fp8chain's."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    assert plugin._upstream_serves_request(torch.device("cuda", 0)) is upstream


@pytest.mark.cpu
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


@pytest.mark.cpu
def test_a_positional_prefix_names_the_layer():
    """``get_quant_method(layer, prefix)`` called positionally still names the layer in logs."""
    layer = torch.nn.Linear(2, 2)
    plugin.after_get_quant_method(None, object(), layer, "model.layers.0.mlp.down_proj")
    assert layer.fp8chain_prefix == "model.layers.0.mlp.down_proj"


class UpstreamRMSNorm(torch.nn.Module):
    """What SGLang's ``RMSNorm`` carries: a bf16 ``weight`` and ``variance_epsilon``."""

    def __init__(self, hidden, device=None, eps=1e-6):
        super().__init__()
        weight = 1 + 0.1 * torch.randn(hidden, device=device).bfloat16()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.variance_epsilon = eps


class UpstreamMQA(torch.nn.Module):
    """SGLang's ``MQALayer`` as the hooks read it: the fused ``wqkv_a``, ``q_norm`` -> ``wq_b`` and
    ``wo_a`` (bf16, as a 32x32-block checkpoint keeps it on Hopper) -> ``wo_b``, the FP8 linears
    without a request of their own on Hopper."""

    def __init__(self, q_lora_rank=256, wq_b_rows=128, groups=2, o_lora_rank=64, group_width=96, hidden=160,
                 device=None, kv_width=64):
        super().__init__()
        self.fuse_wqa_wkv = True
        self.wqkv_a = UpstreamLinear(*ref.random_fp8_weight(q_lora_rank + kv_width, hidden, 32, device=device),
                                     request=False, prefix="model.layers.0.self_attn.wqkv_a")
        self.wq_b = UpstreamLinear(*ref.random_fp8_weight(wq_b_rows, q_lora_rank, 32, device=device), request=False)
        self.q_norm = UpstreamRMSNorm(q_lora_rank, device)
        self.n_local_groups, self.o_lora_rank = groups, o_lora_rank
        self.wo_a = torch.nn.Linear(group_width, groups * o_lora_rank, bias=False, device=device,
                                    dtype=torch.bfloat16).requires_grad_(False)
        self.wo_b = UpstreamLinear(*ref.random_fp8_weight(hidden, groups * o_lora_rank, 32, device=device),
                                   request=False, prefix="model.layers.0.self_attn.wo_b")

    def accepts_mxfp8_swizzled_input(self):
        return False  # Blackwell's FlashInfer input, never on Hopper


def upstream_normalize_q_lora(attn, q):
    """Stands for upstream's ``_normalize_q_lora`` on Hopper: the bf16 normed row, twice."""
    upstream_normalize_q_lora.calls += 1
    y = ref.rms_norm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)
    return y, y


def assert_same_bf16(got, want):
    """The same bits where finite, NaN at the same places (a NaN's payload may differ)."""
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.view(torch.int16)[~got.isnan()], want.view(torch.int16)[~want.isnan()])


def chained_mqa(monkeypatch, **shape):
    """An MQA layer built and loaded with the hooks, in a forward where a pair may go."""
    monkeypatch.setattr(plugin, "_why_no_pair", lambda: None)
    attn = UpstreamMQA(**shape)
    assert plugin.after_mqa_init(None, attn) is None
    for linear in (attn.wqkv_a, attn.wq_b, attn.wo_b):
        assert linear.deepgemm_mxfp8_input is True  # the request, made before the weights load
        plugin.around_process_weights(upstream_process, upstream_method(), linear)
        assert linear.input_format is backends.input_format_for(32)
    return attn


def q_lora_rows(rows, q_lora_rank, device=None, kv_width=64):
    """q_lora as upstream slices it off the fused wqkv_a output (row stride past its width), with a
    zero row and a NaN row where there are rows enough."""
    qkv_a = torch.randn(rows, q_lora_rank + kv_width, device=device).bfloat16()
    if rows >= 3:
        qkv_a[1] = 0
        qkv_a[2, 7] = float("nan")
    return qkv_a[:, :q_lora_rank]


def fp8chains_own_linear(upstream):
    """fp8chain's own FP8 linear on an upstream layer's weight and scales (the same device)."""
    n, k = upstream.weight.shape
    own = ReplicatedLinear(k, n, quant_config=Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0"))
    load_weights(own.to(upstream.weight.device), [("weight", upstream.weight.data),
                                                  ("weight_scale_inv", upstream.weight_scale_inv.data)])
    return own


def check_q_norm_chain(monkeypatch, rows, q_lora_rank, wq_b_rows, device):
    """Where wq_b reads pairs, q_norm's launch returns the bf16 row (the indexer's; the fp32 RMSNorm
    rounded to bf16, a NaN row NaN) and its pair, the pair equal to the standalone quantize of that
    row bit for bit; wq_b then computes, without a quantize, what fp8chain's own linear computes from
    the bf16 row (chain on = chain off)."""
    attn = chained_mqa(monkeypatch, q_lora_rank=q_lora_rank, wq_b_rows=wq_b_rows, device=device)
    q = q_lora_rows(rows, q_lora_rank, device)
    upstream_normalize_q_lora.calls = 0
    y, pair = plugin.around_normalize_q_lora(upstream_normalize_q_lora, attn, q)
    assert upstream_normalize_q_lora.calls == 0
    finite = torch.ones(rows, dtype=torch.bool, device=device)
    if rows >= 3:
        finite[2] = False
        assert y[2].isnan().all()
    assert_close_bf16(y[finite], rms_norm_fp32(q[finite], attn.q_norm.weight, attn.q_norm.variance_epsilon))
    assert_pairs_equal(pair, ref.quantize(y, attn.wq_b.input_format))
    upstream_apply.calls = 0
    out = plugin.around_apply(upstream_apply, upstream_method(), attn.wq_b, pair)
    assert upstream_apply.calls == 0 and out.shape == (rows, wq_b_rows)
    assert_same_bf16(out, fp8chains_own_linear(attn.wq_b)(y))
    if rows >= 3:
        assert out[2].isnan().all() and not out[[0, 1]].isnan().any()  # the NaN row stays visible


@pytest.mark.cpu
@pytest.mark.parametrize("rows", [1, 3, 5, 0])
def test_q_norm_hands_wq_b_the_pair_of_its_bf16_row(monkeypatch, rows):
    check_q_norm_chain(monkeypatch, rows, 256, 128, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 64, 127, 256])
def test_q_norm_hands_wq_b_the_pair_of_its_bf16_row_gpu(monkeypatch, rows):
    """On Hopper at DSv4.1-Flash's wq_b (q_lora_rank 1280, 64 heads x 512 at TP1): the hook makes
    the request there and fp8chain's GEMM takes the pair."""
    check_q_norm_chain(monkeypatch, rows, 1280, 64 * 512, torch.device("cuda"))


@pytest.mark.cpu
def test_q_norm_stands_aside_where_no_pair_may_go(monkeypatch):
    """Upstream's _normalize_q_lora runs for a wq_b that reads no pairs, a q or q_norm that is not
    bf16, and in the forwards _why_no_pair names."""
    attn = chained_mqa(monkeypatch)
    q = q_lora_rows(4, 256)

    def upstream_ran(layer, x):
        upstream_normalize_q_lora.calls = 0
        got = plugin.around_normalize_q_lora(upstream_normalize_q_lora, layer, x)
        return upstream_normalize_q_lora.calls == 1 and got[1] is not None and torch.is_tensor(got[1])

    assert not upstream_ran(attn, q)  # the chained case, for contrast
    assert upstream_ran(attn, q.float())
    attn.q_norm.weight.data = attn.q_norm.weight.data.float()
    assert upstream_ran(attn, q)
    attn.q_norm.weight.data = attn.q_norm.weight.data.bfloat16()
    monkeypatch.setattr(plugin, "_why_no_pair", lambda: "sequence parallelism (test)")
    assert upstream_ran(attn, q)
    monkeypatch.setattr(plugin, "_why_no_pair", lambda: None)
    unasked = UpstreamMQA()
    plugin.around_process_weights(upstream_process, upstream_method(), unasked.wq_b)  # no request: bf16
    assert upstream_ran(unasked, q)


@pytest.mark.cpu
@pytest.mark.parametrize("case", ["hopper", "not_served", "blackwell", "upstream_quant", "bf16_weights"])
def test_linears_ask_only_where_fp8chain_serves(monkeypatch, case):
    """The requests on wqkv_a, wq_b, wo_b and the shared expert's down_proj are made where
    fp8chain's consumers run (Hopper; the CPU under the interpreter here) on e4m3 weights, not where
    another device keeps upstream's weights, not on Blackwell (upstream's), not for bf16 weights;
    wq_b's not where upstream's own Hopper q_lora quantize feeds it."""
    monkeypatch.delenv(plugin.UPSTREAM_HOPPER_Q_LORA_QUANT, raising=False)
    if case == "not_served":
        monkeypatch.setattr(plugin, "_why_not_fp8chain", lambda device: "sm_80 (test)")
    elif case == "blackwell":
        monkeypatch.setattr(plugin, "_upstream_serves_request", lambda device: True)
    elif case == "upstream_quant":
        monkeypatch.setenv(plugin.UPSTREAM_HOPPER_Q_LORA_QUANT, "1")
    attn = UpstreamMQA()
    moe = types.SimpleNamespace(shared_experts=UpstreamSharedExpert(), is_deepseek_v4=True)
    linears = (attn.wqkv_a, attn.wq_b, attn.wo_b, moe.shared_experts.down_proj)
    if case == "bf16_weights":
        for linear in linears:
            linear.weight.data = linear.weight.data.to(torch.bfloat16)
    plugin.after_mqa_init(None, attn)
    plugin.after_moe_init(None, moe)
    assert attn.wqkv_a.deepgemm_mxfp8_input is (case in ("hopper", "upstream_quant"))
    assert attn.wq_b.deepgemm_mxfp8_input is (case == "hopper")
    assert attn.wo_b.deepgemm_mxfp8_input is (case in ("hopper", "upstream_quant"))
    assert moe.shared_experts.down_proj.deepgemm_mxfp8_input is (case in ("hopper", "upstream_quant"))


@pytest.mark.cpu
@pytest.mark.parametrize("sp,invariant,deterministic,why", [
    (False, False, False, None), (True, False, False, "sequence parallelism"),
    (False, True, False, "deterministic"), (False, False, True, "deterministic")])
def test_sglangs_runtime_modes_keep_upstreams_bf16_inputs(monkeypatch, sp, invariant, deterministic, why):
    """The modes read from SGLang at each forward: sequence parallelism, batch-invariant and
    deterministic inference."""
    runtime = types.ModuleType("sglang.srt.runtime_context")
    runtime.get_forward = lambda: types.SimpleNamespace(sp_active=sp)
    runtime.get_exec = lambda: types.SimpleNamespace(
        deterministic=types.SimpleNamespace(enable_deterministic_inference=deterministic))
    ops = types.ModuleType("sglang.srt.batch_invariant_ops")
    ops.is_batch_invariant_mode_enabled = lambda: invariant
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", runtime)
    monkeypatch.setitem(sys.modules, "sglang.srt.batch_invariant_ops", ops)
    got = plugin._why_no_pair()
    assert got is None if why is None else why in got


def upstream_wo_a_matmul(o, wo_a, *args, **kwargs):
    """Stands for upstream's ``_apply_wo_a_bf16_matmul``: the bf16 einsum ``[T, G, R]``."""
    upstream_wo_a_matmul.calls += 1
    return torch.einsum("tgd,grd->tgr", o.float(), wo_a.float()).bfloat16()


def attention_forward(attn, o, **flags):
    """Stands for ``MQALayer.forward`` from the attention output on: ``o [T, G, D]`` through
    ``_apply_wo_a_bf16_matmul`` and ``_project_wo_b`` (``wo_b``'s apply), both as hooked. Returns
    (what the wo_a call returned, wo_b's output)."""
    wo_a = attn.wo_a.weight.view(attn.n_local_groups, attn.o_lora_rank, -1)
    product = plugin.around_wo_a_bf16_matmul(upstream_wo_a_matmul, o, wo_a, **flags)
    wo_b_input = product.flatten(1) if torch.is_tensor(product) else product
    return product, plugin.around_apply(upstream_apply, upstream_method(), attn.wo_b, wo_b_input)


def attention_output(rows, groups, width, device=None):
    """``o [T, G, D]`` as upstream views it: this rank's heads of the attention output, a row
    stride past G*D, with a zero row and a NaN row where there are rows enough."""
    full = torch.randn(rows, 2 * groups * width, device=device).bfloat16()
    if rows >= 3:
        full[1] = 0
        full[2, 5] = float("nan")
    return full[:, :groups * width].view(rows, groups, width)


def check_wo_a_chain(monkeypatch, rows, groups, o_lora_rank, group_width, hidden, device):
    """Inside the layer's forward, the wo_a call returns the FP8 pair of the einsum's bf16 result
    (equal to the standalone quantize of the bf16 bits the bf16-only launch writes), and wo_b
    computes from it, without a quantize, what fp8chain's own linear computes from that bf16."""
    attn = chained_mqa(monkeypatch, groups=groups, o_lora_rank=o_lora_rank, group_width=group_width,
                       hidden=hidden, device=device)
    attn.wo_a.weight.normal_(0, group_width ** -0.5)
    o = attention_output(rows, groups, group_width, device)
    upstream_wo_a_matmul.calls = upstream_apply.calls = 0
    pair, out = plugin.around_mqa_forward(attention_forward, attn, o, is_decode=True, fast_path=True)
    assert upstream_wo_a_matmul.calls == 0 and upstream_apply.calls == 0
    wo_a = attn.wo_a.weight.view(groups, o_lora_rank, -1)
    fmt = attn.wo_b.input_format
    y = einsum.wo_a_einsum(o, wo_a, tile_group=fmt.group_size)  # the bits the pair's launch rounds
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    finite = torch.ones(rows, dtype=torch.bool, device=device)
    if rows >= 3:
        finite[2] = False
        assert y[2, :o_lora_rank].isnan().all()  # the NaN is in group 0's input
    if rows:
        assert rel_error(y[finite], wo_a_einsum_fp(o[finite], wo_a, torch.float64)) < 1e-2
    assert_same_bf16(out, fp8chains_own_linear(attn.wo_b)(y))
    if rows >= 3:
        assert out[2].isnan().all() and not out[[0, 1]].isnan().any()


@pytest.mark.cpu
@pytest.mark.parametrize("rows", [1, 3, 5, 0])
def test_wo_a_hands_wo_b_the_pair_of_its_product(monkeypatch, rows):
    check_wo_a_chain(monkeypatch, rows, 2, 64, 96, 160, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("groups,rows", [(2, 1), (2, 3), (2, 64), (2, 127), (8, 1), (8, 16)])
def test_wo_a_hands_wo_b_the_pair_of_its_product_gpu(monkeypatch, groups, rows):
    """On Hopper at DSv4.1-Flash's shapes: wo_a [G, 1024, 4096] at TP4 (G = 2) and TP1 (G = 8),
    wo_b [5120, G*1024]."""
    check_wo_a_chain(monkeypatch, rows, groups, 1024, 4096, 5120, torch.device("cuda"))


@pytest.mark.cpu
def test_wo_a_hook_stands_aside_where_no_pair_may_go(monkeypatch):
    """Upstream's wo_a product goes on as bf16 outside an MQALayer forward, for a call asking for
    upstream's own quantized output or with arguments this hook does not know, for a weight that
    is not the layer's wo_a, in the forwards _why_no_pair names, and where wo_b reads no pairs."""
    attn = chained_mqa(monkeypatch)
    o = attention_output(4, attn.n_local_groups, 96)
    wo_a = attn.wo_a.weight.view(attn.n_local_groups, attn.o_lora_rank, -1)

    def upstream_ran(layer, call):
        upstream_wo_a_matmul.calls = 0
        got = plugin.around_mqa_forward(lambda a: call(), layer)
        return upstream_wo_a_matmul.calls == 1 and torch.is_tensor(got)

    def hooked(weight=wo_a, **flags):
        return lambda: plugin.around_wo_a_bf16_matmul(upstream_wo_a_matmul, o, weight, **flags)

    assert not upstream_ran(attn, hooked(is_decode=True))  # the chained case, for contrast
    upstream_wo_a_matmul.calls = 0
    assert torch.is_tensor(hooked()()) and upstream_wo_a_matmul.calls == 1  # no forward running
    assert upstream_ran(attn, hooked(is_decode=True, fuse_mxfp8_quant=True))
    assert upstream_ran(attn, hooked(is_decode=True, emit_fp8=True))
    assert upstream_ran(attn, hooked(is_decode=True, a_later_flag=True))
    assert upstream_ran(attn, hooked(weight=wo_a.clone()))
    monkeypatch.setattr(plugin, "_why_no_pair", lambda: "sequence parallelism (test)")
    assert upstream_ran(attn, hooked())
    monkeypatch.setattr(plugin, "_why_no_pair", lambda: None)
    unasked = UpstreamMQA()
    plugin.around_process_weights(upstream_process, upstream_method(), unasked.wo_b)  # no request: bf16
    unasked_wo_a = unasked.wo_a.weight.view(unasked.n_local_groups, unasked.o_lora_rank, -1)
    assert upstream_ran(unasked, hooked(weight=unasked_wo_a))


class UpstreamForwardLinear(UpstreamLinear):
    """An SGLang FP8 linear with its forward: ``(apply(x), None)`` through the apply hook."""

    def forward(self, x):
        return plugin.around_apply(upstream_gemm, upstream_method(), self, x), None


def upstream_gemm(method, layer, x, bias=None):
    """Stands for upstream's bf16 path: the reference GEMM on the dequantized weight."""
    upstream_gemm.calls += 1
    return ref.fp8_gemm(ref.quantize(x, ActFormat.SM90_G32_FP32_MN), layer.weight, layer.weight_scale_inv,
                        32).to(torch.bfloat16)


class UpstreamSharedExpert(torch.nn.Module):
    """SGLang's ``DeepseekV2MLP`` as the hooks read it: ``gate_up_proj`` -> SiLU*mul (clamped at
    ``swiglu_limit``) -> ``down_proj``, FP8 linears."""

    def __init__(self, hidden=128, intermediate=96, swiglu_limit=1.0, device=None):  # a limit the values pass
        super().__init__()
        prefix = "model.layers.0.mlp.shared_experts"
        self.gate_up_proj = UpstreamForwardLinear(*ref.random_fp8_weight(2 * intermediate, hidden, 32, device=device),
                                                  request=False, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = UpstreamForwardLinear(*ref.random_fp8_weight(hidden, intermediate, 32, device=device),
                                               request=False, prefix=f"{prefix}.down_proj")
        self.swiglu_limit = swiglu_limit


def upstream_mlp_forward(mlp, x, **kwargs):
    """Stands for upstream's ``DeepseekV2MLP.forward``: bf16 SiLU*mul into ``down_proj``."""
    upstream_mlp_forward.calls += 1
    gate_up, _ = mlp.gate_up_proj(x)
    return mlp.down_proj(ref.silu_mul(gate_up, limit=mlp.swiglu_limit))[0]


def chained_moe(monkeypatch, is_deepseek_v4=True, **shape):
    """A DeepSeek-V4 MoE (``DeepseekV2MoE``) with its shared expert built and loaded with the hooks,
    in a forward where a pair may go."""
    monkeypatch.setattr(plugin, "_why_no_pair", lambda: None)
    moe = types.SimpleNamespace(shared_experts=UpstreamSharedExpert(**shape), is_deepseek_v4=is_deepseek_v4,
                                mega_shared_l1_weights=None)  # as upstream's __init__ leaves them off the mega MoE
    assert plugin.after_moe_init(None, moe) is None
    for linear in (moe.shared_experts.gate_up_proj, moe.shared_experts.down_proj):
        assert linear.deepgemm_mxfp8_input is is_deepseek_v4
        plugin.around_process_weights(upstream_process, upstream_method(), linear)
    return moe


def check_silu_mul_chain(monkeypatch, rows, hidden, intermediate, device):
    """The shared expert's forward: gate_up as upstream runs it, then one SiLU*mul launch writing the
    pair of its bf16 output (bit for bit the standalone quantize of the bf16-only launch's output),
    and down_proj computing from it, without a quantize, what fp8chain's own linear computes from
    that bf16; a NaN row stays NaN, the clamp applied."""
    mlp = chained_moe(monkeypatch, hidden=hidden, intermediate=intermediate, device=device).shared_experts
    assert mlp.down_proj.input_format is mlp.gate_up_proj.input_format is backends.input_format_for(32)
    x = torch.randn(rows, hidden, device=device).bfloat16()
    if rows >= 3:
        x[1] = 0
        x[2, 3] = float("nan")
    upstream_mlp_forward.calls = upstream_gemm.calls = 0
    out = plugin.around_mlp_forward(upstream_mlp_forward, mlp, x)
    assert upstream_mlp_forward.calls == 0 and upstream_gemm.calls == 1  # gate_up's on bf16 x, upstream's
    upstream_gemm.calls = 0
    gate_up, _ = mlp.gate_up_proj(x)
    y = act.silu_mul(gate_up, limit=mlp.swiglu_limit)
    assert (gate_up.float() > mlp.swiglu_limit).any()  # the clamp is exercised
    assert_same_bf16(out, fp8chains_own_linear(mlp.down_proj)(y))
    pair = act.silu_mul(gate_up, limit=mlp.swiglu_limit, out_format=mlp.down_proj.input_format, return_bf16=False)
    assert_pairs_equal(pair, ref.quantize(y, mlp.down_proj.input_format))
    if rows >= 3:
        assert out[2].isnan().all() and not out[[0, 1]].isnan().any()


@pytest.mark.cpu
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_silu_mul_hands_the_shared_down_its_pair(monkeypatch, rows):
    check_silu_mul_chain(monkeypatch, rows, 128, 96, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 64, 127])
def test_silu_mul_hands_the_shared_down_its_pair_gpu(monkeypatch, rows):
    """On Hopper at DSv4.1-Flash's shared expert: gate_up [4608, 5120], down [5120, 2304]."""
    check_silu_mul_chain(monkeypatch, rows, 5120, 2304, torch.device("cuda"))


@pytest.mark.cpu
def test_mlp_hook_stands_aside_where_no_pair_may_go(monkeypatch):
    """Upstream's MLP forward runs for a MoE that is not DeepSeek-V4's (no request), an input
    already quantized for gate_up or with arguments this hook does not know, no rows, a non-bf16
    input, and in the forwards _why_no_pair names."""
    mlp = chained_moe(monkeypatch).shared_experts
    x = torch.randn(4, 128).bfloat16()

    def upstream_ran(layer, x, **kwargs):
        upstream_mlp_forward.calls = 0
        plugin.around_mlp_forward(upstream_mlp_forward, layer, x, **kwargs)
        return upstream_mlp_forward.calls == 1

    assert not upstream_ran(mlp, x)  # the chained case, for contrast
    assert not upstream_ran(mlp, x, forward_batch=None, gemm_output_zero_allocator=object())
    assert upstream_ran(mlp, x, gateup_pre_quant=(x, x))
    assert upstream_ran(mlp, x, a_later_argument=1)
    assert upstream_ran(mlp, x[:0])
    assert upstream_ran(mlp, x.float())
    monkeypatch.setattr(plugin, "_why_no_pair", lambda: "sequence parallelism (test)")
    assert upstream_ran(mlp, x)
    other = chained_moe(monkeypatch, is_deepseek_v4=False).shared_experts
    assert other.down_proj.deepgemm_mxfp8_input is False and getattr(other.down_proj, "input_format", None) is None
    assert upstream_ran(other, x)


def upstream_combine(hc, state, quantized=None):
    """Stands for SGLang's ``deepseek_v4_mhc.combine`` on Hopper: ``RMSNorm(sum_k pre[k] * R[k])``
    in bf16 (stream 0 where no ``pre`` is carried), no pair."""
    upstream_combine.calls += 1
    if state.input is not None:  # what the previous post already computed
        upstream_combine.shortcuts += 1
        return state.input.rows
    streams = state.streams
    mixed = streams[:, 0] if state.pre is None else ref.mhc_combine(streams, state.pre)
    return ref.rms_norm(mixed, hc.norm.weight, hc.norm.variance_epsilon)


def upstream_read(read, residual, norm, *args, **kwargs):
    """Stands for SGLang's ``HcReadCall.read`` of a carried state on Hopper: the combine (through
    the combine hook, as SGLang's module attribute is hooked) and a ``ReadState`` without a
    pre-quantized input; the later arguments are not read."""
    upstream_read.calls += 1
    hc = types.SimpleNamespace(norm=norm)
    x = plugin.around_hc_combine(upstream_combine, hc, residual, None)
    return x, types.SimpleNamespace(streams=residual.streams, quantized=None, stats=None)


def hc_read(monkeypatch, hidden=160, attention=True, pre_from_prev=True, device=None, intermediate=96, **shape):
    """An attention (or FFN) read (``HcReadCall``) of a DSv4.1 layer whose MQA and MoE were built
    and loaded with the hooks, and the read's RMSNorm (``input_layernorm``)."""
    attn = chained_mqa(monkeypatch, hidden=hidden, device=device, **shape)
    moe = chained_moe(monkeypatch, hidden=hidden, intermediate=intermediate, device=device)
    layer = types.SimpleNamespace(self_attn=attn, mlp=moe, boundary_pre_from_prev=pre_from_prev)
    return types.SimpleNamespace(layer=layer, attention=attention), UpstreamRMSNorm(hidden, device)


def hc_state(rows, hidden, device=None, carried=True):
    """The mHC state a read gets: four bf16 streams ``[T, 4, H]`` and the carried fp32 ``pre``
    (None: the first layer), with a zero row and a NaN row where there are rows enough."""
    streams = torch.randn(rows, 4, hidden, device=device).bfloat16()
    if rows >= 3:
        streams[1] = 0
        streams[2, 3, 5] = float("nan")
    pre = torch.rand(rows, 4, device=device) + 0.1 if carried else None
    return types.SimpleNamespace(streams=streams, pre=pre, input=None)


def check_linear_reads(linear, pair, x):
    """``pair`` is the linear's format and bit for bit the standalone quantize of ``x``; the linear
    computes from it, without upstream's bf16 path, what fp8chain's own linear computes from ``x``."""
    assert pair.fmt is linear.input_format
    assert_pairs_equal(pair, ref.quantize(x, linear.input_format))
    upstream_apply.calls = 0
    out = plugin.around_apply(upstream_apply, upstream_method(), linear, pair)
    assert upstream_apply.calls == 0 and out.shape == (x.shape[0], linear.weight.shape[0])
    assert_same_bf16(out, fp8chains_own_linear(linear)(x))
    return out


def check_normed_rows(x, mixed, norm, nan_row=True):
    """``x`` is the RMSNorm of the combine ``mixed``, correctly rounded from fp32 where finite; where
    there are rows enough (``hc_state``, ``finished_sublayer``) row 1 is zero, and row 2 is NaN
    where ``nan_row`` (finite otherwise)."""
    finite = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    if x.shape[0] >= 3:
        finite[2] = not nan_row
        assert x[2].isnan().all() if nan_row else not x[2].isnan().any()
        assert (x[1] == 0).all()
    assert_close_bf16(x[finite], ref.mhc_norm_fp32(mixed[finite], norm.weight, norm.variance_epsilon))


def check_boundary_chain(monkeypatch, rows, hidden, wqkv_a_rows, device, carried=True):
    """Where wqkv_a reads pairs, the attention read's combine is one fp8chain launch: its bf16 x (the
    indexer's; the fp32 RMSNorm of the bf16 combine, rounded once) and the pair of that x, bit for
    bit the standalone quantize, left in ``ReadState.quantized``; wqkv_a computes from the pair,
    without a quantize, what fp8chain's own linear computes from x; NaN stays visible."""
    q_lora_rank = wqkv_a_rows - 64
    read, norm = hc_read(monkeypatch, hidden, device=device, q_lora_rank=q_lora_rank)
    state = hc_state(rows, hidden, device, carried)
    upstream_read.calls = upstream_combine.calls = upstream_combine.shortcuts = 0
    x, read_state = plugin.around_hc_read(upstream_read, read, state, norm, "")  # as the framework calls it
    assert upstream_read.calls == 1 and upstream_combine.calls == 0
    assert x.shape == (rows, hidden)
    mixed = state.streams[:, 0] if state.pre is None else ref.mhc_combine(state.streams, state.pre)
    check_normed_rows(x, mixed, norm, nan_row=carried)  # the NaN in stream 3 reaches x only through the combine
    out = check_linear_reads(read.layer.self_attn.wqkv_a, read_state.quantized, x)
    assert out.shape == (rows, wqkv_a_rows)
    if rows >= 3 and carried:
        assert out[2].isnan().all() and not out[[0, 1]].isnan().any()


@pytest.mark.cpu
@pytest.mark.parametrize("rows", [1, 3, 5, 0])
def test_the_boundary_hands_wqkv_a_the_pair_of_its_normed_rows(monkeypatch, rows):
    check_boundary_chain(monkeypatch, rows, 160, 256 + 64, torch.device("cpu"))


@pytest.mark.cpu
def test_the_first_layer_normalizes_stream_0_with_its_pair(monkeypatch):
    """No pre is carried into the first layer's read: RMSNorm of R[:, 0], the pair beside it."""
    check_boundary_chain(monkeypatch, 5, 160, 256 + 64, torch.device("cpu"), carried=False)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 64, 127, 256])
def test_the_boundary_hands_wqkv_a_the_pair_of_its_normed_rows_gpu(monkeypatch, rows):
    """On Hopper at DSv4.1-Flash's boundary: H = 5120, wqkv_a [1280 + 512, 5120]."""
    check_boundary_chain(monkeypatch, rows, 5120, 1280 + 512, torch.device("cuda"))


def check_shared_expert_reads(monkeypatch, read, read_state, x):
    """The FFN read left gate_up's pair with the shared expert beside the very rows it quantizes (none
    in ``ReadState.quantized``): bit for bit the quantize of ``x``, which gate_up computes from as
    fp8chain's own linear does from ``x``. The MLP forward on ``x`` takes it once: neither linear
    runs upstream's bf16 path, SiLU*mul is gate_up's GEMM epilogue wherever that pays (no launch of
    its own), and the output is fp8chain's own chain from ``x``; rows of another tensor (the same
    values copied) go upstream's bf16 way into gate_up. NaN stays visible."""
    mlp = read.layer.mlp.shared_experts
    assert read_state.quantized is None
    rows, pair = mlp.fp8chain_gate_up_input
    assert rows is x
    check_linear_reads(mlp.gate_up_proj, pair, x)
    fused = consumer_gemm_silu_mul(mlp.gate_up_proj, pair, mlp.swiglu_limit, mlp.down_proj.input_format,
                                   "gate_up_proj") is not None
    silu_mul_launches = []
    monkeypatch.setattr(plugin, "silu_mul", lambda *a, **k: silu_mul_launches.append(1) or act.silu_mul(*a, **k))
    upstream_mlp_forward.calls = upstream_gemm.calls = 0
    out = plugin.around_mlp_forward(upstream_mlp_forward, mlp, x)
    assert upstream_mlp_forward.calls == upstream_gemm.calls == 0 and mlp.fp8chain_gate_up_input is None
    assert len(silu_mul_launches) == (0 if fused else 1)
    gate_up = fp8chains_own_linear(mlp.gate_up_proj)(x)
    assert_same_bf16(out, fp8chains_own_linear(mlp.down_proj)(act.silu_mul(gate_up, limit=mlp.swiglu_limit)))
    assert torch.equal(out.isnan().any(1), x.isnan().any(1))
    mlp.fp8chain_gate_up_input = (x, pair)
    plugin.around_mlp_forward(upstream_mlp_forward, mlp, x.clone())
    assert upstream_gemm.calls == 1 and mlp.fp8chain_gate_up_input is None  # gate_up's, on bf16


def check_ffn_boundary_chain(monkeypatch, rows, hidden, intermediate, device):
    """Where the shared expert's gate_up and down_proj read pairs, the FFN read's combine is one
    fp8chain launch: x (the router's and the routed experts'), correctly rounded from the fp32 norm,
    and gate_up's pair beside it, which the shared expert reads (check_shared_expert_reads)."""
    read, norm = hc_read(monkeypatch, hidden, attention=False, device=device, intermediate=intermediate)
    state = hc_state(rows, hidden, device)
    upstream_read.calls = upstream_combine.calls = 0
    x, read_state = plugin.around_hc_read(upstream_read, read, state, norm, "")
    assert upstream_read.calls == 1 and upstream_combine.calls == 0
    check_normed_rows(x, ref.mhc_combine(state.streams, state.pre), norm)
    check_shared_expert_reads(monkeypatch, read, read_state, x)


@pytest.mark.cpu
@pytest.mark.parametrize("rows", [1, 3, 5, 64])  # 64: gate_up's SiLU*mul epilogue pays
def test_the_ffn_boundary_hands_the_shared_gate_up_its_pair(monkeypatch, rows):
    check_ffn_boundary_chain(monkeypatch, rows, 160, 96, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 64, 127])
def test_the_ffn_boundary_hands_the_shared_gate_up_its_pair_gpu(monkeypatch, rows):
    """On Hopper at DSv4.1-Flash's shared expert: H = 5120, gate_up [4608, 5120], down [5120, 2304]."""
    check_ffn_boundary_chain(monkeypatch, rows, 5120, 2304, torch.device("cuda"))


@pytest.mark.gpu
def test_the_shared_expert_reads_the_pair_on_a_side_stream_in_a_cuda_graph_gpu(monkeypatch):
    """As SGLang's dual-stream MoE runs it inside a captured decode graph: the FFN read writes the
    pair on the capture stream and the shared expert reads it on a side stream (the pair recorded
    there). Capture raises nothing, the replay gives the eager step's output bit for bit, and no
    linear runs upstream's bf16 path."""
    device = torch.device("cuda")
    read, norm = hc_read(monkeypatch, 5120, attention=False, device=device, intermediate=2304)
    state = hc_state(64, 5120, device)
    mlp, side = read.layer.mlp.shared_experts, torch.cuda.Stream()

    def step():
        x, _ = plugin.around_hc_read(upstream_read, read, state, norm, "")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = plugin.around_mlp_forward(upstream_mlp_forward, mlp, x)
        torch.cuda.current_stream().wait_stream(side)
        return out

    upstream_mlp_forward.calls = upstream_gemm.calls = 0
    eager = step()  # also compiles every launch before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    captured.fill_(float("nan"))  # the replay must write every element
    graph.replay()
    torch.cuda.synchronize()
    assert upstream_mlp_forward.calls == upstream_gemm.calls == 0
    assert_same_bf16(captured, eager)
    assert not eager[~state.streams.isnan().any(2).any(1)].isnan().any()


@pytest.mark.cpu
def test_the_boundary_hooks_stand_aside_where_no_pair_may_go(monkeypatch):
    """Upstream's read and combine run for an FFN read whose shared expert reads no pairs (a MoE not
    DeepSeek-V4's, a down_proj its consumers do not serve, a DeepGEMM mega MoE), a read outside
    DSv4.1's shifted ordering,
    an unfused wq_a / wkv (no request), a wqkv_a that reads no pairs or an MQA taking upstream's own
    swizzled input, a read with arguments the hook does not know, in the forwards _why_no_pair
    names; the combine outside such a read, or of a state it cannot compute as upstream does."""
    read, norm = hc_read(monkeypatch)
    state = hc_state(4, 160)

    def upstream_ran(read, state=state, norm=norm, **kwargs):
        upstream_combine.calls = 0
        x, read_state = plugin.around_hc_read(upstream_read, read, state, norm, **kwargs)
        return upstream_combine.calls == 1 and read_state.quantized is None and torch.is_tensor(x)

    assert not upstream_ran(read)  # the chained case, for contrast
    assert not upstream_ran(read, quant_format="", post_residual_addition=None)  # the framework's defaults
    assert upstream_ran(read, post_residual_addition=torch.zeros(4, 160).bfloat16())
    assert upstream_ran(read, a_later_argument=1)
    ffn, _ = hc_read(monkeypatch, attention=False)
    assert not upstream_ran(ffn)  # the chained FFN read, for contrast
    ffn.layer.mlp = chained_moe(monkeypatch, is_deepseek_v4=False, hidden=160)
    assert upstream_ran(ffn)
    ffn.layer.mlp = chained_moe(monkeypatch, hidden=160)
    ffn.layer.mlp.shared_experts.down_proj.input_format = None
    assert upstream_ran(ffn)
    ffn.layer.mlp = chained_moe(monkeypatch, hidden=160)
    ffn.layer.mlp.mega_shared_l1_weights = torch.zeros(1)  # the shared expert fused into the mega MoE
    assert upstream_ran(ffn)
    assert upstream_ran(hc_read(monkeypatch, pre_from_prev=False)[0])
    assert upstream_ran(read, quant_format="fp8")
    swizzled, _ = hc_read(monkeypatch)
    swizzled.layer.self_attn.accepts_mxfp8_swizzled_input = lambda: True
    assert upstream_ran(swizzled)
    unfused = UpstreamMQA()
    unfused.fuse_wqa_wkv = False
    plugin.after_mqa_init(None, unfused)
    assert unfused.wqkv_a.deepgemm_mxfp8_input is False
    plugin.around_process_weights(upstream_process, upstream_method(), unfused.wqkv_a)
    assert upstream_ran(types.SimpleNamespace(layer=types.SimpleNamespace(self_attn=unfused,
                                                                          boundary_pre_from_prev=True), attention=True))
    for changed in (dict(input=HcNormed(torch.zeros(4, 160).bfloat16())), dict(streams=state.streams.float()),
                    dict(pre=state.pre.double()),
                    dict(streams=torch.randn(4, 4, 144).bfloat16(), pre=state.pre)):  # H not whole 32-groups
        odd = types.SimpleNamespace(**{**vars(state), **changed})
        assert upstream_ran(read, state=odd, norm=norm if odd.streams.shape[2] == 160 else UpstreamRMSNorm(144))
    norm.cast_x_before_out_mul = True
    assert upstream_ran(read)
    norm.cast_x_before_out_mul = False
    strided = UpstreamRMSNorm(320)
    strided.weight = torch.nn.Parameter(strided.weight.data[::2], requires_grad=False)
    assert upstream_ran(read, norm=strided)
    monkeypatch.setattr(plugin, "_why_no_pair", lambda: "sequence parallelism (test)")
    assert upstream_ran(read)
    monkeypatch.setattr(plugin, "_why_no_pair", lambda: None)
    upstream_combine.calls = 0
    plugin.around_hc_combine(upstream_combine, types.SimpleNamespace(norm=norm), state)  # no read around it
    assert upstream_combine.calls == 1


class HcNormed(NamedTuple):
    rows: torch.Tensor


class HcQuantized(NamedTuple):
    rows: torch.Tensor
    pair: tuple


@dataclasses.dataclass
class HcState:
    streams: torch.Tensor
    pre: torch.Tensor = None
    input: object = None
    stats: object = None


def upstream_post_fusion(hc, y, residual, coefficients, next):
    """Stands for SGLang's ``deepseek_v4_mhc._post_fusion`` on Hopper: the post alone (``R'``)."""
    upstream_post_fusion.calls += 1
    pre, post, comb = coefficients
    return HcState(ref.mhc_post(y, residual, post, comb), pre)


def upstream_update_and_read(read, update, value, residual, norm):
    """Stands for SGLang's ``HcReadCall.update_and_read`` in the shifted ordering: the finished
    sublayer's post (with the stats the read carried and this read's boundary) through the post hook,
    then this read through the read hook."""
    next_boundary = types.SimpleNamespace(norm=norm, norm_fusable=True, mega_moe_input=None)
    state = plugin.around_post_fusion(upstream_post_fusion, None, value, residual.streams, residual.stats,
                                      next_boundary)
    return plugin.around_hc_read(upstream_read, read, state, norm, "")


@pytest.fixture
def sglang_mhc_module(monkeypatch):
    """The post stand-in's module, holding the state types as SGLang's ``deepseek_v4_mhc`` does."""
    module = types.ModuleType("sglang_mhc_stand_in")
    module.HcState, module.HcNormed, module.HcQuantized = HcState, HcNormed, HcQuantized
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(upstream_post_fusion, "__module__", module.__name__)
    return module


def finished_sublayer(rows, hidden, device=None):
    """A finished sublayer's output ``y`` and what its read carried: the streams and the stats
    ``(pre, post, comb)``, with a zero row and a NaN in ``y`` where there are rows enough."""
    y = torch.randn(rows, hidden, device=device).bfloat16()
    if rows >= 3:
        y[1] = 0
        y[2, 7] = float("nan")
    streams = hc_state(rows, hidden, device).streams
    if rows >= 3:
        streams[2] = 1  # the NaN comes from y alone
        streams[1] = 0
    pre, post = torch.rand(rows, 4, device=device) + 0.1, torch.rand(rows, 4, device=device)
    comb = torch.rand(rows, 4, 4, device=device)
    return y, types.SimpleNamespace(streams=streams, stats=(pre, post, comb))


def check_folded_boundary(monkeypatch, rows, hidden, wqkv_a_rows, device, attention=True, intermediate=96):
    """Inside a read's update_and_read, the post and the read's combine + RMSNorm are one fp8chain
    launch: R' bitwise the reference post, x correctly rounded from the fp32 norm of R''s combine;
    for the attention's read wqkv_a's pair, bit for bit the quantize of x, in ReadState.quantized,
    and wqkv_a's output from it what fp8chain's own linear computes from x; for the FFN's read the
    shared gate_up's pair, left with the shared expert (check_shared_expert_reads). Upstream's post
    does not run, and its combine only hands on the folded rows."""
    read, norm = hc_read(monkeypatch, hidden, attention=attention, device=device, intermediate=intermediate,
                         q_lora_rank=wqkv_a_rows - 64)
    y, carried = finished_sublayer(rows, hidden, device)
    pre, post, comb = carried.stats
    upstream_post_fusion.calls = upstream_combine.calls = upstream_combine.shortcuts = upstream_read.calls = 0
    x, read_state = plugin.around_hc_update_and_read(upstream_update_and_read, read, None, y, carried, norm)
    assert upstream_post_fusion.calls == 0 and upstream_read.calls == 1
    assert upstream_combine.calls == upstream_combine.shortcuts == 1  # the read takes the folded rows
    new_residual = read_state.streams
    assert_same_bf16(new_residual, ref.mhc_post(y, carried.streams, post, comb))
    check_normed_rows(x, ref.mhc_combine(new_residual, pre), norm)
    if attention:
        check_linear_reads(read.layer.self_attn.wqkv_a, read_state.quantized, x)
    else:
        check_shared_expert_reads(monkeypatch, read, read_state, x)


@pytest.mark.cpu
@pytest.mark.parametrize("rows,attention", [(1, True), (3, True), (5, True), (0, True), (1, False), (3, False)])
def test_the_post_folds_the_next_reads_norm_and_pair(monkeypatch, sglang_mhc_module, rows, attention):
    check_folded_boundary(monkeypatch, rows, 160, 256 + 64, torch.device("cpu"), attention)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,attention", [(1, True), (3, True), (64, True), (127, True), (256, True), (3, False),
                                            (64, False)])
def test_the_post_folds_the_next_reads_norm_and_pair_gpu(monkeypatch, sglang_mhc_module, rows, attention):
    """On Hopper at DSv4.1-Flash's boundary: H = 5120, wqkv_a [1280 + 512, 5120], the shared expert's
    gate_up [4608, 5120] and down [5120, 2304]."""
    check_folded_boundary(monkeypatch, rows, 5120, 1280 + 512, torch.device("cuda"), attention, 2304)


@pytest.mark.cpu
def test_the_post_is_upstreams_where_nothing_folds(monkeypatch, sglang_mhc_module):
    """Upstream's post runs outside a read's update_and_read, for a next norm upstream does not fuse
    or a boundary feeding the DeepGEMM mega MoE, for inputs it does not compute (fp32 y, bf16
    coefficients), on a device fp8chain does not serve, and in the forwards _why_no_pair names."""
    read, norm = hc_read(monkeypatch)
    y, carried = finished_sublayer(4, 160)
    fusable = types.SimpleNamespace(norm=norm, norm_fusable=True, mega_moe_input=None)

    def upstream_ran(y=y, stats=carried.stats, next=fusable, inside=True):
        upstream_post_fusion.calls = 0
        token = plugin._folding_read.set(read if inside else None)
        try:
            state = plugin.around_post_fusion(upstream_post_fusion, None, y, carried.streams, stats, next)
        finally:
            plugin._folding_read.reset(token)
        return upstream_post_fusion.calls == 1 and state.input is None

    assert not upstream_ran()  # the folded case, for contrast
    assert upstream_ran(inside=False)
    assert upstream_ran(next=types.SimpleNamespace(norm=norm, norm_fusable=False, mega_moe_input=None))
    assert upstream_ran(next=types.SimpleNamespace(norm=norm, norm_fusable=True, mega_moe_input=lambda y: y))
    assert upstream_ran(next=None)
    assert upstream_ran(y=y.float())
    assert upstream_ran(stats=tuple(t.bfloat16() for t in carried.stats))
    monkeypatch.setattr(plugin, "why_idle", lambda device: "sm_80 (test)")
    assert upstream_ran()
    monkeypatch.setattr(plugin, "why_idle", lambda device: None)
    monkeypatch.setattr(plugin, "_why_no_pair", lambda: "deterministic inference (test)")
    assert upstream_ran()


@pytest.mark.cpu
@pytest.mark.parametrize("capability,hip,idle", [((9, 0), None, None), ((10, 0), None, "from Blackwell on"),
                                                 ((8, 0), None, "sm_80"), ((9, 0), "6.2", "ROCm")])
def test_why_idle_names_what_keeps_the_plugin_out(monkeypatch, capability, hip, idle):
    """`fp8chain info` reports it: the plugin acts on Hopper only."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    got = plugin.why_idle(torch.device("cuda", 0))
    assert got is None if idle is None else idle in got


@pytest.mark.cpu
def test_the_hook_check_script_says_when_sglang_is_missing(monkeypatch, capsys):
    """scripts/check_sglang_hooks.py (for machines with SGLang) exits 2 with the reason elsewhere."""
    import runpy
    from pathlib import Path

    monkeypatch.setitem(sys.modules, "sglang", None)  # what a machine without SGLang imports
    script = Path(__file__).resolve().parents[2] / "scripts" / "check_sglang_hooks.py"
    main = runpy.run_path(str(script))["main"]
    assert main() == 2
    assert "SGLang's modules do not import here" in capsys.readouterr().err
