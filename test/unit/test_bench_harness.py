"""The benchmark harness: weight rotation past L2, --quick's defaults, tables, results metadata."""

import argparse
import contextlib
import json
import types

import pytest
import torch

from fp8chain.bench import harness

pytestmark = pytest.mark.cpu


def test_copies_past_l2():
    """Copies add up to at least L2_DEFEAT_BYTES (past the H200's 50 MB L2 even for the smallest
    DSv4.1 shard), capped at ``most``, never fewer than one."""
    assert harness.copies_past_l2(64 << 20) == 3  # wo_a G=8: 3 x 64 MiB
    assert harness.copies_past_l2(5120 * 576) == 57  # the TP4 down shard: 57 x 2.9 MB
    assert harness.copies_past_l2(9 << 20) == 18
    assert harness.copies_past_l2(9 << 20, most=8) == 8
    assert harness.copies_past_l2(1 << 30) == 1
    for nbytes in (5120 * 576, 1152 * 5120, 8192 * 1280, 5120 * 2048):  # every TP4 shard
        assert harness.copies_past_l2(nbytes) * nbytes >= harness.L2_DEFEAT_BYTES


def test_rotating_calls_each_item_in_turn():
    seen = []
    call = harness.rotating(lambda a, b: seen.append((a, b)) or a + b, [(1, 2), (3, 4), (5, 6)])
    assert [call() for _ in range(4)] == [3, 7, 11, 3]
    assert seen == [(1, 2), (3, 4), (5, 6), (1, 2)]
    assert call.period == 3
    call.reset()
    assert call() == 3
    both = harness.followed_by(call, lambda: "after")  # an arm adding a launch turns with the rotation
    assert both() == (7, "after") and both.period == 3
    both.reset()
    assert both() == (3, "after")


def test_graphs_capture_whole_turns_from_the_first_item(monkeypatch):
    """A rotation's graph is captured from its first item on (after the warm-up calls) over whole
    turns, so two graphs replayed in turn never read one copy back to back; ``graph_calls`` rounds
    up to whole turns and ``capture_graph`` refuses a part turn."""
    import types

    seen = []
    call = harness.rotating(seen.append, [(0,), (1,), (2,)])
    assert [harness.graph_calls(call, n) for n in (1, 3, 20, 21)] == [3, 3, 21, 21]
    stream = types.SimpleNamespace(wait_stream=lambda other: None)
    fake_cuda = types.SimpleNamespace(  # capture_graph's calls, run eagerly
        is_available=lambda: True, Stream=lambda: stream, current_stream=lambda: stream,
        stream=lambda s: contextlib.nullcontext(), synchronize=lambda: None,
        CUDAGraph=lambda: types.SimpleNamespace(replay=lambda: None), graph=lambda g: contextlib.nullcontext())
    monkeypatch.setattr(harness.torch, "cuda", fake_cuda)
    for _ in range(2):  # two arms' graphs over the same copies
        assert harness.capture_graph(call, 6).calls == 6
    assert seen == [0, 1, 2] + [0, 1, 2] * 2 + [0, 1, 2] + [0, 1, 2] * 2  # warm-up, then whole turns from 0
    with pytest.raises(ValueError, match="20 calls of a rotation of 3 items"):
        harness.capture_graph(call, 20)


def test_no_timing_after_the_profiler(monkeypatch):
    """Once torch.profiler has run in a process, later replays carry CUPTI's per-kernel cost:
    ``replay_times_us`` refuses to time, naming the rule."""
    monkeypatch.setattr(harness, "_profiler_used", True)
    with pytest.raises(harness.ProfiledProcessError, match="time first, profile last"):
        harness.replay_times_us({}, iters=1)


def test_markdown_table_cells():
    """Floats to 4 significant digits (0.8996 and 0.9004 apart), lists of floats joined, missing
    and None as '-', other values as they print."""
    records = [{"M": 1, "ratio": 0.89961, "captures": [95.41, 92.66], "caps": [None, 32]},
               {"M": 2, "ratio": 0.90041, "caps": None}]
    table = harness.markdown_table(records, ["M", "ratio", "captures", "caps"]).splitlines()
    assert table[:2] == ["| M | ratio | captures | caps |", "|---|---|---|---|"]
    assert table[2] == "| 1 | 0.8996 | 95.41 / 92.66 | [None, 32] |"
    assert table[3] == "| 2 | 0.9004 | - | - |"


