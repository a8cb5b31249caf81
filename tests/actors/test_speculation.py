"""Speculative decoding: the n-gram lookup, the scheduler's grants, and verification on a tiny
random model: outputs (greedy, and seeded sampling) identical with and without drafts whether
every draft, none or some are right; stops, max_tokens, preemption and the block pool."""
from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch

from pagewire import LLM, SamplingParams
from pagewire.config import SpeculativeConfig
from pagewire.executor.draft_proposers import Proposer, accepted
from pagewire.scheduler.speculation import PROBE_EVERY, DraftPolicy, DraftState


def _propose(tokens, min_n=1, max_n=4, k=3):
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=min_n,
                                          prompt_lookup_max=max_n))
    return proposer.propose(tokens, proposer.index())


def test_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert _propose(tokens) == [7, 8, 5]                  # "2 3": latest earlier match
    assert _propose(tokens + [7], k=2) == [8, 5]          # "2 3 7" beats "7"
    assert _propose([4, 5, 6]) == []                      # nothing repeats
    assert _propose([1, 2, 1, 2], min_n=3, max_n=3) == []  # min_n 3 not met


def _naive(tokens, min_n, max_n, k):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


def test_the_index_proposes_what_a_scan_finds_as_tokens_grow():
    import random
    rng = random.Random(0)
    proposer = Proposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2,
                                          prompt_lookup_max=4))
    index, tokens = proposer.index(), []
    for _ in range(400):                   # incremental: the index only ever extends
        tokens.append(rng.randrange(6))
        assert proposer.propose(tokens, index) == _naive(tokens, 2, 4, 4)


def test_suffix_also_drafts_from_outputs_that_finished():
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=2, prompt_lookup_min=2)
    proposer = Proposer(cfg)
    assert proposer.propose([7, 8, 9], proposer.index()) == []
    proposer.remember([1, 8, 9, 4, 5, 6])
    assert proposer.propose([7, 8, 9], proposer.index()) == [4, 5]
    assert Proposer(SpeculativeConfig(prompt_lookup_min=2)).recent is None   # ngram: own only


