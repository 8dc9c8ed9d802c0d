"""A small serving loop for the DSv4.1 model: batched prefill + greedy decode over a KV cache.

The KV cache is one latent ``[slots, max_len, head_dim]`` bf16 tensor per layer; sequence ``i``
of a batch owns slot ``i``, and one extra *scratch* slot takes the writes of padding rows
(CUDA-graph buckets larger than the batch), so they never touch a live sequence. Prefill runs
all prompts as one flat token block; each decode step runs one token per sequence, eagerly or
by replaying the CUDA graph captured for the smallest batch bucket that fits
(``runtime.cuda_graph``). The model's ``chain`` switch is read at every step; captured graphs
are kept per chain state, since the captured kernels differ.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Iterable, Sequence

import torch

from fp8chain_kernel.attention import INDEX_DTYPES

from .cuda_graph import DecodeGraphRunner, check_capturable, is_integer, on_model_device

logger = logging.getLogger(__name__)

__all__ = ["Engine", "GenerationResult"]


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]        # generated tokens per prompt (prompt excluded)
    prefill_s: float
    decode_s: float
    decode_steps: int
    graphs: bool                   # decode steps replayed CUDA graphs (False with none run)
    chain: bool
    logits: list[torch.Tensor] | None = None  # per step fp32 [B, V] (``return_logits=True``)


class Engine:
    """Greedy generation for a batch of prompts with ``DeepseekV41ForCausalLM``.

    Args:
        model: the model (weights loaded), on the device it runs on.
        max_batch: most sequences per ``generate`` call.
        max_len: most positions per sequence (prompt + generated).
        cuda_graphs: replay captured decode graphs (CUDA only); ``graph_batch_sizes`` are the
            buckets captured (default 1, 2, 4, ... up to ``max_batch``).
    """

    def __init__(self, model, *, max_batch: int = 8, max_len: int = 256, cuda_graphs: bool = False,
                 graph_batch_sizes: Sequence[int] | None = None):
        for name, value in (("max_batch", max_batch), ("max_len", max_len)):
            if not is_integer(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.model = model
        self.device = model.embed.weight.device
        self.max_batch = int(max_batch)
        self.max_len = int(max_len)
        trained = model.config.max_position_embeddings
        if self.max_len > trained:  # positions past it run on plain RoPE, outside what was trained
            logger.warning("Engine max_len %d exceeds the model's max_position_embeddings %d",
                           self.max_len, trained)
        self.scratch_slot = self.max_batch
        self.kv_caches = model.make_kv_cache(self.max_batch + 1, self.max_len, self.device)
        if not isinstance(cuda_graphs, bool):  # the string "False" is truthy
            raise TypeError(f"cuda_graphs must be a bool, got {cuda_graphs!r}")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        if cuda_graphs:
            check_capturable(model)
        self.cuda_graphs = bool(cuda_graphs)
        if graph_batch_sizes is None:
            graph_batch_sizes, b = [], 1
            while b < self.max_batch:
                graph_batch_sizes.append(b)
                b *= 2
            graph_batch_sizes.append(self.max_batch)
        elif not isinstance(graph_batch_sizes, Iterable):
            raise TypeError(f"graph_batch_sizes must be a sequence of ints, got {type(graph_batch_sizes).__name__}")
        else:
            graph_batch_sizes = list(graph_batch_sizes)  # a generator would be spent by the check
        if not graph_batch_sizes or any(not is_integer(b) or not 0 < b <= self.max_batch for b in graph_batch_sizes):
            raise ValueError(f"graph_batch_sizes must be ints in 1..max_batch={self.max_batch}, "
                             f"got {graph_batch_sizes!r}")
        self.graph_batch_sizes = sorted({int(b) for b in graph_batch_sizes})
        self._runners: dict[bool, object] = {}

    @property
    def chain(self) -> bool:
        return bool(self.model.chain)

    def replays_graphs(self, batch: int) -> bool:
        """Whether decode steps of ``batch`` sequences replay a captured graph (else run eagerly)."""
        return self.cuda_graphs and batch <= max(self.graph_batch_sizes)

    @on_model_device
    def graph_runner(self):
        """The decode graph runner of the current chain state (captured on first use)."""
        key = self.chain
        runner = self._runners.get(key)
        if runner is None:
            runner = DecodeGraphRunner(self.model, self.kv_caches, self.graph_batch_sizes,
                                       scratch_slot=self.scratch_slot)
            runner.capture()
            self._runners[key] = runner
        return runner

    # ---- steps -------------------------------------------------------------------------

    @on_model_device
    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run every prompt (sequence ``i`` in slot ``i``); fp32 logits of each last token ``[B, V]``."""
        self._check_prompts(prompts)
        dev = self.device
        lens = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        slots = torch.cat([torch.full((n,), i, dtype=torch.long, device=dev) for i, n in enumerate(lens)])
        last = torch.tensor(lens, device=dev).cumsum(0) - 1
        # _check_prompts bounds every id, position and slot: no host read in the model
        return self.model(ids, positions, slots, self.kv_caches, logits_indices=last, check_indices=False)

    @on_model_device
    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, *, check_indices: bool = True) -> torch.Tensor:
        """One token per sequence (sequence ``i`` in slot ``i``) -> fp32 logits ``[B, V]``.

        ``tokens`` and ``positions``: int32/int64 ``[B]`` tensors on the engine's device, ``B`` in
        ``1..max_batch``. Each position must be below ``max_len`` and each token id below the
        vocabulary size. A step run eagerly has the model refuse other values (one host read per
        step) unless ``check_indices=False``, as ``generate``, which makes both itself, passes; a
        step replaying a CUDA graph is never checked (no host sync there).

        A replayed step returns a view of its graph's output buffer, which the next replay may
        overwrite, of any batch bucket (the buckets' graphs share one memory pool, so another
        bucket's temporaries may sit there): clone the logits to keep them past the next ``decode``
        (``generate(return_logits=True)`` does). An eager step returns a tensor of its own."""
        for name, t in (("tokens", tokens), ("positions", positions)):
            if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES:
                raise TypeError(f"{name} must be an int32/int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the engine on {self.device}")
        b = tokens.shape[0] if tokens.dim() == 1 else 0
        if not 0 < b <= self.max_batch or positions.shape != tokens.shape:
            raise ValueError(f"tokens and positions must both be [B] with B in 1..{self.max_batch}, got "
                             f"{tuple(tokens.shape)} and {tuple(positions.shape)}")
        slots = torch.arange(b, device=self.device)
        if self.replays_graphs(b):
            self.model.check_replayable()  # a replay does not go through forward's checks
            return self.graph_runner().run(tokens, positions, slots)
        return self.model(tokens, positions, slots, self.kv_caches, check_indices=check_indices)

    # ---- generation --------------------------------------------------------------------

    @on_model_device
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 return_logits: bool = False) -> GenerationResult:
        """Greedy ``max_new_tokens`` tokens for each prompt (step ``s`` logits kept on request)."""
        b = len(prompts)
        self._check_prompts(prompts)
        if not is_integer(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        longest = max(len(p) for p in prompts)
        # the cache holds the prompt and every generated token but the last (it is never fed back)
        if longest + max_new_tokens - 1 > self.max_len:
            raise ValueError(f"prompt {longest} + {max_new_tokens} new tokens need {longest + max_new_tokens - 1} "
                             f"cache positions > max_len {self.max_len}")
        # decode steps (all but the first token) replay graphs where a bucket fits the batch
        graphs = max_new_tokens > 1 and self.replays_graphs(b)
        if max_new_tokens == 0:
            return GenerationResult([[] for _ in prompts], 0.0, 0.0, 0, False, self.chain, [] if return_logits else None)
        if graphs:
            self.graph_runner()  # capture before timing
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        logits = self.prefill(prompts)
        kept = [logits.clone()] if return_logits else None
        next_tokens = logits.argmax(dim=-1)
        sync()
        t1 = time.perf_counter()
        generated = [next_tokens]
        positions = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self.device)
        for _ in range(max_new_tokens - 1):
            logits = self.decode(next_tokens, positions, check_indices=False)
            if kept is not None:
                kept.append(logits.clone())
            next_tokens = logits.argmax(dim=-1)
            generated.append(next_tokens)
            positions = positions + 1
        sync()
        t2 = time.perf_counter()
        tokens = torch.stack(generated, dim=1).cpu().tolist()
        return GenerationResult(tokens, t1 - t0, t2 - t1, max_new_tokens - 1, graphs, self.chain, kept)

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """1..max_batch prompts (one cache slot each), every one a non-empty sequence of at most
        ``max_len`` token ids in ``[0, vocab)``: a longer prompt's last tokens would get no cache row
        (NaN from the attention kernels), an id out of range index the embedding out of bounds (or
        wrap around if negative)."""
        if not 0 < len(prompts) <= self.max_batch:
            raise ValueError(f"batch of {len(prompts)} prompts; this engine takes 1..{self.max_batch}")
        vocab = self.model.embed.weight.shape[0]
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, (str, bytes, bytearray)):  # bytes iterate as ints: a silent misreading
                raise TypeError(f"prompt {i} is {type(prompt).__name__}: prompts are sequences of token ids")
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty")
            if len(prompt) > self.max_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens; this engine's max_len is {self.max_len}")
            bad = next((t for t in prompt if not is_integer(t) or not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"prompt {i} holds {bad!r}: token ids are ints in [0, {vocab})")
