"""Whole tiny models written as GGUF files the way llama.cpp's converter writes them
(actors/testing/gguf_writer.py), loaded by us: Llama end to end against transformers, and the
Qwen and Gemma families' tensors under the Hugging Face names and values their checkpoints
hold."""
from __future__ import annotations

import json
import os
import random
import sys

import pytest
import torch

from pagewire.executor.block_embedding import BlockEmbedding
from pagewire import LLM, SamplingParams
from pagewire.executor.gguf_weights import read_gguf_weights
from pagewire.gguf_header import read_gguf_header
from pagewire.kernels.linear import Linear
from pagewire.model_info import default_model_path, resolve_model
from pagewire.testing.gguf_writer import TOKENIZER_KEYS, write_gguf
from pagewire.testing.real_shapes import cut_tokenizer
from tests.helpers import (HFOracle, answers_as_planes_and_codes, assert_greedy_equal,
                           rank_blocks, use_private_cache)


@pytest.fixture(scope="module")
def full_tokenizer_meta() -> dict:
    """The default model's tokenizer as its GGUF holds it (49,152 tokens)."""
    meta = read_gguf_header(default_model_path()).metadata
    return {k: meta[k] for k in TOKENIZER_KEYS if k in meta}


@pytest.fixture(scope="module")
def tokenizer_meta(full_tokenizer_meta) -> dict:
    """Its first 512 tokens (the specials, every byte, the first merges) and the merges among
    them: a valid byte-level BPE that transformers' GGUF reader and our tokenizer conversion
    parse in a fraction of the time (the tiny models here are fed token ids)."""
    return cut_tokenizer(full_tokenizer_meta)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Converted tokenizers and weights of these throwaway models stay out of ~/.cache."""
    use_private_cache(tmp_path, monkeypatch)


def _gguf_from_hf_dir(hf_dir: str, out: str, meta: dict, qtype: str) -> str:
    from transformers import AutoModelForCausalLM
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    state = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    return write_gguf(out, "llama", state, cfg, meta, qtype)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1", "Q4_0", "Q5_0", "IQ4_NL", "IQ4_XS",
                                   "MXFP4", "Q4_K_M"])
def test_tiny_llama_gguf_greedy_matches_transformers(tiny_llama, tmp_path, tokenizer_meta, qtype,
                                                     monkeypatch):
    """Ours on the GGUF file vs transformers on the same file (its own GGUF loader: its own
    dequantization and Q/K un-permutation). transformers takes head_dim as hidden / heads from
    a GGUF file, hence a shape where that holds. Q8_0 and Q4_1 decode steps multiply the
    file's blocks as stored (kernels/quant.py), Q4_0 as Q4_1 blocks, Q5_0 as Q8_0 blocks of
    the same values, IQ4_NL, IQ4_XS and MXFP4 as level tiles, Q4_K_M's Q4_K and Q6_K as
    32-weight blocks of the same values; prefill their dequantized copies, but for Q4_K_M, run with
    --quantized-matmul-tokens -1 (the default): every step on the blocks, no float copies
    kept (nor packed only to be dropped), none of its linears even dequantized as it loads
    (only the embedding and the norms are) and no dense copy cached on disk (its tiles
    are)."""
    from pagewire.executor import loader
    from transformers import AutoModelForCausalLM
    hf_dir = tiny_llama("gqa2-d128", intermediate_size=512)      # K-quants: 256-weight rows
    path = _gguf_from_hf_dir(hf_dir, str(tmp_path / "tiny.gguf"), tokenizer_meta, qtype)
    blocks_only = qtype == "Q4_K_M"
    packed, pack = [], Linear.pack

    def recording(linear, *args, **kwargs):
        pack(linear, *args, **kwargs)
        packed.append(linear.packed is not None)
    monkeypatch.setattr(Linear, "pack", recording)
    read, read_weights = [], loader.read_gguf_weights
    monkeypatch.setattr(loader, "read_gguf_weights",
                        lambda *a, **kw: read.append(read_weights(*a, **kw)) or read[-1])
    llm = LLM(path, dtype="float32", num_kv_blocks=256, max_model_len=256,
              quantized_matmul_tokens=-1 if blocks_only else 16)
    model = llm.runner.model
    (weights,) = read
    dense = [n for n in weights if n.endswith("proj.weight") or n == "lm_head.weight"]
    # the embedding looks its rows up from the file's blocks where torch dequantizes them
    block_embedding = isinstance(model.embed, BlockEmbedding)
    assert block_embedding == (qtype in ("Q8_0", "Q4_1", "Q4_0", "MXFP4", "Q4_K_M"))
    assert (dense == []) == blocks_only
    assert (model.embed.weight.numel() == 0) == block_embedding       # no float table held
    cache = os.path.join(os.environ["PAGEWIRE_CACHE_DIR"], "weights")
    dense = [f for f in os.listdir(cache) if "-tiles-" not in f] if os.path.isdir(cache) else []
    assert (dense == []) == blocks_only, dense
    floats = [m.weight is not None or m.packed is not None for m in model.modules()
              if isinstance(m, Linear)]
    assert floats == [not blocks_only] * len(floats)
    assert len(packed) == len(floats) and not (blocks_only and any(packed))
    kinds = [[s.kind % 100 for s in m.quantized.segments] if m.quantized else None
             for m in model.modules() if isinstance(m, Linear)]
    if qtype == "Q4_K_M":   # layer 0's qkv: q and k's Q4_K rows, then v's Q6_K ones, each in
        # superblock tiles (62: Q4_K's, 64: Q6_K's), the file's scales as stored
        assert kinds == [[62, 64], [62], [62], [64], [62], [62], [62], [64], [64]], kinds
    else:                   # qkv, o, gate_up, down a layer, then the LM head
        assert [k is not None for k in kinds] == [qtype != "F32"] * (4 * 2 + 1), kinds
    assert (model.fused_decode is not None) == (qtype != "F32")
    oracle = HFOracle(AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                           dtype=torch.float32))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (4, 19, 40)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        theirs, logits = oracle.greedy(prompt, 10)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"{qtype} prompt {len(prompt)}")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "MXFP4"])
def test_tensor_parallel_ranks_multiply_their_share_of_the_files_blocks(tiny_llama, tmp_path,
                                                                        tokenizer_meta, qtype):
    """Each of two ranks packs its rows of qkv, gate_up and the LM head and its block columns
    of o_proj from the file's blocks (Q5_0 and MXFP4 as Q8_0 ones); down's share (208 of 416
    columns) ends inside a block, so it stays float."""
    hf_dir = tiny_llama((192, 6, 3, 32))
    path = _gguf_from_hf_dir(hf_dir, str(tmp_path / "tiny.gguf"), tokenizer_meta, qtype)
    for kinds in rank_blocks(path):
        assert {n for n, k in kinds.items() if k == "float"} == {"layers.0.mlp.down",
                                                                 "layers.1.mlp.down"}
        assert len(kinds) == 9

def test_tensor_parallel_ranks_share_mixed_k_quant_linears(tiny_llama, tmp_path,
                                                          tokenizer_meta):
    """Q4_K_M's layer-0 qkv holds Q4_K rows (q, k) and Q6_K rows (v): each rank takes its
    rows of each segment, so every linear of both ranks multiplies blocks."""
    hf_dir = tiny_llama("gqa2-d128", intermediate_size=512)
    path = _gguf_from_hf_dir(hf_dir, str(tmp_path / "tiny.gguf"), tokenizer_meta, "Q4_K_M")
    for kinds in rank_blocks(path):
        assert set(kinds.values()) == {"blocks"}, kinds


def test_tokenizer_and_chat_template_come_from_the_file(tiny_llama, tmp_path, smol_tokenizer_dir,
                                                        full_tokenizer_meta):
    from transformers import AutoTokenizer

    from pagewire.hf_tokenizer import load_tokenizer
    path = _gguf_from_hf_dir(tiny_llama(), str(tmp_path / "t.gguf"), full_tokenizer_meta, "F32")
    tok = load_tokenizer(resolve_model(path))
    assert tok.chat_template == full_tokenizer_meta["tokenizer.chat_template"]
    reference = AutoTokenizer.from_pretrained(smol_tokenizer_dir)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.encode("Hello, world!") == reference.encode("Hello, world!")


def test_a_tokenizer_is_converted_once_for_every_file_that_holds_it(tiny_llama, tmp_path,
                                                                     tokenizer_meta, monkeypatch):
    """Two formats of one model share one conversion (keyed by the file's tokenizer keys, not
    its bytes); a file whose chat template differs is converted on its own."""
    import uuid

    from pagewire import hf_tokenizer
    converted = []
    convert = hf_tokenizer._convert_gguf_tokenizer
    monkeypatch.setattr(hf_tokenizer, "_convert_gguf_tokenizer",
                        lambda path, target: (converted.append(path), convert(path, target)))
    template = "{{ messages[0]['content'] }} " + uuid.uuid4().hex    # never converted before
    hf_dir = tiny_llama()
    paths = [_gguf_from_hf_dir(hf_dir, str(tmp_path / f"{name}.gguf"),
                               dict(tokenizer_meta, **{"tokenizer.chat_template": t}), qtype)
             for name, qtype, t in (("a", "F32", template), ("b", "Q8_0", template),
                                    ("c", "Q8_0", template + "!"))]
    dirs = [os.path.realpath(hf_tokenizer.tokenizer_directory(resolve_model(p))) for p in paths]
    assert dirs[0] == dirs[1] != dirs[2]
    assert converted == [paths[0], paths[2]]
    assert hf_tokenizer.tokenizer_directory(resolve_model(paths[1])) != dirs[1]   # its memo link
    assert hf_tokenizer.load_tokenizer(resolve_model(paths[2])).chat_template == template + "!"


def test_weight_cache_is_used_and_survives_damage(tiny_llama, tmp_path, tokenizer_meta):
    from pagewire.executor import weight_cache
    from pagewire.executor.loader import load_model
    info = resolve_model(_gguf_from_hf_dir(tiny_llama(), str(tmp_path / "c.gguf"),
                                           tokenizer_meta, "Q8_0"))
    first = load_model(info, "float32").state_dict()
    cached = weight_cache.cache_path(info.digest, torch.float32)
    assert os.path.isfile(cached)
    again = load_model(info, "float32").state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    with open(cached, "r+b") as f:       # cut short: ignored, converted again, rewritten
        f.truncate(os.path.getsize(cached) // 2)
    damaged = load_model(info, "float32").state_dict()
    assert all(torch.equal(first[k], damaged[k]) for k in first)
    assert weight_cache.load(info.digest, torch.float32) is not None    # whole again


def test_int8_all_multiplies_q6_k_as_bit_planes_as_it_does_its_codes(tiny_llama, tmp_path,
                                                                     tokenizer_meta,
                                                                     monkeypatch):
    """--quantized-activations int8-all on avx512_bf16: a Q4_K_M file's Q6_K linears (v_proj's
    rows of qkv, down, the LM head) multiply as bit planes (Q6_KP), prompts through the GEMM
    and decodes through the small steps, answering the tokens of the same engine with
    Q6_KS's int8 codes (the same integer sums: equal logits)."""
    from pagewire.kernels import quant, tiers
    if tiers.best() != "avx512_bf16":
        pytest.skip("Q6_K's bit planes are avx512_bf16's")
    path = _gguf_from_hf_dir(tiny_llama("gqa2-d128", intermediate_size=512),
                             str(tmp_path / "t.gguf"), tokenizer_meta, "Q4_K_M")
    prompts = [{"prompt_token_ids": [5, 77, 300, 12, 9, 41, 8, 100, 3, 250]},
               {"prompt_token_ids": [7, 7, 42, 19, 300, 2, 61, 5, 90]}]
    answers = answers_as_planes_and_codes(
        lambda: LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256,
                    quantized_activations="int8-all"),
        lambda model: [m for m in model.modules() if isinstance(m, Linear)], prompts,
        monkeypatch)
    (planes, planes_out), (codes, codes_out) = answers["planes"], answers["codes"]
    assert quant.Q6_KP + 100 in planes and quant.Q6_KS + 100 not in planes
    assert quant.Q6_KS + 100 in codes and quant.Q6_KP + 100 not in codes
    assert planes_out == codes_out


