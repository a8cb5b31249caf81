"""The options of the encoder-only models (model_info.ENCODER_ARCHITECTURES), read from a
Hugging Face config.json. Five families share one encoder (encoder.py):

    bert        learned absolute positions 0..n-1, token types, post-norm layers
    roberta     RoBERTa and XLM-R: as BERT, positions counted from pad_token_id + 1
    mpnet       as RoBERTa (padding index 1), no token types, a relative position bias
                (T5's buckets) added to every layer's scores
    modernbert  rope (a base for global layers, another for local ones), every
                global_attn_every_n_layers-th layer global, the others a symmetric window of
                local_attention / 2 each way; pre-norm, GeGLU, LayerNorms without bias by
                default, a final norm
    nomic       nomic-embed-text (NomicBertModel): as BERT (post-norm, token types) but rope
                on every layer (one base, rotate-half pairs) in place of learned positions,
                a SwiGLU MLP (silu(gate) * up), no Linear biases
"""
from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("bert", "roberta", "mpnet", "modernbert", "nomic")
# the families whose attention rotates q and k (no learned positions) and whose MLP is gated
ROTARY_FAMILIES = ("modernbert", "nomic")
# transformers' ACT2FN names the encoder computes -> ops.gelu's form ("none": exact erf GELU)
GELU_FORMS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
              "gelu_fast": "tanh"}
# MPNet's compute_position_bias buckets relative positions into 32 whatever the config says
MPNET_BUCKETS = 32
MPNET_PADDING_IDX = 1


def family_of(architecture: str) -> str:
    for prefix, family in (("ModernBert", "modernbert"), ("NomicBert", "nomic"),
                           ("XLMRoberta", "roberta"),
                           ("Roberta", "roberta"), ("MPNet", "mpnet"), ("Bert", "bert")):
        if architecture.startswith(prefix):
            return family
    raise ValueError(f"{architecture} is not an encoder architecture")


@dataclass
class EncoderConfig:
    architecture: str
    family: str                       # FAMILIES
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    type_vocab_size: int = 0          # 0: no token type embedding (MPNet, ModernBERT)
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    # roberta and mpnet: positions padding_idx + 1 + i (transformers'
    # create_position_ids_from_input_ids); None: 0..n-1 (bert), or rope (modernbert)
    padding_idx: int | None = None
    classifier: bool = False          # a *ForSequenceClassification model
    token_classifier: bool = False    # a *ForTokenClassification model (labels every token)
    num_labels: int = 2
    relative_buckets: int = 0         # mpnet: relative_attention_num_buckets
    # modernbert (global_rope_theta and global_layers, all True, nomic's too)
    global_layers: tuple[bool, ...] = ()   # per layer: global attention (else local)
    local_window: int = 0             # a local layer's query sees keys within this distance
    global_rope_theta: float = 160000.0
    local_rope_theta: float = 10000.0
    norm_bias: bool = True            # LayerNorms with a bias (modernbert: norm_bias)
    attention_bias: bool = True
    mlp_bias: bool = True
    classifier_pooling: str = "cls"   # modernbert's head reads the first token or the mean
    classifier_activation: str = "tanh"
    classifier_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary(self) -> bool:
        """q and k rotated, no learned positions; a gated MLP (ROTARY_FAMILIES)."""
        return self.family in ROTARY_FAMILIES

    @classmethod
    def from_hf(cls, cfg: dict, architecture: str | None = None) -> "EncoderConfig":
        """A config.json's options, for `architecture` (None: its first "architectures")."""
        architecture = architecture or (cfg.get("architectures") or [None])[0]
        if architecture is None:
            raise ValueError("config.json names no architecture")
        family = family_of(architecture)
        common = dict(architecture=architecture, family=family, hidden_size=cfg["hidden_size"],
                      num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                      intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                      max_position_embeddings=cfg["max_position_embeddings"],
                      classifier=architecture.endswith("ForSequenceClassification"),
                      token_classifier=architecture.endswith("ForTokenClassification"),
                      num_labels=_num_labels(cfg))
        if cfg["hidden_size"] % cfg["num_attention_heads"]:
            raise ValueError(f"{architecture}: hidden_size is not a multiple of the heads")
        if family == "modernbert":
            return cls(**common, **_modernbert(cfg))
        if family == "nomic":
            return cls(**common, **_nomic(cfg))
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{architecture}: position_embedding_type "
                             f"{cfg['position_embedding_type']!r} is not supported")
        act = cfg.get("hidden_act", "gelu")
        _check_activation(architecture, act)
        if family == "mpnet":
            return cls(**common, layer_norm_eps=cfg.get("layer_norm_eps", 1e-12), hidden_act=act,
                       padding_idx=MPNET_PADDING_IDX,
                       relative_buckets=cfg.get("relative_attention_num_buckets", 32))
        return cls(**common, type_vocab_size=cfg.get("type_vocab_size", 2),
                   layer_norm_eps=cfg.get("layer_norm_eps", 1e-12), hidden_act=act,
                   padding_idx=cfg.get("pad_token_id", 1) if family == "roberta" else None)


