#!/usr/bin/env bash
# Two models on one device, on CPU: a kvpool daemon, two real SGLang 0.5.23 engines with the
# kvpool plugin on elastic pools (two tiny random Llamas of different layouts), a shifting load
# (engine a bursts, then engine b, then both), and `kvpool top` halfway through each phase
# showing the memory move between them. Then the figures of the run.
#
# Usage, from anywhere:  examples/two_models/run.sh [--modes arbiter] [--plot out.png]
# It makes the two virtualenvs first if they are missing (as examples/sglang_cpu/run.sh does):
# the daemon's .venv and SGLang's side venv .venv-sglang (tests/sglang/setup_venv.sh).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${KVPOOL_VENV:-$repo/.venv}"
side="${KVPOOL_SGLANG_VENV:-$repo/.venv-sglang}"
say() { printf '\n[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }

say "1/3 the daemon's venv ($venv)"
. "$repo/examples/main_venv.sh"
main_venv "$venv" "$repo"
# The ready marker decides, not bin/python: an interrupted first run leaves a venv without
# its packages, which setup_venv.sh removes and makes again (about 3 minutes); a finished one
# (from this checkout or another) is used as it is.
say "2/3 SGLang's side venv ($side)"
KVPOOL_SGLANG_VENV="$side" bash "$repo/tests/sglang/setup_venv.sh" --reuse
say "3/3 a daemon, two engines on elastic pools, a shifting load (about 2 minutes)"
cd "$repo"
KVPOOL_SGLANG_VENV="$side" PYTHONPATH="$repo/client:$repo/service" \
    exec "$venv/bin/python" bench/two_models.py --quick --modes arbiter --top "$@"
