"""Tensor parallelism end to end: `pagewire serve -tp 2` with both ranks started by the engine,
and with rank 1 attached by hand over TCP (CURVE keys), gives transformers' greedy tokens on
tiny models of uneven shapes and on the default model; mismatched executors are refused with
the reason; a rank killed or stopped mid-step fails its requests cleanly and never hangs."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from pagewire.testing.server import (TWO_RANKS, Server, alive, child_pids, cmdline, free_port,
                                     running_server)
from tests.helpers import HFOracle, assert_greedy_equal, make_tiny_llama

pytestmark = pytest.mark.slow
F32 = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB"]
PROMPTS = [[5, 17, 300, 42, 7], [9] * 30, list(range(3, 60))]
# (hidden, heads, kv heads, head dim), vocab: rank shares of unequal size everywhere.
SHAPES = {"kv3-of-6-heads": ((96, 6, 3, 32), 511, True),     # KV heads split 2 + 1
          "kv1-below-ranks": ((256, 2, 1, 128), 509, False)}  # the one KV head replicated


@pytest.fixture(scope="module")
def models(tmp_path_factory, smol_tokenizer_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-models")
    return {name: make_tiny_llama(str(root / name), smol_tokenizer_dir, shape, vocab_size=vocab,
                                  tie=tie)
            for name, (shape, vocab, tie) in SHAPES.items()}


def greedy(srv: Server, prompt: list[int], n: int = 16) -> list[int]:
    code, reply, _ = srv.request("POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True})
    assert code == 200, reply
    return [int(t.removeprefix("token_id:")) for t in reply["choices"][0]["logprobs"]["tokens"]]


def assert_matches_transformers(srv: Server, path: str | HFOracle, prompts=PROMPTS) -> None:
    oracle = path if isinstance(path, HFOracle) else HFOracle.from_dir(path)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:   # batched together
        ours = list(pool.map(lambda p: greedy(srv, p), prompts))
    for prompt, tokens in zip(prompts, ours):
        theirs, logits = oracle.greedy(prompt, len(tokens))
        assert_greedy_equal(tokens, theirs, logits, f"prompt of {len(prompt)}")


def ranks(srv: Server) -> dict[str, int]:
    return {cmdline(p).removeprefix("pagewire: "): p for p in child_pids(srv.proc.pid)
            if alive(p) and "executor" in cmdline(p)}


def test_local_ranks_match_transformers(models):
    path = models["kv3-of-6-heads"]
    with running_server([path, *F32, *TWO_RANKS]) as srv:
        assert sorted(ranks(srv)) == ["executor 0", "executor 1"]
        assert_matches_transformers(srv, path)


@pytest.mark.parametrize("name, expert_parallel", [("qwen2-moe-shared", False),
                                                   ("qwen2-moe-shared", True), ("olmoe", False)])
def test_mixture_of_experts_ranks_match_transformers(tmp_path, smol_tokenizer_dir, name,
                                                     expert_parallel):
    """Qwen2-MoE (a shared expert, a dense layer among sparse ones) on two ranks: each holding
    a slice of every expert, or with --enable-expert-parallel three whole experts each. OLMoE:
    its q/k norms over every head, each rank's sums of squares all-reduced."""
    from tests.actors.test_architectures import make_model
    path = make_model(str(tmp_path / "moe"), smol_tokenizer_dir, name)
    extra = ["--enable-expert-parallel"] if expert_parallel else []
    with running_server([path, *F32, *TWO_RANKS, *extra]) as srv:
        assert_matches_transformers(srv, path)


@pytest.mark.parametrize("name", ["gpt-neox-parallel", "gpt2", "phi-2"])
def test_gpt_family_ranks_match_transformers(tmp_path, smol_tokenizer_dir, name):
    """LayerNorms, biased linears (a row-parallel one's bias added by rank 0 alone), GPT-2's
    learned positions after the vocab-parallel embedding's all-reduce; Phi-2's LM-head bias
    split with its vocabulary rows and its two KV heads one per rank."""
    from tests.actors.test_architectures import make_model
    path = make_model(str(tmp_path / name), smol_tokenizer_dir, name)
    with running_server([path, *F32, *TWO_RANKS]) as srv:
        assert_matches_transformers(srv, path)


def test_context_parallel_ranks_match_transformers(models):
    """-tp 2 -dcp 2: the one KV head, replicated on both ranks (each with one of the two
    query heads), has its tokens split over them (each holds 8 of a block's 16):
    transformers' greedy tokens, and twice the blocks in the same KV memory. (Plain -tp 2
    with a replicated KV head attends per rank as the kv3 model does; its head shares are
    tested in test_parallel.py.)"""
    import re
    from pagewire.config import EngineConfig
    path = models["kv1-below-ranks"]
    with running_server([path, *F32, *TWO_RANKS, "--decode-context-parallel-size", "2"]) as srv:
        assert_matches_transformers(srv, path)
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            blocks = int(re.search(r'num_gpu_blocks="(\d+)"', r.read().decode()).group(1))
    alone = EngineConfig.from_options(model=path, dtype="float32", max_model_len=256,
                                      kv_cache_memory=16 * 2**20, tensor_parallel_size=2).resolve()
    assert blocks == 2 * alone.cache.num_kv_blocks


