"""Time to first token of a one-image chat on random weights of SmolVLM-256M's shape
(Idefics3: SigLIP 12 x 768 over 512-pixel tiles of 16-pixel patches, pixel shuffle 4: 64 rows
a tile; SmolLM2-135M's language model), bfloat16, the default tokenizer with Idefics3's image
tokens added. Three cases, each the median of --runs:

    miss       a new image: the tower encodes it, the prompt prefills whole
    encoder    the same image after other text: the encoder cache has it, the prefix cache
               does not (the image's blocks follow different text)
    prefix     the same image and text before it: its blocks come from the prefix cache

    python bench/vision.py [--runs 3] [--side 512] [--out DIR]

The processor (longest edge 1024 in 512-pixel tiles) resizes a 512-pixel image to 1024 and
splits it into 2 x 2 tiles plus the global one: 5 encoder inputs of 64 rows. Printed beside each case: the tiles encoded and the seconds in the tower (the
scheduler's encoder totals).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

SMOLVLM_256M = {
    "vision_config": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                          num_attention_heads=12, image_size=512, patch_size=16),
    "text_config": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
                        rope_theta=100000.0, max_position_embeddings=8192,
                        tie_word_embeddings=False),
    "scale_factor": 4}
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]


def write_model(path: str) -> str:
    """The random bfloat16 directory, written once."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return write_processor(path)
    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessor)

    from pagewire.hf_tokenizer import load_tokenizer
    from pagewire.model_info import resolve_model
    tokenizer = load_tokenizer(resolve_model(None))
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    cfg = json.loads(json.dumps(SMOLVLM_256M))
    cfg["text_config"].update(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2)
    config = Idefics3Config(**cfg, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    Idefics3ImageProcessor(size={"longest_edge": 1024},
                           max_image_size={"longest_edge": 512}).save_pretrained(path)
    return write_processor(path)


def write_processor(path: str) -> str:
    """Idefics3's processor settings beside the image processor's (vLLM reads the image
    rows a tile from them: 64 here, (512 / 16)^2 / 4^2), written once."""
    if not os.path.exists(os.path.join(path, "processor_config.json")):
        from transformers import AutoImageProcessor, AutoTokenizer, Idefics3Processor
        Idefics3Processor(AutoImageProcessor.from_pretrained(path),
                          AutoTokenizer.from_pretrained(path),
                          image_seq_len=64).save_pretrained(path)
    return path


def image(seed: int, side: int):
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def ttft(llm, before: str, picture) -> tuple[float, int, float]:
    """(seconds to the first token, tiles encoded, seconds in the tower)"""
    from pagewire import SamplingParams
    encoder = llm.scheduler.encoder
    queries, hits, seconds = encoder.queries, encoder.hits, encoder.seconds
    start = time.perf_counter()
    llm.generate({"prompt": f"<|im_start|>User:{before}<image>Describe it.<|im_end|>\n"
                            "<|im_start|>Assistant:", "multi_modal_data": {"image": picture}},
                 SamplingParams(temperature=0, max_tokens=1))
    elapsed, encoder = time.perf_counter() - start, llm.scheduler.encoder
    return elapsed, (encoder.queries - queries) - (encoder.hits - hits), \
        encoder.seconds - seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--side", type=int, default=512)
    ap.add_argument("--out", default=os.path.expanduser(
        "~/.cache/pagewire/bench-models/smolvlm-256m-bf16"))
    args = ap.parse_args()
    from pagewire import LLM
    llm = LLM(write_model(args.out), dtype="bfloat16", max_model_len=4096)
    side = args.side
    ttft(llm, "", image(999, side))                          # warm: kernels built, pages
    cases = {"miss": [], "encoder": [], "prefix": []}
    for run in range(args.runs):
        picture = image(run, side)
        cases["miss"].append(ttft(llm, f" run {run}.", picture))
        cases["encoder"].append(ttft(llm, f" another {run}.", picture))
        cases["prefix"].append(ttft(llm, f" another {run}.", picture))
    print(f"SmolVLM-256M shape, bfloat16, {side}-pixel images; backend "
          f"{llm.runner.backend.ops.backend}")
    for name, runs in cases.items():
        times = [t for t, _, _ in runs]
        print(f"  {name:8s} TTFT {statistics.median(times) * 1000:8.1f} ms (runs: "
              f"{', '.join(f'{t * 1000:.0f}' for t in times)}); tiles encoded {runs[-1][1]}, "
              f"{runs[-1][2] * 1000:.0f} ms in the tower")


if __name__ == "__main__":
    main()
