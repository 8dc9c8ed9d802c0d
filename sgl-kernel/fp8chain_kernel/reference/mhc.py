"""Reference for fp8chain_kernel.mhc: manifold-constrained hyper-connections, as DSv4.1 runs them.

Shapes: residual ``R [T, 4, H]`` bf16 (4 hyper-connection streams), sublayer output
``y [T, H]`` bf16, mixes ``pre [T, 4]``, ``post [T, 4]``, ``comb [T, 4, 4]`` fp32.

Numerics, stated once (the kernels in ``fp8chain_kernel.mhc`` follow the same operation order):

* stats: ``X = flatten(R)`` (index ``k*H + h``), ``r = rsqrt(mean(X^2) + rms_eps)``,
  ``m = (X @ fn^T) * r``. The reference evaluates ``mean(X^2)`` and ``X @ fn^T`` in fp64
  (exact for these sizes up to the final fp32 rounding, so independent of summation order) and
  everything after that in fp32:
  ``pre = sigmoid(m[0:4]*scale[0] + base[0:4]) + hc_eps``,
  ``post = 2 * sigmoid(m[4:8]*scale[1] + base[4:8])``,
  ``C[i][j] = m[8+4i+j]*scale[2] + base[8+4i+j]``, ``C = softmax_j(C) + hc_eps``,
  ``C = C / (sum_i C + hc_eps)`` (columns), then ``sinkhorn_iters - 1`` times rows
  ``C = C / (sum_j C + hc_eps)`` and columns ``C = C / (sum_i C + hc_eps)``.
  The last step is a column normalisation, so columns sum to ``S/(S + hc_eps)``, one to
  within ~1e-6; rows sum to one only as far as the Sinkhorn iteration has converged.
* post: ``R'[o] = bf16(post[o]*y + comb[0][o]*R[0] + comb[1][o]*R[1] + comb[2][o]*R[2]
  + comb[3][o]*R[3])``, evaluated left to right in fp32 (no fused multiply-add), one rounding.
* combine: ``v = bf16(pre[0]*R[0] + pre[1]*R[1] + pre[2]*R[2] + pre[3]*R[3])`` left to right
  in fp32; norm: ``x = bf16((v * rsqrt(mean(v^2) + eps)) * w)`` in fp32.
* the FP8 pair of ``x`` is ``reference.quantize(x, fmt)`` of the bf16 ``x``.

Shifted ordering (DSv4.1): a sublayer entering with ``(R, p_prev)`` reads
``x = combine_norm(R, p_prev)``; its own stats come from the same ``R``;
``R' = post(y, R, post_s, comb_s)`` and ``(R', pre_s)`` is handed on, so the boundary between
two sublayers is ``mhc_mega_boundary(y, R, pre_s, post_s, comb_s, w_next)``.
"""

from __future__ import annotations

import torch

from ..formats import ActFormat
from .norm import rms_rsqrt
from .quant import quantize

__all__ = [
    "mhc_stats", "mhc_post", "mhc_post_fp32", "mhc_combine", "mhc_combine_norm",
    "mhc_norm_fp32", "mhc_mega_boundary",
]

HC = 4


def _mixes(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_eps: float,
           sinkhorn_iters: int):
    """fp32 ``m [T, 24]`` -> (pre [T,4], post [T,4], comb [T,4,4])."""
    t = m.shape[0]
    scale = scale.float()
    base = base.float()
    pre = torch.sigmoid(m[:, 0:HC] * scale[0] + base[0:HC]) + hc_eps
    post = 2.0 * torch.sigmoid(m[:, HC:2 * HC] * scale[1] + base[HC:2 * HC])
    logits = (m[:, 2 * HC:] * scale[2] + base[2 * HC:]).view(t, HC, HC)
    e = torch.exp(logits - logits.amax(dim=2, keepdim=True))
    comb = e / e.sum(dim=2, keepdim=True) + hc_eps
    comb = comb / (comb.sum(dim=1, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=2, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=1, keepdim=True) + hc_eps)
    return pre, post, comb


