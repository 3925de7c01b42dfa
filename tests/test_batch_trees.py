"""Trees and judged chains at B > 1 (eval/shapes.py through ``BatchDecoder``, every row's tree drafted as one
batch): every row decodes exactly as
its prompt would alone. Greedy rows equal ``autoregressive_generate`` and their own batch-1 tree decode (same
accepted count at every step) for every proposer kind, static and dynamic trees, B in {1, 2, 5, 8} with ragged
prompts under a cache so tight that the holes left by rejected branches are compacted again and again; sampled
rows follow the target's distribution; EOS on an accepted path ends only its row; rows join and leave; a row does
not depend on its neighbours; judged rows equal their own batch-1 judged decode."""

# ruff: noqa: F811  (the module fixtures tgt, prompts and ar are test_batch_decode's: the same target and prompts)
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import PROPOSER_KINDS, TINY_CFG8, exact_joint, tiny_drafter, tiny_model, tv
from test_batch_decode import LENS, NEW, ar, check_caches, make_drafter, prompts, run, tgt  # noqa: F401

from draftsmith.eval.batch_decoder import BatchDecoder, speculative_generate_batch
from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.eval.tree import TREE_RULES, DynamicTree, tree_from_choices

pytestmark = pytest.mark.usefixtures("one_thread")

TREES = {
    "static": tree_from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    "dynamic": DynamicTree(top_k=3, depth=3, total_tokens=8),
}


@pytest.fixture(scope="module")
def singles(tgt, prompts):
    """Per (kind, tree): the drafter and each prompt's own batch-1 tree decode (tokens, stats)."""
    cache = {}

    def get(kind, tree):
        if (kind, tree) not in cache:
            d = make_drafter(kind, tgt)
            cache[kind, tree] = d, [speculative_generate(tgt, d, p, NEW, tree=TREES[tree]) for p in prompts]
        return cache[kind, tree]

    return get


def tight(tgt, drafter, tree, B, **kw) -> BatchDecoder:
    """A decoder whose cache holds only the longest row's own need, so rejected branches' holes force compaction."""
    room = BatchDecoder(tgt, drafter, tree=tree, **kw).room
    return BatchDecoder(tgt, drafter, tree=tree, max_len=max(LENS[:B]) + NEW + room + 4, **kw)


@pytest.mark.parametrize("B", [1, 2, 5, 8])
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("kind", PROPOSER_KINDS)
def test_greedy_tree_rows_equal_their_own_decode(tgt, prompts, ar, singles, kind, tree, B):
    drafter, ref = singles(kind, tree)
    dec = tight(tgt, drafter, TREES[tree], B)
    ids = [dec.add(p, NEW) for p in prompts[:B]]
    outs = run(dec, ids)
    for b, i in enumerate(ids):
        assert outs[i] == ar[b], (kind, tree, B, b)
        assert outs[i] == ref[b][0]
        assert dec.stats[i].accepted_per_step == ref[b][1].accepted_per_step, (kind, tree, B, b)
        assert dec.stats[i].drafted == ref[b][1].drafted and dec.stats[i].new_tokens == NEW
    if B == 8:
        assert len({dec.stats[i].accepted for i in ids}) > 1  # the rows' accepted paths really were ragged
        assert dec.rc.compactions > 0


def test_accepted_paths_leave_the_top_branch(tgt, prompts, singles):
    """The trees above are only a test if some accepted paths leave the top-1 branch (a hole below a kept slot)."""
    drafter, _ = singles("draft_lm", "static")
    dec = BatchDecoder(tgt, drafter, tree=TREES["static"], max_len=200)
    for p in prompts:
        dec.add(p, NEW)
    holes = 0
    while dec.active():
        dec.step()
        if dec.rows:
            v = dec.rc.view.valid[:, : dec.rc.length]
            first = v.int().argmax(1)  # each row's first valid slot: a hole is an invalid slot after it
            holes += int(sum((~v[b, first[b] :]).sum() for b in range(v.shape[0])))
    assert holes > 0


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("kind", ["draft_lm", "hydra++", "eagle3"])
def test_eos_on_an_accepted_path_ends_only_its_row(tgt, prompts, ar, kind, tree):
    drafter = tgt if kind == "draft_lm" else make_drafter(kind, tgt)  # the target drafting for itself: long paths
    eos = {ar[2][9]}
    want = []
    for a in ar:
        cut = next((j + 1 for j, t in enumerate(a) if t in eos), len(a))
        want.append(a[:cut])
    assert len({len(w) for w in want}) > 1
    outs, stats = speculative_generate_batch(tgt, drafter, prompts, NEW, tree=TREES[tree], eos_ids=eos)
    assert outs == want
    assert [s.new_tokens for s in stats] == [len(w) for w in want]


