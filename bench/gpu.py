"""CUDA figures: single stream and offline throughput, CUDA graphs on (and off), in one run.

    python bench/gpu.py [--model PATH | --shape llama-3.1-8b] [--requests 64]
                        [--input-len 128] [--output-len 128] [--eager] [--kv-memory-gib 2]

The model: --model; else --shape, random bfloat16 weights of a real shape written once under
--out (bench/real_shapes.py's shapes, the default tokenizer); else the default model where
its package is installed; else (a GPU machine without it) random weights of its shape in
bfloat16. A machine without the default model's package names its saved tokenizer with
PAGEWIRE_TEST_TOKENIZER (and its GGUF metadata with PAGEWIRE_TEST_GGUF_TOKENIZER, which
--shape reads). Every request is `--input-len` random tokens then `--output-len` greedy ones
(EOS ignored); output tok/s over the whole run, prefill included. The single-stream ceiling
printed beside it: the bytes a decode step reads (every weight but the embedding table) over
the device's copy bandwidth, measured here.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

import torch

from pagewire import LLM, SamplingParams
from pagewire.model_files import safetensors_files, safetensors_header
from pagewire.testing.real_shapes_hf import save_default_tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))       # bench's own modules
from real_shapes import model_path  # noqa: E402


def smollm2_shape() -> str:
    """Random bfloat16 weights in SmolLM2-135M's shape, saved with the borrowed tokenizer
    (PAGEWIRE_TEST_TOKENIZER's)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    path = tempfile.mkdtemp(prefix="smollm2-shape-")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=2048, rope_theta=100000.0,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    save_default_tokenizer(path)
    return path


def shm_or_tmp() -> str:
    """/dev/shm where it has room for an 8B shape (no disk writes), else the temp folder."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 24 * 10**9:
        return "/dev/shm"
    return tempfile.gettempdir()


def step_bytes(path: str) -> int:
    """Bytes a decode step reads of the weights: every tensor but the embedding table (a
    step gathers a row of it), unless the output head is that table (tied)."""
    total, embed, tied = 0, 0, True
    for file in safetensors_files(path):
        for name, meta in safetensors_header(file).items():
            if name == "__metadata__":
                continue
            begin, end = meta["data_offsets"]
            total += end - begin
            embed += end - begin if name.endswith("embed_tokens.weight") else 0
            tied &= not name.startswith("lm_head")
    return total if tied else total - embed


def copy_bandwidth() -> float:
    """Device memory bandwidth in bytes/s: a 4 GiB device-to-device copy, read plus write."""
    src = torch.empty(2**32, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = begin.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 10 * 2 * 2**32 / seconds


def run(model: str, prompts: list, params: SamplingParams, eager: bool, kv_gib: float,
        max_len: int) -> None:
    llm = LLM(model, dtype="bfloat16", device="cuda", enforce_eager=eager,
              max_model_len=max_len, kv_cache_memory=int(kv_gib * 2**30))
    llm.generate(prompts[:2], params)                     # Triton compiles, graphs warm
    for n in sorted({1, len(prompts)}):
        start = time.perf_counter()
        outs = llm.generate(prompts[:n], params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"  enforce_eager={eager} batch {n}: {tokens / seconds:.1f} output tok/s "
              f"({seconds:.2f} s)", flush=True)
    batch = min(64, len(prompts))
    print(f"  decode steps of {batch}: {step_timeline(llm, prompts[:batch], params)}", flush=True)
    if getattr(llm.runner, "overlap", False):      # the same engine, steps one at a time
        llm.runner.overlap = False
        start = time.perf_counter()
        outs = llm.generate(prompts[:1], params)
        seconds = time.perf_counter() - start
        print(f"  overlap off, batch 1: {len(outs[0].outputs[0].token_ids) / seconds:.1f} "
              f"output tok/s; decode steps of {batch}: "
              f"{step_timeline(llm, prompts[:batch], params)}", flush=True)
    del llm
    torch.cuda.empty_cache()


def step_timeline(llm, prompts: list, params: SamplingParams) -> str:
    """The steady decode steps of one run of `prompts` (every sequence decoding): the wall
    time a step, the GPU busy between the first's start and the last's end (CUDA events
    recorded as each step is launched and after its tokens), and the host time in launch and
    in finish (finish timed once its tokens are back: waiting for them is the GPU's time)."""
    runner, steps = llm.runner, []
    launch, finish = runner.launch, runner.finish

    def timed_launch(plan, after=None, plain=None):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        t0 = time.perf_counter()
        step = launch(plan, after, plain)
        host = time.perf_counter() - t0
        end.record()
        if not getattr(plan, "new", True) and len(plan.running) == len(prompts):
            steps.append([begin, end, host, 0.0, time.perf_counter()])
            step.timing = steps[-1]
        return step

    def timed_finish(step):
        end = getattr(step, "timing", None)
        if end is not None:
            end[1].synchronize()
        t0 = time.perf_counter()
        out = finish(step)
        if end is not None:
            end[3] = time.perf_counter() - t0
        return out
    runner.launch, runner.finish = timed_launch, timed_finish
    try:
        llm.generate(prompts, params)
    finally:
        runner.launch, runner.finish = launch, finish
    torch.cuda.synchronize()
    steps = steps[2:]                        # past the first prompt's decode steps
    if len(steps) < 4:
        return "too few"
    busy = sum(b.elapsed_time(e) for b, e, *_ in steps)
    span = steps[0][0].elapsed_time(steps[-1][1])
    wall = (steps[-1][4] - steps[0][4]) / (len(steps) - 1) * 1e3
    launch_ms = sorted(s[2] for s in steps)[len(steps) // 2] * 1e3
    finish_ms = sorted(s[3] for s in steps)[len(steps) // 2] * 1e3
    return (f"{len(steps)} steps, {wall:.2f} ms a step, GPU busy {100 * busy / span:.0f} %, "
            f"host {launch_ms:.2f} ms launching + {finish_ms:.2f} ms finishing (medians)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--shape", help="a real shape (bench/real_shapes.py), random bfloat16")
    ap.add_argument("--out", default=shm_or_tmp(), help="where --shape's directory is kept")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--eager", action="store_true", help="also run with --enforce-eager")
    ap.add_argument("--kv-memory-gib", type=float, default=2.0)
    args = ap.parse_args()
    model = args.model
    if model is None and args.shape:
        model = model_path(args.shape, "bf16", args.out)     # written once, then kept
    elif model is None and os.environ.get("PAGEWIRE_TEST_TOKENIZER"):
        model = smollm2_shape()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.input_len)]}
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    print(f"{torch.cuda.get_device_name()}: {args.input_len} in, {args.output_len} out")
    if model is not None and os.path.isdir(model):
        bw, nbytes = copy_bandwidth(), step_bytes(model)
        print(f"  copy bandwidth {bw / 1e12:.2f} TB/s; a step reads {nbytes / 1e9:.2f} GB of "
              f"weights: single-stream ceiling {bw / nbytes:.0f} tok/s", flush=True)
    max_len = args.input_len + args.output_len + 16
    for eager in (False, True) if args.eager else (False,):
        run(model, prompts, params, eager, args.kv_memory_gib, max_len)


if __name__ == "__main__":
    main()
