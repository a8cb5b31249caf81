"""gpt-oss's tensors that the Llama family's mapping (weights.py) does not name: each
attention's sinks and o_proj bias, the router's bias, and the experts, which Hugging Face
stores stacked per layer and transposed against nn.Linear:

    mlp.experts.gate_up_proj       [E, H, 2I]  x @ W: gate at even columns, up at odd ones
    mlp.experts.gate_up_proj_bias  [E, 2I]     interleaved the same way
    mlp.experts.down_proj          [E, I, H]   x @ W
    mlp.experts.down_proj_bias     [E, H]

Each expert becomes our two Linears ([out, in] weights): gate_up's rows the gate's I columns
then the up's I (SiLU-and-mul's [gate; up] layout), down the transposed slice."""
from __future__ import annotations

import torch


def gpt_oss_layer(weights: dict[str, torch.Tensor], cfg, layer: int) -> dict[str, torch.Tensor]:
    """Layer `layer`'s gpt-oss-only entries of the state dict (names within the model)."""
    src, dst = f"model.layers.{layer}.", f"layers.{layer}."
    sinks = weights.get(src + "self_attn.sinks", weights.get(src + "self_attn.sinks.weight"))
    out = {dst + "attn.sinks": sinks}                         # (GGUF's name has .weight)
    if cfg.o_proj_bias:
        out[dst + "attn.o_proj.bias"] = weights[src + "self_attn.o_proj.bias"]
    for kind in ("weight", "bias"):
        out[f"{dst}mlp.router.{kind}"] = weights[f"{src}mlp.router.{kind}"]
    if not cfg.stacked_experts:
        return {**out, **_split_experts(weights, cfg, layer)}
    experts = src + "mlp.experts."
    # the stacks are absent where every expert keeps its stored blocks (gpt_oss_expert_blocks)
    gate_up, down = weights.get(experts + "gate_up_proj"), weights.get(experts + "down_proj")
    gate_up_bias, down_bias = weights[experts + "gate_up_proj_bias"], \
        weights[experts + "down_proj_bias"]
    for e in range(cfg.num_experts):
        ours = f"{dst}mlp.experts.{e}."
        b = gate_up_bias[e]                                          # [2I], interleaved
        out[ours + "gate_up.bias"] = torch.cat([b[0::2], b[1::2]])
        out[ours + "down.bias"] = down_bias[e]
        if gate_up is not None:
            w = gate_up[e]                                           # [H, 2I]
            out[ours + "gate_up.weight"] = torch.cat([w[:, 0::2].t(), w[:, 1::2].t()]) \
                .contiguous()
        if down is not None:
            out[ours + "down.weight"] = down[e].t().contiguous()     # [H, I]
    return out


def _split_experts(weights: dict[str, torch.Tensor], cfg, layer: int) -> dict[str, torch.Tensor]:
    """A GGUF file's experts (each expert's gate, up and down apart, nn.Linear's layout,
    gate and up already de-interleaved by llama.cpp's converter): gate_up is gate then up by
    rows, its bias likewise. A weight read as blocks (absent) gets no entry."""
    out = {}
    for e in range(cfg.num_experts):
        src, ours = f"model.layers.{layer}.mlp.experts.{e}.", f"layers.{layer}.mlp.experts.{e}."
        for kind in ("weight", "bias"):
            gate, up = weights.get(f"{src}gate_proj.{kind}"), weights.get(f"{src}up_proj.{kind}")
            if gate is not None and up is not None:
                out[f"{ours}gate_up.{kind}"] = torch.cat([gate, up])
            if f"{src}down_proj.{kind}" in weights:
                out[f"{ours}down.{kind}"] = weights[f"{src}down_proj.{kind}"]
    return out


def gpt_oss_expert_blocks(stored: dict[str, tuple[int, torch.Tensor]], cfg,
                          held) -> dict[str, tuple[int, torch.Tensor]]:
    """The experts' Linears' stored blocks (an MXFP4 checkpoint's), cut from each layer's
    stacks (popped from `stored`: (GGML type, uint8 [E, N, K / 32 * bytes a block]), a row
    per output column of x @ W): gate_up's the even rows (gate) then the odd ones (up), as
    gpt_oss_layer orders the float weight; down's its expert's rows. Only Linears in `held`
    (module names)."""
    out = {}
    for layer in range(cfg.num_layers):
        experts = f"model.layers.{layer}.mlp.experts."
        if experts + "gate_up_proj" not in stored or experts + "down_proj" not in stored:
            continue
        (gate_up_kind, gate_up), (down_kind, down) = \
            stored.pop(experts + "gate_up_proj"), stored.pop(experts + "down_proj")
        rows = gate_up.shape[1]
        order = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])
        for e in range(cfg.num_experts):
            ours = f"layers.{layer}.mlp.experts.{e}."
            if ours + "gate_up" in held:
                out[ours + "gate_up"] = (gate_up_kind, gate_up[e][order].contiguous())
                out[ours + "down"] = (down_kind, down[e].contiguous())
    return out


def gpt_oss_mlp_sources(layer: int, cfg) -> dict[str, list[str]]:
    """weights.mlp_sources for a gpt-oss layer: the router, and every expert's Linears from
    their layer's stacked tensors (the loader reads those for any expert that needs them),
    or, from GGUF, each expert's gate and up (joined by rows) and down."""
    experts = f"model.layers.{layer}.mlp.experts."
    out = {"mlp.router": [f"model.layers.{layer}.mlp.router.weight"]}
    for e in range(cfg.num_experts):
        if cfg.stacked_experts:
            out[f"mlp.experts.{e}.gate_up"] = [experts + "gate_up_proj"]
            out[f"mlp.experts.{e}.down"] = [experts + "down_proj"]
        else:
            out[f"mlp.experts.{e}.gate_up"] = [f"{experts}{e}.{p}_proj.weight"
                                               for p in ("gate", "up")]
            out[f"mlp.experts.{e}.down"] = [f"{experts}{e}.down_proj.weight"]
    return out
