"""Speed of the static harness and of building the embedded default (targets: ``glm5serve verify`` takes seconds
on the tiny checkpoint; make-checkpoint writes tiny in a few seconds).

Run: ``pytest tests/unit/test_bench_verify.py --benchmark-only``.
"""
from __future__ import annotations

from glm5serve.checkpoint import make_checkpoint
from glm5serve.verify import verify


def test_bench_verify_tiny(benchmark, tiny_checkpoint):
    results = benchmark.pedantic(verify, args=(tiny_checkpoint, 4), rounds=3, iterations=1, warmup_rounds=1)
    assert all(c.ok for c in results)


def test_bench_make_tiny_ud(benchmark, tmp_path):
    path = benchmark.pedantic(make_checkpoint, args=(tmp_path, "tiny", "ud-q4_k_xl"), rounds=2, iterations=1)
    assert path.stat().st_size > 1 << 20
