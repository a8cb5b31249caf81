"""--quantization at load against the float checkpoint and the GGUF file it came from.

    python bench/quantize_at_load.py [--rounds 2]

The default model's GGUF is read by transformers (its dequantization) and saved as a float32
Hugging Face directory (cached in /tmp/pagewire-bench-hf); then, one engine per format, all
alive at once and measured in alternation: the GGUF file itself, the float32 directory, and
the directory with --quantization int8 and int4. For each: perplexity on
bench/data/declaration.txt (teacher-forced, 256-token chunks), single-stream decode (128
random prompt tokens, 128 greedy tokens) and 64 such requests at once, output tokens/s.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import time

from pagewire import LLM, SamplingParams
from pagewire.model_info import DEFAULT_MODEL_FILE, default_model_path

HF_DIR = "/tmp/pagewire-bench-hf"
TEXT = os.path.join(os.path.dirname(__file__), "data", "declaration.txt")


def float_checkpoint() -> str:
    if not os.path.isfile(os.path.join(HF_DIR, "config.json")):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        src = os.path.dirname(default_model_path())
        read = AutoModelForCausalLM.from_pretrained(src, gguf_file=DEFAULT_MODEL_FILE,
                                                    dtype=torch.float32)
        config = read.config                # a GGUF-read model will not save itself
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(read.state_dict())
        plain.save_pretrained(HF_DIR)
        AutoTokenizer.from_pretrained(src, gguf_file=DEFAULT_MODEL_FILE).save_pretrained(HF_DIR)
    return HF_DIR


def perplexity(llm: LLM, ids: list[int]) -> float:
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    lps = [t.logprob for t in out.prompt_logprobs[1:]]
    return math.exp(-sum(lps) / len(lps))


def rate(llm: LLM, prompts: list[list[int]]) -> float:
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    hf = float_checkpoint()
    kw = dict(max_model_len=2048, kv_cache_memory=2**30, enable_prefix_caching=False,
              max_num_batched_tokens=256)
    engines = {"gguf": LLM(**kw), "hf float32": LLM(hf, dtype="float32", **kw),
               "hf int8": LLM(hf, dtype="float32", quantization="int8", **kw),
               "hf int4": LLM(hf, dtype="float32", quantization="int4", **kw)}
    ids = engines["gguf"].tokenizer.encode(open(TEXT).read())
    for name, llm in engines.items():
        print(f"{name}: perplexity {perplexity(llm, ids):.3f}", flush=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(64)]
    for r in range(args.rounds):
        single = {name: rate(llm, prompts[:1]) for name, llm in engines.items()}
        many = {name: rate(llm, prompts) for name, llm in engines.items()}
        print(f"round {r}: " + "; ".join(
            f"{name} single {single[name]:.1f} / 64 at once {many[name]:.1f} tok/s"
            for name in engines), flush=True)


if __name__ == "__main__":
    main()
