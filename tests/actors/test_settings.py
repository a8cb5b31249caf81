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
    assert (c.max_num_seqs, c.port, c.drain_timeout) == (8, 9002, 7.0)
    assert c.kv_cache_memory == 512 * 2**20 and c.swap_space == int(1.5 * 2**30)
    assert c.enable_prefix_caching is False
    assert c.api_keys == ["from-file", "env-a", "env-b", "flag"]
    assert settings.build({}, {}).max_num_seqs == 256          # the default


def test_json_config_and_bad_values(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"block_size": 32}))
    assert settings.build({}, {}, str(path)).block_size == 32
    path.write_text(json.dumps({"no_such_option": 1}))
    with pytest.raises(ValueError, match="no_such_option"):
        settings.build({}, {}, str(path))
    with pytest.raises(ValueError, match="bad option"):
        settings.build({}, {"PAGEWIRE_MAX_NUM_SEQS": "lots"})


def test_effective_configuration_redacts_keys():
    line = settings.effective(settings.build({"api_keys": ["secret-1", "secret-2"]}, {}))
    assert "secret" not in line and json.loads(line)["api_keys"] == ["<2 keys>"]


def test_a_bad_option_exits_2_before_anything_starts(monkeypatch):
    monkeypatch.setenv("PAGEWIRE_BLOCK_SIZE", "3")
    assert main(["serve"]) == 2


def test_readme_options_table_lists_exactly_the_serve_flags_and_every_option_has_one():
    """The README's `pagewire serve` options table and the CLI cannot drift apart: a flag
    added without a row (or a row left for a removed flag) fails here, as does an option
    settable by file or environment that no flag sets."""
    import os
    import re

    from pagewire.cli import serve_parser
    actions = serve_parser()._actions
    flags = {s for a in actions for s in a.option_strings if s.startswith("--")} - {"--help"}
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    section = readme[readme.index("### `pagewire serve [MODEL]` options"):]
    section = section[:section.index("\n### ", 1)]
    listed = {flag for cell in re.findall(r"^\| ([^|]+) \|", section, re.M)
              for flag in re.findall(r"`(--[a-z0-9-]+)", cell)}
    assert sorted(flags - listed) == [] and sorted(listed - flags) == []
    assert set(settings.SETTABLE) <= {a.dest for a in actions}
