"""The engine's sample(): greedy, bans, logits processors, SamplingParams -> SamplingTensors,
seeded reproducibility and the generator use replays depend on, and, through the whole path,
that the cuts hold and random rows draw from softmax(logits / temperature). The kernels' cuts
and draw are asserted exactly in tests/kernels/test_sampling.py."""
from __future__ import annotations

import msgspec
import pytest
import torch

from pagewire.executor.sampler import SamplingBatch, _uniforms, sample, sampling_tensors
from pagewire.wire import SamplingParams

V = 8
# A fixed, clearly ordered distribution over V tokens (descending in a shuffled order).
LOGITS = torch.tensor([0.3, 2.0, -1.0, 1.1, 0.0, -0.4, 1.6, 0.7])


@pytest.fixture(autouse=True)
def _fixed_global_rng():
    torch.manual_seed(20240601)   # unseeded rows draw from torch's global generator


def _draw(logits_row: torch.Tensor, params: SamplingParams, n: int,
          index: list[int] | None = None, banned: list[int] | None = None) -> torch.Tensor:
    """n independent draws: n rows holding the same logits and parameters."""
    logits = logits_row.unsqueeze(0).repeat(n, 1)
    batch = SamplingBatch([params] * n, index if index is not None else [0] * n,
                          [list(banned or [])] * n)
    out = sample(logits, batch)
    assert out.shape == (n,) and out.dtype == torch.int64
    return out


def _tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(samples, minlength=len(probs)).double() / len(samples)
    return 0.5 * float((freq - probs.double()).abs().sum())


def test_greedy_rows_return_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=g)
    expected = logits.argmax(-1)
    params = [SamplingParams(temperature=0.0)] * 16
    assert torch.equal(sample(logits.clone(), SamplingBatch(params, [0] * 16, [[]] * 16)), expected)


def test_greedy_rows_return_argmax_in_a_mixed_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 50, generator=g)
    params = [SamplingParams(temperature=0.0 if r % 2 else 1.5, top_k=5, top_p=0.5, min_p=0.3)
              for r in range(10)]
    out = sample(logits.clone(), SamplingBatch(params, list(range(10)), [[]] * 10))
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))


def test_banned_tokens_are_never_chosen():
    top = int(LOGITS.argmax())
    second = int(LOGITS.topk(2).indices[1])
    greedy = _draw(LOGITS, SamplingParams(temperature=0.0), 4, banned=[top])
    assert greedy.tolist() == [second] * 4
    banned = [top, second, 3]
    drawn = _draw(LOGITS, SamplingParams(temperature=3.0), 4000, banned=banned)
    assert not set(drawn.tolist()) & set(banned)
    assert set(drawn.tolist()) == set(range(V)) - set(banned)


def test_per_row_bans_apply_to_their_own_row_only():
    logits = LOGITS.unsqueeze(0).repeat(3, 1)
    top = int(LOGITS.argmax())
    out = sample(logits, SamplingBatch([SamplingParams(temperature=0.0)] * 3, [0, 0, 0],
                                       [[], [top], []]))
    assert out.tolist()[0] == out.tolist()[2] == top and out.tolist()[1] != top


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=100.0, top_k=1),
    SamplingParams(temperature=100.0, top_p=1e-6),
    SamplingParams(temperature=5.0, min_p=1.0),
], ids=["top_k=1", "top_p=1e-6", "min_p=1"])
def test_cuts_that_leave_one_token_equal_argmax(params):
    assert set(_draw(LOGITS, params, 2000).tolist()) == {int(LOGITS.argmax())}


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_never_leaves_the_top_k(k):
    allowed = set(LOGITS.topk(k).indices.tolist())
    drawn = _draw(LOGITS, SamplingParams(temperature=10.0, top_k=k), 5000)
    assert set(drawn.tolist()) == allowed
    probs = torch.zeros(V)
    probs[list(allowed)] = torch.softmax(LOGITS[list(allowed)] / 10.0, -1)
    assert _tv(drawn, probs) < 0.05


def test_top_k_at_or_above_vocab_and_minus_one_cut_nothing():
    for k in (-1, 0, V, V + 10):
        assert set(_draw(LOGITS, SamplingParams(temperature=5.0, top_k=k), 3000).tolist()) \
            == set(range(V))


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    drawn = _draw(logits, SamplingParams(top_p=0.7), 6000)   # 0.5 < 0.7 <= 0.8: two tokens
    assert set(drawn.tolist()) == {0, 1}
    assert _tv(drawn, torch.tensor([0.625, 0.375, 0.0, 0.0])) < 0.04


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    drawn = _draw(logits, SamplingParams(min_p=0.4), 6000)   # threshold 0.2
    assert set(drawn.tolist()) == {0, 1}
    assert _tv(drawn, torch.tensor([0.625, 0.375, 0.0, 0.0])) < 0.04


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_unseeded_draws_follow_softmax_over_temperature(temperature):
    drawn = _draw(LOGITS, SamplingParams(temperature=temperature), 20000)
    assert _tv(drawn, torch.softmax(LOGITS / temperature, -1)) < 0.025