@pytest.mark.parametrize("kind", PROPOSER_KINDS)
def test_tree_rows_join_and_leave_mid_run(tgt, prompts, ar, kind):
    dec = BatchDecoder(tgt, make_drafter(kind, tgt), tree=TREES["dynamic"], max_len=160)
    outs: dict[int, list[int]] = {}

    def step(n=1):
        for _ in range(n):
            for i, toks in dec.step().items():
                outs.setdefault(i, []).extend(toks)
            if dec.rows:
                check_caches(dec)

    a, b, c = dec.add(prompts[1], NEW), dec.add(prompts[5], NEW), dec.add(prompts[7], 2)
    step(3)
    assert c not in dec.active() and outs[c] == ar[7][:2]
    d, e = dec.add(prompts[2], NEW), dec.add(prompts[0], 5)
    step(2)
    dec.remove(b)
    f = dec.add(prompts[6], 1)
    step()
    assert outs[f] == ar[6][:1] and f not in dec.active()
    step(200)
    assert not dec.active()
    assert outs[a] == ar[1] and outs[d] == ar[2] and outs[e] == ar[0][:5]
    assert outs[b] == ar[5][: len(outs[b])] and 0 < len(outs[b]) < NEW


@pytest.mark.parametrize("kind", ["draft_lm", "hydra++", "eagle3"])
def test_a_tree_row_does_not_depend_on_its_neighbours(tgt, prompts, singles, kind):
    drafter, _ = singles(kind, "static")
    x = prompts[3]
    results = []
    for batch in ([x], [prompts[2], x, prompts[0]], [x, *prompts[4:8]]):
        dec = BatchDecoder(tgt, drafter, tree=TREES["static"], max_len=150)
        ids = [dec.add(p, NEW) for p in batch]
        outs = run(dec, ids, check=False)
        i = ids[[k for k, p in enumerate(batch) if p is x][0]]
        results.append((outs[i], dec.stats[i].accepted_per_step))
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("rule", TREE_RULES)
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("kind", PROPOSER_KINDS)
def test_sampled_tree_rows_follow_the_target_distribution(kind, tree, rule):
    """4,000 rows of one prompt in one batch, temperature 1, tree verification by each rule (the point-mass walk
    over top-k children, recursive or SpecTr rejection over sampled ones): the joint of their first three tokens
    matches the target's exact joint; greedy rows in the same batch stay exact."""
    spec = {
        "static": tree_from_choices([[0], [1], [0, 0]], rule),
        "dynamic": DynamicTree(top_k=2, depth=2, total_tokens=4, sampling=rule),
    }
    _sampled_joint(kind, spec[tree])


@pytest.mark.parametrize("rule", TREE_RULES)
@pytest.mark.parametrize("kind", ["draft_lm", "eagle3", "glide"])
@pytest.mark.parametrize("tree", ["cape", "dyspec"])
def test_sampled_cape_and_dyspec_rows_follow_the_target_distribution(kind, rule, tree):
    spec = {
        "cape": DynamicTree(top_k=2, depth=3, total_tokens=4, sampling=rule, frontier=1),
        "dyspec": DynamicTree(top_k=2, depth=3, total_tokens=6, sampling=rule, min_prob=0.1),
    }
    _sampled_joint(kind, spec[tree], N=8000)  # three levels: the third token's marginal is the noisiest


DYSPEC = DynamicTree(top_k=3, depth=4, total_tokens=12, min_prob=0.2)


