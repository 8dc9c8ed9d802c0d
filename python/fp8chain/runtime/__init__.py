"""fp8chain runtime."""
