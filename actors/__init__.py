"""pagewire: an actor-based LLM serving engine.

    from pagewire import LLM, SamplingParams
    llm = LLM()                      # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
"""
from pagewire.wire.sampling_params import InvalidParam, SamplingParams
from pagewire.wire.structured import InvalidConstraint, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch; import it only when asked so `import pagewire` stays light for the
    # actors that never load a model.
    if name in ("LLM", "RequestOutput", "CompletionOutput", "StreamingInput"):
        from . import llm
        return getattr(llm, name)
    if name == "LoRARequest":
        from .lora_files import LoRARequest
        return LoRARequest
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "StreamingInput", "SamplingParams", "StructuredOutputsParams",
           "InvalidParam", "InvalidConstraint", "__version__"]
