"""One DSv4.1 decoder layer's attention sublayer + shared expert, chain on vs off vs a compiled peer.

Per decode step (M tokens, each with a ``--context``-token KV cache; the prefill case is one
sequence of ``--prefill`` tokens with causal attention over its own keys) the timed unit is:
mHC stats -> attention (wqkv_a, q_norm, wq_b, MQA core, inverse RoPE, wo_a einsum, wo_b) ->
mHC boundary -> mHC stats -> shared expert (gate_up, SiLU*mul, down) -> mHC boundary (which
writes the next layer's wqkv_a input). The rest of the MoE sublayer, the router and the routed
experts, is timed on its own beside each decode case (``RoutedExperts``: ``router_us``, the
router in torch ops ``router_torch_us``, ``routed_us``; ``--no-routed`` skips it).

Arms, timed in one process with CUDA-graph replay (median):
- ``chained``: every producer writes the FP8 pair its consumer reads (no quantize launches);
  the mHC stats run on a side stream beside each sublayer (``run_sublayer``), as in the model:
  the attention sublayer's fork right before its attention core at few tokens
  (``MQALayer.stats_beside_core_tokens``), the shared expert's at its start;
- ``unchained``: producers write bf16, every FP8 linear quantizes its own input (Hopper upstream);
- ``chained_stats_at_start`` / ``unchained_stats_at_start``: both steps with the attention
  sublayer's stats forked before wqkv_a at every M (what forking beside the core buys each arm);
- ``chained_serial_stats`` / ``unchained_serial_stats``: both steps with the stats in line on one
  stream (what the side stream buys each arm, and the chain's saving without the overlap);
- ``chained_no_stats`` / ``unchained_no_stats`` (diagnostic): both steps with the mixes computed
  once outside the step (no stats launches), so what the overlapped stats still cost each arm
  is the difference to ``chained`` / ``unchained``;
- ``chained_silu_launch`` (diagnostic): the chained step with SiLU*mul as its own launch after the
  gate_up GEMM instead of the GEMM's SiLU*mul epilogue (``SharedExpert.fuse_silu_mul``);
- ``unchained_no_quantize`` (diagnostic, not a computation): the unchained step with its
  standalone quantize launches taken out, each FP8 linear reading a pair written once before
  capture (``quantize_launches_removed``): what those launches cost the unchained step, i.e. what
  a chain saves by removing them if its FP8 epilogues cost nothing. The chained step differs from
  it only by its producers' FP8 epilogues, the bf16 stores they skip and the gate_up GEMM's
  SiLU*mul epilogue;
- ``chained_best_stats`` / ``unchained_best_stats``: each arm at the fastest of its steps over
  the mHC stats' K-split caps (``HyperConnection.max_stats_splits``, every (attention, FFN)
  combination of ``STATS_SPLIT_CAPS``), with the caps in ``*_best_stats_splits`` and every
  combination's time in ``*_stats_caps_us`` (keyed ``"attention,ffn"``, ``None`` the default). The split count
  sets the stats' bits, so the two arms are bitwise equal only at a shared cap; the overlapped
  stats contend with different launches in each arm (a cap that frees SMs for the unchained
  step's wqkv_a GEMM can slow the chained step), so each arm's fastest is its fair time;
- ``chained_no_pdl`` / ``unchained_no_pdl`` (where kernels launch with programmatic dependent
  launch, ``fp8chain_kernel.launch``): both steps with it off, so what PDL buys each arm is the
  difference to ``chained`` / ``unchained``;
- ``compiled_peer``: the same unit in plain torch ops with cuBLAS blockwise FP8 GEMMs
  (128x128 weight blocks, a torch-composed quantize before each), ``torch.compile``d, computing
  as a serving implementation would: the mHC stats in fp32, the attention's products on bf16
  tensor cores (the references' fp64 stats and fp32 attention products are specifications);
- ``floor``: weight bytes of the unit / copy bandwidth measured in the same run.
With ``--captures N`` the chained and unchained steps are each captured in N graphs, all replayed
in turn, and ``{arm}_captures_us`` lists their times (``{arm}_us`` is the first): whether a step's
time depends on the graph it was captured in (docs/benchmarks.md, the M = 2 gap).
Launches and quantize launches per step come from torch.profiler, after every case is timed.
Successive steps of a graph take copies of the layer in turn (``weight_copies``: three of a TP4
rank's 60 MB, one of TP1's 200 MB), so each step streams its weights from HBM, as serving does
with 42 other layers between two steps of one layer; the compiled peer reads one set of random
g128 weights of its own and the first copy's other parameters, not rotated (at TP4, ~60 MB against
the 50 MB L2: partly cached, which favours the peer).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sgl-kernel"))

from fp8chain.argtypes import positive_int, non_negative_int  # noqa: E402
from fp8chain.bench import harness  # noqa: E402
from fp8chain.layers.mhc import at_start, run_sublayer  # noqa: E402
from fp8chain.layers.moe import RoutedExpertsReference, TopKRouter  # noqa: E402
from fp8chain.layers.quantization import fp8 as fp8_method  # noqa: E402
from fp8chain.layers.quantization.fp8 import Fp8Config  # noqa: E402
from fp8chain.models.deepseek_v41 import (  # noqa: E402
    DeepseekV41Config, DeepseekV41DecoderLayer, _chain_format,
)
from fp8chain_kernel import launch, quant, reference  # noqa: E402
from fp8chain_kernel.formats import ActFormat, align4  # noqa: E402

# M = 40 stands for the batches between the powers of two the launch tables were swept at: its
# token scales' stride (align4(M)) is not a multiple of 16, which Triton compiles differently, and
# the attention's split programs pass one wave of a 32 x 64 tile there (docs/benchmarks.md, layer)
ROWS = [1, 4, 16, 40, 64, 256]
PREFILL = 2048
TP4_RANKS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", nargs="+", type=positive_int, help="decode batch sizes M")
    parser.add_argument("--prefill", type=non_negative_int, help="prefill tokens (0: skip)")
    parser.add_argument("--context", type=positive_int, default=1024, help="KV-cache length per token")
    parser.add_argument("--shapes", nargs="+", choices=["tp1", "tp4"],
                        help="TP1 dims, or one TP4 rank's shard (16 heads, 2 o-groups, a quarter of the shared expert)")
    parser.add_argument("--no-peer", action="store_true", help="skip the torch.compile peer")
    parser.add_argument("--no-routed", action="store_true",
                        help="skip timing the router and the routed experts (the model's torch reference)")
    harness.add_quick(parser, rows=(ROWS, [1, 16, 64]), prefill=(PREFILL, 0), shapes=(["tp1", "tp4"], ["tp1"]))
    parser.add_argument("--iters", type=positive_int, default=20, help="steps per captured graph")
    parser.add_argument("--captures", type=positive_int, default=1,
                        help="graphs captured of the chained and unchained step each, all replayed in turn: "
                             "{arm}_captures_us lists them (a step's time can depend on the graph it was "
                             "captured in); {arm}_us stays the first")


def layer_config(shapes: str, tiny: bool = False, routed: bool = False) -> DeepseekV41Config:
    """The layer's config; ``tp4``: the shapes one rank of four holds under tensor parallelism, on
    a model of its own: a quarter of the heads and o-groups (Flash: 16 and 2; wq_b [8192, 1280],
    wo_a [2, 1024, 4096], wo_b [5120, 2048]) and a quarter of the shared expert's intermediate
    (gate_up [1152, 5120], down [5120, 576] in Flash; SGLang shards the shared expert over the TP
    group by default), and of every routed expert's (SGLang's MoE tensor parallelism without expert
    parallelism). ``routed``: the preset's routed experts (Flash: 256, top 6); without it the
    layer keeps 8 (top 2), which the timed unit never runs."""
    preset = DeepseekV41Config.tiny if tiny else DeepseekV41Config.flash
    overrides = {} if routed else dict(n_routed_experts=8, num_experts_per_tok=2)
    if shapes == "tp4":
        full = preset()
        overrides["moe_intermediate_size"] = full.moe_intermediate_size // TP4_RANKS
        if not tiny:  # tiny's 2 heads and 2 o-groups stand for one rank's: too few to split four ways
            overrides.update(num_attention_heads=full.num_attention_heads // TP4_RANKS,
                             o_groups=full.o_groups // TP4_RANKS)
    return preset(**overrides)


def weight_copies(layer: DeepseekV41DecoderLayer) -> int:
    """Copies of the layer the timed steps take in turn (``harness.copies_past_l2`` of its weight
    bytes): one at TP1 (200 MB of weights), three of a TP4 rank's 60 MB."""
    return harness.copies_past_l2(weight_bytes(layer))


