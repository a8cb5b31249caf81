"""The executor's record of the sequences it has been sent, and how a StepPlan changes it.

No model here: the runner (runner.py) computes and samples; this table says which tokens each
step computes and which sequences sample, and keeps the tokens sampled. Plans apply in the
order they come. A plan may have been made before the previous one's result reached the
scheduler (pipelined steps): its decode rows then read the tokens appended here. A sequence
whose last token stopped it (EOS, a stop token id: the scheduler's own rule,
wire.sampling_params.stops_on) is left out of such a row, and so is one whose step failed; the
scheduler has ended both and ignores them. A constrained sequence carries its grammar matcher
(executor/grammar_matchers.py), advanced by each token appended; a token its grammar refuses fails
that sequence alone. Speculative decoding: after a sequence samples, the proposer
(executor/draft_proposers.py) leaves drafts in it; a plan that schedules a sequence past its
known tokens verifies that many of them (`verifying`), and the step appends the tokens
verified, computed positions advancing only over accepted drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagewire.wire.ids import SeqId
from pagewire.wire.lora import LoraRef
from pagewire.wire.pooling import PoolingSeq
from pagewire.wire.sampling_params import SamplingParams, stops_on
from pagewire.wire.to_executor import StepPlan

# A token sampled by a step that was launched and not yet finished (overlapped steps,
# step_overlap.py): its place in token_ids, filled when that step finishes; the next step's row
# reads it from the device.
PENDING = -1


def plain_sampling(s: SamplingParams) -> bool:
    """Sampling whose next step needs nothing of a token but the token (SeqState.plain)."""
    return s.structured_outputs is None and not s.use_beam_search and not s.has_logits_processors


@dataclass
class SeqState:
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_ids: list[int]
    sampling: SamplingParams
    num_scheduled: int = 0
    stopped: bool = False           # its last sampled token ends it
    matcher: object | None = None   # llguidance.LLMatcher of a constrained sequence
    drafts: list[int] = field(default_factory=list)      # proposed after its last sample
    ngrams: object | None = None    # executor/draft_proposers.py NgramIndex of its tokens
    num_draft_slots: int = 0        # drafts this step verifies (model drafts: filled in it)
    verifying: list[int] = field(default_factory=list)   # the drafts this step computes
    # A random request's model drafts: the distributions each was drawn from ([V] each), for
    # rejection sampling. Empty: the drafts are proposals, judged as one-hot ones.
    draft_probs: list = field(default_factory=list)
    lora: LoraRef | None = None     # its adapter; None: the base model
    compress: bool = False          # KV-Compress: evict after this step
    heads: object | None = None     # KV-Compress: its head rows (executor/head_blocks.py)
    images: list = field(default_factory=list)    # its prompt's (wire/multimodal.py ImageInput)
    pooling: PoolingSeq | None = None   # pooled, never sampled, once computed (wire/pooling.py)
    token_rows: object | None = None    # per-token pooling: its rows so far (token_rows.py)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def runs_as_decode(self) -> bool:
        """Its rows are decode rows: one token, or a last token and its draft slots (known
        from the plan; a model fills the drafts later in the step)."""
        return self.num_scheduled == 1 or self.num_draft_slots > 0

    @property
    def plain(self) -> bool:
        """Nothing on the host reads its sampled tokens before the next step needs them (no
        grammar, drafts, beams or logits processors): that step may run before they are
        known (overlapped steps, step_overlap.py)."""
        return (plain_sampling(self.sampling) and self.matcher is None and not self.drafts
                and self.pooling is None and not self.compress)

    @property
    def samples(self) -> bool:
        """Whether this step's tokens reach the end of its tokens (drafts included): it
        samples the next one (at each draft's position too)."""
        return self.num_computed + self.num_scheduled == len(self.token_ids) + len(self.verifying)


class SeqTable:
    def __init__(self, eos_ids: list[int], matchers=None, proposer=None):
        self.eos_ids = frozenset(eos_ids)
        self.matchers = matchers            # grammar_matchers.py Matchers; None: unconstrained
        self.proposer = proposer            # executor/draft_proposers.py Proposer; None: no drafts
        # methods self, draft_model: drafts come from a model during the step that verifies
        # them (the runner fills `verifying`), not from a proposal after a step
        self.drafts_in_step = proposer is not None and proposer.model_drafting
        self.seqs: dict[SeqId, SeqState] = {}
        self.failed: set[SeqId] = set()      # sequences of a failed step, until a plan drops them

    def forget_all(self) -> None:
        """Sleep mode: the scheduler holds no sequence (it ended or drained them), so none
        of their state is needed again; the plans that would have dropped them never come."""
        self.seqs.clear()
        self.failed.clear()

    def apply(self, plan: StepPlan) -> list[tuple[SeqId, SeqState]]:
        """Drop, add and extend as the plan says; return the sequences it runs, decodes first."""
        for sid in plan.finished + plan.preempted:
            seq = self.seqs.pop(sid, None)
            self.failed.discard(sid)
            if seq is not None and self.proposer is not None and sid in plan.finished:
                self.proposer.remember(seq.token_ids)
        order = []
        for new in plan.new:
            seq = SeqState(list(new.token_ids), new.num_prompt_tokens, new.num_computed,
                           list(new.block_ids), new.sampling, new.num_scheduled,
                           lora=new.lora, compress=new.compress, images=new.images,
                           pooling=new.pooling)
            so = new.sampling.structured_outputs
            if so is not None and self.matchers is not None:
                seq.matcher = self.matchers.start(so, seq.token_ids[seq.num_prompt_tokens:])
            self.seqs[new.seq_id] = seq
            order.append((new.seq_id, seq))
        for run in plan.running:
            if run.seq_id in self.failed:
                continue
            seq = self.seqs[run.seq_id]
            if seq.stopped:
                continue
            seq.block_ids[run.block_offset:] = run.block_ids
            seq.token_ids += run.new_prompt_ids          # streaming input: more prompt
            seq.num_prompt_tokens += len(run.new_prompt_ids)
            seq.token_ids += run.new_token_ids
            seq.num_scheduled, seq.compress = run.num_scheduled, run.compress
            excess = seq.num_computed + run.num_scheduled - len(seq.token_ids)
            seq.verifying = seq.drafts[:excess] if excess > 0 else []
            seq.draft_probs = []
            seq.num_draft_slots = max(excess, 0)
            if len(seq.verifying) != seq.num_draft_slots and not self.drafts_in_step:
                raise ValueError(f"{run.seq_id}: {excess} drafts planned, "
                                 f"{len(seq.drafts)} held")
            order.append((run.seq_id, seq))
        # stable: decodes first (a sequence verifying drafts is one decode row a position)
        order.sort(key=lambda item: not item[1].runs_as_decode)
        return order

    def finish_step(self, order: list[tuple[SeqId, SeqState]],
                    sampled: list[tuple[SeqId, SeqState, list[int]]]) -> dict[SeqId, str]:
        """The step ran: append each sequence's tokens (a beam's next token is the
        scheduler's pick, sent in a later plan), advance what is computed, propose drafts.
        Returns the sequences whose grammar refused their token, with why."""
        for _, seq in order:
            seq.num_computed += seq.num_scheduled
        errors = {}
        for sid, seq, tokens in sampled:
            if seq.sampling.use_beam_search:
                continue
            seq.num_computed -= len(seq.verifying) - (len(tokens) - 1)   # rejected drafts
            seq.verifying, seq.draft_probs = [], []
            for token in tokens:
                error = self._append(seq, token)
                if error:
                    errors[sid] = error
                if seq.stopped:
                    break
            if self.proposer is not None and not seq.stopped and seq.sampling.can_speculate:
                seq.drafts = self._drafts(seq)
        return errors

    def plain_plan(self, plan: StepPlan) -> bool:
        """Whether every sequence the plan runs is plain (SeqState.plain)."""
        if not isinstance(plan, StepPlan) or plan.swap_in or plan.swap_out:
            return False       # a sleep-mode control; swaps move blocks a held step writes
        for new in plan.new:
            if new.pooling is not None or new.compress or not plain_sampling(new.sampling):
                return False
        for run in plan.running:
            seq = self.seqs.get(run.seq_id)
            if seq is not None and not seq.plain:
                return False
        return True

    def reserve(self, order: list[tuple[SeqId, SeqState]],
                sample_seqs: list[tuple[SeqId, SeqState]]) -> list[tuple[int, int]]:
        """A plain step (every sampler SeqState.plain) was launched: advance what is computed
        and hold a PENDING place for each sampled token, as finish_step would once it is
        known. Returns each sampled token's (place, output count: what stops_on reads)."""
        for _, seq in order:
            seq.num_computed += seq.num_scheduled
        places = []
        for _, seq in sample_seqs:
            seq.token_ids.append(PENDING)
            places.append((len(seq.token_ids) - 1, seq.num_output_tokens))
        return places

    def settle(self, sample_seqs: list[tuple[SeqId, SeqState]], places: list[tuple[int, int]],
               tokens: list[int]) -> list[int]:
        """A reserved step finished: its tokens take their places. Returns the indices of the
        sequences whose token counts: not one stopped by an earlier token (that step finished
        after this one was launched; the scheduler has ended it and expects nothing)."""
        kept = []
        for i, ((_, seq), (at, count), token) in enumerate(zip(sample_seqs, places, tokens)):
            if seq.stopped:
                del seq.token_ids[at:]       # its place and any after it: never computed
                continue
            seq.token_ids[at] = token
            seq.stopped = stops_on(seq.sampling, token, count, self.eos_ids)
            kept.append(i)
        return kept

    def _drafts(self, seq: SeqState) -> list[int]:
        """A constrained sequence drafts what its grammar forces (jump-forward: those tokens
        are certain), else the proposer's drafts as far as the grammar allows them."""
        if seq.matcher is not None:
            forced = seq.matcher.compute_ff_tokens()[:self.proposer.k]
            if forced:
                return forced
        elif self.drafts_in_step or seq.sampling.structured_outputs:
            return []          # a model drafts in the verifying step; or reasoning goes on
        if seq.ngrams is None:
            seq.ngrams = self.proposer.index()
        drafts = self.proposer.propose(seq.token_ids, seq.ngrams)
        if seq.matcher is None:
            return drafts
        return drafts[:seq.matcher.validate_tokens(drafts)] if drafts else []

    def _append(self, seq: SeqState, token: int) -> str | None:
        seq.token_ids.append(token)
        seq.stopped = stops_on(seq.sampling, token, seq.num_output_tokens, self.eos_ids)
        if seq.matcher is None:
            self._start_after_reasoning(seq)
        elif not seq.matcher.consume_token(token):
            seq.stopped = True
            return "the output left its grammar: " + \
                seq.matcher.get_error().split("\n<state>")[0][:300]
        return None

    def _start_after_reasoning(self, seq: SeqState) -> None:
        """A constraint waiting for the end of reasoning starts when its last token comes."""
        so = seq.sampling.structured_outputs
        if so is not None and so.start_after and self.matchers is not None:
            seq.matcher = self.matchers.start(so, seq.token_ids[-len(so.start_after):])

    def fail(self, plan: StepPlan) -> None:
        """The plan raised: its sequences' state may be half-applied, so drop it. The scheduler
        ends them on the error; a plan made before it knew may still name them."""
        for sid in [s.seq_id for s in plan.new] + [r.seq_id for r in plan.running]:
            seq = self.seqs.pop(sid, None)
            if seq is not None:    # a step launched after it (overlapped) drops its rows
                seq.stopped = True
            self.failed.add(sid)
