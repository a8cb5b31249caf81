"""What a request asks of a pooling model's raw output (wire/pooling.py: the engine returns the
model's pooled float32 vector untouched): Matryoshka truncation, L2 normalisation, a
classifier's activation, cosine and cross-encoder scores, base64 encoding. Shared by the
gateway's routes (gateway/pooling_routes.py) and the offline LLM (llm_pooling.py), so both
answer alike; numpy only (the gateway loads no torch)."""
from __future__ import annotations

import base64

import numpy as np

from pagewire.wire.sampling_params import InvalidParam

from .pooler_info import (CLASSIFY, EMBED, NO_ACTIVATION, SIGMOID, SOFTMAX, TOKEN_CLASSIFY,
                          PoolerInfo)
from .vector_encoding import check_embed_dtype, vector_bytes

# vLLM's: a JSON answer (floats, or base64 of each vector's bytes) or a binary one (every
# vector's bytes back to back; "bytes" says where each lies in a `metadata` header)
BYTES_FORMATS = ("bytes", "bytes_only")
ENCODING_FORMATS = ("float", "base64") + BYTES_FORMATS
# vLLM's per-token tasks: token_embed (every prompt token's final hidden state) is served for an
# embedding model; token_classify (every token's classifier logits) by a
# *ForTokenClassification model, whose own task it is.
TOKEN_EMBED = "token_embed"


def check_pooling_task(pooler: PoolerInfo, task: str | None, what: str) -> bool:
    """Whether a request asking for vLLM's pooling `task` (None: the model's own) pools every
    prompt token (token_embed; token_classify, a token classifier's own); a task the model
    cannot do is refused, naming the ones it can."""
    if task is None or task == pooler.task:
        return pooler.task == TOKEN_CLASSIFY
    if task == TOKEN_EMBED and pooler.task == EMBED:
        return True
    served = [pooler.task] + ([TOKEN_EMBED] if pooler.task == EMBED else [])
    why = " (a *ForTokenClassification model serves it)" if task == TOKEN_CLASSIFY else ""
    raise InvalidParam("task", f"{what}: task {task!r} is not supported by this model{why}; "
                       f"it serves {', '.join(served)}")


def per_token_rows(pooler: PoolerInfo, rows: np.ndarray, dimensions: int | None = None,
                   normalize: bool | None = None,
                   use_activation: bool | None = None) -> np.ndarray:
    """A per-token output [tokens, width] as asked: a token classifier's rows of logits
    through its activation (raw where use_activation is False), else token_embeddings."""
    if pooler.task == TOKEN_CLASSIFY:
        return probabilities(pooler, rows, use_activation)
    return token_embeddings(pooler, rows, dimensions, normalize)


def check_dimensions(pooler: PoolerInfo, dimensions: int | None) -> None:
    """`dimensions` must be one the model was trained to be cut to (Matryoshka); a model
    without matryoshka_dimensions refuses any (vLLM's rule)."""
    if dimensions is None:
        return
    if not pooler.matryoshka_dimensions:
        raise InvalidParam("dimensions", "this model does not support Matryoshka "
                           "representation: the dimensions parameter is not allowed")
    if dimensions not in pooler.matryoshka_dimensions:
        raise InvalidParam("dimensions", f"dimensions={dimensions} is not one of the model's "
                           f"Matryoshka dimensions {_listed(pooler.matryoshka_dimensions)}")


def _listed(values: list[int]) -> str:
    """A long list (every size up to the hidden size) said by its ends."""
    return str(values) if len(values) <= 16 else f"[{values[0]}, ..., {values[-1]}]"


def embedding(pooler: PoolerInfo, raw: np.ndarray, dimensions: int | None = None,
              normalize: bool | None = None) -> np.ndarray:
    """An embedding as asked: its first `dimensions` values (checked by check_dimensions),
    then L2-normalised where `normalize` (None: the model's default). Truncation comes first:
    a Matryoshka prefix is normalised on its own, as sentence-transformers does."""
    vector = np.asarray(raw, dtype=np.float32)
    if dimensions is not None:
        vector = vector[:dimensions]
    if pooler.normalize if normalize is None else normalize:
        norm = float(np.linalg.norm(vector.astype(np.float64)))
        vector = vector / max(norm, 1e-12)         # a zero vector stays zero
    return vector.astype(np.float32)


