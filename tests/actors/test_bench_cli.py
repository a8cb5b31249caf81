"""`pagewire bench throughput|latency` end to end on the default model: the engine options
given as flags reach the offline engine it builds, and each command writes vLLM's summary
fields (a bench broken by a change to the configuration's shape failed only when run by
hand before); the model is taken as MODEL or as vLLM's `--model`."""
from __future__ import annotations

import json

import pytest

from pagewire import cli

ENGINE = ["--max-model-len", "256", "--kv-cache-memory", "16MiB", "--max-num-seqs", "4"]


@pytest.mark.slow
def test_throughput_runs_with_the_flags_given(tmp_path, monkeypatch):
    from pagewire import bench_cli
    built = []
    real = bench_cli._llm
    monkeypatch.setattr(bench_cli, "_llm", lambda args: built.append(real(args)) or built[-1])
    out = tmp_path / "throughput.json"
    assert cli.main(["bench", "throughput", *ENGINE, "--random-input-len", "16",
                     "--random-output-len", "4", "--num-prompts", "3",
                     "--output-json", str(out)]) == 0
    config = built[0].config
    assert (config.model.max_model_len, config.scheduler.max_num_seqs) == (256, 4)
    assert config.cache.kv_cache_memory == 16 * 2**20
    result = json.loads(out.read_text())
    assert result["num_requests"] == 3 and result["total_num_tokens"] == 3 * (16 + 4)


@pytest.mark.slow
def test_latency_runs(tmp_path):
    out = tmp_path / "latency.json"
    assert cli.main(["bench", "latency", *ENGINE, "--input-len", "8", "--output-len", "4",
                     "--batch-size", "2", "--num-iters", "2", "--num-iters-warmup", "0",
                     "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 2 and result["avg_latency"] > 0


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_model_flag_is_the_positional_model(tmp_path, command):
    model = str(tmp_path / "m.gguf")
    positional = cli.config_from_args(cli.parse_args(["bench", command, model, *ENGINE]))
    flag = cli.config_from_args(cli.parse_args(["bench", command, "--model", model, *ENGINE]))
    both = cli.config_from_args(cli.parse_args(["bench", command, model, "--model", model]))
    assert flag == positional and flag.model.model == both.model.model == model
    assert cli.config_from_args(cli.parse_args(["bench", command])).model.model is None


def test_two_different_models_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["bench", "latency", "a.gguf", "--model", "b.gguf"])
    assert exc.value.code == 2
    assert "the model is given twice: MODEL 'a.gguf' and --model 'b.gguf'" in \
        capsys.readouterr().err


def test_auto_values_reach_the_engine(monkeypatch):
    """`auto` parses to None (the engine decides): the bench passes it on, not the default."""
    from pagewire import bench_cli, llm
    seen = {}
    monkeypatch.setattr(llm, "LLM", lambda model, **fields: seen.update(fields, model=model))
    args = cli.parse_args(["bench", "throughput", "--quantized-matmul-tokens", "auto",
                           "--kv-cache-memory", "3GiB"])
    bench_cli._llm(args)
    assert seen["quantized_matmul_tokens"] is None and seen["kv_cache_memory"] == 3 * 2**30
    bench_cli._llm(cli.parse_args(["bench", "throughput"]))
    assert seen["quantized_matmul_tokens"] == -1 and seen["kv_cache_memory"] is None