def test_a_restart_maps_the_packed_tiles(tiny_llama, tmp_path, tokenizer_meta, monkeypatch):
    """The first start packs a Q4_K_M file's blocks and caches the tiles (tile_cache.py); the
    next packs nothing and answers the same tokens; a damaged cache file is packed again."""
    from pagewire.kernels import quant
    path = _gguf_from_hf_dir(tiny_llama("gqa2-d128", intermediate_size=512),
                             str(tmp_path / "t.gguf"), tokenizer_meta, "Q4_K_M")
    prompt = {"prompt_token_ids": [5, 77, 300, 12, 9, 41]}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def answer() -> list[int]:
        llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256)
        tiles = [s.tiles for m in llm.runner.model.modules() if isinstance(m, Linear)
                 for s in m.quantized.segments]
        return llm.generate([prompt], params)[0].outputs[0].token_ids, tiles
    first, tiles = answer()
    (cached,) = os.listdir(os.path.join(os.environ["PAGEWIRE_CACHE_DIR"], "weights"))
    assert "-uint8-tiles-" in cached and "-0of1-" in cached
    pack = quant.pack
    monkeypatch.setattr(quant, "pack", lambda *a, **kw: pytest.fail("packed again"))
    again, mapped = answer()
    assert again == first and all(torch.equal(a, b) for a, b in zip(tiles, mapped))
    file = os.path.join(os.environ["PAGEWIRE_CACHE_DIR"], "weights", cached)
    whole = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(whole // 2)
    monkeypatch.setattr(quant, "pack", pack)
    assert answer()[0] == first and os.path.getsize(file) == whole      # rewritten


def test_the_weight_cache_keeps_to_its_limit(tmp_path, monkeypatch):
    """prune(): a file of a stale converter version goes at once, then the least recently
    used until the rest fits the limit; the file just written stays, whatever its size."""
    from pagewire.executor import weight_cache
    directory = tmp_path / "weights"
    directory.mkdir()
    version = weight_cache.cache_path("x", torch.float32).rsplit("-", 1)[1]
    files = [("old-bfloat16-" + version, 300), ("stale-bfloat16-0bad0bad.safetensors", 10),
             ("mid-bfloat16-" + version, 300), ("new-bfloat16-" + version, 500)]
    for i, (name, size) in enumerate(files):
        path = directory / name
        path.write_bytes(b"\0" * size)
        os.utime(path, (1000 + i, 1000 + i))
    removed = weight_cache.prune(str(directory / ("new-bfloat16-" + version)), limit=600)
    assert removed == ["stale-bfloat16-0bad0bad.safetensors", "old-bfloat16-" + version,
                       "mid-bfloat16-" + version]
    assert os.listdir(directory) == ["new-bfloat16-" + version]


def _tiny_hf(arch: str, **overrides):
    import transformers as tf
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512)
    cls, cfg_cls, extra = {
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config, {}),
        # transformers reads no head_dim from a qwen3 GGUF file: its default, 128, it is
        "qwen3": (tf.Qwen3ForCausalLM, tf.Qwen3Config, {"head_dim": 128}),
        "gemma": (tf.GemmaForCausalLM, tf.GemmaConfig, {}),
        "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config, {}),
        "gemma3": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig, {}),
    }[arch]
    torch.manual_seed(0)
    model = cls(cfg_cls(**{**common, **extra, **overrides})).float()
    with torch.no_grad():
        for name, p in model.named_parameters():   # norms away from 0 and 1, biases nonzero
            p.normal_(0.3 if "norm" in name else 0, 0.1)
    return model


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma", "gemma2", "gemma3"])
def test_family_tensors_read_under_hf_names(tmp_path, tokenizer_meta, arch):
    """Every tensor of the Hugging Face checkpoint comes back under its own name with its own
    value: Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k norms, Gemma 2/3's four norms per
    layer, not permuted (NEOX rope in ggml), Gemma norms minus llama.cpp's +1."""
    model = _tiny_hf(arch)
    cfg = model.config.to_dict()
    state = {k: v for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    path = write_gguf(str(tmp_path / f"{arch}.gguf"), arch, state, cfg, tokenizer_meta)
    header = read_gguf_header(path)
    ours = read_gguf_weights(path, header, 4, 2)
    assert sorted(ours) == sorted(state)
    for name, w in state.items():
        exact = not (arch.startswith("gemma") and name.endswith("norm.weight"))
        torch.testing.assert_close(ours[name], w, rtol=0, atol=0 if exact else 1e-7, msg=name)
    if arch != "gemma":      # transformers reads GGUF gemma2/3 and qwen2/3, not gemma
        _assert_transformers_agrees(tmp_path, f"{arch}.gguf", state)


def _assert_transformers_agrees(directory, file: str, state: dict) -> None:
    """transformers' own GGUF loader reads the file as the same checkpoint: the file is
    written by llama.cpp's conventions as transformers understands them too."""
    from transformers import AutoModelForCausalLM
    theirs = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=file,
                                                  dtype=torch.float32).state_dict()
    for name, w in state.items():
        torch.testing.assert_close(theirs[name], w, rtol=0, atol=1e-7, msg=name)


