"""DeepseekV41Config: from a HF config.json dict, presets, validation (CPU, no kernels run)."""

import json
import logging

import pytest

from fp8chain.models.deepseek_v41 import DeepseekV41Config

pytestmark = pytest.mark.cpu


def test_flash_preset_matches_reference_dimensions():
    c = DeepseekV41Config.flash()
    assert (c.hidden_size, c.hc_mult, c.num_attention_heads, c.head_dim) == (5120, 4, 64, 512)
    assert (c.qk_rope_head_dim, c.qk_nope_head_dim, c.q_lora_rank) == (64, 448, 1280)
    assert (c.o_groups, c.o_lora_rank, c.o_group_dim) == (8, 1024, 4096)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 6, 2304)
    assert (c.num_hidden_layers, c.vocab_size, c.routed_scaling_factor) == (43, 129280, 1.5)
    assert (c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, c.hc_mix) == (20, 1e-6, 1e-6, 24)
    assert c.weight_block_size == (32, 32)
    assert c.quantization_config["scale_fmt"] == "ue8m0"
    shapes = c.fp8_linear_shapes()
    assert shapes["attn.wq_a"][0] + shapes["attn.wkv"][0] == 1792  # fused wqkv_a [1792, 5120]
    assert shapes["attn.wq_b"] == (64 * 512, 1280)
    assert shapes["attn.wo_b"] == (5120, 8192)
    assert shapes["ffn.shared_experts.w1"] == (2304, 5120)
    assert shapes["ffn.shared_experts.w2"] == (5120, 2304)


def test_tiny_preset_keeps_the_structure():
    c = DeepseekV41Config.tiny()
    assert c.hc_mult == 4 and c.o_groups == 2 and c.num_attention_heads == 2
    assert c.head_dim == 128 and c.qk_rope_head_dim == 64 and c.kv_dim == 128
    assert c.n_routed_experts == 8 and c.num_experts_per_tok == 2
    for name, (n, k) in c.fp8_linear_shapes().items():
        assert k % 128 == 0 and n % 32 == 0, name
    assert DeepseekV41Config.tiny(num_hidden_layers=3).num_hidden_layers == 3


def test_from_dict_roundtrip_and_unknown_keys(tmp_path):
    d = DeepseekV41Config.tiny().to_dict()
    assert d["model_type"] == "deepseek_v4" and d["architectures"] == ["DeepseekV4ForCausalLM"]
    d["compress_ratios"] = [0, 4]
    d["index_topk"] = 512
    c = DeepseekV41Config.from_dict(d)
    assert c == DeepseekV41Config.from_dict(c.to_dict())
    assert c.extra["compress_ratios"] == [0, 4] and c.extra["index_topk"] == 512
    assert c.to_dict()["compress_ratios"] == [0, 4]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(c.to_dict()))
    assert DeepseekV41Config.from_json(path) == c


def test_from_hf_style_dict_overrides_defaults():
    hf = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 1024, "hidden_size": 512, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 256,
        "o_groups": 2, "o_lora_rank": 128, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 256, "routed_scaling_factor": 2.5, "swiglu_limit": 7.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 10, "rope_theta": 50000.0,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32],
                                "scale_fmt": "ue8m0", "activation_scheme": "dynamic"},
    }
    c = DeepseekV41Config.from_dict(hf)
    assert (c.hidden_size, c.num_hidden_layers, c.o_group_dim) == (512, 3, 256)
    assert (c.routed_scaling_factor, c.swiglu_limit, c.hc_sinkhorn_iters) == (2.5, 7.0, 10)
    assert c.rope_theta == 50000.0 and c.extra == {}


@pytest.mark.parametrize("bad", [
    dict(num_attention_heads=3),            # heads not a multiple of o_groups
    dict(hidden_size=200),                  # K not a multiple of the 32-column weight block
    dict(q_lora_rank=80),                   # wq_b K = 80
    dict(moe_intermediate_size=80),
    dict(hc_mult=2),                        # the mHC kernels run 4 streams
    dict(num_experts_per_tok=9),
    dict(qk_rope_head_dim=63),
    dict(scoring_func="softmax"),
    dict(tie_word_embeddings=True),         # the model reads its own head.weight
])
def test_validation_rejects_unsupported_structures(bad):
    with pytest.raises(ValueError):
        DeepseekV41Config.tiny(**bad)


