"""The options given as JSON objects (vLLM's spelling): --speculative-config and
--kv-transfer-config, each a frozen struct checked on its own; EngineConfig holds them.
Imports no torch."""
from __future__ import annotations

import json

import msgspec


# Speculation's default batch limit by device: on a CPU a verified draft row costs a good
# part of a step beyond two sequences (bench/NOTES.md "Speculative decoding": copy-heavy
# prompts 1.37x at 2 running, 1.07x at 4, free text 0.97x and 0.87x); on CUDA rows are nearly
# free (not measured here: the previous default).
MAX_BATCH = {"cpu": 2, "cuda": 8}


class SpeculativeConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """--speculative-config, as vLLM spells it (JSON). Drafts are proposed by the executor
    after each step (executor/draft_proposers.py) and verified by the target in the next."""
    method: str = "ngram"                  # ngram | suffix | self | draft_model
    model: str | None = None               # draft_model: a GGUF or HF directory sharing the
                                           # target's tokenizer
    num_speculative_tokens: int = 3        # drafts verified per step, at most
    prompt_lookup_min: int = 3             # n-gram lengths matched (ngram, suffix)
    prompt_lookup_max: int = 4
    max_batch: int | None = None           # more sequences running than this: no drafts
                                           # (None: MAX_BATCH of the executors' device)
    min_acceptance: float = 0.35           # a sequence accepting fewer drafts drafts rarely
    draft_layers: int | None = None        # self: the target's first layers that draft
                                           # (None: a quarter of them)

    def check(self) -> None:
        if self.method not in ("ngram", "suffix", "self", "draft_model"):
            raise ValueError(f"speculative method must be ngram, suffix, self or draft_model, "
                             f"got {self.method!r}")
        if (self.model is None) == (self.method == "draft_model"):
            raise ValueError("speculative `model` goes with method draft_model (and it needs one)")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError("draft_layers must be at least 1")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in 1..16")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")


class KVTransferConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """--kv-transfer-config, as vLLM spells it (JSON): this engine's part in disaggregated
    prefill and decode (wire/kv_transfer.py has the flow)."""
    kv_connector: str = "PagewireConnector"
    kv_role: str = "kv_both"               # kv_producer (prefills) | kv_consumer | kv_both
    kv_ip: str = "127.0.0.1"               # where the KV server listens (producer)...
    kv_port: int = 14579                   # ...and the address it gives in its answers
    engine_id: str | None = None
    kv_load_failure_policy: str = "recompute"   # or "fail": a pull that fails ends the request
    kv_connector_extra_config: dict = {}   # lease_seconds (120), pull_timeout (10 s)

    def check(self) -> None:
        if self.kv_connector != "PagewireConnector":
            raise ValueError(f"kv_connector must be PagewireConnector, got {self.kv_connector!r}")
        if self.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(f"kv_role must be kv_producer, kv_consumer or kv_both, got "
                             f"{self.kv_role!r}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be recompute or fail")
        unknown = set(self.kv_connector_extra_config) - {"lease_seconds", "pull_timeout"}
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {sorted(unknown)}")

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def lease_seconds(self) -> float:
        return float(self.kv_connector_extra_config.get("lease_seconds", 120.0))

    @property
    def pull_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("pull_timeout", 10.0))


def parse_json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")
    return value


def check_kv_compress(config, info) -> None:
    """KV-Compress (--kv-compress-rate) and what it does not combine with, refused by name:
    blocks of compressed sequences hold no whole prefix (prefix caching, the disk tier,
    disaggregation), are no sequence's but their own (swapping moves whole blocks; forks and
    beams are refused per request), and their rows are one rank's (tensor and context
    parallelism); drafts and sliding windows would need evictions aware of them."""
    rate = config.kv_compress_rate
    if rate is None:
        return
    if not 0 < rate <= 1:
        raise ValueError(f"--kv-compress-rate must be in (0, 1], got {rate}")
    if config.kv_compress_window < 1:
        raise ValueError(f"--kv-compress-window must be at least 1, got "
                         f"{config.kv_compress_window}")
    if config.enable_prefix_caching:
        raise ValueError("--kv-compress-rate needs --no-enable-prefix-caching: a compressed "
                         "sequence's blocks hold no whole prefix to share")
    unbuilt = {"--tensor-parallel-size > 1": config.tensor_parallel_size > 1,
               "--speculative-config": config.speculative_config is not None,
               "--kv-offload-dir": config.kv_offload_dir is not None,
               "--kv-transfer-config": config.kv_transfer_config is not None,
               "--preemption-mode swap": config.preemption_mode == "swap",
               "a sliding-window model": info.sliding_window is not None or
               info.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")}
    for what, given in unbuilt.items():
        if given:
            raise ValueError(f"--kv-compress-rate with {what} is not supported")
