"""The producers benchmark's launch-shape sweep: its candidates and report (timing needs a GPU)."""

import argparse
import json

import pytest
import torch
import triton

from fp8chain.bench import harness
from fp8chain.cli import _load_benchmark
from fp8chain_kernel import act, einsum, norm
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat, QuantizedActivation
from fp8chain_kernel.reference.norm import add_residual, rms_norm_fp32
from helpers import TorchWithGpu, assert_close_bf16, assert_pairs_equal, poisoned_pair


@pytest.mark.cpu
@pytest.mark.parametrize("name,cols", [("rms_norm", 5120), ("q_norm", 1280), ("silu_mul", 2304)])
@pytest.mark.parametrize("rows", [1, 4, 16, 64, 256, 2048])
def test_launch_candidates_hold_the_rule(name, cols, rows):
    """The sweep times the launch rule's own shape among its candidates, so it can confirm or
    overturn it; every candidate is one ``config=`` accepts."""
    bench = _load_benchmark("producers")
    candidates = bench.launch_candidates(name, rows)
    if name == "silu_mul":
        rule = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps"), act._launch_config(rows, cols)))
        checked = [norm.check_launch_config(c, "BLOCK_N", 128) for c in candidates]
    else:
        rule = dict(zip(("BLOCK_M", "BLOCK_H", "num_warps"), norm._launch_config(rows, cols)))
        checked = [norm.check_launch_config(c, "BLOCK_H", cols) for c in candidates]
    assert rule in candidates
    assert len(set(checked)) == len(candidates) and all(c["BLOCK_M"] <= rows for c in candidates)
    with pytest.raises(ValueError, match="sweep-launch"):
        bench.launch_candidates("wo_a_g8", rows)


@pytest.mark.cpu
def test_sweep_launch_option_and_report(tmp_path):
    bench = _load_benchmark("producers")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["--sweep-launch"]).sweep_launch
    with pytest.raises(SystemExit):  # one sweep per run
        parser.parse_args(["--sweep-launch", "--sweep-wo-a"])
    shape = dict(BLOCK_M=2, BLOCK_N=256, num_warps=4)
    records = [dict(producer="silu_mul", T=16, config="rule", arm="bf16", us=1.6),
               dict(producer="silu_mul", T=16, config="rule", arm="fp8", us=1.8),
               dict(producer="silu_mul", T=16, config=shape, arm="bf16", us=1.1),
               dict(producer="silu_mul", T=16, config=shape, arm="fp8", us=1.2),
               dict(producer="silu_mul", T=16, config=dict(shape, num_warps=8), arm="fp8", us=1.3)]
    assert bench.best_launches(records) == [dict(producer="silu_mul", T=16, rule_bf16_us=1.6, rule_fp8_us=1.8,
                                                 best_bf16_us=1.1, best_bf16_config=shape, best_fp8_us=1.2,
                                                 best_fp8_config=shape)]
    text = bench.report({"date": "today", "sweep": "launch"}, records, tmp_path)
    assert "| silu_mul | 16 | 1.6 | 1.8 | 1.1 |" in text
    assert json.loads((tmp_path / "producers_launch_sweep.json").read_text())["records"] == records
    # a sweep with nothing to time, or --splits without the sweep it narrows, is refused before
    # any GPU work or result file
    for argv, match in ((["--sweep-launch", "--producers", "wo_a_g8"], "names none of"),
                        (["--sweep-wo-a", "--producers", "q_norm"], "names no wo_a producer"),
                        (["--splits", "2"], "--splits narrows the --sweep-wo-a candidates")):
        with pytest.raises(SystemExit, match=match):
            bench.run(parser.parse_args([*argv, "--results-dir", str(tmp_path / "run")]))
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    with pytest.raises(SystemExit):
        parser.parse_args(["--sweep-wo-a", "--splits", "0"])


@pytest.mark.cpu
def test_sweeps_take_one_format():
    bench = _load_benchmark("producers")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    formats = [ActFormat.SM90_G32_FP32_MN.value, ActFormat.SM100_G32_UE8M0_PACKED_MN.value]
    for sweep in ("--sweep-wo-a", "--sweep-launch"):
        with pytest.raises(SystemExit, match="time one format"):
            bench.run(parser.parse_args([sweep, "--formats", *formats]))


