"""Model code: one module per architecture family, selected by the HF architecture name."""
from pagewire.model_info import SUPPORTED_ARCHITECTURES

from .llama import LlamaConfig, LlamaForCausalLM
from .llava import LlavaForConditionalGeneration

# Every supported architecture is an option set of the one decoder (see model_config.py);
# LLaVA adds a vision tower beside it.
MODELS = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}
MODELS["LlavaForConditionalGeneration"] = LlavaForConditionalGeneration

__all__ = ["MODELS", "LlamaConfig", "LlamaForCausalLM"]