def spec_counters(srv: Server, above: float = 0.0) -> tuple[float, float]:
    """(draft tokens, accepted tokens) from /metrics, once the scheduler has reported more
    than `above` draft tokens."""
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        values = [sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(name + "{"))
                  for name in ("vllm:spec_decode_num_draft_tokens_total",
                               "vllm:spec_decode_num_accepted_tokens_total")]
        if values[0] > above or time.monotonic() > deadline:
            return values[0], values[1]
        time.sleep(0.2)


def test_local_ranks_draft_with_a_draft_model(models):
    """The target as its own draft model, both split over two ranks: transformers' greedy
    tokens, and every draft accepted; sampled drafts too (drawn from the target's own
    distribution: kept), which every rank must take as rank 0 drew them."""
    path = models["kv3-of-6-heads"]
    spec = json.dumps({"method": "draft_model", "model": path, "max_batch": 8})
    with running_server([path, *F32, *TWO_RANKS, "--speculative-config", spec]) as srv:
        assert_matches_transformers(srv, path)
        drafted, accepted = spec_counters(srv)
        assert accepted == drafted > 0
        code, reply, _ = srv.request("POST", "/v1/completions", {
            "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 1.0, "n": 3,
            "ignore_eos": True})
        assert code == 200, reply
        assert [c["finish_reason"] for c in reply["choices"]] == ["length"] * 3
        more, kept = spec_counters(srv, above=drafted)
        assert kept - accepted == more - drafted > 0


def test_default_model_matches_transformers(default_hf_model):
    with running_server([*F32, *TWO_RANKS]) as srv:
        prompts = [[1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47], [504, 3458, 282] * 5]
        assert_matches_transformers(srv, HFOracle(default_hf_model), prompts)


# bfloat16 logits of this model's top tokens lie below 32 in magnitude: 1/8 is one rounding
# step there (1/16 below 16). Two logits that close are adjacent bfloat16 values, and the
# order in which the ranks' float32 partials were summed may pick either.
BF16_LOGIT_STEP = 1 / 8


def greedy_chat(srv: Server, question: str) -> list[dict]:
    """The greedy answer's tokens, each with its top two (token, logprob)."""
    code, reply, _ = srv.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": question}], "max_tokens": 20,
        "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2})
    assert code == 200, reply
    return reply["choices"][0]["logprobs"]["content"]


def test_bfloat16_ranks_answer_as_one_rank():
    """-tp 2 in bfloat16: the row-parallel partials are summed in float32 and rounded once,
    so the default model's chat answers (test_default_model's questions, one at a time) equal
    one rank's, but where one rank's own top two logits lie within a bfloat16 step (after
    which nothing more is compared). Summed in bfloat16 (before), on the avx512_bf16 tier the
    answer to the cooking question parted at its 17th token with one rank's top two two steps
    (0.25) apart; on the avx2 and avx512 tiers that sum parted five and three answers, each
    within a step, which this check lets pass: there it guards against larger errors only.
    Prefill runs on oneDNN's dense copy here (`--quantized-matmul-tokens 16`, the default
    before #43): with every step on the blocks, the cooking answer parts at its 14th token
    with one rank's top two 0.25 apart, which #43's note leaves open (the ranks' partials are
    float32 there too). The last four questions (the cooking one among them) keep the suite's
    time. Where the CPU multiplies bfloat16 only by emulation (no avx512_bf16), bfloat16 is
    not what a user serves (auto picks float32) and the check guards large errors only: it is
    skipped there for the suite's time."""
    from pagewire.kernels import tiers
    if "avx512_bf16" not in tiers.runnable():
        pytest.skip("bfloat16 is emulated on this CPU (no avx512_bf16)")
    from tests.actors.test_default_model import QUESTIONS
    QUESTIONS = QUESTIONS[4:]      # noqa: N806
    args = ["--dtype", "bfloat16", "--max-model-len", "512", "--kv-cache-memory", "64MiB",
            "--quantized-matmul-tokens", "16"]
    answers = {}
    for ranks in ([], TWO_RANKS):
        with running_server([*args, *ranks]) as srv:
            answers[bool(ranks)] = [greedy_chat(srv, q) for q in QUESTIONS]
    for question, one, two in zip(QUESTIONS, answers[False], answers[True]):
        assert len(one) == len(two) == 20, question
        for i, (a, b) in enumerate(zip(one, two)):
            if a["token"] == b["token"]:
                continue
            (t1, lp1), (t2, lp2) = [(t["token"], t["logprob"]) for t in a["top_logprobs"]]
            assert b["token"] in (t1, t2) and lp1 - lp2 <= BF16_LOGIT_STEP, (
                f"{question!r} parted at token {i}: one rank {a['token']!r}, two ranks "
                f"{b['token']!r}; one rank's top two {t1!r} {lp1:.4f}, {t2!r} {lp2:.4f}")
            break


