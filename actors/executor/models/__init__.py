"""Model code: one module per architecture family, selected by the HF architecture name."""
from .llama import LlamaConfig, LlamaForCausalLM

# Every supported architecture is an option set of the one decoder (see config.py).
MODELS = {name: LlamaForCausalLM for name in (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
    "GPTNeoXForCausalLM", "GPT2LMHeadModel", "GptOssForCausalLM")}

__all__ = ["MODELS", "LlamaConfig", "LlamaForCausalLM"]
