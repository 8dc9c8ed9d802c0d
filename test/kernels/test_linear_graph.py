"""A linear captured in a CUDA graph keeps giving the right answer across weight reloads (GPU).

For each backend / shape / batch size / input path: load checkpoint A, warm up, capture
``layer(static_input)``, then reload A -> B -> A -> B in place; before each replay the graph's
output buffer is poisoned with NaN, and after it the output must equal, bit for bit, an eager
run of a freshly constructed layer loaded with the same checkpoint. Every parameter (loader
targets and derived tensors such as ``weight_scale_blockwise``) must keep its storage.
"""

import pytest
import torch

from fp8chain.layers.linear import ReplicatedLinear
from fp8chain.layers.loading import load_weights
from fp8chain.layers.quantization.fp8 import Fp8Config
from fp8chain.layers.warmup import warmup
from fp8chain_kernel import backends
from fp8chain_kernel.formats import FP8_DTYPE, empty_pair
from fp8chain_kernel.quant import quantize
from helpers import DerivingBackend

pytestmark = pytest.mark.gpu

CAPACITY = 257  # static input buffers are allocated for this many rows and sliced, like a runner


# (N, K, block, backend): DSv4.1 wqkv_a and wo_b (32x32 blocks) on the automatic choice, wqkv_a
# through a backend with a derived tensor, and a 128x128-block shape on Triton and on cuBLAS
# blockwise (which derives its padded scale layout at load).
CASES = [
    pytest.param(1792, 5120, 32, None, id="wqkv_a-auto"),
    pytest.param(1792, 5120, 32, "deriving", id="wqkv_a-deriving"),
    pytest.param(5120, 8192, 32, None, id="wo_b-auto"),
    pytest.param(1536, 1024, 128, "triton", id="g128-triton"),
    pytest.param(1536, 1024, 128, "torch_blockwise", id="g128-torch_blockwise"),
]


def checkpoint(n, k, block, device, pow2):
    blocks = (-(-n // block), -(-k // block))
    if pow2:
        scale = torch.exp2(torch.randint(-10, -5, blocks, device=device).float())
    else:
        scale = torch.rand(blocks, device=device) * 1e-2 + 1e-3
    weight = (torch.randn(n, k, device=device) * 96).clamp(-448, 448).to(FP8_DTYPE)
    return {"weight": weight, "weight_scale_inv": scale}


def storage(layer):
    return {name: (p.data_ptr(), p.stride()) for name, p in layer.named_parameters()}


@pytest.mark.parametrize("path", ["pair", "bf16"])
@pytest.mark.parametrize("rows", [1, 64, 257])
@pytest.mark.parametrize("n,k,block,backend", CASES)
def test_graph_replay_after_reloads_equals_fresh_eager(n, k, block, backend, rows, path, monkeypatch):
    device = torch.device("cuda")
    prefer = None
    if backend == "deriving":
        real = backends.select_backend
        monkeypatch.setattr(backends, "select_backend", lambda fmt, b, n_, k_, prefer=None:
                            DerivingBackend(real(fmt, b, n_, k_, prefer=prefer)))
    elif backend is not None:
        reason = backends.get_backend(backend).rejection(backends.input_format_for(block), block, n, k)
        if reason is not None:
            pytest.skip(f"{backend} unavailable here: {reason}")
        prefer = backend
    pow2 = block == 32
    config = Fp8Config(weight_block_size=(block, block), scale_fmt="ue8m0" if pow2 else None,
                       backend=prefer)

    def make_layer(ckpt):
        layer = ReplicatedLinear(k, n, quant_config=config, prefix="graph_linear", device=device)
        layer.deepgemm_mxfp8_input = True
        load_weights(layer, ckpt.items())
        assert layer.deepgemm_mxfp8_input and layer.input_format is not None
        if backend is not None:
            assert layer.gemm_backend.name == backend
        return layer

    ckpt_a = checkpoint(n, k, block, device, pow2)
    ckpt_b = checkpoint(n, k, block, device, pow2)
    layer = make_layer(ckpt_a)
    fmt = layer.input_format

    # Static input: rows of a CAPACITY-row buffer (a pair keeps the larger scale column stride).
    x = torch.randn(rows, k, device=device).to(torch.bfloat16)
    if rows > 1:
        x[0] = 0  # an all-zero row rides along
    if path == "pair":
        static_in = empty_pair(CAPACITY, k, fmt, device).rows(rows)
        quantize(x, fmt, out=static_in)
    else:
        static_in = torch.empty(CAPACITY, k, dtype=torch.bfloat16, device=device)[:rows]
        static_in.copy_(x)

    warmup(layer, sorted({rows, CAPACITY}))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer(static_in)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_in)
    torch.cuda.synchronize()
    ptrs = storage(layer)
    if backend in ("deriving", "torch_blockwise"):
        assert set(ptrs) - {"weight", "weight_scale_inv"}, "expected a derived tensor"

    outputs = {}
    for step, (tag, ckpt) in enumerate((("A", ckpt_a), ("B", ckpt_b), ("A", ckpt_a), ("B", ckpt_b))):
        if step:
            load_weights(layer, ckpt.items())
        assert storage(layer) == ptrs, f"storage changed after reload {step} ({tag})"
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = make_layer(ckpt)(static_in)
        torch.cuda.synchronize()
        assert static_out.shape == (rows, n)
        assert torch.isfinite(want).all()
        got_bits, want_bits = static_out.view(torch.int16), want.view(torch.int16)
        bad = (got_bits != want_bits).nonzero()
        assert bad.numel() == 0, (f"reload {step} ({tag}): {bad.shape[0]} of {rows * n} outputs "
                                  f"differ from a fresh eager load, first at {bad[:3].tolist()}")
        if rows > 1:
            assert (static_out[0] == 0).all()
        outputs.setdefault(tag, static_out.clone())
    assert not torch.equal(outputs["A"], outputs["B"])
