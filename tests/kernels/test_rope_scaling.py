"""rope_inv_freq equals transformers' ROPE_INIT_FUNCTIONS for every scaling type the Llama
family uses (inverse frequencies and the attention factor)."""
from __future__ import annotations

import pytest
import torch

from pagewire.kernels.rotary import rope_inv_freq

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                    "beta_fast": 16, "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 0.707},
    "yarn-attention": {"rope_type": "yarn", "factor": 3.0, "attention_factor": 1.25,
                       "original_max_position_embeddings": 128, "truncate": False},
}


def _hf_config(head_dim: int, theta: float, scaling: dict | None, max_position: int):
    from transformers import LlamaConfig
    params = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=max_position, rope_parameters=params)


@pytest.mark.parametrize("name", sorted(SCALINGS) + ["default"])
@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 500000.0)])
def test_inv_freq_matches_transformers(name, head_dim, theta):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = SCALINGS.get(name)
    config = _hf_config(head_dim, theta, scaling, 1024)
    ours, our_factor = rope_inv_freq(head_dim, theta, scaling, 1024)
    if scaling is None:
        theirs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        their_factor = 1.0
    else:
        theirs, their_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    assert ours.dtype == torch.float32 and ours.shape == (head_dim // 2,)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert our_factor == pytest.approx(their_factor, rel=1e-12)


def test_dynamic_grows_past_the_trained_length():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = _hf_config(64, 10000.0, SCALINGS["dynamic"], 1024)
    ours, _ = rope_inv_freq(64, 10000.0, SCALINGS["dynamic"], 1024, seq_len=3000)
    theirs, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=3000)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert not torch.equal(ours, rope_inv_freq(64, 10000.0, None)[0])


def test_unknown_type_is_named():
    with pytest.raises(ValueError, match="'longrope' is not supported.*yarn"):
        rope_inv_freq(64, 10000.0, {"rope_type": "longrope", "factor": 2.0}, 1024)