@pytest.mark.parametrize("kind", ["draft_lm", "eagle3", "hydra", "glide"])
def test_dyspec_trees_keep_the_nodes_above_min_prob_and_stay_lossless_in_batches(tgt, prompts, ar, kind):
    """min_prob (DySpec): a level is drafted only while a frontier node reaches min_prob; the kept nodes are those
    that reach it (the row with the most keeps exactly those; at least one node); greedy rows of a batch equal
    their own decode."""
    from draftsmith.eval.shapes import tree_levels

    _five_rows_equal_their_own_decode(tgt, prompts, ar, kind, DYSPEC)
    B, V = 2, 11
    sharp = torch.full((V,), -9.0)
    sharp[3] = 9.0  # p(3) ~ 1: a confident draft
    root = torch.stack([sharp, torch.zeros(V)])  # row 0 sure, row 1 unsure (uniform: 1/11 < 0.2 everywhere)
    fed = []

    def level(run, tokens, states, d, base, n_fed, anc, paths):
        fed.append(d)
        return sharp.expand(B, tokens.shape[1], V).clone(), None

    toks, parents, mask, depths, _ = tree_levels(SimpleNamespace(passes_state=False), root, None, 0, DYSPEC, level)
    assert fed == [1, 2, 3]  # row 0's chain stays above 0.2 to the full depth
    assert toks.shape[1] == 4 and toks[0].tolist() == [3] * 4  # its 4-deep chain; row 1 keeps 4 nodes as well
    assert depths[0].tolist() == [0, 1, 2, 3, 4]
    fed.clear()
    toks, *_ = tree_levels(SimpleNamespace(passes_state=False), torch.zeros(B, V), None, 0, DYSPEC, level)
    assert fed == [] and toks.shape[1] == 1  # nothing reaches 0.2: one node, no drafter forward after the root


def _sampled_joint(kind: str, spec, N: int = 4000) -> None:
    t = tiny_model(0, TINY_CFG8, logit_scale=3.0)
    torch.manual_seed(5)
    drafter = tiny_drafter(kind, t, heads=3, noise=0.3, lm_noise=0.5)
    prompt = [1, 2, 3, 4]
    gen = torch.Generator().manual_seed(0)
    dec = BatchDecoder(t, drafter, tree=spec, max_len=32)
    ids = [dec.add(torch.tensor(prompt), 3, temperature=1.0, generator=gen) for _ in range(N)]
    greedy = [dec.add(torch.tensor(prompt), 3) for _ in range(3)]
    outs = run(dec, ids + greedy, check=False)
    assert all(outs[i] == autoregressive_generate(t, torch.tensor(prompt), 3) for i in greedy)
    counts = torch.zeros(*[t.cfg.vocab_size] * 3)
    for i in ids:
        counts[tuple(outs[i])] += 1
    emp, joint = counts / N, exact_joint(t, prompt, 3)
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert tv(emp.sum(dims), joint.sum(dims)) < 0.03, dims
    assert tv(emp.sum(2), joint.sum(2)) < 0.06
    acc = sum(dec.stats[i].accepted for i in ids)
    assert 0.05 * N < acc  # some sampled rows walked into the tree


def _five_rows_equal_their_own_decode(tgt, prompts, ar, kind: str, tree) -> None:
    """Greedy rows of ragged prompts in one batch under a tight cache equal their own plain decode."""
    dec = tight(tgt, make_drafter(kind, tgt), tree, 5)
    ids = [dec.add(p, NEW) for p in prompts[:5]]
    outs = run(dec, ids)
    assert all(outs[i] == ar[b] for b, i in enumerate(ids))


CAPE = DynamicTree(top_k=3, depth=4, total_tokens=8, frontier=1)


