"""Suite setup: without CUDA, Triton kernels run on the CPU interpreter.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, i.e. before
fp8chain_kernel's kernel modules are imported, so it is decided here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """A different seed per test (but reproducible from its node id), so inputs are fresh."""
    import zlib
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
