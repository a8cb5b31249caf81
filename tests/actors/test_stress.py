"""Hundreds of requests with shared prefixes, aborts, n > 1 and a KV pool small enough to
force preemption: no block leaks, and every finished request's tokens equal the same
request run alone."""
from __future__ import annotations

import random

import pytest

from pagewire import LLM, SamplingParams
from tests.helpers import make_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory, smol_tokenizer_dir):
    return make_tiny_llama(str(tmp_path_factory.mktemp("m")), smol_tokenizer_dir, "gqa2-d64",
                           max_position=512)


def workload(seed: int, count: int):
    rng = random.Random(seed)
    families = [[rng.randrange(3, 512) for _ in range(24)] for _ in range(4)]
    requests = []
    for i in range(count):
        prompt = rng.choice(families)[: rng.randrange(8, 25)] + \
            [rng.randrange(3, 512) for _ in range(rng.randrange(0, 20))]
        kind = rng.random()
        common = dict(max_tokens=rng.randrange(4, 20), ignore_eos=True)
        if kind < 0.5:
            params = SamplingParams(temperature=0, **common)
        elif kind < 0.85:
            params = SamplingParams(temperature=1.0, seed=i, **common)
        else:
            params = SamplingParams(n=2, temperature=1.0, seed=i, **common)
        requests.append((prompt, params))
    return requests


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_stress_no_leaks_and_outputs_equal_alone(model, mode):
    requests = workload(seed=11, count=200)
    engine = LLM(model, dtype="float32", block_size=4, num_kv_blocks=96, max_model_len=64,
                 max_num_seqs=24, max_num_batched_tokens=64, preemption_mode=mode,
                 swap_space=(1 << 20) if mode == "swap" else 0)
    rng = random.Random(5)
    ids, done, aborted, pending = {}, {}, set(), list(range(len(requests)))
    while pending or engine.has_unfinished():
        for _ in range(min(len(pending), rng.randrange(0, 12))):
            i = pending.pop(0)
            ids[engine.add_request(requests[i][0], requests[i][1])] = i
        if rng.random() < 0.15 and engine.has_unfinished():
            victim = rng.choice(sorted(engine._live))
            engine.abort(victim)
            aborted.add(victim)
        if engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step())
    sched = engine.scheduler
    assert sched.num_preemptions > 10
    assert sched.tables.prefix_hits > 0
    kv = sched.kv
    assert kv.num_free == kv.num_blocks and not any(kv.refcount)
    assert not sched.requests and not sched.waiting and not sched.running
    assert not engine.detokenizer.live and not engine.detokenizer.early
    assert len(done) + len(aborted) == len(requests) and len(aborted) >= 5

    alone = LLM(model, dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=64,
                enable_prefix_caching=False)
    for rid, out in done.items():
        prompt, params = requests[ids[rid]]
        (ref,) = alone.generate([{"prompt_token_ids": prompt}], params)
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs], rid