# llama.cpp keeps no query_pre_attn_scalar: it scales by head_dim ** -0.5 (27B aside).
_GGUF_GEMMA = {"sliding_window": 8, "query_pre_attn_scalar": 16}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma2", "gemma3"])
def test_family_gguf_greedy_matches_transformers(tmp_path, tokenizer_meta, arch):
    """Ours on the GGUF file against transformers on the checkpoint it was written from:
    Gemma's sliding window (8, below the prompt) and soft-capping come from the metadata.
    (A gemma 1 GGUF's tokenizer cannot be converted: transformers refuses the architecture.)"""
    model = _tiny_hf(arch, **(_GGUF_GEMMA if arch.startswith("gemma") else {}))
    cfg = model.config.to_dict()
    state = {k: v for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    path = write_gguf(str(tmp_path / f"{arch}.gguf"), arch, state, cfg, tokenizer_meta)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 30)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    oracle = HFOracle(model)
    for prompt, out in zip(prompts, outs):
        theirs, logits = oracle.greedy(prompt, 8)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"{arch} {len(prompt)}")


def test_llama3_rope_freqs_tensor_scales_the_rope(tmp_path, tokenizer_meta):
    """llama.cpp keeps Llama 3's rope scaling as a rope_freqs tensor (a divisor per frequency),
    not as metadata: ours on such a file equals transformers on the llama3-scaled checkpoint."""
    import transformers as tf
    from pagewire.kernels.rotary import rope_inv_freq
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512,
                         rope_parameters={"rope_theta": 10000.0, **scaling})
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.08)
    plain, _ = rope_inv_freq(64, 10000.0)
    scaled, _ = rope_inv_freq(64, 10000.0, scaling)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"} \
        if cfg.tie_word_embeddings else model.state_dict()
    path = write_gguf(str(tmp_path / "llama3.gguf"), "llama", state, cfg.to_dict(),
                      tokenizer_meta, raw={"rope_freqs.weight": (plain / scaled).numpy()})
    llm = LLM(path, dtype="float32", num_kv_blocks=64, max_model_len=256)
    prompt = list(range(3, 90))
    (out,) = llm.generate([{"prompt_token_ids": prompt}],
                          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    theirs, logits = HFOracle(model).greedy(prompt, 10)
    assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, "llama3 rope_freqs")


