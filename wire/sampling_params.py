"""SamplingParams: how one request's tokens are chosen and when it stops.

The same struct is the user-facing `pagewire.SamplingParams` and the value that crosses the wire
(tokenizer -> scheduler -> executor, once per request). Construction validates; an invalid value
raises InvalidParam naming the field, which the gateway turns into a 400.
"""
from __future__ import annotations

import msgspec

from .structured import StructuredOutputsParams

_GREEDY_EPS = 1e-5


class InvalidParam(ValueError):
    """A request field holds a value the engine cannot honour."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1                       # outputs returned
    best_of: int | None = None       # sequences generated (the n with the best logprob return)
    use_beam_search: bool = False    # beam width max(n, best_of); returns the n best beams
    length_penalty: float = 1.0      # beam score = cumulative logprob / length ** penalty
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                   # 0 or -1: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16      # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = []             # stop strings, matched on detokenized text
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None      # None: none; 0: the sampled token's; k: and the top k
    prompt_logprobs: int | None = None   # the same for every prompt token after the first
    presence_penalty: float = 0.0    # subtracted once from every token already generated
    frequency_penalty: float = 0.0   # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides (positive) / multiplies (negative) logits of
                                     # tokens in the prompt or generated
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []        # never completed (the tokenizer fills bad_words_ids)
    bad_words_ids: list[list[int]] = []
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last k tokens
    structured_outputs: StructuredOutputsParams | None = None   # what the output must match
    kv_compress_rate: float | None = None   # KV-Compress: the share of its KV kept; None:
                                            # the engine's --kv-compress-rate

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _check(self.best_of is None or self.best_of >= self.n, "best_of",
               f"best_of must be at least n ({self.n}), got {self.best_of}")
        _check(self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.kv_compress_rate is None or 0 < self.kv_compress_rate <= 1,
               "kv_compress_rate", f"kv_compress_rate must be in (0, 1], got "
               f"{self.kv_compress_rate}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "token ids must be >= 0")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", "logprobs must be >= 0")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
               "prompt_logprobs must be >= 0")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty",
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0, "repetition_penalty",
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(all(-100 <= b <= 100 for b in (self.logit_bias or {}).values()), "logit_bias",
               "logit_bias values must be in [-100, 100]")
        _check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
               "allowed_token_ids", "allowed_token_ids must not be empty")
        _check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
               "truncate_prompt_tokens", "truncate_prompt_tokens must be >= 1")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", "seed must be in [0, 2**63)")
        if self.structured_outputs is not None:
            self._check_constrained()

    def _check_constrained(self) -> None:
        """A constrained output ends where its grammar does: EOS is allowed exactly where
        the grammar accepts, so nothing may ban it or ignore it."""
        for name, clash in (("use_beam_search", self.use_beam_search),
                            ("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens)):
            _check(not clash, name, f"{name} cannot be combined with structured outputs "
                   "(the grammar decides where the output ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_logits_processors(self) -> bool:
        """Whether anything but temperature/top-k/top-p/min-p reshapes the logits."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias
                    or self.allowed_token_ids is not None or self.bad_words_ids)

    @property
    def can_speculate(self) -> bool:
        """Whether its decodes may verify draft tokens (speculative decoding): not for beam
        search, whose next tokens the scheduler picks."""
        return not self.use_beam_search

    @property
    def num_sequences(self) -> int:
        """Sequences the engine generates for one prompt: the beam width for beam search,
        else best_of (or n)."""
        return max(self.n, self.best_of or 0)

    @property
    def num_outputs(self) -> int:
        """Sequences reported back: the n best beams, or every sampled sequence (the
        gateway keeps the n best of best_of)."""
        return self.n if self.use_beam_search else self.num_sequences


def stops_on(s: SamplingParams, token: int, num_output_tokens: int,
             eos_ids: frozenset[int]) -> bool:
    """Whether `token`, a sequence's num_output_tokens-th output, ends it with "stop". The
    scheduler finishes sequences by this rule and the executor stops planning-ahead rows by
    it (a pipelined step runs after the one that sampled the stop): they must agree."""
    if num_output_tokens <= s.min_tokens:       # the executor masks stop tokens before that
        return False
    return (token in eos_ids and not s.ignore_eos) or token in s.stop_token_ids


def best_of(cumulative_logprobs: list[float], n: int) -> list[int]:
    """Which of a request's sequences it returns, in order: all of them when it generated n;
    else (best_of) the n with the highest cumulative logprob, best first, ties in order."""
    indices = list(range(len(cumulative_logprobs)))
    if len(indices) <= n:
        return indices
    return sorted(indices, key=lambda i: -cumulative_logprobs[i])[:n]


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParam(param, message)


class LogprobsChunk(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities of consecutive tokens: token_ids[i] had logprobs[i] under the model;
    top_ids[i] / top_logprobs[i] are the k most likely tokens at that position ([] when no
    top-k was asked)."""
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
