"""fp8chain: DeepSeek-V4.1 serving with FP8 activations kept between kernels (SGLang patchset)."""

__version__ = "0.1.0"
