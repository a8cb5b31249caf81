"""Where options come from: defaults < config file < environment < flags; API keys from all."""
from __future__ import annotations

import json

import pytest

from pagewire import settings
from pagewire.cli import main


def test_precedence_file_then_env_then_flags(tmp_path):
    path = tmp_path / "pagewire.toml"
    path.write_text('max-num-seqs = 8\nport = 9001\nkv_cache_memory = "512MiB"\n'
                    'api-keys = ["from-file"]\ndrain-timeout = 5\n')
    env = {"PAGEWIRE_PORT": "9002", "PAGEWIRE_ENABLE_PREFIX_CACHING": "false",
           "PAGEWIRE_SWAP_SPACE": "1.5", "PAGEWIRE_API_KEY": "env-a,env-b"}
    c = settings.build({"drain_timeout": 7.0, "api_keys": ["flag"]}, env, str(path))
    assert (c.scheduler.max_num_seqs, c.server.port, c.server.drain_timeout) == (8, 9002, 7.0)
    assert c.cache.kv_cache_memory == 512 * 2**20 and c.cache.swap_space == int(1.5 * 2**30)
    assert c.cache.enable_prefix_caching is False
    assert c.server.api_keys == ["from-file", "env-a", "env-b", "flag"]
    assert settings.build({}, {}).scheduler.max_num_seqs == 256          # the default


def test_json_config_and_bad_values(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"block_size": 32}))
    assert settings.build({}, {}, str(path)).cache.block_size == 32
    path.write_text(json.dumps({"no_such_option": 1}))
    with pytest.raises(ValueError, match="no_such_option"):
        settings.build({}, {}, str(path))
    with pytest.raises(ValueError, match="bad option"):
        settings.build({}, {"PAGEWIRE_MAX_NUM_SEQS": "lots"})


def test_quantized_matmul_tokens_takes_a_count_or_auto():
    assert settings.build({}, {}).device.quantized_matmul_tokens == -1      # blocks only
    env = {"PAGEWIRE_QUANTIZED_MATMUL_TOKENS": "16"}
    assert settings.build({}, env).device.quantized_matmul_tokens == 16
    assert settings.build({}, {"PAGEWIRE_QUANTIZED_MATMUL_TOKENS": "auto"}) \
        .device.quantized_matmul_tokens is None
    with pytest.raises(ValueError, match="whole number of tokens or `auto`"):
        settings.build({}, {"PAGEWIRE_QUANTIZED_MATMUL_TOKENS": "many"})


def test_kv_cache_memory_takes_a_size_or_auto():
    assert settings.build({}, {}).cache.kv_cache_memory is None                  # auto
    env = {"PAGEWIRE_KV_CACHE_MEMORY": "4GiB"}
    assert settings.build({}, env).cache.kv_cache_memory == 4 * 2**30
    assert settings.build({"kv_cache_memory": "auto"}, env).cache.kv_cache_memory is None


def test_effective_configuration_redacts_keys():
    line = settings.effective(settings.build({"api_keys": ["secret-1", "secret-2"]}, {}))
    assert "secret" not in line and json.loads(line)["api_keys"] == ["<2 keys>"]


def test_a_bad_option_exits_2_before_anything_starts(monkeypatch):
    monkeypatch.setenv("PAGEWIRE_BLOCK_SIZE", "3")
    assert main(["serve"]) == 2


def test_docs_options_tables_are_the_declared_options_and_every_field_has_one():
    """docs/serving.md's options tables are generated from options.py (a flag added, removed
    or reworded without the guide fails here); every settable EngineConfig field is declared
    exactly once, and `pagewire serve` has exactly the declared flags."""
    import os

    from pagewire.cli import serve_parser
    from pagewire.config import FIELD_SECTION
    from pagewire.options import BY_FIELD, DERIVED, OPTIONS, options_tables
    guide = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "serving.md")).read()
    assert options_tables() in guide, (
        "docs/serving.md's options tables differ from actors/options.py; regenerate with: "
        "python -c 'from pagewire.options import options_tables; print(options_tables())'")
    fields = [o.field for o in OPTIONS if o.field]
    assert sorted(fields) == sorted(set(FIELD_SECTION) - set(DERIVED))
    assert len(fields) == len(set(fields)) == len(BY_FIELD)
    flags = {s for a in serve_parser()._actions for s in a.option_strings} - {"-h", "--help"}
    declared = {n for o in OPTIONS for n in o.names if n.startswith("-")}
    assert flags == declared


