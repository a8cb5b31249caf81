"""LLaVA (LlavaForConditionalGeneration) on a tiny random config against transformers: the
vision tower and projector's image embeddings, and every position's logits of a prompt with
two images (their rows taken from the tower, the rest of the program the text model's), on
the torch reference and on each native CPU tier, float32."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire.testing.tiny_vision import make_tiny_llava, prefill_logits

IMAGE_TOKEN = 500
# the tower's output rows: (28 / 14)^2 = 4 patches an image, the class token dropped
PROMPT = [1, 20, 30] + [IMAGE_TOKEN] * 4 + [40, 50] + [IMAGE_TOKEN] * 4 + [60, 70, 80]


def make_llava(path: str, tokenizer_dir: str) -> str:
    return make_tiny_llava(path, tokenizer_dir, IMAGE_TOKEN)


def _hf(path: str):
    from transformers import LlavaForConditionalGeneration as HfLlava
    return HfLlava.from_pretrained(path, dtype=torch.float32).eval()


def test_the_tower_gives_transformers_image_features(tmp_path, smol_tokenizer_dir):
    path = make_llava(str(tmp_path / "m"), smol_tokenizer_dir)
    model = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=16).runner.model
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = model.encode_images(pixels)                              # [2, 4, 64]
        theirs = _hf(path).model.get_image_features(pixel_values=pixels)
    theirs = getattr(theirs, "pooler_output", theirs)
    theirs = torch.stack(list(theirs)) if isinstance(theirs, (list, tuple)) else theirs
    assert ours.shape == (2, 4, 64)
    assert float((ours - theirs.reshape(ours.shape)).abs().max()) < 1e-5


def test_every_positions_logits_with_two_images(tmp_path, smol_tokenizer_dir):
    _logits_with_two_images(tmp_path, smol_tokenizer_dir, "torch")


def test_every_positions_logits_with_two_images_on_each_tier(tmp_path, smol_tokenizer_dir,
                                                             tier):
    _logits_with_two_images(tmp_path, smol_tokenizer_dir, tier)


def _logits_with_two_images(tmp_path, smol_tokenizer_dir, kernels):
    """The prompt's image rows replaced by the tower's output (forward's `images`), a
    prefill through the paged cache: every position within 1e-4 of transformers' logits."""
    path = make_llava(str(tmp_path / "m"), smol_tokenizer_dir)
    runner = LLM(path, dtype="float32", kernels=kernels, block_size=16,
                 num_kv_blocks=16).runner
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([i for i, t in enumerate(PROMPT) if t == IMAGE_TOKEN])
    with torch.inference_mode():
        images = (rows, runner.model.encode_images(pixels).reshape(-1, 64))
        theirs = _hf(path)(input_ids=torch.tensor([PROMPT]), pixel_values=pixels).logits[0]
    worst = float((prefill_logits(runner, PROMPT, images) - theirs).abs().max())
    print(kernels, "max |logit difference|:", worst)
    assert worst < 1e-4
    # and the images matter: without them the image rows are token 500's embedding
    assert float((prefill_logits(runner, PROMPT) - theirs).abs().max()) > 1e-2


def _images():
    from PIL import Image
    rng = np.random.default_rng(5)
    return [Image.fromarray(rng.integers(0, 256, (40 + 8 * i, 36, 3), dtype=np.uint8))
            for i in range(2)]


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_generate_with_images_matches_transformers(tmp_path, smol_tokenizer_dir, kernels):
    """LLM.generate with multi_modal_data: the tokenizer's preparation (one placeholder an
    image widened to its 4 rows), the executor's image rows, greedy tokens equal to
    transformers' generate on the processor's pixels; the second image changes the answer."""
    from transformers import CLIPImageProcessor
    path = make_llava(str(tmp_path / "m"), smol_tokenizer_dir)
    llm = LLM(path, dtype="float32", kernels=kernels, block_size=16, num_kv_blocks=64)
    images = _images()
    short = [1, 20, 30, IMAGE_TOKEN, 40, 50, IMAGE_TOKEN, 60, 70, 80]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": short, "multi_modal_data": {"image": images}},
                       params)[0]
    assert out.prompt_token_ids == PROMPT                      # placeholders widened
    pixels = torch.from_numpy(CLIPImageProcessor.from_pretrained(path)(
        images=images, return_tensors="np")["pixel_values"])
    theirs = _hf(path).generate(input_ids=torch.tensor([PROMPT]), pixel_values=pixels,
                                max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    assert out.outputs[0].token_ids == theirs
    swapped = llm.generate({"prompt_token_ids": short,
                            "multi_modal_data": {"image": images[::-1]}}, params)[0]
    assert swapped.outputs[0].token_ids != theirs


def test_the_same_image_hits_the_caches_and_another_misses_them(tmp_path, smol_tokenizer_dir):
    """Block size 4: the prompt's blocks holding image rows are shared only when the images
    are the same (their digests are in the block hashes); the executor encodes an image once."""
    path = make_llava(str(tmp_path / "m"), smol_tokenizer_dir)
    llm = LLM(path, dtype="float32", kernels="torch", block_size=4, num_kv_blocks=64)
    first, second = _images()
    prompt = [1, 20, 30, IMAGE_TOKEN] + list(range(100, 110))
    params = SamplingParams(temperature=0, max_tokens=2)

    tables = llm.scheduler.tables

    def run(image):
        before = tables.prefix_hits
        out = llm.generate({"prompt_token_ids": prompt,
                            "multi_modal_data": {"image": image}}, params)[0]
        return out, tables.prefix_hits - before
    (a, _), (again, hit), (_, other_hit) = run(first), run(first), run(second)
    # 17 prompt tokens: blocks 0-3 full; the image's rows are tokens 3-6 (blocks 0 and 1)
    assert (hit, other_hit) == (16, 0)
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    encoder = llm.scheduler.encoder   # the second run computed no image row: nothing to encode
    assert (encoder.queries, encoder.hits, len(llm.runner.images.cache)) == (2, 0, 2)
    assert encoder.seconds > 0


def test_a_chunked_prefill_encodes_its_image_once(tmp_path, smol_tokenizer_dir):
    """Chunks of 5 tokens: the image's rows 3-6 fall in two chunks; the second reads the
    encoder cache, and the answer is the unchunked one's."""
    path = make_llava(str(tmp_path / "m"), smol_tokenizer_dir)
    prompt = {"prompt_token_ids": [1, 20, 30, IMAGE_TOKEN] + list(range(100, 110)),
              "multi_modal_data": {"image": _images()[0]}}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    whole = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64)
    chunked = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64,
                  max_num_batched_tokens=5, enable_prefix_caching=False)
    assert chunked.generate(prompt, params)[0].outputs[0].token_ids == \
        whole.generate(prompt, params)[0].outputs[0].token_ids
    encoder = chunked.scheduler.encoder
    assert (encoder.queries, encoder.hits) == (2, 1)


