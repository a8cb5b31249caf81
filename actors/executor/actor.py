"""The executor actor: receive a StepPlan, run it, return the StepResult (rank 0 only).

With tensor parallelism rank 0 also admits the other ranks (started by the engine, or attached
by hand with `pagewire executor --attach`), forwards each plan to them before running it, and
watches them; every rank runs the same step, its collectives meeting in torch.distributed.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
import traceback

import torch.distributed as dist
import zmq

import pagewire
from pagewire.kernels.ops import resolve_device
from pagewire.wire.channels import PushChannel
from pagewire.wire.engine_control import ControlDone
from pagewire.wire.to_executor import AttachHello, AttachWelcome, ExecutorInbox
from pagewire.wire.to_scheduler import StepResult

from ..config import EngineConfig, parse_tcp
from ..config_sections import EXTERNAL
from ..model_info import ModelInfo
from .parallel import init_group
from .ranks import AttachFailed, RankClient, RankFailure, RankServer
from .pooling_runner import runner_for
from .runner import ModelRunner
from .step_overlap import POLL_SECONDS, StepOverlap

log = logging.getLogger(__name__)
LOCAL_ATTACH_TIMEOUT = 120.0      # ranks the engine starts itself attach within this


def run(env) -> None:
    config = env.config
    if config.parallel.tensor_parallel_size == 1:
        # The KV server's and puller's threads tell the scheduler on a socket of their own
        # (shared by the two under a lock: a ZeroMQ socket is one thread's at a time).
        notices, lock = PushChannel(env.ctx, env.address("scheduler")), threading.Lock()

        def notify(msg) -> None:
            with lock:
                notices.send(msg)
        serve_steps(env, runner_for(config, notify=notify))
    elif env.index == 0:
        server = admit_ranks(env)
        tp = init_group(server.welcome.dist_address, 0, config.parallel.tensor_parallel_size,
                        config.parallel.tp_timeout, resolve_device(config.device.device, 0))
        serve_steps(env, runner_for(config, tp), server)
    else:
        client = RankClient(env.ctx, env.address("ranks"), env.index)
        welcome = client.attach(hello(config.model.model_info, env.index,
                                      config.parallel.tensor_parallel_size, config.model.dtype),
                                LOCAL_ATTACH_TIMEOUT)
        tp = init_group(welcome.dist_address, env.index, config.parallel.tensor_parallel_size,
                        config.parallel.tp_timeout, resolve_device(config.device.device, env.index))
        runner = runner_for(config, tp)
        env.ready()
        follow_steps(runner, client, env.heartbeat)


def serve_steps(env, runner: ModelRunner, ranks: RankServer | None = None) -> None:
    """Rank 0's loop. With other ranks, a failed step is fatal: the ranks may be out of step,
    so the engine core restarts (and in-flight requests fail) rather than go on."""
    inbox = env.pull(f"executor-{env.index}", ExecutorInbox)
    results = env.push("scheduler")
    env.ready(runner.backend.name)
    if ranks is not None:
        ranks.loaded()
    elif getattr(runner, "overlap", False):
        return serve_overlapped(env, runner, inbox, results)
    while True:
        plan = inbox.recv(timeout_ms=1000)
        env.heartbeat()          # a step that hangs stops these: the supervisor notices
        if ranks is not None:
            ranks.poll()
        if plan is None:
            continue
        if ranks is not None:
            ranks.send_plan(plan)
            result = run_collective_step(runner, plan)
            if isinstance(result, ControlDone) and result.status >= 500:
                # a load failed part way, here and perhaps not on the other ranks
                raise RankFailure(f"sleep-mode control failed on rank 0: {result.error}")
            results.send(result)
            ranks.step_done()
            continue
        try:
            result = runner.execute(plan)
        except Exception as e:
            # The step's requests fail; the executor lives on (the scheduler drops their state).
            log.error("step %d failed: %s", plan.step_id, traceback.format_exc())
            runner.fail(plan)
            result = StepResult(plan.step_id, [], [], error=f"{type(e).__name__}: {e}")
        results.send(result)


def serve_overlapped(env, runner: ModelRunner, inbox, results) -> None:
    """serve_steps on one rank with overlapped steps (step_overlap.py): while a step is held,
    the next plan is polled for (launched ahead when it comes) until the held step's tokens
    are back. A failed step's requests fail; the executor lives on."""
    overlap = StepOverlap(runner)
    while True:
        plan = inbox.recv(timeout_ms=1000 if overlap.held is None else 0)
        env.heartbeat()
        if plan is not None:
            outcomes = overlap.run(plan, plan)
        elif overlap.held is None:
            continue
        elif overlap.ready():
            outcomes = overlap.finish_held()
        else:
            time.sleep(POLL_SECONDS)
            continue
        for sent, out in outcomes:
            if isinstance(out, Exception):
                log.error("step %d failed: %s", sent.step_id, "".join(
                    traceback.format_exception(out)))
                out = StepResult(sent.step_id, [], [], error=f"{type(out).__name__}: {out}")
            results.send(out)


