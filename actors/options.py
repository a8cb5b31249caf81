"""Every option of `pagewire serve`, declared once, in groups.

Each Option names an EngineConfig field and says what it means; from these declarations come
the command-line flags and their help (cli.py), the `PAGEWIRE_<FIELD>` environment variables
and the config-file keys (settings.py), docs/serving.md's options tables (options_tables(); a
test fails when the guide differs) and what the configuration digest covers (`decides_outputs`).
EngineConfig (config.py) holds the types and defaults; a test checks that every settable
field has exactly one declaration here. Imports no torch.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import msgspec

from pagewire.kernels import tiers

from .config import FIELD_SECTION, SECTIONS, EngineConfig, parse_bytes
from .pooler_info import CONVERTS, RUNNERS
from .config_sections import (ACTIVATIONS, DEVICES, DTYPES, EXECUTORS, KV_CACHE_DTYPES,
                              PREEMPTION_MODES, QUANTIZATIONS, REASONING_PARSERS,
                              SCHEDULING_POLICIES, TOOL_CALL_PARSERS, parse_json_object)


def gib(text: str | int | float) -> int:
    """vLLM's --swap-space is a number of GiB; a size with a unit is taken as it is."""
    if isinstance(text, (int, float)):
        return int(text * 2**30)
    try:
        return int(float(text) * 2**30)
    except ValueError:
        return parse_bytes(text)


def bytes_or_auto(text: str | int) -> int | None:
    """--kv-cache-memory: a size, or `auto` (None: memory_budget.kv_auto decides)."""
    if isinstance(text, str) and text.strip() == "auto":
        return None
    return parse_bytes(text)


def tokens_or_auto(text: str) -> int | None:
    """--quantized-matmul-tokens: a count, or `auto` (None: executor/linear_blocks.py decides)."""
    if text.strip() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected a whole number of tokens or `auto`, got {text!r}") from None


@dataclass(frozen=True)
class Option:
    field: str                           # the option's flat name ("" for --config); its
                                         # EngineConfig section: config.FIELD_SECTION
    meaning: str                         # docs markdown; the flag's help without backticks
    default: str | None = None           # as docs/serving.md shows it (None: from EngineConfig)
    flags: tuple[str, ...] = ()          # () -> ("--field-name",); bools: see _bool_flag
    choices: tuple[str, ...] = ()
    parse: Callable | None = None        # text (flag, environment, file) -> value
    decides_outputs: bool = True         # in the configuration digest (replays compare it)
    serve_only: bool = False             # not a `pagewire bench` flag
    many: bool = False                   # a list flag taking several values (vLLM's nargs=+)

    @property
    def names(self) -> tuple[str, ...]:
        return self.flags or ("--" + self.field.replace("_", "-"),)

    @property
    def env(self) -> str:
        return f"PAGEWIRE_{self.field.upper()}"


_RUN = {"decides_outputs": False, "serve_only": True}     # how the server runs, not what it says

