"""Model code: one module per architecture family, selected by the HF architecture name."""
from pagewire.model_info import DECODER_CLASSIFIERS, SUPPORTED_ARCHITECTURES, VISION_ARCHITECTURES

from .llama import LlamaConfig, LlamaForCausalLM
from .vision_language import VisionLanguageModel

# Every supported architecture is an option set of the one decoder (see model_config.py);
# the vision ones add a tower beside it.
MODELS = {name: VisionLanguageModel if name in VISION_ARCHITECTURES else LlamaForCausalLM
          for name in SUPPORTED_ARCHITECTURES}
MODELS.update(dict.fromkeys(DECODER_CLASSIFIERS, LlamaForCausalLM))   # a score head in place

__all__ = ["MODELS", "LlamaConfig", "LlamaForCausalLM"]
