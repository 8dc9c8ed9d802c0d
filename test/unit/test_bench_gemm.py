"""The GEMM benchmark's sweep candidates (its timing needs a GPU)."""

import argparse
import json

import pytest
import torch

from fp8chain.cli import _load_benchmark
from fp8chain_kernel.gemv import GEMV_TABLE

pytestmark = pytest.mark.cpu


def _sweep_args(*argv):
    bench = _load_benchmark("gemm")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench, parser.parse_args(["--sweep", *argv])


def test_decode_candidates_follow_the_options_and_fit_shared_memory():
    bench, args = _sweep_args("--stages", "3,6", "--modes", "block_diag,dequant", "--block-k", "128,256",
                              "--block-n", "32,64", "--warps", "2,4", "--scale-ahead", "default,2")
    cands = bench._candidates(args, 16, 1792, 5120, 32)
    assert cands
    assert {c.stages for c in cands} == {3, 6} and {c.warps for c in cands} == {2, 4}
    assert {c.block_n for c in cands} == {32, 64} and {c.block_k for c in cands} <= {128, 256}
    assert {c.scale_ahead for c in cands} == {None, 2}
    assert all(c.dequant != c.block_diag for c in cands)  # exactly one of the two modes asked for
    for c in cands:
        token_cols = (c.block_k // 32) * c.block_m if c.block_diag else c.block_m
        assert token_cols <= 128 and c.stages * c.block_k * (c.block_n + token_cols) <= 200 << 10, c
        assert 5120 // c.block_k % c.split == 0, c


def test_default_candidates_and_group_128():
    bench, args = _sweep_args()
    cands = bench._candidates(args, 16, 1792, 5120, 32)
    assert {c.stages for c in cands} == {4} and {c.block_n for c in cands} == {64, 128}
    assert {(c.dequant, c.block_diag) for c in cands} == {(False, False), (True, False), (False, True)}
    # 128-groups: only the per-group FP8 dot (the other modes need power-of-two 32-group scales)
    assert all(not c.dequant and not c.block_diag for c in bench._candidates(args, 16, 1792, 5120, 128))


@pytest.mark.parametrize("argv,match", [
    (["--shapes", "wq_b,nope"], r"--shapes: unknown \['nope'\]"),
    (["--ms", "0,-5"], r"--ms: \['0', '-5'\] are not positive integers"),
    (["--groups", "32,64"], r"--groups: \['64'\] are not 32 or 128"),
    (["--modes", "dequant,wgmma"], r"--modes: \['wgmma'\] are not operand modes"),
    (["--stages", "x,3"], r"--stages: \['x'\] are not positive integers"),
    (["--block-k", "0,128"], r"--block-k: \['0'\] are not powers of two >= 16"),
    (["--block-n", "96"], r"--block-n: \['96'\] are not powers of two >= 16"),
    (["--warps", "0"], r"--warps: \['0'\] are not 1, 2, 4, 8 or 16"),
    (["--splits", "0"], r"--splits: \['0'\] are not positive integers"),
    (["--token-tiles", "-4"], r"--token-tiles: \['-4'\] are not positive integers"),
    (["--scale-ahead", "5"], r"--scale-ahead: \['5'\] are not 0-4 or 'default'"),
    (["--max-regs", "none,16,256,x"], r"--max-regs: \['16', '256', 'x'\] are not 24-255 or 'none'"),
    (["--precompile", "-1"], r"--precompile must be >= 0"),
    (["--silu", "--shapes", "gate_up,wq_b"], r"--silu: the SiLU\*mul epilogue runs on gate_up, gate_up_tp4 only"),
])
def test_list_options_are_checked_before_any_gpu_work(argv, match):
    bench, args = _sweep_args(*argv)
    with pytest.raises(SystemExit, match=match):
        bench.check_lists(args)
    with pytest.raises(SystemExit, match=match):  # run() checks them first, before its GPU check
        bench.run(args)
    bench.check_lists(_sweep_args("--ms", "1,16", "--groups", "128")[1])  # valid lists pass


def test_register_caps_multiply_the_gemm_candidates_not_the_gemv():
    bench, plain = _sweep_args("--ms", "4,64")
    _, capped = _sweep_args("--ms", "4,64", "--max-regs", "none,168")
    for m in (4, 64):
        want = bench._candidates(plain, m, 5120, 8192, 128)
        got = bench._candidates(capped, m, 5120, 8192, 128)
        tiles = [c for c in want if not isinstance(c, bench.GemvConfig)]
        assert {c.max_regs for c in tiles} == {None}
        assert [c for c in got if not isinstance(c, bench.GemvConfig)] == [
            c._replace(max_regs=cap) for c in tiles for cap in (None, 168)]
        assert [c for c in got if isinstance(c, bench.GemvConfig)] == [c for c in want if isinstance(c, bench.GemvConfig)]
    assert any(isinstance(c, bench.GemvConfig) for c in bench._candidates(capped, 4, 5120, 8192, 128))


def test_block_diagonal_token_tiles_narrow_at_small_m():
    bench, args = _sweep_args("--modes", "block_diag")
    assert {c.block_m for c in bench._candidates(args, 1, 1792, 5120, 32)} == {4, 8, 16}
    assert {c.block_m for c in bench._candidates(args, 5, 1792, 5120, 32)} == {8, 16}
    assert {c.block_m for c in bench._candidates(args, 16, 1792, 5120, 32)} == {16}
    assert {c.block_m for c in bench._candidates(args, 64, 1792, 5120, 32)} == {16, 32}


def test_split_candidates_default_and_option():
    # wqkv_a at BLOCK_K 128: 40 K iterations; by default the four largest splits leaving >= 2 each
    bench, args = _sweep_args("--modes", "block_diag", "--block-k", "128", "--stages", "3", "--block-n", "64")
    assert {c.split for c in bench._candidates(args, 1, 1792, 5120, 32)} == {5, 8, 10, 20}
    # asked for: those that divide the iterations and leave two or more (3 and 40 do not)
    bench, args = _sweep_args("--modes", "block_diag", "--block-k", "128", "--stages", "3", "--block-n", "64",
                              "--splits", "3,8,16,20,40")
    assert {c.split for c in bench._candidates(args, 1, 1792, 5120, 32)} == {8, 20}
    # none fits: unsplit
    assert {c.split for c in bench._candidates(args, 1, 1792, 128 * 7, 32)} == {1}


def test_token_tiles_option_allows_several_tiles_per_m():
    bench, args = _sweep_args("--modes", "block_diag", "--token-tiles", "8,16")
    assert {c.block_m for c in bench._candidates(args, 16, 1792, 5120, 32)} == {8, 16}


def test_gemv_candidates_up_to_four_tokens():
    bench, args = _sweep_args("--ms", "1")
    cands = bench._candidates(args, 1, 1792, 5120, 32)
    gemv = [c for c in cands if isinstance(c, bench.GemvConfig)]
    assert gemv and len(gemv) < len(cands)  # beside the tensor-core GEMM's candidates
    assert all(32 % c.block_n == 0 and c.block_k % 32 == 0 and 2048 <= c.block_n * c.block_k <= 16384 for c in gemv)
    assert set(GEMV_TABLE.values()) <= set(gemv)  # every table entry is a candidate
    four = [c for c in bench._candidates(args, 4, 1792, 5120, 32) if isinstance(c, bench.GemvConfig)]
    three = [c for c in bench._candidates(args, 3, 1792, 5120, 32) if isinstance(c, bench.GemvConfig)]
    assert three == four == gemv  # the same launches at any token count
    assert all(c.block_n * c.block_k <= 128 * 32 * c.warps for c in gemv)  # <= 128 weights per thread and step
    assert bench.GemvConfig(16, 512, 2, 3) in four and bench.GemvConfig(32, 512, 2, 3) not in four
    assert not any(isinstance(c, bench.GemvConfig) for c in bench._candidates(args, 5, 1792, 5120, 32))
    assert all(128 % c.block_n == 0 and c.block_k % 128 == 0 for c in bench.gemv_candidates(128))
    bench, args = _sweep_args("--modes", "block_diag")
    assert not any(isinstance(c, bench.GemvConfig) for c in bench._candidates(args, 1, 1792, 5120, 32))


def test_roofline_counts_every_byte_and_the_flops():
    """Weights (1 B) and their fp32 32x32 block scales, the pair's data and fp32 scales, the bf16
    output over the bandwidth; the larger of that and 2 M N K over the FP8 rate."""
    bench = _load_benchmark("gemm")
    nbytes = 256 * 512 + 4 * 8 * 16 + 4 * 512 + 4 * 4 * 16 + 2 * 4 * 256
    assert bench.roofline_us(4, 256, 512, 32, 1e12, 1e15) == pytest.approx(nbytes / 1e12 * 1e6)
    assert bench.roofline_us(4, 256, 512, 32, 1e12, None) == pytest.approx(nbytes / 1e12 * 1e6)
    flops = 2 * 2048 * 256 * 512
    assert bench.roofline_us(2048, 256, 512, 32, 1e12, 1e14) == pytest.approx(flops / 1e14 * 1e6)


def test_candidates_up_to_256_tokens_add_generated_tiles_to_the_list():
    """At 64 < M <= 256 the generated FP8 and dequantized tiles are 64 or 128 tokens wide (K
    splits included), block-diagonal ones 16 or 32, beside the fixed list; each launch once."""
    bench, args = _sweep_args()
    cands = bench._candidates(args, 256, 1792, 5120, 32)
    assert len(cands) == len(set(cands))
    by_mode = {mode: [c for c in cands if (c.dequant, c.block_diag) == flags]
               for mode, flags in bench.OPERAND_MODES.items()}
    assert {c.block_m for c in by_mode["fp8"]} == {c.block_m for c in by_mode["dequant"]} == {64, 128}
    assert {c.block_m for c in by_mode["block_diag"]} == {16, 32}
    assert {c.split for c in by_mode["dequant"]} >= {1, 2, 4}
    assert bench.gemm.GemmConfig(128, 128, 128, 1, 3, 8) in cands  # from the fixed list
    assert bench.gemm.GemmConfig(128, 64, 128, 2, 4, 4) in cands  # the table's entry for this bucket
    # above 256 tokens the fixed list alone, filtered by --modes like the generated ones
    wide = bench._candidates(args, 2048, 1792, 5120, 32)
    assert {c.block_m for c in wide} <= {64, 128, 256} and all(not c.block_diag for c in wide)
    bench, args = _sweep_args("--modes", "dequant")
    assert all(c.dequant for m in (256, 2048) for c in bench._candidates(args, m, 1792, 5120, 32))
    bench, args = _sweep_args("--modes", "block_diag")
    assert bench._candidates(args, 2048, 1792, 5120, 32) == []


# ---- run() without a GPU: recording fakes for the kernels, capture and replay ----------------

# tiny stand-ins for the DSv4.1 shapes: K/128 = 4 (cuBLAS blockwise valid), 5 (computed with the
# layout torch 2.11 reads wrongly: timed, flagged invalid), K = 288 (no g128 problem)
TINY_SHAPES = {"k512": (256, 512), "k640": (256, 640), "k288": (256, 288)}
# each arm's fake time, set by the launch its graph holds (+ 0.5 us per point)
ARM_US = {"pair_us": 10.0, "bf16_quant_us": 14.0, "w8a16_us": 12.0, "triton_g128_us": 11.0, "cublas_g128_us": 9.0,
          "silu_epilogue_us": 7.0, "silu_launch_us": 8.0}


def _arm_of(launch):
    """Which arm a recorded launch belongs to, from what it reads."""
    from fp8chain_kernel.formats import QuantizedActivation

    if launch["kernel"] == "gemm_silu_mul":
        return "silu_epilogue_us"
    if launch["kernel"] == "scaled_mm":
        return "cublas_g128_us"
    if launch["kernel"] == "w8a16_gemm":
        return "w8a16_us"
    if not isinstance(launch["a"], QuantizedActivation):
        return "bf16_quant_us"
    return "pair_us" if launch["weight_block"] == 32 else "triton_g128_us"


def _graph_arm(graph):
    """A captured graph's arm: the SiLU*mul launch arm holds a GEMM and ``silu_mul`` launches."""
    return "silu_launch_us" if any(launch["kernel"] == "silu_mul" for launch in graph) else _arm_of(graph[0])


def _fake_gpu_gemm_run(monkeypatch, argv, fp8_gemm=None, time_of=None, blockwise=True, fp8_rate=1e9, bench=None,
                       gemm_silu_mul=None):
    """``benchmark/gemm.py``'s ``main`` on the CPU (``TINY_SHAPES``, two weight copies): its
    kernels record their launches (``fp8_gemm`` / ``gemm_silu_mul``: ``fp8_gemm(call)`` gives the
    result, else none),
    a captured graph is the launches its ``iters`` calls made, a replay's time is
    ``time_of(graph)`` (default: the arm's ``ARM_US``, 0.5 us more per point). cuBLAS blockwise
    works (calibrated: the contiguous layout at K/128 % 4 == 0, none else) unless ``blockwise`` is
    False. Returns ``(bench, launches, captures, replays, asked)``."""
    import dataclasses

    from fp8chain.bench import harness
    from fp8chain_kernel import backends
    from helpers import TorchWithGpu

    bench = bench or _load_benchmark("gemm")
    launches, captures, replays, asked = [], [], [], []

    def record(kernel, result=None):
        def launch(a, weight, weight_scale, *, weight_block, fmt=None, out=None, config=None):
            call = dict(kernel=kernel, a=a, w=weight, s=weight_scale, weight_block=weight_block, fmt=fmt,
                        out=out, config=config)
            launches.append(call)
            return result(call) if result else out
        return launch

    def record_silu(kernel, result=None):
        def launch(*args, **kwargs):  # fp8_gemm_silu_mul(a, weight, scale, ...), silu_mul(gate_up, ...)
            call = dict(kernel=kernel, args=args, w=args[1] if len(args) > 1 else None, **kwargs)
            launches.append(call)
            return result(call) if result else None
        return launch

    def scaled_mm(*args, **kwargs):
        launches.append(dict(kernel="scaled_mm", args=args, kwargs=kwargs, w=args[1].t()))

    def capture_graph(fn, iters):
        fn.reset()
        start = len(launches)
        for _ in range(iters):
            fn()
        captures.append(iters)
        return launches[start:]

    def replay_times_us(graphs, iters, rounds=7):
        replays.append((dict(graphs), iters, rounds))
        point = len(replays) - 1
        return {name: time_of(graph) if time_of else ARM_US[_graph_arm(graph)] + 0.5 * point
                for name, graph in graphs.items()}

    fake_torch = TorchWithGpu("torch")
    fake_torch.device = lambda *args: torch.device("cpu")
    fake_torch._scaled_mm = scaled_mm
    monkeypatch.setattr(bench, "torch", fake_torch)
    monkeypatch.setattr(bench, "SHAPES", TINY_SHAPES)
    monkeypatch.setattr(bench.gemm, "fp8_gemm", record("fp8_gemm", fp8_gemm))
    monkeypatch.setattr(bench.gemm, "w8a16_gemm", record("w8a16_gemm"))
    monkeypatch.setattr(bench.gemm, "fp8_gemm_silu_mul", record_silu("gemm_silu_mul", gemm_silu_mul))
    monkeypatch.setattr(bench, "silu_mul", record_silu("silu_mul"))
    caps = dataclasses.replace(backends.probe(), scaled_mm_blockwise=blockwise,
                               scaled_mm_reason="" if blockwise else "no CUDA device")
    monkeypatch.setattr(backends, "probe", lambda *args, **kwargs: caps)
    monkeypatch.setattr(type(backends.get_backend("torch_blockwise")), "_scale_b_view", {True: "contig", False: None})
    monkeypatch.setattr(harness, "copies_past_l2", lambda nbytes, most=64: asked.append(nbytes) or 2)
    monkeypatch.setattr(harness, "bench_meta", lambda: {"device": "fake"})
    monkeypatch.setattr(harness, "copy_bandwidth", lambda device=None: 2e12)

    def fp8_matmul_rate(device=None):
        if fp8_rate is None:
            raise RuntimeError("no FP8 torch._scaled_mm here")
        return fp8_rate

    monkeypatch.setattr(harness, "fp8_matmul_rate", fp8_matmul_rate)
    monkeypatch.setattr(harness, "capture_graph", capture_graph)
    monkeypatch.setattr(harness, "replay_times_us", replay_times_us)
    bench.main([*argv, "--no-save"])
    return bench, launches, captures, replays, asked


@pytest.mark.parametrize("blockwise", [True, False])
def test_run_times_each_arm_on_its_own_inputs(monkeypatch, tmp_path, blockwise):
    """Without a GPU: ``run`` with graphs that are the launches they captured. Each ``*_us`` is the
    time of the graph whose launch is that arm's (the pair GEMM reads the g32 pair, the unchained
    arm bf16 quantized to g32 inside the GEMM, W8A16 the bf16, the g128 arms the g128 pair of the
    same activations), every arm of a point replays in one alternating call over every weight
    copy, floors / roofline / ratios come from the right arms; the g128 columns are None where K %
    128 != 0 (and the cuBLAS one where the probe found cuBLAS blockwise broken)."""
    from fp8chain_kernel import reference as ref
    from fp8chain_kernel.formats import ActFormat
    from helpers import assert_pairs_equal

    G32, G128 = ActFormat.SM90_G32_FP32_MN, ActFormat.SM90_G128_FP32_MN
    rate = 1e9 if blockwise else None  # 1e9: the flops bound the roofline; None: no FP8 rate (bytes alone)
    out_json = tmp_path / "gemm.json"
    bench = _load_benchmark("gemm")
    bench_gemv = bench.GemvConfig(16, 512, 2, 3)
    monkeypatch.setattr(bench, "select_gemv", lambda m, n, k, group: bench_gemv if m == 1 else None)
    bench, launches, captures, replays, asked = _fake_gpu_gemm_run(
        monkeypatch, ["--shapes", "k512,k640,k288", "--ms", "1,16", "--json-out", str(out_json)],
        blockwise=blockwise, fp8_rate=rate, bench=bench)
    saved = json.loads(out_json.read_text())
    meta, records = saved["meta"], saved["records"]
    assert meta["copy_bandwidth_Bps"] == 2e12 and meta["copy_bandwidth_TBps"] == 2.0
    if rate:
        assert meta["fp8_matmul_TFLOPs"] == pytest.approx(rate / 1e12)
    else:
        assert "no FP8" in meta["fp8_matmul_rate_error"] and "fp8_matmul_TFLOPs" not in meta
    assert meta["cublas_blockwise"] == (True if blockwise else "no CUDA device")
    assert [(r["shape"], r["m"]) for r in records] == [(s, m) for s in TINY_SHAPES for m in (1, 16)]
    assert asked == [n * k for n, k in TINY_SHAPES.values()]  # the copies past L2 of one weight's bytes
    assert len(replays) == len(records)
    for point, (r, (graphs, iters, rounds)) in enumerate(zip(records, replays)):
        n, k, m = r["n"], r["k"], r["m"]
        g128 = k % 128 == 0
        arms = {"pair_us", "bf16_quant_us", "w8a16_us"} | ({"triton_g128_us"} if g128 else set()) | (
            {"cublas_g128_us"} if g128 and blockwise else set())
        assert set(graphs) == arms and rounds == 7 and iters % 2 == 0 and iters >= 50
        for arm in arms:
            assert r[arm] == pytest.approx(ARM_US[arm] + 0.5 * point), arm
            assert {_arm_of(launch) for launch in graphs[arm]} == {arm}
            # every weight copy, in its own block size
            block = 128 if arm in ("triton_g128_us", "cublas_g128_us") else 32
            assert len({launch["w"].data_ptr() for launch in graphs[arm]}) == 2, arm
            if arm != "cublas_g128_us":
                assert all(launch["weight_block"] == block and launch["s"].shape == (n // block, k // block)
                           and launch["out"].shape == (m, n) for launch in graphs[arm]), arm
        x = graphs["bf16_quant_us"][0]["a"]
        assert x.dtype == torch.bfloat16 and x.shape == (m, k) and graphs["bf16_quant_us"][0]["fmt"] is G32
        assert all(launch["a"] is x for launch in graphs["w8a16_us"])
        assert_pairs_equal(graphs["pair_us"][0]["a"], ref.quantize(x, G32))
        if g128:
            assert_pairs_equal(graphs["triton_g128_us"][0]["a"], ref.quantize(x, G128))
        else:
            assert r["triton_g128_us"] is None and r["cublas_g128_us"] is None
        if g128 and blockwise:
            assert r["cublas_valid"] is ((k // 128) % 4 == 0)
            launch = graphs["cublas_g128_us"][0]
            (a, _), kw = launch["args"], launch["kwargs"]
            pair128 = ref.quantize(x, G128)
            assert torch.equal(a[:m].view(torch.uint8), pair128.data.view(torch.uint8)) and not a[m:].any()
            assert torch.equal(kw["scale_a"][:m], pair128.scale) and kw["out_dtype"] == torch.bfloat16
            assert kw["scale_b"].t().shape == (n // 128, k // 128)
            assert r["pair_vs_cublas"] == pytest.approx(r["cublas_g128_us"] / r["pair_us"])
            assert r["g128_vs_cublas"] == pytest.approx(r["cublas_g128_us"] / r["triton_g128_us"])
        else:
            assert r["cublas_g128_us"] is None and "pair_vs_cublas" not in r and "cublas_valid" not in r
        assert r["floor_us"] == pytest.approx(n * k / 2e12 * 1e6)
        assert r["bw_frac"] == pytest.approx(r["floor_us"] / r["pair_us"])
        assert r["roofline_us"] == pytest.approx(bench.roofline_us(m, n, k, 32, 2e12, rate))
        assert r["roofline_frac"] == pytest.approx(r["roofline_us"] / r["pair_us"])
        if m == 1:
            assert r["kernel_g32"] == "gemv" and r["config_g32"] == list(bench_gemv)
        else:
            assert r["kernel_g32"] == "gemm"
    # the flops bound the roofline at 1e9 flop/s: a roofline on bytes alone would be far lower
    if rate:
        assert records[-1]["roofline_us"] > 10 * records[-1]["floor_us"]
    assert captures and set(captures) == {replays[0][1]}


def test_report_plots_and_tabulates_every_arm(monkeypatch, tmp_path):
    from fp8chain.bench import harness

    bench = _load_benchmark("gemm")
    plotted = []
    monkeypatch.setattr(harness, "plot_records", lambda name, records, x, y_keys, *a, **k: plotted.append(list(y_keys)))
    record = dict(shape="wo_b_tp4", n=5120, k=2048, m=1, pair_us=1.0, bf16_quant_us=2.0, w8a16_us=1.5,
                  cublas_g128_us=1.2, triton_g128_us=1.1, floor_us=0.5, cublas_valid=False)
    text = bench.report({"date": "today"}, [record], tmp_path)
    assert plotted == [["pair_us", "bf16_quant_us", "w8a16_us", "cublas_g128_us", "triton_g128_us",
                        "silu_epilogue_us", "silu_launch_us", "floor_us"]]
    header, _, row = text.splitlines()[1:4]
    assert header.split(" | ")[-1] == "cublas_valid |" and row.endswith("| False |")
    assert json.loads((tmp_path / "gemm.json").read_text())["records"] == [record]


def test_sweep_keeps_the_fastest_verified_candidate(monkeypatch, tmp_path):
    """Without a GPU: ``--sweep`` with a GEMM stand-in returning the reference result, 1% off for a
    wrong config, NaN for another, raising for a third, 0.1% off for one within tolerance. Only
    configs within 5e-3 of the reference (computed on the weight copy the candidates ran) are
    timed; the fastest of them is kept (the default config, timed beside them, never is); a
    point whose candidates all fail has no record; the sweep's floor is one weight copy's bytes;
    the JSON holds every timed config."""
    from fp8chain_kernel import reference as ref

    bench = _load_benchmark("gemm")
    GemmConfig = bench.gemm.GemmConfig
    A, B, NEAR = GemmConfig(64, 16, 128, 1, 4, 4), GemmConfig(128, 16, 128, 1, 4, 4), GemmConfig(64, 16, 256, 1, 4, 4)
    WRONG, NAN, RAISE = GemmConfig(64, 16, 128, 2, 4, 4), GemmConfig(64, 16, 128, 4, 4, 4), GemmConfig(64, 16, 128, 8, 4, 4)
    GV = bench.GemvConfig(16, 512, 2, 3)
    us = {A: 3.0, B: 2.0, NEAR: 2.5, WRONG: 1.0, NAN: 0.5, GV: 1.5}
    candidates = {1: [GV, A, B, WRONG, NAN, RAISE, NEAR], 16: [A, B, WRONG, NAN, RAISE, NEAR]}
    monkeypatch.setattr(bench, "_candidates", lambda args, m, n, k, group: candidates[m])

    def fp8_gemm(call):
        pair, config = call["a"], call["config"]
        assert pair.fmt is bench.gemm.input_format_for_block(call["weight_block"])  # as the real GEMM refuses
        if config == RAISE:
            raise RuntimeError("out of shared memory")
        got = ref.fp8_gemm(pair, call["w"], call["s"], call["weight_block"]).double()
        if config == NAN:
            return got * float("nan")
        wrong = config == WRONG or (call["weight_block"] == 128 and config is not None and pair.data.shape[0] == 1)
        return got * (1.01 if wrong else 1.001 if config == NEAR else 1.0)

    def time_of(graph):  # the default config: slowest at M = 1, fastest at M = 16
        config, m = graph[0]["config"], graph[0]["a"].data.shape[0]
        return (4.0 if m == 1 else 0.8) if config is None else us[config]

    out_json = tmp_path / "sweep.json"
    bench, launches, captures, replays, asked = _fake_gpu_gemm_run(
        monkeypatch, ["--sweep", "--shapes", "k512", "--ms", "1,16", "--groups", "128,32", "--json-out",
                      str(out_json)], fp8_gemm=fp8_gemm, time_of=time_of, bench=bench)
    saved = json.loads(out_json.read_text())
    meta, records = saved["meta"], saved["records"]
    assert meta["sweep"] is True
    # g128 at M = 1: every candidate wrong, the default alone verified: no record
    assert [(r["group"], r["m"]) for r in records] == [(128, 16), (32, 1), (32, 16)]
    timed = lambda cands: [[us[c], list(c)] for c in cands if c in (A, B, NEAR, GV)]  # noqa: E731
    for r in records:
        assert r["floor_us"] == pytest.approx(256 * 512 / 2e12 * 1e6) and (r["n"], r["k"]) == (256, 512)
        default = 4.0 if r["m"] == 1 else 0.8
        assert r["current_us"] == default
        assert r["all"] == timed(candidates[r["m"]]) + [[default, None]]
    assert (records[0]["best_us"], records[0]["best"], records[0]["kind"]) == (2.0, list(B), "gemm")
    assert (records[1]["best_us"], records[1]["best"], records[1]["kind"]) == (1.5, list(GV), "gemv")
    assert (records[2]["best_us"], records[2]["best"], records[2]["kind"]) == (2.0, list(B), "gemm")
    # the report of a sweep: its own JSON and table
    text = bench.report(meta, records, tmp_path)
    assert json.loads((tmp_path / "gemm_sweep.json").read_text())["records"] == records
    assert not (tmp_path / "gemm.json").exists()
    assert f"| k512 | 32 | 1 | 1.5 | {tuple(GV)} | 4 |" in text



def test_run_times_the_gate_up_with_silu_mul_both_ways(monkeypatch, tmp_path):
    """On a gate_up shape ``run`` also times the chained shared expert's two ways into one pair
    buffer: the GEMM's SiLU*mul epilogue (one launch, the tensor-core config, DSv4.1's clamp, the
    pair alone) and the table's GEMM into ``[M, 2I]`` then ``act.silu_mul`` of that very output,
    both over every weight copy; ``silu_rule`` is ``silu_mul_epilogue_pays`` of the table's
    config. Other shapes get no SiLU*mul arms."""
    from fp8chain_kernel.formats import ActFormat, QuantizedActivation

    G32 = ActFormat.SM90_G32_FP32_MN
    cpu = torch.device("cpu")
    bench = _load_benchmark("gemm")
    monkeypatch.setattr(bench, "SILU_SHAPES", ("k512",))
    pays = {1: False, 16: True}  # by the table config's token tile, here M
    table_config = {m: bench.gemm.GemmConfig(64, m, 128) for m in pays}
    monkeypatch.setattr(bench.gemm, "gemm_config", lambda m, n, k, group, device: table_config[m])
    monkeypatch.setattr(bench.gemm, "silu_mul_epilogue_pays", lambda config: pays[config.block_m])
    out_json = tmp_path / "gemm.json"
    bench, launches, captures, replays, asked = _fake_gpu_gemm_run(
        monkeypatch, ["--shapes", "k512,k640", "--ms", "1,16", "--json-out", str(out_json)], bench=bench)
    records = json.loads(out_json.read_text())["records"]
    assert [(r["shape"], r["m"]) for r in records] == [("k512", 1), ("k512", 16), ("k640", 1), ("k640", 16)]
    for point, ((graphs, _, _), r) in enumerate(zip(replays, records)):
        shape, m = r["shape"], r["m"]
        if shape != "k512":
            assert not {"silu_epilogue_us", "silu_launch_us"} & set(graphs)
            assert r.get("silu_epilogue_us") is None and "silu_rule" not in r
            continue
        assert r["silu_rule"] == ("epilogue" if pays[m] else "launch")
        for arm in ("silu_epilogue_us", "silu_launch_us"):
            assert r[arm] == pytest.approx(ARM_US[arm] + 0.5 * point)
        n, k, i = 256, 512, 128
        epilogue, two_launches = graphs["silu_epilogue_us"], graphs["silu_launch_us"]
        assert {launch["kernel"] for launch in epilogue} == {"gemm_silu_mul"}
        assert [launch["kernel"] for launch in two_launches] == ["fp8_gemm", "silu_mul"] * (len(two_launches) // 2)
        for graph in (epilogue, two_launches[::2]):  # every weight copy
            assert len({launch["w"].data_ptr() for launch in graph}) == 2
        outs = {id(launch["out"]) for launch in epilogue} | {id(launch["out"]) for launch in two_launches
                                                              if launch["kernel"] == "silu_mul"}
        assert len(outs) == 1  # one pair buffer for both ways
        for launch in epilogue:
            pair, w = launch["args"][:2]
            assert isinstance(pair, QuantizedActivation) and pair.data.shape == (m, k) and w.shape == (n, k)
            assert launch["weight_block"] == 32 and launch["limit"] == bench.SWIGLU_LIMIT == 10.0
            assert launch["out_format"] is G32 and launch["return_bf16"] is False
            assert launch["out"].fmt is G32 and launch["out"].data.shape == (m, i)
            assert launch["config"] == bench.gemm.select_config(m, n, k, 32, cpu)
        for gemm_launch, silu_launch in zip(two_launches[::2], two_launches[1::2]):
            assert gemm_launch["config"] is None and gemm_launch["a"] is epilogue[0]["args"][0]
            (gate_up,) = silu_launch["args"]
            assert gate_up is gemm_launch["out"] and gate_up.shape == (m, n)
            assert silu_launch["limit"] == 10.0 and silu_launch["out_format"] is G32
            assert silu_launch["return_bf16"] is False


def test_silu_sweep_checks_and_times_candidates_through_the_epilogue(monkeypatch, tmp_path):
    """``--sweep --silu``: each candidate is checked on bf16 ``y`` against the reference gate_up +
    SiLU*mul (a wrong one is not timed) and timed as the chained shared expert calls it (the pair
    alone, DSv4.1's clamp, one pair buffer, every weight copy); the fastest is kept. Without
    ``--sweep``, ``--silu`` is refused."""
    from fp8chain_kernel import reference as ref

    bench = _load_benchmark("gemm")
    GemmConfig = bench.gemm.GemmConfig
    GOOD, FAST_WRONG, SLOW = GemmConfig(64, 16, 128, 1, 4, 4), GemmConfig(128, 16, 128, 1, 4, 4), GemmConfig(64, 16, 256)
    us = {GOOD: 2.0, FAST_WRONG: 1.0, SLOW: 3.0, None: 2.5}
    monkeypatch.setattr(bench, "SILU_SHAPES", ("k512",))
    monkeypatch.setattr(bench, "_candidates", lambda args, m, n, k, group: [GOOD, FAST_WRONG, SLOW])

    def gemm_silu_mul(call):
        pair, w, s = call["args"]
        y = ref.fp8_gemm_silu_mul(pair, w, s, call["weight_block"], limit=call["limit"])
        return y * 1.01 if call["config"] == FAST_WRONG else y

    out_json = tmp_path / "sweep.json"
    bench, launches, captures, replays, asked = _fake_gpu_gemm_run(
        monkeypatch, ["--sweep", "--silu", "--shapes", "k512", "--ms", "16", "--groups", "32", "--json-out",
                      str(out_json)], gemm_silu_mul=gemm_silu_mul,
        time_of=lambda graph: us[graph[0]["config"]], bench=bench)
    saved = json.loads(out_json.read_text())
    assert saved["meta"]["silu_mul_epilogue"] is True
    (record,) = saved["records"]
    assert (record["best_us"], record["best"], record["current_us"]) == (2.0, list(GOOD), 2.5)
    assert record["all"] == [[2.0, list(GOOD)], [3.0, list(SLOW)], [2.5, None]]
    checked = [call for call in launches if call.get("return_bf16", True)]
    assert [call["config"] for call in checked] == [GOOD, FAST_WRONG, SLOW, None]
    timed = [call for graph in (graph for r in replays for graph in r[0].values()) for call in graph]
    assert {call["kernel"] for call in timed} == {"gemm_silu_mul"}
    assert all(call["return_bf16"] is False and call["limit"] == 10.0 and call["out_format"] is call["out"].fmt
               for call in timed)
    assert len({id(call["out"]) for call in timed}) == 1 and len({call["w"].data_ptr() for call in timed}) == 2
    assert FAST_WRONG not in {call["config"] for call in timed}
    with pytest.raises(SystemExit, match="give --sweep too"):
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        bench.check_lists(parser.parse_args(["--silu", "--shapes", "k512"]))
