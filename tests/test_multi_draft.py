"""Multi-draft verification of sampled trees (eval/tree.py: ``pick_children``, ``multi_draft_accept``): children
drawn without replacement (recursive rejection) or i.i.d. (SpecTr's k-sequential rule) keep the target's
distribution exactly, at one node and through the decoder; they accept more than the point-mass rule when the
drafter's distribution is close to the target's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from draftsmith.eval.accept import Sampler
from draftsmith.eval.tree import (
    TREE_RULES,
    DynamicTree,
    kseq_rho,
    multi_draft_accept,
    pick_children,
    sample_tree_accept,
    tree_from_choices,
)

V = 6


def one_node_outcomes(rule, p_logits, q_logits, k, row, n):
    """n trials at one node: k children drawn by ``pick_children`` from q (row's sampler on q_logits), verified
    against p = softmax(p_logits) -> (the first emitted token of each trial (n,), how many accepted a child)."""
    kids = pick_children([row], rule, q_logits.expand(1, n, V), k)
    p = torch.softmax(p_logits, -1)
    probs, parents = p.expand(k + 1, V), torch.full((k,), -1)
    g = torch.Generator().manual_seed(11)
    first, accepted = [], 0
    for i in range(n):
        q = torch.zeros(k + 1, V)
        q[0] = kids.q[0, i]
        path, y = multi_draft_accept(rule, kids.tokens[0, i], parents, probs, q, g)
        first.append(int(kids.tokens[0, i, path[0]]) if path else y)
        accepted += bool(path)
    return torch.tensor(first), accepted


def _row(temperature=1.0, top_k=0, seed=0):
    s = Sampler(temperature, top_k=top_k, generator=torch.Generator().manual_seed(seed))
    return SimpleNamespace(sampler=s, key=(temperature, top_k, 1.0, id(s.generator)))


def _dists(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 1.5, torch.randn(V, generator=g) * 1.5  # target, draft logits


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("rule", ["recursive", "spectr"])
def test_one_node_emits_the_target_distribution(rule, k):
    """A node with k sampled children: the first emitted token (an accepted child, or the token drawn where the
    walk stopped) is distributed as the target's p, for a drafter far from the target."""
    p_logits, q_logits = _dists(k)
    p = torch.softmax(p_logits, -1)
    first, accepted = one_node_outcomes(rule, p_logits, q_logits, k, _row(), n=6000)
    emp = torch.bincount(first, minlength=V).double() / len(first)
    assert 0.5 * float((emp - p.double()).abs().sum()) < 0.035
    assert 0 < accepted < len(first)


def test_a_draft_support_smaller_than_k_stops_the_walk_exactly():
    """q's top-2 filter leaves 2 tokens for 4 draws without replacement: the draws past its support carry no
    mass and the walk emits from the residual; the output is still the target's."""
    p_logits, q_logits = _dists(7)
    row = _row(top_k=2)
    first, _ = one_node_outcomes("recursive", p_logits, q_logits, 4, row, n=6000)
    emp = torch.bincount(first, minlength=V).double() / len(first)
    assert 0.5 * float((emp - torch.softmax(p_logits, -1).double()).abs().sum()) < 0.035


def test_sampled_children_accept_more_than_the_point_mass_rule_when_the_drafter_matches():
    """q == p: recursive rejection accepts its first child always; SpecTr nearly always; the point-mass rule only
    with the mass p puts on the top-k children."""
    logits = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])
    rates = {
        rule: one_node_outcomes(rule, logits, logits, 2, _row(), n=3000)[1] / 3000 for rule in ("recursive", "spectr")
    }
    p = torch.softmax(logits, -1)
    top2 = float(p.topk(2).values.sum())
    g = torch.Generator().manual_seed(3)
    hits = sum(
        bool(sample_tree_accept(p.topk(2).indices, torch.tensor([-1, -1]), p.expand(3, -1), g)[0]) for _ in range(3000)
    )
    assert rates["recursive"] == 1.0
    assert rates["spectr"] > 0.95
    assert abs(hits / 3000 - top2) < 0.04 and top2 < 0.6


def test_kseq_rho_keeps_the_residual_a_distribution():
    g = torch.Generator().manual_seed(0)
    for k in (1, 2, 4, 8):
        for _ in range(20):
            p, q = (
                torch.softmax(torch.randn(V, generator=g) * 2, -1),
                torch.softmax(torch.randn(V, generator=g) * 2, -1),
            )
            rho = kseq_rho(p, q, k)
            assert 1.0 <= rho <= k
            m = torch.minimum(q, p / rho)
            beta = float(m.sum())
            c = (1 - (1 - beta) ** k) / beta
            assert float((p - c * m).min()) > -1e-6  # a residual, up to the bisection's tolerance
    same = torch.softmax(torch.randn(V, generator=g), -1)
    assert kseq_rho(same, same, 1) == 1.0


