"""Backend selection and the DeepGEMM argument contract (against a fake ``deep_gemm`` module).

DeepGEMM does not run on fp8chain's H200 (its wheels do not match torch 2.11's ABI), so the
DeepGEMM backend is checked here, on CPU: a fake ``deep_gemm`` inserted in ``sys.modules`` checks
every argument of ``fp8_gemm_nt`` (dtype, shape, strides, recipe, ue8m0 flag) against the
documented contract and computes the result with the reference.
"""

import copy
import logging
import sys
import types

import pytest
import torch

from fp8chain.layers.linear import ReplicatedLinear
from fp8chain.layers.loading import load_weights
from fp8chain.layers.quantization.fp8 import Fp8Config
from fp8chain_kernel import backends
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat, align4, cdiv

pytestmark = pytest.mark.cpu

G32, G128, PACKED = ActFormat.SM90_G32_FP32_MN, ActFormat.SM90_G128_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN


class ContractError(AssertionError):
    pass


def _expect(cond, what):
    if not cond:
        raise ContractError(what)


def _mn_major(t, rows, cols, dtype, name):
    _expect(t.dtype == dtype, f"{name} dtype {t.dtype}, want {dtype}")
    _expect(tuple(t.shape) == (rows, cols), f"{name} shape {tuple(t.shape)}, want {(rows, cols)}")
    _expect(t.stride(0) == 1 and (cols == 1 or t.stride(1) == align4(rows)),
            f"{name} strides {t.stride()}, want MN-major (1, {align4(rows)})")


def make_fake_deep_gemm(arch_major: int, calls: list):
    """A ``deep_gemm`` stand-in enforcing fp8_gemm_nt's contract for SM90 or SM100."""

    def fp8_gemm_nt(a, b, d, c=None, recipe=None, compiled_dims="nk", disable_ue8m0_cast=False):
        (a_data, sfa), (b_data, sfb) = a, b
        for name, t in (("a", a_data), ("b", b_data), ("sfa", sfa), ("sfb", sfb), ("d", d)):
            _expect(t.data_ptr() % 16 == 0, f"{name} is not 16-byte aligned (TMA)")
        for name, t in (("a", a_data), ("b", b_data)):
            _expect(t.dtype == torch.float8_e4m3fn, f"{name} dtype {t.dtype}")
            _expect(t.dim() == 2 and t.is_contiguous(), f"{name} must be K-major contiguous, strides {t.stride()}")
        m, k = a_data.shape
        n, kb = b_data.shape
        _expect(k == kb and k % 128 == 0, f"K mismatch or not a multiple of 128: {k} {kb}")
        _expect(d.dtype == torch.bfloat16 and tuple(d.shape) == (m, n) and d.is_contiguous(),
                f"d must be contiguous bf16 {(m, n)}, got {d.dtype} {tuple(d.shape)} {d.stride()}")
        _expect(c is None, "c must be None (no accumulation)")
        if arch_major == 9:  # DeepGEMM's SM90 scale layouts: fp32 in 128-column groups only
            _expect(recipe == (1, 128, 128), f"SM90 recipe {recipe}")
            _, gn, gk = recipe
            _mn_major(sfa, m, cdiv(k, gk), torch.float32, "sfa")
            _expect(sfb.dtype == torch.float32 and tuple(sfb.shape) == (cdiv(n, gn), cdiv(k, gk))
                    and sfb.is_contiguous(), f"sfb must be contiguous fp32 {(cdiv(n, gn), cdiv(k, gk))}, "
                    f"got {sfb.dtype} {tuple(sfb.shape)} {sfb.stride()}")
            a_val = a_data.float() * sfa.repeat_interleave(gk, 1)[:, :k]
            b_val = ref.dequantize_weight(b_data, sfb, (gn, gk))
        else:
            _expect(recipe == (1, 1, 32), f"SM100 recipe {recipe}")
            _expect(disable_ue8m0_cast is True, "packed UE8M0 scales need disable_ue8m0_cast=True")
            _mn_major(sfa, m, cdiv(k, 128), torch.int32, "sfa")
            _mn_major(sfb, n, cdiv(k, 128), torch.int32, "sfb")
            to_scale = lambda packed: torch.exp2(ref.unpack_ue8m0(packed, cdiv(k, 32)).float() - 127)
            a_val = a_data.float() * to_scale(sfa).repeat_interleave(32, 1)[:, :k]
            b_val = b_data.float() * to_scale(sfb).repeat_interleave(32, 1)[:, :k]
        calls.append(dict(m=m, n=n, k=k, recipe=recipe, disable_ue8m0_cast=disable_ue8m0_cast))
        d.copy_((a_val.double() @ b_val.double().t()).to(torch.bfloat16))

    module = types.ModuleType("deep_gemm")
    module.fp8_gemm_nt = fp8_gemm_nt
    return module


