"""The `fp8chain` command: help texts, verify on the CPU, clear refusals without a GPU."""

import pytest
import torch

from fp8chain import cli, verify

pytestmark = pytest.mark.cpu


def test_help_of_every_command(capsys):
    for argv in (["--help"], ["bench", "--help"], ["verify", "--help"], ["demo", "--help"]) + tuple(
            ["bench", name, "--help"] for name in cli.BENCHMARKS):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "usage:" in out
        if argv[0] == "bench" and len(argv) == 3:  # the benchmark's docstring: what it times
            assert cli._load_benchmark(argv[1]).__doc__.strip().splitlines()[0] in out
        if argv == ["bench", "layer", "--help"]:
            assert "unchained_best_stats" in out  # the arms are listed


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_bench_refuses_without_gpu(capsys):
    assert cli.main(["bench", "quant", "--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_verify_passes_and_reports_a_broken_kernel(monkeypatch, capsys):
    assert verify.run_checks(quick=True)

    def broken(device, quick):
        raise AssertionError("fmt x T=1")

    monkeypatch.setitem(verify.CHECKS, "quantize", broken)
    assert not verify.run_checks(quick=True)
    assert "[FAIL] quantize" in capsys.readouterr().out


def test_info_lists_backends(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("triton", "torch_blockwise", "deep_gemm"):
        assert name in out
    assert "programmatic dependent launch: off (needs sm_90+" in out  # CPU
    assert "mHC boundary row barrier at decode: off (the Triton interpreter" in out
    assert "SGLang plugin: sglang.srt.plugins entry point registered (fp8chain.integrations.sglang:install)" in out


@pytest.mark.parametrize("argv", [["demo", "--prompts", "0"], ["demo", "--tokens", "-2"], ["demo", "--layers", "x"],
                                  ["bench", "layer", "--rows", "0"], ["bench", "layer", "--iters", "-1"],
                                  ["bench", "attention", "--prefill", "-5"], ["bench", "quant", "--cols", "0"]])
def test_counts_must_be_positive(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "integer" in capsys.readouterr().err
