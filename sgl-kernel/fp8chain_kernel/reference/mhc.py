"""Reference for fp8chain_kernel.mhc."""
