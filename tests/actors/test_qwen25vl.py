"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration) on a tiny random config against
transformers: the windowed ViT and patch merger's rows for images of their own sizes, every
position's logits of a prompt with two images (M-RoPE: the image rows' (t, h, w) positions,
the text after each image shifted), and greedy generation through LLM.generate, whole and
with the image split across prefill chunks, the decode steps after the image at the shifted
positions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire.executor.mrope import image_row_positions, rope_positions
from pagewire.testing.tiny_vision import make_tiny_qwen25vl
from pagewire.wire.multimodal import ImageInput

IMAGE_TOKEN = 500
# (height, width) in pixels -> the processor's grids in merged patches: 2 x 3 (two windows
# of 2 x 2 squares: 4 and 2) and 4 x 2 (two windows of 4)
SIZES = [(60, 90), (120, 70)]


@pytest.fixture(scope="module")
def path(tmp_path_factory, smol_tokenizer_dir) -> str:
    return make_tiny_qwen25vl(str(tmp_path_factory.mktemp("qwen25vl")), smol_tokenizer_dir,
                              IMAGE_TOKEN)


@pytest.fixture(scope="module")
def hf(path):
    from transformers import Qwen2_5_VLForConditionalGeneration
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def _images():
    from PIL import Image
    return [Image.fromarray(np.random.default_rng(i).integers(0, 256, (h, w, 3), np.uint8))
            for i, (h, w) in enumerate(SIZES)]


