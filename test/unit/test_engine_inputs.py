"""The engine refuses what it cannot generate from, before running anything: token ids outside
the vocabulary (a negative one would wrap around the embedding), negative token counts, engine
sizes that are not positive, graph buckets it would otherwise drop. And what it generates for a
batch is what the model gives each whole sequence alone."""

import types

import pytest
import torch

from fp8chain.models.checkpoint import random_checkpoint_tensors
from fp8chain.models.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM
from fp8chain.runtime.engine import Engine

pytestmark = pytest.mark.cpu


@pytest.fixture(scope="module")
def model():
    return DeepseekV41ForCausalLM(DeepseekV41Config.tiny(num_hidden_layers=1))


@pytest.fixture(scope="module")
def loaded(model):
    """The model with random weights in the checkpoint format (the steps run)."""
    model.load_weights(random_checkpoint_tensors(model.config))
    return model


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


def test_engine_refuses_prompts_of_bytes_or_text_and_a_non_bool_graph_switch(model):
    """Bytes iterate as ints 0..255 (a prompt silently misread as token ids); the string "False"
    is truthy (CUDA graphs silently on)."""
    engine = Engine(model, max_batch=2, max_len=16)
    for prompt in (b"\x01\x02", bytearray(b"\x01"), "12"):
        with pytest.raises(TypeError, match="prompts are sequences of token ids"):
            engine.generate([prompt], 2)
    for switch in ("False", 0, None):
        with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
            Engine(model, max_batch=2, max_len=16, cuda_graphs=switch)


def test_batched_generation_equals_each_sequence_run_alone(loaded):
    """Prompts of different lengths in one batch: every step's logits of every sequence are the
    model's logits for that sequence run alone from scratch (its prompt and the tokens generated
    before; the prefill's row of each prompt's last token, each decode position advanced), and
    every token is the greedy choice of its own step's logits."""
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
    steps = 4
    run = Engine(loaded, max_batch=3, max_len=16).generate(prompts, steps, return_logits=True)
    assert len(run.logits) == steps and all(len(t) == steps for t in run.tokens)
    for i, prompt in enumerate(prompts):
        for s in range(steps):
            seq = prompt + run.tokens[i][:s]
            n = len(seq)
            alone = loaded(torch.tensor(seq), torch.arange(n), torch.zeros(n, dtype=torch.long),
                           loaded.make_kv_cache(1, 16), logits_indices=torch.tensor([n - 1]))[0]
            got = run.logits[s][i]
            err = ((got - alone).norm() / alone.norm()).item()
            assert err < 1e-4, f"prompt {i} step {s}: relative error {err:.2e} from the sequence run alone"
            assert run.tokens[i][s] == int(got.argmax()), f"prompt {i} step {s}: not the greedy token"


def test_generate_refuses_negative_token_counts(model):
    engine = Engine(model, max_batch=2, max_len=16)
    with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int"):
        engine.generate([[1, 2]], -3)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], 0)
    assert engine.generate([[1, 2]], 0).tokens == [[]]
    for count in (2.0, True, "2"):
        with pytest.raises(ValueError, match="max_new_tokens must be a non-negative int"):
            engine.generate([[1, 2]], count)


def test_generate_takes_numpy_integers(loaded):
    """Token ids and the token count as numpy integers (as a tokenizer may hand them over)."""
    import numpy as np

    engine = Engine(loaded, max_batch=1, max_len=16)
    want = engine.generate([[1, 2]], 3).tokens
    assert engine.generate([list(np.array([1, 2], dtype=np.int64))], np.int64(3)).tokens == want
    assert engine.generate([list(np.array([1, 2], dtype=np.int32))], np.int32(3)).tokens == want


def test_engine_steps_run_with_the_models_cuda_device_current(model, monkeypatch):
    """Triton launches, streams, capture and synchronize act on the current CUDA device: every
    Engine entry point makes the model's device current first (a model on cuda:1, cuda:0 current)."""
    import contextlib

    entered = []

    @contextlib.contextmanager
    def current(device):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", current)
    engine = Engine(model, max_batch=1, max_len=8)
    engine.device = torch.device("cuda", 1)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):  # this machine has none
        engine.graph_runner()
    assert entered == [torch.device("cuda", 1)]
    from fp8chain.runtime.cuda_graph import DecodeGraphRunner, on_model_device

    wrapper = on_model_device(lambda self: None).__code__
    for name in ("graph_runner", "prefill", "decode", "generate"):
        assert getattr(Engine, name).__code__ is wrapper, name
    for name in ("capture", "run"):  # the runner used on its own
        assert getattr(DecodeGraphRunner, name).__wrapped__.__code__ is wrapper, name


