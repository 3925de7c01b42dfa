"""Draft trees (issue 4, first part): tree construction from choices, ancestor masks against brute force, the greedy
tree acceptance rule on hand-made logits, KV compaction, and greedy losslessness of tree speculative decoding for
good, noisy, oracle and always-wrong drafters over chains and branching trees (float64 tiny models)."""
from __future__ import annotations

import pytest
import torch
from test_decoder import NEW, PROMPTS, _model, _noisy_copy
from torch import nn

from draftsmith.eval.decoder import autoregressive_generate, speculative_generate, tree_speculative_generate
from draftsmith.eval.tree import (
    ancestor_mask,
    chain_tree,
    compact_cache,
    greedy_tree_accept,
    node_depths,
    tree_from_choices,
)

BINARY3 = [[a] for a in range(2)] + [[a, b] for a in range(2) for b in range(2)] + \
    [[a, b, c] for a in range(2) for b in range(2) for c in range(2)]  # 14 nodes
MEDUSA_LIKE = [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0],
               [0, 0, 0, 0, 0]]
TREES = {"chain1": chain_tree(1), "chain3": chain_tree(3), "chain5": chain_tree(5),
         "binary3": tree_from_choices(BINARY3), "medusa": tree_from_choices(MEDUSA_LIKE)}


class AntiDrafter(nn.Module):
    """Argmax = the target's argmin at every node: every draft in every tree is rejected."""

    def __init__(self, target):
        super().__init__()
        self.target = target

    def new_cache(self, batch, max_len):
        return self.target.new_cache(batch, max_len)

    def forward(self, ids, **kw):
        return -self.target(ids, **kw)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target():
    return _model(0)


@pytest.fixture(scope="module")
def ar_outputs(target):
    return {tuple(p): autoregressive_generate(target, torch.tensor(p), NEW) for p in PROMPTS}


def test_tree_from_choices_and_masks():
    t = tree_from_choices([[1], [0], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    assert t.parents == (-1, -1, 0, 0, 1, 2) and t.ranks == (0, 1, 0, 1, 0, 0) and t.depths == [1, 1, 2, 2, 2, 3]
    parents = torch.tensor(t.parents)
    mask = ancestor_mask(parents)
    for i in range(len(t)):  # brute force: walk up the parents
        want, node = {0, i + 1}, i
        while t.parents[node] >= 0:
            node = t.parents[node]
            want.add(node + 1)
        assert set(mask[i + 1].nonzero().flatten().tolist()) == want
    assert node_depths(parents).tolist() == t.depths
    assert chain_tree(3).parents == (-1, 0, 1)
    with pytest.raises(ValueError, match="prefix"):
        tree_from_choices([[0, 0]])
    with pytest.raises(ValueError, match="non-empty"):
        tree_from_choices([[]])


def test_greedy_tree_accept_rule():
    # Root argmax 7. Node 0 (token 7) accepted; node 1 (token 3) rejected; node 2 = child of 0 with token 9 where
    # node 0's argmax is 9: accepted; node 3 = child of 1 (token 4) matches its parent's argmax but the parent was
    # rejected, so it is not accepted.
    V = 12
    logits = torch.full((5, V), -1.0)
    for row, best in enumerate([7, 9, 4, 2, 5]):
        logits[row, best] = 1.0
    tokens = torch.tensor([7, 3, 9, 4])
    parents = torch.tensor([-1, -1, 0, 1])
    assert greedy_tree_accept(tokens, parents, logits) == ([0, 2], 2)  # bonus: argmax at node 2 (row 3)
    assert greedy_tree_accept(torch.tensor([1, 3, 9, 4]), parents, logits) == ([], 7)  # correction at the root


def test_compact_cache_moves_the_kept_slots(target):
    c = target.new_cache(1, 16)
    with torch.no_grad():
        target(torch.arange(10).view(1, -1), cache=c)
    before = [k.clone() for k in c.k]
    compact_cache(c, 4, [0, 3, 5])
    assert c.length == 7
    for k, old in zip(c.k, before):
        assert torch.equal(k[:, :, :4], old[:, :, :4])
        assert torch.equal(k[:, :, 4:7], old[:, :, [4, 7, 9]])


@pytest.mark.parametrize("tree", list(TREES), ids=str)
@pytest.mark.parametrize("kind", ["bad", "noisy", "oracle", "anti"])
def test_tree_greedy_lossless(target, ar_outputs, kind, tree):
    drafter = {"bad": lambda: _model(1), "noisy": lambda: _noisy_copy(target), "oracle": lambda: target,
               "anti": lambda: AntiDrafter(target)}[kind]()
    spec = TREES[tree]
    depth = max(spec.depths)
    for prompt in PROMPTS:
        out, stats = tree_speculative_generate(target, drafter, torch.tensor(prompt), NEW, spec)
        assert out == ar_outputs[tuple(prompt)], (kind, tree, len(prompt))
        assert stats.new_tokens == NEW and sum(stats.accept_counts) == stats.target_forwards
        if kind == "oracle":  # the top path is the target's own greedy continuation: always fully accepted
            assert stats.accept_counts[depth] >= stats.target_forwards - 1
        if kind == "anti":
            assert stats.accepted == 0 and stats.target_forwards == NEW - 1


def test_tree_beats_chain_acceptance_with_a_noisy_drafter(target):
    """A branching tree of the same depth accepts at least as much as the chain it contains (same drafter)."""
    drafter = _noisy_copy(target, scale=0.6)
    prompt = torch.tensor(PROMPTS[1])
    _, chain = tree_speculative_generate(target, drafter, prompt, NEW, chain_tree(3))
    _, wide = tree_speculative_generate(target, drafter, prompt, NEW, tree_from_choices(BINARY3))
    assert wide.tau >= chain.tau
    # and a chain tree accepts exactly what the chain decoder accepts
    _, ref = speculative_generate(target, drafter, prompt, NEW, draft_len=3)
    assert chain.tau == pytest.approx(ref.tau, rel=0.1)
