"""Compile fp8chain's Triton kernels for Hopper (sm_90) without a GPU; print resource usage.

Run as a script in a process without TRITON_INTERPRET (the interpreter replaces @triton.jit):
``python test/kernels/sm90_compile.py`` calls the public kernel functions on CPU tensors at
DSv4.1-Flash shapes with launching replaced by recording, compiles every recorded launch for
sm_90 with Triton's own ptxas, and prints ``kernel REG:.. STACK:.. LOCAL:.. smem .. spill-allowed
.. max-regs ..`` per launch (max-regs 0: no ``maxnreg`` cap); a compile error exits non-zero. It
catches what the CPU interpreter accepts but the compiler rejects (branch-local shapes, dot
shapes, layouts) and register spills (STACK/LOCAL > 0).
Kernels whose launch configuration depends on the GPU they run on (the mHC boundary) are
called with the H200's configuration patched in, and every kernel with programmatic dependent
launch on, as on sm_90 (``fp8chain_kernel.launch``).
"""

import os
import re
import subprocess
import sys
import tempfile

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from fp8chain_kernel import act, attention, einsum, gemm, gemv, launch, mhc, norm, quant, reference, router  # noqa: E402
from fp8chain_kernel.formats import FP8_DTYPE, ActFormat, cdiv  # noqa: E402

TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv", torch.int32: "i32",
         torch.int64: "i64", torch.uint8: "u8"}
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_pdl", "maxnreg")
launches = []


def _record(self, *args, grid, warmup, **kwargs):
    launches.append((self, args, kwargs))


def _divisibility(kernel, args, kwargs):
    """The alignment facts the launcher would specialize on: tensors (16-byte aligned allocations)
    and integers divisible by 16. Without them ptxas sees unvectorized loads and no cp.async
    pipeline, so shared memory and registers would not be what the GPU compiles."""
    values = dict(zip(kernel.arg_names, args))
    values.update(kwargs)
    return {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
            if index not in kernel.constexprs
            and (isinstance(values[name], torch.Tensor)
                 or (type(values[name]) is int and values[name] % 16 == 0))}


