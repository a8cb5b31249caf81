"""BERT embedding models as llama.cpp's converter writes them (general.architecture "bert",
pagewire.testing.gguf_bert): the GGUF's WordPiece tokenizer against the Hugging Face one it
came from, and LLM(gguf).encode against LLM(hf_dir).encode and sentence-transformers."""
from __future__ import annotations

import os

import numpy as np
import pytest

from pagewire.gguf_header import read_gguf_header
from pagewire.llm import LLM
from pagewire.model_info import resolve_model, with_pooler
from pagewire.testing.gguf_bert import write_bert_gguf
from pagewire.testing.tiny_sentence import make_sentence_model

TEXTS = ["the cat runs in the house", "Paris is a BIG city!", "what", "",
         "the old dog sleeps on the road and the bird flies to the tree " * 2]
PAIRS = ["where does the cat sleep", "the dog", "x", "Tokyo, Rome & Lima", "fast"]
ODD = ["Héllo wörld, the CAT's [MASK] jumped?", "  tabs\tand\nnew lines  ", "东京 tokyo",
       "runsing walkser", "[CLS] the [SEP]"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: path}: a tiny mean-pooled sentence model and its GGUF copies."""
    root = tmp_path_factory.mktemp("bert")
    hf = make_sentence_model(str(root / "hf"), "BertModel", "mean")
    out = {"hf": hf}
    for qtype in ("F32", "F16", "BF16", "Q8_0"):
        out[qtype] = write_bert_gguf(hf, str(root / f"tiny-{qtype}.gguf"), qtype)
    return out


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    return (a * (b / np.linalg.norm(b, axis=1, keepdims=True))).sum(1)


def test_a_gguf_bert_resolves_as_the_encoder_it_was_converted_from(models):
    info = with_pooler(resolve_model(models["F16"]))
    assert (info.format, info.architecture, info.max_model_len, info.hidden_size,
            info.num_layers, info.num_heads, info.intermediate_size, info.vocab_size) == \
        ("gguf", "BertModel", 64, 128, 2, 2, 256, 160)
    pooler = info.pooler
    assert (pooler.task, pooler.pooling_type, pooler.normalize, pooler.encoder_only,
            pooler.size) == ("embed", "MEAN", True, True, 128)
    cls = with_pooler(resolve_model(models["F16"]), overrides={"pooling_type": "CLS"})
    assert cls.pooler.pooling_type == "CLS"


def test_a_gguf_bert_without_a_supported_pooling_type_is_refused(tmp_path):
    hf = make_sentence_model(str(tmp_path / "hf"), "BertModel", "mean")
    os.remove(os.path.join(hf, "modules.json"))          # the converter writes no pooling type
    path = write_bert_gguf(hf, str(tmp_path / "none.gguf"), "F32")
    assert "bert.pooling_type" not in read_gguf_header(path).metadata
    with pytest.raises(ValueError, match="no bert.pooling_type"):
        with_pooler(resolve_model(path))
    pooled = with_pooler(resolve_model(path), overrides={"pooling_type": "MEAN"})
    assert pooled.pooler.pooling_type == "MEAN"


@pytest.mark.parametrize("value, refusal", [(0, "bert.pooling_type none"),
                                             (4, "bert.pooling_type rank")])
def test_pooling_types_none_and_rank_are_refused(value, refusal):
    from pagewire.gguf_bert import pooling_type
    assert [pooling_type({"bert.pooling_type": v}) for v in (1, 2, 3)] == ["MEAN", "CLS", "LAST"]
    with pytest.raises(ValueError, match=refusal):
        pooling_type({"bert.pooling_type": value}, "m.gguf")


def test_the_gguf_tokenizer_encodes_as_the_hugging_face_one(models):
    from transformers import AutoTokenizer

    from pagewire.hf_tokenizer import load_tokenizer
    want = AutoTokenizer.from_pretrained(models["hf"])
    got = load_tokenizer(resolve_model(models["F16"]))
    for text in TEXTS + ODD:
        assert got(text)["input_ids"] == want(text)["input_ids"], text
    for text, pair in zip(TEXTS + ODD, PAIRS * 2):
        a = got(text, pair, return_token_type_ids=True)
        b = want(text, pair, return_token_type_ids=True)
        assert (a["input_ids"], a["token_type_ids"]) == (b["input_ids"], b["token_type_ids"])
    assert (got.cls_token_id, got.sep_token_id, got.pad_token_id, got.unk_token_id,
            got.mask_token_id) == (2, 3, 0, 1, 4)
    ids = want("the cat runs")["input_ids"]
    assert got.decode(ids, skip_special_tokens=True) == "the cat runs"


def test_a_cased_vocabulary_keeps_case_and_accents(tmp_path):
    """llama.cpp lowercases every text; a vocabulary with capitals was not lowercased, and
    its tokenizer (do_lower_case False) is followed."""
    from transformers import BertTokenizerFast

    from pagewire.gguf_wordpiece import wordpiece_tokenizer
    from pagewire.testing.gguf_bert import phantom
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Paris", "paris", "##s", "é", "e",
             "The", "the", ",", "Ü", "##ber"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    want = BertTokenizerFast(str(tmp_path / "vocab.txt"), do_lower_case=False)
    meta = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": [phantom(t) for t in vocab],
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.seperator_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.unknown_token_id": 1,
            "tokenizer.ggml.mask_token_id": 4}
    got = wordpiece_tokenizer(meta)
    for text in ["The Paris, the paris", "Parises é e Über", "PARIS"]:
        assert got(text)["input_ids"] == want(text)["input_ids"], text
    assert got("The Paris é")["input_ids"] == [2, 10, 5, 8, 3]


def _embeddings(path: str, kernels: str = "torch") -> np.ndarray:
    dtype = "float32" if kernels == "torch" else "bfloat16"
    llm = LLM(path, dtype=dtype, kernels=kernels, max_num_seqs=3)   # five prompts, 2 steps
    return np.stack([o.outputs.data for o in llm.encode(TEXTS)])


@pytest.fixture(scope="module")
def sentence_embeddings(models) -> np.ndarray:
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(models["hf"], device="cpu").encode(TEXTS)


# float32 torch ops: F32 weights are the checkpoint's own (the same sums); F16 rounds each
# weight by up to 2^-11 of itself, BF16 by 2^-8, Q8_0 by up to 1/254 of its block's largest
# (measured worst cosines: F32 1 - 0, F16 1 - 6e-8, BF16 1 - 5.7e-6, Q8_0 1 - 5.3e-5)
BOUNDS = {"F32": 1 - 1e-6, "F16": 1 - 1e-6, "BF16": 1 - 5e-5, "Q8_0": 1 - 2e-4}


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0"])
def test_gguf_embeddings_match_sentence_transformers(models, sentence_embeddings, qtype):
    got = _embeddings(models[qtype])
    cosines = _cosines(got, sentence_embeddings)
    assert (cosines > BOUNDS[qtype]).all(), cosines


def test_a_float32_gguf_embeds_as_its_hugging_face_directory(models, sentence_embeddings):
    got = _embeddings(models["F32"])
    np.testing.assert_allclose(got, _embeddings(models["hf"]), rtol=1e-5, atol=1e-5)
    llm = LLM(models["F32"], dtype="float32", kernels="torch")
    embedded = np.array([o.outputs.embedding for o in llm.embed(TEXTS)])
    np.testing.assert_allclose(embedded, sentence_embeddings, atol=1e-5)  # normalised


def test_a_q8_0_gguf_embeds_on_the_native_tiers(models, sentence_embeddings, tier):
    """bfloat16 weights and activations over Q8_0's rounding (measured worst cosine on
    avx2, avx512 and avx512_bf16: 1 - 5.9e-5)."""
    cosines = _cosines(_embeddings(models["Q8_0"], tier), sentence_embeddings)
    assert (cosines > 1 - 5e-4).all(), cosines


# nomic-embed-text (general.architecture "nomic-bert"): transformers' NomicBertModel (the same
# block as llama.cpp's: post-norm, rotate-half rope on q and k, silu(gate) * up, no Linear
# biases) under sentence-transformers is the oracle. A rope base other than NomicBertConfig's
# default 1000 and llama.cpp's 10000, so only the file's nomic-bert.rope.freq_base matches.
NOMIC_THETA = 5000.0


@pytest.fixture(scope="module")
def nomic(tmp_path_factory):
    """{name: path}: a tiny mean-pooled NomicBERT sentence model, its GGUF copies, and
    sentence-transformers' embeddings of TEXTS."""
    from sentence_transformers import SentenceTransformer
    root = tmp_path_factory.mktemp("nomic")
    hf = make_sentence_model(str(root / "hf"), "NomicBertModel", "mean",
                             rope_parameters={"rope_type": "default", "rope_theta": NOMIC_THETA})
    out = {"hf": hf, "want": SentenceTransformer(hf, device="cpu").encode(TEXTS)}
    for qtype in ("F32", "Q8_0"):
        out[qtype] = write_bert_gguf(hf, str(root / f"nomic-{qtype}.gguf"), qtype)
    return out


