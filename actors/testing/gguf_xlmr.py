"""A tiny XLM-RoBERTa cross-encoder (a bge-reranker of the TINY shape) or embedding model (a
BGE-M3's: CLS pooled) with a Unigram tokenizer, and its GGUF as llama.cpp's
convert_hf_to_gguf.py (XLMRobertaModel: arch "bert") writes it (tests): the vocabulary as
tokenizer.ggml.model "t5" with its scores and normalization charsmap (the tokenizer.json path
of _xlmroberta_set_vocab), the position table cut to start at pad_token_id + 1, "roberta."
dropped from the names, a head as cls and cls.output; the pooling type from
sentence-transformers' module, none for a reranker (llama.cpp's server is told `--pooling
rank`)."""
from __future__ import annotations

import base64
import json
import os
import struct

import numpy as np

from .tiny_encoder import TINY, make_tiny_encoder
from .tiny_sentence import WORDS

# a precompiled charsmap that normalizes nothing (a double-array trie of 256 empty units, so
# every byte's lookup stays inside it and matches no label; no replacement strings), which
# travels the converter's path (tokenizer.json's normalizer ->
# tokenizer.ggml.precompiled_charsmap) as a real one does
EMPTY_CHARSMAP = struct.pack("<I", 256 * 4) + bytes(256 * 4)


def _pieces(size: int) -> list[tuple[str, float]]:
    """XLM-R's layout: <s>, <pad>, </s>, <unk>, the pieces, <mask> last; word-initial pieces
    "\\u2581word", WordPiece's "##x" as bare suffixes, single letters to fall back on."""
    words = [("\u2581" + w if not w.startswith("##") else w[2:]) for w in WORDS]
    letters = [c for c in "abcdefghijklmnopqrstuvwxyz"] + ["\u2581" + c for c in "aeiost"]
    pieces = list(dict.fromkeys(words + letters + ["\u2581", ",", "!", "?", "."]))
    pieces = pieces[:size - 5]
    scored = [(p, -1.0 - 0.5 * len(p) - 0.01 * i) for i, p in enumerate(pieces)]
    return [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), *scored] + \
        [(f"\u2581extra{i}", -20.0) for i in range(size - 5 - len(pieces))] + [("<mask>", 0.0)]


def make_reranker(path: str, architecture: str = "XLMRobertaForSequenceClassification") -> str:
    """A random one-label XLMRobertaForSequenceClassification (or an XLMRobertaModel with
    sentence-transformers' CLS pooling) with its tokenizer at path."""
    from transformers import XLMRobertaTokenizer

    from .tiny_sentence import write_sentence_modules
    make_tiny_encoder(path, architecture, num_labels=1,
                      pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
    if not architecture.endswith("ForSequenceClassification"):
        write_sentence_modules(path, "cls")
    XLMRobertaTokenizer(vocab=_pieces(TINY["vocab_size"]),
                        _spm_precompiled_charsmap=EMPTY_CHARSMAP).save_pretrained(path)
    return path


def _add_vocab(writer, path: str, type_vocab_size: int) -> None:
    """The converter's _xlmroberta_set_vocab from tokenizer.json."""
    import gguf
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    with open(os.path.join(path, "tokenizer.json")) as f:
        spec = json.load(f)
    scores = [score for _, score in spec["model"]["vocab"]]
    tokens = [tok.convert_ids_to_tokens(i) for i in range(len(scores))]
    special = set(tok.all_special_ids)
    types = [gguf.TokenType.UNKNOWN if i == tok.unk_token_id else
             gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
             for i in range(len(tokens))]
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(tok.add_prefix_space)
    writer.add_token_type_count(type_vocab_size)
    writer.add_remove_extra_whitespaces(tok.clean_up_tokenization_spaces)
    writer.add_precompiled_charsmap(base64.b64decode(spec["normalizer"]["precompiled_charsmap"]))
    gguf.SpecialVocab(path, n_vocab=len(tokens)).add_to_gguf(writer)


def write_reranker_gguf(path: str, out: str) -> str:
    """The reranker at `path` as the converter writes it with --outtype f32; returns out."""
    import gguf
    from safetensors.numpy import load_file

    from .gguf_bert import st_pooling_type
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    offset = cfg["pad_token_id"] + 1
    writer = gguf.GGUFWriter(out, "bert")
    writer.add_context_length(cfg["max_position_embeddings"] - offset)
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_layer_norm_eps(cfg["layer_norm_eps"])
    writer.add_causal_attention(False)
    if (pooling := st_pooling_type(path)) is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling))
    _add_vocab(writer, path, cfg.get("type_vocab_size", 1))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, cfg["num_hidden_layers"])
    for name, a in load_file(os.path.join(path, "model.safetensors")).items():
        name = name.removeprefix("roberta.")
        if name.endswith("position_ids") or name.startswith("pooler."):   # as the converter
            continue
        if name == "embeddings.position_embeddings.weight":
            a = a[offset:]
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf-py has no BERT name for {name}"
        writer.add_tensor(gguf_name, a.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
