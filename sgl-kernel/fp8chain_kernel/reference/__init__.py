"""Torch-only references for every fp8chain kernel: the specification the tests compare against.

One module per kernel family; everything public is re-exported here, so
``fp8chain_kernel.reference.quantize`` and ``fp8chain_kernel.reference.rms_norm`` both work.
"""

from .quant import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .act import *  # noqa: F401,F403
from .einsum import *  # noqa: F401,F403
from .mhc import *  # noqa: F401,F403
from .gemm import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .router import *  # noqa: F401,F403
