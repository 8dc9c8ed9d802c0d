"""The FP8 chain in a whole tiny DSv4.1 model (CPU; kernels on the Triton interpreter).

* chain on and off generate the same greedy tokens, and their logits are equal bit for bit
  (every producer's pair equals the standalone quantize of its bf16 output, so each FP8 GEMM
  sees the same bytes in both arms);
* chain on runs no standalone quantize; chain off runs one per FP8 linear per forward;
* the logits agree with an fp32 forward on the dequantized weights (no activation
  quantization, no bf16 rounding). With the reference's own routing: median relative L2 error
  <= 0.06 and top-1 agreement >= 75% (measured at 7f0ac61, seed 1234, 256 decode positions:
  median 0.044, top-1 222/256; 25 positions above 0.08, up to 0.59). Those outliers are top-k
  expert flips: FP8 rounding moves a router score across a near tie. With the reference taking
  the FP8 model's expert choices, every position (284, teacher-forced) is within 0.08 (measured
  max 0.078, median 0.040).

Size: 8 prompts x 32 new tokens, about 1.5 minutes per arm on a 2-core CPU (the Triton
interpreter); the GPU suite (test_engine_gpu.py) runs 8 prompts x 64 tokens with CUDA graphs.
"""

import pytest
import torch

from fp8chain.models.checkpoint import (load_checkpoint, load_state_dict, random_checkpoint_tensors,
                                       write_random_checkpoint)
from fp8chain.models.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM, DeepseekV41Reference
from fp8chain.runtime.engine import Engine
from helpers import decode_errors_vs_reference

pytestmark = pytest.mark.cpu

PROMPT_LENS = (5, 3, 8, 6, 1, 7, 4, 2)
NEW_TOKENS = 32
MAX_LEN = max(PROMPT_LENS) + NEW_TOKENS
SEED = 1234
REL_BOUND = 0.08
REL_MEDIAN_BOUND = 0.06
TOP1_BOUND = 0.75


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = DeepseekV41Config.tiny()
    path = tmp_path_factory.mktemp("dsv41_tiny")
    write_random_checkpoint(path, config, seed=SEED)
    config, tensors = load_checkpoint(path)
    model = DeepseekV41ForCausalLM(config)
    model.load_weights(tensors)
    gen = torch.Generator().manual_seed(SEED)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    engine = Engine(model, max_batch=len(prompts), max_len=MAX_LEN)
    runs = {}
    for chain in (True, False):
        model.set_chain(chain)
        model.quantize_counter.reset()
        model.quantize_counter.enabled = True
        runs[chain] = engine.generate(prompts, NEW_TOKENS, return_logits=True)
        runs[chain].quantizes = model.quantize_counter.count
        model.quantize_counter.enabled = False
    model.set_chain(True)
    return dict(config=config, path=path, model=model, prompts=prompts, runs=runs)


def test_every_fp8_linear_reads_a_producer_pair(setup):
    linears = setup["model"].fp8_linears()
    assert len(linears) == 5 * setup["config"].num_hidden_layers
    for name, linear in linears.items():
        assert linear.deepgemm_mxfp8_input and linear.input_format is not None, name


def test_greedy_tokens_identical_chain_on_off(setup):
    on, off = setup["runs"][True], setup["runs"][False]
    assert on.chain and not off.chain
    assert on.tokens == off.tokens
    assert all(len(t) == NEW_TOKENS for t in on.tokens)
    # not degenerate: the batch does not collapse onto one token
    assert len({tok for seq in on.tokens for tok in seq}) > NEW_TOKENS


def test_logits_bitwise_identical_chain_on_off(setup):
    on, off = setup["runs"][True], setup["runs"][False]
    assert len(on.logits) == len(off.logits) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(on.logits, off.logits)):
        assert torch.isfinite(a).all(), step
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item()}"


def test_quantize_launches_saved(setup):
    layers = setup["config"].num_hidden_layers
    forwards = NEW_TOKENS  # prefill + NEW_TOKENS - 1 decode steps
    assert setup["runs"][True].quantizes == 0
    assert setup["runs"][False].quantizes == 5 * layers * forwards


