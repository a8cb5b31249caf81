"""LoRA adapters: a batch mixing the base model and several adapters gives every request the
greedy tokens of transformers on its merged weights; adapters never share prefix-cache blocks
(nor two loads of one); unsupported adapters are refused with the reason; max_loras holds."""
from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch

from pagewire import LLM, LoRARequest, SamplingParams
from pagewire.lora_files import InvalidAdapter, read_adapter
from pagewire.model_info import resolve_model
from tests.helpers import HFOracle, assert_greedy_equal, make_tiny_llama

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 45)), [100, 101, 100, 101, 7]]


def shapes_of(base: str) -> dict[str, tuple[int, int]]:
    """Each projection's (out, in) in the tiny base model."""
    cfg = json.load(open(os.path.join(base, "config.json")))
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def make_adapter(path: str, base: str, targets=ATTN + MLP, rank: int = 4, alpha: float = 8.0,
                 seed: int = 0, layers=(0, 1), extra_config: dict | None = None,
                 tensors: dict | None = None, dtype: torch.dtype = torch.float32) -> str:
    """A PEFT LoRA adapter with random, non-trivial A and B (PEFT starts B at zero), stored
    as `dtype`."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
              "target_modules": list(targets), "base_model_name_or_path": base,
              **(extra_config or {})}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in layers:
        for proj in targets:
            out, inp = shapes_of(base)[proj]
            kind = "self_attn" if proj in ATTN else "mlp"
            key = f"base_model.model.model.layers.{layer}.{kind}.{proj}"
            weights[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) * 0.2).to(dtype)
            weights[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.2).to(dtype)
    weights.update(tensors or {})
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    return path


def merged_oracle(base: str, adapter: str | None, conv1d: bool = False) -> HFOracle:
    """transformers on the base weights plus scale * B @ A for every adapted projection
    (`conv1d`: GPT-2's weights, stored [in, out], take it transposed)."""
    oracle = HFOracle.from_dir(base)
    if adapter is not None:
        merge(oracle.model, adapter, conv1d)
    return oracle


def merge(model, adapter: str, conv1d: bool = False) -> None:
    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
    rank = cfg["r"]
    scale = cfg["lora_alpha"] / (rank ** 0.5 if cfg.get("use_rslora") else rank)
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in tensors.items():
            if ".lora_A." in name:
                delta = scale * (tensors[name.replace("lora_A", "lora_B")].float() @ a.float())
                if _merge_fused(params, name, tensors, scale):
                    continue
                if not _merge_expert(params, name, delta):
                    target = name.removeprefix("base_model.model.").replace(".lora_A.weight",
                                                                             ".weight")
                    params[target] += delta.T if conv1d else delta


def _merge_fused(params: dict, name: str, tensors: dict, scale: float) -> bool:
    """gpt-oss's stacked experts adapted through PEFT's target_parameters (A [r E, in], B
    [out, r E]) merged as PEFT's ParamWrapper computes the delta of a stack stored [E, in,
    out]; the stack is the one whose out B's rows match (gate_up_proj's 2I, down_proj's H).
    False for any other tensor."""
    match = re.fullmatch(r"base_model\.model\.(model\.layers\.\d+\.mlp\.experts)"
                         r"(\.base_layer)?\.lora_A\.weight", name)
    if match is None:
        return False
    a, b = tensors[name].float(), tensors[name.replace("lora_A", "lora_B")].float()
    stacks = [params[f"{match.group(1)}.{p}"] for p in ("gate_up_proj", "down_proj")]
    (stack,) = [p for p in stacks if p.shape[2] == b.shape[0]]
    experts = stack.shape[0]
    delta = torch.einsum("ore,eri->eio", b.reshape(b.shape[0], -1, experts),
                         a.reshape(experts, -1, a.shape[1])) * scale
    stack += delta
    return True


def _merge_expert(params: dict, name: str, delta: torch.Tensor) -> bool:
    """A per-expert adapter's delta (PEFT's transformers-4 names: experts.E.w1/w3/w2 or
    gate/up/down_proj) merged into transformers 5's stacked experts (gate_up_proj [E, 2I, H],
    gate's rows first; down_proj [E, H, I]); False for any other tensor."""
    expert = re.search(r"layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.lora_A", name)
    if expert is None:
        return False
    layer, e, proj = int(expert.group(1)), int(expert.group(2)), expert.group(3)
    stack = f"model.layers.{layer}.mlp.experts."
    if proj in ("w2", "down_proj"):
        params[stack + "down_proj"][e] += delta
    else:
        rows, up = delta.shape[0], int(proj in ("w3", "up_proj"))
        params[stack + "gate_up_proj"][e, up * rows:(up + 1) * rows] += delta
    return True


@pytest.fixture(scope="module")
def base(tmp_path_factory, smol_tokenizer_dir):
    return make_tiny_llama(str(tmp_path_factory.mktemp("lora-base") / "m"), smol_tokenizer_dir,
                           vocab_size=512, seed=6)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, base) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {"attn-qv": make_adapter(str(root / "qv"), base, ("q_proj", "v_proj"), rank=8,
                                    alpha=16, seed=1),
            "all-rslora": make_adapter(str(root / "all"), base, rank=4, alpha=4, seed=2,
                                       extra_config={"use_rslora": True}, dtype=torch.bfloat16),
            "mlp-layer1": make_adapter(str(root / "mlp"), base, MLP, rank=2, alpha=4, seed=3,
                                       layers=(1,), dtype=torch.float16)}


