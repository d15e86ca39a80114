"""Is the harness sharp? Plant each fault of :mod:`faults` in a copy of the code, run the CPU tests that must catch it
(time-capped), and report which tests did. Not part of CI (``.ci/run``): it runs the suite once per fault.

    python tests/mutations/run.py                      # baseline + every fault, table on stdout
    python tests/mutations/run.py --only rank0-slicing --no-baseline --json out.json

Each fault gets a fresh temporary directory holding copies of ``src``, ``tests``, ``conftest.py`` and
``pyproject.toml`` (and of the installed ``vllm_gguf_plugin`` when the fault is in the plugin), first on
``PYTHONPATH``; the working tree of the repository is never written. A fault in a module that the checkpoint
cache digest covers (:data:`glm5serve.cache._SOURCES`) runs with a private ``GLM5SERVE_CACHE``, so the mutant's
checkpoints never land in the user cache. The baseline runs every listed test on an unpatched copy: a test that
fails there catches nothing. Exit status 0 only when every fault is caught by at least one test.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import FAULTS, Fault  # noqa: E402

COPIED = ("src", "tests", "conftest.py", "pyproject.toml")
DIGEST_MODULES = ("checkpoint", "tokenizer", "_corpus", "schema", "config", "quantize")  # glm5serve.cache._SOURCES
# pytest -v: "NODEID OUTCOME [(reason)] [ NN%]"; a parametrized id may hold spaces (a regex parameter)
OUTCOME = re.compile(r"^(\S+::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \(.*\))?(?:\s+\[\s*\d+%\])?\s*$",
                     re.M)
COLLECTION_ERROR = re.compile(r"^ERROR (\S+?)(?: - |$)", re.M)


def _ignore(_dir, names):
    return [n for n in names if n == "__pycache__" or n.endswith((".egg-info", ".pyc"))]


def make_copy(fault: Fault | None) -> tuple[Path, dict[str, str]]:
    """A temporary copy of the repository (and of the plugin if ``fault`` is in it) with ``fault`` applied, and
    the environment to run pytest there. Raises ValueError when an edit's ``old`` text is not found exactly once."""
    tmp = Path(tempfile.mkdtemp(prefix=f"glm5serve-mutant-{fault.name if fault else 'baseline'}-"))
    for name in COPIED:
        src = ROOT / name
        (shutil.copytree(src, tmp / name, ignore=_ignore) if src.is_dir() else shutil.copy2(src, tmp / name))
    pythonpath = [str(tmp / "src")]
    env = {**os.environ, "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    if fault is not None:
        if fault.path.startswith("plugin:"):
            import vllm_gguf_plugin

            shutil.copytree(Path(vllm_gguf_plugin.__file__).parent, tmp / "site" / "vllm_gguf_plugin", ignore=_ignore)
            target = tmp / "site" / "vllm_gguf_plugin" / fault.path.removeprefix("plugin:")
            pythonpath.insert(0, str(tmp / "site"))
        else:
            target = tmp / fault.path
        text = target.read_text()
        for old, new in fault.edits:
            if text.count(old) != 1:
                raise ValueError(f"{fault.name}: {old!r} occurs {text.count(old)} times in {fault.path}: stale fault")
            text = text.replace(old, new)
        target.write_text(text)
        if Path(fault.path).stem in DIGEST_MODULES and fault.path.startswith("src/glm5serve/"):
            env["GLM5SERVE_CACHE"] = str(tmp / "cache")
    env["PYTHONPATH"] = os.pathsep.join(pythonpath + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return tmp, env


def run_tests(tmp: Path, env: dict[str, str], tests: tuple[str, ...], timeout: float) -> dict:
    """Run ``tests`` with pytest in ``tmp``; per-test outcomes, collection errors, time, and whether it timed out."""
    cmd = [sys.executable, "-m", "pytest", *tests, "-v", "--tb=no", "-p", "no:cacheprovider", "-o", "addopts="]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        out, timed_out = proc.stdout + proc.stderr, False
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        timed_out = True
    outcomes = {m[1]: m[2] for m in OUTCOME.finditer(out)}
    return {"outcomes": outcomes, "collection_errors": sorted(set(COLLECTION_ERROR.findall(out)) - set(outcomes)),
            "seconds": round(time.monotonic() - t0, 1), "timed_out": timed_out, "tail": out[-3000:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="fault names (default: all)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per fault (default 600)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unpatched run")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = ap.parse_args(argv)
    faults = [f for f in FAULTS if not args.only or f.name in args.only]
    if args.only and len(faults) != len(args.only):
        ap.error(f"unknown fault(s): {sorted(set(args.only) - {f.name for f in FAULTS})}")
    results: dict = {}
    dead: set[str] = set()
    if not args.no_baseline:
        tests = tuple(dict.fromkeys(t for f in faults for t in f.tests))
        tmp, env = make_copy(None)
        base = run_tests(tmp, env, tests, args.timeout * 2)
        dead = {t for t, o in base["outcomes"].items() if o in ("FAILED", "ERROR")} | set(base["collection_errors"])
        results["(baseline)"] = base
        print(f"baseline: {len(base['outcomes'])} tests in {base['seconds']} s, failing unpatched: "
              f"{sorted(dead) or 'none'}{' (TIMED OUT)' if base['timed_out'] else ''}", flush=True)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    rows, missed = [], []
    for f in faults:
        tmp, env = make_copy(f)
        r = run_tests(tmp, env, f.tests, args.timeout)
        caught = sorted(t for t, o in r["outcomes"].items() if o in ("FAILED", "ERROR") and t not in dead)
        if r["collection_errors"]:
            status = "BROKEN (collection error: " + ", ".join(r["collection_errors"]) + ")"
        elif caught:
            status = "caught"
        else:
            status = "TIMED OUT, not caught" if r["timed_out"] else "MISSED"
        if status != "caught":
            missed.append(f.name)
        r.update(fault=f.name, bug_class=f.bug_class, what=f.what, caught_by=caught, status=status)
        results[f.name] = r
        rows.append(r)
        print(f"{f.name}: {status} in {r['seconds']} s by {len(caught)} of {len(r['outcomes'])} tests", flush=True)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n| fault | class | planted | status | s | caught by |\n|---|---|---|---|---|---|")
    for r in rows:
        by = "<br>".join(re.sub(r"^tests/", "", t) for t in r["caught_by"]) or "-"
        print(f"| {r['fault']} | {r['bug_class']} | {r['what']} | {r['status']} | {r['seconds']} | {by} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if missed:
        print(f"\nnot caught: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
