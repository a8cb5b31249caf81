"""The supervisor's recovery as a state machine, driven with fake processes and a scripted
inbox: an actor that fails while its restart waits for Ready is one more restart within the
budget (not the end of the server); past the budget the server stops; a late Fatal from a
replaced instance does not fail the new one."""
from __future__ import annotations

import itertools

import pytest

from pagewire.config import EngineConfig
from pagewire.supervisor import ActorFailed, Supervisor
from pagewire.wire.to_gateway import EngineEvent
from pagewire.wire.to_supervisor import Fatal, Ready

ACTORS = ["executor 0", "scheduler", "detokenizer", "tokenizer 0", "gateway"]


class FakeProc:
    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.returncode = -sig

    def wait(self, timeout=None):
        return self.returncode

    kill = lambda self: self.send_signal(9)     # noqa: E731


class Sent(list):
    def send(self, msg):
        self.append(msg)


@pytest.fixture
def supervisor(monkeypatch):
    """A serving supervisor over fake children; `script(name, pid)` answers each new instance
    (a list of messages it sends, by spawn order)."""
    sup = Supervisor(EngineConfig.from_options(restart_budget=3))
    pids = itertools.count(100)
    answers: list[list] = []

    def spawn(role, index):
        name = role if role in ("scheduler", "detokenizer", "gateway") else f"{role} {index}"
        sup.children[name] = FakeProc(next(pids))
        sup.ready.discard(name)
        pending.extend(answers.pop(0)(name, sup.children[name].pid) if answers else
                       [Ready(name, sup.children[name].pid)])

    pending: list = []
    sup.inbox = type("Inbox", (), {"recv": lambda self, timeout=None:
                                   pending.pop(0) if pending else None})()
    sup.gateway_channel, sup.scheduler_channel = Sent(), Sent()
    monkeypatch.setattr(sup, "_spawn", spawn)
    for name in ACTORS:
        sup.children[name] = FakeProc(next(pids))
        sup.ready.add(name)
    sup.state = "serving"
    sup.answers = answers
    return sup


def test_a_restart_that_fails_before_ready_is_restarted_within_the_budget(supervisor):
    sup = supervisor
    sup.answers.append(lambda name, pid: [Fatal(name, "cannot load", pid)])   # first respawn
    sup.children["tokenizer 0"].returncode = -9
    sup.recover("tokenizer 0", -9)
    assert sup.state == "serving" and len(sup.restarts) == 2
    assert sup.ready >= set(ACTORS) and sup.children["tokenizer 0"].pid == 106   # 105 failed
    lost = EngineEvent("lost", "tokenizer 0 died", "tokenizer 0")
    assert sup.gateway_channel == [lost, lost,
                                   EngineEvent("back", "tokenizer 0 restarted", "tokenizer 0")]


def test_a_core_actor_dying_during_a_tokenizer_restart_restarts_the_core(supervisor):
    sup = supervisor
    old_scheduler = sup.children["scheduler"]

    def scheduler_dies(name, pid):             # as the new tokenizer comes up
        old_scheduler.returncode = 1
        return [Ready(name, pid)]
    sup.answers.append(scheduler_dies)
    sup.children["tokenizer 0"].returncode = -9
    sup.recover("tokenizer 0", -9)
    assert sup.state == "serving" and len(sup.restarts) == 2
    assert sup.children["scheduler"] is not old_scheduler
    assert [e.status for e in sup.gateway_channel] == ["lost", "down", "up"]


def test_past_the_budget_a_failing_restart_stops_the_server(supervisor):
    sup = supervisor
    sup.answers.extend([lambda name, pid: [Fatal(name, "cannot load", pid)]] * 4)
    sup.children["detokenizer"].returncode = -9
    with pytest.raises(ActorFailed, match="over the restart budget"):
        sup.recover("detokenizer", -9)
    assert len(sup.restarts) == 4                  # the budget is 3


def test_a_late_fatal_of_the_replaced_instance_is_not_the_new_ones(supervisor):
    sup = supervisor
    old_pid = sup.children["tokenizer 0"].pid
    sup.answers.append(lambda name, pid: [Fatal(name, "old news", old_pid), Ready(name, pid)])
    sup.children["tokenizer 0"].returncode = -9
    sup.recover("tokenizer 0", -9)
    assert len(sup.restarts) == 1 and "tokenizer 0" not in sup.fatal
