"""Overlapped steps: the executor launches step N+1 before it reads step N's tokens back.

On a GPU a step's host work (applying the plan, laying out the batch, launching the kernels
or replaying a graph) otherwise waits for the previous step's tokens, and the GPU idles
through it. With async scheduling the next plan is usually queued while a step runs (the
scheduler plans it ahead, assuming one more token a sampling sequence), so ModelRunner.launch
runs the next step's host work while the device works, its rows taking the previous step's
tokens from the device, and only then is the previous step finished (its tokens read back).

Only plain steps overlap (SeqTable.plain_plan: no grammar, drafts, beams, logits processors,
pooling, swaps, KV-Compress; ModelRunner.overlap: one rank, no speculation): nothing on the host
reads a plain step's tokens before the next step needs them. A plain step reserves a PENDING
place for each token it samples (SeqTable.reserve) and fills it when finished (SeqTable.settle);
a sequence its token stopped has run one wasted row in the step launched after, whose token is
dropped, as with a stop string found between two planned steps (docs/pipelined-steps.md). Any
other step is finished before the next one starts, as without overlap. Results leave in plan
order either way.
"""
from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_scheduler import SampledLogprobs

from .seq_table import PENDING
from .step_sampler import Drawn

POLL_SECONDS = 50e-6     # a held step's readiness is checked this often while no plan comes


@dataclass
class Launched:
    """A step launched and not finished: what ModelRunner.finish needs of it. `order` None:
    nothing ran (a sleep-mode control, or no sequence), `result` is whole."""
    plan: Any
    result: Any                       # StepResult, or ControlDone for a control
    order: list | None = None         # the sequences it ran (SeqTable.apply)
    sample_seqs: list = field(default_factory=list)
    batch: Any = None                 # its AttentionBatch
    drawn: Drawn | None = None
    places: list[tuple[int, int]] | None = None   # reserved tokens' places (SeqTable.reserve)

    @property
    def reserved(self) -> bool:
        return self.places is not None

    def ready(self) -> bool:
        """Whether finishing it would not wait for the device."""
        return self.drawn is None or self.drawn.ready()

    def feed(self, input_ids: torch.Tensor, rows: list, upload) -> torch.Tensor:
        """The next step's ids on the device (`upload`: Backend.upload), its PENDING rows
        (this step's tokens, not yet read back) taken from this step's draw there."""
        at = {id(seq): i for i, (_, seq) in enumerate(self.sample_seqs)}
        dst, src = [], []
        for _, seq, row in rows:
            span = seq.token_ids[seq.num_computed:seq.num_computed + seq.num_scheduled]
            if PENDING not in span:
                continue
            if id(seq) not in at or self.drawn is None:
                raise RuntimeError("a row reads a token no step in flight samples")
            for k, token in enumerate(span):
                if token == PENDING:
                    dst.append(row + k)
                    src.append(at[id(seq)])
        ids = upload(input_ids)
        if dst:
            ids[upload(torch.tensor(dst))] = self.drawn.tokens[upload(torch.tensor(src))]
        return ids

    def keep(self, kept: list[int]) -> None:
        """Only these sampled sequences' rows stay in the result (SeqTable.settle)."""
        if len(kept) == len(self.sample_seqs):
            return
        r = self.result
        r.seq_ids = [r.seq_ids[i] for i in kept]
        r.token_ids = [r.token_ids[i] for i in kept]
        if r.logprobs is not None:
            lp = r.logprobs
            r.logprobs = SampledLogprobs([lp.logprobs[i] for i in kept],
                                         [lp.top_ids[i] for i in kept],
                                         [lp.top_logprobs[i] for i in kept])


class StepOverlap:
    """The rule, for any driver: at most one step held (launched, not finished); a plan is
    launched after it only when both are plain, else the held step is finished first.
    Outcomes come back as (tag, StepResult or the exception the step raised), in plan order."""

    def __init__(self, runner):
        self.runner = runner
        self.held: tuple[Launched, Any] | None = None

    def run(self, plan, tag) -> list[tuple[Any, Any]]:
        """Launch `plan` (after the held step, or once it is finished); the outcomes now
        known. A plain step stays held; any other is finished at once."""
        done, plain = [], None
        if self.held is not None:
            plain = self.runner.table.plain_plan(plan)       # (launch is told: asked once)
            if not (plain and self.held[0].reserved):
                done.append(self._finish())
        try:
            step = self.runner.launch(plan, self.held[0] if self.held is not None else None,
                                      plain)
        except Exception as e:
            self._fail(plan)
            return done + self.finish_held() + [(tag, e)]
        done += self.finish_held()
        if step.reserved:
            self.held = (step, tag)
        else:
            done.append(self._outcome(step, tag))
        return done

    def ready(self) -> bool:
        return self.held is None or self.held[0].ready()

    def finish_held(self) -> list[tuple[Any, Any]]:
        return [self._finish()] if self.held is not None else []

    def _finish(self) -> tuple[Any, Any]:
        step, tag = self.held
        self.held = None
        return self._outcome(step, tag)

    def _outcome(self, step: Launched, tag) -> tuple[Any, Any]:
        try:
            return tag, self.runner.finish(step)
        except Exception as e:
            self._fail(step.plan)
            return tag, e

    def _fail(self, plan) -> None:
        if isinstance(plan, StepPlan):
            self.runner.fail(plan)


class OverlappedExecutor:
    """The offline LLM's executor handle (scheduler/engine.py ExecutorHandle) with overlapped
    steps: plans run on a worker thread in the order sent; while a step is held, the worker
    waits for the next plan (to launch it ahead) or for the held step's tokens, whichever
    comes first. An exception from a step is raised by collect. The worker holds the runner
    only while this handle lives: it ends when the handle is collected."""

    def __init__(self, runner, thread_init: Callable[[], None] | None = None):
        self.plans: queue.SimpleQueue = queue.SimpleQueue()
        weakref.finalize(self, self.plans.put, None)          # the worker's stop
        threading.Thread(target=_work, args=(self.plans, StepOverlap(runner), thread_init),
                         name="pagewire-executor", daemon=True).start()

    def send(self, plan) -> Future:
        future: Future = Future()
        self.plans.put((plan, future))
        return future

    def collect(self, ticket: Future):
        return ticket.result()


def _work(plans: queue.SimpleQueue, overlap: StepOverlap, thread_init) -> None:
    """OverlappedExecutor's worker: until a None comes, run each (plan, future)."""
    if thread_init is not None:
        thread_init()
    while True:
        try:
            item = plans.get(timeout=None if overlap.held is None else POLL_SECONDS)
        except queue.Empty:
            if overlap.ready():
                _deliver(overlap.finish_held())
            continue
        if item is None:
            _deliver(overlap.finish_held())
            return
        _deliver(overlap.run(*item))


def _deliver(outcomes: list[tuple[Future, Any]]) -> None:
    for future, out in outcomes:
        if isinstance(out, BaseException):
            future.set_exception(out)
        else:
            future.set_result(out)