def test_model_forward_makes_its_device_current(loaded, monkeypatch):
    """A model called directly (not through the Engine) makes its inputs' device current too: its
    kernels and the mHC stats' side stream must not land on another GPU's stream."""
    import contextlib

    from fp8chain.models import deepseek_v41
    from fp8chain_kernel import launch

    made_current = []

    def on_device(device):
        made_current.append(device)
        return contextlib.nullcontext()

    monkeypatch.setattr(deepseek_v41, "on_device", on_device)
    ids = torch.tensor([1, 2])
    loaded(ids, torch.tensor([0, 1]), torch.tensor([0, 0]), loaded.make_kv_cache(1, 4))
    assert made_current == [ids.device]
    monkeypatch.setattr(torch.cuda, "device", lambda device: ("current", device))
    assert launch.on_device(torch.device("cuda", 1)) == ("current", torch.device("cuda", 1))
    assert isinstance(launch.on_device(torch.device("cpu")), contextlib.nullcontext)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_len=0), "max_len must be a positive int"),
    (dict(max_batch=0), "max_batch must be a positive int"),
    (dict(max_batch=2.5), "max_batch must be a positive int"),
    (dict(max_batch=8, graph_batch_sizes=[16]), "graph_batch_sizes must be ints in 1..max_batch=8"),
    (dict(max_batch=8, graph_batch_sizes=[]), "graph_batch_sizes"),
    (dict(max_batch=8, graph_batch_sizes=[True]), "graph_batch_sizes must be ints"),
    (dict(max_batch=8, graph_batch_sizes=[2.0]), "graph_batch_sizes must be ints"),
])
def test_engine_refuses_sizes_it_cannot_serve(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, **kwargs)


def test_engine_takes_graph_buckets_from_any_iterable(model):
    """A generator (spent once, by the check, before) or a numpy array gives the same buckets."""
    import numpy as np

    for sizes in ((b for b in (4, 1, 2)), np.array([4, 1, 2]), (2, 4, 1, 2)):
        assert Engine(model, max_batch=4, graph_batch_sizes=sizes).graph_batch_sizes == [1, 2, 4]
    with pytest.raises(TypeError, match="graph_batch_sizes must be a sequence of ints, got int"):
        Engine(model, max_batch=8, graph_batch_sizes=4)


def test_generate_captures_graphs_only_for_steps_that_replay_them(loaded, monkeypatch):
    """Graphs are captured (and reported) only where a decode step will replay one: not for one
    new token (no decode step) nor for a batch past the largest bucket; CPU stand-in, the capture
    a stub. No new token returns no logits (an empty list when asked for)."""
    engine = Engine(loaded, max_batch=4, max_len=16, graph_batch_sizes=[1, 2])
    engine.cuda_graphs = True  # the CPU model runs its decode steps eagerly: only the capture is stubbed
    captures = []
    monkeypatch.setattr(engine, "graph_runner", lambda: captures.append(1))
    monkeypatch.setattr(engine, "decode", lambda tokens, positions, **kw: loaded(
        tokens, positions, torch.arange(len(tokens)), engine.kv_caches, check_indices=False))
    for prompts, new, graphs in (([[1, 2]], 1, False), ([[1], [2], [3]], 3, False), ([[1, 2]], 3, True)):
        result = engine.generate(prompts, new)
        assert result.graphs is graphs and len(captures) == int(graphs), (prompts, new)
    empty = engine.generate([[1]], 0, return_logits=True)
    assert empty.logits == [] and not empty.graphs and empty.tokens == [[]]


def test_prefill_refuses_prompts_its_cache_cannot_hold(loaded):
    engine = Engine(loaded, max_batch=2, max_len=8)
    with pytest.raises(ValueError, match="prompt 1 has 9 tokens; this engine's max_len is 8"):
        engine.prefill([[1, 2], list(range(9))])
    with pytest.raises(ValueError, match="batch of 3 prompts; this engine takes 1..2"):
        engine.prefill([[1], [2], [3]])
    with pytest.raises(ValueError, match="holds 512"):
        engine.prefill([[1, 512]])
    assert engine.prefill([[1, 2], list(range(8))]).shape == (2, 512)


