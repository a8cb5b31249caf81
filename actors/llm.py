"""The offline API: LLM(model).generate(prompts, SamplingParams(...)).

Runs the same tokenizer, scheduler, executor and detokenizer cores as the server, in this
process and without sockets: a batch job pays no IPC and needs no run directory. The scheduler
core runs in the step engine (scheduler/engine.py) as in the server, against the executor in
this process; with async scheduling the executor runs plans on a thread of its own, so the next
step is planned (and the last one's tokens detokenized) while a step runs, as in the server.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from pagewire.wire.channels import Sends
from pagewire.wire.engine_control import ControlDone
from pagewire.wire.ids import SeqId, output_ids
from pagewire.wire.kv_event_publisher import publisher_for
from pagewire.wire.lora import LoraRef
from pagewire.wire.pooling import PoolingInput, from_bytes
from pagewire.wire.sampling_params import SamplingParams, best_of
from pagewire.wire.to_detokenizer import TokenDeltas
from pagewire.wire.to_gateway import RequestFailed, TextDeltas
from pagewire.wire.to_scheduler import Abort, NewRequest
from pagewire.wire.to_tokenizer import TokenizePiece, TokenizeRequest

from . import kv_tier_files
from .config import EngineConfig
from .disagg import answer_params, request_transfer
from .detokenizer import Detokenizer
from .executor.pooling_runner import runner_for
from .executor.step_overlap import OverlappedExecutor
from .hf_tokenizer import load_tokenizer
from .llm_pooling import PoolingCalls, PoolingOutput, PoolingRequestOutput
from .llm_prompts import Prompt, listed, per_prompt, piece_prompt, set_prompt
from .llm_prompts import StreamingInput  # noqa: F401  (pagewire.StreamingInput comes from here)
from .llm_sleep import SleepCalls
from .lora_files import LoRARequest, adapter_digest, read_adapter
from .scheduler.core import SchedulerCore
from .scheduler.engine import InProcessExecutor, StepEngine
from .tokenizer import RequestTokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float | None = None
    logprobs: list | None = None          # TokenLogprob per token, when asked


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list | None = None   # TokenLogprob per prompt token (first: logprob None)
    kv_transfer_params: dict | None = None   # a prefill engine's answer (disagg.py)
    pooled: np.ndarray | None = None      # a pooling request's output (float32; encode())


class LLM(PoolingCalls, SleepCalls):
    """An engine in this process. Keyword options are EngineConfig's (dtype, max_model_len,
    max_num_seqs, block_size, kv_cache_memory, ...).

    A driver over the same cores the server's actors run (tokenizer, the scheduler's step
    engine, detokenizer): messages move between them through an in-process queue instead of
    sockets, so stop strings, n / best_of, beams and aborts behave exactly as served.
    `scheduler` and `runner` are there to inspect; the driver itself only moves messages."""

    def __init__(self, model: str | None = None, **options):
        self.config = EngineConfig.from_options(**options, model=model).resolve()
        self.tokenizer = load_tokenizer(self.config.model.model_info)
        # The core first: its tier index scans the disk tier before the executor opens it.
        core = SchedulerCore(self.config, tier_present=kv_tier_files.present(self.config))
        # What the KV server and puller threads tell the scheduler (kv_transfer.py).
        self._notices: queue.SimpleQueue = queue.SimpleQueue()
        self.runner = runner_for(self.config, notify=self._notices.put)
        threads = torch.get_num_threads()    # OpenMP's thread count is per calling thread
        if getattr(self.runner, "overlap", False):       # executor/step_overlap.py
            executor = OverlappedExecutor(self.runner, lambda: torch.set_num_threads(threads))
        else:  # runner.execute is looked up each step: a wrapper set on the runner later runs
            executor = InProcessExecutor(lambda plan: self.runner.execute(plan),
                                         on_thread=self.config.scheduler.async_scheduling,
                                         thread_init=lambda: torch.set_num_threads(threads))
        self.engine = StepEngine(core, executor)
        self.scheduler = self.engine.scheduler
        self._kv_events = publisher_for(self.config.kv_events_config)   # as the actor does
        self.detokenizer = Detokenizer(self.tokenizer)
        self.cores = {"tokenizer": RequestTokenizer(self.config, self.tokenizer),
                      "scheduler": self.engine, "detokenizer": self.detokenizer}
        self._ids = itertools.count()
        self._prompts: dict[str, str | None] = {}     # prompt text, until the request starts
        self._live: dict[str, RequestOutput] = {}
        self._outputs: dict[SeqId, tuple[RequestOutput, CompletionOutput]] = {}   # by output
        self._n: dict[str, int] = {}           # requests generating more sequences than n
        self._failed: dict[str, RequestFailed] = {}
        self._finished: list[RequestOutput] = []
        self._loras: dict[tuple[str, int, str], LoraRef] = {}
        self._streamed: dict[str, RequestOutput] = {}   # finished while streaming inputs
        self._controls: dict[str, ControlDone | None] = {}   # sleep mode's, until answered

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 kv_transfer_params: dict | list[dict | None] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt (greedy by default); outputs in prompt order. A prompt is
        text, a list of token ids, or {"prompt": text} / {"prompt_token_ids": [...]}, with
        "multi_modal_data": {"image": an image or a list of them} for a vision model (PIL
        images or image files' bytes; one placeholder token an image in the prompt, as vLLM
        takes them); `lora_request`: the
        adapter of every prompt, or one per prompt (None: the base model);
        `kv_transfer_params`: disaggregated prefill/decode, as the HTTP field."""
        prompts = listed(prompts)
        params = per_prompt(sampling_params, len(prompts), "sampling params", SamplingParams())
        loras = per_prompt(lora_request, len(prompts), "LoRA requests")
        transfers = per_prompt(kv_transfer_params, len(prompts), "kv_transfer_params")
        return self._run([self.add_request(p, sp, lora_request=lr, kv_transfer_params=kt)
                          for p, sp, lr, kt in zip(prompts, params, loras, transfers)])

    def encode(self, prompts: Prompt | list[Prompt], pairs: str | list[str] | None = None,
               truncate_prompt_tokens: int | None = None,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """A pooling model's raw pooled output for every prompt (text or token ids), in
        prompt order: an embedding (not normalised) or a classifier's logits; `pairs`: a
        cross-encoder's second texts, one per prompt. `pooling_task` (vLLM's): None or the
        model's own task; token_embed: every prompt token's final hidden state, [tokens, H],
        normalised as the model's pooler says; token_classify (a *ForTokenClassification
        model's own): every token's logits, [tokens, labels]. Raises ValueError for an input
        the model refuses (too long without truncation, empty) or a task it cannot do."""
        prompts = listed(prompts)
        per_token = self._per_token(pooling_task)
        pairs = per_prompt(pairs, len(prompts), "pairs")
        outs = self._run([self.add_request(p, SamplingParams(max_tokens=1), pooling=PoolingInput(
            pair, truncate_prompt_tokens, per_token)) for p, pair in zip(prompts, pairs)])
        for out in outs:
            if out.pooled is None:
                raise ValueError(f"request {out.request_id} ended without a pooled output: "
                                 f"{out.outputs[0].finish_reason}")
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids,
                                     self._pooling_output(o, per_token)) for o in outs]

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        """Like generate(), for chat messages rendered with the model's chat template (which
        sees `tools`, OpenAI tool objects, when given)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        params = per_prompt(sampling_params, len(conversations), "sampling params",
                             SamplingParams())
        loras = per_prompt(lora_request, len(conversations), "LoRA requests")
        return self._run([self.add_request(None, sp, messages=conv, tools=tools,
                                           lora_request=lr)
                          for conv, sp, lr in zip(conversations, params, loras)])

    def add_request(self, prompt: Prompt | None, params: SamplingParams | None = None, *,
                    messages: list[dict] | None = None, tools: list[dict] | None = None,
                    lora_request: LoRARequest | None = None,
                    kv_transfer_params: dict | None = None, prompt_open: bool = False,
                    pooling: PoolingInput | None = None) -> str:
        """Queue one request; it runs from the next step(). Raises ValueError if it cannot be
        served (too long, bad token ids, an adapter that cannot be served, ...).
        `prompt_open`: more of the prompt follows (add_prompt_piece)."""
        req_id = str(next(self._ids))
        sampling = params or SamplingParams()
        req = TokenizeRequest(req_id=req_id, arrival_time=time.time(), sampling=sampling,
                              tools=tools, lora=self._lora(lora_request),
                              kv_transfer=request_transfer(self.config, kv_transfer_params,
                                                           sampling), prompt_open=prompt_open,
                              pooling=pooling)
        set_prompt(req, prompt, messages)
        self._prompts[req_id] = req.prompt
        self._deliver([("tokenizer", req)])
        self._prompts.pop(req_id, None)
        if req_id in self._failed:
            raise ValueError(self._failed.pop(req_id).message)
        return req_id

    def add_prompt_piece(self, req_id: str, piece: str | list[int] | None,
                         last: bool = False) -> None:
        """More of a request added with prompt_open=True; `last` closes its prompt and it
        starts generating. Raises ValueError for a piece that cannot be encoded."""
        prompt = piece_prompt(piece)
        text = prompt if isinstance(prompt, str) else None
        ids = None if text is not None else list(prompt or [])
        reply = f"{req_id}:piece"
        self._deliver([("tokenizer", TokenizePiece(req_id=req_id, reply_id=reply, prompt=text,
                                                   prompt_token_ids=ids, last=last))])
        if reply in self._failed:
            raise ValueError(self._failed.pop(reply).message)

    async def generate_streaming(self, pieces, sampling_params: SamplingParams | None = None,
                                 lora_request: LoRARequest | None = None) -> RequestOutput:
        """Generate for a prompt that arrives in pieces: an async iterator of StreamingInput,
        text or token-id lists (vLLM's streaming input). Each piece is prefilled as it comes,
        its KV kept between pieces; generation starts once the iterator ends. Cancelling
        the call aborts the request (its blocks are freed). Other requests and streamed
        prompts run alongside (each call steps the shared engine)."""
        it = aiter(pieces)
        first = await anext(it)
        first = piece_prompt(first)
        req_id = self.add_request(first, sampling_params, lora_request=lora_request,
                                  prompt_open=True)
        pending = asyncio.ensure_future(anext(it))
        try:
            while req_id not in self._streamed:
                if pending is not None and pending.done():
                    error = pending.exception()
                    if error is not None and not isinstance(error, StopAsyncIteration):
                        raise error
                    piece = None if error is not None else pending.result()
                    self.add_prompt_piece(req_id, piece, last=piece is None)
                    pending = None if piece is None else asyncio.ensure_future(anext(it))
                if self._step_if_any():
                    await asyncio.sleep(0)          # let the pieces' producers run
                elif pending is not None:
                    await asyncio.wait([pending])
                elif req_id not in self._streamed:
                    raise RuntimeError(f"streamed request {req_id} cannot run")
        except BaseException:
            if pending is not None:
                pending.cancel()
            self.abort(req_id)
            raise
        return self._streamed.pop(req_id)

    def _step_if_any(self) -> bool:
        """Run a step if one can be planned; requests that finished go to _streamed."""
        self._submit_plans()
        ran = bool(self.engine.num_in_flight)
        if ran:
            self._apply_oldest_step()
        finished, self._finished = self._finished, []
        self._streamed.update((o.request_id, o) for o in finished)
        return ran

    def _lora(self, request: LoRARequest | None) -> LoraRef | None:
        """The adapter's reference, checked the first time it is named: each distinct (name,
        int id, path) is one load of its own."""
        if request is None:
            return None
        if not self.config.lora.enable_lora:
            raise ValueError("a LoRA request needs LLM(..., enable_lora=True)")
        key = (request.lora_name, request.lora_int_id, request.lora_path)
        if key not in self._loras:
            read_adapter(request.lora_path, self.config.model.model_info,
                         self.config.lora.max_lora_rank)
            self._loras[key] = LoraRef(request.lora_name, len(self._loras) + 1,
                                       request.lora_path, adapter_digest(request.lora_path))
        return self._loras[key]

    def abort(self, req_id: str) -> None:
        """Stop a request added with add_request(); it frees its blocks and is never returned."""
        out = self._live.pop(req_id, None)
        if out is None:
            return
        ids = output_ids(req_id, len(out.outputs))
        for out_id in ids:
            self._outputs.pop(out_id, None)
        self._n.pop(req_id, None)
        self._deliver([("scheduler", Abort(ids))])

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it. With async
        scheduling the step after it is already submitted when this one's result is applied."""
        retried = False
        while True:
            self._submit_plans()
            if self.engine.num_in_flight:
                break
            if self._finished:               # a notice ended a request (a pull that failed)
                break
            if self.engine.waiting_for_arrivals():   # nothing runs until blocks come from a
                self._deliver([("scheduler", self._notices.get())])   # prefill engine (or not)
            elif retried:
                raise RuntimeError("scheduler has unfinished requests but nothing to run")
            else:                # a schedule that only preempted plans nothing: plan again
                retried = True
        if self.engine.num_in_flight:
            self._apply_oldest_step()
        finished, self._finished = self._finished, []
        return finished

    def _submit_plans(self) -> None:
        """Hand the scheduler what the KV threads said, then let the engine plan and send the
        executor every plan it may (up to the plans in flight it allows)."""
        self._take_notices()
        while self.engine.plan() is not None:
            pass

    def _take_notices(self) -> None:
        """Leases the KV server ended, pulls the puller finished: to the scheduler."""
        while not self._notices.empty():
            self._deliver([("scheduler", self._notices.get())])

    def _apply_oldest_step(self) -> None:
        """Wait for the oldest plan's result and hand it to the scheduler's engine (and the
        step's KV events to their subscribers)."""
        self._deliver([("scheduler", self.engine.next_result())])
        if self._kv_events is not None:
            batch = self.engine.core.take_kv_events()
            if batch is not None:
                self._kv_events.publish(batch)

    def _deliver(self, sends: Sends) -> None:
        """Move messages between the cores, in order, as the actors' sockets would, until
        none is left; what the server's gateway would get comes to _on_gateway()."""
        queue = deque(sends)
        while queue:
            channel, msg = queue.popleft()
            if channel == "gateway":
                self._on_gateway(msg)
                continue
            if isinstance(msg, NewRequest):
                self._start(msg)
            elif isinstance(msg, TokenDeltas):
                for d in msg.deltas:
                    if d.seq_id in self._outputs:
                        self._outputs[d.seq_id][1].token_ids += d.token_ids
            queue.extend(self.cores[channel].handle(msg))

    def _start(self, new: NewRequest) -> None:
        sampling = new.sampling
        out = RequestOutput(new.req_id, self._prompts.get(new.req_id), new.prompt_token_ids,
                            [CompletionOutput(j) for j in range(sampling.num_outputs)])
        if new.kv_transfer is not None and new.kv_transfer.remote_decode:
            out.kv_transfer_params = answer_params(self.config, new.req_id)
        self._live[new.req_id] = out
        if sampling.num_outputs > sampling.n:
            self._n[new.req_id] = sampling.n
        for j, out_id in enumerate(output_ids(new.req_id, sampling.num_outputs)):
            self._outputs[out_id] = (out, out.outputs[j])

    def _on_gateway(self, msg: TextDeltas | RequestFailed | ControlDone) -> None:
        if isinstance(msg, ControlDone):
            self._controls[msg.req_id] = msg
            return
        if isinstance(msg, RequestFailed):
            self._failed[msg.req_id] = msg
            return
        for t in msg.deltas:
            if t.seq_id not in self._outputs:       # aborted here
                continue
            out, completion = self._outputs[t.seq_id]
            completion.text += t.text
            if t.logprobs is not None:
                completion.logprobs = (completion.logprobs or []) + t.logprobs
            if t.pooled is not None:
                out.pooled = from_bytes(t.pooled).copy()
            if t.prompt_logprobs is not None and completion.index == 0:
                out.prompt_logprobs = (out.prompt_logprobs or []) + t.prompt_logprobs
            if t.finish_reason:
                del self._outputs[t.seq_id]
                completion.finish_reason = t.finish_reason
                completion.cumulative_logprob = t.cumulative_logprob
                del completion.token_ids[t.num_output_tokens:]
                if all(c.finish_reason for c in out.outputs):
                    self._finished.append(self._finalize(out))

    def _finalize(self, out: RequestOutput) -> RequestOutput:
        """All sequences are done: keep the n best of best_of (by cumulative logprob)."""
        del self._live[out.request_id]
        out.finished = True
        if out.outputs[0].finish_reason not in ("stop", "length"):
            out.kv_transfer_params = None          # no lease was made
        n = self._n.pop(out.request_id, len(out.outputs))
        out.outputs = [out.outputs[j] for j in best_of(
            [c.cumulative_logprob or 0.0 for c in out.outputs], n)]
        for j, c in enumerate(out.outputs):
            c.index = j
        return out

    def _run(self, req_ids: list[str]) -> list[RequestOutput]:
        self._take_notices()
        done: dict[str, RequestOutput] = {}
        while any(r not in done for r in req_ids):
            done.update((o.request_id, o) for o in self.step())
        while self.engine.num_in_flight:   # a step planned ahead of sequences that have ended
            self._apply_oldest_step()
        while not self._live and self.engine.has_work():   # plans of their own: leases to
            self.step()                                    # serve, blocks to store
        return [done[r] for r in req_ids]

