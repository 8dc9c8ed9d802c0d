"""fp8chain runtime: a batched prefill + greedy decode loop over a KV cache, CUDA-graph decode."""

from .engine import Engine, GenerationResult

__all__ = ["Engine", "GenerationResult"]
