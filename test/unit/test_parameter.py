"""copy_or_rebind_param: in place, rebind with a warning, register."""

import logging

import pytest
import torch
from torch import nn

from fp8chain.layers.parameter import copy_or_rebind_param

pytestmark = pytest.mark.cpu


def _module_with(name, tensor):
    m = nn.Module()
    p = nn.Parameter(tensor, requires_grad=False)
    p.weight_loader = "marker"
    m.register_parameter(name, p)
    return m, p


def test_same_shape_and_dtype_copies_in_place(caplog):
    m, p = _module_with("w", torch.zeros(4, 6))
    ptr = p.data_ptr()
    new = torch.randn(4, 6)
    with caplog.at_level(logging.WARNING):
        got = copy_or_rebind_param(m, "w", new)
    assert got is p and m.w is p
    assert p.data_ptr() == ptr
    assert torch.equal(p, new)
    assert new.data_ptr() != ptr  # values copied, not aliased
    assert not caplog.records


def test_in_place_keeps_strides_of_existing_parameter():
    backing = torch.zeros(3, 8, dtype=torch.int32)  # an MN-major [8, 3] view
    m, p = _module_with("s", backing.t())
    ptr, strides = p.data_ptr(), p.stride()
    new = torch.randint(-100, 100, (8, 3), dtype=torch.int32)  # row-major
    copy_or_rebind_param(m, "s", new)
    assert p.data_ptr() == ptr and p.stride() == strides
    assert torch.equal(p, new)


@pytest.mark.parametrize("new", [torch.randn(5, 6), torch.randn(4, 6).to(torch.bfloat16)],
                         ids=["shape", "dtype"])
def test_different_shape_or_dtype_rebinds_with_warning(new, caplog):
    m, p = _module_with("w", torch.zeros(4, 6))
    ptr = p.data_ptr()
    with caplog.at_level(logging.WARNING, logger="fp8chain.layers.parameter"):
        got = copy_or_rebind_param(m, "w", new)
    assert got is p and m.w is p
    assert p.data_ptr() == new.data_ptr() != ptr
    assert p.shape == new.shape and p.dtype == new.dtype
    assert p.weight_loader == "marker"  # attributes survive a rebind
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and "stale" in msgs[0] and "w" in msgs[0]


def test_absent_registers_parameter_without_grad():
    m = nn.Module()
    t = torch.randn(3, 2)
    p = copy_or_rebind_param(m, "derived", t)
    assert isinstance(p, nn.Parameter) and not p.requires_grad
    assert "derived" in dict(m.named_parameters())
    assert p.data_ptr() == t.data_ptr()
    # a second call with the same shape copies into the registered storage
    ptr = p.data_ptr()
    copy_or_rebind_param(m, "derived", torch.ones(3, 2))
    assert m.derived.data_ptr() == ptr and torch.equal(m.derived, torch.ones(3, 2))


def test_register_keeps_given_strides():
    m = nn.Module()
    t = torch.zeros(2, 12, dtype=torch.int32).t()[:10]
    p = copy_or_rebind_param(m, "packed", t)
    assert p.stride() == (1, 12)


def test_non_parameter_attribute_is_an_error():
    m = nn.Module()
    m.register_buffer("buf", torch.zeros(2))
    with pytest.raises(TypeError, match="not a Parameter"):
        copy_or_rebind_param(m, "buf", torch.ones(2))
    with pytest.raises(TypeError):
        copy_or_rebind_param(m, "x", [1, 2])


def test_match_strides_rebinds_a_parameter_whose_layout_differs(caplog):
    """A derived tensor whose padded strides are part of its contract: a parameter left dense (by
    ``copy.deepcopy`` / ``.to()``) is rebound to the padded tensor, with the stale-graph warning,
    not copied into with the wrong strides; without ``match_strides`` the copy stays in place."""
    import logging

    from torch import nn

    from fp8chain.layers.parameter import copy_or_rebind_param

    padded = torch.randint(-9, 9, (2, 12), dtype=torch.int32).t()[:10]  # [10, 2], strides (1, 12)
    for match, rebound in ((True, True), (False, False)):
        m = nn.Module()
        p = nn.Parameter(torch.zeros(10, 2, dtype=torch.int32), requires_grad=False)
        m.register_parameter("s", p)
        ptr = p.data_ptr()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fp8chain.layers.parameter"):
            got = copy_or_rebind_param(m, "s", padded, match_strides=match)
        assert torch.equal(got, padded)
        assert (got.stride() == (1, 12)) is rebound and (got.data_ptr() != ptr) is rebound
        assert bool(caplog.records) is rebound


def test_attribute_or_submodule_of_that_name_is_an_error():
    """A plain attribute or a submodule named like the parameter is refused with the same
    TypeError as a buffer (not left to ``register_parameter``'s KeyError)."""
    m = nn.Module()
    m.plain = 3
    m.sub = nn.Linear(2, 2)
    for name in ("plain", "sub"):
        with pytest.raises(TypeError, match=f"Module.{name} exists and is not a Parameter"):
            copy_or_rebind_param(m, name, torch.ones(2))


def test_rebinding_to_a_view_of_its_own_storage_is_allowed():
    """The parameter's own (old) storage is not "another parameter": rebinding ``w`` to a reshaped
    view of itself is fine."""
    m, p = _module_with("w", torch.randn(4, 6))
    ptr, values = p.data_ptr(), p.detach().clone()
    got = copy_or_rebind_param(m, "w", p.detach().view(6, 4))
    assert got is p and p.shape == (6, 4) and p.data_ptr() == ptr
    assert torch.equal(p.view(-1), values.view(-1))
