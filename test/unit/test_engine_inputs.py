"""The engine refuses what it cannot generate from, before running anything: token ids outside
the vocabulary (a negative one would wrap around the embedding), negative token counts, engine
sizes that are not positive, graph buckets it would otherwise drop."""

import pytest

from fp8chain.models.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM
from fp8chain.runtime.engine import Engine

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def model():
    return DeepseekV41ForCausalLM(DeepseekV41Config.tiny(num_hidden_layers=1))


@pytest.mark.parametrize("prompts,match", [
    ([[1, -1]], r"holds -1"),
    ([[1, 512]], r"holds 512: token ids are ints in \[0, 512\)"),
    ([[1, 3.7]], r"holds 3.7"),
    ([[1, True]], r"holds True"),
    ([[1, 2], []], r"prompt 1 is empty"),
])
def test_generate_refuses_bad_prompts(model, prompts, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, max_batch=2, max_len=16).generate(prompts, 2)


def test_generate_refuses_negative_token_counts(model):
    engine = Engine(model, max_batch=2, max_len=16)
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int"):
        engine.generate([[1, 2]], -3)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 0)
    assert engine.generate([[1, 2]], 0).tokens == [[]]


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_len=0), "max_len must be a positive int"),
    (dict(max_batch=0), "max_batch must be a positive int"),
    (dict(max_batch=2.5), "max_batch must be a positive int"),
    (dict(max_batch=8, graph_batch_sizes=[16]), "graph_batch_sizes must be ints in 1..max_batch=8"),
    (dict(max_batch=8, graph_batch_sizes=[]), "graph_batch_sizes"),
])
def test_engine_refuses_sizes_it_cannot_serve(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, **kwargs)
