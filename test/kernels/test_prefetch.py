"""L2 weight prefetch: input checks, no launch off sm_90, and on the GPU that it runs eagerly and
in graphs, changes no byte and leaves a tensor faster to read."""

import statistics

import pytest
import torch

from fp8chain_kernel.prefetch import l2_prefetch, prefetch_supported


@pytest.mark.cpu
def test_refuses_what_it_cannot_prefetch():
    with pytest.raises(TypeError, match="takes a tensor"):
        l2_prefetch([torch.zeros(16)])
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(torch.zeros(8, 8).t())
    with pytest.raises(ValueError, match="16-byte alignment"):
        l2_prefetch(torch.zeros(64, dtype=torch.uint8)[1:17])
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        l2_prefetch(torch.zeros(3, dtype=torch.float32))


@pytest.mark.cpu
def test_launches_nothing_on_the_interpreter_or_cpu():
    assert not prefetch_supported(torch.device("cpu"))
    weight = torch.randn(64, 64)
    before = weight.clone()
    assert l2_prefetch(weight) is None
    assert torch.equal(weight, before)


def _read_us(tensor, prefetch: bool, evict: torch.Tensor, trials: int = 15) -> float:
    """Median time of one full read of ``tensor`` after L2 was flushed by writing ``evict``, with or
    without a prefetch (and a 30 us pause for it to land) before the timed read."""
    out = torch.empty((), device=tensor.device, dtype=torch.float32)
    samples = []
    for _ in range(trials):
        evict.add_(1)
        if prefetch:
            l2_prefetch(tensor)
        torch.cuda._sleep(60_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.sum(tensor, out=out)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


@pytest.mark.gpu
def test_prefetched_tensor_reads_faster_and_is_unchanged_gpu():
    if not prefetch_supported(torch.device("cuda")):
        pytest.skip("L2 bulk prefetch needs compute capability >= 9.0")
    weight = torch.randn(8 << 20, device="cuda")  # 32 MB: fits the H200's 50 MB L2
    before = weight.clone()
    evict = torch.zeros(64 << 20, device="cuda")  # 256 MB written between reads
    _read_us(weight, True, evict, trials=2)  # compile and warm up
    cold, warm = _read_us(weight, False, evict), _read_us(weight, True, evict)
    assert warm < 0.9 * cold, (warm, cold)
    assert torch.equal(weight, before)


@pytest.mark.gpu
def test_prefetch_inside_graph_capture_gpu():
    if not prefetch_supported(torch.device("cuda")):
        pytest.skip("L2 bulk prefetch needs compute capability >= 9.0")
    weight = torch.randn(1000, 1000, device="cuda")  # 4 MB: rounds past the grid's first sweep
    before = weight.clone()
    l2_prefetch(weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        l2_prefetch(weight)
        l2_prefetch(weight[:1])  # 4000 bytes: one partial chunk
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(weight, before)
