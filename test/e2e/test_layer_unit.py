"""The layer benchmark's timed unit (attention + shared expert + mHC boundaries) computes the
same bits with the chain on and off, and the chained unit writes the next layer's pair."""

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

from helpers import TorchWithGpu, assert_unit_chain_on_equals_off

pytestmark = pytest.mark.cpu


def _layer_benchmark():
    path = Path(__file__).resolve().parents[2] / "benchmark" / "layer.py"
    spec = importlib.util.spec_from_file_location("layer_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tp4_unit_holds_one_ranks_shards():
    """The TP4 unit's FP8 linears are one TP4 rank's shards, the GEMM table's TP4 problems (the
    shared expert included: SGLang shards it over the TP group), and TP1's are the TP1 linears."""
    from fp8chain_kernel import gemm

    bench = _layer_benchmark()
    for shapes, want in (("tp1", gemm.DSV41_TP1_LINEARS), ("tp4", gemm.DSV41_TP4_SHARDS)):
        linears = bench.layer_config(shapes).fp8_linear_shapes()
        (gate, k), (up, _) = linears["ffn.shared_experts.w1"], linears["ffn.shared_experts.w3"]
        held = {"wq_b": linears["attn.wq_b"], "wo_b": linears["attn.wo_b"], "gate_up": (gate + up, k),
                "down": linears["ffn.shared_experts.w2"]}
        if shapes == "tp1":  # wqkv_a is replicated: only TP1 lists it
            held["wqkv_a"] = (linears["attn.wq_a"][0] + linears["attn.wkv"][0], linears["attn.wq_a"][1])
        suffix = "_tp4" if shapes == "tp4" else ""
        assert {name + suffix: shape for name, shape in held.items()} == want


@pytest.mark.parametrize("shapes,rows,prefill", [("tp1", 1, False), ("tp4", 3, False), ("tp1", 6, True)])
def test_unit_chain_on_equals_off(shapes, rows, prefill):
    bench = _layer_benchmark()
    config = bench.layer_config(shapes, tiny=True)
    layer = bench.build_layer(config, "cpu")
    assert_unit_chain_on_equals_off(bench.LayerUnit([layer], config, rows, 16, "cpu", prefill=prefill))
    assert bench.weight_bytes(layer) > 0


def test_unit_steps_take_the_weight_copies_in_turn():
    """Successive steps read successive copies of the layer (a TP4 rank's weights would stay in
    L2 from one step to the next otherwise); copies built from one seed give the same step."""
    bench = _layer_benchmark()
    config = bench.layer_config("tp1", tiny=True)
    copies = []
    for _ in range(2):
        torch.manual_seed(0)
        copies.append(bench.build_layer(config, "cpu"))
    unit = bench.LayerUnit(copies, config, 2, 16, "cpu")
    assert unit.layer is copies[0]
    seen = []  # which copy each step reads: its wqkv_a's forward
    hooks = [layer.attn.wqkv_a.register_forward_pre_hook(lambda module, args, i=i: seen.append(i))
             for i, layer in enumerate(copies)]
    with torch.no_grad():
        for _ in range(3):
            unit.step()
        unit.step.reset()  # a graph's capture starts on the first copy again
        unit.step()
    for hook in hooks:
        hook.remove()
    assert seen == [0, 1, 0, 0] and unit.step.period == 2
    assert_unit_chain_on_equals_off(unit)  # copy 1 chained, copy 0 unchained


def test_weight_copies_stream_past_l2():
    """One copy of the TP1 unit (200 MB of weights), three of the TP4 one (60 MB), counted on
    modules without storage."""
    from fp8chain.layers.quantization.fp8 import Fp8Config
    from fp8chain.models.deepseek_v41 import DeepseekV41DecoderLayer

    bench = _layer_benchmark()
    for shapes, copies in (("tp1", 1), ("tp4", 3)):
        config = bench.layer_config(shapes)
        with torch.device("meta"):
            layer = DeepseekV41DecoderLayer(config, 0, Fp8Config.from_config(config.quantization_config))
        assert bench.weight_copies(layer) == copies, shapes


def test_routed_config_keeps_the_presets_experts():
    """The routed-experts timing runs Flash's 256 experts, top 6; a TP4 rank holds every expert at a
    quarter of the intermediate (as the shared expert); the timed unit's layer keeps 8, top 2."""
    bench = _layer_benchmark()
    for shapes, inter in (("tp1", 2304), ("tp4", 576)):
        routed, unit = bench.layer_config(shapes, routed=True), bench.layer_config(shapes)
        assert (routed.n_routed_experts, routed.num_experts_per_tok, routed.moe_intermediate_size) == (256, 6, inter)
        assert (unit.n_routed_experts, unit.num_experts_per_tok, unit.moe_intermediate_size) == (8, 2, inter)
        assert routed.num_attention_heads == unit.num_attention_heads


@pytest.mark.parametrize("rows", [1, 3])
def test_routed_experts_step_and_serving_bytes(rows):
    """The routed step is the model's MoE without the shared expert, on processed checkpoint-format
    weights; its floor counts the router and the MXFP4 bytes of exactly the experts routed to."""
    from fp8chain.layers.moe import dequantize_mxfp4

    bench = _layer_benchmark()
    config = bench.layer_config("tp1", tiny=True, routed=True)
    torch.manual_seed(rows)
    routed = bench.RoutedExperts(config, "cpu")
    experts = routed.experts
    assert torch.equal(experts.w2_dequant, dequantize_mxfp4(experts.w2_weight, experts.w2_scale, torch.bfloat16))
    x = torch.randn(rows, config.hidden_size).bfloat16()
    with torch.no_grad():
        out = routed.step(x)
        idx, weights = routed.gate(x)
    assert out.shape == (rows, config.hidden_size) and torch.isfinite(out).all() and out.abs().sum() > 0
    assert torch.equal(out, experts(x, idx, weights))
    h, i = config.hidden_size, config.moe_intermediate_size
    per_expert = 2 * i * h // 2 + 2 * i * h // 32 + h * i // 2 + h * i // 32  # e2m1 pairs + UE8M0 per 32
    touched = len(set(idx.flatten().tolist()))
    assert routed.serving_bytes(x) == (touched, config.n_routed_experts * h * 2 + touched * per_expert)
    assert 1 <= touched <= min(config.n_routed_experts, rows * config.num_experts_per_tok)


def test_unit_stats_split_cap():
    """``HyperConnection.max_stats_splits`` reaches the stats launch (its fp32 bits change with the
    split count), and at a shared cap the chained and unchained steps stay bitwise equal (the
    layer benchmark's ``*_best_stats`` arms)."""
    bench = _layer_benchmark()
    config = bench.layer_config("tp1", tiny=True)
    layer = bench.build_layer(config, "cpu")
    unit = bench.LayerUnit([layer], config, 2, 16, "cpu")
    kv_before = unit.kv_cache.clone()

    def step(on):
        unit.kv_cache.copy_(kv_before)
        unit.set_chain(on)
        return unit.step()

    with torch.no_grad():
        default = layer.hc_attn.stats(unit.residual)
        layer.hc_attn.max_stats_splits = layer.hc_ffn.max_stats_splits = 1
        capped = layer.hc_attn.stats(unit.residual)
        on, off = step(True), step(False)
    assert not all(torch.equal(a, b) for a, b in zip(default, capped))
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])