def build_layers(config: DeepseekV41Config, device) -> list[DeepseekV41DecoderLayer]:
    """``weight_copies`` copies of the layer, random weights each."""
    first = build_layer(config, device)
    return [first] + [build_layer(config, device) for _ in range(weight_copies(first) - 1)]


def build_layer(config: DeepseekV41Config, device) -> DeepseekV41DecoderLayer:
    """The decoder layer with random weights in the checkpoint's format, processed for serving."""
    quant_config = Fp8Config.from_config(config.quantization_config)
    layer = DeepseekV41DecoderLayer(config, 0, quant_config).to(device)
    block = config.weight_block_size[0]
    with torch.no_grad():
        for module in layer.modules():
            if hasattr(module, "quant_method") and hasattr(module, "weight_scale_inv"):
                w, s = reference.random_fp8_weight(*module.weight.shape, block, device, log2_scale=-14)
                module.weight.copy_(w)
                module.weight_scale_inv.copy_(s)
                module.quant_method.process_weights_after_loading(module)
        layer.attn.wo_a.copy_(torch.randn_like(layer.attn.wo_a, dtype=torch.float32).mul_(0.02))
        for hc in (layer.hc_attn, layer.hc_ffn):
            hc.fn.copy_(torch.randn_like(hc.fn) * 0.02)
            hc.base.copy_(torch.randn_like(hc.base) * 0.1)
        layer.attn.attn_sink.copy_(torch.randn_like(layer.attn.attn_sink))
    return layer


