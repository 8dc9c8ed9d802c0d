"""Integrations of fp8chain into serving engines."""