@pytest.mark.cpu
@pytest.mark.parametrize("name", ["rms_norm", "q_norm", "silu_mul"])
def test_the_compiled_peer_writes_what_the_fp8_arm_writes(name):
    """The peer returns what the benchmark's FP8 arm writes (RMSNorm: the bf16 x, which DSv4.1's
    router reads, and the pair; q_norm and SiLU*mul: the pair alone), so torch.compile cannot skip
    a store the arm makes; its bf16 output is the arm's within one bf16 ulp (two roundings of fp32
    values computed in another order)."""
    bench = _load_benchmark("producers")
    fmt = ActFormat.SM90_G32_FP32_MN
    case = bench.Case(name, 3, fmt, "cpu")
    inputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in case.peer_arg_sets[0]]  # the arm adds the residual in place
    arm = case.fp8()
    arm_outputs = [arm.data, arm.scale] if isinstance(arm, QuantizedActivation) else [arm[0], arm[1].data, arm[1].scale]
    peer_outputs = bench.peer_function(name, fmt)(*inputs)
    assert len(peer_outputs) == len(arm_outputs) == (3 if name == "rms_norm" else 2)
    assert peer_outputs[-2].shape == arm_outputs[-2].shape and peer_outputs[-2].dtype == arm_outputs[-2].dtype
    if name == "rms_norm":
        assert_close_bf16(peer_outputs[0], arm_outputs[0], ulps=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("name,cols", [("rms_norm", 5120), ("q_norm", 1280), ("silu_mul", 2304)])
@pytest.mark.parametrize("rows", [1, 3, 16, 127, 2048])
def test_every_launch_candidate_keeps_the_contract(name, cols, rows, device):
    """Each shape the sweep may time is a correct producer: its FP8 pair equals
    ``reference.quantize`` of its own bf16 output bit for bit, that output is correctly rounded
    from the fp32 reference (``verify.ROUNDED_FROM_FP32``; SiLU*mul, elementwise: the rule's bytes
    exactly; RMSNorm's warps set the order of the row's sum of squares), and no output element is
    left unwritten. A shape that
    faults or writes wrong bytes fails here, named, before a sweep reports its time."""
    bench = _load_benchmark("producers")
    fmt = ActFormat.SM90_G32_FP32_MN
    if name == "silu_mul":
        gate_up = (4 * torch.randn(rows, 2 * cols, device=device)).bfloat16()
        run = lambda config, **out: act.silu_mul(gate_up, limit=7.0, out_format=fmt, config=config, **out)  # noqa: E731
        exact = run(None)[0]
    else:
        x = torch.randn(rows, cols, device=device).bfloat16()
        weight = (1 + 0.1 * torch.randn(cols, device=device)).bfloat16()
        residual = torch.randn(rows, cols, device=device).bfloat16() if name == "rms_norm" else None
        # a fresh residual each call: rms_norm adds x to it in place
        run = lambda config, **out: norm.rms_norm(  # noqa: E731
            x, weight, 1e-6, residual=None if residual is None else residual.clone(), out_format=fmt,
            config=config, **out)
        h = x if residual is None else add_residual(x, residual)
        want = rms_norm_fp32(h, weight, 1e-6)
    for config in bench.launch_candidates(name, rows):
        y, pair = run(config, out=poisoned_pair(rows, cols, fmt, device),
                      out_bf16=torch.full((rows, cols), float("nan"), device=device, dtype=torch.bfloat16))
        torch.cuda.synchronize(device)
        if name == "silu_mul":
            assert torch.equal(y, exact), config
        else:
            assert_close_bf16(y, want)
        assert_pairs_equal(pair, ref.quantize(y, fmt))


@pytest.mark.cpu
def test_producers_bf16_quant_arm_rereads_the_bf16_output():
    """The unchained arm writes bf16, reads it back to quantize and writes the pair."""
    from fp8chain.cli import _load_benchmark
    from fp8chain_kernel.formats import ActFormat

    bench = _load_benchmark("producers")
    fmt = ActFormat.SM90_G32_FP32_MN
    case = bench.Case("silu_mul", 3, fmt, "cpu")
    bf16_out = 3 * case.cols * 2
    assert case.bytes_bf16 == case.in_bytes + bf16_out
    assert case.bytes_bf16_quant == case.bytes_bf16 + bf16_out + harness.pair_bytes(3, case.cols, fmt)


@pytest.mark.cpu
def test_wo_a_sweep_report_keeps_the_fastest_config(tmp_path):
    from fp8chain.cli import _load_benchmark

    bench = _load_benchmark("producers")
    records = [dict(producer="wo_a_g8", T=1, fp8_us=3.0, floor_us=1.0, config="table"),
               dict(producer="wo_a_g8", T=1, fp8_us=2.0, floor_us=1.0, config={"BLOCK_M": 16}),
               dict(producer="wo_a_g8", T=1, fp8_us=2.5, floor_us=1.0, config={"BLOCK_M": 64})]
    rows = bench.report({"sweep": "wo_a"}, records, tmp_path).splitlines()[3:]
    assert rows == ["| wo_a_g8 | 1 | 2 | 1 | {'BLOCK_M': 16} |"]


def _wo_a_weight_bytes(g, r, d, fp8_weights):
    """One wo_a copy's bytes: bf16 ``[G, R, D]``, or e4m3 with its fp32 32x32 block scales."""
    return g * r * d + g * (r // 32) * (d // 32) * 4 if fp8_weights else g * r * d * 2


@pytest.mark.cpu
@pytest.mark.parametrize("name", ["rms_norm", "q_norm", "silu_mul", "mhc_boundary", "wo_a_g2", "wo_a_g8_fp8w"])
def test_each_arms_floor_counts_the_bytes_it_moves(name, monkeypatch):
    """The bytes behind ``floor_*_us``, per producer: what every arm reads and writes besides its
    output (the residual read and written back, gate_up's two halves, wo_a's weights with their
    scales, the boundary's streams and mixes), the bf16 output, the pair, the bf16 store the FP8
    arm keeps where the model reads bf16 (RMSNorm, the mHC boundary), the einsum's flops."""
    bench = _load_benchmark("producers")
    monkeypatch.setattr(harness, "copies_past_l2", lambda nbytes, most=64: 1)  # one weight copy: no 160 MB
    fmt, t = ActFormat.SM90_G32_FP32_MN, 3
    case = bench.Case(name, t, fmt, "cpu")
    h = {"rms_norm": 5120, "q_norm": 1280, "mhc_boundary": 5120}.get(name)
    if name == "rms_norm":  # x, the weight, the residual read and written back
        want_in, cols = t * h * 2 + h * 2 + 2 * t * h * 2, h
    elif name == "q_norm":
        want_in, cols = t * h * 2 + h * 2, h
    elif name == "silu_mul":  # gate and up
        want_in, cols = t * 2 * 2304 * 2, 2304
    elif name == "mhc_boundary":  # y, the 4 streams read and written, the weight, pre / post / comb in fp32
        want_in, cols = t * h * 2 + 2 * t * 4 * h * 2 + h * 2 + t * (4 + 4 + 16) * 4, h
    else:
        g = 8 if "g8" in name else 2
        weight = _wo_a_weight_bytes(g, 1024, 4096, name.endswith("fp8w"))
        want_in, cols = t * g * 4096 * 2 + weight, g * 1024
        assert case.flops == 2 * t * g * 1024 * 4096
    assert (case.in_bytes, case.cols) == (want_in, cols)
    assert case.fp8_bf16 == (name in ("rms_norm", "mhc_boundary"))
    bf16_out, pair = t * cols * 2, harness.pair_bytes(t, cols, fmt)
    assert case.bytes_bf16 == want_in + bf16_out
    assert case.bytes_fp8 == want_in + pair + (bf16_out if case.fp8_bf16 else 0)
    assert case.bytes_bf16_quant == want_in + 2 * bf16_out + pair


@pytest.mark.cpu
@pytest.mark.parametrize("name", ["q_norm", "silu_mul"])
def test_only_the_unchained_arm_launches_the_standalone_quantize(name, monkeypatch):
    """``bf16_quant`` is the bf16 producer followed by ``quant.quantize`` of the bf16 it wrote
    into its preallocated pair; ``bf16`` and ``fp8`` quantize nothing, ``fp8`` emits the pair."""
    bench = _load_benchmark("producers")
    fmt = ActFormat.SM90_G32_FP32_MN
    case = bench.Case(name, 2, fmt, "cpu")
    real, quantized = bench.quant.quantize, []
    monkeypatch.setattr(bench.quant, "quantize",
                        lambda x, fmt, out=None: quantized.append((x.clone(), out)) or real(x, fmt, out=out))
    y = case.bf16()
    assert not quantized and isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    y_again, pair = case.bf16_quant()
    assert len(quantized) == 1 and torch.equal(quantized[0][0], y_again) and torch.equal(y_again, y)
    assert quantized[0][1] is not None and pair.data.data_ptr() == quantized[0][1].data.data_ptr()
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    fp8 = case.fp8()
    assert len(quantized) == 1 and isinstance(fp8, QuantizedActivation)
    assert_pairs_equal(fp8, ref.quantize(y, fmt))


def _fake_gpu_producers_run(monkeypatch, tmp_path, argv):
    """``benchmark/producers.py``'s ``run`` on the CPU: each Case remembered, a graph is the arm
    it was captured from, its time set by which arm it is (bf16 2 us, bf16 + quantize 3.5 us, FP8
    2.5 us, plus 0.1 us per case), launch counts by arm. Returns ``(records, replay calls, cases)``."""
    bench = _load_benchmark("producers")
    cases, replays = [], []

    class CpuCase(bench.Case):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            cases.append(self)

    def arm_of(fn):
        case = next(c for c in cases if fn in (c.bf16, c.bf16_quant, c.fp8))
        return case, next(arm for arm in ("bf16", "bf16_quant", "fp8") if getattr(case, arm) is fn)

    def replay_times_us(graphs, iters, rounds=7):
        replays.append(sorted(graphs))
        times = {}
        for key, fn in graphs.items():
            case, arm = arm_of(fn)
            times[key] = {"bf16": 2.0, "bf16_quant": 3.5, "fp8": 2.5}[arm] + 0.1 * cases.index(case)
        return times

    monkeypatch.setattr(bench, "torch", TorchWithGpu("torch"))
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "Case", CpuCase)
    monkeypatch.setattr(harness, "copies_past_l2", lambda nbytes, most=64: 1)
    monkeypatch.setattr(harness, "bench_meta", lambda: {"device": "fake"})
    monkeypatch.setattr(harness, "copy_bandwidth", lambda: 2e12)
    monkeypatch.setattr(harness, "bf16_matmul_rate", lambda: 5e14)
    monkeypatch.setattr(harness, "capture_graph", lambda fn, iters: fn)
    monkeypatch.setattr(harness, "replay_times_us", replay_times_us)
    monkeypatch.setattr(harness, "count_launches",
                        lambda fn: {"producer": 1, "_quantize_kernel": int(arm_of(fn)[1] == "bf16_quant")})
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = harness.apply_quick(parser.parse_args([*argv, "--results-dir", str(tmp_path)]))
    return bench.run(args)[1], replays, cases


@pytest.mark.cpu
def test_records_hold_each_arms_time_floor_and_ratio(monkeypatch, tmp_path):
    """Without a GPU: ``run`` with graphs that are the arm they were captured from. Each
    ``*_us`` is its own arm's time, the three arms of a case replay in turn, the floors are the
    case's bytes of that arm at the measured bandwidth, the ratios divide the FP8 arm's time by the
    other arm's, the launches are the FP8 arm's; wo_a adds its flops against the matmul rate."""
    records, replays, cases = _fake_gpu_producers_run(
        monkeypatch, tmp_path, ["--producers", "q_norm", "wo_a_g2", "--rows", "1", "--no-peer"])
    assert [(r["producer"], r["T"]) for r in records] == [("q_norm", 1), ("wo_a_g2", 1)]
    assert replays == [["bf16", "bf16_quant", "fp8"]] * 2
    for index, r in enumerate(records):
        case = cases[index]
        assert (r["bf16_us"], r["bf16_quant_us"], r["fp8_us"]) == pytest.approx((2.0 + 0.1 * index, 3.5 + 0.1 * index,
                                                                                   2.5 + 0.1 * index))
        for arm, nbytes in (("bf16", case.bytes_bf16), ("bf16_quant", case.bytes_bf16_quant), ("fp8", case.bytes_fp8)):
            assert r[f"floor_{arm}_us"] == pytest.approx(nbytes / 2e12 * 1e6)
        assert r["fp8_over_bf16"] == pytest.approx(r["fp8_us"] / r["bf16_us"])
        assert r["fp8_over_bf16_quant"] == pytest.approx(r["fp8_us"] / r["bf16_quant_us"])
        assert r["fp8_bw_fraction"] == pytest.approx(r["floor_fp8_us"] / r["fp8_us"])
        assert r["fp8_launches"] == 1 and r["compiled_peer_us"] is None and r["fp8_over_peer"] is None
    wo_a = records[1]
    flops = 2 * 1 * 2 * 1024 * 4096
    assert wo_a["floor_compute_us"] == pytest.approx(flops / 5e14 * 1e6)
    assert wo_a["fp8_tflops"] == pytest.approx(flops / (wo_a["fp8_us"] * 1e-6) / 1e12)
    assert wo_a["fp8_roofline_fraction"] == pytest.approx(max(wo_a["floor_fp8_us"], wo_a["floor_compute_us"])
                                                          / wo_a["fp8_us"])
    assert "floor_compute_us" not in records[0]


@pytest.mark.cpu
def test_wo_a_sweep_takes_the_wo_a_producers_at_every_t():
    bench = _load_benchmark("producers")
    args = argparse.Namespace(producers=["rms_norm", "wo_a_g8", "wo_a_g2_fp8w"], rows=[1, 65])
    assert bench.wo_a_sweep_cases(args) == [("wo_a_g8", 1), ("wo_a_g8", 65), ("wo_a_g2_fp8w", 1), ("wo_a_g2_fp8w", 65)]


@pytest.mark.cpu
@pytest.mark.parametrize("rows", [1, 16, 17, 64, 65, 128, 256, 2048])
def test_wo_a_candidates_by_rows(rows):
    """Decode tiles (16 / 64 rows; 32 too from T = 17) up to T = 64; above, wgmma tiles no taller
    than T needs (up to 256 rows, the tallest converting an FP8 wo_a's weights the fewest times), K
    split 1, 2 or 4 or as ``splits`` says; every candidate passes the kernel's own config check and
    fits the H200's shared memory, none twice."""
    bench = _load_benchmark("producers")
    candidates = bench.wo_a_candidates(rows)
    for c in candidates:
        einsum._check_config(c, 1024, 32)
        assert (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2 * c["num_stages"] <= 220 * 1024
    assert len({tuple(sorted(c.items())) for c in candidates}) == len(candidates)
    heights = {c["BLOCK_M"] for c in candidates}
    if rows <= 64:
        assert heights == ({16, 64} if rows <= 16 else {16, 32, 64})
        return
    assert heights == {64, 128, 256} & set(range(64, max(64, triton.next_power_of_2(rows)) + 1))
    assert max(c["BLOCK_M"] * c["BLOCK_N"] for c in candidates) <= einsum.FP8_WEIGHT_TILE_OUTPUTS
    assert {c["SPLIT"] for c in candidates} == {1, 2, 4}
    assert {c["SPLIT"] for c in bench.wo_a_candidates(rows, splits=[8])} == {8}


@pytest.mark.cpu
@pytest.mark.parametrize("name", ["wo_a_g2", "wo_a_g2_fp8w"])
def test_wo_a_sweep_floor_counts_weights_scales_input_and_pair(name, monkeypatch, tmp_path):
    """Without a GPU: ``--sweep-wo-a``'s floor is one weight copy (FP8: e4m3 bytes and fp32 32x32
    block scales), the bf16 o read and the pair written, at the measured bandwidth; the table's
    own config is timed first."""
    import types

    bench = _load_benchmark("producers")
    timed = []
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "wo_a_candidates", lambda rows, d, splits: [dict(BLOCK_M=16)])
    monkeypatch.setattr(bench, "check_wo_a_launch", lambda *args: None)  # its own tests below
    monkeypatch.setattr(harness, "copies_past_l2", lambda nbytes, most=64: 1)
    monkeypatch.setattr(harness, "bench_meta", lambda: {"device": "fake"})
    monkeypatch.setattr(harness, "copy_bandwidth", lambda: 2e12)
    monkeypatch.setattr(harness, "graph_time_us", lambda fn, iters=100, repeats=7: timed.append(fn) or 5.0 - len(timed))
    args = types.SimpleNamespace(producers=[name], rows=[2], formats=[ActFormat.SM90_G32_FP32_MN.value], iters=1,
                                 splits=None, results_dir=tmp_path)
    meta, records = bench.run_wo_a_sweep(args)
    fmt, g, r, d = ActFormat.SM90_G32_FP32_MN, 2, 1024, 4096
    weight = _wo_a_weight_bytes(g, r, d, name.endswith("fp8w"))
    floor = (weight + 2 * g * d * 2 + harness.pair_bytes(2, g * r, fmt)) / 2e12 * 1e6
    assert [(rec["config"], rec["fp8_us"]) for rec in records] == [("table", 4.0), (dict(BLOCK_M=16), 3.0)]
    assert all(rec["floor_us"] == pytest.approx(floor) for rec in records)


@pytest.mark.cpu
def test_wo_a_sweep_times_only_correct_launches(monkeypatch, tmp_path, capsys):
    """A candidate whose output fails ``check_wo_a_launch`` is skipped, named, before it is timed;
    the table's own launch failing it stops the sweep."""
    import types

    bench = _load_benchmark("producers")
    wrong = dict(BLOCK_M=32)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "wo_a_candidates", lambda rows, d, splits: [dict(BLOCK_M=16), wrong])
    monkeypatch.setattr(harness, "copies_past_l2", lambda nbytes, most=64: 1)
    monkeypatch.setattr(harness, "bench_meta", lambda: {"device": "fake"})
    monkeypatch.setattr(harness, "copy_bandwidth", lambda: 2e12)
    monkeypatch.setattr(harness, "graph_time_us", lambda fn, iters=100, repeats=7: 1.0)
    checked = []

    def check(o, weight, weight_scale, fmt, config, want):
        checked.append(config)
        if config == wrong:
            raise AssertionError("wrong output: relative error 0.5")

    monkeypatch.setattr(bench, "check_wo_a_launch", check)
    args = types.SimpleNamespace(producers=["wo_a_g2"], rows=[2], formats=[ActFormat.SM90_G32_FP32_MN.value],
                                 iters=1, splits=None, results_dir=tmp_path)
    _, records = bench.run_wo_a_sweep(args)
    assert checked == [None, dict(BLOCK_M=16), wrong]
    assert [rec["config"] for rec in records] == ["table", dict(BLOCK_M=16)]
    assert "skip wo_a_g2 T=2 {'BLOCK_M': 32}: AssertionError: wrong output" in capsys.readouterr().out
    def table_wrong(o, weight, weight_scale, fmt, config, want):
        raise AssertionError("wrong output: relative error 0.5")

    monkeypatch.setattr(bench, "wo_a_candidates", lambda rows, d, splits: [])
    monkeypatch.setattr(bench, "check_wo_a_launch", table_wrong)
    with pytest.raises(AssertionError, match="wrong output"):
        bench.run_wo_a_sweep(args)


