"""Pooling requests as they cross the wire: a prompt read, not continued (embeddings, scores,
classification). The gateway turns an /v1/embeddings, /score, /rerank or /classify body into
TokenizeRequests carrying a PoolingInput; the tokenizer encodes them (a cross-encoder's pair as
one input) and sends a NewRequest carrying a PoolingSeq; the scheduler runs the prompt as a
prefill that samples nothing; the executor returns the model's pooled output in the step
result's `pooled` section; the final TokenDelta / TextDelta carry it back. A per-token request
(vLLM's token_embed) is answered with every prompt token's final hidden state instead: one
payload of [prompt tokens, hidden] float32 rows, row-major. What the client asked
of the vector (normalisation, Matryoshka dimensions, encoding, a classifier's activation) is the
gateway's: the engine returns the model's raw pooled output, float32."""
from __future__ import annotations

import msgspec
import numpy as np

from .ids import SeqId


class PoolingInput(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """TokenizeRequest section. `pair`: the second text of a cross-encoder's (query,
    document) pair, encoded with the prompt as one input (token type 1 from its first token);
    `truncate_prompt_tokens`: keep at most this many tokens (-1: max_model_len), else a prompt
    over max_model_len is refused; `per_token`: every prompt token's hidden state, not one
    pooled vector (vLLM's token_embed)."""
    pair: str | None = None
    truncate_prompt_tokens: int | None = None
    per_token: bool = False


class PoolingSeq(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """NewRequest / NewSeq section: this sequence is pooled once its prompt is computed,
    never sampled. `pair_start`: the index of a pair's second text's first token (its token
    type is 1 from there: BERT's segment B); 0 for a single text. `per_token`: the output
    is every prompt token's final hidden state, so every position must be computed here (no
    prefix-cache hit, no swap: a preempted sequence recomputes) and the executor keeps each
    chunk's rows until the last one."""
    pair_start: int = 0
    per_token: bool = False


class PooledResult(msgspec.Struct, array_like=True, gc=False):
    """StepResult section: each pooled sequence whose prompt this step finished, and the
    model's pooled output (an embedding, or a classifier's logits) as float32 bytes; a
    per-token sequence's [prompt tokens, hidden] rows, row-major."""
    vectors: dict[SeqId, bytes]


def to_bytes(vector) -> bytes:
    """A float vector (numpy or list) as the wire carries it: float32, little-endian."""
    return np.asarray(vector, dtype="<f4").tobytes()


def from_bytes(data: bytes) -> np.ndarray:
    """The float32 vector back (read-only view of the bytes)."""
    return np.frombuffer(data, dtype="<f4")


def token_rows(data: bytes, num_tokens: int) -> np.ndarray:
    """A per-token output back: [num_tokens, hidden] (read-only view of the bytes)."""
    return from_bytes(data).reshape(num_tokens, -1)