def test_seeded_draws_over_output_indexes_follow_softmax():
    n = 6000
    drawn = _draw(LOGITS, SamplingParams(temperature=0.8, seed=7), n, index=list(range(n)))
    assert _tv(drawn, torch.softmax(LOGITS / 0.8, -1)) < 0.03


def _seeded_tokens(seed: int, indexes: list[int], others: int, seeded_first: bool,
                   noise_seed: int) -> list[int]:
    """The tokens a seeded row draws at each output index, batched with `others` unseeded rows
    of different logits and parameters."""
    g = torch.Generator().manual_seed(noise_seed)
    torch.manual_seed(noise_seed)
    mine = SamplingParams(temperature=1.0, seed=seed)
    flat = torch.zeros(64)                       # uniform: the noise alone decides
    tokens = []
    for index in indexes:
        rows = [(flat, mine, index)]
        for j in range(others):
            rows.append((torch.randn(64, generator=g),
                         SamplingParams(temperature=0.5 + j, top_k=j, seed=None if j % 2 else j),
                         int(torch.randint(0, 100, (1,), generator=g))))
        if not seeded_first:
            rows.reverse()
        logits = torch.stack([r[0] for r in rows])
        out = sample(logits, SamplingBatch([r[1] for r in rows], [r[2] for r in rows],
                                           [[] for _ in rows]))
        tokens.append(int(out[0 if seeded_first else -1]))
    return tokens


def test_seeded_row_is_reproducible_whatever_shares_the_batch():
    indexes = list(range(40))
    alone = _seeded_tokens(42, indexes, others=0, seeded_first=True, noise_seed=0)
    assert alone == _seeded_tokens(42, indexes, others=0, seeded_first=True, noise_seed=99)
    assert alone == _seeded_tokens(42, indexes, others=3, seeded_first=True, noise_seed=1)
    assert alone == _seeded_tokens(42, indexes, others=5, seeded_first=False, noise_seed=2)
    assert len(set(alone)) > 20                  # output indexes draw differently
    assert alone != _seeded_tokens(43, indexes, others=0, seeded_first=True, noise_seed=0)


def test_seeded_draw_depends_only_on_seed_and_output_index():
    params = SamplingParams(temperature=1.0, seed=2**62 + 5)
    logits = torch.zeros(64)
    a = _draw(logits, params, 1, index=[17])
    b = _draw(logits, params, 3, index=[17, 17, 17])
    assert b.tolist() == [int(a)] * 3


def test_all_greedy_batch_property():
    assert SamplingBatch([SamplingParams(temperature=0.0)] * 2, [0, 0], [[], []]).all_greedy
    assert not SamplingBatch([SamplingParams(temperature=0.0), SamplingParams()], [0, 0],
                             [[], []]).all_greedy


def test_sampling_tensors_carry_each_rows_parameters():
    params = [SamplingParams(temperature=0.0, top_k=-1), SamplingParams(temperature=0.7, top_k=5,
                                                                          top_p=0.9, min_p=0.1)]
    t = sampling_tensors(params)
    assert t.temperature.tolist() == pytest.approx([0.0, 0.7])
    assert t.top_k.tolist() == [-1, 5] and t.top_k.dtype == torch.int64
    assert t.top_p.tolist() == pytest.approx([1.0, 0.9])
    assert t.min_p.tolist() == pytest.approx([0.0, 0.1])
    assert t.greedy.tolist() == [True, False]
    assert all(x.device.type == "cpu" for x in (t.temperature, t.top_k, t.top_p, t.min_p))


# ---- replays: the seeding scheme and the global generator's use ------------------------------

def test_seeded_uniform_is_the_scheme_replays_depend_on():
    """A seeded row's uniform is 1 - rand(1) from a generator seeded by seed ^ ((index + 1) *
    0x9E3779B97F4A7C15), truncated to 63 bits: recorded traces replay only while it stays so."""
    seed, index = 2**62 + 12345, 17
    gen = torch.Generator().manual_seed((seed ^ ((index + 1) * 0x9E3779B97F4A7C15)) & (2**63 - 1))
    expected = 1.0 - torch.rand(1, generator=gen)
    batch = SamplingBatch([SamplingParams(), SamplingParams(seed=seed)], [0, index], [[], []])
    u = _uniforms(batch, torch.device("cpu"))
    assert u.shape == (2, 1) and float(u[1, 0]) == float(expected)


