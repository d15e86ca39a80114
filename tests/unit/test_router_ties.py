"""Router near-ties and single expert flips in the reference engine (``glm5serve.testing.router_ties``), the
helpers the GPU end-to-end test uses to let the fp32 reference settle a divergence between two bf16 engines."""
import pytest
import torch

from glm5serve.testing import router_ties as rt


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from glm5serve.reference import ReferenceModel

    return ReferenceModel.from_gguf(tiny_checkpoint)


IDS = [3, 141, 59, 26, 5, 358, 97, 93, 238, 46, 264, 338]


def test_margins_cover_every_moe_layer_and_position(model):
    m = rt.topk_margins(model, IDS)
    layers = rt.moe_layers(model)
    assert m.shape == (len(layers), len(IDS)) and layers and all(model.mlp_types[i] != "dense" for i in layers)
    assert bool((m >= 0).all()) and bool((m > 0).any())
    everything = rt.near_ties(model, IDS, float("inf"))
    assert len(everything) == m.numel() and [(f.pos, f.layer) for f in everything] == sorted(
        (p, layer) for layer in layers for p in range(len(IDS)))
    assert rt.near_ties(model, IDS, 0.0) == []
    tau = float(m.median())
    ties = rt.near_ties(model, IDS, tau, start=4)
    assert ties and all(f.margin < tau and f.pos >= 4 for f in ties)
    assert len(ties) == int((m[:, 4:] < tau).sum())


def test_a_flip_swaps_the_kth_expert_for_the_runner_up_at_that_position_only(model):
    layer, pos, k = rt.moe_layers(model)[0], 5, model.top_k
    x = torch.randn(len(IDS), model._p(layer, "mlp.gate.weight").shape[1], generator=torch.Generator().manual_seed(0))
    w0, ids0 = type(model).router(model, layer, x)
    w1, ids1 = rt._flipped_router(model, rt.Flip(layer, pos, 0.0))(layer, x)
    others = torch.arange(len(IDS)) != pos
    assert torch.equal(ids0[others], ids1[others]) and torch.equal(w0[others], w1[others])
    gate, bias = model._p(layer, "mlp.gate.weight"), model._p(layer, "mlp.gate.e_score_correction_bias")
    choice = torch.sigmoid(x @ gate.T) + bias
    ranking = choice[pos].argsort(descending=True)
    assert ids1[pos].tolist() == ranking[:k - 1].tolist() + [int(ranking[k])]
    if model.norm_topk_prob:
        assert float(w1[pos].sum()) == pytest.approx(model.routed_scaling_factor, rel=1e-5)
    # another layer is left alone
    other_layer = next(i for i in rt.moe_layers(model) if i != layer)
    assert torch.equal(rt._flipped_router(model, rt.Flip(layer, pos, 0.0))(other_layer, x)[1],
                       type(model).router(model, other_layer, x)[1])


def test_a_flip_changes_that_position_and_not_the_ones_before(model):
    base = rt.logprobs(model, IDS)
    flip = rt.Flip(rt.moe_layers(model)[-1], 6, 0.0)
    flipped = rt.logprobs(model, IDS, flip)
    assert flipped.shape == base.shape and base.shape[0] == len(IDS) and base.dtype == torch.float32
    torch.testing.assert_close(flipped[:6], base[:6], atol=1e-5, rtol=0)  # causal: earlier positions unchanged
    assert float((flipped[6] - base[6]).abs().max()) > 1e-3
    assert "router" not in vars(model)  # the stand-in router is removed again


def test_last_step_under_flips_lists_the_unflipped_step_then_the_nearest_ties(model):
    tau = float(rt.topk_margins(model, IDS).quantile(0.3))
    entries = rt.last_step_under_flips(model, IDS, tau, max_flips=3)
    ties = rt.near_ties(model, IDS, tau)
    assert [f for f, _ in entries] == [None] + ties[-3:]
    torch.testing.assert_close(entries[0][1], rt.logprobs(model, IDS)[-1], atol=0, rtol=0)
    torch.testing.assert_close(entries[1][1], rt.logprobs(model, IDS, ties[-3])[-1], atol=0, rtol=0)
    assert [f for f, _ in rt.last_step_under_flips(model, IDS, tau, max_flips=0)] == [None]


def test_bf16_flip_range(model, tiny_checkpoint):
    from glm5serve.reference import ReferenceModel

    assert rt.bf16_flip_range(model, model, [IDS, IDS[:5]]) == 0.0  # the same model never routes differently
    bf16 = ReferenceModel.from_gguf(tiny_checkpoint, dtype=torch.bfloat16)
    r = rt.bf16_flip_range(model, bf16, [IDS])
    assert 0.0 <= r < float(rt.topk_margins(model, IDS).max())  # rounding does not flip the clearest choice


