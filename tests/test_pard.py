"""PARD (models/pard.py): the drafter kind, its one-forward decoding (eval/proposers.py TokenRows),
greedy and sampled losslessness, trees, the COD training layout and a tiny training run. Float64 tiny models."""

from __future__ import annotations

import json
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


def _one_row(prompt: list[int]):
    from draftsmith.eval.accept import Sampler
    from draftsmith.eval.batch_decoder import _Row
    from draftsmith.eval.decoder import DecodeStats

    return _Row(0, torch.tensor(prompt), 64, Sampler(0.0), DecodeStats())


@torch.no_grad()
def test_drafts_are_the_argmax_of_each_parallel_distribution(target):
    """One step by hand: the chain's drafts are the argmax at cur and at each mask of one forward; the mask slots
    are rolled back and the next step reads the accepted drafts first."""
    from draftsmith.eval.proposers import TokenRows, proposer_for
    from draftsmith.eval.shapes import Verdict

    drafter = tiny_pard(target)
    assert proposer_for(drafter) is TokenRows
    prop = TokenRows(target, drafter, 64)
    assert prop.pard and prop.depth == drafter.parallel_drafts
    row, prompt = _one_row([3, 14, 15, 92, 65]), torch.tensor([[3, 14, 15, 92, 65]])
    prop.join([row], prompt, None, torch.arange(5)[None], {}, [0])
    pick = lambda lg, live: (lg.argmax(-1), None)  # noqa: E731
    toks, _, count = prop.draft([row], torch.tensor([7]), [3], pick)
    m = drafter.cfg.vocab_size
    want = drafter(torch.tensor([[3, 14, 15, 92, 65, 7, m, m]]))[0, -3:].argmax(-1)
    assert torch.cat(toks).tolist() == want.tolist() and count == [3]
    assert prop.rc.length == 6 and row.dpos == 6  # the mask slots are rolled back at once
    v = Verdict([want[:2].tolist()], [[0, 1, 2]], [0], [0], torch.tensor([2]))
    prop.commit([row], torch.tensor([7]), torch.stack(toks, 1), v, {})
    assert prop.rc.length == 6 and row.unread.tolist() == want[:2].tolist()
    toks2, _, _ = prop.draft([row], torch.tensor([9]), [2], pick)
    ref = drafter(torch.tensor([[3, 14, 15, 92, 65, 7, *want[:2].tolist(), 9, m]]))[0, -2:].argmax(-1)
    assert torch.cat(toks2).tolist() == ref.tolist()


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
        kinds = "".join(k for k, _ in ev.log)  # the prefill reads the prompt (and checks the vocabulary) first
        assert kinds.startswith("TD") and "DD" not in kinds[2:] and st.accepted > 0


@torch.no_grad()
def test_static_tree_nodes_are_ranked_tokens_of_their_depths_distribution(target):
    from draftsmith.eval.proposers import TokenRows

    drafter = tiny_pard(target)
    prop = TokenRows(target, drafter, 64)
    row = _one_row([5, 6])
    prop.join([row], torch.tensor([[5, 6]]), None, torch.arange(2)[None], {}, [0])
    spec = TREES["static"]
    from draftsmith.kernels.tree import tree_mask

    tokens = prop.static_tree([row], torch.tensor([8]), spec, tree_mask(torch.tensor(spec.parents))[0], 16)[0][0]
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
    """At B > 1 (eval/batch_decoder.py) every row drafts PARD's way too: one drafter forward per batched step, over each
    row's unread tokens, cur and the masks; every row equals its batch-1 decode, tokens and per-step acceptance."""
    from draftsmith.eval.batch_decoder import BatchDecoder

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
    from draftsmith.eval.tree import choices_from_run, run_accuracies
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
    # per-distance rank accuracies: `draftsmith tree` builds static trees from them as from heads' ones
    acc = run_accuracies(run)
    assert len(acc) == 3 and all(len(a) == 3 for a in acc) and all(0 <= v <= 1 for a in acc for v in a)
    assert acc[0][0] == rows[-1]["top1_draft0"] and acc[2][0] == rows[-1]["top1_draft2"]
    choices = choices_from_run(run, 5)
    assert len(choices) == 5 and choices[0] == [0] and all(len(c) <= 3 for c in choices)
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


# ---- the mask token, recipe checks, export --------------------------------------------------------------------------


