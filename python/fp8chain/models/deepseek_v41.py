"""DeepSeek-V4.1 decoder with the FP8 chain: config, MQA attention, MoE, decoder layer, model.

Every FP8 dense linear (``wqkv_a``, ``wq_b``, ``wo_b``, the shared expert's ``gate_up`` and
``down``) asks for a pre-quantized input, and the kernel in front of it is the producer that
writes that input:

=====================  =====================================  ===========================
consumer               producer                               kernel
=====================  =====================================  ===========================
``attn.wqkv_a``        mHC boundary (post + combine + norm)   ``mhc.mhc_mega_boundary``
                       (layer 0: RMSNorm of stream 0)         ``norm.rms_norm``
``attn.wq_b``          q_norm                                 ``norm.rms_norm``
``attn.wo_b``          wo_a grouped einsum                    ``einsum.wo_a_einsum``
``shared.gate_up``     mHC boundary                           ``mhc.mhc_mega_boundary``
``shared.down``        SiLU*mul (+swiglu clamp)               ``act.silu_mul``
=====================  =====================================  ===========================

``chain`` (``model.set_chain(bool)``) switches all producers' FP8 outputs at once: on, each
producer writes bf16 plus the pair its consumer's ``input_format`` names and the linear runs
without quantizing; off, producers write bf16 only and every FP8 linear quantizes its own input
(the upstream Hopper path). Since a producer's pair equals a standalone quantize of its bf16
output bit for bit, both arms compute the same logits, bit for bit.

Tensor parallelism (``tp_rank``, ``tp_size``, ``tp_group``: a ``torch.distributed`` group) shards
the attention's heads and wo_a groups and the shared expert as SGLang does; wo_a and SiLU*mul then
write their rank's shard of the pair (the rows of K its wo_b / down shard reads), the boundaries
and q_norm the whole pair (wqkv_a is replicated, wq_b reads all of K), and the all-reduces after
``wo_b`` and the shared ``down`` come before the mHC boundaries, which run whole on every rank.

Out of scope here (see docs/model.md): DSv4.1's sparse attention (indexer, compressor, sliding
window), hash-routed layers, multi-token prediction, expert parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from fp8chain_kernel import attention as attention_kernels
from fp8chain_kernel import einsum as einsum_kernels
from fp8chain_kernel.act import check_limit
from fp8chain_kernel.norm import check_eps
from fp8chain_kernel.router import MAX_EXPERTS, MAX_TOP_K
from fp8chain_kernel.reference import (apply_rope, attention_with_sinks, dequantize_weight, rms_rsqrt, rope_cos_sin,
                                       rope_tables)
from fp8chain_kernel.formats import QuantizedActivation, is_int, overlaps
from fp8chain_kernel.launch import on_device

from ..layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, check_tp
from ..layers.mhc import HyperConnection, at_start, expand_streams, run_sublayer
from ..layers.moe import MXFP4_PACKED_DTYPES, RoutedExpertsReference, SharedExpert, TopKRouter, check_mxfp4
from ..layers.norm import RMSNorm
from ..layers.quantization.fp8 import Fp8Config, check_weights

__all__ = [
    "DeepseekV41Config", "MQALayer", "DeepseekV41MoE", "DeepseekV41DecoderLayer",
    "DeepseekV41ForCausalLM",
]

logger = logging.getLogger(__name__)

DEFAULT_QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
}


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------


@dataclass
class DeepseekV41Config:
    """DSv4.1 hyper-parameters under their HF ``config.json`` names (docs/model.md, Config).

    ``head_dim`` is the width of the one latent KV head shared by all query heads (448 nope +
    64 rope for Flash), so ``wqkv_a`` has ``q_lora_rank + head_dim`` rows.
    """

    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    routed_scaling_factor: float = 1.5
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    swiglu_limit: float | None = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    expert_dtype: str = "fp4"
    torch_dtype: str = "bfloat16"
    quantization_config: dict = field(default_factory=lambda: dict(DEFAULT_QUANT_CONFIG))
    #: config.json keys this implementation does not read (kept, written back by ``to_dict``).
    extra: dict = field(default_factory=dict)

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict) -> "DeepseekV41Config":
        """From a HF ``config.json`` dict; keys it does not read go to ``extra``, missing keys take
        Flash's values (``flash()``). Keys it does not read that change what a model computes are
        refused where the model cannot be the one described (another activation, a contradicting
        ``qk_nope_head_dim``) and logged where it still runs the rest of it (``rope_scaling``,
        group-limited routing, a sliding window): ``_check_read_keys``."""
        if d.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ValueError(f"model_type {d['model_type']!r} is not a DeepSeek-V4 config (deepseek_v4)")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in names}
        identity = ("architectures", "model_type", "extra")  # to_dict writes these itself
        extra = {k: v for k, v in d.items() if k not in names and k not in identity}
        given_extra = d.get("extra") or {}
        if not isinstance(given_extra, dict):
            raise ValueError(f"extra must be a dict, got {type(given_extra).__name__}")
        extra.update(given_extra)
        if isinstance(kwargs.get("quantization_config"), dict):
            kwargs["quantization_config"] = dict(kwargs["quantization_config"])
        config = cls(**kwargs, extra=extra)
        config.validate()
        _check_read_keys(d, config)
        return config

    @classmethod
    def from_json(cls, path) -> "DeepseekV41Config":
        """From a ``config.json`` file; one that is not a JSON object raises ``ValueError`` naming it."""
        with open(path) as f:
            try:
                d = json.load(f)
            except ValueError as exc:
                raise ValueError(f"{path}: not a JSON file ({exc})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path}: a config.json holds a JSON object, got a {type(d).__name__}")
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        """The HF ``config.json`` dict (``architectures``/``model_type`` included)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d["quantization_config"] = dict(self.quantization_config)
        out = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
        out.update(self.extra)
        out.update(d)
        return out

    @classmethod
    def flash(cls, **overrides) -> "DeepseekV41Config":
        """DeepSeek-V4.1-Flash (docs/model.md, Config)."""
        config = cls(**overrides)
        config.validate()
        return config

    @classmethod
    def tiny(cls, **overrides) -> "DeepseekV41Config":
        """A small model with Flash's structure: 4 streams, 2 o-groups, 1 latent KV head, MXFP4
        routed experts, FP8 32x32 dense weights; every FP8 GEMM has K % 128 == 0 and
        N % 32 == 0, so every activation format (incl. the packed one) is exercised."""
        values = dict(
            vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=2,
            head_dim=128, qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=128,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
            max_position_embeddings=4096,
        )
        values.update(overrides)
        config = cls(**values)
        config.validate()
        return config

    # ---- derived -----------------------------------------------------------------------

    @property
    def kv_dim(self) -> int:
        """Width of the one latent KV head (= ``head_dim``)."""
        return self.head_dim

    @property
    def qk_nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_mix(self) -> int:
        """mHC mix values per sublayer: pre hc + post hc + comb hc*hc."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def o_group_dim(self) -> int:
        """Input width of one wo_a group: ``heads / o_groups * head_dim``."""
        return self.num_attention_heads // self.o_groups * self.head_dim

    @property
    def weight_block_size(self) -> tuple[int, int]:
        block = self.quantization_config.get("weight_block_size", [32, 32])
        return int(block[0]), int(block[1])

    def fp8_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``[N, K]`` of each FP8 dense linear (checkpoint names, one layer)."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return {
            "attn.wq_a": (self.q_lora_rank, h),
            "attn.wkv": (self.kv_dim, h),
            "attn.wq_b": (self.num_attention_heads * self.head_dim, self.q_lora_rank),
            "attn.wo_a": (self.o_groups * self.o_lora_rank, self.o_group_dim),
            "attn.wo_b": (h, self.o_groups * self.o_lora_rank),
            "ffn.shared_experts.w1": (i, h),
            "ffn.shared_experts.w3": (i, h),
            "ffn.shared_experts.w2": (h, i),
        }

    def _value_errors(self) -> list[str]:
        """What is of the wrong kind: every count and width a positive int, every float setting a
        positive finite number, the switches bools, the weight blocks two positive ints."""
        errors = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and not (is_int(value) and value > 0):
                errors.append(f"{f.name} must be a positive int, got {value!r}")
            elif f.type in ("float", "float | None"):
                optional = f.type == "float | None"
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if not ((optional and value is None) or (number and 0 < value < math.inf)):
                    errors.append(f"{f.name} must be a positive finite number{' or None' if optional else ''}, "
                                  f"got {value!r}")
            elif f.type == "bool" and not isinstance(value, bool):
                errors.append(f"{f.name} must be true or false, got {value!r}")
        qc = self.quantization_config
        block = qc.get("weight_block_size", [32, 32]) if isinstance(qc, dict) else None
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(is_int(v) and v > 0 for v in block)):
            errors.append(f"quantization_config must be a dict whose weight_block_size is two positive ints, "
                          f"got {qc!r}")
        if not isinstance(self.extra, dict):
            errors.append(f"extra must be a dict, got {type(self.extra).__name__}")
        return errors

    def validate(self) -> None:
        """Raise ``ValueError`` for a value of the wrong kind or a structure this model (or an FP8
        format) cannot run."""
        errors = self._value_errors()
        if errors:  # the structural checks below do arithmetic on these values
            raise ValueError("invalid DeepseekV41Config: " + "; ".join(errors))
        try:  # what the FP8 linears will read: refused here rather than when the model is built
            fp8 = Fp8Config.from_config(self.quantization_config)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"invalid DeepseekV41Config: quantization_config: {exc}") from None
        if fp8.ignored_layers:  # the checkpoint layout and its loader have every dense linear in FP8
            raise ValueError(f"invalid DeepseekV41Config: quantization_config keeps {list(fp8.ignored_layers)} "
                             "unquantized; a DSv4.1 checkpoint has every dense linear in FP8 (not supported)")
        if self.num_attention_heads % self.o_groups:
            errors.append(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                          f"o_groups={self.o_groups}")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            errors.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= head_dim")
        if self.num_key_value_heads != 1:
            errors.append("DSv4.1 attention has one latent KV head (num_key_value_heads=1)")
        if self.num_experts_per_tok > self.n_routed_experts:
            errors.append("num_experts_per_tok > n_routed_experts")
        if self.n_routed_experts > MAX_EXPERTS or self.num_experts_per_tok > MAX_TOP_K:
            errors.append(f"the router kernel runs up to {MAX_EXPERTS} experts and top-{MAX_TOP_K}, got "
                          f"{self.n_routed_experts} and top-{self.num_experts_per_tok}")
        # what the kernels take: refused here rather than at the first forward (in warmup or capture)
        try:
            check_limit(self.swiglu_limit)
        except ValueError as exc:
            errors.append(f"swiglu_{exc}")
        for name in ("rms_norm_eps", "hc_eps"):
            try:
                check_eps(getattr(self, name), name)
            except ValueError as exc:
                errors.append(str(exc))
        if self.n_shared_experts != 1:
            errors.append("exactly one shared expert is supported")
        if self.hc_mult != 4:
            errors.append(f"hc_mult={self.hc_mult}: the mHC kernels run 4 streams")
        if self.scoring_func != "sqrtsoftplus":
            errors.append(f"scoring_func {self.scoring_func!r} is not supported (sqrtsoftplus)")
        if self.expert_dtype != "fp4":
            errors.append(f"expert_dtype {self.expert_dtype!r} is not supported (fp4)")
        if self.tie_word_embeddings:  # DSv4.1 has its own head.weight; a tied one would be ignored
            errors.append("tie_word_embeddings=True is not supported (the model reads head.weight)")
        bn, bk = self.weight_block_size
        # the FP8 activation groups are the weight block's K columns: the block rule covers them
        # (a TP4 shard of the shared down projection has K = 576, a multiple of 32 but not of 128)
        for name, (n, k) in self.fp8_linear_shapes().items():
            if n % bn or k % bk:
                errors.append(f"{name}: [{n}, {k}] must be a multiple of the {bn}x{bk} weight blocks")
        if self.o_lora_rank % bn:  # wo_a writes wo_b's pair: a scale group never spans two einsum groups
            errors.append(f"o_lora_rank={self.o_lora_rank} must be a multiple of the weight block's {bn} rows")
        for name, k in (("hidden_size", self.hidden_size), ("moe_intermediate_size",
                                                              self.moe_intermediate_size)):
            if k % 32:
                errors.append(f"{name}={k} must be a multiple of 32 (MXFP4 groups)")
        if errors:
            raise ValueError("invalid DeepseekV41Config: " + "; ".join(errors))


def _check_read_keys(d: dict, config: DeepseekV41Config) -> None:
    """config.json keys the model does not read but that say what it computes: ``ValueError`` where
    the model cannot be the one described, a WARNING where it runs without that feature."""
    refused = []
    if d.get("hidden_act", "silu") != "silu":
        refused.append(f"hidden_act={d['hidden_act']!r} (the shared and routed experts run SiLU)")
    if "qk_nope_head_dim" in d and d["qk_nope_head_dim"] != config.qk_nope_head_dim:
        refused.append(f"qk_nope_head_dim={d['qk_nope_head_dim']!r} (head_dim - qk_rope_head_dim = "
                       f"{config.qk_nope_head_dim})")
    if refused:
        raise ValueError("invalid DeepseekV41Config: " + "; ".join(refused))
    if d.get("rope_scaling"):
        logger.warning("config rope_scaling %r is not implemented: positions rotate with plain RoPE "
                       "(rope_theta); scaling such as YaRN changes the frequencies and the attention "
                       "scale at every position, so the logits differ from the scaled model's "
                       "everywhere", d["rope_scaling"])
    n_group, topk_group = d.get("n_group"), d.get("topk_group")
    if is_int(n_group) and is_int(topk_group) and 1 < n_group and topk_group < n_group:
        logger.warning("config n_group=%d, topk_group=%d (group-limited routing) is not implemented: the "
                       "router picks the top %d of all experts, which can span more groups", n_group,
                       topk_group, config.num_experts_per_tok)
    if d.get("sliding_window") is not None:
        logger.warning("config sliding_window=%r is not implemented: every token attends to its whole "
                       "context", d["sliding_window"])
    if is_int(d.get("num_hash_layers")) and d["num_hash_layers"] > 0:
        logger.warning("config num_hash_layers=%d (hash-routed first layers) is not implemented: every layer routes "
                       "with its learned router", d["num_hash_layers"])
    if d.get("torch_dtype", "bfloat16") != "bfloat16":
        logger.warning("config torch_dtype=%r is not used: the model runs its activations, norms and dense "
                       "weights in bfloat16 and its quantized weights as stored", d["torch_dtype"])


# --------------------------------------------------------------------------------------------
# RoPE and the attention core (shared by the model and the fp32 reference)
# --------------------------------------------------------------------------------------------


def _chain_format(linear, chain: bool):
    """The format a producer should write for ``linear``: its ``input_format`` when the chain
    is on and the linear accepted a pre-quantized input, else ``None`` (bf16 only)."""
    return getattr(linear, "input_format", None) if chain else None


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


#: Decode steps of up to this many tokens fork the attention sublayer's mHC stats beside its
#: attention core: there the split kernel runs a few programs per token and leaves most SMs to
#: the stats, where beside wqkv_a they take SMs from a bandwidth-bound GEMV or GEMM. From 8 tokens
#: on neither place is faster on the H200 (docs/model.md, "Structure and the chain").
STATS_BESIDE_CORE_TOKENS = 4


class MQALayer(nn.Module):
    """DSv4.1 attention with the chain: x -> wqkv_a -> q_norm -> wq_b -> MQA core over the KV
    cache -> inverse RoPE -> wo_a einsum -> wo_b.

    The core is plain causal multi-query attention: one ``head_dim``-wide latent head (the last
    ``head_dim`` columns of ``wqkv_a``, RMS-normed by ``kv_norm``, RoPE on its last
    ``qk_rope_head_dim`` dims) serves as key and value of every query head; queries are
    RMS-normalized per head (no weight) and roped the same way; per-head attention sinks.
    DSv4.1's sparse indexer and compressor are not modelled; the bf16 ``x`` and ``q_lora`` they
    would read are still produced (``last_x``/``last_q_lora`` keep them when ``keep_indexer_inputs``).

    With ``tp_size > 1`` (as SGLang shards it) each rank holds ``heads / tp`` query heads and
    ``o_groups / tp`` wo_a groups (``wq_b`` column parallel, ``wo_b`` row parallel with its
    all-reduce over ``tp_group``, the heads' sinks); ``wqkv_a``, the norms and the latent KV cache
    are whole on every rank.
    """

    def __init__(self, config: DeepseekV41Config, layer_idx: int = 0, quant_config=None,
                 prefix: str = "attn", tp_rank: int = 0, tp_size: int = 1, tp_group=None):
        super().__init__()
        c = config
        check_tp(tp_rank, tp_size)
        if c.o_groups % tp_size:  # the heads split with them (heads are a multiple of the groups)
            raise ValueError(f"o_groups={c.o_groups} is not divisible by tp_size {tp_size}")
        self.layer_idx = layer_idx
        self.num_heads = c.num_attention_heads // tp_size  # this rank's
        self.head_dim = c.head_dim
        self.rope_dim = c.qk_rope_head_dim
        self.q_lora_rank = c.q_lora_rank
        self.o_groups = c.o_groups // tp_size  # this rank's
        self.o_lora_rank = c.o_lora_rank
        self.rope_theta = c.rope_theta
        self.eps = c.rms_norm_eps
        self.softmax_scale = c.head_dim ** -0.5
        self.chain = True
        self.keep_indexer_inputs = False
        self.stats_beside_core_tokens = STATS_BESIDE_CORE_TOKENS
        self.wqkv_a = ReplicatedLinear(c.hidden_size, c.q_lora_rank + c.kv_dim, bias=False,
                                       quant_config=quant_config, prefix=f"{prefix}.wqkv_a")
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(c.q_lora_rank, c.num_attention_heads * c.head_dim,
                                         bias=False, quant_config=quant_config,
                                         prefix=f"{prefix}.wq_b", tp_rank=tp_rank, tp_size=tp_size)
        self.kv_norm = RMSNorm(c.kv_dim, c.rms_norm_eps)  # its weight; applied inside rope_qkv
        self.wo_a = nn.Parameter(torch.zeros(self.o_groups, c.o_lora_rank, c.o_group_dim,
                                             dtype=torch.bfloat16), requires_grad=False)
        self.wo_b = RowParallelLinear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False,
                                      quant_config=quant_config, prefix=f"{prefix}.wo_b",
                                      tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32),
                                      requires_grad=False)
        # The producer -> consumer request (docs/layers.md, Construction).
        self.wqkv_a.deepgemm_mxfp8_input = True
        self.wq_b.deepgemm_mxfp8_input = True
        self.wo_b.deepgemm_mxfp8_input = True
        self.last_x = self.last_q_lora = None
        self._rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def attend(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               kv_cache: torch.Tensor, impl=attention_kernels) -> torch.Tensor:
        """The attention core between ``wq_b`` and ``wo_a``: ``q [T, nh*d]`` (wq_b's output) and
        the raw latent ``kv [T, d]`` (wqkv_a's last columns) -> ``o [T, G, nh/G*d]`` bf16, after
        the inverse RoPE.

        ``kv_norm`` runs inside ``rope_qkv`` (``kv_weight``), which writes the normed, roped
        latent into ``kv_cache``; ``impl`` provides ``rope_qkv`` and
        ``mqa_attention`` (the Triton kernels, or ``fp8chain_kernel.reference`` for a plain-torch
        arm). The same in both arms of the chain.
        """
        cos, sin = self.rope_tables(kv_cache.shape[1], kv_cache.device)
        q = impl.rope_qkv(q, kv, cos, sin, kv_cache, slots, positions, self.eps, kv_weight=self.kv_norm.weight)
        o = impl.mqa_attention(q, kv_cache, slots, positions, self.attn_sink, self.softmax_scale, cos, sin)
        return o.view(q.shape[0], self.o_groups, self.wo_a.shape[2])  # explicit: T = 0 too

    def share_rope_tables(self, tables: dict) -> None:
        """Keep the RoPE tables in ``tables``, a dict the caller shares between layers (the model
        gives all its layers one)."""
        self._rope_tables = tables

    @torch.compiler.disable
    def rope_tables(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for positions ``0..length-1``, made once per cache length (at warmup,
        before any graph capture) and reused; the layers of one model share them."""
        key = (length, str(device), self.rope_dim, self.rope_theta)
        if key not in self._rope_tables:
            self._rope_tables[key] = rope_tables(length, self.rope_dim, self.rope_theta, device)
        return self._rope_tables[key]

    def forward(self, x: torch.Tensor, x_pair: QuantizedActivation | None, positions: torch.Tensor,
                slots: torch.Tensor, kv_cache: torch.Tensor, fork_stats=None) -> torch.Tensor:
        """``x [T, H]`` bf16 (+ its pair when chained) -> ``y [T, H]`` bf16.

        ``kv_cache [S, L, head_dim]`` bf16; token ``t`` writes its roped latent at
        ``kv_cache[slots[t], positions[t]]`` and attends to positions ``<= positions[t]`` of
        its slot. ``fork_stats`` (``run_sublayer``'s) is called once: right before the
        attention core at up to ``stats_beside_core_tokens`` tokens, else first.
        """
        beside_core = x.shape[0] <= self.stats_beside_core_tokens
        if fork_stats is not None and not beside_core:
            fork_stats()
        qkv = self.wqkv_a(x_pair if (self.chain and x_pair is not None) else x)
        q_lora, kv = qkv[:, :self.q_lora_rank], qkv[:, self.q_lora_rank:]
        q_lora, q_pair = self.q_norm(q_lora, _chain_format(self.wq_b, self.chain))
        if self.keep_indexer_inputs:  # what DSv4.1's indexer reads (not modelled here)
            self.last_x, self.last_q_lora = x, q_lora
        q = self.wq_b(q_pair if q_pair is not None else q_lora)
        if fork_stats is not None and beside_core:
            fork_stats()
        o = self.attend(q, kv, positions, slots, kv_cache)

        fmt = _chain_format(self.wo_b, self.chain)
        # chained, wo_b is the only reader of the einsum's output: the pair alone, no bf16 store;
        # unchained, the bf16 bits of the chained launch (tiles of wo_b's scale group)
        group = self.wo_b.act_format.group_size if fmt is None and self.wo_b.act_format is not None else None
        return self.wo_b(einsum_kernels.wo_a_einsum(o, self.wo_a, out_format=fmt, return_bf16=fmt is None,
                                                    tile_group=group))


# --------------------------------------------------------------------------------------------
# MoE
# --------------------------------------------------------------------------------------------


class DeepseekV41MoE(nn.Module):
    """Router + FP8 shared expert (chained) + MXFP4 routed experts (torch reference).

    ``y = bf16(sum_k w_k * expert_k(x) + shared(x))`` with ``w`` already scaled by
    ``routed_scaling_factor``. With ``tp_size > 1`` the shared expert is sharded (its ``down``
    sums over the ranks); the router and the routed experts' reference run whole on every rank.
    """

    def __init__(self, config: DeepseekV41Config, quant_config=None, prefix: str = "ffn", tp_rank: int = 0,
                 tp_size: int = 1, tp_group=None):
        super().__init__()
        c = config
        self.gate = TopKRouter(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok,
                               c.routed_scaling_factor, renormalize=c.norm_topk_prob)
        self.shared_experts = SharedExpert(c.hidden_size, c.moe_intermediate_size,
                                           swiglu_limit=c.swiglu_limit, quant_config=quant_config,
                                           prefix=f"{prefix}.shared_experts", tp_rank=tp_rank, tp_size=tp_size,
                                           tp_group=tp_group)
        self.experts = RoutedExpertsReference(c.n_routed_experts, c.hidden_size,
                                              c.moe_intermediate_size, c.swiglu_limit)

    @property
    def input_linear(self):
        """The FP8 linear that reads this sublayer's input (its producer writes this format)."""
        return self.shared_experts.gate_up

    def forward(self, x: torch.Tensor, x_pair: QuantizedActivation | None = None) -> torch.Tensor:
        topk_idx, topk_weights = self.gate(x)
        shared = self.shared_experts(x, x_pair)
        routed = self.experts(x, topk_idx, topk_weights)
        return (routed + shared.float()).to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Decoder layer and model
# --------------------------------------------------------------------------------------------


class DeepseekV41DecoderLayer(nn.Module):
    """Attention and MoE sublayers joined by mHC boundaries (shifted ordering)."""

    def __init__(self, config: DeepseekV41Config, layer_idx: int, quant_config=None, *, tp_rank: int = 0,
                 tp_size: int = 1, tp_group=None):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.chain = True
        self.overlap_stats = True  # mHC stats on a side stream beside each sublayer (CUDA)
        hc = dict(hc_mult=c.hc_mult, rms_eps=c.rms_norm_eps, hc_eps=c.hc_eps,
                  sinkhorn_iters=c.hc_sinkhorn_iters)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_attn = HyperConnection(c.hidden_size, **hc)
        self.hc_ffn = HyperConnection(c.hidden_size, **hc)
        tp = dict(tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        self.attn = MQALayer(c, layer_idx, quant_config, prefix=f"layers.{layer_idx}.attn", **tp)
        self.ffn = DeepseekV41MoE(c, quant_config, prefix=f"layers.{layer_idx}.ffn", **tp)

    def forward(self, x, x_pair, residual, positions, slots, kv_cache, next_norm: RMSNorm,
                next_linear):
        """Runs both sublayers from ``(x, x_pair, residual)`` (the input of attention) and
        returns the next sublayer's ``(x, x_pair, residual)``: the boundary after the MoE
        normalizes with ``next_norm`` and writes the format ``next_linear`` reads."""
        residual, x, x_pair = run_sublayer(
            self.hc_attn, lambda fork: self.attn(x, x_pair, positions, slots, kv_cache, fork), residual,
            self.ffn_norm, _chain_format(self.ffn.input_linear, self.chain), self.overlap_stats)
        residual, x, x_pair = run_sublayer(
            self.hc_ffn, at_start(lambda: self.ffn(x, x_pair)), residual, next_norm,
            _chain_format(next_linear, self.chain), self.overlap_stats)
        return x, x_pair, residual


class LMHead(nn.Module):
    """bf16 ``[V, H]`` output projection; logits in fp32."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size, hidden_size, dtype=torch.bfloat16),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.weight.float().t()


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size, hidden_size, dtype=torch.bfloat16),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


def _dense_scale_name(name: str) -> str:
    """A dense weight's block scales under the alias ``<x>.scale`` -> ``<x>.weight_scale_inv``; any
    other name (an MXFP4 expert's ``.scale`` among them) unchanged (docs/model.md)."""
    if name.endswith(".scale") and not re.search(r"\.experts\.\d+\.", name):
        return name[: -len(".scale")] + ".weight_scale_inv"
    return name


def _capturing_graph(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device`` (host reads are forbidden then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class DeepseekV41ForCausalLM(nn.Module):
    """The whole decoder: embedding -> 4-stream residual -> layers -> final combine + norm ->
    head. ``chain`` switches every producer's FP8 output (``set_chain``)."""

    def __init__(self, config: DeepseekV41Config, *, chain: bool = True, device=None, tp_rank: int = 0,
                 tp_size: int = 1, tp_group=None):
        super().__init__()
        config.validate()
        self.config = config
        self.quant_config = Fp8Config.from_config(config.quantization_config)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        with torch.device(device if device is not None else "cpu"):
            self.embed = Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(
                DeepseekV41DecoderLayer(config, i, self.quant_config, tp_rank=tp_rank, tp_size=tp_size,
                                        tp_group=tp_group)
                for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.head = LMHead(config.vocab_size, config.hidden_size)
        # one set of RoPE tables for all layers: [L, rd/2] fp32 twice per layer would be ~1.3 GiB
        # at Flash's 43 layers and 128K positions
        shared_tables: dict = {}
        for layer in self.layers:
            layer.attn.share_rope_tables(shared_tables)
        self.chain = chain
        self.set_chain(chain)
        self.quantize_counter = QuantizeCounter(self)
        self._fp8_linear_list = list(self.fp8_linears().items())  # check_replayable, once per replay
        # why the model may not run: a load_weights that failed after it had written parameters
        self.weights_error: str | None = None

    @classmethod
    def from_pretrained(cls, path, *, device=None, chain: bool = True, **tp) -> "DeepseekV41ForCausalLM":
        """Config + weights from a checkpoint directory (``models.checkpoint`` format); ``tp``:
        ``tp_rank``, ``tp_size``, ``tp_group`` (each rank reads the whole checkpoint, keeps its shard)."""
        from .checkpoint import load_checkpoint

        config, tensors = load_checkpoint(path)
        model = cls(config, chain=chain, device=device, **tp)
        model.load_weights((name, t.to(device)) if device is not None else (name, t)
                           for name, t in tensors)
        return model

    # ---- chain switch ----------------------------------------------------------------

    def set_chain(self, on: bool) -> None:
        """Producers write FP8 pairs (``True``) or bf16 only (``False``), model-wide."""
        if not isinstance(on, bool):  # bool("false") is True
            raise TypeError(f"chain must be True or False, got {on!r}")
        for module in self.modules():
            if hasattr(module, "chain"):
                module.chain = on

    def fp8_linears(self) -> dict[str, nn.Module]:
        """Every FP8 dense linear by module name."""
        kinds = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear)
        return {name: m for name, m in self.named_modules() if isinstance(m, kinds)}

    # ---- KV cache --------------------------------------------------------------------

    def make_kv_cache(self, num_slots: int, max_len: int, device=None) -> list[torch.Tensor]:
        """One bf16 ``[num_slots, max_len, head_dim]`` latent cache per layer."""
        device = device if device is not None else self.embed.weight.device
        return [torch.zeros(num_slots, max_len, self.config.kv_dim, dtype=torch.bfloat16,
                            device=device) for _ in self.layers]

    # ---- forward ---------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                kv_caches: list[torch.Tensor], logits_indices: torch.Tensor | None = None, *,
                check_indices: bool = True) -> torch.Tensor:
        """Flat tokens of any number of sequences -> fp32 logits ``[len(logits_indices), V]``
        (all tokens when ``logits_indices`` is None).

        ``input_ids``, ``positions`` and ``slots`` are int32/int64 ``[T]``: token ``t`` writes its
        latent at ``[slots[t], positions[t]]`` of each layer's cache in ``kv_caches`` (one
        ``[S, L, head_dim]`` cache per layer, ``make_kv_cache``). Ids outside ``[0, V)``, positions
        outside ``[0, L)`` and slots outside ``[0, S)`` are refused before anything runs, at the
        cost of one host read per call; ``check_indices=False`` skips that read for a caller that
        made the indices itself (the runtime ``Engine``: its validated prompts and the steps of
        ``generate``). While a CUDA graph is captured it is skipped too (capture forbids host
        syncs), so graph replays are not checked: the ``Engine`` validates what it feeds them.
        Dtypes, shapes and devices are always checked (no host read). A model whose last
        ``load_weights`` failed part-way refuses to run (``check_weights_loaded``).
        """
        self.check_weights_loaded()
        self._check_inputs(input_ids, positions, slots, kv_caches, logits_indices)
        with on_device(input_ids.device):  # the kernels and the stats' side stream act on the current device
            if check_indices and not _capturing_graph(input_ids.device):
                self._check_index_values(input_ids, positions, slots, kv_caches, logits_indices)
            return self._layers_forward(input_ids, positions, slots, kv_caches, logits_indices)

    def _layers_forward(self, input_ids, positions, slots, kv_caches, logits_indices):
        c = self.config
        residual = expand_streams(self.embed(input_ids), c.hc_mult)
        first = self.layers[0]
        x, x_pair = first.attn_norm(residual[:, 0], _chain_format(first.attn.wqkv_a, self.chain))
        for i, layer in enumerate(self.layers):
            if i + 1 < len(self.layers):
                nxt = self.layers[i + 1]
                next_norm, next_linear = nxt.attn_norm, nxt.attn.wqkv_a
            else:
                next_norm, next_linear = self.norm, None
            x, x_pair, residual = layer(x, x_pair, residual, positions, slots, kv_caches[i],
                                        next_norm, next_linear)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.head(x)

    def _check_inputs(self, input_ids, positions, slots, kv_caches, logits_indices=None) -> None:
        """``forward``'s refusals of index dtypes, shapes and devices and of the caches' layout."""
        device = self.embed.weight.device
        indices = (("input_ids", input_ids), ("positions", positions), ("slots", slots))
        if logits_indices is not None:
            indices += (("logits_indices", logits_indices),)
        for name, t in indices:
            if not isinstance(t, torch.Tensor) or t.dtype not in attention_kernels.INDEX_DTYPES:
                got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise TypeError(f"{name} must be an int32/int64 tensor, got {got}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device}, the model on {device}")
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D [T], got shape {tuple(input_ids.shape)}")
        if logits_indices is not None and logits_indices.dim() != 1:
            raise ValueError(f"logits_indices must be 1-D [N], got shape {tuple(logits_indices.shape)}")
        if positions.shape != input_ids.shape or slots.shape != input_ids.shape:
            raise ValueError(f"positions and slots must have input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(positions.shape)} and {tuple(slots.shape)}")
        if not isinstance(kv_caches, (list, tuple)):
            raise TypeError(f"kv_caches must be a list of per-layer caches (make_kv_cache), got "
                            f"{type(kv_caches).__name__}")
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches must hold one cache per layer: {len(self.layers)} layers, "
                             f"got {len(kv_caches)}")
        shapes = [tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
                  for cache in kv_caches]
        if len(set(shapes)) != 1 or not (isinstance(shapes[0], tuple) and len(shapes[0]) == 3):
            raise ValueError(f"kv_caches must be [S, L, head_dim] tensors of one shape (make_kv_cache), "
                             f"got {sorted(set(map(str, shapes)))}")
        for i, j in itertools.combinations(range(len(kv_caches)), 2):
            if overlaps(kv_caches[i], kv_caches[j]):  # a later layer would overwrite an earlier one's keys
                raise ValueError(f"kv_caches[{i}] and kv_caches[{j}] share memory: each layer needs a cache "
                                 "of its own (make_kv_cache)")

    def _check_index_values(self, input_ids, positions, slots, kv_caches, logits_indices=None) -> None:
        """``forward``'s refusal of index values (one host read): an id out of range indexes the
        embedding out of bounds (a negative one wraps around), a position or slot out of range
        makes the attention kernels skip the token (no cache row, NaN output), two tokens at one (slot, position) race for one cache row (one
        token's latent is lost, and it attends to the other's), a logits index out of range picks
        no token (a negative one another token)."""
        num_slots, length = kv_caches[0].shape[:2]
        ranges = (("input_ids", input_ids, self.config.vocab_size, "the vocabulary"),
                  ("positions", positions, length, "the KV cache length"),
                  ("slots", slots, num_slots, "the KV cache slots"))
        if logits_indices is not None and logits_indices.numel():
            ranges += (("logits_indices", logits_indices, input_ids.shape[0], "the tokens"),)
        cells = torch.sort(slots.long() * length + positions.long()).values
        shared_cell = (cells[1:] == cells[:-1]).any()
        bad = torch.stack([((t < 0) | (t >= bound)).any() for _, t, bound, _ in ranges] + [shared_cell])
        if bad.any().item():  # the one host read
            *outside, shared = bad.tolist()
            problems = [f"{name} must be in [0, {bound}) ({what}), got values in [{t.min().item()}, {t.max().item()}]"
                        for (name, t, bound, what), out in zip(ranges, outside) if out]
            if shared and not any(outside[1:3]):
                cell = cells[1:][cells[1:] == cells[:-1]][0].item()
                problems.append(f"tokens share the KV-cache row (slot {cell // length}, position "
                                f"{cell % length}): each (slot, position) may be written once per call")
            raise ValueError("; ".join(problems))

    # ---- weights ---------------------------------------------------------------------

    def check_weights_loaded(self) -> None:
        """Raise ``RuntimeError`` while the parameters hold parts of two checkpoints: the last
        ``load_weights`` failed after it had copied some tensors in (a later one that succeeds
        clears this). Checked by ``forward`` and by ``check_replayable`` before every graph replay."""
        if self.weights_error is not None:
            raise RuntimeError(self.weights_error)

    def check_replayable(self) -> None:
        """Raise ``RuntimeError`` where a captured decode graph must not replay; its replay runs no
        Python, so the ``Engine`` asks before each one (and the graph runner before capture):
        ``check_weights_loaded``; every FP8 linear and the routed experts processed (a
        ``layers.loading.load_weights`` that failed part-way leaves them refusing eager calls, which a
        replay would not make); and no
        host-side diagnostics on (``TopKRouter.record``, ``MQALayer.keep_indexer_inputs``: a replay
        would leave them holding what the capture saw)."""
        self.check_weights_loaded()
        for name, linear in self._fp8_linear_list:
            if linear.act_format is None:
                raise RuntimeError(f"{name}: weights not processed (a load failed part-way?); load the weights "
                                   "again before replaying decode graphs")
        for i, layer in enumerate(self.layers):
            if layer.ffn.experts.stale is not None:
                raise RuntimeError(f"layers.{i}.ffn.experts: {layer.ffn.experts.stale}")
            if layer.ffn.gate.record is not None or layer.attn.keep_indexer_inputs:
                raise RuntimeError(f"layers.{i}: ffn.gate.record or attn.keep_indexer_inputs is on; decode graph "
                                   "replays run no Python and would not update them: run eagerly to use them")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load DSv4.1 checkpoint tensors (names: docs/model.md); returns the names loaded.

        Fused parameters are concatenated here (``wq_a`` + ``wkv`` -> ``wqkv_a``, shared
        ``w1`` + ``w3`` -> ``gate_up``), ``wo_a`` is dequantized to bf16, MXFP4 experts are
        stacked per layer; FP8 linears go through ``fp8chain.layers.loading.load_weights``,
        which also runs their ``process_weights_after_loading``. Values are copied into the
        existing parameters as the tensors stream in (no second copy of the checkpoint is held),
        so a reload is seen by captured CUDA graphs. Raises ``KeyError`` for an unknown name and
        ``ValueError`` for a missing one or a bad value; once a tensor has been copied in, a
        failure also leaves the model refusing to run until a load succeeds
        (``check_weights_loaded``): it would otherwise compute with parts of two checkpoints.
        """
        written = False

        def started() -> None:
            nonlocal written
            written = True

        try:
            loaded = self._load_weights(weights, started)
        except BaseException as exc:
            if written:
                self.weights_error = (f"the last load_weights failed after writing parameters ({type(exc).__name__}: "
                                      f"{exc}); they hold parts of two checkpoints until a load_weights succeeds")
            raise
        self.weights_error = None
        return loaded

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], started) -> set[str]:
        """``load_weights``' work; calls ``started()`` before its first write into the model."""
        from ..layers import loading
        from .checkpoint import checkpoint_layout

        layout = checkpoint_layout(self.config)
        expected = set(layout)
        loaded: set[str] = set()
        pending: dict[str, dict[str, torch.Tensor]] = {}
        params = dict(self.named_parameters())
        c = self.config
        inter = c.moe_intermediate_size

        def copy_into(target: str, tensor: torch.Tensor) -> None:
            param = params[target]
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{target}: checkpoint shape {tuple(tensor.shape)} != "
                                 f"parameter shape {tuple(param.shape)}")
            started()
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype) if tensor.dtype != param.dtype else tensor)

        def stash(key: str, part: str, tensor: torch.Tensor, parts: tuple[str, ...]):
            slot = pending.setdefault(key, {})
            slot[part] = tensor
            if all(p in slot for p in parts):
                done = pending.pop(key)
                return [done[p] for p in parts]
            return None

        def dense_linear(pfx: str, linear: str, kind: str, tensor: torch.Tensor):
            """A checked FP8 linear tensor to its parameter: yielded as it is, or fused once both
            halves are in (``wqkv_a`` = ``wq_a`` + ``wkv``, ``gate_up`` = ``w1`` + ``w3``)."""
            if linear in ("attn.wq_a", "attn.wkv"):
                parts = stash(f"{pfx}.attn.wqkv_a.{kind}", linear[5:], tensor, ("wq_a", "wkv"))
                if parts is not None:
                    yield f"{pfx}.attn.wqkv_a.{kind}", torch.cat(parts, 0)
            elif linear in ("attn.wq_b", "attn.wo_b"):
                yield f"{pfx}.{linear}.{kind}", tensor
            elif linear in ("ffn.shared_experts.w1", "ffn.shared_experts.w3"):
                key = f"{pfx}.ffn.shared_experts.gate_up.{kind}"
                parts = stash(key, linear[-2:], tensor, ("w1", "w3"))
                if parts is not None:
                    yield key, torch.cat(parts, 0)
            else:  # the shared w2
                yield f"{pfx}.ffn.shared_experts.down.{kind}", tensor

        def fp8_linear_tensors():
            """Every tensor in turn: the FP8 linears' yielded (fused pairs once both halves are in)
            for ``loading.load_weights`` to write as they come, the rest written here. Each FP8
            linear's weight and scales are checked whole (``check_weights``) under their checkpoint
            name once both are in: every tensor parallel rank sees the same verdict and the error
            names the file's tensor and index, not a rank's shard of a fused parameter."""
            for name, tensor in weights:
                name = admit_checkpoint_name(name, layout, loaded)
                _check_checkpoint_tensor(name, tensor, layout[name])
                if name in ("embed.weight", "head.weight", "norm.weight"):
                    copy_into(name, tensor)
                    continue
                m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
                i, rest = int(m.group(1)), m.group(2)
                pfx = f"layers.{i}"
                if rest == "attn.attn_sink":  # one per query head: this rank's heads
                    copy_into(f"{pfx}.{rest}", self._shard(tensor))
                elif rest in ("attn_norm.weight", "ffn_norm.weight", "attn.q_norm.weight",
                              "attn.kv_norm.weight", "ffn.gate.weight", "ffn.gate.bias"):
                    if rest == "ffn.gate.bias":
                        _check_values_within(name, tensor, "gate.bias")
                    copy_into(f"{pfx}.{rest}", tensor)
                elif (h := re.fullmatch(r"hc_(attn|ffn)_(fn|base|scale)", rest)):
                    if h.group(2) == "fn":
                        _check_values_within(name, tensor, "fn")
                    copy_into(f"{pfx}.hc_{h.group(1)}.{h.group(2)}", tensor)
                elif (q := re.fullmatch(r"(attn\.(?:wq_a|wkv|wq_b|wo_b)|ffn\.shared_experts\.w[123])\."
                                        r"(weight|weight_scale_inv)", rest)):
                    linear = q.group(1)
                    both = stash(f"{pfx}.{linear}", q.group(2), tensor, ("weight", "weight_scale_inv"))
                    if both is not None:
                        check_weights(*both, self.quant_config.block, self.quant_config.scale_fmt, f"{pfx}.{linear}")
                        for kind, checked in zip(("weight", "weight_scale_inv"), both):
                            yield from dense_linear(pfx, linear, kind, checked)
                elif (q := re.fullmatch(r"attn\.wo_a\.(weight|weight_scale_inv)", rest)):
                    parts = stash(f"{pfx}.attn.wo_a", q.group(1), tensor, ("weight", "weight_scale_inv"))
                    if parts is not None:
                        self._load_wo_a(self.layers[i].attn, f"{pfx}.attn.wo_a", *parts, started)
                elif (q := re.fullmatch(r"ffn\.experts\.(\d+)\.(w1|w2|w3)\.(weight|scale)", rest)):
                    e, w = int(q.group(1)), q.group(2)
                    matrix = f"{pfx}.ffn.experts.{e}.{w}"
                    both = stash(matrix, q.group(3), tensor.view(torch.uint8), ("weight", "scale"))
                    if both is None:
                        continue
                    check_mxfp4(*both, matrix)  # named here; the experts' processing sees them stacked
                    experts = self.layers[i].ffn.experts
                    rows = slice(0, inter) if w == "w1" else slice(inter, 2 * inter)
                    targets = ((experts.w13_weight[e, rows], experts.w13_scale[e, rows]) if w != "w2"
                               else (experts.w2_weight[e], experts.w2_scale[e]))
                    for kind, target, value in zip(("weight", "scale"), targets, both):
                        if tuple(target.shape) != tuple(value.shape):
                            raise ValueError(f"{matrix}.{kind}: shape {tuple(value.shape)} != {tuple(target.shape)}")
                    started()
                    with torch.no_grad():
                        for target, value in zip(targets, both):
                            target.copy_(value)
                else:  # pragma: no cover - checkpoint_layout and this table are written together
                    raise KeyError(f"no rule for checkpoint tensor {name!r}")
            missing = expected - loaded
            if missing or pending:
                raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. "
                                 f"{sorted(missing)[:5]} (incomplete groups: {sorted(pending)[:5]})")

        def announced(items):
            for item in items:
                started()
                yield item

        # the linears' tensors written as they stream in, then every layer's processing (the
        # experts' bf16 copies too): no second copy of the checkpoint is held
        loading.load_weights(self, announced(fp8_linear_tensors()))
        return loaded

    def _shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's ``1 / tp_size`` of ``tensor``'s rows (query heads, wo_a groups)."""
        rows = tensor.shape[0] // self.tp_size
        return tensor.narrow(0, self.tp_rank * rows, rows)

    def _load_wo_a(self, attn: MQALayer, name: str, weight: torch.Tensor, scale: torch.Tensor, started) -> None:
        """FP8 ``[G*R, D]`` + 32x32 scales -> bf16 ``[G, R, D]`` (dequantized once, in place),
        after the checks the FP8 linears' tensors get (``check_weights``); ``started()`` before
        the write."""
        check_weights(weight, scale, self.quant_config.block, self.quant_config.scale_fmt, name)
        # this rank's groups: their rows of the weight and of the 32-row scale blocks
        weight, scale = self._shard(weight), self._shard(scale)
        w = dequantize_weight(weight.to(attn.wo_a.device), scale.to(attn.wo_a.device),
                              self.config.weight_block_size)
        started()
        with torch.no_grad():
            attn.wo_a.copy_(w.view(attn.wo_a.shape).to(torch.bfloat16))


#: Element types a checkpoint may store MXFP4 experts in (packed e2m1 pairs; e8m0 scale bits).
MXFP4_WEIGHT_DTYPES = MXFP4_PACKED_DTYPES
MXFP4_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8)
#: Element types of the other tensors, converted on copy (an FP8 one would lose its scale).
VALUE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_checkpoint_tensor(name: str, tensor, spec) -> None:
    """A checkpoint tensor against its ``checkpoint_layout`` entry (``check_tensor_spec``)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(tensor).__name__}")
    check_tensor_spec(name, tuple(tensor.shape), tensor.dtype, spec)


