"""A GGUF language model with llama.cpp's mmproj file (--mmproj): the tiny LLaVA and Idefics3
written as llama.cpp ships them (text GGUF + mmproj GGUF, float32, from the same random
weights as their Hugging Face directories) give the directory model's tower outputs and
greedy tokens; a mmproj that does not fit is refused by name."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire.gguf_header import read_gguf_header
from pagewire.model_info import default_model_path
from pagewire.testing.gguf_writer import TOKENIZER_KEYS
from pagewire.testing.mmproj_writer import write_llama_cpp_pair
from pagewire.testing.tiny_vision import make_tiny_idefics3, make_tiny_llava
from pagewire.testing.real_shapes import cut_tokenizer
from tests.helpers import use_private_cache

IMAGE_TOKEN = 3           # the vocabulary entry the GGUF's tokenizer calls <image>
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def small_vocab() -> dict:
    """The default model's GGUF tokenizer cut to its first 512 tokens (a valid byte-level
    BPE: converted in a fraction of the full one's seconds), token 3 named <image>."""
    meta = read_gguf_header(default_model_path()).metadata
    return cut_tokenizer({k: meta[k] for k in TOKENIZER_KEYS if k in meta})


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, small_vocab, smol_tokenizer_dir) -> dict:
    """{"llava" | "idefics3": (HF directory, text GGUF, mmproj GGUF)}."""
    root = tmp_path_factory.mktemp("mmproj")
    out = {}
    for name, make in (("llava", make_tiny_llava), ("idefics3", make_tiny_idefics3)):
        hf = make(str(root / name), smol_tokenizer_dir, image_token=IMAGE_TOKEN)
        out[name] = (hf, *write_llama_cpp_pair(hf, str(root / f"{name}.gguf"),
                                               str(root / f"mmproj-{name}.gguf"), small_vocab,
                                               image_token=IMAGE_TOKEN))
    return out


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    use_private_cache(tmp_path, monkeypatch)


def _gguf_llm(pair) -> LLM:
    _, text, mmproj = pair
    return LLM(text, mmproj=mmproj, dtype="float32", kernels="torch", num_kv_blocks=64)


def _image(width: int, height: int):
    from PIL import Image
    pixels = np.random.default_rng(width).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize("name,side", [("llava", 28), ("idefics3", 32)])
