"""PARD (models/pard.py): the drafter kind, its one-forward decoding at batch 1 (eval/proposers.py PardProposer),
greedy and sampled losslessness, trees, the COD training layout and a tiny training run. Float64 tiny models."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import (
    DECODE_PROMPTS,
    NEW,
    TINY_CFG8,
    check_tau_consistency,
    exact_joint,
    noisy_copy,
    tiny_model,
    tv,
)

from draftsmith.eval.decoder import speculative_generate
from draftsmith.eval.tree import DynamicTree, tree_from_choices
from draftsmith.models.pard import Pard, PardConfig


def tiny_pard(target, k: int = 4, noise: float = 0.25) -> Pard:
    """A PARD drafter with a noisy copy of the target's weights: draft 1 is often right, later ones less."""
    src = noisy_copy(target, noise)
    pard = Pard(PardConfig(**target.cfg.to_dict(), pard_k=k)).double().eval()
    pard.load_state_dict(src.state_dict(), strict=False)
    with torch.no_grad():
        pard.mask_embed.copy_(pard.embed_tokens.weight.mean(0))
    return pard


class Events:
    """Forward calls of the target ("T") and the drafter ("D", with its input ids) in order."""

    def __init__(self, target, drafter):
        self.log: list[tuple[str, torch.Tensor]] = []
        self.handles = [
            target.register_forward_pre_hook(lambda m, a: self.log.append(("T", a[0]))),
            drafter.register_forward_pre_hook(lambda m, a: self.log.append(("D", a[0]))),
        ]

    def close(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("draft_len", [1, 2, 3, 4])
def test_greedy_chain_equals_target_with_one_drafter_forward_per_step(target, ar_outputs, one_thread, draft_len):
    """Greedy output equals the target's own token for token, and every step runs the drafter exactly once: one
    forward over (unread + cur + γ-1 masks), never two drafter forwards between target verifies."""
    drafter = tiny_pard(target)
    mask_id = drafter.cfg.vocab_size
    accepted = 0
    for prompt in DECODE_PROMPTS:
        ev = Events(target, drafter)
        out, st = speculative_generate(target, drafter, torch.tensor(prompt), NEW, draft_len=draft_len)
        ev.close()
        assert out == ar_outputs[tuple(prompt)], (draft_len, len(prompt))
        check_tau_consistency(st)
        accepted += st.accepted
        kinds = "".join(k for k, _ in ev.log)
        # the prefill, the vocabulary check, then one drafter forward per verify (the last step may have no budget)
        assert re.fullmatch(r"TD(DT)*T?", kinds), kinds
        for ids in [ids for k, ids in ev.log[2:] if k == "D"]:
            masks = int((ids == mask_id).sum())
            assert ids.shape[0] == 1 and masks < draft_len and bool((ids[0, -masks - 1 :] == mask_id).sum() == masks)
    assert accepted > 0


def test_drafts_are_the_argmax_of_each_parallel_distribution(target):
    """One step by hand: the chain's drafts are the argmax at cur and at each mask of one forward; the mask slots
    are rolled back and the next step reads the accepted drafts first."""
    from draftsmith.eval.accept import Sampler
    from draftsmith.eval.proposers import PardProposer, proposer_for

    drafter = tiny_pard(target)
    assert proposer_for(drafter) is PardProposer
    prop = PardProposer(target, drafter)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    prop.prefill(prompt, {}, 64, check_vocab=True)
    cur = torch.tensor([7])
    d = prop.chain(cur, 3, Sampler(0.0).pick)
    m = drafter.cfg.vocab_size
    want = drafter(torch.tensor([[3, 14, 15, 92, 65, 7, m, m]]))[0, -3:].argmax(-1)
    assert d.tokens.tolist() == want.tolist() and d.q is None
    assert prop.cache.length == 6 and prop.root_len == 6  # the mask slots are rolled back at once
    prop.commit(d, d.tokens[:2], [0, 1, 2], {})
    assert prop.cache.length == 6 and prop.unread.tolist() == want[:2].tolist()
    d2 = prop.chain(torch.tensor([9]), 2, Sampler(0.0).pick)
    ref = drafter(torch.tensor([[3, 14, 15, 92, 65, 7, *want[:2].tolist(), 9, m]]))[0, -2:].argmax(-1)
    assert d2.tokens.tolist() == ref.tolist()


def test_chain_longer_than_pard_k_is_capped(target, ar_outputs):
    drafter = tiny_pard(target, k=2)
    out, st = speculative_generate(target, drafter, torch.tensor(DECODE_PROMPTS[1]), NEW, draft_len=4)
    assert out == ar_outputs[tuple(DECODE_PROMPTS[1])] and len(st.accept_counts) == 3  # 0..2 accepted


TREES = {
    "static": tree_from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    "dynamic": DynamicTree(top_k=3, depth=3, total_tokens=8),
}


@pytest.mark.parametrize("shape", list(TREES))
def test_trees_are_lossless_with_one_drafter_forward(target, ar_outputs, shape):
    """Trees from the parallel distributions: the node at depth d is a top token of distribution d; greedy output
    equals the target's, and each step is still one drafter forward."""
    drafter = tiny_pard(target)
    for prompt in DECODE_PROMPTS:
        ev = Events(target, drafter)
        out, st = speculative_generate(target, drafter, torch.tensor(prompt), NEW, tree=TREES[shape])
        ev.close()
        assert out == ar_outputs[tuple(prompt)], (shape, len(prompt))
        check_tau_consistency(st)
        kinds = "".join(k for k, _ in ev.log)
        assert "DD" not in kinds and st.accepted > 0


def test_static_tree_nodes_are_ranked_tokens_of_their_depths_distribution(target):
    from draftsmith.eval.proposers import PardProposer

    drafter = tiny_pard(target)
    prop = PardProposer(target, drafter)
    prop.prefill(torch.tensor([[5, 6]]), {}, 64)
    spec = TREES["static"]
    tokens = prop.static_tree(torch.tensor([8]), spec, None)
    m = drafter.cfg.vocab_size
    logits = drafter(torch.tensor([[5, 6, 8, m, m]]))[0, -3:]
    for tok, d, r in zip(tokens.tolist(), spec.depths, spec.ranks):
        assert tok == int(logits[d - 1].topk(r + 1).indices[-1])


def test_sampling_keeps_the_target_distribution():
    """Rejection sampling with draft i drawn from its own q_i: the first three new tokens follow the target's
    exact joint (4,000 decodes)."""
    target = tiny_model(0, TINY_CFG8, logit_scale=3.0)
    drafter = tiny_pard(target, k=3, noise=0.5)
    gen = torch.Generator().manual_seed(0)
    prompt, depth, N = [1, 2, 3, 4], 3, 4000
    joint = exact_joint(target, prompt, depth)
    counts = torch.zeros_like(joint)
    acc = drafted = 0
    for _ in range(N):
        out, st = speculative_generate(target, drafter, torch.tensor(prompt), 4, draft_len=2, temperature=1.0,
                                       generator=gen)  # fmt: skip
        counts[tuple(out[:depth])] += 1
        acc, drafted = acc + st.accepted, drafted + st.drafted
    emp = counts / N
    assert 0.05 < acc / drafted < 0.95  # both accept and reject paths were exercised
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert tv(emp.sum(dims), joint.sum(dims)) < 0.03, dims
    assert tv(emp.sum(2), joint.sum(2)) < 0.05


def test_batched_rows_equal_their_own_decode_with_one_drafter_forward_per_step(target, ar_outputs, one_thread):
    """At B > 1 (eval/batch.py) every row drafts PARD's way too: one drafter forward per batched step, over each
    row's unread tokens, cur and the masks; every row equals its batch-1 decode, tokens and per-step acceptance."""
    from draftsmith.eval.batch import BatchDecoder

    drafter = tiny_pard(target)
    dec = BatchDecoder(target, drafter, draft_len=3, max_len=256)
    ids = {dec.add(torch.tensor(p), NEW): p for p in DECODE_PROMPTS}
    calls = []
    handle = drafter.register_forward_pre_hook(lambda m, a: calls.append(a[0]))
    outs, first, rows = {i: [] for i in ids}, True, 0
    while dec.active():
        calls.clear()
        for i, toks in dec.step().items():
            outs[i].extend(toks)
        mask_calls = [c for c in calls if bool((c == drafter.cfg.vocab_size).any())]
        assert len(calls) - (len(ids) if first else 0) <= 1 and len(mask_calls) <= 1  # prefills, then one per step
        rows = max([rows, *(c.shape[0] for c in mask_calls)])
        first = False
    assert rows == len(ids)  # the rows drafted together
    handle.remove()
    for i, p in ids.items():
        alone = speculative_generate(target, drafter, torch.tensor(p), NEW, draft_len=3)[1]
        assert outs[i] == ar_outputs[tuple(p)]
        assert dec.stats[i].accepted_per_step == alone.accepted_per_step


# ---- training: the COD layout and a tiny run ------------------------------------------------------------------------


def test_cod_segments_shrink_and_keep_every_masks_chain():
    """Segment i keeps int(N * max(0.7**i, 0.2)) response positions, each one's predecessor (segment i-1,
    position p-1) kept too, so every mask's chain is in the sequence."""
    from draftsmith.models.pard import cod_segments

    pm = torch.zeros(60, dtype=torch.bool)
    pm[10:50] = True  # N = 40 response positions
    segs = cod_segments(pm, 6, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert [s.numel() for s in segs] == [28, 19, 13, 9, 8]  # the last at the 0.2 floor
    prev = torch.arange(60)
    for s in segs:
        assert bool(pm[s].all()) and bool(torch.isin(s - 1, prev).all())
        prev = s


def test_cod_layout_shows_each_mask_what_decoding_shows_it(target):
    """The one training forward over the COD layout gives, at a mask of segment i at position p, exactly the logits
    decoding computes after the real tokens up to p - i and i masks; plain positions are the causal forward; each
    trained position's record row is the predict_mask row of the token it predicts (p + 1)."""
    from draftsmith.models.pard import cod_layout

    drafter = tiny_pard(target)
    m = drafter.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 90, (2, 14), generator=g)
    pm = torch.zeros(2, 14, dtype=torch.bool)
    pm[0, 4:13], pm[1, 2:9] = True, True  # different lengths: row 1 is padded
    lay = cod_layout(ids, pm, 4, m, 0.7, 0.2, g)
    assert lay.ids.shape[1] > 14 and bool((lay.ids[:, 14:] == m).all())
    with torch.no_grad():
        out = drafter(lay.ids, pos=lay.pos, attn_mask=lay.attn_mask)[lay.train]  # (M, V) row-major
        plain = drafter(ids)
    row = pm.flatten().long().cumsum(0).view(2, 14) - 1
    b_of = torch.arange(2)[:, None].expand_as(lay.train)[lay.train]
    seen = set()
    for t, (b, p, j, r) in enumerate(zip(b_of.tolist(), lay.pos[lay.train].tolist(), lay.dist.tolist(),
                                          lay.rows.tolist())):  # fmt: skip
        assert r == int(row[b, p])
        anchor = p - (j - 1)
        if j == 1:
            want = plain[b, p]
        else:
            with torch.no_grad():
                want = drafter(torch.cat([ids[b, : anchor + 1], torch.full((j - 1,), m)])[None])[0, -1]
        torch.testing.assert_close(out[t], want)
        seen.add(j)
    assert seen == {1, 2, 3, 4}


def test_pard_objective_fits_a_batch_at_every_distance(target):
    """The objective itself: Adam on one fixed batch (target-written tokens, top-k teacher from the target) drives
    the COD loss down and every distance's alpha up; the metrics name each distance."""
    from draftsmith.models.registry import build_drafter
    from draftsmith.recipes.schema import LossConfig
    from draftsmith.train.objectives import Context, pard_objective

    torch.manual_seed(0)
    drafter = build_drafter("pard", {"n_layers": 1, "pard_k": 3, "freeze_embeddings": False}, target).train()
    ids = torch.randint(0, 90, (2, 24))
    pm = torch.zeros(2, 24, dtype=torch.bool)
    pm[:, 4:23] = True
    with torch.no_grad():
        lp = torch.log_softmax(target(ids)[pm], -1)
    top = lp.topk(8, -1)
    batch = {"input_ids": ids, "predict_mask": pm, "labels": ids[:, 1:][pm[:, :-1]],
             "topk_ids": top.indices, "topk_logprobs": top.values.float()}  # fmt: skip
    section = drafter_spec_section("pard", pard_k=3)
    ctx = Context(unwrapped=drafter, generator=torch.Generator().manual_seed(0), params=section)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    losses, first = [], None
    for _ in range(40):
        out = pard_objective(drafter, batch, LossConfig(kind="fkl"), ctx)
        opt.zero_grad()
        (out.loss_sum / out.n).backward()
        opt.step()
        losses.append(float(out.loss_sum.detach()) / out.n)
        first = first if losses[1:] else out.metrics
    assert losses[-1] < 0.3 * losses[0], losses[::10]
    assert {"top1_draft0", "top1_draft1", "top1_draft2", "alpha_draft2", "tau_estimate"} <= set(out.metrics)
    assert all(out.metrics[f"alpha_draft{j}"] > first[f"alpha_draft{j}"] for j in range(3))
    assert out.metrics["cod_tokens"] > 1.5 and out.n == int(pm.sum())


def drafter_spec_section(kind: str, **fields):
    from draftsmith.models.registry import drafter_spec

    return drafter_spec(kind).section(fields)


def test_tiny_training_lowers_the_loss_and_the_checkpoint_decodes_losslessly(train_run, tiny_model_dir):
    """`draftsmith train` with drafter.kind=pard on the tiny records (sampled from a near-uniform random target, so
    the loss has little to learn): a finite, falling loss, per-distance metrics logged, and the final checkpoint
    loads as a Pard that decodes the target's greedy output."""
    import json

    from draftsmith.eval.decoder import autoregressive_generate
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import load_drafter

    run = train_run(
        "pard",
        "drafter.kind=pard",
        "drafter.pard_k=3",
        "drafter.freeze_embeddings=false",
        "train.loss.kind=ce",
        "train.steps=24",
        "train.lr=1e-2",
        "train.warmup_steps=0",
    )
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "train"]
    assert len(rows) == 24 and all(k in rows[0] for k in ("top1_draft0", "top1_draft2", "alpha", "cod_tokens"))
    loss = [r["loss"] for r in rows]
    assert all(x == x for x in loss) and sum(loss[-6:]) < sum(loss[:6])
    drafter, info = load_drafter(run / "checkpoints" / "final")
    assert info["kind"] == "pard" and isinstance(drafter, Pard) and drafter.cfg.pard_k == 3
    tgt = load_model(str(tiny_model_dir)).model
    for prompt in ([5, 6, 7], [20, 21, 22, 23, 24]):
        x = torch.tensor(prompt)
        out, st = speculative_generate(tgt, drafter, x, 16, draft_len=3)
        assert out == autoregressive_generate(tgt, x, 16)


def test_tiny_pipeline_runs_with_pard(tmp_path, tiny_overrides):
    """`draftsmith run tiny drafter.kind=pard`: generate, train, eval (lossless, one draft block per step) and the
    recipe's export, end to end."""
    import json

    from draftsmith.cli import main

    args = [*tiny_overrides, "target.dtype=float64", "drafter.kind=pard", "drafter.pard_k=3", "-q"]
    assert main(["run", "tiny", *args]) == 0
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0 and 1.0 <= report["tau"] <= 4.0