def test_a_gguf_nomic_bert_resolves_with_its_rope_base_and_pooling(nomic):
    from pagewire.executor.models.gguf_encoder import gguf_encoder_config
    info = with_pooler(resolve_model(nomic["Q8_0"]))
    assert (info.format, info.architecture, info.max_model_len, info.hidden_size,
            info.num_layers, info.intermediate_size) == \
        ("gguf", "NomicBertModel", 64, 128, 2, 256)
    assert (info.pooler.pooling_type, info.pooler.normalize, info.pooler.encoder_only) == \
        ("MEAN", True, True)
    cfg = gguf_encoder_config(read_gguf_header(nomic["Q8_0"]))
    assert (cfg.family, cfg.global_rope_theta, cfg.hidden_act, cfg.type_vocab_size,
            cfg.attention_bias, cfg.mlp_bias) == ("nomic", NOMIC_THETA, "silu", 2, False, False)


# float32 torch ops (measured worst cosines: F32 1 - 0, Q8_0 1 - 8.2e-5)
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_nomic_embeddings_match_sentence_transformers(nomic, qtype):
    cosines = _cosines(_embeddings(nomic[qtype]), nomic["want"])
    assert (cosines > BOUNDS[qtype]).all(), cosines


def test_a_q8_0_gguf_nomic_bert_embeds_on_the_native_tiers(nomic, tier):
    """bfloat16 over Q8_0's rounding (measured worst cosine on avx2: 1 - 1.1e-4)."""
    cosines = _cosines(_embeddings(nomic["Q8_0"], tier), nomic["want"])
    assert (cosines > 1 - 5e-4).all(), cosines


