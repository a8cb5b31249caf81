"""Both ends of a KV transfer between engines (the flow: wire/kv_transfer.py).

KvServer (prefill engine, executor rank 0): a thread with a ROUTER socket. The step loop adds
the leases each plan carries; a KvPull is answered with the leased blocks of the hashes asked
(first to last, stopping at one the lease does not hold), read under the lock that also
guards the lease table. A lease ends when its puller releases it or when it expires; it is
out of the table before its scheduler hears (KvLeaseEnded) and frees the blocks, so blocks
are never served once they may be reused.

KvPuller (decode engine): a thread that, for each pull of a plan, asks the source's server,
waits up to pull_timeout, writes the blocks that came into the pool and releases the lease
(whether all, some or none came), then tells the scheduler (KvPulled). Steps run meanwhile:
the pulled blocks belong to waiting requests only, which no step touches. A server that is gone, slow, of another layout, or without that lease
gives fewer blocks than asked: the scheduler computes the rest or fails the request.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import msgspec
import torch
import zmq

from pagewire.wire.channels import make_decoder
from pagewire.wire.ids import SeqId
from pagewire.wire.kv_transfer import (KvBlocks, KvLease, KvLeaseEnded, KvPull, KvPulled,
                                       KvPullerInbox, KvRelease, KvServerInbox)
from pagewire.wire.to_executor import KvLoad

from .. import kv_tier_files
from .kv_blocks import BlockBytes

log = logging.getLogger(__name__)
_encode = msgspec.msgpack.encode     # a call of its own each time: the server is a thread


def _secure(sock: zmq.Socket, keys: str | None, server: bool) -> None:
    """CURVE with the engine's keys (`pagewire keys DIR`, the same directory on both
    engines): the server is the engine key, a puller the executor key."""
    if not keys:
        return
    from .ranks import load_curve_keys
    if server:
        public, secret = load_curve_keys(keys, "engine", True)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
    else:
        public, secret = load_curve_keys(keys, "executor", True)
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_serverkey = load_curve_keys(keys, "engine", False)[0]


class KvServer:
    def __init__(self, ctx: zmq.Context, address: str, blocks: BlockBytes, layout: str,
                 lease_seconds: float, notify, keys: str | None = None):
        """notify(KvLeaseEnded) is called from the server's thread."""
        self.blocks, self.layout, self.lease_seconds = blocks, layout, lease_seconds
        self.notify = notify
        self.lock = threading.Lock()
        self.leases: dict[str, tuple[dict[bytes, int], float]] = {}   # hash -> block, deadline
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        _secure(self.sock, keys, server=True)
        self.sock.bind(address)
        self.decoder = make_decoder(KvServerInbox)
        self.thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)
        self.thread.start()

    def add(self, leases: list[KvLease]) -> None:
        deadline = time.monotonic() + self.lease_seconds
        with self.lock:
            for lease in leases:
                self.leases[lease.lease] = (dict(zip(lease.hashes, lease.block_ids)), deadline)

    def _serve(self) -> None:
        torch.set_num_threads(1)   # no second OpenMP team on the step's cores (llm.py)
        while True:
            if self.sock.poll(200):
                identity, frame = self.sock.recv_multipart()
                try:
                    msg = self.decoder.decode(frame)
                except Exception as e:      # not ours: say so, stay up
                    self.sock.send_multipart([identity, _encode(KvBlocks("", 0, str(e)))])
                    continue
                if isinstance(msg, KvPull):
                    self.sock.send_multipart([identity, *self._answer(msg)])
                else:
                    self._end(msg.lease, expired=False)
            now = time.monotonic()
            with self.lock:
                expired = [k for k, (_, deadline) in self.leases.items() if deadline < now]
            for lease in expired:
                self._end(lease, expired=True)

    def _answer(self, pull: KvPull) -> list[bytes]:
        if pull.layout != self.layout:
            return [_encode(KvBlocks(pull.lease, 0, f"layout {self.layout} here, "
                                                   f"{pull.layout} asked"))]
        with self.lock:
            held = self.leases.get(pull.lease)
            if held is None:
                return [_encode(KvBlocks(pull.lease, 0, "no such lease (expired or released)"))]
            ids = []
            for h in pull.hashes:
                if h not in held[0]:
                    break
                ids.append(held[0][h])
            payloads = self.blocks.read(ids) if ids else []
        return [_encode(KvBlocks(pull.lease, len(ids))), *payloads]

    def _end(self, lease: str, expired: bool) -> None:
        with self.lock:
            known = self.leases.pop(lease, None) is not None
        if known:
            if expired:
                log.warning("KV lease %s expired before a decode engine released it", lease)
            self.notify(KvLeaseEnded(lease, expired))


