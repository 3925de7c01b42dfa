"""Draft trees: tree construction from choices, ancestor masks against brute force, the greedy
and sampling tree acceptance rules, KV compaction, greedy losslessness of tree speculative decoding for good, noisy,
oracle and always-wrong drafters over chains and branching trees (float64 tiny models), and the target's
distribution kept when sampling through a tree."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import (
    DECODE_PROMPTS,
    NEW,
    REFERENCE_DRAFTERS,
    TINY_CFG,
    TINY_CFG8,
    noisy_copy,
    reference_drafter,
    sampled_joint,
    tiny_model,
    tv,
)
from torch import nn

from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.eval.tree import (
    TREE_RULES,
    DynamicTree,
    ancestor_mask,
    best_nodes,
    chain_tree,
    compact_cache,
    greedy_tree_accept,
    node_depths,
    sample_tree_accept,
    tree_from_choices,
)
from draftsmith.eval.tree_decoder import tree_speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread

BINARY3 = (
    [[a] for a in range(2)]
    + [[a, b] for a in range(2) for b in range(2)]
    + [[a, b, c] for a in range(2) for b in range(2) for c in range(2)]
)  # 14 nodes
MEDUSA_LIKE = [
    [0],
    [1],
    [2],
    [3],
    [0, 0],
    [0, 1],
    [1, 0],
    [0, 0, 0],
    [0, 0, 1],
    [0, 1, 0],
    [0, 0, 0, 0],
    [0, 0, 0, 0, 0],
]
TREES = {
    "chain1": chain_tree(1),
    "chain3": chain_tree(3),
    "chain5": chain_tree(5),
    "binary3": tree_from_choices(BINARY3),
    "medusa": tree_from_choices(MEDUSA_LIKE),
    "dynamic": DynamicTree(top_k=3, depth=4, total_tokens=10),
    "dynamic_wide": DynamicTree(5, 5, 60),
}


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
@pytest.mark.parametrize("kind", REFERENCE_DRAFTERS)
def test_tree_greedy_lossless(target, ar_outputs, kind, tree):
    drafter = reference_drafter(kind, target)
    spec = TREES[tree]
    depth = spec.depth if isinstance(spec, DynamicTree) else max(spec.depths)
    for prompt in DECODE_PROMPTS:
        out, stats = tree_speculative_generate(target, drafter, torch.tensor(prompt), NEW, spec)
        assert out == ar_outputs[tuple(prompt)], (kind, tree, len(prompt))
        assert stats.new_tokens == NEW and sum(stats.accept_counts) == stats.target_forwards
        if kind == "oracle" and not isinstance(spec, DynamicTree):  # the top path is the target's greedy one
            assert stats.accept_counts[depth] >= stats.target_forwards - 1
        if kind == "oracle":  # a dynamic tree may spend its budget on siblings, but the top child always matches
            assert stats.accepted >= stats.target_forwards - 1
        if kind == "anti":
            assert stats.accepted == 0 and stats.target_forwards == NEW - 1


def test_tree_beats_chain_acceptance_with_a_noisy_drafter(target):
    """A branching tree of the same depth accepts at least as much as the chain it contains (same drafter)."""
    drafter = noisy_copy(target, scale=0.6)
    prompt = torch.tensor(DECODE_PROMPTS[1])
    _, chain = tree_speculative_generate(target, drafter, prompt, NEW, chain_tree(3))
    _, wide = tree_speculative_generate(target, drafter, prompt, NEW, tree_from_choices(BINARY3))
    assert wide.tau >= chain.tau
    # and a chain tree accepts exactly what the chain decoder accepts, step by step, until the chain decoder
    # shortens its last blocks to stay within max_new_tokens (a tree keeps its shape there)
    _, ref = speculative_generate(target, drafter, prompt, NEW, draft_len=3)
    emitted, k = 1, 0
    while k < len(ref.accepted_per_step) and NEW - emitted - 1 >= 3:
        emitted, k = emitted + ref.accepted_per_step[k] + 1, k + 1
    assert k >= 10 and chain.accepted_per_step[:k] == ref.accepted_per_step[:k]


@pytest.mark.parametrize("rule", TREE_RULES)
def test_tree_sampling_matches_target_end_to_end(rule):
    """Sampling through a branching tree keeps the target's distribution under every rule (batch 1): joint of the
    first 3 new tokens."""
    target, drafter = tiny_model(0, TINY_CFG8, logit_scale=3.0), tiny_model(1, TINY_CFG8, logit_scale=3.0)
    gen, N = torch.Generator().manual_seed(0), 3000
    spec = tree_from_choices([[0], [1], [0, 0], [1, 0], [0, 1]], rule)
    emp, joint, st = sampled_joint(
        lambda x: tree_speculative_generate(target, drafter, x, 4, spec, temperature=1.0, generator=gen),
        target,
        [1, 2, 3, 4],
        3,
        N,
    )
    assert 0.1 * N < st.accepted < 2 * N  # some steps accept, some reject
    for dims in [(1, 2), (0, 2), (0, 1)]:  # sampling noise at N = 3000 is ~0.015 (test_multi_draft: 100,000 rows)
        assert tv(emp.sum(dims), joint.sum(dims)) < 0.035, dims
    assert tv(emp.sum(2), joint.sum(2)) < 0.05


def test_sample_tree_accept_descends_only_into_matching_children():
    probs = torch.zeros(4, 5)
    probs[0, 2] = 1.0  # root: surely 2 -> node 1 carries 2
    probs[2, 4] = 1.0  # node 1: surely 4 -> no child carries 4 -> emitted
    tokens, parents = torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 1])
    assert sample_tree_accept(tokens, parents, probs) == ([1], 4)


def _closure_reference(scores: list[float], parents: list[int], depths: list[int], budget: int) -> list[int]:
    """The best ``budget`` nodes by (-score, id), closed under ancestors by walking up, sorted by (depth, id)."""
    keep = set()
    for n in sorted(range(len(scores)), key=lambda n: (-scores[n], n))[:budget]:
        while n >= 0 and n not in keep:
            keep.add(n)
            n = parents[n]
    return sorted(keep, key=lambda n: (depths[n], n))


def test_best_nodes_are_ancestor_closed_parent_first_and_fixed_size():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(2, 40, (1,), generator=g))
        parents, depths, scores = [-1], [1], [-float(torch.rand(1, generator=g))]
        for i in range(1, n):  # parents recorded first; a child's cumulative log-prob <= its parent's
            p = int(torch.randint(-1, i, (1,), generator=g))
            tie = trial % 3 == 0 and bool(torch.rand(1, generator=g) < 0.5)  # exact ties (log q == 0)
            base = 0.0 if p < 0 else scores[p]
            scores.append(base - (0.0 if tie else float(torch.rand(1, generator=g))))
            parents.append(p)
            depths.append(1 if p < 0 else depths[p] + 1)
        budget = int(torch.randint(1, n + 1, (1,), generator=g))
        got = best_nodes(torch.tensor(scores), torch.tensor(depths), budget).tolist()
        assert got == _closure_reference(scores, parents, depths, budget) and len(got) == budget


@pytest.mark.parametrize("rule", TREE_RULES)
def test_dynamic_tree_sampling_matches_target_end_to_end(rule):
    target, drafter = tiny_model(0, TINY_CFG8, logit_scale=3.0), tiny_model(1, TINY_CFG8, logit_scale=3.0)
    gen = torch.Generator().manual_seed(1)
    emp, joint, _ = sampled_joint(
        lambda x: tree_speculative_generate(
            target, drafter, x, 4, DynamicTree(2, 3, 5, rule), temperature=1.0, generator=gen
        ),
        target,
        [1, 2, 3, 4],
        3,
        2000,
    )
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert tv(emp.sum(dims), joint.sum(dims)) < 0.035, dims


def test_dynamic_tree_follows_a_confident_drafter_to_full_depth():
    """With a sharp target as its own drafter, the top-1 path outscores every sibling, so reranking keeps it to
    the full depth and every step accepts `depth` drafts."""
    target = tiny_model(0, logit_scale=30.0)
    prompt = torch.tensor(DECODE_PROMPTS[1])
    ref = autoregressive_generate(target, prompt, NEW)
    out, stats = tree_speculative_generate(target, target, prompt, NEW, DynamicTree(top_k=3, depth=4, total_tokens=10))
    assert out == ref and stats.accept_counts[4] >= stats.target_forwards - 1


class ReducedVocabDrafter(nn.Module):
    """A drafter whose LM head covers only the target ids ``used`` (sorted), with EAGLE-3 d2t offsets."""

    def __init__(self, model, used: list[int]):
        super().__init__()
        self.model, self.target_vocab_size = model, model.cfg.vocab_size
        self.register_buffer("used", torch.tensor(sorted(used)))
        self.register_buffer("d2t", self.used - torch.arange(len(used)))

    def new_cache(self, batch, max_len):
        return self.model.new_cache(batch, max_len)

    def forward(self, ids, **kw):
        return self.model(ids, **kw)[..., self.used]  # (..., V_draft)


@pytest.mark.parametrize("tree", ["chain", "binary3", "dynamic"])
def test_reduced_draft_vocabulary_is_lossless_and_maps_ids(target, ar_outputs, tree):
    prompt = DECODE_PROMPTS[1]
    ref = ar_outputs[tuple(prompt)]
    covering = sorted(set(ref) | set(range(0, TINY_CFG.vocab_size, 3)))  # every target argmax is draftable
    partial = list(range(0, TINY_CFG.vocab_size, 2))  # many target tokens are not
    for used, oracle in ((covering, True), (partial, False)):
        drafter = ReducedVocabDrafter(target, used)
        if tree == "chain":
            out, st = speculative_generate(target, drafter, torch.tensor(prompt), NEW, draft_len=3)
            full = st.accept_counts[3]
        else:
            spec = TREES[tree] if tree != "chain" else None
            out, st = tree_speculative_generate(target, drafter, torch.tensor(prompt), NEW, spec)
            full = st.accepted
        assert out == ref
        if oracle:  # the restricted oracle drafts exactly the target's argmax: (nearly) everything is accepted
            assert full >= st.target_forwards - 1
        else:
            assert st.accepted < st.drafted


def test_reduced_draft_vocabulary_sampling_keeps_the_target_distribution():
    target, base = tiny_model(0, TINY_CFG8, logit_scale=3.0), tiny_model(1, TINY_CFG8, logit_scale=3.0)
    drafter = ReducedVocabDrafter(base, [0, 2, 3, 5, 7])
    gen = torch.Generator().manual_seed(5)
    emp, joint, _ = sampled_joint(
        lambda x: speculative_generate(target, drafter, x, 3, draft_len=2, temperature=1.0, generator=gen),
        target,
        [1, 2, 3, 4],
        2,
        2500,
    )
    assert tv(emp.sum(1), joint.sum(1)) < 0.03 and tv(emp.sum(0), joint.sum(0)) < 0.035


def test_choices_from_measured_head_accuracies():
    """Medusa's construction: the most valuable paths (products of per-rank accuracies), prefix-closed, and a
    usable static tree; Vicuna-7B's published top-1 head accuracies give a chain-first tree."""
    from draftsmith.eval.tree import choices_from_accuracies

    acc = [[0.56, 0.12, 0.05], [0.32, 0.12, 0.06], [0.20, 0.10, 0.05]]  # algorithms.md A5.2 (top-1), rest made up
    ch = choices_from_accuracies(acc, 6)
    assert ch[:2] == [[0], [0, 0]] and len(ch) == 6
    assert all(c[:-1] in ch or len(c) == 1 for c in ch)  # prefix-closed
    value = {tuple(c): math.prod(acc[d][r] for d, r in enumerate(c)) for c in ch}
    left_out = [(0, 0, 0), (1,), (0, 1), (2,), (1, 0)]
    assert min(value.values()) >= max(
        math.prod(acc[d][r] for d, r in enumerate(p)) for p in left_out if list(p) not in ch
    )
    tree = tree_from_choices(ch)
    assert len(tree) == 6 and max(tree.depths) <= 3


