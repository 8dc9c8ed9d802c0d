"""Quantization configs and linear methods (SGLang's names).

``get_quantization_config(hf_config)`` reads a checkpoint's ``quantization_config`` (a dict, or an
object with that attribute, e.g. a transformers config) and returns the matching config, or None
for an unquantized checkpoint.
"""

from __future__ import annotations

from .fp8 import Fp8Config, Fp8LinearMethod

QUANTIZATION_METHODS = {"fp8": Fp8Config}

__all__ = ["Fp8Config", "Fp8LinearMethod", "QUANTIZATION_METHODS", "get_quantization_config"]


def get_quantization_config(config) -> Fp8Config | None:
    """The quantization config of a model config (dict or object), or None when absent."""
    if config is None:
        return None
    if isinstance(config, dict):
        qc = config.get("quantization_config", config if "quant_method" in config else None)
    else:
        qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = dict(qc.to_dict() if hasattr(qc, "to_dict") else vars(qc))
    method = qc.get("quant_method")
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unsupported quant_method {method!r}; supported: {sorted(QUANTIZATION_METHODS)}")
    return QUANTIZATION_METHODS[method].from_config(qc)
