"""Consumer backends for FP8 GEMMs that read a ``QuantizedActivation`` as its producer wrote it.

Three kinds, one interface (``GemmBackend``):

* ``triton``: fp8chain's Triton kernel (``fp8chain_kernel.gemm``), both Hopper formats;
* ``torch_blockwise``: cuBLAS blockwise FP8 through ``torch._scaled_mm`` (1x128 activation
  scales, 128x128 weight blocks), Hopper, ``sm90_g128_fp32_mn`` only;
* ``deep_gemm``: DeepGEMM ``fp8_gemm_nt`` when ``deep_gemm`` imports and one tiny call runs
  (users' SGLang stacks; it does not run on fp8chain's own H200, whose torch 2.11 does not match
  the DeepGEMM wheels' ABI, so there its argument contract is tested against a fake module).

``probe()`` finds out once what this process can run; ``select_backend`` picks explicitly and logs
its choice together with every rejected backend and the reason; nothing is chosen silently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..formats import ActFormat, QuantizedActivation, cdiv, check_no_overlap, check_pair, pair_parts
from ..gemm import check_block_scaled
from ..norm import check_rows

__all__ = [
    "Capabilities", "GemmBackend", "probe", "input_format_for", "select_backend", "get_backend",
    "backend_names", "BACKEND_NAMES",
]

logger = logging.getLogger("fp8chain.backends")


@dataclass(frozen=True)
class Capabilities:
    """What this process can run, found once by ``probe()``."""

    cuda: bool
    arch: tuple[int, int] | None  # compute capability of the current CUDA device
    torch_version: str
    triton_interpreter: bool
    deep_gemm: bool  # ``deep_gemm`` imported and one tiny fp8_gemm_nt call ran and was right
    deep_gemm_reason: str  # why not (empty when available)
    scaled_mm_blockwise: bool  # torch._scaled_mm ran 1x128 x 128x128 blockwise calls correctly
    scaled_mm_reason: str


class GemmBackend:
    """One consumer kind. Instances are stateless singletons (``get_backend(name)``)."""

    name: str = ""

    def rejection(self, fmt: ActFormat, weight_block: int, n: int, k: int) -> str | None:
        """Why this backend cannot serve ``fmt`` x (``n x k`` weights in ``weight_block`` blocks),
        or None when it can."""
        raise NotImplementedError

    def derive_weight_tensors(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                              weight_block: int) -> dict[str, torch.Tensor]:
        """Tensors this backend reads besides the checkpoint's weight and scales (their shapes
        depend only on the weight's shape, so a reload can copy into them in place); ``{}`` when
        none."""
        return {}

    def gemm(self, pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
             derived: dict, out: torch.Tensor | None = None) -> torch.Tensor:
        """bf16 ``[M, N]`` = dequant(pair) @ dequant(weight)^T."""
        raise NotImplementedError

    def gemm_silu_mul(self, pair: QuantizedActivation, weight: torch.Tensor, weight_scale: torch.Tensor,
                      derived: dict, limit: float | None, out_format: ActFormat) -> QuantizedActivation | None:
        """The FP8 pair (``out_format``) of ``act.silu_mul(gemm(...), limit=limit)`` for a gate_up
        weight ``[2I, K]``, in one launch, bit for bit what ``gemm`` followed by ``act.silu_mul``
        writes; None where this backend has no such epilogue, or it does not pay for this problem (the
        caller runs the two launches)."""
        return None

    def __repr__(self) -> str:
        return f"<GemmBackend {self.name}>"


def _check_operands(pair, weight, weight_scale, weight_block: int, out) -> tuple[int, int, int]:
    check_pair(pair)
    n, k = check_block_scaled(weight, weight_scale, weight_block)
    m, ka = pair.data.shape
    if ka != k:
        raise ValueError(f"activation has K={ka}, weight has K={k}")
    for name, t in (("weight", weight), ("weight_scale", weight_scale)):
        if t.device != pair.data.device:
            raise ValueError(f"{name} is on {t.device}, the activation on {pair.data.device}")
    if out is not None:
        if out.dtype != torch.bfloat16:
            raise TypeError(f"out must be bfloat16 {(m, n)}, got {out.dtype} {tuple(out.shape)}")
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out must be bfloat16 {(m, n)}, got {out.dtype} {tuple(out.shape)}")
        check_rows(out, "out", (m, n), pair.data.device)  # unit column stride, one location per element
        check_no_overlap([("out", out)], pair_parts(pair, "a") + [("weight", weight), ("weight_scale", weight_scale)])
    return m, n, k


# ----------------------------------------------------------------------------------------------
# Probe
# ----------------------------------------------------------------------------------------------

_CAPS: Capabilities | None = None


def _tiny_problem(device, fmt: ActFormat, weight_block: int, m: int = 4, n: int = 128, k: int = 256):
    from .. import reference

    gen = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    weight = (torch.randn(n, k, generator=gen) * 8).to(torch.float8_e4m3fn).to(device)
    exps = torch.randint(-9, -5, (cdiv(n, weight_block), cdiv(k, weight_block)), generator=gen)
    weight_scale = torch.exp2(exps.float()).to(device)
    pair = reference.quantize(x, fmt)
    want = reference.fp8_gemm(pair, weight, weight_scale, weight_block)
    return pair, weight, weight_scale, want


def _try_backend(backend: GemmBackend, device, fmt: ActFormat, weight_block: int) -> str:
    """Run one tiny GEMM; '' when it ran and matched the reference, else the reason."""
    try:
        pair, weight, weight_scale, want = _tiny_problem(device, fmt, weight_block)
        derived = backend.derive_weight_tensors(weight, weight_scale, weight_block)
        got = backend.gemm(pair, weight, weight_scale, derived)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        got = got.double().cpu()
        want = want.cpu()
        err = ((got - want).norm() / want.norm()).item()
        if not torch.isfinite(got).all() or err > 1e-2:
            return f"a tiny {fmt.value} GEMM ran but was wrong (relative error {err:.3g})"
        return ""
    except Exception as exc:  # noqa: BLE001 - any failure means: cannot serve
        return f"a tiny {fmt.value} GEMM failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def probe(refresh: bool = False, arch: tuple[int, int] | None = None) -> Capabilities:
    """Capabilities of this process, probed once and cached (``refresh=True`` probes again).
    ``arch`` overrides the detected compute capability (tests); the capabilities probed with it
    stay cached, so later plain calls see that arch until ``probe(refresh=True)``."""
    global _CAPS
    if _CAPS is not None and not refresh and arch is None:
        return _CAPS
    from ..fp8_tile import interpreting

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if arch is None and cuda:
        arch = tuple(torch.cuda.get_device_capability(device))
    # Provisional caps so the backends' own checks can read arch while the probe runs.
    _CAPS = Capabilities(cuda, arch, torch.__version__, interpreting(), False, "probing", False, "probing")

    try:
        import deep_gemm  # noqa: F401

        if not hasattr(deep_gemm, "fp8_gemm_nt"):
            dg_reason = "deep_gemm imports but has no fp8_gemm_nt"
        elif arch is None:
            dg_reason = "no CUDA device (arch unknown)"
        elif arch[0] >= 10:  # probed in the format DeepGEMM reads on this arch
            dg_reason = _try_backend(_BACKENDS["deep_gemm"], device, ActFormat.SM100_G32_UE8M0_PACKED_MN, 32)
        else:  # Hopper: fp32 scales in 128-column groups only
            dg_reason = _try_backend(_BACKENDS["deep_gemm"], device, ActFormat.SM90_G128_FP32_MN, 128)
    except Exception as exc:  # noqa: BLE001 - ImportError, or an ABI mismatch raising OSError
        dg_reason = f"deep_gemm does not import: {type(exc).__name__}: {str(exc)[:200]}"

    if not cuda:
        sm_reason = "no CUDA device"
    elif arch is None or arch[0] != 9:
        sm_reason = f"cuBLAS blockwise 1x128 x 128x128 scaling runs on SM90 only, this is sm{arch}"
    elif not hasattr(torch, "_scaled_mm"):
        sm_reason = f"torch {torch.__version__} has no torch._scaled_mm"
    else:
        try:
            sm_reason = _BACKENDS["torch_blockwise"].calibrate(device)
        except Exception as exc:  # noqa: BLE001
            sm_reason = f"torch._scaled_mm blockwise failed: {type(exc).__name__}: {str(exc)[:200]}"


    _CAPS = Capabilities(cuda, arch, torch.__version__, interpreting(), dg_reason == "", dg_reason,
                         sm_reason == "", sm_reason)
    return _CAPS


def input_format_for(weight_block: int, arch: tuple[int, int] | None = None) -> ActFormat:
    """The activation format producers write for a consumer of ``weight_block`` blocks:
    32 -> ``sm100_g32_ue8m0_packed_mn`` on Blackwell (SM100+) where DeepGEMM runs (the only
    backend that reads it), else ``sm90_g32_fp32_mn`` (the Triton GEMM's, on any arch);
    128 -> ``sm90_g128_fp32_mn``."""
    if arch is None:
        arch = probe().arch
    if weight_block == 32:
        if arch is not None and arch[0] >= 10 and probe().deep_gemm:
            return ActFormat.SM100_G32_UE8M0_PACKED_MN
        return ActFormat.SM90_G32_FP32_MN
    if weight_block == 128:
        return ActFormat.SM90_G128_FP32_MN
    raise ValueError(f"weight_block must be 32 or 128, got {weight_block}")


# ----------------------------------------------------------------------------------------------
# Registry and selection
# ----------------------------------------------------------------------------------------------

from .deep_gemm import DeepGemmBackend  # noqa: E402
from .torch_blockwise import TorchBlockwiseBackend  # noqa: E402
from .triton import TritonBackend  # noqa: E402

# Default preference: DeepGEMM where it runs (users' stacks), then Triton, then cuBLAS.
_BACKENDS: dict[str, GemmBackend] = {
    b.name: b for b in (DeepGemmBackend(), TritonBackend(), TorchBlockwiseBackend())
}


BACKEND_NAMES: tuple[str, ...] = tuple(_BACKENDS)  # default preference order


def backend_names() -> list[str]:
    """Backend names in default preference order."""
    return list(_BACKENDS)


def get_backend(name: str) -> GemmBackend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown GEMM backend {name!r}; known: {', '.join(_BACKENDS)}") from None


def select_backend(fmt: ActFormat | str, weight_block: int, n: int, k: int,
                   prefer: str | None = None) -> GemmBackend:
    """The backend that serves ``fmt`` activations x ``n x k`` weights in ``weight_block`` blocks.

    ``prefer`` names one backend and is strict (ValueError with its reason if it cannot serve).
    Otherwise the first of ``backend_names()`` that can serve wins. The choice and every
    rejection reason are logged at INFO; ValueError when none can serve.
    """
    fmt = ActFormat(fmt)
    what = f"{fmt.value} x {n}x{k} weights in {weight_block}x{weight_block} blocks"
    if prefer is not None:
        backend = get_backend(prefer)
        reason = backend.rejection(fmt, weight_block, n, k)
        if reason is not None:
            logger.info("fp8chain GEMM for %s: preferred backend %s rejected: %s", what, prefer, reason)
            raise ValueError(f"backend {prefer!r} cannot serve {what}: {reason}")
        logger.info("fp8chain GEMM for %s: %s (preferred)", what, prefer)
        return backend
    rejected = []
    for name, backend in _BACKENDS.items():
        reason = backend.rejection(fmt, weight_block, n, k)
        if reason is None:
            logger.info("fp8chain GEMM for %s: %s%s", what, name,
                        "".join(f"; {r} rejected: {why}" for r, why in rejected))
            return backend
        rejected.append((name, reason))
    detail = "; ".join(f"{r}: {why}" for r, why in rejected)
    logger.info("fp8chain GEMM for %s: no backend can serve (%s)", what, detail)
    raise ValueError(f"no GEMM backend can serve {what}: {detail}")
