"""fp8chain layers."""