def test_int16_blocks_serve_every_step_on_the_avx2_tier(tiny_llama, tmp_path, tokenizer_meta,
                                                        tier, monkeypatch):
    """--quantized-matmul-tokens auto, on a core whose int16 products outrun its FMAs (the
    rate forced, so every machine tests this path): on `avx2` (int16 activations) the blocks'
    integer GEMM multiplies the prefill too and no linear keeps a float copy; the greedy
    tokens still match transformers'. Elsewhere steps of up to 16 tokens take the blocks
    (int16 ones on `avx512`, exact ones on the bfloat16 tiers) and the float copy stays for
    larger ones."""
    from transformers import AutoModelForCausalLM
    from pagewire.kernels import native, tiers
    monkeypatch.setattr(native.load(tier), "int16_mac_ratio", 1.7)
    hf_dir = tiny_llama("gqa2-d128", intermediate_size=512)
    path = _gguf_from_hf_dir(hf_dir, str(tmp_path / "tiny.gguf"), tokenizer_meta, "Q4_1")
    llm = LLM(path, dtype="float32", num_kv_blocks=256, max_model_len=256, kernels=tier,
              quantized_matmul_tokens=None)
    gemm = tier == "avx2"
    linears = [m for m in llm.runner.model.modules() if isinstance(m, Linear)]
    kind = 0 if tiers.has_bf16_dot(tier) else 2
    assert [m.quantized.kind // 100 for m in linears] == [kind] * len(linears)
    assert [m.packed is None and m.weight is None for m in linears] == [gemm] * len(linears)
    assert {m.quantized_max_tokens for m in linears} == {sys.maxsize if gemm else 16}
    oracle = HFOracle(AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                           dtype=torch.float32))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (13, 60)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        theirs, logits = oracle.greedy(prompt, 8)
        assert_greedy_equal(out.outputs[0].token_ids, theirs, logits, f"{tier} {len(prompt)}")