def test_tree_cli_builds_trees_from_a_runs_logged_accuracies(tmp_path, capsys):
    """``draftsmith tree RUN --nodes ..``: the last train row's rank accuracies -> choices per size,
    with expected tau = 1 + the sum of the kept paths' values; a run without them is a one-line error."""
    from draftsmith.cli import main as cli_main
    from draftsmith.eval.tree import choices_from_accuracies, expected_tau

    def main(argv):
        return cli_main(["tree", *argv])

    acc = [[0.5, 0.3], [0.4, 0.1]]
    rows = [
        {
            "stage": "train",
            "step": 1,
            "acc_head0_rank0": 0.1,
            "acc_head0_rank1": 0.1,
            "acc_head1_rank0": 0.1,
            "acc_head1_rank1": 0.1,
        },
        {"stage": "train", "step": 2, **{f"acc_head{k}_rank{r}": acc[k][r] for k in (0, 1) for r in (0, 1)}},
        {"stage": "eval", "step": 2, "tau_measured": 1.3},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(tmp_path), "--nodes", "1,3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].endswith("eval.tree.choices=[[0]]") and "expected tau 1.500" in lines[0]
    ch3 = choices_from_accuracies(acc, 3)
    assert ch3 == [[0], [1], [0, 0]] and expected_tau(acc, ch3) == pytest.approx(1 + 0.5 + 0.3 + 0.5 * 0.4)
    assert lines[1].endswith("eval.tree.choices=[[0],[1],[0,0]]") and "expected tau 2.000" in lines[1]
    # an EAGLE run logs per-TTT-step accuracies instead: depth k reads step k
    steps = {"stage": "train", "step": 3, **{f"acc_step{k}_rank{r}": acc[k][r] for k in (0, 1) for r in (0, 1)}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(steps) + "\n")
    assert main([str(tmp_path), "--nodes", "3"]) == 0
    assert capsys.readouterr().out.strip().endswith("eval.tree.choices=[[0],[1],[0,0]]")
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[2]) + "\n")
    assert main([str(tmp_path)]) == 2 and "no per-head, per-step or per-distance accuracies" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2