def test_digest_covers_what_decides_outputs():
    from pagewire.options import DIGESTED
    base = settings.build({}, {})
    for field, value, counts in (("port", 1234, False), ("trace_dir", "/tmp/x", False),
                                 ("threads", 3, False), ("max_num_seqs", 7, True),
                                 ("async_scheduling", False, True), ("seed", 5, True)):
        changed = settings.build({field: value}, {})
        assert (changed.digest() != base.digest()) == counts == (field in DIGESTED), field


def test_flags_carry_their_environment_names_in_the_help():
    from pagewire.cli import serve_parser
    text = serve_parser().format_help()
    assert "$PAGEWIRE_MAX_NUM_SEQS" in text and "$PAGEWIRE_KV_CACHE_MEMORY" in text


def test_speculative_config_from_a_flag_the_environment_or_a_file(tmp_path):
    import argparse
    from pagewire.options import add_flags
    parser = argparse.ArgumentParser()
    add_flags(parser, serve=True)
    flags = vars(parser.parse_args(["--speculative-config",
                                    '{"method": "suffix", "num_speculative_tokens": 5}']))
    spec = settings.build(flags, {}).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min) == ("suffix", 5, 3)
    env = {"PAGEWIRE_SPECULATIVE_CONFIG": '{"num_speculative_tokens": 2}'}
    assert settings.build({}, env).speculative_config.num_speculative_tokens == 2
    path = tmp_path / "c.toml"
    path.write_text('[speculative-config]\nmethod = "ngram"\nprompt_lookup_max = 6\n')
    assert settings.build({}, {}, str(path)).speculative_config.prompt_lookup_max == 6
    for bad, words in (('{"method": "eagle"}', "ngram, suffix, self or draft_model"),
                       ("[1]", "JSON object"), ('{"num_speculative_tokens": 0}', "1..16"),
                       ('{"typo": 1}', "typo"), ('{"method": "draft_model"}', "needs one"),
                       ('{"model": "/m"}', "goes with method draft_model"),
                       ('{"method": "draft_model", "model": "/nowhere"}', "/nowhere")):
        with pytest.raises(ValueError, match=words):
            settings.build({}, {"PAGEWIRE_SPECULATIVE_CONFIG": bad}).resolve()
    with pytest.raises(ValueError, match="do not combine"):
        settings.build({"async_scheduling": True,
                        "speculative_config": '{"method": "ngram"}'}, {}).resolve()


def test_lora_options_as_vllm_spells_them(tmp_path):
    import argparse
    from pagewire.options import add_flags
    parser = argparse.ArgumentParser()
    add_flags(parser, serve=True)
    flags = vars(parser.parse_args(["m", "--enable-lora", "--lora-modules", "a=/x",
                                    '{"name": "b", "path": "/y", "base_model_name": "m"}',
                                    "--max-loras", "2"]))
    config = settings.build(flags, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert config.model.model == "m" and config.lora.max_loras == 2 \
        and config.lora.allow_runtime_lora_updating
    from pagewire.lora_files import parse_module
    assert [parse_module(m) for m in config.lora.lora_modules] == [("a", "/x"), ("b", "/y")]
    env = settings.build({}, {"PAGEWIRE_LORA_MODULES": "a=/x c=/z"})
    assert env.lora.lora_modules == ["a=/x", "c=/z"] and not env.lora.allow_runtime_lora_updating
    for options, words in (({"lora_modules": ["a=/x"]}, "needs --enable-lora"),
                           ({"enable_lora": True, "lora_modules": ["nopath"]}, "name=path"),
                           ({"enable_lora": True, "lora_modules": ["a=/nowhere"]},
                            "a: /nowhere: no such adapter directory"),
                           ({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1},
                            "at least --max-loras")):
        with pytest.raises(ValueError, match=words):
            settings.build({**options, "dtype": "float32"}, {}).resolve()