def test_prefill_unit_is_causal():
    """Prefill: one sequence, token t at position t; the step writes every token's key, and a
    token's attention output does not depend on later tokens."""
    bench = _layer_benchmark()
    config = bench.layer_config("tp1", tiny=True)
    layer = bench.build_layer(config, "cpu")
    unit = bench.LayerUnit([layer], config, 5, 16, "cpu", prefill=True)
    assert unit.positions.tolist() == [0, 1, 2, 3, 4] and unit.slots.tolist() == [0] * 5
    assert tuple(unit.kv_cache.shape) == (1, 5, config.head_dim)
    with torch.no_grad():
        unit.set_chain(True)
        kv_before = unit.kv_cache.clone()
        _, x_all, _ = unit.step()
        assert not torch.equal(unit.kv_cache, kv_before)  # the step wrote the keys of its tokens
        unit.kv_cache.copy_(kv_before)
        unit.x[4] = torch.randn_like(unit.x[4])  # change the last token only
        unit.set_chain(True)
        _, x_changed, _ = unit.step()
    assert torch.equal(x_all[:4], x_changed[:4])
    assert not torch.equal(x_all[4], x_changed[4])


def test_precomputed_stats_arm_freezes_the_mixes_and_restores_them():
    """The no-stats diagnostic arm: inside the context both sublayers reuse mixes computed once
    (the attention sublayer's are exactly the step's own); afterwards the stats run again."""
    bench = _layer_benchmark()
    config = bench.layer_config("tp1", tiny=True)
    layer = bench.build_layer(config, "cpu")
    unit = bench.LayerUnit([layer], config, 3, 16, "cpu")
    with torch.no_grad():
        kv_before = unit.kv_cache.clone()
        want = unit.step()
        with bench.precomputed_stats([layer], unit.residual):
            frozen = layer.hc_attn.stats(torch.randn_like(unit.residual))
            assert all(torch.equal(a, b) for a, b in zip(frozen, layer.hc_attn.__class__.stats(
                layer.hc_attn, unit.residual)))
            unit.kv_cache.copy_(kv_before)
            residual, x, _ = unit.step()
            assert torch.isfinite(x.float()).all()
        assert "stats" not in vars(layer.hc_attn) and "stats" not in vars(layer.hc_ffn)
        unit.kv_cache.copy_(kv_before)
        again = unit.step()
    assert all(torch.equal(a, b) for a, b in zip(want[:2], again[:2]))


