"""The offline API: LLM(model).generate(prompts, SamplingParams(...)).

Runs the same tokenizer, scheduler, executor and detokenizer code as the server, in this
process and without sockets: a batch job pays no IPC and needs no run directory.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from pagewire.wire.sampling import SamplingParams, output_ids
from pagewire.wire.to_detokenizer import TokenDeltas
from pagewire.wire.to_gateway import RequestFailed
from pagewire.wire.to_tokenizer import ChatMessage, TokenizeRequest

from .config import EngineConfig
from .detokenizer import Detokenizer
from .executor.runner import ModelRunner
from .hf_tokenizer import load_tokenizer
from .scheduler.scheduler import Scheduler
from .tokenizer import RequestTokenizer

Prompt = str | list[int] | dict


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


class LLM:
    """An engine in this process. Keyword options are EngineConfig's (dtype, max_model_len,
    max_num_seqs, block_size, kv_cache_memory, ...)."""

    def __init__(self, model: str | None = None, **options):
        self.config = EngineConfig(model=model, **options).resolve()
        self.tokenizer = load_tokenizer(self.config.model_info)
        self.request_tokenizer = RequestTokenizer(self.config, self.tokenizer)
        self.scheduler = Scheduler(self.config)
        self.runner = ModelRunner(self.config)
        self.detokenizer = Detokenizer(self.tokenizer)
        self._ids = itertools.count()
        self._live: dict[str, RequestOutput] = {}
        self._outputs: dict[str, tuple[RequestOutput, CompletionOutput]] = {}   # by output id
        self._n: dict[str, int] = {}           # requests generating more sequences than n

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt (greedy by default); outputs in prompt order. A prompt is
        text, a list of token ids, or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        return self._run([self.add_request(p, sp) for p, sp in zip(prompts, params)])

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             ) -> list[RequestOutput]:
        """Like generate(), for chat messages rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        params = _per_prompt(sampling_params, len(conversations))
        return self._run([self.add_request(None, sp, messages=conv)
                          for conv, sp in zip(conversations, params)])

    def add_request(self, prompt: Prompt | None, params: SamplingParams | None = None, *,
                    messages: list[dict] | None = None) -> str:
        """Queue one request; it runs from the next step(). Raises ValueError if it cannot be
        served (too long, bad token ids, ...)."""
        req_id = str(next(self._ids))
        req = TokenizeRequest(req_id=req_id, arrival_time=time.time(),
                              sampling=params or SamplingParams())
        if messages is not None:
            req.messages = [ChatMessage(**m) for m in messages]
        elif isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids = list(prompt["prompt_token_ids"] if isinstance(prompt, dict)
                                        else prompt)
        result = self.request_tokenizer.process(req)
        if isinstance(result, RequestFailed):
            raise ValueError(result.message)
        start, new = result
        sampling = new.sampling
        out = RequestOutput(req_id, req.prompt, new.prompt_token_ids,
                            [CompletionOutput(j) for j in range(sampling.num_outputs)])
        self._live[req_id] = out
        if sampling.num_outputs > sampling.n:
            self._n[req_id] = sampling.n
        for j, out_id in enumerate(output_ids(req_id, sampling.num_outputs)):
            self._outputs[out_id] = (out, out.outputs[j])
        self.detokenizer.start(start)
        self.scheduler.add(new)
        return req_id

    def abort(self, req_id: str) -> None:
        """Stop a request added with add_request(); it frees its blocks and is never returned."""
        out = self._live.pop(req_id, None)
        if out is None:
            return
        ids = output_ids(req_id, len(out.outputs))
        for out_id in ids:
            self._outputs.pop(out_id, None)
        self._n.pop(req_id, None)
        self.detokenizer.on_deltas(TokenDeltas(self.scheduler.abort(ids)))

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it."""
        plan = self.scheduler.schedule()
        if plan is None:
            raise RuntimeError("scheduler has unfinished requests but nothing to run")
        deltas = self.scheduler.update(self.runner.execute(plan))
        for d in deltas:
            self._outputs[d.req_id][1].token_ids += d.token_ids
        texts, aborts = self.detokenizer.on_deltas(TokenDeltas(deltas))
        if aborts:
            self.detokenizer.on_deltas(TokenDeltas(self.scheduler.abort(aborts)))
        finished = []
        for t in texts:
            out, completion = self._outputs[t.req_id]
            completion.text += t.text
            if t.logprobs is not None:
                completion.logprobs = (completion.logprobs or []) + t.logprobs
            if t.prompt_logprobs is not None and completion.index == 0:
                out.prompt_logprobs = (out.prompt_logprobs or []) + t.prompt_logprobs
            if t.finish_reason:
                del self._outputs[t.req_id]
                completion.finish_reason = t.finish_reason
                completion.cumulative_logprob = t.cumulative_logprob
                del completion.token_ids[t.num_output_tokens:]
                if all(c.finish_reason for c in out.outputs):
                    finished.append(self._finalize(out))
        return finished

    def _finalize(self, out: RequestOutput) -> RequestOutput:
        """All sequences are done: keep the n best of best_of (by cumulative logprob)."""
        del self._live[out.request_id]
        out.finished = True
        n = self._n[out.request_id] if out.request_id in self._n else len(out.outputs)
        if n < len(out.outputs):
            out.outputs = sorted(out.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))[:n]
            for j, c in enumerate(out.outputs):
                c.index = j
        self._n.pop(out.request_id, None)
        return out

    def _run(self, req_ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while any(r not in done for r in req_ids):
            done.update((o.request_id, o) for o in self.step())
        return [done[r] for r in req_ids]


def _per_prompt(params, n: int) -> list[SamplingParams]:
    params = params if isinstance(params, list) else [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError(f"{n} prompts but {len(params)} sampling params")
    return params
