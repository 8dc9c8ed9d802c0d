"""Checks shared by the suites: bitwise pair equality, NaN-safe error norms, poisoned buffers."""

from __future__ import annotations

import types

import torch

from fp8chain.verify import ROUNDED_FROM_FP32, bf16_ulp_error
from fp8chain_kernel.formats import FP8_DTYPE, ActFormat, QuantizedActivation, empty_pair


def assert_pairs_equal(got: QuantizedActivation, want: QuantizedActivation) -> None:
    """Data bytes and the logical scale view equal bit for bit (NaN payloads included)."""
    assert got.fmt is want.fmt, (got.fmt, want.fmt)
    assert got.data.shape == want.data.shape, (got.data.shape, want.data.shape)
    assert got.scale.shape == want.scale.shape, (got.scale.shape, want.scale.shape)
    gd, wd = got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8).cpu()
    bad = (gd != wd).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} data bytes differ, first at {bad[:5].tolist()}: " \
        f"got {gd[tuple(bad[0])]:#x} want {wd[tuple(bad[0])]:#x}"
    gs = got.scale.cpu().contiguous().view(torch.int32)
    ws = want.scale.cpu().contiguous().view(torch.int32)
    bad = (gs != ws).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} scales differ, first at {bad[:5].tolist()}"


# ``poisoned_pair``'s fill. The data byte is a finite e4m3 code (13.0), not the NaN code a NaN
# input quantizes to, so an unwritten element where the reference holds NaN fails too. Scales: -1
# (fp32; scales are positive) and, packed, exponents 1..4 (below what the 1e-4 amax floor allows;
# all bits set would be four infinite groups).
POISON_DATA_BYTE = 0x55
POISON_FP32_SCALE = -1.0
POISON_PACKED_SCALE = 0x01020304


def poisoned_pair(rows: int, cols: int, fmt, device) -> QuantizedActivation:
    """An out pair filled with values no producer writes where it should (``POISON_*``), so an
    unwritten element cannot pass a comparison."""
    pair = empty_pair(rows, cols, fmt, device)
    pair.data.view(torch.uint8).fill_(POISON_DATA_BYTE)
    pair.scale.fill_(POISON_PACKED_SCALE if ActFormat(fmt).packed else POISON_FP32_SCALE)
    return pair


def row_padded_pair(rows: int, cols: int, fmt, device, pad: int = 64) -> tuple[QuantizedActivation, torch.Tensor]:
    """A ``poisoned_pair`` whose data rows are padded by ``pad`` poison bytes (``data.stride(0) =
    cols + pad``, which ``check_pair`` allows), and the whole data buffer behind it."""
    buf = torch.full((rows, cols + pad), POISON_DATA_BYTE, dtype=torch.uint8, device=device)
    scale = poisoned_pair(rows, cols, fmt, device).scale
    return QuantizedActivation(buf.view(FP8_DTYPE)[:, :cols], scale, ActFormat(fmt)), buf


def assert_padded_pair_equal(got: QuantizedActivation, want: QuantizedActivation, buf: torch.Tensor) -> None:
    """``got`` (a ``row_padded_pair`` over ``buf``) equals ``want`` bit for bit, still at its padded
    row stride, and its padding is still poison."""
    assert got.data.stride(0) == buf.shape[1]
    assert_pairs_equal(got, want)
    assert (buf[:, got.data.shape[1]:] == POISON_DATA_BYTE).all()


