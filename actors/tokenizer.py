"""The tokenizer actor: chat template, encoding and length checks. Stateless; several may run.

A request that cannot be served is answered from here (RequestFailed straight to the gateway)
and never reaches the scheduler. Otherwise the detokenizer learns of the request first
(DetokStart), then the scheduler gets it (NewRequest). A request with structured outputs
waits here for its grammar (actors/grammar_compiler.py): compiled on a thread pool while the actor
goes on with other messages, and a bad or too slow constraint is a 400 from here.
"""
from __future__ import annotations

import time

import msgspec

from pagewire.wire.channels import Sends
from pagewire.wire.pooling import PoolingSeq
from pagewire.wire.sampling_params import InvalidParam, SamplingParams
from pagewire.wire.structured import InvalidConstraint
from pagewire.wire.to_detokenizer import DetokStart, PromptGrew, detok_start
from pagewire.wire.to_gateway import DetokenizeReply, RequestFailed, TokenizeReply
from pagewire.wire.to_scheduler import NewRequest, PromptPiece
from pagewire.wire.to_tokenizer import (DetokenizeOnly, TokenizeOnly, TokenizePiece,
                                        TokenizeRequest, TokenizerInbox)

from .config import EngineConfig
from .gateway import harmony
from .grammar_compiler import COMPILE_TIMEOUT_S, GrammarCompiler, find, result_of
from .hf_tokenizer import load_tokenizer
from .pooling_prompts import encode_pooled
from .image_inputs import ImagePreparer

_NO_SAMPLING = SamplingParams()


