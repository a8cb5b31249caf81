"""The model's shape and per-architecture options, read from a Hugging Face config.json or a
GGUF header. One dataclass serves every architecture (the Llama family, the mixtures of
experts, the GPT family): each is a set of options on the same decoder (see llama.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagewire.model_info import (DECODER_CLASSIFIERS, GPT_ARCHITECTURES, MOE_ARCHITECTURES,
                                 MULTI_HEAD_ARCHITECTURES, hf_text_config)


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False             # biases on q, k, v (Qwen2)
    qk_norm: bool = False                    # RMSNorm of each q and k head before rope (Qwen3, Gemma3)
    sandwich_norms: bool = False             # norms after attention and MLP too (Gemma2/3)
    activation: str = "silu"                 # "silu" | "gelu_tanh" (Gemma)
    embed_scale: float = 1.0                 # embeddings times this (Gemma: sqrt(hidden))
    attn_scale: float | None = None          # default head_dim ** -0.5
    attn_softcap: float | None = None        # scores -> cap * tanh(scores / cap) (Gemma2)
    final_softcap: float | None = None       # the same on the logits
    # Per layer: the sliding window (None: global attention) and which rope table it uses
    # (index into rope_tables). Empty lists mean every layer global, table 0.
    layer_windows: list[int | None] = field(default_factory=list)
    layer_rope: list[int] = field(default_factory=list)
    # Rope tables: (theta, Hugging Face rope parameters or None). Table 0 is the default.
    rope_tables: list[tuple[float, dict | None]] = field(default_factory=list)
    rope_freq_divisors: list[float] | None = None   # GGUF Llama 3: the global table's
                                                    # frequencies divided by these (rope_freqs)
    rope_table_len: int = 0                  # positions tabled: max_position x a linear,
                                             # dynamic or yarn factor (the context grows too)
    qk_norm_flat: bool = False               # the q/k norms span all heads' q (k), not one head (OLMoE)
    # GPT-family blocks (GPT-NeoX, GPT-2): LayerNorms with biases, a plain (ungated) MLP with
    # biases, attention and MLP in parallel off one residual, rope on part of each head or
    # learned absolute positions instead.
    layer_norm: bool = False                 # LayerNorm (with bias), not RMSNorm
    parallel_residual: bool = False          # x + attn(norm1(x)) + mlp(norm2(x))
    gated_mlp: bool = True                   # act(gate) * up; else act(up)
    mlp_bias: bool = True                    # the plain MLP's biases (Starcoder2: use_bias)
    o_proj_bias: bool = False
    lm_head_bias: bool = False               # GPT-J, Phi-2
    rotary_dim: int = 0                      # rope on the first rotary_dim of a head (0: all;
    #                                          -1: no rope: learned positions)
    learned_positions: int = 0               # a table of this many positions added to the
    #                                          embeddings (GPT-2)
    # Mixture of experts (models/moe.py): a sparse MLP in the layers `sparse_layers` marks.
    # 0 experts: every MLP dense.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_top_k: bool = False            # the chosen experts' weights rescaled to sum to 1
    shared_expert_size: int = 0              # a gated dense expert every token takes (Qwen2-MoE)
    sparse_layers: list[bool] = field(default_factory=list)
    # gpt-oss (_gpt_oss): attention sinks (a learned logit per q head in each softmax), biases
    # on the router and every expert Linear, top-k of the router's logits then a softmax over
    # those k, and experts of the clamped SwiGLU ("swiglu_oai", kernels/activation.py).
    attention_sinks: bool = False
    moe_bias: bool = False
    topk_then_softmax: bool = False
    expert_activation: str = "silu"          # "silu" | "swiglu_oai"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    stacked_experts: bool = True             # Hugging Face's [E, H, 2I] stacks; GGUF's: gate,
    #                                          up and down stacked apart, [E, rows, cols]
    architecture: str = "LlamaForCausalLM"
    num_labels: int = 0                      # a classifier's (*ForSequenceClassification):
    #                                          its score head's rows replace the LM head's

    def __post_init__(self):
        if not self.rope_tables:
            self.rope_tables = [(self.rope_theta, None)]
        if not self.layer_windows:
            self.layer_windows = [None] * self.num_layers
        if not self.layer_rope:
            self.layer_rope = [0] * self.num_layers
        if not self.sparse_layers:
            self.sparse_layers = [self.num_experts > 0] * self.num_layers
        if self.attn_scale is None:
            self.attn_scale = self.head_dim ** -0.5
        if not self.rope_table_len:
            factors = [s.get("factor", 1.0) for _, s in self.rope_tables if s
                       and s.get("rope_type") in ("linear", "dynamic", "yarn")]
            self.rope_table_len = int(self.max_position * max(factors, default=1.0))

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer slides (Mistral): blocks behind it can be freed."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        labels = len(cfg.get("id2label") or {}) or cfg.get("num_labels", 2) \
            if arch in DECODER_CLASSIFIERS else 0
        arch = DECODER_CLASSIFIERS.get(arch, arch)           # the decoder under the score head
        cfg = hf_text_config(cfg)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = _rope_parameters(cfg)
        base = dict(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim, rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", 10000.0),
            max_position=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", arch.startswith("Gemma")),
            attention_bias=cfg.get("attention_bias", False), architecture=arch,
            num_labels=labels)
        if labels:                   # the score head is its own matrix, whatever ties say
            base["tie_word_embeddings"] = False
        scaled = rope if rope.get("rope_type", "default") != "default" else None
        base["rope_tables"] = [(base["rope_theta"], scaled)]
        n = base["num_layers"]
        if arch == "Qwen2ForCausalLM":
            base["attention_bias"] = True
            if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
                first = cfg.get("max_window_layers", n)
                base["layer_windows"] = [cfg["sliding_window"] if i >= first else None
                                         for i in range(n)]
        elif arch == "Qwen3ForCausalLM":
            base["qk_norm"] = True
        elif arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
            base["layer_windows"] = [cfg.get("sliding_window")] * n
        elif arch == "GemmaForCausalLM":
            base.update(activation="gelu_tanh", embed_scale=base["hidden_size"] ** 0.5)
        elif arch.startswith("Gemma"):
            base.update(_gemma(cfg, arch, base))
        if arch in MOE_ARCHITECTURES:
            base.update(_moe(cfg, arch, n))
        if arch == "GptOssForCausalLM":
            base.update(_gpt_oss(cfg, base))
        if arch in GPT_ARCHITECTURES:
            base.update(_gpt(cfg, arch, base))
        return cls(**base)

    @classmethod
    def from_gguf(cls, meta: dict[str, Any], has_output: bool) -> "LlamaConfig":
        """llama.cpp's metadata in Hugging Face's terms, then from_hf (the tensors come under
        Hugging Face names too, see gguf_weights.py)."""
        from pagewire.model_info import gguf_architecture
        from pagewire.rope_scaling import gguf_rope_scaling
        arch = meta["general.architecture"]
        heads = int(meta[f"{arch}.attention.head_count"])
        hidden = int(meta[f"{arch}.embedding_length"])

        def get(key, default=None):
            return meta.get(f"{arch}.{key}", default)
        cfg = {"architectures": [gguf_architecture(meta)],
               "vocab_size": int(get("vocab_size") or len(meta["tokenizer.ggml.tokens"])),
               "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
               "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
               "num_key_value_heads": int(get("attention.head_count_kv", heads)),
               "head_dim": int(get("attention.key_length", hidden // heads)),
               "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon",
                                         get("attention.layer_norm_epsilon"))),
               "rope_theta": float(get("rope.freq_base", 10000.0)),
               "rope_scaling": gguf_rope_scaling(meta, arch),
               "max_position_embeddings": int(get("context_length")),
               "tie_word_embeddings": not has_output,
               "sliding_window": get("attention.sliding_window"),
               "attn_logit_softcapping": get("attn_logit_softcapping"),
               "final_logit_softcapping": get("final_logit_softcapping")}
        if get("expert_count"):           # llama.cpp's names for the experts' settings
            cfg.update(num_experts=int(get("expert_count")),
                       num_experts_per_tok=int(get("expert_used_count")),
                       moe_intermediate_size=int(get("expert_feed_forward_length", 0)) or None,
                       shared_expert_intermediate_size=get("expert_shared_feed_forward_length"),
                       norm_topk_prob=bool(get("expert_weights_norm", arch == "qwen3moe")))
        if arch in ("gptneox", "gpt2", "phi2", "starcoder2"):
            cfg.update(_gguf_gpt(arch, get, cfg, hidden // heads))
        if arch == "gpt-oss":             # converter: gate and up stacked apart, yarn untruncated
            cfg.update(stacked_experts=False, rope_scaling=cfg["rope_scaling"] and
                       {**cfg["rope_scaling"], "truncate": False})
        if arch == "llama":
            cfg["sliding_window"] = None
        if arch == "qwen2":
            cfg["use_sliding_window"] = False
        return cls.from_hf({k: v for k, v in cfg.items() if v is not None})


def _gguf_gpt(arch: str, get, cfg: dict, head_dim: int) -> dict:
    """The GPT family's keys from llama.cpp's: LayerNorms' epsilon, the activation (GPT-NeoX's
    exact GELU, the others' tanh form), rope on rope.dimension_count columns."""
    out = dict(hidden_act="gelu" if arch == "gptneox" else "gelu_new",
               layer_norm_eps=cfg["rms_norm_eps"], norm_epsilon=cfg["rms_norm_eps"],
               partial_rotary_factor=int(get("rope.dimension_count", head_dim)) / head_dim)
    if arch == "gptneox":
        out.update(use_parallel_residual=bool(get("use_parallel_residual", True)),
                   rotary_pct=out["partial_rotary_factor"], rotary_emb_base=cfg["rope_theta"])
    return out


