"""fp8chain quantization."""
