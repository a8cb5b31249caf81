"""Hugging Face directories: sharded safetensors with an index, dtype conversion at load; and
the errors that stop `pagewire serve` (exit 2) before any actor starts."""
from __future__ import annotations

import json
import os

import pytest
import torch

from pagewire import cli
from pagewire.executor.loader import load_model, read_safetensors
from pagewire.executor.models import MODELS
from pagewire.kernels.rotary import ROPE_TYPES as KERNEL_ROPE_TYPES
from pagewire.model_info import (DECODER_CLASSIFIERS, SUPPORTED_ARCHITECTURES, default_model_path,
                                 resolve_model)
from pagewire.rope_scaling import ROPE_TYPES


def _reshard(path: str, dtype: torch.dtype = torch.float32, shards: int = 3) -> dict:
    """Rewrite the directory's weights as `shards` files plus model.safetensors.index.json."""
    from safetensors.torch import save_file
    weights = read_safetensors(path)
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(weights)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n].to(dtype).contiguous() for n in names[i::shards]}
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return weights


def test_sharded_checkpoint_loads_the_same_weights(tiny_llama):
    single = load_model(resolve_model(tiny_llama(seed=4)), "float32").state_dict()
    path = tiny_llama(seed=4)
    _reshard(path)
    sharded = load_model(resolve_model(path), "float32").state_dict()
    assert sorted(single) == sorted(sharded)
    assert all(torch.equal(single[k], sharded[k]) for k in single)


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtype_conversion_at_load(tiny_llama, stored, dtype):
    path = tiny_llama(seed=5)
    source = _reshard(path, stored, shards=2)
    model = load_model(resolve_model(path), dtype)
    want = getattr(torch, dtype)
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {want}
    embed = source["model.embed_tokens.weight"].to(stored).to(want)
    assert torch.equal(params["embed.weight"], embed)


def test_missing_shard_is_named(tiny_llama):
    path = tiny_llama()
    _reshard(path)
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    with pytest.raises(ValueError, match="shard model-00002-of-00003.safetensors listed in "
                                         "model.safetensors.index.json is missing"):
        resolve_model(path)


def test_truncated_safetensors_is_named(tiny_llama):
    path = tiny_llama()
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 100)
    with pytest.raises(ValueError, match=r"model\.safetensors: truncated: tensor \S+ ends at byte"):
        resolve_model(path)


def test_truncated_gguf_is_named(tmp_path):
    path = str(tmp_path / "cut.gguf")
    with open(default_model_path(), "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(50_000_000))
    with pytest.raises(ValueError, match=r"cut\.gguf: truncated or corrupt GGUF: tensor blk\.\S+ needs bytes"):
        resolve_model(path)
    with open(path, "wb") as f:
        f.write(b"GGUF\x03\x00\x00\x00\x05")
    with pytest.raises(ValueError, match=r"cut\.gguf: GGUF header is truncated or corrupt"):
        resolve_model(path)


def _edit_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_unsupported_architecture_lists_the_supported(tiny_llama):
    path = tiny_llama()
    _edit_config(path, architectures=["FooForCausalLM"])
    with pytest.raises(ValueError, match="architecture FooForCausalLM is not supported "
                                         r"\(supported: LlamaForCausalLM, MistralForCausalLM"):
        resolve_model(path)


def test_missing_config_keys_are_named(tiny_llama):
    path = tiny_llama()
    _edit_config(path, num_hidden_layers=None, intermediate_size=None)
    with pytest.raises(ValueError, match="config.json is missing num_hidden_layers, intermediate_size"):
        resolve_model(path)


def test_context_length_and_rope_scaling_from_config(tiny_llama):
    path = tiny_llama(max_position=1024)
    assert resolve_model(path).max_model_len == 1024
    _edit_config(path, rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 512})
    info = resolve_model(path)
    assert info.rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 512}
    assert info.max_model_len == 2048
    _edit_config(path, rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0})
    info = resolve_model(path)      # an older config: rope_scaling, "type"
    assert (info.rope_scaling, info.max_model_len) == ({"rope_type": "linear", "factor": 2.0}, 2048)
    _edit_config(path, rope_scaling={"rope_type": "su", "factor": 2.0})
    with pytest.raises(ValueError, match="rope scaling 'su' is not supported"):
        resolve_model(path)


def test_serve_exits_2_before_starting_actors(tiny_llama, caplog, monkeypatch):
    """The error is logged by the supervisor and nothing is spawned."""
    import pagewire.supervisor as supervisor
    monkeypatch.setattr(supervisor.Supervisor, "run", lambda self: pytest.fail("actors started"))
    path = tiny_llama()
    _edit_config(path, architectures=["FooForCausalLM"])
    assert cli.main(["serve", path]) == 2
    assert "FooForCausalLM is not supported" in caplog.text
    assert cli.main(["serve", tiny_llama(), "--max-model-len", "4096"]) == 2
    assert "longer than the model's context (1024 tokens" in caplog.text


def test_torch_free_lists_match_the_model_code():
    assert sorted(SUPPORTED_ARCHITECTURES + tuple(DECODER_CLASSIFIERS)) == sorted(MODELS)
    assert ROPE_TYPES == KERNEL_ROPE_TYPES


def _mapped_file(address: int) -> str | None:
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5] if len(fields) > 5 else None
    return None


def test_tensors_are_memory_mapped(tiny_llama):
    """A tensor already in the target dtype is the file's pages, not a copy; a converted
    one is a copy."""
    path = tiny_llama()
    file = os.path.join(path, "model.safetensors")
    same = read_safetensors(path, torch.float32)["model.embed_tokens.weight"]
    assert _mapped_file(same.data_ptr()) == os.path.realpath(file)
    cast = read_safetensors(path, torch.bfloat16)["model.embed_tokens.weight"]
    assert _mapped_file(cast.data_ptr()) != os.path.realpath(file)
