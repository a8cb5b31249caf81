"""Random-weight models of real shapes: GGUF files and bfloat16 Hugging Face directories whose
tensors have the sizes and storage types of the models people serve, so speed and memory are
measured at those sizes (bench/real_shapes.py is the command; the tests write tiny ones;
real_shapes_hf.py writes the Hugging Face directories).

Quality is not the point, bytes and shapes are. Nothing is quantized: each GGUF tensor is
written as random block bytes whose fp16 scale fields are then set to small values, so an 8B
file takes seconds of CPU and one tensor's memory at a time. The scales give weights of
about 0.02 root mean square (like a checkpoint's init), which keeps the residual stream and
logits finite through 32 layers. The vocabulary and tokenizer are the default model's."""
from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np

from .gguf_writer import TOKENIZER_KEYS, add_metadata, copy_tokenizer, tensor_type

# Public config.json values; the vocabulary is the default model's, not the real one.
SHAPES = {
    "llama-3.2-1b": dict(architecture="LlamaForCausalLM", hidden_size=2048,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, tie_word_embeddings=True,
                         rope_theta=500000.0, rms_norm_eps=1e-5),
    "llama-3.2-3b": dict(architecture="LlamaForCausalLM", hidden_size=3072,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         intermediate_size=8192, tie_word_embeddings=True,
                         rope_theta=500000.0, rms_norm_eps=1e-5),
    "llama-3.1-8b": dict(architecture="LlamaForCausalLM", hidden_size=4096,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, tie_word_embeddings=False,
                         rope_theta=500000.0, rms_norm_eps=1e-5),
    "qwen2.5-1.5b": dict(architecture="Qwen2ForCausalLM", hidden_size=1536,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-7b": dict(architecture="Qwen2ForCausalLM", hidden_size=3584,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, tie_word_embeddings=False,
                       rope_theta=1000000.0, rms_norm_eps=1e-6),
    # Mixture of experts: 64 experts of 1024 rows, 8 a token (GGUF only: a Hugging Face
    # directory's experts are one tensor each, which tensor_plan does not lay out).
    "olmoe-1b-7b": dict(architecture="OlmoeForCausalLM", hidden_size=2048,
                        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                        intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                        tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5),
    # gpt-oss-20b's (GGUF only): 32 experts of 2880 rows, 4 a token, MXFP4 as ggml-org's
    # file stores them; attention sinks, biases, every other layer a 128-token window.
    "gpt-oss-20b": dict(architecture="GptOssForCausalLM", hidden_size=2880,
                        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=64, intermediate_size=2880, num_local_experts=32,
                        num_experts_per_tok=4, sliding_window=128, tie_word_embeddings=False,
                        rope_theta=150000.0, rms_norm_eps=1e-5, rope_parameters=dict(
                            rope_type="yarn", factor=32.0, rope_theta=150000.0,
                            original_max_position_embeddings=4096)),
    # The GPT family: Pythia-1.4B's (GGUF only, as the mixture).
    "gpt-neox-1.4b": dict(architecture="GPTNeoXForCausalLM", hidden_size=2048,
                          num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                          intermediate_size=8192, rotary_pct=0.25, use_parallel_residual=True,
                          layer_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0),
}
# MXFP4: gpt-oss's experts MXFP4, its other linears and embedding Q8_0 (gpt-oss only).
# IQ4_XS: the linears IQ4_XS, the embedding and LM head Q6_K (llama.cpp's choice for them).
FORMATS = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q8_0", "bf16", "MXFP4", "IQ4_XS")
MAX_POSITION = 32768          # a 32k context is servable
GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "OlmoeForCausalLM": "olmoe", "GPTNeoXForCausalLM": "gptneox",
             "GptOssForCausalLM": "gpt-oss"}

