"""The model and its MoE layers refuse what they would compute wrongly, before computing: token ids,
positions and slots outside the embedding or the KV cache (the attention kernels would skip such
a token and give it NaN), inputs and routing of the wrong shape, a chain switch that is not a bool, router and
shared-expert settings they cannot run, and checkpoint scales that would be misread."""

import re

import pytest
import torch

from fp8chain.layers.moe import (
    RoutedExpertsReference, SharedExpert, TopKRouter, check_mxfp4, dequantize_mxfp4, quantize_mxfp4,
    swiglu_reference,
)
from fp8chain.models import deepseek_v41
from fp8chain.models.checkpoint import random_checkpoint_tensors
from fp8chain.models.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM
from fp8chain_kernel import act
from fp8chain_kernel import reference as ref
from fp8chain_kernel.reference.act import silu_mul_fp32

pytestmark = pytest.mark.cpu

SLOTS, LENGTH = 2, 8  # the KV cache of the forward tests


@pytest.fixture(scope="module")
def config():
    return DeepseekV41Config.tiny(num_hidden_layers=1)


@pytest.fixture(scope="module")
def model(config):
    """The model with random weights in the checkpoint format (a forward that passes runs)."""
    model = DeepseekV41ForCausalLM(config)
    model.load_weights(random_checkpoint_tensors(config))
    return model


def _inputs(model, ids=(1, 2, 3), positions=(0, 1, 0), slots=(0, 0, 1)):
    return (torch.tensor(ids), torch.tensor(positions), torch.tensor(slots),
            model.make_kv_cache(SLOTS, LENGTH))


# ---- forward --------------------------------------------------------------------------------


@pytest.mark.parametrize("where,match", [
    (dict(ids=(1, -1, 3)), r"input_ids must be in \[0, 512\) \(the vocabulary\), got values in \[-1, 3\]"),
    (dict(ids=(1, 512, 3)), r"input_ids must be in \[0, 512\) .*got values in \[1, 512\]"),
    (dict(positions=(0, 8, 0)), r"positions must be in \[0, 8\) \(the KV cache length\), got values in \[0, 8\]"),
    (dict(positions=(0, -1, 0)), r"positions must be in \[0, 8\) .*got values in \[-1, 0\]"),
    (dict(slots=(0, 2, 1)), r"slots must be in \[0, 2\) \(the KV cache slots\), got values in \[0, 2\]"),
    (dict(slots=(0, -1, 1)), r"slots must be in \[0, 2\) .*got values in \[-1, 1\]"),
], ids=["negative id", "id >= vocab", "position >= length", "negative position", "slot >= slots", "negative slot"])
def test_forward_refuses_indices_outside_the_embedding_or_the_cache(model, where, match):
    with pytest.raises(ValueError, match=match):
        model(*_inputs(model, **where))


def test_forward_names_every_index_out_of_range(model):
    with pytest.raises(ValueError, match=r"input_ids must .*; positions must .*; slots must"):
        model(*_inputs(model, ids=(512, 2, 3), positions=(0, 9, 0), slots=(0, 0, 5)))


def test_forward_refuses_two_tokens_at_one_cache_row(model):
    """Two tokens at one (slot, position) race for one KV-cache row: one token's latent is lost and
    it attends to the other's. Refused before the cache is written; one slot at two positions, or
    one position in two slots, runs."""
    ids, positions, slots, caches = _inputs(model, ids=(5, 7, 3), positions=(0, 0, 1), slots=(1, 1, 1))
    before = caches[0].clone()
    with pytest.raises(ValueError, match=r"tokens share the KV-cache row \(slot 1, position 0\)"):
        model(ids, positions, slots, caches)
    assert torch.equal(caches[0], before)
    with pytest.raises(ValueError, match=r"input_ids must .*; tokens share the KV-cache row \(slot 0, position 3\)"):
        model(*_inputs(model, ids=(512, 2), positions=(3, 3), slots=(0, 0)))
    # out-of-range cells are reported as such, not as shared
    with pytest.raises(ValueError, match=r"positions must be in \[0, 8\)[^;]*$"):
        model(*_inputs(model, ids=(1, 2), positions=(9, 9), slots=(0, 0)))
    assert model(*_inputs(model, ids=(5, 7), positions=(0, 0), slots=(0, 1))).shape == (2, 512)