def check_tensor_spec(name: str, shape: tuple[int, ...], dtype: torch.dtype | None, spec) -> None:
    """A checkpoint tensor's shape and element type against its ``checkpoint_layout`` entry: the
    shape, and an element type that is read right: FP8 weights e4m3 and their block scales float32
    (uint8 UE8M0 bytes would be read as numbers), MXFP4 experts and their scales bytes, every other
    tensor a float of 16 bits or more (converted on copy). ``dtype=None`` (a file's element type
    torch has no name for here) checks the shape only."""
    if tuple(shape) != tuple(spec.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(shape)} != expected {tuple(spec.shape)}")
    allowed = {"fp8": (spec.dtype,), "fp8_scale": (spec.dtype,), "mxfp4": MXFP4_WEIGHT_DTYPES,
               "mxfp4_scale": MXFP4_SCALE_DTYPES}.get(spec.kind, VALUE_DTYPES)
    if dtype is not None and dtype not in allowed:
        raise TypeError(f"{name}: {spec.kind} tensors must be one of {allowed}, got {dtype}")


def admit_checkpoint_name(name: str, layout, seen: set[str]) -> str:
    """The ``layout`` name a checkpoint tensor fills (``<x>.scale`` -> ``<x>.weight_scale_inv``),
    added to ``seen``: ``KeyError`` for a name outside the layout, ``ValueError`` for one already
    seen (under either name)."""
    if name not in layout:
        alias = _dense_scale_name(name)
        if alias == name or alias not in layout:
            raise KeyError(f"unexpected checkpoint tensor {name!r}")
        name = alias
    if name in seen:
        raise ValueError(f"checkpoint tensor {name!r} given twice (as .scale and .weight_scale_inv?)")
    seen.add(name)
    return name