@pytest.mark.cpu
@pytest.mark.parametrize("fp8_weights", [False, True])
def test_check_wo_a_launch_passes_the_kernel_and_fails_wrong_outputs(fp8_weights, monkeypatch):
    """The sweep's check on the interpreter: the kernel's own launch passes (bf16 or FP8 weights);
    a bf16 output off by more than the bound, a NaN in it, or a pair one byte off fails."""
    bench = _load_benchmark("producers")
    fmt = ActFormat.SM90_G32_FP32_MN
    rows, g, r, d = 3, 2, 64, 64
    o = torch.randn(rows, g, d).bfloat16()
    if fp8_weights:
        weight, scale = ref.random_fp8_wo_a(g, r, d, device="cpu", log2_scale=-6)
    else:
        weight, scale = (torch.randn(g, r, d) / d ** 0.5).bfloat16(), None
    want = bench.wo_a_reference_fp64(o, weight, scale)
    bench.check_wo_a_launch(o, weight, scale, fmt, None, want)
    y, pair = einsum.wo_a_einsum(o, weight, weight_scale=scale, out_format=fmt)

    def returning(y_out, pair_out):
        monkeypatch.setattr(bench.einsum, "wo_a_einsum", lambda *args, **kwargs: (y_out, pair_out))

    off = y.clone()
    off[1] = (off[1].float() * 1.1).bfloat16()
    returning(off, ref.quantize(off, fmt))
    with pytest.raises(AssertionError, match="relative error"):
        bench.check_wo_a_launch(o, weight, scale, fmt, None, want)
    nan = y.clone()
    nan[2, 5] = float("nan")
    returning(nan, ref.quantize(nan, fmt))
    with pytest.raises(AssertionError, match="relative error"):
        bench.check_wo_a_launch(o, weight, scale, fmt, None, want)
    data = pair.data.clone()
    data.view(torch.uint8)[0, 0] ^= 1
    returning(y, QuantizedActivation(data, pair.scale, pair.fmt))
    with pytest.raises(AssertionError, match="pair"):
        bench.check_wo_a_launch(o, weight, scale, fmt, None, want)