def assert_rows_poisoned(pair: QuantizedActivation, first_row: int) -> None:
    """Rows ``first_row..`` of a ``poisoned_pair`` (data and logical scales) are still poison."""
    assert (pair.data[first_row:].view(torch.uint8) == POISON_DATA_BYTE).all()
    poison = POISON_PACKED_SCALE if pair.fmt.packed else POISON_FP32_SCALE
    assert (pair.scale[first_row:] == poison).all()


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The worst row's ``||out_r - ref_r|| / ||ref_r||`` in fp64 (rows: every index but the last),
    so a wrong row of small values cannot hide behind large ones; a row whose reference is all zero
    must be all zero (else inf), and NaN anywhere in either gives inf (never passes)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    out, ref = out.double(), ref.double()
    if not (torch.isfinite(out).all() and torch.isfinite(ref).all()):
        return float("inf")
    if out.numel() == 0:
        return 0.0
    cols = ref.shape[-1] if ref.dim() else 1
    out, ref = out.reshape(-1, cols), ref.reshape(-1, cols)
    err, norm = (out - ref).norm(dim=1), ref.norm(dim=1)
    zero = norm == 0
    if (err[zero] > 0).any():
        return float("inf")
    return (err[~zero] / norm[~zero]).max().item() if (~zero).any() else 0.0


def assert_close_bf16(out: torch.Tensor, ref: torch.Tensor, ulps: float = ROUNDED_FROM_FP32) -> None:
    """Elementwise within ``ulps`` bf16 ulps of ``ref`` (fp32 reference), in the ulp of each
    reference value's own binade (``verify.bf16_ulp_error``); NaN fails."""
    assert torch.isfinite(out).all(), "non-finite values in output"
    worst = bf16_ulp_error(out, ref)
    assert worst <= ulps, f"max error {worst:.3f} bf16 ulps > {ulps}"


def assert_other_rows_unchanged(y, pair, clean_y, clean_pair, changed_row: int) -> None:
    """Rows other than ``changed_row`` equal the clean run's, bf16 output and fp8 bytes."""
    keep = [i for i in range(y.shape[0]) if i != changed_row]
    assert torch.equal(y[keep], clean_y[keep])
    assert torch.equal(pair.data[keep].view(torch.uint8), clean_pair.data[keep].view(torch.uint8))


def assert_captured_rest_untouched(big: QuantizedActivation, big_y: torch.Tensor, rows: int, cols: int) -> None:
    """A producer that wrote ``rows x cols`` into poisoned buffers captured for more rows/columns
    (``poisoned_pair`` and a NaN-filled bf16 buffer) left everything else as it was."""
    assert_rows_poisoned(big, rows)
    assert torch.isnan(big_y[rows:]).all() and torch.isnan(big_y[:rows, cols:]).all()


class DerivingBackend:
    """Wraps a GEMM backend: derives a transposed copy of the weight scales at load and runs the
    GEMM on that copy only, so a derived tensor left stale by a reload shows in the output."""

    name = "deriving"

    def __init__(self, inner):
        self.inner = inner

    def rejection(self, fmt, weight_block, n, k):
        return self.inner.rejection(fmt, weight_block, n, k)

    def derive_weight_tensors(self, weight, weight_scale, weight_block):
        return {"weight_scale_t": weight_scale.t().contiguous().clone()}  # never an alias of the raw scales

    def gemm(self, pair, weight, weight_scale, derived, out=None):
        return self.inner.gemm(pair, weight, derived["weight_scale_t"].t(), {}, out=out)


def decode_errors_vs_reference(reference, prompts, run, new_tokens):
    """Relative L2 error of each decode step's logits against an fp32 reference forward over the
    same tokens, and how many steps agree on the top-1 token: ``(errors tensor, agreements)``."""
    errors, agree = [], 0
    for i, prompt in enumerate(prompts):
        want_all = reference(prompt + run.tokens[i][:-1])
        for step in range(new_tokens):
            got, want = run.logits[step][i].double(), want_all[len(prompt) - 1 + step].double()
            errors.append(((got - want).norm() / want.norm()).item())
            agree += int(got.argmax() == want.argmax())
    return torch.tensor(errors), agree