def test_a_deep_copy_counts_its_quantizes_into_its_own_counter(model):
    """The quantize counter's hooks follow a deep copy of the model: running the copy unchained
    counts into the copy's counter and leaves the original's alone."""
    import copy

    twin = copy.deepcopy(model)
    twin.set_chain(False)
    for m in (model, twin):
        m.quantize_counter.reset()
        m.quantize_counter.enabled = True
    try:
        twin(*_inputs(twin))
    finally:
        model.quantize_counter.enabled = False
    assert twin.quantize_counter.count >= 5 and model.quantize_counter.count == 0


def test_forward_refuses_layers_sharing_one_cache():
    """A cache shared by two layers lets the later layer overwrite the earlier one's keys: the
    logits of that call are right, the next step's are not."""
    config = DeepseekV41Config.tiny(num_hidden_layers=2)
    model = DeepseekV41ForCausalLM(config)
    model.load_weights(random_checkpoint_tensors(config))
    ids, positions, slots, caches = _inputs(model)
    with pytest.raises(ValueError, match=r"kv_caches\[0\] and kv_caches\[1\] share memory"):
        model(ids, positions, slots, [caches[0], caches[0]])
    halves = torch.zeros(2 * SLOTS, LENGTH, config.kv_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share memory"):  # overlapping views of one buffer
        model(ids, positions, slots, [halves[:SLOTS], halves[1:SLOTS + 1]])
    assert model(ids, positions, slots, [halves[:SLOTS], halves[SLOTS:]]).shape == (3, 512)


def test_layers_share_one_set_of_rope_tables():
    """The [L, rd/2] cos / sin tables are made once per model, not once per layer."""
    two = DeepseekV41Config.tiny(num_hidden_layers=2)
    model = DeepseekV41ForCausalLM(two)
    first, second = (layer.attn.rope_tables(LENGTH, "cpu") for layer in model.layers)
    assert first[0] is second[0] and first[1] is second[1]
    other = DeepseekV41ForCausalLM(two)  # another model makes its own
    assert other.layers[0].attn.rope_tables(LENGTH, "cpu")[0] is not first[0]


def test_forward_refuses_inputs_of_the_wrong_kind_or_shape(model):
    ids, positions, slots, caches = _inputs(model)
    with pytest.raises(TypeError, match="positions must be an int32/int64 tensor, got torch.float32"):
        model(ids, positions.float(), slots, caches)
    with pytest.raises(TypeError, match="input_ids must be an int32/int64 tensor, got list"):
        model([1, 2, 3], positions, slots, caches)
    with pytest.raises(ValueError, match=r"input_ids must be 1-D \[T\], got shape \(1, 3\)"):
        model(ids.view(1, 3), positions.view(1, 3), slots.view(1, 3), caches)
    with pytest.raises(ValueError, match=r"positions and slots must have input_ids' shape \(3,\), "
                                         r"got \(2,\) and \(3,\)"):
        model(ids, positions[:2], slots, caches)
    with pytest.raises(ValueError, match=r"got \(3,\) and \(4,\)"):
        model(ids, positions, torch.tensor([0, 0, 1, 1]), caches)
    with pytest.raises(ValueError, match="kv_caches must hold one cache per layer: 1 layers, got 2"):
        model(ids, positions, slots, caches * 2)
    with pytest.raises(ValueError, match="kv_caches must hold one cache per layer: 1 layers, got 0"):
        model(ids, positions, slots, [])
    with pytest.raises(TypeError, match="kv_caches must be a list of per-layer caches .*got Tensor"):
        model(ids, positions, slots, caches[0])
    with pytest.raises(ValueError, match=r"kv_caches must be \[S, L, head_dim\] tensors .*got \['\(8, 128\)'\]"):
        model(ids, positions, slots, [caches[0][0]])


def test_forward_checks_the_logits_indices(model):
    """``logits_indices`` pick token rows: int32/int64, 1-D, each in [0, T) (a negative one would
    pick another token, a 0-d one drop the row dimension); refused before anything runs."""
    ids, positions, slots, caches = _inputs(model)
    before = caches[0].clone()
    for bad, error, match in ((torch.tensor([0, -1]), ValueError, r"logits_indices must be in \[0, 3\) \(the tokens\)"),
                              (torch.tensor([3]), ValueError, r"logits_indices must be in \[0, 3\)"),
                              (torch.tensor(2), ValueError, r"logits_indices must be 1-D \[N\], got shape \(\)"),
                              (torch.tensor([2.0]), TypeError, "logits_indices must be an int32/int64 tensor"),
                              ([2], TypeError, "logits_indices must be an int32/int64 tensor, got list")):
        with pytest.raises(error, match=match):
            model(ids, positions, slots, caches, logits_indices=bad)
    assert torch.equal(caches[0], before)  # refused before the forward wrote the cache
    full = model(ids, positions, slots, caches)
    picked = model(ids, positions, slots, model.make_kv_cache(SLOTS, LENGTH), logits_indices=torch.tensor([2, 0]))
    assert torch.equal(picked, full[[2, 0]])


def test_forward_accepts_the_last_id_position_and_slot(model):
    logits = model(*_inputs(model, ids=(511, 0), positions=(LENGTH - 1, 0), slots=(SLOTS - 1, 0)))
    assert logits.shape == (2, 512) and torch.isfinite(logits).all()


def test_forward_of_no_tokens_gives_no_logits(model):
    """T = 0 runs through every layer in both arms (a reshape inferred a width from 0 elements)."""
    caches = model.make_kv_cache(SLOTS, LENGTH)
    before = [c.clone() for c in caches]
    empty = torch.zeros(0, dtype=torch.long)
    for chain in (True, False):
        model.set_chain(chain)
        logits = model(empty, empty, empty, caches)
        assert logits.shape == (0, model.config.vocab_size) and logits.dtype == torch.float32
    model.set_chain(True)
    assert all(torch.equal(a, b) for a, b in zip(before, caches))


def test_forward_skips_the_value_check_while_a_graph_is_captured(model, monkeypatch):
    """Capture forbids the host read: the values are then left to what fills the graph's inputs
    (the runtime Engine), and the forward goes straight to the embedding."""
    class Embedded(Exception):
        pass

    def embed(ids):
        raise Embedded

    inputs = _inputs(model, positions=(0, LENGTH, 0))
    with pytest.raises(ValueError, match="positions must be in"):
        model(*inputs)
    monkeypatch.setattr(model.embed, "forward", embed)
    monkeypatch.setattr(deepseek_v41, "_capturing_graph", lambda device: True)
    with pytest.raises(Embedded):
        model(*inputs)


# ---- chain switch ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["false", 0, 1, None, torch.tensor(True)])
def test_chain_must_be_a_bool(config, model, value):
    with pytest.raises(TypeError, match=re.escape(f"chain must be True or False, got {value!r}")):
        model.set_chain(value)
    assert model.chain is True and model.layers[0].attn.chain is True  # unchanged
    with pytest.raises(TypeError, match="chain must be True or False"):
        DeepseekV41ForCausalLM(config, chain=value)


# ---- MoE layers -----------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [0, 9, -1, 2.0, True])
def test_router_top_k_must_be_in_1_to_num_experts(top_k):
    with pytest.raises(ValueError, match=rf"top_k must be an int in 1\.\.8 \(num_experts, .*\), got {top_k!r}"):
        TopKRouter(256, 8, top_k, 1.5)


def test_router_sizes_the_kernel_cannot_run_are_refused_at_construction():
    """The router kernel holds a token's scores in one tile (1024 experts) and picks at most 32: past
    either the router would fail at its first forward (inside warmup or graph capture, perhaps)."""
    with pytest.raises(ValueError, match=r"num_experts must be an int in 1\.\.1024"):
        TopKRouter(64, 2048, 8, 1.5)
    with pytest.raises(ValueError, match=r"top_k must be an int in 1\.\.32 "):
        TopKRouter(64, 64, 40, 1.5)
    for overrides in (dict(n_routed_experts=2048), dict(n_routed_experts=64, num_experts_per_tok=40),
                      dict(swiglu_limit=1e-40), dict(rms_norm_eps=1e-50), dict(hc_eps=1e-50)):
        with pytest.raises(ValueError, match="invalid DeepseekV41Config"):
            DeepseekV41Config.tiny(**overrides).validate()


def test_shared_expert_shards_refuse_what_does_not_split():
    """Each rank's shard of gate, of up and of down's K must be whole 32x32 weight blocks."""
    from fp8chain.layers.quantization.fp8 import Fp8Config

    config = Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0")
    expert = SharedExpert(256, 128, swiglu_limit=10.0, quant_config=config, tp_rank=1, tp_size=2)
    assert expert.gate_up.weight.shape == (128, 256) and expert.down.weight.shape == (256, 64)
    with pytest.raises(ValueError, match=r"per-rank part sizes \[48, 48\] are not multiples of the 32x32"):
        SharedExpert(256, 96, swiglu_limit=10.0, quant_config=config, tp_rank=0, tp_size=2)


@pytest.mark.parametrize("idx_shape,weights_shape", [
    ((3, 2), (3, 3)),  # a weight column more than chosen experts (it was never read)
    ((2, 2), (2, 2)),  # routing for two of the three tokens (the third came out zero)
    ((3, 2), (2, 2)),
    ((6,), (6,)),
], ids=["extra weight column", "a token short", "weights a token short", "flat"])
def test_routed_experts_refuse_routing_not_shaped_like_the_tokens(model, idx_shape, weights_shape):
    experts = model.layers[0].ffn.experts
    x = torch.randn(3, 256).bfloat16()
    idx = torch.zeros(idx_shape, dtype=torch.long)
    weights = torch.ones(weights_shape)
    with pytest.raises(ValueError, match=re.escape(f"x [T, H] = (3, 256) needs topk_idx and topk_weights both "
                                                   f"[T, k], got {idx_shape} and {weights_shape}")):
        experts(x, idx, weights)


def test_mxfp4_decoding_refuses_the_nan_scale_byte():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    scale = torch.tensor([[127], [255]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"byte 255 .*NaN.* first at \[1, 0\]"):
        dequantize_mxfp4(packed, scale)
    with pytest.raises(ValueError, match="byte 255"):
        dequantize_mxfp4(packed, scale.view(torch.float8_e8m0fnu))


# ---- checkpoint scales ----------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), -1.0, 0.0, 3.0])
def test_load_refuses_wo_a_scales_that_are_not_positive_powers_of_two(config, value):
    tensors = dict(random_checkpoint_tensors(config))
    scale = tensors["layers.0.attn.wo_a.weight_scale_inv"].clone()
    scale[1, 0] = value
    tensors["layers.0.attn.wo_a.weight_scale_inv"] = scale
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wo_a\.weight_scale_inv: 1 of .* scales are not "
                                         r"positive, finite powers of two .*first at \[1, 0\]"):
        DeepseekV41ForCausalLM(config).load_weights(tensors.items())


@pytest.mark.parametrize("name,index", [
    ("layers.0.attn.wq_b.weight_scale_inv", (-1, 1)),       # in rank 1's rows at TP2
    ("layers.0.attn.wo_b.weight_scale_inv", (1, -1)),       # in rank 1's columns at TP2
    ("layers.0.attn.wkv.weight_scale_inv", (0, 1)),         # the second half of the fused wqkv_a
    ("layers.0.ffn.shared_experts.w3.weight_scale_inv", (1, 2)),
])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_load_checks_each_fp8_linear_whole_under_its_checkpoint_name(config, name, index, tp_size):
    """A bad dense scale is refused on every tensor parallel rank (each checks the whole tensor, not
    its shard), and the error names the checkpoint's tensor and its index there, also in a half
    of a fused parameter (wqkv_a, gate_up)."""
    tensors = dict(random_checkpoint_tensors(config))
    scale = tensors[name].clone()
    scale[index] = 3.0
    tensors[name] = scale
    where = [i % n for i, n in zip(index, scale.shape)]
    for rank in range(tp_size):
        with pytest.raises(ValueError, match=re.escape(name) + r": 1 of .* scales are not positive, finite powers "
                                             r"of two .*first at " + re.escape(str(where)) + ": 3.0"):
            DeepseekV41ForCausalLM(config, tp_rank=rank, tp_size=tp_size).load_weights(tensors.items())


@pytest.mark.parametrize("name,index,value", [
    ("layers.0.hc_ffn_fn", (2, 7), float("nan")), ("layers.0.hc_ffn_fn", (2, 7), float("inf")),
    ("layers.0.hc_ffn_fn", (2, 7), -3.4e38),  # fp32, beyond bf16: mhc_stats splits fn into bf16 parts
    ("layers.0.ffn.gate.bias", (3,), float("nan")), ("layers.0.ffn.gate.bias", (3,), -float("inf")),
])
def test_load_refuses_mhc_fn_and_router_bias_values_the_kernels_cannot_use(config, name, index, value):
    """A NaN router bias would send every token to one expert with finite weights; an fn value past
    bf16's range would make every mix NaN."""
    tensors = dict(random_checkpoint_tensors(config))
    tensor = tensors[name].clone()
    tensor[index] = value
    tensors[name] = tensor
    with pytest.raises(ValueError, match=re.escape(name) + r": 1 values are not finite within .*first at "
                                         + re.escape(str(list(index)))):
        DeepseekV41ForCausalLM(config).load_weights(tensors.items())


@pytest.mark.parametrize("name", ["layers.0.attn.wq_b.weight_scale_inv", "layers.0.attn.wo_a.weight_scale_inv",
                                  "layers.0.ffn.shared_experts.w2.weight_scale_inv"])
def test_load_refuses_dense_scales_stored_as_bytes(config, name):
    """A UE8M0 byte 128 (2.0) stored as uint8 would be read as the number 128.0, a power of two
    64x off: dense scales must be the checkpoint's float32."""
    tensors = dict(random_checkpoint_tensors(config))
    tensors[name] = torch.full_like(tensors[name], 128, dtype=torch.uint8)
    with pytest.raises(TypeError, match=rf"{name}: fp8_scale tensors must be one of \(torch.float32,\), "
                                        rf"got torch.uint8"):
        DeepseekV41ForCausalLM(config).load_weights(tensors.items())


def test_load_refuses_an_fp8_embedding(config):
    """It would be cast to bf16 without its scale."""
    tensors = dict(random_checkpoint_tensors(config))
    tensors["embed.weight"] = tensors["embed.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="embed.weight: embed tensors must be one of .*got torch.float8_e4m3fn"):
        DeepseekV41ForCausalLM(config).load_weights(tensors.items())


def test_load_refuses_nan_expert_scales(config):
    tensors = dict(random_checkpoint_tensors(config))
    name = "layers.0.ffn.experts.3.w2.scale"
    scale = tensors[name].view(torch.uint8).clone()
    scale[4, 1] = 255
    tensors[name] = scale.view(torch.float8_e8m0fnu)
    model = DeepseekV41ForCausalLM(config)
    with pytest.raises(ValueError, match=re.escape(name) + r" \(\d+, \d+\): 1 hold the byte 255 .*first at \[4, 1\]"):
        model.load_weights(tensors.items())


def test_load_names_the_expert_tensor_whose_values_overflow(config):
    """A scale byte 254 times the largest e2m1 code (6 x 2^127) is past fp32's range: refused under
    the expert matrix's checkpoint name (the stacked parameters' index would name neither)."""
    tensors = dict(random_checkpoint_tensors(config))
    matrix = "layers.0.ffn.experts.5.w3"
    scale, weight = tensors[f"{matrix}.scale"].view(torch.uint8).clone(), tensors[f"{matrix}.weight"].view(torch.uint8).clone()
    scale[2, 0] = 254
    weight[2, 0] = 0x07  # codes 7 (6.0) and 0
    tensors[f"{matrix}.scale"], tensors[f"{matrix}.weight"] = scale, weight
    model = DeepseekV41ForCausalLM(config)
    with pytest.raises(ValueError, match=re.escape(matrix) + r": MXFP4 data .* overflow fp32 .*first at \[2, 0\]"):
        model.load_weights(tensors.items())


def test_check_mxfp4_names_the_tensor_for_a_scale_byte_253_overflow():
    """Byte 253 with code 6 (4 x 2^126 = 2^128) overflows fp32: refused at load, under the tensor's name."""
    packed = torch.full((2, 16), 0x22, dtype=torch.uint8)
    packed[1, 0] = 0x06
    scale = torch.tensor([[127], [253]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^layers\.0\.ffn\.experts\.1\.w1: MXFP4 data .*overflow fp32"):
        check_mxfp4(packed, scale, "layers.0.ffn.experts.1.w1")


def test_mxfp4_decoding_refuses_scales_of_other_rows():
    """Scales with fewer rows than the data would broadcast row 0's scales over all: refused."""
    packed = torch.full((4, 16), 0x22, dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs scales"):
        dequantize_mxfp4(packed, torch.full((1, 1), 127, dtype=torch.uint8))


def test_swiglu_reference_matches_the_act_spec():
    """swiglu_reference clamps gate from above and up on both sides, as the act kernel's reference."""
    gate_up = torch.randn(7, 64) * 20
    for limit in (None, 7.0):
        assert torch.equal(swiglu_reference(gate_up, limit), silu_mul_fp32(gate_up, limit))


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_passes_scaling_and_renormalize_to_the_kernel(renormalize):
    """TopKRouter's weights are the reference's for its own routed_scaling_factor and renormalize."""
    router = TopKRouter(64, 16, 4, 2.5, renormalize=renormalize)
    router.weight.copy_((torch.randn(16, 64) / 8).bfloat16())
    router.bias.copy_(torch.linspace(-1, 1, 16))  # distinct keys for zero rows
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    idx, weights = router(x)
    want_idx, want_weights = ref.router_topk(x, router.weight, router.bias, 4, 2.5, renormalize)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


def _experts_with_weights(e=2, h=64, i=32):
    experts = RoutedExpertsReference(num_experts=e, hidden_size=h, intermediate_size=i, swiglu_limit=7.0)
    w13, s13 = quantize_mxfp4(torch.randn(e, 2 * i, h) * 0.2)
    w2, s2 = quantize_mxfp4(torch.randn(e, h, i) * 0.2)
    for name, t in (("w13_weight", w13), ("w13_scale", s13), ("w2_weight", w2), ("w2_scale", s2)):
        getattr(experts, name).data.copy_(t)
    return experts


def test_routed_experts_round_the_activation_to_bf16():
    """Each token's result is sum_k w_k * (bf16(swiglu(x @ w13.T)) @ w2.T), fp32 elsewhere."""
    experts = _experts_with_weights()
    experts.process_weights_after_loading()
    x = torch.randn(5, 64).bfloat16()
    idx = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
    w = torch.rand(5, 2)
    want = torch.zeros(5, 64)
    for t in range(5):
        for k in range(2):
            e = int(idx[t, k])
            gate_up = x[t:t + 1].float() @ experts.w13_dequant[e].float().t()
            h = swiglu_reference(gate_up, 7.0).bfloat16().float()
            want[t] += w[t, k] * (h @ experts.w2_dequant[e].float().t())[0]
    torch.testing.assert_close(experts(x, idx, w), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(experts(x, idx, w), experts(x, idx, w))


def test_routed_experts_ignore_experts_no_token_is_routed_to():
    """An expert whose output overflows to inf leaves the tokens not routed to it finite (no 0 * inf)."""
    experts = _experts_with_weights()
    experts.w2_weight.data[1] = 0x77  # code 7 = 6.0 everywhere
    experts.w2_scale.data[1] = 252  # 6 x 2^125 per element: any nonzero h overflows
    experts.process_weights_after_loading()
    x = torch.randn(3, 64).bfloat16()
    out = experts(x, torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1))
    assert torch.isfinite(out).all()
    assert not torch.isfinite(experts(x, torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1))).all()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_routes_scales_and_clamps_with_the_configs_settings(norm_topk_prob):
    """The MoE sublayer uses its config's norm_topk_prob, routed_scaling_factor and swiglu_limit."""
    config = DeepseekV41Config.tiny(num_hidden_layers=1, norm_topk_prob=norm_topk_prob,
                                    routed_scaling_factor=2.5, swiglu_limit=0.5)
    model = DeepseekV41ForCausalLM(config)
    model.load_weights(random_checkpoint_tensors(config))
    ffn = model.layers[0].ffn
    x = torch.randn(4, config.hidden_size).bfloat16()
    idx, weights = ffn.gate(x)
    want_idx, want_weights = ref.router_topk(x, ffn.gate.weight, ffn.gate.bias, config.num_experts_per_tok,
                                             2.5, norm_topk_prob)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)

    def routed(limit):
        out = torch.zeros(x.shape[0], config.hidden_size)
        for t in range(x.shape[0]):
            for k in range(config.num_experts_per_tok):
                e = int(idx[t, k])
                gate_up = x[t:t + 1].float() @ ffn.experts.w13_dequant[e].float().t()
                h = swiglu_reference(gate_up, limit).bfloat16().float()
                out[t] += weights[t, k] * (h @ ffn.experts.w2_dequant[e].float().t())[0]
        return out

    want = routed(0.5)
    assert (want - routed(None)).abs().max() > 1e-2  # the clamp is active at these weights
    torch.testing.assert_close(ffn.experts(x, idx, weights), want, rtol=1e-5, atol=1e-5)
    shared = ffn.shared_experts(x).float()
    torch.testing.assert_close(ffn(x).float(), (want + shared).bfloat16().float(), rtol=1e-2, atol=1e-3)


def test_forward_refuses_layer_caches_of_different_shapes():
    """Every layer's cache must have one [S, L, head_dim] shape (the index check reads the first)."""
    config = DeepseekV41Config.tiny(num_hidden_layers=2)
    model = DeepseekV41ForCausalLM(config)
    model.load_weights(random_checkpoint_tensors(config))
    ids, positions, slots, caches = _inputs(model)
    shorter = torch.zeros(SLOTS, LENGTH - 1, config.kv_dim, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"kv_caches must be \[S, L, head_dim\] tensors of one shape"):
        model(ids, positions, slots, [caches[0], shorter])


def test_model_refuses_o_groups_that_do_not_split_over_the_ranks():
    """o_groups not divisible by tp_size is refused (else a rank holds zero wo_a groups)."""
    config = DeepseekV41Config.tiny(num_hidden_layers=1, num_attention_heads=4, o_groups=2)
    with pytest.raises(ValueError, match="o_groups=2 is not divisible by tp_size 4"):
        DeepseekV41ForCausalLM(config, tp_rank=0, tp_size=4)


@pytest.mark.parametrize("value", [torch.finfo(torch.bfloat16).max, -torch.finfo(torch.bfloat16).max])
def test_load_accepts_mhc_fn_values_at_the_bf16_limit(value):
    """An hc fn value of exactly +-bf16 max is finite within the bound: loaded, not refused."""
    config = DeepseekV41Config.tiny(num_hidden_layers=1)
    tensors = dict(random_checkpoint_tensors(config))
    fn = tensors["layers.0.hc_ffn_fn"].clone()
    fn[2, 7] = value
    tensors["layers.0.hc_ffn_fn"] = fn
    model = DeepseekV41ForCausalLM(config)
    model.load_weights(tensors.items())
    assert model.layers[0].hc_ffn.fn[2, 7].item() == value


def test_attention_rope_tables_follow_the_config():
    """The attention's cos/sin tables are RoPE's of the config's rope_theta and qk_rope_head_dim."""
    config = DeepseekV41Config.tiny(num_hidden_layers=1, rope_theta=500.0, qk_rope_head_dim=32)
    attn = deepseek_v41.MQALayer(config)
    cos, sin = attn.rope_tables(16, "cpu")
    want_cos, want_sin = ref.rope_tables(16, 32, 500.0, "cpu")
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_the_scale_alias_renames_dense_block_scales_only():
    """``<x>.scale`` is a dense weight's block scales (-> ``<x>.weight_scale_inv``); a routed expert's
    ``.scale`` is its MXFP4 scale bytes and keeps its name (the fp32 reference reads it so)."""
    rename = deepseek_v41._dense_scale_name
    assert rename("layers.0.attn.wq_b.scale") == "layers.0.attn.wq_b.weight_scale_inv"
    assert rename("layers.1.ffn.shared_experts.w2.scale") == "layers.1.ffn.shared_experts.w2.weight_scale_inv"
    assert rename("layers.0.ffn.experts.3.w1.scale") == "layers.0.ffn.experts.3.w1.scale"
    assert rename("layers.0.attn.wq_b.weight") == "layers.0.attn.wq_b.weight"


def test_kept_indexer_inputs_are_the_attention_input_and_the_normed_q_lora(model):
    """``keep_indexer_inputs`` keeps what DSv4.1's indexer reads: the attention's bf16 input and the
    q_norm output (not wqkv_a's raw q_lora columns)."""
    attn = model.layers[0].attn
    attn.keep_indexer_inputs = True
    try:
        with torch.no_grad():
            model(*_inputs(model))
            x, q_lora = attn.last_x, attn.last_q_lora
            want, _ = attn.q_norm(attn.wqkv_a(x)[:, :attn.q_lora_rank], None)
    finally:
        attn.keep_indexer_inputs = False
        attn.last_x = attn.last_q_lora = None
    assert x.shape == (3, model.config.hidden_size) and x.dtype == torch.bfloat16
    assert torch.equal(q_lora, want)


def test_the_shared_expert_clamps_with_the_configs_swiglu_limit():
    """The shared expert's SiLU*mul clamps at the config's swiglu_limit (as the routed experts do):
    its output is down(silu_mul(gate_up(x), limit)) bit for bit, at weights where the clamp is active."""
    config = DeepseekV41Config.tiny(num_hidden_layers=1, swiglu_limit=0.5)
    model = DeepseekV41ForCausalLM(config)
    model.load_weights(random_checkpoint_tensors(config))
    shared = model.layers[0].ffn.shared_experts
    x = torch.randn(4, config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        gate_up = shared.gate_up(x)
        want = shared.down(act.silu_mul(gate_up, limit=0.5))
        unclamped = shared.down(act.silu_mul(gate_up, limit=None))
        got = shared(x)
    assert not torch.equal(want, unclamped)  # the clamp is active at these weights
    assert torch.equal(got, want)


def test_every_mhc_boundary_takes_the_configs_sinkhorn_iterations_and_epsilons():
    """A Sinkhorn iteration more or less moves the mixes too little for a logits bound to see: the
    boundaries' settings are checked as built."""
    config = DeepseekV41Config.tiny(hc_sinkhorn_iters=7, hc_eps=3e-6, rms_norm_eps=2e-6)
    model = DeepseekV41ForCausalLM(config)
    for layer in model.layers:
        for hc in (layer.hc_attn, layer.hc_ffn):
            assert (hc.sinkhorn_iters, hc.hc_eps, hc.rms_eps) == (7, 3e-6, 2e-6)