@pytest.mark.cpu
def test_launch_candidates_span_the_documented_shapes():
    """RMSNorm: 1-8 rows of the whole width per program at 4, 8 or 16 warps (q_norm's narrower rows:
    2, 4 or 8); SiLU*mul: 128 / 256 wide tiles of 1-32 rows, 2-8 warps, at most 8192 outputs."""
    bench = _load_benchmark("producers")
    shapes = lambda name, rows: {tuple(c.values()) for c in bench.launch_candidates(name, rows)}  # noqa: E731
    assert shapes("rms_norm", 64) == {(m, 8192, w) for m in (1, 2, 4, 8) for w in (4, 8, 16)}
    assert shapes("q_norm", 2) == {(m, 2048, w) for m in (1, 2) for w in (2, 4, 8)}
    silu = shapes("silu_mul", 64)
    assert {(m, n) for m, n, _ in silu} == {(m, n) for n in (128, 256) for m in (1, 2, 4, 8, 16, 32) if m * n <= 8192}
    assert {w for *_, w in silu} == {2, 4, 8} and (1, 128, 8) not in silu  # 256 threads for 128 outputs


@pytest.mark.cpu
def test_report_plots_every_arm(monkeypatch, tmp_path):
    bench = _load_benchmark("producers")
    plotted = []
    monkeypatch.setattr(harness, "plot_records", lambda name, records, x, y_keys, *a, **k: plotted.append(list(y_keys)))
    record = dict(case="silu_mul I=2304", format="g32", T=1, bf16_us=1.0, bf16_quant_us=2.0, fp8_us=1.2)
    bench.report({"date": "today"}, [record], tmp_path)
    assert plotted == [["bf16_us", "bf16_quant_us", "fp8_us", "compiled_peer_us", "floor_fp8_us"]]


@pytest.mark.cpu
@pytest.mark.parametrize("fp8_weights", [False, True])
def test_wo_a_weight_copies_count_the_scales(fp8_weights, monkeypatch):
    """The four arms and the wo_a sweep take their weights from one helper: copies past L2 by one
    copy's bytes, the FP8 weights' fp32 block scales included."""
    bench = _load_benchmark("producers")
    asked = []
    monkeypatch.setattr(harness, "copies_past_l2", lambda nbytes, most=64: asked.append(nbytes) or 3)
    g, r, d = 2, 64, 128
    weights, nbytes = bench.wo_a_weight_copies(g, r, d, fp8_weights, "cpu")
    want = _wo_a_weight_bytes(g, r, d, fp8_weights)
    assert nbytes == want and asked == [want] and len(weights) == 3
    assert all((s is not None) == fp8_weights for _, s in weights)
    assert weights[0][0].data_ptr() != weights[1][0].data_ptr()

