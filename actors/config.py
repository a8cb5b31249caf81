"""EngineConfig: every option of a running engine, resolved once by the supervisor (or the
offline LLM) and handed to each actor as JSON. Imports no torch."""
from __future__ import annotations

import hashlib
import logging
import os
import re

import msgspec

from pagewire.kernels import tiers

from . import lora_files
from .config_sections import (ACTIVATIONS, ACTOR_SECTIONS, BLOCK_SIZES, CHOICES, DEVICES, DTYPES,
                              EXECUTORS, EXTERNAL, FIELD_SECTION, KV_CACHE_DTYPES, LOCAL,
                              MAX_BATCH, PREEMPTION_MODES, QUANTIZATIONS, SCHEDULING_POLICIES,
                              SECTIONS, SWAP, TOP_LEVEL, WHOLE_SECTIONS, CacheConfig,
                              DeviceConfig, FleetConfig, KVEventsConfig, KVTransferConfig,
                              LoraConfig, ModelConfig, ObservabilityConfig, ParallelConfig,
                              SchedulerConfig, ServerConfig, SpeculativeConfig, check_choice,
                              check_kv_compress, check_kv_events, check_kv_transfer,
                              check_sleep_mode, group_by_section)
from .kv_sizing import KVPoolPlan
from .model_info import ModelInfo, check_architecture_options, resolve_model, with_pooler

