"""Warmup: every registered path runs at every batch size, zeros included, outputs finite."""

import pytest
import torch
from torch import nn

from fp8chain.layers.linear import ReplicatedLinear
from fp8chain.layers.loading import load_weights
from fp8chain.layers.quantization.fp8 import Fp8Config
from fp8chain.layers.warmup import (
    WarmupRun, linear_warmup, register_warmup, warmup, warmup_providers,
)
from fp8chain_kernel.formats import FP8_DTYPE

pytestmark = pytest.mark.cpu

CFG32 = Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0")


def fp8_checkpoint(prefix, n, k, block=32):
    return [(f"{prefix}weight", (torch.randn(n, k) * 96).clamp(-448, 448).to(FP8_DTYPE)),
            (f"{prefix}weight_scale_inv",
             torch.exp2(torch.randint(-10, -5, (-(-n // block), -(-k // block))).float()))]


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.chained = ReplicatedLinear(256, 128, quant_config=CFG32, prefix="chained", bias=True)
        self.chained.deepgemm_mxfp8_input = True
        self.plain = ReplicatedLinear(128, 64, quant_config=CFG32, prefix="plain")
        self.dense = ReplicatedLinear(64, 32, prefix="dense")


def loaded_model():
    model = TwoLinears()
    ckpt = (fp8_checkpoint("chained.", 128, 256) + fp8_checkpoint("plain.", 64, 128)
            + [("chained.bias", torch.randn(128).to(torch.bfloat16)),
               ("dense.weight", torch.randn(32, 64).to(torch.bfloat16))])
    load_weights(model, ckpt)
    return model


def test_warmup_runs_every_path_zeros_included():
    model = loaded_model()
    assert model.chained.input_format is not None and model.plain.input_format is None
    sizes = [1, 3, 8]
    runs = warmup(model, sizes, fills=["random"])
    assert all(isinstance(r, WarmupRun) for r in runs)
    seen = {(r.module, r.rows, r.fill) for r in runs}
    for name in ("chained", "plain", "dense"):
        for rows in sizes:
            for fill in ("zeros", "random"):
                assert (name, rows, fill) in seen
    chained = [r for r in runs if r.module == "chained" and r.fill == "zeros"]
    # bf16 + fresh pair at every size, + a row-slice of the 8-row buffer below 8 rows
    assert len(chained) == 3 * 2 + 2
    assert any("rows of a 8-row buffer" in r.what for r in chained)
    assert len([r for r in runs if r.module == "plain"]) == 3 * 2


def test_warmup_on_zeros_runs_the_chain_and_gives_finite_outputs():
    model = loaded_model()
    layer = model.chained
    outs = []

    def recording(module, rows, fill, capacity):
        ran = linear_warmup(module, rows, fill, capacity)
        outs.extend(out for _, out in ran)
        return ran

    register_warmup(layer, recording)  # replaces the provider registered at load
    runs = warmup(layer, [0, 1, 5], fills=())
    assert {r.fill for r in runs} == {"zeros"} and {r.rows for r in runs} == {0, 1, 5}
    assert any(r.what.startswith("pair ") for r in runs)
    assert len(outs) == len(runs)
    for out in outs:
        assert torch.isfinite(out).all()
        assert torch.equal(out, layer.bias.expand_as(out))  # zero input: exactly the bias


def test_reload_replaces_providers_instead_of_adding():
    model = loaded_model()
    before = [(name, key) for name, key, _ in warmup_providers(model)]
    assert sorted(n for n, _ in before) == ["chained", "dense", "plain"]
    load_weights(model, fp8_checkpoint("plain.", 64, 128))
    assert [(name, key) for name, key, _ in warmup_providers(model)] == before


def test_non_finite_output_fails_warmup():
    model = loaded_model()
    register_warmup(model.plain, lambda m, rows, fill, cap: [("broken", torch.full((rows, 2), float("nan")))])
    with pytest.raises(RuntimeError, match=r"plain \[broken\] produced non-finite values for 2 rows of zeros"):
        warmup(model, [2])


def test_bad_arguments():
    model = loaded_model()
    for sizes in ([-1], [1.5], [True]):
        with pytest.raises(ValueError, match="batch sizes must be ints >= 0"):
            warmup(model, sizes)
    with pytest.raises(ValueError, match="unknown warmup fill"):
        warmup(model, [1], fills=["ones"])


def test_warmup_refuses_a_single_non_finite_value():
    from torch import nn

    from fp8chain.layers.warmup import register_warmup, warmup

    module = nn.Linear(2, 2)
    out = torch.zeros(3, 4)
    out[1, 2] = float("inf")
    register_warmup(module, lambda m, rows, fill, cap: [("one inf", out)])
    with pytest.raises(RuntimeError, match=r"\[one inf\] produced non-finite values"):
        warmup(module, [3])


def test_make_input_dtype_and_values():
    """Warmup inputs come in the asked dtype for both fills; "random" is standard normal (signed)."""
    from fp8chain.layers.warmup import make_input

    for fill in ("zeros", "random"):
        assert make_input(4, 8, fill).dtype == torch.bfloat16
        assert make_input(4, 8, fill, dtype=torch.float32).dtype == torch.float32
    assert not make_input(4, 8, "zeros").any()
    x = make_input(64, 64, "random", dtype=torch.float32)
    assert (x < 0).float().mean() > 0.4 and 0.9 < x.std() < 1.1


def test_each_batch_size_runs_once_in_increasing_order():
    model = loaded_model()
    runs = warmup(model.plain, [8, 1, 8, 3], fills=())
    assert [r.rows for r in runs] == [1, 3, 8]


def test_every_tensor_of_a_tuple_output_is_checked_and_every_key_runs():
    """A provider may return several tensors for one path: each must be finite. Providers under
    different keys of one module all run."""
    module = nn.Linear(2, 2)
    good, bad = torch.zeros(2), torch.tensor([0.0, float("nan")])
    register_warmup(module, lambda m, rows, fill, cap: [("first", good)], key="first")
    register_warmup(module, lambda m, rows, fill, cap: [("pair", (good, bad))], key="second")
    assert [key for _, key, _ in warmup_providers(module)] == ["first", "second"]
    with pytest.raises(RuntimeError, match=r"\[pair\] produced non-finite values"):
        warmup(module, [1])
