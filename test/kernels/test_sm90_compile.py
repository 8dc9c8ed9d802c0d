"""Kernels the CPU interpreter accepts must also compile for Hopper (sm_90), without spills."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.cpu
def test_kernels_compile_for_sm90_without_spills():
    """The compiler (not the interpreter) accepts the attention and mHC boundary kernels for
    Hopper (sm_90), without register spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 5, result.stdout
    for line in lines:
        assert "STACK:0 " in line and "LOCAL:0 " in line, line  # no spills
