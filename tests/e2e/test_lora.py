"""LoRA adapters served: `model` picks an adapter (or the base model) in a concurrent mixed
batch, each answer the greedy tokens of transformers on its merged weights; /v1/models lists
the adapters; adapters load, reload and unload at run time; bad adapters and unknown models
get OpenAI errors with the reason, and the server answers the next request."""
from __future__ import annotations

import concurrent.futures
import os
import urllib.request

import pytest

from pagewire.testing.server import TWO_RANKS, Server, running_server
from tests.actors.test_lora import MLP, make_adapter, merged_oracle
from tests.helpers import assert_greedy_equal, make_tiny_llama

pytestmark = pytest.mark.slow
PROMPT = list(range(20, 40))


@pytest.fixture(scope="module")
def files(tmp_path_factory, smol_tokenizer_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-e2e")
    base = make_tiny_llama(str(root / "base"), smol_tokenizer_dir, vocab_size=512, seed=8)
    adapters = root / "adapters"
    return {"base": base, "root": str(adapters),
            "a": make_adapter(str(adapters / "a"), base, seed=11),
            "b": make_adapter(str(adapters / "b"), base, MLP, rank=8, alpha=32, seed=12),
            "c": make_adapter(str(adapters / "c"), base, ("q_proj",), seed=13),
            "big": make_adapter(str(adapters / "big"), base, rank=64, seed=14),
            "outside": make_adapter(str(root / "outside"), base, seed=15)}


def greedy(srv: Server, model: str, n: int = 10) -> list[int]:
    code, reply, _ = srv.request("POST", "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert code == 200, reply
    assert reply["model"] == model
    return [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]


def assert_merged(tokens: list[int], base: str, adapter: str | None) -> None:
    theirs, logits = merged_oracle(base, adapter).greedy(PROMPT, len(tokens))
    assert_greedy_equal(tokens, theirs, logits, str(adapter))


def test_adapters_are_served_loaded_and_refused_at_run_time(files):
    base = files["base"]
    args = [base, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
            "--served-model-name", "tiny", "--enable-lora", "--lora-modules", f"a={files['a']}",
            f"b={files['b']}", "--max-loras", "2", "--allow-runtime-lora-updating",
            "--lora-root", files["root"]]
    with running_server(args) as srv:
        code, models, _ = srv.request("GET", "/v1/models")
        assert [(m["id"], m["parent"]) for m in models["data"]] == \
            [("tiny", None), ("a", "tiny"), ("b", "tiny")]
        names = ["tiny", "a", "b", "a", "tiny", "b"]
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:     # one batch
            outs = list(pool.map(lambda m: greedy(srv, m), names))
        for name, tokens in zip(names, outs):
            assert_merged(tokens, base, files.get(name))
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            assert 'vllm:lora_requests_info{max_lora="2"' in r.read().decode()

        def load(name: str, path: str, **extra) -> tuple[int, dict]:
            code, reply, _ = srv.request("POST", "/v1/load_lora_adapter",
                                         {"lora_name": name, "lora_path": path, **extra})
            return code, reply

        code, reply = load("big", files["big"])
        assert code == 400 and "rank 64 is above --max-lora-rank 16" in \
            reply["error"]["message"]
        code, reply = load("x", files["outside"])
        assert code == 400 and "outside --lora-root" in reply["error"]["message"]
        code, reply = load("x", os.path.join(files["root"], "missing"))
        assert code == 400 and "no such adapter directory" in reply["error"]["message"]
        code, reply = load("a", files["c"])
        assert code == 400 and "already been loaded" in reply["error"]["message"]
        assert load("c", files["c"])[0] == 200
        assert_merged(greedy(srv, "c"), base, files["c"])
        assert load("a", files["c"], load_inplace=True)[0] == 200      # a new version of a
        assert_merged(greedy(srv, "a"), base, files["c"])
        code, reply, _ = srv.request("POST", "/v1/unload_lora_adapter", {"lora_name": "c"})
        assert code == 200
        code, reply, _ = srv.request("POST", "/v1/completions", {"model": "c", "prompt": "hi"})
        assert code == 404 and reply["error"]["type"] == "NotFoundError"
        assert_merged(greedy(srv, "tiny"), base, None)


def test_adapters_split_over_tensor_parallel_ranks(tmp_path, smol_tokenizer_dir):
    """Uneven shares (3 KV heads over 2 ranks): each rank holds its heads' and intermediate
    rows' slice of every adapter, as of the base weights."""
    base = make_tiny_llama(str(tmp_path / "base"), smol_tokenizer_dir, (96, 6, 3, 32),
                           vocab_size=511, seed=9)
    a = make_adapter(str(tmp_path / "a"), base, seed=21)
    b = make_adapter(str(tmp_path / "b"), base, ("k_proj", "o_proj", "down_proj"), seed=22)
    args = [base, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
            "--served-model-name", "tiny", *TWO_RANKS, "--enable-lora", "--max-loras", "2",
            "--lora-modules", f"a={a}", f"b={b}"]
    with running_server(args) as srv:
        names = ["a", "tiny", "b"]
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            outs = list(pool.map(lambda m: greedy(srv, m), names))
    for name, tokens in zip(names, outs):
        assert_merged(tokens, base, {"a": a, "b": b}.get(name))


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_expert_adapters_split_over_ranks(tmp_path, smol_tokenizer_dir, expert_parallel):
    """Qwen2-MoE with an adapter of its attention, experts and shared expert over two ranks:
    each rank its slice of every expert's rows (plain), or its whole experts (expert
    parallel; the shared expert split as in plain), as of the base weights."""
    from tests.actors.test_architectures import make_model
    from tests.actors.test_lora_families import attention_adapter, expert_modules
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, "qwen2-moe-shared")
    adapter = attention_adapter(str(tmp_path / "a"), base, ("q_proj", "o_proj"),
                                extra=expert_modules(base, False, (0, 2), shared=True))
    args = [base, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
            "--served-model-name", "tiny", *TWO_RANKS, "--enable-lora", "--lora-modules",
            f"a={adapter}"] + (["--enable-expert-parallel"] if expert_parallel else [])
    with running_server(args) as srv:
        tokens = greedy(srv, "a")
    theirs, logits = merged_oracle(base, adapter).greedy(PROMPT, len(tokens))
    assert_greedy_equal(tokens, theirs, logits, "experts over two ranks")


def test_a_fused_qkv_adapter_split_over_ranks(tmp_path, smol_tokenizer_dir):
    """GPT-NeoX's head-by-head query_key_value adapter, its B reordered and split into q, k
    and v, each rank its heads' rows."""
    from pagewire.lora_names import shape
    from pagewire.model_info import resolve_model
    from tests.actors.test_architectures import make_model
    from tests.actors.test_lora_families import GPT_MODULES, write_adapter
    base = make_model(str(tmp_path / "base"), smol_tokenizer_dir, "gpt-neox-parallel")
    info = resolve_model(base)
    prefix, modules = GPT_MODULES["gpt-neox-parallel"]
    adapter = write_adapter(str(tmp_path / "a"), {
        f"base_model.model.{prefix.format(layer)}.{module}": shape(info, proj)
        for layer in range(info.num_layers) for module, proj in modules})
    args = [base, "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB",
            "--served-model-name", "tiny", *TWO_RANKS, "--enable-lora", "--lora-modules",
            f"a={adapter}"]
    with running_server(args) as srv:
        tokens = greedy(srv, "a")
    theirs, logits = merged_oracle(base, adapter).greedy(PROMPT, len(tokens))
    assert_greedy_equal(tokens, theirs, logits, "GPT-NeoX over two ranks")