def test_global_generator_use_is_one_call_per_random_step_and_none_when_all_greedy():
    """Unseeded draws replay from --seed only while each step uses torch's generator the same
    way: one rand((S, 1)) when a row samples at random, nothing when every row is greedy."""
    start = torch.get_rng_state()
    sample(LOGITS.unsqueeze(0).repeat(3, 1), SamplingBatch([SamplingParams(temperature=0.0)] * 3,
                                                           [0] * 3, [[]] * 3))
    assert torch.equal(torch.get_rng_state(), start)
    mixed = [SamplingParams(temperature=0.0), SamplingParams(seed=3), SamplingParams(top_k=2)]
    sample(LOGITS.unsqueeze(0).repeat(3, 1), SamplingBatch(mixed, [0] * 3, [[]] * 3))
    after = torch.get_rng_state()
    torch.set_rng_state(start)
    torch.rand((3, 1))
    assert torch.equal(after, torch.get_rng_state())


# ---- logits processors: applied before the kernels' sampler, asserted on greedy rows ---------
# LOGITS' top tokens: 1 (2.0), 6 (1.6), 3 (1.1).

def _greedy(params: SamplingParams, tokens: list[int] = (), num_prompt: int = 0,
            logits_row: torch.Tensor = LOGITS) -> int:
    """The greedy token of one row whose history is tokens (the first num_prompt of them the
    prompt)."""
    params = msgspec.structs.replace(params, temperature=0.0)
    tokens = list(tokens)
    batch = SamplingBatch([params], [len(tokens) - num_prompt], [[]], [(tokens, num_prompt)])
    return int(sample(logits_row.unsqueeze(0).clone(), batch)[0])


def test_logit_bias_adds_to_the_logits():
    assert _greedy(SamplingParams(logit_bias={4: 2.5})) == 4           # 0.0 + 2.5 > 2.0
    assert _greedy(SamplingParams(logit_bias={4: 1.9})) == 1           # 1.9 < 2.0
    assert _greedy(SamplingParams(logit_bias={1: -1.0})) == 6          # 1.0 < 1.6


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    assert _greedy(SamplingParams(repetition_penalty=2.0), [1], 1) == 6     # prompt counts
    assert _greedy(SamplingParams(repetition_penalty=1.2), [1], 1) == 1     # 1.67 > 1.6
    negative = torch.tensor([-1.0, -1.1])
    assert _greedy(SamplingParams(repetition_penalty=2.0), [0], 1, negative) == 1


def test_frequency_penalty_counts_each_generated_occurrence():
    p = SamplingParams(frequency_penalty=0.25)
    assert _greedy(p, [1, 1], 2) == 1                  # the prompt's tokens do not count
    assert _greedy(p, [1], 0) == 1                     # 2.0 - 0.25 > 1.6
    assert _greedy(p, [1, 1], 0) == 6                  # 2.0 - 0.5 < 1.6


def test_presence_penalty_applies_once_per_generated_token():
    p = SamplingParams(presence_penalty=0.5)
    assert _greedy(p, [1], 1) == 1
    assert _greedy(p, [1], 0) == 6                     # 1.5 < 1.6
    assert _greedy(SamplingParams(presence_penalty=0.3), [1, 1, 1], 0) == 1   # 1.7: once


def test_allowed_token_ids_are_the_only_candidates():
    assert _greedy(SamplingParams(allowed_token_ids=[0, 4, 5])) == 0
    drawn = sample(LOGITS.unsqueeze(0).repeat(2000, 1),
                   SamplingBatch([SamplingParams(temperature=5.0, allowed_token_ids=[0, 4, 5])]
                                 * 2000, [0] * 2000, [[]] * 2000, [([], 0)] * 2000))
    assert set(drawn.tolist()) == {0, 4, 5}


def test_bad_words_are_never_completed():
    assert _greedy(SamplingParams(bad_words_ids=[[1]])) == 6
    assert _greedy(SamplingParams(bad_words_ids=[[3, 1]]), [7, 3], 1) == 6   # 3 generated last
    assert _greedy(SamplingParams(bad_words_ids=[[3, 1]]), [7, 2], 1) == 1
    assert _greedy(SamplingParams(bad_words_ids=[[3, 1]]), [3], 1) == 1      # 3 is the prompt's
