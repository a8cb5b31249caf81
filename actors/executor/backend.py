"""The executor's backend: the kernel set for one (device, tier), and every choice that depends
on it, in one place.

kernels/ops.py select_ops picks the kernels once per process (CPU tier, Triton or the torch
reference) and states what they do in a Capabilities record. This object lays each model out
for them and answers the runner's device- and tier-dependent questions from that record, so
the runner, the loader and the model code never ask which device, tier or backend they run on
(tests/kernels/test_backend_boundary.py):

    backend = Backend(device, config.device.kernels)
    model = backend.load(info, config, tp, cp)        # built with its kernels, weights laid out
    backend.prepare_caches(model, kv_caches)          # its fused decode program, if any
    backend.captures_graphs(config, tp_size, ..., model)  # CUDA graphs or eager steps
    ids, positions, batch = backend.to_device(ids, positions, batch)
    tokens = backend.sample(logits, sampling_batch, spans)
"""
from __future__ import annotations

import torch

from pagewire import memory_budget
from pagewire.kernels import moe, quant, tiers
from pagewire.kernels.attention import AttentionBatch
from pagewire.kernels.linear import pack_linears
from pagewire.kernels.ops import select_ops

from . import huge_pages
from .cuda_graphs import DecodeGraphs, GraphLora
from .decode_layout import batch_to
from .linear_blocks import keep_bf16_tiles, keep_quantized
from .loader import TORCH_DTYPES, read_model
from .models.fused_decode import FusedDecode
from .models.moe import SparseMoE
from .sampler import sample

# How each GGML type's weights meet their activations (kernels/quant.py ROUNDINGS), by
# --quantized-activations; a type not named multiplies them exactly.
_Q4 = (quant.Q4_0, quant.Q4_1, quant.Q4_K, quant.Q4_KS)  # multiplied as nibble tiles; the rest
_Q8 = (quant.Q5_0, quant.Q5_1, quant.Q8_0, quant.IQ4_NL, quant.Q2_K, quant.Q5_K,   # as int8
       quant.Q6_K, quant.Q2_KS, quant.Q5_KS, quant.Q6_KS, quant.IQ4_XSS, quant.MXFP4)
ROUNDINGS = {"exact": {}, "int16": dict.fromkeys((*_Q4, *_Q8), "int16"),
             "int8": dict.fromkeys(_Q4, "int8"),
             "int8-all": dict.fromkeys((*_Q4, *_Q8), "int8"),
             "int8-prefill": dict.fromkeys(_Q4, "int8-large")}


def roundings(activations: str, bf16_dot: bool) -> dict[int, str]:
    """ROUNDINGS[activations] on a tier with (`bf16_dot`) or without a bfloat16 dot product.
    int8 and int8-prefill round only Q4 weights' activations (int8-prefill in large steps):
    every other weight keeps the tier's default (tiers.default_rounding: exact with the dot
    product, else int16, whose answers are exact's and whose kernels run ~1.6x faster there;
    int8-large's small steps take it natively: csrc/quant_kernels.cpp large_int8)."""
    if activations in ("int8", "int8-prefill"):
        return {**ROUNDINGS[tiers.default_rounding(bf16_dot)], **ROUNDINGS[activations]}
    return ROUNDINGS[activations]


