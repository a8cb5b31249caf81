"""Prometheus metrics for GET /metrics, under vLLM's names and labels so its dashboards work.

The gateway measures what it sees per sequence (a choice of a request; vLLM counts each as a
request too): time to first token and between tokens from the moment its TextDeltas arrive,
end-to-end latency, prompt and generation lengths, and the finish reason. The scheduler's
figures (running/waiting, KV cache usage, token counters, preemptions, prefix cache, step and
queue times) arrive as SchedulerStats: counters cumulative, histograms as the observations made
since its previous report. Everything lives in a private CollectorRegistry, so several
GatewayMetrics (tests) never collide.
"""
from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import exposition

from pagewire.wire.ids import SeqId
from pagewire.wire.to_gateway import SchedulerStats, TextDelta

CONTENT_TYPE = getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", exposition.CONTENT_TYPE_LATEST)

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards' quantiles mean the same.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0]


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's build_1_2_5_buckets)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > limit:
                return out
            out.append(value)
        exponent += 1


def buckets_pow2(limit: int) -> list[int]:
    """1, 8, 16, 32, ... up to the first power of two at or over limit."""
    out, value = [1, 8], 16
    while out[-1] < limit:
        out.append(value)
        value *= 2
    return out


class _Seq:
    __slots__ = ("start", "first_token_at", "last_token_at", "num_prompt", "num_output")

    def __init__(self, start: float):
        self.start = start
        self.first_token_at: float | None = None
        self.last_token_at = start
        self.num_prompt: int | None = None
        self.num_output = 0


# SchedulerStats' cumulative counters -> (metric, help): vLLM's names, pagewire's own beside.
COUNTERS = {
    "prompt_tokens": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens": ("vllm:generation_tokens", "Number of generation tokens processed."),
    "preemptions": ("vllm:num_preemptions", "Cumulative number of preemptions."),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens."),
    "spec_drafts": ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "spec_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    "spec_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",
                             "Number of accepted tokens."),
    "external_prefix_cache_queries": (
        "vllm:external_prefix_cache_queries",
        "External prefix cache (the disk KV tier) queries, in tokens."),
    "external_prefix_cache_hits": (
        "vllm:external_prefix_cache_hits",
        "External prefix cache (the disk KV tier) hits, in tokens."),
    "experts_read": ("pagewire:moe_experts_read",
                     "Mixture of experts: experts read, each chosen expert once a layer and step."),
    "moe_steps": ("pagewire:moe_steps", "Mixture of experts: steps that read experts."),
    "encoder_cache_queries": ("pagewire:encoder_cache_queries",
                              "Vision: images the steps' rows read from the encoder."),
    "encoder_cache_hits": ("pagewire:encoder_cache_hits",
                           "Vision: of those, images found in the encoder cache."),
    "encoder_seconds": ("pagewire:encoder_seconds", "Vision: seconds encoding images."),
    "kv_offload_stores": ("pagewire:kv_offload_stores", "KV blocks written to the disk tier."),
    "kv_offload_loads": ("pagewire:kv_offload_loads",
                         "KV blocks planned to load from the disk tier."),
    "kv_offload_load_failures": (
        "pagewire:kv_offload_load_failures",
        "Disk tier loads that found a block missing or damaged (recomputed)."),
    "kv_offload_bytes_stored": ("pagewire:kv_offload_stored_bytes",
                                "Bytes of K/V written to the disk tier."),
    "kv_offload_bytes_loaded": ("pagewire:kv_offload_loaded_bytes",
                                "Bytes of K/V loaded from the disk tier."),
}


