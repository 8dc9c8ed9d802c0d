"""Quantization configs and linear methods (SGLang's names).

``get_quantization_config(hf_config)`` reads a checkpoint's ``quantization_config`` (a dict, or an
object with that attribute, e.g. a transformers config) and returns the matching config, or None
for an unquantized checkpoint. Given a method name instead (``"fp8"``), it returns that method's
config class, as upstream's ``get_quantization_config(quantization: str)`` does.
"""

from __future__ import annotations

from .fp8 import Fp8Config, Fp8LinearMethod

QUANTIZATION_METHODS = {"fp8": Fp8Config}

__all__ = ["Fp8Config", "Fp8LinearMethod", "QUANTIZATION_METHODS", "get_quantization_config"]


def _config_class(method) -> type[Fp8Config]:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unsupported quant_method {method!r}; supported: {sorted(QUANTIZATION_METHODS)}")
    return QUANTIZATION_METHODS[method]


def get_quantization_config(config) -> Fp8Config | type[Fp8Config] | None:
    """The quantization config of a model config (dict or object), or None when absent; the
    config class of a method name (``ValueError`` for a name not in ``QUANTIZATION_METHODS``)."""
    if isinstance(config, str):
        return _config_class(config)
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
    return _config_class(qc.get("quant_method")).from_config(qc)
