"""``_ledger.c`` under AddressSanitizer and UndefinedBehaviorSanitizer.

The extension is compiled again with ``-fsanitize=address,undefined`` into a temp dir and a
child Python (with the sanitizer runtimes preloaded) runs ``ledger_program.py`` on it: random
programs, junk ids and misuse, compared with the numpy ledger every step. Any out-of-bounds
access, overflow or other undefined behaviour aborts the child with a report. Skipped where
there is no gcc or no sanitizer runtime (CI has both).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "service" / "kvpoold" / "alloc" / "_ledger.c"
PROGRAM = Path(__file__).with_name("ledger_program.py")


def _runtime(gcc: str, name: str) -> str | None:
    out = subprocess.run([gcc, f"-print-file-name={name}"], capture_output=True, text=True,
                         check=False).stdout.strip()
    return out if out and os.path.isabs(out) and os.path.exists(out) else None


GCC = shutil.which("gcc")
ASAN = _runtime(GCC, "libasan.so") if GCC else None
UBSAN = _runtime(GCC, "libubsan.so") if GCC else None


@pytest.mark.skipif(not (GCC and ASAN and UBSAN), reason="needs gcc with ASan and UBSan")
def test_ledger_program_runs_clean_under_asan_and_ubsan(tmp_path: Path) -> None:
    assert GCC and ASAN and UBSAN
    built = tmp_path / "_ledger.so"
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [GCC, "-O1", "-g", "-std=c11", "-fsanitize=address,undefined",
         "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-fPIC", "-shared",
         f"-I{include}", str(SOURCE), "-o", str(built)],
        check=True, capture_output=True, text=True, timeout=120,
    )
    env = {
        **os.environ,
        "LD_PRELOAD": f"{ASAN}:{UBSAN}",
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        "PYTHONMALLOC": "malloc",  # so ASan sees numpy's and Python's heap blocks too
    }
    out = subprocess.run(
        [sys.executable, str(PROGRAM), "--module", str(built), "--seeds", "11", "12", "13", "14",
         "--steps", "2000"],
        env=env, capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-4000:]
    assert "AddressSanitizer" not in report and "runtime error" not in report, report[-4000:]
    assert report.count("C and numpy agree") == 4