class GatewayMetrics:
    """The gateway's registry. Hooks, all taking an optional monotonic `now` (tests):
    on_request_start / on_request_end around an HTTP request, on_tokens for each TextDelta of a
    sequence (first token, later tokens, finish), on_scheduler_stats; `handler` serves them."""

    def __init__(self, model_name: str, max_model_len: int = 2048,
                 max_num_batched_tokens: int = 2048, num_speculative_tokens: int = 1,
                 max_loras: int | None = None):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine": "0"}
        self._scheduler_metrics(max_num_batched_tokens, num_speculative_tokens)
        self._request_metrics(max_model_len)
        r = self.registry
        self.in_flight = Gauge("pagewire:requests_in_flight",
                               "HTTP generation requests being handled by the gateway.",
                               registry=r)
        self.api_requests = Counter("pagewire:api_requests",
                                    "HTTP generation requests by the API they came in by.",
                                    ["api"], registry=r)
        self.backend = Gauge("pagewire:backend_info",
                             "The executors' kernel backend (device and CPU tier) and dtype: 1.",
                             ["backend", "dtype"], registry=r)
        self.seqs: dict[SeqId, _Seq] = {}
        self.max_loras, self.lora_labels = max_loras, None
        self.lora_info = Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r) if max_loras else None

    def _labelled(self, kind, name: str, doc: str, **kwargs):
        """A metric of the model's labels (vLLM's model_name and engine), those values set."""
        return kind(name, doc, list(self.labels), registry=self.registry,
                    **kwargs).labels(**self.labels)

    def _scheduler_metrics(self, max_num_batched_tokens: int,
                           num_speculative_tokens: int) -> None:
        """What SchedulerStats reports: gauges, counters (COUNTERS) and histograms."""
        r, names = self.registry, list(self.labels)
        self.num_running = self._labelled(Gauge, "vllm:num_requests_running",
                                          "Number of requests running.")
        self.num_waiting = self._labelled(Gauge, "vllm:num_requests_waiting",
                                          "Number of requests waiting.")
        self.kv_usage = self._labelled(Gauge, "vllm:kv_cache_usage_perc",
                                       "KV cache usage. 1 means 100 percent usage.")
        self.counters = {key: self._labelled(Counter, name, doc)
                         for key, (name, doc) in COUNTERS.items()}
        self.last_counts = {name: 0 for name in self.counters}
        self.tier_blocks = self._labelled(Gauge, "pagewire:kv_offload_blocks",
                                          "KV blocks in the disk tier.")
        self.accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", names + ["position"], registry=r)
        for pos in range(num_speculative_tokens):         # present from the start, as vLLM
            self.accepted_per_pos.labels(**self.labels, position=str(pos))
        self.last_per_pos: list[int] = []
        self.iteration_tokens = self._labelled(
            Histogram, "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine step.",
            buckets=buckets_pow2(max_num_batched_tokens))
        self.queue_time = self._labelled(
            Histogram, "vllm:request_queue_time_seconds",
            "Histogram of time spent waiting in the queue, in seconds.", buckets=LATENCY_BUCKETS)
        self.step_duration = Histogram(
            "pagewire:step_duration_seconds", "Time from a step plan sent to its result received.",
            buckets=STEP_BUCKETS, registry=r)
        self.inbox_messages = Counter("pagewire:scheduler_inbox_messages",
                                      "Messages received by the scheduler, by type.", ["type"],
                                      registry=r)
        self.last_inbox: dict[str, int] = {}

    def _request_metrics(self, max_model_len: int) -> None:
        """What the gateway measures of each sequence."""
        def histogram(name, doc, buckets):
            return self._labelled(Histogram, name, doc, buckets=buckets)

        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS)
        self.prompt_len = histogram("vllm:request_prompt_tokens",
                                    "Number of prefill tokens processed.",
                                    buckets_1_2_5(max_model_len))
        self.output_len = histogram("vllm:request_generation_tokens",
                                    "Number of generation tokens processed.",
                                    buckets_1_2_5(max_model_len))
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               list(self.labels) + ["finished_reason"], registry=self.registry)
        for reason in ("stop", "length", "abort", "error"):   # present from the start, as vLLM
            self.success.labels(**self.labels, finished_reason=reason)

    def set_backend(self, backend: str, dtype: str) -> None:
        self.backend.labels(backend=backend, dtype=dtype).set(1)

    def set_cache_config(self, config) -> None:
        """vllm:cache_config_info: the KV cache's settings as labels (vLLM's names; the
        "gpu" blocks are the device pool's, "cpu" the swap tier's), value 1."""
        labels = {**self.labels, "block_size": config.cache.block_size,
                  "cache_dtype": config.cache.kv_cache_dtype,
                  "enable_prefix_caching": config.cache.enable_prefix_caching,
                  "num_gpu_blocks": config.cache.num_kv_blocks,
                  "num_cpu_blocks": config.cache.num_host_blocks,
                  "swap_space": config.cache.swap_space / 2**30,
                  "sliding_window": config.model.model_info.sliding_window}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              list(labels), registry=self.registry).labels(
                  **{k: str(v) for k, v in labels.items()}).set(1)

    # -- per request, measured at the gateway --------------------------------------------------

    def on_request_start(self, seq_ids: list[SeqId], now: float | None = None,
                         api: str = "openai") -> None:
        """An HTTP request arrived by `api` (doors.py Door.name) that will produce these
        sequences."""
        now = time.monotonic() if now is None else now
        self.in_flight.inc()
        self.api_requests.labels(api=api).inc()
        for sid in seq_ids:
            self.seqs[sid] = _Seq(now)

    def on_tokens(self, delta: TextDelta, now: float | None = None) -> None:
        """A TextDelta of a tracked sequence arrived: first token, later tokens, finish."""
        seq = self.seqs.get(delta.seq_id)
        if seq is None:
            return
        if delta.finish_reason == "rejected":    # refused before it ran: not a request served
            del self.seqs[delta.seq_id]
            return
        now = time.monotonic() if now is None else now
        seq.num_prompt = delta.num_prompt_tokens
        if delta.num_output_tokens > seq.num_output:
            if seq.first_token_at is None:
                self.on_first_token(seq, now)
            else:
                self.itl.observe(now - seq.last_token_at)
            seq.last_token_at, seq.num_output = now, delta.num_output_tokens
        if delta.finish_reason:
            self.on_finish(delta.seq_id, delta.finish_reason, now)

    def on_first_token(self, seq: _Seq, now: float) -> None:
        seq.first_token_at = now
        self.ttft.observe(now - seq.start)

    def on_finish(self, seq_id: SeqId, reason: str, now: float | None = None) -> None:
        """A sequence ended (stop, length, abort, error)."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            return
        now = time.monotonic() if now is None else now
        self.e2e.observe(now - seq.start)
        if seq.num_prompt is not None:           # unknown for one aborted before any reply
            self.prompt_len.observe(seq.num_prompt)
        self.output_len.observe(seq.num_output)
        self.success.labels(**self.labels, finished_reason=reason).inc()

    def on_request_end(self, seq_ids: list[SeqId], aborted: set[SeqId] | frozenset = frozenset(),
                       now: float | None = None) -> None:
        """The HTTP handler ended. Sequences in `aborted` that had not finished count as
        aborts; others still tracked (refused before running) are forgotten."""
        self.in_flight.dec()
        for sid in seq_ids:
            if sid in aborted:
                self.on_finish(sid, "abort", now)
            else:
                self.seqs.pop(sid, None)

    # -- from the scheduler --------------------------------------------------------------------

    def on_scheduler_stats(self, msg: SchedulerStats) -> None:
        self.num_running.set(msg.num_running)
        self.num_waiting.set(msg.num_waiting)
        self.kv_usage.set(msg.kv_cache_usage)
        self.tier_blocks.set(msg.kv_offload_blocks)
        for name, counter in self.counters.items():
            value = getattr(msg, name)
            counter.inc(max(0, value - self.last_counts[name]))
            self.last_counts[name] = max(value, self.last_counts[name])
        for kind, value in msg.inbox_messages.items():
            last = self.last_inbox.get(kind, 0)
            self.inbox_messages.labels(type=kind).inc(max(0, value - last))
            self.last_inbox[kind] = max(value, last)
        for pos, value in enumerate(msg.spec_accepted_per_pos):
            last = self.last_per_pos[pos] if pos < len(self.last_per_pos) else 0
            self.accepted_per_pos.labels(**self.labels, position=str(pos)).inc(
                max(0, value - last))
        if msg.spec_accepted_per_pos:
            self.last_per_pos = list(msg.spec_accepted_per_pos)
        for n in msg.iteration_tokens:
            self.iteration_tokens.observe(n)
        for t in msg.queue_times:
            self.queue_time.observe(t)
        for t in msg.step_durations:
            self.step_duration.observe(t)
        self.on_loras(msg.running_loras, msg.waiting_loras)

    def on_loras(self, running: list[str], waiting: list[str]) -> None:
        """vLLM's form: one sample, its labels the adapters (comma-separated), its value when
        they were last reported."""
        if self.lora_info is None:
            return
        labels = (str(self.max_loras), ",".join(waiting), ",".join(running))
        if labels != self.lora_labels and self.lora_labels is not None:
            self.lora_info.remove(*self.lora_labels)
        self.lora_labels = labels
        self.lora_info.labels(*labels).set(time.time())

    # -- exposition ----------------------------------------------------------------------------

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def handler(self, request: web.Request) -> web.Response:
        return web.Response(body=self.exposition(), headers={"Content-Type": CONTENT_TYPE})