def run_collective_step(runner: ModelRunner, plan) -> StepResult:
    """A step whose collectives need every rank: a rank that died or stops answering makes
    torch.distributed raise (at once, or after --tp-timeout), which is fatal for the group."""
    try:
        return runner.execute(plan)
    except RuntimeError as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RankFailure(f"tensor-parallel step {plan.step_id} failed, a rank left or stopped "
                          f"answering: {first_line[:200]}") from e


def follow_steps(runner: ModelRunner, client: RankClient, heartbeat) -> None:
    """A rank r > 0's loop: run each plan rank 0 forwards; results stay with rank 0."""
    client.loaded()
    while True:
        plan = client.recv(1000)
        heartbeat()
        if plan is not None:
            run_collective_step(runner, plan)
            client.step_done()


def admit_ranks(env) -> RankServer:
    """Rank 0: wait until every other rank has attached (heartbeating meanwhile)."""
    config = env.config
    external = config.parallel.executors == EXTERNAL
    if external:
        address = config.parallel.listen
        host, port = parse_tcp(address)
        dist_address = f"tcp://{host}:{port + 1}"
    else:
        address = env.address("ranks")
        dist_address = f"tcp://127.0.0.1:{_free_port()}"
    welcome = AttachWelcome(config.public().to_json().decode(), dist_address)
    server = RankServer(env.ctx, address, config.parallel.tensor_parallel_size,
                        lambda h: refusal(config, h), welcome, config.parallel.curve_keys)
    if external:
        log.info("waiting for executor ranks 1..%d to attach at %s",
                 config.parallel.tensor_parallel_size - 1, address)
    server.await_ranks(config.parallel.attach_timeout if external else LOCAL_ATTACH_TIMEOUT,
                       env.heartbeat)
    return server


def hello(info: ModelInfo, rank: int, tensor_parallel_size: int = 0,
          dtype: str | None = None) -> AttachHello:
    """What an executor says of itself (0 / None: no claim to check)."""
    return AttachHello(version=pagewire.__version__, rank=rank,
                       tensor_parallel_size=tensor_parallel_size, model_name=info.name,
                       model_digest=info.digest, dtype=dtype)


def refusal(config: EngineConfig, h: AttachHello) -> str | None:
    """Why an executor cannot join this engine, or None."""
    size, info = config.parallel.tensor_parallel_size, config.model.model_info
    if h.version != pagewire.__version__:
        return f"the engine runs pagewire {pagewire.__version__}, the executor {h.version}"
    if h.tensor_parallel_size and h.tensor_parallel_size != size:
        return (f"the engine runs --tensor-parallel-size {size}, the executor was started "
                f"for {h.tensor_parallel_size}")
    if not 1 <= h.rank < size:
        return f"rank {h.rank} is outside 1..{size - 1} (--tensor-parallel-size {size})"
    if h.model_digest != info.digest:
        return (f"the engine serves {info.name} (weights {info.digest}), the executor has "
                f"{h.model_name} (weights {h.model_digest})")
    if h.dtype and h.dtype != config.model.dtype:
        return f"the engine runs --dtype {config.model.dtype}, the executor asked for {h.dtype}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def attached(address: str, rank: int, info: ModelInfo, keys: str | None, timeout: float,
             threads: int | None = None, tensor_parallel_size: int = 0,
             dtype: str | None = None) -> None:
    """`pagewire executor --attach`: join an engine as rank `rank`; when the engine goes away
    (its core restarted), attach again. Raises AttachFailed when refused or unanswered."""
    while True:
        ctx = zmq.Context()
        client = RankClient(ctx, address, rank, keys)
        try:
            welcome = client.attach(hello(info, rank, tensor_parallel_size, dtype), timeout)
            config = EngineConfig.from_json(welcome.config_json.encode()).replace(
                model_info=info, threads=threads)
            log.info("attached to %s as rank %d of %d", address, rank,
                     config.parallel.tensor_parallel_size)
            tp = init_group(welcome.dist_address, rank, config.parallel.tensor_parallel_size,
                            config.parallel.tp_timeout, resolve_device(config.device.device, rank))
            follow_steps(runner_for(config, tp), client, lambda: None)
        except AttachFailed:
            raise
        except (RuntimeError, OSError) as e:
            log.warning("lost the engine (%s); attaching again", e)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            client.close()
            ctx.destroy(linger=0)
