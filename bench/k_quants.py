"""K-quant GGUF files multiplied as stored vs as dequantized float copies, beside llama.cpp.

The default model's rows (576 columns) are not whole 256-weight superblocks, so llama.cpp
falls back to other types for nearly all of its tensors. This makes a random-weight Llama
whose every row is (hidden 1024, intermediate 2816, 8 layers, the default model's 49,152-token
vocabulary), writes it as F32 GGUF (actors/testing/gguf_writer.py), and has llama.cpp's own
quantizer (the peer's llama-cpp-python) turn it into each of `--types` (llama.cpp's mixes:
Q4_K_M puts Q6_K in v_proj and down_proj of some layers and in the LM head). Then, one engine
at a time, alternating: a single stream of 128 random prompt tokens and 128 greedy tokens:
  pagewire  `pagewire bench latency` (as stored: the default)
  floats    the same with `--quantized-matmul-tokens 0` (the dequantized copies: what every
            K-quant did before)
  llama.cpp ../shared/peers/llamacpp_single.py on the same file

    python bench/k_quants.py [--types Q4_K_M Q5_K_M Q3_K_M] [--runs 2] [--dir /tmp/kq]
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys

from compare import PAGEWIRE

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = os.path.join(HERE, "..", "..", "shared", "peers")
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4)
FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q3_K_M": 12, "Q6_K": 18}   # llama_ftype values


def make_f32(path: str) -> None:
    """The random model as F32 GGUF with the default model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagewire.gguf_header import read_gguf_header
    from pagewire.model_info import default_model_path
    from pagewire.testing.gguf_writer import TOKENIZER_KEYS, write_gguf
    meta = read_gguf_header(default_model_path()).metadata
    tokenizer = {k: meta[k] for k in TOKENIZER_KEYS if k in meta}
    cfg = LlamaConfig(vocab_size=len(tokenizer["tokenizer.ggml.tokens"]), **SHAPE,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    write_gguf(path, "llama", model.state_dict(), cfg.to_dict(), tokenizer)


def peer_python() -> str:
    """The llama.cpp peer's interpreter (llamacpp.sh builds it on first use)."""
    home = os.environ.get("PEERS_HOME", os.path.expanduser("~/.cache/pagewire-peers"))
    found = glob.glob(os.path.join(home, "llamacpp-venv-*", "bin", "python"))
    if not found:
        sys.exit("run `bash ../shared/peers/llamacpp.sh single 1 2` once first (it builds "
                 "llama-cpp-python for this CPU)")
    return found[0]


def quantize(f32: str, out: str, ftype: int) -> None:
    code = ("import sys, llama_cpp as l; p = l.llama_model_quantize_default_params(); "
            f"p.ftype = {ftype}; p.nthread = 2; "
            "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
    subprocess.run([peer_python(), "-c", code, f32, out], check=True)


def tok_per_s(engine: str, path: str) -> float:
    if engine == "llama.cpp":
        out = subprocess.run([peer_python(), os.path.join(PEERS, "llamacpp_single.py"), path,
                              "3", "2"], capture_output=True, text=True, check=True).stdout
        return float(re.search(r"([\d.]+) output tok/s", out).group(1))
    cmd = [*PAGEWIRE, "bench", "latency", path, "--input-len", "128", "--output-len", "128",
           "--batch-size", "1", "--num-iters", "3", "--max-model-len", "2048"]
    if engine == "floats":
        cmd += ["--quantized-matmul-tokens", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    match = re.search(r"Avg latency: ([\d.]+) seconds", proc.stdout + proc.stderr)
    if proc.returncode or not match:
        sys.exit(f"failed: {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-3000:]}")
    return 128 / float(match.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", nargs="+", default=["Q4_K_M"], choices=sorted(FTYPES))
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--dir", default="/tmp/pagewire-k-quants")
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    f32 = os.path.join(a.dir, "random-llama-f32.gguf")
    if not os.path.exists(f32):
        make_f32(f32)
    for name in a.types:
        path = os.path.join(a.dir, f"random-llama-{name}.gguf")
        if not os.path.exists(path):
            quantize(f32, path, FTYPES[name])
        size = os.path.getsize(path) / 2**20
        for run in range(a.runs):
            rates = {e: tok_per_s(e, path) for e in ("pagewire", "floats", "llama.cpp")}
            print(f"{name} ({size:.0f} MiB) run {run + 1}: " + ", ".join(
                f"{e} {r:.1f} tok/s" for e, r in rates.items()) +
                f"; pagewire / floats {rates['pagewire'] / rates['floats']:.2f}x, "
                f"pagewire / llama.cpp {rates['pagewire'] / rates['llama.cpp']:.2f}x",
                flush=True)


if __name__ == "__main__":
    main()
