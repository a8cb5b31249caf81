"""The offline API's pooling calls (vLLM's LLM.embed, LLM.score, LLM.classify): LLM.encode's raw
pooled vectors post-processed as the server's routes do (pooling_outputs.py), so an offline
embedding equals the served one. A mixin of LLM (llm.py), which supplies `config` and
`encode`."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .llm_prompts import listed
from .pooler_info import CLASSIFY, EMBED, PoolerInfo
from .pooling_outputs import check_dimensions, check_pooling_task, check_scores, check_task, \
    cosine, cross_score, embedding, per_token_rows, probabilities


@dataclass
class PoolingOutput:
    data: np.ndarray            # the model's pooled output, float32 ([tokens, H]: token_embed;
                                # [tokens, labels]: token_classify's logits)


@dataclass
class PoolingRequestOutput:
    """vLLM's: what LLM.encode() returns for one prompt."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score: `request_id` is its second text's request (a cross-encoder's pair
    input), or the embedding request of that text."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


class PoolingCalls:
    """LLM's pooling calls. Each raises ValueError where the server answers 400: a model
    that generates, the other task's model, a dimensions the model was not trained for, an
    input the tokenizer refuses."""

    def _pooler(self, task: str | None, what: str) -> PoolerInfo:
        return check_task(self.config.model.model_info.pooler, task, what)

    def _per_token(self, pooling_task: str | None) -> bool:
        """Whether LLM.encode's `pooling_task` (None: the model's own) answers every prompt
        token (token_embed, token_classify; a task the model cannot do: ValueError)."""
        if pooling_task is None and self.config.model.model_info.pooler is None:
            return False
        return check_pooling_task(self._pooler(None, "LLM.encode"), pooling_task, "LLM.encode")

    def _pooling_output(self, out, per_token: bool) -> PoolingOutput:
        """One finished request's output as encode() returns it: the raw pooled vector, or
        its prompt tokens' rows: token_embed's [tokens, H], normalised as the pooler says, or
        a token classifier's logits [tokens, labels]."""
        if not per_token:
            return PoolingOutput(out.pooled)
        pooler = self.config.model.model_info.pooler
        return PoolingOutput(per_token_rows(pooler, out.pooled.reshape(
            len(out.prompt_token_ids), -1), use_activation=False))

    def embed(self, prompts, *, dimensions: int | None = None, normalize: bool | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, cut to `dimensions` (a Matryoshka size) and normalised
        as the model says unless `normalize` is given."""
        pooler = self._pooler(EMBED, "LLM.embed")
        check_dimensions(pooler, dimensions)
        outs = self.encode(listed(prompts), truncate_prompt_tokens=truncate_prompt_tokens)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(
            embedding(pooler, o.outputs.data, dimensions, normalize).tolist())) for o in outs]

    def classify(self, prompts, *, use_activation: bool | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (the model's activation unless use_activation
        is False: its logits)."""
        pooler = self._pooler(CLASSIFY, "LLM.classify")
        outs = self.encode(listed(prompts), truncate_prompt_tokens=truncate_prompt_tokens)
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids, ClassificationOutput(
            probabilities(pooler, o.outputs.data, use_activation).tolist())) for o in outs]

    def score(self, text_1: str | list[str], text_2: str | list[str], *,
              use_activation: bool | None = None,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """Scores of (text_1, text_2) pairs, 1:1, 1:N or N:N: a cross-encoder (classify)
        reads each pair as one input; an embedding model's score is the cosine similarity of
        the two texts' embeddings."""
        pooler = self._pooler(None, "LLM.score")
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if not first or not second or (len(first) > 1 and len(first) != len(second)):
            raise ValueError(f"text_1 and text_2 must be 1:1, 1:N or N:N (and not empty); got "
                             f"{len(first)}:{len(second)}")
        queries = first * len(second) if len(first) == 1 else first
        check_scores(pooler)
        if pooler.task == CLASSIFY:
            outs = self.encode(queries, pairs=second,
                               truncate_prompt_tokens=truncate_prompt_tokens)
            return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(
                cross_score(pooler, o.outputs.data, use_activation))) for o in outs]
        outs = self.encode(first + second, truncate_prompt_tokens=truncate_prompt_tokens)
        left, right = outs[:len(first)], outs[len(first):]
        return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(
            cosine(left[0 if len(first) == 1 else i].outputs.data, o.outputs.data)))
            for i, o in enumerate(right)]