def assert_unit_chain_on_equals_off(unit) -> None:
    """The layer benchmark's unit (``benchmark/layer.py``, ``LayerUnit``) run once with the chain on
    and once off from the same KV cache: the same residual and next input bit for bit, and the
    chained step's pair equal to the quantization of that input."""
    from fp8chain_kernel import reference

    with torch.no_grad():
        unit.set_chain(True)
        kv_before = unit.kv_cache.clone()
        residual_on, x_on, pair_on = unit.step()
        unit.kv_cache.copy_(kv_before)
        unit.set_chain(False)
        residual_off, x_off, pair_off = unit.step()
    assert torch.isfinite(x_on.float()).all()
    assert torch.equal(residual_on, residual_off) and torch.equal(x_on, x_off)
    assert pair_off is None
    assert_pairs_equal(pair_on, reference.quantize(x_on, unit.layer.attn.wqkv_a.input_format))


def generate_chain_arms(model, prompts, new_tokens: int, max_len: int) -> dict:
    """Greedy generation with the chain on and off (eager steps): ``{chain: (tokens, logits on CPU,
    standalone quantizes counted)}``. First checks that every FP8 linear accepted a pre-quantized
    input: otherwise both arms would quantize in the linears and agree without testing the chain."""
    from fp8chain.runtime.engine import Engine

    refused = [name for name, linear in model.fp8_linears().items() if linear.input_format is None]
    assert not refused, f"these FP8 linears take no producer pair: {refused}"
    engine = Engine(model, max_batch=len(prompts), max_len=max_len)
    counter = model.quantize_counter
    runs = {}
    for chain in (True, False):
        model.set_chain(chain)
        counter.reset()
        counter.enabled = True
        run = engine.generate(prompts, new_tokens, return_logits=True)
        counter.enabled = False
        runs[chain] = (run.tokens, torch.stack(run.logits).cpu(), counter.count)
    model.set_chain(True)
    return runs


def run_ranks(target, world: int, *args) -> None:
    """``target(rank, *args)`` in ``world`` processes joined by a gloo process group (CPU tensors, or
    CUDA tensors of several ranks on one GPU); returns when every rank has ended (a rank's exception
    is raised here). ``target`` must be a module-level function (the processes import it). The ranks
    meet through a file (no port to race for)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as rendezvous:
        mp.spawn(_in_group, args=(target, world, f"file://{rendezvous}/group", args), nprocs=world, join=True)


def _in_group(rank: int, target, world: int, init_method: str, args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    # Every rank's connections are up before any may finish: a rank whose target makes no
    # collective call could otherwise tear the group down while another is still connecting.
    dist.barrier()
    try:
        target(rank, *args)
    finally:
        dist.destroy_process_group()


# ---- stand-ins for SGLang's block-FP8 linear (the plugin's tests) --------------------------------

class UpstreamLinear(torch.nn.Module):
    """What SGLang's block-FP8 method leaves on a linear layer after loading."""

    def __init__(self, weight, scale, request=True, prefix="model.layers.0.self_attn.wq_b"):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(scale, requires_grad=False)
        self.deepgemm_mxfp8_input = request
        self.prefix = prefix


def upstream_method(block=32, scale_fmt=None):
    """SGLang's Fp8LinearMethod as the hooks read it: its config's block size and scale format."""
    return types.SimpleNamespace(quant_config=types.SimpleNamespace(weight_block_size=[block, block],
                                                                    scale_fmt=scale_fmt))


def upstream_process(method, layer):
    """Stands for SGLang 0.5.23's processing off Blackwell: it prepares a requested layer for its
    own packed pairs, which fails there, and sets the flag to that outcome, False."""
    upstream_process.calls = getattr(upstream_process, "calls", 0) + 1
    if layer.deepgemm_mxfp8_input:
        layer.deepgemm_mxfp8_input = False


class TorchWithGpu(types.ModuleType):
    """``torch`` as a benchmark module sees it, but reporting a GPU: lets a benchmark's ``run``
    pass its GPU check on the CPU where the tests replace its timing with fakes."""

    cuda = types.SimpleNamespace(is_available=lambda: True)

    def __getattr__(self, name):
        return getattr(torch, name)

