"""fp8chain models."""
