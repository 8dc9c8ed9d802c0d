"""CUDA-graph capture of the decode step for a set of batch buckets (GPU only).

Static input buffers (token ids, positions, KV slots) are allocated once for the largest
bucket; bucket ``b`` is captured on their first ``b`` rows, so every graph reads the same
storage and a replay only needs the new step's values copied in. Rows past the live batch are
padding: token 0 at position 0 in the engine's scratch slot, so their KV writes never touch a
live sequence (they race for that one scratch row, which only padding rows read). Every bucket
runs eagerly first (Triton compiles outside capture; the layers' registered warmups run too) and
must give finite logits (else ``capture`` raises), then graphs are captured from the largest
bucket down, sharing one memory pool. Outputs are the logits tensors the captured forward
produced (static too): ``run`` returns a view of them, valid until the next replay.
"""

from __future__ import annotations

import functools
import numbers
from typing import Sequence

import torch

from fp8chain_kernel.launch import on_device

__all__ = ["DecodeGraphRunner", "check_capturable", "on_model_device"]


def on_model_device(method):
    """Run a method with ``self.device`` (the model's) the current device (``launch.on_device``:
    kernels, new streams and graph capture act on the current device, whatever device the
    tensors are on; a model on ``cuda:1`` while ``cuda:0`` is current)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with on_device(self.device):
            return method(self, *args, **kwargs)
    return run


def check_capturable(model) -> None:
    """Decode graphs are captured for TP1 models only: capturing a tensor-parallel model's
    all-reduces is not verified (ValueError)."""
    tp_size = getattr(model, "tp_size", 1)
    if tp_size > 1:
        raise ValueError(f"CUDA-graph decode runs tp_size=1 only; this model has tp_size={tp_size} "
                         "(run it with cuda_graphs=False)")


def is_integer(value) -> bool:
    """An integer (numpy's too), not a bool or a float."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class DecodeGraphRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], batch_sizes: Sequence[int], *,
                 scratch_slot: int):
        """``scratch_slot``: a KV-cache slot no sequence uses; the padding rows of a bucket write
        their keys there (the ``Engine`` keeps slot ``max_batch`` for it)."""
        check_capturable(model)
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.model = model
        self.kv_caches = kv_caches
        batch_sizes = list(batch_sizes)
        if not batch_sizes or any(not is_integer(b) or b < 1 for b in batch_sizes):
            raise ValueError(f"batch buckets must be positive ints, got {batch_sizes}")
        self.batch_sizes = sorted({int(b) for b in batch_sizes})
        slots = kv_caches[0].shape[0] if kv_caches else 0
        if not is_integer(scratch_slot) or not 0 <= scratch_slot < slots:
            raise ValueError(f"scratch_slot must be a slot of the KV cache, an int in [0, {slots}), got {scratch_slot!r}")
        self.scratch_slot = int(scratch_slot)
        self.device = model.embed.weight.device
        self.chain = bool(model.chain)
        cap = self.batch_sizes[-1]
        self.input_ids = torch.zeros(cap, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(cap, dtype=torch.long, device=self.device)
        self.slots = torch.full((cap,), self.scratch_slot, dtype=torch.long, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _forward(self, b: int) -> torch.Tensor:
        # no value check: the runner made the indices (the Engine checks what it copies in), and
        # its padding rows share the scratch row on purpose, which the check refuses
        return self.model(self.input_ids[:b], self.positions[:b], self.slots[:b], self.kv_caches,
                          check_indices=False)

    @torch.no_grad()
    @on_model_device
    def capture(self) -> None:
        from ..layers.warmup import warmup

        if bool(self.model.chain) != self.chain:
            raise RuntimeError("model.chain changed between construction and capture")
        self.model.check_replayable()
        warmup(self.model, self.batch_sizes)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in self.batch_sizes:  # compile every specialization outside capture
                for _ in range(2):
                    logits = self._forward(b)
                # this eager run is the producers' warmup: a path writing NaN or inf (a kernel, a
                # weight) fails here, before graphs replay it silently into every token
                if not torch.isfinite(logits).all():
                    raise RuntimeError(f"decode bucket {b} (chain={self.chain}) gave non-finite logits in "
                                       "its eager run before capture; nothing was captured")
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        pool = None
        for b in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
            self.outputs[b] = out
        torch.cuda.synchronize()

    def bucket(self, rows: int) -> int:
        for b in self.batch_sizes:
            if b >= rows:
                return b
        raise ValueError(f"{rows} rows exceed the largest captured bucket {self.batch_sizes[-1]}")

    @torch.no_grad()
    @on_model_device
    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Replay the bucket for ``len(tokens)`` rows; fp32 logits ``[rows, V]`` (a view)."""
        if bool(self.model.chain) != self.chain:
            raise RuntimeError("these graphs were captured with chain="
                               f"{self.chain}; the model now has chain={self.model.chain}")
        rows = tokens.shape[0]
        b = self.bucket(rows)
        self.input_ids[:rows].copy_(tokens)
        self.positions[:rows].copy_(positions)
        self.slots[:rows].copy_(slots)
        if b > rows:
            self.input_ids[rows:b].zero_()
            self.positions[rows:b].zero_()
            self.slots[rows:b].fill_(self.scratch_slot)
        self.graphs[b].replay()
        self.replays += 1
        return self.outputs[b][:rows]