def test_recursive_children_are_distinct_and_scored_by_rank():
    """Draws without replacement never repeat a token; a sampled row's scores are q's sorted log-probs (what a
    dynamic tree's shape reads), a greedy row's children are its top-k."""
    logits = torch.randn(2, 3, 50)
    rows = [_row(), SimpleNamespace(sampler=Sampler(0.0), key=(0.0, 0, 1.0, None))]
    kids = pick_children(rows, "recursive", logits, 5)
    assert kids.sampled.tolist() == [True, False]
    for j in range(3):
        assert len(set(kids.tokens[0, j].tolist())) == 5
    assert torch.equal(kids.tokens[1], logits[1].topk(5).indices)
    q = torch.softmax(logits[0], -1)
    assert torch.allclose(kids.scores[0], q.log().topk(5).values)
    assert torch.allclose(kids.q[0], q) and not kids.q[1].any()
    assert pick_children(rows, "point_mass", logits, 5).q is None


def test_static_slots_and_rule_are_checked():
    spec = tree_from_choices([[0], [2], [0, 0]], "recursive")
    assert spec.slots == [0, 1, 0]  # the rank-2 child is its parent's second draw
    with pytest.raises(ValueError, match="tree sampling rule 'typical'"):
        tree_from_choices([[0]], "typical")
    with pytest.raises(ValueError, match="tree sampling rule"):
        DynamicTree(2, 2, 3, "typical")


def test_the_walk_descends_through_accepted_children():
    """Two levels, point-mass distributions: the target surely takes node 0's token, then node 2's."""
    tokens, parents = torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0])
    probs = torch.zeros(4, 5)
    probs[0, 1] = probs[1, 3] = probs[3, 4] = 1.0
    q = torch.zeros(4, 5)
    q[0, [1, 2]] = 0.5
    q[1, 3] = 1.0
    for rule in ("recursive", "spectr"):
        assert multi_draft_accept(rule, tokens, parents, probs, q) == ([0, 2], 4)


@pytest.mark.parametrize("rule", ["recursive", "spectr"])
def test_two_levels_emit_the_target_joint(rule):
    """A two-level tree of sampled children (2 under the root, 2 and 1 under those), each node's children drawn
    from its own q: the first two emitted tokens follow the target's joint p(a) p(b | a)."""
    g = torch.Generator().manual_seed(0)
    p1, p2 = (
        torch.softmax(torch.randn(V, generator=g) * 1.5, -1),
        torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1),
    )
    q1, q2 = torch.randn(V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5  # draft logits
    row, n = _row(seed=1), 6000
    counts = torch.zeros(V, V)
    for _ in range(n):
        root = pick_children([row], rule, q1[None], 2)
        a0, a1 = root.tokens[0].tolist()
        k0, k1 = pick_children([row], rule, q2[a0][None], 2), pick_children([row], rule, q2[a1][None], 1)
        tokens = torch.tensor([a0, a1, *k0.tokens[0].tolist(), int(k1.tokens[0, 0])])
        probs = torch.stack([p1, p2[a0], p2[a1], p1, p1, p1])  # the leaves' rows only draw a third token
        q = torch.zeros(6, V)
        q[0], q[1], q[2] = root.q[0], k0.q[0], k1.q[0]
        path, y = multi_draft_accept(rule, tokens, torch.tensor([-1, -1, 0, 0, 1]), probs, q, row.sampler.generator)
        out = [int(tokens[i]) for i in path] + [y]
        if len(out) < 2:  # the walk stopped at the root: the next step draws b from the target
            out.append(int(torch.multinomial(p2[out[0]], 1, generator=g)))
        counts[out[0], out[1]] += 1
    assert 0.5 * float((counts / n - p1[:, None] * p2).abs().sum()) < 0.035


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["static", "dynamic"])
@pytest.mark.parametrize("rule", TREE_RULES)
def test_a_hundred_thousand_rows_follow_the_target_closely(rule, shape):
    """The batched decoder at B = 100,000 rows of one prompt, temperature 1: every rule's joint of the first three
    tokens is within sampling noise of the target's (about 0.002 per token marginal at this size)."""
    from conftest import TINY_CFG8, exact_joint, tiny_model, tv
    from test_batch_decode import run

    from draftsmith.eval.batch_decoder import BatchDecoder

    t, d = tiny_model(0, TINY_CFG8, logit_scale=3.0), tiny_model(1, TINY_CFG8, logit_scale=3.0)
    spec = {
        "static": tree_from_choices([[0], [1], [0, 0], [1, 0], [0, 1]], rule),
        "dynamic": DynamicTree(2, 3, 5, rule),
    }[shape]
    gen, n = torch.Generator().manual_seed(1), 100_000
    dec = BatchDecoder(t, d, tree=spec, max_len=32)
    ids = [dec.add(torch.tensor([1, 2, 3, 4]), 3, temperature=1.0, generator=gen) for _ in range(n)]
    outs = run(dec, ids, check=False)
    counts = torch.zeros(8, 8, 8)
    for i in ids:
        counts[tuple(outs[i])] += 1
    emp, joint = counts / n, exact_joint(t, [1, 2, 3, 4], 3)
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert tv(emp.sum(dims), joint.sum(dims)) < 0.006, dims
    assert tv(emp.sum(2), joint.sum(2)) < 0.01
