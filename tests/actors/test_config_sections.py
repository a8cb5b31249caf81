"""EngineConfig by section: flat option names for users, sections inside, each actor holding
only its sections, every choice list declared once, recordings from before still read."""
from __future__ import annotations

import json
import time

import pytest

from pagewire import settings
from pagewire.config import ACTOR_SECTIONS, FIELD_SECTION, SECTIONS, EngineConfig
from pagewire.config_sections import (EXECUTORS, PREEMPTION_MODES, REASONING_PARSERS,
                                      SCHEDULING_POLICIES, TOOL_CALL_PARSERS)
from pagewire.options import BY_FIELD

# EngineConfig's fields before the sections (HEAD 297e603): a trace header's config_json held
# one key per field.
FLAT_FIELDS = (
    "model", "served_model_name", "host", "port", "dtype", "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "block_size", "kv_cache_memory", "num_kv_blocks", "kv_cache_dtype",
    "quantization", "enable_chunked_prefill", "enable_prefix_caching", "swap_space",
    "preemption_mode", "kv_offload_dir", "kv_offload_size", "kv_compress_rate",
    "kv_compress_window", "scheduling_policy", "max_num_queued_reqs", "max_num_queued_tokens",
    "num_tokenizers", "threads", "kernels", "quantized_matmul_tokens", "quantized_activations",
    "device", "enforce_eager", "disable_cascade_attn", "async_scheduling", "actor_nice",
    "restart_budget", "restart_window", "seed", "tensor_parallel_size",
    "decode_context_parallel_size", "executors", "listen", "curve_keys", "attach_timeout",
    "tp_timeout", "trace_dir", "trace_redact", "trace_segment_bytes", "trace_max_segments",
    "drain_timeout", "api_keys", "cache_salt_per_api_key", "metrics_require_api_key",
    "chat_template", "enable_auto_tool_choice", "tool_call_parser", "reasoning_parser",
    "speculative_config", "kv_transfer_config", "enable_lora", "lora_modules", "max_loras",
    "max_lora_rank", "max_cpu_loras", "allow_runtime_lora_updating", "lora_root", "run_dir",
    "model_info", "draft_model_info", "num_host_blocks", "num_tier_blocks", "kv_block_bytes",
    "backend")
# Fields added since (a recording before them reads with their defaults).
ADDED_SINCE = ("enable_expert_parallel", "responses_store_entries", "responses_store_bytes",
               "limit_mm_per_prompt", "allowed_local_media_path", "allowed_media_domains",
               "encoder_budget", "files_dir", "files_max_bytes", "batch_concurrency",
               "mmproj", "runner", "convert", "pooler_config", "models_file", "models_dir",
               "model_idle_timeout", "models_memory_budget", "max_loaded_models",
               "model_load_timeout", "model_queue_size", "enable_sleep_mode", "kv_events_config",
               "warm_spares", "prefix_wait")


def _resolved(**options) -> EngineConfig:
    return EngineConfig.from_options(max_model_len=512, kv_cache_memory=64 * 2**20,
                                     **options).resolve()


def _flat_json(config: EngineConfig) -> bytes:
    """The configuration as a recording made before the sections holds it."""
    flat = config.flat()
    return json.dumps({k: flat[k] for k in FLAT_FIELDS}, default=_encodable).encode()


def _header(config: EngineConfig, config_json: str | None = None, actor: str = "tokenizer 0"):
    """A trace header as process.open_tracer writes it (config_json: as recorded)."""
    from pagewire.wire.trace import FORMAT_VERSION, TraceHeader
    info = config.model.model_info
    return TraceHeader(version=FORMAT_VERSION, actor=actor, pid=1, segment=0,
                       config_digest=config.digest(), model_id=f"{info.name}@{info.digest}",
                       config_json=config_json or config.public().to_json().decode(),
                       started=time.time(), redacted=False)


def _encodable(value):
    import msgspec
    return msgspec.to_builtins(value)


def test_every_option_has_one_section_and_the_flat_names_are_kept():
    assert len(EngineConfig.__struct_fields__) == 14 and len(FLAT_FIELDS) == 72
    assert set(FLAT_FIELDS) | set(ADDED_SINCE) | {"config_digest"} == set(FIELD_SECTION)
    owned = [f for c in SECTIONS.values() for f in c.__struct_fields__]
    assert len(owned) == len(set(owned))                        # no field in two sections
    config = EngineConfig.from_options(block_size=32, max_num_seqs=8, port=9000, enable_lora=True)
    assert (config.cache.block_size, config.scheduler.max_num_seqs, config.server.port,
            config.lora.enable_lora) == (32, 8, 9000, True)
    changed = config.replace(block_size=64, tensor_parallel_size=2)
    assert (changed.cache.block_size, changed.parallel.tensor_parallel_size,
            changed.scheduler.max_num_seqs) == (64, 2, 8)
    assert config.cache.block_size == 32                        # frozen: replace copies
    with pytest.raises(AttributeError):
        config.cache.block_size = 1
    line = json.loads(settings.effective(config))
    assert list(line) == list(BY_FIELD) and line["block_size"] == 32


def test_a_recording_before_the_sections_reads_as_the_same_configuration():
    config = _resolved(max_num_seqs=8, scheduling_policy="priority").public()
    old = _flat_json(config)
    assert set(json.loads(old)) == set(FLAT_FIELDS)
    assert EngineConfig.from_json(old) == config.replace(config_digest="")
    assert EngineConfig.from_json(config.to_json()) == config


