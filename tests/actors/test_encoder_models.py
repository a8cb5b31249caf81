"""The encoder-only models (executor/models/encoder.py) on tiny random checkpoints against
transformers at model level: a flat batch of 3 sequences (5, 17 and 1 tokens) gives, for each
token, transformers' last_hidden_state of its sequence run alone, and the classifiers its
logits, through Backend.load (the layout the backend gives each kernel set) on the torch
reference and every native CPU tier this machine runs."""
from __future__ import annotations

import pytest
import torch

from pagewire.config import EngineConfig
from pagewire.executor.backend import Backend
from pagewire.executor.models.encoder import EncoderModel
from pagewire.model_info import ENCODER_ARCHITECTURES, ModelInfo
from pagewire.testing.tiny_encoder import NUM_LABELS, TINY, make_tiny_encoder

LENS = [5, 17, 1]
CLASSIFIERS = [a for a in ENCODER_ARCHITECTURES if a.endswith("ForSequenceClassification")]
# (hidden states, logits): float32 on every kernel set within 1e-4 of transformers' float32
# (measured: <= 4e-6). bfloat16 (native tiers): activations rounded to 8 bits of mantissa
# after each op, against transformers' float32 on the same (bfloat16-valued) weights: hidden
# states (LayerNorm outputs, |h| up to ~4) within 0.08, logits within 0.06 (measured: <= 0.04
# and 0.034, each tier)
BOUNDS = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (0.08, 0.06)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("encoders")
    return {a: make_tiny_encoder(str(root / a), a) for a in ENCODER_ARCHITECTURES}