def test_generate_fills_the_cache_up_to_max_len(loaded):
    """A prompt of n tokens and k new ones write n + k - 1 cache positions (the last token is never
    fed back): up to max_len is served, one more refused; numpy sizes are taken like ints."""
    import numpy as np

    engine = Engine(loaded, max_batch=np.int64(1), max_len=np.int32(8), graph_batch_sizes=[np.int64(1)])
    assert (engine.max_batch, engine.max_len, engine.graph_batch_sizes) == (1, 8, [1])
    assert type(engine.graph_batch_sizes[0]) is int
    assert [len(t) for t in engine.generate([list(range(8))], 1).tokens] == [1]
    assert [len(t) for t in engine.generate([list(range(7))], 2).tokens] == [2]
    with pytest.raises(ValueError, match="7 \\+ 3 new tokens need 9 cache positions > max_len 8"):
        engine.generate([list(range(7))], 3)


def test_engine_warns_past_the_trained_context(loaded, caplog):
    trained = loaded.config.max_position_embeddings
    with caplog.at_level("WARNING", logger="fp8chain.runtime.engine"):
        Engine(loaded, max_batch=1, max_len=trained)
        assert not caplog.records
        Engine(loaded, max_batch=1, max_len=trained + 1)
    assert f"max_len {trained + 1} exceeds the model's max_position_embeddings {trained}" in caplog.text


def test_decode_refuses_tokens_it_cannot_place(loaded):
    engine = Engine(loaded, max_batch=2, max_len=8)
    engine.prefill([[1, 2], [3]])
    tokens, positions = torch.tensor([5, 6]), torch.tensor([2, 1])
    with pytest.raises(TypeError, match="tokens must be an int32/int64 tensor, got torch.float32"):
        engine.decode(tokens.float(), positions)
    with pytest.raises(TypeError, match="positions must be an int32/int64 tensor, got list"):
        engine.decode(tokens, [2, 1])
    # the model and the attention kernels read int32/int64 indices only: refused here, not later
    for dtype in (torch.int16, torch.uint8):
        with pytest.raises(TypeError, match=f"tokens must be an int32/int64 tensor, got {dtype}"):
            engine.decode(tokens.to(dtype), positions)
    assert engine.decode(tokens.int(), positions.int()).shape == (2, 512)
    with pytest.raises(ValueError, match=r"must both be \[B\] with B in 1..2, got \(3,\) and \(3,\)"):
        engine.decode(torch.tensor([5, 6, 7]), torch.tensor([2, 1, 1]))
    with pytest.raises(ValueError, match=r"got \(2,\) and \(1,\)"):
        engine.decode(tokens, positions[:1])
    with pytest.raises(ValueError, match=r"got \(1, 2\)"):
        engine.decode(tokens.view(1, 2), positions.view(1, 2))
    assert engine.decode(tokens, positions).shape == (2, 512)


def test_only_a_public_eager_decode_reads_the_indices_back(loaded, monkeypatch):
    """The model's range check of the indices costs a host read per forward: ``generate`` (its
    prefill from validated prompts, its decode steps from tokens and positions it makes) skips it;
    a caller's eager ``decode`` keeps it, and an out-of-range position is still refused there."""
    reads = []
    real = type(loaded)._check_index_values
    monkeypatch.setattr(type(loaded), "_check_index_values",
                        lambda self, *args: reads.append(args[1].tolist()) or real(self, *args))
    engine = Engine(loaded, max_batch=2, max_len=8)
    result = engine.generate([[1, 2], [3]], 3)
    assert reads == [] and [len(t) for t in result.tokens] == [3, 3]
    engine.decode(torch.tensor([5, 6]), torch.tensor([3, 2]))
    assert reads == [[3, 2]]
    with pytest.raises(ValueError, match=r"positions must be in \[0, 8\)"):
        engine.decode(torch.tensor([5, 6]), torch.tensor([8, 2]))
    engine.decode(torch.tensor([5, 6]), torch.tensor([3, 2]), check_indices=False)
    assert len(reads) == 2


def test_graph_runner_forward_runs_its_padding_rows(loaded, monkeypatch):
    """The decode graphs' padding rows share the engine's scratch row (token 0, position 0): the
    model's check refuses two tokens at one row, so the runner, which made those indices itself,
    runs its eager warmup forward without it (CPU stand-in for the CUDA path)."""
    from fp8chain.runtime.cuda_graph import DecodeGraphRunner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    caches = loaded.make_kv_cache(3, 8)
    runner = DecodeGraphRunner(loaded, caches, [4], scratch_slot=2)
    runner.input_ids[:1], runner.positions[:1], runner.slots[:1] = 5, 3, 0  # one live row, three padding
    logits = runner._forward(4)
    assert logits.shape == (4, 512) and torch.isfinite(logits[:1]).all()
    with pytest.raises(ValueError, match="tokens share the KV-cache row"):  # what the check says about them
        loaded(runner.input_ids, runner.positions, runner.slots, caches)
    for slot in (3, -1, 1.0):
        with pytest.raises(ValueError, match=r"scratch_slot must be a slot of the KV cache, an int in \[0, 3\)"):
            DecodeGraphRunner(loaded, caches, [4], scratch_slot=slot)
    for buckets in ([2.5], [0], [], [True]):
        with pytest.raises(ValueError, match="batch buckets must be positive ints"):
            DecodeGraphRunner(loaded, caches, buckets, scratch_slot=2)


