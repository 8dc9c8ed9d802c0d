"""Reference for ``fp8chain_kernel.router``: the MoE router's logits, scores, top-k and weights.

``logits = x @ weight.T`` in fp32 (bf16 ``x [T, H]`` and ``weight [E, H]``, exact products);
``scores = sqrt(softplus(logits))`` (softplus: ``log1p(exp(l))``, ``l`` itself above 20); the
experts are the ``top_k`` largest ``scores + bias`` (fp32 ``bias [E]``, selection only), a NaN
counting as +inf and ties going to the lower expert index, in descending order; their weights are
the unbiased scores, divided by their sum (at least 1e-20) with ``renormalize``, times ``scaling``;
a chosen expert whose key is NaN weighs NaN. A NaN in a token's logits therefore picks NaN
experts and gives the token NaN weights, and so does a NaN bias (it is chosen first), for every
token, with ``renormalize``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["route_topk", "router_topk", "router_keys", "router_untied"]


def route_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, renormalize: bool = True,
               idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx int64 [T, top_k], weights fp32 [T, top_k])`` from fp32 ``logits [T, E]``; ``idx``
    given: keep that expert choice and compute only its weights."""
    scores = _scores(logits)
    key = scores + bias.float()
    if idx is None:
        idx = torch.sort(_nan_as_inf(key), dim=-1, descending=True, stable=True).indices[..., :top_k]
    # an expert whose key is NaN (its score or its bias) weighs NaN
    weights = torch.where(torch.isnan(key), torch.nan, scores).gather(-1, idx)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return idx, weights * scaling


def _scores(logits: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(F.softplus(logits.float()))


def _nan_as_inf(key: torch.Tensor) -> torch.Tensor:
    """What the choice ranks: ``scores + bias``, a NaN as +inf."""
    return torch.where(torch.isnan(key), torch.inf, key)


def _logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.float() @ weight.float().t()


def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float,
                renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``router.router_topk``: see the module docstring."""
    return route_topk(_logits(x, weight), bias, top_k, scaling, renormalize)


def router_keys(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, E]`` selection keys of the tokens ``x``: ``scores + bias``, a NaN as +inf."""
    return _nan_as_inf(_scores(_logits(x, weight)) + bias.float())


def router_untied(keys: torch.Tensor, top_k: int, margin: float) -> torch.Tensor:
    """bool ``[T]``: the tokens whose ``top_k + 1`` largest keys are all more than ``margin`` apart,
    so a router computing the logits in another order must make the reference's choice (all
    tokens where every expert is chosen, the chosen experts' order included: all keys apart)."""
    top = keys.sort(dim=-1, descending=True, stable=True).values[:, :top_k + 1]
    if top.shape[-1] < 2:
        return torch.ones(keys.shape[0], dtype=torch.bool, device=keys.device)
    return (top[:, :-1] - top[:, 1:]).amin(dim=-1) > margin
