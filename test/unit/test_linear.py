"""LinearBase and its tensor-parallel variants: shard math, weight loaders, unquantized forward."""

import pytest
import torch
import torch.nn.functional as F

from fp8chain.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from fp8chain.layers.loading import load_weights
from fp8chain.layers.quantization.fp8 import Fp8Config
from fp8chain_kernel.formats import FP8_DTYPE

pytestmark = pytest.mark.cpu


def _fp8_weight(n, k):
    return (torch.randn(n, k) * 50).to(FP8_DTYPE)


def _pow2_scales(rows, cols):
    return torch.exp2(torch.randint(-12, -4, (rows, cols)).float())


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("block", [32, 128])
def test_column_parallel_shards_n(tp_size, block):
    n, k = 128 * tp_size, 256
    config = Fp8Config(weight_block_size=(block, block), scale_fmt="ue8m0")
    full_w, full_s = _fp8_weight(n, k), _pow2_scales(n // block, k // block)
    full_b = torch.randn(n).to(torch.bfloat16)
    for rank in range(tp_size):
        layer = ColumnParallelLinear(k, n, bias=True, quant_config=config, tp_rank=rank, tp_size=tp_size)
        ptrs = {name: p.data_ptr() for name, p in layer.named_parameters()}
        assert layer.weight.shape == (n // tp_size, k)
        assert layer.weight_scale_inv.shape == (n // tp_size // block, k // block)
        # full checkpoint tensors are narrowed to this rank's rows
        layer.weight_loader(layer.weight, full_w)
        layer.weight_loader(layer.weight_scale_inv, full_s)
        layer.weight_loader(layer.bias, full_b)
        rows = slice(rank * n // tp_size, (rank + 1) * n // tp_size)
        srows = slice(rank * n // tp_size // block, (rank + 1) * n // tp_size // block)
        assert torch.equal(layer.weight.view(torch.uint8), full_w[rows].view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv, full_s[srows])
        assert torch.equal(layer.bias, full_b[rows])
        # already-sharded tensors are taken as they are
        layer.weight_loader(layer.weight_scale_inv, full_s[srows] * 2)
        assert torch.equal(layer.weight_scale_inv, full_s[srows] * 2)
        assert ptrs == {name: p.data_ptr() for name, p in layer.named_parameters()}


def test_replicated_layer_under_tp_holds_any_k():
    """A replicated FP8 layer is whole on every rank: K need not split into whole blocks per rank
    (it does for RowParallel), and every rank computes what one rank alone would."""
    n, k, block = 64, 40, 32
    config = Fp8Config(weight_block_size=(block, block), scale_fmt="ue8m0")
    w, s = _fp8_weight(n, k), _pow2_scales(n // block, -(-k // block))
    x = torch.randn(3, k).to(torch.bfloat16)
    outs = []
    for tp_size in (1, 2):
        layer = ReplicatedLinear(k, n, quant_config=config, tp_rank=tp_size - 1, tp_size=tp_size)
        load_weights(layer, [("weight", w), ("weight_scale_inv", s)])
        outs.append(layer(x))
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="per-rank size 20 is not a multiple"):
        RowParallelLinear(k, n, quant_config=config, tp_rank=0, tp_size=2)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_row_parallel_shards_k(tp_size):
    n, k, block = 128, 128 * tp_size, 32
    config = Fp8Config(weight_block_size=(block, block), scale_fmt="ue8m0")
    full_w, full_s = _fp8_weight(n, k), _pow2_scales(n // block, k // block)
    full_b = torch.randn(n).to(torch.bfloat16)
    for rank in range(tp_size):
        layer = RowParallelLinear(k, n, bias=True, quant_config=config, tp_rank=rank, tp_size=tp_size)
        assert layer.weight.shape == (n, k // tp_size)
        layer.weight_loader(layer.weight, full_w)
        layer.weight_loader(layer.weight_scale_inv, full_s)
        layer.weight_loader(layer.bias, full_b)
        cols = slice(rank * k // tp_size, (rank + 1) * k // tp_size)
        scols = slice(rank * k // tp_size // block, (rank + 1) * k // tp_size // block)
        assert torch.equal(layer.weight.view(torch.uint8), full_w[:, cols].view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv, full_s[:, scols])
        assert torch.equal(layer.bias, full_b)  # bias is whole on every rank
        assert (layer.forward_bias is None) == (rank != 0)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_unquantized_row_parallel_partials_sum_to_full(tp_size):
    n, k = 48, 64
    w, b = torch.randn(n, k), torch.randn(n)
    x = torch.randn(5, k)
    total = torch.zeros(5, n)
    for rank in range(tp_size):
        layer = RowParallelLinear(k, n, bias=True, tp_rank=rank, tp_size=tp_size,
                                  params_dtype=torch.float32, reduce_results=False)
        load_weights(layer, [("weight", w), ("bias", b)])
        cols = slice(rank * k // tp_size, (rank + 1) * k // tp_size)
        total += layer(x[:, cols])
    torch.testing.assert_close(total, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_fp8_row_parallel_partials_sum_to_the_replicated_layer_with_the_bias_once(tp_size):
    """The FP8 method's row-parallel partials: only rank 0 adds the bias, so the sum over ranks
    is the replicated layer's output (the bias once), within the ranks' bf16 roundings."""
    n, k, block = 64, 256, 32
    config = Fp8Config(weight_block_size=(block, block), scale_fmt="ue8m0")
    w, s, b = _fp8_weight(n, k), _pow2_scales(n // block, k // block), torch.randn(n).to(torch.bfloat16) * 64
    x = torch.randn(3, k).to(torch.bfloat16)
    whole = ReplicatedLinear(k, n, bias=True, quant_config=config)
    load_weights(whole, [("weight", w), ("weight_scale_inv", s), ("bias", b)])
    total = torch.zeros(3, n)
    for rank in range(tp_size):
        layer = RowParallelLinear(k, n, bias=True, quant_config=config, tp_rank=rank, tp_size=tp_size,
                                  reduce_results=False)
        load_weights(layer, [("weight", w), ("weight_scale_inv", s), ("bias", b)])
        cols = slice(rank * k // tp_size, (rank + 1) * k // tp_size)
        total += layer(x[:, cols]).float()
        if rank:
            assert torch.equal(layer(torch.zeros(1, k // tp_size).to(torch.bfloat16)), torch.zeros(1, n).bfloat16())
    want = whole(x).float()
    assert ((total - want).norm() / want.norm()) < 1e-2


def test_row_parallel_without_a_process_group_refuses_to_return_partials():
    layer = RowParallelLinear(64, 32, tp_rank=0, tp_size=2)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        layer(torch.randn(2, 32).to(torch.bfloat16))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_merged_column_parallel_shards_each_part(tp_size):
    """gate and up in one weight: each rank holds its shard of gate, then its shard of up (weight,
    block scales, bias), from the full checkpoint tensor or part by part (``loaded_shard_id``)."""
    inter, k, block = 64 * tp_size, 128, 32
    config = Fp8Config(weight_block_size=(block, block), scale_fmt="ue8m0")
    full_w, full_s = _fp8_weight(2 * inter, k), _pow2_scales(2 * inter // block, k // block)
    full_b = torch.randn(2 * inter).to(torch.bfloat16)
    def shard(full, rank):  # this rank's rows of the first part, then of the second
        part = full.shape[0] // 2
        rows = part // tp_size
        return torch.cat([full[rank * rows:(rank + 1) * rows], full[part + rank * rows:part + (rank + 1) * rows]])

    for rank in range(tp_size):
        layer = MergedColumnParallelLinear(k, [inter, inter], bias=True, quant_config=config, tp_rank=rank,
                                           tp_size=tp_size)
        layer.weight_loader(layer.weight, full_w)
        layer.weight_loader(layer.weight_scale_inv, full_s)
        layer.weight_loader(layer.bias, full_b)
        assert torch.equal(layer.weight.view(torch.uint8), shard(full_w, rank).view(torch.uint8))
        assert torch.equal(layer.weight_scale_inv, shard(full_s, rank))
        assert torch.equal(layer.bias, shard(full_b, rank))
        # this rank's merged shape is ambiguous without a part id: [gate_r | up_r], a contiguous
        # slice of the full tensor, or (at TP2) one whole part: refused, the layer unchanged
        for ambiguous in (shard(full_s, rank) * 2, full_s[rank * 2 * inter // block // tp_size:][:2 * inter // block // tp_size]):
            with pytest.raises(ValueError, match="ambiguous"):
                layer.weight_loader(layer.weight_scale_inv, ambiguous)
            assert torch.equal(layer.weight_scale_inv, shard(full_s, rank))
        # one part at a time: whole, or this rank's rows of it
        gate, up = full_w[:inter], full_w[inter:]
        layer.weight_loader(layer.weight, up, loaded_shard_id=1)
        layer.weight_loader(layer.weight, gate[rank * inter // tp_size:][:inter // tp_size], loaded_shard_id=0)
        assert torch.equal(layer.weight.view(torch.uint8), shard(full_w, rank).view(torch.uint8))
        layer.weight_loader(layer.weight_scale_inv, full_s[inter // block:] * 4, loaded_shard_id=1)
        assert torch.equal(layer.weight_scale_inv[inter // block // tp_size:], shard(full_s, rank)[inter // block // tp_size:] * 4)
        assert torch.equal(layer.weight_scale_inv[:inter // block // tp_size], shard(full_s, rank)[:inter // block // tp_size])
        for bad_id in (2, -1, "1", 1.0):
            with pytest.raises(ValueError, match="loaded_shard_id must be a part index"):
                layer.weight_loader(layer.weight, up, loaded_shard_id=bad_id)
        with pytest.raises(ValueError, match="part 0 has shape"):
            layer.weight_loader(layer.weight, full_w, loaded_shard_id=0)
    with pytest.raises(ValueError, match="not divisible by tp_size"):
        MergedColumnParallelLinear(k, [inter + 1, inter - 1], tp_size=tp_size)


def test_merged_column_parallel_at_tp1_loads_parts_and_refuses_parts_of_partial_blocks():
    """At TP1 too every part is whole weight blocks (a scale row would span gate and up rows), and
    the weight, its block scales and the bias load part by part (``loaded_shard_id``)."""
    config = Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0")
    with pytest.raises(ValueError, match=r"per-rank part sizes \[48, 48\] are not multiples of the 32x32 weight block"):
        MergedColumnParallelLinear(128, [48, 48], quant_config=config)
    inter, k = 64, 128
    layer = MergedColumnParallelLinear(k, [inter, inter], bias=True, quant_config=config)
    full_w, full_s = _fp8_weight(2 * inter, k), _pow2_scales(2 * inter // 32, k // 32)
    full_b = torch.randn(2 * inter).to(torch.bfloat16)
    for part in (1, 0):
        rows = slice(part * inter, (part + 1) * inter)
        layer.weight_loader(layer.weight, full_w[rows], loaded_shard_id=part)
        layer.weight_loader(layer.weight_scale_inv, full_s[part * inter // 32:(part + 1) * inter // 32], loaded_shard_id=part)
        layer.weight_loader(layer.bias, full_b[rows], loaded_shard_id=part)
    assert torch.equal(layer.weight.view(torch.uint8), full_w.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, full_s) and torch.equal(layer.bias, full_b)


def test_a_deep_copied_sharded_layer_reloads_its_shard():
    """torch's Parameter deep copy drops loader attributes: the layer's own deep copy keeps them,
    the loader bound to the copy, so a full checkpoint tensor is still sharded (it was refused as
    a shape mismatch) and loads into the copy alone."""
    import copy

    from fp8chain.layers.loading import load_weights

    n, k, block, tp_size = 128, 64, 32, 2
    config = Fp8Config(weight_block_size=(block, block), scale_fmt="ue8m0")
    full_w, full_s = _fp8_weight(2 * n, k), _pow2_scales(2 * n // block, k // block)
    for kind, sizes in ((ColumnParallelLinear, (k, 2 * n)), (MergedColumnParallelLinear, (k, [n, n]))):
        layer = kind(*sizes, quant_config=config, tp_rank=1, tp_size=tp_size)
        load_weights(layer, [("weight", full_w), ("weight_scale_inv", full_s)])
        twin = copy.deepcopy(layer)
        assert twin.weight.weight_loader.__self__ is twin and twin.weight.shard_dim == 0
        assert twin.weight_scale_inv.weight_loader.__self__ is twin
        before = layer.weight.view(torch.uint8).clone()
        other_w = _fp8_weight(2 * n, k).view(torch.uint8)
        load_weights(twin, [("weight", other_w.view(full_w.dtype)), ("weight_scale_inv", full_s)])
        rank_rows = (other_w[n:] if kind is ColumnParallelLinear else
                     torch.cat([other_w[n // 2:n], other_w[n + n // 2:]]))  # rank 1's half of each part
        assert torch.equal(twin.weight.view(torch.uint8), rank_rows)
        assert torch.equal(layer.weight.view(torch.uint8), before)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_unquantized_column_parallel_outputs_are_slices(tp_size):
    n, k = 64, 40
    w, b = torch.randn(n, k).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    x = torch.randn(3, k).to(torch.bfloat16)
    full = F.linear(x, w, b)
    for rank in range(tp_size):
        layer = ColumnParallelLinear(k, n, bias=True, tp_rank=rank, tp_size=tp_size)
        load_weights(layer, [("weight", w), ("bias", b)])
        rows = slice(rank * n // tp_size, (rank + 1) * n // tp_size)
        assert torch.equal(layer(x), full[:, rows])


def test_loader_errors():
    config = Fp8Config(weight_block_size=(32, 32))
    layer = ColumnParallelLinear(64, 128, quant_config=config, tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match="checkpoint shape"):
        layer.weight_loader(layer.weight, _fp8_weight(96, 64))
    with pytest.raises(TypeError, match="cannot be loaded"):
        layer.weight_loader(layer.weight, torch.randn(64, 64).to(torch.bfloat16))
    # UE8M0 scale bytes into the fp32 scales would read byte 128 (the scale 2.0) as 128.0
    with pytest.raises(TypeError, match="uint8 cannot be loaded"):
        layer.weight_loader(layer.weight_scale_inv, torch.full((4, 2), 128, dtype=torch.uint8))
    unquantized = ReplicatedLinear(8, 8)
    with pytest.raises(TypeError, match="int32 cannot be loaded"):
        load_weights(unquantized, [("weight", torch.ones(8, 8, dtype=torch.int32))])
    with pytest.raises(ValueError, match="given twice"):
        load_weights(unquantized, [("weight", torch.ones(8, 8)), ("weight", 2 * torch.ones(8, 8))])
    with pytest.raises(ValueError, match="not divisible"):
        ColumnParallelLinear(64, 102, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="multiple of the 32x32"):
        ColumnParallelLinear(64, 80, quant_config=config, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="rank"):
        ReplicatedLinear(64, 64, tp_rank=2, tp_size=2)


def test_unquantized_forward_and_leading_dims():
    layer = ReplicatedLinear(32, 24, bias=True)
    w, b = torch.randn(24, 32).to(torch.bfloat16), torch.randn(24).to(torch.bfloat16)
    load_weights(layer, [("weight", w), ("bias", b)])
    x = torch.randn(2, 3, 32).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, w, b))
    assert layer.input_format is None and not layer.deepgemm_mxfp8_input


def test_unquantized_refuses_request(caplog):
    layer = ReplicatedLinear(32, 24, prefix="model.x")
    layer.deepgemm_mxfp8_input = True
    with caplog.at_level("INFO", logger="fp8chain.layers.linear"):
        load_weights(layer, [("weight", torch.randn(24, 32).to(torch.bfloat16))])
    assert layer.deepgemm_mxfp8_input is False and layer.input_format is None
    assert len(caplog.records) == 1 and "model.x" in caplog.records[0].getMessage()


def test_load_weights_strictness():
    layer = ReplicatedLinear(32, 24)
    with pytest.raises(KeyError, match="nope"):
        load_weights(layer, [("nope", torch.zeros(1))])
    assert load_weights(layer, [("nope", torch.zeros(1))], strict=False) == set()


def test_fp8_config_from_config():
    cfg = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [32, 32],
                                 "scale_fmt": "ue8m0", "activation_scheme": "dynamic"})
    assert cfg.weight_block_size == (32, 32) and cfg.scale_fmt == "ue8m0" and cfg.block == 32
    assert Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]}).scale_fmt is None
    for bad in ({"quant_method": "awq", "weight_block_size": [32, 32]},
                {"quant_method": "fp8"},
                {"quant_method": "fp8", "weight_block_size": [64, 64]},
                {"quant_method": "fp8", "weight_block_size": [32, 128]},
                {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "e8m0x"},
                {"quant_method": "fp8", "weight_block_size": [32, 32], "activation_scheme": "static"}):
        with pytest.raises(ValueError):
            Fp8Config.from_config(bad)


def test_ignored_layers_stay_unquantized():
    cfg = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [32, 32],
                                 "ignored_layers": ["model.layers.0.attn.wq_b"]})
    kept = ReplicatedLinear(64, 64, quant_config=cfg, prefix="model.layers.0.attn.wq_b")
    quant = ReplicatedLinear(64, 64, quant_config=cfg, prefix="model.layers.1.attn.wq_b")
    assert kept.weight.dtype == torch.bfloat16 and not hasattr(kept, "weight_scale_inv")
    assert quant.weight.dtype == FP8_DTYPE and quant.weight_scale_inv.shape == (2, 2)


def test_ignored_layers_match_whole_name_components_at_either_end():
    """An ignored entry keeps a layer unquantized when it is the layer's leading or trailing dotted
    components (``lm_head`` for ``model.lm_head``, ``model.layers.0`` for its linears), not a substring."""
    cfg = Fp8Config(weight_block_size=(32, 32), ignored_layers=("lm_head", "model.layers.0"))
    for prefix, kept in (("lm_head", True), ("model.lm_head", True), ("model.layers.0.attn.wq_b", True),
                         ("model.layers.0", True), ("model.xlm_head", False), ("model.layers.01.attn.wq_b", False),
                         ("model.layers.1.attn.wq_b", False)):
        layer = ReplicatedLinear(64, 64, quant_config=cfg, prefix=prefix)
        assert (layer.weight.dtype == torch.bfloat16) is kept, prefix
