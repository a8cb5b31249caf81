"""The executor's part of per-token pooling (vLLM's token_embed, wire/pooling.py): a pooled
sequence whose request asks for every prompt token's final hidden state. A prompt may run over
several steps (chunked prefill); each step's rows are written at their positions into the
sequence's buffer (SeqState.token_rows, [prompt tokens, hidden] float32 on the host), and the
step that computes its last token sends the whole buffer as one payload. The scheduler never
maps a cached prefix for such a sequence and preempts it by recompute, so every position is
computed by this executor after the sequence was (re)added, and the buffer, which lives and dies
with the SeqState, is full when the last chunk lands."""
from __future__ import annotations

import numpy as np
import torch

from pagewire.wire.ids import SeqId
from pagewire.wire.pooling import PooledResult, to_bytes


def per_token(seq) -> bool:
    """Whether this sequence (an executor SeqState) pools every prompt token."""
    return seq.pooling is not None and seq.pooling.per_token


def keep_rows(seq, rows: np.ndarray, start: int) -> None:
    """Write a step's rows [n, H] (float32) of seq's prompt at positions start..start+n."""
    if seq.token_rows is None:
        if start:        # the scheduler's promise (no cached prefix, no swap) was broken
            raise RuntimeError(f"a per-token pooled prompt must be computed from its first "
                               f"token here; this one arrived with {start} computed")
        seq.token_rows = np.zeros((seq.num_prompt_tokens, rows.shape[1]), dtype="<f4")
    seq.token_rows[start:start + len(rows)] = rows


def pooled_result(hidden: torch.Tensor, pooled: list, pool_last) -> PooledResult | None:
    """The step's pooled outputs. `pooled`: (seq id, SeqState, first row, rows) of every
    pooling sequence this step ran; `pool_last(states [R, H])` -> those states' outputs
    (an embedding model's: each row through its Dense modules, if any, as vLLM's token_embed
    projects every token). A per-token sequence keeps its rows each step and is sent whole
    once its last token ran; a last-token one is sent from its last step only."""
    vectors: dict[SeqId, bytes] = {}
    last = [(sid, row + n - 1) for sid, seq, row, n in pooled
            if seq.samples and not per_token(seq)]
    if last:
        out = pool_last(hidden[[row for _, row in last]]).cpu().numpy()
        vectors.update({sid: to_bytes(v) for (sid, _), v in zip(last, out)})
    for sid, seq, row, n in pooled:
        if per_token(seq):
            keep_rows(seq, pool_last(hidden[row:row + n]).float().cpu().numpy(),
                      seq.num_computed)
            if seq.samples:
                vectors[sid] = seq.token_rows.tobytes()
    return PooledResult(vectors) if vectors else None
