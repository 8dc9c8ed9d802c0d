"""The ``RMSNorm`` module's return convention over ``norm.rms_norm``: ``(y, pair or None)``
whichever way the pair is asked for (a format, a caller-given pair, or neither), with the
caller's buffers written in place."""

import pytest
import torch

from fp8chain.layers.norm import RMSNorm
from fp8chain_kernel import reference as ref
from fp8chain_kernel.formats import ActFormat
from fp8chain_kernel.reference.norm import rms_norm_fp32
from helpers import assert_close_bf16, assert_pairs_equal, poisoned_pair

pytestmark = pytest.mark.cpu

ROWS, HIDDEN = 3, 256


def _module_and_input():
    module = RMSNorm(HIDDEN, eps=1e-6)
    module.weight.copy_((1.0 + 0.5 * torch.randn(HIDDEN)).bfloat16())
    x = torch.randn(ROWS, HIDDEN).bfloat16()
    x[1] = 0.0  # a zero row
    return module, x


def test_bf16_only_returns_no_pair():
    module, x = _module_and_input()
    y, pair = module(x)
    assert pair is None
    assert_close_bf16(y, rms_norm_fp32(x, module.weight, module.eps))


@pytest.mark.parametrize("fmt", list(ActFormat))
def test_format_or_given_pair_returns_the_pair_of_y(fmt):
    module, x = _module_and_input()
    y, pair = module(x, fmt)
    assert_pairs_equal(pair, ref.quantize(y, fmt))
    given, given_y = poisoned_pair(ROWS, HIDDEN, fmt, x.device), torch.full_like(x, float("nan"))
    y2, pair2 = module(x, out=given, out_bf16=given_y)  # the pair's format implied by `out`
    assert pair2 is given and y2 is given_y
    assert torch.equal(y2, y)
    assert_pairs_equal(pair2, pair)


def test_weight_is_bf16_and_takes_no_dtype():
    """``norm.rms_norm`` reads a bf16 weight: the module has no dtype to get wrong."""
    assert RMSNorm(HIDDEN).weight.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="dtype"):
        RMSNorm(HIDDEN, 1e-6, dtype=torch.float32)


def test_module_eps_reaches_the_kernel():
    """The module's own eps is used: rows whose mean square is of eps's order tell 1e-2 from 1e-6."""
    module = RMSNorm(HIDDEN, eps=1e-2)
    x = (0.05 * torch.randn(ROWS, HIDDEN)).bfloat16()
    y, _ = module(x)
    assert_close_bf16(y, rms_norm_fp32(x, module.weight, 1e-2))


def test_fresh_module_weight_is_one():
    """Before a load the weight is the identity gain: y is the plain RMS normalization of x."""
    module = RMSNorm(HIDDEN)
    x = torch.randn(ROWS, HIDDEN).bfloat16()
    y, _ = module(x)
    assert torch.equal(module.weight, torch.ones(HIDDEN, dtype=torch.bfloat16))
    assert_close_bf16(y, rms_norm_fp32(x, torch.ones(HIDDEN), module.eps))
