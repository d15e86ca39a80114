"""Router near-ties in the reference engine: where a sigmoid top-k router's expert choice is within rounding of going
the other way, and what one such flip does to the logits.

GLM-5 routes each token to the top-``k`` experts of ``sigmoid(x·W_gᵀ) + e_score_correction_bias`` (DeepSeek-V3
"noaux_tc"; transformers ``GlmMoeDsaTopkRouter``). Where the k-th and (k+1)-th scores are closer than a bf16 engine's
rounding moves them, that engine may take the runner-up expert, and an unrelated expert moves the logits by up to
nats. The functions here let a test ask the fp32 reference (:class:`glm5serve.reference.ReferenceModel`, teacher
forced) what such a flip does, instead of guessing a tolerance; :func:`settles` also tries the decode kernels' int8
activation rounding (:mod:`~glm5serve.testing.activation_rounding`). Single-group routers (``n_group == 1``) only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import torch

from glm5serve.testing.activation_rounding import PREFILL_ROUNDED, int8_activations


@dataclass(frozen=True)
class Flip:
    """The router of MoE layer ``layer`` at position ``pos`` (index into the ids) taking its runner-up expert
    instead of its k-th; ``margin`` is the k-th minus the (k+1)-th choice score there (score units)."""

    layer: int
    pos: int
    margin: float


def _ranked(model, i: int, x: torch.Tensor):
    """(scores (T, E) fp32, top-(k+1) of the choice scores) of MoE layer ``i`` on its normed input ``x`` (T, H)."""
    scores, choice = model.router_scores(i, x)
    return scores, choice.topk(model.top_k + 1, dim=-1)


def _flipped_router(model, flip: Flip):
    """A drop-in for ``model.router`` that takes the runner-up expert at ``flip`` (weights renormalised over the new
    set as the router does: the chosen scores, ``norm_topk_prob``, ``routed_scaling_factor``)."""
    k = model.top_k

    def router(i, x):
        if i != flip.layer:
            return type(model).router(model, i, x)
        scores, top = _ranked(model, i, x)
        chosen = top.indices[:, :k].clone()
        chosen[flip.pos, k - 1] = top.indices[flip.pos, k]
        weights = scores.gather(1, chosen)
        if model.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * model.routed_scaling_factor, chosen
    return router


def _forward_with(model, ids: Sequence[int], router=None, cache=None) -> torch.Tensor:
    if model.n_group != 1:
        raise ValueError(f"router flips handle single-group routers only, not n_group={model.n_group}")
    if router is not None:
        model.router = router
    try:
        with torch.inference_mode():
            return model.forward(list(ids), cache)
    finally:
        if router is not None:
            del model.router


def topk_margins(model, ids: Sequence[int]) -> torch.Tensor:
    """(L, T) fp32 on the CPU: the k-th minus the (k+1)-th choice score of each MoE layer (in layer order) at each
    position of ``ids`` (T,), teacher forced. Raises ValueError for a grouped router (``n_group > 1``)."""
    margins = []

    def spy(i, x):
        _, top = _ranked(model, i, x)
        margins.append(top.values[:, -2] - top.values[:, -1])
        return type(model).router(model, i, x)

    _forward_with(model, ids, spy)
    return torch.stack(margins).cpu()


def moe_layers(model) -> list[int]:
    """Indices of the MoE layers of ``model``, in order (the rows of :func:`topk_margins`)."""
    return [i for i, t in enumerate(model.mlp_types) if t != "dense"]


def near_ties(model, ids: Sequence[int], tau: float, start: int = 0) -> list[Flip]:
    """Every (MoE layer, position ≥ ``start``) of ``ids`` whose top-k margin is below ``tau``, ordered by position,
    then layer. Teacher forced on ``ids``: a flip moves the later layers' margins, so the set is that of the
    unflipped pass."""
    m = topk_margins(model, ids)
    layers = moe_layers(model)
    found = (m < tau).nonzero().tolist()
    return sorted((Flip(layers[r], p, float(m[r, p])) for r, p in found if p >= start), key=lambda f: (f.pos, f.layer))


def logprobs(model, ids: Sequence[int], flip: Flip | None = None, rounding: int | None = None,
             rounded_from: int = 0, prefill_rounded: tuple[str, ...] | None = PREFILL_ROUNDED) -> torch.Tensor:
    """(T, vocab) fp32 log-softmax on the CPU of ``model`` over ``ids`` (T,), teacher forced, with ``flip`` applied
    when given and, when ``rounding`` is given, the linears' inputs rounded to int8 blocks of that many values
    (:func:`~glm5serve.testing.activation_rounding.int8_activations`) at positions from ``rounded_from`` on (those
    an engine computed at a decode batch size); before it (the prefill) only the inputs of the weights named in
    ``prefill_rounded`` (None: all; ``activation_rounding.rounded_in_prefill``). A ``rounded_from`` > 0 runs the two
    parts through a KV cache, as an engine does. Raises ValueError for a grouped router."""
    if rounding is None or rounded_from <= 0 or prefill_rounded is None:
        with int8_activations(model, rounding):
            logits = _forward_with(model, ids, None if flip is None else _flipped_router(model, flip))
        return torch.log_softmax(logits.float(), -1).cpu()
    cache, parts = model.new_cache(), []
    for start, stop, only in ((0, rounded_from, prefill_rounded), (rounded_from, len(ids), None)):
        if start >= stop:
            continue
        here = None if flip is None or not start <= flip.pos < stop else replace(flip, pos=flip.pos - start)
        with int8_activations(model, rounding, only):
            parts.append(_forward_with(model, ids[start:stop], None if here is None else _flipped_router(model, here),
                                       cache))
    return torch.log_softmax(torch.cat(parts).float(), -1).cpu()


def bf16_flip_range(model, model_bf16, sequences: Iterable[Sequence[int]]) -> float:
    """The largest fp32 top-k margin at which ``model_bf16`` (the same weights computing in bf16) routes to another
    expert set than ``model`` (fp32), over every MoE layer and position of ``sequences`` (teacher forced); 0.0 when
    no set differs. A measure of how far bf16 rounding reaches into router margins on this checkpoint: below it an
    engine computing in bf16 may take the runner-up expert. Raises ValueError for a grouped router."""
    worst = 0.0
    for ids in sequences:
        sets = []
        for m in (model, model_bf16):
            chosen = []

            def spy(i, x, m=m, chosen=chosen):
                chosen.append(_ranked(m, i, x)[1].indices[:, :m.top_k].sort(-1).values)
                return type(m).router(m, i, x)
            _forward_with(m, ids, spy)
            sets.append(torch.stack(chosen).cpu())
        differ = (sets[0] != sets[1]).any(-1)  # (L, T)
        if differ.any():
            worst = max(worst, float(topk_margins(model, ids)[differ].max()))
    return worst


def last_step_under_flips(model, ids: Sequence[int], tau: float, max_flips: int = 32, rounding: int | None = None,
                          flips: Sequence[Flip] | None = None, rounded_from: int = 0,
                          prefill_rounded: tuple[str, ...] | None = PREFILL_ROUNDED
                          ) -> list[tuple[Flip | None, torch.Tensor]]:
    """The (vocab,) fp32 log-softmax at the last position of ``ids`` (the next-token distribution), unflipped first
    (flip None), then with each of the ``max_flips`` near-ties (margin < ``tau``, :func:`near_ties`, of the unrounded
    pass; or the given ``flips``) closest to the end flipped, one at a time: one reference forward each, with the
    linears' inputs rounded to int8 blocks of ``rounding`` values when given (from ``rounded_from`` on, before it
    those of ``prefill_rounded``, as in :func:`logprobs`). Flips are taken one at a time because together they can
    cancel. Raises ValueError for a grouped router."""
    if flips is None:
        flips = near_ties(model, ids, tau)[-max_flips:] if max_flips > 0 else []
    return [(f, logprobs(model, ids, f, rounding, rounded_from, prefill_rounded)[-1]) for f in [None, *flips]]


def _candidate(flip: Flip | None, rounding: int | None) -> str:
    """How the reference ran, in words: which flip, which activation rounding."""
    where = "no flip" if flip is None else (f"a flip in layer {flip.layer} at position {flip.pos} "
                                            f"(margin {flip.margin:.4f})")
    return where + ("" if rounding is None else f", activations rounded per {rounding}")


def settles(model, ids: Sequence[int], base: Mapping, base_token: int, other: Mapping, other_token: int, tol: float,
            tau: float, max_flips: int = 32, roundings: Sequence[int | None] = (None,), rounded_from: int = 0,
            prefill_rounded: tuple[str, ...] | None = PREFILL_ROUNDED) -> tuple[bool, str]:
    """Whether the fp32 reference settles a step where two bf16 engines broke a tolerance rule: ``ids`` is the
    history both share (the step predicts the token after it), ``base``/``other`` each engine's ``{token: logprob}``
    there (its top-k and chosen token), ``base_token``/``other_token`` their greedy choices. Teacher forced on
    ``ids``, with no flip or one flip of a near-tie (margin < ``tau``, :func:`last_step_under_flips`), the linears'
    inputs as they are or rounded to int8 blocks (each entry of ``roundings``, None: not rounded; at the positions from
    ``rounded_from`` on, before it those of ``prefill_rounded``: :func:`logprobs`), the reference must
    reproduce each engine within ``tol``; the two engines may differ in rounding, and either or both may take the
    flip:

    * same token t, logprobs too far apart: one candidate within ``tol`` of the baseline's logprob of t, one within
      ``tol`` of the other engine's;
    * tokens a (baseline) and b (other): with ``q = lp(a) - lp(b)`` (each engine's q bounded from its top-k dict),
      one candidate's q at least the baseline's minus 2·tol, one at most the other's plus 2·tol.

    The candidates for one flip f are the reference unflipped and with f, under each rounding; the near-ties come
    from the unrounded pass, and a rounded pass carries whatever expert choices the rounding itself moves (a flip
    then swaps that pass's k-th and (k+1)-th experts). Each engine then differs from the reference by ``tol`` per
    logprob, so from the other engine by one router near-tie, activation rounding and bf16. Returns (settled, one
    line saying what the reference gave). Raises ValueError for empty ``roundings`` or a grouped router."""
    if not roundings:
        raise ValueError("settles: roundings must hold at least one entry (None: not rounded)")
    flips = near_ties(model, ids, tau)[-max_flips:] if max_flips > 0 else []
    runs = {r: last_step_under_flips(model, ids, tau, rounding=r, flips=flips, rounded_from=rounded_from,
                                     prefill_rounded=prefill_rounded) for r in roundings}
    lb, lo = ({int(t): float(v) for t, v in d.items()} for d in (base, other))
    ta, tb = int(base_token), int(other_token)
    if ta == tb:
        name = f"lp({ta})"

        def value(lp):
            return float(lp[ta])
        fits_base, fits_other = (lambda x: abs(x - lb[ta]) <= tol), (lambda x: abs(x - lo[ta]) <= tol)
        wanted = f"lp({ta}) {lb[ta]:.2f} (baseline) and {lo[ta]:.2f} (other) within {tol}"
    else:
        name = "q"

        def value(lp):
            return float(lp[ta] - lp[tb])
        q_base = lb[ta] - lb.get(tb, min(lb.values()))   # at least this: b may be below the baseline's top-k
        q_other = lo.get(ta, min(lo.values())) - lo[tb]  # at most this
        fits_base, fits_other = (lambda x: x >= q_base - 2 * tol), (lambda x: x <= q_other + 2 * tol)
        wanted = f"q = lp({ta}) - lp({tb}) >= {q_base - 2 * tol:.2f} (baseline) and <= {q_other + 2 * tol:.2f} (other)"
    vals = {r: [(f, value(lp)) for f, lp in entries] for r, entries in runs.items()}
    first = None if None in vals else roundings[0]
    q0 = vals[first][0][1]
    furthest = None
    for j in range(len(flips) + 1):
        cands = [(f, r, q) for r in roundings for f, q in {0: vals[r][0], j: vals[r][j]}.values()]
        hit_b = next((c for c in cands if fits_base(c[2])), None)
        hit_o = next((c for c in cands if fits_other(c[2])), None)
        if hit_b and hit_o:
            how = (f"baseline: {_candidate(*hit_b[:2])} ({name} {hit_b[2]:.2f}); other: {_candidate(*hit_o[:2])} "
                   f"({name} {hit_o[2]:.2f})")
            return True, (f"settled by the reference ({name} {q0:.2f} with {_candidate(None, first)}), {how}; "
                          f"wanted {wanted}")
        for c in cands:
            if furthest is None or abs(c[2] - q0) > abs(furthest[2] - q0):
                furthest = c
    rounded = [r for r in roundings if r is not None]
    also = f", activations also rounded per {'/'.join(map(str, rounded))}" if rounded else ""
    return False, (f"not settled by the reference with <= 1 router flip ({len(flips)} near-ties < {tau:.4f} tried"
                   f"{also}): {name} {q0:.2f} with {_candidate(None, first)}, furthest {furthest[2]:.2f} with "
                   f"{_candidate(*furthest[:2])}; wanted {wanted}")