def _moe(cfg: dict, arch: str, n: int) -> dict:
    """Experts, how many a token takes and how their weights are normalised (Mixtral always;
    the others as norm_topk_prob says), each architecture's attention options, and which
    layers are sparse (Qwen-MoE: every decoder_sparse_step-th but mlp_only_layers)."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    out = dict(num_experts=experts, experts_per_token=cfg["num_experts_per_tok"],
               expert_intermediate_size=cfg.get("moe_intermediate_size")
               or cfg["intermediate_size"],
               normalize_top_k=arch == "MixtralForCausalLM" or cfg.get("norm_topk_prob", False))
    if arch == "MixtralForCausalLM":
        out["layer_windows"] = [cfg.get("sliding_window")] * n
    elif arch == "OlmoeForCausalLM":
        if cfg.get("clip_qkv") is not None:
            raise ValueError("OlmoeForCausalLM with clip_qkv is not supported")
        out.update(qk_norm=True, qk_norm_flat=True)
    elif arch.startswith("Qwen"):                             # Qwen2-MoE, Qwen3-MoE
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        out["sparse_layers"] = [(i + 1) % step == 0 and i not in dense for i in range(n)]
        if arch == "Qwen2MoeForCausalLM":
            out.update(attention_bias=cfg.get("qkv_bias", True),
                       shared_expert_size=cfg.get("shared_expert_intermediate_size") or 0)
        else:
            out["qk_norm"] = True
    return out


def _gpt(cfg: dict, arch: str, base: dict) -> dict:
    """Every one: LayerNorms, a plain MLP, head_dim hidden / heads whatever other keys say.
    GPT-NeoX, GPT-J and Phi-2: attention and MLP in parallel (GPT-J and Phi-2 off one norm,
    which the loader gives both norms' places: gpt_weights.py), rope on part of each head
    (GPT-J's interleaved pairs made rotate-half by its q/k rows' order). GPT-2: learned
    positions, a tied head. Starcoder2: sequential, grouped-query, a sliding window.
    Activation: exact GELU where the config says "gelu", else its tanh form."""
    act = cfg.get("hidden_act") or cfg.get("activation_function")
    heads = cfg["num_attention_heads"]
    head_dim = cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    out = dict(num_kv_heads=heads if arch in MULTI_HEAD_ARCHITECTURES
               else cfg.get("num_key_value_heads") or heads,
               head_dim=head_dim,
               layer_norm=True, gated_mlp=False, attention_bias=True, o_proj_bias=True,
               rms_norm_eps=cfg.get("layer_norm_eps", 1e-5),
               activation="gelu" if act == "gelu" else "gelu_tanh")
    if arch == "GPTNeoXForCausalLM":
        factor = rope.get("partial_rotary_factor", cfg.get("rotary_pct", 1.0))
        out.update(parallel_residual=cfg.get("use_parallel_residual", True),
                   attention_bias=cfg.get("attention_bias", True),
                   o_proj_bias=cfg.get("attention_bias", True), rotary_dim=int(head_dim * factor),
                   rope_theta=rope.get("rope_theta", cfg.get("rotary_emb_base", 10000.0)))
    elif arch == "GPTJForCausalLM":
        out.update(parallel_residual=True, attention_bias=False, o_proj_bias=False,
                   lm_head_bias=True, rotary_dim=cfg.get("rotary_dim") or head_dim,
                   rope_theta=10000.0)
    elif arch == "PhiForCausalLM":
        if cfg.get("qk_layernorm"):
            raise ValueError("PhiForCausalLM with qk_layernorm is not supported")
        out.update(parallel_residual=True, lm_head_bias=True,
                   rotary_dim=int(head_dim * rope.get("partial_rotary_factor",
                                                      cfg.get("partial_rotary_factor", 0.5))),
                   rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    elif arch == "Starcoder2ForCausalLM":
        bias = cfg.get("use_bias", True)
        out.update(attention_bias=bias, o_proj_bias=bias, mlp_bias=bias,
                   rms_norm_eps=cfg.get("norm_epsilon", 1e-5),
                   layer_windows=[cfg.get("sliding_window")] * base["num_layers"])
        return out                          # full rope, base["rope_tables"] as read
    else:
        return {**out, "rotary_dim": -1, "learned_positions": base["max_position"],
                "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}
    out["rope_tables"] = [(out["rope_theta"], None)]
    return out


def _gpt_oss(cfg: dict, base: dict) -> dict:
    """gpt-oss: biases on q, k, v and o; sinks; sliding and full layers as layer_types says
    (transformers' default: even layers slide); the MoE options of LlamaConfig's gpt-oss
    group. Its max_position_embeddings is the yarn-extended length already (131072 = 4096 x
    32), so the rope table spans that, not that times the factor."""
    n, bias = base["num_layers"], cfg.get("attention_bias", True)
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(n)]
    rope = base["rope_tables"][0][1] or {}
    extended = int(rope.get("original_max_position_embeddings", 0) * rope.get("factor", 1.0))
    return dict(attention_bias=bias, o_proj_bias=bias, attention_sinks=True, moe_bias=True,
                topk_then_softmax=True, expert_activation="swiglu_oai",
                swiglu_alpha=cfg.get("swiglu_alpha", 1.702),
                swiglu_limit=cfg.get("swiglu_limit", 7.0),
                stacked_experts=cfg.get("stacked_experts", True),
                layer_windows=[cfg.get("sliding_window") if t == "sliding_attention" else None
                               for t in types],
                rope_table_len=max(base["max_position"], extended))


def _rope_parameters(cfg: dict) -> dict:
    """transformers 5 keeps rope settings in rope_parameters (theta included); older configs
    have rope_theta and rope_scaling."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope


def _gemma(cfg: dict, arch: str, base: dict) -> dict:
    """Gemma2/Gemma3: sandwich norms, GELU, scaled embeddings, soft-capping (Gemma2),
    alternating sliding/global layers (Gemma3: its own rope base for the sliding ones)."""
    n = base["num_layers"]
    out = dict(sandwich_norms=True, activation="gelu_tanh",
               embed_scale=base["hidden_size"] ** 0.5,
               attn_scale=cfg.get("query_pre_attn_scalar", base["head_dim"]) ** -0.5,
               attn_softcap=cfg.get("attn_logit_softcapping"),
               final_softcap=cfg.get("final_logit_softcapping"))
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:            # Gemma2: even layers slide; Gemma3: 5 sliding, then 1 global
        period = cfg.get("sliding_window_pattern", 2 if arch.startswith("Gemma2") else 6)
        types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                 for i in range(n)]
    out["layer_windows"] = [window if t == "sliding_attention" else None for t in types]
    if arch.startswith("Gemma3"):
        out["qk_norm"] = True
        rope = cfg.get("rope_parameters") or {}
        if "sliding_attention" in rope:          # transformers 5: one set per layer type
            full, local = rope["full_attention"], rope["sliding_attention"]
        else:
            full = _rope_parameters(cfg)
            local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
        out["rope_tables"] = [(full.get("rope_theta", 1e6), _scaled(full)),
                              (local.get("rope_theta", 1e4), _scaled(local))]
        out["layer_rope"] = [1 if t == "sliding_attention" else 0 for t in types]
    return out


def _scaled(rope: dict) -> dict | None:
    return rope if rope.get("rope_type", "default") != "default" else None
