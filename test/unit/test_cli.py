"""The `fp8chain` command: help texts, verify on the CPU, clear refusals without a GPU."""

import argparse
import json

import pytest
import torch

from fp8chain import cli, verify
from fp8chain_kernel import reference as ref

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


def test_bench_all_without_benchmark_scripts_fails(tmp_path, monkeypatch, capsys):
    """An install without the benchmark/ scripts: `bench all` says nothing ran and fails."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "BENCH_DIR", tmp_path)
    assert cli.main(["bench", "all", "--results-dir", str(tmp_path / "results")]) == 1
    captured = capsys.readouterr()
    assert "[skip] benchmark/layer.py is not in this checkout" in captured.out
    assert f"no benchmark ran: {tmp_path} holds none" in captured.err


def test_verify_passes_and_reports_a_broken_kernel(monkeypatch, capsys):
    assert verify.run_checks(quick=True)

    def broken(device, quick):
        raise AssertionError("fmt x T=1")

    monkeypatch.setitem(verify.CHECKS, "quantize", broken)
    assert not verify.run_checks(quick=True)
    assert "[FAIL] quantize" in capsys.readouterr().out


def _break(monkeypatch, module, name, wrong):
    """``module.name`` replaced by ``wrong(real, *args, **kwargs)``."""
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: wrong(real, *args, **kwargs))


def _norm_without_weight(real, x, weight, eps, **kwargs):
    return real(x, torch.ones_like(weight), eps, **kwargs)


def _swiglu_swapped(real, gate_up, **kwargs):
    return real(gate_up.roll(gate_up.shape[-1] // 2, dims=-1), **kwargs)


def _einsum_negated(real, o, wo_a, **kwargs):
    return real(o, -wo_a, **kwargs)


def _boundary_without_post(real, y, residual, pre, post, *args, **kwargs):
    return real(y, residual, pre, post * 0, *args, **kwargs)


def _rope_without_kv_weight(real, *args, kv_weight=None, **kwargs):
    return real(*args, **kwargs)


@pytest.mark.parametrize("module,name,wrong,check", [
    ("norm", "rms_norm", _norm_without_weight, "producers"),
    ("act", "silu_mul", _swiglu_swapped, "producers"),
    ("einsum", "wo_a_einsum", _einsum_negated, "wo_a + mhc"),
    ("mhc", "mhc_mega_boundary", _boundary_without_post, "wo_a + mhc"),
    ("attention", "rope_qkv", _rope_without_kv_weight, "attention"),
], ids=["rms_norm", "silu_mul", "wo_a", "mhc", "rope_qkv"])
def test_verify_fails_a_kernel_that_computes_wrong(module, name, wrong, check, monkeypatch):
    """Each check compares its kernels' outputs with the reference, not only the FP8 pair with the
    kernel's own (wrong) bf16 output: a kernel computing the wrong thing consistently fails it."""
    import importlib

    _break(monkeypatch, importlib.import_module(f"fp8chain_kernel.{module}"), name, wrong)
    with pytest.raises(AssertionError):
        verify.CHECKS[check](torch.device("cpu"), True)


def _hiding_nan(real, x, *args, **kwargs):
    return real(x.nan_to_num(0.0), *args, **kwargs)


@pytest.mark.parametrize("module,name,check", [
    ("norm", "rms_norm", "producers"),
    ("act", "silu_mul", "producers"),
    ("einsum", "wo_a_einsum", "wo_a + mhc"),
    ("mhc", "mhc_mega_boundary", "wo_a + mhc"),
])
def test_verify_fails_a_producer_that_hides_nan(module, name, check, monkeypatch):
    """A producer that turns a NaN (or an infinity) of its input into finite values fails its
    check: verify feeds every producer rows holding NaN and +-inf."""
    import importlib

    _break(monkeypatch, importlib.import_module(f"fp8chain_kernel.{module}"), name, _hiding_nan)
    with pytest.raises(AssertionError, match="NaN / inf row came out finite"):
        verify.CHECKS[check](torch.device("cpu"), True)


def test_verify_reports_a_check_that_raises_and_runs_the_rest(monkeypatch, capsys):
    ran = []

    def raises(device, quick):
        raise RuntimeError("launch failed")

    def passes(device, quick):
        ran.append(True)
        return "fine"

    monkeypatch.setattr(verify, "CHECKS", {"first": raises, "second": passes})
    assert not verify.run_checks(quick=True)
    out = capsys.readouterr().out
    assert "[FAIL] first" in out and "RuntimeError: launch failed" in out
    assert "[ok  ] second" in out and ran == [True]


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("argv", [["demo", "--device", "cpu"], ["demo", "--device=cpu", "--layers", "1"], ["demo"],
                                  ["info"], ["bench", "layer", "--rows", "1"]])
