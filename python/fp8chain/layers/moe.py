"""DSv4.1 MoE pieces: router, FP8 shared expert (a chained producer/consumer pair), and the
routed experts as a torch reference over dequantized MXFP4 weights.

MXFP4 (the routed experts' checkpoint format): e2m1 values, two per byte (element ``2j`` in the
low nibble of byte ``j``, ``2j+1`` in the high nibble; nibble = sign bit 3 + magnitude code
0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6), one UE8M0 scale per 32 consecutive elements along K
(byte ``e`` means ``2^(e-127)``). Value = e2m1 * scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8chain_kernel import act as act_kernels
from fp8chain_kernel import router as router_kernels
from fp8chain_kernel.formats import QuantizedActivation, is_int

from .linear import MergedColumnParallelLinear, RowParallelLinear
from .loading import PACKED_E2M1_DTYPES
from .quantization.fp8 import consumer_gemm_silu_mul

__all__ = [
    "E2M1_VALUES", "MXFP4_GROUP", "MXFP4_PACKED_DTYPES", "MXFP4_LARGEST", "check_mxfp4_scales", "dequantize_mxfp4",
    "quantize_mxfp4", "TopKRouter",
    "SharedExpert", "RoutedExpertsReference", "swiglu_reference",
]

MXFP4_GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
#: the largest MXFP4 value fp32 and bf16 hold: 6 x 2^125 (4 x 2^126 = 2^128 is already inf)
MXFP4_LARGEST = E2M1_MAX * 2.0**125
#: element types packed e2m1 pairs come in (read as their bytes)
MXFP4_PACKED_DTYPES = (torch.uint8, torch.int8) + PACKED_E2M1_DTYPES


def _e2m1_table(device) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])  # code 8..15: sign bit set


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype in (torch.uint8, torch.int8):
        return scale.view(torch.uint8)
    raise TypeError(f"MXFP4 scales must be float8_e8m0fnu or uint8, got {scale.dtype}")


def check_mxfp4_scales(scale: torch.Tensor, name: str = "MXFP4 scales") -> None:
    """UE8M0 scale bytes are 0..254: 255 (UE8M0's NaN) raises ``ValueError`` naming ``name`` and
    the first."""
    sbytes = _scale_bytes(scale)
    nan = sbytes == 255
    if nan.any():  # dequantizing would turn it into 2^128 = inf
        raise ValueError(f"{name} {tuple(sbytes.shape)}: {int(nan.sum())} hold the byte 255 (NaN in UE8M0; "
                         f"scales are bytes 0..254), first at {nan.nonzero()[0].tolist()}")


def check_mxfp4(packed: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    """The checks ``dequantize_mxfp4`` makes, on one checkpoint tensor pair, the errors naming
    ``name``: no scale byte 255, no value past fp32's range (only scale bytes 253 and 254 can
    take one there, so only then is it decoded)."""
    check_mxfp4_scales(scale, f"{name}.scale")
    if bool((_scale_bytes(scale) >= 253).any()):
        try:
            dequantize_mxfp4(packed, scale)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed e2m1 ``[..., N, K/2]`` (``MXFP4_PACKED_DTYPES``) + UE8M0 ``[..., N, K/32]`` ->
    ``[..., N, K]``.

    Every MXFP4 value up to ``MXFP4_LARGEST`` is exact in bf16 and fp32 (3 significant bits times a
    power of two). A scale byte 255 (UE8M0's NaN), or a code times its scale past fp32's range
    (scale bytes 253 and 254 with the larger codes), raises ``ValueError``.
    """
    if packed.dtype not in MXFP4_PACKED_DTYPES:
        raise TypeError(f"packed e2m1 data must be one of {MXFP4_PACKED_DTYPES}, got {packed.dtype}")
    packed = packed.view(torch.uint8)
    k = packed.shape[-1] * 2
    sbytes = _scale_bytes(scale)
    if sbytes.shape[-1] * MXFP4_GROUP != k or sbytes.shape[:-1] != packed.shape[:-1]:
        raise ValueError(f"MXFP4 data {tuple(packed.shape)} needs scales "
                         f"{tuple(packed.shape[:-1]) + (k // MXFP4_GROUP,)}, got {tuple(sbytes.shape)}")
    check_mxfp4_scales(sbytes)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], k)
    values = _e2m1_table(packed.device)[codes.long()]
    # 2^(e-127), exact: the exponent field for bytes 1..254; byte 0 is 2^-127, fp32's subnormal 0x00400000
    pow2 = torch.where(sbytes == 0, 0x00400000, sbytes.to(torch.int32) << 23).view(torch.float32)
    values = values * pow2.repeat_interleave(MXFP4_GROUP, dim=-1)
    overflow = torch.isinf(values)
    if overflow.any():
        raise ValueError(f"MXFP4 data {tuple(packed.shape)}: {int(overflow.sum())} values overflow fp32 (code x "
                         f"2^(scale byte - 127) > {MXFP4_LARGEST:.4g}), first at {overflow.nonzero()[0].tolist()}")
    return values.to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[..., N, K]`` -> (packed uint8 ``[..., N, K/2]``, UE8M0 bytes uint8 ``[..., N, K/32]``).

    Scale per 32: the smallest power of two ``s`` with ``amax / s <= 6``; values rounded to the
    nearest e2m1 (ties to the smaller magnitude). For writing checkpoints. A value that is NaN,
    infinite or beyond ``MXFP4_LARGEST`` raises ``ValueError`` (MXFP4 has no code for it).
    """
    *lead, n, k = w.shape
    if k % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs K % 32 == 0, got K={k}")
    beyond = ~(w.float().abs() <= MXFP4_LARGEST)  # NaN compares False
    if beyond.any():
        raise ValueError(f"MXFP4 holds finite values up to {MXFP4_LARGEST:.4g}: {int(beyond.sum())} of "
                         f"{tuple(w.shape)} are not, first at {beyond.nonzero()[0].tolist()}")
    g = w.float().reshape(*lead, n, k // MXFP4_GROUP, MXFP4_GROUP)
    amax = g.abs().amax(dim=-1).clamp_min(2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-127, 127)
    # fix any log2 rounding at the boundary: ensure amax / 2^e <= 6 and amax / 2^(e-1) > 6
    exponent = torch.where(amax / torch.exp2(exponent) > E2M1_MAX, exponent + 1, exponent)
    exponent = torch.where(amax / torch.exp2(exponent - 1) <= E2M1_MAX, exponent - 1, exponent)
    scaled = g / torch.exp2(exponent).unsqueeze(-1)
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=w.device)
    mids = (mags[1:] + mags[:-1]) / 2
    code = torch.bucketize(scaled.abs(), mids, right=False)  # ties go to the smaller magnitude
    code = code | ((scaled < 0).to(code.dtype) << 3)
    code = code.reshape(*lead, n, k).to(torch.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    scale = (exponent + 127).to(torch.uint8)
    return packed.contiguous(), scale.contiguous()


def swiglu_reference(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """fp32 ``silu(min(gate, limit)) * clamp(up, -limit, limit)`` of ``[T, 2I]`` (the act spec)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter].float(), gate_up[..., inter:].float()
    if limit is not None:
        gate = torch.clamp(gate, max=limit)
        up = torch.clamp(up, min=-limit, max=limit)
    return F.silu(gate) * up


