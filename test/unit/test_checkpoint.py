"""DSv4.1 checkpoints: layout, random writer, reader, MXFP4/FP8 weight encodings, model loading."""

import json

import pytest
import torch

from fp8chain.layers.moe import E2M1_VALUES, MXFP4_LARGEST, dequantize_mxfp4, quantize_mxfp4
from fp8chain.models.checkpoint import (
    INDEX_FILE, checkpoint_layout, load_checkpoint, load_state_dict, quantize_fp8_blockwise,
    random_checkpoint_tensors, write_random_checkpoint,
)
from fp8chain.models.deepseek_v41 import DeepseekV41Config, check_tensor_spec
from fp8chain_kernel.formats import FP8_DTYPE
from fp8chain_kernel.reference import dequantize_weight

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def tiny():
    return DeepseekV41Config.tiny()


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny):
    path = tmp_path_factory.mktemp("ckpt")
    write_random_checkpoint(path, tiny, seed=7)
    return path


def test_layout_names_dtypes_shapes(tiny):
    layout = checkpoint_layout(tiny)
    e, h, i = tiny.n_routed_experts, tiny.hidden_size, tiny.moe_intermediate_size
    per_layer = 2 + 6 + 5 * 2 + 3 + 2 + 3 * 2 + e * 3 * 2
    assert len(layout) == 3 + tiny.num_hidden_layers * per_layer
    assert layout["embed.weight"] == ((tiny.vocab_size, h), torch.bfloat16, "embed")
    assert layout["head.weight"].shape == (tiny.vocab_size, h)
    assert layout["layers.1.attn.wq_a.weight"].shape == (tiny.q_lora_rank, h)
    assert layout["layers.1.attn.wq_a.weight"].dtype == FP8_DTYPE
    assert layout["layers.1.attn.wkv.weight_scale_inv"] == ((tiny.kv_dim // 32, h // 32), torch.float32,
                                                            "fp8_scale")
    assert layout["layers.0.attn.wo_a.weight"].shape == (tiny.o_groups * tiny.o_lora_rank, tiny.o_group_dim)
    assert layout["layers.0.hc_attn_fn"] == ((24, 4 * h), torch.float32, "hc_fn")
    assert layout["layers.0.hc_ffn_base"].shape == (24,) and layout["layers.0.hc_ffn_scale"].shape == (3,)
    assert layout["layers.0.ffn.gate.weight"].dtype == torch.bfloat16
    assert layout["layers.0.ffn.experts.7.w1.weight"] == ((i, h // 2), torch.uint8, "mxfp4")
    assert layout["layers.0.ffn.experts.7.w2.scale"] == ((h, i // 32), torch.float8_e8m0fnu, "mxfp4_scale")
    assert layout["layers.0.ffn.shared_experts.w2.weight"].shape == (h, i)


def test_round_trip_names_dtypes_shapes(written, tiny):
    config, it = load_checkpoint(written)
    assert config == tiny
    tensors = dict(it)
    layout = checkpoint_layout(tiny)
    assert set(tensors) == set(layout)
    for name, spec in layout.items():
        assert tuple(tensors[name].shape) == spec.shape, name
        assert tensors[name].dtype == spec.dtype, name
    index = json.loads((written / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(layout)
    assert len(set(index["weight_map"].values())) == tiny.num_hidden_layers
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert json.loads((written / "config.json").read_text())["quantization_config"]["weight_block_size"] == [32, 32]


def test_deterministic_from_seed(written, tiny, tmp_path):
    _, first = load_state_dict(written)
    again = dict(random_checkpoint_tensors(tiny, seed=7))
    other = dict(random_checkpoint_tensors(tiny, seed=8))
    for name, t in first.items():
        assert torch.equal(t.view(torch.uint8), again[name].view(torch.uint8)), name
    differs = [n for n, t in first.items() if not torch.equal(t.view(torch.uint8), other[n].view(torch.uint8))]
    assert len(differs) > 0.9 * len(first)


def test_weights_are_sane(written, tiny):
    _, t = load_state_dict(written)
    for name, x in t.items():
        if name.endswith("weight_scale_inv"):  # power-of-two, positive, finite
            assert torch.isfinite(x).all() and (x > 0).all(), name
            assert ((x.view(torch.int32) & 0x7FFFFF) == 0).all(), name
    w = dequantize_weight(t["layers.0.attn.wq_b.weight"], t["layers.0.attn.wq_b.weight_scale_inv"], 32)
    std = w.std().item() * tiny.q_lora_rank ** 0.5
    assert 0.8 < std < 1.2  # ~ 1/sqrt(fan_in)
    e = dequantize_mxfp4(t["layers.1.ffn.experts.3.w1.weight"], t["layers.1.ffn.experts.3.w1.scale"])
    assert 0.7 < e.std().item() * tiny.hidden_size ** 0.5 < 1.3
    assert torch.isfinite(t["layers.0.hc_attn_fn"]).all()


def test_mxfp4_encoding_roundtrip():
    values = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES[1:]) + (0.0,) * 17)
    w = torch.stack([values * 2.0 ** e for e in (-3, 0, 5)])  # exactly representable rows [3, 32]
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (3, 16) and packed.dtype == torch.uint8 and scale.shape == (3, 1)
    assert torch.equal(dequantize_mxfp4(packed, scale), w)
    assert torch.equal(dequantize_mxfp4(packed, scale.view(torch.float8_e8m0fnu)), w)
    # nibble order: element 2j in the low nibble of byte j
    one = torch.zeros(1, 32)
    one[0, 0], one[0, 1] = 1.0, -6.0
    p, s = quantize_mxfp4(one)
    assert int(s[0, 0]) == 127 and int(p[0, 0]) == (0x2 | (0xF << 4))
    # random: within half an e2m1 step of the block's scale
    x = torch.randn(64, 128)
    p, s = quantize_mxfp4(x)
    err = (dequantize_mxfp4(p, s) - x).abs()
    step = (s.to(torch.int32) - 127).float().exp2().repeat_interleave(32, dim=1)
    assert (err <= step + 1e-6).all()  # largest e2m1 gap is 2 (between 4 and 6): half is 1 * scale
    # every UE8M0 byte 0..254 is 2^(byte - 127), byte 0 (2^-127, an fp32 subnormal) included
    ones = torch.full((255, 16), 0x22, dtype=torch.uint8)  # e2m1 code 2 = 1.0 in both nibbles
    exps = torch.arange(255, dtype=torch.uint8)[:, None]
    got = dequantize_mxfp4(ones, exps)[:, 0].double()
    assert torch.equal(got, torch.exp2(torch.arange(255, dtype=torch.float64) - 127))
    if hasattr(torch, "float4_e2m1fn_x2"):  # the loader takes this element type: so does the decoder
        assert torch.equal(dequantize_mxfp4(packed.view(torch.float4_e2m1fn_x2), scale), w)


def test_mxfp4_refuses_values_it_cannot_hold():
    """Decoding: a code times its scale past fp32's range (bytes 253 / 254 with the larger codes)
    is refused, the largest that fits (6 x 2^125) decodes exactly. Encoding: NaN, inf and values
    past that largest one have no MXFP4 code."""
    largest = torch.full((1, 16), 0x77, dtype=torch.uint8)  # e2m1 code 7 = 6.0 in both nibbles
    assert dequantize_mxfp4(largest, torch.tensor([[252]], dtype=torch.uint8))[0, 0] == MXFP4_LARGEST
    for byte, code in ((253, 0x66), (254, 0x44)):  # 4 x 2^126 and 2 x 2^127: 2^128
        packed = torch.full((2, 16), 0x22, dtype=torch.uint8)
        packed[1, 3] = code
        with pytest.raises(ValueError, match=r"2 values overflow fp32 .*first at \[1, 6\]"):
            dequantize_mxfp4(packed, torch.tensor([[127], [byte]], dtype=torch.uint8))
    assert torch.equal(quantize_mxfp4(torch.full((1, 32), MXFP4_LARGEST))[1], torch.tensor([[252]], dtype=torch.uint8))
    for value in (float("nan"), float("inf"), -3.0e38):
        w = torch.randn(2, 64)
        w[1, 40] = value
        with pytest.raises(ValueError, match=r"1 of \(2, 64\) are not, first at \[1, 40\]"):
            quantize_mxfp4(w)


def test_fp8_blockwise_encoding():
    w = torch.randn(64, 96) * 0.05
    data, scale = quantize_fp8_blockwise(w, (32, 32))
    assert data.dtype == FP8_DTYPE and scale.shape == (2, 3)
    deq = dequantize_weight(data, scale, 32)
    assert ((deq - w).abs() <= w.abs() * 2 ** -3 + 1e-6).all()
    blocks = deq.reshape(2, 32, 3, 32).abs().amax(dim=(1, 3))
    assert (blocks <= 448 * scale).all() and (blocks > 224 * scale).all()


def test_model_reads_the_checkpoint_back(written, tiny):
    from fp8chain.models.deepseek_v41 import DeepseekV41ForCausalLM

    config, it = load_checkpoint(written)
    model = DeepseekV41ForCausalLM(config)
    loaded = model.load_weights(it)
    _, t = load_state_dict(written)
    assert loaded == set(t)
    attn = model.layers[1].attn
    assert torch.equal(attn.wqkv_a.weight.view(torch.uint8), torch.cat(
        [t["layers.1.attn.wq_a.weight"], t["layers.1.attn.wkv.weight"]]).view(torch.uint8))
    assert torch.equal(attn.wqkv_a.weight_scale_inv, torch.cat(
        [t["layers.1.attn.wq_a.weight_scale_inv"], t["layers.1.attn.wkv.weight_scale_inv"]]))
    wo_a = dequantize_weight(t["layers.1.attn.wo_a.weight"], t["layers.1.attn.wo_a.weight_scale_inv"], 32)
    assert torch.equal(attn.wo_a, wo_a.view(attn.wo_a.shape).bfloat16())
    shared = model.layers[0].ffn.shared_experts
    assert torch.equal(shared.gate_up.weight.view(torch.uint8), torch.cat(
        [t["layers.0.ffn.shared_experts.w1.weight"], t["layers.0.ffn.shared_experts.w3.weight"]]).view(torch.uint8))
    assert torch.equal(shared.down.weight_scale_inv, t["layers.0.ffn.shared_experts.w2.weight_scale_inv"])
    experts = model.layers[0].ffn.experts
    i = tiny.moe_intermediate_size
    assert torch.equal(experts.w13_weight[5, i:], t["layers.0.ffn.experts.5.w3.weight"])
    assert torch.equal(experts.w2_scale[2], t["layers.0.ffn.experts.2.w2.scale"].view(torch.uint8))
    assert torch.equal(experts.w13_dequant[5, :i].float(), dequantize_mxfp4(
        t["layers.0.ffn.experts.5.w1.weight"], t["layers.0.ffn.experts.5.w1.scale"]))
    assert torch.equal(model.layers[1].hc_ffn.fn, t["layers.1.hc_ffn_fn"])
    assert torch.equal(model.head.weight, t["head.weight"])
    for name, linear in model.fp8_linears().items():
        assert linear.input_format is not None, name  # every request honoured


def test_from_pretrained(written, tiny):
    from fp8chain.models.deepseek_v41 import DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM.from_pretrained(written, chain=False)
    _, t = load_state_dict(written)
    assert model.config == tiny and not model.chain and not model.layers[0].attn.chain
    assert torch.equal(model.layers[0].attn.attn_sink, t["layers.0.attn.attn_sink"])


def test_reload_keeps_storage_and_rejects_bad_names(written, tiny):
    from fp8chain.models.deepseek_v41 import DeepseekV41ForCausalLM

    config, it = load_checkpoint(written)
    model = DeepseekV41ForCausalLM(config)
    model.load_weights(it)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    ptrs.update({n: b.data_ptr() for n, b in model.named_buffers()})
    other = dict(random_checkpoint_tensors(tiny, seed=99))
    model.load_weights(other.items())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == {n: ptrs[n] for n, _ in model.named_parameters()}
    assert all(b.data_ptr() == ptrs[n] for n, b in model.named_buffers())
    assert torch.equal(model.embed.weight, other["embed.weight"])
    with pytest.raises(KeyError):
        model.load_weights([("layers.0.attn.nonsense.weight", torch.zeros(1))])
    partial = [(n, t) for n, t in other.items() if n != "layers.1.attn.wkv.weight"]
    with pytest.raises(ValueError):
        model.load_weights(partial)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_writer_refuses_a_shard_size_before_creating_anything(tmp_path, tiny, bad):
    with pytest.raises(ValueError, match="layers_per_shard must be a positive int"):
        write_random_checkpoint(tmp_path / "ckpt", tiny, layers_per_shard=bad)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("layers_per_shard", [1, 2, 4])
def test_writer_places_layers_in_shards_and_holds_one_shard_at_a_time(tmp_path, monkeypatch, layers_per_shard):
    """Each shard file holds its layers (the embedding with the first, the final norm and head
    with the last), the index says so, and a shard is written before the next one's tensors are
    generated: at most one shard's tensors are held."""
    import safetensors.torch

    from fp8chain.models import checkpoint

    config = DeepseekV41Config.tiny(num_hidden_layers=3)
    generated, saved = [0], []
    real_tensors, real_save = checkpoint.random_checkpoint_tensors, safetensors.torch.save_file

    def counting_tensors(*args, **kwargs):
        for item in real_tensors(*args, **kwargs):
            generated[0] += 1
            yield item

    def recording_save(tensors, fname, **kwargs):
        saved.append(len(tensors))
        # the tensor that opened the next shard may already be generated, nothing past it
        assert generated[0] <= sum(saved) + 1, (generated[0], saved)
        real_save(tensors, fname, **kwargs)

    monkeypatch.setattr(checkpoint, "random_checkpoint_tensors", counting_tensors)
    monkeypatch.setattr(safetensors.torch, "save_file", recording_save)
    path = write_random_checkpoint(tmp_path / "ckpt", config, seed=3, layers_per_shard=layers_per_shard)
    shards = -(-3 // layers_per_shard)
    assert len(saved) == shards and sum(saved) == generated[0] == len(checkpoint_layout(config))
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    names = lambda s: f"model-{s + 1:05d}-of-{shards:05d}.safetensors"  # noqa: E731
    for name, fname in weight_map.items():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else (0 if name == "embed.weight" else 2)
        assert fname == names(layer // layers_per_shard), name
    with safetensors.safe_open(str(path / names(shards - 1)), "pt") as f:
        assert {"norm.weight", "head.weight", "layers.2.attn_norm.weight"} <= set(f.keys())
    _, tensors = load_checkpoint(path)
    expected = dict(real_tensors(config, seed=3))
    for name, t in tensors:
        assert torch.equal(t.view(torch.uint8), expected.pop(name).view(torch.uint8)), name
    assert not expected


def test_a_rewrite_replaces_the_checkpoint_and_an_interrupted_one_leaves_none(tmp_path, monkeypatch):
    """Writing into a checkpoint's directory replaces it (no shard of the old one stays beside the
    new ones), and a write that stops part-way leaves no index and no config.json: loading that
    directory fails instead of reading two seeds' shards as one checkpoint."""
    import safetensors.torch

    from fp8chain.models.deepseek_v41 import DeepseekV41ForCausalLM

    config = DeepseekV41Config.tiny(num_hidden_layers=2)
    path = write_random_checkpoint(tmp_path / "ckpt", config, seed=7, layers_per_shard=1)
    write_random_checkpoint(path, config, seed=9, layers_per_shard=2)
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    _, tensors = load_checkpoint(path)
    got, want = dict(tensors), dict(random_checkpoint_tensors(config, seed=9))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)) for name, t in want.items())
    real_save, saved = safetensors.torch.save_file, []

    def failing_second_shard(tensors, fname, **kwargs):
        if saved:
            raise OSError("disk full (test)")
        saved.append(fname)
        real_save(tensors, fname, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_second_shard)
    with pytest.raises(OSError, match="disk full"):
        write_random_checkpoint(path, config, seed=11, layers_per_shard=1)
    assert not (path / INDEX_FILE).exists() and not (path / "config.json").exists()
    with pytest.raises(FileNotFoundError, match="config.json"):
        DeepseekV41ForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="a checkpoint is a directory .* not a file; pass"):
        DeepseekV41ForCausalLM.from_pretrained(path / "model-00001-of-00002.safetensors")


def test_load_writes_each_fp8_linear_as_its_tensors_stream_in(tiny):
    """No second copy of the checkpoint is held: by the time the next layer's first tensor arrives,
    the layer before has every FP8 linear written (the fused wqkv_a and gate_up once both halves
    are in), and a reload's new values reach the linears too."""
    from fp8chain.models.deepseek_v41 import DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM(tiny)
    model.load_weights(random_checkpoint_tensors(tiny, seed=1))
    tensors = dict(random_checkpoint_tensors(tiny, seed=2))
    layer = model.layers[0]
    linears = {"attn.wq_b": tensors["layers.0.attn.wq_b.weight"], "attn.wo_b": tensors["layers.0.attn.wo_b.weight"],
               "attn.wqkv_a": torch.cat([tensors["layers.0.attn.wq_a.weight"], tensors["layers.0.attn.wkv.weight"]]),
               "ffn.shared_experts.gate_up": torch.cat([tensors["layers.0.ffn.shared_experts.w1.weight"],
                                                        tensors["layers.0.ffn.shared_experts.w3.weight"]]),
               "ffn.shared_experts.down": tensors["layers.0.ffn.shared_experts.w2.weight"]}
    checked = []

    def stream():
        for name, tensor in tensors.items():
            if name.startswith("layers.1.") and not checked:
                for path, want in linears.items():
                    got = layer.get_submodule(path).weight
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), path
                checked.append(name)
            yield name, tensor

    model.load_weights(stream())
    assert checked


def test_a_load_that_fails_part_way_leaves_the_model_refusing_to_run():
    """A failed load that had already copied tensors in (here: all but the head) leaves parameters
    of two checkpoints: forward and the engine refuse until a load succeeds. A load refused before
    its first write (an unknown first name) leaves the model as it was."""
    from fp8chain.models.deepseek_v41 import DeepseekV41ForCausalLM
    from fp8chain.runtime.engine import Engine

    config = DeepseekV41Config.tiny(num_hidden_layers=1)
    first = dict(random_checkpoint_tensors(config, seed=1))
    model = DeepseekV41ForCausalLM(config)
    model.load_weights(first.items())
    engine = Engine(model, max_batch=1, max_len=8)
    before = engine.prefill([[1, 2, 3]])

    with pytest.raises(KeyError):
        model.load_weights([("nonsense.weight", torch.zeros(1)), *first.items()])
    assert model.weights_error is None and torch.equal(engine.prefill([[1, 2, 3]]), before)

    second = [(n, t) for n, t in random_checkpoint_tensors(config, seed=2) if n != "head.weight"]
    with pytest.raises(ValueError, match="missing 1 tensors"):
        model.load_weights(second)
    for run in (lambda: engine.prefill([[1, 2, 3]]), lambda: engine.generate([[1, 2]], 2),
                lambda: engine.decode(torch.tensor([1]), torch.tensor([3])),
                lambda: model(torch.tensor([1]), torch.tensor([0]), torch.tensor([0]),
                              model.make_kv_cache(1, 8))):
        with pytest.raises(RuntimeError, match="parts of two checkpoints"):
            run()

    model.load_weights(first.items())
    assert model.weights_error is None and torch.equal(engine.prefill([[1, 2, 3]]), before)


def _copy_checkpoint(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _shards(path):
    return json.loads((path / INDEX_FILE).read_text())["weight_map"]


def test_loader_refuses_a_tensor_in_the_wrong_shard_or_in_two(written, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy_checkpoint(written, tmp_path / "moved")
    weight_map = _shards(path)
    files = sorted(set(weight_map.values()))
    name = next(n for n, f in weight_map.items() if f == files[0])
    first, second = load_file(path / files[0]), load_file(path / files[1])
    save_file({**second, name: torch.zeros_like(first[name])}, path / files[1])  # in two shards
    with pytest.raises(ValueError, match=f"{name}.*index maps to|{name} is in both"):
        dict(load_checkpoint(path)[1])
    del first[name]
    save_file(first, path / files[0])  # now only in the shard the index does not name
    with pytest.raises(ValueError, match=f"holds {name}, which the index maps to"):
        dict(load_checkpoint(path)[1])


def test_loader_refuses_an_index_entry_no_shard_holds(written, tmp_path):
    """A truncated shard (a tensor the index maps to it is gone) or a stale index naming a tensor
    no shard holds: the loader says so after reading the shards, rather than loading less."""
    from safetensors.torch import load_file, save_file

    path = _copy_checkpoint(written, tmp_path / "truncated")
    weight_map = _shards(path)
    name, fname = next(iter(sorted(weight_map.items())))
    shard = load_file(path / fname)
    del shard[name]
    save_file(shard, path / fname)
    with pytest.raises(ValueError, match=f"1 tensors of the index are in no shard \\(first: {name}"):
        dict(load_checkpoint(path)[1])
    path = _copy_checkpoint(written, tmp_path / "stale")
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"]["layers.0.attn.indexer.wq_b.weight"] = fname
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="in no shard \\(first: layers.0.attn.indexer.wq_b.weight"):
        dict(load_checkpoint(path)[1])


def test_a_checkpoint_missing_a_shard_fails_before_a_live_model_is_touched(written, tmp_path):
    """Every shard's header is read before the first tensor: reloading a live model from a
    checkpoint whose last shard is gone (or unreadable) raises before anything is written, so the
    model keeps serving its weights."""
    from fp8chain.models.deepseek_v41 import DeepseekV41ForCausalLM
    from fp8chain.runtime.engine import Engine

    model = DeepseekV41ForCausalLM.from_pretrained(written)
    engine = Engine(model, max_batch=1, max_len=8)
    before = engine.prefill([[1, 2, 3]])
    path = _copy_checkpoint(written, tmp_path / "gone")
    last = sorted(set(_shards(path).values()))[-1]
    (path / last).unlink()
    with pytest.raises(FileNotFoundError, match=f"{last}: the index names this shard"):
        model.load_weights(load_checkpoint(path)[1])
    (path / last).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=f"{last}: cannot read the shard"):
        model.load_weights(load_checkpoint(path)[1])
    assert model.weights_error is None and torch.equal(engine.prefill([[1, 2, 3]]), before)


def _rewrite_last_shard(src, dst, edit):
    """A copy of checkpoint ``src`` at ``dst`` whose last shard's tensors went through ``edit``
    (a dict -> dict in place), the index following the names."""
    from safetensors.torch import load_file, save_file

    path = _copy_checkpoint(src, dst)
    index = json.loads((path / INDEX_FILE).read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    tensors = load_file(path / last)
    edit(tensors)
    save_file(tensors, path / last)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != last}
    index["weight_map"].update({n: last for n in tensors})
    (path / INDEX_FILE).write_text(json.dumps(index))
    return path


def _misshape(name):
    def edit(tensors):
        tensors[name] = tensors[name][..., :-2].contiguous()
    return edit


def _to_float(name):
    def edit(tensors):
        tensors[name] = tensors[name].float()
    return edit


def _as_bytes(name):
    def edit(tensors):
        tensors[name] = tensors[name].view(torch.uint8)
    return edit


def _drop(name):
    def edit(tensors):
        del tensors[name]
    return edit


def _add_unknown(tensors):
    tensors["layers.1.attn.indexer.wq_b.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)


def _alias_twice(tensors):
    scale = "layers.1.attn.wq_b.weight_scale_inv"
    tensors["layers.1.attn.wq_b.scale"] = tensors[scale].clone()


@pytest.mark.parametrize("edit,error,match", [
    (_misshape("head.weight"), ValueError, "head.weight: checkpoint shape"),
    (_to_float("layers.1.ffn.shared_experts.w2.weight"), TypeError, "shared_experts.w2.weight: fp8 tensors"),
    (_as_bytes("layers.1.attn.wq_b.weight"), TypeError, "wq_b.weight: fp8 tensors"),
    (_drop("layers.1.ffn.experts.3.w1.scale"), ValueError, "lacks 1 tensors of its layout \\(first: layers.1.ffn.experts.3.w1.scale"),
    (_add_unknown, KeyError, "unexpected checkpoint tensor 'layers.1.attn.indexer.wq_b.weight'"),
    (_alias_twice, ValueError, "layers.1.attn.wq_b.weight_scale_inv' given twice"),
], ids=["shape", "dtype", "bytes", "missing", "unknown", "twice"])
def test_reload_of_a_bad_checkpoint_fails_on_its_headers_before_a_write(written, tmp_path, edit, error, match):
    """A tensor of the wrong shape or element type, missing, unknown or given twice in the last
    shard: ``load_checkpoint`` refuses it from the headers, before the iterator yields the first
    tensor, so a live model being reloaded keeps serving its weights (without the header check
    the load fails at that tensor, after every earlier one was written)."""
    from fp8chain.models.deepseek_v41 import DeepseekV41ForCausalLM
    from fp8chain.runtime.engine import Engine

    model = DeepseekV41ForCausalLM.from_pretrained(written)
    engine = Engine(model, max_batch=1, max_len=8)
    before = engine.prefill([[1, 2, 3]])
    path = _rewrite_last_shard(written, tmp_path / "bad", edit)
    for config in (None, model.config):
        with pytest.raises(error, match=match):
            model.load_weights(load_checkpoint(path, config=config)[1])
    assert model.weights_error is None and torch.equal(engine.prefill([[1, 2, 3]]), before)


def test_reload_refuses_a_checkpoint_of_another_model(written, tmp_path, tiny):
    """Reloading a live model checks the checkpoint's ``config.json`` against the model's config
    (given as ``config``) and its headers against the model's layout."""
    path = _copy_checkpoint(written, tmp_path / "other")
    config = json.loads((path / "config.json").read_text())
    config["rope_theta"] = 5e5
    config["transformers_version"] = "4.57.0"  # a key the model does not read may differ
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="describes another model \\(1 fields differ: rope_theta: 500000.0 "
                                         "in the checkpoint, 10000.0 given"):
        load_checkpoint(path, config=tiny)
    assert load_checkpoint(path)[0].rope_theta == 5e5
    assert load_checkpoint(written, config=tiny)[0] == tiny
    config["rope_theta"] = tiny.rope_theta
    (path / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(path, config=tiny)[0].extra == {"transformers_version": "4.57.0"}


def test_loader_names_a_corrupt_index_or_shard(written, tmp_path):
    path = _copy_checkpoint(written, tmp_path / "corrupt")
    config = (path / "config.json").read_text()
    for text, match in ((config[: len(config) // 2], "config.json: not a JSON file"),
                        ("[1, 2]", "config.json: a config.json holds a JSON object, got a list")):
        (path / "config.json").write_text(text)
        with pytest.raises(ValueError, match=match):
            load_checkpoint(path)
    (path / "config.json").write_text(config)
    index = (path / INDEX_FILE).read_text()
    (path / INDEX_FILE).write_text(index[: len(index) // 2])
    with pytest.raises(ValueError, match=INDEX_FILE):
        load_checkpoint(path)
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="weight_map"):
        load_checkpoint(path)
    for shard in (3, None, ""):
        (path / INDEX_FILE).write_text(json.dumps({"weight_map": {**_shards(written), "embed.weight": shard}}))
        with pytest.raises(ValueError, match="not a shard file name"):
            load_checkpoint(path)
    (path / INDEX_FILE).write_text(index)
    shard = sorted(set(_shards(path).values()))[0]
    (path / shard).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=shard):
        dict(load_checkpoint(path)[1])


@pytest.mark.parametrize("name,bad,error,match", [
    ("layers.0.attn.wq_a.weight", lambda t: t[:, :-32], ValueError, "shape"),  # a fused part
    ("layers.0.attn.wkv.weight", lambda t: t.float(), TypeError, "fp8 tensor"),
    ("layers.0.attn.wo_a.weight", lambda t: t.float(), TypeError, "fp8 tensor"),
    ("layers.0.attn.wq_a.weight_scale_inv", lambda t: t[:-1], ValueError, "shape"),
    ("layers.0.ffn.experts.1.w2.scale", lambda t: t.view(torch.float8_e4m3fn), TypeError, "mxfp4_scale"),
    ("layers.0.ffn.shared_experts.w1.weight", lambda t: t.tolist(), TypeError, "expected a tensor"),
])
def test_load_weights_checks_every_tensor_against_the_layout(tiny, name, bad, error, match):
    from fp8chain.models.deepseek_v41 import DeepseekV41ForCausalLM

    tensors = dict(random_checkpoint_tensors(tiny, seed=3))
    tensors[name] = bad(tensors[name])
    with pytest.raises(error, match=match):
        DeepseekV41ForCausalLM(tiny).load_weights(tensors.items())


def test_load_weights_refuses_a_tensor_given_twice(tiny):
    from fp8chain.models.deepseek_v41 import DeepseekV41ForCausalLM

    items = list(random_checkpoint_tensors(tiny, seed=3))
    scale = "layers.0.attn.wq_b.weight_scale_inv"
    items.append(("layers.0.attn.wq_b.scale", dict(items)[scale]))
    with pytest.raises(ValueError, match="given twice"):
        DeepseekV41ForCausalLM(tiny).load_weights(items)


def test_dense_scale_alias_reads_as_weight_scale_inv(tiny):
    """``<x>.scale`` for a dense weight's block scales: the model and the fp32 reference both read it
    as ``<x>.weight_scale_inv`` (an expert's ``.scale`` stays an MXFP4 scale), and refuse both names."""
    from fp8chain.models.deepseek_v41 import DeepseekV41ForCausalLM, DeepseekV41Reference

    canonical = dict(random_checkpoint_tensors(tiny, seed=5))
    aliased = {(name[: -len("weight_scale_inv")] + "scale" if name.endswith(".weight_scale_inv") else name): t
               for name, t in canonical.items()}
    assert sum(name.endswith(".weight_scale_inv") for name in aliased) == 0
    models = []
    for tensors in (canonical, aliased):
        model = DeepseekV41ForCausalLM(tiny)
        model.load_weights(tensors.items())
        models.append(model.state_dict())
    assert models[0].keys() == models[1].keys()
    for key in models[0]:
        assert torch.equal(models[0][key], models[1][key]), key

    want, got = DeepseekV41Reference(tiny, canonical).w, DeepseekV41Reference(tiny, aliased).w
    assert want.keys() == got.keys()
    for key in want:
        assert torch.equal(want[key], got[key]), key
    twice = dict(canonical, **{"layers.0.attn.wq_b.scale": canonical["layers.0.attn.wq_b.weight_scale_inv"]})
    with pytest.raises(ValueError, match="given twice"):
        DeepseekV41Reference(tiny, twice)


def test_quantize_fp8_blockwise_defaults_to_dsv41_blocks_and_scales_a_zero_block():
    """32 x 32 blocks by default (DSv4.1), and an all-zero block gets a positive finite scale (its
    amax floor), not one the loader refuses."""
    assert quantize_fp8_blockwise(torch.randn(64, 64))[1].shape == (2, 2)
    w = torch.randn(64, 64)
    w[:32, 32:] = 0
    data, scale = quantize_fp8_blockwise(w)
    assert (scale > 0).all() and torch.isfinite(scale).all()
    assert not data[:32, 32:].float().any() and data[32:].float().any()


def test_loader_without_an_index_refuses_a_name_in_two_shards(written, tmp_path):
    """Without an index the shards are read in name order: a tensor in two of them is refused from
    the headers (``load_state_dict`` would keep the last copy, a reload write both)."""
    from safetensors.torch import load_file, save_file

    path = _copy_checkpoint(written, tmp_path / "noindex")
    (path / INDEX_FILE).unlink()
    first, second = sorted(path.glob("*.safetensors"))[:2]
    tensors = load_file(second)
    tensors["embed.weight"] = load_file(first)["embed.weight"]
    save_file(tensors, second)
    with pytest.raises(ValueError, match="embed.weight is in both"):
        load_checkpoint(path)


def test_mxfp4_encoding_rounds_ties_to_the_smaller_magnitude():
    """Values halfway between two e2m1 codes take the smaller magnitude (the documented rounding)."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = torch.tensor([6.0] + mids + [-m for m in mids] + [0.0] * 17)
    packed, scale = quantize_mxfp4(row[None])
    assert int(scale[0, 0]) == 127
    want = [6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    want = torch.tensor(want + [-w for w in want[1:]] + [0.0] * 17)
    assert torch.equal(dequantize_mxfp4(packed, scale)[0].abs(), want.abs())


def test_tensor_spec_of_an_element_type_torch_cannot_name_checks_the_shape_only():
    """dtype=None (a safetensors type without a torch name) passes the type check; shape still checked."""
    layout = checkpoint_layout(DeepseekV41Config.tiny(num_hidden_layers=1))
    name = "layers.0.attn.wq_b.weight"
    spec = layout[name]
    check_tensor_spec(name, spec.shape, None, spec)
    with pytest.raises(ValueError, match="checkpoint shape"):
        check_tensor_spec(name, (spec.shape[0], spec.shape[1] - 32), None, spec)


def test_mxfp4_encoding_of_zero_groups_and_k_not_a_multiple_of_32():
    """An all-zero group gets a valid (non-NaN) scale byte and decodes to zeros; K not a multiple
    of the 32-element group is a ValueError."""
    w = torch.randn(3, 64)
    w[1] = 0.0
    w[2, 32:] = 0.0
    packed, scale = quantize_mxfp4(w)
    assert (scale != 255).all()
    got = dequantize_mxfp4(packed, scale)
    assert not got[1].any() and not got[2, 32:].any()
    with pytest.raises(ValueError, match="K % 32 == 0"):
        quantize_mxfp4(torch.randn(2, 48))
