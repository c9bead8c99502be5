#!/usr/bin/env bash
# SGLang 0.5.23 on CPU with its KV cache in a kvpool daemon, in one command:
#
#   examples/sglang_cpu/run.sh            # from the repository root of a clone; no GPU needed
#
# 1. makes (once) the two virtualenvs: the daemon's (.venv, as the README's first command makes
#    it: CPU torch 2.13.0 and kvpool[server]) and the side virtualenv SGLang runs in (CPU torch,
#    sglang==0.5.23 without its GPU-only dependencies, kvpool editable from this checkout:
#    tests/sglang/setup_venv.sh); ~3 minutes the first time, nothing after;
# 2. writes a tiny random Llama (2 layers, vocab 256, float32) into a temporary directory;
# 3. starts `kvpoold serve` on a Unix socket there;
# 4. starts SGLang's HTTP server (python -m sglang.launch_server) with kvpool's platform plugin
#    (SGLANG_PLATFORM=kvpool KVPOOL_POOL=tiny): SGLang's scheduler configures the pool in the
#    daemon, maps its memory and takes its pages from a lease;
# 5. sends two /generate requests over HTTP (token ids: the tiny model has no tokenizer);
# 6. prints `kvpool stats` and `kvpool leases`, stops the server and shows the pages back (the
#    sealed ones kept by the pool's directory: `kvpool sealed tiny`).
#
# Environment: KVPOOL_VENV (the daemon's venv, default <repo>/.venv), KVPOOL_SGLANG_VENV (the
# side venv, default <repo>/.venv-sglang; a finished one made from another checkout is used as
# it is, with this checkout's plugin), PORT (SGLang's HTTP port, default a free one), KEEP=1
# (keep the temporary directory and its logs).
# Exits non-zero, with the last lines of the failing log, when any step fails.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${KVPOOL_SGLANG_VENV:-$repo/.venv-sglang}"
main="${KVPOOL_VENV:-$repo/.venv}"
export KVPOOL_SGLANG_VENV="$venv"
harness="$repo/tests/sglang"
py="$venv/bin/python"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvpool-sglang-cpu.XXXXXX")"
sock="$work/kvpool.sock"
target="unix://$sock"
export KVPOOL_TARGET="$target"  # the kvpool CLI and the plugin find the daemon here
daemon_pid="" server_pid=""

step="" in_setup=0
say() { step="${1%% *}"; printf '\n== %s\n' "$*"; }
fail() {
    printf 'sglang_cpu: %s\n' "$1" >&2
    [[ -n "${2:-}" && -f "$2" ]] && { printf -- '--- last lines of %s:\n' "$2" >&2; tail -n 30 "$2" >&2; }
    exit 1
}
cleanup() {
    [[ -n "$server_pid" ]] && kill -TERM -- "-$server_pid" 2>/dev/null || true
    [[ -n "$daemon_pid" ]] && kill -TERM "$daemon_pid" 2>/dev/null || true
    wait 2>/dev/null || true
    if [[ "${KEEP:-0}" == 1 ]]; then echo "kept $work"; else rm -rf "$work"; fi
}
interrupted() {
    trap - INT TERM
    # While the side venv is made, setup_venv.sh says itself what it left (one line).
    (( in_setup )) || printf 'sglang_cpu: interrupted at step %s; stopping what it started\n' \
        "${step:-0/6}" >&2
    exit 130
}
trap cleanup EXIT
trap interrupted INT TERM

say "1/6 the daemon's venv ($main) and SGLang's side venv ($venv)"
. "$repo/examples/main_venv.sh"
main_venv "$main" "$repo"
# Does nothing when the side venv's ready marker is there (a finished one made from another
# checkout is used as it is: the plugin still comes from this checkout, PYTHONPATH below);
# repairs an unfinished one (an interrupted first run).
in_setup=1
"$harness/setup_venv.sh" --reuse
in_setup=0

