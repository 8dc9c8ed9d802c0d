"""The benchmarks time every case before they profile any (``harness.replay_times_us`` refuses to
time after ``harness.kernel_profile``), and fill every field, at small sizes on the GPU."""

import argparse

import pytest

from fp8chain.bench import harness
from fp8chain.cli import _load_benchmark

pytestmark = pytest.mark.gpu


def _run(name: str, argv: list[str], monkeypatch, tmp_path):
    """``benchmark/<name>.py``'s ``run`` as ``fp8chain bench`` calls it, in a process whose earlier
    tests may have profiled (the flag is reset: this checks the order within one run)."""
    monkeypatch.setattr(harness, "_profiler_used", False)
    bench = _load_benchmark(name)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = harness.apply_quick(parser.parse_args(argv))
    args.results_dir = tmp_path
    meta, records = bench.run(args)
    assert harness._profiler_used  # launches were counted, after every timing
    return records


def test_producers_run_times_then_counts(monkeypatch, tmp_path, device):
    records = _run("producers", ["--producers", "silu_mul", "mhc_boundary", "--rows", "1", "3", "--no-peer",
                                 "--iters", "5"], monkeypatch, tmp_path)
    assert len(records) == 4
    assert all(r["fp8_launches"] == 1 and r["fp8_us"] > 0 and r["bf16_quant_us"] > 0 for r in records)


def test_attention_run_times_then_profiles(monkeypatch, tmp_path, device):
    records = _run("attention", ["--rows", "1", "4", "--contexts", "256", "--heads", "16", "--prefill", "0",
                                 "--iters", "5"], monkeypatch, tmp_path)
    assert len(records) == 2
    assert all(r["attention_us"] > 0 and r["split_us"] > 0 and "_mqa_split_kernel" in r["kernels"] for r in records)


def test_layer_run_times_then_counts(monkeypatch, tmp_path, device):
    records = _run("layer", ["--rows", "1", "3", "--shapes", "tp4", "--prefill", "3", "--no-peer", "--context", "256",
                             "--iters", "3", "--captures", "2"], monkeypatch, tmp_path)
    # a decode M equal to the prefill length stays a decode case beside the prefill
    assert [(r["M"], r["phase"]) for r in records] == [(1, "decode"), (3, "decode"), (3, "prefill")]
    caps = _load_benchmark("layer").STATS_SPLIT_CAPS
    for r in records:
        assert r["chained_quantize_launches"] == 0 and r["unchained_quantize_launches"] == 5
        for arm in ("chained", "unchained"):  # two graphs of each arm, the first the arm's own time
            assert len(r[f"{arm}_captures_us"]) == 2 and r[f"{arm}_captures_us"][0] == r[f"{arm}_us"]
            assert all(us > 0 for us in r[f"{arm}_captures_us"])
        assert r["chained_us"] > 0 and r["unchained_serial_stats_us"] > 0 and r["chained_kernels"]
        for arm in ("chained", "unchained"):
            assert r[f"{arm}_best_stats_us"] > 0
            assert all(cap in caps for cap in r[f"{arm}_best_stats_splits"])
            tried = r[f"{arm}_stats_caps_us"]  # every (attention, FFN) pair, the best among them
            assert len(tried) == len(caps) ** 2 and min(tried.values()) == r[f"{arm}_best_stats_us"]
            assert tried[",".join(map(str, r[f"{arm}_best_stats_splits"]))] == r[f"{arm}_best_stats_us"]
        assert r["best_stats_chained_over_unchained"] > 0
        if r["phase"] == "decode":  # the router and Flash's 256 routed experts (top 6), timed apart
            assert r["routed_us"] > r["router_us"] > 0 and r["router_torch_us"] > 0 and r["routed_floor_us"] > 0
            assert 1 <= r["routed_experts_touched"] <= 6 * r["M"]
        else:
            assert "routed_us" not in r
