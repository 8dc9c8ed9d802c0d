"""fp8chain models: DeepSeek-V4.1 with the FP8 chain, its checkpoints and an fp32 reference."""

from .deepseek_v41 import (
    DeepseekV41Config, DeepseekV41DecoderLayer, DeepseekV41ForCausalLM, DeepseekV41MoE,
    DeepseekV41Reference, MQALayer,
)

__all__ = [
    "DeepseekV41Config", "DeepseekV41DecoderLayer", "DeepseekV41ForCausalLM", "DeepseekV41MoE",
    "DeepseekV41Reference", "MQALayer",
]
