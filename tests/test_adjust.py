"""A request's logit adjustments (OpenAI's presence / frequency penalties, logit_bias, min_tokens: eval/accept.py
``Adjust``) and the target's logprobs, through the batch decoder (eval/batch_decoder.py) for chains, trees and plain
decoding. The reference is written here independently: a full forward per token, the penalties counted by hand."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CFG8, noisy_copy, tiny_eagle, tiny_heads, tiny_model, tv
from test_batch_decode import LENS, make_drafter, prompts, run, tgt  # noqa: F401

from draftsmith.eval.accept import Adjust
from draftsmith.eval.batch_decoder import BatchDecoder
from draftsmith.eval.tree import tree_from_choices

pytestmark = pytest.mark.usefixtures("one_thread")

TREE = tree_from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
EOS = 2
ADJ = Adjust(presence=0.4, frequency=1.5, bias=((3, 2.0), (5, -50.0)), min_tokens=6, banned=(EOS,))


def adjusted(logits: torch.Tensor, generated: list[int], adj: Adjust) -> torch.Tensor:
    """OpenAI's rule on one position's logits (V,), by hand."""
    x = logits.double().clone()
    for t, v in adj.bias:
        x[t] += v
    for t in set(generated):
        c = generated.count(t)
        x[t] -= adj.frequency * c + adj.presence
    if len(generated) < adj.min_tokens:
        x[list(adj.banned)] = float("-inf")
    return x


def reference(model, prompt: list[int], n: int, adj: Adjust) -> list[int]:
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out]))[0, -1]
        t = int(adjusted(logits, out, adj).argmax())
        out.append(t)
        if t == EOS:
            break
    return out


@pytest.mark.parametrize(
    "kind,tree", [("plain", None), ("draft_lm", None), ("eagle3", None), ("hydra++", None), ("eagle3", TREE),
                  ("medusa", TREE)],
)  # fmt: skip
def test_greedy_rows_follow_the_adjusted_argmax(tgt, prompts, kind, tree):  # noqa: F811
    """Rows with and without adjustments in one batch: each equals its own reference (the adjusted rows differ
    from the plain ones, so the adjustment is applied, and only to its own row)."""
    drafter = make_drafter(kind, tgt)
    dec = BatchDecoder(tgt, drafter, draft_len=3, eos_ids={EOS}, tree=tree, max_len=200)
    ids = {}
    for p in prompts[:4]:
        ids[dec.add(p, 24, adjust=ADJ)] = (p, ADJ)
        ids[dec.add(p, 24)] = (p, Adjust())
    outs = run(dec, list(ids), check=False)
    changed = 0
    for rid, (p, adj) in ids.items():
        want = reference(tgt, p.tolist(), 24, adj)
        assert outs[rid] == want, (kind, rid)
        changed += adj is ADJ and want != reference(tgt, p.tolist(), 24, Adjust())
    assert changed >= 3
    if kind in ("draft_lm", "eagle3"):  # (random heads accept nothing on this target)
        assert sum(dec.stats[i].accepted for i in ids) > 0


def _adjusted_joint(model, prompt: list[int], depth: int, adj: Adjust) -> torch.Tensor:
    V = model.cfg.vocab_size
    joint = torch.zeros(*[V] * depth, dtype=torch.float64)
    for seq in torch.cartesian_prod(*[torch.arange(V)] * depth).view(-1, depth).tolist():
        with torch.no_grad():
            logits = model(torch.tensor([prompt + seq[:-1]]))[0, len(prompt) - 1 :]
        p = 1.0
        for i, t in enumerate(seq):
            p *= float(torch.softmax(adjusted(logits[i], seq[:i], adj), -1)[t])
        joint[tuple(seq)] = p
    return joint


@pytest.mark.parametrize("kind", ["draft_lm", "eagle3", "medusa-tree"])
def test_sampled_rows_follow_the_adjusted_distribution(kind):
    """3,000 rows at temperature 1 with penalties, a bias and min_tokens: the joint of their first three tokens
    matches the adjusted distribution, enumerated exactly, while drafts are both accepted and rejected."""
    t = tiny_model(0, TINY_CFG8, logit_scale=3.0)
    torch.manual_seed(5)
    drafter = {"draft_lm": noisy_copy(t, 0.5), "eagle3": tiny_eagle(3, t, 0.3),
               "medusa-tree": tiny_heads("medusa", t, 2, 0.3)}[kind]  # fmt: skip
    tree = tree_from_choices([[0], [1], [0, 0]]) if kind.endswith("tree") else None
    adj = Adjust(presence=0.3, frequency=0.8, bias=((1, 1.0),), min_tokens=2, banned=(0,))
    prompt, N = [1, 2, 3, 4], 3000
    gen = torch.Generator().manual_seed(0)
    dec = BatchDecoder(t, drafter, draft_len=2, max_len=32, tree=tree)
    ids = [dec.add(torch.tensor(prompt), 3, temperature=1.0, generator=gen, adjust=adj) for _ in range(N)]
    outs = run(dec, ids, check=False)
    counts = torch.zeros(*[t.cfg.vocab_size] * 3, dtype=torch.float64)
    for i in ids:
        counts[tuple(outs[i])] += 1
    emp, joint = counts / N, _adjusted_joint(t, prompt, 3, adj)
    assert float(emp[0].sum()) == 0 and float(emp[:, 0].sum()) == 0  # min_tokens: token 0 never comes first
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert tv(emp.sum(dims), joint.sum(dims)) < 0.035, dims
    acc = sum(dec.stats[i].accepted for i in ids)
    assert 0.05 * N < acc < 0.95 * sum(dec.stats[i].drafted for i in ids)


@pytest.mark.parametrize("kind,tree", [("plain", None), ("draft_lm", None), ("eagle3", TREE)])
def test_logprobs_are_the_targets_own(tgt, prompts, kind, tree):  # noqa: F811
    """Each emitted token's logprob and top-3 equal the target's raw log-softmax at its position (a full forward),
    whatever the drafter proposed and whatever the adjustment changed; rows without logprobs report none."""
    dec = BatchDecoder(tgt, make_drafter(kind, tgt), draft_len=3, eos_ids={EOS}, tree=tree, max_len=200)
    ids = [dec.add(p, 20, logprobs=3, adjust=ADJ if i % 2 else None) for i, p in enumerate(prompts[:4])]
    other = dec.add(prompts[4], 20)
    outs = run(dec, [*ids, other], check=False)
    assert other not in dec.logprobs
    for rid, p in zip(ids, prompts[:4]):
        got = dec.logprobs.pop(rid)
        with torch.no_grad():
            lp = torch.log_softmax(tgt(torch.tensor([p.tolist() + outs[rid]]))[0, len(p) - 1 : -1].double(), -1)
        assert len(got) == len(outs[rid])
        for j, (tok, (val, top)) in enumerate(zip(outs[rid], got)):
            assert val == pytest.approx(float(lp[j, tok]), abs=1e-5)
            assert [v for _, v in top] == pytest.approx(lp[j].topk(3).values.tolist(), abs=1e-5)
            assert {i for i, _ in top} <= set(range(tgt.cfg.vocab_size))


def test_an_adjustment_changes_only_what_it_names():
    """Adjust.apply on a chain of drafts: the penalty at a draft position counts the drafts before it."""
    logits = torch.zeros(3, 6)
    Adjust(frequency=1.0).apply(logits, [4, 4], ids=torch.tensor([4, 1, 1]))
    assert logits[:, 4].tolist() == [-2, -2, -2] and logits[:, 1].tolist() == [0, -1, -2]
    assert float(logits[:, [0, 2, 3, 5]].abs().sum()) == 0
    logits = torch.zeros(3, 6)
    Adjust(min_tokens=3, banned=(2,)).apply(logits, [5], ids=torch.tensor([5, 1, 1]))
    assert logits[:, 2].tolist() == [float("-inf"), float("-inf"), 0]
