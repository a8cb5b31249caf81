"""Sleep mode and weight updates through the offline LLM (the scheduler core, the step engine
and the executor's runner, as served): the same greedy tokens after waking from either level,
the KV pool's memory given back while asleep, new weights giving their checkpoint's
transformers tokens, every hostile call answered cleanly, and the pool's blocks all free and
uncached after each control. The CUDA path's weight parking runs here on the CPU (the torch
reference backend) for its logic, and for real under the gpu marker."""
from __future__ import annotations

import asyncio
import os
import tempfile

import psutil
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from pagewire import LLM, SamplingParams
from pagewire.config import EngineConfig
from pagewire.executor.sleep_mode import model_tensors, park, restore
from pagewire.wire.channels import ipc_address
from pagewire.wire.engine_control import ControlDone, SleepEngine, WakeEngine
from tests.helpers import HFOracle, assert_greedy_equal, make_tiny_llama

PROMPT = [1, 5, 9, 33, 47, 101, 7]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
POOL = 128 * 2**20     # the KV pool's bytes


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smol_tokenizer_dir):
    """One engine for the module, on checkpoint "a"; every test leaves it awake on "a". The
    KV pool on ordinary pages (PAGEWIRE_HUGE_PAGES=0: zeroed, so resident, at allocation)
    makes its memory measurable."""
    root = tmp_path_factory.mktemp("sleep")
    paths = {name: make_tiny_llama(str(root / name), smol_tokenizer_dir, seed=seed, **kw)
             for name, seed, kw in (("a", 0, {}), ("b", 1, {}),
                                    ("heads", 2, {"shape": "mha-d64"}))}
    old = os.environ.get("PAGEWIRE_HUGE_PAGES")
    os.environ["PAGEWIRE_HUGE_PAGES"] = "0"
    try:
        llm = LLM(paths["a"], enable_sleep_mode=True, kv_cache_memory=POOL, max_model_len=512,
                  dtype="float32")
        yield llm, paths, greedy(llm)
    finally:
        if old is None:
            os.environ.pop("PAGEWIRE_HUGE_PAGES")
        else:
            os.environ["PAGEWIRE_HUGE_PAGES"] = old


def greedy(llm: LLM) -> list[int]:
    out = llm.generate([PROMPT], GREEDY)[0].outputs[0]
    assert out.finish_reason == "length", out
    return out.token_ids


def assert_pool_clear(llm: LLM) -> None:
    """Every block free, nothing cached, no request, no executor sequence left."""
    kv = llm.scheduler.kv
    assert (kv.num_free, kv.cached, llm.scheduler.requests) == (kv.num_blocks, {}, {})
    assert llm.runner.table.seqs == {}


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_pool_and_wakes_to_the_same_greedy_tokens(engine, level):
    llm, _, tokens = engine
    rss = psutil.Process().memory_info().rss
    assert llm.sleep(level) == ["weights", "kv_cache"] and llm.is_sleeping()
    freed = rss - psutil.Process().memory_info().rss
    assert freed >= 0.9 * POOL, f"{freed >> 20} MiB freed of a {POOL >> 20} MiB pool"
    assert llm.runner.kv_caches == [] and (llm.runner.model is None) == (level == 2)
    assert_pool_clear(llm)
    refused = llm.generate([PROMPT], GREEDY)[0].outputs[0]      # asleep: refused, as a 503
    assert (refused.finish_reason, refused.token_ids) == ("rejected", [])
    assert llm.wake_up() == [] and not llm.is_sleeping()
    assert greedy(llm) == tokens


def test_requests_in_flight_are_aborted_or_finished_first(engine):
    llm, _, tokens = engine
    llm.add_request(PROMPT, GREEDY)
    llm.step()
    llm.step()                                 # prefilled and decoding
    llm.sleep(1)                               # mode abort (vLLM's default)
    (ended,) = llm.step()                      # its final output, already delivered
    assert ended.outputs[0].finish_reason == "abort" and len(ended.outputs[0].token_ids) < 12
    assert_pool_clear(llm)
    llm.wake_up()
    req_id = llm.add_request(PROMPT, GREEDY)
    llm.step()
    llm.sleep(2, mode="wait")                  # runs it to its end first
    (done,) = llm.step()
    assert (done.request_id, done.outputs[0].token_ids) == (req_id, tokens)
    assert_pool_clear(llm)
    llm.wake_up()
    assert greedy(llm) == tokens