class LayerUnit:
    """Static inputs and the fp8chain step of one decode/prefill shape."""

    def __init__(self, layers: list[DeepseekV41DecoderLayer], config: DeepseekV41Config, rows: int,
                 context: int, device, prefill: bool = False):
        """Decode: ``rows`` sequences, each at position ``context - 1`` of its own cache slot.
        Prefill: one sequence of ``rows`` tokens at positions ``0 .. rows - 1`` (causal: token t
        attends to the keys of tokens 0..t, written by the step itself).

        ``layers``: copies of the layer (``build_layers``) that successive steps take in turn, so
        that a graph of many steps streams the weights from HBM, as serving does with 42 other
        layers between two steps of one layer (one copy where the weights exceed L2 anyway).
        ``layer`` is the first copy."""
        self.layers, self.config = list(layers), config
        self.layer = self.layers[0]
        #: one step, each call on the next copy (``harness.rotating``: graphs start on the first)
        self.step = harness.rotating(self._step, [(layer,) for layer in self.layers])
        h, hc = config.hidden_size, config.hc_mult
        self.residual = torch.randn(rows, hc, h, device=device).bfloat16()
        self.x = torch.randn(rows, h, device=device).bfloat16()
        if prefill:
            self.positions = torch.arange(rows, device=device)
            self.slots = torch.zeros(rows, dtype=torch.long, device=device)
            self.kv_cache = torch.randn(1, rows, config.head_dim, device=device).bfloat16()
        else:
            self.positions = torch.full((rows,), context - 1, dtype=torch.long, device=device)
            self.slots = torch.arange(rows, device=device)
            self.kv_cache = torch.randn(rows, context, config.head_dim, device=device).bfloat16()
        self._x_pairs: dict[bool, object] = {}
        self.set_chain(True)

    def set_chain(self, on: bool) -> None:
        """Switch every producer; the attention input pair is what the previous layer's
        boundary would have written (made here from the current ``x``, outside the timed step, into
        one buffer per arm, so a graph captured for one arm still reads its own pair while the
        other arm is set)."""
        self.chain = on
        for module in (m for layer in self.layers for m in layer.modules()):
            if hasattr(module, "chain"):
                module.chain = on
        fmt = _chain_format(self.layer.attn.wqkv_a, on)
        if fmt is not None:
            self._x_pairs[on] = quant.quantize(self.x, fmt, out=self._x_pairs.get(on))
        self.x_pair = self._x_pairs.get(on)

    def _step(self, layer: DeepseekV41DecoderLayer):
        chain = self.chain
        overlap = layer.overlap_stats
        residual, x, pair = run_sublayer(
            layer.hc_attn,
            lambda fork: layer.attn(self.x, self.x_pair, self.positions, self.slots, self.kv_cache, fork),
            self.residual, layer.ffn_norm, _chain_format(layer.ffn.input_linear, chain), overlap)
        return run_sublayer(layer.hc_ffn, at_start(lambda: layer.ffn.shared_experts(x, pair)), residual,
                            layer.attn_norm, _chain_format(layer.attn.wqkv_a, chain), overlap)


