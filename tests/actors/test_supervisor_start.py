"""The supervisor's start as a state machine, driven with fake processes and a scripted inbox:
every actor starts at once, and the gateway is told EngineReady (with executor 0's backend)
only once every other actor has said Ready, and again while it has not said Ready itself."""
from __future__ import annotations

import itertools

from pagewire.config import EngineConfig
from pagewire.supervisor import ENGINE_READY_EVERY, Supervisor
from pagewire.wire.to_gateway import EngineReady
from pagewire.wire.to_supervisor import Ready


class FakeProc:
    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        return self.returncode


class Sent(list):
    def send(self, msg):
        self.append(msg)


def test_the_gateway_opens_only_after_every_other_actor_is_ready(monkeypatch, tmp_path):
    sup = Supervisor(EngineConfig.from_options())
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))
    pids, spawned = itertools.count(100), []

    def spawn(role, index):
        name = role if role in ("scheduler", "detokenizer", "gateway") else f"{role} {index}"
        sup.children[name] = FakeProc(next(pids))
        spawned.append(name)

    gateway, clock = Sent(), [0.0]
    # the inbox as each recv finds it: what the gateway was sent so far decides its answer
    script = [Ready("scheduler", 101), None, Ready("tokenizer 0", 103),
              Ready("detokenizer", 102), Ready("executor 0", 100, "cpu-avx2"), None,
              "tick", None, "gateway"]

    def recv(timeout=None):
        step = script.pop(0)
        if step == "tick":                   # past ENGINE_READY_EVERY without its Ready
            clock[0] += ENGINE_READY_EVERY
            return None
        if step == "gateway":
            return Ready("gateway", 104)
        return step

    monkeypatch.setattr(sup, "_spawn", spawn)
    monkeypatch.setattr("pagewire.supervisor.time.monotonic", lambda: clock[0])
    monkeypatch.setattr("pagewire.supervisor.PushChannel",
                        lambda ctx, address: gateway if address.endswith("gateway.sock")
                        else Sent())
    monkeypatch.setattr("pagewire.supervisor.PullChannel",
                        lambda *a: type("Inbox", (), {"recv": lambda self, t: recv(t)})())
    sent_at = []
    gateway.send = lambda msg: (sent_at.append(len(script)), list.append(gateway, msg))
    try:
        sup.start()
    finally:
        sup.ctx.term()
    assert spawned == ["executor 0", "scheduler", "detokenizer", "tokenizer 0", "gateway"]
    assert gateway == [EngineReady("cpu-avx2"), EngineReady("cpu-avx2")]
    assert sent_at == [4, 2]     # after executor 0's Ready, again a second later, then Ready
    assert sup.ready == set(spawned) and sup.config.device.backend == "cpu-avx2"