def test_no_quantize_arm_quantizes_once_per_shape_and_restores(monkeypatch):
    """The unchained_no_quantize diagnostic arm: inside the context the unchained step's FP8
    linears quantize on their first call only (one pair per input shape, made before any graph is
    captured), later steps launch no quantize; afterwards every call quantizes again."""
    bench = _layer_benchmark()
    config = bench.layer_config("tp1", tiny=True)
    layer = bench.build_layer(config, "cpu")
    unit = bench.LayerUnit([layer], config, 3, 16, "cpu")
    unit.set_chain(False)
    calls = []
    real = bench.quant.quantize
    monkeypatch.setattr(bench.quant, "quantize", lambda x, fmt, out=None: calls.append(tuple(x.shape)) or real(x, fmt, out))
    monkeypatch.setattr(bench.fp8_method, "quantize", bench.quant.quantize)
    with torch.no_grad():
        with bench.quantize_launches_removed():
            unit.step()
            first = list(calls)
            unit.step()
            assert calls == first
        # one pair per distinct input shape of the five FP8 linears (wqkv_a and gate_up share one)
        widths = {config.hidden_size, config.q_lora_rank, layer.attn.wo_b.weight.shape[1],
                  layer.ffn.shared_experts.down.weight.shape[1]}
        assert sorted(first) == sorted((3, w) for w in widths)
        assert bench.fp8_method.quantize is bench.quant.quantize
        unit.step()
    assert len(calls) == len(first) + 5
    x = torch.randn(3, config.hidden_size).bfloat16()
    with bench.quantize_launches_removed(), pytest.raises(TypeError, match="out= pair is not supported"):
        bench.fp8_method.quantize(x, layer.attn.wqkv_a.input_format, out=bench.quant.quantize(x, "sm90_g32_fp32_mn"))