def test_accepted_counts_the_leading_matches():
    assert accepted([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted([4, 5, 6], [4, 5, 6, 1]) == 3
    assert accepted([], [3]) == 0


def _req(num_drafts=3, draft_acceptance=1.0, draft_skips=0, max_tokens=100,
         num_output_tokens=0, num_draft_slots=0):
    """A sequence as the draft policy reads it: its drafts' state, and its room to generate."""
    spec = DraftState(num_drafts, num_draft_slots, draft_acceptance, draft_skips)
    return SimpleNamespace(spec=spec, max_tokens=max_tokens, num_output_tokens=num_output_tokens)


def test_the_policy_grants_within_budget_max_tokens_and_batch_size():
    policy = DraftPolicy(SpeculativeConfig(num_speculative_tokens=3, max_batch=4))
    assert policy.grant(_req(), budget=10, num_running=4) == 3
    assert policy.grant(_req(), budget=2, num_running=1) == 2
    assert policy.grant(_req(max_tokens=10, num_output_tokens=8), 10, 1) == 1
    assert policy.grant(_req(), budget=10, num_running=5) == 0     # above max_batch
    assert policy.grant(_req(num_drafts=0), budget=10, num_running=1) == 0
    assert DraftPolicy(None).grant(_req(), 10, 1) == 0


def test_the_batch_limit_defaults_by_device(model):
    """A verified draft row costs a CPU a good part of a step: speculation is on up to 2
    running sequences there (bench/NOTES.md "Speculative decoding"), 8 on CUDA; a given limit
    stays."""
    from pagewire.config import EngineConfig
    from pagewire.config_sections import MAX_BATCH

    def limit(device="cpu", **kw):
        cfg = EngineConfig.from_options(model=model, speculative_config=SpeculativeConfig(**kw),
                           device=device, num_kv_blocks=64).resolve()
        return cfg.speculative_config.max_batch
    assert limit() == MAX_BATCH["cpu"] == 2 and limit(max_batch=5) == 5
    assert limit("cuda") == MAX_BATCH["cuda"] == 8          # resolving needs no GPU
    assert DraftPolicy(SpeculativeConfig()).max_batch == 2
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        limit(max_batch=0)
    half = DraftPolicy(SpeculativeConfig(num_speculative_tokens=4))
    assert half.grant(_req(num_drafts=4, draft_acceptance=0.5), 10, 1) == 2   # likely right


def test_draft_state_exists_once_the_executor_holds_drafts():
    """A sequence's DraftState (seq.spec) is made by the first result saying the executor
    drafted for it; until then it gets no grant and holds no draft record."""
    from pagewire.wire.ids import SeqId
    from pagewire.wire.to_scheduler import DraftsResult
    policy = DraftPolicy(SpeculativeConfig(num_speculative_tokens=2))
    seq = SimpleNamespace(seq_id=SeqId("a"), spec=None, max_tokens=100, num_output_tokens=0)
    assert policy.grant(seq, 10, 1) == 0
    assert policy.tokens_of(seq, 7, None) == [7]
    assert seq.spec is None
    assert policy.tokens_of(seq, 8, DraftsResult({}, {}, {seq.seq_id: 2})) == [8]
    assert seq.spec == DraftState(num_drafts=2) and policy.grant(seq, 10, 1) == 2


def test_a_sequence_that_rarely_accepts_drafts_only_every_probe_steps():
    policy = DraftPolicy(SpeculativeConfig(num_speculative_tokens=2, min_acceptance=0.5))
    req = _req(num_draft_slots=2, num_drafts=2)
    for _ in range(4):
        req.spec.num_slots = 2
        policy.verified(req.spec, 0)
    assert req.spec.acceptance < 0.5
    grants = [policy.grant(req, 10, 1) for _ in range(2 * PROBE_EVERY)]
    assert grants.count(0) == 2 * PROBE_EVERY - 2 and grants.count(1) == 2   # probes: one
    assert (policy.num_drafts, policy.num_draft_tokens, policy.num_accepted_tokens) == (4, 8, 0)


class _Oracle:
    """Proposes the reference continuation, with every `wrong`-th draft spoiled."""

    def __init__(self, references: list[list[int]], k: int, wrong: int = 0):
        self.references, self.k, self.wrong = references, k, wrong

    def index(self):
        return None

    def propose(self, tokens: list[int], own=None) -> list[int]:
        for ref in self.references:
            if ref[:len(tokens)] == tokens:
                drafts = ref[len(tokens):len(tokens) + self.k]
                if self.wrong:
                    drafts = [t if (len(tokens) + i) % self.wrong else t + 1
                              for i, t in enumerate(drafts)]
                return drafts
        return []

    def remember(self, tokens):
        pass


@pytest.fixture(scope="module")
def model(tmp_path_factory, smol_tokenizer_dir):
    from tests.helpers import make_tiny_llama
    return make_tiny_llama(str(tmp_path_factory.mktemp("spec") / "m"), smol_tokenizer_dir,
                           vocab_size=512, seed=4)


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], list(range(20, 45)), [100, 101, 100, 101]]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "max_batch": 8}


def _run(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def _with_oracle(model, reference, wrong=0, **options) -> LLM:
    llm = LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=4, speculative_config=SPEC,
              **options)
    refs = [p + r for p, r in zip(PROMPTS, reference)]
    llm.runner.table.proposer = _Oracle(refs, 4, wrong)
    return llm


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=30),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=11, max_tokens=30),
    SamplingParams(temperature=0.7, seed=5, max_tokens=30, presence_penalty=0.5,
                   frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={7: 2.0}),
], ids=["greedy", "seeded", "penalties"])
@pytest.mark.parametrize("wrong", [0, 3, 1], ids=["all-right", "some-wrong", "all-wrong"])
def test_outputs_are_the_same_with_drafts_right_or_wrong(model, params, wrong):
    plain = LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=4)
    reference = _run(plain, params)
    llm = _with_oracle(model, reference, wrong)
    assert _run(llm, params) == reference
    d = llm.scheduler.drafts
    assert d.num_draft_tokens > 0
    if wrong == 0:
        assert d.num_accepted_tokens == d.num_draft_tokens          # every draft right
    elif wrong == 1:
        assert d.num_accepted_tokens == 0
    else:
        assert 0 < d.num_accepted_tokens < d.num_draft_tokens
    assert llm.scheduler.kv.num_free == llm.scheduler.kv.num_blocks   # nothing leaked
    steps = llm.scheduler.step_id
    assert (steps < plain.scheduler.step_id) == (d.num_accepted_tokens > 0)