def test_kernels_load_for_the_interpreter_where_they_run_on_cpu(monkeypatch, argv, gpu):
    """Without a GPU every command, and with one `demo --device cpu`, runs the kernels on the
    Triton interpreter: TRITON_INTERPRET=1 before any kernel module loads."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    cli._use_interpreter_for_cpu(cli._named(argv))
    import os

    on_cpu = not gpu or (argv[0] == "demo" and any("cpu" in a for a in argv))
    assert os.environ.get("TRITON_INTERPRET") == ("1" if on_cpu else None)


def test_only_bench_loads_the_benchmark_scripts(monkeypatch):
    """demo, verify and info parse without loading benchmark/*.py (a broken benchmark script cannot
    break them, and they start faster); bench loads them for its options."""
    def refuse(name):
        raise AssertionError(f"benchmark/{name}.py loaded")

    import os

    monkeypatch.setattr(cli, "_load_benchmark", refuse)
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))  # main may set it
    for argv in (["info"], ["verify", "--quick"], ["demo", "--layers", "1"]):
        with pytest.raises(SystemExit) as exit_info:  # the whole parse, through main
            cli.main([*argv, "--help"])
        assert exit_info.value.code == 0
    with pytest.raises(AssertionError, match="loaded"):
        cli.main(["bench", "layer", "--help"])


def test_demo_on_cpu_refuses_kernels_loaded_for_the_gpu(monkeypatch):
    import argparse
    import importlib

    from fp8chain.runtime import demo

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as if the kernels had loaded without it
    importlib.import_module("fp8chain_kernel.quant")
    with pytest.raises(SystemExit, match="loaded for the GPU"):
        demo.run_demo(argparse.Namespace(device="cpu", prompts=1, tokens=1, seed=0, layers=1, out=None, eager=False))


def test_info_lists_backends(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("triton", "torch_blockwise", "deep_gemm"):
        assert name in out
    assert "programmatic dependent launch: off (needs sm_90+" in out  # CPU
    assert "mHC boundary row barrier at decode: off (the Triton interpreter" in out
    assert "triton release: tested (fp8chain tests 3.6 and 3.8; launch tables swept under 3.6)" in out
    from fp8chain_kernel import launch
    past_swept = launch.triton_release() > launch.SWEPT_RELEASE
    where = "" if past_swept else " where the token scales' stride is not a multiple of 16"
    assert f"M = 64 GEMM entries capped at 168 registers{where}," in out
    assert f"M-bucket-256 entries capped {'for the gate_up with the SiLU*mul epilogue' if past_swept else 'on padded token-scale rows'}," in out
    assert f"mHC stats finish: {'one token' if past_swept else 'up to 256 tokens'} a program" in out
    assert f"mHC stats partial sums at decode: {'unpipelined' if past_swept else 'pipelined'}" in out
    assert "SGLang plugin: sglang.srt.plugins entry point registered (fp8chain.integrations.sglang:install)" in out
    assert "on cpu: feeds DeepSeek-V4's wqkv_a, wq_b, wo_b and shared-expert gate_up_proj and down_proj from fp8chain's producers" in out


@pytest.mark.parametrize("argv", [["demo", "--prompts", "0"], ["demo", "--tokens", "-2"], ["demo", "--layers", "x"],
                                  ["bench", "layer", "--rows", "0"], ["bench", "layer", "--iters", "-1"],
                                  ["bench", "attention", "--prefill", "-5"], ["bench", "quant", "--cols", "0"]])
def test_counts_must_be_positive(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "integer" in capsys.readouterr().err


def test_demo_runs_on_cpu_and_writes_its_summary(tmp_path, capsys):
    """One new token (no decode step): both arms prefill, the tokens agree, the rate reads n/a,
    and ``--out`` gets demo.json and the checkpoint."""
    import argparse
    import json

    from fp8chain.runtime import demo

    args = argparse.Namespace(device="cpu", prompts=2, tokens=1, seed=3, layers=1, out=str(tmp_path / "out"),
                              eager=False)
    assert demo.run_demo(args) == 0
    out = capsys.readouterr().out
    assert "0 decode steps in 0.00 s (n/a)" in out and "tokens identical with the chain on and off: YES" in out
    summary = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert summary["identical"] and summary["quantize_saved_per_step"] == 5
    assert (tmp_path / "out" / "checkpoint" / "config.json").exists()


@pytest.mark.parametrize("seed", ["-1", str(2**63), str(2**64)])
def test_demo_seed_names_one_checkpoint(seed, capsys):
    """torch's generator folds a negative seed onto a large one and refuses 2**64: a seed outside
    [0, 2**63) is refused by the parser."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--seed", seed])
    assert exit_info.value.code == 2
    assert "is not a seed in [0, 2**63)" in capsys.readouterr().err


def test_demo_refuses_an_out_path_that_is_a_file_or_empty(tmp_path):
    import argparse

    from fp8chain.runtime import demo

    afile = tmp_path / "afile"
    afile.write_text("")
    for out, why in ((str(afile), ".*afile: exists and is not a directory"), ("", "'': an empty path")):
        with pytest.raises(SystemExit, match=f"demo --out {why}"):
            demo.run_demo(argparse.Namespace(device="cpu", prompts=1, tokens=1, seed=0, layers=1, out=out,
                                             eager=False))


def test_bench_and_demo_refuse_a_directory_they_cannot_write_before_running(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for target, why in ((afile, f"{afile}: exists and is not a directory"),
                        (afile / "sub", f"{afile / 'sub'}: {afile} is not a directory"), ("", "'': an empty path")):
        for argv in (["bench", "quant", "--results-dir", str(target)], ["bench", "all", "--results-dir", str(target)],
                     ["demo", "--out", str(target)]):
            with pytest.raises(SystemExit) as exit_info:
                cli.main(argv)
            assert exit_info.value.code == 2
            assert f"cannot write to {why}" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--layers", "100000000000"], "is not an integer from 1 to 64"),
    (["--tokens", "1000000000000"], "is not an integer from 1 to 4084"),
    (["--prompts", "100000000"], "is not an integer from 1 to 256"),
])
def test_demo_refuses_sizes_it_cannot_hold(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_demo_token_cap_is_the_tiny_models_positions():
    from fp8chain.models.deepseek_v41 import DeepseekV41Config
    from fp8chain.runtime import demo

    assert demo.MAX_POSITIONS == DeepseekV41Config.tiny().max_position_embeddings
    assert max(len(p) for p in demo._prompts(64, 512, 0)) <= demo.LONGEST_PROMPT


@pytest.mark.parametrize("argv,phrase", [(["demo"], "whether they are identical"), (["verify"], "Exit status 1"),
                                         (["info"], "finds the plugin"), (["bench"], "both arms in one process"),
                                         (["bench", "all"], "each in a process of its own")])
def test_every_command_describes_itself_in_its_help(argv, phrase, capsys):
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    assert phrase in " ".join(capsys.readouterr().out.split())  # the description, its lines joined


def test_bench_refuses_an_unwritable_default_results_dir_before_running(tmp_path, monkeypatch, capsys):
    from fp8chain.bench import harness

    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setattr(harness, "RESULTS_DIR", afile / "results")
    assert cli.main(["bench", "quant"]) == 2
    assert f"cannot write to {afile / 'results'}: {afile} is not a directory" in capsys.readouterr().err


def test_bench_markdown_lands_beside_the_json_its_report_saved(tmp_path, monkeypatch):
    """A sweep saves its JSON under its own name (e.g. gemm_sweep.json): its table goes beside it,
    not over the timing run's gemm.md."""
    import argparse
    import types

    from fp8chain.bench import harness

    def report(meta, records, results_dir):
        return f"{harness.save_results('fake_sweep', meta, records, results_dir)}\n| table |"

    fake = types.SimpleNamespace(run=lambda args: ({"date": "d"}, [{"x": 1}]), report=report)
    monkeypatch.setattr(cli, "_load_benchmark", lambda name: fake)
    cli._run_benchmark("fake", argparse.Namespace(results_dir=str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake_sweep.json", "fake_sweep.md"]
    assert "| table |" in (tmp_path / "fake_sweep.md").read_text()


def test_a_hand_set_triton_interpret_0_does_not_stop_the_cpu(monkeypatch):
    """Without a GPU the kernels run only on the interpreter: TRITON_INTERPRET=0 is overridden."""
    import os

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cli._use_interpreter_for_cpu(["demo"])
    assert os.environ["TRITON_INTERPRET"] == "1"


def _device_script(out, *args):
    """``scripts/device.sh OUT ARGS...`` run from the repository root."""
    import subprocess
    from pathlib import Path

    script = Path(cli.REPO_ROOT) / "scripts" / "device.sh"
    return subprocess.run(["bash", str(script), str(out), *args], cwd=cli.REPO_ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("mode", ["bnech", "bench:", "tests,bench"])
def test_device_script_refuses_an_unknown_mode_before_any_work(mode, tmp_path):
    """A misspelt or missing mode ran nothing and exited 0."""
    done = _device_script(tmp_path / "out", mode)
    assert done.returncode == 2 and f"unknown mode '{mode}'" in done.stderr and "usage:" in done.stderr
    assert not (tmp_path / "out").exists()


def test_device_script_takes_options_without_a_mode(tmp_path):
    """``OUTDIR --quick`` is the default mode with that option, not an unknown mode '--quick'."""
    done = _device_script(tmp_path / "out", "--quick", "--jobs", "x")
    assert done.returncode == 2 and "--jobs takes a positive integer, got 'x'" in done.stderr  # parsed as options


def test_device_script_deals_each_gpu_test_to_one_process(tmp_path):
    """``--jobs`` spreads a file's gpu tests over the processes, each test run exactly once (on a
    machine without a GPU they run as skips); a file that fails to import, or paths without a gpu
    test, fail the run. device.txt names the torch and Triton the run imports."""
    import xml.etree.ElementTree as ET

    import triton

    out = tmp_path / "out"
    done = _device_script(out, "tests", "--jobs", "3", "--", "test/kernels/test_act.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"torch {torch.__version__}, triton {triton.__version__} from " in (out / "device.txt").read_text()
    collected = [line for line in (out / "gpu-tests-collected.txt").read_text().splitlines() if "::" in line]
    ran = [[case.get("name") for case in ET.parse(out / f"gpu-tests-{k}.xml").iter("testcase")] for k in range(3)]
    assert all(len(share) >= len(collected) // 3 for share in ran)  # dealt in turn, not a file a process
    names = [name for share in ran for name in share]
    assert sorted(names) == sorted(line.split("::", 1)[1] for line in collected) and len(set(names)) == len(names)

    empty = _device_script(tmp_path / "none", "tests", "--jobs", "2", "--", "test/unit/test_cli.py")
    assert empty.returncode == 1 and "no gpu test collected under: test/unit/test_cli.py" in empty.stderr

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "test_broken.py").write_text("import a_module_that_does_not_exist\n")
    partly = _device_script(tmp_path / "partly", "tests", "--jobs", "2", "--", str(broken), "test/kernels/test_act.py")
    assert partly.returncode == 1 and "collecting the gpu tests failed" in partly.stderr
    assert (tmp_path / "partly" / "gpu-tests-1.xml").exists()  # what was collected still ran


def test_documented_maximums_are_accepted():
    from fp8chain import argtypes

    assert cli.build_parser(benchmarks=False).parse_args(["demo", "--layers", "64"]).layers == 64
    assert argtypes.seed_int(str(2**63 - 1)) == 2**63 - 1


def test_an_unwritable_output_parent_is_named(tmp_path, monkeypatch):
    from fp8chain import argtypes

    monkeypatch.setattr(argtypes.os, "access", lambda path, mode: False)
    assert "is not writable" in argtypes.output_dir_problem(tmp_path / "x")


@pytest.mark.parametrize("failing", [None, "gemm"])
def test_bench_all_forwards_its_options_and_reports_a_failure(monkeypatch, tmp_path, failing):
    import argparse
    import types

    ran = []

    def run(command):
        ran.append(command)
        return types.SimpleNamespace(returncode=1 if failing in command else 0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli.subprocess, "run", run)
    status = cli._cmd_bench(argparse.Namespace(benchmark="all", quick=True, results_dir=str(tmp_path)))
    assert len(ran) > 1 and all("--quick" in c and c[-2:] == ["--results-dir", str(tmp_path)] for c in ran)
    assert status == (1 if failing else 0)


def test_an_explicit_results_dir_is_not_refused_for_the_default_one(tmp_path, monkeypatch, capsys):
    import argparse

    from fp8chain.bench import harness

    blocker = tmp_path / "afile"
    blocker.write_text("")
    monkeypatch.setattr(harness, "RESULTS_DIR", blocker / "results")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli._cmd_bench(argparse.Namespace(benchmark="quant", quick=False, results_dir=str(tmp_path / "ok"))) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def _norm_truncating(real, x, weight, eps, *, out_format=None, **kwargs):
    """RMSNorm whose bf16 output is the fp32 value truncated (rounded toward zero), not rounded to
    nearest: up to 1 bf16 ulp off; its pair is the quantization of that (wrong) output."""
    from fp8chain_kernel.reference.norm import rms_norm_fp32

    want = rms_norm_fp32(x, weight, eps)
    y = (want.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    return (y, ref.quantize(y, out_format)) if out_format is not None else y


def test_verify_fails_a_producer_that_truncates_instead_of_rounding(monkeypatch):
    """Correct rounding is the contract (half an ulp and a little): a truncating producer, within
    one ulp everywhere, must fail the rounded check, not pass on a loose ulp bound or unit."""
    from fp8chain_kernel import norm

    _break(monkeypatch, norm, "rms_norm", _norm_truncating)
    with pytest.raises(AssertionError, match="rms_norm .* bf16 ulps from the fp32 reference"):
        verify.CHECKS["producers"](torch.device("cpu"), True)


def test_verify_compares_the_pairs_scales(monkeypatch):
    """A quantize whose FP8 data is right but whose scales are off by a factor of two fails."""
    from fp8chain_kernel import quant

    def wrong_scale(real, x, fmt, *args, **kwargs):
        pair = real(x, fmt, *args, **kwargs)
        pair.scale.view(torch.int32).bitwise_xor_(1 << 23)  # fp32: the exponent off by one
        return pair

    _break(monkeypatch, quant, "quantize", wrong_scale)
    with pytest.raises(AssertionError):
        verify.CHECKS["quantize"](torch.device("cpu"), True)


def test_verify_fails_a_quantize_that_hides_nan(monkeypatch):
    from fp8chain_kernel import quant

    _break(monkeypatch, quant, "quantize", lambda real, x, *a, **k: real(x.nan_to_num(0.0), *a, **k))
    with pytest.raises(AssertionError, match="NaN / inf rows"):
        verify.CHECKS["quantize"](torch.device("cpu"), True)


def test_verify_fails_a_norm_that_zeroes_infinities(monkeypatch):
    """A normalised row holding an infinity is NaN throughout: a norm that drops the infinity
    (its row then finite) fails, even where the NaN row stays NaN."""
    from fp8chain_kernel import norm

    _break(monkeypatch, norm, "rms_norm", lambda real, x, *a, **k: real(x.masked_fill(x.isinf(), 0), *a, **k))
    with pytest.raises(AssertionError, match="NaN / inf row came out finite"):
        verify.CHECKS["producers"](torch.device("cpu"), True)


def test_verify_fails_a_gemm_one_percent_off(monkeypatch):
    from fp8chain_kernel import gemm

    _break(monkeypatch, gemm, "fp8_gemm", lambda real, *a, weight_block, **k: real(
        *a, weight_block=weight_block, **k) * (1.02 if weight_block == 128 else 1.0))
    with pytest.raises(AssertionError, match="relative error"):
        verify.CHECKS["gemm"](torch.device("cpu"), True)


def test_verify_fails_a_router_choosing_other_experts(monkeypatch):
    """Other experts with the reference's weights: the choice itself is checked."""
    from fp8chain_kernel import router

    def shifted(real, x, weight, *args, **kwargs):
        idx, weights = real(x, weight, *args, **kwargs)
        return (idx + 1) % weight.shape[0], weights

    _break(monkeypatch, router, "router_topk", shifted)
    with pytest.raises(AssertionError, match="another expert choice"):
        verify.CHECKS["router"](torch.device("cpu"), True)


def test_verify_fails_attention_five_percent_off(monkeypatch):
    from fp8chain_kernel import attention

    _break(monkeypatch, attention, "mqa_attention", lambda real, *a, **k: real(*a, **k) * 1.05)
    with pytest.raises(AssertionError, match="attention T=1: relative error"):
        verify.CHECKS["attention"](torch.device("cpu"), True)


def test_demo_counts_per_step_and_reports_tokens_that_differ(tmp_path, monkeypatch, capsys):
    """Two new tokens (prefill + one decode step): launches saved are per forward, not the run's
    total; tokens that differ between the arms make it say NO, exit 1 and record it."""
    from fp8chain.runtime import demo
    from fp8chain.runtime.engine import Engine

    real = Engine.generate

    def generate(self, prompts, n, **kwargs):
        result = real(self, prompts, n, **kwargs)
        if not self.model.chain:
            result.tokens[0][-1] += 1
        return result

    monkeypatch.setattr(Engine, "generate", generate)
    args = argparse.Namespace(device="cpu", prompts=1, tokens=2, seed=3, layers=1, out=str(tmp_path), eager=False)
    assert demo.run_demo(args) == 1
    assert "tokens identical with the chain on and off: NO" in capsys.readouterr().out
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert summary["identical"] is False
    assert summary["quantize_saved_per_step"] == 5
    assert summary["chain_off"]["quantize_per_step"] == 5 and summary["chain_on"]["quantize_per_step"] == 0
    assert summary["chain_on"]["decode_steps"] == 1
