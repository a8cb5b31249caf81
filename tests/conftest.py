"""Shared fixtures (helpers live in tests/helpers.py)."""
from __future__ import annotations

import os

import pytest

# One torch thread per engine in tests: with two threads on two cores, any other busy process
# (a server's other actors, the test client) stalls every parallel region, and a tiny model's
# step goes from ~0.5 ms to ~50 ms. Servers started by the tests inherit this.
os.environ.setdefault("PAGEWIRE_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton kernels run on CPU tensors in tests

from tests.helpers import make_tiny_llama


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory) -> str:
    """The default model's tokenizer as a Hugging Face directory (tiny models borrow it)."""
    from pagewire.hf_tokenizer import load_tokenizer
    from pagewire.model_info import resolve_model

    path = str(tmp_path_factory.mktemp("smol-tokenizer"))
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return path


@pytest.fixture
def tiny_llama(tmp_path, smol_tokenizer_dir):
    """Factory: tiny_llama(shape=..., **kw) -> path of a fresh tiny model directory."""
    counter = iter(range(1000))

    def make(shape: str = "gqa2-d64", **kw) -> str:
        return make_tiny_llama(str(tmp_path / f"model{next(counter)}"), smol_tokenizer_dir,
                               shape, **kw)
    return make
