"""Random-weight models of real shapes, written once and kept, for benchmarks at the sizes
people serve (actors/testing/real_shapes.py writes them; quality is not the point).

    python bench/real_shapes.py --shape llama-3.2-1b --format Q4_0 [--out DIR] [--force]
    python bench/real_shapes.py --shape all --format all

prints each path written (or found whole). Shapes: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b,
qwen2.5-1.5b, qwen2.5-7b (their config.json values, the default model's 49,152-token
vocabulary and tokenizer, a 32k context). Formats: Q4_0, Q4_K_M, Q5_K_M, Q8_0 (GGUF files)
and bf16 (a Hugging Face directory). Out: $PAGEWIRE_BENCH_MODELS, else ~/.cache/pagewire/bench-models.
From another bench script: `model_path(shape, fmt)` writes on first use and returns the path.
"""
from __future__ import annotations

import argparse
import os
import sys

from pagewire.testing.real_shapes import FORMATS, SHAPES, gguf_is_whole, write_gguf_model
from pagewire.testing.real_shapes_hf import hf_is_whole, write_hf_model


def default_out_dir() -> str:
    return os.environ.get("PAGEWIRE_BENCH_MODELS") or \
        os.path.expanduser("~/.cache/pagewire/bench-models")


def target(shape: str, fmt: str, out_dir: str | None = None) -> str:
    """Where `shape` in `fmt` lives: NAME-FMT.gguf, or the directory NAME-bf16."""
    name = f"{shape}-{fmt}" if fmt == "bf16" else f"{shape}-{fmt}.gguf"
    return os.path.join(out_dir or default_out_dir(), name)


def model_path(shape: str, fmt: str, out_dir: str | None = None, force: bool = False) -> str:
    """The path of `shape` in `fmt`, written first unless a whole one is there."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    path = target(shape, fmt, out_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if fmt == "bf16":
        if force or not hf_is_whole(path, SHAPES[shape]):
            write_hf_model(path, SHAPES[shape])
    elif force or not gguf_is_whole(path, SHAPES[shape], fmt):
        write_gguf_model(path, SHAPES[shape], fmt)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=[*SHAPES, "all"])
    p.add_argument("--format", required=True, choices=[*FORMATS, "all"])
    p.add_argument("--out", default=None, help="directory (default: $PAGEWIRE_BENCH_MODELS "
                   "or ~/.cache/pagewire/bench-models)")
    p.add_argument("--force", action="store_true", help="write again even if whole")
    args = p.parse_args(argv)
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    formats = list(FORMATS) if args.format == "all" else [args.format]
    for shape in shapes:
        for fmt in formats:
            gpt_oss = SHAPES[shape]["architecture"] == "GptOssForCausalLM"
            if len(shapes) * len(formats) > 1 and gpt_oss != (fmt == "MXFP4"):
                continue           # "all": gpt-oss as MXFP4 only, MXFP4 for gpt-oss only
            print(model_path(shape, fmt, args.out, args.force), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
