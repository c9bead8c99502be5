#!/usr/bin/env bash
# Run the GPU tests (tests/gpu: CUDA IPC, and CUDA VMM for elastic pools) on a GPU machine, from
# the repository root or anywhere.
#
# Needs a CUDA build of torch already installed: it cannot be downloaded here (device machines
# are offline, and torch's CUDA wheels come from their own index). The other dependencies
# (grpcio, msgspec, numpy, protobuf, rich, pytest...) are installed if missing: from
# $KVPOOL_WHEELS (a directory of wheels, --no-index) when set, else from pip's default index.
# When something cannot be had, it prints "SKIPPED: <why>" and exits 0 without running.
# cuda-bindings (the elastic pools' VMM tests) is installed the same way when missing, in the
# major version of torch's CUDA; when it cannot be had, only those tests are skipped (a
# "SKIPPED: test_elastic_vmm.py ..." line, and pytest reports them skipped). SGLang 0.5.23 (the
# allocator synchronization test) likewise: the machine's own, or from $KVPOOL_WHEELS.
#
# Output: the pytest -v log on stdout, and in $OUT/gpu-tests.txt when $OUT is set.
# Exit status: pytest's (0 all passed, 1 failures), or 0 after a SKIPPED line.
set -uo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD/client:$PWD/service${PYTHONPATH:+:$PYTHONPATH}"
# kvpoold refuses expandable segments (their IPC handles cannot be opened elsewhere).
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF

skip() {
  echo "SKIPPED: $*"
  exit 0
}

command -v "$PYTHON" >/dev/null || skip "no $PYTHON on PATH"
"$PYTHON" - <<'EOF' || skip "torch with CUDA is not installed or sees no GPU (see above); install a CUDA build of torch 2.13 first (pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128), it cannot be fetched offline"
import sys
try:
    import torch
except ImportError:
    print("torch is not installed", file=sys.stderr)
    sys.exit(1)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} GPU(s) visible")
if torch.version.cuda is None:
    print("this torch is a CPU build", file=sys.stderr)
    sys.exit(1)
if not torch.cuda.is_available():
    print("torch.cuda.is_available() is False (driver? CUDA_VISIBLE_DEVICES?)", file=sys.stderr)
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB uuid {p.uuid}")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

DEPS=(numpy msgspec "grpcio==1.85.1" "grpcio-health-checking==1.85.1"
      "grpcio-reflection==1.85.1" "protobuf>=7.35.1,<8" rich prometheus-client
      pytest pytest-asyncio pytest-timeout)
have_deps() {
  "$PYTHON" -c "import numpy, msgspec, grpc, grpc_health, grpc_reflection, google.protobuf, \
rich, prometheus_client, pytest, pytest_asyncio, pytest_timeout" 2>/dev/null
}
if ! have_deps; then
  echo "installing the test dependencies (torch is left alone)"
  if [ -n "${KVPOOL_WHEELS:-}" ]; then
    "$PYTHON" -m pip install -q --no-index --find-links "$KVPOOL_WHEELS" "${DEPS[@]}"
  else
    "$PYTHON" -m pip install -q "${DEPS[@]}"
  fi
  have_deps || skip "cannot install ${DEPS[*]} (offline? set KVPOOL_WHEELS to a wheel directory)"
fi

have_cuda_bindings() {
  "$PYTHON" -c "from cuda.bindings import driver" 2>/dev/null
}
if ! have_cuda_bindings; then
  CUDA_MAJOR=$("$PYTHON" -c "import torch; print(torch.version.cuda.split('.')[0])")
  if [ "$CUDA_MAJOR" = "12" ]; then BINDINGS="cuda-bindings>=12.8,<13"
  else BINDINGS="cuda-bindings>=13,<14"; fi
  echo "installing $BINDINGS for the CUDA VMM tests"
  if [ -n "${KVPOOL_WHEELS:-}" ]; then
    "$PYTHON" -m pip install -q --no-index --find-links "$KVPOOL_WHEELS" "$BINDINGS"
  else
    "$PYTHON" -m pip install -q "$BINDINGS"
  fi
  have_cuda_bindings \
    || echo "SKIPPED: test_elastic_vmm.py (cannot install $BINDINGS; offline? set KVPOOL_WHEELS)"
fi

# SGLang 0.5.23 for test_sglang_sync.py (the two allocators' synchronizations): the machine's
# own install, else from $KVPOOL_WHEELS (--no-deps: its GPU stack is the machine's); without it
# only that test is skipped.
have_sglang() {
  "$PYTHON" -c "from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator" \
    2>/dev/null
}
if ! have_sglang && [ -n "${KVPOOL_WHEELS:-}" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --find-links "$KVPOOL_WHEELS" sglang==0.5.23
fi
have_sglang || echo "SKIPPED: test_sglang_sync.py (SGLang 0.5.23 is not importable; install it, \
or put its wheel in KVPOOL_WHEELS)"

LOG=/dev/null
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  LOG="$OUT/gpu-tests.txt"
fi
"$PYTHON" -m pytest tests/gpu -v -rs -p no:cacheprovider 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