GROUPS: dict[str, tuple[Option, ...]] = {
    "model": (
        Option("model", "a `.gguf` file or a Hugging Face directory (safetensors)",
               "embedded SmolLM2", flags=("model",)),
        Option("mmproj", "a GGUF model's vision tower and projector, llama.cpp's mmproj file "
               "(LLaVA's `mlp` or SmolVLM's `idefics3` projector): the pair takes images "
               "(see docs/models.md \"Vision\")", "none"),
        Option("served_model_name", "the id clients pass as `model`", "model's name"),
        Option("runner", "`generate` (completions, chat, ...) or `pooling` (embeddings, "
               "scores, classification: see docs/pooling.md); `auto`: pooling for an "
               "encoder-only model (BERT, RoBERTa, ...), else generate", choices=RUNNERS),
        Option("convert", "what a pooling runner makes of the model: `embed` (a causal LM's "
               "last token's hidden state; an encoder's pooled one), `classify` (a "
               "*ForSequenceClassification head's logits); `auto`: the architecture's own "
               "(a *ForTokenClassification model's is token_classify, and takes no other)",
               choices=CONVERTS),
        Option("pooler_config", "pooler overrides, as JSON: `{\"pooling_type\": \"MEAN\", "
               "\"normalize\": false, \"use_activation\": false}`", "model's",
               parse=parse_json_object),
        Option("dtype", "`auto` (bfloat16 on a GPU, or where the backend's CPU tier "
               "multiplies it in hardware, AVX512-BF16 or AMX; else float32, faster there than "
               "emulated bfloat16), `bfloat16`, `float16`, `float32`: weights are converted to "
               "it as they load",
               choices=DTYPES),
        Option("max_model_len", "longest prompt + output; the default and the upper bound are the "
               "config's context (`max_position_embeddings` or GGUF `context_length`, times the "
               "factor of a linear, dynamic or yarn rope scaling)", "model's context"),
        Option("seed", "random state of unseeded sampling (a replay starts from it too)"),
        Option("quantization", "`int8` or `int4`: a float checkpoint's linears rounded as "
               "they load to the quantized kernels' blocks (Q8_0; Q4_1 with a Q8_0 LM head); "
               "see \"Quantize at load\"", "none", choices=QUANTIZATIONS),
        Option("enable_sleep_mode", "serve `POST /sleep`, `/wake_up`, `/update_weights` and "
               "`GET /is_sleeping`: free the KV pool and park or drop the weights between "
               "uses, load new weights without a restart (see docs/sleep-mode.md)",
               decides_outputs=False),
    ),
    "cache": (
        Option("block_size", "tokens per KV block"),
        Option("kv_cache_memory", "KV cache size over all layers (`512MiB`, `4GiB`, ...); `auto`: "
               "half the memory left after the weights and 1 GiB, at most what `--max-num-seqs` "
               "sequences of `--max-model-len` fill, at least one (a context not given is "
               "lowered to fit; logged at start; 2 GiB on CUDA): see \"Memory\" in "
               "docs/models.md", "auto", parse=bytes_or_auto),
        Option("num_kv_blocks", "exact block count, overriding `--kv-cache-memory`"),
        Option("kv_cache_dtype", "`auto` (the model's dtype), `int8`, `fp8` (= `fp8_e4m3`), "
               "`fp8_e5m2`: keys and values stored in one byte each with a float32 scale per "
               "token and head (see \"Quantized KV cache\")",
               choices=KV_CACHE_DTYPES),
        Option("enable_prefix_caching", "turn automatic prefix caching off",
               flags=("--no-enable-prefix-caching",)),
        Option("swap_space", "host-memory KV tier for preemption, GiB (or `512MiB`)", parse=gib),
        Option("preemption_mode", "`auto` (swap when the host tier has room, else recompute), "
               "`recompute`, `swap`", choices=PREEMPTION_MODES),
        Option("kv_transfer_config", "disaggregated prefill and decode, as JSON: `{\"kv_role\": "
               "\"kv_producer\", \"kv_ip\": \"10.0.0.5\", \"kv_port\": 14579}` on a prefill "
               "engine, `\"kv_consumer\"` on a decode engine; `kv_load_failure_policy` "
               "`recompute` or `fail` (see \"Disaggregated prefill and decode\")", "off",
               parse=parse_json_object, decides_outputs=False),
        Option("kv_events_config", "publish the prefix cache's block events as vLLM does, as "
               "JSON: `{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
               "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}` (see "
               "docs/kv-events.md)", "off", parse=parse_json_object, decides_outputs=False),
        Option("kv_offload_dir", "a disk KV tier in DIR: every computed block is stored there, "
               "a prefix missing from the pool is loaded from it, and it outlives restarts "
               "(see \"KV tier on disk\")", "off", decides_outputs=False),
        Option("kv_offload_size", "the disk tier's bound (`20GiB`, ...); least recently used "
               "blocks go first", "4GiB", parse=parse_bytes, decides_outputs=False),
        Option("kv_compress_rate", "KV-Compress: each sequence keeps this share (0 to 1] of its "
               "KV, per layer, evicting the least attended tokens of each KV head (see "
               "\"KV-Compress\"); needs `--no-enable-prefix-caching`", "off"),
        Option("kv_compress_window", "KV-Compress: the latest tokens every KV head keeps (and how "
               "often a decoding sequence compresses again)"),
    ),
    "scheduler": (
        Option("max_num_seqs", "most requests running at once"),
        Option("max_num_batched_tokens", "token budget of one step, shared by decodes and prefill "
               "chunks"),
        Option("enable_chunked_prefill", "turn chunking off (a prompt then runs whole in one step)",
               flags=("--no-enable-chunked-prefill",)),
        Option("encoder_budget", "image rows a vision model encodes in one step (an image "
               "larger than it is encoded alone)", "max-num-batched-tokens"),
        Option("speculative_config", "speculative decoding, as JSON: `{\"method\": \"ngram\", "
               "\"num_speculative_tokens\": 3, \"prompt_lookup_min\": 3, "
               "\"prompt_lookup_max\": 4}`; `method` `suffix` also matches recent outputs, `self` "
               "drafts with the target's first `draft_layers` layers, `draft_model` with a "
               "smaller checkpoint (`model`); "
               "`max_batch`, `min_acceptance`: when it turns itself off (see \"Speculative "
               "decoding\")", "off", parse=parse_json_object),
        Option("async_scheduling", "plan each step while the previous one runs (two plans in "
               "flight; see \"Pipelined steps\"); `--no-async-scheduling`: one plan in flight; "
               "auto: on where a CUDA driver is present, off on CPU (measured no faster there)",
               "auto",
               flags=("--async-scheduling", "--no-async-scheduling")),
        Option("scheduling_policy", "`fcfs` or `priority` (request field `priority`, lower first; "
               "preempts lower-priority work when blocks run short)", choices=SCHEDULING_POLICIES),
        Option("prefix_wait", "a waiting request whose next prompt blocks a running request is "
               "computing now (a shared prefix) waits for them, then maps them as a prefix hit, "
               "instead of computing them again (see \"Prefix wait\" in docs/kv-cache.md); "
               "`--no-prefix-wait`: "
               "each computes its own copy", flags=("--prefix-wait", "--no-prefix-wait")),
        Option("max_num_queued_reqs", "beyond this many waiting requests, new ones get 503 at once",
               "unlimited"),
        Option("max_num_queued_tokens", "beyond this many waiting prompt tokens, new requests get "
               "503 at once", "unlimited"),
    ),
    "kernels and devices": (
        Option("kernels", "the backend: `auto` (the best native CPU tier, Triton on CUDA), "
               "`cpu` (the best tier), a tier by name (`avx2`, `avx512`, `avx512_bf16`; `amx` is "
               "another name for `avx512_bf16`: any up to this CPU's own; a higher one is "
               "refused at start), `torch` (the "
               "reference), `triton`; `cpu` and the tiers run on the CPU, also where a GPU is "
               "(`--device cuda` with them is refused)",
               choices=tuple(tiers.BACKENDS)),
        Option("device", "`auto` (CUDA when present, else CPU), `cpu` or `cuda`",
               choices=DEVICES),
        Option("threads", "torch threads of the executor", "all cores", decides_outputs=False),
        Option("enforce_eager", "no CUDA graphs: every decode step runs eagerly"),
        Option("disable_cascade_attn", "no cascade attention: decode rows under one shared "
               "prefix each read it themselves (see \"Cascade attention\")"),
        Option("quantized_matmul_tokens", "steps of up to this many tokens multiply a GGUF model's "
               "weights as stored (as blocks of the same values: see \"Models and start-up\"), a "
               "quantized checkpoint's and --quantization's blocks "
               "(CPU, every tier, bfloat16 or float32; see \"Kernels and devices\"); larger "
               "steps use a dequantized copy; `-1` (the default): every step, and no "
               "dequantized copy is held: the weights take about their file's memory (a "
               "bfloat16 checkpoint's BF16 tiles too); `0`: never; `auto`: a dense copy for "
               "steps above 16 tokens where the blocks' GEMM is the slower (every tier but "
               "`avx2` with fast int16 multiply-adds: 0.75-0.9x oneDNN on a prefill chunk), "
               "while the copies fit in half the memory free after the KV pool",
               "-1", parse=tokens_or_auto),
        Option("quantized_activations", "what those stored weights multiply: `exact` activations "
               "(float32 or bfloat16 precision); `int16`: activations rounded per 32 columns to 15 "
               "bits (finer than bfloat16) and multiplied in integers, ~1.6x a single stream on "
               "AVX2; `int8`: Q4_0/Q4_1/Q4_K weights take activations rounded to int8 per 32 "
               "columns (about 3x fewer instructions a weight), the others keep `auto`'s; "
               "`int8-all`: every other block type too (Q8_0, Q6_K, Q5_K, ...), llama.cpp's own arithmetic "
               "(on `avx512_bf16` VNNI integer products at every step: a single stream of an 8B "
               "Q4_K_M 1.3x llama.cpp's, 16 served streams 1.8-2x); `int8-prefill`: int8 for "
               "Q4_0/Q4_1/Q4_K weights only in steps of 8+ tokens (prefill chunks, big "
               "batches: an integer GEMM, VNNI's on `avx512_bf16`, ~1.8x the exact kernels), `auto`'s "
               "elsewhere; `auto`: `int16` on tiers without a bfloat16 dot "
               "product (`avx2`, `avx512`), `exact` on `avx512_bf16` (int8 rounding "
               "garbles the default model's answers, as it does in llama.cpp: see \"Kernels and "
               "devices\")",
               choices=ACTIVATIONS),
    ),
    "tensor parallelism": (
        Option("tensor_parallel_size", "executor ranks, each holding a share of the model (see "
               "\"Tensor parallelism\")", flags=("--tensor-parallel-size", "-tp")),
        Option("enable_expert_parallel", "a mixture of experts' ranks each hold whole experts "
               "(a contiguous share of them) instead of a slice of every expert (see \"Tensor "
               "parallelism\")"),
        Option("decode_context_parallel_size", "ranks of a KV head that split its tokens instead "
               "of each holding them all: N times the context in the same KV memory (see "
               "\"Context parallelism\")", flags=("--decode-context-parallel-size", "-dcp")),
        Option("executors", "`local`: the engine starts every rank; `external`: ranks 1.. attach "
               "with `pagewire executor --attach`", choices=EXECUTORS, **_RUN),
        Option("listen", "`tcp://HOST:PORT` where external executors attach (an explicit address; "
               "torch.distributed uses PORT+1)", "none", **_RUN),
        Option("curve_keys", "directory from `pagewire keys DIR`; required with `--listen`", "none",
               **_RUN),
        Option("attach_timeout", "seconds to wait for external ranks", **_RUN),
        Option("tp_timeout", "seconds a collective may wait before the step fails", **_RUN),
    ),
    "server": (
        Option("", "TOML or JSON file of options (flag names or field names as keys)", "none",
               flags=("--config",)),
        Option("host", "where the HTTP server listens", **_RUN),
        Option("port", "the HTTP server's port", **_RUN),
        Option("num_tokenizers", "tokenizer processes", **_RUN),
        Option("drain_timeout", "seconds SIGTERM waits for in-flight requests", **_RUN),
        Option("restart_budget", "actor restarts allowed within `--restart-window` before the "
               "server exits 1", **_RUN),
        Option("restart_window", "seconds over which `--restart-budget` counts", **_RUN),
        Option("warm_spares", "keep a loaded spare tokenizer and detokenizer process: a dead "
               "one's restart promotes it (back within a second, not a cold start)", **_RUN),
        Option("actor_nice", "niceness of every actor but the executors (they keep the cores)",
               **_RUN),
    ),
    "chat and tools": (
        Option("chat_template", "a Jinja chat template file used instead of the model's",
               "model's", serve_only=True),
        Option("enable_auto_tool_choice", "let `tool_choice: auto` (the default with `tools`) "
               "parse the model's own tool calls out of its text (needs `--tool-call-parser`)",
               **_RUN),
        Option("tool_call_parser", "the model's tool-call syntax: `hermes` (`<tool_call>` JSON "
               "`</tool_call>`: Qwen, Hermes), `llama3_json` (a JSON object, Llama 3.x), "
               "`mistral` (`[TOOL_CALLS]` and a JSON list), `openai` (gpt-oss's harmony "
               "messages to `functions.NAME`; with `--reasoning-parser openai_gptoss`)", "none",
               choices=TOOL_CALL_PARSERS, **_RUN),
        Option("reasoning_parser", "return a reasoning model's `<think>` block as "
               "`reasoning_content` apart from `content` (`deepseek_r1`: the output starts in "
               "the block; `qwen3`: it opens with `<think>`; `openai_gptoss`: gpt-oss's "
               "channels, the final one the content, the others (analysis) the reasoning); an "
               "output constraint applies from the block's end (gpt-oss: the final channel's "
               "message marker)", "none", choices=REASONING_PARSERS, serve_only=True),
        Option("files_dir", "where `/v1/files` (batch inputs and outputs) are kept",
               "$PAGEWIRE_CACHE_DIR/files", **_RUN),
        Option("files_max_bytes", "the files' bound in all (an upload past it is a 413)",
               "1GiB", parse=parse_bytes, **_RUN),
        Option("batch_concurrency", "a `/v1/batches` job's requests in flight (at priority "
               "1000: interactive requests, 0 by default, go first under `--scheduling-policy "
               "priority`)", **_RUN),
        Option("responses_store_entries", "`/v1/responses` kept for `previous_response_id` "
               "and `GET` (the least recently used go first)", **_RUN),
        Option("responses_store_bytes", "the responses store's bound in bytes", "64MiB",
               parse=parse_bytes, **_RUN),
    ),
    "Images": (
        Option("limit_mm_per_prompt", "images one prompt may hold, as JSON: `{\"image\": 4}` "
               "(see docs/models.md \"Vision\")", "`{\"image\": 8}`",
               parse=parse_json_object, **_RUN),
        Option("allowed_local_media_path", "`file://` image URLs are read only under this "
               "directory", "none: refused", **_RUN),
        Option("allowed_media_domains", "`http(s)://` image URLs are fetched only from these "
               "hosts (several after one flag)", "none: refused", many=True, **_RUN),
    ),
    "LoRA adapters": (
        Option("enable_lora", "serve LoRA adapters (PEFT directories) beside the base model "
               "(see \"LoRA adapters\")"),
        Option("lora_modules", "adapters served from the start: `name=path` (several after one "
               "flag), or JSON `{\"name\": ..., \"path\": ...}`; a request picks one by "
               "`model`", "none", many=True),
        Option("max_loras", "distinct adapters in one step (requests of others wait)"),
        Option("max_lora_rank", "adapters of a higher rank are refused"),
        Option("max_cpu_loras", "adapters an executor keeps loaded (least recently used "
               "unloaded first)", "max_loras"),
        Option("allow_runtime_lora_updating", "serve `POST /v1/load_lora_adapter` and "
               "`/v1/unload_lora_adapter` (also `$VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`)",
               **_RUN),
        Option("lora_root", "adapters loaded at run time must lie under this directory",
               "anywhere", **_RUN),
    ),
    "security": (
        Option("api_keys", "accepted bearer key, repeatable (also `$PAGEWIRE_API_KEY` or "
               "`$VLLM_API_KEY`, comma-separated); guards `/v1/*` and Ollama's `/api/*`",
               "none", flags=("--api-key",),
               **_RUN),
        Option("cache_salt_per_api_key", "each API key's requests get their own prefix-cache salt "
               "(tenants never share blocks)", **_RUN),
        Option("metrics_require_api_key", "put `GET /metrics` behind the API key check too (open "
               "by default)", **_RUN),
    ),
    "fleet": (
        Option("models_file", "serve several models: a TOML, YAML or JSON file naming each "
               "(served name, path, `pinned`, `idle_timeout`, `memory`, any option of this "
               "table); each is loaded on its first request (see docs/models-fleet.md)", "none",
               **_RUN),
        Option("models_dir", "serve every GGUF file and model directory in DIR, each under its "
               "file or folder name, loaded on its first request", "none", **_RUN),
        Option("model_idle_timeout", "seconds a model may go unused before it is unloaded "
               "(pinned models stay); 0: never", **_RUN),
        Option("models_memory_budget", "memory the loaded models may hold together (`24GiB`); "
               "loading past it unloads the least recently used idle model first", "none",
               parse=parse_bytes, **_RUN),
        Option("max_loaded_models", "models loaded at once (least recently used idle model "
               "out first); 0: no bound", **_RUN),
        Option("model_load_timeout", "seconds a request waits for its model to load before a "
               "503", **_RUN),
        Option("model_queue_size", "requests that may wait for one loading model; past it "
               "a 503", **_RUN),
    ),
    "observability": (
        Option("trace_dir", "record every actor's messages in DIR (see \"Debugging with traces\")",
               "off", flags=("--trace",), **_RUN),
        Option("trace_redact", "blank prompts, outputs and token ids in traces (counts and timing "
               "kept)", **_RUN),
        Option("trace_segment_bytes", "a trace file rotates past this size", "64MiB",
               parse=parse_bytes, **_RUN),
        Option("trace_max_segments", "trace files each actor keeps (the oldest is dropped): the "
               "disk bound", **_RUN),
    ),
}

