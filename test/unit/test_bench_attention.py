"""The attention benchmark's roofline and case plan (its timing needs a GPU)."""

import argparse

import pytest

from fp8chain.bench import harness
from fp8chain.cli import _load_benchmark

pytestmark = pytest.mark.cpu


def test_roofline_counts_cache_rows_and_key_pairs():
    bench = _load_benchmark("attention")
    # decode: 2 tokens, each its own 16-key slot; q and o are 2 x 4 heads x 8 columns each
    assert bench.roofline("decode", 2, 4, 8, 16) == ((2 * 16 + 2 * 2 * 4) * 8 * 2, 4 * 4 * 8 * 2 * 16)
    # prefill: one slot of 3 keys read once; token t attends to t + 1 keys (1 + 2 + 3 pairs)
    assert bench.roofline("prefill", 3, 4, 8, 3) == ((3 + 2 * 3 * 4) * 8 * 2, 4 * 4 * 8 * 6)


def test_calls_take_turns_over_cache_copies_past_the_l2(monkeypatch):
    """Each call of a case reads the next copy of its KV cache (the copies add up to more than the
    L2), the rope and the attention alike, every tile and split count too."""
    import types

    import torch

    bench = _load_benchmark("attention")
    seen = []

    def rope_qkv(q2d, kv, cos, sin, cache, *args, **kwargs):
        seen.append(cache.data_ptr())
        return torch.zeros(q2d.shape[0], q2d.shape[1] // bench.HEAD_DIM, bench.HEAD_DIM, dtype=torch.bfloat16)

    def mqa_attention(q, cache, *args, tile=None, splits=None, **kwargs):
        seen.append((cache.data_ptr(), tile, splits))

    monkeypatch.setattr(bench, "attention", types.SimpleNamespace(rope_qkv=rope_qkv, mqa_attention=mqa_attention))
    rope, attend, cache = bench._calls("decode", 2, 1, 1024, device="cpu")  # 1 MB of keys: 160 copies
    copies = rope.period
    assert copies * cache.numel() * 2 >= harness.L2_DEFEAT_BYTES
    seen.clear()
    for _ in range(copies + 1):
        rope()
    assert len(set(seen[:copies])) == copies and seen[copies] == seen[0] == cache.data_ptr()
    call = attend((16, 16), 3)
    seen.clear()
    for _ in range(copies):
        call()
    assert len({ptr for ptr, _, _ in seen}) == copies and {(t, n) for _, t, n in seen} == {((16, 16), 3)}


def test_plan():
    bench = _load_benchmark("attention")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)

    def plan(*argv):
        return bench.plan(harness.apply_quick(parser.parse_args(argv)))

    assert plan("--quick") == [("decode", 64, m, 1024) for m in (1, 16, 64)]
    cases = plan("--heads", "16", "--rows", "1", "4", "--contexts", "512", "--prefill", "128")
    assert cases == [("decode", 16, 1, 512), ("decode", 16, 4, 512), ("prefill", 16, 128, 128)]
    # an option given explicitly wins over --quick, before or after it
    assert plan("--rows", "2", "--quick") == plan("--quick", "--rows", "2") == [("decode", 64, 2, 1024)]
    assert len(plan()) == len(bench.HEADS) * (len(bench.CONTEXTS) * len(bench.ROWS) + 1)


def test_tiles_option_and_report(tmp_path):
    bench = _load_benchmark("attention")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["--tiles", "32x64", "64X32"]).tiles == [(32, 64), (64, 32)]
    for bad in ("64", "0x0", "48x64", "64x8"):  # mqa_attention takes powers of two >= 16
        with pytest.raises(SystemExit):
            parser.parse_args(["--tiles", bad])
    record = dict(phase="decode", heads=64, M=1, context=1024, rope_us=1.0, attention_us=10.0, split_us=8.0,
                  merge_us=2.0, key_splits=8, bytes=1, flops=1, floor_us=1.0, floor_fraction=0.1, kernels={})
    record.update({"attention_us[64x32]": 5.0, "key_splits[64x32]": 2})
    text = bench.report({"date": "today"}, [record], tmp_path)
    header, _, row = text.splitlines()[1:4]
    assert header.endswith("| attention_us[64x32] | key_splits[64x32] |")
    assert row.endswith("| 5 | 2 |")
    assert (tmp_path / "attention.json").exists() and (tmp_path / "attention.png").exists()