@pytest.fixture
def fake_deep_gemm(monkeypatch, request):
    arch = request.param
    calls = []
    monkeypatch.setitem(sys.modules, "deep_gemm", make_fake_deep_gemm(arch[0], calls))
    caps = backends.probe(refresh=True, arch=arch)
    yield arch, calls, caps
    monkeypatch.delitem(sys.modules, "deep_gemm")
    backends.probe(refresh=True)


def _weights(n, k, block):
    w = (torch.randn(n, k) * 32).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-12, -6, (cdiv(n, block), cdiv(k, block))).float())
    return w, scale


def _activation(m, k):
    x = torch.randn(m, k) * torch.exp2(torch.randint(-4, 4, (m, 1)).float())
    if m >= 3:
        x[1] = 0
    return x.bfloat16()


# ------------------------------------------------------------------------------------------
# DeepGEMM contract
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fake_deep_gemm", [(9, 0)], indirect=True)
@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_deep_gemm_sm90_contract(fake_deep_gemm, m):
    arch, calls, caps = fake_deep_gemm
    assert caps.deep_gemm, caps.deep_gemm_reason  # the probe's tiny call (g128) ran on the fake
    fmt, block = G128, 128
    n, k = 96, 256
    backend = backends.select_backend(fmt, block, n, k)
    assert backend.name == "deep_gemm"
    w, s = _weights(n, k, block)
    derived = backend.derive_weight_tensors(w, s, block)
    assert derived == {}
    pair = ref.quantize(_activation(m, k), fmt)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    got = backend.gemm(pair, w, s, derived, out=out)
    assert got is out and calls[-1]["recipe"] == (1, block, block)
    want = ref.fp8_gemm(pair, w, s, block)
    assert ((got.double() - want).norm() / want.norm()) < 5e-3


@pytest.mark.parametrize("fake_deep_gemm", [(10, 0)], indirect=True)
@pytest.mark.parametrize("m", [1, 5, 12])
def test_deep_gemm_sm100_packed_contract(fake_deep_gemm, m):
    arch, calls, caps = fake_deep_gemm
    assert caps.deep_gemm, caps.deep_gemm_reason
    assert backends.input_format_for(32, arch) is PACKED
    n, k = 70, 384  # N not a multiple of 4: the packed weight scales' column stride is align4(N)
    backend = backends.select_backend(PACKED, 32, n, k)
    assert backend.name == "deep_gemm"
    w, s = _weights(n, k, 32)
    derived = backend.derive_weight_tensors(w, s, 32)
    packed = derived["weight_scale_inv_deepgemm"]
    assert torch.equal(packed, ref.pack_weight_scale_for_deepgemm(s, n, k))
    assert packed.stride() == (1, align4(n))
    pair = ref.quantize(_activation(m, k), PACKED)
    got = backend.gemm(pair, w, s, derived)
    assert calls[-1]["recipe"] == (1, 1, 32) and calls[-1]["disable_ue8m0_cast"] is True
    want = ref.fp8_gemm(pair, w, s, 32)
    assert ((got.double() - want).norm() / want.norm()) < 5e-3