def _signature(kernel, args, kwargs):
    values = dict(zip(kernel.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    signature, constexprs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        value = values[name]
        if index in kernel.constexprs:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int) and value == 1:  # the launcher folds an int equal to 1 into the kernel
            signature[name], constexprs[name] = "constexpr", 1
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
        else:
            signature[name] = "fp32"
    return signature, constexprs


def record_launches() -> None:
    """Call every kernel family at DSv4.1-Flash shapes; the launches are recorded, not run."""
    bf16 = lambda *shape: torch.randn(*shape).bfloat16()  # noqa: E731
    for fmt in ActFormat:
        quant.quantize(bf16(64, 5120), fmt)
    for fmt in (ActFormat.SM90_G32_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN):
        for rows in (1, 2048):
            for width in (5120, 1280):  # the boundary's RMSNorm at layer 0, q_norm
                norm.rms_norm(bf16(rows, width), bf16(width), 1e-6, out_format=fmt)
            act.silu_mul(bf16(rows, 4608), limit=10.0, out_format=fmt)
        for rows, groups in ((1, 2), (4, 8), (64, 2), (256, 2), (2048, 8)):
            einsum.wo_a_einsum(bf16(rows, groups, 4096), bf16(groups, 1024, 4096), out_format=fmt)
            einsum.wo_a_einsum(bf16(rows, groups, 4096), torch.zeros(groups, 1024, 4096, dtype=FP8_DTYPE),
                               weight_scale=torch.ones(groups, 1024 // 32, 4096 // 32), out_format=fmt)
    for block, fmt in ((32, ActFormat.SM90_G32_FP32_MN), (128, ActFormat.SM90_G128_FP32_MN)):
        weight = torch.zeros(1792, 5120, dtype=FP8_DTYPE)
        scale = torch.ones(1792 // block, 5120 // block)
        for rows in (1, 64, 2048):
            gemm.fp8_gemm(quant.quantize(bf16(rows, 5120), fmt), weight, scale, weight_block=block)
    def table_launch(tokens, n, k, group, cfg):
        gemm.fp8_gemm(quant.quantize(bf16(tokens, k), gemm.input_format_for_block(group)),
                      torch.zeros(n, k, dtype=FP8_DTYPE), torch.ones(cdiv(n, group), k // group),
                      weight_block=group, config=cfg)

    for (tokens, n, k, group), cfg in gemv.GEMV_TABLE.items():  # every GEMV table launch
        table_launch(tokens, n, k, group, cfg)
    for (bucket, n, k, group), cfg in gemm.CONFIG_TABLE.items():  # every GEMM table launch
        table_launch(min(bucket, 2048), n, k, group, cfg)
        if cfg.residency_cap:  # capped under every Triton: M = 40 (a scale stride not a multiple of 16)
            table_launch(40 if cfg.dequant else 200, n, k, group, cfg)  # and M = 200 (padded scale rows)
    gate_up = torch.zeros(4608, 5120, dtype=FP8_DTYPE)
    for fmt in (ActFormat.SM90_G32_FP32_MN, ActFormat.SM100_G32_UE8M0_PACKED_MN):
        for rows in (1, 64, 200, 2048):  # 200: the M-bucket-256 entry on padded scale rows, capped
            gemm.fp8_gemm_silu_mul(quant.quantize(bf16(rows, 5120), ActFormat.SM90_G32_FP32_MN), gate_up,
                                   torch.ones(4608 // 32, 5120 // 32), weight_block=32, limit=10.0, out_format=fmt,
                                   return_bf16=False)
    for rows in (1, 64, 2048):  # the router: H split at decode, 16 x 16 and 64 x 64 tiles
        router.router_topk(bf16(rows, 5120), bf16(256, 5120), torch.zeros(256), 6, 1.5)
    cos, sin = reference.rope_tables(1024, 64, 10000.0)
    cache = torch.zeros(64, 1024, 512, dtype=torch.bfloat16)
    # default tiles 16 x 64 (16 key splits, merged) and 64 x 64 wgmma at two stages (2 splits,
    # merged; one split: the split kernel writes the output, the spill SPILL_ALLOWED names);
    # rope_qkv with and without the fused kv norm
    for rows in (1, 64, 256, 2048):
        slots, positions = torch.arange(rows) % 64, torch.full((rows,), 1023)
        kv_weight = bf16(512) if rows > 1 else None
        q = attention.rope_qkv(bf16(rows, 64 * 512), bf16(rows, 512), cos, sin, cache, slots, positions, 1e-6,
                               kv_weight=kv_weight)
        attention.mqa_attention(q, cache, slots, positions, torch.zeros(64), 512 ** -0.5, cos, sin)


def record_boundary_launches() -> None:
    """The mHC stats and boundary as configured on an H200 (132 SMs, one row per program): T = 1
    and 16 (row barrier: slices of 128 and 1024 columns), 128 (the last program of a row
    normalizes it) and 2048 (whole 5120-column rows), writing x and the packed pair; the post
    alone (``mhc_post``) at the same T; the stats also at T = 64 (16-token tiles of three chunks
    a split, loaded without a pipeline under Triton >= 3.7)."""
    gpu_config = dict(_target_programs=lambda device: 2 * 132, _max_rows_per_program=lambda device: 1,
                      compiled_for_gpu=lambda device: True)
    saved = {name: getattr(mhc, name) for name in gpu_config}
    for name, value in gpu_config.items():
        setattr(mhc, name, value)
    try:
        for rows in (1, 16, 64, 128, 2048):
            mhc.mhc_stats(torch.randn(rows, 4, 5120).bfloat16(), torch.randn(24, 4 * 5120), torch.rand(3),
                          torch.randn(24))
        for rows in (1, 16, 128, 2048):
            mixes = torch.rand(rows, 4), torch.rand(rows, 4), torch.rand(rows, 4, 4)
            mhc.mhc_mega_boundary(torch.randn(rows, 5120).bfloat16(), torch.randn(rows, 4, 5120).bfloat16(),
                                  *mixes, torch.randn(5120).bfloat16(), 1e-6,
                                  out_format=ActFormat.SM100_G32_UE8M0_PACKED_MN)
            mhc.mhc_post(torch.randn(rows, 5120).bfloat16(), torch.randn(rows, 4, 5120).bfloat16(), *mixes[1:])
    finally:
        for name, value in saved.items():
            setattr(mhc, name, value)


# Launches measured faster on the H200 despite a spill, with the most stack bytes they may use:
# the 64-head split tile with one key split (its epilogue: docs/benchmarks.md, attention); two
# GEMM table entries the sweep timed fastest among its verified candidates (docs/gemm.md, "Register
# use on sm_90"): wqkv_a at M bucket 256 (bf16-dequantized operands, 128 x 64 tile, eight K slices
# of 5 iterations) and wq_b at M bucket 64 (bf16-dequantized operands, 128 x 64 tile, one slice).
SPILL_ALLOWED = {
    ("_mqa_split_kernel", (("BLOCK_H", 64), ("SPLITS", 1))): 1024,
    ("_block_scaled_gemm_kernel", (("GROUP", 32), ("DEQUANT", True), ("SPLIT", 8), ("BLOCK_N", 128),
                                   ("BLOCK_M", 64), ("SCALE_AHEAD", 0))): 40,
    ("_block_scaled_gemm_kernel", (("GROUP", 32), ("DEQUANT", True), ("SPLIT", 1), ("BLOCK_N", 128),
                                   ("BLOCK_M", 64), ("SCALE_AHEAD", 0))): 32,
    # the gate_up on padded scale rows at the 168 cap writing the Blackwell packed pair (not a
    # launch DSv4.1 makes on Hopper; the sm90 pair's launch fits without a spill)
    ("_gemm_silu_mul_kernel", (("PACKED", True), ("PADDED_SCALE_ROWS", True))): 8,
}

# Launches Triton 3.8 spills and 3.6 does not, with the stack bytes 3.8 gives them; timed under both
# on an H100 (docs/benchmarks.md, "Triton 3.8"): the bf16-weight wo_a's 64 x 128 tile (65-256
# rows, 2-4 % slower at T = 256) and the 128-column-group GEMM's 128 x 128 tile (6-10 % at M =
# 2048); the two 32-group dequantized entries above spill 40 bytes under 3.8.
SPILL_ALLOWED_TRITON_3_8 = {
    ("_wo_a_kernel", (("W_FP8", False), ("BLOCK_M", 64), ("BLOCK_N", 128))): 416,
    ("_block_scaled_gemm_kernel", (("GROUP", 128), ("DEQUANT", False), ("BLOCK_N", 128), ("BLOCK_M", 128))): 40,
    ("_block_scaled_gemm_kernel", (("GROUP", 32), ("DEQUANT", True), ("SPLIT", 1), ("BLOCK_N", 128),
                                   ("BLOCK_M", 64), ("SCALE_AHEAD", 0))): 40,
}
if launch.triton_release() >= (3, 8):
    SPILL_ALLOWED = {**SPILL_ALLOWED, **SPILL_ALLOWED_TRITON_3_8}


def unordered_sums(ptx: str) -> tuple[int, int]:
    """(fp32 sums rounded to bf16, those not added left to right as written) in ``ptx``.

    A sum here is an ``add.rn.f32`` chain that a conversion to bf16 rounds (the mHC post and
    combine); written left to right, each add takes the running sum first and a product second,
    as ``fp8_tile.add_rn`` keeps them. A compiler that reorders the chain (Triton 3.8 without
    ``add_rn``) or a chain of plain ``+`` (whose operands the compiler may swap) fails this."""
    adds = {d: (a, b) for d, a, b in re.findall(r"add\.rn\.f32\s+(%r\d+),\s*(%r\d+),\s*(%r\d+);", ptx)}
    products = set(re.findall(r"mul\.rn\.f32\s+(%r\d+),", ptx))

    def left_to_right(reg):
        first, second = adds[reg]
        return second in products and (first in products or (first in adds and left_to_right(first)))

    rounded = re.findall(r"cvt\.rn\.bf16x2\.f32\s+%r\d+,\s*(%r\d+),\s*(%r\d+);", ptx)
    rounded += [(reg,) for reg in re.findall(r"cvt\.rn\.bf16\.f32\s+%rs\d+,\s*(%r\d+);", ptx)]
    roots = [reg for regs in rounded for reg in regs if reg in adds]
    return len(roots), sum(not left_to_right(reg) for reg in roots)


def _allowance_key(kernel, constexprs):
    """The ``SPILL_ALLOWED`` key matching this launch, or None."""
    return next((key for key in SPILL_ALLOWED
                 if key[0] == kernel.__name__ and all(constexprs.get(k) == v for k, v in key[1])), None)


def main() -> int:
    JITFunction.run = _record
    launch.supported = lambda: True  # the launches an sm_90 GPU makes
    with torch.no_grad():
        record_launches()
        record_boundary_launches()
    jobs = [(k, *_signature(k, a, kw), {o: kw[o] for o in OPTIONS if o in kw}, _divisibility(k, a, kw))
            for k, a, kw in launches]
    jobs = list({repr(job): job for job in jobs}.values())  # launches alike compile once
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    target = GPUTarget("cuda", 90, 32)
    unused = set(SPILL_ALLOWED)
    for kernel, signature, constexprs, options, attrs in jobs:
        allowance = _allowance_key(kernel, constexprs)
        unused.discard(allowance)
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                  target=target, options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True,
                                   text=True, check=True).stdout
        print(kernel.__name__, next(line.strip() for line in usage.splitlines() if "REG:" in line),
              f"smem {compiled.metadata.shared} spill-allowed {SPILL_ALLOWED.get(allowance, 0)}"
              f" max-regs {options.get('maxnreg', 0)}")
        if kernel.__name__ == "_boundary_kernel":
            sums, unordered = unordered_sums(compiled.asm["ptx"])
            print(f"sum-order {kernel.__name__} sums {sums} unordered {unordered}")
    for name, values in sorted(unused):  # an allowance no launch uses any more must go
        print(f"unused-allowance {name} {dict(values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