class _CountingKernel:
    """Stands in for a Triton kernel: counts the launches, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches += 1
            return launch(*args, **kwargs)

        return run


def test_standalone_quantize_kernel_launches_per_step(setup, monkeypatch):
    """The quantize kernel's own launches in one decode step, whoever makes them: none chained
    (a producer that quantized its output with a second launch would show here, where the
    per-linear counter above would not), one per FP8 linear unchained."""
    from fp8chain_kernel import quant

    model, config = setup["model"], setup["config"]
    counter = _CountingKernel(quant._quantize_kernel)
    monkeypatch.setattr(quant, "_quantize_kernel", counter)
    engine = Engine(model, max_batch=2, max_len=8)
    engine.prefill([[1, 2, 3], [4, 5]])
    launches = {}
    try:
        for chain in (True, False):
            model.set_chain(chain)
            counter.launches = 0
            engine.decode(torch.tensor([6, 7]), torch.tensor([3, 2]))
            launches[chain] = counter.launches
    finally:
        model.set_chain(True)
    assert launches == {True: 0, False: 5 * config.num_hidden_layers}


def test_logits_match_fp32_reference(setup):
    """Decode logits vs the fp32 reference with its own routing: top-1 agreement and median."""
    _, tensors = load_state_dict(setup["path"])
    reference = DeepseekV41Reference(setup["config"], tensors)
    errors, agree = decode_errors_vs_reference(reference, setup["prompts"], setup["runs"][True], NEW_TOKENS)
    assert torch.isfinite(errors).all(), "non-finite logits"
    print(f"fp32 reference (own routing): relative L2 error median {errors.median().item():.4f}, "
          f"max {errors.max().item():.4f}, {int((errors <= REL_BOUND).sum())}/{len(errors)} "
          f"<= {REL_BOUND}; top-1 agreement {agree}/{len(errors)}")
    assert errors.median().item() <= REL_MEDIAN_BOUND
    assert agree / len(errors) >= TOP1_BOUND


def test_logits_match_fp32_reference_same_routing(setup):
    """Every position within REL_BOUND of the fp32 reference once the reference takes the FP8
    model's expert choices (so only the numerics differ, not a discrete top-k flip)."""
    model, config = setup["model"], setup["config"]
    sequences = [p + t[:-1] for p, t in zip(setup["prompts"], setup["runs"][True].tokens)]
    ids = torch.tensor([t for s in sequences for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in sequences])
    slots = torch.cat([torch.full((len(s),), i) for i, s in enumerate(sequences)])
    for layer in model.layers:
        layer.ffn.gate.record = []
    try:
        with torch.no_grad():
            logits = model(ids, positions, slots, model.make_kv_cache(len(sequences), MAX_LEN))
        routing = [layer.ffn.gate.record[0] for layer in model.layers]
    finally:
        for layer in model.layers:
            layer.ffn.gate.record = None
    _, tensors = load_state_dict(setup["path"])
    reference = DeepseekV41Reference(config, tensors)
    errors, start = [], 0
    for i, seq in enumerate(sequences):
        rows = slice(start, start + len(seq))
        ref = reference(seq, routing=[r[rows] for r in routing])
        got = logits[rows]
        errors += (((got.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1))).tolist()
        start += len(seq)
    errors = torch.tensor(errors)
    print(f"fp32 reference (same routing), {len(errors)} positions: relative L2 error median "
          f"{errors.median().item():.4f}, max {errors.max().item():.4f}")
    assert torch.isfinite(errors).all()
    assert errors.max().item() <= REL_BOUND


def test_two_layer_prefill_off_default_settings_matches_the_fp32_reference():
    """A fast check of the whole model's numerics (no engine, no module fixture): one prompt through
    two layers (so a layer hands its output to the next layer's norm, not the final one), with the
    settings the model takes from its config moved off their defaults (RoPE theta, routed scaling
    and renormalization, SwiGLU clamp, Sinkhorn iterations). With the reference taking the model's
    expert choices, every position is within REL_BOUND."""
    config = DeepseekV41Config.tiny(rope_theta=500.0, routed_scaling_factor=2.5, norm_topk_prob=False,
                                    swiglu_limit=0.5, hc_sinkhorn_iters=5)
    tensors = dict(random_checkpoint_tensors(config, seed=7))
    model = DeepseekV41ForCausalLM(config)
    model.load_weights(tensors.items())
    seq = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(7))
    n = seq.numel()
    for layer in model.layers:
        layer.ffn.gate.record = []
    with torch.no_grad():
        logits = model(seq, torch.arange(n), torch.zeros(n, dtype=torch.long), model.make_kv_cache(1, n))
    routing = [layer.ffn.gate.record[0] for layer in model.layers]
    ref = DeepseekV41Reference(config, tensors)(seq.tolist(), routing=routing).double()
    errors = (logits.double() - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert torch.isfinite(errors).all()
    assert errors.max().item() <= REL_BOUND, errors.tolist()
