"""The MoE router (``router.router_topk``) against ``reference.router_topk``: CPU interpreter at
small E and H, GPU at DSv4.1-Flash's 256 experts x 5120, top 6.

Checked:
* the expert choice equals the reference's for every token whose reference keys (``scores + bias``)
  have no near tie among their ``top_k + 1`` largest (all gaps above ``TIE``: the kernel's logits
  sum the same fp32 products in another order, its exp / log round differently); where one has, the
  kernel's choice is still a top-k up to ``TIE``; most tokens have none;
* the weights agree with the reference's to ``RTOL`` / ``ATOL`` on those tokens;
* a NaN in a token's x gives that token NaN weights (experts 0.. k-1, as NaN keys count as +inf)
  and touches no other token; zero rows are routed by the bias alone, weights 1 / k x scaling;
* every element of poisoned ``out`` buffers is written; two calls give the same bits; bad input
  raises naming what is wrong.
"""

import pytest
import torch

from fp8chain_kernel import reference as ref
from fp8chain_kernel import router

CPU_T = [1, 2, 3, 5, 16, 64, 65, 127]
GPU_T = [1, 2, 3, 4, 16, 64, 127, 256, 2048]
TIE = 1e-4
RTOL, ATOL = 1e-5, 2e-6
SCALING = 1.5