@pytest.mark.parametrize("fake_deep_gemm", [(10, 0)], indirect=True)
def test_deep_gemm_packed_weight_scales_get_their_layout_back(fake_deep_gemm, caplog):
    """N % 4 != 0: the layer's packed weight scales are a padded view (column stride align4(N)),
    which a deepcopy of the layer makes dense (so does moving it to another device). The backend then refuses them by name before DeepGEMM
    would, and the next ``process_weights_after_loading`` rebinds them in the padded layout (an
    in-place copy would keep the dense strides)."""
    _, calls, _ = fake_deep_gemm
    n, k, m = 70, 384, 3
    w, s = _weights(n, k, 32)
    layer = ReplicatedLinear(k, n, quant_config=Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0"))
    layer.deepgemm_mxfp8_input = True
    load_weights(layer, [("weight", w), ("weight_scale_inv", s)])
    assert layer.gemm_backend.name == "deep_gemm" and layer.input_format is PACKED
    assert layer.weight_scale_inv_deepgemm.stride() == (1, align4(n))
    pair = ref.quantize(_activation(m, k), PACKED)
    want = layer(pair)
    copied = copy.deepcopy(layer)
    assert copied.weight_scale_inv_deepgemm.stride() != (1, align4(n))  # the premise
    with pytest.raises(ValueError, match=r"weight_scale_inv_deepgemm has strides .*process_weights_after_loading"):
        copied(pair)
    with caplog.at_level(logging.WARNING):
        copied.quant_method.process_weights_after_loading(copied)
    assert "rebinding storage" in caplog.text
    assert copied.weight_scale_inv_deepgemm.stride() == (1, align4(n))
    assert torch.equal(copied(pair), want) and calls[-1]["n"] == n


@pytest.mark.parametrize("fake_deep_gemm", [(9, 0)], indirect=True)
def test_deep_gemm_relays_out_scales_of_a_captured_buffer(fake_deep_gemm):
    """A row slice of a pair captured for more rows has scale column stride > align4(M); the
    backend hands DeepGEMM the exact layout (scales copied, FP8 data untouched)."""
    _, calls, _ = fake_deep_gemm
    n, k = 64, 256
    w, s = _weights(n, k, 128)
    pair = ref.quantize(_activation(9, k), G128).rows(5)
    assert pair.scale.stride(1) == 12
    got = backends.get_backend("deep_gemm").gemm(pair, w, s, {})
    assert calls[-1]["recipe"] == (1, 128, 128)
    want = ref.fp8_gemm(pair, w, s, 128)
    assert ((got.double() - want).norm() / want.norm()) < 5e-3


@pytest.mark.parametrize("fake_deep_gemm", [(9, 0), (10, 0)], indirect=True)
def test_deep_gemm_hands_tma_16_byte_aligned_activations(fake_deep_gemm):
    """A pair whose data or scales start off a 16-byte boundary (views into a larger buffer at an
    odd offset) is copied to aligned storage before DeepGEMM's TMA reads it."""
    arch, calls, _ = fake_deep_gemm
    m, n, k = 3, 64, 256
    fmt, block = (G128, 128) if arch[0] == 9 else (PACKED, 32)
    w, s = _weights(n, k, block)
    backend = backends.get_backend("deep_gemm")
    derived = backend.derive_weight_tensors(w, s, block)
    pair = ref.quantize(_activation(m, k), fmt)
    data = torch.empty(m * k + 4, dtype=torch.uint8)[4:].view(torch.float8_e4m3fn).view(m, k)
    data.copy_(pair.data)
    word = pair.scale.element_size()
    scale_store = torch.zeros(pair.scale.shape[1] * 4 + 1, dtype=pair.scale.dtype)[1:]
    scale = scale_store.as_strided(pair.scale.shape, (1, 4))
    scale.copy_(pair.scale)
    assert data.data_ptr() % 16 and scale.data_ptr() % 16 and word == 4
    out = torch.empty(m * n + 1, dtype=torch.bfloat16)[1:].view(m, n)  # 2 bytes off
    got = backend.gemm(pair._replace(data=data, scale=scale), w, s, derived, out=out)
    assert got is out and torch.equal(got, backend.gemm(pair, w, s, derived))


@pytest.mark.parametrize("fake_deep_gemm", [(9, 0)], indirect=True)
def test_deep_gemm_refuses_an_out_it_would_write_wrongly(fake_deep_gemm):
    """DeepGEMM writes ``out`` through its pointer: a strided, expanded or overlapping buffer is
    refused before the call (the Triton backend's checks)."""
    _, calls, _ = fake_deep_gemm
    m, n, k = 4, 64, 256
    w, s = _weights(n, k, 128)
    pair = ref.quantize(_activation(m, k), G128)
    backend = backends.get_backend("deep_gemm")
    before = len(calls)
    with pytest.raises(ValueError, match="unit column stride"):
        backend.gemm(pair, w, s, {}, out=torch.empty(n, m, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="one location per element"):
        backend.gemm(pair, w, s, {}, out=torch.empty(1, n, dtype=torch.bfloat16).expand(m, n))
    shared = torch.empty(pair.data.numel() * 2, dtype=torch.uint8)
    a = pair._replace(data=shared[:pair.data.numel()].view(torch.float8_e4m3fn).view(m, k))
    a.data.copy_(pair.data)
    with pytest.raises(ValueError, match="overlaps"):
        backend.gemm(a, w, s, {}, out=shared.view(torch.bfloat16)[:m * n].view(m, n))
    assert len(calls) == before


@pytest.mark.parametrize("fake_deep_gemm", [(9, 0), (10, 0)], indirect=True)
def test_deep_gemm_refuses_other_formats_and_strided_weights_before_the_call(fake_deep_gemm):
    """Called directly (not through ``select_backend``), the backend still refuses a pair in a
    format DeepGEMM does not read on this arch (TypeError naming both) and a weight its TMA
    cannot read (ValueError), and wrong dtypes of the weight scales or ``out`` as TypeError."""
    arch, calls, _ = fake_deep_gemm
    m, n, k = 3, 64, 256
    fmt, block = (G128, 128) if arch[0] == 9 else (PACKED, 32)
    backend = backends.get_backend("deep_gemm")
    w, s = _weights(n, k, block)
    derived = backend.derive_weight_tensors(w, s, block)
    before = len(calls)
    for other in (f for f in (G32, G128, PACKED) if f is not fmt):
        with pytest.raises(TypeError, match=f"reads {fmt.value}, got {other.value}"):
            backend.gemm(ref.quantize(_activation(m, k), other), w, s, derived)
    pair = ref.quantize(_activation(m, k), fmt)
    padded_rows = torch.zeros(n, k + 128, dtype=torch.float8_e4m3fn)[:, :k]
    padded_rows.copy_(w)
    with pytest.raises(ValueError, match="weight must be K-major contiguous"):
        backend.gemm(pair, padded_rows, s, derived)
    with pytest.raises(TypeError, match="weight_scale must be float32"):
        backend.gemm(pair, w, s.double(), derived)
    with pytest.raises(TypeError, match="out must be bfloat16"):
        backend.gemm(pair, w, s, derived, out=torch.empty(m, n))
    assert len(calls) == before
    backend.gemm(pair, w, s, derived)  # the pair and weight it reads go through
    assert len(calls) == before + 1


@pytest.mark.parametrize("fake_deep_gemm", [(9, 0)], indirect=True)
def test_fake_catches_k_major_scales(fake_deep_gemm):
    """The fake is not a rubber stamp: K-major activation scales (the common mistake) fail."""
    n, k, m = 64, 256, 8
    w, s = _weights(n, k, 128)
    pair = ref.quantize(_activation(m, k), G128)
    k_major = pair.scale.contiguous()  # [M, K/128] row-major: strides (K/128, 1)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    import deep_gemm

    with pytest.raises(ContractError, match="sfa strides"):
        deep_gemm.fp8_gemm_nt((pair.data, k_major), (w, s), d, recipe=(1, 128, 128))
    with pytest.raises(ContractError, match="recipe"):  # no 32-column fp32 scales on SM90
        deep_gemm.fp8_gemm_nt((pair.data, pair.scale), (w, s), d, recipe=(1, 32, 32))
    g32 = ref.quantize(_activation(m, k), G32)
    with pytest.raises(ContractError, match="sfa shape"):  # g32 scales under the 128 recipe
        deep_gemm.fp8_gemm_nt((g32.data, g32.scale), (w, s), d, recipe=(1, 128, 128))
    with pytest.raises(ContractError, match="d must be"):
        deep_gemm.fp8_gemm_nt((pair.data, pair.scale), (w, s), d.float(), recipe=(1, 128, 128))
    deep_gemm.fp8_gemm_nt((pair.data, pair.scale), (w, s), d, recipe=(1, 128, 128))  # the right call passes


@pytest.mark.parametrize("fake_deep_gemm", [(10, 0)], indirect=True)
def test_fake_catches_missing_ue8m0_flag_and_raw_weight_scales(fake_deep_gemm):
    n, k, m = 64, 256, 4
    w, s = _weights(n, k, 32)
    pair = ref.quantize(_activation(m, k), PACKED)
    packed_w = ref.pack_weight_scale_for_deepgemm(s, n, k)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    import deep_gemm

    with pytest.raises(ContractError, match="disable_ue8m0_cast"):
        deep_gemm.fp8_gemm_nt((pair.data, pair.scale), (w, packed_w), d, recipe=(1, 1, 32))
    with pytest.raises(ContractError, match="sfb"):
        deep_gemm.fp8_gemm_nt((pair.data, pair.scale), (w, s), d, recipe=(1, 1, 32), disable_ue8m0_cast=True)
    with pytest.raises(ValueError, match="weight_scale_inv_deepgemm"):
        backends.get_backend("deep_gemm").gemm(pair, w, s, {})
    stale = {"weight_scale_inv_deepgemm": ref.pack_weight_scale_for_deepgemm(*_weights(2 * n, k, 32)[1:], 2 * n, k)}
    with pytest.raises(ValueError, match=r"must be int32 \(64, 2\) for this weight, got torch.int32 \(128, 2\)"):
        backends.get_backend("deep_gemm").gemm(pair, w, s, stale)


@pytest.mark.parametrize("fake_deep_gemm", [(9, 0)], indirect=True)
def test_probe_rejects_a_deep_gemm_that_computes_wrong(fake_deep_gemm, monkeypatch):
    def wrong(a, b, d, **kwargs):
        d.zero_()

    monkeypatch.setattr(sys.modules["deep_gemm"], "fp8_gemm_nt", wrong)
    caps = backends.probe(refresh=True, arch=(9, 0))
    assert not caps.deep_gemm and "wrong" in caps.deep_gemm_reason


def test_probe_reports_broken_import(monkeypatch):
    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise OSError("undefined symbol: _ZN3c10 (ABI mismatch)")

    monkeypatch.setitem(sys.modules, "deep_gemm", Broken("deep_gemm"))
    try:
        caps = backends.probe(refresh=True, arch=(9, 0))
        assert not caps.deep_gemm and "ABI mismatch" in caps.deep_gemm_reason
    finally:
        monkeypatch.delitem(sys.modules, "deep_gemm")
        backends.probe(refresh=True)


# ------------------------------------------------------------------------------------------
# Selection
# ------------------------------------------------------------------------------------------

def test_select_without_deep_gemm_picks_triton_and_logs_reasons(caplog, monkeypatch):
    monkeypatch.delitem(sys.modules, "deep_gemm", raising=False)
    backends.probe(refresh=True)
    with caplog.at_level(logging.INFO, logger="fp8chain.backends"):
        chosen = backends.select_backend(G32, 32, 1792, 5120)
    assert chosen.name == "triton" and chosen is backends.get_backend("triton")
    text = caplog.text
    assert "triton" in text and "deep_gemm rejected" in text


@pytest.mark.parametrize("fake_deep_gemm", [(10, 0)], indirect=True)
def test_a_layer_deep_gemm_cannot_serve_on_blackwell_reads_the_triton_format(fake_deep_gemm, caplog):
    """On Blackwell the producers' format is DeepGEMM's packed UE8M0, which only DeepGEMM reads; a
    layer whose K DeepGEMM refuses (DSv4.1's TP4 shared down, K = 576) takes the format the Triton
    GEMM reads instead of the torch fallback, and publishes it; a configured triton backend too."""
    _, calls, _ = fake_deep_gemm
    n, k, m = 256, 576, 3
    w, s = _weights(n, k, 32)
    for backend in (None, "triton"):
        config = Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0", backend=backend)
        layer = ReplicatedLinear(k, n, quant_config=config)
        layer.deepgemm_mxfp8_input = True
        with caplog.at_level(logging.WARNING):
            load_weights(layer, [("weight", w), ("weight_scale_inv", s)])
        assert "torch fallback" not in caplog.text
        assert layer.gemm_backend.name == "triton" and layer.input_format is G32 and layer.act_format is G32
        pair = ref.quantize(_activation(m, k), G32)
        want = ref.fp8_gemm(pair, w, s, 32)
        got = layer(pair)
        assert ((got.double() - want).norm() / want.norm()) < 5e-3
    wide = ReplicatedLinear(512, n, quant_config=Fp8Config(weight_block_size=(32, 32), scale_fmt="ue8m0"))
    wide.deepgemm_mxfp8_input = True
    load_weights(wide, [("weight", _weights(n, 512, 32)[0]), ("weight_scale_inv", _weights(n, 512, 32)[1])])
    assert wide.gemm_backend.name == "deep_gemm" and wide.input_format is PACKED  # K % 128 == 0: DeepGEMM's


@pytest.mark.parametrize("fake_deep_gemm", [(9, 0)], indirect=True)
def test_select_prefers_deep_gemm_then_triton(fake_deep_gemm, caplog):
    _, _, caps = fake_deep_gemm
    assert caps.deep_gemm, caps.deep_gemm_reason  # probed in the format it reads on SM90 (g128)
    assert backends.select_backend(G128, 128, 1792, 5120).name == "deep_gemm"
    assert backends.select_backend(G128, 128, 1792, 5120, prefer="triton").name == "triton"
    # DSv4.1's 32x32 blocks: DeepGEMM has no SM90 layout for fp32 scales in 32-column groups
    with caplog.at_level(logging.INFO, logger="fp8chain.backends"):
        assert backends.select_backend(G32, 32, 1792, 5120).name == "triton"
    assert "on sm90 it does not read sm90_g32_fp32_mn" in caplog.text
    # K not a multiple of 128 (nor of the 128-column group Triton reads): the error names each reason
    assert backends.select_backend(G128, 128, 256, 384).name == "deep_gemm"
    with pytest.raises(ValueError, match="deep_gemm: K=320 is not a multiple of 128; triton: K=320"):
        backends.select_backend(G128, 128, 256, 320)


def test_blockwise_refuses_other_formats_where_it_runs(monkeypatch):
    """Where cuBLAS blockwise serves (probed working), it still refuses a format or block it does not
    read, and the shapes its scale layout cannot take."""
    import dataclasses

    working = dataclasses.replace(backends.probe(), scaled_mm_blockwise=True, scaled_mm_reason="")
    monkeypatch.setattr(backends, "probe", lambda *args, **kwargs: working)
    blockwise = backends.get_backend("torch_blockwise")
    assert "sm90_g128_fp32_mn with 128x128" in blockwise.rejection(G32, 32, 1792, 5120)
    assert "sm90_g128_fp32_mn with 128x128" in blockwise.rejection(G128, 32, 1792, 5120)
    assert "N % 16 == 0" in blockwise.rejection(G128, 128, 1800, 5120)
    assert blockwise.rejection(G128, 128, 1792, 5120) is None


def test_select_rejections_and_errors():
    triton_backend = backends.get_backend("triton")
    assert triton_backend.rejection(G32, 32, 1792, 5120) is None
    assert triton_backend.rejection(G128, 128, 32768, 1280) is None
    assert "reads sm90_g32_fp32_mn" in triton_backend.rejection(G128, 32, 1792, 5120)
    assert "reads sm90_g32_fp32_mn" in triton_backend.rejection(PACKED, 32, 1792, 5120)
    assert "multiple of the 128-column group" in triton_backend.rejection(G128, 128, 256, 320)
    blockwise = backends.get_backend("torch_blockwise")
    if not backends.probe().scaled_mm_blockwise:
        assert blockwise.rejection(G128, 128, 1792, 5120) == backends.probe().scaled_mm_reason
    with pytest.raises(ValueError, match="torch_blockwise"):
        backends.select_backend(G32, 32, 1792, 5120, prefer="torch_blockwise")
    with pytest.raises(ValueError, match="no GEMM backend can serve"):
        backends.select_backend(PACKED, 32, 1792, 5120)
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        backends.get_backend("cutlass")
    assert backends.backend_names() == ["deep_gemm", "triton", "torch_blockwise"]


def test_input_format_for():
    assert backends.input_format_for(32, (9, 0)) is G32
    # Blackwell without DeepGEMM (this process): the Triton GEMM's format, not one nothing reads
    assert not backends.probe().deep_gemm and backends.input_format_for(32, (10, 0)) is G32
    assert backends.input_format_for(128, (9, 0)) is G128
    assert backends.input_format_for(128, (10, 0)) is G128
    with pytest.raises(ValueError):
        backends.input_format_for(64, (9, 0))


def test_triton_backend_gemm_matches_reference(device):
    n, k, m = 128, 256, 3
    w, s = (t.to(device) for t in _weights(n, k, 32))
    pair = ref.quantize(_activation(m, k).to(device), G32)
    backend = backends.get_backend("triton")
    got = backend.gemm(pair, w, s, backend.derive_weight_tensors(w, s, 32))
    want = ref.fp8_gemm(pair, w, s, 32)
    assert ((got.double() - want).norm() / want.norm()) < 5e-3


def test_torch_blockwise_derived_scale_layout():
    """The padded 128x128 weight-scale buffer cuBLAS reads: [N/128, round_up(K/128, 4)], zero tail."""
    n, k = 256, 1280  # K/128 = 10 -> padded to 12
    w, s = _weights(n, k, 128)
    padded = backends.get_backend("torch_blockwise").derive_weight_tensors(w, s, 128)["weight_scale_blockwise"]
    assert padded.shape == (2, 12) and padded.is_contiguous()
    assert torch.equal(padded[:, :10], s) and not padded[:, 10:].any()


def _fake_scaled_mm(calls):
    """torch 2.11's checks for 1x128 x 128x128 blockwise ``_scaled_mm`` (scale_a strides exactly
    (1, M); scale_b.t() the contiguous [N/128, K/128] tensor), computed with the reference."""

    def scaled_mm(a, b, scale_a, scale_b, out_dtype=None):
        m, k = a.shape
        n = b.shape[1]
        assert a.dtype == torch.float8_e4m3fn and a.is_contiguous() and m % 4 == 0, (a.stride(), m)
        assert a.data_ptr() % 16 == 0 and scale_a.data_ptr() % 16 == 0, "operands must be 16-byte aligned"
        assert b.stride() == (1, k), f"mat_b must be column-major, strides {b.stride()}"
        assert tuple(scale_a.shape) == (m, cdiv(k, 128)) and scale_a.stride() == (1, m), scale_a.stride()
        sbt = scale_b.t()
        assert tuple(sbt.shape) == (cdiv(n, 128), cdiv(k, 128)) and sbt.stride() == (cdiv(k, 128), 1)
        calls.append(m)
        a_val = a.float() * scale_a.repeat_interleave(128, 1)[:, :k]
        w_val = ref.dequantize_weight(b.t(), sbt, 128)
        return (a_val.double() @ w_val.double().t()).to(out_dtype)

    return scaled_mm


def test_torch_blockwise_calibrates_before_its_first_gemm_when_probe_did_not(monkeypatch):
    """A layout torch accepts may still be read with another stride (torch 2.11 at K/128 % 4 != 0),
    so a GEMM before any calibration calibrates rather than trying layouts until one is accepted."""
    calls, calibrated = [], []
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(calls), raising=False)
    backend = backends.get_backend("torch_blockwise")
    monkeypatch.setattr(type(backend), "_scale_b_view", {})

    def calibrate(self, device):
        calibrated.append(device)
        type(self)._scale_b_view = {True: "contig", False: None}
        return ""

    monkeypatch.setattr(type(backend), "calibrate", calibrate)
    n, k = 256, 640  # K/128 = 5
    w, s = _weights(n, k, 128)
    pair = ref.quantize(_activation(4, k), G128)
    with pytest.raises(ValueError, match="no working 128x128 scale layout for K/128 = 5"):
        backend.gemm(pair, w, s, backend.derive_weight_tensors(w, s, 128))
    assert calibrated == [w.device] and calls == []  # the fake would have accepted "contig"


@pytest.mark.parametrize("m", [1, 3, 4, 6])
def test_torch_blockwise_prepares_arguments_like_torch_checks(monkeypatch, m):
    """M padded to a multiple of 4, MN-major scales with stride exactly M, sliced pairs re-laid
    out, output rows past M dropped; against a stand-in with torch 2.11's argument checks."""
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(calls), raising=False)
    backend = backends.get_backend("torch_blockwise")
    monkeypatch.setattr(type(backend), "_scale_b_view", {True: "contig", False: None})
    n, k = 256, 512
    w, s = _weights(n, k, 128)
    big = ref.quantize(_activation(m + 5, k), G128)
    pair = ref.quantize(_activation(m, k), G128)
    data = torch.empty(m * k + 4, dtype=torch.uint8)[4:].view(torch.float8_e4m3fn).view(m, k)
    data.copy_(pair.data)
    scale = torch.zeros(pair.scale.shape[1] * align4(m) + 1)[1:].as_strided(pair.scale.shape, (1, align4(m)))
    scale.copy_(pair.scale)
    assert data.data_ptr() % 16 and scale.data_ptr() % 16
    for pair in (pair, big.rows(m), pair._replace(data=data, scale=scale)):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        got = backend.gemm(pair, w, s, backend.derive_weight_tensors(w, s, 128), out=out)
        assert got is out and calls[-1] == -(-m // 4) * 4
        want = ref.fp8_gemm(pair, w, s, 128)
        assert ((got.double() - want).norm() / want.norm()) < 5e-3
    with pytest.raises(ValueError, match="no working 128x128 scale layout"):
        backend.gemm(ref.quantize(_activation(m, 640), G128), *_weights(n, 640, 128), {})


def test_operands_of_different_k_are_refused_by_name():
    weight, scale = ref.random_fp8_weight(128, 256, 128)
    pair = ref.quantize(torch.randn(4, 128).bfloat16(), G128)
    with pytest.raises(ValueError, match="activation has K=128, weight has K=256"):
        backends._check_operands(pair, weight, scale, 128, None)


def test_probe_rejects_a_deep_gemm_that_writes_nan(monkeypatch):
    """A DeepGEMM whose probe GEMM writes NaN is not used (NaN > tolerance is False: the check must
    ask for finite output first)."""
    def writes_nan(a, b, d, **kwargs):
        d.fill_(float("nan"))

    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(fp8_gemm_nt=writes_nan))
    try:
        assert not backends.probe(refresh=True, arch=(9, 0)).deep_gemm
    finally:
        monkeypatch.delitem(sys.modules, "deep_gemm")
        backends.probe(refresh=True)