class RoutedExperts:
    """The part of the MoE sublayer that the timed unit leaves out, on its own: the router and the
    routed experts as the model runs them until MoE kernels replace them (``TopKRouter``,
    ``RoutedExpertsReference``: every expert's GEMMs in fp32 over its dequantized MXFP4 weights),
    with random weights in the checkpoint's format. The chain switches nothing here (both arms
    hand the router and the experts the same bf16 x), so one timing serves both."""

    def __init__(self, config: DeepseekV41Config, device):
        c = config
        with torch.device(device):
            self.gate = TopKRouter(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok,
                                   c.routed_scaling_factor, renormalize=c.norm_topk_prob)
            self.experts = RoutedExpertsReference(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size,
                                                  c.swiglu_limit)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn_like(self.gate.weight, dtype=torch.float32) * 0.02)
            for data, scale in ((self.experts.w13_weight, self.experts.w13_scale),
                                (self.experts.w2_weight, self.experts.w2_scale)):
                data.random_(0, 256)  # any two e2m1 codes per byte
                scale.random_(117, 122)  # 2^-10 .. 2^-6: expert weights of about 0.02
        self.experts.process_weights_after_loading()

    def step(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x))

    def serving_bytes(self, x: torch.Tensor) -> tuple[int, int]:
        """(experts the tokens ``x`` route to, the bytes a serving MoE step reads for them: the
        router's bf16 weight and those experts' MXFP4 data and scales)."""
        experts = self.experts
        touched = int(self.gate(x)[0].unique().numel())
        per_expert = sum(t[0].numel() * t.element_size() for t in (experts.w13_weight, experts.w13_scale,
                                                                    experts.w2_weight, experts.w2_scale))
        return touched, self.gate.weight.numel() * self.gate.weight.element_size() + touched * per_expert

    def measure(self, rows: int, bandwidth: float, iters: int) -> dict:
        """``router_us`` (the router alone: ``router.router_topk``), ``router_torch_us`` (the same
        routing in torch ops, ``reference.router_topk``: fp32 GEMM, softplus, sort) and
        ``routed_us`` (router + routed experts) per step of ``rows`` tokens, graph replay;
        ``routed_experts_touched`` and ``routed_floor_us``, the serving bytes of those experts over
        the copy ``bandwidth`` (bytes / s)."""
        x = torch.randn(rows, self.gate.weight.shape[1], device=self.gate.weight.device).bfloat16()
        touched, nbytes = self.serving_bytes(x)
        gate = self.gate
        torch_router = functools.partial(reference.router_topk, x, gate.weight, gate.bias, gate.top_k,
                                         gate.routed_scaling_factor, gate.renormalize)
        return {"router_us": harness.graph_time_us(lambda: gate(x), iters=iters),
                "router_torch_us": harness.graph_time_us(torch_router, iters=iters),
                # the reference's step takes milliseconds: a few calls per graph are enough
                "routed_us": harness.graph_time_us(lambda: self.step(x), iters=2, repeats=5),
                "routed_experts_touched": touched, "routed_floor_us": nbytes / bandwidth * 1e6}


@contextlib.contextmanager
def precomputed_stats(layers: list[DeepseekV41DecoderLayer], residual: torch.Tensor):
    """Both sublayers of every layer copy take their mHC mixes computed once here instead of
    launching the stats."""
    def frozen(mixes):
        def stats(residual, side_stream=None):
            if side_stream is not None:  # the step still forks and joins the side stream
                side_stream.wait_stream(torch.cuda.current_stream())
            return mixes
        return stats

    hcs = [hc for layer in layers for hc in (layer.hc_attn, layer.hc_ffn)]
    for hc in hcs:
        hc.stats = frozen(hc.stats(residual))
    try:
        yield
    finally:
        for hc in hcs:
            del hc.stats


@contextlib.contextmanager
def stats_at_sublayer_start(layers: list[DeepseekV41DecoderLayer]):
    """The attention sublayer forks its mHC stats before wqkv_a at every token count."""
    saved = [layer.attn.stats_beside_core_tokens for layer in layers]
    for layer in layers:
        layer.attn.stats_beside_core_tokens = 0
    try:
        yield
    finally:
        for layer, tokens in zip(layers, saved):
            layer.attn.stats_beside_core_tokens = tokens


@contextlib.contextmanager
def stats_in_line(layers: list[DeepseekV41DecoderLayer]):
    """Both sublayers compute their mHC stats on the main stream, in line with the sublayer."""
    for layer in layers:
        layer.overlap_stats = False
    try:
        yield
    finally:
        for layer in layers:
            layer.overlap_stats = True


