"""The rank sockets' liveness: a rank counts another's silence only from when its own model is
loaded, since every rank loads at once and pings no one meanwhile (a 33 s first load on a GPU
machine's host failed rank 1 at its first receive, its clock started at the welcome)."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from pagewire.executor import ranks
from pagewire.executor.ranks import RankClient, RankFailure, RankServer
from pagewire.wire.to_executor import AttachHello, AttachWelcome


@pytest.fixture
def attached(tmp_path, monkeypatch):
    """Rank 0 and rank 1 of two, attached over ipc: pings every 0.05 s, 0.3 s of silence
    fails a rank."""
    monkeypatch.setattr(ranks, "PEER_TIMEOUT", 0.3)
    monkeypatch.setattr(ranks, "PING_INTERVAL", 0.05)
    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/ranks.sock"
    server = RankServer(ctx, address, 2, lambda hello: None, AttachWelcome("{}", "tcp://x:1"))
    client = RankClient(ctx, address, 1)
    waiter = threading.Thread(target=server.await_ranks, args=(10,))
    waiter.start()
    client.attach(AttachHello(version="v", rank=1, tensor_parallel_size=2, model_name="m",
                              model_digest="d"), 10)
    waiter.join()
    yield server, client
    client.close(), server.close()
    ctx.term()


def test_a_rank_loading_longer_than_the_silence_limit_is_not_taken_for_gone(attached):
    server, client = attached
    time.sleep(0.5)                       # both load their models: no pings either way
    client.loaded()
    server.loaded()
    for _ in range(8):                    # now both ping: neither side fails
        server.poll()
        assert client.recv(60) is None
    time.sleep(0.5)                       # rank 0 goes silent for good
    with pytest.raises(RankFailure, match="rank 0 at .* stopped answering"):
        client.recv(100)


def test_without_loaded_the_clock_runs_from_the_welcome(attached):
    """Rank 0 checks first: the client's recv pings before it fails, and a ping that
    reached rank 0 before its poll would count as an answer (it did on a loaded machine).
    The client fails before reading what rank 0's poll sent."""
    server, client = attached
    time.sleep(0.5)
    with pytest.raises(RankFailure, match="executor rank 1 stopped answering"):
        server.poll()
    with pytest.raises(RankFailure, match="stopped answering"):
        client.recv(100)
