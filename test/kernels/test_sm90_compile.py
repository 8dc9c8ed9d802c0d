"""Kernels the CPU interpreter accepts must also compile for Hopper (sm_90) without spilling
registers (except the launches ``sm90_compile.SPILL_ALLOWED`` names, within their bound), within
the register cap a launch sets (``GemmConfig.max_regs``, ``gemm.m64_register_cap``), the
producers' FP8 stores must not shuffle their tile through shared memory, and the mHC boundary's
post and combine must add their terms in the order written (``sm90_compile.unordered_sums``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EVERY_KERNEL = {"_rope_qkv_kernel", "_mqa_split_kernel", "_mqa_merge_kernel", "_boundary_kernel", "_quantize_kernel",
                "_silu_mul_kernel", "_rms_norm_kernel", "_wo_a_kernel", "_block_scaled_gemm_kernel",
                "_gemm_silu_mul_kernel", "_gemv_kernel", "_stats_partial_kernel", "_stats_finish_kernel",
                "_router_logits_kernel", "_router_topk_kernel"}
# Producers whose FP8 store must share the layout of their bf16 accesses (fp8_tile.fp8_offsets):
# only reductions and the scale tile go through shared memory, not the data tile (16 KiB at
# H = 5120 when the layouts differ).
SHARED_LAYOUT = {"_rms_norm_kernel", "_silu_mul_kernel"}
SHARED_LAYOUT_MAX_BYTES = 1024


@pytest.mark.cpu
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    unused = [line for line in lines if line.startswith("unused-allowance ")]
    assert not unused, f"SPILL_ALLOWED names launches no kernel makes: {unused}"
    # the mHC post and combine sum left to right, as reference.mhc does (bitwise R' and x)
    orders = [line for line in lines if line.startswith("sum-order ")]
    assert orders, result.stdout
    for line in orders:
        sums, unordered = (int(v) for v in re.search(r"sums (\d+) unordered (\d+)", line).groups())
        assert sums > 0 and unordered == 0, line
    usage = [line.split(" ", 1) for line in lines if not line.startswith("sum-order ")]
    assert {name for name, _ in usage} == EVERY_KERNEL, result.stdout
    capped = 0
    for name, resources in usage:
        cap = int(re.search(r"max-regs (\d+)", resources).group(1))
        if cap:
            capped += 1
            assert int(re.search(r"REG:(\d+)", resources).group(1)) <= cap, f"{name} over its register cap: {resources}"
        allowed = int(re.search(r"spill-allowed (\d+)", resources).group(1))
        stack = int(re.search(r"STACK:(\d+)", resources).group(1))
        assert stack <= allowed and "LOCAL:0 " in resources, f"{name} spills: {resources}"
        if name in SHARED_LAYOUT:
            shared = int(re.search(r"smem (\d+)", resources).group(1))
            assert shared <= SHARED_LAYOUT_MAX_BYTES, f"{name} shuffles its tile through shared memory: {resources}"
    # under every Triton the three dequantized residency entries at M = 40, the two per-group ones at
    # M = 200 and the gate_up's SiLU*mul launch there in both output formats (at M = 64 too from 3.7 on)
    assert capped >= 7, result.stdout