def test_nomic_ais_own_config_reads_as_transformers_one(nomic, tmp_path):
    """nomic-ai's config.json (remote code: n_embd, rotary_emb_base, max_trained_positions)
    over the same weights (transformers saves nomic-ai's tensor names) embeds the same; a
    block it does not compute (prenorm) is refused by name."""
    import json
    import shutil
    path = shutil.copytree(nomic["hf"], tmp_path / "nomic-ai")
    theirs = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "n_embd": 128,
              "n_layer": 2, "n_head": 2, "n_inner": 256, "n_positions": 8192,
              "max_trained_positions": 48, "vocab_size": 160, "type_vocab_size": 2,
              "layer_norm_epsilon": 1e-12, "rotary_emb_base": NOMIC_THETA,
              "activation_function": "swiglu", "prenorm": False, "causal": False,
              "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
              "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
              "rotary_emb_scale_base": None}
    (path / "config.json").write_text(json.dumps(theirs))
    assert resolve_model(str(path)).max_model_len == 48
    cosines = _cosines(_embeddings(str(path)), nomic["want"])
    assert (cosines > 1 - 1e-6).all(), cosines
    from pagewire.executor.models.encoder_config import EncoderConfig
    with pytest.raises(ValueError, match="prenorm=True is not supported"):
        EncoderConfig.from_hf({**theirs, "prenorm": True, "hidden_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 2,
                               "intermediate_size": 256, "max_position_embeddings": 48})


