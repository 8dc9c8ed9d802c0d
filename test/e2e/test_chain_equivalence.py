"""The FP8 chain in a whole tiny DSv4.1 model (CPU; kernels on the Triton interpreter).

* chain on and off generate the same greedy tokens, and their logits are equal bit for bit
  (every producer's pair equals the standalone quantize of its bf16 output, so each FP8 GEMM
  sees the same bytes in both arms);
* chain on runs no standalone quantize; chain off runs one per FP8 linear per forward;
* the logits agree with an fp32 forward on the dequantized weights (no activation quantization,
  no bf16 rounding): per generated position, the relative L2 error of the logits has median
  <= 0.06, is <= 0.08 at >= 90% of positions, and top-1 agrees at >= 75% of positions.
  Measured (seed 1234, 32 positions): median ~0.043, 31 of 32 positions <= 0.07, one outlier at
  0.38 where the layer-1 router's k-th vs (k+1)-th score margin is 0.015 (median 0.086): FP8
  rounding flips a top-k expert choice there. Top-1 agreement ~90%.

Size: the issue's 8 prompts x 32 tokens takes several minutes per arm on the 2-core CPU
interpreter, so this runs 4 prompts x 8 tokens on the tiny config (2 layers); the GPU suite
(test_engine_gpu.py) runs 8 prompts x 64 tokens with CUDA graphs.
"""

import pytest
import torch

from fp8chain.models.checkpoint import load_checkpoint, load_state_dict, write_random_checkpoint
from fp8chain.models.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM, DeepseekV41Reference
from fp8chain.runtime.engine import Engine

pytestmark = pytest.mark.cpu

PROMPT_LENS = (5, 3, 8, 6)
NEW_TOKENS = 8
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
    engine = Engine(model, max_batch=len(prompts), max_len=32)
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


def test_logits_match_fp32_reference(setup):
    _, tensors = load_state_dict(setup["path"])
    reference = DeepseekV41Reference(setup["config"], tensors)
    on = setup["runs"][True]
    agree = total = 0
    errors = []
    for i, prompt in enumerate(setup["prompts"]):
        sequence = prompt + on.tokens[i]
        ref = reference(sequence[:-1])  # logits predicting tokens len(prompt)..end
        for step in range(NEW_TOKENS):
            got = on.logits[step][i]
            want = ref[len(prompt) - 1 + step]
            rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
            assert rel == rel and rel != float("inf"), "non-finite logits"
            errors.append(rel)
            agree += int(got.argmax() == want.argmax())
            total += 1
    errors = torch.tensor(errors)
    within = int((errors <= REL_BOUND).sum())
    print(f"fp32 reference: relative L2 error median {errors.median().item():.4f}, "
          f"max {errors.max().item():.4f}, {within}/{total} <= {REL_BOUND}; "
          f"top-1 agreement {agree}/{total}")
    assert errors.median().item() <= REL_MEDIAN_BOUND
    assert within >= 0.9 * total
    assert agree / total >= TOP1_BOUND