def test_blockwise_rejects_the_k_classes_its_calibration_found_broken(monkeypatch):
    """cuBLAS blockwise at K / 128 classes whose scale layout calibration found none for: refused at
    load (not at the first GEMM, possibly inside graph capture)."""
    import dataclasses

    working = dataclasses.replace(backends.probe(), scaled_mm_blockwise=True, scaled_mm_reason="")
    monkeypatch.setattr(backends, "probe", lambda *a, **k: working)
    blockwise = backends.get_backend("torch_blockwise")
    monkeypatch.setattr(type(blockwise), "_scale_b_view", {True: "contig", False: None})
    assert blockwise.rejection(G128, 128, 256, 512) is None
    assert "K/128 = 5" in blockwise.rejection(G128, 128, 256, 640)


@pytest.mark.parametrize("arch,serves", [((8, 9), True), ((9, 0), True), ((8, 6), False)])
def test_triton_serves_from_ada_on(monkeypatch, arch, serves):
    import dataclasses

    caps = dataclasses.replace(backends.probe(), cuda=True, arch=arch)
    monkeypatch.setattr(backends, "probe", lambda *a, **k: caps)
    assert (backends.get_backend("triton").rejection(G32, 32, 1792, 5120) is None) is serves


def test_triton_refuses_without_a_device_or_interpreter_and_empty_weights(monkeypatch):
    """No CUDA device and no TRITON_INTERPRET: nothing runs the kernels; an empty weight (N or K
    zero, whose K passes the group check) is refused by name too. 128x128 blocks take any scales,
    32x32 ones power-of-two scales only."""
    import dataclasses

    triton_backend = backends.get_backend("triton")
    bare = dataclasses.replace(backends.probe(), cuda=False, arch=None, triton_interpreter=False)
    monkeypatch.setattr(backends, "probe", lambda *a, **k: bare)
    assert "no CUDA device and TRITON_INTERPRET is not set" in triton_backend.rejection(G32, 32, 1792, 5120)
    interpreting = dataclasses.replace(bare, triton_interpreter=True)
    monkeypatch.setattr(backends, "probe", lambda *a, **k: interpreting)
    assert triton_backend.rejection(G32, 32, 1792, 5120) is None
    assert "empty weight 0x5120" in triton_backend.rejection(G32, 32, 0, 5120)
    assert "empty weight 256x0" in triton_backend.rejection(G128, 128, 256, 0)
    w, s = _weights(256, 512, 128)
    assert triton_backend.derive_weight_tensors(w, s * 3, 128) == {}  # not powers of two: fine at g128
    w32, s32 = _weights(256, 512, 32)
    with pytest.raises(ValueError, match="power-of-two"):
        triton_backend.derive_weight_tensors(w32, s32 * 3, 32)