def test_decode_refuses_to_replay_what_a_replay_would_get_wrong(monkeypatch):
    """A replay runs no Python: before each one the engine asks ``check_replayable``, which refuses
    FP8 linears left unprocessed by a bare layer load that failed part-way (the model's own
    ``weights_error`` is not set by it) and host-side diagnostics a replay would leave stale. CPU
    stand-in for the CUDA path: the replay itself is a stub."""
    from fp8chain.layers import loading

    model = DeepseekV41ForCausalLM(DeepseekV41Config.tiny(num_hidden_layers=1))
    tensors = dict(random_checkpoint_tensors(model.config))
    model.load_weights(tensors.items())
    engine = Engine(model, max_batch=2, max_len=8)
    replays = []
    monkeypatch.setattr(engine, "replays_graphs", lambda batch: True)
    monkeypatch.setattr(engine, "graph_runner", lambda: type("Runner", (), {"run": lambda *a: replays.append(a)})())
    one = torch.tensor([1])
    engine.decode(one, one)
    assert len(replays) == 1
    scale = model.layers[0].attn.wq_b.weight_scale_inv
    with pytest.raises(ValueError, match="does not match"):  # writes wq_b's weight, then fails
        loading.load_weights(model, [("layers.0.attn.wq_b.weight", model.layers[0].attn.wq_b.weight.clone()),
                                     ("layers.0.attn.wq_b.weight_scale_inv", scale[:1].clone())])
    assert model.weights_error is None
    with pytest.raises(RuntimeError, match=r"layers.0.attn.wqkv_a: weights not processed"):  # every layer
        engine.decode(one, one)
    model.load_weights(tensors.items())
    engine.decode(one, one)
    nan_scale = model.layers[0].ffn.experts.w2_scale.clone()
    nan_scale.view(-1)[0] = 255
    with pytest.raises(ValueError, match="255"):  # the routed experts alone fail their processing
        loading.load_weights(model, [("layers.0.ffn.experts.w2_scale", nan_scale)])
    with pytest.raises(RuntimeError, match=r"layers.0.ffn.experts: routed experts: weights not processed"):
        engine.decode(one, one)
    model.load_weights(tensors.items())
    engine.decode(one, one)
    for switch_on, switch_off in ((lambda: setattr(model.layers[0].ffn.gate, "record", []),
                                   lambda: setattr(model.layers[0].ffn.gate, "record", None)),
                                  (lambda: setattr(model.layers[0].attn, "keep_indexer_inputs", True),
                                   lambda: setattr(model.layers[0].attn, "keep_indexer_inputs", False))):
        switch_on()
        with pytest.raises(RuntimeError, match="layers.0: ffn.gate.record or attn.keep_indexer_inputs is on"):
            engine.decode(one, one)
        switch_off()
    engine.decode(one, one)
    assert len(replays) == 4


def _runner(monkeypatch, buckets, slots=5):
    from fp8chain.runtime.cuda_graph import DecodeGraphRunner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = types.SimpleNamespace(embed=types.SimpleNamespace(weight=torch.zeros(1)), chain=True)
    runner = DecodeGraphRunner(model, [torch.zeros(slots, 1)], buckets, scratch_slot=slots - 1)
    return runner


def test_graph_runner_bucket_is_the_smallest_that_holds_the_batch(monkeypatch):
    runner = _runner(monkeypatch, [4, 1, 2])
    assert [runner.bucket(rows) for rows in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match="5 rows exceed the largest captured bucket 4"):
        runner.bucket(5)


def test_graph_runner_padding_rows_write_the_scratch_slot(monkeypatch):
    """Rows past the live batch get token 0 at position 0 in the scratch slot, whatever a larger
    batch left in the static buffers: their KV writes never land in a live sequence's slot."""
    runner = _runner(monkeypatch, [4])
    runner.graphs = {4: types.SimpleNamespace(replay=lambda: None)}
    runner.outputs = {4: torch.zeros(4, 8)}
    runner.run(torch.tensor([7, 8, 9, 10]), torch.tensor([3, 4, 5, 6]), torch.tensor([0, 1, 2, 3]))
    out = runner.run(torch.tensor([11]), torch.tensor([2]), torch.tensor([1]))
    assert out.shape == (1, 8)
    assert runner.input_ids.tolist() == [11, 0, 0, 0]
    assert runner.positions.tolist() == [2, 0, 0, 0]
    assert runner.slots.tolist() == [1, 4, 4, 4]


