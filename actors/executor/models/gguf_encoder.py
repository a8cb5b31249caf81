"""A GGUF BERT or NomicBERT (general.architecture "bert" or "nomic-bert", gguf_bert.py) as an
EncoderModel: its tensors under the Hugging Face names encoder_weights.encoder_state reads,
dequantized (any type gguf_weights.read_tensor takes: F32, F16, BF16, Q8_0, ...) and cast to
the model's dtype as each is read; the config from its metadata.

llama.cpp's names (gguf-py's MODEL_TENSORS[MODEL_ARCH.BERT] and [NOMIC_BERT]) -> the
checkpoint's they were converted from: BertModel's, and nomic-ai's for NomicBERT (attn_qkv
is Wqkv, q, k and v stacked by rows; ffn_up is fc11, ffn_gate fc12: silu(gate) * up). A
reranker's classifier head, cls and cls.output, is BERT's pooler and classifier
(gguf_bert.hf_architecture)."""
from __future__ import annotations

import numpy as np
import torch

from pagewire import gguf_bert

from .encoder import EncoderModel
from .encoder_config import EncoderConfig
from .encoder_weights import encoder_state

# per general.architecture: the embeddings' names, a layer's prefix and its names
_EMBEDDINGS = {"token_embd": "embeddings.word_embeddings",
               "token_types": "embeddings.token_type_embeddings",
               "position_embd": "embeddings.position_embeddings",
               "token_embd_norm": "embeddings.LayerNorm"}
_NAMES = {
    "bert": ({**_EMBEDDINGS, "cls": "pooler.dense", "cls.output": "classifier"},
             "encoder.layer.{}.", {
        "attn_q": "attention.self.query", "attn_k": "attention.self.key",
        "attn_v": "attention.self.value", "attn_output": "attention.output.dense",
        "attn_output_norm": "attention.output.LayerNorm", "ffn_up": "intermediate.dense",
        "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}),
    "nomic-bert": ({**_EMBEDDINGS, "token_embd_norm": "emb_ln"}, "encoder.layers.{}.", {
        "attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj", "attn_output_norm": "norm1",
        "ffn_up": "mlp.fc11", "ffn_gate": "mlp.fc12", "ffn_down": "mlp.fc2",
        "layer_output_norm": "norm2"}),
}


def hf_name(name: str, arch: str = "bert") -> str | None:
    """An `arch` GGUF tensor's Hugging Face name ("blk.0.attn_q.weight" ->
    "encoder.layer.0.attention.self.query.weight"); None for one the encoder does not read."""
    embeddings, prefix, layer = _NAMES[arch]
    module, _, kind = name.rpartition(".")
    if module in embeddings:
        return f"{embeddings[module]}.{kind}"
    parts = module.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer:
        return f"{prefix.format(parts[1])}{layer[parts[2]]}.{kind}"
    return None


def gguf_encoder_config(header, architecture: str | None = None) -> EncoderConfig:
    """The encoder's config from the file's metadata and tensors (gguf_bert.file_config)."""
    return EncoderConfig.from_hf(gguf_bert.file_config(header), architecture)


def read_gguf_state(path: str, header, cfg: EncoderConfig,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """EncoderModel's state dict from the file's tensors, each in `dtype`."""
    from ..gguf_weights import read_tensor
    data = np.memmap(path, dtype=np.uint8, mode="r")
    arch = header.metadata["general.architecture"]
    weights = {}
    for info in header.tensors.values():
        name = hf_name(info.name, arch)
        if name is not None:
            weights[name] = read_tensor(data, info, dtype)
    return encoder_state(weights, cfg)


def load_gguf_encoder(path: str, dtype: torch.dtype, ops=None,
                      architecture: str | None = None) -> EncoderModel:
    """The EncoderModel of a "bert" or "nomic-bert" GGUF file, on the CPU (Backend.load moves
    and lays it out, as for a safetensors encoder)."""
    from pagewire.gguf_header import read_gguf_header

    from ..loader import no_init, one_thread    # (it imports encoder_weights, which imports us)
    header = read_gguf_header(path)
    cfg = gguf_encoder_config(header, architecture)
    with one_thread():
        with no_init():
            model = EncoderModel(cfg, ops)
        state = read_gguf_state(path, header, cfg, dtype)
        result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys:
        raise ValueError(f"weights missing from {path}: {', '.join(result.missing_keys[:5])}")
    return model.requires_grad_(False).eval()
