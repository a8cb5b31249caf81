"""EngineConfig's sections (vLLM's ModelConfig, CacheConfig, ... shape): each a frozen struct of
the options one part of the engine reads, with its choice lists declared once beside the field
they bound (the checks, options.py's flag choices and the code comparing against a choice all
use the same tuple). The options given as JSON objects (vLLM's spelling), --speculative-config
and --kv-transfer-config, are sections of their own, None when off. Imports no torch."""
from __future__ import annotations

import json

import msgspec

from .model_info import ModelInfo

DTYPES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("none", "int8", "int4")          # executor/load_quantization.py
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")    # kernels/kv_quant.py
PREEMPTION_MODES = AUTO_PREEMPTION, RECOMPUTE, SWAP = ("auto", "recompute", "swap")
SCHEDULING_POLICIES = FCFS, PRIORITY = ("fcfs", "priority")
DEVICES = ("auto", "cpu", "cuda")
ACTIVATIONS = ("auto", "exact", "int16", "int8", "int8-all",     # --quantized-activations
               "int8-prefill")
EXECUTORS = LOCAL, EXTERNAL = ("local", "external")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "openai")   # gateway/tools.py PARSERS
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")   # gateway/chat_output.py
SPECULATIVE_METHODS = ("ngram", "suffix", "self", "draft_model")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
KV_EVENT_PUBLISHERS = ("zmq", "null")


def check_choice(name: str, value, choices: tuple) -> None:
    """Refuse a value outside its declared choices, naming them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")


class _Section(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Section):
    """What model runs and how its weights and outputs are numbered: every actor reads it."""
    model: str | None = None                 # path to a GGUF file or HF directory; None: default
    mmproj: str | None = None                # a GGUF model's vision tower (llama.cpp's mmproj)
    served_model_name: str | None = None
    dtype: str = "auto"                      # DTYPES
    max_model_len: int | None = None         # None: the model's own context length
    quantization: str = "none"               # QUANTIZATIONS: linears rounded at load
    seed: int = 0                            # the executor's random state for unseeded sampling
    runner: str = "auto"                     # RUNNERS: generate, or pool (pooler_info.py)
    convert: str = "auto"                    # CONVERTS: a causal LM's pooled output
    pooler_config: dict | None = None        # pooler overrides (pooler_info._OVERRIDES)
    enable_sleep_mode: bool = False          # POST /sleep, /wake_up, /update_weights
    model_info: ModelInfo | None = None      # filled in by resolve()
    draft_model_info: ModelInfo | None = None    # speculative method draft_model's (resolve())


class CacheConfig(_Section):
    """The KV pool, its tiers and what its blocks hold."""
    block_size: int = 16                     # BLOCK_SIZES
    kv_cache_memory: int | None = None       # bytes of K/V cache, all layers; None: auto
                                             # (memory_budget.kv_auto)
    num_kv_blocks: int | None = None         # overrides kv_cache_memory
    kv_cache_dtype: str = "auto"             # KV_CACHE_DTYPES
    enable_prefix_caching: bool = True
    swap_space: int = 0                      # bytes of host-memory KV tier for preemption
    preemption_mode: str = AUTO_PREEMPTION   # PREEMPTION_MODES: auto swaps if it fits
    kv_offload_dir: str | None = None        # the disk KV tier's directory; None: no tier
    kv_offload_size: int = 4 * 2**30         # its bound in bytes (all ranks' files together)
    kv_compress_rate: float | None = None    # KV-Compress: share of each sequence's KV kept
    kv_compress_window: int = 64             # its latest tokens every head keeps
    num_host_blocks: int = 0                 # filled in by resolve()
    num_tier_blocks: int = 0                 # blocks the disk tier holds at most (resolve())
    kv_block_bytes: int = 0                  # one block's K/V over all layers and ranks


class SchedulerConfig(_Section):
    """What each step may hold and who waits."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = None     # plan step N+1 while step N runs
                                             # (scheduler/engine.py); None: on where a CUDA
                                             # driver is present
    scheduling_policy: str = FCFS            # SCHEDULING_POLICIES (priority: lower first)
    max_num_queued_reqs: int | None = None   # beyond: new requests are refused (HTTP 503)
    max_num_queued_tokens: int | None = None # prompt tokens waiting, beyond: refused
    encoder_budget: int | None = None        # image rows encoded in one step; None: the
                                             # token budget (scheduler/encoder_budget.py)


