"""The producers benchmark's launch-shape sweep: its candidates and report (timing needs a GPU)."""

import argparse
import json

import pytest
import torch

from fp8chain.bench import harness
from fp8chain.cli import _load_benchmark
from fp8chain_kernel import act, norm
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat, QuantizedActivation
from fp8chain_kernel.reference.norm import add_residual, rms_norm_fp32
from helpers import assert_close_bf16, assert_pairs_equal, poisoned_pair


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
                        (["--sweep-wo-a", "--rows", "256", "2048"], "no wo_a producer at T <= 64"),
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


def test_wo_a_sweep_report_keeps_the_fastest_config(tmp_path):
    from fp8chain.cli import _load_benchmark

    bench = _load_benchmark("producers")
    records = [dict(producer="wo_a_g8", T=1, fp8_us=3.0, floor_us=1.0, config="table"),
               dict(producer="wo_a_g8", T=1, fp8_us=2.0, floor_us=1.0, config={"BLOCK_M": 16}),
               dict(producer="wo_a_g8", T=1, fp8_us=2.5, floor_us=1.0, config={"BLOCK_M": 64})]
    rows = bench.report({"sweep": "wo_a"}, records, tmp_path).splitlines()[3:]
    assert rows == ["| wo_a_g8 | 1 | 2 | 1 | {'BLOCK_M': 16} |"]