def test_hostile_calls_are_answered_and_change_nothing(engine):
    llm, paths, tokens = engine
    assert llm.wake_up() == []                                   # awake already: a no-op
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(3)
    with pytest.raises(ValueError, match="tags are weights and kv_cache"):
        llm.wake_up(["everything"])
    with pytest.raises(ValueError, match="cannot read weights at /nowhere"):
        llm.update_weights("/nowhere")
    with pytest.raises(ValueError, match="num_heads 2 .served: 4."):
        llm.update_weights(paths["heads"])
    assert greedy(llm) == tokens                                 # the old weights serve on
    llm.sleep(2)
    assert llm.sleep(1) == ["weights", "kv_cache"]               # asleep already: a no-op
    with pytest.raises(ValueError, match="wake the weights first"):
        llm.wake_up(["kv_cache"])
    assert llm.wake_up(["weights"]) == ["kv_cache"] and llm.is_sleeping()
    assert llm.wake_up(["kv_cache"]) == []
    assert_pool_clear(llm)
    assert greedy(llm) == tokens


def test_one_control_at_a_time(engine):
    """A second control while one is pending is answered 409 at once; the first runs on."""
    llm, _, tokens = engine
    eng = llm.engine
    assert eng.handle(SleepEngine(req_id="first", level=1)) == []
    [(to, busy)] = eng.handle(WakeEngine(req_id="second"))
    assert (to, busy.req_id, busy.status) == ("gateway", "second", 409)
    assert isinstance(eng.plan(), SleepEngine) and eng.plan() is None    # sent, in flight
    [(to, done)] = eng.handle(eng.next_result())
    assert (to, done.req_id, done.status, done.asleep) == \
        ("gateway", "first", 200, ["weights", "kv_cache"])
    llm.wake_up()
    assert greedy(llm) == tokens


def test_new_weights_give_their_checkpoints_transformers_tokens(engine):
    llm, paths, tokens = engine
    llm.generate([PROMPT], GREEDY)                  # blocks cached under the old weights
    assert llm.update_weights(paths["b"]) == []
    assert_pool_clear(llm)                          # ...are forgotten
    theirs, logits = HFOracle.from_dir(paths["b"]).greedy(PROMPT, 12)
    ours = greedy(llm)
    assert_greedy_equal(ours, theirs, logits, "after the update")
    assert ours != tokens
    llm.sleep(2)                                    # RL's order: drop, load new, wake the pool
    assert llm.update_weights(paths["a"]) == ["kv_cache"]
    llm.wake_up()
    assert greedy(llm) == tokens


def test_parked_weights_come_back_whole(smol_tokenizer_dir, tmp_path):
    """The CUDA path's park/restore (pinned host copies, device memory released, each tensor
    object kept) run on the CPU over the torch reference backend, which keeps weights as
    loaded (a native CPU backend's address tables would not survive a move)."""
    llm = LLM(make_tiny_llama(str(tmp_path / "m"), smol_tokenizer_dir), kernels="torch",
              kv_cache_memory=8 * 2**20, max_model_len=512, dtype="float32")
    tokens = greedy(llm)
    tensors = model_tensors(llm.runner.model)
    held = [t for t in tensors if t.numel()]
    parked = park(llm.runner.model, pin=False, every=True)
    assert [t for t, _ in parked] == held and len(held) > 10
    assert all(t.numel() == 0 for t in tensors)
    restore(parked)
    assert greedy(llm) == tokens


