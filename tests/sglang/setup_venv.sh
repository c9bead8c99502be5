#!/usr/bin/env bash
# Create the side virtualenv in which SGLang 0.5.23 runs on CPU: its own KV-pool sizing
# (tests/sglang/sglang_sizes.py), its allocator and pools (and its own allocator unit tests on
# kvpool's allocator), and its engine with the plugin (tests/integration/sglang/; see
# tests/sglang/README.md). The steps both side venvs share
# are in tests/side_venv_lib.sh.
#
#   tests/sglang/setup_venv.sh            # venv at ${KVPOOL_SGLANG_VENV:-<repo>/.venv-sglang}
#   tests/sglang/setup_venv.sh --reuse    # a finished one made from another checkout is kept
#
# Idempotent: a marker file in the venv records a finished setup of this exact package
# list; a later run with the marker in place does nothing. A venv without the marker (an
# interrupted setup) is removed and made again. Exits non-zero on any failure.
#
# torch comes first, the CPU build (tests/torch_wheel.py picks it: $KVPOOL_TORCH_WHEEL or a
# wheel in pip's find-links, else PyTorch's CPU wheel index); SGLang is installed without its dependencies (most are CUDA-only), then
# the pure-Python packages the harness path imports. The constraint keeps every later
# step from replacing the CPU torch with a CUDA build from PyPI.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${KVPOOL_SGLANG_VENV:-$repo/.venv-sglang}"
python="${PYTHON:-python3}"
marker="$venv/.kvpool-sglang-ready"

TORCH="torch==2.13.0"
SGLANG="sglang==0.5.23"
# What SGLang's config, resolution, memory-pool and model modules import on the path the
# harness drives. Pinned where SGLang 0.5.23 pins them.
DEPS=(
    "transformers==5.19.0"
    "tokenizers==0.23.2"
    "compressed-tensors==0.18.0"
    "apache-tvm-ffi==0.1.11"
    "sentencepiece==0.2.1"
    "openai==2.8.0"
    "uvicorn>=0.51"
    "pyzmq>=25.1.2"
    aiohttp
    dill
    einops
    fastapi
    gguf
    msgspec
    orjson
    partial_json_parser
    pillow
    psutil
    pybase64
    pydantic
    requests
    # The engine and HTTP server (tests/integration/sglang/): scheduler, tokenizer manager,
    # detokenizer, sampling, the OpenAI-compatible server's imports.
    "openai-harmony==0.0.4"
    "xgrammar==0.2.7"
    anthropic
    blobfile
    interegular
    jsonschema
    loguru
    nvidia-ml-py
    opentelemetry-api
    pydantic-settings
    python-dateutil
    python-multipart
    setproctitle
    six
    soundfile
    tiktoken
    tqdm
    uvloop
    watchfiles
    xxhash
    zstandard
    prometheus-client
    # SGLang's own unit tests (tests/integration/sglang/test_sglang_own_allocator_tests.py):
    # their base class (sglang.test.test_utils) imports SGLang's benchmark datasets.
    datasets
)

. "$here/../side_venv_lib.sh"

want="$TORCH $SGLANG ${DEPS[*]} kvpool-editable:$repo"
venv_begin "$@"
venv_torch

say "installing $SGLANG without its dependencies"
run_pip --no-deps "$SGLANG"

say "installing the harness's dependencies: ${DEPS[*]}"
run_pip -c "$constraints" "${DEPS[@]}"

venv_kvpool "the client and the SGLang plugin"

say "smoke test: SGLang sizes a Llama 3.1 8B pool through the harness"
case='[{"id": "smoke", "config": "'"$repo"'/tests/data/models/llama-3.1-8b-instruct.json",
        "budget_bytes": 1073741824, "page_size": 16}]'
out="$(PYTHONPATH="$here/stubs" "$venv/bin/python" "$here/sglang_sizes.py" <<<"$case" 2>"$venv/smoke.log")" || {
    say "smoke test failed; see $venv/smoke.log" >&2
    exit 1
}
if ! grep -q '"max_total_num_tokens": 8192' <<<"$out"; then
    say "smoke test gave an unexpected result:" >&2
    printf '%s\n' "$out" >&2
    exit 1
fi

venv_done
