"""The kernels' sampler (pagewire.kernels.token_sampling): exactly which tokens each cut keeps, and
which token the inverse-CDF draw picks for a given uniform, so every outcome is asserted
exactly; the native draw against the search where the CPU has it."""
from __future__ import annotations

import pytest
import torch

from pagewire.kernels.token_sampling import (SamplingTensors, draw, draw_by_search,
                                       rejection_sample, sample, sampling_logits)

# A fixed, clearly ordered distribution over 8 tokens (descending in a shuffled order).
LOGITS = torch.tensor([0.3, 2.0, -1.0, 1.1, 0.0, -0.4, 1.6, 0.7])
V = len(LOGITS)
# Four tokens of known probability, most likely first.
QUARTET = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


def params(rows: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
           greedy=False) -> SamplingTensors:
    """Per-row tensors; each argument is one value for every row or a list of per-row values."""
    def column(value, dtype):
        values = value if isinstance(value, list) else [value] * rows
        assert len(values) == rows
        return torch.tensor(values, dtype=dtype)
    return SamplingTensors(column(temperature, torch.float32), column(top_k, torch.int64),
                           column(top_p, torch.float32), column(min_p, torch.float32),
                           column(greedy, torch.bool))


def rows_of(logits_row: torch.Tensor, n: int) -> torch.Tensor:
    return logits_row.unsqueeze(0).repeat(n, 1)


def kept(logits_row: torch.Tensor, **row_params) -> set[int]:
    """The tokens one row keeps after temperature and the cuts."""
    out = sampling_logits(logits_row.unsqueeze(0).clone(), params(1, **row_params))
    return set(out[0].isfinite().nonzero().flatten().tolist())


def midpoints(probs: torch.Tensor) -> torch.Tensor:
    """[V] float32 uniforms, the middle of each token's interval of the cumulative distribution:
    the draw must return token i for the i-th (rounding cannot move a midpoint across)."""
    cdf = probs.double().cumsum(0)
    return ((cdf - probs.double() / 2) / cdf[-1]).float()


# ---- temperature -----------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_draw_follows_softmax_over_temperature(temperature):
    probs = torch.softmax(LOGITS.double() / temperature, -1)
    u = midpoints(probs)
    out = sample(rows_of(LOGITS, V), params(V, temperature=temperature), u)
    assert out.tolist() == list(range(V))


def test_temperature_moves_the_draw():
    """The midpoints at temperature 3 drawn at temperature 1 land elsewhere: the test above
    can tell a temperature that was not applied."""
    u = midpoints(torch.softmax(LOGITS.double() / 3.0, -1))
    assert sample(rows_of(LOGITS, V), params(V), u).tolist() != list(range(V))


def test_temperature_one_without_cuts_returns_the_logits_untouched():
    logits = rows_of(LOGITS, 3)
    out = sampling_logits(logits, params(3))
    assert out is logits and torch.equal(out, rows_of(LOGITS, 3))


def test_each_row_has_its_own_temperature():
    temperatures = [0.5, 1.0, 2.0, 4.0]
    out = sampling_logits(rows_of(LOGITS, 4), params(4, temperature=temperatures))
    for row, t in enumerate(temperatures):
        torch.testing.assert_close(out[row], LOGITS / t, rtol=0, atol=0)


# ---- top-k -----------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3, V - 1])
def test_top_k_keeps_exactly_the_k_most_likely(k):
    assert kept(LOGITS, top_k=k) == set(LOGITS.topk(k).indices.tolist())
    u = torch.linspace(0.001, 1.0, 400)
    drawn = sample(rows_of(LOGITS, 400), params(400, temperature=5.0, top_k=k), u)
    assert set(drawn.tolist()) == set(LOGITS.topk(k).indices.tolist())


@pytest.mark.parametrize("k", [-1, 0, V, V + 3])
def test_top_k_off_at_zero_negative_or_vocab(k):
    assert kept(LOGITS, top_k=k) == set(range(V))


