"""``fp8chain demo``: a tiny random DSv4.1 checkpoint, run with the FP8 chain on and off.

Writes a tiny checkpoint in the DSv4.1 format (FP8 32x32 dense weights, MXFP4 experts), loads
it, generates greedy tokens for a batch of random prompts with the chain on and then off, and
prints the tokens, whether the two arms are identical, and how many standalone quantize
launches the chain saves per decode step. On a GPU the launches are counted with
torch.profiler on one eager decode step and decode replays CUDA graphs; on CPU the kernels run
on the Triton interpreter and the FP8 linears' own quantizes are counted by a forward pre-hook
(``DeepseekV41ForCausalLM.quantize_counter``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ..argtypes import int_in, output_dir, output_dir_problem, seed_int

__all__ = ["add_demo_arguments", "run_demo"]

CPU_DEFAULTS = dict(prompts=2, tokens=8)
GPU_DEFAULTS = dict(prompts=8, tokens=32)
LONGEST_PROMPT = 12  # tokens (``_prompts``)
MAX_POSITIONS = 4096  # the tiny model's max_position_embeddings


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--prompts", type=int_in(1, 256), default=None,
                        help="prompts in the batch, 1-256 (default: 2 on CPU, 8 on GPU)")
    parser.add_argument("--tokens", type=int_in(1, MAX_POSITIONS - LONGEST_PROMPT), default=None,
                        help=f"greedy tokens generated per prompt, 1-{MAX_POSITIONS - LONGEST_PROMPT}: a prompt "
                             f"of up to {LONGEST_PROMPT} and its tokens fit the tiny model's {MAX_POSITIONS} "
                             "positions (default: 8 on CPU, 32 on GPU)")
    parser.add_argument("--seed", type=seed_int, default=0, help="checkpoint and prompt seed (0 to 2**63 - 1)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run (auto: cuda if available)")
    parser.add_argument("--out", default=None, type=output_dir,
                        help="directory for the checkpoint and demo.json (default: a temp dir, removed)")
    parser.add_argument("--layers", type=int_in(1, 64), default=2, help="decoder layers of the tiny model, 1-64")
    parser.add_argument("--eager", action="store_true", help="GPU: decode without CUDA graphs")
    return parser


def _resolve_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device found")
    return choice


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    lens = torch.randint(4, LONGEST_PROMPT + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def _gpu_quantize_launches(model, engine, rows: int) -> int:
    import torch

    from fp8chain.bench.harness import count_launches, quantize_launches

    tokens = torch.zeros(rows, dtype=torch.long, device="cuda")
    positions = torch.zeros(rows, dtype=torch.long, device="cuda")
    slots = torch.full((rows,), engine.scratch_slot, dtype=torch.long, device="cuda")
    # every row in the scratch row, as the decode graphs' padding: no live sequence is written, and
    # the model's check, which refuses two tokens at one row, is skipped (only launches are counted)
    return quantize_launches(count_launches(
        lambda: model(tokens, positions, slots, engine.kv_caches, check_indices=False)))


def run_demo(args) -> int:
    """Run the demo; returns 0 when both arms generate identical tokens, else 1."""
    import triton

    device = _resolve_device(getattr(args, "device", "auto"))
    if device == "cpu":
        if not triton.knobs.runtime.interpret:  # Triton's own reading of TRITON_INTERPRET
            if "fp8chain_kernel.quant" in sys.modules:  # compiled for the GPU: no launch on CPU tensors
                raise SystemExit("demo --device cpu: the kernels were loaded for the GPU before "
                                 "TRITON_INTERPRET=1 was set; run it in a process started with "
                                 "TRITON_INTERPRET=1 (the fp8chain command sets it itself)")
            os.environ["TRITON_INTERPRET"] = "1"
    from fp8chain.models.checkpoint import write_random_checkpoint
    from fp8chain.models.deepseek_v41 import DeepseekV41Config, DeepseekV41ForCausalLM
    from fp8chain.runtime.engine import Engine

    defaults = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    n_prompts = args.prompts or defaults["prompts"]
    n_tokens = args.tokens or defaults["tokens"]
    seed = int(getattr(args, "seed", 0) or 0)
    layers = int(getattr(args, "layers", 2) or 2)
    graphs = device == "cuda" and not getattr(args, "eager", False)

    config = DeepseekV41Config.tiny(num_hidden_layers=layers)
    out_dir = Path(args.out) if getattr(args, "out", None) is not None else None
    if out_dir is not None and (problem := output_dir_problem(args.out)) is not None:
        raise SystemExit(f"demo --out {problem}")
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="fp8chain_demo_")
        ckpt_dir = Path(tmp.name)
    else:
        ckpt_dir = out_dir / "checkpoint"
    try:
        t0 = time.perf_counter()
        write_random_checkpoint(ckpt_dir, config, seed=seed)
        model = DeepseekV41ForCausalLM.from_pretrained(ckpt_dir, device=device)
        config = model.config
        t_load = time.perf_counter() - t0
        prompts = _prompts(n_prompts, config.vocab_size, seed)
        longest = max(len(p) for p in prompts)
        engine = Engine(model, max_batch=n_prompts, max_len=longest + n_tokens, cuda_graphs=graphs)
        print(f"fp8chain demo: tiny DSv4.1 ({layers} layers, hidden {config.hidden_size}, "
              f"{config.n_routed_experts} MXFP4 experts top-{config.num_experts_per_tok}, "
              f"{len(model.fp8_linears())} FP8 linears), checkpoint {ckpt_dir} (seed {seed}), "
              f"device {device}{' (Triton interpreter)' if device == 'cpu' else ''}"
              f"{', CUDA-graph decode' if graphs else ''}; {n_prompts} prompts x {n_tokens} tokens")
        print(f"  checkpoint written and loaded in {t_load:.1f} s")
        formats = sorted({str(l.input_format) for l in model.fp8_linears().values()})
        print(f"  producer formats: {', '.join(formats)}")

        runs = {}
        counter = model.quantize_counter
        for chain in (True, False):
            print(f"  generating with the chain {'on' if chain else 'off'} ...", flush=True)
            model.set_chain(chain)
            counter.reset()
            counter.enabled = device == "cpu"
            runs[chain] = engine.generate(prompts, n_tokens), counter.count
            counter.enabled = False
        # launches are counted on the GPU only after both arms are timed: once torch.profiler has run
        # in a process, every later kernel launch in it is slower (bench.harness)
        results = {}
        for chain in (True, False):
            run, count = runs[chain]
            if device == "cuda":
                model.set_chain(chain)
                per_step = _gpu_quantize_launches(model, engine, n_prompts)
                how = "torch.profiler, one eager decode step"
            else:
                per_step = count / max(1, n_tokens)  # prefill + (n_tokens - 1) decode steps
                how = "forward pre-hooks on the FP8 linears, per forward"
            results[chain] = dict(tokens=run.tokens, quantize_per_step=per_step, how=how,
                                  prefill_s=run.prefill_s, decode_s=run.decode_s,
                                  decode_steps=run.decode_steps)
            arm = "on " if chain else "off"
            rate = f"{run.decode_steps / run.decode_s:.1f} steps/s" if run.decode_steps and run.decode_s > 0 else "n/a"
            print(f"  chain {arm}: prefill {run.prefill_s * 1e3:.1f} ms, {run.decode_steps} decode "
                  f"steps in {run.decode_s:.2f} s ({rate}), standalone quantize "
                  f"launches per step: {per_step:g}")
        model.set_chain(True)

        identical = results[True]["tokens"] == results[False]["tokens"]
        for i, prompt in enumerate(prompts):
            print(f"  prompt {i} {prompt}")
            print(f"    chain on : {results[True]['tokens'][i]}")
            print(f"    chain off: {results[False]['tokens'][i]}")
        saved = results[False]["quantize_per_step"] - results[True]["quantize_per_step"]
        print(f"tokens identical with the chain on and off: {'YES' if identical else 'NO'}")
        print(f"quantize launches saved per decode step: {saved:g} "
              f"({results[False]['quantize_per_step']:g} -> {results[True]['quantize_per_step']:g}; "
              f"{results[True]['how']})")
        if device == "cpu":
            print("(CPU timings are the Triton interpreter's, not performance; run on a GPU for that)")
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            summary = dict(device=device, layers=layers, seed=seed, prompts=prompts,
                           identical=identical, quantize_saved_per_step=saved, graphs=graphs,
                           chain_on=results[True], chain_off=results[False])
            (out_dir / "demo.json").write_text(json.dumps(summary, indent=1))
            print(f"summary: {out_dir / 'demo.json'}")
        return 0 if identical else 1
    finally:
        if tmp is not None:
            tmp.cleanup()

