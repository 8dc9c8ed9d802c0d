"""Weight reload: storage kept, derived tensors recomputed in place, results equal fresh loads."""

import dataclasses
import logging

import pytest
import torch
from torch import nn

from fp8chain.layers.linear import ColumnParallelLinear, ReplicatedLinear
from fp8chain.layers.loading import load_weights, process_weights_after_loading
from fp8chain.layers.quantization.fp8 import Fp8Config
from fp8chain_kernel import backends
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import FP8_DTYPE, ActFormat
from fp8chain_kernel.quant import quantize
from helpers import DerivingBackend

pytestmark = pytest.mark.cpu

CFG32 = Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0")
N, K = 128, 256


def checkpoint(n=N, k=K, block=32, bias=False):
    ckpt = {"weight": (torch.randn(n, k) * 96).clamp(-448, 448).to(FP8_DTYPE),
            "weight_scale_inv": torch.exp2(torch.randint(-10, -5, (-(-n // block), -(-k // block))).float())}
    if bias:
        ckpt["bias"] = torch.randn(n).to(torch.bfloat16)
    return ckpt


@pytest.fixture(params=["selected", "deriving"])
def backend_kind(request, monkeypatch):
    if request.param == "deriving":
        real = backends.select_backend
        monkeypatch.setattr(backends, "select_backend",
                            lambda fmt, block, n, k, prefer=None: DerivingBackend(real(fmt, block, n, k)))
    return request.param


def make_layer(request=True, bias=False):
    layer = ReplicatedLinear(K, N, quant_config=CFG32, prefix="wo_b", bias=bias)
    layer.deepgemm_mxfp8_input = request
    return layer


def storage(layer):
    return {name: (p.data_ptr(), p.stride()) for name, p in layer.named_parameters()}


def bits(t):
    return t.view(torch.int16)


def outputs(layer, x):
    outs = [layer(x)]
    if layer.input_format is not None:
        outs.append(layer(quantize(x, layer.input_format)))
    return outs


@pytest.mark.parametrize("bias", [False, True])
def test_reload_a_b_a_keeps_storage_and_equals_fresh_loads(backend_kind, bias):
    a, b = checkpoint(bias=bias), checkpoint(bias=bias)
    x = torch.randn(5, K).to(torch.bfloat16)
    fresh = {}
    for tag, ckpt in (("A", a), ("B", b)):
        layer = make_layer(bias=bias)
        load_weights(layer, ckpt.items())
        fresh[tag] = outputs(layer, x)
    assert not torch.equal(bits(fresh["A"][0]), bits(fresh["B"][0]))

    live = make_layer(bias=bias)
    load_weights(live, a.items())
    before = storage(live)
    if backend_kind == "deriving":
        assert "weight_scale_t" in before
    for tag, ckpt in (("B", b), ("A", a), ("B", b), ("A", a)):
        load_weights(live, ckpt.items())
        assert storage(live) == before, tag
        assert live.deepgemm_mxfp8_input is True and live.input_format is not None
        for got, want in zip(outputs(live, x), fresh[tag], strict=True):
            assert torch.equal(bits(got), bits(want)), tag


def test_process_twice_equals_once(backend_kind):
    layer = make_layer()
    load_weights(layer, checkpoint().items())
    x = torch.randn(3, K).to(torch.bfloat16)
    snapshot = {name: p.detach().clone() for name, p in layer.named_parameters()}
    ptrs = storage(layer)
    out = layer(x)
    layer.quant_method.process_weights_after_loading(layer)
    layer.quant_method.process_weights_after_loading(layer)
    assert storage(layer) == ptrs
    for name, p in layer.named_parameters():
        assert torch.equal(p.view(torch.uint8) if p.dtype == FP8_DTYPE else p,
                           snapshot[name].view(torch.uint8) if p.dtype == FP8_DTYPE else snapshot[name]), name
    assert layer.deepgemm_mxfp8_input is True
    assert torch.equal(bits(layer(x)), bits(out))


def test_deepgemm_packed_scales_follow_reloads(monkeypatch):
    """Blackwell DeepGEMM's packed scales: same storage on every reload, always the packing of
    the raw scales just loaded (never a re-packing of packed values)."""
    monkeypatch.setattr(backends, "_CAPS", dataclasses.replace(
        backends.probe(), arch=(10, 0), deep_gemm=True, deep_gemm_reason=""))
    backend = backends.get_backend("deep_gemm")
    a, b = checkpoint(), checkpoint()
    layer = make_layer()
    load_weights(layer, a.items())
    assert layer.gemm_backend is backend
    assert layer.input_format is ActFormat.SM100_G32_UE8M0_PACKED_MN
    ptrs = storage(layer)
    assert "weight_scale_inv_deepgemm" in ptrs
    for ckpt in (b, a, a, b):
        load_weights(layer, ckpt.items())
        assert storage(layer) == ptrs
        want = ref.pack_weight_scale_for_deepgemm(ckpt["weight_scale_inv"], N, K)
        assert torch.equal(layer.weight_scale_inv_deepgemm, want)
        assert torch.equal(layer.weight_scale_inv, ckpt["weight_scale_inv"])
        layer.quant_method.process_weights_after_loading(layer)
        assert torch.equal(layer.weight_scale_inv_deepgemm, want)


def test_a_processing_failing_with_any_error_leaves_the_layer_refusing_to_run(backend_kind, monkeypatch):
    """Deriving B's tensors fails with something other than a refusal (out of memory, say): the
    layer holds B's raw weights and A's derived tensors, so it refuses bf16 and pairs alike until
    a processing succeeds, which then equals a fresh load of B."""
    a, b = checkpoint(), checkpoint()
    x = torch.randn(3, K).to(torch.bfloat16)
    layer = make_layer()
    load_weights(layer, a.items())
    pair = quantize(x, layer.input_format)
    working = backends.select_backend

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(backends, "select_backend", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        load_weights(layer, b.items())
    with pytest.raises(RuntimeError, match="weights not processed"):
        layer(x)
    with pytest.raises(TypeError, match="reads bf16 input"):
        layer(pair)
    monkeypatch.setattr(backends, "select_backend", working)
    layer.quant_method.process_weights_after_loading(layer)
    fresh = make_layer()
    load_weights(fresh, b.items())
    assert layer.deepgemm_mxfp8_input is True
    for got, want in zip(outputs(layer, x), outputs(fresh, x), strict=True):
        assert torch.equal(bits(got), bits(want))


def test_a_configured_backend_that_rejects_the_layer_fails_its_load():
    """``Fp8Config(backend=...)`` is a requirement: cuBLAS blockwise reads no 32x32 blocks, so the
    load fails naming it (rather than running the torch fallback GEMM) and the layer refuses to run."""
    layer = ReplicatedLinear(K, N, quant_config=dataclasses.replace(CFG32, backend="torch_blockwise"), prefix="wo_b")
    layer.deepgemm_mxfp8_input = True
    with pytest.raises(ValueError, match="torch_blockwise"):
        load_weights(layer, checkpoint().items())
    with pytest.raises(RuntimeError, match="weights not processed"):
        layer(torch.randn(3, K).to(torch.bfloat16))


def test_a_fresh_layer_given_only_its_weight_refuses_to_run():
    """Block scales start unset (NaN), not as a placeholder 1.0 the checks would take for a
    checkpoint's: a first load without them fails processing and the layer refuses to run."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # serving stacks build models so: the scales stay fp32
    try:
        layer = make_layer()
    finally:
        torch.set_default_dtype(default)
    assert layer.weight_scale_inv.dtype == torch.float32
    with pytest.raises(ValueError, match=r"weight_scale_inv: .* not positive, finite powers of two"):
        load_weights(layer, [("weight", checkpoint()["weight"])])
    with pytest.raises(RuntimeError, match="weights not processed"):
        layer(torch.randn(3, K).to(torch.bfloat16))
    load_weights(layer, checkpoint().items())
    assert layer.input_format is not None


def test_a_fresh_layer_given_only_its_scales_refuses_to_run():
    """The weight starts as e4m3 NaN codes, as the scales start NaN: a first load of the scales
    alone fails processing (it served zeros) and the layer refuses to run; a NaN code in a
    loaded weight is refused too."""
    layer = make_layer()
    with pytest.raises(ValueError, match=rf"weight: {N * K} of {N * K} values are e4m3 NaN codes"):
        load_weights(layer, [("weight_scale_inv", checkpoint()["weight_scale_inv"])])
    with pytest.raises(RuntimeError, match="weights not processed"):
        layer(torch.randn(3, K).to(torch.bfloat16))
    tensors = checkpoint()
    tensors["weight"].view(torch.uint8)[5, 7] = 0xFF
    with pytest.raises(ValueError, match=r"weight: 1 of .* NaN codes .* first at \[5, 7\]"):
        load_weights(layer, tensors.items())
    load_weights(layer, checkpoint().items())
    assert layer.input_format is not None


def test_partial_reload_and_sharded_reload():
    full_a, full_b = checkpoint(n=2 * N), checkpoint(n=2 * N)
    layer = ColumnParallelLinear(K, 2 * N, quant_config=CFG32, tp_rank=1, tp_size=2)
    load_weights(layer, full_a.items())
    ptrs = storage(layer)
    # reload only the weight (scales kept), from the full tensor
    load_weights(layer, [("weight", full_b["weight"])])
    assert storage(layer) == ptrs
    assert torch.equal(layer.weight.view(torch.uint8), full_b["weight"][N:].view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, full_a["weight_scale_inv"][N // 32:])


def test_reload_with_another_shape_fails_and_keeps_storage(caplog):
    layer = make_layer()
    load_weights(layer, checkpoint().items())
    ptrs = storage(layer)
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="checkpoint shape"):
        load_weights(layer, checkpoint(n=N + 32).items())
    assert storage(layer) == ptrs


def test_a_load_failing_after_a_write_leaves_the_layer_refusing_to_run(backend_kind):
    """Scales of B written, then B's weight refused: the layer holds parts of two checkpoints, so
    it refuses bf16 and pairs alike (its derived tensors poisoned) until a load succeeds; the
    request for a pre-quantized input stands for that load."""
    a, b = checkpoint(), checkpoint()
    x = torch.randn(3, K).to(torch.bfloat16)
    layer = make_layer()
    load_weights(layer, a.items())
    pair = quantize(x, layer.input_format)
    with pytest.raises(ValueError, match="checkpoint shape"):
        load_weights(layer, [("weight_scale_inv", b["weight_scale_inv"]), ("weight", checkpoint(n=N + 32)["weight"])])
    with pytest.raises(RuntimeError, match="weights not processed"):
        layer(x)
    with pytest.raises(TypeError, match="reads bf16 input"):
        layer(pair)
    assert all(torch.isnan(getattr(layer, name)).all() for name in layer.derived_weight_names)
    fresh = make_layer()
    load_weights(fresh, b.items())
    load_weights(layer, b.items())
    assert layer.input_format is ActFormat.SM90_G32_FP32_MN
    for got, want in zip(outputs(layer, x), outputs(fresh, x)):
        assert torch.equal(bits(got), bits(want))


def test_processing_goes_on_past_a_layer_that_fails(backend_kind):
    """A reload whose scales one layer refuses (not powers of two under ``scale_fmt: ue8m0``):
    that layer refuses to run, every other layer is processed from its new weights (with a
    deriving backend, unprocessed it would keep tensors derived from the old ones)."""
    from torch import nn

    x = torch.randn(3, K).to(torch.bfloat16)
    model = nn.ModuleDict({"bad": make_layer(), "good": make_layer()})
    a, b = checkpoint(), checkpoint()
    load_weights(model, [(f"{layer}.{name}", t) for layer in model for name, t in a.items()])
    corrupt = dict(b, weight_scale_inv=b["weight_scale_inv"] * 1.5)
    with pytest.raises(ValueError, match="not positive, finite powers of two"):
        load_weights(model, [(f"bad.{n}", t) for n, t in corrupt.items()] + [(f"good.{n}", t) for n, t in b.items()])
    with pytest.raises(RuntimeError, match="weights not processed"):
        model["bad"](x)
    fresh = make_layer()
    load_weights(fresh, b.items())
    for got, want in zip(outputs(model["good"], x), outputs(fresh, x)):
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("loaded_dtype", [torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                                          torch.float8_e4m3fn])
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_an_8_bit_float_loads_only_into_its_own_dtype(loaded_dtype, param_dtype):
    """FP8 in another encoding, or into a bf16 / fp32 parameter, would be taken by value without
    its scales: refused (e4m3 into e4m3 loads); UE8M0 scales into fp32 ones convert exactly."""
    from fp8chain.layers.loading import default_weight_loader

    param = torch.nn.Parameter(torch.zeros(4, 8, dtype=param_dtype), requires_grad=False)
    loaded = torch.randn(4, 8).to(loaded_dtype)
    if loaded_dtype == param_dtype:
        default_weight_loader(param, loaded)
        assert torch.equal(param.view(torch.uint8), loaded.view(torch.uint8))
    else:
        with pytest.raises(TypeError, match=f"{loaded_dtype} cannot be loaded into a {param_dtype} parameter"):
            default_weight_loader(param, loaded)
    if param_dtype == torch.float32:
        exponents = torch.randint(100, 140, (4, 8), dtype=torch.uint8)
        default_weight_loader(param, exponents.view(torch.float8_e8m0fnu))
        assert torch.equal(param, torch.exp2(exponents.float() - 127))


def test_layer_loader_reprocesses_the_routed_experts_and_reads_e8m0_scales_as_bytes():
    """The routed experts derive bf16 copies of their MXFP4 weights: a reload through
    ``layers.loading.load_weights`` re-derives them (before, they kept the old weights). Their
    UE8M0 scales stored as float8_e8m0fnu go in as bytes; another float into a byte parameter
    would be converted by value and is refused."""
    from fp8chain.layers.moe import RoutedExpertsReference, dequantize_mxfp4

    experts = RoutedExpertsReference(num_experts=2, hidden_size=64, intermediate_size=32, swiglu_limit=None)
    gen = torch.Generator().manual_seed(3)
    w13 = torch.randint(0, 256, tuple(experts.w13_weight.shape), generator=gen, dtype=torch.uint8)
    scale = torch.randint(120, 127, tuple(experts.w13_scale.shape), generator=gen, dtype=torch.uint8)
    load_weights(experts, [("w13_weight", w13), ("w13_scale", scale.view(torch.float8_e8m0fnu))])
    assert torch.equal(experts.w13_scale, scale)
    assert torch.equal(experts.w13_dequant, dequantize_mxfp4(w13, scale, torch.bfloat16))
    with pytest.raises(TypeError, match="torch.float32 cannot be loaded into a torch.uint8 parameter"):
        load_weights(experts, [("w13_scale", scale.float())])
    if hasattr(torch, "float4_e2m1fn_x2"):  # packed e2m1 pairs under their own element type: their bytes
        other = torch.randint(0, 256, tuple(experts.w13_weight.shape), generator=gen, dtype=torch.uint8)
        load_weights(experts, [("w13_weight", other.view(torch.float4_e2m1fn_x2))])
        assert torch.equal(experts.w13_weight, other)


def test_routed_experts_left_unprocessed_by_a_failed_load_refuse_to_run():
    """A reload whose MXFP4 scales hold the NaN byte 255 fails; so does one that writes a tensor
    and then fails on the next. Either way the routed experts refuse to run (their bf16 copies no
    longer follow their parameters) until a load succeeds, which equals a fresh load."""
    from fp8chain.layers.moe import RoutedExpertsReference

    def make():
        return RoutedExpertsReference(num_experts=2, hidden_size=64, intermediate_size=32, swiglu_limit=None)

    experts = make()
    gen = torch.Generator().manual_seed(5)
    good = {name: torch.randint(0, 256, tuple(p.shape), generator=gen, dtype=torch.uint8)
            for name, p in experts.named_parameters()}
    for name in ("w13_scale", "w2_scale"):
        good[name] = torch.randint(118, 127, tuple(good[name].shape), generator=gen, dtype=torch.uint8)
    x = torch.randn(3, 64).bfloat16()
    idx, weights = torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.rand(3, 2)
    load_weights(experts, good.items())
    before = experts(x, idx, weights)
    nan_scale = good["w2_scale"].clone()
    nan_scale[1, 3, 0] = 255
    with pytest.raises(ValueError, match="255"):
        load_weights(experts, [("w2_scale", nan_scale)])
    with pytest.raises(RuntimeError, match="routed experts: weights not processed"):
        experts(x, idx, weights)
    load_weights(experts, good.items())
    assert torch.equal(experts(x, idx, weights), before)
    with pytest.raises(ValueError, match="does not match"):  # w13_weight written, then the next refused
        load_weights(experts, [("w13_weight", good["w13_weight"].flip(0)), ("w2_weight", good["w2_weight"][:1])])
    with pytest.raises(RuntimeError, match="routed experts: weights not processed"):
        experts(x, idx, weights)
    load_weights(experts, good.items())
    fresh = make()
    load_weights(fresh, good.items())
    assert torch.equal(experts(x, idx, weights), fresh(x, idx, weights))


def test_load_weights_refuses_a_name_given_twice():
    """A checkpoint naming one tensor twice is refused (the second copy would silently win)."""
    a, b = checkpoint(), checkpoint()
    with pytest.raises(ValueError, match="'weight' is given twice"):
        load_weights(ReplicatedLinear(K, N, quant_config=CFG32, prefix="wo_b", bias=False), [("weight", a["weight"]), ("weight_scale_inv", a["weight_scale_inv"]),
                                ("weight", b["weight"])])


def test_an_interrupted_load_leaves_the_layer_refusing_to_run():
    """A KeyboardInterrupt after some tensors were written leaves the layer refusing to run."""
    a, b = checkpoint(), checkpoint()
    layer = ReplicatedLinear(K, N, quant_config=CFG32, prefix="wo_b", bias=False)
    load_weights(layer, a.items())

    def stream():
        yield "weight_scale_inv", b["weight_scale_inv"]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        load_weights(layer, stream())
    with pytest.raises(RuntimeError, match="weights not processed"):
        layer(torch.randn(3, K).bfloat16())


def test_a_load_refused_at_its_first_tensor_leaves_the_layer_running():
    """Nothing written (the first tensor refused): the layer keeps serving its old weights."""
    a = checkpoint()
    layer, fresh = ReplicatedLinear(K, N, quant_config=CFG32, prefix="wo_b", bias=False), ReplicatedLinear(K, N, quant_config=CFG32, prefix="wo_b", bias=False)
    load_weights(layer, a.items())
    load_weights(fresh, a.items())
    with pytest.raises(ValueError, match="checkpoint shape"):
        load_weights(layer, [("weight", checkpoint(n=N + 32)["weight"])])
    x = torch.randn(3, K).bfloat16()
    assert torch.equal(layer(x), fresh(x))


def test_processing_raises_the_first_error_after_processing_every_module():
    """Every module is processed even past failures; the first failure is the one raised."""
    done = []

    class Step(nn.Module):
        def __init__(self, name, fails):
            super().__init__()
            self.name, self.fails = name, fails

        def process_weights_after_loading(self):
            done.append(self.name)
            if self.fails:
                raise ValueError(f"{self.name} failed")

    model = nn.Sequential(Step("a", True), Step("b", False), Step("c", True))
    with pytest.raises(ValueError, match="^a failed$"):
        process_weights_after_loading(model)
    assert done == ["a", "b", "c"]


def test_an_integer_tensor_loads_into_any_integer_parameter():
    """Integer tensors go into integer parameters of another width (by value): only 8-bit floats
    are held to their own dtype."""
    from fp8chain.layers.loading import default_weight_loader

    for param_dtype, loaded_dtype in ((torch.int32, torch.int8), (torch.int8, torch.int32), (torch.int64, torch.uint8)):
        param = torch.nn.Parameter(torch.zeros(4, 8, dtype=param_dtype), requires_grad=False)
        loaded = torch.randint(0, 100, (4, 8), dtype=loaded_dtype)
        default_weight_loader(param, loaded)
        assert torch.equal(param.long(), loaded.long())


def test_processing_counts_every_processed_layer_and_runs_after_an_empty_load():
    """``process_weights_after_loading`` returns how many modules it processed (quantized layers
    and modules that derive tensors themselves); ``load_weights`` processes even when no tensor was
    given (a model invalidated by a failed load runs again after it)."""
    done = []

    class Deriving(nn.Module):
        def process_weights_after_loading(self):
            done.append(self)

    model = nn.Sequential(make_layer(), Deriving(), nn.ReLU())
    model[0].quant_method.process_weights_after_loading = lambda layer: done.append(layer)
    assert process_weights_after_loading(model) == 2 and done == [model[0], model[1]]
    done.clear()
    assert load_weights(model, []) == set() and done == [model[0], model[1]]


def test_an_unknown_name_is_refused_unless_not_strict(caplog):
    layer = make_layer()
    with pytest.raises(KeyError, match="'nonsense' has no parameter"):
        load_weights(layer, [("nonsense", torch.zeros(1))])
    with caplog.at_level(logging.WARNING, logger="fp8chain.layers.loading"):
        assert load_weights(layer, [*checkpoint().items(), ("nonsense", torch.zeros(1))], strict=False) == {
            "weight", "weight_scale_inv"}
    assert any("skipped 1 tensors" in r.getMessage() for r in caplog.records)


def test_routed_experts_name_the_expert_holding_a_nan_scale():
    """The scales are checked whole before any expert is decoded, so the error's index names the
    expert (``[expert, row, group]``)."""
    from fp8chain.layers.moe import RoutedExpertsReference

    experts = RoutedExpertsReference(num_experts=2, hidden_size=64, intermediate_size=32, swiglu_limit=None)
    experts.w2_scale[1, 3, 0] = 255
    with pytest.raises(ValueError, match=r"\(2, 64, 1\): 1 hold the byte 255 .*first at \[1, 3, 0\]"):
        experts.process_weights_after_loading()