@contextlib.contextmanager
def quantize_launches_removed():
    """Every FP8 linear fed bf16 takes a pair quantized on its first call for that input shape
    (eagerly, before a graph is captured) instead of quantizing at every call: the step launches no
    quantize, and its GEMMs read stale pairs (a timing diagnostic, not a computation). Yields the
    pairs: a graph captured here reads them, so its caller keeps them until the graph's last replay."""
    pairs = {}

    def stale_pair(x, fmt, out=None):
        if out is not None:  # filling it would be a copy launch per call, the very launch this removes
            raise TypeError("quantize_launches_removed: a caller-given out= pair is not supported")
        key = (tuple(x.shape), ActFormat(fmt), x.device)
        if key not in pairs:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("quantize_launches_removed: a new input shape inside graph capture")
            pairs[key] = quant.quantize(x, fmt)
        return pairs[key]

    saved, fp8_method.quantize = fp8_method.quantize, stale_pair
    try:
        yield pairs
    finally:
        fp8_method.quantize = saved


def weight_bytes(layer: DeepseekV41DecoderLayer) -> int:
    linears = [layer.attn.wqkv_a, layer.attn.wq_b, layer.attn.wo_b,
               layer.ffn.shared_experts.gate_up, layer.ffn.shared_experts.down]
    total = sum(m.weight.numel() + m.weight_scale_inv.numel() * 4 for m in linears)
    total += layer.attn.wo_a.numel() * 2 + sum(hc.fn.numel() * 4 for hc in (layer.hc_attn, layer.hc_ffn))
    return total


