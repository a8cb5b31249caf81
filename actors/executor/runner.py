"""ModelRunner: the executor's state and one step of work.

Holds the model, the KV cache tensors and a SeqTable (seq_table.py) of the sequences it has
been sent. execute() applies a StepPlan to the table (drop finished, add new, extend block
tables), lays the scheduled tokens out as one flat batch (decodes first, then prefill spans),
runs the model, samples for every sequence whose computed tokens reach the end of its known
tokens, and appends those tokens.
"""
from __future__ import annotations

import dataclasses
import logging
import numpy as np
import torch

from pagewire.kernels import kv_quant
from pagewire.kernels.attention import AttentionBatch, PrefillSpan
from pagewire.kernels.context_parallel import local_batch
from pagewire.kernels.ops import resolve_device
from pagewire.pooler_info import CLASSIFY
from pagewire.wire.engine_control import ControlDone, EngineControl
from pagewire.wire.ids import SeqId
from pagewire.wire.to_executor import StepPlan
from pagewire.wire.to_scheduler import (CompressResult, DraftsResult, PromptLogprobsResult,
                                         StepResult, TierResult)

from .. import kv_tier_files
from ..config import EngineConfig, default_threads
from ..config_sections import LOCAL
from . import huge_pages
from .backend import Backend
from .cuda_graphs import DecodeGraphs
from .decode_layout import decode_tables
from .dense_projection import dense_projection
from .grammar_matchers import Matchers
from .head_blocks import Compressor
from .image_rows import ImageRows, image_key_ends
from .kv_blocks import allocate_kv_cache
from .disk_tier import DiskTier
from .kv_transfer import transfer_ends
from .linear_blocks import holdings
from .loader import TORCH_DTYPES
from .lora import Adapters, LoraBatch
from .mrope import rope_positions
from .models.moe import describe_experts
from .parallel import TensorParallel, context_groups
from .prompt_logprobs import prompt_logprobs, spans_of
from .seq_table import SeqState, SeqTable
from .sleep_mode import SleepState, run_control
from .step_overlap import Launched
from .step_sampler import StepSampler
from .token_rows import pooled_result
from .draft_proposers import InStepDraft, Proposer

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None, notify=None):
        """notify(msg): how the KV server and puller threads (kv_transfer.py) tell the
        scheduler a lease ended or pulls did."""
        parallel = config.parallel
        ranks_here = parallel.tensor_parallel_size if parallel.executors == LOCAL else 1
        torch.set_num_threads(config.device.threads or default_threads(ranks_here))
        torch.manual_seed(config.model.seed)   # unseeded sampling replays exactly from a trace
        self.config = config
        self.tp = dataclasses.replace(tp or TensorParallel(),
                                      expert_parallel=parallel.enable_expert_parallel)
        self.block_size = config.cache.block_size
        self.device = resolve_device(config.device.device, self.tp.rank)
        # Every device- and tier-dependent choice below is the backend's (backend.py).
        self.backend = Backend(self.device, config.device.kernels)
        # Context parallelism: this rank holds block_size / size tokens of each block.
        dcp = config.parallel.decode_context_parallel_size
        self.cp = context_groups(self.tp, dcp) if dcp > 1 else None
        self.model_info = config.model.model_info    # the weights' (a weight update's)
        self.load_weights(self.model_info)
        # One block past the scheduler's pool: the scratch block padded decode rows write to.
        self.scratch_block = config.cache.num_kv_blocks
        self.eos_ids = list(config.model.model_info.eos_token_ids)
        # Rank 0's tokens are every rank's (execute()), so only rank 0 matches grammars.
        self.matchers = Matchers(config.model.model_info, config.model.model_info.vocab_size,
                                 self.eos_ids) if self.tp.rank == 0 else None
        spec = config.speculative_config
        # Overlapped steps (step_overlap.py): where plans come ahead, on one rank, no drafting.
        self.overlap = bool(config.scheduler.async_scheduling) and self.tp.size == 1 \
            and spec is None and config.cache.kv_compress_rate is None
        self.table = SeqTable(self.eos_ids, self.matchers, Proposer(spec) if spec else None)
        self.sampler = StepSampler(self.backend, self.tp, self.matchers, self.eos_ids)
        self.build_kv()
        self.tier = DiskTier(kv_tier_files.tier_directory(config, self.tp.rank),
                             self.all_caches[0], self.tp) if config.cache.kv_offload_dir else None
        self.kv_server, self.kv_puller = transfer_ends(config, self.all_caches[0], self.tp.rank,
                                                       notify)
        self.sleep = SleepState()          # sleep mode (sleep_mode.py)
        huge_pages.release_freed_memory()

    def load_weights(self, info) -> None:
        """The model at `info`, and what is built over its layers: LoRA slots, image rows,
        KV-Compress's scorer. The current model (if any) is replaced only once the new one
        has loaded. (At start, and again for sleep mode's level 2 and weight updates.)"""
        config = self.config
        model = self.backend.load(info, config, self.tp, self.cp)
        self.model, self.model_info = model, info
        # an embedding model's sentence-transformers Dense modules, read from its directory
        self.dense = dense_projection(info.path, info.pooler, self.device)
        log.info("%s", self.backend.describe(config))
        log.info("%s", holdings(self.model))
        if self.model.cfg.num_experts:
            log.info("%s", describe_experts(self.model))
        # Before the fused decode program is encoded: it names each linear's LoRA slot.
        self.adapters = Adapters(self.model, config.model.model_info, config.lora.max_lora_rank,
                                 config.lora.max_cpu_loras or config.lora.max_loras) \
            if config.lora.enable_lora else None
        # a vision model's image rows and its encoder cache (image_rows.py)
        self.images = ImageRows(self.model) if hasattr(self.model, "encode_images") else None
        # image tokens that see their whole image in prefill (Gemma 3): key ends per query
        self.whole_images = getattr(self.model, "bidirectional_images", False)
        self.compressor = Compressor.of(config, self.model) \
            if config.cache.kv_compress_rate is not None else None

    def drop_weights(self) -> None:
        """Sleep mode level 2: let the model and what is built over it go (the KV pool is
        dropped first)."""
        self.model = self.adapters = self.images = self.compressor = None

    def build_kv(self) -> None:
        """The KV pool over the current model and what reads it: a drafting model and its
        caches, the decode graphs. (At start, and on waking from sleep mode.)"""
        self.kv_caches, self.host_caches = self._caches(self.model)
        self.drafter = self._drafter(self.config.speculative_config)
        # What swaps and copy-on-write move: every layer's cache, a draft model's too.
        draft_device, draft_host = self.drafter.own_caches() if self.drafter else ([], [])
        self.all_caches = (self.kv_caches + draft_device, self.host_caches + draft_host)
        self.graphs = self.decode_graphs(capture=True) if self.backend.captures_graphs(
            self.config, self.tp.size, self.compressor is not None, self.model) else None
        huge_pages.release_freed_memory()

    def drop_kv(self) -> None:
        """Sleep mode: let the KV pool and everything built over it go."""
        self.model.use_fused_decode(None)
        self.kv_caches, self.host_caches, self.all_caches = [], [], ([], [])
        self.drafter = self.graphs = None

    def _caches(self, model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A model's K/V caches on the device (the pool and the scratch block) and on the host
        (the swap tier, if any); its fused decode path is built over the former."""
        config, cfg = self.config, model.cfg
        dtype, width = kv_quant.cache_layout(config.cache.kv_cache_dtype,
                                             TORCH_DTYPES[config.model.dtype], cfg.head_dim)
        layout = (self.block_size // self.config.parallel.decode_context_parallel_size,
                  model.num_kv_heads, width, dtype)             # this rank's heads and tokens
        kv_device = self.backend.kv_device
        if self.compressor is not None:       # one pool of head rows for every layer
            pool = self.compressor.allocate(config.cache.num_kv_blocks + 1, width, dtype, kv_device)
            caches = [pool] * cfg.num_layers
            self.backend.prepare_caches(model, caches, head_rows=True)
            return caches, []
        on_device = allocate_kv_cache(cfg.num_layers, config.cache.num_kv_blocks + 1, *layout,
                                      kv_device)
        self.backend.prepare_caches(model, on_device)
        host = allocate_kv_cache(cfg.num_layers, config.cache.num_host_blocks,
                                 *layout) if config.cache.num_host_blocks else []
        return on_device, host

    def _drafter(self, spec) -> InStepDraft | None:
        """Methods self and draft_model draft with a model during the verifying step."""
        if spec is None or spec.method not in ("self", "draft_model"):
            return None
        if spec.method == "self":
            return InStepDraft.of_target(self.model, self.kv_caches, spec.draft_layers,
                                         self.block_size, self.tp)
        draft = self.backend.load(self.config.model.draft_model_info, self.config, self.tp)
        caches, host = self._caches(draft)
        log.info("draft model %s (%d layers)", self.config.model.draft_model_info.path,
                 draft.cfg.num_layers)
        return InStepDraft(draft, caches, self.block_size, self.model.cfg.vocab_size,
                           mirrors=True, host_caches=host, tp=self.tp)

    def decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Decode graphs (capture=False: their buffers and padding, run eagerly): the
        backend's (Backend.decode_graphs)."""
        return self.backend.decode_graphs(self.model, self.kv_caches, self.config,
                                          self.scratch_block, capture, self.adapters is not None)

    @torch.inference_mode()
    def execute(self, plan: StepPlan | EngineControl) -> StepResult | ControlDone:
        """One step; or a sleep-mode control, which comes in a plan's place (sleep_mode.py)."""
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan | EngineControl, after: Launched | None = None,
               plain: bool | None = None) -> Launched:
        """A step up to its tokens drawn on the device; finish() reads them back. `after`: the
        step launched before it and not finished (overlapped steps, step_overlap.py: both
        plain), whose sampled tokens its rows take on the device. `plain`: the plan's
        SeqTable.plain_plan where the caller knows it already."""
        if not isinstance(plan, StepPlan):
            return Launched(plan, run_control(self, plan))
        reserve = self.overlap and (self.table.plain_plan(plan) if plain is None else plain)
        order = self.table.apply(plan)
        loaded = self._move_blocks(plan)
        self._copy_blocks(plan)
        if not order:             # only tier and transfer work, or every row's sequence stopped
            return Launched(plan, StepResult(plan.step_id, [], [], tier=loaded))
        to_draft = [seq for _, seq in order if seq.num_draft_slots > len(seq.verifying)]
        if to_draft:              # methods self, draft_model: a model drafts now
            self.drafter.fill(to_draft)
        input_ids, positions, batch, sample_rows, sample_seqs, rows, pooled = self._layout(order)
        if after is not None:
            input_ids = after.feed(input_ids, rows, self.backend.upload)
        masks = self.sampler.grammar_masks(sample_seqs)      # filled while the model runs
        lora = self._lora_batch(rows, len(input_ids))
        images = self.images.step(rows, self.device) if self.images is not None else None
        hidden = self._forward(input_ids, positions, batch, lora, images)      # [T, H]
        if self.drafter is not None and self.drafter.mirrors:
            self._mirror(order, to_draft)
        result = StepResult(plan.step_id, [rid for rid, _ in sample_seqs], [], tier=loaded)
        if self.model.cfg.num_experts:
            result.experts_read = self.model.take_expert_reads()
        if images is not None:
            result.encoder = self.images.take_counts()
        spans = spans_of(rows)
        if spans:
            result.prompt_logprobs = PromptLogprobsResult(prompt_logprobs(self.model, hidden,
                                                                          spans))
        if pooled:      # a causal model's last token (pooler_info.LAST), or every token's
            result.pooled = pooled_result(hidden, pooled, self._pooled_output)
        step = Launched(plan, result, order, sample_seqs, batch)
        if sample_rows:
            # (a device tensor indexed by a list copies the list over, waiting for the device)
            rows_at = self.backend.upload(torch.tensor(sample_rows))
            logits = self.model.compute_logits(hidden[rows_at])                # [R, V]
            step.drawn = self.sampler.draw(logits, sample_seqs, masks)
        if reserve:
            step.places = self.table.reserve(order, sample_seqs)
        return step

    @torch.inference_mode()
    def finish(self, step: Launched) -> StepResult | ControlDone:
        """A launched step's tokens read back and appended: its result."""
        result, order, sample_seqs = step.result, step.order, step.sample_seqs
        if order is None:         # a control, or a plan that ran no sequence
            return result
        produced = self.sampler.read(step.drawn, sample_seqs, result) \
            if step.drawn is not None else []
        if step.places is not None:
            step.keep(self.table.settle(sample_seqs, step.places, [t[0] for t in produced]))
            return result
        if self.compressor is not None:       # before finish_step counts the step computed
            head_lens = self.compressor.compress(order, step.batch.heads, self.kv_caches[0])
            result.compress = CompressResult(head_lens) if head_lens else None
        result.errors = self.table.finish_step(order, [
            (sid, seq, tokens) for (sid, seq), tokens in zip(sample_seqs, produced)]) or None
        num_drafts = self._drafts_held(sample_seqs)
        if num_drafts:                # the section exists when drafts came back or are held
            result.drafts = result.drafts or DraftsResult({}, {}, {})
            result.drafts.num_drafts = num_drafts
        return result

    def _pooled_output(self, states: torch.Tensor) -> torch.Tensor:
        """Pooling rows' last-token states [R, H] -> their output, float32: the states through
        the model's Dense modules if any (embed), or the LM head's logits of the classifier
        tokens (two: the second's minus the first's, one score:
        pooler_info.PoolerInfo.classifier_tokens)."""
        pooler = self.config.model.model_info.pooler
        tokens = pooler.classifier_tokens
        if pooler.task == CLASSIFY and not tokens:     # a score head (DECODER_CLASSIFIERS)
            return self.model.compute_logits(states)
        if not tokens:
            return states.float() if self.dense is None else self.dense(states)
        logits = self.model.compute_logits(states)[:, tokens]                # [R, K]
        return logits[:, 1:] - logits[:, :1] if len(tokens) == 2 else logits

    def fail(self, plan: StepPlan) -> None:
        """The plan's step failed: its sequences' state is no longer theirs (seq_table.py)."""
        self.table.fail(plan)

    def _mirror(self, order: list[tuple[SeqId, SeqState]], drafted: list[SeqState]) -> None:
        """draft_model: the step's tokens its draft passes did not run, through the draft."""
        passed = {id(seq) for seq in drafted}
        rest = [(sid, seq) for sid, seq in order if id(seq) not in passed]
        if rest:
            self.drafter.mirror(*self._layout(rest)[:3])

    def _drafts_held(self, sample_seqs: list[tuple[SeqId, SeqState]]) -> dict[SeqId, int]:
        """Drafts each sequence can verify next step: those proposed, or (a model drafting in
        that step) num_speculative_tokens for every sequence that may draft."""
        if self.drafter is None:
            return {sid: len(seq.drafts) for sid, seq in sample_seqs if seq.drafts}
        k = self.config.speculative_config.num_speculative_tokens
        return {sid: len(seq.drafts) or k for sid, seq in sample_seqs
                if not seq.stopped and seq.sampling.can_speculate
                and (seq.drafts or seq.sampling.structured_outputs is None)}

    def _lora_batch(self, rows: list[tuple[SeqId, SeqState, int]],
                    num_rows: int) -> LoraBatch | None:
        """The step's rows and their adapters (None: every row is the base model's)."""
        if self.adapters is None:
            return None
        spans = [(row, seq.num_scheduled, seq.lora) for _, seq, row in rows
                 if seq.lora is not None]
        return self.adapters.batch(spans, num_rows, self.device) if spans else None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 batch: AttentionBatch, lora: LoraBatch | None = None,
                 images=None) -> torch.Tensor:
        """`images`: the step's image rows and embeddings (image_rows.py), or None."""
        decode_only = not batch.prefills
        graphs = self.graphs
        if decode_only and graphs is not None and batch.cascade is None and images is None \
                and (lora is None or graphs.lora is not None and not lora.adapts_experts) \
                and graphs.fits(len(input_ids), batch.decode_block_tables.shape[1]):
            return graphs.run(input_ids, positions, batch.slot_mapping,
                              batch.decode_block_tables, batch.decode_context_lens, lora)
        if self.cp is not None:
            batch = local_batch(batch, self.cp.rank, self.cp.size, self.block_size)
        input_ids, positions, batch = self.backend.to_device(input_ids, positions, batch)
        return self.model(input_ids, positions, self.kv_caches, batch, lora, images)

    def _move_blocks(self, plan: StepPlan) -> TierResult | None:
        """Blocks between engines and tiers, before the step writes any: leases to serve,
        pulls to start, disk-tier work. Returns how many blocks of each tier load arrived."""
        if plan.leases and self.kv_server is not None:
            self.kv_server.add(plan.leases)
        if plan.pulls and self.kv_puller is not None:   # (a replay has none: the recorded
            self.kv_puller.start(plan.pulls)            # KvPulled messages come from the trace)
        loaded = self.tier.run(plan.tier) if plan.tier is not None else None
        return TierResult(loaded) if loaded else None

    def _copy_blocks(self, plan: StepPlan) -> None:
        """Swap out, swap in, then copy-on-write, each over every layer (StepPlan's order)."""
        device, host = self.all_caches
        for pairs, src_caches, dst_caches in ((plan.swap_out, device, host),
                                              (plan.swap_in, host, device),
                                              (plan.copies, device, device)):
            if pairs:
                src, dst = torch.tensor(pairs).T
                for src_cache, dst_cache in zip(src_caches, dst_caches):
                    dst_cache[:, dst.to(dst_cache.device)] = \
                        src_cache[:, src.to(src_cache.device)].to(dst_cache.device)

    def _layout(self, order: list[tuple[SeqId, SeqState]]):
        """Flatten the scheduled tokens: ids, positions, attention layout, and which rows of
        the hidden states to sample from (with their requests)."""
        bs = self.block_size
        ids, pos, slots, sample_rows, sample_seqs, prefills = [], [], [], [], [], []
        rows, pooled = [], []
        # Decode rows: (sequence, context length). A sequence verifying drafts is one decode
        # row per position: every row's K/V is written before any row attends, and each row
        # sees up to its own position, so the span is causal without a prefill kernel (and
        # small speculative steps take the fused decode path).
        decodes = [(seq, seq.num_computed + i + 1) for _, seq in order if seq.runs_as_decode
                   for i in range(seq.num_scheduled)]
        plain_rows = self.compressor is None     # (else each head row's slot: head_blocks.py)
        for rid, seq in order:
            start, n = seq.num_computed, seq.num_scheduled
            row = len(ids)
            rows.append((rid, seq, row))
            if n == 1 and plain_rows and not seq.images:     # a decode row: most rows, in ints
                ids.append(seq.token_ids[start])
                pos.append(start)
                slots.append(seq.block_ids[start // bs] * bs + start % bs)
            else:
                self._lay_span(seq, row, ids, pos, slots, prefills)
            if seq.pooling is not None:     # read, not sampled (token_rows.py)
                pooled.append((rid, seq, row, n))
            elif seq.samples:             # the last position; every drafted one too
                sample_rows.extend(range(row + n - 1 - len(seq.verifying), row + n))
                sample_seqs.append((rid, seq))
        cascade = self.config.device.disable_cascade_attn or self.compressor is not None
        batch = AttentionBatch(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode_tokens=len(decodes), prefills=prefills,
            **decode_tables(decodes, bs, None if cascade else self.backend.ops.cascade_thresholds))
        if self.compressor is not None:
            batch.heads = self.compressor.layout(order)
        return (torch.tensor(ids), torch.tensor(pos, dtype=torch.int64), batch,
                sample_rows, sample_seqs, rows, pooled)

    def _lay_span(self, seq: SeqState, row: int, ids: list, pos: list, slots: list,
                  prefills: list) -> None:
        """_layout's rows of a sequence that is not one plain decode row: a prompt's span, a
        last token and its drafts, or rows whose positions images shift."""
        bs, start, n = self.block_size, seq.num_computed, seq.num_scheduled
        p = np.arange(start, start + n)
        blocks = np.asarray(seq.block_ids)
        ids.extend(seq.token_ids[start:start + n])    # drafts run after its last token
        ids.extend(seq.verifying)
        pos.extend(rope_positions(seq.images, p).tolist())     # p, or M-RoPE's (mrope.py)
        if self.compressor is None:        # (else each head row's own: head_blocks.py)
            slots.extend((blocks[p // bs] * bs + p % bs).tolist())
        if not seq.runs_as_decode:
            nb = -(-(start + n) // bs)
            ends = image_key_ends(seq.images, start, n) if self.whole_images else None
            prefills.append(PrefillSpan(row, n, start + n, torch.from_numpy(blocks[:nb]), ends))