def test_sleep_mode_refuses_what_it_cannot_rebuild(engine, tmp_path):
    _, paths, _ = engine
    with pytest.raises(ValueError, match="--enable-sleep-mode with --kv-offload-dir"):
        EngineConfig.from_options(model=paths["a"], enable_sleep_mode=True, max_model_len=256,
                                  kv_offload_dir=str(tmp_path)).resolve()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_level_one_on_cuda_moves_the_weights_to_host_memory(smol_tokenizer_dir, tmp_path):
    llm = LLM(make_tiny_llama(str(tmp_path / "m"), smol_tokenizer_dir), device="cuda",
              enable_sleep_mode=True, kv_cache_memory=64 * 2**20, max_model_len=512,
              dtype="float32")
    tokens = greedy(llm)
    held = torch.cuda.memory_allocated()
    llm.sleep(1)
    assert held - torch.cuda.memory_allocated() >= 0.95 * 64 * 2**20
    assert all(t.numel() == 0 for t in model_tensors(llm.runner.model) if t.is_cuda)
    assert all(host.is_pinned() for _, host in llm.runner.sleep.parked)
    llm.wake_up()
    assert greedy(llm) == tokens


class FakeScheduler:
    """Answers each control at once as the engine would; records what it was sent."""

    def __init__(self, gateway):
        self.gateway, self.sent = gateway, []

    def send(self, msg) -> None:
        self.sent.append(msg)
        asleep = ["weights", "kv_cache"] if isinstance(msg, SleepEngine) else []
        done = ControlDone(req_id=msg.req_id, asleep=asleep)
        asyncio.get_running_loop().call_soon(self.gateway.routes[msg.req_id].put_nowait, done)


def test_the_routes_over_a_fake_engine(engine):
    """Off without the flag (404), behind the API key, the sleeping gateway's 503 for
    generation while /tokenize is still served, and the controls' wire messages."""
    from pagewire.gateway.server import Gateway
    _, paths, _ = engine

    async def main(check, **options):
        with tempfile.TemporaryDirectory(dir="/tmp") as run_dir:
            config = EngineConfig.from_options(model=paths["a"], max_model_len=256,
                                               run_dir=run_dir, **options).resolve()
            gateway = Gateway(config, lambda name: ipc_address(run_dir, name))
            gateway.scheduler = FakeScheduler(gateway)
            async with TestClient(TestServer(gateway.app)) as client:
                await check(client, gateway)

    async def off(client, gateway):
        for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/update_weights")):
            r = await client.request(method, path)
            assert r.status == 404 and "--enable-sleep-mode" in (await r.text())

    async def on(client, gateway):
        key = {"Authorization": "Bearer k"}
        assert (await client.post("/sleep")).status == 401
        r = await client.post("/sleep?level=2&mode=wait", headers=key)
        assert (r.status, await r.json()) == (200, {"is_sleeping": True, "aborted_requests": 0,
                                                    "asleep": ["weights", "kv_cache"]})
        assert (await (await client.get("/is_sleeping", headers=key)).json()) == \
            {"is_sleeping": True}
        r = await client.post("/v1/completions", json={"prompt": "hi"}, headers=key)
        assert r.status == 503 and "sleeping" in (await r.json())["error"]["message"]
        r = await client.post("/wake_up?tags=kv_cache&tags=soul", headers=key)
        assert r.status == 400 and "soul" in (await r.text())
        r = await client.post("/update_weights", json={"path": paths["heads"]}, headers=key)
        assert r.status == 400 and "num_heads" in (await r.text())
        r = await client.post("/update_weights", json={"model_path": paths["b"],
                                                       "abort_all_requests": True}, headers=key)
        assert r.status == 200 and (await r.json())["success"]
        assert [type(m).__name__ for m in gateway.scheduler.sent] == \
            ["SleepEngine", "UpdateWeights"]
        sleep, update = gateway.scheduler.sent
        assert (sleep.level, sleep.mode, update.path, update.mode) == \
            (2, "wait", paths["b"], "abort")

    asyncio.run(main(off))
    asyncio.run(main(on, enable_sleep_mode=True, api_keys=["k"]))
