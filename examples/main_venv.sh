# The daemon's virtualenv the examples run kvpoold and the kvpool CLI from, made once (sourced by
# examples/*/run.sh). `main_venv VENV REPO`: nothing when VENV already imports torch, kvpool and
# the daemon; else (a fresh machine, or a first run interrupted halfway) it installs into it, as
# the README's first command does: the CPU torch 2.13.0 tests/torch_wheel.py picks (a local CPU
# wheel, else PyTorch's CPU index, else it stops with one line saying what to download; never a
# CUDA build), then kvpool[server] from this checkout. pip is idempotent: a half-made venv is
# finished, never thrown away.
main_venv() {
    local main="$1" repo="$2"
    if [[ -x "$main/bin/kvpoold" ]] &&
        "$main/bin/python" -c "import torch, kvpool, kvpoold.main" >/dev/null 2>&1; then
        return 0
    fi
    echo "making $main (CPU torch 2.13.0, kvpool[server] from this checkout)"
    [[ -x "$main/bin/python" ]] || python3 -m venv "$main"
    "$main/bin/python" "$repo/tests/torch_wheel.py" --install torch==2.13.0
    "$main/bin/pip" install -q -c "$repo/.ci/constraints.txt" -e "$repo[server]"
}