def test_grouped_routers_are_refused(model):
    assert model.n_group == 1
    model.n_group = 2
    try:
        with pytest.raises(ValueError, match="single-group routers only, not n_group=2"):
            rt.logprobs(model, IDS, rt.Flip(rt.moe_layers(model)[0], 0, 0.0))
    finally:
        model.n_group = 1


def _top5(lp: torch.Tensor) -> dict[int, float]:
    v, i = lp.topk(5)
    return dict(zip(i.tolist(), v.tolist()))


SEQ = [292, 87, 70, 472, 88, 396, 314, 193, 486, 39, 87, 174]  # the tiny model: some flips change its next token


def test_settles_a_divergence_that_one_flip_reproduces_and_no_other(model):
    """Two stand-in engines: the reference itself, and the reference with one near-tie flipped. The reference
    settles the pair with that flip available, and not without any flip; an engine further off than any single
    flip moves the reference is never settled."""
    entries = rt.last_step_under_flips(model, SEQ, 1.0, max_flips=100)
    lp0, a0 = entries[0][1], int(entries[0][1].argmax())
    token_flip = next((f, lp) for f, lp in entries[1:] if int(lp.argmax()) != a0)
    same_token = max(((f, lp) for f, lp in entries[1:] if int(lp.argmax()) == a0),
                     key=lambda e: abs(float(e[1][a0] - lp0[a0])))
    moved = abs(float(same_token[1][a0] - lp0[a0]))
    assert moved > 0.2, moved
    for (flip, lp), tol in ((token_flip, 0.05), (same_token, moved / 4)):
        args = (model, SEQ, _top5(lp0), a0, _top5(lp), int(lp.argmax()), tol)
        ok, how = rt.settles(*args, tau=flip.margin * 1.001, max_flips=100)
        assert ok and f"a flip in layer {flip.layer} at position {flip.pos}" in how, how
        ok, how = rt.settles(*args, tau=flip.margin * 1.001, max_flips=0)
        assert not ok and "not settled" in how and "(0 near-ties" in how, how
    far = _top5(lp0)
    far[a0] -= 100.0
    assert max(abs(float(lp[a0] - lp0[a0])) for _, lp in entries) < 99  # so no single flip reaches that far
    assert not rt.settles(model, SEQ, _top5(lp0), a0, far, a0, 0.25, tau=1.0, max_flips=100)[0]


def _on_grid(x: torch.Tensor, block: int) -> bool:
    """Whether every block of x (..., K) is d * integers with d = max|x| / 127, as round_activations leaves it."""
    b = x.double().reshape(*x.shape[:-1], -1, block)
    d = b.abs().amax(-1, keepdim=True) / 127
    u = b / torch.where(d > 0, d, 1)
    return bool(((u - u.round()).abs() < 1e-3).all())


