"""bench/embeddings.py's pure parts: the sentences' token lengths, the FLOP arithmetic of the
ceiling, and encoder_shapes' directories loading in transformers."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from pagewire.testing.encoder_shapes import SHAPES, write_encoder

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))          # embeddings.py imports its siblings
    try:
        spec = importlib.util.spec_from_file_location("bench_embeddings", BENCH / "embeddings.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {arch: write_encoder(str(root / arch), arch, "tiny")
            for arch in ("MPNetModel", "BertModel", "BertForSequenceClassification")}


def test_sentences_are_16_to_64_tokens_and_repeat_by_seed(bench, tiny_dirs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dirs["BertModel"])
    sentences = bench.make_sentences(tok, 300, seed=3)
    lens = bench.text_tokens(tok, sentences)
    assert min(lens) == 16 and max(lens) == 64            # 300 draws of 49 lengths hit both ends
    assert sentences == bench.make_sentences(tok, 300, seed=3)
    assert sentences != bench.make_sentences(tok, 300, seed=4)
    # The specials wrap a text as CLS ... SEP and a pair as CLS a SEP b SEP.
    assert len(tok(sentences[0])["input_ids"]) == lens[0] + 2
    pair = tok(sentences[0], sentences[1])
    assert len(pair["input_ids"]) == lens[0] + lens[1] + 3
    assert pair["token_type_ids"].count(1) == lens[1] + 1


def test_rerank_items_are_queries_with_their_candidates(bench, tiny_dirs):
    from argparse import Namespace

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dirs["BertModel"])
    a = Namespace(workload="rerank", queries=3, candidates=5, seed=0)
    items, lens = bench.workload_items(tok, a)
    assert [len(docs) for _, docs in items] == [5, 5, 5] and len(lens) == 3
    query, docs = items[1]
    assert 8 <= bench.text_tokens(tok, [query])[0] <= 16
    # A pair's length is its specials' and both texts' tokens, as the tokenizer counts it.
    assert lens[1] == [len(tok(query, d)["input_ids"]) for d in docs]
    embed, embed_lens = bench.workload_items(tok, Namespace(workload="embed", sentences=4, seed=0))
    assert embed_lens == [[len(ids) for ids in tok(embed)["input_ids"]]]


def test_encoder_flops_counts_linears_and_attention(bench):
    shape = SHAPES["mpnet-base"]
    linear_params = 12 * (4 * 768 * 768 + 2 * 768 * 3072)       # 84,934,656
    assert linear_params == 84_934_656
    assert bench.encoder_flops(1, shape) == 2 * linear_params + 4 * 12 * 768
    assert bench.encoder_flops(64, shape) == 2 * linear_params * 64 + 4 * 12 * 64 * 64 * 768


def test_written_directories_load_in_transformers(tiny_dirs):
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer
    mpnet = AutoModel.from_pretrained(tiny_dirs["MPNetModel"])
    assert type(mpnet).__name__ == "MPNetModel" and mpnet.dtype == torch.bfloat16
    assert mpnet.config.max_position_embeddings == 514 and mpnet.config.hidden_size == 64
    bert = AutoModel.from_pretrained(tiny_dirs["BertModel"])
    assert bert.config.max_position_embeddings == 512 and bert.config.num_hidden_layers == 2
    cross = AutoModelForSequenceClassification.from_pretrained(
        tiny_dirs["BertForSequenceClassification"])
    assert cross.config.num_labels == 1
    tok = AutoTokenizer.from_pretrained(tiny_dirs["BertModel"])
    assert mpnet.config.vocab_size == len(tok) and mpnet.config.pad_token_id == tok.pad_token_id
    with torch.no_grad():
        out = mpnet(**tok(["a b c", "d"], padding=True, return_tensors="pt"))
    assert out.last_hidden_state.shape == (2, 5, 64)
    with open(os.path.join(tiny_dirs["MPNetModel"], "1_Pooling", "config.json")) as f:
        assert json.load(f)["pooling_mode_mean_tokens"] is True
    assert not os.path.exists(os.path.join(tiny_dirs["BertForSequenceClassification"],
                                           "modules.json"))


def test_pagewire_reads_the_pooling_files(tiny_dirs):
    from pagewire.model_info import resolve_model, with_pooler
    embed = with_pooler(resolve_model(tiny_dirs["MPNetModel"]), "pooling").pooler
    assert (embed.task, embed.pooling_type, embed.size, embed.normalize) == ("embed", "MEAN", 64,
                                                                            True)
    cross = with_pooler(resolve_model(tiny_dirs["BertForSequenceClassification"]),
                        "pooling").pooler
    assert (cross.task, cross.pooling_type, cross.size, cross.activation) == (
        "classify", "CLS", 1, "sigmoid")


def test_sentence_transformers_loads_them(tiny_dirs):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(tiny_dirs["MPNetModel"], device="cpu")
    assert [type(m).__name__ for m in model] == ["Transformer", "Pooling", "Normalize"]
    vectors = model.encode(["a b c", "d e"])
    assert vectors.shape == (2, 64)
    assert abs(float((vectors[0] ** 2).sum()) - 1) < 0.02        # normalized (bfloat16)
    scores = st.CrossEncoder(tiny_dirs["BertForSequenceClassification"], device="cpu").predict(
        [("q", "a b"), ("q", "c")])
    assert scores.shape == (2,) and all(0 < s < 1 for s in scores)


def test_default_engines_leave_out_emulated_bfloat16(bench):
    """Where the CPU has no bfloat16 GEMM (the ceiling is float32's), sentence-transformers
    runs in float32 only by default: its emulated bfloat16 would take hours."""
    engines = bench.default_engines().split(",")
    assert "st-fp32" in engines and "pagewire" in engines
    assert ("st" in engines) == (bench.GEMM == "bf16")
