"""Tiny random-weight sentence-transformers models for tests: a tiny encoder checkpoint
(tiny_encoder.py) with a WordPiece tokenizer of a few words and sentence-transformers' files
(modules.json, the pooling module, Dense projections, a Normalize module), which
SentenceTransformer and CrossEncoder load as they would a released model."""
from __future__ import annotations

import json
import os

from .tiny_encoder import TINY, make_tiny_encoder

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the a an of to in and or is are was be it this that on for with as by at from "
         "cat dog bird fish tree house car road river city sun moon star sky rain snow "
         "red blue green black white big small fast slow old new good bad hot cold "
         "runs jumps sees eats likes finds makes takes gives walks sleeps flies swims "
         "paris london rome tokyo cairo lima oslo kyiv what where when who why how "
         "##s ##ed ##ing ##er ##ly ##est").split()


def write_wordpiece(path: str, vocab_size: int = TINY["vocab_size"]) -> None:
    """A lower-casing BERT tokenizer of SPECIALS + WORDS (padded with unused tokens to
    vocab_size), saved at path."""
    from transformers import BertTokenizerFast
    vocab = SPECIALS + WORDS
    vocab += [f"[unused{i}]" for i in range(vocab_size - len(vocab))]
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    BertTokenizerFast(os.path.join(path, "vocab.txt"), do_lower_case=True).save_pretrained(path)


def make_sentence_model(path: str, architecture: str = "BertModel", pooling: str = "mean",
                        normalize: bool = True, dense: tuple = (), **overrides) -> str:
    """A tiny encoder with a tokenizer and sentence-transformers' modules (`pooling`: "mean",
    "cls" or "lasttoken"; `dense`: write_sentence_modules'); a *ForSequenceClassification one
    is a CrossEncoder, a *ForTokenClassification one a tagger (no modules)."""
    make_tiny_encoder(path, architecture, **overrides)
    write_wordpiece(path)
    if not architecture.endswith(("ForSequenceClassification", "ForTokenClassification")):
        write_sentence_modules(path, pooling, normalize, dense=dense)
    return path


def write_sentence_modules(path: str, pooling: str = "mean", normalize: bool = True,
                           width: int = TINY["hidden_size"], dense: tuple = ()) -> None:
    """sentence-transformers' modules.json and pooling config (`pooling`: "mean", "cls"
    or "lasttoken"), then a Dense module per `dense` entry, (out_features, torch.nn
    activation class name) or with a third item False for an older pickled save without a
    bias, then a Normalize module where `normalize`."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    vector = width                                # the size of what the next module reads
    for spec in dense:
        folder = f"{len(modules)}_Dense"
        vector = _write_dense(os.path.join(path, folder), vector, *spec)
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": folder,
                        "type": "sentence_transformers.models.Dense"})
    if normalize:
        modules.append({"idx": len(modules), "name": str(len(modules)),
                        "path": f"{len(modules)}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(path, modules[-1]["path"]), exist_ok=True)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    modes = {f"pooling_mode_{m}": pooling == m.split("_")[0] for m in
             ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": width, **modes}, f)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)


def _write_dense(folder: str, width: int, out_features: int, activation: str,
                 safe: bool = True) -> int:
    """A random-weight Dense module width -> out_features saved by sentence-transformers
    itself (config.json and model.safetensors; where not `safe`, no bias and the older
    pytorch_model.bin); returns out_features."""
    import torch
    from sentence_transformers.sentence_transformer.modules import Dense
    module = Dense(width, out_features, bias=safe,
                   activation_function=getattr(torch.nn, activation)())
    with torch.no_grad():         # outputs of about 2: the activation bends, not saturates
        module.linear.weight.normal_(0, 2 / width ** 0.5)
    os.makedirs(folder, exist_ok=True)
    module.save(folder, safe_serialization=safe)
    return out_features
