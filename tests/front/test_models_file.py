"""The front's models file and directory, the engines' options, the merged /metrics."""
from __future__ import annotations

import os

import pytest

from pagewire.front.front_metrics import labelled
from pagewire.front.models_file import (ModelEntry, engine_values, read_models_file,
                                        scan_models_dir)


def _write(path, text: str) -> str:
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def test_a_toml_models_file_gives_each_model_its_path_options_and_adapters(tmp_path):
    (tmp_path / "chat.gguf").write_bytes(b"GGUF")
    (tmp_path / "emb").mkdir()
    path = _write(tmp_path / "models.toml", """
[models.chat]
model = "chat.gguf"
pinned = true
max-model-len = 4096
lora_modules = ["sql=/srv/sql", '{"name": "law", "path": "/srv/law"}']

[models.embed]
model = "emb"
runner = "pooling"
idle_timeout = 600
memory = "2GiB"
""")
    chat, embed = read_models_file(path)
    assert chat == ModelEntry("chat", str(tmp_path / "chat.gguf"),
                              {"max_model_len": 4096,
                               "lora_modules": ["sql=/srv/sql",
                                                '{"name": "law", "path": "/srv/law"}']},
                              pinned=True, adapters=("sql", "law"))
    assert embed == ModelEntry("embed", str(tmp_path / "emb"), {"runner": "pooling"},
                               idle_timeout=600.0, memory=2 * 2**30)


def test_a_yaml_models_file_reads_the_same(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    path = _write(tmp_path / "models.yaml", "models:\n  small:\n    model: m.gguf\n"
                  "    dtype: float32\n")
    assert read_models_file(path) == [ModelEntry("small", str(tmp_path / "m.gguf"),
                                                 {"dtype": "float32"})]


@pytest.mark.parametrize("body, said", [
    ('[models.x]\nmodel = "m.gguf"\nport = 9000\n', "cannot set here: ['port']"),
    ('[models.x]\nmodel = "m.gguf"\nno_such_option = 1\n', "['no_such_option']"),
    ('[models.x]\nmodel = "m.gguf"\ndtype = "float7"\n', "model 'x'"),
    ('[models.x]\nmodel = "missing.gguf"\n', "missing.gguf does not exist"),
    ('[models.x]\nmodel = "m.gguf"\nmemory = "lots"\n', "not a size"),
    ('title = "no models"\n', "expected a `models` table"),
])
def test_a_models_file_that_cannot_be_served_is_refused_naming_why(tmp_path, body, said):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=None) as e:
        read_models_file(_write(tmp_path / "models.toml", body))
    assert said in str(e.value)


def test_a_models_dir_serves_gguf_files_and_model_folders_but_vision_files(tmp_path):
    for name in ("b.gguf", "mmproj-b.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    assert [(e.name, os.path.basename(e.path)) for e in scan_models_dir(str(tmp_path))] == \
        [("a", "a"), ("b", "b.gguf")]


def test_an_engine_starts_from_the_front_options_under_its_own():
    front = {"dtype": "float32", "max_model_len": 512, "api_keys": ["k"], "port": 8000,
             "models_file": "m.toml", "model_idle_timeout": 5.0}
    entry = ModelEntry("chat", "/m/chat.gguf", {"max_model_len": 4096})
    assert engine_values(front, entry, 41000) == {
        "dtype": "float32", "max_model_len": 4096, "api_keys": ["k"], "model": "/m/chat.gguf",
        "served_model_name": "chat", "host": "127.0.0.1", "port": 41000}


def test_metrics_merge_by_family_and_label_every_sample_with_its_model():
    a = ('# HELP vllm:num_requests_running running\n# TYPE vllm:num_requests_running gauge\n'
         'vllm:num_requests_running{model_name="a",engine="0"} 1.0\n'
         '# HELP pagewire:api_requests_total by api\n# TYPE pagewire:api_requests_total counter\n'
         'pagewire:api_requests_total{api="chat"} 3.0\n')
    b = a.replace('"a"', '"b"').replace("1.0", "2.0").replace("3.0", "4.0")
    assert labelled([("a", a), ("b", b)], "own 1\n") == (
        '# HELP vllm:num_requests_running running\n# TYPE vllm:num_requests_running gauge\n'
        'vllm:num_requests_running{model_name="a",engine="0"} 1.0\n'
        'vllm:num_requests_running{model_name="b",engine="0"} 2.0\n'
        '# HELP pagewire:api_requests_total by api\n# TYPE pagewire:api_requests_total counter\n'
        'pagewire:api_requests_total{model_name="a",api="chat"} 3.0\n'
        'pagewire:api_requests_total{model_name="b",api="chat"} 4.0\n'
        'own 1\n')