def test_a_tokenizer_recording_with_the_flat_configuration_replays(tmp_path, capsys):
    """A trace whose header holds the flat JSON of before (replay_config reads it through
    EngineConfig.from_json) replays without a divergence."""
    from pagewire.hf_tokenizer import load_tokenizer
    from pagewire.replay import replay
    from pagewire.tokenizer import RequestTokenizer
    from pagewire.wire.channels import encode
    from pagewire.wire.to_tokenizer import TokenizeOnly
    from pagewire.wire.trace import TraceWriter, set_recording
    config = _resolved()
    info = config.model.model_info
    header = _header(config, _flat_json(config.public()).decode())
    set_recording(str(tmp_path), True)
    tracer = TraceWriter(str(tmp_path), header, 2**20, 2)
    ask = TokenizeOnly(req_id="t0", prompt="The capital of France")
    reply = RequestTokenizer(config, load_tokenizer(info)).tokenize_only(ask)
    tracer.record_message("in", "tokenizer-0", ask, encode(ask))
    tracer.record_message("out", "gateway", reply, encode(reply))
    tracer.close()
    assert replay(str(tmp_path), "tokenizer") == 0
    assert "replayed 2 records of the tokenizer (tokenizer 0, pid 1): no divergence" \
        in capsys.readouterr().out


def test_replay_takes_an_actors_sections_as_recorded_and_applies_overrides():
    from pagewire.replay import replay_config
    detok = _resolved().for_actor("detokenizer").public()
    assert replay_config(_header(detok), {}) == (detok, [])
    config, changed = replay_config(_header(detok), {"max_model_len": 256})
    assert config.model.max_model_len == 256 and changed == ["max_model_len: 512 -> 256"]
    assert config.cache is None and config.server is None and config.scheduler is None


def test_each_actor_holds_only_its_sections():
    full = _resolved(api_keys=["k"], speculative_config={"method": "ngram"})
    for role, held in ACTOR_SECTIONS.items():
        mine = EngineConfig.from_json(full.for_actor(role).to_json())
        present = {s for s in (*SECTIONS, "speculative_config", "kv_transfer_config",
                               "kv_events_config") if getattr(mine, s) is not None}
        assert present == set(held) - {"kv_transfer_config", "kv_events_config"}, role  # off
        assert mine.model == full.model and mine.run_dir == full.run_dir
        assert mine.observability.config_digest == full.digest()    # the engine's, not its
    detok = full.for_actor("detokenizer")
    assert detok.cache is None and detok.server is None and detok.speculative_config is None
    assert detok.public().observability.trace_dir is None             # no server section: fine
    assert full.for_actor("gateway").public().server.api_keys == []


def test_every_choice_list_is_declared_once():
    """options.py's flag choices are the tuples the checks use; the parsers' tables match."""
    from pagewire.gateway.tools import PARSERS
    for field, choices in (("scheduling_policy", SCHEDULING_POLICIES),
                           ("preemption_mode", PREEMPTION_MODES), ("executors", EXECUTORS),
                           ("tool_call_parser", TOOL_CALL_PARSERS),
                           ("reasoning_parser", REASONING_PARSERS)):
        assert BY_FIELD[field].choices is choices, field
    assert tuple(PARSERS) == TOOL_CALL_PARSERS
    for field, bad in (("scheduling_policy", "lifo"), ("preemption_mode", "drop"),
                       ("executors", "remote"), ("tool_call_parser", "xml"),
                       ("reasoning_parser", "o1")):
        with pytest.raises(ValueError, match=f"{field} must be one of"):
            _resolved(**{field: bad})


def _modules_of(role: str) -> set[str]:
    """The project's modules an actor's process imports (at the top or inside functions),
    found by walking the imports from its module in process.ROLES."""
    import ast
    import importlib.util

    from pagewire.process import ROLES
    seen, todo = set(), [ROLES[role], "pagewire.process"]
    while todo:
        name = todo.pop()
        if name in seen or not name.startswith("pagewire."):    # pagewire/__init__'s imports
            continue                                            # run only for pagewire.LLM
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:                  # a name imported from a module
            continue
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        seen.add(name)
        package = name if spec.origin.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(open(spec.origin).read())):
            if isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""),
                                                   package) if node.level else node.module
                todo += [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
    return {m for m in seen if m.startswith("pagewire.")}


@pytest.mark.parametrize("role", sorted(ACTOR_SECTIONS))
def test_no_actor_reads_a_section_it_is_not_sent(role):
    """Every `config.<section>` read in the modules an actor imports names a section that
    actor holds (ACTOR_SECTIONS); the modules that hold every section are left out."""
    import importlib.util
    import re
    whole = ("model", "observability", "speculative_config", "kv_transfer_config",
             "kv_events_config")
    read = re.compile(r"(?:\bconfig|\bcfg)\.(" + "|".join((*SECTIONS, *whole)) + r")\b")
    # These hold every section; lora_files (check_options) and kv_sizing read sections only
    # as resolve() calls them.
    everything = {"pagewire.config", "pagewire.config_sections", "pagewire.options",
                  "pagewire.settings", "pagewire.llm", "pagewire.replay", "pagewire.supervisor",
                  "pagewire.lora_files", "pagewire.kv_sizing"}
    modules = _modules_of(role) - everything
    assert any(m.endswith(".process") for m in modules) and len(modules) > 3
    reads = {(m, s) for m in modules
             for s in read.findall(open(importlib.util.find_spec(m).origin).read())}
    assert {(m, s) for m, s in reads if s not in ACTOR_SECTIONS[role]} == set()
