"""Log-probabilities of prompt tokens (the prompt_logprobs request field).

The hidden state at prompt position p predicts token p + 1, so a prefill span covering
positions [start, start + n) yields the logprobs of prompt tokens start + 1 .. start + n (those
that are still prompt). Logits are computed in chunks: a whole prompt's worth at once would
be prompt length x vocabulary floats.
"""
from __future__ import annotations

import torch

from pagewire.wire.ids import SeqId
from pagewire.wire.sampling_params import LogprobsChunk

_CHUNK_ROWS = 256


def prompt_logprobs(model, hidden: torch.Tensor,
                    spans: list[tuple[SeqId, int, list[int], int]]) -> dict[SeqId, LogprobsChunk]:
    """spans: (sequence, first hidden row, target token ids, top k). Returns each sequence's
    chunk: targets[i] is predicted by hidden row first_row + i."""
    out = {}
    for sid, first_row, targets, k in spans:
        lps, top_ids, top_lps = [], [], []
        for i in range(0, len(targets), _CHUNK_ROWS):
            tgt = torch.tensor(targets[i:i + _CHUNK_ROWS], device=hidden.device)
            rows = hidden[first_row + i:first_row + i + len(tgt)]
            logprobs = torch.log_softmax(model.compute_logits(rows), dim=-1)   # [n, V]
            lps += logprobs.gather(1, tgt[:, None]).squeeze(1).tolist()
            if k:
                values, indices = logprobs.topk(k, dim=-1)
                top_ids += indices.tolist()
                top_lps += values.tolist()
            else:
                top_ids += [[] for _ in tgt]
                top_lps += [[] for _ in tgt]
        out[sid] = LogprobsChunk(list(targets), lps, top_ids, top_lps)
    return out


def spans_of(rows: list[tuple[SeqId, object, int]]) -> list[tuple[SeqId, int, list[int], int]]:
    """The prompt-logprob spans of a step, from (sequence, SeqState, first row) of every
    scheduled sequence; only sequences whose request asked and whose span covers prompt
    positions before the last one contribute."""
    spans = []
    for sid, seq, row in rows:
        k = seq.sampling.prompt_logprobs
        start, n = seq.num_computed, seq.num_scheduled
        end = min(start + n, seq.num_prompt_tokens - 1)
        if k is not None and end > start:
            spans.append((sid, row, seq.token_ids[start + 1:end + 1], k))
    return spans
