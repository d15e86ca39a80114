"""``kernels.gguf_topk_moe.expert_groups``: the (token, slot) pairs of a routing sorted by expert and padded into
groups, the layout the grouped MoE kernels read (vLLM's ``moe_align_block_size`` layout). Checked against the
definition, for drawn routings with repeated experts, unused experts and dropped (negative) ids."""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from glm5serve.kernels.gguf_topk_moe import expert_groups


@st.composite
def routings(draw):
    E = draw(st.integers(1, 12))
    T = draw(st.integers(1, 40))
    k = draw(st.integers(1, 4))
    ids = draw(st.lists(st.integers(-1, E - 1), min_size=T * k, max_size=T * k))
    return torch.tensor(ids, dtype=torch.int32).view(T, k), E, draw(st.sampled_from((1, 4, 16)))


@given(routings())
def test_groups_hold_each_routed_pair_once_in_expert_order(case):
    ids, E, gm = case
    P = ids.numel()
    pairs, gexp = expert_groups(ids, E, gm)
    G = -(-P // gm) + min(E, P)
    assert pairs.shape == (G * gm,) and gexp.shape == (G,) and pairs.dtype == gexp.dtype == torch.int32
    flat = ids.view(-1).tolist()
    expected = []  # per expert in ascending order: its pairs ascending, padded with P to a multiple of gm
    for e in range(E):
        mine = [p for p, x in enumerate(flat) if x == e]
        n_groups = -(-len(mine) // gm)
        expected += [(e, mine[g * gm:(g + 1) * gm] + [P] * (gm - len(mine[g * gm:(g + 1) * gm])))
                     for g in range(n_groups)]
    got = [(int(gexp[g]), pairs[g * gm:(g + 1) * gm].tolist()) for g in range(G)]
    assert got[:len(expected)] == expected
    assert all(e == -1 for e, _ in got[len(expected):]), "groups past the last expert's run must be unused (-1)"


def test_routings_of_another_rank_or_size_are_refused_in_one_line():
    ids = torch.zeros(3, 2, dtype=torch.int32)
    for bad in (ids.view(-1), ids.view(3, 2, 1)):  # (T, k) only: other ranks were flattened silently
        msg = f"expert_groups: topk_ids must be (T, k), got shape {tuple(bad.shape)}"
        with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
            expert_groups(bad, 4)
    with pytest.raises(ValueError, match=r"^expert_groups: num_experts=2147483648 does not fit int32 expert ids"):
        expert_groups(ids, 2**31)  # tried to allocate the counts of 2**31 experts