log = logging.getLogger(__name__)

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str | int) -> int:
    """'4GiB', '512M', '1.5g', 1024 -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgtKMGT]?)(i?[bB])?\s*", text)
    if not match:
        raise ValueError(f"not a size: {text!r} (try 2GiB or 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def encoder_only_options(config: "EngineConfig", info: ModelInfo) -> dict:
    """The options an encoder-only model runs with. It keeps no KV: a prompt runs whole in
    one step (no chunks, a token budget of at least a context), nothing is cached, and the
    scheduler's blocks only count the tokens in flight (two plans' worth;
    executor/pooling_runner.py allocates none). Its linears multiply dense packed weights at
    every step (a step is a whole batch of prompts: oneDNN's packing ran a base-sized encoder
    13 % faster in bfloat16 than the BF16 tiles, 2x in float32) unless
    --quantized-matmul-tokens says otherwise (with --quantization int8: its blocks, every step)."""
    max_len = config.model.max_model_len or info.max_model_len
    budget = max(config.scheduler.max_num_batched_tokens, max_len)
    bs, seqs = config.cache.block_size, config.scheduler.max_num_seqs
    tokens = config.device.quantized_matmul_tokens     # --quantization int8: its blocks
    if tokens == -1 and config.model.quantization == "none":
        tokens = 0
    return dict(enable_chunked_prefill=False, enable_prefix_caching=False,
                max_num_batched_tokens=budget,
                quantized_matmul_tokens=tokens,
                num_kv_blocks=config.cache.num_kv_blocks or 2 * (-(-budget // bs) + seqs))


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The engine's options by section. An actor receives only the sections it reads
    (ACTOR_SECTIONS, for_actor()); the others are None there. The options keep their flat
    names everywhere a user meets them (flags, PAGEWIRE_<FIELD>, config files, LLM(**options),
    the effective-configuration log line): from_options(), flat(), get() and replace() take and
    give those names, FIELD_SECTION says which section holds each."""
    model: ModelConfig | None = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig | None = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig | None = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig | None = msgspec.field(default_factory=ParallelConfig)
    device: DeviceConfig | None = msgspec.field(default_factory=DeviceConfig)
    server: ServerConfig | None = msgspec.field(default_factory=ServerConfig)
    observability: ObservabilityConfig | None = msgspec.field(default_factory=ObservabilityConfig)
    lora: LoraConfig | None = msgspec.field(default_factory=LoraConfig)
    fleet: FleetConfig | None = msgspec.field(default_factory=FleetConfig)
    speculative_config: SpeculativeConfig | None = None   # speculative decoding; None: off
    kv_transfer_config: KVTransferConfig | None = None    # disaggregated prefill/decode
    kv_events_config: KVEventsConfig | None = None        # prefix-cache events; None: off
    # What every actor's process reads as it starts (process.py):
    actor_nice: int = 10                     # niceness of every actor but the executors
    run_dir: str | None = None               # where the ipc sockets live; set by the supervisor

    def resolve(self) -> "EngineConfig":
        """Return a copy with the model read, dtype, context and KV pool size decided.
        Raises ValueError with a clear message if the options do not fit together."""
        info = self.model.model_info or with_pooler(
            resolve_model(self.model.model, self.model.mmproj), self.model.runner,
            self.model.convert, self.model.pooler_config)
        if info.pooler is not None and info.pooler.encoder_only:
            self = self.replace(**encoder_only_options(self, info))
        tier = self._check_kernels()
        self = self.replace(device=self._device())   # what follows reads it
        dtype = _resolve_dtype(self.model.dtype, tier, self._on_cuda())
        activations = _resolve_activations(self.device.quantized_activations, self.model.dtype,
                                           tier)
        max_len = self.model.max_model_len or info.max_model_len
        if max_len > info.max_model_len:
            raise ValueError(f"max_model_len={max_len} is longer than the model's context "
                             f"({info.max_model_len} tokens, from its config)")
        if max_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_len}")
        self._check_choices(info, max_len)
        draft = self._check_speculation(info, max_len)
        pool = KVPoolPlan(self, info, draft, dtype)
        max_len, kv_memory = pool.memory(max_len, self._on_cuda())
        per_block, num_blocks, host_blocks = pool.blocks(max_len, kv_memory)
        tier_blocks = pool.tier_blocks(per_block)
        check_kv_transfer(self, info)
        check_kv_events(self)
        self._check_parallel()
        self._check_chat()
        check_kv_compress(self, info)
        check_sleep_mode(self, info)
        lora_files.check_options(self, info)
        check_architecture_options(info, {"--enable-lora": self.lora.enable_lora,
                             "--tensor-parallel-size > 1": self.parallel.tensor_parallel_size > 1,
                             "--kv-compress-rate": self.cache.kv_compress_rate is not None,
                             "--decode-context-parallel-size > 1":
                                 self.parallel.decode_context_parallel_size > 1})
        resolved = self.replace(
            model_info=info, draft_model_info=draft, dtype=dtype, max_model_len=max_len,
            num_kv_blocks=num_blocks, num_host_blocks=host_blocks, num_tier_blocks=tier_blocks,
            kv_block_bytes=per_block, served_model_name=self.model.served_model_name or info.name,
            quantized_activations=activations,
            async_scheduling=self._async_scheduling(), speculative_config=self._speculation())
        return resolved.replace(config_digest=resolved.digest())

    def _check_choices(self, info: ModelInfo, max_len: int) -> None:
        """The options that name one of a set, or a count, each on its own."""
        model, cache, scheduler = self.model, self.cache, self.scheduler
        if cache.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be a power of two up to 128, got {cache.block_size}")
        check_choice("quantization", model.quantization, QUANTIZATIONS)
        if model.quantization != "none" and (info.format == "gguf" or info.stored_quantization):
            raise ValueError("--quantization rounds a float checkpoint as it loads; this "
                             "checkpoint's weights are already quantized (its blocks are used)")
        check_choice("kv_cache_dtype", cache.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("scheduling_policy", scheduler.scheduling_policy, SCHEDULING_POLICIES)
        check_choice("preemption_mode", cache.preemption_mode, PREEMPTION_MODES)
        check_choice("device", self.device.device, DEVICES)
        for name in ("tool_call_parser", "reasoning_parser"):
            if self.get(name) is not None:
                check_choice(name, self.get(name), CHOICES[name])
        if scheduler.max_num_batched_tokens < 1 or scheduler.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        matmul_tokens = self.device.quantized_matmul_tokens
        if matmul_tokens is not None and matmul_tokens < -1:
            raise ValueError("quantized_matmul_tokens must be -1 (every step), 0 (none) or "
                             f"positive, got {matmul_tokens}")
        if not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens < max_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be at least "
                             f"max_model_len ({max_len})")

    def _speculation(self) -> SpeculativeConfig | None:
        """--speculative-config with its batch limit decided for the executors' device."""
        spec = self.speculative_config
        if spec is None or spec.max_batch is not None:
            return spec
        return msgspec.structs.replace(
            spec, max_batch=MAX_BATCH["cuda" if self._on_cuda() else "cpu"])

    def _check_speculation(self, target: ModelInfo, max_len: int) -> ModelInfo | None:
        """The draft model's description (method draft_model), or None."""
        spec = self.speculative_config
        if spec is None:
            return None
        spec.check()
        if self.scheduler.async_scheduling:
            raise ValueError("--speculative-config and --async-scheduling do not combine: a "
                             "step's token count is known only from the previous result")
        if spec.model is None:
            return None
        draft = self.model.draft_model_info or resolve_model(spec.model)
        # It reads the target's block tables: blocks the target's window frees must be ones
        # the draft no longer reads, and every position the target reaches must be one it has.
        if draft.sliding_window != target.sliding_window:
            raise ValueError(f"the draft model's sliding window ({draft.sliding_window}) must "
                             f"be the target's ({target.sliding_window})")
        if draft.max_model_len < max_len:
            raise ValueError(f"the draft model's context ({draft.max_model_len} tokens) is "
                             f"shorter than max_model_len={max_len}")
        return draft

    def _check_chat(self) -> None:
        if self.server.enable_auto_tool_choice and self.server.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.server.tool_call_parser == "openai" and \
                self.server.reasoning_parser != "openai_gptoss":
            raise ValueError("--tool-call-parser openai (gpt-oss's harmony messages) needs "
                             "--reasoning-parser openai_gptoss")
        if self.server.chat_template is not None and not os.path.isfile(self.server.chat_template):
            raise ValueError(f"--chat-template {self.server.chat_template}: no such file")

    def _async_scheduling(self) -> bool:
        """auto: pipelined steps where a GPU runs them (the GPU idles while the scheduler
        plans); on a CPU the scheduler's work takes cores from the step and two plans in flight
        measured no faster (bench/NOTES.md "Pipelined steps")."""
        if self.scheduler.async_scheduling is not None:
            return self.scheduler.async_scheduling
        if self.speculative_config is not None:     # drafts are planned from the last result
            return False
        return self._on_cuda()

    def _device(self) -> str:
        """A CPU tier (--kernels cpu, avx2, ...) runs on the CPU: auto means cpu there, also
        on a machine with a GPU, and cuda is refused."""
        if not tiers.runs_on_cpu(self.device.kernels):
            return self.device.device
        if self.device.device == "cuda":
            raise ValueError(f"--kernels {self.device.kernels} runs on the CPU: it does not "
                             "combine with --device cuda")
        return "cpu"

    def _on_cuda(self) -> bool:
        """Whether the executors will run on CUDA (kernels/ops.py resolve_device decides the
        same with torch); the driver's /proc entry stands in for CUDA here, which imports no
        torch."""
        return self.device.device == "cuda" or (self.device.device == "auto"
                                         and os.path.exists("/proc/driver/nvidia/version"))

    def _check_kernels(self) -> str | None:
        """The CPU tier the executors will run (None: none), checked before any actor
        starts: a named tier this CPU cannot run is refused here."""
        return tiers.tier_to_run(self.device.kernels)

    def _check_parallel(self) -> None:
        parallel = self.parallel
        if parallel.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        check_choice("executors", parallel.executors, EXECUTORS)
        if parallel.executors == EXTERNAL:
            if parallel.tensor_parallel_size < 2:
                raise ValueError("--executors external needs --tensor-parallel-size 2 or more")
            if not parallel.listen:
                raise ValueError("--executors external needs --listen tcp://HOST:PORT")
        if parallel.listen:
            parse_tcp(parallel.listen)
            if not parallel.curve_keys:
                raise ValueError(f"--listen {parallel.listen} needs --curve-keys DIR (make the "
                                 "keys with `pagewire keys DIR`): executors are authenticated")
        gpus = visible_gpus() if self._on_cuda() and parallel.executors == LOCAL else 0
        if 0 < gpus < parallel.tensor_parallel_size:
            raise ValueError(f"--tensor-parallel-size {parallel.tensor_parallel_size} runs each "
                             f"rank on a GPU of its own (NCCL cannot share one) and {gpus} "
                             f"{'is' if gpus == 1 else 'are'} visible: fewer ranks, or "
                             "--device cpu")

    def digest(self) -> str:
        """What decides the engine's outputs, hashed (in trace headers). Which fields count is
        declared with the options (options.DIGESTED): addresses, keys, restarts, tracing and
        the like are left out. resolve() keeps it as observability.config_digest, so an actor
        holding some sections records the engine's digest, not its part's."""
        from .options import DIGESTED
        values = {k: v for k, v in self.flat().items() if k in DIGESTED}
        return hashlib.sha256(msgspec.json.encode(values)).hexdigest()[:16]

    def public(self) -> "EngineConfig":
        """This configuration as it may leave the process (into a trace header, to an attached
        executor): no API keys, no trace directory."""
        return self.replace(**{k: v for k, v in (("api_keys", []), ("trace_dir", None))
                               if self.get(k, _ABSENT) is not _ABSENT})

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @staticmethod
    def from_json(data: bytes) -> "EngineConfig":
        """Sections as to_json() writes them, or the flat object of one field per option that
        traces recorded before the sections (pagewire replay reads those too)."""
        raw = msgspec.json.decode(data)
        if set(raw) - set(EngineConfig.__struct_fields__):
            return EngineConfig.from_options(**raw)
        return msgspec.convert(raw, EngineConfig)

    @staticmethod
    def from_options(strict: bool = True, **options) -> "EngineConfig":
        """An EngineConfig from flat option values (LLM(**options), the settings' sources,
        tests); strict=False converts text ("8") as the flags and files give it. Names that
        are no option are ignored, as they always were."""
        by_section = group_by_section({k: v for k, v in options.items() if k in FIELD_SECTION})
        top = by_section.pop("", {})
        for name in WHOLE_SECTIONS:
            if top.get(name) is not None:
                top[name] = msgspec.convert(top[name], WHOLE_SECTIONS[name], strict=strict)
        sections = {s: msgspec.convert(v, SECTIONS[s], strict=strict)
                    for s, v in by_section.items()}
        return EngineConfig(**sections, **top)

    def flat(self) -> dict:
        """{option: value} over the sections held, in section order."""
        values = {}
        for name in EngineConfig.__struct_fields__:
            part = getattr(self, name)
            if name in SECTIONS:
                values.update(msgspec.structs.asdict(part) if part is not None else {})
            else:
                values[name] = part
        return values

    def get(self, name: str, default=None):
        """One option's value by its flat name (default where its section is not held)."""
        section = FIELD_SECTION[name]
        holder = getattr(self, section) if section else self
        return default if holder is None else getattr(holder, name)

    def replace(self, **options) -> "EngineConfig":
        """A copy with options (flat names) changed, each in its section."""
        by_section = group_by_section(options)
        changes = by_section.pop("", {})
        for section, values in by_section.items():
            changes[section] = msgspec.structs.replace(getattr(self, section), **values)
        return msgspec.structs.replace(self, **changes)

    def with_sections(self, **sections) -> "EngineConfig":
        """A copy with whole sections (by section name) set or removed (None)."""
        return msgspec.structs.replace(self, **sections)

    def for_actor(self, role: str) -> "EngineConfig":
        """What one actor receives: the sections its code reads (ACTOR_SECTIONS), None others."""
        held = ACTOR_SECTIONS[role]
        return self.with_sections(**{s: None for s in (*SECTIONS, *WHOLE_SECTIONS)
                                     if s not in held})