#: Checkpoint tensors whose values must be finite within a bound: (the bound, why).
_VALUE_BOUNDS = {
    # mhc_stats multiplies fn on the tensor cores as three bf16 parts: beyond bf16's range a value
    # splits into inf - inf and makes every mix of every token NaN
    "fn": (torch.finfo(torch.bfloat16).max, "mhc_stats splits fn into bf16 parts"),
    # a NaN or infinite correction decides every token's experts while its weights stay finite
    "gate.bias": (torch.finfo(torch.float32).max, "the router's selection adds it"),
}


def _check_values_within(name: str, tensor: torch.Tensor, kind: str) -> None:
    """``ValueError`` naming the count and the first element of ``tensor`` that is NaN, infinite or
    beyond ``_VALUE_BOUNDS[kind]``."""
    bound, why = _VALUE_BOUNDS[kind]
    bad = ~(tensor.float().abs() <= bound)  # NaN compares False
    if bad.any():
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{name}: {int(bad.sum())} values are not finite within +-{bound:.4g} ({why}), "
                         f"first at {first}")


class QuantizeCounter:
    """Counts the standalone quantizes the FP8 linears run: a forward pre-hook on each FP8
    linear that sees a bf16 input (not a pre-quantized pair) counts one (that linear then
    quantizes it itself). Works on any device, graph capture excepted (hooks do not run on
    replay): use the profiler there. ``counter.enabled`` gates counting."""

    def __init__(self, model: DeepseekV41ForCausalLM):
        self.count = 0
        self.enabled = False
        self.per_linear: dict[str, int] = {}
        for name, linear in model.fp8_linears().items():
            # a partial of a bound method, not a closure: a deep copy of the model copies it with
            # the counter, so the copy counts into its own
            linear.register_forward_pre_hook(functools.partial(self._count, name))

    def _count(self, name: str, module, args) -> None:
        if self.enabled and args and not isinstance(args[0], QuantizedActivation):
            self.count += 1
            self.per_linear[name] = self.per_linear.get(name, 0) + 1

    def reset(self) -> None:
        self.count = 0
        self.per_linear.clear()