def _num_labels(cfg: dict) -> int:
    """transformers keeps the label count as id2label (num_labels is not saved); 2 by
    default, as PretrainedConfig's."""
    if cfg.get("id2label"):
        return len(cfg["id2label"])
    return cfg.get("num_labels", 2)


def _check_activation(architecture: str, act: str) -> None:
    if act not in GELU_FORMS and act != "relu":
        raise ValueError(f"{architecture}: activation {act!r} is not supported "
                         f"({', '.join([*GELU_FORMS, 'relu'])})")


# nomic-ai's own config.json (remote code; GPT-2's n_embd, ... renamed by
# model_info.hf_text_config): the values the block here computes, as llama.cpp's converter
# asserts them (another is refused by name)
_NOMIC_FIXED = {"activation_function": "swiglu", "prenorm": False, "causal": False,
                "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False,
                "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
                "rotary_emb_scale_base": None}


def _nomic(cfg: dict) -> dict:
    """NomicBertModel's options: transformers' NomicBertConfig keys (rope_parameters; its
    default base 1000, nomic-embed-text-v1.5's) or nomic-ai's (rotary_emb_base, ...)."""
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"NomicBertModel: rope scaling {rope['rope_type']!r} is not supported")
    heads = cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, cfg["hidden_size"] // heads):
        raise ValueError("NomicBertModel: head_dim other than hidden_size / heads is not "
                         "supported")
    act = cfg.get("hidden_act", "silu")
    odd = [f"{k}={cfg[k]!r}" for k, v in _NOMIC_FIXED.items() if k in cfg and cfg[k] != v]
    if act != "silu" or odd:
        raise ValueError(f"NomicBertModel: {', '.join(odd) or f'activation {act!r}'} is not "
                         "supported (nomic-embed-text v1 / v1.5's SwiGLU post-norm block is)")
    theta = rope.get("rope_theta", cfg.get("rope_theta", cfg.get("rotary_emb_base", 1000.0)))
    return dict(type_vocab_size=cfg.get("type_vocab_size", 2),
                layer_norm_eps=cfg.get("layer_norm_eps", 1e-12), hidden_act=act,
                global_layers=(True,) * cfg["num_hidden_layers"],
                global_rope_theta=float(theta), attention_bias=False, mlp_bias=False)


def _modernbert(cfg: dict) -> dict:
    """ModernBERT's options: transformers 5's layer_types and rope_parameters, or the older
    global_attn_every_n_layers and global/local_rope_theta keys."""
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        every = cfg.get("global_attn_every_n_layers", 3)
        types = ["sliding_attention" if i % every else "full_attention" for i in range(layers)]
    rope = cfg.get("rope_parameters") or {}
    for kind in ("full_attention", "sliding_attention"):
        if rope.get(kind, {}).get("rope_type", "default") != "default":
            raise ValueError(f"ModernBERT: rope scaling {rope[kind]['rope_type']!r} is not "
                             "supported")
    full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    act = cfg.get("hidden_activation", "gelu")
    head_act = cfg.get("classifier_activation", "gelu")
    for name in (act, head_act):
        _check_activation("ModernBERT", name)
    return dict(layer_norm_eps=cfg.get("norm_eps", 1e-5), hidden_act=act,
                global_layers=tuple(t == "full_attention" for t in types),
                local_window=cfg.get("local_attention", 128) // 2,
                global_rope_theta=full.get("rope_theta", cfg.get("global_rope_theta", 160000.0)),
                # an old config's local_rope_theta null: local layers rotate as global ones
                local_rope_theta=local.get("rope_theta", cfg.get("local_rope_theta", 10000.0))
                or full.get("rope_theta", cfg.get("global_rope_theta", 160000.0)),
                norm_bias=cfg.get("norm_bias", False),
                attention_bias=cfg.get("attention_bias", False),
                mlp_bias=cfg.get("mlp_bias", False),
                classifier_pooling=cfg.get("classifier_pooling", "cls"),
                classifier_activation=head_act,
                classifier_bias=cfg.get("classifier_bias", False))
