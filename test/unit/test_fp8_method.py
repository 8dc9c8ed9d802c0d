"""Fp8LinearMethod: the request flag life cycle, forward paths, scale validation (CPU; the Triton
GEMM runs on the interpreter at small shapes)."""

import dataclasses
import logging

import pytest
import torch

from fp8chain.layers.linear import ReplicatedLinear
from fp8chain.layers.loading import load_weights
from fp8chain.layers.quantization import get_quantization_config
from fp8chain.layers.quantization.fp8 import Fp8Config
from fp8chain_kernel import backends
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import FP8_DTYPE, ActFormat, align4
from fp8chain_kernel.quant import quantize
from helpers import rel_error

pytestmark = pytest.mark.cpu

LOGGER = "fp8chain.layers.quantization.fp8"
CFG32 = Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0")
CFG128 = Fp8Config(weight_block_size=(128, 128))


def checkpoint(n, k, block, pow2=True):
    weight = (torch.randn(n, k) * 96).clamp(-448, 448).to(FP8_DTYPE)
    shape = (-(-n // block), -(-k // block))
    if pow2:
        scale = torch.exp2(torch.randint(-10, -5, shape).float())
    else:
        scale = torch.rand(shape) * 1e-2 + 1e-3
    return {"weight": weight, "weight_scale_inv": scale}


def make_layer(n, k, cfg=CFG32, request=False, ckpt=None, prefix="wq_b", bias=False):
    layer = ReplicatedLinear(k, n, quant_config=cfg, prefix=prefix, bias=bias)
    layer.deepgemm_mxfp8_input = request
    ckpt = ckpt or checkpoint(n, k, cfg.block, pow2=cfg.scale_fmt == "ue8m0")
    load_weights(layer, ckpt.items())
    return layer, ckpt


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def gemm_reference(pair, ckpt, block):
    return ref.fp8_gemm(pair, ckpt["weight"], ckpt["weight_scale_inv"], block)


def test_request_honoured(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        layer, ckpt = make_layer(128, 256, request=True)
    fmt = backends.input_format_for(32)
    assert fmt.group_size == 32
    assert layer.deepgemm_mxfp8_input is True
    assert layer.input_format is fmt and layer.act_format is fmt
    assert layer.gemm_backend is not None
    assert not [r for r in caplog.records if r.name == LOGGER]
    x = torch.randn(5, 256).to(torch.bfloat16)
    pair = quantize(x, fmt)
    out = layer(pair)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 128)
    assert rel_error(out, gemm_reference(pair, ckpt, 32)) < 5e-3


def test_request_refused_on_unsupported_shape(caplog, monkeypatch):
    n, k = 128, 100  # K not a multiple of the 32-column group: no backend here serves it
    fmt = backends.input_format_for(32)
    with pytest.raises(ValueError):
        backends.select_backend(fmt, 32, n, k)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        layer, ckpt = make_layer(n, k, request=True, prefix="model.layers.0.attn.wq_b")
    assert layer.deepgemm_mxfp8_input is False
    assert layer.input_format is None and layer.gemm_backend is None
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1, lines
    assert lines[0].startswith("model.layers.0.attn.wq_b: ") and "keeping bf16 input" in lines[0]
    assert "K=100" in lines[0]
    # the layer still works on bf16 input (quantized by the layer, torch fallback GEMM)
    x = torch.randn(3, k).to(torch.bfloat16)
    out = layer(x)
    assert out.shape == (3, n)
    assert rel_error(out, gemm_reference(ref.quantize(x, fmt), ckpt, 32)) < 5e-3
    with pytest.raises(TypeError, match="reads bf16 input"):
        layer(quantize(x, fmt))
    x[1, 5] = float("nan")
    out = layer(x)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()
    # products no TF32 setting of the process can round: fp64 operands
    seen, matmul = [], torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: seen.append((a.dtype, b.dtype)) or matmul(a, b))
    layer(x)
    assert seen == [(torch.float64, torch.float64)]


def test_not_requested_stays_unchained(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        layer, ckpt = make_layer(128, 256, request=False)
    assert layer.deepgemm_mxfp8_input is False and layer.input_format is None
    assert layer.act_format is backends.input_format_for(32) and layer.gemm_backend is not None
    assert not [r for r in caplog.records if r.name == LOGGER]
    x = torch.randn(4, 256).to(torch.bfloat16)
    pair = quantize(x, layer.act_format)
    assert rel_error(layer(x), gemm_reference(pair, ckpt, 32)) < 5e-3
    with pytest.raises(TypeError, match="reads bf16 input"):
        layer(pair)


@pytest.mark.parametrize("cfg", [CFG32, CFG128], ids=["block32", "block128"])
def test_bf16_path_equals_pair_path_bitwise(cfg):
    layer, ckpt = make_layer(128, 256, cfg=cfg, request=True)
    for rows in (1, 3, 6, 17):
        x = torch.randn(rows, 256).to(torch.bfloat16)
        x[0, :40] = 0  # a partly zero row
        if rows > 2:
            x[2] = 0  # an all-zero row
        via_bf16 = layer(x)
        via_pair = layer(quantize(x, layer.input_format))
        assert torch.equal(bits(via_bf16), bits(via_pair)), rows
        assert torch.isfinite(via_bf16).all()
        if rows > 2:
            assert (via_bf16[2] == 0).all()


def test_mismatched_pair_raises_type_error_naming_both_formats():
    layer, _ = make_layer(128, 256, request=True)
    x = torch.randn(2, 256).to(torch.bfloat16)
    for other in ActFormat:
        if other is layer.input_format:
            continue
        with pytest.raises(TypeError) as info:
            layer(ref.quantize(x, other))
        assert layer.input_format.value in str(info.value) and other.value in str(info.value)


def test_leading_dims_zero_rows_and_bias():
    layer, _ = make_layer(128, 256, request=True, bias=True)
    bias = torch.randn(128).to(torch.bfloat16)
    layer.bias.data.copy_(bias)
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    out = layer(x)
    assert out.shape == (2, 3, 128)
    assert torch.equal(bits(out.reshape(6, 128)), bits(layer(x.reshape(6, 256))))
    assert layer(torch.zeros(0, 256, dtype=torch.bfloat16)).shape == (0, 128)
    assert layer(torch.zeros(2, 0, 256, dtype=torch.bfloat16)).shape == (2, 0, 128)
    zero = layer(torch.zeros(3, 256, dtype=torch.bfloat16))
    assert torch.equal(bits(zero), bits(bias.expand(3, 128)))
    with pytest.raises(ValueError, match="K=256"):
        layer(torch.zeros(3, 128, dtype=torch.bfloat16))


def test_nan_input_stays_visible():
    layer, _ = make_layer(128, 256, request=True)
    x = torch.randn(3, 256).to(torch.bfloat16)
    clean = layer(x)
    x[1, 7] = float("nan")
    out = layer(x)
    assert torch.isnan(out[1]).all()  # every output of the token: its NaN reaches each column's dot
    assert torch.equal(bits(out[0]), bits(clean[0])) and torch.equal(bits(out[2]), bits(clean[2]))


def test_ue8m0_checkpoint_needs_power_of_two_scales():
    ckpt = checkpoint(128, 256, 32)
    ckpt["weight_scale_inv"][1, 2] = 0.3
    with pytest.raises(ValueError, match=r"wq_b\.weight_scale_inv: 1 of 32 .*powers of two.*\[1, 2\]"):
        make_layer(128, 256, ckpt=ckpt)
    # continuous scales are fine without scale_fmt, but zeros/NaN are not
    ckpt = checkpoint(128, 256, 128, pow2=False)
    make_layer(128, 256, cfg=CFG128, ckpt=ckpt)
    ckpt["weight_scale_inv"][0, 0] = 0.0
    with pytest.raises(ValueError, match="positive and finite"):
        make_layer(128, 256, cfg=CFG128, ckpt=ckpt)


def test_forward_before_processing_is_an_error():
    layer = ReplicatedLinear(256, 128, quant_config=CFG32)
    with pytest.raises(RuntimeError, match="not processed"):
        layer(torch.zeros(1, 256, dtype=torch.bfloat16))


def _deepgemm_sm100(monkeypatch):
    """Pretend to be a Blackwell process where deep_gemm runs: the backends then pick DeepGEMM
    with the packed UE8M0 format (its GEMM itself is not run here)."""
    caps = backends.probe()
    monkeypatch.setattr(backends, "_CAPS", dataclasses.replace(
        caps, arch=(10, 0), deep_gemm=True, deep_gemm_reason=""))
    fmt = backends.input_format_for(32)
    assert fmt is ActFormat.SM100_G32_UE8M0_PACKED_MN
    return backends.get_backend("deep_gemm"), fmt


@pytest.mark.parametrize("n,k", [(128, 256), (96, 384), (4608 // 16, 5120 // 8)])
def test_deepgemm_sm100_packed_weight_scales_match_reference(monkeypatch, n, k):
    backend, fmt = _deepgemm_sm100(monkeypatch)
    layer, ckpt = make_layer(n, k, request=True)
    assert layer.gemm_backend is backend
    assert layer.deepgemm_mxfp8_input is True and layer.input_format is fmt
    assert layer.derived_weight_names == ("weight_scale_inv_deepgemm",)
    packed = layer.weight_scale_inv_deepgemm
    want = ref.pack_weight_scale_for_deepgemm(ckpt["weight_scale_inv"], n, k)
    assert packed.dtype == torch.int32 and packed.shape == (n, -(-k // 128))
    assert packed.stride() == (1, align4(n))
    assert torch.equal(packed, want)
    # the raw scales are untouched
    assert torch.equal(layer.weight_scale_inv, ckpt["weight_scale_inv"])


def test_deepgemm_sm100_layer_with_k_not_multiple_of_128_reads_the_triton_format(monkeypatch, caplog):
    """DeepGEMM refuses K % 128 != 0 in its packed format: the layer takes the Triton GEMM's
    format instead (its request honoured there), not the torch fallback."""
    _deepgemm_sm100(monkeypatch)
    with caplog.at_level(logging.INFO):
        layer, ckpt = make_layer(96, 160, request=True)
    assert layer.deepgemm_mxfp8_input is True and layer.input_format is ActFormat.SM90_G32_FP32_MN
    assert layer.gemm_backend.name == "triton" and not hasattr(layer, "weight_scale_inv_deepgemm")
    assert "K=160 is not a multiple of 128" in caplog.text and "torch fallback" not in caplog.text
    x = torch.randn(2, 160).to(torch.bfloat16)
    want = gemm_reference(ref.quantize(x, ActFormat.SM90_G32_FP32_MN), ckpt, 32)
    assert rel_error(layer(x), want) < 5e-3


def test_refused_when_backend_cannot_derive(monkeypatch, caplog):
    """Blackwell DeepGEMM needs power-of-two weight scales to pack; a 32x32 checkpoint without
    ``scale_fmt: ue8m0`` and with other scales is refused (and still computes)."""
    _deepgemm_sm100(monkeypatch)
    cfg = Fp8Config(weight_block_size=(32, 32))
    ckpt = checkpoint(128, 256, 32, pow2=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        layer, _ = make_layer(128, 256, cfg=cfg, request=True, ckpt=ckpt)
    assert layer.deepgemm_mxfp8_input is False and layer.input_format is None
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "deep_gemm: " in lines[0] and "power-of-two" in lines[0], lines
    x = torch.randn(2, 256).to(torch.bfloat16)
    want = gemm_reference(ref.quantize(x, ActFormat.SM100_G32_UE8M0_PACKED_MN), ckpt, 32)
    assert rel_error(layer(x), want) < 5e-3


def test_triton_refuses_32_blocks_without_power_of_two_scales(caplog):
    """The Triton GEMM dequantizes 32x32 blocks to bf16 from 17 tokens on, exact only for
    power-of-two scales: with others a token's output would depend on its batch's size. Such a
    checkpoint (no ``scale_fmt: ue8m0``) is refused and served by the torch fallback, whose rows
    do not depend on the batch."""
    cfg = Fp8Config(weight_block_size=(32, 32))
    ckpt = checkpoint(64, 128, 32, pow2=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        layer, _ = make_layer(64, 128, cfg=cfg, request=True, ckpt=ckpt)
    assert layer.gemm_backend is None and layer.deepgemm_mxfp8_input is False and layer.input_format is None
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) == 1 and "triton: 32x32 weight blocks need power-of-two scales" in lines[0], lines
    x = torch.randn(20, 128).to(torch.bfloat16)
    full = layer(x)
    assert torch.equal(layer(x[:3]), full[:3])
    assert rel_error(full, gemm_reference(ref.quantize(x, ActFormat.SM90_G32_FP32_MN), ckpt, 32)) < 5e-3
    served, _ = make_layer(64, 128, cfg=cfg, request=True, ckpt=checkpoint(64, 128, 32))  # powers of two: served
    assert served.gemm_backend is not None and served.input_format is ActFormat.SM90_G32_FP32_MN


def test_a_refused_reload_keeps_the_request_and_poisons_stale_derived_scales(monkeypatch, caplog):
    """Loads A, B, A where Blackwell DeepGEMM cannot pack B's scales (not powers of two): B is
    served bf16 on the torch fallback, A again as a fresh load of A is (the request is not lost);
    after B the packed scales derived for A, which a graph captured under A would still read,
    are UE8M0 NaN rather than A's."""
    _deepgemm_sm100(monkeypatch)
    cfg = Fp8Config(weight_block_size=(32, 32))
    a = checkpoint(128, 256, 32)
    b = {"weight": a["weight"], "weight_scale_inv": a["weight_scale_inv"] * 1.25}
    layer, _ = make_layer(128, 256, cfg=cfg, request=True, ckpt=a)
    fresh = (layer.input_format, layer.gemm_backend, layer.weight_scale_inv_deepgemm.clone())
    assert fresh[0] is ActFormat.SM100_G32_UE8M0_PACKED_MN
    packed = layer.weight_scale_inv_deepgemm
    with caplog.at_level(logging.INFO, logger=LOGGER):
        load_weights(layer, b.items())
    assert layer.input_format is None and layer.gemm_backend is None and layer.derived_weight_names == ()
    assert layer.fp8chain_refused_request and not layer.deepgemm_mxfp8_input
    assert (packed == -1).all()  # every byte 0xFF
    x = torch.randn(2, 256).to(torch.bfloat16)
    want = gemm_reference(ref.quantize(x, ActFormat.SM100_G32_UE8M0_PACKED_MN), b, 32)
    assert rel_error(layer(x), want) < 5e-3
    load_weights(layer, a.items())
    assert (layer.input_format, layer.gemm_backend) == fresh[:2] and layer.deepgemm_mxfp8_input
    assert not layer.fp8chain_refused_request
    assert layer.weight_scale_inv_deepgemm.data_ptr() == packed.data_ptr()
    assert torch.equal(layer.weight_scale_inv_deepgemm, fresh[2])


def test_get_quantization_config():
    hf = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32],
                                  "scale_fmt": "ue8m0"}}
    cfg = get_quantization_config(hf)
    assert isinstance(cfg, Fp8Config) and cfg.block == 32 and cfg.scale_fmt == "ue8m0"
    assert get_quantization_config({"hidden_size": 8}) is None
    with pytest.raises(ValueError, match="unsupported quant_method"):
        get_quantization_config({"quantization_config": {"quant_method": "gptq"}})


def test_gate_up_silu_mul_epilogue_is_the_two_launches(monkeypatch):
    """``consumer_gemm_silu_mul``: on the Triton backend the pair of ``act.silu_mul(layer(pair))``
    from one launch, byte for byte; None for a backend without the epilogue, a layer with a bias
    (fp8chain's ``forward_bias``, or ``bias`` on a layer without it, as SGLang's) or gate and up
    halves that are not whole weight blocks."""
    from fp8chain.layers.quantization.fp8 import consumer_gemm_silu_mul
    from fp8chain_kernel import act, gemv
    from helpers import assert_pairs_equal

    layer, _ = make_layer(256, 256, request=True, prefix="gate_up")
    fmt = layer.input_format
    pair = quantize(torch.randn(3, 256).bfloat16(), fmt)
    got = consumer_gemm_silu_mul(layer, pair, 7.0, fmt)
    assert got is not None
    assert_pairs_equal(got, act.silu_mul(layer(pair), limit=7.0, out_format=fmt, return_bf16=False))
    biased, _ = make_layer(256, 256, request=True, prefix="gate_up", bias=True)
    assert consumer_gemm_silu_mul(biased, pair, 7.0, fmt) is None
    sglang_style = torch.nn.Module()  # a prepared layer with upstream's attributes only
    for name in ("weight", "weight_scale_inv", "gemm_backend", "derived_weight_names", "input_format"):
        setattr(sglang_style, name, getattr(layer, name))
    for name in layer.derived_weight_names:
        setattr(sglang_style, name, getattr(layer, name))
    sglang_style.bias = None
    assert_pairs_equal(consumer_gemm_silu_mul(sglang_style, pair, 7.0, fmt, "gate_up_proj"), got)
    sglang_style.bias = torch.zeros(256)
    assert consumer_gemm_silu_mul(sglang_style, pair, 7.0, fmt, "gate_up_proj") is None
    halves, _ = make_layer(96, 256, request=True, prefix="gate_up")  # I = 48: not whole 32-row blocks
    assert consumer_gemm_silu_mul(halves, pair, 7.0, fmt) is None
    one = quantize(torch.randn(1, 256).bfloat16(), fmt)
    assert consumer_gemm_silu_mul(layer, one, 7.0, fmt) is not None
    monkeypatch.setitem(gemv.GEMV_TABLE, (1, 256, 256, 32), gemv.GemvConfig(4, 256))
    assert consumer_gemm_silu_mul(layer, one, 7.0, fmt) is None  # one token runs the GEMV: two launches
    assert consumer_gemm_silu_mul(layer, pair, 7.0, fmt) is not None
    monkeypatch.setitem(gemv.GEMV_TABLE, (4, 256, 256, 32), gemv.GemvConfig(4, 256))
    assert consumer_gemm_silu_mul(layer, pair, 7.0, fmt) is None  # three tokens on the 4-token tile
    monkeypatch.setattr(layer, "gemm_backend", object())  # a backend with no such epilogue
    assert consumer_gemm_silu_mul(layer, pair, 7.0, fmt) is None


def test_shared_expert_epilogue_on_off_and_chain_off_agree(monkeypatch):
    """The chained shared expert takes the gate_up GEMM's SiLU*mul epilogue (one launch); without
    it, and with the chain off, the output is the same bits."""
    from fp8chain.layers.moe import SharedExpert
    from fp8chain_kernel import gemm

    expert = SharedExpert(256, 128, swiglu_limit=7.0, quant_config=CFG32, prefix="shared")
    for linear in (expert.gate_up, expert.down):
        load_weights(linear, checkpoint(*linear.weight.shape, 32).items())
    calls = []
    fused_gemm = gemm.fp8_gemm_silu_mul
    monkeypatch.setattr(gemm, "fp8_gemm_silu_mul", lambda *a, **kw: calls.append(1) or fused_gemm(*a, **kw))
    x = torch.randn(3, 256).bfloat16()
    pair = quantize(x, expert.gate_up.input_format)
    fused = expert(x, pair)
    assert calls == [1]
    expert.fuse_silu_mul = False
    assert torch.equal(bits(expert(x, pair)), bits(fused))
    expert.fuse_silu_mul, expert.chain = True, False
    assert torch.equal(bits(expert(x, pair)), bits(fused))
    assert calls == [1]


@pytest.mark.parametrize("tokens", [1, 3])
def test_shared_expert_tokens_on_the_gemv_keep_chain_on_equal_off(tokens, monkeypatch):
    """Tokens of a problem the GEMV serves: the chained shared expert takes GEMV + SiLU*mul
    (not the tensor-core GEMM's epilogue, whose sums differ), so chain on and off agree bit for bit."""
    from fp8chain.layers.moe import SharedExpert
    from fp8chain_kernel import gemm, gemv

    expert = SharedExpert(256, 128, swiglu_limit=7.0, quant_config=CFG32, prefix="shared")
    for linear in (expert.gate_up, expert.down):
        load_weights(linear, checkpoint(*linear.weight.shape, 32).items())
        monkeypatch.setitem(gemv.GEMV_TABLE, (gemv.gemv_token_tile(tokens), *linear.weight.shape, 32),
                            gemv.GemvConfig(4, 128))
    calls = []
    fused_gemm, real_gemv = gemm.fp8_gemm_silu_mul, gemm.launch_gemv
    monkeypatch.setattr(gemm, "fp8_gemm_silu_mul", lambda *a, **kw: calls.append("fused") or fused_gemm(*a, **kw))
    monkeypatch.setattr(gemm, "launch_gemv", lambda *a: calls.append("gemv") or real_gemv(*a))
    x = torch.randn(tokens, 256).bfloat16()
    chained = expert(x, quantize(x, expert.gate_up.input_format))
    assert calls == ["gemv", "gemv"]
    expert.chain = False
    assert torch.equal(bits(expert(x, None)), bits(chained))


def test_column_strided_bf16_input_equals_its_contiguous_copy():
    """A bf16 input with non-unit column stride (a transposed view) is served, bit-equal to its copy."""
    layer, _ = make_layer(128, 256)
    x = torch.randn(256, 5).to(torch.bfloat16).t()  # [5, 256], strides (1, 5)
    assert x.stride(1) != 1
    assert torch.equal(bits(layer(x)), bits(layer(x.contiguous())))


def test_pair_with_wrong_column_count_is_refused_naming_k():
    """A pair in the right format but not K columns wide is a ValueError naming the weight's K."""
    layer, _ = make_layer(128, 256, request=True)
    for cols in (128, 288):
        pair = quantize(torch.randn(2, cols).to(torch.bfloat16), layer.input_format)
        with pytest.raises(ValueError, match=f"input has {cols} columns, weight expects K=256"):
            layer(pair)