def _inputs(architecture: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Token ids (a padding id inside the first sequence: RoBERTa's positions skip it) and
    token types (BERT's and NomicBERT's second sequence a pair: its last 9 tokens type 1)."""
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, TINY["vocab_size"], (n,), generator=g) for n in LENS]
    ids[0][2] = 1
    types = [torch.zeros(n, dtype=torch.int64) for n in LENS]
    if architecture.startswith(("Bert", "NomicBert")):
        types[1][8:] = 1
    return ids, types


_REFERENCE: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor | None]] = {}


def _reference(path: str, key_name: str, dtype: torch.dtype):
    """transformers' hidden states [T, H] and logits [B, labels] (None for a base model),
    each sequence run alone, in float32 on the weights rounded to `dtype`; cached by
    `key_name` (the architecture, and "-variant" for another checkpoint of it)."""
    key, architecture = (key_name, dtype), key_name.split("-")[0]
    if key not in _REFERENCE:
        import transformers
        model = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32)
        model = model.to(dtype).float().eval()
        base = getattr(model, model.base_model_prefix, model)
        ids, types = _inputs(architecture)
        typed = not architecture.startswith(("MPNet", "ModernBert"))
        hidden, logits = [], []
        with torch.inference_mode():
            for i, t in zip(ids, types):
                kw = {"token_type_ids": t[None]} if typed else {}
                hidden.append(base(input_ids=i[None], **kw).last_hidden_state[0])
                if model is not base:       # [1, labels], or a token classifier's [1, n, labels]
                    logits.append(model(input_ids=i[None], **kw).logits.flatten(0, -2))
        _REFERENCE[key] = (torch.cat(hidden), torch.cat(logits) if logits else None)
    return _REFERENCE[key]


def _load(path: str, architecture: str, kernels: str, dtype: torch.dtype,
          tp=None) -> EncoderModel:
    info = ModelInfo(path=path, format="hf", name="tiny", architecture=architecture,
                     max_model_len=TINY["max_position_embeddings"],
                     vocab_size=TINY["vocab_size"], num_layers=2, num_kv_heads=2, head_dim=64,
                     eos_token_ids=[], digest="tiny")
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    config = EngineConfig.from_options(model_info=info, dtype=name, kernels=kernels)
    return Backend(torch.device("cpu"), kernels).load(info, config, tp)


def _run(model: EncoderModel, architecture: str) -> torch.Tensor:
    ids, types = _inputs(architecture)
    with torch.inference_mode():
        return model(torch.cat(ids), torch.cat(types), LENS)


@pytest.mark.parametrize("architecture", ENCODER_ARCHITECTURES)
def test_on_torch_float32(checkpoints, architecture):
    _check(checkpoints[architecture], architecture, "torch", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("architecture", ENCODER_ARCHITECTURES)
def test_on_each_tier(checkpoints, architecture, tier, dtype):
    """The tier's layout (oneDNN-packed or BF16-tiled linears, native norms and GELU; in
    bfloat16 on AVX512-BF16 the native attention too)."""
    _check(checkpoints[architecture], architecture, tier, dtype)


def _check(path: str, architecture: str, kernels: str, dtype: torch.dtype) -> None:
    """Every token's hidden state, and a classifier's logits, against transformers'."""
    model = _load(path, architecture, kernels, dtype)
    hidden_bound, logit_bound = BOUNDS[dtype]
    theirs, their_logits = _reference(path, architecture, dtype)
    ours = _run(model, architecture)
    assert ours.shape == (sum(LENS), TINY["hidden_size"]) and ours.dtype == dtype
    worst = float((ours.float() - theirs).abs().max())
    print(architecture, kernels, dtype, "max |hidden difference|:", worst)
    assert worst < hidden_bound
    if their_logits is None:
        return
    tokens = architecture.endswith("ForTokenClassification")
    logits = model.classify_tokens(ours) if tokens else model.classify(ours, LENS)
    assert logits.shape == (sum(LENS) if tokens else len(LENS), NUM_LABELS)
    assert logits.dtype == torch.float32
    worst = float((logits - their_logits).abs().max())
    print(architecture, kernels, dtype, "max |logit difference|:", worst)
    assert worst < logit_bound


@pytest.mark.parametrize("architecture", ["BertModel", "MPNetModel"])
def test_pooling_types(checkpoints, architecture):
    """CLS: each sequence's first token; LAST: its last; MEAN: its tokens' mean (as
    sentence-transformers' mean pooling of transformers' states), float32 [B, H]."""
    model = _load(checkpoints[architecture], architecture, "torch", torch.float32)
    hidden = _run(model, architecture)
    theirs, _ = _reference(checkpoints[architecture], architecture, torch.float32)
    starts = [0, 5, 22]
    cls, last, mean = (model.embed(hidden, LENS, kind) for kind in ("CLS", "LAST", "MEAN"))
    assert cls.dtype == last.dtype == mean.dtype == torch.float32
    assert torch.equal(cls, hidden[starts])
    assert torch.equal(last, hidden[[4, 21, 22]])
    expected = torch.stack([theirs[s:s + n].mean(0) for s, n in zip(starts, LENS)])
    assert float((mean - expected).abs().max()) < 1e-5
    with pytest.raises(ValueError, match="pooling type"):
        model.embed(hidden, LENS, "MAX")


def test_a_base_model_has_no_classifier_and_one_rank_only(checkpoints):
    from pagewire.executor.parallel import TensorParallel
    model = _load(checkpoints["RobertaModel"], "RobertaModel", "torch", torch.float32)
    with pytest.raises(ValueError, match="no classification head"):
        model.classify(_run(model, "RobertaModel"), LENS)
    two = TensorParallel(rank=0, size=2)
    with pytest.raises(ValueError, match="tensor parallelism"):
        _load(checkpoints["BertModel"], "BertModel", "torch", torch.float32, two)


def test_prefixed_names_and_old_layer_norm_names_load_the_same(checkpoints, tmp_path):
    """A base model's tensors under its base-model prefix ("bert."), with old BERT's LayerNorm
    gamma / beta names and a masked-LM head beside them, give the same states."""
    import shutil

    from safetensors.torch import load_file, save_file
    source = checkpoints["BertModel"]
    renamed = {}
    for name, tensor in load_file(f"{source}/model.safetensors").items():
        name = name.replace("LayerNorm.weight", "LayerNorm.gamma") \
            .replace("LayerNorm.bias", "LayerNorm.beta")
        renamed["bert." + name] = tensor
    renamed["cls.predictions.bias"] = torch.zeros(TINY["vocab_size"])
    save_file(renamed, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{source}/config.json", tmp_path / "config.json")
    ours = _run(_load(str(tmp_path), "BertModel", "torch", torch.float32), "BertModel")
    assert torch.equal(ours, _run(_load(source, "BertModel", "torch", torch.float32),
                                  "BertModel"))


def test_config_options():
    """ModernBERT's older keys (global_attn_every_n_layers, global/local_rope_theta, a null
    local theta: global's); what the encoder cannot compute is refused by name."""
    from pagewire.executor.models.encoder_config import EncoderConfig
    base = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                intermediate_size=96, vocab_size=100, max_position_embeddings=512)
    old = EncoderConfig.from_hf({**base, "architectures": ["ModernBertModel"],
                                 "global_attn_every_n_layers": 3, "local_attention": 128,
                                 "global_rope_theta": 160000.0, "local_rope_theta": None})
    assert (old.global_layers, old.local_window) == ((True, False, False, True), 64)
    assert old.local_rope_theta == old.global_rope_theta == 160000.0
    assert (old.norm_bias, old.mlp_bias, old.classifier) == (False, False, False)
    cls = EncoderConfig.from_hf({**base, "architectures": ["XLMRobertaForSequenceClassification"],
                                 "pad_token_id": 1, "id2label": {"0": "a", "1": "b", "2": "c",
                                                                  "3": "d"}})
    assert (cls.family, cls.padding_idx, cls.num_labels, cls.classifier) == \
        ("roberta", 1, 4, True)
    with pytest.raises(ValueError, match="relative_key"):
        EncoderConfig.from_hf({**base, "architectures": ["BertModel"],
                               "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="silu"):
        EncoderConfig.from_hf({**base, "architectures": ["BertModel"], "hidden_act": "silu"})


def test_roberta_reads_no_token_types(checkpoints):
    """A pair's types (1 from its second text on, as the engine lays them out for every
    model) change BERT's states and not XLM-R's (type_vocab_size 1; its tokenizer gives
    none, transformers then uses type 0)."""
    ids = torch.randint(3, TINY["vocab_size"], (9,), generator=torch.Generator().manual_seed(2))
    pair = torch.tensor([0] * 4 + [1] * 5)
    for architecture, changes in (("BertModel", True), ("XLMRobertaModel", False)):
        model = _load(checkpoints[architecture], architecture, "torch", torch.float32)
        with torch.inference_mode():
            plain, typed = model(ids, None, [9]), model(ids, pair, [9])
        assert torch.equal(plain, typed) != changes


def test_mpnet_position_bias_is_transformers_at_every_distance():
    """Relative distances past the exact buckets (8) and past max_distance (128: the last
    bucket) index the table as transformers' compute_position_bias does."""
    from transformers import MPNetConfig
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    from pagewire.executor.models.encoder import mpnet_position_bias
    torch.manual_seed(0)
    encoder = MPNetEncoder(MPNetConfig(**TINY, relative_attention_num_buckets=32))
    theirs = encoder.compute_position_bias(torch.zeros(1, 300, 1))[0]          # [H, L, L]
    ours = mpnet_position_bias(encoder.relative_attention_bias.weight.detach(), 300)
    assert torch.equal(ours, theirs)


def test_modernbert_classifies_from_the_mean_too(tmp_path):
    """classifier_pooling "mean": the head reads each sequence's mean state."""
    architecture = "ModernBertForSequenceClassification"
    path = make_tiny_encoder(str(tmp_path), architecture, classifier_pooling="mean")
    model = _load(path, architecture, "torch", torch.float32)
    assert model.cfg.classifier_pooling == "mean"
    _, theirs = _reference(path, architecture + "-mean", torch.float32)
    logits = model.classify(_run(model, architecture), LENS)
    assert float((logits - theirs).abs().max()) < 1e-4