# GGML type -> (bytes per block, weights per block, (byte offset of an fp16 scale, low,
# high) for each scale field). Every other byte may be anything: all bit patterns are valid
# quants (and Q4_K's packed 6-bit scales). The ranges give weights of ~0.02 rms: Q4_0
# d * (q - 8); Q8_0 d * q; Q4_K d * sc * q - dmin * mn (dmin ~ 7.5 d centres a sub-block
# on average); Q6_K d * sc * q with sc cut to -16..15 (below), so d stays a normal fp16.
BLOCKS = {
    "Q4_0": (18, 32, ((0, 0.002, 0.006),)),
    "Q8_0": (34, 32, ((0, 1.5e-4, 4e-4),)),
    "Q4_K": (144, 256, ((0, 6.5e-5, 1.1e-4), (2, 5e-4, 8e-4))),
    "Q5_K": (176, 256, ((0, 3.2e-5, 5.5e-5), (2, 5e-4, 8e-4))),   # q to 31: half Q4_K's d
    "Q6_K": (210, 256, ((208, 8e-5, 1.6e-4),)),
    "MXFP4": (17, 32, ()),     # E8M0 exponents 119-121 (below): 2^-9..2^-7 x levels to 12
    "IQ4_XS": (136, 256, ((0, 1.2e-5, 2e-5),)),   # d x (-32..31) x levels of rms ~68
}


class Planned(NamedTuple):
    hf_name: str
    gguf_name: str
    dims: tuple[int, ...]     # numpy order: [out, in] for a linear
    ggml_type: str            # "F32" for norms and biases in a GGUF file


def default_tokenizer_meta(limit: int | None = None) -> dict:
    """The default model's tokenizer as its GGUF holds it, cut to its first `limit` tokens
    where given (cut_tokenizer). PAGEWIRE_TEST_GGUF_TOKENIZER names a JSON copy instead
    (tests/gpu_prepare.sh writes it for a machine without the default model's package)."""
    if os.environ.get("PAGEWIRE_TEST_GGUF_TOKENIZER"):
        with open(os.environ["PAGEWIRE_TEST_GGUF_TOKENIZER"]) as f:
            meta = json.load(f)
    else:
        from pagewire.gguf_header import read_gguf_header
        from pagewire.model_info import default_model_path
        meta = read_gguf_header(default_model_path()).metadata
    meta = {k: meta[k] for k in TOKENIZER_KEYS if k in meta}
    return meta if limit is None else cut_tokenizer(meta, limit)


def cut_tokenizer(meta: dict, limit: int = 512) -> dict:
    """A GGUF tokenizer's metadata cut to its first `limit` tokens (the specials, every byte,
    the first merges) and the merges among them: a valid byte-level BPE that transformers'
    GGUF reader and our conversion parse in a fraction of the full one's time (tiny test
    models are fed token ids)."""
    meta = dict(meta)
    tokens = list(meta["tokenizer.ggml.tokens"][:limit])
    kept = set(tokens)
    meta["tokenizer.ggml.tokens"] = tokens
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][:limit]
    meta["tokenizer.ggml.merges"] = [
        m for m in meta["tokenizer.ggml.merges"]
        if all(p in kept for p in m.split(" ", 1)) and m.replace(" ", "", 1) in kept]
    return meta


def hf_config(shape: dict, vocab_size: int, bos: int, eos: int) -> dict:
    """config.json of a shape (also what the GGUF metadata is written from)."""
    cfg = {k: v for k, v in shape.items() if k != "architecture"}
    cfg.setdefault("max_position_embeddings", MAX_POSITION)
    cfg.setdefault("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    return {"architectures": [shape["architecture"]],
            "model_type": GGUF_ARCH[shape["architecture"]], **cfg, "vocab_size": vocab_size,
            "bos_token_id": bos, "eos_token_id": eos, "hidden_act": "silu",
            "torch_dtype": "bfloat16"}


