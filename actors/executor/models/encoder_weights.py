"""Hugging Face's encoder checkpoints -> EncoderModel's state dict (encoder.py), and the
loader that reads one.

A *ForSequenceClassification checkpoint prefixes the encoder's names with its base model's
("bert.", "roberta.", "mpnet.", "model."); a base model's have none. NomicBERT's are
nomic-ai's own (emb_ln, encoder.layers.N.attn.Wqkv, mlp.fc11 the up rows, mlp.fc12 the
gate's), as transformers saves them too. Old BERT checkpoints
name LayerNorm parameters gamma and beta. Tensors no model reads (a base model's pooler, a
masked-LM head) are left out."""
from __future__ import annotations

import json
import os

import torch

from .encoder import EncoderModel
from .encoder_config import EncoderConfig

_PREFIXES = ("bert.", "roberta.", "mpnet.", "model.", "nomic_bert.")

# ours -> theirs, after the prefix, per family: embeddings and the model's own tensors
_EMBEDDINGS = {
    "bert": {"words": "embeddings.word_embeddings", "positions": "embeddings.position_embeddings",
             "token_types": "embeddings.token_type_embeddings",
             "embed_norm": "embeddings.LayerNorm"},
    "mpnet": {"words": "embeddings.word_embeddings",
              "positions": "embeddings.position_embeddings",
              "embed_norm": "embeddings.LayerNorm",
              "relative_bias": "encoder.relative_attention_bias"},
    "modernbert": {"words": "embeddings.tok_embeddings", "embed_norm": "embeddings.norm",
                   "final_norm": "final_norm"},
    "nomic": {"words": "embeddings.word_embeddings",
              "token_types": "embeddings.token_type_embeddings", "embed_norm": "emb_ln"},
}
_EMBEDDINGS["roberta"] = _EMBEDDINGS["bert"]
# a layer's: ours -> theirs (a tuple: concatenated by rows), under each family's layer prefix
_LAYERS = {
    "bert": ("encoder.layer.{}.", {
        "qkv": ("attention.self.query", "attention.self.key", "attention.self.value"),
        "out": "attention.output.dense", "attn_norm": "attention.output.LayerNorm",
        "up": "intermediate.dense", "down": "output.dense", "mlp_norm": "output.LayerNorm"}),
    "mpnet": ("encoder.layer.{}.", {
        "qkv": ("attention.attn.q", "attention.attn.k", "attention.attn.v"),
        "out": "attention.attn.o", "attn_norm": "attention.LayerNorm",
        "up": "intermediate.dense", "down": "output.dense", "mlp_norm": "output.LayerNorm"}),
    "modernbert": ("layers.{}.", {
        "qkv": "attn.Wqkv", "out": "attn.Wo", "attn_norm": "attn_norm", "up": "mlp.Wi",
        "down": "mlp.Wo", "mlp_norm": "mlp_norm"}),
    "nomic": ("encoder.layers.{}.", {
        "qkv": "attn.Wqkv", "out": "attn.out_proj", "attn_norm": "norm1",
        "up": ("mlp.fc12", "mlp.fc11"), "down": "mlp.fc2", "mlp_norm": "norm2"}),
}
_LAYERS["roberta"] = _LAYERS["bert"]
# the classification head's (no base-model prefix on theirs but BERT's pooler)
_HEADS = {
    "bert": {"head_dense": "pooler.dense", "classifier": "classifier"},
    "roberta": {"head_dense": "classifier.dense", "classifier": "classifier.out_proj"},
    "mpnet": {"head_dense": "classifier.dense", "classifier": "classifier.out_proj"},
    "modernbert": {"head_dense": "head.dense", "head_norm": "head.norm",
                   "classifier": "classifier"},
}


# a token classifier's: a Linear on every token's state (ModernBERT's head first, as for
# its sequences)
_TOKEN_HEADS = {family: {"classifier": "classifier"} for family in ("bert", "roberta", "mpnet")}
_TOKEN_HEADS["modernbert"] = {"head_dense": "head.dense", "head_norm": "head.norm",
                              "classifier": "classifier"}


def _unprefixed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in weights.items():
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.endswith(".gamma"):
            name = name[:-len("gamma")] + "weight"
        elif name.endswith(".beta"):
            name = name[:-len("beta")] + "bias"
        out[name] = tensor
    return out