class RequestTokenizer:
    """The tokenizer core: turns a TokenizeRequest into (DetokStart, NewRequest), or a
    RequestFailed; handle() takes any inbox message and returns what to send where. With
    `background`, a request whose grammar is still compiling is held and poll() returns it
    once compiled; without, handle() waits for the compile."""

    def __init__(self, config: EngineConfig, tokenizer, background: bool = False):
        self.tokenizer = tokenizer
        self.max_model_len = config.model.max_model_len
        self.vocab_size = config.model.model_info.vocab_size
        self.kv_compress = config.cache.kv_compress_rate is not None
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size,
                                        config.model.model_info.eos_token_ids)
        self.background = background
        # With a reasoning parser, a constraint applies from the end of the <think> block
        # (gpt-oss: from the final channel's <|message|>, special tokens of its vocabulary).
        parser = config.server.reasoning_parser
        end = harmony.FINAL_START if parser == "openai_gptoss" else "</think>"
        self.reasoning_end = tokenizer.encode(end, add_special_tokens=False) if parser else None
        if config.server.chat_template is not None:       # --chat-template: in place of the model's
            with open(config.server.chat_template) as f:
                tokenizer.chat_template = f.read()
        self.compiling: list[tuple] = []      # (future, DetokStart, NewRequest, deadline)
        self.images = ImagePreparer.of(config.model.model_info, tokenizer)   # None: text only

    def handle(self, msg: TokenizeRequest | TokenizeOnly | DetokenizeOnly) -> Sends:
        if isinstance(msg, TokenizeOnly):
            return [("gateway", self.tokenize_only(msg))]
        if isinstance(msg, DetokenizeOnly):
            return [("gateway", self.detokenize_only(msg))]
        if isinstance(msg, TokenizePiece):
            return self.piece(msg)
        result = self.process(msg)
        if isinstance(result, RequestFailed):
            return [("gateway", result)]
        start, new = result
        so = new.sampling.structured_outputs
        if so is None:             # the detokenizer first: it then rarely sees tokens before it
            return [("detokenizer", start), ("scheduler", new)]
        future = self.grammars.submit(so)
        if self.background and not future.done():
            self.compiling.append((future, start, new, time.monotonic() + COMPILE_TIMEOUT_S))
            return []
        return self._with_grammar(future, start, new, COMPILE_TIMEOUT_S)

    def poll(self) -> Sends:
        """The held requests whose grammar compiled, failed or ran out of time."""
        sends, held, now = [], [], time.monotonic()
        for future, start, new, deadline in self.compiling:
            if future.done() or now >= deadline:
                sends += self._with_grammar(future, start, new)
            else:
                held.append((future, start, new, deadline))
        self.compiling = held
        return sends

    def _with_grammar(self, future, start: DetokStart, new: NewRequest,
                      timeout: float = 0.0) -> Sends:
        so = new.sampling.structured_outputs
        try:
            grammar = result_of(future, so, timeout)
        except InvalidConstraint as e:
            return [("gateway", RequestFailed(req_id=new.req_id, status=400, message=str(e),
                                              param="structured_outputs"))]
        sampling = msgspec.structs.replace(new.sampling, structured_outputs=msgspec.structs.replace(
            so, compiled=grammar, start_after=self.start_after(new.prompt_token_ids)))
        return [("detokenizer", start),
                ("scheduler", msgspec.structs.replace(new, sampling=sampling))]

    def process(self, req: TokenizeRequest) -> tuple[DetokStart, NewRequest] | RequestFailed:
        try:
            if req.pooling is not None:
                return self.process_pooled(req)
            ids = self.encode(req)
            ids, images = self.with_images(ids, req.images)
            if req.sampling.truncate_prompt_tokens is not None:
                ids = ids[-req.sampling.truncate_prompt_tokens:]
            self.check_length(ids, req.sampling.max_tokens)
            self.check_token_ids(req.sampling)
            s = self.with_bad_words_ids(req.sampling)
            if req.prompt_open:
                self.check_streamable(s)
            self.check_compressible(s)
        except InvalidParam as e:
            return RequestFailed(req_id=req.req_id, status=400, message=str(e), param=e.param)
        except Exception as e:  # a template error, an unencodable prompt: the client's problem
            return RequestFailed(req_id=req.req_id, status=400, message=f"{type(e).__name__}: {e}")
        echo = None
        if req.echo:
            echo = self.tokenizer.decode(ids, skip_special_tokens=False) \
                if req.prompt is None or s.truncate_prompt_tokens else req.prompt
        start = detok_start(req.req_id, ids, s, echo_prompt=echo)
        return start, NewRequest(req_id=req.req_id, prompt_token_ids=ids, sampling=s,
                                 arrival_time=req.arrival_time, cache_salt=req.cache_salt,
                                 priority=req.priority, lora=req.lora,
                                 kv_transfer=req.kv_transfer, prompt_open=req.prompt_open,
                                 images=images)

    def process_pooled(self, req: TokenizeRequest) -> tuple[DetokStart, NewRequest]:
        """A prompt to pool (pooling_prompts.py): nothing to sample, so no sampling checks;
        an invalid input raises InvalidParam (process() answers it)."""
        images = []
        if req.messages is not None:                # vLLM's chat embeddings: one input
            req = self.flattened(req)
        if req.images:                              # an image to embed (CLIP)
            if not hasattr(self.images, "pooled") or req.prompt or req.prompt_token_ids:
                raise InvalidParam("input", "this model embeds no images" if not hasattr(
                    self.images, "pooled") else "an image is embedded alone, without text")
            if req.pooling.per_token:
                raise InvalidParam("task", "token_embed reads a text's tokens; an image is "
                                   "embedded whole (task embed)")
            ids, images = self.images.pooled(req.images)
            pooling = PoolingSeq()
        else:
            ids, pooling = encode_pooled(self.tokenizer, req, self.max_model_len,
                                         self.vocab_size)
        start = detok_start(req.req_id, ids, req.sampling, pooled=True)
        return start, NewRequest(req_id=req.req_id, prompt_token_ids=ids, sampling=req.sampling,
                                 arrival_time=req.arrival_time, cache_salt=req.cache_salt,
                                 priority=req.priority, lora=req.lora, pooling=pooling,
                                 images=images)

    def flattened(self, req: TokenizeRequest) -> TokenizeRequest:
        """A pooled chat's messages as one prompt: rendered by the chat template where the
        model has one, else their texts joined by newlines (CLIP's)."""
        if self.tokenizer.chat_template is not None and not req.images:
            ids = self.encode_chat(req)
            return msgspec.structs.replace(req, messages=None, prompt_token_ids=ids)
        text = "\n".join(m.content for m in req.messages if m.content)
        return msgspec.structs.replace(req, messages=None, prompt=text or None)

    def with_images(self, ids: list[int], files: list[bytes]) -> tuple[list[int], list]:
        """The prompt with its images' rows (image_inputs.py), and the images."""
        if self.images is None:
            if files:
                raise InvalidParam("messages", "this model takes no images")
            return ids, []
        return self.images.expand(ids, files)

    def piece(self, msg: TokenizePiece) -> Sends:
        """More of an open prompt, encoded on its own (no special tokens): to the scheduler,
        which runs it in arrival order (one tokenizer takes a session's messages: the
        gateway routes them by request id)."""
        if msg.prompt_token_ids is not None:
            ids = list(msg.prompt_token_ids)
            try:
                self.check_prompt_ids(ids)
            except InvalidParam as e:
                return [("gateway", RequestFailed(req_id=msg.reply_id, status=400,
                                                  message=str(e), param=e.param))]
        else:
            ids = self.tokenizer.encode(msg.prompt or "", add_special_tokens=False)
        return [("detokenizer", PromptGrew(msg.req_id, len(ids))),
                ("scheduler", PromptPiece(msg.req_id, ids, msg.last))]

    @staticmethod
    def check_streamable(s: SamplingParams) -> None:
        """What a streamed prompt (prompt_open) cannot have: several outputs to fork from the
        prompt, and a grammar, which would hold the request here while its pieces go on."""
        if s.num_sequences > 1 or s.use_beam_search:
            raise InvalidParam("n", "a streamed prompt takes n = 1 (no best_of, no beam search)")
        if s.structured_outputs is not None:
            raise InvalidParam("structured_outputs", "structured outputs are not supported "
                               "with a streamed prompt")

    def check_compressible(self, s: SamplingParams) -> None:
        """KV-Compress evicts a sequence's own KV: nothing shared between sequences (n > 1,
        beams) can be compressed, and a rate means nothing to an engine that keeps all."""
        if not self.kv_compress:
            if s.kv_compress_rate is not None:
                raise InvalidParam("kv_compress_rate", "this engine keeps all KV: start it "
                                   "with --kv-compress-rate to compress")
        elif s.num_sequences > 1 or s.use_beam_search:
            raise InvalidParam("n", "with KV-Compress a request has one sequence: n = 1, no "
                               "best_of, no beam search")

    def start_after(self, prompt: list[int]) -> list[int] | None:
        """Where a constraint starts: after the reasoning block, unless the prompt closed it
        already (a template with thinking switched off writes an empty block)."""
        end = self.reasoning_end
        if not end or find(prompt[-len(end) - 8:], end) >= 0:
            return None
        return end

    def check_token_ids(self, s) -> None:
        """Token ids in the sampling fields must exist: the executor indexes logits by them."""
        for name, ids in (("logit_bias", list(s.logit_bias or {})),
                          ("allowed_token_ids", s.allowed_token_ids or []),
                          ("stop_token_ids", s.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidParam(name, f"{name}: token id {bad[0]} is out of range "
                                         f"[0, {self.vocab_size})")

    def tokenize_only(self, msg: TokenizeOnly) -> TokenizeReply | RequestFailed:
        try:
            if msg.messages is not None:
                ids = self.encode_chat(TokenizeRequest(
                    req_id=msg.req_id, arrival_time=0.0, sampling=_NO_SAMPLING,
                    messages=msg.messages, add_generation_prompt=msg.add_generation_prompt,
                    continue_final_message=msg.continue_final_message,
                    chat_template_kwargs=msg.chat_template_kwargs, tools=msg.tools))
                if self.images is not None:      # an image's rows counted, none read
                    ids = self.images.widen(ids)
            else:
                ids = self.tokenizer.encode(msg.prompt or "",
                                            add_special_tokens=msg.add_special_tokens)
        except Exception as e:
            return RequestFailed(req_id=msg.req_id, status=400, message=f"{type(e).__name__}: {e}")
        return TokenizeReply(msg.req_id, ids, self.tokenizer.convert_ids_to_tokens(ids))

    def detokenize_only(self, msg: DetokenizeOnly) -> DetokenizeReply | RequestFailed:
        bad = [t for t in msg.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return RequestFailed(req_id=msg.req_id, status=400, param="tokens",
                                 message=f"token id {bad[0]} is out of range [0, {self.vocab_size})")
        return DetokenizeReply(msg.req_id, self.tokenizer.decode(msg.token_ids))

    def with_bad_words_ids(self, s):
        """Token sequences of each bad word, as it would start a text and after a space."""
        if not s.bad_words:
            return s
        seqs = []
        for word in s.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                # ids the model cannot produce (a tokenizer wider than the model) never match
                if ids and ids not in seqs and max(ids) < self.vocab_size:
                    seqs.append(ids)
        return msgspec.structs.replace(s, bad_words_ids=seqs)

    def encode(self, req: TokenizeRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            ids = list(req.prompt_token_ids)
            self.check_prompt_ids(ids)
        elif req.messages is not None:
            ids = self.encode_chat(req)
        else:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=True)
        if not ids:
            raise InvalidParam("prompt", "the prompt is empty")
        if max(ids) >= self.vocab_size:      # a tokenizer wider than the model's embedding
            raise InvalidParam("prompt", f"the prompt encodes to token {max(ids)}, past the "
                                         f"model's vocabulary of {self.vocab_size}")
        return ids

    def check_prompt_ids(self, ids: list[int]) -> None:
        """A prompt given as token ids names only tokens of the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParam("prompt", f"token id {bad[0]} is out of range "
                                         f"[0, {self.vocab_size})")

    def with_placeholders(self, message) -> str:
        """A message's text with the model's image placeholder where each image part was."""
        text = message.content or ""
        if not message.image_slots:
            return text
        if self.images is None:
            raise InvalidParam("messages", "this model takes no images")
        mark = self.images.mark()
        for at in reversed(message.image_slots):
            text = text[:at] + mark + text[at:]
        return text

    def encode_chat(self, req: TokenizeRequest) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise InvalidParam("messages", "this model has no chat template; use /v1/completions")
        messages = [msgspec.structs.asdict(m) | {"content": self.with_placeholders(m)}
                    for m in req.messages]
        messages = [{k: v for k, v in m.items() if v is not None and k != "image_slots"}
                    for m in messages]
        kwargs = dict(req.chat_template_kwargs)
        if req.tools:
            kwargs["tools"] = req.tools
        add_generation_prompt = kwargs.pop("add_generation_prompt", req.add_generation_prompt)
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=req.continue_final_message, **kwargs)
        # The template already wrote the special tokens it wants.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_length(self, ids: list[int], max_tokens: int | None) -> None:
        limit = self.max_model_len
        if len(ids) >= limit:
            raise InvalidParam("prompt", f"This model's maximum context length is {limit} tokens. "
                               f"However, your prompt has {len(ids)} tokens, leaving no room "
                               "for output.")
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise InvalidParam("max_tokens", f"This model's maximum context length is {limit} "
                               f"tokens. However, you requested {len(ids) + max_tokens} tokens "
                               f"({len(ids)} in the prompt, {max_tokens} for the completion).")


def prepare(config: EngineConfig) -> RequestTokenizer:
    """The slow part of a start (transformers, the model's tokenizer), which a warm spare
    does ahead (process.py)."""
    return RequestTokenizer(config, load_tokenizer(config.model.model_info), background=True)


def run(env, prepared: RequestTokenizer | None = None) -> None:
    tokenizer = prepared if prepared is not None else prepare(env.config)
    inbox = env.pull(f"tokenizer-{env.index}", TokenizerInbox)
    pushes = {name: env.push(name) for name in ("scheduler", "detokenizer", "gateway")}
    env.ready()
    while True:
        msg = inbox.recv(timeout_ms=5 if tokenizer.compiling else 1000)
        env.heartbeat()
        sends = tokenizer.handle(msg) if msg is not None else []
        for channel, out in sends + tokenizer.poll():
            pushes[channel].send(out)
