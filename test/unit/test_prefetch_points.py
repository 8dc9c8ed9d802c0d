"""Where the model prefetches weights into L2 (``layers.prefetch``): each point forks the
documented weight at the documented place, unknown points are refused, and no point changes a
bit of the logits (CPU: the prefetch launches nothing there, so this checks the wiring)."""

import pytest
import torch

from fp8chain.layers import mhc, moe
from fp8chain.layers.prefetch import PREFETCH_POINTS
from fp8chain.models import deepseek_v41
from fp8chain.models.checkpoint import load_checkpoint, write_random_checkpoint
from fp8chain.models.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv41_tiny_prefetch")
    write_random_checkpoint(path, DeepseekV41Config.tiny(), seed=7)
    config, tensors = load_checkpoint(path)
    model = DeepseekV41ForCausalLM(config)
    model.load_weights(tensors)
    return model


def _forward(model):
    ids = torch.tensor([3, 17, 250])
    positions = torch.tensor([0, 4, 1])
    slots = torch.tensor([0, 1, 2])
    with torch.no_grad():
        return model(ids, positions, slots, model.make_kv_cache(3, 8))


def test_points_fork_their_weights_in_step_order(model, monkeypatch):
    forked = []
    for module in (deepseek_v41, moe, mhc):
        monkeypatch.setattr(module, "prefetch_weight", forked.append)
    want, at_boundaries = [], []  # every point's weights in launch order; the boundaries' alone
    for i, layer in enumerate(model.layers):
        attn, shared = layer.attn, layer.ffn.shared_experts
        following = [model.layers[i + 1].attn.wqkv_a.weight] if i + 1 < len(model.layers) else []
        want += [attn.wq_b.weight, attn.wo_a, shared.gate_up.weight, shared.down.weight, *following]
        at_boundaries += [shared.gate_up.weight, *following]
    try:
        model.set_prefetch_points(PREFETCH_POINTS)
        logits = _forward(model)
        assert len(forked) == len(want) and all(a is b for a, b in zip(forked, want))
        forked.clear()
        model.set_prefetch_points({"boundary"})
        _forward(model)
        assert len(forked) == len(at_boundaries) == len(model.layers) * 2 - 1
        assert all(a is b for a, b in zip(forked, at_boundaries))
    finally:
        model.set_prefetch_points(())
    assert torch.equal(logits, _forward(model))


def test_unknown_points_refused(model):
    with pytest.raises(ValueError, match="unknown prefetch points"):
        model.set_prefetch_points({"wo_b"})
    with pytest.raises(ValueError, match="unknown prefetch points"):
        model.layers[0].set_prefetch_points(["boundary", "gate_up"])
