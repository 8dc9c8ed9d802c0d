"""Reference for fp8chain_kernel.gemm."""
