"""The tiny DSv4.1 model at TP2 on the GPU: two processes on one GPU joined by a gloo group (NCCL
takes one GPU per rank), the compiled kernels, eager steps: each rank's tokens and logits equal with
the chain on and off and equal on both ranks, bit for bit. (CUDA-graph decode runs TP1 only.)"""

import os

import pytest
import torch

from fp8chain.models.checkpoint import write_random_checkpoint
from fp8chain.models.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM
from fp8chain.runtime.engine import Engine
from helpers import generate_chain_arms, run_ranks

pytestmark = pytest.mark.gpu

TP = 2
PROMPT_LENS = (5, 3, 8, 6, 1, 7, 4, 2)
NEW_TOKENS = 16


def _rank(rank: int, checkpoint: str, out: str) -> None:
    # two processes share the GPU: the boundary's row barrier needs a GPU to itself (docs/model.md)
    os.environ["FP8CHAIN_ROW_BARRIER"] = "0"
    model = DeepseekV41ForCausalLM.from_pretrained(checkpoint, device="cuda", tp_rank=rank, tp_size=TP)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    torch.save(generate_chain_arms(model, prompts, NEW_TOKENS, max_len=32), f"{out}/rank{rank}.pt")
    with pytest.raises(ValueError, match="CUDA-graph decode runs tp_size=1 only"):
        Engine(model, cuda_graphs=True)


def test_tp2_ranks_and_chain_arms_agree_gpu(tmp_path):
    checkpoint, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    write_random_checkpoint(checkpoint, DeepseekV41Config.tiny(), seed=3)
    run_ranks(_rank, TP, str(checkpoint), str(out))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(TP)]
    first_tokens, first_logits, _ = ranks[0][True]
    assert len({tok for seq in first_tokens for tok in seq}) > NEW_TOKENS  # not a degenerate run
    for results in ranks:
        for chain, (tokens, logits, quantizes) in results.items():
            assert (quantizes == 0) == chain, (chain, quantizes)  # the chained arm quantizes nothing
            assert torch.isfinite(logits).all(), chain
            assert tokens == first_tokens and torch.equal(logits, first_logits), chain
