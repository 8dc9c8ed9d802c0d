"""Programmatic dependent launch: when kernels use it, and that it changes no byte (GPU)."""

import pytest
import torch
import triton
import triton.language as tl

from fp8chain_kernel import launch
from fp8chain_kernel.gemm import fp8_gemm
from fp8chain_kernel.mhc import mhc_mega_boundary
from fp8chain_kernel.norm import rms_norm


@pytest.mark.cpu
def test_off_on_the_interpreter_and_without_a_gpu():
    assert not launch.supported()
    with launch.programmatic_launches():
        assert launch.pdl_options(torch.device("cpu")) == {"PDL": False}


@pytest.mark.cpu
def test_on_by_default_where_supported(monkeypatch):
    """Default on; FP8CHAIN_PDL=0 turns it off; blocks override both and nest."""
    monkeypatch.setattr(launch, "supported", lambda: True)
    monkeypatch.delenv("FP8CHAIN_PDL", raising=False)
    assert launch.pdl_options(torch.device("cpu")) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("FP8CHAIN_PDL", "0")
    assert launch.pdl_options(torch.device("cpu")) == {"PDL": False}
    with launch.programmatic_launches():
        assert launch.enabled()
        with launch.programmatic_launches(False):
            assert not launch.enabled()
        assert launch.enabled()
    assert not launch.enabled()


