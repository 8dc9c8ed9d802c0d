"""fp8chain integrations."""