class KvPuller:
    def __init__(self, ctx: zmq.Context, blocks: BlockBytes, layout: str, timeout: float,
                 notify, keys: str | None = None):
        """notify(KvPulled) is called from the puller's thread when a plan's pulls end."""
        self.ctx, self.blocks, self.layout, self.timeout = ctx, blocks, layout, timeout
        self.notify, self.keys = notify, keys
        self.decoder = make_decoder(KvPullerInbox)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._work, name="kv-puller", daemon=True)
        self.thread.start()

    def start(self, loads: list[KvLoad]) -> None:
        """Pull on the puller's thread while steps go on. The scheduler keeps the blocks out
        of every step (their request waits) until it hears they were filled."""
        self.jobs.put(loads)

    def pull(self, loads: list[KvLoad]) -> dict[SeqId, int]:
        return {load.seq_id: self._pull(load) for load in loads}

    def _work(self) -> None:
        torch.set_num_threads(1)   # no second OpenMP team on the step's cores (llm.py)
        while True:
            loads = self.jobs.get()
            self.notify(KvPulled(self.pull(loads)))

    def _pull(self, load: KvLoad) -> int:
        """Blocks filled (a prefix of load's), after releasing the lease."""
        sock = self.ctx.socket(zmq.DEALER)       # one per pull: a late answer never misleads
        sock.setsockopt(zmq.LINGER, 1000)
        _secure(sock, self.keys, server=False)
        sock.connect(load.source.address)
        try:
            return self._receive(sock, load) if load.hashes else 0
        finally:
            sock.send(_encode(KvRelease(load.source.lease)))
            sock.close()

    def _receive(self, sock: zmq.Socket, load: KvLoad) -> int:
        sock.send(_encode(KvPull(load.source.lease, load.hashes, self.layout)))
        if not sock.poll(int(self.timeout * 1000)):
            log.warning("KV pull from %s (lease %s) timed out", load.source.address,
                        load.source.lease)
            return 0
        head, *payloads = sock.recv_multipart()
        reply = self.decoder.decode(head)
        if reply.error:
            log.warning("KV pull from %s refused: %s", load.source.address, reply.error)
        count = min(reply.count, len(payloads), len(load.block_ids))
        if any(len(p) != self.blocks.block_bytes for p in payloads[:count]):
            return 0
        for block, payload in zip(load.block_ids[:count], payloads):
            self.blocks.write(block, bytearray(payload))
        return count


def transfer_ends(config, caches: list[torch.Tensor], rank: int,
                  notify) -> tuple[KvServer | None, KvPuller | None]:
    """The ends of disaggregated prefill/decode this engine's role asks for, over the device
    caches `caches` of tensor-parallel rank `rank`; notify(msg) tells the scheduler."""
    transfer = config.kv_transfer_config
    if transfer is None:
        return None, None
    blocks = BlockBytes(caches)
    layout = kv_tier_files.layout_key(config, rank)
    ctx, keys = zmq.Context.instance(), config.parallel.curve_keys
    server = KvServer(ctx, f"tcp://{transfer.kv_ip}:{transfer.kv_port}", blocks, layout,
                      transfer.lease_seconds, notify, keys) if transfer.produces else None
    puller = KvPuller(ctx, blocks, layout, transfer.pull_timeout, notify, keys) \
        if transfer.consumes else None
    return server, puller