def stream_until_error(srv: Server, kill) -> dict:
    """Start a long stream, call kill() once tokens flow; return the error event it ends
    with."""
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": 190, "n": 8, "temperature": 1.0, "seed": 1,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(srv.url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: "):
                events.append(line[6:].strip())
                if len(events) == 3:
                    kill()
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    return error["message"]


def test_local_rank_killed_mid_step_fails_requests_and_the_engine_recovers(models):
    path = models["kv3-of-6-heads"]
    with running_server([path, *F32, *TWO_RANKS]) as srv:
        victim = ranks(srv)["executor 1"]
        last = stream_until_error(srv, lambda: os.kill(victim, signal.SIGKILL))
        assert "executor" in last
        deadline = time.monotonic() + 90
        while not srv.healthy():
            assert time.monotonic() < deadline, "not healthy again"
            time.sleep(0.5)
        assert ranks(srv)["executor 1"] != victim
        assert_matches_transformers(srv, path, PROMPTS[:1])


def test_stopped_rank_fails_the_step_after_the_timeout(models):
    path = models["kv3-of-6-heads"]
    with running_server([path, *F32, *TWO_RANKS, "--tp-timeout", "3"]) as srv:
        victim = ranks(srv)["executor 1"]
        started = time.monotonic()
        try:
            last = stream_until_error(srv, lambda: os.kill(victim, signal.SIGSTOP))
        finally:
            os.kill(victim, signal.SIGCONT)
        assert "stopped answering" in last
        assert time.monotonic() - started < 30


# -- attached by hand --------------------------------------------------------------------------

@contextlib.contextmanager
def attached_executor(address: str, keys: str, *args: str):
    proc = subprocess.Popen([sys.executable, "-m", "pagewire.cli", "executor", "--attach",
                             address, "--rank", "1", "--curve-keys", keys, *args])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def refused(address: str, keys: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "pagewire.cli", "executor", "--attach",
                             address, "--curve-keys", keys, "--attach-timeout", "10", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[str, str]:
    """(good keys, a second set whose executor key the engine does not know)."""
    good, other = (str(tmp_path_factory.mktemp(n)) for n in ("keys", "other-keys"))
    for d in (good, other):
        subprocess.run([sys.executable, "-m", "pagewire.cli", "keys", d], check=True,
                       capture_output=True)
    shutil.copy(os.path.join(good, "engine.key"), other)      # the right engine, a wrong key
    return good, other


def test_attached_rank_matches_refuses_mismatches_and_recovers(models, keys):
    path = models["kv3-of-6-heads"]
    good, other = keys
    address = f"tcp://127.0.0.1:{free_port()}"
    serve = [path, *F32, *TWO_RANKS, "--executors", "external", "--listen", address,
             "--curve-keys", good, "--attach-timeout", "120"]
    with tempfile.TemporaryDirectory(dir="/tmp") as run_parent, \
            attached_executor(address, good, path) as executor:
        srv = Server(serve, run_parent)        # healthy only once rank 1 has attached
        try:
            assert sorted(ranks(srv)) == ["executor 0"]      # rank 1 is not the engine's child
            assert_matches_transformers(srv, path)
            attempts = {   # each refused at the handshake, whatever the others do: at once
                "refused this executor's CURVE key": (other, path, "--rank", "1"),
                "the executor has SmolLM2-135M-Instruct": (good, "--rank", "1"),
                "was started for 3": (good, path, "--rank", "1", "-tp", "3"),
                "rank 2 is outside 1..1": (good, path, "--rank", "2"),
                "rank 1 is already attached": (good, path, "--rank", "1")}
            with concurrent.futures.ThreadPoolExecutor(len(attempts)) as pool:
                errors = pool.map(lambda args: refused(address, *args), attempts.values())
                for reason, error in zip(attempts, errors):
                    assert reason in error, error
            last = stream_until_error(srv, executor.kill)    # killed mid-step
            assert "a rank left or stopped answering" in last
            assert srv.request("GET", "/health")[0] == 503
            with attached_executor(address, good, path):      # a new rank 1: serving again
                deadline = time.monotonic() + 90
                while not srv.healthy():
                    assert time.monotonic() < deadline, "not healthy after re-attaching"
                    time.sleep(0.5)
                assert_matches_transformers(srv, path, PROMPTS[:1])
        finally:
            srv.stop()