def test_results_name_a_dirty_checkout(tmp_path, monkeypatch):
    """Figures measured on uncommitted code say so; FP8CHAIN_COMMIT wins where it is set."""
    import subprocess

    from fp8chain.bench import harness

    monkeypatch.delenv("FP8CHAIN_COMMIT", raising=False)
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "one")
    head = git("rev-parse", "--short=7", "HEAD").stdout.decode().strip()
    assert harness._git_commit(tmp_path) == head
    (tmp_path / "f").write_text("2")
    assert harness._git_commit(tmp_path) == f"{head}-dirty"
    monkeypatch.setenv("FP8CHAIN_COMMIT", "abc1234")
    assert harness._git_commit(tmp_path) == "abc1234"


def test_quick_fills_only_the_options_not_given(capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="+", type=int, help="M values")
    parser.add_argument("--prefill", type=int, help="prefill tokens")
    harness.add_quick(parser, rows=([1, 4, 16], [1]), prefill=(2048, 0))

    def parsed(*argv):
        args = harness.apply_quick(parser.parse_args(argv))
        return args.rows, args.prefill

    assert parsed() == ([1, 4, 16], 2048)
    assert parsed("--quick") == ([1], 0)
    assert parsed("--quick", "--rows", "8") == parsed("--rows", "8", "--quick") == ([8], 0)
    assert parsed("--prefill", "2048", "--quick") == ([1], 2048)
    assert parsed("--prefill", "0") == ([1, 4, 16], 0)
    parser.print_help()
    text = " ".join(capsys.readouterr().out.split())
    assert "M values (default: 1 4 16; --quick: 1)" in text
    assert "the reduced sweep: --rows 1, --prefill 0 (an option given explicitly wins)" in text
    with pytest.raises(ValueError, match="cols"):
        harness.add_quick(argparse.ArgumentParser(), cols=([1], [2]))


def _fake_cuda_events(monkeypatch, elapsed_ms):
    """torch.cuda as replay_times_us sees it: each Event pair reports the next of ``elapsed_ms``."""
    times = iter(elapsed_ms)

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return next(times)

    monkeypatch.setattr(harness.torch, "cuda", types.SimpleNamespace(Event=Event))


def test_replay_times_are_the_median_per_call_of_alternated_rounds(monkeypatch):
    """Per call (a replay's ms / iters, in us), the median over rounds (one slow outlier round does
    not move it), the arms' replays alternated round by round."""
    replays = []
    graphs = {arm: types.SimpleNamespace(replay=lambda arm=arm: replays.append(arm)) for arm in ("a", "b")}
    # rounds of (a, b): a takes 1 ms, b 2 ms per replay of 10 calls, except one 50 ms outlier each
    _fake_cuda_events(monkeypatch, [1.0, 2.0] * 4 + [50.0, 50.0] + [1.0, 2.0] * 2)
    times = harness.replay_times_us(graphs, iters=10, rounds=7)
    assert times == {"a": pytest.approx(100.0), "b": pytest.approx(200.0)}
    assert replays == ["a", "b"] * 7


def test_replay_times_refuse_a_graph_of_another_call_count(monkeypatch):
    """A graph that ``capture_graph`` made holds its call count; timing it as another count would
    scale every per-call time by their ratio, so ``replay_times_us`` refuses before replaying."""
    replays = []
    graphs = {"a": types.SimpleNamespace(replay=lambda: replays.append("a"), calls=48)}
    _fake_cuda_events(monkeypatch, [1.0] * 7)
    with pytest.raises(ValueError, match="graph 'a' holds 48 calls, timed as 50"):
        harness.replay_times_us(graphs, iters=50)
    assert replays == []
    assert harness.replay_times_us(graphs, iters=48) == {"a": pytest.approx(1e3 / 48)}


def test_copy_bandwidth_counts_bytes_read_and_written(monkeypatch):
    """A copy of ``2 * nbytes`` moved (nbytes read + nbytes written) taking 1 us: 2 * nbytes / 1 us."""
    asked = []
    monkeypatch.setattr(harness, "copy_time_us", lambda moved, device=None, iters=100: asked.append(moved) or 1.0)
    assert harness.copy_bandwidth("cpu", nbytes=1 << 20) == pytest.approx(2 * (1 << 20) / 1e-6)
    assert asked == [2 << 20]


def test_copy_time_moves_the_bytes_it_is_asked_for(monkeypatch):
    """``copy_time_us(n)`` times a kernel that reads n / 2 bytes of bf16 and writes as many."""
    monkeypatch.setattr(harness, "graph_time_us", lambda fn, iters=100, repeats=7: fn())
    dst = harness.copy_time_us(1 << 16, device="cpu")
    assert dst.dtype == torch.bfloat16 and dst.numel() * dst.element_size() == (1 << 16) // 2