def test_a_reserved_mask_token_inside_the_vocabulary_decodes_losslessly(target, ar_outputs):
    """drafter.mask_token: an id of the target's vocabulary stands for the mask (its input embedding is
    mask_embed); decoding feeds that id and stays lossless. An id outside the vocabulary is a one-line error."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.registry import build_drafter

    d = build_drafter("pard", {"n_layers": 2, "mask_token": 3}, target).double().eval()
    assert d.cfg.mask_id == 3 and d.embed_tokens.weight.shape[0] == target.cfg.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(d.embed(torch.tensor([[3]]))[0, 0], d.mask_embed)
    d.layers.load_state_dict(noisy_copy(target).layers.state_dict())
    ev = Events(target, d)
    for prompt in DECODE_PROMPTS:
        out, _ = speculative_generate(target, d, torch.tensor(prompt), NEW, draft_len=3)
        assert out == ar_outputs[tuple(prompt)]
    ev.close()
    assert any(bool((ids == 3).any()) for k, ids in ev.log if k == "D")
    with pytest.raises(DraftsmithError, match="mask_token=97 is outside"):
        build_drafter("pard", {"mask_token": 97}, target)


def test_recipe_checks_init_layers_length_for_pard(tiny_overrides):
    from draftsmith.errors import DraftsmithError
    from draftsmith.recipes.loader import load_recipe

    with pytest.raises(DraftsmithError, match="init_layers has 1 entries but n_layers is 2"):
        load_recipe("tiny", [*tiny_overrides, "drafter.kind=pard", "drafter.n_layers=2"])


@pytest.fixture(scope="module")
def pard_checkpoints(tmp_path_factory, tiny_model_dir):
    """Saved PARD drafters for the tiny HF target: the mask appended or a reserved id, with tied or untied
    embeddings, and a reduced head."""
    from dataclasses import replace

    from draftsmith.models.llama import Llama
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import build_drafter, save_drafter

    tgt = load_model(str(tiny_model_dir)).model
    root, out = tmp_path_factory.mktemp("pard-ckpts"), {}
    counts = torch.arange(tgt.cfg.vocab_size, dtype=torch.float64)
    assert tgt.cfg.tie_embeddings  # as SmolLM2's; the "untied" drafters come from an untied copy
    untied = Llama(replace(tgt.cfg, tie_embeddings=False))
    untied.load_state_dict({**tgt.state_dict(), "lm_head.weight": tgt.embed_tokens.weight * 0.5})
    sections = {
        "appended": {"n_layers": 1, "pard_k": 3},
        "reserved": {"n_layers": 1, "pard_k": 3, "mask_token": 5},
        "vocab": {"n_layers": 1, "pard_k": 3, "draft_vocab": 120},
        "untied-appended": {"n_layers": 1, "pard_k": 3},
        "untied-reserved": {"n_layers": 1, "pard_k": 3, "mask_token": 5},
    }
    for i, (name, section) in enumerate(sections.items()):
        torch.manual_seed(i)
        d = build_drafter("pard", section, untied if name.startswith("un") else tgt, counts=counts, eos_ids={2})
        assert d.cfg.tie_embeddings == (name in ("appended", "reserved"))
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        meta = {"target": str(tiny_model_dir), "recipe": f"test-pard-{name}", "step": 3}
        out[name] = save_drafter(root / name / "checkpoints" / "final", d, "pard", meta)
    return tgt, out


@pytest.mark.parametrize("name", ["appended", "reserved", "vocab", "untied-appended", "untied-reserved"])
def test_hf_export_is_a_llama_folder_with_the_mask_token_in_its_config(pard_checkpoints, tmp_path, name):
    """--format hf writes a plain LlamaForCausalLM with pard_token and pard_k in config.json: transformers gives
    our logits on ids with the mask token in them (an appended mask adds one row, whose logit is the mean of the
    others, so never the argmax); load_export reads it back to the same greedy decode."""
    from transformers import AutoModelForCausalLM

    from draftsmith.export.writer import export, load_export
    from draftsmith.models.registry import load_drafter

    tgt, ckpts = pard_checkpoints
    out = export(ckpts[name], "hf", tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    drafter, _ = load_drafter(ckpts[name])
    V = tgt.cfg.vocab_size
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["pard_k"] == 3
    assert cfg["pard_token"] == drafter.cfg.mask_id and cfg["vocab_size"] == (V if name.endswith("reserved") else V + 1)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    m = drafter.cfg.mask_id
    ids = torch.tensor([[4, 9, 17, 33, m, m]])
    with torch.no_grad():
        logits = hf(ids).logits
        ours = drafter(ids)
    kept = torch.isfinite(ours)  # a reduced head: -inf outside its rows in ours, the mean row's logit in HF's
    torch.testing.assert_close(logits[..., :V][kept], ours[kept], rtol=1e-4, atol=1e-4)
    assert bool((logits[..., :V].argmax(-1) == ours.argmax(-1)).all())
    if not name.endswith("reserved"):
        assert bool((logits[..., V] < logits[..., :V].max(-1).values).all())
    back, info = load_export(out, tgt)
    assert isinstance(back, Pard) and back.cfg == drafter.cfg
    prompt = torch.tensor([3, 14, 15, 92, 65])
    (a, sa), (b, sb) = (speculative_generate(tgt, d, prompt, 16, draft_len=3) for d in (back, drafter))
    assert a == b and sa.accept_counts == sb.accept_counts


def test_vllm_export_needs_a_reserved_mask_token(pard_checkpoints, tmp_path):
    """--format vllm: vLLM's draft-model path needs the target's vocabulary size and reads the mask id from
    config.json's pard_token; an appended mask is refused in one line, a reserved id exports."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.export.writer import export

    _, ckpts = pard_checkpoints
    with pytest.raises(DraftsmithError, match="mask_token"):
        export(ckpts["appended"], "vllm", tmp_path / "a")
    out = export(ckpts["reserved"], "vllm", tmp_path / "r")
    assert json.loads((out / "config.json").read_text())["pard_token"] == 5
    assert '"parallel_drafting": true' in (out / "README.md").read_text()


