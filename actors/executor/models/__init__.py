"""Model code: one module per architecture family, selected by the HF architecture name."""
from .llama import LlamaConfig, LlamaForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}

__all__ = ["MODELS", "LlamaConfig", "LlamaForCausalLM"]