@pytest.mark.parametrize("prompt, images, message", [
    ([1, IMAGE_TOKEN, 2], [], "1 image placeholders and 0 images"),
    ([1, 2], [b"x"], "0 image placeholders and 1 images"),
    ([1, IMAGE_TOKEN, 2], [b"not an image"], "image 0 cannot be read"),
    ([1, IMAGE_TOKEN, IMAGE_TOKEN, 2], [b"x"], "a run of 2 placeholders"),
])
def test_bad_images_are_refused_by_name(tmp_path, smol_tokenizer_dir, prompt, images, message):
    path = make_llava(str(tmp_path / "m"), smol_tokenizer_dir)
    llm = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=16)
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": images}})


def test_a_decompression_bomb_is_refused_before_decoding(tmp_path, smol_tokenizer_dir):
    from PIL import Image
    import io
    buffer = io.BytesIO()
    Image.new("1", (10000, 10000)).save(buffer, format="PNG")     # a few KB, 100M pixels
    path = make_llava(str(tmp_path / "m"), smol_tokenizer_dir)
    llm = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=16)
    with pytest.raises(ValueError, match="over the limit"):
        llm.generate({"prompt_token_ids": [1, IMAGE_TOKEN],
                      "multi_modal_data": {"image": buffer.getvalue()}})


def test_a_text_model_takes_no_images(tiny_llama):
    llm = LLM(tiny_llama(), dtype="float32", kernels="torch", num_kv_blocks=64)
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": [b"x"]}})


def test_ngram_speculation_keeps_the_tokens(tmp_path, smol_tokenizer_dir):
    path = make_llava(str(tmp_path / "m"), smol_tokenizer_dir)
    prompt = {"prompt_token_ids": [1, IMAGE_TOKEN] + [7, 8, 9] * 6,
              "multi_modal_data": {"image": _images()[0]}}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64)
    drafted = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert drafted.generate(prompt, params)[0].outputs[0].token_ids == \
        plain.generate(prompt, params)[0].outputs[0].token_ids