def _greedy(llm: LLM, prompts, loras, n: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_a_mixed_batch_gives_each_request_its_merged_models_tokens(base, adapters, kernels):
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=4,
              enable_lora=True, max_loras=3, kernels=kernels)
    names = [None, *adapters]
    requests = {name: LoRARequest(name, i, adapters[name]) for i, name in enumerate(names)
                if name}
    cases = [(p, name) for p in PROMPTS for name in names]        # every adapter in every step
    ours = _greedy(llm, [p for p, _ in cases], [requests.get(n) for _, n in cases])
    oracles = {name: merged_oracle(base, adapters.get(name)) for name in names}
    seen = {}
    for (prompt, name), tokens in zip(cases, ours):
        theirs, logits = oracles[name].greedy(prompt, len(tokens))
        assert_greedy_equal(tokens, theirs, logits, f"{name} on a prompt of {len(prompt)}")
        seen.setdefault(tuple(prompt), set()).add(tuple(tokens))
    assert all(len(outs) == len(names) for outs in seen.values())   # the adapters matter
    assert llm.scheduler.kv.num_free == llm.scheduler.kv.num_blocks


@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
def test_adapter_weights_are_as_narrow_as_the_file_or_the_model(base, adapters, model_dtype):
    """float32 adapter files on a bfloat16 model are held in bfloat16 (vLLM's lora_dtype
    auto: a step reads every weight); a narrower file keeps its own dtype."""
    llm = LLM(base, dtype=model_dtype, max_model_len=256, num_kv_blocks=64, block_size=4,
              enable_lora=True, max_loras=3)
    loras = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())]
    _greedy(llm, PROMPTS[:1] * 3, loras, n=2)
    held = {name: {w.a.dtype for w in llm.runner.adapters.loaded[i + 1].weights.values()}
            for i, name in enumerate(adapters)}
    narrow = getattr(torch, model_dtype)
    assert held == {"attn-qv": {narrow}, "all-rslora": {torch.bfloat16},
                    "mlp-layer1": {torch.float16}}


def test_prefix_blocks_are_shared_by_equal_adapter_content_only(base, adapters, tmp_path):
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=4,
              enable_lora=True)
    prompt = list(range(30, 62))                          # 8 full blocks
    tables = llm.scheduler.tables

    def hits(lora) -> int:
        before = tables.prefix_hits
        _greedy(llm, [prompt], lora, n=2)
        return tables.prefix_hits - before

    first = LoRARequest("qv", 1, adapters["attn-qv"])
    assert hits(first) == 0 and hits(first) == 28         # its own blocks, found again
    assert hits(LoRARequest("all", 2, adapters["all-rslora"])) == 0
    assert hits(None) == 0                                # the base model's are apart too
    reloaded = make_adapter(str(tmp_path / "qv2"), base, ("q_proj", "v_proj"), rank=8,
                            alpha=16, seed=5)
    assert hits(LoRARequest("qv", 1, reloaded)) == 0      # same name, a new version
    # The same files under another name and id: their content digest salts the blocks, so
    # they are found (as they are by a restarted engine through the disk tier).
    assert hits(LoRARequest("qv-copy", 7, adapters["attn-qv"])) == 28