def test_the_towers_rows_are_the_directory_models(pairs, name, side):
    hf, _, _ = pairs[name]
    ours = _gguf_llm(pairs[name]).runner.model
    theirs = LLM(hf, dtype="float32", kernels="torch", num_kv_blocks=64).runner.model
    pixels = torch.randn(3, 3, side, side, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got, want = ours.encode_images(pixels), theirs.encode_images(pixels)
    assert got.shape == (3, 4, 64)
    assert torch.equal(got, want)


def test_llava_greedy_tokens_are_the_directory_models(pairs):
    """An image of the tower's size is the same pixels both ways (no resize; the same
    normalization), so the answers are the same tokens."""
    hf, _, _ = pairs["llava"]
    prompt = {"prompt_token_ids": [1, 20, IMAGE_TOKEN, 30, 40],
              "multi_modal_data": {"image": _image(28, 28)}}
    ours = _gguf_llm(pairs["llava"]).generate(prompt, GREEDY)[0]
    theirs = LLM(hf, dtype="float32", kernels="torch", num_kv_blocks=64).generate(prompt,
                                                                                 GREEDY)[0]
    assert ours.prompt_token_ids == [1, 20] + [IMAGE_TOKEN] * 4 + [30, 40]
    assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids


def test_idefics3_greedy_tokens_are_transformers(pairs):
    """llama.cpp's tiling of a 40 x 30 image (to 64 x 48, then 64 x 64: two by two tiles of
    32, and the global tile) is what transformers' processor makes of it; the prompt holds Idefics3's
    text around them and the answer is transformers' generate on the same ids and tiles."""
    from transformers import Idefics3ForConditionalGeneration, Idefics3ImageProcessor
    hf, _, _ = pairs["idefics3"]
    image = _image(40, 30)
    llm = _gguf_llm(pairs["idefics3"])
    out = llm.generate({"prompt": "Look: <image> What?", "multi_modal_data": {"image": image}},
                       GREEDY)[0]
    tiles = Idefics3ImageProcessor.from_pretrained(hf)(images=[[image]], return_tensors="pt",
                                                       return_row_col_info=True)
    assert (tiles["rows"][0][0], tiles["cols"][0][0]) == (2, 2)
    assert out.prompt_token_ids.count(IMAGE_TOKEN) == 5 * 4
    model = Idefics3ForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
    theirs = model.generate(input_ids=torch.tensor([out.prompt_token_ids]),
                            pixel_values=tiles["pixel_values"], max_new_tokens=6,
                            do_sample=False)[0, len(out.prompt_token_ids):].tolist()
    assert out.outputs[0].token_ids == theirs


def _mmproj(pair, path: str, **options) -> str:
    """The pair's tower written again with `options` (mmproj_writer.write_mmproj's)."""
    import json
    import os

    from safetensors.torch import load_file

    from pagewire.testing.mmproj_writer import write_mmproj
    hf = pair[0]
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    state = options.pop("state", None) or load_file(os.path.join(hf, "model.safetensors"))
    return write_mmproj(path, hf, cfg, state, **options)


def test_a_mmproj_that_does_not_fit_is_refused_by_name(pairs, tmp_path, small_vocab):
    from safetensors.torch import load_file

    from pagewire.model_info import resolve_model
    hf, text, mmproj = pairs["llava"]
    narrow = load_file(f"{hf}/model.safetensors")
    narrow["multi_modal_projector.linear_2.weight"] = \
        narrow["multi_modal_projector.linear_2.weight"][:32]
    cases = [
        (hf, mmproj, "is a Hugging Face directory"),
        (text, text, "not a mmproj file (general.architecture is 'llama'"),
        (text, _mmproj(pairs["llava"], str(tmp_path / "ldp.gguf"), projector="ldp"),
         "projector type 'ldp' is not supported (supported: mlp, idefics3)"),
        (text, _mmproj(pairs["llava"], str(tmp_path / "cut.gguf"), drop=("mm.2.weight",)),
         "tensor 'mm.2.weight' is missing"),
        (text, _mmproj(pairs["llava"], str(tmp_path / "narrow.gguf"), state=narrow),
         "gives rows of width 32, the language model"),
        (text, str(tmp_path / "absent.gguf"), "no mmproj file at"),
    ]
    for model, tower, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            resolve_model(model, tower)
    plain = write_llama_cpp_pair(hf, str(tmp_path / "plain.gguf"), str(tmp_path / "p.gguf"),
                                 small_vocab)[0]
    with pytest.raises(ValueError, match="the vocabulary has no <image> token"):
        resolve_model(plain, mmproj)


def test_llava_images_are_letterboxed_as_llama_cpp_does():
    """40 x 20 -> 28 x 14 (bicubic), centred on a 28 x 28 square of LLaVA's grey (rows 7-20);
    an image of the tower's size is kept as it is."""
    from PIL import Image

    from pagewire.gguf_image_inputs import LLAVA_PAD, letterboxed
    image = _image(40, 20)
    out = np.asarray(letterboxed(image, 28))
    inner = np.asarray(image.resize((28, 14), Image.Resampling.BICUBIC))
    assert out.shape == (28, 28, 3)
    assert (out[:7] == LLAVA_PAD).all() and (out[21:] == LLAVA_PAD).all()
    assert np.array_equal(out[7:21], inner)
    same = _image(28, 28)
    assert letterboxed(same, 28) is same


def test_a_float16_mmproj_gives_the_rows_within_its_rounding(pairs, tmp_path):
    """The files llama.cpp ships keep the tower's matrices (and the 4-D patch embedding) in
    float16: read and widened, the rows stay within float16's rounding of the weights."""
    hf, text, _ = pairs["idefics3"]
    tower = _mmproj(pairs["idefics3"], str(tmp_path / "f16.gguf"), f16=True)
    ours = LLM(text, mmproj=tower, dtype="float32", kernels="torch",
               num_kv_blocks=64).runner.model
    theirs = LLM(hf, dtype="float32", kernels="torch", num_kv_blocks=64).runner.model
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got, want = ours.encode_images(pixels), theirs.encode_images(pixels)
    worst = float((got - want).abs().max() / want.abs().max())
    print("float16 mmproj: max |difference| / max |row value|:", worst)
    assert 0 < worst < 1e-2
