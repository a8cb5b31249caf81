"""Shared fixtures (helpers live in tests/helpers.py)."""
from __future__ import annotations

import os

import pytest

# One torch thread per engine in tests: with two threads on two cores, any other busy process
# (a server's other actors, the test client) stalls every parallel region, and a tiny model's
# step goes from ~0.5 ms to ~50 ms. Servers started by the tests inherit this.
os.environ.setdefault("PAGEWIRE_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")   # Triton kernels run on CPU tensors in tests

from pagewire.kernels import tiers
from tests.helpers import make_tiny_llama

_TIERS_TESTED: set[str] = set()


@pytest.fixture(params=tiers.TIERS)
def tier(request) -> str:
    """Each native CPU tier (kernels/tiers.py); skipped, naming the tier, on a CPU that
    cannot run it."""
    if request.param not in tiers.runnable():
        pytest.skip(f"needs the {request.param} tier: this CPU runs "
                    f"{', '.join(tiers.runnable()) or 'none'}")
    # Recorded on the report, not here: under pytest-xdist the fixture runs in a worker and
    # the summary below is written by the controller, which sees only reports.
    request.node.user_properties.append(("tier", request.param))
    return request.param


def pytest_runtest_logreport(report):
    _TIERS_TESTED.update(value for name, value in report.user_properties if name == "tier")


@pytest.fixture
def native_lib(tier):
    """That tier's native library (built on first use)."""
    from pagewire.kernels import native
    lib = native.load(tier)
    if lib is None:
        pytest.skip("no C++ compiler for the native kernels")
    return lib


def pytest_terminal_summary(terminalreporter):
    tested = [t for t in tiers.TIERS if t in _TIERS_TESTED]
    untested = [t for t in tiers.TIERS if t not in _TIERS_TESTED]
    terminalreporter.write_line(f"native CPU tiers tested: {', '.join(tested) or 'none'}; not "
                                f"tested: {', '.join(untested) or 'none'} (this CPU runs "
                                f"{', '.join(tiers.runnable()) or 'none'})")


@pytest.fixture(scope="session")
def smol_tokenizer_dir(tmp_path_factory) -> str:
    """The default model's tokenizer as a Hugging Face directory (tiny models borrow it).
    PAGEWIRE_TEST_TOKENIZER names a saved copy instead, for a machine without the default
    model's package (the GPU machine: its 98 MB GGUF does not travel there)."""
    from pagewire.hf_tokenizer import load_tokenizer
    from pagewire.model_info import resolve_model

    if os.environ.get("PAGEWIRE_TEST_TOKENIZER"):
        return os.environ["PAGEWIRE_TEST_TOKENIZER"]
    path = str(tmp_path_factory.mktemp("smol-tokenizer"))
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def default_hf_model():
    """transformers' own reading of the default model's GGUF (its dequantization, its Q/K
    un-permutation), float32, loaded once a session: parsing the GGUF's 49k-token metadata
    alone takes ~15 s. Shared: a test that changes weights changes a copy.deepcopy."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagewire.model_info import DEFAULT_MODEL_FILE, default_model_path
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(default_model_path()),
                                                gguf_file=DEFAULT_MODEL_FILE,
                                                dtype=torch.float32).eval()


@pytest.fixture
def tiny_llama(tmp_path, smol_tokenizer_dir):
    """Factory: tiny_llama(shape=..., **kw) -> path of a fresh tiny model directory."""
    counter = iter(range(1000))

    def make(shape: str = "gqa2-d64", **kw) -> str:
        return make_tiny_llama(str(tmp_path / f"model{next(counter)}"), smol_tokenizer_dir,
                               shape, **kw)
    return make


@pytest.fixture(scope="session")
def gguf_tokenizer_meta() -> dict:
    """The default model's tokenizer as its GGUF holds it, for the GGUF files tests write
    (PAGEWIRE_TEST_GGUF_TOKENIZER names a JSON copy on a machine without its package)."""
    from pagewire.testing.real_shapes import default_tokenizer_meta
    return default_tokenizer_meta()
