"""The KV pool's size, decided as EngineConfig.resolve() reads the options: bytes a block,
device blocks, host swap blocks and disk-tier blocks, and the context that fits. Imports no
torch."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import memory_budget
from .config_sections import SWAP
from .model_info import ModelInfo

if TYPE_CHECKING:
    from .config import EngineConfig

log = logging.getLogger(__name__)

# --kv-cache-memory auto on a CUDA device: the pool the CPU default was before `auto`
# (the device's free memory is not measured before its executors start).
AUTO_DEVICE_KV_MEMORY = 2 * 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class KVPoolPlan:
    """The pool of one resolution: `config`'s cache, scheduler and parallel options for the
    model `info` (and its draft, whose K/V sits beside the target's in every block: the same
    block ids) in activations of `dtype`."""

    def __init__(self, config: EngineConfig, info: ModelInfo, draft: ModelInfo | None,
                 dtype: str):
        self.config, self.info, self.draft, self.dtype = config, info, draft, dtype
        self.cache = config.cache

    def bytes_per_token(self) -> int:
        quantized = self.cache.kv_cache_dtype != "auto"
        return sum(m.kv_bytes_per_token(DTYPE_BYTES[self.dtype], quantized)
                   for m in (self.info, self.draft) if m is not None)

    def memory(self, max_len: int, on_cuda: bool) -> tuple[int, int]:
        """(max_model_len, bytes of the KV pool): --kv-cache-memory, or its `auto` plan
        (memory_budget.kv_auto, logged) where neither it nor --num-kv-blocks is given. On
        CUDA `auto` is AUTO_DEVICE_KV_MEMORY: the device's memory is not the host's."""
        config = self.config
        memory = self.cache.kv_cache_memory
        if memory is not None or self.cache.num_kv_blocks is not None:
            return max_len, memory or 0
        if on_cuda:
            return max_len, AUTO_DEVICE_KV_MEMORY
        plan = memory_budget.kv_auto(
            self.info, self.bytes_per_token(), max_len, config.model.max_model_len is not None,
            config.scheduler.max_num_seqs, config.device.quantized_matmul_tokens)
        log.info("KV cache auto: %.2f GiB (%s)", plan.bytes / 2**30, plan.reason)
        bs = self.cache.block_size       # a lowered context fills whole blocks of the pool
        return (max_len if plan.max_len == max_len else plan.max_len // bs * bs), plan.bytes

    def blocks(self, max_len: int, kv_memory: int) -> tuple[int, int, int]:
        """(bytes of a block, device blocks, host swap blocks). Under context parallelism a
        block's tokens are spread over its ranks."""
        per_block = self.cache.block_size * self.bytes_per_token() // self.context_parallel()
        num_blocks = self.cache.num_kv_blocks
        if num_blocks is None:
            num_blocks = kv_memory // per_block
        if num_blocks * self.cache.block_size < max_len:
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {self.cache.block_size} tokens) cannot "
                f"hold one sequence of max_model_len={max_len}; raise --kv-cache-memory or lower "
                f"--max-model-len")
        host_blocks = self.cache.swap_space // per_block
        if self.cache.preemption_mode == SWAP and host_blocks == 0:
            raise ValueError("preemption_mode swap needs --swap-space")
        return per_block, num_blocks, host_blocks

    def tier_blocks(self, per_block: int) -> int:
        """Blocks the disk tier may hold (0: no tier)."""
        if self.cache.kv_offload_dir is None:
            return 0
        if not self.cache.enable_prefix_caching:
            raise ValueError("--kv-offload-dir keeps prefix-cache blocks: it needs prefix caching")
        blocks = self.cache.kv_offload_size // per_block
        if blocks < 1:
            raise ValueError(f"--kv-offload-size {self.cache.kv_offload_size} bytes holds no block "
                             f"({per_block} bytes each)")
        return blocks

    def context_parallel(self) -> int:
        """The context-parallel size, checked: ranks that would each hold a KV head's tokens
        (tensor parallelism with fewer KV heads than ranks) split them instead."""
        parallel, info = self.config.parallel, self.info
        size = parallel.decode_context_parallel_size
        if size == 1:
            return 1
        replicas = parallel.tensor_parallel_size // info.num_kv_heads
        if size < 1 or replicas < 2 or replicas % size:
            raise ValueError(f"--decode-context-parallel-size {size} needs tensor parallelism "
                             f"with each KV head on a multiple of {size} ranks (this model has "
                             f"{info.num_kv_heads} KV heads, "
                             f"-tp {parallel.tensor_parallel_size})")
        if self.cache.block_size % size:
            raise ValueError(f"--block-size {self.cache.block_size} must be a multiple of "
                             f"--decode-context-parallel-size {size}")
        unbuilt = {"a sliding-window model": info.sliding_window is not None or
                   info.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"),
                   "--speculative-config": self.config.speculative_config is not None,
                   "--kv-offload-dir": self.cache.kv_offload_dir is not None}
        for what, given in unbuilt.items():
            if given:
                raise ValueError(f"--decode-context-parallel-size with {what} is not built yet")
        return size
