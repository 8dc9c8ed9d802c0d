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
