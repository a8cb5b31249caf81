"""Messages the gateway receives: text from the detokenizer, refusals from tokenizers, metrics
from the scheduler."""
from __future__ import annotations

import msgspec

from .engine_control import ControlDone
from .ids import SeqId


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    """One token's log-probability, with its text and the top alternatives' (None for the
    first prompt token, which nothing predicts)."""
    token_id: int
    token: str
    logprob: float | None
    top: list[tuple[int, str, float]] = []      # (token id, text, logprob), most likely first


class TextDelta(msgspec.Struct, array_like=True, gc=False):
    seq_id: SeqId                       # an output sequence
    text: str
    num_prompt_tokens: int
    num_output_tokens: int              # outputs so far, this delta's included
    finish_reason: str | None = None    # "stop" | "length" | "abort" | "error" | "rejected"
    error: str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprob] | None = None          # of this delta's tokens
    prompt_logprobs: list[TokenLogprob] | None = None   # once, before any output
    echo_prompt: str | None = None                      # once, before any output
    pooled: bytes | None = None         # a pooling request's output, float32 (pooling.py)
    from_start: bool = False            # text is the output's whole text so far, rebuilt after
                                        # a detokenizer restart: what was received is dropped


class TextDeltas(msgspec.Struct, tag=True, gc=False):
    deltas: list[TextDelta]


class TokenizeReply(msgspec.Struct, tag=True):
    req_id: str
    token_ids: list[int]
    token_strs: list[str]


class DetokenizeReply(msgspec.Struct, tag=True):
    req_id: str
    text: str


class EngineEvent(msgspec.Struct, tag=True):
    """From the supervisor. "down": the scheduler or an executor died and is being restarted:
    fail every request in flight, refuse new ones (503) until "up". "lost": the stateless actor
    `actor` ("tokenizer 1", "detokenizer") died and is being restarted: a tokenizer's unanswered
    requests are resent (gateway/tokenizer_pool.py), a detokenizer's outputs are rebuilt from
    the scheduler's record (DetokResync); "back": it is serving again."""
    status: str          # "down" | "up" | "lost" | "back"
    reason: str
    actor: str = ""


class EngineReady(msgspec.Struct, tag=True):
    """From the supervisor, once every other actor has said Ready: the gateway, started beside
    them, opens its HTTP port only now (nothing serves HTTP before the engine can). Sent again
    until the gateway says Ready; receiving it twice changes nothing."""
    backend: str         # the executors' kernel backend, as executor 0 reported it


class RequestFailed(msgspec.Struct, tag=True, kw_only=True):
    """A request refused before it reached the scheduler (bad prompt, too long, ...)."""
    req_id: str
    status: int                  # HTTP status the gateway answers with
    message: str
    error_type: str = "BadRequestError"
    param: str | None = None


class SchedulerStats(msgspec.Struct, tag=True, kw_only=True):
    """The scheduler's figures for /metrics, sent about once a second while it is busy, once
    when it goes idle, and at least every 2 seconds (the engine's heartbeat). Counters are cumulative since the scheduler started; gauges are current;
    the lists are the histogram observations made since the previous report."""
    num_running: int                   # sequences running
    num_waiting: int                   # sequences waiting (swapped ones included)
    kv_cache_usage: float              # fraction of device KV blocks in use, 0..1
    prompt_tokens: int                 # prompt tokens of prompts whose prefill completed
    generation_tokens: int             # tokens sampled
    preemptions: int
    prefix_cache_queries: int          # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int             # of which found cached
    inbox_messages: dict[str, int] = {}   # scheduler inbox messages received, by type
    iteration_tokens: list[int] = []      # tokens per step
    queue_times: list[float] = []         # seconds from arrival to first scheduled
    step_durations: list[float] = []      # seconds from plan sent to result received
    step_running_for: float = 0.0         # seconds the step now in flight has run (0: none)
    spec_drafts: int = 0                  # speculative decoding: steps of a sequence that
    spec_draft_tokens: int = 0            # verified drafts, the drafts verified, and of those
    spec_accepted_tokens: int = 0         # the ones accepted (cumulative);
    spec_accepted_per_pos: list[int] = []  # accepted at draft position i (cumulative)
    running_loras: list[str] = []         # the adapters of running / waiting sequences
    waiting_loras: list[str] = []
    external_prefix_cache_queries: int = 0   # disk tier: tokens looked up there (cumulative)
    external_prefix_cache_hits: int = 0      # of which loaded
    experts_read: int = 0                    # mixtures of experts: expert reads (each chosen
    moe_steps: int = 0                       # expert once a layer and step) over these steps
    encoder_cache_queries: int = 0           # vision: images the steps read (cumulative),
    encoder_cache_hits: int = 0              # of which found encoded in the encoder cache,
    encoder_seconds: float = 0.0             # and the seconds encoding the rest
    kv_offload_stores: int = 0               # blocks written, read back, failed to read back
    kv_offload_loads: int = 0
    kv_offload_load_failures: int = 0
    kv_offload_bytes_stored: int = 0
    kv_offload_bytes_loaded: int = 0
    kv_offload_blocks: int = 0               # blocks it holds now


GatewayInbox = (TextDeltas | RequestFailed | SchedulerStats | TokenizeReply | DetokenizeReply
                | EngineEvent | EngineReady | ControlDone)