def test_ngram_drafts_keep_greedy_outputs(model):
    params = SamplingParams(temperature=0, max_tokens=40)
    reference = _run(LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128), params)
    llm = LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128, speculative_config=SPEC)
    assert _run(llm, params) == reference
    assert llm.scheduler.drafts.num_drafts > 0


def test_a_stop_inside_the_verified_drafts_ends_the_output_there(model):
    greedy = SamplingParams(temperature=0, max_tokens=30)
    reference = _run(LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128), greedy)
    stop = reference[0][9]                       # somewhere inside a run of accepted drafts
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop])
    llm = _with_oracle(model, reference)
    out = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    assert out.token_ids == reference[0][:reference[0].index(stop) + 1]
    assert out.finish_reason == "stop"
    short = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=7))[0]
    assert short.outputs[0].token_ids == reference[1][:7]           # max_tokens kept exactly
    assert llm.scheduler.kv.num_free == llm.scheduler.kv.num_blocks


def test_drafts_survive_preemption_and_n(model):
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24)
    roomy = LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=4)
    reference = [[c.token_ids for c in o.outputs] for o in roomy.generate(PROMPTS, params)]
    tight = LLM(model, dtype="float32", num_kv_blocks=20, block_size=4, max_model_len=64,
                speculative_config=SPEC)
    tight.runner.table.proposer = _Oracle([p + c for p, cs in zip(PROMPTS, reference)
                                           for c in cs], 4)
    outs = [[c.token_ids for c in o.outputs] for o in tight.generate(PROMPTS, params)]
    assert outs == reference
    assert tight.scheduler.num_preemptions > 0
    assert tight.scheduler.drafts.num_accepted_tokens > 0
    assert tight.scheduler.kv.num_free == tight.scheduler.kv.num_blocks


def test_draft_counters_reach_prometheus_with_vllms_names():
    from pagewire.gateway.metrics import GatewayMetrics
    from pagewire.wire.to_gateway import SchedulerStats
    metrics = GatewayMetrics("m")
    base = dict(num_running=1, num_waiting=0, kv_cache_usage=0.0, prompt_tokens=0,
                generation_tokens=0, preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0)
    metrics.on_scheduler_stats(SchedulerStats(**base, spec_drafts=2, spec_draft_tokens=6,
                                              spec_accepted_tokens=4,
                                              spec_accepted_per_pos=[2, 1, 1]))
    metrics.on_scheduler_stats(SchedulerStats(**base, spec_drafts=3, spec_draft_tokens=9,
                                              spec_accepted_tokens=5,
                                              spec_accepted_per_pos=[3, 1, 1]))
    text = metrics.exposition().decode()
    labels = '{engine="0",model_name="m"'
    for line in (f"vllm:spec_decode_num_drafts_total{labels}}} 3.0",
                 f"vllm:spec_decode_num_draft_tokens_total{labels}}} 9.0",
                 f"vllm:spec_decode_num_accepted_tokens_total{labels}}} 5.0",
                 f'vllm:spec_decode_num_accepted_tokens_per_pos_total{labels},position="0"}} 3.0',
                 f'vllm:spec_decode_num_accepted_tokens_per_pos_total{labels},position="2"}} 1.0'):
        assert line in text, line