def test_top_k_leaves_the_kept_logits_unchanged():
    out = sampling_logits(rows_of(LOGITS, 1), params(1, top_k=3))[0]
    top = LOGITS.topk(3).indices
    assert torch.equal(out[top], LOGITS[top])


# ---- top-p -----------------------------------------------------------------------------------

@pytest.mark.parametrize("top_p,expected", [(0.45, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2}),
                                            (0.99, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_nucleus(top_p, expected):
    assert kept(QUARTET, top_p=top_p) == expected


def test_top_p_one_drops_no_token_where_the_cumulative_sum_rounds_to_one():
    """The regression: one token holds all but ~1e-20 of the mass, so the float32 cumulative sum
    is 1 from the first token on. top_p = 1 must still keep every token, as no top-p does,
    in a batch whose other rows do cut (so the cut stage runs)."""
    g = torch.Generator().manual_seed(3)
    peaked = torch.randn(50, generator=g)
    peaked[17] = 60.0
    logits = torch.stack([peaked, peaked, torch.randn(50, generator=g)])
    out = sampling_logits(logits.clone(), params(3, top_k=[0, 10, 0], top_p=[1.0, 1.0, 0.5]))
    assert torch.equal(out[0], peaked)
    assert torch.equal(out[1], sampling_logits(peaked.unsqueeze(0).clone(),
                                               params(1, top_k=10, top_p=1.0))[0])
    assert out[1].isfinite().sum() == 10


def test_small_top_p_keeps_only_the_top_token():
    assert kept(LOGITS, temperature=100.0, top_p=1e-6) == {int(LOGITS.argmax())}
    u = torch.linspace(0.001, 1.0, 200)
    drawn = sample(rows_of(LOGITS, 200), params(200, temperature=100.0, top_p=1e-6), u)
    assert set(drawn.tolist()) == {int(LOGITS.argmax())}


def test_top_p_counts_the_mass_after_top_k():
    """top-k first, then top-p over the renormalized survivors: of [0.4, 0.3 | 0.2, 0.1] with
    top_k = 2 the second token holds 3/7, so top_p = 0.5 keeps the first alone (over the whole
    row the mass before it is 0.4 < 0.5, which would keep it)."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert kept(logits, top_k=2, top_p=0.5) == {0}
    assert kept(logits, top_p=0.5) == {0, 1}


# ---- min-p -----------------------------------------------------------------------------------

@pytest.mark.parametrize("min_p,expected", [(0.0, {0, 1, 2, 3}), (0.25, {0, 1, 2}),
                                            (0.4, {0, 1}), (0.7, {0}), (1.0, {0})])
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p, expected):
    assert kept(QUARTET, min_p=min_p) == expected


def test_min_p_is_relative_to_the_distribution_after_temperature():
    # at temperature 4 the quartet flattens: every token is above 0.4 times the top one
    assert kept(QUARTET, temperature=4.0, min_p=0.4) == {0, 1, 2, 3}


# ---- greedy and random rows ------------------------------------------------------------------

def test_all_greedy_rows_return_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 100, generator=g)
    out = sample(logits.clone(), params(16, temperature=0.0, greedy=True), torch.ones(16))
    assert torch.equal(out, logits.argmax(-1))


def test_mixed_batch_greedy_rows_argmax_random_rows_as_if_alone():
    """Greedy rows take the argmax whatever their other fields hold (temperature 0 divides
    nothing); each random row draws what it draws alone with the same uniform."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 50, generator=g) * 2
    u = 1.0 - torch.rand(10, generator=g)
    greedy = [r % 2 == 1 for r in range(10)]
    mixed = params(10, temperature=[0.0 if gr else 1.5 for gr in greedy], top_k=5, top_p=0.5,
                   min_p=0.3, greedy=greedy)
    out = sample(logits.clone(), mixed, u)
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))
    alone = sample(logits[0::2].clone(), params(5, temperature=1.5, top_k=5, top_p=0.5,
                                                min_p=0.3), u[0::2])
    assert torch.equal(out[0::2], alone)
    scaled = sampling_logits(logits.clone(), mixed)
    assert torch.equal(scaled[1::2], logits[1::2])          # greedy rows pass through


