"""Model code: one module per architecture family, selected by the HF architecture name."""
from pagewire.model_info import SUPPORTED_ARCHITECTURES

from .llama import LlamaConfig, LlamaForCausalLM

# Every supported architecture is an option set of the one decoder (see model_config.py).
MODELS = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}

__all__ = ["MODELS", "LlamaConfig", "LlamaForCausalLM"]
