"""The executor's grammar matchers: one per constrained sequence, built from the grammar the
tokenizer actor compiled (actors/grammar_compiler.py), advanced by each token the sequence samples.

A sequence that arrives in a NewSeq (new, forked, or back after preemption) gets a fresh
matcher that consumes its output tokens so far, so forks and recomputes need no matcher state
on the wire. Each step the bitmasks of the constrained rows are filled on a thread while the
model runs (llguidance releases the GIL and splits the rows over its own threads), and the
sampler applies them before any other choice (executor/sampler.py).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
from collections import OrderedDict

import llguidance
import llguidance.numpy
import numpy as np

from pagewire.wire.structured import StructuredOutputsParams

from ..grammar_compiler import find, llg_tokenizer
from ..hf_tokenizer import load_tokenizer

_PRISTINE_ENTRIES = 256      # unstarted matchers kept by grammar digest (copied per sequence)


class Matchers:
    """Builds matchers and fills their bitmasks. The tokenizer is loaded on the first
    constrained sequence, not at start: engines that never see one never pay for it."""

    def __init__(self, model_info, vocab_size: int, eos_ids):
        self._tokenizer_args = (model_info, vocab_size, tuple(eos_ids))
        self._llg_tokenizer = None
        self._pristine: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()
        self._threads = llguidance.LLExecutor()
        self._filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="masks")

    def start(self, so: StructuredOutputsParams,
              outputs: list[int]) -> llguidance.LLMatcher | None:
        """A matcher for the constraint that has consumed `outputs` (in an error state if
        they do not match: the caller reads is_error()); those after so.start_after when that
        is set, and None while the outputs have not reached it (still reasoning)."""
        if so.start_after:
            at = find(outputs, so.start_after)
            if at < 0:
                return None
            outputs = outputs[at + len(so.start_after):]
        grammar = so.compiled
        key = hashlib.sha256(grammar.encode()).digest()
        pristine = self._pristine.get(key)
        if pristine is None:
            if self._llg_tokenizer is None:
                info, vocab_size, eos_ids = self._tokenizer_args
                self._llg_tokenizer = llg_tokenizer(load_tokenizer(info), vocab_size, eos_ids)
            pristine = self._pristine[key] = llguidance.LLMatcher(
                self._llg_tokenizer, grammar, log_level=0)
            if len(self._pristine) > _PRISTINE_ENTRIES:
                self._pristine.popitem(last=False)
        self._pristine.move_to_end(key)
        matcher = pristine.deep_copy()
        if outputs:
            matcher.consume_tokens(outputs)
        return matcher

    @staticmethod
    def at_positions(matcher: llguidance.LLMatcher,
                     drafts: list[int]) -> list[llguidance.LLMatcher]:
        """The matcher's state at each position of a row verifying `drafts`: as it is, then
        after each draft (copies; the sequence's own matcher advances only over the tokens
        the step keeps)."""
        states = [matcher]
        for token in drafts:
            state = states[-1].deep_copy()
            state.consume_token(token)
            states.append(state)
        return states

    def fill_async(self, matchers: list[llguidance.LLMatcher]) -> concurrent.futures.Future:
        """A future of the bitmasks [len(matchers), ceil(V / 32)] int32 (V: the llguidance
        tokenizer's width, at least the logits'): bit t of row r set where matchers[r]
        allows token t."""
        return self._filler.submit(self._fill, matchers)

    def _fill(self, matchers: list[llguidance.LLMatcher]) -> np.ndarray:
        width = self._llg_tokenizer.vocab_size
        masks = llguidance.numpy.allocate_token_bitmask(len(matchers), width)
        llguidance.numpy.fill_next_token_bitmask_par(
            self._threads, [(m, r) for r, m in enumerate(matchers)], masks)
        for r, m in enumerate(matchers):
            if m.is_error():        # allow all: the sampled token then fails the sequence
                masks[r] = -1
        return masks