def test_graph_runner_per_chain_state_pads_into_a_slot_no_sequence_owns(model, monkeypatch):
    """One decode graph runner per chain state, captured once and reused; its padding rows write a
    KV-cache slot past every live sequence's (CPU stand-in: capture is a stub)."""
    from fp8chain.runtime.cuda_graph import DecodeGraphRunner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    captured = []
    monkeypatch.setattr(DecodeGraphRunner, "capture", lambda self: captured.append(self))
    engine = Engine(model, max_batch=2, max_len=8, graph_batch_sizes=[1, 2])
    engine.cuda_graphs = True
    try:
        on = engine.graph_runner()
        assert engine.graph_runner() is on and on.chain is True
        model.set_chain(False)
        off = engine.graph_runner()
        assert off is not on and off.chain is False and engine.graph_runner() is off
        model.set_chain(True)
        assert engine.graph_runner() is on and captured == [on, off]
    finally:
        model.set_chain(True)
    assert on.scratch_slot not in range(engine.max_batch)
    assert all(cache.shape[0] > on.scratch_slot for cache in engine.kv_caches)



def test_engine_refuses_a_zero_graph_bucket(model):
    """A bucket of 0 sequences cannot be captured: refused at construction, not at capture."""
    with pytest.raises(ValueError, match="graph_batch_sizes must be ints in 1..max_batch=4"):
        Engine(model, max_batch=4, graph_batch_sizes=[0, 2])


def test_a_batch_filling_the_largest_bucket_replays(model):
    """With graphs on, every batch up to and including the largest bucket replays; one more runs eagerly."""
    engine = Engine(model, max_batch=4, max_len=8, graph_batch_sizes=[1, 2])
    assert not engine.replays_graphs(1)  # graphs off
    engine.cuda_graphs = True
    assert [engine.replays_graphs(b) for b in (1, 2, 3, 4)] == [True, True, False, False]


def test_generate_reports_one_decode_step_per_token_after_the_first(loaded):
    """``decode_steps`` counts the decode steps run: every new token but the first (the prefill's)."""
    engine = Engine(loaded, max_batch=1, max_len=8)
    for new in (0, 1, 3):
        result = engine.generate([[1, 2]], new, return_logits=True)
        assert result.decode_steps == max(new - 1, 0) and len(result.logits) == new, new


def test_generate_keeps_each_steps_logits_when_decode_reuses_its_buffer(loaded, monkeypatch):
    """``return_logits`` keeps a copy of every step's logits, also where ``decode`` returns a view of one
    reused buffer (a replayed graph's output; CPU stand-in)."""
    engine = Engine(loaded, max_batch=1, max_len=8)
    want = engine.generate([[1, 2]], 3, return_logits=True).logits
    real, buffer = engine.decode, torch.empty(1, 512)
    monkeypatch.setattr(engine, "decode", lambda tokens, positions, **kw: buffer.copy_(real(tokens, positions, **kw)))
    got = engine.generate([[1, 2]], 3, return_logits=True).logits
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(want[1], want[2])


def test_decode_refuses_tensors_on_another_device(loaded):
    """Tokens or positions on another device than the engine's are refused naming both devices."""
    engine = Engine(loaded, max_batch=1, max_len=8)
    one = torch.tensor([1])
    for tokens, positions, name in ((one.to("meta"), one, "tokens"), (one, one.to("meta"), "positions")):
        with pytest.raises(ValueError, match=f"{name} is on meta, the engine on cpu"):
            engine.decode(tokens, positions)


def test_cuda_graphs_on_a_cpu_model_are_refused_at_construction(model):
    """``cuda_graphs=True`` for a model not on a CUDA device fails when the engine is built, not at a step."""
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        Engine(model, max_batch=1, max_len=8, cuda_graphs=True)


def test_default_graph_buckets_are_powers_of_two_and_max_batch(model):
    """Without ``graph_batch_sizes`` the buckets are the powers of two below ``max_batch`` and
    ``max_batch`` itself, so every batch the engine takes has a bucket."""
    assert Engine(model, max_batch=6, max_len=8).graph_batch_sizes == [1, 2, 4, 6]
    assert Engine(model, max_batch=8, max_len=8).graph_batch_sizes == [1, 2, 4, 8]