# An XLM-R cross-encoder (bge-reranker-style) as llama.cpp's converter writes it: arch "bert",
# a "t5" Unigram vocabulary, the head as cls / cls.output; transformers'
# XLMRobertaForSequenceClassification (sigmoid of its one logit) is the oracle.
QUERY = "where does the cat sleep"
DOCS = ["the cat sleeps in the house", "Paris is a big city!", "the dog runs", "",
        "cats sleep, dogs run " * 3]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """{name: path}: the tiny reranker, its GGUF, and transformers' scores of DOCS."""
    import torch
    from transformers import AutoTokenizer, XLMRobertaForSequenceClassification

    from pagewire.testing.gguf_xlmr import make_reranker, write_reranker_gguf
    root = tmp_path_factory.mktemp("reranker")
    hf = make_reranker(str(root / "hf"))
    tok = AutoTokenizer.from_pretrained(hf)
    model = XLMRobertaForSequenceClassification.from_pretrained(hf).eval()
    with torch.inference_mode():
        want = [torch.sigmoid(model(**tok(QUERY, d, return_tensors="pt")).logits)[0, 0].item()
                for d in DOCS]
    return {"hf": hf, "gguf": write_reranker_gguf(hf, str(root / "reranker.gguf")),
            "want": np.array(want)}


def test_a_gguf_reranker_resolves_as_a_classifier_with_its_unigram_tokenizer(reranker):
    from transformers import AutoTokenizer

    from pagewire.hf_tokenizer import load_tokenizer
    info = with_pooler(resolve_model(reranker["gguf"]))
    assert (info.architecture, info.max_model_len, info.pooler.task,
            info.pooler.labels) == ("BertForSequenceClassification", 62, "classify", ["LABEL_0"])
    want, got = AutoTokenizer.from_pretrained(reranker["hf"]), load_tokenizer(info)
    for text, pair in zip(TEXTS + ODD, PAIRS * 2):
        assert got(text)["input_ids"] == want(text)["input_ids"], text
        assert got(text, pair)["input_ids"] == want(text, pair)["input_ids"], (text, pair)


def test_a_bert_classifier_without_its_pooler_is_refused():
    """llama.cpp's converter drops a BertForSequenceClassification's pooler (cls.output
    alone): neither llama.cpp nor pagewire can run that head."""
    from pagewire.gguf_bert import hf_architecture
    meta = {"general.architecture": "bert"}
    assert hf_architecture(meta, {"cls.weight", "cls.output.weight"}) == \
        "BertForSequenceClassification"
    assert hf_architecture(meta, {"token_embd.weight"}) == "BertModel"
    with pytest.raises(ValueError, match="m.gguf: a GGUF bert classifier .* no cls dense"):
        hf_architecture(meta, {"cls.output.weight"}, "m.gguf")


def _scores(path: str, kernels: str = "torch") -> np.ndarray:
    dtype = "float32" if kernels == "torch" else "bfloat16"
    llm = LLM(path, dtype=dtype, kernels=kernels, max_num_seqs=3)
    return np.array([o.outputs.score for o in llm.score(QUERY, DOCS)])


def test_gguf_reranker_scores_match_transformers(reranker):
    """float32 torch ops, F32 weights (measured: within 6e-8), in transformers' order."""
    got = _scores(reranker["gguf"])
    np.testing.assert_allclose(got, reranker["want"], atol=1e-6)
    assert list(np.argsort(-got)) == list(np.argsort(-reranker["want"]))


def test_a_gguf_reranker_scores_on_the_native_tiers(reranker, tier):
    """bfloat16 weights and activations (measured on avx2: within 2e-3)."""
    np.testing.assert_allclose(_scores(reranker["gguf"], tier), reranker["want"], atol=6e-3)


def test_an_xlm_r_gguf_embeds_as_sentence_transformers(tmp_path):
    """BGE-M3-style: an XLMRobertaModel (CLS pooled) as "bert" with a "t5" vocabulary and the
    converter's cut position table (float32 torch ops; measured: within 1.2e-7 of 1)."""
    from sentence_transformers import SentenceTransformer

    from pagewire.testing.gguf_xlmr import make_reranker, write_reranker_gguf
    hf = make_reranker(str(tmp_path / "hf"), "XLMRobertaModel")
    path = write_reranker_gguf(hf, str(tmp_path / "xlmr.gguf"))
    info = with_pooler(resolve_model(path))
    assert (info.architecture, info.pooler.pooling_type) == ("BertModel", "CLS")
    want = SentenceTransformer(hf, device="cpu").encode(TEXTS)
    cosines = _cosines(_embeddings(path), want)
    assert (cosines > 1 - 1e-6).all(), cosines