def test_kernel_breakdown_lists_the_costliest_kernels_first():
    bench = _layer_benchmark()
    kernels = {"_quantize_kernel": {"launches": 5, "us": 7.5}, "gemm_kernel": {"launches": 2, "us": 30.0},
               "tiny": {"launches": 1, "us": 0.5}}
    line = bench.kernel_breakdown([{"shapes": "tp1", "phase": "decode", "M": 4, "chained_kernels": kernels}], top=2)
    assert line.startswith("- tp1 decode M=4: kernels 38.0 us: gemm_kernel 30.0 (2); _quantize_kernel 7.5 (5)")
    assert "tiny" not in line


def _fork_order(layer, unit) -> list[str]:
    """The order in which the attention sublayer's launches start in one step: wqkv_a, the mHC
    stats of each sublayer (``stats``), the attention core (``attend``)."""
    events = []
    watched = (("wqkv_a", layer.attn.wqkv_a, "forward"), ("attend", layer.attn, "attend"),
               ("stats", layer.hc_attn, "stats"), ("stats", layer.hc_ffn, "stats"))
    for name, module, attr in watched:
        def recorded(*args, _name=name, _call=getattr(module, attr), **kwargs):
            events.append(_name)
            return _call(*args, **kwargs)
        setattr(module, attr, recorded)
    try:
        with torch.no_grad():
            unit.set_chain(True)
            unit.step()
    finally:
        for _, module, attr in watched:
            delattr(module, attr)
    return events


def test_attention_stats_fork_beside_the_core_at_few_tokens():
    """Up to ``stats_beside_core_tokens`` tokens the attention sublayer forks its mHC stats right
    before the attention core, beyond it (and in the ``*_stats_at_start`` arms) before wqkv_a;
    the shared expert forks first. The step's bits do not depend on where the stats fork."""
    bench = _layer_benchmark()
    config = bench.layer_config("tp1", tiny=True)
    layer = bench.build_layer(config, "cpu")
    limit = layer.attn.stats_beside_core_tokens
    assert limit >= 1
    few = bench.LayerUnit([layer], config, limit, 16, "cpu")
    assert _fork_order(layer, few) == ["wqkv_a", "stats", "attend", "stats"]
    many = bench.LayerUnit([layer], config, limit + 1, 16, "cpu")
    assert _fork_order(layer, many) == ["stats", "wqkv_a", "attend", "stats"]
    kv_before = few.kv_cache.clone()
    with torch.no_grad():
        beside_core = few.step()
        few.kv_cache.copy_(kv_before)
        with bench.stats_at_sublayer_start([layer]):
            assert _fork_order(layer, few) == ["stats", "wqkv_a", "attend", "stats"]
            few.kv_cache.copy_(kv_before)
            at_start = few.step()
    assert layer.attn.stats_beside_core_tokens == limit
    assert all(torch.equal(a, b) for a, b in zip(beside_core[:2], at_start[:2]))


def test_stats_in_line_arm_restores_the_side_stream_on_error():
    bench = _layer_benchmark()
    layer = bench.build_layer(bench.layer_config("tp1", tiny=True), "cpu")
    assert layer.overlap_stats
    with pytest.raises(KeyError):
        with bench.stats_in_line([layer]):
            assert not layer.overlap_stats
            raise KeyError("a failing arm")
    assert layer.overlap_stats


@pytest.mark.parametrize("module_name,kernels_attr,kernel,switch", [
    ("fp8chain.models.deepseek_v41", "einsum_kernels", "wo_a_einsum", None),
    ("fp8chain.layers.moe", "act_kernels", "silu_mul", "fuse_silu_mul")])
