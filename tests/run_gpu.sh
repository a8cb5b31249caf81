#!/usr/bin/env bash
# The tests that run CUDA, with the Triton kernels compiled for the GPU (TRITON_INTERPRET=0;
# the CPU suite interprets them). On a machine with an NVIDIA GPU: bash tests/run_gpu.sh
# [pytest args]. Every engine these tests start runs on the GPU (device auto); tests that pin
# device="cpu" check the CPU backends there too. Without the default model's package,
# PAGEWIRE_TEST_TOKENIZER=DIR names a saved copy of its tokenizer for the tiny models, and the
# tests that load the default model itself fail.
# On the lent GPU machine (no registries): tests/gpu_prepare.sh, run here, puts the wheels it
# installs in .whl/ and the tokenizer in .gpu/tokenizer; carry both. BENCH=1 runs
# the GPU benchmarks (bench/gpu.py: the default model's shape, then Llama-3.1-8B's, random
# bfloat16 weights) after the tests, BENCH=only instead of them. TRITON_INTERPRET=0 matters:
# tests/conftest.py defaults it to 1.
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
        --target /tmp/site \
        .whl/*.whl . >/dev/null || exit 1
    export PYTHONPATH=/tmp/site
fi
[ -d .gpu/tokenizer ] && export PAGEWIRE_TEST_TOKENIZER="${PAGEWIRE_TEST_TOKENIZER:-$PWD/.gpu/tokenizer}"
[ -f .gpu/gguf_tokenizer.json ] && export PAGEWIRE_TEST_GGUF_TOKENIZER="$PWD/.gpu/gguf_tokenizer.json"
# The native CPU kernels, every tier this CPU runs, built once before the tests: built by the
# first tests instead, beside a dozen workers, a build outlasted the per-test timeout.
python3 -c 'from pagewire.kernels import native, tiers
for tier in tiers.runnable(): print("native", tier, native.library_path(tier))' || exit 1
gpu_bench() {
    python3 bench/gpu.py
    python3 bench/gpu.py --shape llama-3.1-8b --requests 1000 --kv-memory-gib 24
}
[ "${BENCH:-}" = only ] && { gpu_bench; exit; }
workers=()
python3 -c 'import xdist' 2>/dev/null && workers=(-n "${WORKERS:-8}")
python3 -m pytest -q "${workers[@]}" -p no:cacheprovider --timeout 150 -rfE \
    tests/actors/test_step_overlap.py tests/actors/test_step_engine_drivers.py \
    tests/kernels/test_triton.py tests/kernels/test_kv_quant.py tests/kernels/test_cascade.py \
    tests/kernels/test_moe_triton.py tests/kernels/test_attention_sinks.py \
    tests/actors/test_moe_models.py tests/actors/test_gpt_oss.py tests/actors/test_gpt_family.py \
    tests/kernels/test_context_parallel.py tests/kernels/test_sampling.py \
    tests/actors/test_cuda_graphs.py tests/actors/test_llm_vs_hf.py \
    tests/actors/test_pipelining.py tests/actors/test_lora.py tests/actors/test_kv_cache_dtype.py \
    tests/actors/test_speculation.py tests/actors/test_cascade.py \
    tests/actors/test_structured_outputs.py tests/actors/test_logits_features.py \
    tests/actors/test_sliding_window.py tests/actors/test_architectures.py \
    tests/actors/test_sampler.py tests/actors/test_kv_compress.py \
    tests/actors/test_streaming_input.py tests/actors/test_checkpoint_formats.py \
    tests/actors/test_disk_tier.py tests/actors/test_kv_tier.py tests/actors/test_disagg.py \
    tests/actors/test_engine_sharing.py tests/actors/test_kv_blocks.py \
    tests/e2e/test_lora.py tests/e2e/test_kv_tier.py tests/e2e/test_disagg.py \
    tests/e2e/test_tensor_parallel.py tests/actors/test_backend.py "$@"
status=$?
[ -n "${BENCH:-}" ] && gpu_bench
exit $status
