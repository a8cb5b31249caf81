"""Helpers for driving the scheduler by hand in tests."""
from __future__ import annotations

from pagewire.config import EngineConfig
from pagewire.model_info import ModelInfo
from pagewire.scheduler.scheduler import Scheduler
from pagewire.wire.sampling import SamplingParams
from pagewire.wire.to_scheduler import NewRequest, StepResult

EOS = 2


def make_scheduler(num_blocks=16, block_size=4, budget=64, max_seqs=8, max_len=64, chunked=True,
                   window=None, **options):
    info = ModelInfo(path="/dev/null", format="hf", name="m", architecture="LlamaForCausalLM",
                     max_model_len=max_len, vocab_size=100, num_layers=1, num_kv_heads=1,
                     head_dim=8, eos_token_ids=[EOS], digest="0", sliding_window=window)
    config = EngineConfig(model_info=info, num_kv_blocks=num_blocks, block_size=block_size,
                          max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                          enable_chunked_prefill=chunked, **options).resolve()
    return Scheduler(config)


def new(rid, n_prompt, first=None, **sampling) -> NewRequest:
    """A request whose prompt is distinct per id (no accidental prefix hits) unless `first`
    (the first token id) is given."""
    sampling.setdefault("max_tokens", 100)
    first = 1000 * (1 + sum(map(ord, rid))) if first is None else first
    return NewRequest(req_id=rid, prompt_token_ids=list(range(first, first + n_prompt)),
                      sampling=SamplingParams(**sampling), arrival_time=0.0)


def step(sched: Scheduler, tokens: dict[str, int] | None = None, default=5):
    """schedule() then update() with `default` sampled for every request that samples."""
    plan = sched.schedule()
    assert plan is not None
    samplers = [r for r in sched.in_flight[plan.step_id] if r.num_computed + r.num_scheduled == len(r.token_ids)]
    ids = [r.req_id for r in samplers]
    toks = [(tokens or {}).get(rid, default) for rid in ids]
    result = StepResult(plan.step_id, ids, toks)
    if any(r.group is not None for r in samplers):   # beams get candidates tok, tok+1, ...
        k = [2 * r.group.width if r.group else 0 for r in samplers]
        result.top_ids = [[t + i for i in range(n)] for t, n in zip(toks, k)]
        result.top_logprobs = [[-1.0 - i for i in range(n)] for n in k]
        result.logprobs = [0.0] * len(ids)
    return plan, sched.update(plan, result)


def assert_pool_whole(sched: Scheduler) -> None:
    kv = sched.kv
    assert kv.num_free == kv.num_blocks
    assert not any(kv.refcount)
    assert sorted(kv.free_queue) == list(range(kv.num_blocks))
    assert all(kv.hash_of[b] == h for h, b in kv.cached.items())
    host = sched.tables.host
    assert host is None or (host.num_free == host.num_blocks and not any(host.refcount))


