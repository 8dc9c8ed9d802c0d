"""Check fp8chain's SGLang plugin against the SGLang installed here, without starting a server.

    python scripts/check_sglang_hooks.py        # on a CPU: TRITON_INTERPRET=1 python scripts/...

SGLang's own ``HookRegistry`` applies the plugin's hooks to its real modules, then the hooked
methods run on minimal layers holding only what they read (random DSv4.1-style FP8 weights, 32x32
blocks, small shapes): ``Fp8LinearMethod.process_weights_after_loading`` and ``apply``,
``MQALayer._normalize_q_lora``, ``_apply_wo_a_bf16_matmul`` inside and outside an ``MQALayer``
forward, ``DeepseekV2MLP.__call__``, both mHC reads ``HcReadCall.read`` (with the module
function ``combine`` they call; the FFN's feeding a shared expert's ``DeepseekV2MLP``) and both
reads' ``update_and_read`` (with the post's ``_post_fusion``). Each result is compared bit for bit
with fp8chain's own linear. Prints one line per check; exit status 1 if any fails. The runtime modes the hooks read at
each forward (sequence parallelism, deterministic inference) are published only inside a server,
so the checks run as outside those modes.
"""

from __future__ import annotations

import inspect
import pkgutil
import sys
import types

import torch


def main() -> int:
    try:
        import sglang.srt.models.deepseek_v2 as v2
        import sglang.srt.models.deepseek_v4 as v4
        import sglang.srt.models.deepseek_v4_boundary as boundary
        import sglang.srt.models.deepseek_v4_mhc as mhc
        from sglang.srt.layers.layernorm import RMSNorm
        from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
        from sglang.srt.plugins.hook_registry import HookRegistry
    except ImportError as exc:
        print(f"SGLang's modules do not import here: {exc}", file=sys.stderr)
        return 2
    from fp8chain.integrations import sglang as plugin
    from fp8chain.layers.linear import ReplicatedLinear
    from fp8chain.layers.loading import load_weights
    from fp8chain.layers.quantization.fp8 import Fp8Config as OwnFp8Config
    from fp8chain.layers.quantization.fp8 import consumer_gemm_silu_mul
    from fp8chain_kernel import einsum
    from fp8chain_kernel.mhc import mhc_combine_norm
    from fp8chain_kernel.norm import rms_norm
    from fp8chain_kernel import reference as ref
    from fp8chain_kernel.formats import QuantizedActivation

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    idle = plugin.why_idle(device)
    if idle:
        print(f"the plugin leaves every layer to upstream on this {device.type}: {idle}", file=sys.stderr)
        return 2
    failures = []

    def check(name, ok, detail=""):
        print(f"[{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}")
        if not ok:
            failures.append(name)

    # (hooked function, the reader of its later arguments, how many come before them)
    readers = ((v4._apply_wo_a_bf16_matmul, plugin._wo_a_output_asked, 2),
               (v2.DeepseekV2MLP.forward, plugin._mlp_input_prequantized, 2),
               (boundary.HcReadCall.read, plugin._read_asks_format, 3))
    for target, reader, leading in readers:
        want = list(inspect.signature(reader).parameters)
        got = list(inspect.signature(target).parameters)[leading:]
        check(f"{target.__qualname__} takes the arguments the hook reads", got == want, f"{got}")
    got = list(inspect.signature(mhc.combine).parameters)
    check("deepseek_v4_mhc.combine takes (hc, state, quantized)", got == ["hc", "state", "quantized"], f"{got}")

    def targets():  # what each hooked target resolves to now
        return {target: pkgutil.resolve_name(target) for target, _, _ in plugin.HOOKS}

    originals = targets()
    plugin.install()
    HookRegistry.apply_hooks()
    patched = targets()
    for name, fn in patched.items():
        check(f"hooked {name.removeprefix('sglang.srt.')}", getattr(fn, "__wrapped__", None) is originals[name])
    plugin._why_no_pair = lambda: None  # the runtime modes are published inside a server only

    method = Fp8LinearMethod(Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[32, 32],
                                       scale_fmt="ue8m0"))

    def fp8_linear(n, k, name):
        """A module as SGLang's FP8 linear holds a 32x32-block checkpoint, asking for a pair and
        processed by the real (hooked) method; ``forward`` runs the real (hooked) ``apply``."""
        layer = torch.nn.Module()
        weight, scale = ref.random_fp8_weight(n, k, 32, device=device)
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
        layer.deepgemm_mxfp8_input, layer.prefix = True, name
        method.process_weights_after_loading(layer)
        layer.forward = lambda x: (method.apply(layer, x), None)
        return layer

    def own_linear(layer):
        n, k = layer.weight.shape
        own = ReplicatedLinear(k, n, quant_config=OwnFp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0"))
        load_weights(own.to(device), [("weight", layer.weight.data), ("weight_scale_inv", layer.weight_scale_inv.data)])
        return own

    def same_bits(a, b):
        return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))

    def is_quantize_of(pair, x, fmt):
        """``pair`` is a pair in ``fmt`` whose bytes are the standalone quantize of ``x``'s."""
        return (isinstance(pair, QuantizedActivation) and pair.fmt is fmt
                and torch.equal(pair.data.view(torch.uint8), ref.quantize(x, fmt).data.view(torch.uint8)))

    wq_b = fp8_linear(512, 256, "layers.0.self_attn.wq_b")
    check("Fp8LinearMethod.process_weights_after_loading serves the request", wq_b.deepgemm_mxfp8_input is True
          and wq_b.input_format is not None, f"{getattr(wq_b.input_format, 'value', None)}")
    x = torch.randn(5, 256, device=device).bfloat16()
    out = method.apply(wq_b, ref.quantize(x, wq_b.input_format))
    check("Fp8LinearMethod.apply(pair) is fp8chain's linear", same_bits(out, own_linear(wq_b)(x)))

    attn = v4.MQALayer.__new__(v4.MQALayer)
    torch.nn.Module.__init__(attn)
    attn.wq_b = wq_b
    attn.q_norm = torch.nn.Module()
    attn.q_norm.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(256, device=device).bfloat16(), requires_grad=False)
    attn.q_norm.variance_epsilon = 1e-6
    y, pair = attn._normalize_q_lora(x)
    check("MQALayer._normalize_q_lora returns the bf16 row and its pair", is_quantize_of(pair, y, wq_b.input_format))
    check("wq_b on that pair is fp8chain's linear on the row", same_bits(wq_b(pair)[0], own_linear(wq_b)(y)))

    attn.wo_a = torch.nn.Module()
    wo_a_weight = (torch.randn(2 * 128, 192, device=device) / 16).bfloat16()
    attn.wo_a.weight = torch.nn.Parameter(wo_a_weight, requires_grad=False)
    attn.wo_b = fp8_linear(160, 256, "layers.0.self_attn.wo_b")
    o = torch.randn(5, 2 * 192, device=device).bfloat16().view(5, 2, 192)
    wo_a = attn.wo_a.weight.view(2, 128, 192)
    product = plugin.around_mqa_forward(lambda layer: v4._apply_wo_a_bf16_matmul(o, wo_a, is_decode=True), attn)
    fmt = attn.wo_b.input_format
    check("_apply_wo_a_bf16_matmul inside an MQALayer forward returns wo_b's pair",
          is_quantize_of(product, einsum.wo_a_einsum(o, wo_a, tile_group=fmt.group_size), fmt))
    outside = v4._apply_wo_a_bf16_matmul(o, wo_a, is_decode=True)
    check("_apply_wo_a_bf16_matmul outside a forward is upstream's bf16", torch.is_tensor(outside)
          and outside.shape == (5, 2, 128))

    mlp = v2.DeepseekV2MLP.__new__(v2.DeepseekV2MLP)
    torch.nn.Module.__init__(mlp)
    gate_up = torch.randn(5, 2 * 96, device=device).bfloat16()  # gate_up_proj stays upstream's: bf16 in and out
    mlp.gate_up_proj = torch.nn.Module()
    mlp.gate_up_proj.forward = lambda x: (gate_up, None)
    mlp.swiglu_limit = 1.0

    def recording(layer, received):
        """``layer`` (an ``fp8_linear``) whose forward also appends its input to ``received``."""
        def forward(x):
            received.append(x)
            return method.apply(layer, x), None
        layer.forward = forward
        return layer

    received = []
    mlp.down_proj = recording(fp8_linear(256, 96, "layers.0.mlp.shared_experts.down_proj"), received)
    out = mlp(x)
    check("DeepseekV2MLP.__call__ hands down_proj the pair of SiLU*mul", len(received) == 1
          and isinstance(received[0], QuantizedActivation) and out.shape == (5, 256))
    y = ref.silu_mul(gate_up, limit=1.0)
    check("down_proj on that pair is fp8chain's linear on the bf16 activation",
          same_bits(out, own_linear(mlp.down_proj)(y)))
    hidden = 5120  # SGLang folds a read's norm into the post before it only at DSv4.1's width (make_boundary)
    attn.fuse_wqa_wkv, attn.attn_tp_size = True, 1
    attn.wqkv_a = fp8_linear(256 + 64, hidden, "layers.0.self_attn.wqkv_a")

    def rms_norm_module():
        norm = RMSNorm(hidden, eps=1e-6).to(device=device, dtype=torch.bfloat16)
        norm.weight.data = 1 + 0.1 * torch.randn(hidden, device=device).bfloat16()
        return norm

    attn_norm, ffn_norm = rms_norm_module(), rms_norm_module()
    shared = v2.DeepseekV2MLP.__new__(v2.DeepseekV2MLP)  # the shared expert the FFN's read feeds
    torch.nn.Module.__init__(shared)
    gate_up_inputs = []
    shared.gate_up_proj = recording(fp8_linear(2 * 96, hidden, "layers.0.mlp.shared_experts.gate_up_proj"),
                                    gate_up_inputs)
    shared.down_proj = fp8_linear(hidden, 96, "layers.0.mlp.shared_experts.down_proj")
    shared.swiglu_limit = 1.0
    cfg = mhc.HcConfig(mult=4, sinkhorn_iters=20, eps=1e-6, rms_eps=1e-6, hidden=hidden, pre_from_prev=True,
                       cp_prefill=False)
    layer = torch.nn.Module()  # a DSv4.1 decoder layer as its mHC reads and updates use it
    layer.self_attn = attn
    layer.mlp = v2.DeepseekV2MoE.__new__(v2.DeepseekV2MoE)
    torch.nn.Module.__init__(layer.mlp)
    layer.mlp.shared_experts, layer.mlp.num_fused_shared_experts = shared, 0
    layer.mlp.tp_size, layer.mlp.is_deepseek_v4 = 1, True
    layer.mlp.mega_shared_l1_weights = None  # as DeepseekV2MoE.__init__ leaves it off the mega MoE
    layer.input_layernorm, layer.post_attention_layernorm = attn_norm, ffn_norm
    layer.attn_hc = mhc.HcSubLayer(cfg, None, None, None, attn_norm)
    layer.ffn_hc = mhc.HcSubLayer(cfg, None, None, None, ffn_norm)
    layer.boundary_pre_from_prev, layer.boundary_mhc_fusions, layer.engram = True, True, None
    layer.hc_cfg, layer.hc_stats_stream = cfg, None
    decode = types.SimpleNamespace(forward_mode=types.SimpleNamespace(is_decode=lambda: True,
                                                                      is_target_verify=lambda: False))

    def reader(attention):
        return boundary.HcRead(layer, attention).bind(decode, boundary.LayerCall())

    def pair_checks(what, x, state):
        pair = getattr(state, "quantized", None)
        check(f"{what} leaves wqkv_a's pair in ReadState.quantized", is_quantize_of(pair, x, attn.wqkv_a.input_format))
        check(f"{what}: wqkv_a on that pair is fp8chain's linear on x",
              isinstance(pair, QuantizedActivation) and same_bits(attn.wqkv_a(pair)[0], own_linear(attn.wqkv_a)(x)))

    def shared_expert_checks(what, x):
        rows, pair = getattr(shared, "fp8chain_gate_up_input", None) or (None, None)
        check(f"{what} leaves the shared gate_up's pair with the shared expert, beside x",
              rows is x and is_quantize_of(pair, x, shared.gate_up_proj.input_format))
        epilogue = consumer_gemm_silu_mul(shared.gate_up_proj, pair, 1.0, shared.down_proj.input_format,
                                          "gate_up_proj") is not None  # where it pays at these rows
        gate_up_inputs.clear()
        out = layer.mlp._forward_shared_experts(x)
        if epilogue:
            check(f"{what}: DeepseekV2MoE._forward_shared_experts(x) runs gate_up with the SiLU*mul epilogue "
                  "on that pair (not gate_up's forward)", not gate_up_inputs)
        else:
            check(f"{what}: DeepseekV2MoE._forward_shared_experts(x) hands gate_up that pair",
                  len(gate_up_inputs) == 1 and gate_up_inputs[0] is pair)
        gate_up = own_linear(shared.gate_up_proj)(x)
        check(f"{what}: the shared expert's output is fp8chain's linears' from x",
              same_bits(out, own_linear(shared.down_proj)(ref.silu_mul(gate_up, limit=1.0))))

    streams = torch.randn(5, 4, hidden, device=device).bfloat16()
    pre, post = torch.rand(5, 4, device=device) + 0.1, torch.rand(5, 4, device=device)
    comb = torch.rand(5, 4, 4, device=device)
    for carried, what in ((pre, "the carried pre"), (None, "no pre (the first layer: stream 0)")):
        what = f"HcReadCall.read with {what}"
        x, state = reader(True).read(mhc.HcState(streams, carried), attn_norm, "")  # as the framework calls it
        want = (mhc_combine_norm(streams, carried, attn_norm.weight, 1e-6) if carried is not None else
                rms_norm(streams[:, 0], attn_norm.weight, 1e-6))
        check(f"{what} returns fp8chain's combine + RMSNorm", same_bits(x, want))
        pair_checks(what, x, state)
    x, state = reader(False).read(mhc.HcState(streams, pre), ffn_norm, "")
    check("HcReadCall.read (the FFN's) returns fp8chain's combine + RMSNorm",
          same_bits(x, mhc_combine_norm(streams, pre, ffn_norm.weight, 1e-6)))
    check("HcReadCall.read (the FFN's) leaves no pair in ReadState.quantized", state.quantized is None)
    shared_expert_checks("HcReadCall.read (the FFN's)", x)

    y = torch.randn(5, hidden, device=device).bfloat16()  # the finished sublayer's output
    carried = boundary.ReadState(streams, stats=(pre, post, comb), call=boundary.LayerCall())
    for attention, what in ((True, "the attention's read after the MoE"),
                            (False, "the FFN's read after the attention")):
        what = f"HcReadCall.update_and_read ({what})"
        norm = attn_norm if attention else ffn_norm
        upstream_posts, upstream_post = [], mhc.post  # the post launch upstream's Hopper path runs
        mhc.post = lambda *args: upstream_posts.append(args) or upstream_post(*args)
        try:  # upstream's own post needs a server's published config: it fails here where nothing folds
            x, state = reader(attention).update_and_read(boundary.HcUpdate(layer, not attention), y, carried, norm)
        except Exception as exc:
            check(f"{what} runs", False, f"{type(exc).__name__}: {exc}")
            continue
        finally:
            mhc.post = upstream_post
        check(f"{what}: upstream's post does not run (folded into fp8chain's launch)", not upstream_posts)
        new_residual = state.streams
        check(f"{what}: the post is fp8chain's (R' the reference's)",
              same_bits(new_residual, ref.mhc_post(y, streams, post, comb)))
        check(f"{what}: x is fp8chain's combine + RMSNorm of R' from the same launch",
              same_bits(x, mhc_combine_norm(new_residual, pre, norm.weight, 1e-6)))
        if attention:
            pair_checks(what, x, state)
        else:
            check(f"{what} leaves no pair in ReadState.quantized", state.quantized is None)
            shared_expert_checks(what, x)
    print(f"{len(failures)} failed" if failures else "every check passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