class Backend:
    """One per executor process: `ops` (the kernels every model op calls), `capabilities`
    (what they do), `name` (for logs, metrics and Ready)."""

    def __init__(self, device: torch.device, kernels: str = "auto"):
        self.device = device
        self.ops = select_ops(device, kernels)
        self.capabilities = self.ops.capabilities
        self.name = self.ops.backend

    def describe(self, config) -> str:
        """The log line's details: the dtype and, where stored blocks are multiplied, how."""
        quantized = f", quantized activations {config.device.quantized_activations}" \
            if self.capabilities.native_weights else ""
        return f"backend {self.name} (dtype {config.model.dtype}{quantized})"

    def load(self, info, config, tp, cp=None) -> torch.nn.Module:
        """The model for `info` on the device, built with this backend's kernels (and `cp`,
        the context-parallel group, or None), its weights laid out for them."""
        place = self._place_blocks(info, config) if self.capabilities.native_weights else None
        model, _ = read_model(info, config.model.dtype, tp, config.model.quantization,
                              self.ops, cp, place)
        model = model.to(self.device)
        self.prepare(model, config)
        return model

    def _place_blocks(self, info, config):
        """keep_quantized for read_model: stored (or --quantization rounded) blocks first, so
        a Linear that keeps only them never reads its float weight and packs nothing. The
        options are read when it is called (an encoder model, which has no KV pool, never
        calls it)."""
        def place(model, rounded) -> int:
            dtype = TORCH_DTYPES[config.model.dtype]
            rounding = roundings(config.device.quantized_activations,
                                 self.capabilities.bf16_dot)
            tokens = config.device.quantized_matmul_tokens
            room = None if tokens is not None else memory_budget.dense_budget(
                config.cache.num_kv_blocks * config.cache.kv_block_bytes)
            return keep_quantized(model, info, tokens, rounding, rounded, dtype, room)
        return place

    def prepare(self, model, config) -> None:
        """Weight layouts for the native CPU kernels, after the blocks read_model placed: BF16
        tiles; oneDNN's packed dense weights (float32 without a bfloat16 dot product); then
        the tiles a step streams onto huge pages, after packing. Other backends run the
        weights as loaded."""
        caps = self.capabilities
        if not caps.native_weights:
            return
        keep_bf16_tiles(model, config.device.quantized_matmul_tokens)
        pack_linears(model, upcast=not caps.bf16_dot)
        if config.model.model_info.format == "hf":
            _own_memory(model)
        # The huge-page mappings under the tiles live as long as the model (sleep mode and
        # weight updates drop models: their mappings go with them).
        model.page_arenas = []
        huge_pages.back_model(model, model.page_arenas)
        for block in model.modules():     # where the tiles now lie (after back_model's moves)
            if isinstance(block, SparseMoE):
                block.native_spec = moe.native_spec(block, caps.block_kinds)

    @property
    def kv_device(self) -> torch.device | None:
        """Where KV pools go (kv_blocks.allocate_kv_cache): None for host memory, which it
        may put on huge pages; else the device."""
        return None if self.capabilities.host_memory else self.device

    @staticmethod
    def prepare_caches(model, kv_caches: list[torch.Tensor], head_rows: bool = False) -> None:
        """Give the model its fused decode program over these caches, where its kernels have
        one and every op of its layers encodes (fused_decode.py); else none."""
        model.use_fused_decode(FusedDecode.build(model, kv_caches, head_rows=head_rows))

    def captures_graphs(self, config, tp_size: int, compressed: bool, model=None) -> bool:
        """Whether decode steps replay CUDA graphs: where the backend has them, not with
        --enforce-eager, tensor parallelism or KV-Compress (its layouts change every step), nor
        where one of the model's expert blocks runs through a path that reads its routing on
        the host (Ops.moe_in_graphs: torch's grouping)."""
        if not (self.capabilities.graphs and not config.device.enforce_eager and tp_size == 1
                and not compressed):
            return False
        blocks = [m for m in model.modules() if isinstance(m, SparseMoE)] if model else []
        return all(self.ops.moe_in_graphs(block, TORCH_DTYPES[config.model.dtype])
                   for block in blocks)

    def decode_graphs(self, model, kv_caches, config, scratch_block: int, capture: bool,
                      with_adapters: bool) -> DecodeGraphs:
        """Decode graphs (capture=False: their buffers and padding, run eagerly). With
        adapters, where the kernels take LoRA inputs as static buffers, the graphs do
        (GraphLora); else steps with adapters run eagerly."""
        width = -(-config.model.max_model_len // config.cache.block_size)
        lora = GraphLora.of(model, config.scheduler.max_num_seqs, config.lora.max_loras,
                            config.lora.max_lora_rank) \
            if with_adapters and self.capabilities.lora_in_graphs else None
        return DecodeGraphs(model, kv_caches, config.scheduler.max_num_seqs, width,
                            config.cache.block_size, scratch_block, capture, lora, self.staged)

    def to_device(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """A step's inputs (laid out in host memory) where the kernels read them."""
        if self.capabilities.host_memory:
            return input_ids, positions, batch
        return self.upload(input_ids), self.upload(positions), batch_to(batch, self.device,
                                                                         self.staged)

    def staged(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor in pinned memory, where the device's copy engine reads it without
        waiting: a copy from pageable memory may synchronise with every step queued (and a
        blocking one does), which would stall overlapped steps (step_overlap.py)."""
        return t.pin_memory() if t.is_cpu and not self.capabilities.host_memory else t

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A step's host tensor where the kernels read it, its copy queued behind the steps
        there (the tensor itself where the kernels read host memory)."""
        if self.capabilities.host_memory:
            return t
        return self.staged(t).to(self.device, non_blocking=True)

    def copy_back(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event] | None:
        """A step's sampled ids on their way to pinned host memory behind the step's work,
        with the event that marks them there; None where the device is host memory."""
        if self.capabilities.host_memory:
            return None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def sample(self, logits: torch.Tensor, batch, spans=()) -> torch.Tensor:
        """sampler.sample through this backend's kernels (parameters uploaded without a
        wait)."""
        return sample(logits, batch, self.ops, spans, self.upload)


def _own_memory(model) -> None:
    """Copy the float tensors a model keeps (embedding, norms, any unpacked Linear) out of the
    safetensors files they were mapped from. One kept tensor holds its file's whole mapping,
    so after the Linears' tiles were made the pages read for them stayed resident: a 1B
    bfloat16 directory's 2 GB beside its 2 GB of tiles."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