OPTIONS: tuple[Option, ...] = tuple(o for group in GROUPS.values() for o in group)
BY_FIELD = {o.field: o for o in OPTIONS if o.field}
# Fields resolve() derives, never set by hand.
DERIVED = ("model_info", "draft_model_info", "num_host_blocks", "num_tier_blocks", "kv_block_bytes",
           "run_dir", "backend", "config_digest")
DIGESTED = frozenset(f for f in FIELD_SECTION
                     if f in DERIVED and f not in ("run_dir", "backend", "num_tier_blocks",
                                                   "kv_block_bytes", "config_digest")
                     or f in BY_FIELD and BY_FIELD[f].decides_outputs)
_DEFAULTS = EngineConfig()


def annotation(field: str) -> str:
    """An option's declared type, as written in its section (a string: postponed annotations)."""
    section = FIELD_SECTION[field]
    return (SECTIONS[section] if section else EngineConfig).__annotations__[field]


def shown_default(o: Option) -> str:
    if o.default is not None:
        return o.default
    value = _DEFAULTS.get(o.field)
    if isinstance(value, bool):
        return "on" if value else "off"
    return "—" if value is None else str(value)


def add_flags(parser: argparse.ArgumentParser, serve: bool) -> None:
    """The flags of `pagewire serve` (serve=True) or `pagewire bench`. Flags left unset stay
    out of the namespace (argparse.SUPPRESS), so the file and environment can supply them."""
    for o in OPTIONS:
        if o.serve_only and not serve:
            continue
        text = o.meaning.replace("`", "")
        if o.field:
            text += f" (default {shown_default(o)}; ${o.env})"
        names, kwargs = _argument(o)
        parser.add_argument(*names, help=text, default=argparse.SUPPRESS, **kwargs)


