"""The planted faults of ``tests/mutations`` still apply to the code: every edit's ``old`` text occurs exactly once
in its file and every listed test file exists. The fault-injection run is not part of CI (about 10 minutes), so
without this check a refactor silently turns a fault stale (it did once: ``scaling-never-config`` after the
config's metadata type checks)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "mutations"))
from faults import FAULTS  # noqa: E402


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_fault_applies_to_the_current_code(fault):
    if fault.path.startswith("plugin:"):
        plugin = pytest.importorskip("vllm_gguf_plugin")
        target = Path(plugin.__file__).parent / fault.path.removeprefix("plugin:")
    else:
        target = ROOT / fault.path
    text = target.read_text()
    for old, _ in fault.edits:
        assert text.count(old) == 1, f"{fault.name}: {old!r} occurs {text.count(old)} times in {fault.path}"
    for node in fault.tests:
        assert (ROOT / node.split("::")[0]).is_file(), f"{fault.name}: no test file {node}"


def test_outcomes_are_read_for_parametrized_ids_with_spaces():
    """run.py reads each test's outcome from ``pytest -v``; an id holding spaces (a regex parameter such as
    ``RoPE scaling \\(linear\\)``) was not matched, so a fault caught only by such a test was reported MISSED."""
    from run import OUTCOME

    out = ("tests/unit/t.py::test_a[keys2-glm-dsa\\.rope\\.scale_linear=2: RoPE scaling \\(linear\\)] FAILED [ 60%]\n"
           "tests/unit/t.py::test_b[x] PASSED [ 80%]\n"
           "tests/unit/t.py::test_c SKIPPED (no GPU) [100%]\n"
           "FAILED tests/unit/t.py::test_a[keys2-glm-dsa\\.rope\\.scale_linear=2: RoPE scaling \\(linear\\)]\n")
    assert {m[1]: m[2] for m in OUTCOME.finditer(out)} == {
        "tests/unit/t.py::test_a[keys2-glm-dsa\\.rope\\.scale_linear=2: RoPE scaling \\(linear\\)]": "FAILED",
        "tests/unit/t.py::test_b[x]": "PASSED", "tests/unit/t.py::test_c": "SKIPPED"}