class DeviceConfig(_Section):
    """Where the executors run and with which kernels."""
    device: str = "auto"                     # DEVICES: auto (cuda if present, else cpu)
    kernels: str = "auto"                    # a backend: kernels/tiers.py BACKENDS
    threads: int | None = None               # torch threads in the executor; None: all cores
    quantized_matmul_tokens: int | None = -1     # steps up to this many tokens use GGUF weights
                                             # as stored; 0: never; -1: every step (no float
                                             # copy); None: auto (executor/linear_blocks.py)
    quantized_activations: str = "auto"      # ACTIVATIONS
    enforce_eager: bool = False              # no CUDA graphs
    disable_cascade_attn: bool = False       # decode rows never attend a shared prefix once
    backend: str = ""                        # executor 0's, as it reported it (gateway metric)


class ParallelConfig(_Section):
    """Executor ranks: how many, how the model and its tokens split, how remote ones attach."""
    tensor_parallel_size: int = 1            # executor ranks, each holding a share of the model
    decode_context_parallel_size: int = 1    # ranks of a KV head splitting its tokens
    enable_expert_parallel: bool = False     # ranks hold whole experts, not slices of each
    executors: str = LOCAL                   # EXECUTORS: local: the engine starts every rank;
                                             # external: ranks 1.. attach at `listen`
    listen: str | None = None                # tcp://HOST:PORT where external ranks attach
    curve_keys: str | None = None            # directory from `pagewire keys` (TCP needs it)
    attach_timeout: float = 300.0            # seconds rank 0 waits for external ranks
    tp_timeout: float = 30.0                 # a collective waiting longer than this fails


class ServerConfig(_Section):
    """The HTTP edge, its tokenizers and chat handling, and the supervisor's restart policy."""
    host: str = "127.0.0.1"
    port: int = 8000
    num_tokenizers: int = 1
    drain_timeout: float = 30.0              # seconds SIGTERM waits for in-flight requests
    restart_budget: int = 5                  # actor restarts allowed within restart_window...
    restart_window: float = 300.0            # ...seconds; beyond, the server exits 1
    warm_spares: bool = False                # a loaded spare tokenizer and detokenizer process
    api_keys: list[str] = []                 # bearer keys guarding /v1/*; empty: open
    cache_salt_per_api_key: bool = False     # each API key's requests get their own KV salt
    metrics_require_api_key: bool = False    # GET /metrics behind the API key check too
    chat_template: str | None = None         # a Jinja file replacing the model's chat template
    enable_auto_tool_choice: bool = False    # tool_choice "auto": parse the model's tool calls
    tool_call_parser: str | None = None      # TOOL_CALL_PARSERS
    reasoning_parser: str | None = None      # REASONING_PARSERS: <think> blocks (channels) apart
    limit_mm_per_prompt: dict = {}           # {"image": N}: images one prompt may hold (8)
    allowed_local_media_path: str | None = None   # file:// image URLs only under here
    allowed_media_domains: list[str] = []    # http(s):// image URLs only from these hosts
    files_dir: str | None = None             # /v1/files on disk; None: <cache>/files
    files_max_bytes: int = 2**30             # ...and their bound in all
    batch_concurrency: int = 16              # a /v1/batches job's requests in flight
    responses_store_entries: int = 1000      # /v1/responses kept (per server, every key's)...
    responses_store_bytes: int = 64 * 2**20  # ...and their bound in bytes: LRU out past either