class TopKRouter(nn.Module):
    """bf16 router ``[E, H]``: sqrt-softplus scores of the fp32 logits, top-k (selection adds the
    fp32 correction ``bias``), weights renormalized over the top-k, times ``routed_scaling_factor``:
    ``fp8chain_kernel.router.router_topk``, two launches."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, routed_scaling_factor: float,
                 renormalize: bool = True):
        super().__init__()
        if not (is_int(num_experts) and 1 <= num_experts <= router_kernels.MAX_EXPERTS):
            raise ValueError(f"num_experts must be an int in 1..{router_kernels.MAX_EXPERTS} (the router kernel "
                             f"holds a token's scores in one tile), got {num_experts!r}")
        most = min(num_experts, router_kernels.MAX_TOP_K)
        if not (is_int(top_k) and 1 <= top_k <= most):
            raise ValueError(f"top_k must be an int in 1..{most} (num_experts, and the router kernel's "
                             f"{router_kernels.MAX_TOP_K}), got {top_k!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.routed_scaling_factor = routed_scaling_factor
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=torch.bfloat16),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
        #: set to a list to record every forward's ``topk_idx`` (tests, diagnostics)
        self.record: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` bf16 -> ``(topk_idx int64 [T, k], topk_weights fp32 [T, k])``."""
        idx, weights = router_kernels.router_topk(x, self.weight, self.bias, self.top_k, self.routed_scaling_factor,
                                                  self.renormalize)
        if self.record is not None:
            self.record.append(idx.detach().clone())
        return idx, weights