def test_logprobs_of_accepted_drafts_equal_plain_decodings(model):
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=20, logprobs=2)
    plain = LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=4)
    ref = plain.generate(PROMPTS, params)
    llm = _with_oracle(model, [o.outputs[0].token_ids for o in ref], wrong=4)
    outs = llm.generate(PROMPTS, params)
    assert llm.scheduler.drafts.num_accepted_tokens > 0
    for ours, theirs in zip(outs, ref):
        a, b = ours.outputs[0], theirs.outputs[0]
        assert a.token_ids == b.token_ids
        assert [(e.token_id, [t for t, _, _ in e.top]) for e in a.logprobs] == \
            [(e.token_id, [t for t, _, _ in e.top]) for e in b.logprobs]
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs],
                                                                abs=1e-4)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=30),
                                    SamplingParams(temperature=0.8, seed=2, max_tokens=30)],
                         ids=["greedy", "seeded"])
def test_self_drafts_keep_outputs_and_the_whole_model_as_its_draft_is_always_right(model, params):
    """Greedy: the tokens of decoding without drafts. Seeded: a random request's model drafts
    are judged by rejection sampling, so its tokens are reproducible, not those of plain
    decoding (the chi-square test below checks their distribution). A draft drawn from the
    target's own distribution (all layers) is always kept, greedy or not."""
    plain = LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=4)
    reference = _run(plain, params)
    accepted = {}
    for layers in (1, 2):                               # the tiny model has 2 layers
        llm = LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=4,
                  speculative_config={"method": "self", "draft_layers": layers,
                                      "num_speculative_tokens": 3, "min_acceptance": 0.0,
                                      "max_batch": 8})
        out = _run(llm, params)
        d = llm.scheduler.drafts
        accepted[layers] = (d.num_accepted_tokens, d.num_draft_tokens)
        assert out == (reference if params.greedy else _run(llm, params))
        assert llm.scheduler.kv.num_free == llm.scheduler.kv.num_blocks
    whole_accepted, whole_drafted = accepted[2]
    assert whole_accepted == whole_drafted > 0
    assert accepted[1][1] > 0


@pytest.fixture(scope="module")
def draft(tmp_path_factory, smol_tokenizer_dir):
    """A smaller random model with the target's vocabulary: one layer, other head shapes."""
    from tests.helpers import make_tiny_llama
    return make_tiny_llama(str(tmp_path_factory.mktemp("draft") / "d"), smol_tokenizer_dir,
                           "gqa3-odd", vocab_size=512, num_layers=1, seed=9)


def _draft_model(path: str) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
            "min_acceptance": 0.0, "max_batch": 8}


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=30),
                                    SamplingParams(temperature=0.8, seed=2, max_tokens=30)],
                         ids=["greedy", "seeded"])
def test_a_draft_model_keeps_outputs_and_the_target_as_its_own_draft_is_always_right(
        model, draft, params):
    reference = _run(LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128,
                         block_size=4), params)
    counts = {}
    for name, path in (("other", draft), ("target", model)):
        llm = LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=4,
                  speculative_config=_draft_model(path))
        out = _run(llm, params)
        d = llm.scheduler.drafts
        counts[name] = (d.num_accepted_tokens, d.num_draft_tokens)
        assert out == (reference if params.greedy else _run(llm, params))   # seeded: the same
        assert llm.scheduler.kv.num_free == llm.scheduler.kv.num_blocks
    accepted_, drafted = counts["target"]
    assert accepted_ == drafted > 0          # drawn from the target's own distribution: kept
    assert counts["other"][1] > 0 and counts["other"][0] < counts["other"][1]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_draft_models_cache_follows_preemption_swaps_and_shared_prefixes(model, mode):
    """The target as its own draft, greedy: any K/V the draft cache lost or misplaced (a
    swap, a prefix-cache hit, a copy-on-write) would show as a rejected draft."""
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = PROMPTS + [PROMPTS[1] + [60, 61, 62], PROMPTS[1][:17]]    # shared prefixes
    roomy = LLM(model, dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=4)
    reference = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    tight = LLM(model, dtype="float32", num_kv_blocks=24, block_size=4, max_model_len=64,
                preemption_mode=mode, swap_space=2**20 if mode == "swap" else 0,
                speculative_config=_draft_model(model))
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == reference
    s = tight.scheduler
    assert s.num_preemptions > 0
    assert s.drafts.num_accepted_tokens == s.drafts.num_draft_tokens > 0
    assert s.kv.num_free == s.kv.num_blocks


