"""CLIP as a pooling model: texts through its causal text tower and images through its ViT,
each projected, against transformers' get_text_features / get_image_features."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from pagewire.kernels import tiers
from pagewire.llm import LLM
from pagewire.testing.tiny_clip import make_tiny_clip

TEXTS = ["the cat sat.", "a dog", "x"]


def _png(seed: int, size=(40, 50)) -> bytes:
    from PIL import Image
    pixels = (np.random.RandomState(seed).rand(*size, 3) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """(directory, its texts' and images' features as transformers computes them)."""
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizerFast
    path = make_tiny_clip(str(tmp_path_factory.mktemp("clip")))
    model = CLIPModel.from_pretrained(path).eval()
    ids = CLIPTokenizerFast.from_pretrained(path)(TEXTS).input_ids
    pixels = CLIPImageProcessor.from_pretrained(path)(
        images=[Image.open(io.BytesIO(_png(s))).convert("RGB") for s in (0, 1)],
        return_tensors="pt").pixel_values

    def features(out):
        return getattr(out, "pooler_output", out).numpy()
    with torch.no_grad():
        texts = [features(model.get_text_features(input_ids=torch.tensor([i])))[0] for i in ids]
        images = features(model.get_image_features(pixel_values=pixels))
    return path, np.stack(texts), images


@pytest.mark.parametrize("kernels", ["torch", *tiers.TIERS])
def test_texts_and_images_embed_as_transformers_does(clip, kernels):
    if kernels != "torch" and kernels not in tiers.runnable():
        pytest.skip(f"this CPU does not run the {kernels} tier")
    path, want_texts, want_images = clip
    llm = LLM(path, kernels=kernels, dtype="float32" if kernels == "torch" else "bfloat16")
    pooler = llm.config.model.model_info.pooler
    assert (pooler.pooling_type, pooler.size, pooler.encoder_only) == ("LAST", 48, True)
    texts = np.stack([o.outputs.data for o in llm.encode(TEXTS)])
    images = np.stack([o.outputs.data for o in llm.encode(
        [{"prompt": "", "multi_modal_data": {"image": _png(s)}} for s in (0, 1)])])
    bound = 1e-5 if kernels == "torch" else 3e-2
    np.testing.assert_allclose(texts, want_texts, atol=bound, rtol=bound)
    np.testing.assert_allclose(images, want_images, atol=bound, rtol=bound)
    assert llm.scheduler.kv.num_free == llm.scheduler.kv.num_blocks


def test_an_image_is_embedded_alone(clip):
    llm = LLM(clip[0], kernels="torch", dtype="float32")
    with pytest.raises(ValueError, match="without text"):
        llm.encode([{"prompt": "the cat", "multi_modal_data": {"image": _png(0)}}])
    with pytest.raises(ValueError, match="one image"):
        llm.encode([{"prompt": "", "multi_modal_data": {"image": [_png(0), _png(1)]}}])


def test_token_embed_reads_the_text_towers_states_and_refuses_an_image(clip):
    from transformers import CLIPModel
    llm = LLM(clip[0], kernels="torch", dtype="float32")
    with pytest.raises(ValueError, match="an image is embedded whole"):
        llm.encode([{"prompt": "", "multi_modal_data": {"image": _png(0)}}],
                   pooling_task="token_embed")
    out = llm.encode(TEXTS[:1], pooling_task="token_embed")[0]
    with torch.no_grad():     # the text tower's states after its final norm, unprojected
        rows = CLIPModel.from_pretrained(clip[0]).eval().text_model(
            input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
    want = (rows / rows.norm(dim=1, keepdim=True)).numpy()
    np.testing.assert_allclose(out.outputs.data, want, atol=1e-5)