def mhc_stats(residual: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
              *, rms_eps: float = 1e-6, hc_eps: float = 1e-6, sinkhorn_iters: int = 20,
              dtype: torch.dtype = torch.float64):
    """``residual [T, 4, H]`` -> fp32 ``(pre [T, 4], post [T, 4], comb [T, 4, 4])``.

    ``dtype``: the precision of ``mean(X^2)`` and ``X @ fn^T``; float64 is the specification, and
    float32 what a serving implementation computes (the benchmarks' compiled torch peer)."""
    t, hc, h = residual.shape
    if hc != HC:
        raise ValueError(f"mHC expects {HC} streams, got residual shape {tuple(residual.shape)}")
    x = residual.reshape(t, hc * h).to(dtype)
    r = rms_rsqrt(x, rms_eps)
    m = ((x @ fn.to(dtype).t()) * r).float()
    return _mixes(m, scale, base, hc_eps, sinkhorn_iters)


def mhc_post_fp32(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor:
    """Unrounded fp32 ``post[o]*y + sum_i comb[i][o]*R[i]`` ``[T, 4, H]`` (left to right)."""
    r = residual.float()
    post = post.float()
    comb = comb.float()
    acc = post[:, :, None] * y.float()[:, None, :]
    for i in range(HC):
        acc = acc + comb[:, i, :, None] * r[:, i, None, :]
    return acc


def mhc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor:
    """``R' [T, 4, H]`` bf16: the post mix with one rounding."""
    return mhc_post_fp32(y, residual, post, comb).to(torch.bfloat16)


def mhc_combine(residual: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``v = bf16(sum_k pre[k]*R[k])`` ``[T, H]`` (left to right in fp32)."""
    r = residual.float()
    pre = pre.float()
    v = pre[:, 0, None] * r[:, 0]
    for k in range(1, HC):
        v = v + pre[:, k, None] * r[:, k]
    return v.to(torch.bfloat16)


def mhc_norm_fp32(v: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Unrounded fp32 ``(v * rsqrt(mean(v^2) + eps)) * w`` of a bf16 ``v [T, H]``."""
    v = v.float()
    rs = rms_rsqrt(v, norm_eps)
    return (v * rs) * norm_weight.float()


def _outputs(x: torch.Tensor, out_format, return_bf16: bool):
    pair = quantize(x, ActFormat(out_format)) if out_format is not None else None
    return x if return_bf16 else None, pair


def mhc_combine_norm(residual: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor,
                     norm_eps: float, *, out_format=None, return_bf16: bool = True):
    """``x = bf16(RMSNorm(bf16(sum_k pre[k]*R[k])))``; returns ``x``, ``(x, pair)`` with
    ``out_format``, or ``pair`` with ``return_bf16=False``."""
    if not return_bf16 and out_format is None:
        raise ValueError("return_bf16=False needs an out_format")
    x = mhc_norm_fp32(mhc_combine(residual, pre), norm_weight, norm_eps).to(torch.bfloat16)
    x, pair = _outputs(x, out_format, return_bf16)
    if out_format is None:
        return x
    return (x, pair) if return_bf16 else pair


def mhc_mega_boundary(y: torch.Tensor, residual: torch.Tensor, pre: torch.Tensor,
                      post: torch.Tensor, comb: torch.Tensor, norm_weight: torch.Tensor,
                      norm_eps: float, *, out_format=None, return_bf16: bool = True):
    """Post of the finished sublayer, then combine + RMSNorm of the next one with the carried
    ``pre``: returns ``(R', x, pair)`` (``x`` None when ``return_bf16=False``, ``pair`` None
    without ``out_format``)."""
    if not return_bf16 and out_format is None:
        raise ValueError("return_bf16=False needs an out_format")
    new_residual = mhc_post(y, residual, post, comb)
    x = mhc_norm_fp32(mhc_combine(new_residual, pre), norm_weight, norm_eps).to(torch.bfloat16)
    x, pair = _outputs(x, out_format, return_bf16)
    return new_residual, x, pair
