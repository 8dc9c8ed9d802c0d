"""DSv4.1 checkpoints: the tensor layout, a random checkpoint writer, a reader.

The format is DSv4.1's (docs/model.md lists every name):

* dense linears: FP8 e4m3 ``<name>.weight [N, K]`` with fp32 power-of-two 32x32 block scales
  ``<name>.weight_scale_inv [N/32, K/32]`` (dequantized value = fp8 * scale);
* routed experts: MXFP4, ``experts.<e>.w{1,2,3}.weight`` packed e2m1 uint8 ``[N, K/2]`` and
  ``.scale`` UE8M0 (``float8_e8m0fnu``) ``[N, K/32]``;
* embedding, head, norms, router weight: bf16; router correction bias, attention sinks and
  mHC parameters: fp32;
* safetensors shards + ``model.safetensors.index.json`` + ``config.json``.

``write_random_checkpoint`` draws every tensor from one seeded generator in layout order, so a
seed names a checkpoint exactly; weights are scaled (``~1/sqrt(fan_in)``) so activations stay
O(1) through the layers and greedy decoding is not degenerate.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Iterator, NamedTuple

import torch

from fp8chain_kernel.formats import FP8_DTYPE, FP8_MAX, is_int
from fp8chain_kernel.reference import pow2_scale_multiplier, ue8m0_exponent

from ..layers.moe import MXFP4_GROUP, quantize_mxfp4
from .deepseek_v41 import DeepseekV41Config, admit_checkpoint_name, check_tensor_spec

__all__ = ["TensorSpec", "checkpoint_layout", "random_checkpoint_tensors", "write_random_checkpoint",
           "load_checkpoint", "load_state_dict", "quantize_fp8_blockwise"]

INDEX_FILE = "model.safetensors.index.json"

#: safetensors header element types -> torch (``check_tensor_spec`` checks a type missing here by
#: shape only; the tensor itself is checked again as it is loaded).
SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str  # fp8 | fp8_scale | mxfp4 | mxfp4_scale | embed | head | norm | router | bias | sink | hc_fn | hc_base | hc_scale


def checkpoint_layout(config: DeepseekV41Config) -> "OrderedDict[str, TensorSpec]":
    """Every checkpoint tensor name -> (shape, dtype, kind), in writing order."""
    c = config
    h, inter = c.hidden_size, c.moe_intermediate_size
    bn, bk = c.weight_block_size
    out: OrderedDict[str, TensorSpec] = OrderedDict()
    out["embed.weight"] = TensorSpec((c.vocab_size, h), torch.bfloat16, "embed")
    fp8_shapes = c.fp8_linear_shapes()
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}"
        out[f"{p}.attn_norm.weight"] = TensorSpec((h,), torch.bfloat16, "norm")
        out[f"{p}.ffn_norm.weight"] = TensorSpec((h,), torch.bfloat16, "norm")
        for sub in ("attn", "ffn"):
            out[f"{p}.hc_{sub}_fn"] = TensorSpec((c.hc_mix, c.hc_mult * h), torch.float32, "hc_fn")
            out[f"{p}.hc_{sub}_base"] = TensorSpec((c.hc_mix,), torch.float32, "hc_base")
            out[f"{p}.hc_{sub}_scale"] = TensorSpec((3,), torch.float32, "hc_scale")
        for name in ("attn.wq_a", "attn.wkv", "attn.wq_b", "attn.wo_a", "attn.wo_b"):
            n, k = fp8_shapes[name]
            out[f"{p}.{name}.weight"] = TensorSpec((n, k), FP8_DTYPE, "fp8")
            out[f"{p}.{name}.weight_scale_inv"] = TensorSpec((-(-n // bn), -(-k // bk)), torch.float32,
                                                             "fp8_scale")
        out[f"{p}.attn.q_norm.weight"] = TensorSpec((c.q_lora_rank,), torch.bfloat16, "norm")
        out[f"{p}.attn.kv_norm.weight"] = TensorSpec((c.kv_dim,), torch.bfloat16, "norm")
        out[f"{p}.attn.attn_sink"] = TensorSpec((c.num_attention_heads,), torch.float32, "sink")
        out[f"{p}.ffn.gate.weight"] = TensorSpec((c.n_routed_experts, h), torch.bfloat16, "router")
        out[f"{p}.ffn.gate.bias"] = TensorSpec((c.n_routed_experts,), torch.float32, "bias")
        for name in ("ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3"):
            n, k = fp8_shapes[name]
            out[f"{p}.{name}.weight"] = TensorSpec((n, k), FP8_DTYPE, "fp8")
            out[f"{p}.{name}.weight_scale_inv"] = TensorSpec((-(-n // bn), -(-k // bk)), torch.float32,
                                                             "fp8_scale")
        for e in range(c.n_routed_experts):
            for w, (n, k) in (("w1", (inter, h)), ("w2", (h, inter)), ("w3", (inter, h))):
                out[f"{p}.ffn.experts.{e}.{w}.weight"] = TensorSpec((n, k // 2), torch.uint8, "mxfp4")
                out[f"{p}.ffn.experts.{e}.{w}.scale"] = TensorSpec((n, k // MXFP4_GROUP),
                                                                   torch.float8_e8m0fnu, "mxfp4_scale")
    out["norm.weight"] = TensorSpec((h,), torch.bfloat16, "norm")
    out["head.weight"] = TensorSpec((c.vocab_size, h), torch.bfloat16, "head")
    return out


def quantize_fp8_blockwise(w: torch.Tensor, block: tuple[int, int] = (32, 32)) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[N, K]`` -> (e4m3 ``[N, K]``, fp32 power-of-two scales ``[N/bn, K/bk]``), the
    smallest power of two per block with ``amax / s <= 448``."""
    n, k = w.shape
    bn, bk = block
    if n % bn or k % bk:
        raise ValueError(f"[{n}, {k}] is not a multiple of the {bn}x{bk} blocks")
    blocks = w.float().reshape(n // bn, bn, k // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    scale, inv = pow2_scale_multiplier(ue8m0_exponent(amax))
    data = (blocks * inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(n, k).to(FP8_DTYPE)
    return data, scale.contiguous()


def random_checkpoint_tensors(config: DeepseekV41Config, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of a random DSv4.1 checkpoint, deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(int(seed))
    c = config
    layout = checkpoint_layout(c)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    pending_scale: dict[str, torch.Tensor] = {}
    for name, spec in layout.items():
        if spec.kind in ("fp8_scale", "mxfp4_scale"):
            yield name, pending_scale.pop(name)
            continue
        shape = spec.shape
        if spec.kind == "embed":
            t = randn(*shape).to(torch.bfloat16)
        elif spec.kind == "head":
            t = (randn(*shape) * (2.0 / math.sqrt(shape[1]))).to(torch.bfloat16)
        elif spec.kind == "norm":
            t = (1.0 + 0.1 * randn(*shape)).to(torch.bfloat16)
        elif spec.kind == "router":
            t = (randn(*shape) / math.sqrt(shape[1])).to(torch.bfloat16)
        elif spec.kind == "bias":
            t = 0.05 * randn(*shape)
        elif spec.kind == "sink":
            t = 0.5 * randn(*shape)
        elif spec.kind == "hc_fn":
            t = randn(*shape) / math.sqrt(shape[1])
        elif spec.kind == "hc_base":
            t = 0.5 * randn(*shape)
        elif spec.kind == "hc_scale":
            t = 0.5 + 0.1 * randn(*shape)
        elif spec.kind == "fp8":
            n, k = shape
            t, scale = quantize_fp8_blockwise(randn(n, k) / math.sqrt(k), c.weight_block_size)
            pending_scale[name[: -len(".weight")] + ".weight_scale_inv"] = scale
        elif spec.kind == "mxfp4":
            n, k = shape[0], shape[1] * 2
            t, scale = quantize_mxfp4(randn(n, k) / math.sqrt(k))
            pending_scale[name[: -len(".weight")] + ".scale"] = scale.view(torch.float8_e8m0fnu)
        else:  # pragma: no cover
            raise ValueError(f"unknown tensor kind {spec.kind}")
        if tuple(t.shape) != shape or t.dtype != spec.dtype:
            raise AssertionError(f"{name}: generated {tuple(t.shape)} {t.dtype}, layout says {spec}")
        yield name, t.contiguous()


def _shard_of(name: str, num_layers: int, layers_per_shard: int) -> int:
    if name.startswith("layers."):
        return int(name.split(".")[1]) // layers_per_shard
    if name == "embed.weight":
        return 0
    return (num_layers - 1) // layers_per_shard if num_layers else 0


def write_random_checkpoint(path, config: DeepseekV41Config, seed: int = 0, *,
                            layers_per_shard: int = 1) -> Path:
    """Write a random DSv4.1 checkpoint into directory ``path`` (``layers_per_shard`` decoder
    layers per safetensors file, a positive int); returns the path. Shards are written as they
    fill (the layout lists tensors shard by shard), so at most one shard is held in memory.

    A checkpoint already in ``path`` is replaced: its index, ``config.json`` and
    ``model-*-of-*.safetensors`` shards are removed first, and the new index is written last, so a
    write that stops part-way leaves no index and no config, which no load mistakes for a
    checkpoint (a mix of two seeds' shards would load silently)."""
    from safetensors.torch import save_file

    if not is_int(layers_per_shard) or layers_per_shard < 1:  # before anything is created
        raise ValueError(f"layers_per_shard must be a positive int, got {layers_per_shard!r}")
    config.validate()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in [path / INDEX_FILE, path / "config.json", *path.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    num_shards = max(1, -(-config.num_hidden_layers // layers_per_shard))
    weight_map, total = {}, 0

    def save(s: int, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()

    shard, tensors = 0, {}
    for name, tensor in random_checkpoint_tensors(config, seed):
        s = _shard_of(name, config.num_hidden_layers, layers_per_shard)
        if s != shard:
            if s < shard:  # pragma: no cover - checkpoint_layout lists tensors in shard order
                raise AssertionError(f"{name} belongs to shard {s}, already written")
            save(shard, tensors)
            shard, tensors = s, {}
        tensors[name] = tensor
    save(shard, tensors)
    with open(path / "config.json", "w") as f:
        json.dump(config.to_dict(), f, indent=1)
    with open(path / INDEX_FILE, "w") as f:  # last: its presence says the checkpoint is whole
        json.dump({"metadata": {"total_size": total, "seed": int(seed)}, "weight_map": weight_map},
                  f, indent=1, sort_keys=True)
    return path


def load_checkpoint(path, *, config: DeepseekV41Config | None = None
                    ) -> tuple[DeepseekV41Config, Iterator[tuple[str, torch.Tensor]]]:
    """``(config, iterator of (name, tensor))`` of a checkpoint directory, shard by shard.

    With an index, every tensor must sit in the shard the index names and appear once; without
    one, the ``*.safetensors`` files are read in name order and a name in two of them is an error.
    Every shard's header is read and checked here, before the iterator yields a tensor, against
    ``checkpoint_layout`` of ``config`` (a live model's, when reloading it; by default the
    checkpoint's own ``config.json``): a missing, corrupt or misplaced shard, a tensor missing,
    unknown, given twice or of another shape or element type fails before any parameter is
    written (a live model being reloaded keeps its weights). Given ``config``, the checkpoint's
    ``config.json`` must describe the same model (``ValueError`` naming the fields it reads that differ).
    A corrupt index or shard raises ``ValueError`` naming the file, a shard the index names but
    the directory lacks ``FileNotFoundError``; the layout's errors are ``load_weights``' own
    (``KeyError`` for an unknown name, ``TypeError`` for an element type, else ``ValueError``)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if path.is_file():
        raise ValueError(f"{path}: a checkpoint is a directory (config.json and *.safetensors shards), "
                         f"not a file; pass {path.parent}")
    own = DeepseekV41Config.from_json(path / "config.json")
    if config is not None:
        _check_same_model(path, own, config)
    layout = checkpoint_layout(config or own)
    index_path = path / INDEX_FILE
    weight_map = None
    if index_path.exists():
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}")
            odd = [v for v in weight_map.values() if not isinstance(v, str) or not v][:1]
            if odd:
                raise TypeError(f"weight_map maps a tensor to {odd[0]!r}, not a shard file name")
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path}: not a safetensors index with a weight_map ({exc})") from None
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))

    def shard(fname):
        if not (path / fname).is_file():
            raise FileNotFoundError(f"{path / fname}: the index names this shard, the directory has no such file")
        try:
            return safe_open(str(path / fname), framework="pt")
        except SafetensorError as exc:
            raise ValueError(f"{path / fname}: cannot read the shard ({exc})") from exc

    seen: dict[str, str] = {}
    headers: dict[str, tuple[list[int], str]] = {}
    for fname in files:
        with shard(fname) as f:
            for name in f.keys():
                if name in seen:
                    raise ValueError(f"{name} is in both {seen[name]} and {fname}")
                if weight_map is not None and weight_map.get(name) != fname:
                    raise ValueError(f"{fname} holds {name}, which the index maps to {weight_map.get(name)!r}")
                seen[name] = fname
                header = f.get_slice(name)
                headers[name] = header.get_shape(), header.get_dtype()
    absent = sorted(set(weight_map or ()) - set(seen))
    if absent:  # a truncated shard or a stale index: the loader would never see these
        raise ValueError(f"{len(absent)} tensors of the index are in no shard (first: {absent[0]}, "
                         f"mapped to {weight_map[absent[0]]})")
    _check_headers(path, headers, layout)

    def tensors():
        for fname in files:
            with shard(fname) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    return own, tensors()


def _check_same_model(path: Path, own: DeepseekV41Config, config: DeepseekV41Config) -> None:
    """``ValueError`` naming the fields the model reads where the checkpoint's config and ``config``
    differ (keys it does not read, ``extra``, may: a ``transformers_version``, say)."""
    mine, theirs = own.to_dict(), config.to_dict()
    differ = sorted(k for k in mine.keys() | theirs.keys() if k not in own.extra and k not in config.extra
                    and mine.get(k) != theirs.get(k))
    if differ:
        shown = ", ".join(f"{k}: {mine.get(k)!r} in the checkpoint, {theirs.get(k)!r} given" for k in differ[:5])
        raise ValueError(f"{path / 'config.json'} describes another model ({len(differ)} fields differ: {shown})")


def _check_headers(path: Path, headers: dict[str, tuple[list[int], str]], layout) -> None:
    """The shards' headers (name -> shape, safetensors element type) against ``layout``, each as
    ``load_weights`` checks the tensor, and every layout tensor present."""
    admitted: set[str] = set()
    for name, (shape, dtype) in headers.items():
        spec = layout[admit_checkpoint_name(name, layout, admitted)]
        check_tensor_spec(name, tuple(shape), SAFETENSORS_DTYPES.get(dtype), spec)
    missing = [name for name in layout if name not in admitted]
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} tensors of its layout (first: {missing[0]})")


def load_state_dict(path) -> tuple[DeepseekV41Config, dict[str, torch.Tensor]]:
    """The whole checkpoint as a dict (small models: tests, the fp32 reference)."""
    config, it = load_checkpoint(path)
    return config, dict(it)