@pytest.mark.parametrize("tier", ["avx2"], indirect=True)
def test_slow_int16_products_keep_dense_copies_for_large_steps(tiny_llama, tmp_path,
                                                                tokenizer_meta, tier,
                                                                monkeypatch):
    """The same model on a core whose vpmaddwd does no more than its FMAs (Haswell, Zen 1):
    auto keeps the float copies for steps over 16 tokens, and the greedy tokens of a prompt
    that takes them equal those of --quantized-matmul-tokens 16."""
    from pagewire.kernels import native
    monkeypatch.setattr(native.load(tier), "int16_mac_ratio", 1.0)
    hf_dir = tiny_llama("gqa2-d128", intermediate_size=512)
    path = _gguf_from_hf_dir(hf_dir, str(tmp_path / "tiny.gguf"), tokenizer_meta, "Q4_1")
    prompt = [random.Random(8).randrange(3, 512) for _ in range(40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = []
    for matmul_tokens in (None, 16):
        llm = LLM(path, dtype="float32", num_kv_blocks=256, max_model_len=256, kernels=tier,
                  quantized_matmul_tokens=matmul_tokens)
        linears = [m for m in llm.runner.model.modules() if isinstance(m, Linear)]
        assert all(m.packed is not None or m.weight is not None for m in linears)
        assert {m.quantized_max_tokens for m in linears} == {16}
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        tokens.append(out.outputs[0].token_ids)
    assert tokens[0] == tokens[1]
