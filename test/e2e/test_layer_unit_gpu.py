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
        assert_unit_chain_on_equals_off(bench.LayerUnit(layer, config, rows, 256, "cuda"))
