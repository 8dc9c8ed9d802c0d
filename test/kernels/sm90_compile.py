"""Compile Triton kernels (attention, the mHC boundary) for Hopper (sm_90) without a GPU and print each one's resource usage.

Run as a script in a process without TRITON_INTERPRET (the interpreter replaces @triton.jit):
``python test/kernels/sm90_compile.py`` prints ``name REG:.. STACK:.. LOCAL:..`` per kernel and
exits non-zero on a compile error. It catches what the CPU interpreter accepts but the compiler
rejects (branch-local shapes, dot shapes, layouts), and register spills (LOCAL > 0).
"""

import os
import subprocess
import sys
import tempfile

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import fp8chain_kernel.attention as attention  # noqa: E402
import fp8chain_kernel.mhc as mhc  # noqa: E402

PTR, I32, F32, CX = "*fp32", "i32", "fp32", "constexpr"

# (kernel, signature, constexpr values, num_warps) at DSv4.1-Flash shapes (D = 512, rd = 64).
KERNELS = [
    (attention._rope_qkv_kernel,
     dict(q_ptr="*bf16", kv_ptr="*bf16", cos_ptr=PTR, sin_ptr=PTR, out_ptr=PTR, cache_ptr="*bf16",
          slot_ptr="*i64", pos_ptr="*i64", NH=I32, D=I32, eps=F32, stride_qt=I32, stride_kvt=I32,
          stride_ot=I32, stride_oh=I32, stride_cs=I32, stride_cl=I32, HALF=CX, BLOCK_H=CX, BLOCK_D=CX,
          BLOCK_HALF=CX, EXACT_CAST=CX),
     dict(HALF=32, BLOCK_H=16, BLOCK_D=512, BLOCK_HALF=32, EXACT_CAST=False), 8),
    (attention._mqa_split_kernel,
     dict(q_ptr=PTR, kv_ptr="*bf16", slot_ptr="*i64", pos_ptr="*i64", part_o_ptr=PTR, part_ml_ptr=PTR,
          NH=I32, D=I32, L=I32, scale=F32, stride_qt=I32, stride_qh=I32, stride_ks=I32, stride_kl=I32,
          SPLITS=CX, STEPS=CX, BLOCK_H=CX, BLOCK_L=CX, BLOCK_D=CX),
     dict(SPLITS=16, STEPS=4, BLOCK_H=16, BLOCK_L=16, BLOCK_D=512), 8),
    (attention._mqa_merge_kernel,
     dict(part_o_ptr=PTR, part_ml_ptr=PTR, sink_ptr=PTR, cos_ptr=PTR, sin_ptr=PTR, pos_ptr="*i64",
          o_ptr="*bf16", NH=I32, D=I32, stride_ot=I32, stride_oh=I32, SPLITS=CX, HALF=CX, BLOCK_H=CX,
          BLOCK_D=CX, BLOCK_HALF=CX, EXACT_CAST=CX),
     dict(SPLITS=16, HALF=32, BLOCK_H=16, BLOCK_D=512, BLOCK_HALF=32, EXACT_CAST=False), 8),
]
_BOUNDARY_SIGNATURE = dict(
    y_ptr="*bf16", r_ptr="*bf16", pre_ptr=PTR, post_ptr=PTR, comb_ptr=PTR, w_ptr="*bf16", rout_ptr="*bf16",
    x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*i32", T=I32, H=I32, eps=F32,
    **{name: I32 for name in ("stride_yt", "stride_rt", "stride_rs", "stride_et", "stride_ek", "stride_pt",
                              "stride_pk", "stride_ct", "stride_ci", "stride_cj", "stride_ot", "stride_os",
                              "stride_xt", "stride_qt", "stride_sm", "stride_sg")},
    **{name: CX for name in ("DO_POST", "DO_NORM", "STORE_X", "QUANT", "BM", "SLICE", "BLOCK", "BLOCK1",
                             "CHUNKS1", "GROUP", "POW2", "PACKED", "EXACT_CAST")})
# The mHC boundary as configured on a GPU (one row per program) at T = 1 (40 slices of 128
# columns) and T = 2048 (whole 5120-column rows), H = 5120, writing the packed Blackwell pair.
for slice_, block in ((128, 128), (5120, 1024)):
    KERNELS.append((mhc._boundary_kernel, _BOUNDARY_SIGNATURE,
                    dict(DO_POST=True, DO_NORM=True, STORE_X=True, QUANT=True, BM=1, SLICE=slice_, BLOCK=block,
                         BLOCK1=1024, CHUNKS1=5, GROUP=32, POW2=True, PACKED=True, EXACT_CAST=False), 4))


def main() -> int:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    target = GPUTarget("cuda", 90, 32)
    for kernel, signature, constexprs, warps in KERNELS:
        options = {"num_warps": warps}
        if kernel is mhc._boundary_kernel:
            options["enable_fp_fusion"] = False  # as launched: sums in the reference's order
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=target, options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True,
                                   text=True, check=True).stdout
        line = next(l.strip() for l in usage.splitlines() if "REG:" in l)
        print(kernel.__name__, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
