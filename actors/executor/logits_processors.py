"""Per-request reshaping of next-token logits before sampling, in vLLM's order: allowed token
ids, bad words, logit bias, then repetition, frequency and presence penalties. Only rows whose
request asks for one of these are touched (a Python loop over those rows only)."""
from __future__ import annotations

import torch

from pagewire.wire.sampling_params import SamplingParams


def apply_logits_processors(logits: torch.Tensor, params: list[SamplingParams],
                            histories: list[tuple[list[int], int]]) -> None:
    """logits: [S, V] float32, modified in place. histories[row] = (the row's tokens, how many
    of them are prompt)."""
    for row, (p, (tokens, num_prompt)) in enumerate(zip(params, histories)):
        if not p.has_logits_processors:
            continue
        x = logits[row]
        if p.allowed_token_ids is not None:
            keep = torch.full_like(x, float("-inf"))
            ids = torch.tensor(p.allowed_token_ids, device=x.device)
            keep[ids] = x[ids]
            x.copy_(keep)
        for word in p.bad_words_ids:
            if len(word) == 1 or _ends_with(tokens, num_prompt, word[:-1]):
                x[word[-1]] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=x.device)
            x[ids] += torch.tensor(list(p.logit_bias.values()), device=x.device)
        _apply_penalties(x, p, tokens, num_prompt)


def _ends_with(tokens: list[int], num_prompt: int, prefix: list[int]) -> bool:
    """Whether the generated tokens end with `prefix` (a bad word's all-but-last tokens)."""
    n = len(prefix)
    return len(tokens) - num_prompt >= n and tokens[len(tokens) - n:] == prefix


def _apply_penalties(x: torch.Tensor, p: SamplingParams, tokens: list[int],
                     num_prompt: int) -> None:
    """OpenAI's frequency/presence penalties count generated tokens only; the repetition
    penalty (CTRL, as vLLM) applies to every token seen, prompt included."""
    vocab = x.shape[0]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in tokens if t < vocab}), dtype=torch.long,
                            device=x.device)
        if len(seen):
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                  vals * p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        out = torch.tensor(tokens[num_prompt:], dtype=torch.long, device=x.device)
        if len(out):
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(x.dtype)
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
