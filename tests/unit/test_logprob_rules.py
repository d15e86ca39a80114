"""The comparison rules the GPU end-to-end tests rely on must themselves be right (they run on a CPU here)."""
from glm5serve.testing.logprobs import bit_identical, margin, tolerance_rule, top_k_rule


def steps(*rows):
    return [dict(r) for r in rows]


def test_top_k_rule_accepts_swap_within_top5_and_stops_there():
    a = steps({1: -0.1, 2: -2.0}, {3: -0.2, 4: -1.0}, {9: -0.1})
    b = steps({1: -0.1, 2: -2.1}, {4: -0.3, 3: -0.4}, {8: -0.1})  # step 2 differs too: not compared
    r = top_k_rule([1, 3, 9], a, [1, 4, 8], b)
    assert r.ok and r.first_diff == 1 and abs(r.max_gap) < 1e-12


def test_top_k_rule_rejects_token_outside_other_top_k():
    a = steps({1: -0.1, 2: -2.0})
    b = steps({5: -0.1, 6: -2.0})
    r = top_k_rule([1], a, [5], b)
    assert not r.ok and r.first_diff == 0


def test_top_k_rule_measures_gap_on_agreeing_prefix():
    r = top_k_rule([1, 1], steps({1: -0.5}, {1: -0.25}), [1, 1], steps({1: -0.5}, {1: -0.5}))
    assert r.ok and r.first_diff is None and r.max_gap == 0.25


def test_tolerance_rule():
    base = steps({1: -0.01, 2: -3.0}, {3: -0.6, 4: -0.7})
    # within tolerance, then a flip at a small-margin step: allowed
    ok = tolerance_rule([1, 4], steps({1: -0.02, 2: -3.0}, {4: -0.6, 3: -0.7}), [1, 3], base, tol=0.05)
    assert ok.ok and ok.first_diff == 1 and abs(ok.max_gap - 0.01) < 1e-12
    # a flip where the baseline margin is large: not allowed
    bad = tolerance_rule([2], steps({2: -0.01, 1: -0.02}), [1], base, tol=0.05)
    assert not bad.ok and "margin" in bad.why
    # a logprob gap beyond tolerance with the same token: not allowed
    gap = tolerance_rule([1], steps({1: -0.2, 2: -3.0}), [1], base, tol=0.05)
    assert not gap.ok and gap.max_gap > 0.05
    assert margin({1: -0.1, 2: -0.6}) == 0.5


def test_bit_identical():
    a = steps({1: -0.5, 2: -1.5})
    assert bit_identical([1], a, [1], steps({1: -0.5, 2: -1.5})).ok
    r = bit_identical([1], a, [1], steps({1: -0.5, 2: -1.5000001}))
    assert not r.ok and r.max_gap > 0
    assert not bit_identical([1], a, [2], steps({2: -0.5})).ok
