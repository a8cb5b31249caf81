#!/usr/bin/env bash
# Prepare a GPU run from a machine with the package registries (the GPU machine has none):
# the wheels tests/run_gpu.sh installs there (Python 3.12, x86-64 Linux: what the GPU image
# lacks of pagewire's and the tests' needs) into .whl/, and the default model's tokenizer into
# .gpu/tokenizer (its 98 MB GGUF does not travel). Both are git-ignored locally; carry them:
#   bash tests/gpu_prepare.sh            # here
#   bash tests/run_gpu.sh                # there, with .whl and .gpu carried
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
mkdir -p .whl .gpu
platforms=()
for n in 17 24 26 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# pagewire's needs the image lacks, then the test clients' (the image has torch, triton,
# transformers, tokenizers, aiohttp, uvloop, numpy, jinja2, prometheus-client, safetensors,
# pytest, pytest-timeout and pytest-xdist)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl \
    msgspec pyzmq gguf setproctitle llguidance \
    jsonschema referencing rpds-py jsonschema-specifications \
    openai pydantic pydantic-core annotated-types typing-inspection jiter sniffio distro \
    httpx2 httpcore2 truststore idna anyio 2>&1 | grep -v '^WARNING' || true
# one version of each: pip download may leave an older one beside a newer
ls .whl | sed 's/-[0-9].*//' | sort | uniq -d | while read -r name; do
    ls -v .whl/"$name"-[0-9]* | head -n -1 | xargs rm -f; done
python3 - <<'PY'
from pagewire.hf_tokenizer import load_tokenizer
from pagewire.model_info import resolve_model
load_tokenizer(resolve_model(None)).save_pretrained(".gpu/tokenizer")
import json
import numpy as np
from pagewire.gguf_header import read_gguf_header
from pagewire.model_info import default_model_path
from pagewire.testing.gguf_writer import TOKENIZER_KEYS
meta = read_gguf_header(default_model_path()).metadata
with open(".gpu/gguf_tokenizer.json", "w") as f:     # what tests/conftest.py's fixture reads
    json.dump({k: meta[k].tolist() if isinstance(meta[k], np.ndarray) else meta[k]
               for k in TOKENIZER_KEYS if k in meta}, f)
PY
du -sh .whl .gpu
