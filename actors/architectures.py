"""The architectures pagewire serves, by what they are (names only, no torch): the decoders
the executor's model code implements, the pooling-only ones, those with images, experts or the
GPT family's blocks, and GGUF's names for them. model_info.py checks a model against these
(and re-exports them, where most code imports them from)."""
from __future__ import annotations

# The Hugging Face architectures the executor's model code implements (executor/models'
# MODELS maps each to its class), kept here so the supervisor can check without importing
# torch.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Phi3ForCausalLM", "GemmaForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                           "GPTNeoXForCausalLM", "GPT2LMHeadModel", "GPTJForCausalLM",
                           "PhiForCausalLM", "Starcoder2ForCausalLM",
                           "GptOssForCausalLM", "LlavaForConditionalGeneration",
                           "Idefics3ForConditionalGeneration",
                           "Qwen2_5_VLForConditionalGeneration", "Gemma3ForConditionalGeneration")
# Encoder-only models (bidirectional attention, no KV cache): pooling only
# (executor/models/encoder.py), their classifiers (cross-encoders, rerankers) and token
# classifiers too.
ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification", "RobertaModel",
                         "RobertaForSequenceClassification", "XLMRobertaModel",
                         "XLMRobertaForSequenceClassification", "MPNetModel",
                         "MPNetForSequenceClassification", "ModernBertModel",
                         "ModernBertForSequenceClassification", "NomicBertModel",
                         # taggers: every token's labels (task token_classify)
                         "BertForTokenClassification", "RobertaForTokenClassification",
                         "XLMRobertaForTokenClassification", "MPNetForTokenClassification",
                         "ModernBertForTokenClassification")
# Text and image towers embedding into one space (executor/models/clip.py): pooling only, no
# KV cache, as the encoders.
CLIP_ARCHITECTURES = ("CLIPModel",)
# Causal LMs with a classifier's score head in place of the LM head (reward models,
# rerankers): the same decoder (executor/models/llama.py), the head's rows one per label.
DECODER_CLASSIFIERS = {f"{family}ForSequenceClassification": f"{family}ForCausalLM"
                       for family in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2")}
# Those that take images (a vision tower beside the language model: executor/models/vision_language.py).
VISION_ARCHITECTURES = ("LlavaForConditionalGeneration", "Idefics3ForConditionalGeneration",
                        "Qwen2_5_VLForConditionalGeneration", "Gemma3ForConditionalGeneration")
# Those whose image tokens attend each other both ways within one image during prefill
# (Gemma 3): a prefill chunk holds an image whole (scheduler/encoder_budget.py), and an image
# longer than the step's token budget is refused.
WHOLE_IMAGE_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
# The GPT family's: LayerNorms, plain MLPs, parallel residuals, learned positions.
GPT_ARCHITECTURES = ("GPTNeoXForCausalLM", "GPT2LMHeadModel", "GPTJForCausalLM",
                     "PhiForCausalLM", "Starcoder2ForCausalLM")
# Those whose every head has its own keys and values, whatever num_key_value_heads says.
MULTI_HEAD_ARCHITECTURES = ("GPTNeoXForCausalLM", "GPT2LMHeadModel", "GPTJForCausalLM")
# Those whose MLPs are mixtures of experts (executor/models/moe.py).
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                     "OlmoeForCausalLM", "GptOssForCausalLM")
# GGUF general.architecture -> the Hugging Face architecture of the same model.
# (llama.cpp keeps Mixtral as "llama" with experts: gguf_architecture tells them apart.)
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM",
                      "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                      "olmoe": "OlmoeForCausalLM", "gptneox": "GPTNeoXForCausalLM",
                      "gpt2": "GPT2LMHeadModel", "phi2": "PhiForCausalLM",
                      "starcoder2": "Starcoder2ForCausalLM", "gpt-oss": "GptOssForCausalLM",
                      # embedding models (gguf_bert.py)
                      "bert": "BertModel", "nomic-bert": "NomicBertModel"}
