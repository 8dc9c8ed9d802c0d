"""At DSv4.1-Flash dimensions on the GPU, the layer benchmark's unit computes the same bits with
the chain on and off, at token counts where different GEMM kernels serve (one to four tokens: the
GEMV for the problems ``gemv.GEMV_TABLE`` holds at that token tile, the tensor-core GEMM for the
others; five: the tensor-core GEMM alone)."""

import pytest

from fp8chain.cli import _load_benchmark
from helpers import assert_unit_chain_on_equals_off

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shapes", ["tp1", "tp4"])
def test_flash_unit_chain_on_equals_off_gpu(shapes):
    bench = _load_benchmark("layer")
    config = bench.layer_config(shapes)
    layer = bench.build_layer(config, "cuda")
    for rows in (1, 3, 4, 5):
        assert_unit_chain_on_equals_off(bench.LayerUnit([layer], config, rows, 256, "cuda"))


def test_flash_unit_stats_fork_changes_no_bit_gpu():
    """TP1 unit in captured graphs, replayed: the mHC stats forked beside the attention core (the
    default at these M), before wqkv_a, or in line give the same bits, and repeated replays agree
    (a join that missed the side stream would race the boundary against the stats)."""
    import contextlib

    import torch

    bench = _load_benchmark("layer")
    config = bench.layer_config("tp1")
    layer = bench.build_layer(config, "cuda")

    for rows in (1, 4):
        unit = bench.LayerUnit([layer], config, rows, 256, "cuda")
        assert rows <= layer.attn.stats_beside_core_tokens
        results = {}
        with torch.no_grad():
            unit.set_chain(True)
            variants = (("beside_core", contextlib.nullcontext),
                        ("at_start", lambda: bench.stats_at_sublayer_start([layer])),
                        ("in_line", lambda: bench.stats_in_line([layer])))
            for name, variant in variants:
                with variant():
                    out = {}
                    graph = bench.harness.capture_graph(lambda: out.update(step=unit.step()), iters=1)
                    replays = []
                    for _ in range(20):
                        graph.replay()
                        replays.append([t.clone() for t in out["step"][:2]])
                    torch.cuda.synchronize()
                for r in replays[1:]:
                    assert all(torch.equal(a, b) for a, b in zip(r, replays[0])), (name, rows)
                results[name] = replays[0]
        for name, got in results.items():
            assert all(torch.equal(a, b) for a, b in zip(got, results["beside_core"])), (name, rows)