def _argument(o: Option) -> tuple[tuple[str, ...], dict]:
    """The argparse names and keywords of an option's flag."""
    if not o.field:
        return o.names, {"dest": "config_file"}
    if o.names == ("model",):                   # the positional MODEL (its name is its dest)
        return o.names, {"nargs": "?"}
    kind = annotation(o.field)
    if kind.startswith("bool"):
        if len(o.names) == 2:                   # --x / --no-x: argparse adds the --no- form
            return o.names[:1], {"dest": o.field, "action": argparse.BooleanOptionalAction}
        action = "store_false" if o.names[0].startswith("--no-") else "store_true"
        return o.names, {"dest": o.field, "action": action}
    if kind.startswith("list"):
        many = {"nargs": "+", "action": "extend"} if o.many else {"action": "append"}
        return o.names, {"dest": o.field, **many}
    parse = o.parse or (int if "int" in kind else float if "float" in kind else str)
    choices = {"choices": list(o.choices)} if o.choices else {}
    return o.names, {"dest": o.field, "type": parse, **choices}


def options_tables() -> str:
    """docs/serving.md's options tables, one per group, as they must read."""
    out = []
    for name, group in GROUPS.items():
        out += [f"**{name[0].upper()}{name[1:]}**", "", "| option | default | meaning |", "|---|---|---|"]
        for o in group:
            flags = ", ".join(f"`{'MODEL' if f == 'model' else f}`" for f in o.names)
            out.append(f"| {flags} | {shown_default(o)} | {o.meaning} |")
        out.append("")
    return "\n".join(out)


def values_from_env(environ) -> dict:
    """Options from PAGEWIRE_<FIELD> variables (API keys: comma-separated)."""
    values = {}
    for o in OPTIONS:
        text = environ.get(o.env) if o.field else None
        if text:
            values[o.field] = text.split(",") if o.field == "api_keys" else \
                text.split() if o.many else text
    return values


def convert(values: dict) -> EngineConfig:
    """An EngineConfig from option values given as text or typed. Raises ValueError."""
    values = {k: BY_FIELD[k].parse(v) if isinstance(v, str) and BY_FIELD[k].parse else v
              for k, v in values.items()}
    try:
        return EngineConfig.from_options(strict=False, **values)
    except msgspec.ValidationError as e:
        raise ValueError(f"bad option: {e}") from None
