"""BERT-family embedding models as llama.cpp's converter (convert_hf_to_gguf.py, BertModel
and NomicBertModel) writes them: general.architecture "bert" or "nomic-bert"
(nomic-embed-text v1 / v1.5). Read here without torch: the Hugging Face config the encoder
is built from, the pooling type, and the WordPiece vocabulary under its Hugging Face
spellings (the weights: executor/models/gguf_encoder.py; the tokenizer: gguf_wordpiece.py).

What the converter changes, and how it is undone (ARCH below: "bert" or "nomic-bert"):
- metadata: ARCH.context_length (max_position_embeddings; nomic-embed-text's 8192 written
  as the 2048 it was trained for), embedding_length, feed_forward_length, block_count,
  attention.head_count, attention.layer_norm_epsilon; nomic-bert's rope.freq_base (its
  rotary_emb_base; llama.cpp's default 10000 where absent); type_vocab_size as
  tokenizer.ggml.token_type_count. The activation is not recorded: BERT's exact (erf) GELU
  is assumed, as transformers' BertModel has it; nomic-bert's is SwiGLU (the converter
  refuses any other).
- ARCH.pooling_type: llama.cpp's enum, from sentence-transformers' pooling module.
- a classifier (a cross-encoder reranker: llama.cpp's `--pooling rank`): its head as `cls`
  (RoBERTa's classifier.dense, BERT's pooler) and `cls.output` (out_proj, classifier): the
  model is BertForSequenceClassification (RoBERTa's head computes the same: dense, tanh,
  out_proj on the first token). The converter drops a BertForSequenceClassification's
  pooler, leaving `cls.output` alone, which llama.cpp cannot run either: refused.
- XLM-R (tokenizer.ggml.model "t5": gguf_unigram.py) is written as "bert": its position
  table cut by the converter to start at pad_token_id + 1, so BERT's positions 0..n-1 read
  the rows RoBERTa's would; one token type.
- vocabulary: "##x" continuation pieces become "x", word-initial pieces "\\u2581x"
  (llama.cpp's phantom space); tokens in brackets ([CLS], [unused0]) are kept as they are.
"""
from __future__ import annotations

# general.architecture -> the Hugging Face architecture and model_type it was converted from
ARCHITECTURES = {"bert": ("BertModel", "bert"), "nomic-bert": ("NomicBertModel", "nomic_bert")}
PHANTOM = "\u2581"
# llama.cpp's enum llama_pooling_type -> pooler_info's pooling types (None: refused)
POOLING_TYPES = {0: None, 1: "MEAN", 2: "CLS", 3: "LAST", 4: None}
_POOLING_NAMES = {0: "none", 4: "rank"}
CLASSIFIER = "BertForSequenceClassification"     # a "bert" file with a classification head


def hf_architecture(meta: dict, tensors, path: str = "") -> str:
    """The Hugging Face architecture of a BERT-family GGUF whose tensors are named
    `tensors`: its encoder's, or BERT's classifier where it has a classification head."""
    arch = meta["general.architecture"]
    if "cls.output.weight" not in tensors:
        return ARCHITECTURES[arch][0]
    if arch != "bert" or "cls.weight" not in tensors:
        raise ValueError(f"{path}: a GGUF {arch} classifier with a cls.output head and "
                         f"{'no' if 'cls.weight' not in tensors else 'a'} cls dense is not "
                         "supported (a BertForSequenceClassification converted without its "
                         "pooler cannot be run; an XLM-R reranker's head, cls and cls.output, "
                         "can)")
    return CLASSIFIER


def file_config(header) -> dict:
    """The config.json of the model a GGUF file (a gguf_header.GGUFHeader) was converted
    from: hf_config with its token types and classifier labels read from its tensors."""
    types = header.tensors.get("token_types.weight")
    out = header.tensors.get("cls.output.weight")
    return hf_config(header.metadata, types.shape[0] if types is not None else None,
                     out.shape[0] if out is not None else None, header.tensors)