@pytest.mark.parametrize("bad,named", [
    (dict(hidden_size="256"), "hidden_size must be a positive int"),
    (dict(hidden_size=256.0), "hidden_size must be a positive int"),
    (dict(o_groups=0), "o_groups must be a positive int"),
    (dict(num_hidden_layers=0), "num_hidden_layers must be a positive int"),
    (dict(vocab_size=-5), "vocab_size must be a positive int"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok must be a positive int"),
    (dict(norm_topk_prob="false"), "norm_topk_prob must be true or false"),
    (dict(routed_scaling_factor=True), "routed_scaling_factor must be a positive finite number"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be a positive finite number"),
    (dict(quantization_config=None), "quantization_config must be a dict"),
    (dict(quantization_config={"weight_block_size": [32]}), "weight_block_size is two positive ints"),
    # what the FP8 linears read, refused with the config rather than when the model is built
    (dict(quantization_config={**DeepseekV41Config.tiny().quantization_config, "weight_block_size": [64, 64]}),
     r"weight_block_size must be \[32, 32\] or \[128, 128\]"),
    (dict(quantization_config={**DeepseekV41Config.tiny().quantization_config, "quant_method": "awq"}),
     "quantization_config: "),
    # what the first forward would refuse: wo_a's rows per group in whole scale groups, finite floats
    (dict(o_lora_rank=48), "o_lora_rank=48 must be a multiple of the weight block's 32 rows"),
    (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor must be a positive finite number"),
    (dict(rope_theta=float("inf")), "rope_theta must be a positive finite number"),
    (dict(rope_theta=float("nan")), "rope_theta must be a positive finite number"),
    # keys the model does not read but which describe another model
    (dict(hidden_act="gelu"), "hidden_act='gelu' \\(the shared and routed experts run SiLU\\)"),
    (dict(qk_nope_head_dim=128), "qk_nope_head_dim=128 \\(head_dim - qk_rope_head_dim = 64\\)"),
    (dict(quantization_config={**DeepseekV41Config.tiny().quantization_config, "fmt": "e5m2"}),
     "fmt must be 'e4m3'"),
    # the checkpoint layout has every dense linear in FP8: a layer kept in bf16 could never load
    (dict(quantization_config={**DeepseekV41Config.tiny().quantization_config,
                               "modules_to_not_convert": ["layers.0.attn.wq_b"]}),
     r"keeps \['layers.0.attn.wq_b'\] unquantized"),
])
def test_from_dict_names_values_of_the_wrong_kind(bad, named):
    with pytest.raises(ValueError, match=named):
        DeepseekV41Config.from_dict({**DeepseekV41Config.tiny().to_dict(), **bad})


def test_from_dict_refuses_other_models_and_says_what_it_ignores(caplog):
    tiny = DeepseekV41Config.tiny().to_dict()
    with pytest.raises(ValueError, match="not a DeepSeek-V4 config"):
        DeepseekV41Config.from_dict({**tiny, "model_type": "llama"})
    with pytest.raises(ValueError, match="extra must be a dict"):
        DeepseekV41Config.from_dict({**tiny, "extra": [1]})
    yarn = {"type": "yarn", "factor": 16}
    with caplog.at_level("WARNING"):
        config = DeepseekV41Config.from_dict({**tiny, "rope_scaling": yarn})
    assert "rope_scaling" in caplog.text and config.extra["rope_scaling"] == yarn
    caplog.clear()
    with caplog.at_level("WARNING"):  # still the model it runs, without that feature: said
        config = DeepseekV41Config.from_dict({**tiny, "n_group": 4, "topk_group": 1, "sliding_window": 128,
                                              "hidden_act": "silu", "qk_nope_head_dim": 64, "torch_dtype": "float32",
                                              "num_hash_layers": 3})
    assert "group-limited routing" in caplog.text and "sliding_window=128" in caplog.text
    assert "torch_dtype='float32' is not used" in caplog.text and "num_hash_layers=3" in caplog.text
    assert config.extra["n_group"] == 4
    assert DeepseekV41Config.from_dict({**tiny, "swiglu_limit": None}).swiglu_limit is None


def test_validation_takes_k_in_weight_blocks_not_128():
    """A TP4 shard of the shared expert: down K = 2304 / 4 = 576, whole 32-column blocks (and
    activation groups) though no multiple of 128."""
    c = DeepseekV41Config.flash(moe_intermediate_size=576)
    assert c.fp8_linear_shapes()["ffn.shared_experts.w2"] == (5120, 576)
    assert DeepseekV41Config.tiny(q_lora_rank=96).fp8_linear_shapes()["attn.wq_b"][1] == 96


def test_to_dict_writes_the_read_fields_over_extra():
    """A read field's value wins over a same-named key in extra, so from_dict(to_dict()) round-trips."""
    c = DeepseekV41Config.tiny(extra={"hidden_size": 1024, "index_topk": 512})
    d = c.to_dict()
    assert d["hidden_size"] == 256 and d["index_topk"] == 512
    assert DeepseekV41Config.from_dict(d).hidden_size == 256


def test_from_dict_keeps_a_given_extra():
    """The keys of a config.json's own "extra" dict are kept in extra and written back by to_dict."""
    d = {**DeepseekV41Config.tiny().to_dict(), "extra": {"index_topk": 512}, "compress_ratios": [0, 4]}
    c = DeepseekV41Config.from_dict(d)
    assert c.extra == {"index_topk": 512, "compress_ratios": [0, 4]}
    assert c.to_dict()["index_topk"] == 512


def test_group_routing_warns_only_when_groups_limit_the_choice(caplog):
    """n_group with topk_group == n_group routes over all experts: no group-limited warning."""
    tiny = DeepseekV41Config.tiny().to_dict()
    with caplog.at_level(logging.WARNING):
        DeepseekV41Config.from_dict({**tiny, "n_group": 4, "topk_group": 4})
    assert "group-limited routing" not in caplog.text
    with caplog.at_level(logging.WARNING):
        DeepseekV41Config.from_dict({**tiny, "n_group": 4, "topk_group": 3})
    assert "group-limited routing" in caplog.text


def test_from_dict_and_to_dict_copy_the_quantization_config():
    """The config holds its own quantization_config: editing the dict it was read from, or the
    dict to_dict wrote, leaves the config as it was (and the other way round)."""
    d = DeepseekV41Config.tiny().to_dict()
    c = DeepseekV41Config.from_dict(d)
    d["quantization_config"]["scale_fmt"] = "edited"
    assert c.quantization_config["scale_fmt"] == "ue8m0"
    out = c.to_dict()
    out["quantization_config"]["weight_block_size"] = [128, 128]
    assert c.quantization_config["weight_block_size"] == [32, 32] and c.weight_block_size == (32, 32)


@pytest.mark.parametrize("name", ["routed_scaling_factor", "rope_theta", "rms_norm_eps", "hc_eps"])
def test_float_settings_of_zero_are_refused(name):
    """"Positive" excludes 0 (a zero scaling factor silences every routed expert; a zero theta
    makes every RoPE frequency infinite)."""
    with pytest.raises(ValueError, match=f"{name} must be a positive finite number"):
        DeepseekV41Config.from_dict({**DeepseekV41Config.tiny().to_dict(), name: 0.0})


def test_the_bounds_of_rope_dim_and_top_k_are_inclusive():
    """RoPE on the whole head (qk_rope_head_dim == head_dim, no nope part) and top-k over every
    routed expert (num_experts_per_tok == n_routed_experts) are valid structures."""
    c = DeepseekV41Config.tiny(qk_rope_head_dim=128)
    assert c.qk_rope_head_dim == c.head_dim == 128 and c.qk_nope_head_dim == 0
    assert DeepseekV41Config.tiny(num_experts_per_tok=8).num_experts_per_tok == 8
    with pytest.raises(ValueError, match="qk_rope_head_dim=192 must be even and <= head_dim"):
        DeepseekV41Config.tiny(qk_rope_head_dim=192)


def test_one_hash_routed_layer_is_said(caplog):
    """num_hash_layers counts the first layers that route by hash: even one is not modelled."""
    with caplog.at_level(logging.WARNING):
        DeepseekV41Config.from_dict({**DeepseekV41Config.tiny().to_dict(), "num_hash_layers": 1})
    assert "num_hash_layers=1" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        DeepseekV41Config.from_dict({**DeepseekV41Config.tiny().to_dict(), "num_hash_layers": 0})
    assert "num_hash_layers" not in caplog.text