def tensor_plan(shape: dict, fmt: str, vocab_size: int) -> list[Planned]:
    """Every tensor of the model, in llama.cpp's order, with its type in a `fmt` file
    (Q4_0, Q4_K_M, Q5_K_M, Q8_0: the embedding stored like the linears, Q4_K_M's and
    Q5_K_M's from its Q4_K or Q5_K;
    bf16: all "BF16")."""
    hidden = shape["hidden_size"]
    if shape["architecture"] == "GptOssForCausalLM":
        if fmt != "MXFP4":
            raise ValueError(f"a gpt-oss shape is written as MXFP4, not {fmt}")
        return _gpt_oss_plan(shape, vocab_size)
    head_dim = hidden // shape["num_attention_heads"]
    q_rows, kv_rows = shape["num_attention_heads"] * head_dim, \
        shape["num_key_value_heads"] * head_dim
    bias = shape["architecture"] == "Qwen2ForCausalLM"

    def kind(hf_name: str, dims: tuple[int, ...]) -> str:
        if fmt == "bf16":
            return "BF16"
        if len(dims) == 1 or hf_name.endswith("mlp.gate.weight"):   # routers stay float32
            return "F32"
        embedding = hf_name.endswith(("embed_tokens.weight", "embed_in.weight"))
        if fmt == "IQ4_XS":
            return "Q6_K" if embedding or hf_name.endswith("lm_head.weight") else "IQ4_XS"
        if fmt in ("Q4_K_M", "Q5_K_M") and embedding:
            return fmt[:4]
        return tensor_type(fmt, hf_name)

    if shape["architecture"] == "GPTNeoXForCausalLM":
        return [Planned(hf, gg, dims, kind(hf, dims)) for hf, gg, dims in
                _neox_rows(shape, vocab_size)]
    rows = [("model.embed_tokens.weight", "token_embd.weight", (vocab_size, hidden))]
    for i in range(shape["num_hidden_layers"]):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        rows.append((hf + "input_layernorm.weight", gg + "attn_norm.weight", (hidden,)))
        for proj, short, out in (("q", "q", q_rows), ("k", "k", kv_rows), ("v", "v", kv_rows)):
            rows.append((f"{hf}self_attn.{proj}_proj.weight", f"{gg}attn_{short}.weight",
                         (out, hidden)))
            if bias:
                rows.append((f"{hf}self_attn.{proj}_proj.bias", f"{gg}attn_{short}.bias",
                             (out,)))
        if shape.get("num_experts"):                         # OLMoE: q/k norms, experts
            rows += [(hf + "self_attn.q_norm.weight", gg + "attn_q_norm.weight", (q_rows,)),
                     (hf + "self_attn.k_norm.weight", gg + "attn_k_norm.weight", (kv_rows,))]
        rows += [(hf + "self_attn.o_proj.weight", gg + "attn_output.weight", (hidden, q_rows)),
                 (hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight", (hidden,))]
        rows += _mlp_rows(shape, hf, gg)
    rows.append(("model.norm.weight", "output_norm.weight", (hidden,)))
    if not shape["tie_word_embeddings"]:
        rows.append(("lm_head.weight", "output.weight", (vocab_size, hidden)))
    return [Planned(hf, gg, dims, kind(hf, dims)) for hf, gg, dims in rows]


def _gpt_oss_plan(shape: dict, vocab_size: int) -> list[Planned]:
    """gpt-oss's tensors as llama.cpp's converter names them: every linear biased, the
    experts' gate and up stacked apart, a sink a head; experts MXFP4, the rest Q8_0."""
    h, heads, kv = shape["hidden_size"], shape["num_attention_heads"], \
        shape["num_key_value_heads"]
    q_rows, kv_rows, experts, inter = heads * shape["head_dim"], kv * shape["head_dim"], \
        shape["num_local_experts"], shape["intermediate_size"]
    plan = [Planned("model.embed_tokens.weight", "token_embd.weight", (vocab_size, h), "Q8_0")]
    for i in range(shape["num_hidden_layers"]):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        plan.append(Planned(hf + "input_layernorm.weight", gg + "attn_norm.weight", (h,), "F32"))
        for proj, rows, cols in (("q", q_rows, h), ("k", kv_rows, h), ("v", kv_rows, h),
                                 ("output", h, q_rows)):
            name = f"{hf}self_attn.{'o' if proj == 'output' else proj}_proj."
            plan += [Planned(name + "weight", f"{gg}attn_{proj}.weight", (rows, cols), "Q8_0"),
                     Planned(name + "bias", f"{gg}attn_{proj}.bias", (rows,), "F32")]
        plan += [Planned(hf + "self_attn.sinks", gg + "attn_sinks.weight", (heads,), "F32"),
                 Planned(hf + "post_attention_layernorm.weight", gg + "post_attention_norm.weight",
                         (h,), "F32"),
                 Planned(hf + "mlp.router.weight", gg + "ffn_gate_inp.weight", (experts, h), "F32"),
                 Planned(hf + "mlp.router.bias", gg + "ffn_gate_inp.bias", (experts,), "F32")]
        for proj, dims in (("gate", (experts, inter, h)), ("up", (experts, inter, h)),
                           ("down", (experts, h, inter))):
            name = f"{hf}mlp.experts.{proj}_proj."
            plan += [Planned(name + "weight", f"{gg}ffn_{proj}_exps.weight", dims, "MXFP4"),
                     Planned(name + "bias", f"{gg}ffn_{proj}_exps.bias", dims[:2], "F32")]
    return plan + [Planned("model.norm.weight", "output_norm.weight", (h,), "F32"),
                   Planned("lm_head.weight", "output.weight", (vocab_size, h), "Q8_0")]


def _neox_rows(shape: dict, vocab_size: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """GPT-NeoX's tensors: LayerNorms with biases, one fused QKV, every linear biased."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    rows = [("gpt_neox.embed_in.weight", "token_embd.weight", (vocab_size, h))]
    for i in range(shape["num_hidden_layers"]):
        hf, gg = f"gpt_neox.layers.{i}.", f"blk.{i}."
        for ours, theirs, dims in (("input_layernorm", "attn_norm", (h,)),
                                   ("attention.query_key_value", "attn_qkv", (3 * h, h)),
                                   ("attention.dense", "attn_output", (h, h)),
                                   ("post_attention_layernorm", "ffn_norm", (h,)),
                                   ("mlp.dense_h_to_4h", "ffn_up", (inter, h)),
                                   ("mlp.dense_4h_to_h", "ffn_down", (h, inter))):
            rows += [(f"{hf}{ours}.weight", f"{gg}{theirs}.weight", dims),
                     (f"{hf}{ours}.bias", f"{gg}{theirs}.bias", dims[:1])]
    return rows + [("gpt_neox.final_layer_norm.weight", "output_norm.weight", (h,)),
                   ("gpt_neox.final_layer_norm.bias", "output_norm.bias", (h,)),
                   ("embed_out.weight", "output.weight", (vocab_size, h))]


def _mlp_rows(shape: dict, hf: str, gg: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """A layer's MLP tensors: dense, or a router and three stacks of experts [E, rows, cols]
    (named by their merged Hugging Face form, as llama.cpp's converter sees them)."""
    hidden, inter, experts = shape["hidden_size"], shape["intermediate_size"], \
        shape.get("num_experts")
    if not experts:
        return [(hf + "mlp.gate_proj.weight", gg + "ffn_gate.weight", (inter, hidden)),
                (hf + "mlp.up_proj.weight", gg + "ffn_up.weight", (inter, hidden)),
                (hf + "mlp.down_proj.weight", gg + "ffn_down.weight", (hidden, inter))]
    return [(hf + "mlp.gate.weight", gg + "ffn_gate_inp.weight", (experts, hidden)),
            (hf + "mlp.experts.gate_proj.weight", gg + "ffn_gate_exps.weight",
             (experts, inter, hidden)),
            (hf + "mlp.experts.up_proj.weight", gg + "ffn_up_exps.weight",
             (experts, inter, hidden)),
            (hf + "mlp.experts.down_proj.weight", gg + "ffn_down_exps.weight",
             (experts, hidden, inter))]


def random_blocks(ggml_type: str, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [rows, cols / weights per block * block bytes]: random quants, small scales."""
    size, per, scales = BLOCKS[ggml_type]
    n = rows * cols // per
    blocks = random_bytes(n * size, rng).reshape(n, size)
    for offset, low, high in scales:
        d = rng.uniform(low, high, n).astype(np.float16)
        blocks[:, offset:offset + 2] = d.view(np.uint8).reshape(n, 2)
    if ggml_type == "Q6_K":       # int8 sub-block scales in -16..15
        blocks[:, 192:208] = ((blocks[:, 192:208] & 0x1F).view(np.int8) - 16).view(np.uint8)
    if ggml_type == "MXFP4":      # the levels' rms ~5.9: weights of ~0.02
        blocks[:, 0] = rng.integers(119, 122, n, dtype=np.uint8)
    return blocks.reshape(rows, -1)


def random_bytes(count: int, rng) -> np.ndarray:
    """`count` random bytes, writable (64-bit draws: ~8x faster than drawing uint8)."""
    words = rng.bit_generator.random_raw((count + 7) // 8)
    return words.view(np.uint8)[:count]


def _small_values(planned: Planned, rng) -> np.ndarray:
    """A norm's ones, or a bias of normal * 0.02."""
    if planned.hf_name.endswith("norm.weight"):
        return np.ones(planned.dims, dtype=np.float32)
    return (rng.standard_normal(planned.dims) * 0.02).astype(np.float32)


def gguf_data_bytes(plan: list[Planned], alignment: int = 32) -> int:
    """Bytes of tensor data a GGUF file of `plan` holds after its header (each padded)."""
    total = 0
    for t in plan:
        if t.ggml_type == "F32":
            nbytes = 4 * int(np.prod(t.dims))
        else:
            size, per, _ = BLOCKS[t.ggml_type]
            nbytes = int(np.prod(t.dims)) // per * size
        total += (nbytes + alignment - 1) // alignment * alignment
    return total


def write_gguf_model(path: str, shape: dict, fmt: str, tokenizer_meta: dict | None = None,
                     seed: int = 0) -> str:
    """Write a `fmt` GGUF of `shape` to `path` (via path + ".part", renamed when whole), one
    tensor in memory at a time."""
    import gguf
    meta = tokenizer_meta if tokenizer_meta is not None else default_tokenizer_meta()
    vocab = len(meta["tokenizer.ggml.tokens"])
    plan = tensor_plan(shape, fmt, vocab)
    arch = GGUF_ARCH[shape["architecture"]]
    cfg = hf_config(shape, vocab, int(meta["tokenizer.ggml.bos_token_id"]),
                    int(meta["tokenizer.ggml.eos_token_id"]))
    part = path + ".part"
    writer = gguf.GGUFWriter(part, arch)
    add_metadata(writer, arch, cfg, vocab)
    copy_tokenizer(writer, meta)
    for t in plan:
        if t.ggml_type == "F32":
            writer.add_tensor_info(t.gguf_name, t.dims, np.dtype(np.float32),
                                   4 * int(np.prod(t.dims)))
        else:
            size, per, _ = BLOCKS[t.ggml_type]
            byte_shape = (*t.dims[:-1], t.dims[-1] // per * size)
            writer.add_tensor_info(t.gguf_name, byte_shape, np.dtype(np.uint8),
                                   int(np.prod(byte_shape)),
                                   raw_dtype=gguf.GGMLQuantizationType[t.ggml_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for t in plan:
        data = _small_values(t, rng) if t.ggml_type == "F32" else \
            random_blocks(t.ggml_type, int(np.prod(t.dims[:-1])), t.dims[-1], rng)
        writer.write_tensor_data(data)
        del data
    writer.close()
    os.replace(part, path)
    return path


def gguf_is_whole(path: str, shape: dict, fmt: str) -> bool:
    """`path` is a GGUF file of exactly `shape`'s tensors in `fmt`'s types and sizes."""
    from pagewire.gguf_header import GGML_TYPES, read_gguf_header
    try:
        header = read_gguf_header(path)
    except (OSError, ValueError):
        return False
    vocab = len(header.metadata.get("tokenizer.ggml.tokens", ()))
    plan = tensor_plan(shape, fmt, vocab)
    found = {n: (t.shape, GGML_TYPES[t.ggml_type][0]) for n, t in header.tensors.items()
             if t.ggml_type in GGML_TYPES}
    if found != {t.gguf_name: (t.dims, t.ggml_type) for t in plan}:
        return False
    start = min(t.offset for t in header.tensors.values())
    return os.path.getsize(path) == start + gguf_data_bytes(plan)
