"""fp8chain bench."""