def _torch_scaled_mm_reading(padded_stride: bool):
    """Blockwise ``_scaled_mm`` of two torch versions: torch 2.11 (``padded_stride`` False) accepts
    only ``scale_b.t()`` the contiguous [N/128, K/128] tensor, yet cuBLAS reads its rows with the
    stride L4 = round_up(K/128, 4) (wrong at K/128 % 4 != 0); a torch that checks for cuBLAS's
    layout (True) accepts only [N/128, K/128] with row stride L4 and computes right."""

    def scaled_mm(a, b, scale_a, scale_b, out_dtype=None):
        m, k = a.shape
        sbt = scale_b.t()
        nb, kb = cdiv(b.shape[1], 128), cdiv(k, 128)
        l4 = align4(kb)
        if tuple(sbt.shape) != (nb, kb) or sbt.stride() != ((l4, 1) if padded_stride else (kb, 1)):
            raise RuntimeError(f"scale_b layout {tuple(sbt.shape)} {sbt.stride()} not accepted")
        flat = sbt.as_strided((sbt.untyped_storage().nbytes() // 4 - sbt.storage_offset(),), (1,))
        index = torch.arange(nb)[:, None] * l4 + torch.arange(kb)[None, :]  # the rows cuBLAS reads
        read = torch.where(index < flat.numel(), flat[index.clamp(max=flat.numel() - 1)], torch.zeros(()))
        a_val = a.float() * scale_a.repeat_interleave(128, 1)[:, :k]
        return (a_val.double() @ ref.dequantize_weight(b.t(), read, 128).double().t()).to(out_dtype)

    return scaled_mm


@pytest.mark.parametrize("padded_stride,views", [(False, {True: "contig", False: None}),
                                                 (True, {True: "contig", False: "exact"})])
def test_torch_blockwise_calibration_keeps_only_layouts_that_compute_right(monkeypatch, padded_stride, views):
    """``calibrate`` on the CPU against two torch behaviours: torch 2.11 accepts the contiguous
    layout at K/128 = 5 too but cuBLAS reads it wrongly there, so that class gets no layout (and
    is refused); a torch that checks cuBLAS's padded stride gets the exact view at K/128 = 5 (at
    K/128 = 4 the contiguous layout is that same layout).
    A torch that computes wrongly at every layout is reported, with the reason."""
    import dataclasses

    backend = backends.get_backend("torch_blockwise")
    monkeypatch.setattr(type(backend), "_scale_b_view", {})
    monkeypatch.setattr(torch, "_scaled_mm", _torch_scaled_mm_reading(padded_stride), raising=False)
    assert backend.calibrate(torch.device("cpu")) == ""
    assert type(backend)._scale_b_view == views
    working = dataclasses.replace(backends.probe(), scaled_mm_blockwise=True, scaled_mm_reason="")
    monkeypatch.setattr(backends, "probe", lambda *a, **k: working)
    assert backend.rejection(G128, 128, 256, 512) is None
    assert (backend.rejection(G128, 128, 256, 640) is None) is (views[False] is not None)
    zero = lambda a, b, scale_a, scale_b, out_dtype=None: torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)  # noqa: E731
    monkeypatch.setattr(torch, "_scaled_mm", zero, raising=False)
    assert "did not compute right" in backend.calibrate(torch.device("cpu"))
    assert type(backend)._scale_b_view == {True: None, False: None}


def test_torch_blockwise_operands_refuse_a_pair_of_another_format(monkeypatch):
    """The benchmark times ``_scaled_mm`` on ``scaled_mm_operands`` directly: a g32 pair (scales
    per 32 columns) is refused there by name, not handed to cuBLAS as 1x128 scales."""
    backend = backends.get_backend("torch_blockwise")
    monkeypatch.setattr(type(backend), "_scale_b_view", {True: "contig", False: None})
    w, s = _weights(256, 512, 128)
    g32 = ref.quantize(_activation(4, 512), G32)
    for call in (backend.scaled_mm_operands, backend.gemm):
        with pytest.raises(TypeError, match="torch_blockwise reads sm90_g128_fp32_mn, got a pair in sm90_g32_fp32_mn"):
            call(g32, w, s, backend.derive_weight_tensors(w, s, 128))


@pytest.mark.parametrize("fake_deep_gemm", [(9, 0)], indirect=True)
def test_deep_gemm_refuses_another_block_and_hands_contiguous_weight_scales(fake_deep_gemm):
    """On SM90 DeepGEMM reads g128 pairs with 128x128 weight blocks: the format alone does not
    make it serve 32x32 blocks. Weight scales held as a transposed view (any strides torch allows)
    reach DeepGEMM contiguous, as its sfb is read."""
    _, calls, _ = fake_deep_gemm
    backend = backends.get_backend("deep_gemm")
    assert "does not read sm90_g128_fp32_mn with 32x32 blocks" in backend.rejection(G128, 32, 256, 512)
    n, k, m = 256, 512, 3
    w, s = _weights(n, k, 128)
    strided = s.t().contiguous().t()
    assert not strided.is_contiguous() and torch.equal(strided, s)
    pair = ref.quantize(_activation(m, k), G128)
    assert torch.equal(backend.gemm(pair, w, strided, {}), backend.gemm(pair, w, s, {}))