class SharedExpert(nn.Module):
    """FP8 gate_up (column parallel) -> SiLU*mul producer -> FP8 down (row parallel).

    With ``tp_size > 1`` each rank holds its shard of the gate rows and of the up rows
    (``MergedColumnParallelLinear``), runs SiLU*mul on its shard of the intermediate, and ``down``
    sums the ranks' partial products (all-reduce over ``tp_group``).

    Both linears request a pre-quantized input (``deepgemm_mxfp8_input``). With ``chain`` on,
    the SiLU*mul launch writes ``down``'s FP8 pair itself; off, it writes bf16 and ``down``
    quantizes its own input. Chained, with ``fuse_silu_mul`` (the default) and a gate_up backend
    that has the epilogue (Triton: ``gemm.fp8_gemm_silu_mul``), SiLU*mul and the pair come out of
    the gate_up GEMM itself: one launch fewer, the same bytes.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, swiglu_limit: float | None,
                 quant_config=None, prefix: str = "", tp_rank: int = 0, tp_size: int = 1, tp_group=None):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.swiglu_limit = swiglu_limit
        self.chain = True
        self.gate_up = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False,
                                                  quant_config=quant_config, prefix=f"{prefix}.gate_up",
                                                  tp_rank=tp_rank, tp_size=tp_size)
        self.down = RowParallelLinear(intermediate_size, hidden_size, bias=False,
                                      quant_config=quant_config, prefix=f"{prefix}.down",
                                      tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        self.gate_up.deepgemm_mxfp8_input = True
        self.down.deepgemm_mxfp8_input = True
        self.fuse_silu_mul = True

    def forward(self, x: torch.Tensor, x_pair: QuantizedActivation | None = None) -> torch.Tensor:
        fmt = self.down.input_format if self.chain else None
        if fmt is not None and x_pair is not None and self.fuse_silu_mul:
            h_pair = consumer_gemm_silu_mul(self.gate_up, x_pair, self.swiglu_limit, fmt)
            if h_pair is not None:
                return self.down(h_pair)
        gate_up = self.gate_up(x_pair if (self.chain and x_pair is not None) else x)
        # chained, down is the only reader of SiLU*mul: the pair alone, no bf16 store
        return self.down(act_kernels.silu_mul(gate_up, limit=self.swiglu_limit, out_format=fmt,
                                              return_bf16=fmt is None))


class RoutedExpertsReference(nn.Module):
    """Routed experts over dequantized MXFP4 weights, in torch (the reference the MoE kernels
    replace). Checkpoint tensors live in ``w13_weight/w13_scale/w2_weight/w2_scale`` (gate rows
    first, then up rows); the dequantized bf16 copies are derived at load, in place.

    Each expert's GEMMs run over the whole token block and unrouted tokens get weight 0, so
    the computation has static shapes (CUDA-graph capturable) and each token's result is what
    a grouped (sorted-by-expert) run computes: ``sum_k w_k * down_e(act(gate_up_e(x)))`` with
    fp32 accumulation, the activation taken on the fp32 gate_up and rounded to bf16 (the shared
    expert's path rounds gate_up to bf16 first: a routed-expert kernel written to match this
    reference must not).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 swiglu_limit: float | None):
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.swiglu_limit = swiglu_limit
        u8 = dict(dtype=torch.uint8)
        self.w13_weight = nn.Parameter(torch.zeros(e, 2 * i, h // 2, **u8), requires_grad=False)
        self.w13_scale = nn.Parameter(torch.full((e, 2 * i, h // MXFP4_GROUP), 127, **u8),
                                      requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(e, h, i // 2, **u8), requires_grad=False)
        self.w2_scale = nn.Parameter(torch.full((e, h, i // MXFP4_GROUP), 127, **u8),
                                     requires_grad=False)
        self.register_buffer("w13_dequant", torch.zeros(e, 2 * i, h, dtype=torch.bfloat16),
                             persistent=False)
        self.register_buffer("w2_dequant", torch.zeros(e, h, i, dtype=torch.bfloat16),
                             persistent=False)
        #: why the bf16 copies do not follow the MXFP4 parameters (``invalidate``); None when they do
        self.stale: str | None = None

    def process_weights_after_loading(self) -> None:
        """Derive the bf16 weights into the existing buffers (same storage on every reload), one
        expert at a time: dequantizing all of Flash's 256 experts at once would take ~70 GB of
        int64 codes and fp32 values on the way. A failure (refused scales, out of memory) leaves
        the module refusing to run (``invalidate``) until a processing succeeds."""
        try:
            with torch.no_grad():
                check_mxfp4_scales(self.w13_scale)  # before any write: the error names the expert
                check_mxfp4_scales(self.w2_scale)
                for e in range(self.num_experts):
                    self.w13_dequant[e].copy_(dequantize_mxfp4(self.w13_weight[e], self.w13_scale[e], torch.bfloat16))
                    self.w2_dequant[e].copy_(dequantize_mxfp4(self.w2_weight[e], self.w2_scale[e], torch.bfloat16))
        except BaseException:
            self.invalidate()
            raise
        self.stale = None

    def invalidate(self) -> None:
        """The MXFP4 parameters changed without a successful processing (a load or a processing
        that failed part-way): the bf16 copies are poisoned with NaN and ``forward`` refuses to run
        until ``process_weights_after_loading`` succeeds."""
        self.stale = "routed experts: weights not processed (a load failed part-way?); load the weights again"
        self.w13_dequant.fill_(float("nan"))
        self.w2_dequant.fill_(float("nan"))

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` bf16 -> fp32 ``[T, H]`` (routing weights applied, already scaled);
        ``topk_idx`` and ``topk_weights`` are both ``[T, k]``."""
        if self.stale is not None:
            raise RuntimeError(self.stale)
        t = x.shape[0]
        if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != t or topk_weights.shape != topk_idx.shape:
            # scatter would leave rows without routing at zero, or read only part of the weights
            raise ValueError(f"x [T, H] = {tuple(x.shape)} needs topk_idx and topk_weights both [T, k], got "
                             f"{tuple(topk_idx.shape)} and {tuple(topk_weights.shape)}")
        dense = torch.zeros(t, self.num_experts, dtype=torch.float32, device=x.device)
        dense.scatter_add_(1, topk_idx, topk_weights.float())
        routed = torch.zeros(t, self.num_experts, dtype=torch.bool, device=x.device)
        routed.scatter_(1, topk_idx, True)
        out = torch.zeros(t, self.hidden_size, dtype=torch.float32, device=x.device)
        xf = x.float()
        for e in range(self.num_experts):
            gate_up = xf @ self.w13_dequant[e].float().t()
            h = swiglu_reference(gate_up, self.swiglu_limit).to(torch.bfloat16)
            y = h.float() @ self.w2_dequant[e].float().t()
            out += torch.where(routed[:, e:e + 1], dense[:, e:e + 1] * y, torch.zeros_like(y))
        return out
