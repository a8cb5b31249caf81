"""Idefics3 (SmolVLM's architecture) on a tiny random config against transformers: the SigLIP
tower, pixel shuffle and projection's rows for each tile, and every position's logits of a
prompt whose image is split into tiles (each tile's rows where its placeholders are)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire import LLM
from pagewire.testing.tiny_vision import make_tiny_idefics3, prefill_logits

IMAGE_TOKEN = 500


def _hf(path: str):
    from transformers import Idefics3ForConditionalGeneration
    return Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _tiles(n: int) -> torch.Tensor:
    return torch.randn(1, n, 3, 32, 32, generator=torch.Generator().manual_seed(n))


def test_each_tiles_rows_are_transformers_image_features(tmp_path, smol_tokenizer_dir):
    path = make_tiny_idefics3(str(tmp_path / "m"), smol_tokenizer_dir)
    model = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64).runner.model
    pixels = _tiles(3)
    with torch.inference_mode():
        ours = model.encode_images(pixels[0])                          # [3, 4, 64]
        theirs = _hf(path).model.get_image_features(pixel_values=pixels)
    theirs = getattr(theirs, "pooler_output", theirs)
    theirs = torch.cat(list(theirs)) if isinstance(theirs, (list, tuple)) else theirs
    assert ours.shape == (3, 4, 64)
    assert float((ours.reshape(-1, 64) - theirs.reshape(-1, 64)).abs().max()) < 1e-5


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_every_positions_logits_with_a_tiled_image(tmp_path, smol_tokenizer_dir, kernels):
    path = make_tiny_idefics3(str(tmp_path / "m"), smol_tokenizer_dir)
    runner = LLM(path, dtype="float32", kernels=kernels, block_size=16,
                 num_kv_blocks=64).runner
    pixels = _tiles(3)
    prompt = [1, 20]
    for _ in range(3):                      # a tile: its marker tokens, then its four rows
        prompt += [30, 31] + [IMAGE_TOKEN] * 4
    prompt += [40, 41, 42]
    rows = torch.tensor([i for i, t in enumerate(prompt) if t == IMAGE_TOKEN])
    with torch.inference_mode():
        images = (rows, runner.model.encode_images(pixels[0]).reshape(-1, 64))
        theirs = _hf(path)(input_ids=torch.tensor([prompt]), pixel_values=pixels).logits[0]
    worst = float((prefill_logits(runner, prompt, images) - theirs).abs().max())
    print(kernels, "max |logit difference|:", worst)
    assert worst < 1e-4


def _image(height: int, width: int):
    from PIL import Image
    pixels = np.random.default_rng(height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize("size", [(50, 70), (20, 24)], ids=["tiled", "global-only"])
def test_generate_with_a_tiled_image_matches_transformers(tmp_path, smol_tokenizer_dir, size):
    """The tokenizer's Idefics3 prompt string (transformers' processor's, with this
    tokenizer's image token), a tile an encoder input, and greedy tokens equal to
    transformers' generate on the same ids and its image processor's tiles."""
    from transformers import AutoTokenizer, Idefics3ImageProcessor, Idefics3Processor
    from pagewire import SamplingParams
    path = make_tiny_idefics3(str(tmp_path / "m"), smol_tokenizer_dir, image_token=3,
                              vocab_size=49152)
    image = _image(*size)
    llm = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64)
    out = llm.generate({"prompt": "Look: <repo_name> What is it?",
                        "multi_modal_data": {"image": image}},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    processor = Idefics3ImageProcessor.from_pretrained(path)
    tiles = processor(images=[[image]], return_tensors="pt", return_row_col_info=True)
    reference = Idefics3Processor(processor, AutoTokenizer.from_pretrained(path), image_seq_len=4)
    text = reference.replace_image_token(tiles, 0).replace("<image>", "<repo_name>")
    assert llm.tokenizer.decode(out.prompt_token_ids) == \
        llm.tokenizer.decode(llm.tokenizer.encode("Look: " + text + " What is it?"))
    theirs = _hf(path).generate(input_ids=torch.tensor([out.prompt_token_ids]),
                                pixel_values=tiles["pixel_values"], max_new_tokens=6,
                                do_sample=False)[0, len(out.prompt_token_ids):].tolist()
    assert out.outputs[0].token_ids == theirs
