# What tests/sglang/setup_venv.sh and tests/vllm/setup_venv.sh share (sourced, not run): the
# marker check, a fresh venv, pip with a log shown on failure, the CPU torch (a local wheel,
# else PyTorch's CPU wheel index: tests/torch_wheel.py), kvpool's client editable from the
# checkout, and the marker at the end.
#
# The sourcing script sets, before calling these: venv (its path), python (the interpreter
# that makes it), marker (the file recording a finished setup), want (the exact package list
# that marker records), repo (the checkout), TORCH (the torch requirement). set -euo pipefail
# is the caller's. The caller passes its own arguments to venv_begin: --reuse (what the
# examples pass) also takes a finished venv of the same package list made from another
# checkout (CI's, or a shared one) as it is; the caller puts its own client/ on PYTHONPATH.

say() { printf 'setup_venv: %s\n' "$*"; }

# Exits 0 when the marker records this exact setup (with --reuse: this package list, from any
# checkout); else removes an unfinished or outdated venv (never a directory that is not one)
# and makes a fresh one, with run_pip ready.
venv_begin() {
    local have=""
    [[ -f "$marker" ]] && have="$(cat "$marker")"
    if [[ -n "$have" && "$have" == "$want" ]]; then
        say "$venv is ready (marker $marker); nothing to do"
        exit 0
    fi
    if [[ "${1:-}" == --reuse && -n "$have" && "${have% kvpool-editable:*}" == "${want% kvpool-editable:*}" ]]; then
        say "$venv is ready (made from the checkout at ${have##* kvpool-editable:}); used as it is"
        exit 0
    fi
    if [[ -n "${1:-}" && "$1" != --reuse ]]; then
        say "unknown argument $1 (the only one is --reuse)" >&2
        exit 2
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
    # pip's own chatter (resolver warnings about the engine's GPU dependencies, left out on
    # purpose) goes to a log that is shown when a step fails.
    pip_log="$venv/pip.log"
    # Ctrl-C (or a TERM) from here on: one line with the log's path, not pip's whole log; the
    # venv has no marker, so the next run removes it and starts again.
    trap venv_interrupted INT TERM
}

venv_interrupted() {
    trap - INT TERM
    say "interrupted; $venv is unfinished (the next run makes it again); pip's log: $pip_log" >&2
    exit 130
}

# pip install, its chatter into the log; on failure the log's last lines and its path.
run_pip() {
    if ! "${install[@]}" --quiet "$@" 2>>"$pip_log"; then
        tail -n 25 "$pip_log" >&2
        say "pip install $* failed (the last lines of its log above; all of it: $pip_log)" >&2
        exit 1
    fi
}

# The CPU torch first, from the source tests/torch_wheel.py picks (a local wheel: the one
# $KVPOOL_TORCH_WHEEL names or one in pip's find-links; else PyTorch's CPU wheel index; else
# it stops with one line saying what to download), then torch's own dependencies under the
# constraint that keeps every later step from replacing it with a CUDA build.
venv_torch() {
    local choice source
    if ! choice="$("$venv/bin/python" "$repo/tests/torch_wheel.py" "$TORCH" 2>"$venv/torch.err")"; then
        say "$(cat "$venv/torch.err")" >&2
        exit 1
    fi
    mapfile -t source <<<"$choice"
    say "installing ${source[0]}"
    run_pip "${source[@]:1}"
    say "installing $TORCH's own dependencies"
    run_pip -c "$constraints" "$TORCH"
    if ! "$venv/bin/python" -W ignore -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
        say "torch in $venv is a CUDA build; expected the CPU wheel" >&2
        exit 1
    fi
}

# kvpool's client (and its engine plugins' entry points), editable from this checkout; its base
# dependencies pinned as pyproject.toml pins them. $1: what to call it in the log line.
venv_kvpool() {
    local deps=("grpcio==1.85.1" "grpcio-health-checking==1.85.1" "protobuf>=7.35.1,<8" rich)
    say "installing kvpool (editable, $1) from $repo"
    run_pip -c "$constraints" "${deps[@]}"
    run_pip --no-deps -e "$repo"
}

# The marker: this exact setup is finished.
venv_done() {
    printf '%s' "$want" >"$marker"
    say "ready in $((SECONDS - start)) s: $venv"
}