@pytest.mark.parametrize("kind", ["draft_lm", "eagle3", "hydra", "glide"])
def test_cape_trees_are_the_top1_chain_plus_siblings_and_lossless_in_batches(tgt, prompts, ar, kind):
    """frontier=1 (CaPE): every kept node is the top-1 chain's node or a child of one, the chain's nodes are the
    only ones expanded; greedy rows of a batch equal their own decode."""
    from draftsmith.eval.shapes import tree_levels

    _five_rows_equal_their_own_decode(tgt, prompts, ar, kind, CAPE)
    B, V = 3, 11
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0))

    def level(run, tokens, states, d, base, n_fed, anc, paths):
        assert tokens.shape[1] == 1  # one node expanded per level
        return torch.randn(B, 1, V, generator=torch.Generator().manual_seed(d)), None

    toks, parents, mask, depths, _ = tree_levels(SimpleNamespace(passes_state=False), logits, None, 0, CAPE, level)
    for b in range(B):
        par = parents[b].tolist()
        expanded = {p for p in par if p >= 0}
        assert len({int(depths[b, 1 + p]) for p in expanded}) == len(expanded)  # one expanded node per depth


class _StateJudge:
    """A judge whose verdict depends on the target state it is shown: keeps a draft when state[0] > 0."""

    def accepts(self, states):
        return states[:, 0] > 0


@pytest.mark.parametrize("B", [1, 2, 5, 8])
def test_judged_rows_equal_their_own_judged_decode(tgt, prompts, B):
    """Lossy Judge-Decoding chains at B > 1: each row's output, accepted counts and judged count equal its own
    batch-1 judged decode (the judge reads each row's own states at its own drafts)."""
    drafter, judge = make_drafter("draft_lm", tgt), _StateJudge()
    ref = [speculative_generate(tgt, drafter, p, NEW, draft_len=3, judge=judge) for p in prompts[:B]]
    assert sum(st.judge_accepted for _, st in ref) > 0
    outs, stats = speculative_generate_batch(tgt, drafter, prompts[:B], NEW, draft_len=3, judge=judge)
    for b in range(B):
        assert outs[b] == ref[b][0], b
        assert stats[b].accepted_per_step == ref[b][1].accepted_per_step
        assert stats[b].judge_accepted == ref[b][1].judge_accepted


def test_what_batch_one_refuses_is_refused(tgt, prompts):
    drafter = make_drafter("draft_lm", tgt)
    with pytest.raises(ValueError, match="stop_drafting"):
        BatchDecoder(tgt, drafter, tree=TREES["static"], stop_drafting=lambda *a: True)
    with pytest.raises(ValueError, match="drafter"):
        BatchDecoder(tgt, None, tree=TREES["static"])
    with pytest.raises(ValueError, match="judge"):
        BatchDecoder(tgt, drafter, judge=_StateJudge()).add(prompts[0], 4, temperature=1.0)
    with pytest.raises(ValueError, match="judge"):
        BatchDecoder(tgt, make_drafter("medusa", tgt), judge=_StateJudge())
    with pytest.raises(ValueError, match="heads"):
        BatchDecoder(tgt, make_drafter("medusa", tgt), tree=tree_from_choices([[0]] + [[0] * d for d in range(2, 7)]))


@pytest.mark.parametrize("shape", ["chain", "static", "dynamic"])
@pytest.mark.parametrize("kind", PROPOSER_KINDS)
def test_steps_without_speculation_keep_every_row_exact(tgt, prompts, ar, kind, shape):
    """``step(speculate=False)`` (the server above online.speculate_max_batch) drafts nothing; steps with and
    without drafts mixed leave every row equal to the target's own greedy output and every cache consistent."""
    drafter = make_drafter(kind, tgt)
    tree = None if shape == "chain" else TREES[shape]
    dec = BatchDecoder(tgt, drafter, draft_len=3, tree=tree, max_len=200)
    ids = [dec.add(p, NEW) for p in prompts[:5]]
    outs, n, plain = {i: [] for i in ids}, 0, 0
    while dec.active():
        speculate = n % 3 != 1
        for i, toks in dec.step(speculate=speculate).items():
            outs[i] += toks
        if dec.rows:
            check_caches(dec)
        plain += not speculate
        n += 1
    assert all(outs[i] == ar[b] for b, i in enumerate(ids)), (kind, shape)
    assert plain > 3 and sum(dec.stats[i].accepted for i in ids) > 0
