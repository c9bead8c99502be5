"""The numbers the docs quote about the tree (the wheel's file count, the differential tests'
case counts, the architecture table's rows) are the ones the tree has: a doc that says "88
cases" while the test runs 93 fails here, not in a reader's hands."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO

# What pip wheel adds beside the packages' files: METADATA, WHEEL, RECORD, entry_points.txt,
# top_level.txt (tests/e2e/test_wheel.py counts a built wheel's files against README too).
DIST_INFO_FILES = 5


def quoted(path: str, pattern: str) -> list[int]:
    """Every number ``pattern`` (one group) finds in ``path``; at least one must be there."""
    text = (REPO / path).read_text()
    found = [int(m.replace(",", "")) for m in re.findall(pattern, text)]
    assert found, f"{path} no longer says {pattern!r}: update this test with the doc"
    return found


def packaged_files() -> int:
    """Files of the two packages as the wheel takes them (modules, stubs, .pyi, py.typed,
    data), as tests/e2e/test_wheel.py's ``packaged_sources`` counts them."""
    count = 0
    for root in (REPO / "client", REPO / "service"):
        for path in root.rglob("*"):
            parts = path.relative_to(root).parts
            if (path.is_file() and "__pycache__" not in parts and path.suffix != ".pyc"
                    and not parts[0].endswith(".egg-info")):
                count += 1
    return count


def test_readme_wheel_file_count() -> None:
    assert quoted("README.md", r"makes the same ([\d,]+) files") == [
        packaged_files() + DIST_INFO_FILES]


def test_vllm_parity_case_counts() -> None:
    from tests.integration.test_vllm_parity import CASES

    assert quoted("tests/vllm/README.md", r"the ([\d,]+) cases of the parity test") == [len(CASES)]
    assert quoted("docs/vllm.md", r"every case vLLM sizes \(([\d,]+) cases") == [len(CASES)]


def test_sglang_parity_case_count() -> None:
    from tests.integration.test_sglang_parity import CASES

    assert quoted("docs/sizing.md", r"differential test generates ([\d,]+) cases") == [len(CASES)]


def test_architecture_table_rows() -> None:
    table = json.loads((REPO / "service/kvpoold/sizing/sglang_architectures.json").read_text())
    rows = len(table["rows"])
    assert quoted("docs/sizing.md", r"sglang/srt/models/\*\.py`: ([\d,]+) classes") == [rows]
    assert quoted("README.md", r"SGLang's model registry\s+\(([\d,]+),") == [rows]


@pytest.mark.parametrize("doc", ["README.md", "docs/elastic.md", "docs/sharing.md"])
def test_no_doc_installs_kvpool_from_an_index(doc: str) -> None:
    """kvpool is on no package index: its extras install from a clone (``-e ".[cuda]"``)."""
    assert not re.search(r"pip install '?kvpool\[", (REPO / doc).read_text())
