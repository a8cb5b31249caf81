"""Streaming input (a prompt that arrives in pieces): each piece is prefilled as it comes and
its KV kept, generation starts after the last piece with the greedy tokens of the whole
prompt, no prompt token is computed twice, and an aborted session frees every block."""
from __future__ import annotations

import asyncio
import random

import pytest

from pagewire import LLM, SamplingParams, StreamingInput

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smol_tokenizer_dir) -> str:
    from tests.helpers import make_tiny_llama
    return make_tiny_llama(str(tmp_path_factory.mktemp("stream") / "m"), smol_tokenizer_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", num_kv_blocks=128, max_model_len=256)


def _computed(llm) -> list[int]:
    """Every step's computed tokens per sequence, recorded from the plans the executor runs."""
    seen = []
    real = llm.runner.execute

    def execute(plan):
        seen.extend((e.seq_id.req, e.num_scheduled) for e in plan.new + plan.running)
        return real(plan)
    llm.runner.execute = execute
    return seen


async def _pieces(parts, gaps: list[asyncio.Event] | None = None):
    for i, part in enumerate(parts):
        if gaps:                        # wait until the engine has run the pieces before
            await asyncio.sleep(0.05)
        yield StreamingInput(part) if i % 2 else part


@pytest.mark.parametrize("cuts", [[20], [1, 17, 18, 40], [5, 6, 7, 8, 9, 33]])
def test_a_prompt_in_pieces_generates_as_the_whole_prompt(llm, model_dir, cuts):
    """Transformers' greedy tokens on the whole prompt; each prompt token computed once (a
    fresh random prompt: no prefix-cache hits), then one a generated token."""
    from tests.helpers import HFOracle, assert_greedy_equal
    rng = random.Random(len(cuts))
    prompt = [rng.randrange(3, 512) for _ in range(45)]
    bounds = [0, *cuts, len(prompt)]
    parts = [prompt[a:b] for a, b in zip(bounds, bounds[1:])]
    seen = _computed(llm)
    out = asyncio.run(llm.generate_streaming(_pieces(parts, gaps=[]), PARAMS))
    theirs, logits = HFOracle.from_dir(model_dir).greedy(prompt, 8)
    assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"cuts {cuts}")
    assert out.prompt_token_ids == parts[0]
    assert sum(n for req, n in seen if req == out.request_id) == len(prompt) + 8 - 1
    llm.runner.execute = type(llm.runner).execute.__get__(llm.runner)


def test_pieces_are_prefilled_as_they_arrive_and_abort_frees_everything(llm):
    rng = random.Random(9)
    prompt = [rng.randrange(3, 512) for _ in range(100)]
    free = llm.scheduler.kv.num_free
    seen = _computed(llm)
    gate = asyncio.Event()

    async def pieces():
        yield prompt[:40]
        await asyncio.sleep(0.1)         # the engine prefills what it has meanwhile
        yield prompt[40:90]
        await gate.wait()                # never set: the session is cancelled here

    async def main():
        task = asyncio.ensure_future(llm.generate_streaming(pieces(), PARAMS))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    steps = [n for _, n in seen]
    # 39 of the first piece (its last token waits for more), then the rest of the 90 but one
    assert steps[:2] == [39, 50]
    assert llm.scheduler.requests == {}
    assert llm.scheduler.kv.num_free == free
    llm.runner.execute = type(llm.runner).execute.__get__(llm.runner)


def test_a_streamed_prompt_refuses_n_above_one(llm):
    async def pieces():
        yield [5, 6, 7]
    with pytest.raises(ValueError, match="streamed prompt takes n = 1"):
        asyncio.run(llm.generate_streaming(pieces(), SamplingParams(n=2)))
