"""Random-weight encoder models of real shapes as Hugging Face directories that transformers,
sentence-transformers (`SentenceTransformer`, `CrossEncoder`), vLLM and pagewire all load:
all-mpnet-base-v2's shape as an MPNetModel, and the same shape as a BertModel (what vLLM
serves; BERT-base's FLOPs equal MPNet-base's) or a one-label BertForSequenceClassification
(a cross-encoder reranker).

Quality is not the point, shapes and token counts are. The vocabulary is the default model's
byte-level BPE (no network here), given a BERT-style post-processor: `<|im_start|>` text
`<|im_end|>` (CLS/SEP), a pair as `<|im_start|>` a `<|im_end|>` b `<|im_end|>` with token
types 0/1, `<|endoftext|>` (id 0) padding. Weights are transformers' own init (normal 0.02,
LayerNorm 1/0), stored as bfloat16 safetensors by default."""
from __future__ import annotations

import json
import os
import shutil

from .tiny_sentence import write_sentence_modules

SHAPES = {
    # all-mpnet-base-v2 / BERT-base: 12 layers of 768, 12 heads, FFN 3072.
    "mpnet-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                       intermediate_size=3072),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128),
}
ARCHITECTURES = ("MPNetModel", "BertModel", "BertForSequenceClassification")
CLS, SEP, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
MAX_TOKENS = 512              # the position table's usable length (MPNet's has 2 more)


def write_encoder(path: str, architecture: str, shape: str = "mpnet-base", seed: int = 0,
                  dtype: str = "bfloat16") -> str:
    """Write the model at `path` (via path + ".part", renamed when whole); an existing `path`
    is taken as written. Returns `path`."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    import torch
    part = path + ".part"
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part)
    tok = save_tokenizer(part, token_types=architecture.startswith("Bert"))
    config = encoder_config(architecture, SHAPES[shape], len(tok), tok.convert_tokens_to_ids(
        [CLS, SEP, PAD]))
    torch.manual_seed(seed)
    import transformers
    model = getattr(transformers, architecture)(config).to(getattr(torch, dtype))
    model.save_pretrained(part)
    if not architecture.endswith("ForSequenceClassification"):
        # As all-mpnet-base-v2 ships them: Transformer, mean Pooling, Normalize.
        write_sentence_modules(part, "mean", True, width=config.hidden_size)
        _write_json(os.path.join(part, "sentence_bert_config.json"),
                    {"max_seq_length": MAX_TOKENS, "do_lower_case": False})
    shutil.rmtree(path, ignore_errors=True)
    os.rename(part, path)
    return path


def encoder_config(architecture: str, dims: dict, vocab: int, specials: list[int]):
    """The transformers config of `architecture` at `dims` over a `vocab`-token vocabulary
    whose CLS, SEP, PAD ids are `specials`."""
    import transformers
    cls_id, sep_id, pad_id = specials
    if architecture.startswith("MPNet"):
        # MPNet numbers positions from pad_token_id + 1 (pad 0 here: 513 rows used of the
        # real model's 514).
        return transformers.MPNetConfig(vocab_size=vocab, max_position_embeddings=MAX_TOKENS + 2,
                                        pad_token_id=pad_id, bos_token_id=cls_id,
                                        eos_token_id=sep_id, **dims)
    extra = dict(num_labels=1) if architecture.endswith("ForSequenceClassification") else {}
    return transformers.BertConfig(vocab_size=vocab, max_position_embeddings=MAX_TOKENS,
                                   type_vocab_size=2, pad_token_id=pad_id, **dims, **extra)


def save_tokenizer(path: str, token_types: bool):
    """The default model's tokenizer with the BERT-style post-processor (module docstring)
    saved at `path`, as a PreTrainedTokenizerFast with CLS/SEP/PAD named; returns it.
    `token_types`: its encodings carry token_type_ids (BERT's segment embedding reads them;
    MPNet has none)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from pagewire.hf_tokenizer import load_tokenizer
    from pagewire.model_info import resolve_model
    backend = load_tokenizer(resolve_model(None)).backend_tokenizer
    ids = {t: backend.token_to_id(t) for t in (CLS, SEP, PAD)}
    backend.post_processor = TemplateProcessing(
        single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, ids[CLS]), (SEP, ids[SEP])])
    names = ["input_ids", *(["token_type_ids"] if token_types else []), "attention_mask"]
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, cls_token=CLS, sep_token=SEP,
                                  pad_token=PAD, unk_token=PAD, bos_token=CLS, eos_token=SEP,
                                  model_max_length=MAX_TOKENS, model_input_names=names)
    tok.save_pretrained(path)
    return tok


def _write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2)