def hf_config(meta: dict, type_vocab_size: int | None = None, num_labels: int | None = None,
              tensors=()) -> dict:
    """The config.json of the model a "bert" or "nomic-bert" GGUF was converted from (the
    keys EncoderConfig.from_hf reads). `type_vocab_size`: the token_types tensor's rows,
    where the file has no token_type_count; `num_labels`: cls.output's rows (a classifier's:
    `tensors`, the file's tensor names, tell)."""
    arch = meta["general.architecture"]
    architecture = hf_architecture(meta, tensors)
    model_type = ARCHITECTURES[arch][1]
    count = meta.get("tokenizer.ggml.token_type_count", type_vocab_size)
    cfg = {"architectures": [architecture], "model_type": model_type,
           "hidden_size": int(meta[f"{arch}.embedding_length"]),
           "num_hidden_layers": int(meta[f"{arch}.block_count"]),
           "num_attention_heads": int(meta[f"{arch}.attention.head_count"]),
           "intermediate_size": int(meta[f"{arch}.feed_forward_length"]),
           "vocab_size": len(meta["tokenizer.ggml.tokens"]),
           "max_position_embeddings": int(meta[f"{arch}.context_length"]),
           "type_vocab_size": int(count if count is not None else 2),
           "layer_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_epsilon", 1e-12))}
    if architecture == CLASSIFIER:
        labels = meta.get(f"{arch}.classifier.output_labels")
        cfg["id2label"] = {str(i): str(label) for i, label in enumerate(labels)} \
            if labels is not None and len(labels) == num_labels else \
            {str(i): f"LABEL_{i}" for i in range(num_labels)}
    if arch == "nomic-bert":
        base = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
        return {**cfg, "hidden_act": "silu",
                "rope_parameters": {"rope_type": "default", "rope_theta": base}}
    return {**cfg, "hidden_act": "gelu", "position_embedding_type": "absolute"}


def pooler_inputs(header, path: str, overrides: dict | None) -> tuple[dict, dict]:
    """What pooler_info.resolve_pooler reads of a BERT-family GGUF: its config (file_config:
    a classifier's labels) and --pooler-config with the file's pooling type as an embedding
    model's default (the file keeps no sentence-transformers modules; normalised, as
    without them)."""
    cfg, overrides = file_config(header), dict(overrides or {})
    if cfg["architectures"][0] != CLASSIFIER and "pooling_type" not in overrides:
        overrides["pooling_type"] = pooling_type(header.metadata, path)
    return cfg, overrides


def pooling_type(meta: dict, path: str = "") -> str:
    """The pooling type ARCH.pooling_type names (MEAN, CLS or LAST), for an embedding model
    (a classifier's file pools through its head, whatever this says). A file without one,
    or with none or rank (rank without a classification head), is refused: give
    --pooler-config pooling_type to pool it anyway."""
    key = f"{meta.get('general.architecture', 'bert')}.pooling_type"
    value = meta.get(key)
    kind = POOLING_TYPES.get(int(value)) if value is not None else None
    if kind is None:
        what = f"no {key}" if value is None else \
            f"{key} {_POOLING_NAMES.get(int(value), value)}"
        raise ValueError(f"{path}: a GGUF BERT-family model with {what} is not supported "
                         "(mean, cls and last are; --pooler-config "
                         "'{\"pooling_type\": \"MEAN\"}' chooses one)")
    return kind


def hf_vocab(tokens: list[str]) -> list[str]:
    """The converter's vocabulary in WordPiece's own spellings: "\\u2581x" -> "x", a bracketed
    token as it is, any other "x" -> "##x" (the inverse of its phantom-space rewriting; a
    continuation piece that was itself bracketed, "##[x]", cannot be told from "[x]")."""
    out = []
    for token in tokens:
        if token.startswith(PHANTOM):
            out.append(token[len(PHANTOM):])
        elif token.startswith("[") and token.endswith("]"):
            out.append(token)
        else:
            out.append("##" + token)
    return out


def lowercases(vocab: list[str]) -> bool:
    """Whether the model's tokenizer lowercased its text: llama.cpp's WPM always does, but a
    cased BERT's vocabulary has capitals, which lowercased text could never reach. Uncased
    (no capital outside brackets): lowercase and strip accents, as BertTokenizer's
    do_lower_case; cased: neither."""
    return not any(t != t.lower() for t in vocab if not (t.startswith("[") and t.endswith("]")))


def special_ids(meta: dict) -> dict[str, int]:
    """The special tokens' ids: {cls, sep, pad, unk, mask}. gguf-py writes CLS as BOS and SEP
    also as EOS where a tokenizer_config names no BOS or EOS; older files have cls_token_id."""
    key = "tokenizer.ggml.{}_token_id".format
    found = {"cls": meta.get(key("cls"), meta.get(key("bos"))),
             "sep": meta.get(key("seperator"), meta.get(key("eos"))),
             "pad": meta.get(key("padding")), "unk": meta.get(key("unknown")),
             "mask": meta.get(key("mask"))}
    missing = [name for name in ("cls", "sep", "unk") if found[name] is None]
    if missing:
        raise ValueError(f"GGUF BERT tokenizer: no {', '.join(missing)} token id")
    return {name: int(value) for name, value in found.items() if value is not None}
