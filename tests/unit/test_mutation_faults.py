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