def test_an_adapter_of_the_language_model_matches_transformers_merged(tmp_path,
                                                                     smol_tokenizer_dir):
    """A LoRA adapter of the text layers (named as transformers 5 saves LLaVA's language
    model), images in the prompt: transformers' tokens on the merged weights; a tensor of
    the vision tower is refused by name."""
    from transformers import CLIPImageProcessor

    from pagewire import LoRARequest
    from pagewire.lora_files import InvalidAdapter, read_adapter
    from pagewire.lora_names import shape
    from pagewire.model_info import resolve_model
    from tests.actors.test_lora import merge
    from tests.actors.test_lora_families import write_adapter
    path = make_llava(str(tmp_path / "m"), smol_tokenizer_dir)
    info = resolve_model(path)
    adapter = write_adapter(str(tmp_path / "a"), {
        f"base_model.model.model.language_model.layers.{i}.{part}.{proj}": shape(info, proj)
        for i in range(info.num_layers)
        for part, proj in (("self_attn", "q_proj"), ("self_attn", "v_proj"),
                           ("mlp", "down_proj"))})
    llm = LLM(path, dtype="float32", block_size=16, num_kv_blocks=64, enable_lora=True)
    images = _images()
    short = [1, 20, 30, IMAGE_TOKEN, 40, 50, IMAGE_TOKEN, 60, 70, 80]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": short, "multi_modal_data": {"image": images}},
                       params, lora_request=LoRARequest("a", 1, adapter))[0]
    pixels = torch.from_numpy(CLIPImageProcessor.from_pretrained(path)(
        images=images, return_tensors="np")["pixel_values"])
    hf = _hf(path)
    base = hf.generate(input_ids=torch.tensor([PROMPT]), pixel_values=pixels,
                       max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    merge(hf, adapter)
    theirs = hf.generate(input_ids=torch.tensor([PROMPT]), pixel_values=pixels,
                         max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    assert out.outputs[0].token_ids == theirs != base
    tower = write_adapter(str(tmp_path / "t"), {
        "base_model.model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj":
        (32, 32)})
    with pytest.raises(InvalidAdapter, match="vision_tower.* not a LoRA A or B of q/k/v/o"):
        read_adapter(tower, info, 16)


@pytest.mark.parametrize("options, what", [
    (dict(tensor_parallel_size=2, device="cpu"), "--tensor-parallel-size > 1"),
    (dict(kv_compress_rate=0.5, enable_prefix_caching=False), "--kv-compress-rate")])
def test_what_llava_cannot_do_yet_is_refused_by_name(tmp_path, smol_tokenizer_dir, options,
                                                     what):
    path = make_llava(str(tmp_path / "m"), smol_tokenizer_dir)
    with pytest.raises(ValueError, match=f"LlavaForConditionalGeneration with {re.escape(what)}"):
        LLM(path, dtype="float32", num_kv_blocks=16, **options)


def test_the_encoder_budget_splits_a_prompt_before_an_image(tmp_path, smol_tokenizer_dir):
    """A budget of 4 image rows: the second image's rows start the next step (the first
    step stops just before them); the answer is the unbudgeted one's."""
    path = make_llava(str(tmp_path / "m"), smol_tokenizer_dir)
    prompt = {"prompt_token_ids": [1, 20, 30, IMAGE_TOKEN, 40, 50, IMAGE_TOKEN, 60, 70, 80],
              "multi_modal_data": {"image": _images()}}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    whole = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64)
    budgeted = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64, encoder_budget=4)
    chunks = []
    schedule = budgeted.scheduler.schedule

    def recording(*args):
        planned = schedule(*args)
        if planned is not None:
            chunks.append([n for _, n in planned[1]])
        return planned
    budgeted.scheduler.schedule = recording
    assert budgeted.generate(prompt, params)[0].outputs[0].token_ids == \
        whole.generate(prompt, params)[0].outputs[0].token_ids
    assert chunks[:2] == [[9], [7]]          # 3 + 4 image + 2 rows, then 4 image + 3 rows


def test_the_encoder_budget_counts_an_image_where_its_first_row_runs():
    from types import SimpleNamespace

    from pagewire.scheduler.encoder_budget import EncoderBudget
    from pagewire.wire.multimodal import ImageInput

    def seq(planned, *offsets):
        images = [ImageInput(bytes([o]), o, 4, b"", [3, 1, 1]) for o in offsets]
        return SimpleNamespace(num_planned=planned, request=SimpleNamespace(images=images))
    budget = EncoderBudget(6)
    assert budget.cut(seq(0, 2, 10), 20) == 10          # the first fits, the second waits
    assert budget.cut(seq(0, 0), 4) == 0                 # 2 rows left: an image of 4 waits
    assert budget.cut(seq(3, 2), 5) == 5                 # started earlier: not counted again
    alone = EncoderBudget(2)
    assert alone.cut(seq(0, 1), 8) == 8                  # larger than the budget: alone
