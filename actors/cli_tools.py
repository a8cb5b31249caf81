"""`pagewire` subcommands besides serve and bench: reading traces, replaying an actor,
attaching an executor, making keys.

    pagewire trace show|stats DIR ...        (see trace_tools.py)
    pagewire replay DIR --actor NAME [--set OPTION=VALUE ...]
    pagewire executor --attach tcp://HOST:PORT --rank R [MODEL] [--curve-keys DIR] ...
    pagewire keys DIR
    pagewire router --replicas URL ... [--policy kv-aware|round-robin] [--kv-events EP ...]
    pagewire router --prefill URL ... --decode URL ...   (see router.py)
"""
from __future__ import annotations

import argparse
import json
import logging

from .config import FIELD_SECTION

COMMANDS = ("trace", "replay", "executor", "keys", "router")


def _override(text: str) -> tuple[str, object]:
    """OPTION=VALUE for `pagewire replay --set`: VALUE as JSON, else as a string."""
    key, sep, value = text.partition("=")
    key = key.strip().lstrip("-").replace("-", "_")
    if not sep or key not in FIELD_SECTION:
        raise argparse.ArgumentTypeError(f"{text!r}: expected OPTION=VALUE with an engine option")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def add_commands(sub) -> None:
    trace = sub.add_parser("trace", help="read traces recorded with --trace DIR")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    show = trace_sub.add_parser("show", help="a readable timeline")
    show.add_argument("directory")
    show.add_argument("--request", help="only messages about request ids containing this")
    show.add_argument("--actor", help="only this actor (e.g. scheduler, 'executor 0')")
    show.add_argument("--type", dest="type_name", help="only this message type (e.g. StepPlan)")
    show.add_argument("--since", type=float, help="seconds from the first record")
    show.add_argument("--until", type=float)
    stats = trace_sub.add_parser("stats", help="message rates, sizes, per-request latency")
    stats.add_argument("directory")
    replay = sub.add_parser("replay", help="re-run an actor on its recorded inbox and diff")
    replay.add_argument("directory")
    replay.add_argument("--actor", required=True, choices=["scheduler", "detokenizer", "tokenizer"])
    replay.add_argument("--set", dest="overrides", action="append", type=_override,
                        metavar="OPTION=VALUE", help="replay with this option changed "
                        "(e.g. max_num_seqs=8); the report names what differs")
    ex = sub.add_parser("executor", help="attach an executor rank to a running engine")
    ex.add_argument("model", nargs="?", help="this host's copy of the engine's model "
                    "(default: the embedded SmolLM2-135M-Instruct)")
    ex.add_argument("--attach", required=True, help="the engine's --listen tcp://HOST:PORT")
    ex.add_argument("--rank", type=int, required=True)
    ex.add_argument("--curve-keys", help="directory with executor.key_secret and engine.key")
    ex.add_argument("--tensor-parallel-size", "-tp", type=int, default=0,
                    help="checked against the engine's")
    ex.add_argument("--dtype", help="checked against the engine's")
    ex.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    ex.add_argument("--attach-timeout", type=float, default=300.0)
    keys = sub.add_parser("keys", help="make CURVE keys for attaching executors over TCP")
    keys.add_argument("directory")
    from . import router
    router.add_command(sub)


def run(args: argparse.Namespace) -> int:
    if args.command == "executor":
        return _executor(args)
    if args.command == "router":
        from . import router
        return router.run(args)
    logging.basicConfig(level="WARNING")
    if args.command == "keys":
        from .executor.ranks import make_keys
        for path in make_keys(args.directory):
            print(path)
        print("the engine needs engine.key_secret and executor.key; copy executor.key_secret "
              "and engine.key to each executor host")
        return 0
    if args.command == "replay":
        from .replay import replay
        return replay(args.directory, args.actor, dict(getattr(args, "overrides", None) or []))
    from . import trace_tools
    if args.trace_command == "show":
        trace_tools.show(args.directory, getattr(args, "request", None), getattr(args, "actor", None),
                         getattr(args, "type_name", None), getattr(args, "since", None),
                         getattr(args, "until", None))
    else:
        trace_tools.stats(args.directory)
    return 0


def _executor(args: argparse.Namespace) -> int:
    """Exit 2 when refused or unanswered (the reason is logged)."""
    from .config import parse_tcp
    from .model_info import resolve_model
    from .process import setup_logging
    setup_logging(f"executor {args.rank}")
    log = logging.getLogger("executor")
    import setproctitle
    setproctitle.setproctitle(f"pagewire: executor {args.rank} (attached)")
    try:
        parse_tcp(args.attach)
        info = resolve_model(getattr(args, "model", None))
    except ValueError as e:
        log.error("%s", e)
        return 2
    from .executor.actor import attached
    from .executor.ranks import AttachFailed
    try:
        attached(args.attach, args.rank, info, getattr(args, "curve_keys", None),
                 args.attach_timeout, getattr(args, "threads", None),
                 args.tensor_parallel_size, getattr(args, "dtype", None))
    except (AttachFailed, FileNotFoundError) as e:
        log.error("%s", e)
        return 2
    return 0
