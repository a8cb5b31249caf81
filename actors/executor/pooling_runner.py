"""PoolingRunner: an encoder-only model's executor (BERT, RoBERTa, MPNet, ModernBERT and their
classifiers: models/encoder.py). No KV cache and no sequence table: attention is bidirectional,
so the configuration (config.encoder_only_options) has the scheduler send every prompt whole in
one step, never chunked, never cached; each plan's new sequences run, pool (or, per-token
requests, return every token's final hidden state), and are forgotten.
`runner_for` picks this or ModelRunner for a configuration."""
from __future__ import annotations

import logging

import numpy as np
import torch

from pagewire.kernels.ops import resolve_device
from pagewire.pooler_info import EMBED, TOKEN_CLASSIFY
from pagewire.wire.pooling import PooledResult, to_bytes
from pagewire.wire.to_executor import NewSeq, StepPlan
from pagewire.wire.to_scheduler import StepResult

from ..config import EngineConfig, default_threads
from .image_rows import image_pixels
from .backend import Backend
from .dense_projection import dense_projection
from .parallel import TensorParallel
from .runner import ModelRunner

log = logging.getLogger(__name__)


def runner_for(config: EngineConfig, tp: TensorParallel | None = None, notify=None):
    """The executor's runner: a PoolingRunner for an encoder-only model, else a ModelRunner."""
    pooler = config.model.model_info.pooler
    if pooler is not None and pooler.encoder_only:
        return PoolingRunner(config, tp)
    return ModelRunner(config, tp, notify)


class PoolingRunner:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None):
        torch.set_num_threads(config.device.threads or default_threads(1))
        self.config = config
        self.tp = tp or TensorParallel()
        self.device = resolve_device(config.device.device, self.tp.rank)
        self.backend = Backend(self.device, config.device.kernels)
        self.model = self.backend.load(config.model.model_info, config, self.tp)
        self.pooler = config.model.model_info.pooler
        # sentence-transformers' Dense modules after pooling (none: the pooled vector as is)
        self.dense = dense_projection(config.model.model_info.path, self.pooler, self.device)
        log.info("%s", self.backend.describe(config))

    def fail(self, plan: StepPlan) -> None:
        """A step failed: nothing is kept between steps, so nothing to forget."""

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        if plan.running:          # a prompt split over steps: the configuration forbids it
            raise RuntimeError("an encoder-only model runs each prompt whole in one step; "
                               f"step {plan.step_id} continues {len(plan.running)} sequences")
        texts = [new for new in plan.new if not new.images]
        images = [new for new in plan.new if new.images]           # CLIP's: one image each
        vectors = {}
        if texts:
            vectors.update(zip([new.seq_id for new in texts], self._texts(texts)))
        if images:
            pixels = torch.from_numpy(np.stack([image_pixels(new.images[0]) for new in images]))
            out = self._projected(self.model.embed_images(pixels.to(self.device)))  # [N, P]
            vectors.update(zip([new.seq_id for new in images], out.cpu().numpy()))
        return StepResult(plan.step_id, [], [], pooled=PooledResult(
            {sid: to_bytes(v) for sid, v in vectors.items()}))

    def _texts(self, seqs: list[NewSeq]) -> list[np.ndarray]:
        """Whole prompts -> each one's pooled output: an embedding [H] or a classifier's
        logits [labels]; a per-token request's (vLLM's token_embed) every token's final
        hidden state [n, H] (through the Dense modules, if any: [n, their out_features]); a
        token classifier's every token's logits [n, labels]."""
        ids, types, lens = self._layout(seqs)
        hidden = self.model(ids, types, lens)                                # [T, H]
        starts = np.cumsum([0, *lens])
        if self.pooler.task == TOKEN_CLASSIFY:                 # every request per token
            logits = self.model.classify_tokens(hidden).cpu().numpy()     # [T, labels]
            return [logits[starts[i]:starts[i + 1]] for i in range(len(seqs))]
        if self.pooler.task == EMBED:
            out = self._projected(self.model.embed(hidden, lens, self.pooler.pooling_type))
        else:
            out = self.model.classify(hidden, lens)                          # [B, labels]
        vectors = list(out.float().cpu().numpy())
        for i, new in enumerate(seqs):
            if new.pooling.per_token:
                rows = self._projected(hidden[starts[i]:starts[i + 1]])     # vLLM's way
                vectors[i] = rows.float().cpu().numpy()
        return vectors

    def _projected(self, pooled: torch.Tensor) -> torch.Tensor:
        """Pooled embeddings [B, H] through the Dense modules, all rows in one matmul each."""
        return pooled if self.dense is None else self.dense(pooled)

    def _layout(self, seqs: list[NewSeq]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The flat batch: token ids [T], token types [T] (1 from a pair's second text on:
        BERT's segment B), and each sequence's length."""
        ids, types, lens = [], [], []
        for new in seqs:
            n = len(new.token_ids)
            if new.num_computed or new.num_scheduled != n or new.pooling is None:
                raise RuntimeError(f"{new.seq_id}: an encoder-only model pools whole prompts "
                                   f"({new.num_computed} cached, {new.num_scheduled} of {n} "
                                   "scheduled)")
            start = new.pooling.pair_start or n
            ids += new.token_ids
            types += [0] * start + [1] * (n - start)
            lens.append(n)
        return (torch.tensor(ids, device=self.device), torch.tensor(types, device=self.device),
                lens)
