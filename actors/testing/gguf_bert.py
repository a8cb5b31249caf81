"""Write a Hugging Face BERT or NomicBERT directory (tiny_sentence.make_sentence_model) as a
GGUF file the way llama.cpp's convert_hf_to_gguf.py (BertModel, NomicBertModel) does (tests,
bench): gguf-py's own tensor names for the architecture ("bert", "nomic-bert": transformers
saves a NomicBertModel under nomic-ai's names, the converter's input), its SpecialVocab for
the special token ids, the phantom-space vocabulary, the pooling type from
sentence-transformers' pooling module, nomic-bert's rope base; 1-D tensors, norms, positions
and token types float32, the other 2-D weights in `qtype`."""
from __future__ import annotations

import json
import os

import numpy as np

_POOLING = {"pooling_mode_mean_tokens": 1, "pooling_mode_cls_token": 2,
            "pooling_mode_lasttoken": 3}             # gguf.PoolingType's values
_FLOAT32 = ("position_embd.weight", "token_types.weight")
# config.json's architecture -> gguf-py's MODEL_ARCH member
_ARCHS = {"BertModel": "BERT", "NomicBertModel": "NOMIC_BERT"}


def phantom(token: str) -> str:
    """The converter's spelling of a WordPiece token."""
    if token.startswith("[") and token.endswith("]"):
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def st_pooling_type(path: str) -> int | None:
    """gguf.PoolingType's value of sentence-transformers' pooling module at path (None:
    no module), as the converter's _try_set_pooling_type reads it."""
    modules = os.path.join(path, "modules.json")
    if not os.path.isfile(modules):
        return None
    with open(modules) as f:
        folder = next((m["path"] for m in json.load(f) if m["type"].endswith("Pooling")), None)
    if folder is None:
        return None
    with open(os.path.join(path, folder, "config.json")) as f:
        modes = json.load(f)
    return next(value for key, value in _POOLING.items() if modes.get(key))


def _add_vocab(writer, path: str) -> None:
    import gguf
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    by_id = {i: t for t, i in tok.get_vocab().items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    special = set(tok.all_special_tokens)
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([phantom(t) for t in tokens])
    writer.add_token_types(types)
    gguf.SpecialVocab(path, n_vocab=len(tokens)).add_to_gguf(writer)


def _tensors(path: str, arch, layers: int) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under gguf-py's names for `arch` (a gguf.MODEL_ARCH),
    float32; the pooler and heads left out, as the converter leaves them."""
    import gguf
    from safetensors.numpy import load_file
    names = gguf.get_tensor_name_map(arch, layers)
    out = {}
    for name, a in load_file(os.path.join(path, "model.safetensors")).items():
        name = name.removeprefix("bert.")
        if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf-py has no {arch.name} name for {name}"
        out[gguf_name] = a.astype(np.float32)
    return out


def write_bert_gguf(path: str, out: str, qtype: str = "F16") -> str:
    """The BERT or NomicBERT directory at `path` as llama.cpp's converter writes it with
    --outtype `qtype` (F32, F16, BF16 or Q8_0); returns `out`."""
    import gguf
    from gguf.quants import quantize
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    arch = gguf.MODEL_ARCH[_ARCHS[cfg["architectures"][0]]]
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_layer_norm_eps(cfg["layer_norm_eps"])
    writer.add_causal_attention(False)
    if arch == gguf.MODEL_ARCH.NOMIC_BERT:
        writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    pooling = st_pooling_type(path)
    if pooling is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling))
    writer.add_token_type_count(cfg.get("type_vocab_size", 1))
    _add_vocab(writer, path)
    kind = gguf.GGMLQuantizationType[qtype]
    for name, a in _tensors(path, arch, cfg["num_hidden_layers"]).items():
        if a.ndim == 1 or name.endswith("_norm.weight") or name in _FLOAT32 or qtype == "F32":
            writer.add_tensor(name, a)
        elif qtype == "F16":
            writer.add_tensor(name, a.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(a, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