_ABSENT = object()
assert set(EngineConfig.__struct_fields__) == {*SECTIONS, *TOP_LEVEL}

def _resolve_activations(activations: str, dtype: str, tier: str | None) -> str:
    """auto: the tier's default (kernels/tiers.py default_activations). int8 (Q4 weights) and
    int8-all (Q8_0 too: llama.cpp's arithmetic) are faster still but garble the default
    model's answers, as llama.cpp's own do (bench/NOTES.md "int16 and int8 activations"):
    they are taken only by name."""
    check_choice("quantized_activations", activations, ACTIVATIONS)
    if activations == "auto":
        return tiers.default_activations(tier)
    return activations


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use (CUDA_VISIBLE_DEVICES, else the driver's /proc list),
    counted without importing torch; 0 where there is no driver."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return len([d for d in listed.split(",") if d.strip() and not d.strip().startswith("-")])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _resolve_dtype(dtype: str, tier: str | None, cuda: bool) -> str:
    """auto: the backend's default for the device and tier (kernels/tiers.py default_dtype)."""
    if dtype == "auto":
        return tiers.default_dtype(tier, cuda)
    check_choice("dtype", dtype, DTYPES)
    return dtype


def parse_tcp(address: str) -> tuple[str, int]:
    """tcp://HOST:PORT -> (HOST, PORT). The host must be named: a wildcard would listen on
    every interface without anyone having asked for it (0.0.0.0 asks)."""
    m = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:/]+):(\d+)", address)
    if not m:
        raise ValueError(f"{address!r} is not tcp://HOST:PORT")
    if m.group(1) == "*":
        raise ValueError(f"{address!r}: name the address to listen on (tcp://0.0.0.0:PORT for "
                         "every interface)")
    return m.group(1).strip("[]"), int(m.group(2))


def default_threads(ranks: int = 1) -> int:
    """$PAGEWIRE_THREADS, else the cores this process may run on, shared among the tensor-
    parallel ranks on this machine (at least one each)."""
    return int(os.environ.get("PAGEWIRE_THREADS") or 0) or \
        max(1, len(os.sched_getaffinity(0)) // ranks)