def test_splits_option_and_report(tmp_path):
    bench = _load_benchmark("attention")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["--splits", "2", "4"]).splits == [2, 4]
    for bad in ("0", "-3"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--splits", bad])
    record = dict(phase="decode", heads=64, M=16, context=1024, rope_us=1.0, attention_us=30.0, split_us=20.0,
                  merge_us=9.0, key_splits=4, bytes=1, flops=1, floor_us=1.0, floor_fraction=0.1, kernels={})
    record.update({"attention_us[splits=2]": 40.0, "attention_us[splits=8]": 37.0})
    header, _, row = bench.report({"date": "today"}, [record], tmp_path).splitlines()[1:4]
    assert header.endswith("| attention_us[splits=2] | attention_us[splits=8] |")
    assert row.endswith("| 40 | 37 |")


def test_records_hold_the_roofline_against_the_attention_time(monkeypatch):
    """Without a GPU: ``run`` with the rope timed 3 us and the attention 20 us. The floor is the
    larger of the case's bytes at the copy bandwidth and its flops at the matmul rate (here the
    flops), ``floor_fraction`` that floor over the attention's time."""
    import types

    from helpers import TorchWithGpu

    bench = _load_benchmark("attention")
    real_calls = bench._calls

    def calls(phase, heads, tokens, context, device="cuda"):
        rope, attend, cache = real_calls(phase, heads, tokens, context, device="cpu")
        rope.kind = "rope"
        return rope, lambda tile=None, splits=None: types.SimpleNamespace(kind="attention", tile=tile), cache

    monkeypatch.setattr(bench, "torch", TorchWithGpu("torch"))
    monkeypatch.setattr(bench, "_calls", calls)
    monkeypatch.setattr(harness, "copies_past_l2", lambda nbytes, most=64: 1)
    monkeypatch.setattr(harness, "bench_meta", lambda: {"device": "fake"})
    monkeypatch.setattr(harness, "copy_bandwidth", lambda: 2e12)
    monkeypatch.setattr(harness, "bf16_matmul_rate", lambda: 1e12)  # slow products: flops bound
    monkeypatch.setattr(harness, "graph_time_us",
                        lambda fn, iters=100, repeats=7: {"rope": 3.0, "attention": 20.0}[fn.kind])
    monkeypatch.setattr(harness, "kernel_profile", lambda fn: {"_mqa_split_kernel": {"launches": 1, "us": 15.0}})
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = harness.apply_quick(parser.parse_args(["--heads", "16", "--rows", "1", "--contexts", "64",
                                                  "--prefill", "0"]))
    (record,) = bench.run(args)[1]
    nbytes, flops = bench.roofline("decode", 1, 16, bench.HEAD_DIM, 64)
    assert (record["rope_us"], record["attention_us"], record["bytes"], record["flops"]) == (3.0, 20.0, nbytes, flops)
    assert flops / 1e12 > nbytes / 2e12
    assert record["floor_us"] == pytest.approx(flops / 1e12 * 1e6)
    assert record["floor_fraction"] == pytest.approx(record["floor_us"] / 20.0)
    assert (record["split_us"], record["merge_us"]) == (15.0, 0.0)


def test_counts_must_be_positive():
    bench = _load_benchmark("attention")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    for argv in (["--contexts", "0"], ["--heads", "0"], ["--rows", "0"], ["--iters", "0"], ["--prefill", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