def _refused(tmp_path, base, **kw) -> str:
    with pytest.raises(InvalidAdapter) as e:
        read_adapter(make_adapter(str(tmp_path / "bad"), base, **kw), resolve_model(base), 16)
    return str(e.value)


@pytest.mark.parametrize("kw, words", [
    ({"rank": 32}, "rank 32 is above --max-lora-rank 16"),
    ({"extra_config": {"use_dora": True}}, "DoRA is not supported"),
    ({"extra_config": {"modules_to_save": ["lm_head"]}}, "modules_to_save"),
    ({"extra_config": {"bias": "all"}}, "bias 'all'"),
    ({"extra_config": {"rank_pattern": {"q_proj": 2}}}, "per-module ranks"),
    ({"tensors": {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 512)}},
     "embeddings, LM head"),
    ({"tensors": {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                  torch.zeros(7, 4)}}, "has shape [7, 4], the base model needs [256, 4]"),
    ({"layers": (0, 5)}, "the base model has 2 layers"),
], ids=["rank", "dora", "modules_to_save", "bias", "rank_pattern", "embedding", "shape",
        "layer"])
def test_unsupported_adapters_are_refused_with_the_reason(tmp_path, base, kw, words):
    assert words in _refused(tmp_path, base, **kw)


def test_a_refused_adapter_leaves_the_engine_serving(tmp_path, base, adapters):
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=4,
              enable_lora=True)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(InvalidAdapter, match="pickled and is refused"):
        _greedy(llm, PROMPTS[:1], LoRARequest("p", 1, str(pickled)))
    with pytest.raises(InvalidAdapter, match="no such adapter directory"):
        _greedy(llm, PROMPTS[:1], LoRARequest("gone", 2, str(tmp_path / "nowhere")))
    good = _greedy(llm, PROMPTS[:1], LoRARequest("qv", 3, adapters["attn-qv"]))
    theirs, logits = merged_oracle(base, adapters["attn-qv"]).greedy(PROMPTS[0], 12)
    assert_greedy_equal(good[0], theirs, logits)


def test_max_loras_caps_the_adapters_of_a_step(base, adapters):
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=4,
              enable_lora=True, max_loras=1, max_cpu_loras=2)
    widths, lora_batch = [], llm.runner._lora_batch

    def recording(*args):
        batch = lora_batch(*args)
        widths.append(0 if batch is None else len(batch.adapters))
        return batch
    llm.runner._lora_batch = recording
    names = list(adapters)
    loras = [LoRARequest(n, i + 1, adapters[n]) for i, n in enumerate(names)] + [None]
    ours = _greedy(llm, [PROMPTS[1]] * 4, loras)
    assert max(widths) == 1 and len(llm.runner.adapters.loaded) <= 2
    for lora, tokens in zip(loras, ours):
        oracle = merged_oracle(base, lora and lora.lora_path)
        theirs, logits = oracle.greedy(PROMPTS[1], len(tokens))
        assert_greedy_equal(tokens, theirs, logits)


def test_triton_steps_with_the_same_adapters_reuse_their_stacked_weights(base, adapters):
    """TritonOps stacks a step's adapters' weights a linear (LoraBatch.dense) once for every
    step with the same loads in the same order; another set stacks anew, and an unloaded
    adapter's stacks go with it. Tokens stay the merged models'."""
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=4,
              enable_lora=True, max_loras=2, max_cpu_loras=2, kernels="triton")
    batches, lora_batch = [], llm.runner._lora_batch

    def recording(*args):
        batches.append(lora_batch(*args))
        return batches[-1]
    llm.runner._lora_batch = recording
    loras = [LoRARequest(n, i + 1, path) for i, (n, path) in enumerate(adapters.items())]
    slot, stacked = llm.runner.model.layers[0].attn.qkv.lora_slot, []
    for pair in (loras[:2], loras[1:]):          # the second loads a third, unloading the first
        del batches[:]
        ours = _greedy(llm, PROMPTS[:2], pair, n=4)
        for prompt, lora, tokens in zip(PROMPTS, pair, ours):
            assert_greedy_equal(tokens, *merged_oracle(base, lora.lora_path).greedy(
                prompt, len(tokens)))
        assert len(batches) > 1 and len({tuple(a.generation for a in b.adapters)
                                         for b in batches}) == 1
        assert all(b.dense(slot)[0] is batches[0].dense(slot)[0] for b in batches)
        stacked.append(batches[0].dense(slot)[0])
    assert stacked[1] is not stacked[0]
    assert list(llm.runner.adapters.stacks) == [tuple(a.generation for a in batches[0].adapters)]