class FleetConfig(_Section):
    """Several models behind one server (actors/front/): read by the front alone, never sent
    to an actor. Either models_file or models_dir turns it on."""
    models_file: str | None = None           # TOML/YAML/JSON: served name -> path and options
    models_dir: str | None = None            # every GGUF file / model directory in it
    model_idle_timeout: float = 0.0          # seconds unused before a model unloads; 0: never
    models_memory_budget: int | None = None  # bytes the loaded models may hold (LRU out past it)
    max_loaded_models: int = 0               # models loaded at once (LRU out past it); 0: any
    model_load_timeout: float = 300.0        # seconds a request waits for its model to load
    model_queue_size: int = 64               # requests one loading model may hold waiting


class ObservabilityConfig(_Section):
    """Tracing: every actor records its messages when trace_dir is set."""
    trace_dir: str | None = None             # record every actor's messages here
    trace_redact: bool = False               # blank prompts and outputs in traces
    trace_segment_bytes: int = 64 * 2**20    # a trace file rotates past this size...
    trace_max_segments: int = 8              # ...and each actor keeps this many
    config_digest: str = ""                  # EngineConfig.digest(), kept by resolve()


class LoraConfig(_Section):
    """LoRA adapters served beside the base model."""
    enable_lora: bool = False
    lora_modules: list[str] = []             # name=path (or JSON) adapters served from start
    max_loras: int = 1                       # distinct adapters in one step
    max_lora_rank: int = 16                  # adapters of higher rank are refused
    max_cpu_loras: int | None = None         # adapters kept loaded (LRU); None: max_loras
    allow_runtime_lora_updating: bool = False   # POST /v1/load_lora_adapter, unload_...
    lora_root: str | None = None             # run-time loads only from under this directory


# Speculation's default batch limit by device: on a CPU a verified draft row costs a good
# part of a step beyond two sequences (bench/NOTES.md "Speculative decoding": copy-heavy
# prompts 1.37x at 2 running, 1.07x at 4, free text 0.97x and 0.87x); on CUDA rows are nearly
# free (not measured here: the previous default).
MAX_BATCH = {"cpu": 2, "cuda": 8}


class SpeculativeConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """--speculative-config, as vLLM spells it (JSON). Drafts are proposed by the executor
    after each step (executor/draft_proposers.py) and verified by the target in the next."""
    method: str = "ngram"                  # ngram | suffix | self | draft_model
    model: str | None = None               # draft_model: a GGUF or HF directory sharing the
                                           # target's tokenizer
    num_speculative_tokens: int = 3        # drafts verified per step, at most
    prompt_lookup_min: int = 3             # n-gram lengths matched (ngram, suffix)
    prompt_lookup_max: int = 4
    max_batch: int | None = None           # more sequences running than this: no drafts
                                           # (None: MAX_BATCH of the executors' device)
    min_acceptance: float = 0.35           # a sequence accepting fewer drafts drafts rarely
    draft_layers: int | None = None        # self: the target's first layers that draft
                                           # (None: a quarter of them)

    def check(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be {', '.join(SPECULATIVE_METHODS[:-1])} "
                             f"or {SPECULATIVE_METHODS[-1]}, got {self.method!r}")
        if (self.model is None) == (self.method == "draft_model"):
            raise ValueError("speculative `model` goes with method draft_model (and it needs one)")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError("draft_layers must be at least 1")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in 1..16")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")


class KVTransferConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """--kv-transfer-config, as vLLM spells it (JSON): this engine's part in disaggregated
    prefill and decode (wire/kv_transfer.py has the flow)."""
    kv_connector: str = "PagewireConnector"
    kv_role: str = "kv_both"               # kv_producer (prefills) | kv_consumer | kv_both
    kv_ip: str = "127.0.0.1"               # where the KV server listens (producer)...
    kv_port: int = 14579                   # ...and the address it gives in its answers
    engine_id: str | None = None
    kv_load_failure_policy: str = "recompute"   # or "fail": a pull that fails ends the request
    kv_connector_extra_config: dict = {}   # lease_seconds (120), pull_timeout (10 s)

    def check(self) -> None:
        if self.kv_connector != "PagewireConnector":
            raise ValueError(f"kv_connector must be PagewireConnector, got {self.kv_connector!r}")
        check_choice("kv_role", self.kv_role, KV_ROLES)
        check_choice("kv_load_failure_policy", self.kv_load_failure_policy,
                     KV_LOAD_FAILURE_POLICIES)
        unknown = set(self.kv_connector_extra_config) - {"lease_seconds", "pull_timeout"}
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}")

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def lease_seconds(self) -> float:
        return float(self.kv_connector_extra_config.get("lease_seconds", 120.0))

    @property
    def pull_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("pull_timeout", 10.0))


class KVEventsConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """--kv-events-config, as vLLM spells it (JSON): the scheduler publishes its prefix cache's
    BlockStored / BlockRemoved / AllBlocksCleared events (wire/kv_events.py, docs/kv-events.md)."""
    enable_kv_cache_events: bool = False
    publisher: str | None = None           # "zmq", or "null" (none); None: zmq when enabled
    endpoint: str = "tcp://*:5557"         # PUB: bound if it has * or :: or is ipc://, else
    replay_endpoint: str | None = None     # connected; ROUTER answering replays (bound)
    buffer_steps: int = 10_000             # batches (steps) kept for replays
    hwm: int = 100_000                     # PUB high-water mark: messages queued per subscriber
    max_queue_size: int = 100_000          # vLLM's; pagewire hands batches over a pipe (unused)
    topic: str = ""

    def check(self) -> None:
        check_choice("publisher", self.publisher or "zmq", KV_EVENT_PUBLISHERS)
        if self.buffer_steps < 1 or self.hwm < 0:
            raise ValueError("kv-events-config: buffer_steps must be at least 1, hwm at least 0")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "parallel": ParallelConfig, "device": DeviceConfig, "server": ServerConfig,
            "observability": ObservabilityConfig, "lora": LoraConfig, "fleet": FleetConfig}
WHOLE_SECTIONS = {"speculative_config": SpeculativeConfig, "kv_transfer_config": KVTransferConfig,
                  "kv_events_config": KVEventsConfig}
# EngineConfig's fields besides the sections: the options that are whole sections, and what
# every actor's process reads as it starts (process.py).
TOP_LEVEL = (*WHOLE_SECTIONS, "actor_nice", "run_dir")
# Each option's section by its flat name ("": a field of EngineConfig itself).
FIELD_SECTION = {**{f: s for s, c in SECTIONS.items() for f in c.__struct_fields__},
                 **{f: "" for f in TOP_LEVEL}}
# The sections each actor's code reads (the supervisor, the offline LLM and replays of the
# scheduler hold them all; process.py's start reads model, observability and the top-level
# fields in every actor). The scheduler holds the executor's: its trace must replay with a
# fresh executor (replay.py), and kv_tier_files reads the device and parallel sections.
_EXECUTOR = ("model", "cache", "scheduler", "parallel", "device", "observability", "lora",
             "speculative_config", "kv_transfer_config")
ACTOR_SECTIONS = {
    "executor": _EXECUTOR,
    "scheduler": (*_EXECUTOR, "kv_events_config"),
    "tokenizer": ("model", "cache", "server", "observability"),
    "detokenizer": ("model", "observability"),
    "gateway": ("model", "cache", "scheduler", "device", "server", "observability", "lora",
                "speculative_config", "kv_transfer_config"),
}
CHOICES = {"tool_call_parser": TOOL_CALL_PARSERS, "reasoning_parser": REASONING_PARSERS}


