"""The GEMM benchmark's sweep candidates (its timing needs a GPU)."""

import argparse

import pytest

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
    (["--precompile", "-1"], r"--precompile must be >= 0"),
])
def test_list_options_are_checked_before_any_gpu_work(argv, match):
    bench, args = _sweep_args(*argv)
    with pytest.raises(SystemExit, match=match):
        bench.check_lists(args)
    bench.check_lists(_sweep_args("--ms", "1,16", "--groups", "128")[1])  # valid lists pass


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