def test_quantize_launches_counts_only_the_standalone_quantize():
    """The standalone ``_quantize_kernel``, not every kernel whose name mentions quantizing."""
    assert harness.quantize_launches({"_quantize_kernel": 3, "_gemm_kernel": 7, "fused_norm_quantize": 4}) == 3


def test_save_results_keeps_the_meta(tmp_path):
    meta = {"device": "H200", "commit": "abc1234", "copy_bandwidth_TBps": 4.1}
    path = harness.save_results("x", meta, [{"M": 1}], tmp_path)
    assert path == tmp_path / "x.json"
    assert json.loads(path.read_text()) == {"meta": meta, "records": [{"M": 1}]}


def test_graph_calls_at_least_one_call():
    assert harness.graph_calls(lambda: None, 0) == 1


def test_quant_floor_reads_bf16_and_writes_the_pair():
    from fp8chain.cli import _load_benchmark
    from fp8chain_kernel.formats import ActFormat

    bench = _load_benchmark("quant")
    fmt = ActFormat.SM90_G32_FP32_MN
    assert bench.quantize_bytes(4, 512, fmt) == 4 * 512 * 2 + 4 * 512 + 4 * 16 * 4


def test_roofline_is_the_larger_of_the_byte_and_flop_times_in_us():
    assert harness.roofline_us(4e6, 2e12) == pytest.approx(2.0)  # 4 MB at 2 TB/s
    assert harness.roofline_us(4e6, 2e12, 1e9, 1e15) == pytest.approx(2.0)  # 1 us of flops: bytes bound
    assert harness.roofline_us(4e6, 2e12, 5e9, 1e15) == pytest.approx(5.0)  # 5 us of flops bound
    assert harness.roofline_us(4e6, 2e12, 5e9, None) == pytest.approx(2.0)  # no rate: bytes alone


def test_quant_records_divide_the_right_times(monkeypatch, tmp_path):
    """Without a GPU: the quant benchmark's ``run`` with each graph timed by what it calls (the
    Triton quantize 4 us, the torch reference 10 us, the copy 2 us): the floor is the case's bytes
    at the measured bandwidth, ``bw_fraction`` floor / Triton, ``copy_fraction`` copy / Triton,
    ``speedup_vs_torch`` torch / Triton."""
    from fp8chain.cli import _load_benchmark
    from fp8chain_kernel.formats import ActFormat
    from helpers import TorchWithGpu

    bench = _load_benchmark("quant")

    class GpuTorch(TorchWithGpu):  # its inputs made on the CPU whatever device is asked
        @staticmethod
        def randn(*shape, device=None, **kwargs):
            return torch.randn(*shape, **kwargs)

    copied = []
    monkeypatch.setattr(bench, "torch", GpuTorch("torch"))
    monkeypatch.setattr(bench, "empty_pair", lambda rows, cols, fmt, device: None)
    monkeypatch.setattr(bench, "quant", types.SimpleNamespace(quantize=lambda x, fmt, out=None: 4.0))
    monkeypatch.setattr(bench, "reference", types.SimpleNamespace(quantize=lambda x, fmt: 10.0))
    monkeypatch.setattr(harness, "bench_meta", lambda: {"device": "fake"})
    monkeypatch.setattr(harness, "copy_bandwidth", lambda: 2e12)
    monkeypatch.setattr(harness, "graph_time_us", lambda fn, iters=100, repeats=7: fn())
    monkeypatch.setattr(harness, "copy_time_us", lambda nbytes, iters=100: copied.append(nbytes) or 2.0)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    for argv in (["--rows", "0"], ["--cols", "0"], ["--iters", "0"], ["--formats", "fp16"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    fmt = ActFormat.SM90_G32_FP32_MN
    args = harness.apply_quick(parser.parse_args(["--formats", fmt.value, "--rows", "4", "--cols", "512"]))
    (record,) = bench.run(args)[1]
    nbytes = bench.quantize_bytes(4, 512, fmt)
    assert copied == [nbytes] and record["bytes"] == nbytes
    assert (record["triton_us"], record["torch_us"], record["copy_us"]) == (4.0, 10.0, 2.0)
    assert record["floor_us"] == pytest.approx(nbytes / 2e12 * 1e6)
    assert record["bw_fraction"] == pytest.approx(record["floor_us"] / 4.0)
    assert record["copy_fraction"] == pytest.approx(0.5) and record["speedup_vs_torch"] == pytest.approx(2.5)
