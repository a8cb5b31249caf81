"""EngineConfig: every option of a running engine, resolved once by the supervisor (or the
offline LLM) and handed to each actor as JSON. Imports no torch."""
from __future__ import annotations

import hashlib
import os
import re

import msgspec

from pagewire.kernels import tiers

from . import lora_files
from .config_sections import MAX_BATCH, KVTransferConfig, SpeculativeConfig, check_kv_compress
from .model_info import ModelInfo, resolve_model

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_bytes(text: str | int) -> int:
    """'4GiB', '512M', '1.5g', 1024 -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgtKMGT]?)(i?[bB])?\s*", text)
    if not match:
        raise ValueError(f"not a size: {text!r} (try 2GiB or 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    model: str | None = None                 # path to a GGUF file or HF directory; None: default
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"                      # auto | bfloat16 | float16 | float32
    max_model_len: int | None = None         # None: the model's own context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int = 2 * 2**30         # bytes of K/V cache, all layers
    num_kv_blocks: int | None = None         # overrides kv_cache_memory
    kv_cache_dtype: str = "auto"             # auto | int8 | fp8 | fp8_e4m3 | fp8_e5m2
    quantization: str = "none"               # none | int8 | int4: linears rounded at load
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    swap_space: int = 0                      # bytes of host-memory KV tier for preemption
    preemption_mode: str = "auto"            # auto (swap if it fits, else recompute) | recompute | swap
    kv_offload_dir: str | None = None        # the disk KV tier's directory; None: no tier
    kv_offload_size: int = 4 * 2**30         # its bound in bytes (all ranks' files together)
    kv_compress_rate: float | None = None    # KV-Compress: share of each sequence's KV kept
    kv_compress_window: int = 64             # its latest tokens every head keeps
    scheduling_policy: str = "fcfs"          # fcfs | priority (lower `priority` first)
    max_num_queued_reqs: int | None = None   # beyond: new requests are refused (HTTP 503)
    max_num_queued_tokens: int | None = None # prompt tokens waiting, beyond: refused
    num_tokenizers: int = 1
    threads: int | None = None               # torch threads in the executor; None: all cores
    kernels: str = "auto"                    # a backend: kernels/tiers.py BACKENDS
    quantized_matmul_tokens: int | None = None   # steps up to this many tokens use GGUF weights
                                             # as stored; 0: never; -1: every step (no float
                                             # copy); None: auto (executor/loader.py)
    quantized_activations: str = "auto"      # auto | exact | int16 | int8 (Q4 weights) | int8-all
    device: str = "auto"                     # auto (cuda if present, else cpu) | cpu | cuda
    enforce_eager: bool = False              # no CUDA graphs
    disable_cascade_attn: bool = False       # decode rows never attend a shared prefix once
    async_scheduling: bool | None = None     # plan step N+1 while step N runs (scheduler/engine.py);
                                             # None: on where a CUDA driver is present
    actor_nice: int = 10                     # niceness of every actor but the executors
    restart_budget: int = 5                  # actor restarts allowed within restart_window...
    restart_window: float = 300.0            # ...seconds; beyond, the server exits 1
    seed: int = 0                            # the executor's random state for unseeded sampling
    tensor_parallel_size: int = 1            # executor ranks, each holding a share of the model
    decode_context_parallel_size: int = 1    # ranks of a KV head splitting its tokens
    executors: str = "local"                 # "local": the engine starts every rank;
                                             # "external": ranks 1.. attach at `listen`
    listen: str | None = None                # tcp://HOST:PORT where external ranks attach
    curve_keys: str | None = None            # directory from `pagewire keys` (TCP needs it)
    attach_timeout: float = 300.0            # seconds rank 0 waits for external ranks
    tp_timeout: float = 30.0                 # a collective waiting longer than this fails
    trace_dir: str | None = None             # record every actor's messages here
    trace_redact: bool = False               # blank prompts and outputs in traces
    trace_segment_bytes: int = 64 * 2**20    # a trace file rotates past this size...
    trace_max_segments: int = 8              # ...and each actor keeps this many
    drain_timeout: float = 30.0              # seconds SIGTERM waits for in-flight requests
    api_keys: list[str] = []                 # bearer keys guarding /v1/*; empty: open
    cache_salt_per_api_key: bool = False     # each API key's requests get their own KV salt
    metrics_require_api_key: bool = False    # GET /metrics behind the API key check too
    chat_template: str | None = None         # a Jinja file replacing the model's chat template
    enable_auto_tool_choice: bool = False    # tool_choice "auto": parse the model's tool calls
    tool_call_parser: str | None = None      # hermes | llama3_json | mistral
    reasoning_parser: str | None = None      # deepseek_r1 | qwen3: <think> blocks apart
    speculative_config: SpeculativeConfig | None = None   # speculative decoding; None: off
    kv_transfer_config: KVTransferConfig | None = None    # disaggregated prefill/decode
    enable_lora: bool = False                # serve LoRA adapters beside the base model
    lora_modules: list[str] = []             # name=path (or JSON) adapters served from start
    max_loras: int = 1                       # distinct adapters in one step
    max_lora_rank: int = 16                  # adapters of higher rank are refused
    max_cpu_loras: int | None = None         # adapters kept loaded (LRU); None: max_loras
    allow_runtime_lora_updating: bool = False   # POST /v1/load_lora_adapter, unload_...
    lora_root: str | None = None             # run-time loads only from under this directory
    run_dir: str | None = None               # where the ipc sockets live; set by the supervisor
    # Filled in by resolve():
    model_info: ModelInfo | None = None
    draft_model_info: ModelInfo | None = None    # speculative method draft_model's
    num_host_blocks: int = 0
    num_tier_blocks: int = 0                 # blocks the disk tier holds at most
    kv_block_bytes: int = 0                  # one block's K/V over all layers and ranks
    backend: str = ""                        # executor 0's, as it reported it (gateway metric)

    def resolve(self) -> "EngineConfig":
        """Return a copy with the model read, dtype, context and KV pool size decided.
        Raises ValueError with a clear message if the options do not fit together."""
        info = self.model_info or resolve_model(self.model)
        tier = self._check_kernels()
        self = msgspec.structs.replace(self, device=self._device())   # what follows reads it
        dtype = _resolve_dtype(self.dtype, tier, self._on_cuda())
        activations = _resolve_activations(self.quantized_activations, self.dtype, tier)
        max_len = self.max_model_len or info.max_model_len
        if max_len > info.max_model_len:
            raise ValueError(f"max_model_len={max_len} is longer than the model's context "
                             f"({info.max_model_len} tokens, from its config)")
        if max_len < 1:
            raise ValueError(f"max_model_len must be positive, got {max_len}")
        self._check_choices(info, max_len)
        draft = self._check_speculation(info, max_len)
        per_block, num_blocks, host_blocks = self._kv_pool(info, draft, dtype, max_len)
        tier_blocks = self._check_tier(per_block)
        self._check_transfer(info)
        self._check_parallel()
        self._check_chat()
        check_kv_compress(self, info)
        lora_files.check_options(self, info)
        return msgspec.structs.replace(
            self, model_info=info, draft_model_info=draft, dtype=dtype, max_model_len=max_len,
            num_kv_blocks=num_blocks, num_host_blocks=host_blocks, num_tier_blocks=tier_blocks,
            kv_block_bytes=per_block, served_model_name=self.served_model_name or info.name,
            quantized_activations=activations,
            async_scheduling=self._async_scheduling(), speculative_config=self._speculation())

    def _check_choices(self, info: ModelInfo, max_len: int) -> None:
        """The options that name one of a set, or a count, each on its own."""
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                             f"{self.quantization!r}")
        if self.quantization != "none" and (info.format == "gguf" or info.stored_quantization):
            raise ValueError("--quantization rounds a float checkpoint as it loads; this "
                             "checkpoint's weights are already quantized (its blocks are used)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be fcfs or priority, got "
                             f"{self.scheduling_policy!r}")
        if self.preemption_mode not in ("auto", "recompute", "swap"):
            raise ValueError("preemption_mode must be auto, recompute or swap, got "
                             f"{self.preemption_mode!r}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.quantized_matmul_tokens is not None and self.quantized_matmul_tokens < -1:
            raise ValueError("quantized_matmul_tokens must be -1 (every step), 0 (none) or "
                             f"positive, got {self.quantized_matmul_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be at least "
                             f"max_model_len ({max_len})")

    def _kv_pool(self, info: ModelInfo, draft: ModelInfo | None, dtype: str,
                 max_len: int) -> tuple[int, int, int]:
        """(bytes of a block, device blocks, host swap blocks). A draft model's K/V sits beside
        the target's in every block (the same block ids); under context parallelism a block's
        tokens are spread over its ranks."""
        per_block = self.block_size * sum(
            m.kv_bytes_per_token(_DTYPE_BYTES[dtype], self.kv_cache_dtype != "auto")
            for m in (info, draft) if m is not None) // self._check_context_parallel(info)
        num_blocks = self.num_kv_blocks
        if num_blocks is None:
            num_blocks = self.kv_cache_memory // per_block
        if num_blocks * self.block_size < max_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {self.block_size} tokens) cannot hold one "
                f"sequence of max_model_len={max_len}; raise --kv-cache-memory or lower "
                f"--max-model-len")
        host_blocks = self.swap_space // per_block
        if self.preemption_mode == "swap" and host_blocks == 0:
            raise ValueError("preemption_mode swap needs --swap-space")
        return per_block, num_blocks, host_blocks

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
        if self.async_scheduling:
            raise ValueError("--speculative-config and --async-scheduling do not combine: a "
                             "step's token count is known only from the previous result")
        if spec.model is None:
            return None
        draft = self.draft_model_info or resolve_model(spec.model)
        # It reads the target's block tables: blocks the target's window frees must be ones
        # the draft no longer reads, and every position the target reaches must be one it has.
        if draft.sliding_window != target.sliding_window:
            raise ValueError(f"the draft model's sliding window ({draft.sliding_window}) must "
                             f"be the target's ({target.sliding_window})")
        if draft.max_model_len < max_len:
            raise ValueError(f"the draft model's context ({draft.max_model_len} tokens) is "
                             f"shorter than max_model_len={max_len}")
        return draft

    def _check_tier(self, per_block: int) -> int:
        """Blocks the disk tier may hold (0: no tier)."""
        if self.kv_offload_dir is None:
            return 0
        if not self.enable_prefix_caching:
            raise ValueError("--kv-offload-dir keeps prefix-cache blocks: it needs prefix caching")
        blocks = self.kv_offload_size // per_block
        if blocks < 1:
            raise ValueError(f"--kv-offload-size {self.kv_offload_size} bytes holds no block "
                             f"({per_block} bytes each)")
        return blocks

    def _check_transfer(self, info: ModelInfo) -> None:
        transfer = self.kv_transfer_config
        if transfer is None:
            return
        transfer.check()
        if info.sliding_window is not None:
            raise ValueError("--kv-transfer-config with a sliding-window model is not built yet")
        if transfer.produces and not self.curve_keys and not transfer.kv_ip.startswith("127."):
            raise ValueError(f"a KV server on {transfer.kv_ip} needs --curve-keys DIR (the same "
                             "`pagewire keys` directory on both engines): blocks are authenticated")
        if not self.enable_prefix_caching:
            raise ValueError("--kv-transfer-config names blocks by their prefix-cache hashes: "
                             "it needs prefix caching")
        if self.tensor_parallel_size != 1:
            raise ValueError("--kv-transfer-config with tensor parallelism is not built yet")

    def _check_context_parallel(self, info: ModelInfo) -> int:
        """The context-parallel size, checked: ranks that would each hold a KV head's tokens
        (tensor parallelism with fewer KV heads than ranks) split them instead."""
        size = self.decode_context_parallel_size
        if size == 1:
            return 1
        replicas = self.tensor_parallel_size // info.num_kv_heads
        if size < 1 or replicas < 2 or replicas % size:
            raise ValueError(f"--decode-context-parallel-size {size} needs tensor parallelism "
                             f"with each KV head on a multiple of {size} ranks (this model has "
                             f"{info.num_kv_heads} KV heads, -tp {self.tensor_parallel_size})")
        if self.block_size % size:
            raise ValueError(f"--block-size {self.block_size} must be a multiple of "
                             f"--decode-context-parallel-size {size}")
        unbuilt = {"a sliding-window model": info.sliding_window is not None or
                   info.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
                   "--speculative-config": self.speculative_config is not None,
                   "--kv-offload-dir": self.kv_offload_dir is not None}
        for what, given in unbuilt.items():
            if given:
                raise ValueError(f"--decode-context-parallel-size with {what} is not built yet")
        return size

    def _check_chat(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template {self.chat_template}: no such file")

    def _async_scheduling(self) -> bool:
        """auto: pipelined steps where a GPU runs them (the GPU idles while the scheduler
        plans); on a CPU the scheduler's work takes cores from the step and two plans in flight
        measured no faster (bench/NOTES.md "Pipelined steps")."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        if self.speculative_config is not None:     # drafts are planned from the last result
            return False
        return self._on_cuda()

    def _device(self) -> str:
        """A CPU tier (--kernels cpu, avx2, ...) runs on the CPU: auto means cpu there, also
        on a machine with a GPU, and cuda is refused."""
        if not tiers.runs_on_cpu(self.kernels):
            return self.device
        if self.device == "cuda":
            raise ValueError(f"--kernels {self.kernels} runs on the CPU: it does not combine "
                             "with --device cuda")
        return "cpu"

    def _on_cuda(self) -> bool:
        """Whether the executors will run on CUDA (kernels/ops.py resolve_device decides the
        same with torch); the driver's /proc entry stands in for CUDA here, which imports no
        torch."""
        return self.device == "cuda" or (self.device == "auto"
                                         and os.path.exists("/proc/driver/nvidia/version"))

    def _check_kernels(self) -> str | None:
        """The CPU tier the executors will run (None: none), checked before any actor
        starts: a named tier this CPU cannot run is refused here."""
        return tiers.tier_to_run(self.kernels)

    def _check_parallel(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.executors not in ("local", "external"):
            raise ValueError(f"executors must be local or external, got {self.executors!r}")
        if self.executors == "external":
            if self.tensor_parallel_size < 2:
                raise ValueError("--executors external needs --tensor-parallel-size 2 or more")
            if not self.listen:
                raise ValueError("--executors external needs --listen tcp://HOST:PORT")
        if self.listen:
            parse_tcp(self.listen)
            if not self.curve_keys:
                raise ValueError(f"--listen {self.listen} needs --curve-keys DIR (make the keys "
                                 "with `pagewire keys DIR`): executors are authenticated")
        gpus = visible_gpus() if self._on_cuda() and self.executors == "local" else 0
        if 0 < gpus < self.tensor_parallel_size:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} runs each rank "
                             f"on a GPU of its own (NCCL cannot share one) and {gpus} "
                             f"{'is' if gpus == 1 else 'are'} visible: fewer ranks, or "
                             "--device cpu")

    def digest(self) -> str:
        """What decides the engine's outputs, hashed: replays compare it. Which fields count
        is declared with the options (options.DIGESTED): addresses, keys, restarts, tracing
        and the like are left out."""
        from .options import DIGESTED
        values = {k: v for k, v in msgspec.structs.asdict(self).items() if k in DIGESTED}
        return hashlib.sha256(msgspec.json.encode(values)).hexdigest()[:16]

    def public(self) -> "EngineConfig":
        """This configuration as it may leave the process (into a trace header, to an attached
        executor): no API keys, no trace directory."""
        return msgspec.structs.replace(self, api_keys=[], trace_dir=None)

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @staticmethod
    def from_json(data: bytes) -> "EngineConfig":
        return msgspec.json.decode(data, type=EngineConfig)


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")    # kernels/kv_quant.py
QUANTIZATIONS = ("none", "int8", "int4")          # executor/load_quantization.py
ACTIVATIONS = ("auto", "exact", "int16", "int8", "int8-all")   # --quantized-activations


def _resolve_activations(activations: str, dtype: str, tier: str | None) -> str:
    """auto: the tier's default (kernels/tiers.py default_activations). int8 (Q4 weights) and
    int8-all (Q8_0 too: llama.cpp's arithmetic) are faster still but garble the default
    model's answers, as llama.cpp's own do (bench/NOTES.md "int16 and int8 activations"):
    they are taken only by name."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"quantized_activations must be one of {', '.join(ACTIVATIONS)}, got "
                         f"{activations!r}")
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
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
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
