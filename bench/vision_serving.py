"""Image chats served side by side: `vllm bench serve --dataset-name random-mm` (vLLM's own
load client, each request a chat of random text and one random image) against `pagewire
serve`, `vllm serve` and llama.cpp's `llama-server --mmproj`, one server at a time, on random
weights of SmolVLM-256M's shape (bench/vision.py writes the directory).

    python bench/vision_serving.py [--engines pagewire,vllm-cpu,llamacpp] [--runs 1]
        [--side 512] [--prompts 32] [--concurrency 16] [-- extra bench-serve args]

Every engine reads the same weights: pagewire and vLLM the Hugging Face directory (bfloat16),
llama.cpp the GGUFs its own converter (the llama.cpp sources vendored in the peer's build,
convert_hf_to_gguf.py) writes from it, f16: the language model from a text-only copy of the
directory, the tower with --mmproj. All three run the same image processor settings (longest
edge 1024 in 512-pixel tiles: a 512-pixel image is 4 tiles and the global one, 320 image
rows). Each request: 64 random text tokens, one `--side` pixel random image, 128 output tokens
(ignore_eos). Prints the prompt tokens one image chat counts on each server (whether they cut
the image alike), output tok/s, median TTFT, median TPOT per engine and pagewire's ratios.
vLLM runs torch on one thread on this 2-core machine unless OMP_NUM_THREADS says otherwise
(its own default); `OMP_NUM_THREADS=2 python bench/vision_serving.py --engines vllm-cpu`
measures it on both.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import urllib.request

from compare import PAGEWIRE, PEER, peer_dtype, split_argv
from serving import LLAMACPP, free_port, launch, run_load, stop
from vision import write_model

MODEL = "smolvlm-256m"
PEERS = os.environ.get("PEERS_HOME", os.path.expanduser("~/.cache/pagewire-peers"))
CONVERTER = os.path.join(PEERS, "src", "llama_cpp_python-0.3.36", "vendor", "llama.cpp")


def text_only(path: str) -> str:
    """The directory's language model alone as a LlamaForCausalLM directory (llama.cpp
    converts the text model and the tower apart), written once."""
    out = os.path.join(path, "text-only")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import (AutoTokenizer, Idefics3ForConditionalGeneration, LlamaConfig,
                              LlamaForCausalLM)
    full = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16)
    text = LlamaConfig(**full.config.text_config.to_dict())
    text.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(text).to(torch.bfloat16)
    model.model.load_state_dict(full.model.text_model.state_dict())
    model.lm_head.load_state_dict(full.lm_head.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out


def gguf_files(path: str) -> tuple[str, str]:
    """(text GGUF, mmproj GGUF), f16, written once by llama.cpp's own converter."""
    text, mmproj = os.path.join(path, "text-f16.gguf"), os.path.join(path, "mmproj-f16.gguf")
    for source, out, extra in ((text_only(path), text, []), (path, mmproj, ["--mmproj"])):
        if not os.path.exists(out):
            subprocess.run(["bash", PEER, "exec", "env",
                            f"PYTHONPATH={os.path.join(CONVERTER, 'gguf-py')}", "python",
                            os.path.join(CONVERTER, "convert_hf_to_gguf.py"), source,
                            "--outtype", "f16", "--outfile", out, *extra],
                           check=True, capture_output=True)
    return text, mmproj


def command(engine: str, path: str, port: int, concurrency: int) -> list[str]:
    if engine == "pagewire":
        return [*PAGEWIRE, "serve", path, "--port", str(port), "--max-model-len", "4096",
                "--served-model-name", MODEL, "--dtype", "bfloat16",
                *os.environ.get("PAGEWIRE_SERVE_ARGS", "").split()]
    if engine == "llamacpp":
        text, mmproj = gguf_files(path)
        return ["bash", LLAMACPP, "server", text, str(port), "--mmproj", mmproj,
                "--parallel", str(concurrency), "-t", str(os.cpu_count()),
                "-c", str(concurrency * 4096), "--alias", MODEL]
    return ["bash", PEER, "exec", "vllm", "serve", path,
            "--dtype", os.environ.get("VLLM_DTYPE", peer_dtype()), "--max-model-len", "4096",
            "--port", str(port), "--served-model-name", MODEL,
            "--limit-mm-per-prompt", '{"image": 1}']


def image_prompt_tokens(port: int, side: int) -> int:
    """The prompt tokens one chat of a `side`-pixel image and a line of text counts on this
    server: whether the engines cut the image into the same rows."""
    from vision import image
    buf = io.BytesIO()
    image(7, side).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": url}}]}]}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["usage"]["prompt_tokens"]


def bench(port: int, path: str, a, extra: list[str]) -> dict[str, float]:
    cmd = ["bash", PEER, "bench-serve", "--backend", "openai-chat", "--base-url",
           f"http://127.0.0.1:{port}", "--endpoint", "/v1/chat/completions", "--model", MODEL,
           "--tokenizer", path, "--dataset-name", "random-mm", "--random-input-len", "64",
           "--random-output-len", "128", "--random-range-ratio", "0",
           "--random-mm-base-items-per-request", "1",
           "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
           "--random-mm-bucket-config", f"{{({a.side}, {a.side}, 1): 1.0}}",
           "--num-prompts", str(a.prompts), "--max-concurrency", str(a.concurrency),
           "--ignore-eos", "--seed", "0", *extra]
    return run_load(cmd)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engines", default="pagewire,vllm-cpu,llamacpp")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--side", type=int, default=512)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--out", default=os.path.expanduser(
        "~/.cache/pagewire/bench-models/smolvlm-256m-bf16"))
    own, extra = split_argv(sys.argv[1:])
    a = p.parse_args(own)
    path = write_model(a.out)
    results: dict[str, dict] = {}
    for i in range(a.runs):
        for engine in a.engines.split(","):
            port = free_port()
            proc = launch(command(engine, path, port, a.concurrency), port, engine)
            try:
                tokens = image_prompt_tokens(port, a.side)
                results[engine] = bench(port, path, a, extra)
            finally:
                stop(proc)
            print(f"run {i + 1} {engine:9} one image chat {tokens} prompt tokens  " + "  ".join(
                f"{k} {v:.1f}" for k, v in results[engine].items()), flush=True)
    ours = results.get("pagewire")
    for peer in ("vllm-cpu", "llamacpp"):
        if ours and peer in results:
            theirs = results[peer]
            print(f"pagewire / {peer}: output tok/s {ours['output tok/s'] / theirs['output tok/s']:.2f}x, "
                  f"median TTFT {ours['median TTFT ms'] / theirs['median TTFT ms']:.2f}x, "
                  f"median TPOT {ours['median TPOT ms'] / theirs['median TPOT ms']:.2f}x "
                  "(lower is better), last run")


if __name__ == "__main__":
    main()
