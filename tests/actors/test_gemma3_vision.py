"""Gemma 3 (Gemma3ForConditionalGeneration) on a tiny random config against transformers: the
SigLIP tower, average pool, soft-embedding norm and projection's rows; every position's
logits of a prompt with two images, whose tokens attend their own image both ways (the
prefill's per-query key limits) under a sliding layer and a global one; and greedy
generation through LLM.generate, whole and in small chunks that never split an image."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire import LLM
from pagewire.testing.tiny_vision import make_tiny_gemma3, prefill_logits

IMAGE, BOI, EOI = 500, 498, 499
# four rows an image (mm_tokens_per_image 4): each between its boi and eoi
PROMPT = [1, 20, 30, BOI] + [IMAGE] * 4 + [EOI, 40, 50, BOI] + [IMAGE] * 4 + [EOI, 60, 70]


def _hf(path: str):
    from transformers import Gemma3ForConditionalGeneration
    return Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _pixels(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(n))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, smol_tokenizer_dir) -> str:
    return make_tiny_gemma3(str(tmp_path_factory.mktemp("gemma3")), smol_tokenizer_dir)


def test_the_tower_gives_transformers_image_features(gemma3):
    model = LLM(gemma3, dtype="float32", kernels="torch", num_kv_blocks=16).runner.model
    pixels = _pixels(2)
    with torch.inference_mode():
        ours = model.encode_images(pixels)                              # [2, 4, 64]
        theirs = _hf(gemma3).model.get_image_features(pixel_values=pixels).pooler_output
    assert ours.shape == (2, 4, 64) and float(ours.abs().mean()) > 0.1   # random, not zeros
    assert float((ours - theirs).abs().max()) < 1e-5


def _ends(prompt: list[int]) -> torch.Tensor:
    """Each position's key end: an image token's its image's end, the others' own + 1."""
    from pagewire.executor.image_rows import image_key_ends
    from pagewire.wire.multimodal import ImageInput
    starts = [i for i, t in enumerate(prompt) if t == IMAGE and prompt[i - 1] != IMAGE]
    return image_key_ends([ImageInput(b"", s, 4, b"", []) for s in starts], 0, len(prompt))


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_every_positions_logits_with_two_images(gemma3, kernels):
    """Image tokens see their whole image (transformers' token_type_ids mask), a sliding
    layer's window (4) counted back from each query: every position within 1e-4 of
    transformers' logits; attending causally instead differs."""
    runner = LLM(gemma3, dtype="float32", kernels=kernels, block_size=16,
                 num_kv_blocks=16).runner
    pixels = _pixels(2)
    rows = torch.tensor([i for i, t in enumerate(PROMPT) if t == IMAGE])
    types = (torch.tensor([PROMPT]) == IMAGE).long()
    with torch.inference_mode():
        images = (rows, runner.model.encode_images(pixels).reshape(-1, 64))
        theirs = _hf(gemma3)(input_ids=torch.tensor([PROMPT]), pixel_values=pixels,
                             token_type_ids=types).logits[0]
    assert _ends(PROMPT).tolist()[3:9] == [4, 8, 8, 8, 8, 9]
    worst = float((prefill_logits(runner, PROMPT, images, _ends(PROMPT)) - theirs).abs().max())
    print(kernels, "max |logit difference|:", worst)
    assert worst < 1e-4
    assert float((prefill_logits(runner, PROMPT, images) - theirs).abs().max()) > 1e-2


def _images():
    from PIL import Image
    rng = np.random.default_rng(5)
    return [Image.fromarray(rng.integers(0, 256, (40 + 8 * i, 36, 3), dtype=np.uint8))
            for i in range(2)]


@pytest.fixture(scope="module")
def gemma3_wide(tmp_path_factory, smol_tokenizer_dir) -> str:
    """A vocabulary of 2048: the tokenizer's "\\n\\n" (1116) around each image is in it."""
    return make_tiny_gemma3(str(tmp_path_factory.mktemp("gemma3")), smol_tokenizer_dir,
                            vocab_size=2048)


def test_generate_matches_transformers_whole_and_in_chunks(gemma3_wide):
    """LLM.generate with a lone boi an image: widened to "\\n\\n" boi, 4 image tokens, eoi
    "\\n\\n" (Gemma 3's processor's sequence), greedy tokens equal to transformers' generate
    with token_type_ids; with a budget of 6 tokens a step, each chunk ends before an image it
    would split (chunks 4, 6, 3, 6, 2 of the 21-token prompt) and the tokens are the same."""
    from transformers import AutoImageProcessor
    from pagewire import SamplingParams
    nn = 1116
    short = [1, 20, BOI, 40, BOI, 60, 70]
    widened = [1, 20] + [nn, BOI] + [IMAGE] * 4 + [EOI, nn, 40] + [nn, BOI] + [IMAGE] * 4 + \
        [EOI, nn, 60, 70]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": short, "multi_modal_data": {"image": _images()}}
    llm = LLM(gemma3_wide, dtype="float32", kernels="torch", num_kv_blocks=16)
    out = llm.generate(prompt, params)[0]
    assert out.prompt_token_ids == widened
    pixels = AutoImageProcessor.from_pretrained(gemma3_wide)(
        images=_images(), return_tensors="pt")["pixel_values"]
    ids = torch.tensor([widened])
    theirs = _hf(gemma3_wide).generate(
        input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long(),
        max_new_tokens=6, do_sample=False)[0, len(widened):].tolist()
    assert out.outputs[0].token_ids == theirs

    chunked = LLM(gemma3_wide, dtype="float32", kernels="cpu", num_kv_blocks=16,
                  max_num_batched_tokens=6, enable_prefix_caching=False)
    sizes, execute = [], chunked.runner.execute

    def recording(plan):
        sizes.extend(s.num_scheduled for s in [*plan.new, *plan.running])
        return execute(plan)
    chunked.runner.execute = recording
    assert chunked.generate(prompt, params)[0].outputs[0].token_ids == theirs
    assert sizes[:5] == [4, 6, 3, 6, 2]


def test_an_image_over_the_token_budget_is_refused(gemma3_wide):
    """Its 4 rows cannot be one chunk of a 3-token step: an error, not a split image."""
    from pagewire import SamplingParams
    from pagewire.scheduler.live_requests import queue_refusal
    llm = LLM(gemma3_wide, dtype="float32", kernels="torch", num_kv_blocks=16,
              max_num_batched_tokens=3)
    out = llm.generate({"prompt_token_ids": [1, 20, BOI, 40],
                        "multi_modal_data": {"image": _images()[0]}},
                       SamplingParams(max_tokens=2))[0]
    assert (out.outputs[0].finish_reason, out.outputs[0].token_ids) == ("error", [])
    from pagewire.wire.to_scheduler import NewRequest
    from pagewire.wire.multimodal import ImageInput
    from pagewire.wire.sampling_params import SamplingParams as WireParams
    msg = NewRequest(req_id="r", prompt_token_ids=[1] * 8, sampling=WireParams(),
                     arrival_time=0.0, images=[ImageInput(b"", 2, 4, b"", [])])
    reason, error = queue_refusal(msg, llm.config, [])
    assert reason == "error" and error.startswith("an image of 4 tokens does not fit one step")


def test_pan_and_scan_crops_match_transformers(tmp_path, smol_tokenizer_dir):
    """do_pan_and_scan: a 20 x 50 image (2.5 wide) is the original and 3 crops; its boi becomes
    Gemma 3's processor's text (each of the 4 its own sequence, an encoder input), greedy
    tokens equal to transformers' on the same ids and the processor's 4 pixel arrays. The
    tokenizer's special tokens 3, 4, 5 stand in for boi, eoi and the image token."""
    from PIL import Image
    from transformers import AutoImageProcessor
    from pagewire import SamplingParams
    path = make_tiny_gemma3(str(tmp_path / "m"), smol_tokenizer_dir, image_token=5,
                            vocab_size=49152, pan_and_scan=True)
    image = Image.fromarray(np.random.default_rng(7).integers(0, 256, (20, 50, 3),
                                                              dtype=np.uint8))
    llm = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64)
    out = llm.generate({"prompt": "Look: <repo_name> What is it?",
                        "multi_modal_data": {"image": image}},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    full = "\n\n<repo_name>" + "<file_sep>" * 4 + "<reponame>\n\n"
    text = "Here is the original image " + full + \
        " and here are some crops to help you see better " + " ".join([full] * 3)
    ids = out.prompt_token_ids
    assert llm.tokenizer.decode(ids) == \
        llm.tokenizer.decode(llm.tokenizer.encode("Look: " + text + " What is it?"))
    assert ids.count(5) == 16
    pixels = AutoImageProcessor.from_pretrained(path)(images=[image],
                                                      return_tensors="pt")["pixel_values"]
    assert pixels.shape == (4, 3, 32, 32)
    t = torch.tensor([ids])
    theirs = _hf(path).generate(input_ids=t, pixel_values=pixels, token_type_ids=(t == 5).long(),
                                max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == theirs


def test_a_cached_prefix_that_ends_inside_an_image(gemma3_wide):
    """Blocks of 8: the image's rows are positions 7-10; a second prompt that differs from
    position 13 on maps block 0 (its row 7 computed seeing the whole image) from the prefix
    cache and computes from position 8, mid-image, its rows seeing up to the image's end:
    the same tokens and log-probabilities (within 1e-4) as without the cache (attending
    causally there moves them by ~0.03)."""
    from pagewire import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)

    def prompt(x):
        return {"prompt_token_ids": [1, 20, 30, 31, 32, BOI, x, 60, 70],
                "multi_modal_data": {"image": _images()[0]}}
    cached = LLM(gemma3_wide, dtype="float32", kernels="torch", block_size=8,
                 num_kv_blocks=64)
    first = cached.generate(prompt(40), params)[0]
    assert first.prompt_token_ids[7:11] == [IMAGE] * 4
    before = cached.scheduler.tables.prefix_hits
    second = cached.generate(prompt(41), params)[0].outputs[0]
    assert cached.scheduler.tables.prefix_hits - before == 8
    fresh = LLM(gemma3_wide, dtype="float32", kernels="torch", block_size=8,
                num_kv_blocks=64, enable_prefix_caching=False)
    expected = fresh.generate(prompt(41), params)[0].outputs[0]
    assert second.token_ids == expected.token_ids
    assert max(abs(a.logprob - b.logprob)
               for a, b in zip(second.logprobs, expected.logprobs)) < 1e-4


def test_a_chunk_stops_before_an_image_it_would_split():
    """The scheduler's rule (EncoderBudget.cut, whole_images): images at [4, 8) and [13, 17);
    a chunk ends before an image it cannot hold whole, one that starts inside an image (after
    a cached prefix) runs only when it reaches the image's end; other models split freely."""
    from types import SimpleNamespace
    from pagewire.scheduler.encoder_budget import EncoderBudget
    from pagewire.wire.multimodal import ImageInput
    images = [ImageInput(b"a", 4, 4, b"", []), ImageInput(b"b", 13, 4, b"", [])]

    def cut(planned: int, n: int, whole: bool = True) -> int:
        seq = SimpleNamespace(request=SimpleNamespace(images=images), num_planned=planned)
        return EncoderBudget(100, whole).cut(seq, n)
    assert [cut(0, 6), cut(4, 6), cut(10, 6), cut(13, 6), cut(19, 6)] == [4, 6, 3, 6, 6]
    assert (cut(6, 1), cut(6, 2), cut(0, 3)) == (0, 2, 3)
    assert cut(0, 6, whole=False) == 6


def test_a_released_configs_sparse_text_config_takes_gemma3s_defaults():
    """gemma-3-4b-it's config.json names 6 text keys; the rest are Gemma3TextConfig's."""
    from pagewire.executor.models.vision_language import VisionLanguageConfig
    from pagewire.model_info import image_placeholders
    released = {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
        "eoi_token_index": 256000, "image_token_index": 262144, "mm_tokens_per_image": 256,
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    cfg = VisionLanguageConfig.from_hf(released)
    assert (cfg.architecture, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.tie_word_embeddings) == ("Gemma3ForCausalLM", 262208, 8, 4, 256, True)
    assert cfg.layer_windows[:6] == [1024] * 5 + [None] and len(cfg.layer_windows) == 34
    assert [theta for theta, _ in cfg.rope_tables] == [1e6, 1e4]
    assert cfg.rope_tables[0][1]["factor"] == 8.0 and cfg.attn_scale == 256 ** -0.5
    assert (cfg.vision.pooled_tokens, cfg.vision.layer_norm_eps, cfg.vision.num_layers) == \
        (256, 1e-6, 27)
    assert image_placeholders(released) == (262144, 256)
