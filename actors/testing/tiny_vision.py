"""Tiny random-weight vision models for tests (and nothing else): a LLaVA directory in
transformers' layout with its image processor and a borrowed tokenizer."""
from __future__ import annotations

import os
import shutil

import torch

IMAGE_SIZE = 28       # 2 x 2 patches of 14: four rows an image (the class token dropped)


def make_tiny_llava(path: str, tokenizer_dir: str, image_token: int = 500, seed: int = 3,
                    vocab_size: int = 512) -> str:
    """A LlavaForConditionalGeneration of a 3-layer CLIP tower (width 32) and a 2-layer Llama
    (width 64; a vocabulary of 512 for token-id prompts, the tokenizer's for text ones),
    weights scaled up so that errors show."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=14,
                              projection_dim=32)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                         image_token_index=image_token)
    processor = CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                   crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return _save(LlavaForConditionalGeneration, config, processor, path, tokenizer_dir, seed)


def make_tiny_idefics3(path: str, tokenizer_dir: str, image_token: int = 500, seed: int = 3,
                       vocab_size: int = 512) -> str:
    """An Idefics3ForConditionalGeneration (SmolVLM's architecture): a 3-layer SigLIP tower
    (width 32, 32-pixel tiles of 8-pixel patches), a pixel shuffle of 2 (four rows a tile)
    and a 2-layer Llama (width 64), weights scaled up so that errors show; its image
    processor splits images into tiles of 32 pixels (longest edge 64) plus the global one."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=2, image_size=32, patch_size=8)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                            scale_factor=2, image_token_id=image_token)
    from transformers import Idefics3ImageProcessor
    processor = Idefics3ImageProcessor(size={"longest_edge": 64},
                                       max_image_size={"longest_edge": 32})
    return _save(Idefics3ForConditionalGeneration, config, processor, path, tokenizer_dir, seed)


def make_tiny_qwen25vl(path: str, tokenizer_dir: str, image_token: int = 500, seed: int = 3,
                       vocab_size: int = 512) -> str:
    """A Qwen2_5_VLForConditionalGeneration: a 2-layer ViT (width 32; the second layer full
    attention, the first in windows of 2 x 2 merge squares, 56 pixels, so an image over
    56 pixels a side has several windows), a 2 x 2 patch merger and a 2-layer Qwen2 text model
    (width 64, head 16: M-RoPE sections 2, 3, 3), weights scaled up so that errors show; its
    image processor keeps images between 4 and 48 merge squares (28 x 28 pixels each)."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  out_hidden_size=64, fullatt_block_indexes=[1])
    text = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                 "rope_theta": 10000.0})
    config = Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=image_token,
                              video_token_id=image_token + 1,
                              vision_start_token_id=image_token + 2,
                              vision_end_token_id=image_token + 3)
    processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 48)
    return _save(Qwen2_5_VLForConditionalGeneration, config, processor, path, tokenizer_dir,
                 seed)


def _save(model_class, config, processor, path: str, tokenizer_dir: str, seed: int,
          randomize=None) -> str:
    """Random float32 weights (scaled up so that errors show; `randomize(model)` first makes
    random what transformers starts at a constant), the processor and the borrowed
    tokenizer, saved in `path`."""
    torch.manual_seed(seed)
    model = model_class(config).float()
    with torch.no_grad():
        if randomize is not None:
            randomize(model)
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def prefill_logits(runner, prompt: list[int], images=None, key_ends=None) -> torch.Tensor:
    """Every position's logits of `prompt` run as one prefill through the runner's paged
    cache (blocks 0.. of 16 tokens), `images` (rows, embeddings) in place of those rows;
    `key_ends`: the span's (PrefillSpan.key_ends), or None: causal."""
    from pagewire.kernels.attention import AttentionBatch, PrefillSpan
    n = len(prompt)
    span = PrefillSpan(0, n, n, torch.arange(-(-n // 16)), key_ends)
    batch = AttentionBatch(torch.arange(n), 0, None, None, [span])
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(prompt), torch.arange(n), runner.kv_caches, batch,
                              images=images)
        return runner.model.compute_logits(hidden)


def make_tiny_gemma3(path: str, tokenizer_dir: str, image_token: int = 500, seed: int = 3,
                     vocab_size: int = 512, pan_and_scan: bool = False) -> str:
    """A Gemma3ForConditionalGeneration: a 2-layer SigLIP tower (width 32, 32-pixel images of
    8-pixel patches: a 4 x 4 grid), pooled to 4 rows an image, and a 2-layer Gemma 3 text
    model (width 64; layer 0 slides, window 4, so a window ends inside an image), weights
    scaled up so that errors show; boi/eoi are the two ids before `image_token`. With
    `pan_and_scan` its processor also crops an image stretched 1.2x or more (crops of at
    least 8 pixels, at most 4)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig
    from transformers import SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import \
        Gemma3ImageProcessorPil
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=32, patch_size=8,
                                vision_use_head=False)
    text = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, max_position_embeddings=256, sliding_window=4,
                            layer_types=["sliding_attention", "full_attention"],
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = Gemma3Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                          mm_tokens_per_image=4, image_token_index=image_token,
                          boi_token_index=image_token - 2, eoi_token_index=image_token - 1)
    crops = dict(do_pan_and_scan=True, pan_and_scan_min_crop_size=8,
                 pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)
    processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32},
                                        **(crops if pan_and_scan else {}))
    return _save(Gemma3ForConditionalGeneration, config, processor, path, tokenizer_dir, seed,
                 _random_gemma3_projector)


def _random_gemma3_projector(model) -> None:
    """transformers starts Gemma 3's projection at zeros (every image row 0, images then
    unseen) and its norm at 0 (a scale of 1): both random here."""
    projector = model.model.multi_modal_projector
    projector.mm_input_projection_weight.normal_(0, 0.03)
    projector.mm_soft_emb_norm.weight.normal_(0, 0.3)