def test_a_decode_streams_steps_share_one_lora_batch(base, adapters):
    """Each decode step of one stream lays its row out as the step before did, with the same
    load: it gets that step's LoraBatch again. The prefill, another adapter and a reload after
    an eviction (a new load) each make a new one."""
    llm = LLM(base, dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=4,
              enable_lora=True, max_loras=1, max_cpu_loras=1)
    batches, lora_batch = [], llm.runner._lora_batch

    def recording(*args):
        batches.append(lora_batch(*args))
        return batches[-1]
    llm.runner._lora_batch = recording
    first, second = (LoRARequest(n, i + 1, adapters[n])
                     for i, n in enumerate(("attn-qv", "all-rslora")))
    tokens = _greedy(llm, [PROMPTS[0]], [first], n=5)[0]
    assert_greedy_equal(tokens, *merged_oracle(base, first.lora_path).greedy(PROMPTS[0], 5))
    prefill, *decodes = batches
    assert len(decodes) == 4 and all(b is decodes[0] for b in decodes)
    assert decodes[0] is not prefill and decodes[0].adapter_of_row.tolist() == [0]
    for lora, generation in ((second, 1), (first, 2)):   # each load evicts the other
        del batches[:]
        _greedy(llm, [PROMPTS[0]], [lora], n=3)
        assert {b.adapters[0].generation for b in batches} == {generation}
        assert decodes[0] not in batches
        assert llm.runner.adapters.last[1] is batches[-1]


def test_lora_requests_info_names_the_running_and_waiting_adapters():
    from prometheus_client import generate_latest
    from pagewire.gateway.metrics import GatewayMetrics
    m = GatewayMetrics("tiny", max_loras=2)
    m.on_loras(["a", "b"], ["c"])
    m.on_loras(["c"], [])
    text = generate_latest(m.registry).decode()
    samples = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info")]
    assert len(samples) == 1 and samples[0].startswith(
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="c",'
        'waiting_lora_adapters=""}')
    assert "lora_requests_info" not in generate_latest(GatewayMetrics("tiny").registry).decode()


@pytest.mark.slow
def test_the_default_model_with_adapters_matches_transformers(tmp_path, default_hf_model):
    """The GGUF's quantized linears: decode steps take the fused native path, the adapters'
    deltas inside it; prefill takes the per-op path."""
    from safetensors.torch import save_file
    from pagewire.lora_files import projection_shapes
    info = resolve_model(None)
    paths = []
    for seed, targets in ((1, ATTN + MLP), (2, ("q_proj", "v_proj", "down_proj"))):
        path = tmp_path / f"a{seed}"
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps(
            {"r": 8, "lora_alpha": 16, "target_modules": list(targets)}))
        g, weights = torch.Generator().manual_seed(seed), {}
        for layer in range(info.num_layers):
            for proj in targets:
                out, inp = projection_shapes(info)[proj]
                key = f"base_model.model.model.layers.{layer}." \
                      f"{'self_attn' if proj in ATTN else 'mlp'}.{proj}"
                weights[f"{key}.lora_A.weight"] = torch.randn(8, inp, generator=g) * 0.05
                weights[f"{key}.lora_B.weight"] = torch.randn(out, 8, generator=g) * 0.05
        save_file(weights, str(path / "adapter_model.safetensors"))
        paths.append(str(path))
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory=64 * 2**20,
              enable_lora=True, max_loras=2)
    assert llm.runner.model.fused_decode is not None
    loras = [LoRARequest("a1", 1, paths[0]), LoRARequest("a2", 2, paths[1])]
    prompt = [{"role": "user", "content": "Write a haiku about the sea."}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = [llm.chat([prompt], params, lora_request=lora)[0] for lora in loras]
    base_out = llm.chat([prompt], params)[0].outputs[0].token_ids
    assert len({tuple(o.outputs[0].token_ids) for o in outs} | {tuple(base_out)}) == 3
    for lora, out in zip(loras, outs):
        model = copy.deepcopy(default_hf_model)
        merge(model, lora.lora_path)
        theirs, logits = HFOracle(model).greedy(out.prompt_token_ids, 12)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, str(lora))