@pytest.mark.cpu
def test_a_launch_on_tensors_of_another_cuda_device_is_refused(monkeypatch):
    """Triton launches on the current device whatever device the tensors are on: every launch asks
    ``pdl_options`` with its tensors' device, which refuses one that is not current."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert launch.pdl_options(torch.device("cuda", 0)) == {"PDL": False}
    with pytest.raises(ValueError, match=r"tensors are on cuda:1 but cuda:0 is the current device.*on_device"):
        launch.pdl_options(torch.device("cuda", 1))


@pytest.mark.cpu
def test_a_workspace_is_one_buffer_per_user_and_device(monkeypatch):
    monkeypatch.setattr(launch, "_workspaces", {})
    first = launch.zeroed_workspace("test", torch.device("cpu"), 8, torch.int64)
    assert launch.zeroed_workspace("test", torch.device("cpu"), 4, torch.int64) is first
    for numel, dtype in ((16, torch.int64), (8, torch.int32)):  # a caller that disagrees is a bug
        with pytest.raises(RuntimeError, match="workspace 'test'"):
            launch.zeroed_workspace("test", torch.device("cpu"), numel, dtype)


@pytest.mark.cpu
def test_sm_count_stand_in_off_the_gpu(monkeypatch):
    """Off a GPU each caller's stand-in sizes the launch; on one the device's own count is asked."""
    assert launch.sm_count(torch.device("cpu"), interpreter=7) == 7
    monkeypatch.setattr(launch, "_multiprocessors", lambda index: 78)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    assert launch.sm_count(torch.device("cuda", 1), interpreter=7) == 78
    monkeypatch.setattr(launch, "interpreting", lambda: True)
    assert launch.sm_count(torch.device("cuda", 1), interpreter=7) == 7


@pytest.mark.cpu
def test_arrival_counters_one_zeroed_buffer_per_user():
    """Each user gets one zeroed buffer per device, the same one on every later call (a captured
    graph reuses the buffer its eager warm-up made: no zeroing node per launch)."""
    cpu = torch.device("cpu")
    gemm_counters = launch.arrival_counters("test-gemm", cpu, 8)
    assert gemm_counters.dtype == torch.int32 and gemm_counters.numel() == launch.ARRIVAL_SLOTS
    assert not gemm_counters.any()
    assert launch.arrival_counters("test-gemm", cpu, 8) is gemm_counters
    assert launch.arrival_counters("test-boundary", cpu, 8) is not gemm_counters


@pytest.mark.gpu
def test_a_workspace_first_made_inside_capture_is_not_cached():
    """A first use inside CUDA-graph capture gets a buffer of the graph's own, zeroed by it at every
    replay; the cache stays empty, so the next eager use makes (and keeps) a buffer outside the pool."""
    dev = torch.empty(0, device="cuda").device
    user = "test-first-use-in-capture"
    launch._workspaces.pop((user, dev), None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = launch.zeroed_workspace(user, dev, 8, torch.int32)
        captured.add_(1)
    assert (user, dev) not in launch._workspaces
    eager = launch.zeroed_workspace(user, dev, 8, torch.int32)
    assert eager.data_ptr() != captured.data_ptr() and not eager.any()
    assert launch.zeroed_workspace(user, dev, 8, torch.int32) is eager
    for _ in range(2):  # zeroed, then bumped once, at each replay
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, torch.ones_like(captured))
    assert not eager.any()
    launch._workspaces.pop((user, dev), None)


@triton.jit
def _split_sum_kernel(vals_ptr, out_ptr, part_ptr, count_ptr, REVERSED: tl.constexpr, SPLIT: tl.constexpr,
                      ROWS: tl.constexpr, COLS: tl.constexpr):
    """Each program publishes the partial of one K slice of one tile; REVERSED hands the slices to
    the programs in reverse, so slice 0 arrives last where programs start in grid order."""
    tile = tl.program_id(0)
    tiles = tl.num_programs(0)
    slice_ = SPLIT - 1 - tl.program_id(1) if REVERSED else tl.program_id(1)
    local = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    acc = tl.load(vals_ptr + (slice_ * tiles + tile) * ROWS * COLS + local)
    if launch.publish_partial(acc, part_ptr, count_ptr, tile, tiles, slice_, SPLIT, ROWS, COLS):
        tl.store(out_ptr + tile * ROWS * COLS + local, launch.gather_partials(part_ptr, tile, tiles, SPLIT, ROWS, COLS))
        launch.rearm(count_ptr, tile)


def _check_split_sums_in_slice_order(device):
    """The tile the last slice finishes is the fp32 sum of the partials in slice order, whichever
    slice arrives last: values of mixed magnitude make every other order give other bits."""
    split, tiles, rows, cols = 4, 3, 4, 8
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(split, tiles, rows, cols, generator=gen) * 1e8
    small = torch.randn(split, tiles, rows, cols, generator=gen)
    vals = torch.where(torch.rand(split, tiles, rows, cols, generator=gen) < 0.5, big, small).to(device)
    in_order = torch.zeros(tiles, rows, cols, device=device)
    reverse = torch.zeros_like(in_order)
    for s in range(split):
        in_order = in_order + vals[s]
        reverse = reverse + vals[split - 1 - s]
    assert (in_order != reverse).float().mean() > 0.2  # the order shows in the bits
    part = torch.empty(split * tiles * rows * cols, device=device)
    counters = torch.zeros(tiles, dtype=torch.int32, device=device)
    for reversed_ in (False, True, False, True):  # the counters re-armed between launches
        out = torch.full((tiles, rows, cols), float("nan"), device=device)
        _split_sum_kernel[(tiles, split)](vals, out, part, counters, REVERSED=reversed_, SPLIT=split,
                                          ROWS=rows, COLS=cols)
        assert torch.equal(out, in_order), reversed_
        assert not counters.any()


@pytest.mark.cpu
def test_split_partials_sum_in_slice_order_whatever_arrives_last():
    _check_split_sums_in_slice_order(torch.device("cpu"))


@pytest.mark.gpu
def test_split_partials_sum_in_slice_order_whatever_arrives_last_gpu():
    _check_split_sums_in_slice_order(torch.device("cuda"))


def _chain(y, residual, mixes, weight, w, w_scale, fmt):
    """mHC boundary (FP8 pair) -> GEMM -> RMSNorm: three dependent launches."""
    pre, post, comb = mixes
    new_residual, x, pair = mhc_mega_boundary(y, residual, pre, post, comb, weight, 1e-6, out_format=fmt)
    out = fp8_gemm(pair, w, w_scale, weight_block=32)
    return new_residual, x, pair.data, pair.scale, out, rms_norm(out, weight[: out.shape[1]], 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_programmatic_launches_change_no_byte(rows):
    """The same chain eagerly without PDL and replayed from a CUDA graph captured with it."""
    if not launch.supported():
        pytest.skip("PDL needs sm_90 or later")
    h, n = 5120, 1792
    fmt = "sm90_g32_fp32_mn"
    y = torch.randn(rows, h, device="cuda").bfloat16()
    residual = torch.randn(rows, 4, h, device="cuda").bfloat16()
    mixes = (torch.rand(rows, 4, device="cuda"), 2 * torch.rand(rows, 4, device="cuda"),
             torch.rand(rows, 4, 4, device="cuda"))
    weight = (1 + 0.1 * torch.randn(h, device="cuda")).bfloat16()
    w = (torch.randn(n, h, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    w_scale = torch.exp2(torch.randint(-10, -4, (n // 32, h // 32), device="cuda").float())
    args = (y, residual, mixes, weight, w, w_scale, fmt)
    with launch.programmatic_launches(False):
        want = _chain(*args)
    with launch.programmatic_launches():
        _chain(*args)  # compile and warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = _chain(*args)
    for t in got:  # poisoned: every element must be rewritten by the replay
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
        else:
            t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(want, got):
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b)


@pytest.mark.cpu
@pytest.mark.parametrize("major,want", [(8, False), (9, True), (10, True)])
def test_pdl_supported_from_compute_capability_9(monkeypatch, major, want):
    """Compiled kernels on a GPU of compute capability 9.0 (H100 / H200) or later support PDL."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "_capability_major", lambda index: major)
    assert launch.supported() is want