def test_chained_producer_writes_the_pair_only(monkeypatch, module_name, kernels_attr, kernel, switch):
    """Chained, the wo_a einsum and SiLU*mul (as its own launch) feed only their FP8 consumer
    (wo_b, down): they return the pair alone (no bf16 store); unchained, the bf16 output."""
    import importlib

    from fp8chain_kernel.formats import QuantizedActivation

    bench = _layer_benchmark()
    config = bench.layer_config("tp4", tiny=True)
    layer = bench.build_layer(config, "cpu")
    if switch:
        monkeypatch.setattr(layer.ffn.shared_experts, switch, False)
    unit = bench.LayerUnit([layer], config, 3, 16, "cpu")
    kernels = getattr(importlib.import_module(module_name), kernels_attr)
    producer, results = getattr(kernels, kernel), []
    monkeypatch.setattr(kernels, kernel,
                        lambda *args, **kwargs: results.append(producer(*args, **kwargs)) or results[-1])
    with torch.no_grad():
        for on in (True, False):
            unit.set_chain(on)
            unit.step()
    chained, unchained = results
    assert isinstance(chained, QuantizedActivation)
    assert isinstance(unchained, torch.Tensor) and unchained.dtype == torch.bfloat16
    assert chained.data.shape == unchained.shape


@pytest.mark.cpu
def test_mhc_stats_copy_and_pickle():
    """A sublayer's stats survive copy, deepcopy and pickle as MHCStats with their three parts."""
    import copy
    import pickle

    from fp8chain.layers import mhc

    stats = mhc.MHCStats(torch.rand(3, 4), torch.rand(3, 4), torch.rand(3, 4, 4))
    for twin in (copy.copy(stats), copy.deepcopy(stats), pickle.loads(pickle.dumps(stats))):
        assert type(twin) is mhc.MHCStats
        assert all(torch.equal(a, b) for a, b in zip((twin.pre, twin.post, twin.comb), stats))