say "2/6 a tiny random Llama in $work/model"
PYTHONPATH="$harness/stubs" "$py" "$harness/engine_run.py" make-model "$work/model" \
    || fail "could not write the tiny model"

say "3/6 kvpoold serve on $target"
"$main/bin/kvpoold" serve --listen "$target" --budget 256MiB --log-level warning \
    >"$work/kvpoold.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 1 100); do
    [[ -S "$sock" ]] && "$main/bin/kvpool" stats >/dev/null 2>&1 && break
    kill -0 "$daemon_pid" 2>/dev/null || fail "kvpoold exited" "$work/kvpoold.log"
    sleep 0.2
done
"$main/bin/kvpool" stats >/dev/null || fail "kvpoold is not answering" "$work/kvpoold.log"
echo "kvpoold is serving (pid $daemon_pid)"

port="${PORT:-$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
say "4/6 SGLang's HTTP server on 127.0.0.1:$port with the kvpool plugin (pool 'tiny')"
# The flags are SGLang's CPU path: the torch-native attention backend and sampler, no CUDA
# graphs, no grammar backend, no tokenizer (the tiny model has none), float32 like the model;
# a small pool (512 tokens in pages of 4) so it starts in seconds.
(
    export SGLANG_PLATFORM=kvpool KVPOOL_POOL=tiny KVPOOL_TARGET="$target" \
        PYTHONPATH="$harness/stubs:$repo/client" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
    unset VIRTUAL_ENV
    exec setsid "$py" "$harness/engine_run.py" serve --model-path "$work/model" \
        --host 127.0.0.1 --port "$port" --device cpu --attention-backend torch_native \
        --skip-tokenizer-init --disable-cuda-graph --dtype float32 --sampling-backend pytorch \
        --grammar-backend none --disable-overlap-schedule --page-size 4 \
        --max-total-tokens 512 --mem-fraction-static 0.05 --random-seed 0 --log-level warning
) >"$work/sglang.log" 2>&1 &
server_pid=$!
start=$SECONDS
until curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; do
    kill -0 "$server_pid" 2>/dev/null || fail "the SGLang server exited" "$work/sglang.log"
    (( SECONDS - start > 600 )) && fail "the SGLang server did not come up in 600 s" "$work/sglang.log"
    (( (SECONDS - start) % 10 == 0 )) && echo "  waiting for the server ($((SECONDS - start)) s)"
    sleep 1
done
echo "the server is up after $((SECONDS - start)) s"

say "5/6 two requests over HTTP (greedy, 8 new tokens each)"
for ids in "[1, 2, 3, 4, 5]" "[9, 8, 7, 6, 5, 4, 3, 2, 1]"; do
    body='{"input_ids": '"$ids"', "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": true}}'
    out="$(curl -sf -H 'Content-Type: application/json' -d "$body" "http://127.0.0.1:$port/generate")" \
        || fail "POST /generate failed" "$work/sglang.log"
    "$py" -c 'import json, sys; r = json.loads(sys.argv[2]); print("prompt", sys.argv[1], "-> output_ids", r["output_ids"])' "$ids" "$out"
done

say "6/6 what the daemon holds: the pool SGLang configured, and its scheduler's lease"
"$main/bin/kvpool" stats
"$main/bin/kvpool" leases

echo
echo "stopping the SGLang server: its lease ends and its pages go back to the pool (its radix"
echo "cache's full pages, sealed, stay in the pool's directory for the next server: docs/restart.md)"
kill -TERM -- "-$server_pid" 2>/dev/null || true
wait "$server_pid" 2>/dev/null || true
server_pid=""
for _ in $(seq 1 60); do
    [[ "$("$main/bin/kvpool" leases)" == "no open leases" ]] && break
    sleep 0.5
done
"$main/bin/kvpool" leases
"$main/bin/kvpool" stats --pool tiny
"$main/bin/kvpool" sealed tiny
echo
echo "done: SGLang served from kvpool memory on CPU"
