"""A pooling model's pooler as resolved from its files and the flags (pooler_info.py)."""
from __future__ import annotations

import json
import re

import pytest

from pagewire.pooler_info import DenseModule, PoolerInfo, resolve_pooler
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


def _dense(path, specs: list[dict]) -> None:
    """modules.json with a Dense module per config (then Normalize), configs as saved."""
    folders = [f"{2 + i}_Dense" for i in range(len(specs))]
    _write(path, "modules.json",
           [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
           + [{"path": f, "type": "sentence_transformers.models.Dense"} for f in folders]
           + [{"path": "9_Normalize", "type": "sentence_transformers.models.Normalize"}])
    _write(path, "1_Pooling/config.json", {"pooling_mode_cls_token": True})
    for folder, spec in zip(folders, specs):
        _write(path, f"{folder}/config.json", spec)


def test_dense_modules_are_read_in_order_and_set_the_embedding_size(tmp_path):
    _dense(tmp_path, [{"in_features": 64, "out_features": 32, "bias": False,
                       "activation_function": "torch.nn.modules.linear.Identity"},
                      {"in_features": 32, "out_features": 16}])      # Tanh: the default
    pooler = resolve_pooler(str(tmp_path), {**BERT, "is_matryoshka": True}, "BertModel", True)
    assert pooler.dense == [DenseModule(folder="2_Dense", in_features=64, out_features=32,
                                        bias=False, activation="identity"),
                            DenseModule(folder="3_Dense", in_features=32, out_features=16,
                                        bias=True, activation="tanh")]
    assert (pooler.size, pooler.normalize, pooler.matryoshka_dimensions[-1]) == (16, True, 16)


@pytest.mark.parametrize("spec, message", [
    ({"activation_function": "torch.nn.modules.activation.Softplus"}, "Softplus' is not"),
    ({"activation_function": "my_package.Swish"}, "Swish' is not"),
    ({"in_features": 48}, "in_features 48 but the vector before it has 64"),
    ({"use_residual": True}, "residual"),
    ({"module_input_name": "token_embeddings"}, "residual or over other features"),
])
def test_a_dense_module_that_cannot_apply_is_refused_naming_its_file(tmp_path, spec, message):
    _dense(tmp_path, [{"in_features": 64, "out_features": 8, **spec}])
    config = str(tmp_path / "2_Dense" / "config.json")
    with pytest.raises(ValueError, match=re.escape(config) + ".*" + message):
        resolve_pooler(str(tmp_path), BERT, "BertModel", True)


def test_a_dense_module_after_normalize_is_refused(tmp_path):
    _write(tmp_path, "modules.json", [{"path": "1_Normalize",
                                       "type": "sentence_transformers.models.Normalize"},
                                      {"path": "2_Dense",
                                       "type": "sentence_transformers.models.Dense"}])
    with pytest.raises(ValueError, match="modules.json: a Dense module \\(2_Dense\\) after "
                                         "Normalize"):
        resolve_pooler(str(tmp_path), BERT, "BertModel", True)
