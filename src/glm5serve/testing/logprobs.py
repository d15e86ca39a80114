"""Rules for comparing two greedy generations that carry per-step top-k logprobs (vLLM against the reference
engine, CUDA graphs against eager, TP=2 against TP=1).

A generation is ``(tokens, logprobs)``: ``tokens`` a list of ids, ``logprobs[i]`` a ``{token_id: logprob}`` dict
for step ``i`` holding at least the chosen token and the top-k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

Step = Mapping[int, float]


def _norm(step: Mapping) -> dict[int, float]:
    return {int(t): float(lp) for t, lp in step.items()}


@dataclass
class Agreement:
    """How two generations of one prompt agree: ``first_diff`` is the first step whose tokens differ (None if
    all agree), ``max_gap`` the largest |logprob difference| of the chosen token over the agreeing prefix
    (both sides must report it), ``ok`` whether the comparison rule held, ``why`` what broke it."""

    n: int
    first_diff: int | None
    max_gap: float
    ok: bool
    why: str = ""


def _gap(a: Step, b: Step, tok: int) -> float:
    return abs(a[tok] - b[tok]) if tok in a and tok in b else 0.0


def top_k_rule(tokens_a: Sequence[int], lps_a: Sequence[Step], tokens_b: Sequence[int], lps_b: Sequence[Step],
               k: int = 5) -> Agreement:
    """vLLM's ``check_logprobs_close`` rule (``tests/models/utils.py``): tokens may differ, but at the first step where
    they do, each side's token must be among the other side's top-``k``; the rest is not compared (the
    continuations diverge from there)."""
    n = min(len(tokens_a), len(tokens_b))
    gap = 0.0
    for i in range(n):
        a, b = _norm(lps_a[i]), _norm(lps_b[i])
        ta, tb = int(tokens_a[i]), int(tokens_b[i])
        if ta == tb:
            gap = max(gap, _gap(a, b, ta))
            continue
        top_a = sorted(a, key=a.get, reverse=True)[:k]
        top_b = sorted(b, key=b.get, reverse=True)[:k]
        ok = ta in top_b and tb in top_a
        return Agreement(n, i, gap, ok, "" if ok else f"step {i}: token {ta} vs {tb} not in each other's top-{k}")
    return Agreement(n, None, gap, True)


def margin(step: Step) -> float:
    """Top-1 minus top-2 logprob of one step (inf if only one token is reported)."""
    lps = sorted((float(v) for v in step.values()), reverse=True)
    return lps[0] - lps[1] if len(lps) > 1 else float("inf")


def tolerance_rule(tokens_a: Sequence[int], lps_a: Sequence[Step], tokens_b: Sequence[int], lps_b: Sequence[Step],
                   tol: float) -> Agreement:
    """Chosen-token logprobs agree within ``tol`` while tokens agree, and tokens must agree wherever side ``b``'s
    (the baseline's) top-1 margin exceeds ``2·tol`` — a change of at most ``tol`` in each of two logprobs cannot
    flip such a step. A divergence at a step with a smaller margin is allowed and ends the comparison."""
    n = min(len(tokens_a), len(tokens_b))
    gap = 0.0
    for i in range(n):
        a, b = _norm(lps_a[i]), _norm(lps_b[i])
        ta, tb = int(tokens_a[i]), int(tokens_b[i])
        if ta != tb:
            m = margin(b)
            ok = m <= 2 * tol
            return Agreement(n, i, gap, ok, "" if ok else f"step {i}: token {ta} vs {tb} with baseline margin {m:.4f}")
        g = _gap(a, b, ta)
        gap = max(gap, g)
        if g > tol:
            return Agreement(n, None, gap, False, f"step {i}: chosen-token logprob gap {g:.4g} > {tol}")
    return Agreement(n, None, gap, True)


def bit_identical(tokens_a: Sequence[int], lps_a: Sequence[Step], tokens_b: Sequence[int], lps_b: Sequence[Step]
                  ) -> Agreement:
    """Same tokens and exactly the same top-k logprob dicts at every step."""
    n = min(len(tokens_a), len(tokens_b))
    if len(tokens_a) != len(tokens_b):
        return Agreement(n, n, 0.0, False, f"lengths {len(tokens_a)} vs {len(tokens_b)}")
    gap = 0.0
    for i in range(n):
        a, b = _norm(lps_a[i]), _norm(lps_b[i])
        if int(tokens_a[i]) != int(tokens_b[i]):
            return Agreement(n, i, gap, False, f"step {i}: token {tokens_a[i]} vs {tokens_b[i]}")
        if a != b:
            common = set(a) & set(b)
            gap = max([gap, *(abs(a[t] - b[t]) for t in common)])
            return Agreement(n, None, gap, False, f"step {i}: logprobs differ (max gap {gap:.3g})")
    return Agreement(n, None, 0.0, True)
