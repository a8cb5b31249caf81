"""A GGUF file's WordPiece tokenizer (tokenizer.ggml.model "bert": llama.cpp's WPM) as the
Hugging Face fast tokenizer the model was converted from: BertTokenizerFast's pipeline
(BERT normalizer, BERT pre-tokenizer, WordPiece with "##" continuations, "[CLS] $A [SEP]"
and "[CLS] $A [SEP] $B [SEP]" with token types 0 then 1), over the vocabulary in its own
spellings again (gguf_bert.hf_vocab) and the file's special token ids.

Where llama.cpp's WPM and Hugging Face's differ, Hugging Face's is followed (the model was
trained on it): llama.cpp lowercases every text and keeps accents; an uncased vocabulary
here lowercases and strips accents (BertTokenizer's do_lower_case), a cased one neither."""
from __future__ import annotations

from .gguf_bert import hf_vocab, lowercases, special_ids

MODEL = "bert"                     # tokenizer.ggml.model of a WordPiece vocabulary
_SPECIAL_ARGS = {"cls": "cls_token", "sep": "sep_token", "pad": "pad_token",
                 "unk": "unk_token", "mask": "mask_token"}


def is_wordpiece(meta: dict) -> bool:
    return meta.get("tokenizer.ggml.model") == MODEL


def wordpiece_tokenizer(meta: dict):
    """The GGUF metadata's tokenizer as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = hf_vocab([str(t) for t in meta["tokenizer.ggml.tokens"]])
    ids = special_ids(meta)
    names = {kind: vocab[i] for kind, i in ids.items()}
    # a vocabulary's later duplicate wins, as WordPiece.from_file reads a vocab.txt
    table = {token: i for i, token in enumerate(vocab)}
    tok = Tokenizer(models.WordPiece(table, unk_token=names["unk"],
                                     continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=None,
                                                lowercase=lowercases(vocab))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = (names["cls"], ids["cls"]), (names["sep"], ids["sep"])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls[0]}:0 $A:0 {sep[0]}:0",
        pair=f"{cls[0]}:0 $A:0 {sep[0]}:0 $B:1 {sep[0]}:1", special_tokens=[cls, sep])
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        **{_SPECIAL_ARGS[kind]: name for kind, name in names.items()})


def save_wordpiece(meta: dict, target: str) -> None:
    """Save the tokenizer at `target` (tokenizer.json and tokenizer_config.json, as
    hf_tokenizer's cache keeps a converted GGUF tokenizer)."""
    wordpiece_tokenizer(meta).save_pretrained(target)