# ---- the draw --------------------------------------------------------------------------------

def test_draw_picks_the_token_whose_interval_holds_u():
    u = midpoints(torch.softmax(LOGITS.double(), -1))
    assert draw_by_search(rows_of(LOGITS, V), u).tolist() == list(range(V))
    assert draw(rows_of(LOGITS, V), u.unsqueeze(1)).tolist() == list(range(V))   # [S, 1] too


def test_draw_never_picks_a_masked_token():
    logits = rows_of(LOGITS, 300)
    logits[:, [1, 4, 7]] = float("-inf")                   # the top token and the last one
    drawn = draw(logits, torch.linspace(1e-6, 1.0, 300))
    assert set(drawn.tolist()) == {0, 2, 3, 5, 6}
    assert int(drawn[-1]) == 6                              # u = 1: the last live token


def test_native_draw_matches_the_cumulative_search(native_lib):
    """draw() on the CPU (the native kernel) against softmax + cumsum + search: the same token,
    except where the target lies within float rounding of a cumulative boundary; never a -inf
    token; u = 1 draws one of the last tokens of weight (those past it hold no more than
    rounding), not a token of the masked tail behind them."""
    assert native_lib.sample_serves(torch.zeros(1, 1))      # every tier has the kernel
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(96, 1003, generator=g) * 4           # V not a multiple of 16
    logits[::3, 700:] = float("-inf")                         # masked tails
    logits[1, :] = float("-inf")
    logits[1, 517] = 2.0                                      # one live token
    u = 1.0 - torch.rand(96, 1, generator=g)
    u[::5] = 1.0
    ours = draw(logits, u, native_lib)
    ref = draw_by_search(logits.clone(), u)
    cdf = torch.softmax(logits.double(), -1).cumsum(-1)
    for row in range(96):
        assert logits[row, ours[row]] > float("-inf")
        if ours[row] != ref[row]:
            edge = min(ours[row], ref[row])
            assert abs(cdf[row, edge] - u[row, 0]) < 1e-5, (row, ours[row], ref[row])
    assert ours[1] == 517
    for row in range(0, 96, 5):
        assert cdf[row, ours[row]] > 1 - 1e-6
    for n in (V, 5):                      # vocabularies shorter than a vector
        mid = midpoints(torch.softmax(LOGITS[:n].double(), -1))
        assert draw(rows_of(LOGITS[:n], n), mid, native_lib).tolist() == list(range(n))


def test_rejection_sampling_keeps_the_target_distribution():
    """A draft drawn from q, judged against p: the first token follows p (chi-square over
    20,000 draws), a draft equal in both is always kept, one p gives no weight never."""
    g = torch.Generator().manual_seed(4)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0]])
    q = torch.tensor([[0.1, 0.1, 0.3, 0.2, 0.3]])
    draws = 20000
    counts = torch.zeros(5)
    for _ in range(draws):
        x = int(torch.multinomial(q[0], 1, generator=g))
        u = torch.rand(3, generator=g).clamp_(min=1e-9).tolist()
        out = rejection_sample(p, q, [x], u[:1], u[1:])
        assert out[:1] == [x] or out[0] != x            # a refused draft is never redrawn
        counts[out[0]] += 1
    expected = p[0] * draws
    live = expected > 0
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    assert counts[4] == 0 and chi2 < 18.5                # 3 degrees of freedom, p ~ 3e-4
    assert rejection_sample(p, p[:1], [2], [1.0], [0.5, 0.5]) == [2, 2]   # kept, then p[1]
    assert rejection_sample(p, torch.tensor([[0, 0, 0, 0, 1.0]]), [4], [0.01], [0.6, 0.5]) \
        == [1]                             # p(4) = 0: refused; the residual is p itself