@pytest.mark.cpu
def test_split_workspace_runs_unsplit_past_the_arrival_counters(monkeypatch):
    """More tiles than ARRIVAL_SLOTS counters run unsplit; up to it, split with split x tiles partials."""
    monkeypatch.setattr(launch, "_workspaces", {})
    cpu = torch.device("cpu")
    assert launch.split_workspace("test-split", 4, launch.ARRIVAL_SLOTS + 1, 16, cpu) == (1, None, None)
    split, part, counters = launch.split_workspace("test-split", 4, launch.ARRIVAL_SLOTS, 2, cpu)
    assert split == 4 and part.numel() == 4 * launch.ARRIVAL_SLOTS * 2
    assert counters.numel() >= launch.ARRIVAL_SLOTS and not counters.any()


@pytest.mark.cpu
def test_a_block_that_raises_restores_the_setting(monkeypatch):
    """``programmatic_launches`` pops its override even when its block raises."""
    monkeypatch.setattr(launch, "supported", lambda: True)
    monkeypatch.delenv("FP8CHAIN_PDL", raising=False)
    with pytest.raises(RuntimeError, match="inside"):
        with launch.programmatic_launches(False):
            raise RuntimeError("inside")
    assert launch.enabled()


@pytest.mark.cpu
def test_sm_count_asks_the_tensors_device(monkeypatch):
    """Launch shapes are sized against the SMs of the tensors' GPU (the current one for a device
    without an index), and never against a GPU for CPU tensors."""
    monkeypatch.setattr(launch, "_multiprocessors", {0: 132, 1: 78}.__getitem__)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert launch.sm_count(torch.device("cuda", 1), interpreter=7) == 78
    assert launch.sm_count(torch.device("cuda", 0), interpreter=7) == 132
    assert launch.sm_count(torch.device("cuda"), interpreter=7) == 132
    assert not launch.compiled_for_gpu(torch.device("cpu"))
    assert launch.sm_count(torch.device("cpu"), interpreter=7) == 7


@pytest.mark.cpu
def test_on_device_switches_to_a_cuda_device_only():
    """``on_device`` makes a CUDA device current (a ``torch.cuda.device`` block), nothing for another
    device type (the block is only entered on a GPU)."""
    block = launch.on_device(torch.device("cuda", 1))
    assert isinstance(block, torch.cuda.device) and block.idx == 1
    assert not isinstance(launch.on_device(torch.device("cpu")), torch.cuda.device)


@pytest.mark.cpu
def test_interpreting_follows_triton_interpret(monkeypatch):
    """``interpreting`` reads Triton's own TRITON_INTERPRET setting (compiled kernels where it is off)."""
    from fp8chain_kernel.fp8_tile import interpreting

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreting()


@pytest.mark.cpu
def test_registers_per_thread_keeps_the_programs_resident():
    """The cap for N programs of W warps on one SM: a multiple of 8, at most 255, N programs fit in
    65536 registers and N with 8 more registers each would not."""
    for programs, warps in ((3, 4), (2, 4), (1, 8), (4, 4), (5, 2)):
        cap = launch.registers_per_thread(programs, warps)
        threads = programs * warps * 32
        assert cap % 8 == 0 or cap == 255
        assert cap * threads <= 65536 and (cap == 255 or (cap + 8) * threads > 65536), (programs, warps)
    assert launch.registers_per_thread(3, 4) == 168 and launch.registers_per_thread(2, 4) == 255