def _inputs(tokens, experts, hidden, device, nan_rows=(), zero_rows=()):
    """x as a row-strided view (logits of about 2 sigma), the router weight and a bias of 0.1 sigma."""
    x = torch.randn(tokens, hidden + 8, device=device).bfloat16()[:, :hidden]
    x[list(zero_rows)] = 0
    x[list(nan_rows), hidden // 2] = float("nan")
    weight = (torch.randn(experts, hidden, device=device) * 2 / hidden ** 0.5).bfloat16()
    bias = torch.randn(experts, device=device) * 0.1
    return x, weight, bias


def _poisoned_out(tokens, top_k, device):
    """Outputs holding values the router never writes: an expert index of -7 and a weight of -7
    (not NaN, which a NaN row rightly gets)."""
    return (torch.full((tokens, top_k), -7, dtype=torch.int64, device=device),
            torch.full((tokens, top_k), -7.0, device=device))


def check_router_with_nan_and_zero_rows(tokens, experts, hidden, device):
    """Top 6, a NaN row in the middle and a zero row last where there are enough rows."""
    check_router(tokens, experts, hidden, 6, device, nan_rows=[tokens // 2] if tokens > 1 else [],
                 zero_rows=[tokens - 1] if tokens > 2 else [])


def check_router(tokens, experts, hidden, top_k, device, renormalize=True, nan_rows=(), zero_rows=()):
    x, weight, bias = _inputs(tokens, experts, hidden, device, nan_rows, zero_rows)
    out = _poisoned_out(tokens, top_k, device)
    idx, weights = router.router_topk(x, weight, bias, top_k, SCALING, renormalize, out=out)
    assert idx is out[0] and weights is out[1]
    want_idx, want_weights = ref.router_topk(x, weight, bias, top_k, SCALING, renormalize)

    key = ref.router_keys(x, weight, bias)
    nan = torch.zeros(tokens, dtype=torch.bool, device=device)
    nan[list(nan_rows)] = True
    clear = ~nan & ref.router_untied(key, top_k, TIE)
    assert torch.equal(idx[clear], want_idx[clear])
    torch.testing.assert_close(weights[clear], want_weights[clear], rtol=RTOL, atol=ATOL)
    # near ties: still a top-k up to TIE, distinct experts
    assert ((idx >= 0) & (idx < experts)).all()
    assert all(len(set(row)) == top_k for row in idx.tolist())
    kth = key.sort(dim=-1, descending=True).values[:, top_k - 1:top_k]
    assert (key.gather(1, idx)[~nan] >= kth[~nan] - TIE).all()
    assert torch.isfinite(weights[~nan]).all()
    if nan_rows:
        assert torch.equal(idx[nan], want_idx[nan]) and torch.isnan(weights[nan]).all()
    if renormalize and tokens:
        sums = weights[~nan].sum(dim=-1)
        torch.testing.assert_close(sums, torch.full_like(sums, SCALING), rtol=1e-6, atol=1e-6)
    for row in zero_rows:  # the bias alone chooses; every score is sqrt(log 2)
        if clear[row]:
            assert torch.equal(idx[row], torch.sort(bias, descending=True, stable=True).indices[:top_k])
    if clear.numel() >= 16:
        assert clear.float().mean() >= 0.75  # most tokens have no near tie: the check above bites
    again = router.router_topk(x, weight, bias, top_k, SCALING, renormalize)
    assert torch.equal(again[0], idx)
    torch.testing.assert_close(again[1], weights, rtol=0, atol=0, equal_nan=True)
    return idx, weights


@pytest.mark.cpu
@pytest.mark.parametrize("tokens", CPU_T)
def test_router_cpu(tokens, device):
    check_router_with_nan_and_zero_rows(tokens, 64, 320, device)


@pytest.mark.cpu
@pytest.mark.parametrize("experts,hidden,top_k,renormalize", [
    (256, 128, 6, True),   # Flash's expert count, a short H (one slice per program)
    (40, 200, 4, False),   # E not a multiple of 16, H not of 128, weights not renormalized
    (7, 64, 7, True),      # every expert chosen
    (33, 96, 1, True),     # top 1: its weight is the scaling
])
def test_router_shapes_cpu(experts, hidden, top_k, renormalize, device):
    idx, weights = check_router(5, experts, hidden, top_k, device, renormalize)
    if top_k == 1:
        torch.testing.assert_close(weights, torch.full_like(weights, SCALING))


def check_nan_expert(device, nan_in):
    """A NaN in one expert's router row or in its bias makes its key NaN for every token: it ranks
    first (as +inf), so every token routes to it and gets NaN weights, never a finite routing that
    hides it (a NaN bias once gave finite weights: they come from the unbiased scores)."""
    x, weight, bias = _inputs(5, 48, 128, device)
    if nan_in == "weight":
        weight[29, 7] = float("nan")
    else:
        bias[29] = float("nan")
    idx, weights = router.router_topk(x, weight, bias, 6, SCALING, out=_poisoned_out(5, 6, device))
    want_idx, want_weights = ref.router_topk(x, weight, bias, 6, SCALING)
    assert (idx[:, 0] == 29).all() and torch.equal(idx[:, 0], want_idx[:, 0])
    assert torch.isnan(weights).all() and torch.isnan(want_weights).all()
    idx, weights = router.router_topk(x, weight, bias, 6, SCALING, renormalize=False)
    assert torch.isnan(weights[:, 0]).all() and torch.isfinite(weights[:, 1:]).all()


@pytest.mark.cpu
@pytest.mark.parametrize("nan_in", ["weight", "bias"])
def test_router_nan_expert_is_chosen_and_poisons_the_weights(device, nan_in):
    check_nan_expert(device, nan_in)


@pytest.mark.gpu
@pytest.mark.parametrize("nan_in", ["weight", "bias"])
def test_router_nan_expert_is_chosen_and_poisons_the_weights_gpu(device, nan_in):
    check_nan_expert(device, nan_in)


@pytest.mark.cpu
def test_router_untied_holds_every_chosen_place_apart():
    """The ordered choice is checked only where the keys it orders are apart: with every expert
    chosen a tie anywhere still orders two experts either way (it counted as untied)."""
    keys = torch.tensor([[3.0, 2.0, 1.0], [3.0, 1.0, 1.0], [2.0, 2.0, 1.0]])
    assert ref.router_untied(keys, 3, 1e-3).tolist() == [True, False, False]
    assert ref.router_untied(keys, 1, 1e-3).tolist() == [True, True, False]
    assert ref.router_untied(keys[:, :1], 1, 1e-3).tolist() == [True, True, True]  # one expert


@pytest.mark.cpu
def test_router_no_tokens_and_bad_input(device):
    x, weight, bias = _inputs(3, 32, 64, device)
    idx, weights = router.router_topk(x[:0], weight, bias, 6, SCALING)
    assert idx.shape == (0, 6) and weights.shape == (0, 6) and idx.dtype == torch.int64
    bad = [
        (TypeError, "x must be torch.bfloat16", dict(x=x.float())),
        (TypeError, "bias must be torch.float32", dict(bias=bias.bfloat16())),
        (ValueError, r"weight must be \[E, H\] with H = x's 64", dict(weight=weight[:, :32])),
        (ValueError, r"bias must have shape \(32,\)", dict(bias=bias[:16])),
        (ValueError, "top_k must be an int in 1..32", dict(top_k=33)),
        (ValueError, "top_k must be an int", dict(top_k=0)),
        (ValueError, "x must have unit column stride", dict(x=x.t().contiguous().t())),
        (ValueError, "scaling must be a finite number", dict(scaling="1.5")),
        (ValueError, "scaling must be a finite number", dict(scaling=float("nan"))),
        (ValueError, "scaling must be a finite number", dict(scaling=1e39)),  # inf once passed as fp32
        (ValueError, r"out idx must have shape \(3, 6\)", dict(out=_poisoned_out(2, 6, device))),
        (ValueError, "the router runs 1 to 1024 experts",
         dict(weight=torch.zeros(1025, 64, dtype=torch.bfloat16, device=device),
              bias=torch.zeros(1025, device=device))),
    ]
    for error, message, change in bad:
        args = dict(x=x, weight=weight, bias=bias, top_k=6, scaling=SCALING) | change
        with pytest.raises(error, match=message):
            router.router_topk(args.pop("x"), args.pop("weight"), args.pop("bias"), args.pop("top_k"),
                               args.pop("scaling"), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", GPU_T)
def test_router_dsv41_gpu(tokens, device):
    check_router_with_nan_and_zero_rows(tokens, 256, 5120, device)


@pytest.mark.gpu
def test_router_in_a_cuda_graph_gpu(device):
    """Replaying a captured router call into static ``out`` buffers gives the eager call's bits."""
    x, weight, bias = _inputs(4, 256, 5120, device)
    eager = router.router_topk(x, weight, bias, 6, SCALING)
    out = _poisoned_out(4, 6, device)
    router.router_topk(x, weight, bias, 6, SCALING, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        router.router_topk(x, weight, bias, 6, SCALING, out=out)
    out[0].fill_(-7)  # poisoned again after the eager call and the capture: only the replay writes
    out[1].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
