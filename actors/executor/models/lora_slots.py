"""Where each adaptable Linear's LoRA weights sit in an adapter's table (executor/lora.py):
its slot, a row of the table, fixed when the model is built (Linear.lora_slot; -1: never
adapted). Every layer's LORA_LINEARS come first, then, for a mixture of experts, two slots an
expert (gate_up, down), num_experts + 1 a layer (the last: the shared expert's)."""
from __future__ import annotations

# The linears of every layer, in their order: linear `name` of layer i is slot
# i * len(LORA_LINEARS) + its index.
LORA_LINEARS = ("attn.qkv", "attn.o_proj", "mlp.gate_up", "mlp.down")


def lora_slot(layer: int, name: str) -> int:
    return layer * len(LORA_LINEARS) + LORA_LINEARS.index(name)


def expert_lora_slots(cfg, layer: int, expert: int) -> tuple[int, int]:
    """The (gate_up, down) slots of expert `expert` of layer `layer` (== cfg.num_experts:
    the shared expert)."""
    first = num_dense_slots(cfg.num_layers) + 2 * (layer * (cfg.num_experts + 1) + expert)
    return first, first + 1


def num_dense_slots(num_layers: int) -> int:
    """The slots before the experts': the first expert slot."""
    return num_layers * len(LORA_LINEARS)


def num_slots(cfg) -> int:
    """Rows of an adapter's table for a model of this config (models/model_config.py)."""
    experts = 2 * cfg.num_layers * (cfg.num_experts + 1) if cfg.num_experts else 0
    return num_dense_slots(cfg.num_layers) + experts
