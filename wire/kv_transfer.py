"""Disaggregated prefill and decode: what a request says about its KV, and the messages of the
KV transfer between a prefill engine (producer) and a decode engine (consumer).

The flow is vLLM's: a proxy sends a request to the prefill engine with
`kv_transfer_params: {"do_remote_decode": true}` and max_tokens 1; that engine computes the
prompt and, instead of freeing its blocks, holds them under a lease named by the request id,
and answers with `kv_transfer_params` naming itself (`remote_host`, `remote_port`,
`remote_request_id`). The proxy sends the original request with those to the decode engine,
which pulls the prompt's full blocks from the prefill engine's KV server (an executor
thread, ZeroMQ ROUTER) on a thread of its own while its steps go on, computes the rest and
decodes. A pull names its blocks by their
chained hashes (kv_manager.py): a block is served only if the lease holds one of that hash,
so a decode engine never loads KV of other tokens, another salt or adapter. The pull also
names the layout (kv_tier_files.layout_key): engines of different weights, dtypes or block
sizes refuse each other. The decode side releases the lease after its load (whole or not);
a lease nobody releases expires.
"""
from __future__ import annotations

import msgspec

from .ids import SeqId


class KvSource(msgspec.Struct, array_like=True, frozen=True):
    """Where a decode engine pulls a request's prefix: a prefill engine's KV server."""
    address: str                 # tcp://HOST:PORT
    lease: str                   # the prefill engine's request id


class KvTransfer(msgspec.Struct, array_like=True, frozen=True):
    """A request's part in the flow: computed here for a remote decode (its blocks then held
    under a lease named by its request id), or decoded here after a remote prefill."""
    remote_decode: bool = False
    remote_prefill: KvSource | None = None


class KvLease(msgspec.Struct, array_like=True, gc=False):
    """From the prefill engine's scheduler to its executor: blocks the KV server may serve
    under `lease` until it is released or expires."""
    lease: str
    block_ids: list[int]
    hashes: list[bytes]


class KvPulled(msgspec.Struct, tag=True):
    """From a decode engine's puller (a thread of executor 0) to its scheduler: the pulls of
    a plan ended, with how many leading blocks each filled (the rest are to be computed)."""
    loaded: dict[SeqId, int]


class KvLeaseEnded(msgspec.Struct, tag=True):
    """From the KV server to its scheduler: the lease's blocks may be freed (the decode
    engine released it, or it expired: `expired`)."""
    lease: str
    expired: bool = False


# -- between the engines (the KV server's socket) ----------------------------------------------

class KvPull(msgspec.Struct, tag=True):
    lease: str
    hashes: list[bytes]          # the blocks wanted, in table order
    layout: str                  # the puller's layout key: the server's must be equal


class KvRelease(msgspec.Struct, tag=True):
    lease: str


class KvBlocks(msgspec.Struct, tag=True):
    """The answer to a KvPull: the first `count` wanted blocks follow, one frame each (the
    lease holds blocks of those hashes, stopping at the first it does not); `error` says why
    none or fewer came."""
    lease: str
    count: int
    error: str | None = None


KvServerInbox = KvPull | KvRelease
KvPullerInbox = KvBlocks
