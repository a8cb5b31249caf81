"""Token classifiers (*ForTokenClassification: named entities, tags) through the engine's cores,
offline: LLM.encode answers every prompt token's logits [tokens, labels], as transformers'
logits of the same tokens; the other pooling calls and tasks are refused by name; the
pooler's options from the config and --pooler-config."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagewire.llm import LLM
from pagewire.pooler_info import resolve_pooler
from pagewire.testing.tiny_encoder import NUM_LABELS
from pagewire.testing.tiny_sentence import make_sentence_model

TEXTS = ["the cat runs in the house", "paris", "the old dog sleeps on the road " * 3]


@pytest.mark.parametrize("architecture", ["BertForTokenClassification",
                                          "ModernBertForTokenClassification"])
def test_every_tokens_logits_equal_transformers(tmp_path, architecture):
    import transformers
    path = make_sentence_model(str(tmp_path), architecture)
    llm = LLM(path, dtype="float32", kernels="torch", max_num_seqs=2)   # over several steps
    outs = llm.encode(TEXTS)
    hf = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32).eval()
    for out in outs:
        with torch.no_grad():
            want = hf(torch.tensor([out.prompt_token_ids])).logits[0].numpy()
        assert out.outputs.data.shape == (len(out.prompt_token_ids), NUM_LABELS)
        np.testing.assert_allclose(out.outputs.data, want, atol=1e-5)
    assert [len(o.prompt_token_ids) for o in outs] == [8, 3, 23]
    again = llm.encode(TEXTS[1], pooling_task="token_classify")[0].outputs.data
    np.testing.assert_allclose(again, outs[1].outputs.data, atol=1e-5)   # batched apart
    for task in ("token_embed", "embed", "classify"):
        with pytest.raises(ValueError, match=f"task '{task}' is not supported by this model; "
                                             "it serves token_classify"):
            llm.encode(TEXTS[:1], pooling_task=task)
    for call, what in ((lambda: llm.embed("a"), "task is embed, but this model's is "
                                                "token_classify"),
                       (lambda: llm.classify("a"), "task is classify, but this model's is "
                                                   "token_classify"),
                       (lambda: llm.score("a", "b"), "scores need an embedding model or a "
                                                     "cross-encoder")):
        with pytest.raises(ValueError, match=what):
            call()


def test_the_pooler_labels_every_token():
    cfg = {"id2label": {"0": "O", "1": "B-LOC", "2": "I-LOC"}}
    pooler = resolve_pooler("/nowhere", cfg, "BertForTokenClassification", encoder_only=True)
    assert (pooler.task, pooler.pooling_type, pooler.size, pooler.labels, pooler.activation) == \
        ("token_classify", "ALL", 3, ["O", "B-LOC", "I-LOC"], "softmax")
    raw = resolve_pooler("/nowhere", cfg, "BertForTokenClassification", True,
                         overrides={"use_activation": False})
    assert raw.activation == "none"
    with pytest.raises(ValueError, match="--convert embed does not apply to it"):
        resolve_pooler("/nowhere", cfg, "BertForTokenClassification", True, convert="embed")
    with pytest.raises(ValueError, match="\\['pooling_type'\\] do not apply"):
        resolve_pooler("/nowhere", cfg, "BertForTokenClassification", True,
                       overrides={"pooling_type": "CLS"})
    with pytest.raises(ValueError, match="cannot generate"):
        resolve_pooler("/nowhere", cfg, "BertForTokenClassification", True, runner="generate")
