"""`kv_transfer_params` as a request carries them in and a prefill engine's answer carries
them out (vLLM's names; the flow: wire/kv_transfer.py). Shared by the gateway and the offline
API. Without --kv-transfer-config the field is ignored, as an engine without a connector
ignores it."""
from __future__ import annotations

from pagewire.wire.kv_transfer import KvSource, KvTransfer
from pagewire.wire.sampling_params import SamplingParams


def request_transfer(config, params: dict | None, sampling: SamplingParams) -> KvTransfer | None:
    """A request's part in disaggregated prefill/decode; ValueError says what is wrong."""
    transfer = config.kv_transfer_config
    if not params or transfer is None:
        return None
    if params.get("do_remote_decode"):
        if not transfer.produces:
            raise ValueError(f"do_remote_decode: this engine is a {transfer.kv_role}, it does "
                             "not prefill for others")
        if sampling.num_outputs > 1 or sampling.use_beam_search:
            raise ValueError("do_remote_decode: one output sequence only (n, best_of, beams)")
        return KvTransfer(remote_decode=True)
    if params.get("do_remote_prefill"):
        if not transfer.consumes:
            raise ValueError(f"do_remote_prefill: this engine is a {transfer.kv_role}, it does "
                             "not decode for others")
        host, port, lease = (params.get(k) for k in
                             ("remote_host", "remote_port", "remote_request_id"))
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(lease, str)):
            raise ValueError("do_remote_prefill needs remote_host, remote_port and "
                             "remote_request_id (as the prefill engine answered them)")
        return KvTransfer(remote_prefill=KvSource(f"tcp://{host}:{port}", lease))
    return None


def answer_params(config, req_id: str) -> dict:
    """What a prefill engine answers for a request it computed for a remote decode: where its
    blocks wait, under which lease."""
    transfer = config.kv_transfer_config
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": transfer.engine_id or f"{transfer.kv_ip}:{transfer.kv_port}",
            "remote_block_ids": None, "remote_host": transfer.kv_ip,
            "remote_port": transfer.kv_port, "remote_request_id": req_id, "tp_size": 1}