def group_by_section(options: dict) -> dict[str, dict]:
    """Flat option values, {section: {option: value}} ("": EngineConfig's own fields)."""
    grouped: dict[str, dict] = {}
    for name, value in options.items():
        grouped.setdefault(FIELD_SECTION[name], {})[name] = value
    return grouped


def parse_json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def check_kv_transfer(config, info) -> None:
    """--kv-transfer-config, checked against the rest of the configuration."""
    transfer = config.kv_transfer_config
    if transfer is None:
        return
    transfer.check()
    if info.sliding_window is not None:
        raise ValueError("--kv-transfer-config with a sliding-window model is not built yet")
    remote = not transfer.kv_ip.startswith("127.")
    if transfer.produces and not config.parallel.curve_keys and remote:
        raise ValueError(f"a KV server on {transfer.kv_ip} needs --curve-keys DIR (the same "
                         "`pagewire keys` directory on both engines): blocks are authenticated")
    if not config.cache.enable_prefix_caching:
        raise ValueError("--kv-transfer-config names blocks by their prefix-cache hashes: "
                         "it needs prefix caching")
    if config.parallel.tensor_parallel_size != 1:
        raise ValueError("--kv-transfer-config with tensor parallelism is not built yet")


def check_kv_events(config) -> None:
    """--kv-events-config: the events name prefix-cache blocks, so they need prefix caching."""
    events = config.kv_events_config
    if events is None:
        return
    events.check()
    if events.publishes and not config.cache.enable_prefix_caching:
        raise ValueError("--kv-events-config publishes the prefix cache's blocks: it needs "
                         "prefix caching")


def check_kv_compress(config, info) -> None:
    """KV-Compress (--kv-compress-rate) and what it does not combine with, refused by name:
    blocks of compressed sequences hold no whole prefix (prefix caching, the disk tier,
    disaggregation), are no sequence's but their own (swapping moves whole blocks; forks and
    beams are refused per request), and their rows are one rank's (tensor and context
    parallelism); drafts and sliding windows would need evictions aware of them."""
    rate = config.cache.kv_compress_rate
    if rate is None:
        return
    if not 0 < rate <= 1:
        raise ValueError(f"--kv-compress-rate must be in (0, 1], got {rate}")
    if config.cache.kv_compress_window < 1:
        raise ValueError(f"--kv-compress-window must be at least 1, got "
                         f"{config.cache.kv_compress_window}")
    if config.cache.enable_prefix_caching:
        raise ValueError("--kv-compress-rate needs --no-enable-prefix-caching: a compressed "
                         "sequence's blocks hold no whole prefix to share")
    unbuilt = {"--tensor-parallel-size > 1": config.parallel.tensor_parallel_size > 1,
               "--speculative-config": config.speculative_config is not None,
               "--kv-offload-dir": config.cache.kv_offload_dir is not None,
               "--kv-transfer-config": config.kv_transfer_config is not None,
               "--preemption-mode swap": config.cache.preemption_mode == "swap",
               "a sliding-window model": info.sliding_window is not None or
               info.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")}
    for what, given in unbuilt.items():
        if given:
            raise ValueError(f"--kv-compress-rate with {what} is not supported")


def check_sleep_mode(config, info: ModelInfo) -> None:
    """--enable-sleep-mode with what it cannot serve (EngineConfig.resolve): what keeps KV
    blocks beyond the pool's life (a disk tier, leases to decode engines) or holds state
    the pool's rebuild would lose (KV-Compress's head rows), and encoder-only pooling
    models (no KV pool, their own runner)."""
    if not config.model.enable_sleep_mode:
        return
    given = {"--kv-offload-dir": config.cache.kv_offload_dir is not None,
             "--kv-transfer-config": config.kv_transfer_config is not None,
             "--kv-compress-rate": config.cache.kv_compress_rate is not None,
             "an encoder-only (pooling) model": info.pooler is not None
             and info.pooler.encoder_only}
    for what, on in given.items():
        if on:
            raise ValueError(f"--enable-sleep-mode with {what} is not supported")
