"""The layer benchmark's timed unit (attention + shared expert + mHC boundaries) computes the
same bits with the chain on and off, and the chained unit writes the next layer's pair."""

import importlib.util
from pathlib import Path

import pytest
import torch

from fp8chain_kernel import reference
from helpers import assert_pairs_equal

pytestmark = pytest.mark.cpu


def _layer_benchmark():
    path = Path(__file__).resolve().parents[2] / "benchmark" / "layer.py"
    spec = importlib.util.spec_from_file_location("layer_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("shapes,rows", [("tp1", 1), ("tp4", 3)])
def test_unit_chain_on_equals_off(shapes, rows):
    bench = _layer_benchmark()
    config = bench.layer_config(shapes, tiny=True)
    layer = bench.build_layer(config, "cpu")
    unit = bench.LayerUnit(layer, config, rows, 16, "cpu")
    with torch.no_grad():
        unit.set_chain(True)
        kv_before = unit.kv_cache.clone()
        residual_on, x_on, pair_on = unit.step()
        unit.kv_cache.copy_(kv_before)
        unit.set_chain(False)
        residual_off, x_off, pair_off = unit.step()
    assert torch.isfinite(x_on.float()).all()
    assert torch.equal(residual_on, residual_off) and torch.equal(x_on, x_off)
    assert pair_off is None
    assert_pairs_equal(pair_on, reference.quantize(x_on, layer.attn.wqkv_a.input_format))
    assert bench.weight_bytes(layer) > 0


def test_kernel_breakdown_lists_the_costliest_kernels_first():
    bench = _layer_benchmark()
    kernels = {"_quantize_kernel": {"launches": 5, "us": 7.5}, "gemm_kernel": {"launches": 2, "us": 30.0},
               "tiny": {"launches": 1, "us": 0.5}}
    line = bench.kernel_breakdown([{"shapes": "tp1", "phase": "decode", "M": 4, "chained_kernels": kernels}], top=2)
    assert line.startswith("- tp1 decode M=4: kernels 38.0 us: gemm_kernel 30.0 (2); _quantize_kernel 7.5 (5)")
    assert "tiny" not in line