class CompiledPeer:
    """The same unit in plain torch + cuBLAS blockwise FP8 (g128 weights), torch.compile'd: the
    references' arithmetic at serving precision (``reference.mhc_stats`` in fp32,
    ``reference.mqa_attention`` with bf16 products).

    torch 2.11's blockwise ``_scaled_mm`` computes wrong results when K/128 is not a multiple
    of 4 (docs/gemm.md), so for those GEMMs (wq_b K=1280, down K=2304) the peer zero-pads K to
    a multiple of 512: same result, a few more bytes.
    """

    def __init__(self, layer: DeepseekV41DecoderLayer, config: DeepseekV41Config, device):
        from fp8chain_kernel.backends import get_backend

        blockwise = get_backend("torch_blockwise")
        if blockwise.calibrate(device):
            raise RuntimeError("cuBLAS blockwise FP8 does not run here; no compiled peer")
        self.layer, self.c = layer, config
        self.weights = {}
        for name, module in (("wqkv_a", layer.attn.wqkv_a), ("wq_b", layer.attn.wq_b),
                             ("wo_b", layer.attn.wo_b), ("gate_up", layer.ffn.shared_experts.gate_up),
                             ("down", layer.ffn.shared_experts.down)):
            n, k = module.weight.shape
            padded_k = -(-k // 512) * 512
            w, s = reference.random_fp8_weight(n, padded_k, 128, device, log2_scale=-14)
            w[:, k:] = 0
            # the [K/128, N/128] view of the checkpoint scales that torch 2.11's blockwise
            # _scaled_mm takes for K/128 % 4 == 0 (what the backend calibrated)
            self.weights[name] = (w.t(), s.contiguous().t())
        # One static-shape compile per (shapes, M): raise dynamo's default limit of 8 recompiles
        # per function, past which it silently falls back to eager for the remaining cases.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.attention = types.SimpleNamespace(
            rope_qkv=reference.rope_qkv,
            mqa_attention=functools.partial(reference.mqa_attention, matmul_dtype=torch.bfloat16))
        self.step = torch.compile(self._step, dynamic=False)

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Torch-composed g128 quantize (rows padded to 4, K to the padded weight) + cuBLAS."""
        w_t, scale_b = self.weights[name]
        rows, cols = x.shape
        x = torch.nn.functional.pad(x, (0, w_t.shape[0] - cols, 0, align4(rows) - rows))
        data, scale, _ = reference.quantize_groups(x, ActFormat.SM90_G128_FP32_MN)
        scale_a = scale.t().contiguous().t()  # MN-major [M, K/128], strides (1, M)
        out = torch._scaled_mm(data, w_t, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        return out[:rows]

    def _stats(self, hc, residual):
        c = self.c
        return reference.mhc_stats(residual, hc.fn, hc.scale, hc.base, rms_eps=c.rms_norm_eps, hc_eps=c.hc_eps,
                                   sinkhorn_iters=c.hc_sinkhorn_iters, dtype=torch.float32)

    def _step(self, residual, x, positions, slots, kv_cache):
        layer, c = self.layer, self.c
        attn = layer.attn
        t = x.shape[0]
        stats = self._stats(layer.hc_attn, residual)
        qkv = self._linear("wqkv_a", x)
        q_lora, kv = qkv[:, :attn.q_lora_rank], qkv[:, attn.q_lora_rank:]
        q = self._linear("wq_b", reference.rms_norm(q_lora, attn.q_norm.weight, c.rms_norm_eps))
        o = attn.attend(q, kv.contiguous(), positions, slots, kv_cache, impl=self.attention)
        o = torch.einsum("tgd,grd->tgr", o, attn.wo_a).reshape(t, -1)
        y = self._linear("wo_b", o)
        pre, post, comb = stats
        residual, xf, _ = reference.mhc_mega_boundary(y, residual, pre, post, comb, layer.ffn_norm.weight,
                                                      c.rms_norm_eps)
        stats = self._stats(layer.hc_ffn, residual)
        h = reference.silu_mul(self._linear("gate_up", xf), limit=c.swiglu_limit)
        y = self._linear("down", h)
        pre, post, comb = stats
        return reference.mhc_mega_boundary(y, residual, pre, post, comb, layer.attn_norm.weight, c.rms_norm_eps)


ARMS = (("chained", True), ("unchained", False))
# K-split caps of the mHC stats partial tried per sublayer: the default (about two programs per
# SM, 160 splits at decode, H = 5120) and 32 (docs/benchmarks.md, layer: the unchained step's fastest at
# M <= 4, 3-4 us faster there than at the default, which is the chained step's fastest).
STATS_SPLIT_CAPS = (None, 32)


def _time_arms(unit: LayerUnit, record: dict, variant: str, iters: int, diagnostics: bool = False,
               captures: int = 1) -> None:
    """``record["{arm}{variant}_us"]`` for both arms of ``unit`` as the layer is now configured
    (with ``diagnostics`` also ``chained_silu_launch_us``, the chained step with the shared
    expert's SiLU*mul as its own launch, and ``unchained_no_quantize_us``): one graph per arm,
    their replays alternated (``harness.replay_times_us``). With ``captures`` > 1 each arm is
    captured that many times, every graph timed, ``record["{arm}{variant}_captures_us"]`` the
    list in capture order (the first is ``{arm}{variant}_us``)."""
    graphs = {}
    graph_inputs = []  # what a diagnostic graph reads besides the unit's buffers: alive through its replays
    for arm, on in ARMS:
        unit.set_chain(on)
        for capture in range(captures):
            graphs[(f"{arm}{variant}", capture)] = harness.capture_graph(unit.step, iters)
    if diagnostics:
        shared = [layer.ffn.shared_experts for layer in unit.layers]
        unit.set_chain(True)
        for expert in shared:
            expert.fuse_silu_mul = False
        try:
            graphs[("chained_silu_launch", 0)] = harness.capture_graph(unit.step, iters)
        finally:
            for expert in shared:
                expert.fuse_silu_mul = True
        unit.set_chain(False)
        with quantize_launches_removed() as stale_pairs:
            graphs[("unchained_no_quantize", 0)] = harness.capture_graph(unit.step, iters)
        graph_inputs.append(stale_pairs)
    times = harness.replay_times_us(graphs, iters, rounds=7)
    for (name, capture), us in times.items():
        if capture == 0:
            record[f"{name}_us"] = us
    if captures > 1:
        for arm, _ in ARMS:
            record[f"{arm}{variant}_captures_us"] = [times[(f"{arm}{variant}", c)] for c in range(captures)]


def _time_best_stats_splits(unit: LayerUnit, record: dict, iters: int) -> None:
    """``record["{arm}_best_stats_us"]``: each arm's fastest step over the (attention, FFN) pairs
    of ``STATS_SPLIT_CAPS`` for the mHC stats' K splits, all graphs replayed in turn, and the
    pair in ``record["{arm}_best_stats_splits"]`` (None: ``mhc_stats``' default)."""
    graphs = {}
    try:
        for caps in itertools.product(STATS_SPLIT_CAPS, repeat=2):
            for layer in unit.layers:
                layer.hc_attn.max_stats_splits, layer.hc_ffn.max_stats_splits = caps
            for arm, on in ARMS:
                unit.set_chain(on)
                graphs[(arm, caps)] = harness.capture_graph(unit.step, iters)
    finally:
        for layer in unit.layers:
            layer.hc_attn.max_stats_splits = layer.hc_ffn.max_stats_splits = None
    times = harness.replay_times_us(graphs, iters, rounds=7)
    for arm, _ in ARMS:
        key = min((k for k in times if k[0] == arm), key=times.get)
        record[f"{arm}_best_stats_us"] = times[key]
        record[f"{arm}_best_stats_splits"] = list(key[1])
        # every pair, keyed "attention,ffn": at a shared pair the arms are bit-identical
        record[f"{arm}_stats_caps_us"] = {",".join(map(str, caps)): us for (a, caps), us in times.items() if a == arm}


def run(args) -> tuple[dict, list[dict]]:
    if not torch.cuda.is_available():
        raise SystemExit("benchmark layer needs a CUDA GPU (run `fp8chain demo` / the tests on CPU)")
    meta = harness.bench_meta()
    bandwidth = harness.copy_bandwidth()
    meta.update(copy_bandwidth_TBps=bandwidth / 1e12, context=args.context)
    records = []
    torch.manual_seed(0)
    # (shapes, tokens, prefill?): a decode M equal to the prefill length stays a decode case
    cases = [case for s in args.shapes
             for case in [(s, m, False) for m in args.rows] + ([(s, args.prefill, True)] if args.prefill else [])]
    layers, peers, routed = {}, {}, {}
    # Pass 1 times every case, pass 2 profiles them: once torch.profiler has run, every kernel of
    # a later replay is slower (the harness docstring), so no timing may follow a profile.
    for shapes, rows, is_prefill in harness.progress(cases, "layer"):
        config = layer_config(shapes)
        if shapes not in layers:
            layers[shapes] = build_layers(config, "cuda")
            try:  # the peer: its own random g128 FP8 weights, the first copy's other parameters
                peers[shapes] = None if args.no_peer else CompiledPeer(layers[shapes][0], config, "cuda")
            except RuntimeError as exc:
                print(f"no compiled peer: {exc}", file=sys.stderr)
                peers[shapes] = None
        copies, peer = layers[shapes], peers[shapes]
        layer = copies[0]
        unit = LayerUnit(copies, config, rows, args.context, "cuda", prefill=is_prefill)
        record = {"shapes": shapes, "M": rows, "phase": "prefill" if is_prefill else "decode"}
        with torch.no_grad():
            iters = harness.graph_calls(unit.step, args.iters)  # whole turns over the copies
            _time_arms(unit, record, "", iters, diagnostics=True, captures=args.captures)
            _time_best_stats_splits(unit, record, iters)
            with stats_at_sublayer_start(copies):
                _time_arms(unit, record, "_stats_at_start", iters)
            with stats_in_line(copies):
                _time_arms(unit, record, "_serial_stats", iters)
            with precomputed_stats(copies, unit.residual):
                _time_arms(unit, record, "_no_stats", iters)
            if launch.enabled():
                with launch.programmatic_launches(False):
                    _time_arms(unit, record, "_no_pdl", iters)
            unit.set_chain(True)
            if peer is not None:
                inputs = (unit.residual, unit.x, unit.positions, unit.slots, unit.kv_cache)
                try:
                    record["compiled_peer_us"] = harness.graph_time_us(lambda: peer.step(*inputs),
                                                                       iters=args.iters, repeats=5)
                except Exception as exc:  # the peer is a comparison, not the subject: keep the rest
                    record["compiled_peer_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    print(f"compiled peer failed at {shapes} M={rows}: {record['compiled_peer_error']}",
                          file=sys.stderr)
            if not (is_prefill or args.no_routed):
                if shapes not in routed:
                    routed[shapes] = RoutedExperts(layer_config(shapes, routed=True), "cuda")
                record.update(routed[shapes].measure(rows, bandwidth, args.iters))
        record["floor_us"] = weight_bytes(layer) / bandwidth * 1e6
        record["weight_copies"] = len(copies)
        for variant, ratio in (("", "chained_over_unchained"), ("_best_stats", "best_stats_chained_over_unchained"),
                               ("_stats_at_start", "stats_at_start_chained_over_unchained"),
                               ("_serial_stats", "serial_chained_over_unchained"),
                               ("_no_stats", "no_stats_chained_over_unchained")):
            record[ratio] = record[f"chained{variant}_us"] / record[f"unchained{variant}_us"]
        record["no_quantize_over_unchained"] = record["unchained_no_quantize_us"] / record["unchained_us"]
        if record.get("compiled_peer_us"):
            record["chained_over_peer"] = record["chained_us"] / record["compiled_peer_us"]
        record["chained_over_floor"] = record["chained_us"] / record["floor_us"]
        records.append(record)
        del unit
    for record in harness.progress(records, "launches (torch.profiler)"):
        shapes, rows = record["shapes"], record["M"]
        unit = LayerUnit(layers[shapes], layer_config(shapes), rows, args.context, "cuda",
                         prefill=record["phase"] == "prefill")
        with torch.no_grad():
            for arm, on in ARMS:
                unit.set_chain(on)
                kernels = harness.kernel_profile(unit.step)
                launches = harness.launch_counts(kernels)
                record[f"{arm}_launches"] = sum(launches.values())
                record[f"{arm}_quantize_launches"] = harness.quantize_launches(launches)
                record[f"{arm}_kernels"] = kernels
            unit.set_chain(False)
            with quantize_launches_removed():  # kernel_profile's warm-up call makes the pairs
                launches = harness.launch_counts(harness.kernel_profile(unit.step))
            record["unchained_no_quantize_launches"] = sum(launches.values())
            record["unchained_no_quantize_quantize_launches"] = harness.quantize_launches(launches)
        del unit
    return meta, records


COLUMNS = ["shapes", "phase", "M", "chained_us", "unchained_us", "chained_best_stats_us", "unchained_best_stats_us",
           "chained_best_stats_splits", "unchained_best_stats_splits", "chained_silu_launch_us",
           "unchained_no_quantize_us",
           "chained_stats_at_start_us", "unchained_stats_at_start_us", "chained_serial_stats_us",
           "unchained_serial_stats_us", "chained_no_stats_us", "unchained_no_stats_us", "chained_no_pdl_us",
           "unchained_no_pdl_us", "compiled_peer_us",
           "floor_us", "chained_over_unchained", "best_stats_chained_over_unchained",
           "stats_at_start_chained_over_unchained", "serial_chained_over_unchained",
           "no_stats_chained_over_unchained", "no_quantize_over_unchained", "chained_over_peer", "chained_over_floor", "chained_launches",
           "unchained_launches", "chained_quantize_launches", "unchained_quantize_launches",
           "unchained_no_quantize_launches", "unchained_no_quantize_quantize_launches"]
# the router and routed experts, beside the unit's two arms they are reported apart from
ROUTED_COLUMNS = ["shapes", "M", "router_us", "router_torch_us", "routed_us", "routed_experts_touched",
                  "routed_floor_us", "chained_us", "unchained_us"]


def report(meta: dict, records: list[dict], results_dir=None) -> str:
    path = harness.save_results("layer", meta, records, results_dir)
    decode = [dict(r, panel=f"{r['shapes']} decode, context {meta['context']}") for r in records if r["phase"] == "decode"]
    harness.plot_records("layer", decode, "M", ["chained_us", "unchained_us", "unchained_no_quantize_us",
                                               "unchained_best_stats_us", "compiled_peer_us", "floor_us"],
                         "us per decode step (attention + shared expert)", group="panel", results_dir=results_dir)
    captured = [f"{arm}_captures_us" for arm, _ in ARMS if any(f"{arm}_captures_us" in r for r in records)]
    columns = COLUMNS[:5] + captured + COLUMNS[5:]  # beside chained_us / unchained_us
    text = f"{path}\n" + harness.markdown_table(records, columns) + "\n" + kernel_breakdown(records)
    routed = [r for r in decode if "routed_us" in r]
    if routed:
        harness.plot_records("layer_routed", routed, "M", ["routed_us", "router_us", "router_torch_us", "routed_floor_us",
                                                           "chained_us"],
                             "us per decode step (router + routed experts; chained_us: the attention + "
                             "shared-expert unit, for scale)", group="panel", results_dir=results_dir)
        text += "\n\nRouter and routed experts (the model's torch reference; the same in both arms):\n"
        text += harness.markdown_table(routed, ROUTED_COLUMNS)
    return text


def kernel_breakdown(records: list[dict], top: int = 8) -> str:
    """The chained step's most expensive kernels per case (eager profile, GPU us)."""
    lines = []
    for r in records:
        kernels = sorted(r["chained_kernels"].items(), key=lambda item: -item[1]["us"])
        total = sum(entry["us"] for _, entry in kernels)
        parts = [f"{name[:40]} {entry['us']:.1f} ({int(entry['launches'])})" for name, entry in kernels[:top]]
        lines.append(f"- {r['shapes']} {r['phase']} M={r['M']}: kernels {total:.1f} us: " + "; ".join(parts))
    return "\n".join(lines)


if __name__ == "__main__":
    harness.benchmark_main(__doc__, add_arguments, run, report)