def test_int8_activations_round_the_kernel_linears_only_and_restore(model, monkeypatch):
    """Over a whole forward inside ``int8_activations``, every named weight's linear sees inputs on the int8 grid
    except the router's, the indexer head's and kv_b_proj's, which see them as computed; outside (also after an
    exception) nothing is rounded; a bad block, or an unrounded weight narrower than fp32, is refused."""
    from glm5serve import reference
    from glm5serve.testing.activation_rounding import UNROUNDED_SUFFIXES, int8_activations

    names = {t.data_ptr(): n for n, t in model.w.items()}
    seen: dict[str, list[torch.Tensor]] = {}
    plain = torch.nn.functional.linear

    def spy(x, w, b=None):
        if w.data_ptr() in names:
            seen.setdefault(names[w.data_ptr()], []).append(x.detach().clone())
        return plain(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    with int8_activations(model, 32):
        rt.logprobs(model, IDS)
    kept = {n for n in seen if n.endswith(UNROUNDED_SUFFIXES)}
    assert {s.split(".")[-2] for s in kept} == {"gate", "weights_proj", "kv_b_proj"}, kept
    for n, xs in seen.items():
        on = [_on_grid(x, 32) for x in xs if x.shape[-1] % 32 == 0]
        assert on, n
        assert (not any(on)) if n in kept else all(on), (n, on)
    assert {n.split(".")[-2] for n in seen} >= {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "lm_head"}
    monkeypatch.undo()
    assert reference.F is torch.nn.functional
    with pytest.raises(RuntimeError), int8_activations(model, 256):
        raise RuntimeError
    assert reference.F is torch.nn.functional
    assert torch.equal(rt.logprobs(model, IDS, rounding=None), rt.logprobs(model, IDS))
    assert not torch.equal(rt.logprobs(model, IDS, rounding=32), rt.logprobs(model, IDS))
    with pytest.raises(ValueError, match="block=64, expected one of"), int8_activations(model, 64):
        pass
    gate = next(n for n in model.w if n.endswith("mlp.gate.weight"))
    saved = model.w[gate]
    model.w[gate] = saved.bfloat16()
    try:
        with pytest.raises(ValueError, match=f"{gate} is torch.bfloat16; the unrounded weights must be fp32"):
            with int8_activations(model, 32):
                pass
    finally:
        model.w[gate] = saved


def test_a_prefill_rounds_only_what_an_engine_step_of_its_size_rounds(model, monkeypatch):
    """With ``rounded_from`` k the reference runs positions < k as a prefill and the rest through its KV cache: in
    the prefill only the weights named in ``prefill_rounded`` see inputs on the int8 grid (the output head; the
    experts too when named, reached as slices of the 3-D tensors), after it every kernel linear does; the prefill's
    rows equal a one-pass forward that rounds only the output head, the later rows do not."""
    from glm5serve.kernels.gguf_gemv import MAX_FAST_M
    from glm5serve.kernels.gguf_topk_moe import MOE_Q8_MAX_M
    from glm5serve.testing.activation_rounding import (EXPERT_SUFFIXES, UNROUNDED_SUFFIXES, int8_activations,
                                                       rounded_in_prefill)

    assert rounded_in_prefill(MAX_FAST_M) is None
    assert rounded_in_prefill(MAX_FAST_M + 1) == rounded_in_prefill(MOE_Q8_MAX_M) == ("lm_head.weight",
                                                                                       *EXPERT_SUFFIXES)
    assert rounded_in_prefill(MOE_Q8_MAX_M + 1) == rt.PREFILL_ROUNDED == ("lm_head.weight",)
    spans = [(n, t.data_ptr(), t.data_ptr() + t.nbytes) for n, t in model.w.items()]
    part, seen = [0], {}
    plain, forward = torch.nn.functional.linear, type(model).forward

    def spy(x, w, b=None):
        name = next((n for n, lo, hi in spans if lo <= w.data_ptr() < hi), None)
        if name is not None and x.shape[-1] % 32 == 0:
            seen.setdefault((part[0], name), []).append(_on_grid(x, 32))
        return plain(x, w, b)

    def counted(ids, cache=None):
        part[0] += 1
        return forward(model, ids, cache)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    monkeypatch.setattr(model, "forward", counted, raising=False)
    for pre in (rounded_in_prefill(MOE_Q8_MAX_M + 1), rounded_in_prefill(MAX_FAST_M + 1)):
        part[0], seen = 0, {}
        rt.logprobs(model, IDS, rounding=32, rounded_from=4, prefill_rounded=pre)
        assert {p for p, _ in seen} == {1, 2}
        assert any(p == 1 and n.endswith(EXPERT_SUFFIXES) for p, n in seen)
        for (p, n), on in seen.items():
            rounded = not n.endswith(UNROUNDED_SUFFIXES) and (p == 2 or n.endswith(pre))
            assert all(on) if rounded else not any(on), (pre, p, n, on)
    monkeypatch.undo()
    two = rt.logprobs(model, IDS, rounding=32, rounded_from=4)
    with int8_activations(model, 32, only=rt.PREFILL_ROUNDED):
        one = rt.logprobs(model, IDS)
    torch.testing.assert_close(two[:4], one[:4], atol=1e-5, rtol=1e-5)  # fp32 sums over 4 rows against 12
    assert float((two[4:] - one[4:]).abs().max()) > 1e-3
    assert float((two[4:] - rt.logprobs(model, IDS, rounding=32)[4:]).abs().max()) > 1e-3
    assert torch.equal(rt.logprobs(model, IDS, rounding=32, rounded_from=4, prefill_rounded=None),
                       rt.logprobs(model, IDS, rounding=32))
    for only, why in ((("mlp.gate.weight",), "names a weight left unrounded"), (("nope",), "names no weight")):
        with pytest.raises(ValueError, match=why), int8_activations(model, 32, only=only):
            pass


def test_a_flip_lands_on_its_position_on_either_side_of_rounded_from(model):
    """A flip before ``rounded_from`` is taken in the prefill pass, one after it in the cached pass at its own
    position: earlier positions unchanged, its position moved."""
    layer = rt.moe_layers(model)[-1]
    base = rt.logprobs(model, IDS, rounding=32, rounded_from=4)
    for pos in (2, 6):
        flipped = rt.logprobs(model, IDS, rt.Flip(layer, pos, 0.0), rounding=32, rounded_from=4)
        torch.testing.assert_close(flipped[:pos], base[:pos], atol=1e-5, rtol=0)
        assert float((flipped[pos] - base[pos]).abs().max()) > 1e-3, pos
    assert "router" not in vars(model)


def test_round_activations_bounds():
    """Per block: |x - r| <= d / 2 with d = max|x| / 127, the block maximum kept (code ±127), an all-zero block
    zero; K not a multiple of the block raises."""
    from glm5serve.testing.activation_rounding import round_activations

    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x[1, 256:] = 0
    for block in (32, 256):
        r = round_activations(x, block)
        d = x.view(2, -1, block).abs().amax(-1, keepdim=True) / 127
        err = (x - r).view(2, -1, block).abs()
        assert (err <= d / 2 * (1 + 1e-6)).all() and (r != x).any()
        k = x.view(2, -1, block).abs().argmax(-1, keepdim=True)
        assert torch.allclose(r.view(2, -1, block).gather(-1, k), x.view(2, -1, block).gather(-1, k), rtol=1e-6)
        assert not r[1, 256:].any()
    with pytest.raises(ValueError, match="K=512 is not a multiple of block=96"):
        round_activations(x, 96)


def test_settles_a_gap_that_activation_rounding_reproduces_and_no_other(model):
    """Two stand-in engines: the reference as it is and with its linears' inputs rounded per 32. A tolerance below
    their gap is broken; the reference settles it when that rounding is a candidate and not otherwise; an engine
    further off than any candidate is never settled."""
    lp0, lp32 = rt.logprobs(model, SEQ)[-1], rt.logprobs(model, SEQ, rounding=32)[-1]
    a0 = int(lp0.argmax())
    gap = abs(float(lp32[a0] - lp0[a0]))
    assert gap > 1e-3, gap
    args = (model, SEQ, _top5(lp0), a0, _top5(lp32), int(lp32.argmax()), gap / 4)
    ok, how = rt.settles(*args, tau=1e-9, max_flips=0, roundings=(None,))
    assert not ok and "not settled" in how, how
    ok, how = rt.settles(*args, tau=1e-9, max_flips=0, roundings=(None, 256, 32))
    assert ok and "other: no flip, activations rounded per 32" in how and "baseline: no flip (" in how, how
    far = _top5(lp0)
    far[a0] -= 100.0
    ok, how = rt.settles(model, SEQ, _top5(lp0), a0, far, a0, 0.25, tau=1.0, max_flips=100, roundings=(None, 32, 256))
    assert not ok and "activations also rounded per 32/256" in how, how


def test_settles_a_flip_taken_together_with_rounding_for_either_engine(model):
    """A stand-in engine that takes one near-tie flip *and* rounds its activations per 32, against the reference as
    it is: settled with that flip and that rounding among the candidates, whichever engine is the baseline (the
    message names the flip and the rounding for that engine); not settled by rounding alone or with no
    candidates but the unflipped reference; no roundings at all is refused."""
    flips = rt.near_ties(model, SEQ, 1.0)[-100:]
    plain = rt.last_step_under_flips(model, SEQ, 1.0, flips=flips)
    rounded = rt.last_step_under_flips(model, SEQ, 1.0, rounding=32, flips=flips)
    lp0, r0 = plain[0][1], rounded[0][1]
    a0 = int(lp0.argmax())

    def apart(k):  # how far the flip-and-round candidate k is from the unflipped ones and from its flip alone
        v = float(rounded[k][1][a0])
        return min(abs(v - float(lp0[a0])), abs(v - float(r0[a0])), abs(v - float(plain[k][1][a0])))

    k = max((k for k in range(1, len(plain)) if int(rounded[k][1].argmax()) == a0), key=apart)
    flip, lpk = plain[k][0], rounded[k][1]
    tol = apart(k) / 3
    assert tol > 0.01, tol
    for base, other, who in ((lp0, lpk, "other"), (lpk, lp0, "baseline")):
        args = (model, SEQ, _top5(base), a0, _top5(other), a0, tol)
        ok, how = rt.settles(*args, tau=flip.margin * 1.001, max_flips=len(plain) - k, roundings=(None, 32))
        assert ok and f"{who}: a flip in layer {flip.layer} at position {flip.pos}" in how, how
        assert f"{who}: a flip in layer {flip.layer} at position {flip.pos} (margin {flip.margin:.4f}), " \
               "activations rounded per 32" in how, how
        ok, how = rt.settles(*args, tau=flip.margin * 1.001, max_flips=0, roundings=(None, 32))
        assert not ok, how
    with pytest.raises(ValueError, match="roundings must hold at least one entry"):
        rt.settles(model, SEQ, _top5(lp0), a0, _top5(lp0), a0, 0.1, tau=1.0, roundings=())
