"""A GGUF file's SentencePiece Unigram tokenizer (tokenizer.ggml.model "t5"), as llama.cpp's
converter writes XLM-RoBERTa's (convert_hf_to_gguf.py's _xlmroberta_set_vocab: BGE-M3,
multilingual E5, bge-reranker), back as the Hugging Face XLMRobertaTokenizer it came from:
transformers' own pipeline for it (Unigram over the pieces and their scores, the file's
precompiled normalization charsmap, whitespace split and "\\u2581" metaspace, "<s> $A </s>"
and "<s> $A </s> </s> $B </s>" with no token types).

The converter keeps the Hugging Face ids (its sentencepiece path realigns the pieces as
fairseq's offset does: <s>, <pad>, </s>, <unk> first), and transformers' Unigram takes the
unknown token at id 3, where both put <unk>: a file with it elsewhere is refused."""
from __future__ import annotations

MODEL = "t5"                       # tokenizer.ggml.model of a Unigram vocabulary
UNK_ID = 3                         # XLMRobertaTokenizer's Unigram(unk_id=3)
_IDS = {"bos_token": "bos", "eos_token": "eos", "sep_token": "seperator", "cls_token": "cls",
        "unk_token": "unknown", "pad_token": "padding", "mask_token": "mask"}
_DEFAULTS = {"cls": "bos", "seperator": "eos"}   # gguf-py writes CLS as BOS, SEP as EOS


def is_unigram(meta: dict) -> bool:
    return meta.get("tokenizer.ggml.model") == MODEL


def unigram_tokenizer(meta: dict):
    """The GGUF metadata's tokenizer as a transformers XLMRobertaTokenizer."""
    from transformers import XLMRobertaTokenizer

    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
    key = "tokenizer.ggml.{}_token_id".format
    unk = meta.get(key("unknown"))
    if unk is not None and int(unk) != UNK_ID:
        raise ValueError(f"GGUF Unigram tokenizer: the unknown token is id {unk}; XLM-RoBERTa's "
                         f"is {UNK_ID} (other SentencePiece layouts are not supported)")
    names = {}
    for arg, kind in _IDS.items():
        found = meta.get(key(kind), meta.get(key(_DEFAULTS.get(kind, kind))))
        if found is not None:
            names[arg] = tokens[int(found)]
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    return XLMRobertaTokenizer(
        vocab=list(zip(tokens, scores)),
        add_prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        _spm_precompiled_charsmap=bytes(bytearray(charsmap)) if charsmap is not None and
        len(charsmap) else None, **names)


def save_unigram(meta: dict, target: str) -> None:
    """Save the tokenizer at `target` (as hf_tokenizer's cache keeps a converted GGUF one)."""
    unigram_tokenizer(meta).save_pretrained(target)
