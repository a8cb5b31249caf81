"""The executor's backend (actors/executor/backend.py) and the capabilities record it decides
from (kernels/ops.py Capabilities): each kernel set states what it does once, and the runner's
device- and tier-dependent choices follow from that record alone."""
from __future__ import annotations

import pytest
import torch

from pagewire.config import EngineConfig
from pagewire.executor.backend import Backend
from pagewire.kernels import quant, tiers
from pagewire.kernels.ops import Capabilities, CpuOps, TorchOps, select_ops

CUDA = torch.device("cuda", 0)      # only named: nothing here touches a GPU


def test_each_tier_states_what_its_kernels_do(native_lib):
    caps = CpuOps(native_lib).capabilities
    bf16 = native_lib.tier == "avx512_bf16"
    planes = {quant.Q6_KP + 100, quant.Q5_KP + 100}   # bit planes: avx512_bf16's int8 only
    assert caps == Capabilities(
        host_memory=True, native_weights=True, fused_decode=True, bf16_dot=bf16,
        block_kinds=frozenset(quant.KINDS) - (set() if bf16 else planes),
        int16_large_steps=native_lib.tier == "avx2",
        int8_large_steps=native_lib.tier in ("avx2", "avx512_bf16"), graphs=False,
        lora_in_graphs=False)


def test_the_torch_reference_lays_nothing_out_and_graphs_only_on_a_gpu():
    assert select_ops(torch.device("cpu"), "torch").capabilities == Capabilities()
    on_gpu = TorchOps(CUDA).capabilities
    assert (on_gpu.host_memory, on_gpu.graphs, on_gpu.lora_in_graphs) == (False, True, False)
    assert not on_gpu.native_weights and not on_gpu.fused_decode and not on_gpu.block_kinds


def test_triton_takes_lora_inputs_in_its_graphs():
    from pagewire.kernels.triton_ops import TritonOps
    caps = TritonOps(CUDA).capabilities
    assert (caps.graphs, caps.lora_in_graphs, caps.host_memory) == (True, True, False)
    assert TritonOps().capabilities.graphs is False       # the interpreter, on the CPU


def test_graphs_and_pools_follow_the_capabilities():
    config = EngineConfig()
    on_cpu = Backend(torch.device("cpu"), "torch")
    assert on_cpu.kv_device is None                        # host memory: huge pages may back it
    assert not on_cpu.captures_graphs(config, 1, False)
    on_gpu = Backend(CUDA, "torch")
    assert on_gpu.kv_device == CUDA
    assert on_gpu.captures_graphs(config, 1, False)
    assert not on_gpu.captures_graphs(EngineConfig.from_options(enforce_eager=True), 1, False)
    assert not on_gpu.captures_graphs(config, 2, False)    # tensor parallelism: eager
    assert not on_gpu.captures_graphs(config, 1, True)     # KV-Compress: eager
    ids, positions = torch.arange(3), torch.arange(3)
    assert on_cpu.to_device(ids, positions, None) == (ids, positions, None)   # left in place


def test_no_graphs_where_an_expert_block_reads_its_routing_on_the_host():
    """torch's grouping loops over the experts chosen (a host sync a capture refuses): a model
    with such a block decodes eagerly; one without any block still captures."""
    from pagewire.executor.models.moe import SparseMoE
    block = SparseMoE.__new__(SparseMoE)
    torch.nn.Module.__init__(block)
    block.activation = ("silu", None, None)
    on_gpu, config = Backend(CUDA, "torch"), EngineConfig.from_options(dtype="bfloat16")
    assert not on_gpu.ops.moe_in_graphs(block, torch.bfloat16)
    assert not on_gpu.captures_graphs(config, 1, False, torch.nn.Sequential(block))
    assert on_gpu.captures_graphs(config, 1, False, torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_amx_selects_the_avx512_bf16_tier():
    """--kernels amx is avx512_bf16 (kernels/tiers.py ALIASES)."""
    if "avx512_bf16" not in tiers.runnable():
        pytest.skip(f"needs avx512_bf16: this CPU runs {', '.join(tiers.runnable())}")
    assert select_ops(torch.device("cpu"), "amx").backend == "cpu-avx512_bf16"
