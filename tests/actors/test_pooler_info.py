"""A pooling model's pooler as resolved from its files and the flags (pooler_info.py)."""
from __future__ import annotations

import json

import pytest

from pagewire.pooler_info import PoolerInfo, resolve_pooler
from pagewire.testing.tiny_sentence import write_sentence_modules

BERT = {"hidden_size": 64, "num_labels": 2}


def _write(path, name: str, value) -> None:
    file = path / name
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(value))


def test_sentence_transformers_files_decide_pooling_and_normalisation(tmp_path):
    write_sentence_modules(str(tmp_path), "mean", normalize=True)
    assert resolve_pooler(str(tmp_path), BERT, "MPNetModel", True) == PoolerInfo(
        task="embed", pooling_type="MEAN", size=64, normalize=True, encoder_only=True)
    write_sentence_modules(str(tmp_path), "cls", normalize=False)
    pooler = resolve_pooler(str(tmp_path), BERT, "BertModel", True)
    assert (pooler.pooling_type, pooler.normalize) == ("CLS", False)
    overridden = resolve_pooler(str(tmp_path), BERT, "BertModel", True,
                                overrides={"pooling_type": "mean", "normalize": True})
    assert (overridden.pooling_type, overridden.normalize) == ("MEAN", True)


def test_defaults_without_sentence_transformers_files(tmp_path):
    bert = resolve_pooler(str(tmp_path), BERT, "BertModel", True)
    assert (bert.task, bert.pooling_type, bert.normalize) == ("embed", "CLS", True)
    assert resolve_pooler(str(tmp_path), BERT, "LlamaForCausalLM", False) is None
    llama = resolve_pooler(str(tmp_path), {"hidden_size": 64}, "LlamaForCausalLM", False,
                           convert="embed")
    assert (llama.pooling_type, llama.encoder_only, llama.also_generates) == ("LAST", False, False)
    both = resolve_pooler(str(tmp_path), {"hidden_size": 64}, "LlamaForCausalLM", False,
                          runner="generate", convert="embed")
    assert both.also_generates
    matryoshka = resolve_pooler(str(tmp_path), {**BERT, "matryoshka_dimensions": [64, 32, 16]},
                                "BertModel", True)
    assert matryoshka.matryoshka_dimensions == [64, 32, 16]


def test_a_classifier_reads_its_labels_and_activation(tmp_path):
    two = {**BERT, "id2label": {"0": "negative", "1": "positive"}}
    pooler = resolve_pooler(str(tmp_path), two, "BertForSequenceClassification", True)
    assert (pooler.task, pooler.labels, pooler.size, pooler.activation) == \
        ("classify", ["negative", "positive"], 2, "softmax")
    one = {**BERT, "num_labels": 1, "id2label": {"0": "LABEL_0"}}
    assert resolve_pooler(str(tmp_path), one, "XLMRobertaForSequenceClassification",
                          True).activation == "sigmoid"
    identity = {**one, "sentence_transformers": {
        "activation_fn": "torch.nn.modules.linear.Identity"}}
    assert resolve_pooler(str(tmp_path), identity, "BertForSequenceClassification",
                          True).activation == "none"


@pytest.mark.parametrize("architecture, options, message", [
    ("BertModel", dict(runner="generate"), "cannot generate"),
    ("BertModel", dict(convert="classify"), "needs a classifier"),
    ("BertModel", dict(overrides={"pooling": "CLS"}), "unknown keys"),
    ("BertModel", dict(overrides={"pooling_type": "MAX"}), "pooling_type must be"),
    ("LlamaForCausalLM", dict(convert="embed", overrides={"pooling_type": "MEAN"}),
     "last token"),
    ("BertModel", dict(runner="pool"), "--runner must be"),
    ("LlamaForCausalLM", dict(convert="classify"), "has neither"),
    ("LlamaForCausalLM", dict(convert="classify", overrides={"classifier_from_token": "yes"}),
     "list of token texts"),
])
def test_what_cannot_be_served_is_refused_by_name(tmp_path, architecture, options, message):
    with pytest.raises(ValueError, match=message):
        resolve_pooler(str(tmp_path), BERT, architecture, architecture == "BertModel", **options)


def test_a_dense_projection_module_is_refused(tmp_path):
    _write(tmp_path, "modules.json", [{"path": "2_Dense",
                                       "type": "sentence_transformers.models.Dense"}])
    with pytest.raises(ValueError, match="Dense projection"):
        resolve_pooler(str(tmp_path), BERT, "BertModel", True)