# --------------------------------------------------------------------------------------------
# fp32 reference forward on dequantized weights (the accuracy spec of the chained model)
# --------------------------------------------------------------------------------------------


class DeepseekV41Reference:
    """Pure fp32 forward of one sequence from checkpoint tensors (dequantized weights, no
    activation quantization, no bf16 rounding): what the FP8 model approximates."""

    def __init__(self, config: DeepseekV41Config, tensors: dict[str, torch.Tensor], device="cpu"):
        from ..layers.moe import dequantize_mxfp4

        self.config = config
        self.device = torch.device(device)
        c = config
        canonical = {_dense_scale_name(name): t for name, t in tensors.items()}
        if len(canonical) != len(tensors):
            raise ValueError("a dense weight's block scales are given twice (as .scale and .weight_scale_inv)")
        tensors = canonical
        w: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name.endswith(".weight_scale_inv") or re.search(r"experts\.\d+\..*\.scale$", name):
                continue
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            if base is not None and f"{base}.weight_scale_inv" in tensors:
                t = dequantize_weight(t, tensors[f"{base}.weight_scale_inv"], c.weight_block_size)
            elif base is not None and f"{base}.scale" in tensors:
                t = dequantize_mxfp4(t, tensors[f"{base}.scale"])
            w[name] = t.float().to(self.device)
        self.w = w

    def _norm(self, x, weight):
        return x * rms_rsqrt(x, self.config.rms_norm_eps) * weight

    def _stats(self, residual, pfx):
        c, hc = self.config, self.config.hc_mult
        fn, scale, base = self.w[f"{pfx}_fn"], self.w[f"{pfx}_scale"], self.w[f"{pfx}_base"]
        flat = residual.reshape(residual.shape[0], -1)
        r = rms_rsqrt(flat, c.rms_norm_eps)
        mix = (flat @ fn.t()) * r
        pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + c.hc_eps
        post = 2 * torch.sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
        comb = (mix[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
        comb = torch.softmax(comb, dim=-1) + c.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + c.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + c.hc_eps)
        return pre, post, comb

    def _attention(self, x, positions, pfx):
        c, w = self.config, self.w
        t, nh, d, rd = x.shape[0], c.num_attention_heads, c.head_dim, c.qk_rope_head_dim
        q_lora = self._norm(x @ w[f"{pfx}.wq_a.weight"].t(), w[f"{pfx}.q_norm.weight"])
        kv = self._norm(x @ w[f"{pfx}.wkv.weight"].t(), w[f"{pfx}.kv_norm.weight"])
        q = (q_lora @ w[f"{pfx}.wq_b.weight"].t()).view(t, nh, d)
        q = q * rms_rsqrt(q, c.rms_norm_eps)
        cos, sin = rope_cos_sin(positions, rd, c.rope_theta)
        q = torch.cat([q[..., :d - rd], apply_rope(q[..., d - rd:], cos, sin)], -1)
        kv = torch.cat([kv[:, :d - rd], apply_rope(kv[:, d - rd:], cos, sin)], -1)
        keys = kv.unsqueeze(0).expand(t, t, d)
        valid = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        o = attention_with_sinks(q, keys, valid, w[f"{pfx}.attn_sink"], d ** -0.5)
        o = torch.cat([o[..., :d - rd], apply_rope(o[..., d - rd:], cos, sin, inverse=True)], -1)
        o = o.reshape(t, c.o_groups, -1)
        wo_a = w[f"{pfx}.wo_a.weight"].view(c.o_groups, c.o_lora_rank, -1)
        o = torch.einsum("tgd,grd->tgr", o, wo_a).reshape(t, -1)
        return o @ w[f"{pfx}.wo_b.weight"].t()

    def _moe(self, x, pfx, idx=None):
        from fp8chain_kernel.reference import route_topk

        from ..layers.moe import swiglu_reference

        c, w = self.config, self.w
        idx, weights = route_topk(x @ w[f"{pfx}.gate.weight"].t(), w[f"{pfx}.gate.bias"],
                                  c.num_experts_per_tok, c.routed_scaling_factor, c.norm_topk_prob,
                                  idx=None if idx is None else idx.to(x.device))

        def expert(xs, p):
            gate_up = torch.cat([xs @ w[f"{p}.w1.weight"].t(), xs @ w[f"{p}.w3.weight"].t()], -1)
            return swiglu_reference(gate_up, c.swiglu_limit) @ w[f"{p}.w2.weight"].t()

        out = expert(x, f"{pfx}.shared_experts")
        for e in range(c.n_routed_experts):
            rows, k = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, weights[rows, k, None] * expert(x[rows], f"{pfx}.experts.{e}"))
        return out

    @torch.no_grad()
    def forward(self, tokens, routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """fp32 logits ``[T, V]`` of one sequence (causal).

        ``routing``: per layer, the ``[T, k]`` expert choice to use instead of the reference's
        own top-k (e.g. the FP8 model's, so a near-tie flipped by FP8 rounding does not switch
        experts); the routing weights are still the reference's fp32 scores of those experts.
        """
        c, w = self.config, self.w
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(ids.numel(), device=self.device)
        residual = w["embed.weight"][ids].unsqueeze(1).expand(-1, c.hc_mult, -1)
        x = self._norm(residual[:, 0], w["layers.0.attn_norm.weight"])
        names = []
        for i in range(c.num_hidden_layers):
            names += [(f"layers.{i}.hc_attn", "attn", f"layers.{i}.ffn_norm.weight"),
                      (f"layers.{i}.hc_ffn", "ffn", f"layers.{i + 1}.attn_norm.weight"
                       if i + 1 < c.num_hidden_layers else "norm.weight")]
        for n, (hc_pfx, kind, next_norm) in enumerate(names):
            layer = f"layers.{n // 2}"
            if kind == "attn":
                y = self._attention(x, positions, f"{layer}.attn")
            else:
                y = self._moe(x, f"{layer}.ffn", None if routing is None else routing[n // 2])
            pre, post, comb = self._stats(residual, hc_pfx)
            residual = post.unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("tio,tih->toh", comb, residual)
            v = (pre.unsqueeze(-1) * residual).sum(1)
            x = self._norm(v, w[next_norm])
        return x @ w["head.weight"].t()

    __call__ = forward