def test_a_draft_models_cache_comes_out_of_the_kv_budget(model, draft):
    from pagewire.config import EngineConfig
    spec = SpeculativeConfig(method="draft_model", model=draft)
    # per token: target 2 layers x 2 KV heads x 64 x (K, V) x 4 B = 2048; draft 1 x 1 x 64 x 2
    # x 4 = 512; blocks of 16 tokens
    plain = EngineConfig.from_options(model=model, dtype="float32",
                                      kv_cache_memory=2**22).resolve()
    both = EngineConfig.from_options(model=model, dtype="float32", kv_cache_memory=2**22,
                                     speculative_config=spec).resolve()
    assert (plain.cache.num_kv_blocks, both.cache.num_kv_blocks) == (2**22 // (16 * 2048),
                                                                     2**22 // (16 * 2560))
    assert both.model.draft_model_info.path == draft and plain.model.draft_model_info is None


def _exact_joint(path: str, prompt: list[int], length: int, top_k: int) -> dict:
    """{token tuple: probability} of the first `length` tokens at temperature 1 and top_k,
    from transformers' logits: the distribution speculation must keep."""
    from tests.helpers import HFOracle
    model = HFOracle.from_dir(path).model
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = list(joint)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        top = logits.topk(top_k, dim=-1)
        probs = top.values.softmax(dim=-1)
        joint = {p + (int(t),): joint[p] * float(q) for p, ts, qs in
                 zip(prefixes, top.indices, probs) for t, q in zip(ts, qs)}
    return joint


@pytest.mark.parametrize("method", ["draft_model", "self", "ngram"])
def test_sampled_tokens_follow_the_target_distribution(model, draft, method):
    """Thousands of unseeded draws of 3 tokens (the second step verifies a draft for the
    third): a chi-square test of their joint frequencies against transformers' exact joint."""
    # Every token once (bar the special 0..2): ngram finds any first token and drafts its
    # successor; the model drafts do not care.
    prompt, k, draws = list(range(3, 512)), 3, 2000
    spec = {"method": method, "num_speculative_tokens": 1, "prompt_lookup_min": 1,
            "min_acceptance": 0.0, "max_batch": draws,
            **({"model": draft} if method == "draft_model" else {}),
            **({"draft_layers": 1} if method == "self" else {})}
    llm = LLM(model, dtype="float32", max_model_len=1024, num_kv_blocks=4096, block_size=4,
              max_num_seqs=draws, max_num_batched_tokens=draws * 2, speculative_config=spec)
    params = SamplingParams(temperature=1.0, top_k=k, max_tokens=3, ignore_eos=True)
    counts = collections.Counter(tuple(o.outputs[0].token_ids)
                                 for o in llm.generate([prompt] * draws, params))
    assert llm.scheduler.drafts.num_draft_tokens > draws // 2          # the third token verified
    joint = _exact_joint(model, prompt, 3, k)
    assert set(counts) <= set(joint)
    expected = torch.tensor([p * draws for p in joint.values()], dtype=torch.float64)
    seen = torch.tensor([counts[t] for t in joint], dtype=torch.float64)
    big = expected >= 5                  # sparse cells pooled into one
    exp_ = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    obs = torch.cat([seen[big], seen[~big].sum().reshape(1)])
    chi2 = float(((obs - exp_) ** 2 / exp_.clamp(min=1e-9)).sum())
    dof = len(exp_) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2)))
    assert p_value > 1e-4, (chi2, dof)