def test_stop_rules_shorten_pard_blocks_and_stay_lossless(target, ar_outputs):
    """The chain stop hooks over the precomputed distributions: a confidence rule that trusts nothing drafts
    nothing (plain target steps), an entropy rule shortens blocks; the output stays the target's."""
    from draftsmith.models.acceptance import ConfidenceStop, EntropyStop

    drafter, x = tiny_pard(target), torch.tensor(DECODE_PROMPTS[2])
    want = ar_outputs[tuple(DECODE_PROMPTS[2])]
    _, fixed = speculative_generate(target, drafter, x, NEW, draft_len=3)
    out, never = speculative_generate(
        target, drafter, x, NEW, draft_len=3, stop_drafting=ConfidenceStop(1e-9, min_len=0)
    )
    assert out == want and never.drafted == 0
    out, short = speculative_generate(target, drafter, x, NEW, draft_len=3, stop_drafting=EntropyStop(threshold=3.0))
    assert out == want and 0 < short.drafted < fixed.drafted
    check_tau_consistency(short)


def test_init_from_a_trained_draft_lm_adapts_it(tmp_path):
    """PARD's own use: drafter.init_from a draft_lm checkpoint gives a Pard with that draft's weights (so its
    draft-1 distribution is the autoregressive draft's) and a fresh mask embedding."""
    from draftsmith.models.registry import build_drafter, save_drafter

    target = tiny_model(0).float()
    ar = build_drafter("draft_lm", {"n_layers": 1}, target)
    with torch.no_grad():
        for p in ar.layers.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ckpt = save_drafter(tmp_path / "ar", ar, "draft_lm", {})
    pard = build_drafter("pard", {"init_from": str(ckpt), "pard_k": 2}, target)
    assert isinstance(pard, Pard) and pard.cfg.n_layers == 1 and pard.mask_embed.requires_grad
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(pard(ids), ar(ids))


def test_reduced_vocabulary_pard_decodes_and_trains(target, ar_outputs):
    """drafter.draft_vocab: the head keeps the most frequent ids (here the highest); decoding stays lossless and
    the COD objective with CE drops positions whose label the head lacks, at every distance."""
    from draftsmith.models.registry import build_drafter
    from draftsmith.recipes.schema import LossConfig
    from draftsmith.train.objectives import Context, pard_objective

    counts = torch.arange(target.cfg.vocab_size, dtype=torch.float)
    d = build_drafter("pard", {"n_layers": 2, "draft_vocab": 48}, target, counts=counts, eos_ids={2}).double()
    d.layers.load_state_dict(noisy_copy(target).layers.state_dict())
    d.eval()
    for prompt in DECODE_PROMPTS:
        assert speculative_generate(target, d, torch.tensor(prompt), NEW, draft_len=3)[0] == ar_outputs[tuple(prompt)]
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    pm = torch.zeros(2, 20, dtype=torch.bool)
    pm[:, 3:19] = True
    batch = {"input_ids": ids, "predict_mask": pm, "labels": ids[:, 1:][pm[:, :-1]]}
    ctx = Context(unwrapped=d, generator=torch.Generator().manual_seed(0), params=drafter_spec_section("pard"))
    out = pard_objective(d.train(), batch, LossConfig(kind="ce"), ctx)
    kept = int((d.t2d[batch["labels"]] >= 0).sum())  # the labels the head has (EOS 2 and ids 50..96)
    assert out.n == kept and torch.isfinite(out.loss_sum)
    out.loss_sum.backward()
    assert d.mask_embed.grad is not None and bool(d.mask_embed.grad.abs().sum() > 0)