def _processed(path, images):
    from transformers import AutoImageProcessor
    out = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    grids = [[t, h // 2, w // 2] for t, h, w in out["image_grid_thw"].tolist()]
    return out["pixel_values"], out["image_grid_thw"], grids


@pytest.mark.parametrize("count", [1, 2])
def test_the_tower_gives_transformers_image_features(path, hf, count):
    model = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64).runner.model
    pixels, thw, grids = _processed(path, _images()[:count])
    assert grids == [[1, 2, 3], [1, 4, 2]][:count]
    with torch.inference_mode():
        ours = model.encode_images(pixels, grids)
        theirs = hf.model.get_image_features(pixel_values=pixels, image_grid_thw=thw)
    assert [tuple(x.shape) for x in ours] == [(6, 64), (8, 64)][:count]
    for a, b in zip(ours, theirs.pooler_output):
        assert float((a - b).abs().max()) < 1e-5


def _prompt(grids) -> tuple[list[int], list[ImageInput]]:
    prompt, images = [1, 20, 21], []
    for grid in grids:
        n = int(np.prod(grid))
        images.append(ImageInput(bytes(len(images)), len(prompt), n, b"", [], grid))
        prompt += [IMAGE_TOKEN] * n + [30, 31]
    return prompt + [40, 41, 42], images


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_every_positions_logits_with_two_images(path, hf, kernels):
    from pagewire.kernels.attention import AttentionBatch, PrefillSpan
    runner = LLM(path, dtype="float32", kernels=kernels, block_size=16,
                 num_kv_blocks=64).runner
    pixels, thw, grids = _processed(path, _images())
    prompt, images = _prompt(grids)
    n = len(prompt)
    positions = rope_positions(images, np.arange(n))
    # text after the 2 x 3 image: 6 rows advance 3; after the 4 x 2 one: 8 rows advance 4
    assert positions[-3:].tolist() == [n - 3 - 3 - 4, n - 2 - 3 - 4, n - 1 - 3 - 4]
    rows = torch.tensor([i for i, t in enumerate(prompt) if t == IMAGE_TOKEN])
    batch = AttentionBatch(torch.arange(n), 0, None, None,
                           [PrefillSpan(0, n, n, torch.arange(-(-n // 16)))])
    with torch.inference_mode():
        embeds = torch.cat(runner.model.encode_images(pixels, grids))
        thw_rows = torch.from_numpy(np.concatenate(
            [image_row_positions(images, im, range(im.length)) for im in images]))
        hidden = runner.model(torch.tensor(prompt), torch.from_numpy(positions),
                              runner.kv_caches, batch, images=(rows, embeds, thw_rows))
        ours = runner.model.compute_logits(hidden)
        theirs = hf(input_ids=torch.tensor([prompt]), pixel_values=pixels, image_grid_thw=thw,
                    mm_token_type_ids=(torch.tensor([prompt]) == IMAGE_TOKEN).int()).logits[0]
    worst = float((ours - theirs).abs().max())
    print(kernels, "max |logit difference|:", worst)
    assert worst < 1e-4


def test_generate_matches_transformers_whole_chunked_and_cached(path, hf):
    """One placeholder an image, widened to its rows by the tokenizer; 8 greedy tokens equal
    transformers' (decodes at the shifted positions); the same with 5-token prefill chunks
    (the image's 6 rows in two chunks) and, prefix caching on, again from cached blocks."""
    image = _images()[0]
    short = [1, 20, 21, IMAGE_TOKEN, 30, 31, 40]
    prompt = [1, 20, 21] + [IMAGE_TOKEN] * 6 + [30, 31, 40]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    pixels, thw, _ = _processed(path, [image])
    theirs = hf.generate(input_ids=torch.tensor([prompt]), pixel_values=pixels,
                         image_grid_thw=thw, do_sample=False, max_new_tokens=8,
                         mm_token_type_ids=(torch.tensor([prompt]) == IMAGE_TOKEN).int()
                         )[0, len(prompt):].tolist()
    request = {"prompt_token_ids": short, "multi_modal_data": {"image": image}}
    whole = LLM(path, dtype="float32", kernels="torch", block_size=4, num_kv_blocks=160)
    out = whole.generate(request, params)[0]
    assert out.prompt_token_ids == prompt
    assert out.outputs[0].token_ids == theirs
    before = whole.scheduler.tables.prefix_hits
    assert whole.generate(request, params)[0].outputs[0].token_ids == theirs
    assert whole.scheduler.tables.prefix_hits - before == 8   # the blocks before the last token's
    chunked = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64,
                  max_num_batched_tokens=5, enable_prefix_caching=False)
    assert chunked.generate(request, params)[0].outputs[0].token_ids == theirs
    assert (chunked.scheduler.encoder.queries, chunked.scheduler.encoder.hits) == (2, 1)


def test_a_text_prompts_image_part_is_qwens_placeholder(tmp_path, smol_tokenizer_dir):
    """The borrowed tokenizer's <repo_name> (3) as <|image_pad|>, <file_sep> (5) and
    <filename> (6) as <|vision_start|> and <|vision_end|>: a chat image part becomes the
    three (as Qwen's template writes it), the pad widened to the image's 6 rows by a text
    prompt's generate, whose greedy tokens are transformers'."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from pagewire.image_inputs import ImagePreparer
    from pagewire.model_info import resolve_model
    path = make_tiny_qwen25vl(str(tmp_path / "m"), smol_tokenizer_dir, image_token=3,
                              vocab_size=49152)
    tokenizer = AutoTokenizer.from_pretrained(path)
    preparer = ImagePreparer.of(resolve_model(path), tokenizer)
    assert preparer.mark() == "<file_sep><repo_name><filename>"
    assert preparer.widen([1, 5, 3, 6]) == [1, 5, 3, 6]      # rows unknown until it is read
    llm = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=64)
    out = llm.generate({"prompt": "Look: " + preparer.mark() + " What is it?",
                        "multi_modal_data": {"image": _images()[0]}},
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    ids = out.prompt_token_ids
    start = ids.index(5)
    assert ids[start:start + 8] == [5] + [3] * 6 + [6]
    pixels, thw, _ = _processed(path, _images()[:1])
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    theirs = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=thw,
                         mm_token_type_ids=(torch.tensor([ids]) == 3).int(), do_sample=False,
                         max_new_tokens=6)[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == theirs


def test_fused_decode_and_ngram_drafts_keep_the_tokens(path):
    """The native kernels' fused decode program (int8 blocks: it encodes only quantized
    linears) and n-gram drafts (verified as decode rows) read the shifted positions the
    runner gives them: the per-op path's greedy tokens (that path is transformers', above)."""
    request = {"prompt_token_ids": [1, IMAGE_TOKEN] + [7, 8, 9] * 4,
               "multi_modal_data": {"image": _images()[1]}}      # 4 x 2: 8 rows, advances 4
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    fused = LLM(path, dtype="float32", kernels="cpu", num_kv_blocks=64, quantization="int8",
                enable_prefix_caching=False)
    assert fused.runner.model.fused_decode is not None
    tokens = fused.generate(request, params)[0].outputs[0].token_ids
    fused.runner.model.use_fused_decode(None)
    assert fused.generate(request, params)[0].outputs[0].token_ids == tokens
    drafted = LLM(path, dtype="float32", kernels="cpu", num_kv_blocks=64, quantization="int8",
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert drafted.generate(request, params)[0].outputs[0].token_ids == tokens


def test_a_flat_released_config_reads_as_the_nested_one():
    """The released checkpoints' config.json: the text model's keys at the top level, rope
    as rope_scaling of type "mrope" beside rope_theta (Qwen2.5-VL-3B-Instruct's shape)."""
    from pagewire.executor.models.vision_language import VisionLanguageConfig
    from pagewire.rope_scaling import hf_rope_scaling
    cfg = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "hidden_size": 2048,
           "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
           "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6,
           "rope_theta": 1000000.0, "max_position_embeddings": 128000,
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
           "tie_word_embeddings": True, "image_token_id": 151655,
           "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280,
                             "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
                             "out_hidden_size": 2048, "patch_size": 14,
                             "spatial_merge_size": 2, "window_size": 112,
                             "fullatt_block_indexes": [7, 15, 23, 31],
                             "temporal_patch_size": 2}}
    read = VisionLanguageConfig.from_hf(cfg)
    assert (read.mrope_section, read.rope_tables, read.attention_bias, read.head_dim,
            read.tie_word_embeddings) == ([16, 24, 24], [(1000000.0, None)], True, 128, True)
    assert (read.vision.depth, read.vision.fullatt_block_indexes, read.vision.out_hidden_size,
            read.vision.image_token_id) == (32, [7, 15, 23, 31], 2048, 151655)
    assert hf_rope_scaling(cfg) is None


def test_preempted_sequences_resume_at_the_same_positions(path):
    """Four image prompts in a pool too small for all: sequences are preempted and come back
    (recomputed), their answers those of a pool that holds them all."""
    from PIL import Image
    images = [Image.fromarray(np.random.default_rng(s).integers(0, 256, (120, 70 + 28 * s, 3),
                                                                 np.uint8)) for s in range(4)]
    requests = [{"prompt_token_ids": [1, 20 + s, IMAGE_TOKEN] + [7, 8, 9] * 3,
                 "multi_modal_data": {"image": image}} for s, image in enumerate(images)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=200, block_size=4,
                max_model_len=100)
    tight = LLM(path, dtype="float32", kernels="torch", num_kv_blocks=30, block_size=4,
                max_model_len=100)
    answers = [o.outputs[0].token_ids for o in tight.generate(requests, params)]
    assert tight.scheduler.num_preemptions > 0
    assert answers == [o.outputs[0].token_ids for o in roomy.generate(requests, params)]