def token_embeddings(pooler: PoolerInfo, rows: np.ndarray, dimensions: int | None = None,
                     normalize: bool | None = None) -> np.ndarray:
    """A token_embed output [tokens, H] as asked: each row cut to `dimensions`, then
    L2-normalised where `normalize` (None: the model's default), as embedding() does one."""
    rows = np.asarray(rows, dtype=np.float32)
    if dimensions is not None:
        rows = rows[:, :dimensions]
    if pooler.normalize if normalize is None else normalize:
        norms = np.linalg.norm(rows.astype(np.float64), axis=1, keepdims=True)
        rows = rows / np.maximum(norms, 1e-12)
    return rows.astype(np.float32)


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """A classifier's logits [..., labels] through its activation (pooler_info.ACTIVATIONS),
    a softmax over the last axis (each token's row, for a token classifier's)."""
    x = np.asarray(logits, dtype=np.float64)
    if activation == SIGMOID:
        return (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    if activation == SOFTMAX:
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)
    if activation == NO_ACTIVATION:
        return x.astype(np.float32)
    raise ValueError(f"unknown activation {activation!r}")


def probabilities(pooler: PoolerInfo, logits: np.ndarray,
                  use_activation: bool | None = None) -> np.ndarray:
    """A classifier's output: its logits through the model's activation, or raw where the
    request turns activation off (vLLM's use_activation)."""
    return activate(logits, pooler.activation if use_activation in (None, True)
                    else NO_ACTIVATION)


def cross_score(pooler: PoolerInfo, logits: np.ndarray,
                use_activation: bool | None = None) -> float:
    """A cross-encoder's score of one (query, document) pair: its one label's activated
    logit (sigmoid for a reranker); with several labels, the last label's probability (a
    [not relevant, relevant] classifier's "relevant")."""
    return float(probabilities(pooler, logits, use_activation)[-1])


def check_scores(pooler: PoolerInfo) -> None:
    """Scores come from a cross-encoder (classify) or an embedding model (cosine); a token
    classifier has neither."""
    if pooler.task not in (EMBED, CLASSIFY):
        raise InvalidParam("model", f"scores need an embedding model or a cross-encoder; this "
                           f"model's task is {pooler.task} (ask /pooling)")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity (0 where either vector is zero)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / norms) if norms > 0 else 0.0


def check_encoding(encoding_format: str, embed_dtype: str = "float32",
                   endianness: str = "native") -> None:
    """A request's encoding options, refused before anything runs where one is not known."""
    if encoding_format not in ENCODING_FORMATS:
        raise InvalidParam("encoding_format", f"encoding_format must be one of "
                           f"{', '.join(ENCODING_FORMATS)}, got {encoding_format!r}")
    try:
        check_embed_dtype(embed_dtype, endianness)
    except ValueError as e:
        raise InvalidParam("endianness" if str(e).startswith("endianness") else "embed_dtype",
                           str(e)) from None


def encoded(vector: np.ndarray, encoding_format: str = "float", embed_dtype: str = "float32",
            endianness: str = "native") -> list[float] | str:
    """A vector (or a token_embed's rows) as a JSON answer carries it: floats (whatever
    embed_dtype says, as vLLM), or base64 of its bytes in `embed_dtype` and `endianness`
    (the defaults, float32 in this x86 machine's order, are OpenAI's base64: the openai
    client decodes it with numpy)."""
    check_encoding(encoding_format, embed_dtype, endianness)
    if encoding_format == "float":
        return np.asarray(vector, dtype=np.float32).tolist()
    if encoding_format == "base64":
        return base64.b64encode(vector_bytes(vector, embed_dtype, endianness)).decode()
    raise InvalidParam("encoding_format", f"encoding_format {encoding_format!r} answers "
                       "binary, not JSON")


def check_task(pooler: PoolerInfo | None, task: str | None, what: str) -> PoolerInfo:
    """The model's pooler, where it serves `what` (an endpoint or offline call) asking for
    `task` (None: either task). A generating model, or the other task's model, refuses it,
    naming the runner or the --convert that would serve it."""
    if pooler is None:
        raise InvalidParam("model", f"{what} needs a pooling model, but the model runs with "
                           "--runner generate; start it with --runner pooling (a causal LM "
                           "also takes --convert embed or classify)")
    if task is not None and pooler.task != task:
        convert = {EMBED: "embed", CLASSIFY: "classify"}[task]
        raise InvalidParam("model", f"{what} needs a model whose pooling task is {task}, but "
                           f"this model's is {pooler.task} (--runner pooling --convert "
                           f"{convert} serves it, where the model allows)")
    return pooler
