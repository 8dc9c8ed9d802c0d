"""At DSv4.1-Flash dimensions on the GPU, the layer benchmark's unit computes the same bits with
the chain on and off, at the token counts where different GEMM kernels serve (one token: the
GEMV for the problems of ``gemv.GEMV_TABLE``; four: the tensor-core GEMM)."""

import pytest
import torch

from fp8chain.cli import _load_benchmark
from fp8chain_kernel import reference
from helpers import assert_pairs_equal

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shapes", ["tp1", "tp4"])
def test_flash_unit_chain_on_equals_off_gpu(shapes):
    bench = _load_benchmark("layer")
    config = bench.layer_config(shapes)
    layer = bench.build_layer(config, "cuda")
    for rows in (1, 4):
        unit = bench.LayerUnit(layer, config, rows, 256, "cuda")
        with torch.no_grad():
            unit.set_chain(True)
            kv_before = unit.kv_cache.clone()
            residual_on, x_on, pair_on = unit.step()
            unit.kv_cache.copy_(kv_before)
            unit.set_chain(False)
            residual_off, x_off, _ = unit.step()
        assert torch.isfinite(x_on.float()).all(), rows
        assert torch.equal(residual_on, residual_off) and torch.equal(x_on, x_off), rows
        assert_pairs_equal(pair_on, reference.quantize(x_on, layer.attn.wqkv_a.input_format))
