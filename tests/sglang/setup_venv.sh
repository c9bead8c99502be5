#!/usr/bin/env bash
# Create the side virtualenv in which tests/sglang/sglang_sizes.py runs SGLang 0.5.23's
# own KV-pool sizing on CPU (see tests/sglang/README.md).
#
#   tests/sglang/setup_venv.sh            # venv at ${KVPOOL_SGLANG_VENV:-<repo>/.venv-sglang}
#
# Idempotent: a marker file in the venv records a finished setup of this exact package
# list; a later run with the marker in place does nothing. A venv without the marker (an
# interrupted setup) is removed and made again. Exits non-zero on any failure.
#
# torch comes first and from this machine's disk (the CPU wheel pip finds through its
# find-links); SGLang is installed without its dependencies (most are CUDA-only), then
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
)

say() { printf 'setup_venv: %s\n' "$*"; }

want="$TORCH $SGLANG ${DEPS[*]} kvpool-editable:$repo"
if [[ -f "$marker" && "$(cat "$marker")" == "$want" ]]; then
    say "$venv is ready (marker $marker); nothing to do"
    exit 0
fi

start=$SECONDS
if [[ -e "$venv" ]]; then
    if [[ ! -f "$venv/pyvenv.cfg" ]]; then
        say "$venv exists and is not a virtualenv; refusing to touch it" >&2
        exit 1
    fi
    say "removing the unfinished or outdated venv $venv"
    rm -rf "$venv"
fi

say "creating $venv with $("$python" --version 2>&1)"
"$python" -m venv "$venv"
# Keep the venv out of git status without touching the repository's .gitignore.
printf '*\n' >"$venv/.gitignore"
install=("$venv/bin/python" -m pip --disable-pip-version-check install --progress-bar off)
constraints="$venv/kvpool-constraints.txt"
printf '%s\n' "$TORCH" >"$constraints"

# pip's own chatter (resolver warnings about SGLang's CUDA dependencies, which are
# left out on purpose) goes to a log that is shown when a step fails.
pip_log="$venv/pip.log"
run_pip() {
    if ! "${install[@]}" --quiet "$@" 2>>"$pip_log"; then
        cat "$pip_log" >&2
        say "pip install $* failed" >&2
        exit 1
    fi
}

say "installing $TORCH, the CPU wheel from this machine's disk (no index)"
run_pip --no-index --no-deps "$TORCH"
say "installing $TORCH's own dependencies"
run_pip -c "$constraints" "$TORCH"
if ! "$venv/bin/python" -W ignore -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
    say "torch in $venv is a CUDA build; expected the CPU wheel" >&2
    exit 1
fi

say "installing $SGLANG without its dependencies"
run_pip --no-deps "$SGLANG"

say "installing the harness's dependencies: ${DEPS[*]}"
run_pip -c "$constraints" "${DEPS[@]}"

# kvpool's client and its SGLang plugin (the entry point in group sglang.srt.platforms),
# editable from this checkout; its base dependencies pinned as pyproject.toml pins them.
KVPOOL_DEPS=("grpcio==1.85.1" "grpcio-health-checking==1.85.1" "protobuf>=7.35.1,<8" rich)
say "installing kvpool (editable, the client and the SGLang plugin) from $repo"
run_pip -c "$constraints" "${KVPOOL_DEPS[@]}"
run_pip --no-deps -e "$repo"

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

printf '%s' "$want" >"$marker"
say "ready in $((SECONDS - start)) s: $venv"
