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
    for rows in (1, 2, 3, 4, 5):  # 2: the GEMV's two-token table entries
        assert_unit_chain_on_equals_off(bench.LayerUnit([layer], config, rows, 256, "cuda"))


def test_flash_unit_stats_fork_changes_no_bit_gpu():
    """TP1 unit in captured graphs: with the mHC stats forked beside the attention core (the default
    at these M), before wqkv_a, or in line, each replay on fresh inputs gives the bits of an eager
    step with the stats in line on those inputs (a join that missed the side stream would let the
    boundary read the previous replay's stats: with fresh inputs those differ)."""
    import contextlib

    import torch

    bench = _load_benchmark("layer")
    config = bench.layer_config("tp1")
    layer = bench.build_layer(config, "cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)

    def fresh_inputs(unit):
        unit.residual.copy_(torch.randn(unit.residual.shape, device="cuda", generator=generator))
        unit.x.copy_(torch.randn(unit.x.shape, device="cuda", generator=generator))
        unit.set_chain(True)  # the attention input pair, re-quantized into its captured buffer

    for rows in (1, 4):
        unit = bench.LayerUnit([layer], config, rows, 256, "cuda")
        assert rows <= layer.attn.stats_beside_core_tokens
        with torch.no_grad():
            unit.set_chain(True)
            variants = (("beside_core", contextlib.nullcontext),
                        ("at_start", lambda: bench.stats_at_sublayer_start([layer])),
                        ("in_line", lambda: bench.stats_in_line([layer])))
            for name, variant in variants:
                with variant():
                    out = {}
                    graph = bench.harness.capture_graph(lambda: out.update(step=unit.step()), iters=1)
                previous = None
                for trial in range(4):
                    fresh_inputs(unit)
                    graph.replay()
                    torch.cuda.synchronize()
                    replayed = [t.clone() for t in out["step"][:2]]
                    with bench.stats_in_line([layer]):
                        eager = unit.step()[:2]
                    torch.cuda.synchronize()
                    assert all(torch.equal(a, b) for a, b in zip(replayed, eager)), (name, rows, trial)
                    assert previous is None or not torch.equal(replayed[0], previous[0]), (name, rows, trial)
                    previous = replayed
