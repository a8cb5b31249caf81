"""PushChannel/PullChannel over ipc sockets in a private run directory."""
from __future__ import annotations

import os
import stat

import msgspec
import pytest
import zmq

from pagewire.wire import SamplingParams
from pagewire.wire.channels import PullChannel, PushChannel, encode, ipc_address, make_run_dir
from pagewire.wire.ids import SeqId
from pagewire.wire.to_scheduler import Abort, NewRequest, SchedulerInbox, StepResult
from pagewire.wire.to_supervisor import Fatal, Ready, SupervisorInbox


class Ctx:
    """A zmq context plus the channels to close before it is termed at teardown."""

    def __init__(self):
        self.zmq = zmq.Context()
        self.channels: list = []

    def push(self, addresses, **kw) -> PushChannel:
        self.channels.append(PushChannel(self.zmq, addresses, **kw))
        return self.channels[-1]

    def pull(self, address, inbox_type, **kw) -> PullChannel:
        self.channels.append(PullChannel(self.zmq, address, inbox_type, **kw))
        return self.channels[-1]


@pytest.fixture
def ctx():
    context = Ctx()
    yield context
    for channel in context.channels:
        channel.close()
    context.zmq.term()


@pytest.fixture
def run_dir(tmp_path_factory):
    # tmp_path_factory's short "r<N>" folder: per-test tmp_path names can push an ipc path
    # past the socket path limit.
    return make_run_dir(str(tmp_path_factory.mktemp("r")))


def test_run_dir_is_private_and_fresh(tmp_path):
    a, b = make_run_dir(str(tmp_path)), make_run_dir(str(tmp_path))
    assert a != b
    for path in (a, b):
        assert os.path.isdir(path) and os.path.dirname(path) == str(tmp_path)
        assert os.path.basename(path).startswith("pagewire-")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        assert os.listdir(path) == []


def test_ipc_address_names_a_socket_in_the_run_dir(run_dir):
    assert ipc_address(run_dir, "scheduler") == f"ipc://{run_dir}/scheduler.sock"


def test_ipc_address_rejects_an_over_long_path(tmp_path):
    long_dir = str(tmp_path / ("d" * 120))
    with pytest.raises(ValueError, match="too long"):
        ipc_address(long_dir, "scheduler")


def test_longest_accepted_ipc_address_can_be_bound(ctx, run_dir):
    """Whatever limit ipc_address applies, every address it accepts must fit a socket."""
    name_len = 1
    while True:
        try:
            ipc_address(run_dir, "x" * (name_len + 1))
        except ValueError:
            break
        name_len += 1
        assert name_len < 200, "no length limit"
    address = ipc_address(run_dir, "x" * name_len)
    inbox = ctx.pull(address, SupervisorInbox)
    push = ctx.push(address)
    push.send(Ready("x", 1))
    assert inbox.recv(timeout_ms=2000) == Ready("x", 1)


def test_messages_arrive_in_order_and_typed(ctx, run_dir):
    address = ipc_address(run_dir, "scheduler")
    inbox = ctx.pull(address, SchedulerInbox)
    push = ctx.push(address)
    sent = [NewRequest(req_id=f"r{i}", prompt_token_ids=list(range(i + 1)),
                       sampling=SamplingParams(seed=i), arrival_time=float(i)) for i in range(20)]
    sent += [Abort([SeqId("r3"), SeqId("r7", 1)]), StepResult(step_id=5, seq_ids=[SeqId("r1")], token_ids=[99])]
    for msg in sent:
        push.send(msg)
    received = [inbox.recv(timeout_ms=2000) for _ in sent]
    assert [type(m) for m in received] == [type(m) for m in sent]
    assert received == sent
    assert os.path.exists(os.path.join(run_dir, "scheduler.sock"))


def test_recv_times_out_with_none_when_empty(ctx, run_dir):
    inbox = ctx.pull(ipc_address(run_dir, "supervisor"), SupervisorInbox)
    assert inbox.recv(timeout_ms=50) is None
    assert inbox.recv(timeout_ms=0) is None


def test_recv_raises_on_a_foreign_message(ctx, run_dir):
    address = ipc_address(run_dir, "supervisor")
    inbox = ctx.pull(address, SupervisorInbox)
    push = ctx.push(address)
    push.send(Abort([SeqId("x")]))
    push.sock.send(b"\xc1garbage")
    push.send(Ready("tokenizer 0", 17))
    with pytest.raises(msgspec.ValidationError):
        inbox.recv(timeout_ms=2000)
    with pytest.raises(msgspec.DecodeError) as info:
        inbox.recv(timeout_ms=2000)
    assert not isinstance(info.value, msgspec.ValidationError)
    assert inbox.recv(timeout_ms=2000) == Ready("tokenizer 0", 17)   # the inbox still works


def test_push_to_two_inboxes_round_robins(ctx, run_dir):
    addresses = [ipc_address(run_dir, "tokenizer-0"), ipc_address(run_dir, "tokenizer-1")]
    inboxes = [ctx.pull(a, SupervisorInbox) for a in addresses]
    push = ctx.push(addresses)
    # PUSH only round-robins over peers it is connected to; wait until both have had a probe.
    reached = [False, False]
    for _ in range(200):
        push.send(Fatal("probe", ""))
        for which, inbox in enumerate(inboxes):
            while inbox.recv(timeout_ms=5) is not None:
                reached[which] = True
        if all(reached):
            break
    assert all(reached)
    msgs = [Ready(f"actor {i}", i) for i in range(10)]
    for msg in msgs:
        push.send(msg)
    got = [[], []]
    for which, inbox in enumerate(inboxes):
        while (m := inbox.recv(timeout_ms=100)) is not None:
            got[which].append(m)
    assert sorted(got[0] + got[1], key=lambda m: m.pid) == msgs
    assert len(got[0]) == len(got[1]) == 5
    assert [m.pid % 2 for m in got[0]] == [got[0][0].pid % 2] * 5   # strictly alternating
    assert [m.pid % 2 for m in got[1]] == [got[1][0].pid % 2] * 5
    assert got[0][0].pid % 2 != got[1][0].pid % 2


def test_push_can_bind_and_pull_connect(ctx, run_dir):
    address = ipc_address(run_dir, "gateway")
    push = ctx.push(address, bind=True)
    inbox = ctx.pull(address, SupervisorInbox, bind=False)
    push.send(Fatal("gateway", "port in use"))
    assert inbox.recv(timeout_ms=2000) == Fatal("gateway", "port in use")


def test_push_sends_exactly_the_encoded_frame(ctx, run_dir):
    address = ipc_address(run_dir, "raw")
    raw = ctx.zmq.socket(zmq.PULL)
    raw.bind(address)
    push = ctx.push(address)
    try:
        msg = Abort([SeqId("a"), SeqId("b")])
        push.send(msg)
        assert raw.poll(2000)
        assert raw.recv() == encode(msg)
    finally:
        raw.close()