def test_weight_bytes_count_the_units_fp8_weights_scales_wo_a_and_mhc():
    """The floor's bytes: the five FP8 linears' e4m3 weights and fp32 block scales, the bf16 wo_a
    and both sublayers' fp32 mHC ``fn`` (a TP4 rank's shards, counted on modules without storage)."""
    from fp8chain.layers.quantization.fp8 import Fp8Config
    from fp8chain.models.deepseek_v41 import DeepseekV41DecoderLayer

    bench = _layer_benchmark()
    config = bench.layer_config("tp4")
    with torch.device("meta"):
        layer = DeepseekV41DecoderLayer(config, 0, Fp8Config.from_config(config.quantization_config))
    shapes, (bn, bk) = config.fp8_linear_shapes(), config.weight_block_size
    linears = [(shapes["attn.wq_a"][0] + shapes["attn.wkv"][0], config.hidden_size), shapes["attn.wq_b"],
               shapes["attn.wo_b"], (2 * shapes["ffn.shared_experts.w1"][0], config.hidden_size),
               shapes["ffn.shared_experts.w2"]]
    want = sum(n * k + -(-n // bn) * -(-k // bk) * 4 for n, k in linears)
    want += config.o_groups * config.o_lora_rank * config.o_group_dim * 2
    hc = config.hc_mult
    want += 2 * (2 + hc) * hc * hc * config.hidden_size * 4
    assert bench.weight_bytes(layer) == want


def _fake_gpu_run(monkeypatch, tmp_path, argv):
    """``benchmark/layer.py``'s ``run`` on the CPU at the tiny config, two weight copies: every
    ``capture_graph`` records the configuration the step is captured in (chain, stale quantize
    pairs, SiLU*mul fusion, mHC stats caps / placement / frozen mixes, PDL) instead of running it,
    ``replay_times_us`` gives each graph a distinct time (the best-stats arms fastest at one known
    pair of caps each), ``kernel_profile`` fake launch counts. Returns ``(bench, meta,
    records, snapshots by time, replay calls, the layer copies)``: which arm a record's figure
    comes from is then checkable."""
    import types

    bench = _layer_benchmark()
    harness, real_quantize = bench.harness, bench.fp8_method.quantize
    units, snapshots, replays, profiled = [], {}, [], []
    tiny = bench.layer_config

    class CpuUnit(bench.LayerUnit):
        def __init__(self, layers, config, rows, context, device, prefill=False):
            super().__init__(layers, config, rows, context, "cpu", prefill=prefill)
            units.append(self)

    def state():
        unit = units[-1]
        layer = unit.layers[0]
        assert all(lay.hc_attn.max_stats_splits == layer.hc_attn.max_stats_splits for lay in unit.layers)
        return dict(chain=unit.chain, stale=bench.fp8_method.quantize is not real_quantize,
                         fused=layer.ffn.shared_experts.fuse_silu_mul,
                         caps=(layer.hc_attn.max_stats_splits, layer.hc_ffn.max_stats_splits),
                         overlap=layer.overlap_stats, at_start=layer.attn.stats_beside_core_tokens == 0,
                         frozen="stats" in vars(layer.hc_attn), pdl=list(bench.launch._override),
                         M=len(unit.positions))

    def capture_graph(fn, iters):
        assert iters % fn.period == 0 and not profiled
        return state()

    def cost(snap):  # the best-stats arms: chained fastest at (32, None), unchained at (None, 32)
        best = (32, None) if snap["chain"] else (None, 32)
        return 100.0 + (0 if snap["chain"] else 10) - (5 if snap["caps"] == best else 0)

    def replay_times_us(graphs, iters, rounds=7):
        assert not profiled  # time first, profile last
        replays.append(list(graphs))
        times = {}
        for key, snap in graphs.items():
            times[key] = cost(snap) + 0.001 * (len(snapshots) + 1)
            snapshots[times[key]] = snap
        return times

    def kernel_profile(fn):
        profiled.append(True)
        snap = state()
        quantizes = 0 if (snap["chain"] or snap["stale"]) else 5
        return {"gemm": {"launches": 7 if snap["chain"] else 9, "us": 3.0},
                "_quantize_kernel": {"launches": quantizes, "us": 1.0}}

    copies = {}

    def build_layers(config, device):
        if "layers" not in copies:
            torch.manual_seed(0)
            copies["layers"] = [bench.build_layer(config, "cpu") for _ in range(2)]
        return copies["layers"]

    monkeypatch.setattr(bench, "torch", TorchWithGpu("torch"))
    monkeypatch.setattr(bench, "launch", types.SimpleNamespace(
        enabled=lambda: True, programmatic_launches=bench.launch.programmatic_launches,
        _override=bench.launch._override))
    monkeypatch.setattr(bench, "layer_config", lambda shapes, routed=False: tiny(shapes, tiny=True, routed=routed))
    monkeypatch.setattr(bench, "build_layers", build_layers)
    monkeypatch.setattr(bench, "LayerUnit", CpuUnit)
    monkeypatch.setattr(bench, "CompiledPeer", lambda layer, config, device: types.SimpleNamespace(
        step=lambda *inputs: None))
    monkeypatch.setattr(harness, "bench_meta", lambda: {"device": "fake"})
    monkeypatch.setattr(harness, "copy_bandwidth", lambda: 2e12)
    monkeypatch.setattr(harness, "capture_graph", capture_graph)
    monkeypatch.setattr(harness, "replay_times_us", replay_times_us)
    monkeypatch.setattr(harness, "graph_time_us", lambda fn, iters=100, repeats=7: 400.0)
    monkeypatch.setattr(harness, "kernel_profile", kernel_profile)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = harness.apply_quick(parser.parse_args(argv))
    args.results_dir = tmp_path
    meta, records = bench.run(args)
    assert bench.fp8_method.quantize is real_quantize and not bench.launch._override
    for layer in copies["layers"]:  # every arm's switch is back where the model keeps it
        assert layer.overlap_stats and layer.ffn.shared_experts.fuse_silu_mul
        assert layer.hc_attn.max_stats_splits is None and layer.hc_ffn.max_stats_splits is None
        assert "stats" not in vars(layer.hc_attn) and layer.attn.stats_beside_core_tokens > 0
    return bench, meta, records, snapshots, replays, copies["layers"]


def test_every_arm_times_the_step_it_names_and_the_ratios_divide_those_times(monkeypatch, tmp_path):
    """Without a GPU: ``run`` with graphs that record the configuration they were captured in.
    Each ``*_us`` of a record comes from a graph of the arm it names (chained / unchained, stale
    pairs, SiLU*mul launch, stats caps / placement / mixes, PDL off), each of those graphs at the
    record's M; the best-stats arms are each arm's fastest caps with the pair (attention, FFN) and
    every pair's time; the arms of a comparison replay in turn; the ratios, the floor and the
    launch counts are the ones the columns name."""
    bench, meta, records, snap, replays, layers = _fake_gpu_run(
        monkeypatch, tmp_path, ["--rows", "2", "--prefill", "3", "--shapes", "tp4", "--context", "16",
                                "--captures", "2", "--no-routed", "--iters", "3"])
    assert [(r["shapes"], r["M"], r["phase"]) for r in records] == [("tp4", 2, "decode"), ("tp4", 3, "prefill")]
    default = dict(stale=False, fused=True, caps=(None, None), overlap=True, at_start=False, frozen=False, pdl=[])
    arms = {"": {}, "_silu_launch": dict(fused=False), "_no_quantize": dict(stale=True),
            "_stats_at_start": dict(at_start=True), "_serial_stats": dict(overlap=False),
            "_no_stats": dict(frozen=True), "_no_pdl": dict(pdl=[False])}
    for r in records:
        for variant, changes in arms.items():
            for arm, chain in (("chained", True), ("unchained", False)):
                key = f"{arm}{variant}_us"
                if variant in ("_silu_launch", "_no_quantize") and (arm == "chained") != (variant == "_silu_launch"):
                    assert key not in r
                    continue
                assert snap[r[key]] == dict(default, chain=chain, M=r["M"], **changes), key
        for arm, chain, best in (("chained", True, [32, None]), ("unchained", False, [None, 32])):
            assert r[f"{arm}_best_stats_splits"] == best
            assert snap[r[f"{arm}_best_stats_us"]] == dict(default, chain=chain, M=r["M"], caps=tuple(best))
            tried = r[f"{arm}_stats_caps_us"]
            assert sorted(tried) == ["32,32", "32,None", "None,32", "None,None"]
            for pair, us in tried.items():
                attention, ffn = (None if c == "None" else int(c) for c in pair.split(","))
                assert snap[us] == dict(default, chain=chain, M=r["M"], caps=(attention, ffn)), pair
            captured = r[f"{arm}_captures_us"]
            assert len(captured) == 2 and captured[0] == r[f"{arm}_us"] and captured[0] < captured[1]
            assert snap[captured[1]] == snap[captured[0]]
        for variant, ratio in (("", "chained_over_unchained"), ("_best_stats", "best_stats_chained_over_unchained"),
                               ("_stats_at_start", "stats_at_start_chained_over_unchained"),
                               ("_serial_stats", "serial_chained_over_unchained"),
                               ("_no_stats", "no_stats_chained_over_unchained")):
            assert r[ratio] == pytest.approx(r[f"chained{variant}_us"] / r[f"unchained{variant}_us"]), ratio
        assert r["no_quantize_over_unchained"] == pytest.approx(r["unchained_no_quantize_us"] / r["unchained_us"])
        assert r["compiled_peer_us"] == 400.0 and r["chained_over_peer"] == pytest.approx(r["chained_us"] / 400.0)
        # the floor: one copy's weight bytes (each step reads one) at the measured bandwidth
        assert r["weight_copies"] == 2
        assert r["floor_us"] == pytest.approx(bench.weight_bytes(layers[0]) / 2e12 * 1e6)
        assert r["chained_over_floor"] == pytest.approx(r["chained_us"] / r["floor_us"])
        assert (r["chained_launches"], r["chained_quantize_launches"]) == (7, 0)
        assert (r["unchained_launches"], r["unchained_quantize_launches"]) == (14, 5)
        assert (r["unchained_no_quantize_launches"], r["unchained_no_quantize_quantize_launches"]) == (9, 0)
    # the arms of each comparison alternate: one replay_times_us per pass, every arm of it in one
    first = replays[0]
    assert {("chained", 0), ("chained", 1), ("unchained", 0), ("unchained", 1), ("chained_silu_launch", 0),
            ("unchained_no_quantize", 0)} == set(first)
    assert len(replays[1]) == 2 * len(bench.STATS_SPLIT_CAPS) ** 2
    assert all(len(keys) >= 2 for keys in replays) and len(replays) == 2 * 6


def test_report_puts_every_arms_time_in_the_table(monkeypatch, tmp_path):
    """The markdown table has a column for each arm's time, the captures' lists beside
    ``chained_us`` / ``unchained_us``, and the row's figures are the record's."""
    bench, meta, records, *_ = _fake_gpu_run(
        monkeypatch, tmp_path, ["--rows", "2", "--prefill", "0", "--shapes", "tp1", "--context", "16",
                                "--captures", "2", "--no-routed", "--no-peer", "--iters", "3"])
    meta["context"] = 16
    header, _, row = bench.report(meta, records, tmp_path).splitlines()[1:4]
    columns = [c.strip() for c in header.strip("|").split("|")]
    cells = dict(zip(columns, (c.strip() for c in row.strip("|").split("|"))))
    assert columns[3:7] == ["chained_us", "unchained_us", "chained_captures_us", "unchained_captures_us"]
    timed = {key for key in records[0]  # every pair's time (a dict) is in the JSON alone
             if key.endswith("_us") and not key.endswith("_stats_caps_us") and not key.startswith("compiled_peer")}
    assert timed <= set(columns)
    for key in timed | {"chained_over_unchained", "no_quantize_over_unchained", "chained_over_floor"}:
        value = records[0][key]
        assert cells[key] == (" / ".join(f"{v:.4g}" for v in value) if isinstance(value, list) else f"{value:.4g}"), key
    assert (tmp_path / "layer.json").exists()


def test_layer_arguments_refuse_what_no_run_can_use():
    bench = _layer_benchmark()
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    for argv in (["--captures", "0"], ["--context", "0"], ["--iters", "0"], ["--rows", "0"], ["--prefill", "-1"],
                 ["--shapes", "tp2"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    args = bench.harness.apply_quick(parser.parse_args(["--quick"]))
    assert (args.rows, args.prefill, args.shapes, args.captures, args.context) == ([1, 16, 64], 0, ["tp1"], 1, 1024)
    args = bench.harness.apply_quick(parser.parse_args([]))
    assert (args.rows, args.prefill, args.shapes) == (bench.ROWS, bench.PREFILL, ["tp1", "tp4"])


def test_only_the_unchained_step_quantizes_and_only_the_chained_boundaries_write_pairs(monkeypatch):
    """What the two arms' launches differ by: the chained step quantizes nothing (each producer
    writes its consumer's pair, both mHC boundaries included), the unchained one quantizes the
    input of each of its five FP8 linears and its boundaries write bf16 alone."""
    bench = _layer_benchmark()
    config = bench.layer_config("tp1", tiny=True)
    layer = bench.build_layer(config, "cpu")
    unit = bench.LayerUnit([layer], config, 2, 16, "cpu")
    quantized, formats = [], []
    real_quantize, real_sublayer = bench.fp8_method.quantize, bench.run_sublayer
    monkeypatch.setattr(bench.fp8_method, "quantize",
                        lambda x, fmt, out=None: quantized.append(tuple(x.shape)) or real_quantize(x, fmt, out))
    monkeypatch.setattr(bench, "run_sublayer",
                        lambda hc, sublayer, residual, norm, fmt, overlap: formats.append(fmt) or real_sublayer(
                            hc, sublayer, residual, norm, fmt, overlap))
    counts = {}
    with torch.no_grad():
        for on in (True, False):
            quantized.clear(), formats.clear()
            unit.set_chain(on)
            unit.step()
            counts[on] = (len(quantized), list(formats))
    pairs = [layer.ffn.shared_experts.gate_up.input_format, layer.attn.wqkv_a.input_format]
    assert all(fmt is not None for fmt in pairs)
    assert counts == {True: (0, pairs), False: (5, [None, None])}