def _modules(cfg: EncoderConfig) -> dict[str, str | tuple[str, ...]]:
    """Each of our modules -> the Hugging Face module(s) it is read from."""
    names = dict(_EMBEDDINGS[cfg.family])
    prefix, layer = _LAYERS[cfg.family]
    for i in range(cfg.num_layers):
        theirs = prefix.format(i)
        for ours, src in layer.items():
            if ours == "attn_norm" and cfg.family == "modernbert" and i == 0:
                continue                         # layer 0 attends its input unnormed
            names[f"layers.{i}.{ours}"] = tuple(theirs + s for s in src) \
                if isinstance(src, tuple) else theirs + src
    if cfg.classifier:
        names.update(_HEADS[cfg.family])
    elif cfg.token_classifier:
        names.update(_TOKEN_HEADS[cfg.family])
    return names


def encoder_state(weights: dict[str, torch.Tensor], cfg: EncoderConfig) -> dict[str, torch.Tensor]:
    """{Hugging Face name: tensor} -> EncoderModel's state dict: q, k, v fused by rows; a
    norm stored without a bias (ModernBERT's norm_bias false) given a zero one. A module
    missing from `weights` is left out (load_state_dict names it)."""
    weights = _unprefixed(weights)
    state = {}
    for ours, theirs in _modules(cfg).items():
        parts = theirs if isinstance(theirs, tuple) else (theirs,)
        for kind in ("weight", "bias"):
            found = [weights.get(f"{p}.{kind}") for p in parts]
            if all(t is not None for t in found):
                state[f"{ours}.{kind}"] = torch.cat(found) if len(found) > 1 else found[0]
        if ours.endswith("norm") and f"{ours}.weight" in state and f"{ours}.bias" not in state:
            state[f"{ours}.bias"] = torch.zeros_like(state[f"{ours}.weight"])
    return state


def read_encoder(info, dtype: torch.dtype, tp=None, quantization: str = "none", ops=None,
                 cp=None) -> EncoderModel:
    """loader.read_model for an encoder ModelInfo (info.path, a Hugging Face directory or a
    llama.cpp "bert" GGUF file: gguf_encoder.py), on the CPU: Backend.load moves it to its
    device and lays it out (prepare). One rank, no context parallelism: each refused with a
    ValueError; --quantization int8 (its Linears rounded to Q8_0) is read_model's."""
    if tp is not None and tp.size > 1:
        raise ValueError(f"{info.architecture}: encoder models run on one rank; tensor "
                         "parallelism is not supported for them (--tensor-parallel-size 1)")
    if cp is not None:
        raise ValueError(f"{info.architecture}: encoder models have no KV cache to split "
                         "(--decode-context-parallel-size 1)")
    if quantization not in ("none", "int8"):
        raise ValueError(f"{info.architecture}: --quantization {quantization} is not "
                         "supported for encoder models (int8 is)")
    if info.format == "gguf":
        from .gguf_encoder import load_gguf_encoder
        return load_gguf_encoder(info.path, dtype, ops, architecture=info.architecture)
    return load_encoder(info.path, dtype, ops, architecture=info.architecture)


def load_encoder(path: str, dtype: torch.dtype, ops=None, device=None,
                 architecture: str | None = None) -> EncoderModel:
    """The encoder of a Hugging Face safetensors directory, its weights cast to `dtype`, built
    with the backend's `ops` (None: torch's), on `device` (None: the CPU), as `architecture`
    (None: config.json's). The caller lays the weights out for its kernels
    (Backend.prepare); the weights as read serve the torch ops."""
    from pagewire.model_info import hf_text_config

    from ..loader import no_init, one_thread, read_safetensors    # (it imports this module)
    with open(os.path.join(path, "config.json")) as f:
        cfg = EncoderConfig.from_hf(hf_text_config(json.load(f)), architecture)
    with one_thread():
        with no_init():                   # every tensor comes from the file: no init
            model = EncoderModel(cfg, ops)
        state = encoder_state(read_safetensors(path, dtype), cfg)
        result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys:
        raise ValueError(f"weights missing from {path}: {', '.join(result.missing_keys[:5])}")
    return model.requires_grad_(False).to(device or torch.device("cpu")).eval()
