"""SpecDec++ acceptance head (algorithms.md A7): the stop rules' arithmetic, the weighted soft-label BCE objective,
and the whole path on the tiny pipeline: draft LM -> SpecDec++ labels -> head training -> adaptive-length eval
(lossless) -> threshold sweep."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import drafter_kinds

from draftsmith.cli import main
from draftsmith.models.acceptance import (
    AcceptanceConfig,
    AcceptanceHead,
    AcceptanceHeadConfig,
    AcceptanceStop,
    ConfidenceStop,
    EntropyStop,
    acceptance_features,
)


def test_stop_rules():
    head = AcceptanceHead(AcceptanceConfig(dim=4, n_layers=1))
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(0.0)  # every draft predicted accepted with probability 0.5
    rule = AcceptanceStop(head, threshold=0.6, min_len=1)
    h = torch.zeros(4)
    # after 1 draft: P(some rejected) = 0.5 <= 0.6 -> go on; after 2: 0.75 > 0.6 -> stop
    assert [rule(1, None, h), rule(2, None, h)] == [False, True]
    assert rule(1, None, h) is False  # a new block resets the product
    assert AcceptanceStop(head, 0.4, min_len=3)(1, None, h) is False  # min_len wins
    flat, peaked = torch.zeros(8), torch.tensor([9.0] + [0.0] * 7)
    ent = EntropyStop(threshold=1.0)
    assert ent(1, flat, None) is True and ent(1, peaked, None) is False  # ln 8 = 2.08 nats vs ~0.01
    # confidence, after (asked about the next draft), min_len 0: P multiplies each next draft's top probability
    half = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    conf = ConfidenceStop(threshold=0.8, min_len=0)
    assert [conf(0, half, None), conf(1, half, None), conf(2, half, None)] == [False, False, True]  # .5, .75, .875
    assert conf(0, torch.log(torch.tensor([0.1, 0.9])), None) is False  # a new block: 1 - 0.9
    assert conf(0, torch.zeros(6), None) is True  # a new block: 1 - 1/6 > 0.8, draft nothing
    assert ConfidenceStop(threshold=0.6, min_len=2)(0, torch.zeros(3), None) is False  # min_len wins
    conf = ConfidenceStop(threshold=0.8)
    conf.min_len = 0  # as the sweep sets it: blocks now start at n = 0, and each resets the product
    assert [conf(0, half, None), conf(1, half, None), conf(2, half, None), conf(0, half, None)] == [False] * 2 + [
        True,
        False,
    ]
    # before (asked right after draft n is picked): q of that draft, and a block starts at n = 1
    conf = ConfidenceStop(threshold=0.6, before_feed=True)
    assert conf.before_feed and conf(1, half, None, torch.tensor(0)) is False  # 1 - 0.5
    assert conf(2, half, None, torch.tensor(1)) is True  # 1 - 0.5 * 0.25
    assert conf(1, half, None, torch.tensor(1)) is True  # reset: 1 - 0.25


def test_before_head_reads_the_producing_state_and_the_drafts_own_probability():
    head = AcceptanceHead(AcceptanceConfig(dim=4, n_layers=1, state="before"))
    rule = AcceptanceStop(head, threshold=0.5)
    assert rule.before_feed and not AcceptanceStop(AcceptanceHead(AcceptanceConfig(dim=4)), 0.5).before_feed
    logits = torch.tensor([2.0, 0.0, float("-inf"), 1.0])  # a reduced vocabulary leaves -inf rows
    x = acceptance_features(torch.ones(4), logits, torch.tensor(0))
    logp = torch.log_softmax(logits, -1)
    ref_ent = -(logp[[0, 1, 3]].exp() * logp[[0, 1, 3]]).sum()
    torch.testing.assert_close(x, torch.cat([torch.ones(4), logp[:1], ref_ent.view(1)]))
    with torch.no_grad():  # the logit grows with log q(y) only: a confident draft is predicted accepted
        head.inp.weight.zero_()
        head.inp.bias.zero_()
        head.inp.weight[0, 4] = 1.0
        for b in head.blocks:  # identity blocks
            b.linear.weight.zero_()
            b.linear.bias.zero_()
        head.out.weight.zero_()
        head.out.weight[0, 0] = 10.0
        head.out.bias.fill_(5.0)
    sure, unsure = torch.tensor([9.0, 0.0, 0.0, 0.0]), torch.zeros(4)
    assert rule(1, sure, torch.zeros(4), torch.tensor(0)) is False
    assert rule(1, unsure, torch.zeros(4), torch.tensor(0)) is True  # log q = -1.39: p_hat = sigmoid(-8.9)
    ent = EntropyStop(threshold=1.0, before_feed=True)
    assert ent.before_feed and ent(1, unsure, None, torch.tensor(0)) is True and ent(1, sure, None, 0) is False


@pytest.fixture(scope="module")
def specdec_run(tmp_path_factory, tiny_model_dir, prompts_file):
    """A trained tiny draft LM and records with SpecDec++ labels from it."""
    root = tmp_path_factory.mktemp("specdec")
    common = [
        f"target.model={tiny_model_dir}",
        f"data.prompts.path={prompts_file}",
        f"eval.prompts.path={prompts_file}",
        "-q",
    ]
    assert main(["run", "tiny", f"out_dir={root / 'draft'}", "eval.enabled=false", *common]) == 0
    draft = root / "draft" / "checkpoints" / "final"
    assert (
        main(
            [
                "generate",
                "tiny",
                f"out_dir={root / 'head'}",
                f"data.specdec_labels.checkpoint={draft}",
                "data.specdec_labels.temperature=1.0",
                "data.n_samples=2",
                "data.temperature=1.0",
                *common,
            ]
        )
        == 0
    )
    return root, draft, common


def test_acceptance_objective_is_weighted_soft_bce(specdec_run, tiny_model_dir):
    from draftsmith.data.dataset import RecordDataset, collate
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import build_drafter
    from draftsmith.recipes.schema import LossConfig
    from draftsmith.train.objectives import Context, acceptance_objective

    root, draft, _ = specdec_run
    tgt = load_model(str(tiny_model_dir)).model
    head = build_drafter("acceptance_head", {"draft": str(draft), "n_layers": 1}, tgt)
    assert not any(p.requires_grad for p in head.draft.parameters())
    batch = collate([RecordDataset(root / "head" / "data", 128, signals={"specdec"})[i] for i in range(4)])
    params = AcceptanceHeadConfig(draft=str(draft), n_layers=1, mixing_ratio=0.0, weight_mismatch=6.0)
    out = acceptance_objective(
        head, batch, LossConfig(kind="ce"), Context(unwrapped=head, params=params, generator=torch.Generator())
    )
    assert out.n == len(batch["spec_accept"])  # mixing 0: every response token is replaced by the draft's sample
    # reference: the draft reads the fully swapped sequence; the loss is the weighted soft BCE at every label
    z = batch["input_ids"].clone()
    pos = torch.zeros_like(batch["predict_mask"])
    pos[:, 1:] = batch["predict_mask"][:, :-1]
    z[pos] = batch["spec_token"].long()
    with torch.no_grad():
        a = torch.sigmoid(head(head.draft(z, return_hidden=True)[pos]))
    s = batch["spec_accept"].float()
    ref = -(6 * (1 - s) * torch.log1p(-a) + s * torch.log(a)).sum()
    torch.testing.assert_close(out.loss_sum.detach(), ref, rtol=1e-4, atol=1e-4)
    out.loss_sum.backward()
    assert head.out.weight.grad is not None


def test_before_head_objective_trains_and_decodes_losslessly(specdec_run, tiny_model_dir, tmp_path):
    """A ``before`` head: the objective reads the draft's state *producing* each labelled token on the target's own
    text (every label counts, no mixing) plus log q(y) and the entropy; it trains from the CLI, decodes its draft
    losslessly with the rule asked before feeding, and an eval.stop.state that contradicts the head is refused."""
    import yaml

    from draftsmith.data.dataset import RecordDataset, collate
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import build_drafter
    from draftsmith.recipes.loader import find_recipe
    from draftsmith.recipes.schema import LossConfig
    from draftsmith.train.objectives import Context, acceptance_objective

    root, draft, common = specdec_run
    tgt = load_model(str(tiny_model_dir)).model
    params = AcceptanceHeadConfig(draft=str(draft), n_layers=1, state="before", weight_mismatch=6.0)
    head = build_drafter("acceptance_head", params, tgt)
    batch = collate([RecordDataset(root / "head" / "data", 128, signals={"specdec"})[i] for i in range(4)])
    out = acceptance_objective(
        head, batch, LossConfig(kind="ce"), Context(unwrapped=head, params=params, generator=torch.Generator())
    )
    s, y = batch["spec_accept"].float(), batch["spec_token"].long()
    assert out.n == len(s)
    pm = batch["predict_mask"]
    with torch.no_grad():  # reference, row by row: the state at t drafts the response token at t + 1
        xs = []
        for b in range(len(pm)):
            h = head.draft(batch["input_ids"][b : b + 1], return_hidden=True)[0]
            t = pm[b, :-1].nonzero()[:, 0]
            xs.append((h[t], head.draft.lm_head(h[t])))
        h = torch.cat([a for a, _ in xs])
        a = torch.sigmoid(head(acceptance_features(h, torch.cat([q for _, q in xs]), y)))
    ref = -(6 * (1 - s) * torch.log1p(-a) + s * torch.log(a)).sum()
    torch.testing.assert_close(out.loss_sum.detach(), ref, rtol=1e-4, atol=1e-4)

    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "acceptance_head", "draft": str(draft), "n_layers": 1, "state": "before"}
    recipe = tmp_path / "tiny-before.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    run = tmp_path / "before"
    import shutil

    shutil.copytree(root / "head" / "data", run / "data")
    assert main(["train", str(recipe), f"out_dir={run}", "train.steps=3", *common]) == 0
    cfg = json.loads((run / "checkpoints" / "final" / "drafter.json").read_text())["config"]
    assert cfg["state"] == "before"
    assert (
        main(["eval", str(recipe), f"out_dir={run}", "target.dtype=float64", "eval.stop.threshold=0.5", *common]) == 0
    )
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0 and report["strategy"]["stop"]["state"] == "before"
    assert main(["eval", str(recipe), f"out_dir={run}", "eval.stop.state=after", *common]) == 2
    # the same head asked before each next draft (state=next), min_len 0: steps may draft nothing; lossless
    assert (
        main(
            [
                "eval",
                str(recipe),
                f"out_dir={run}",
                "target.dtype=float64",
                "eval.stop.threshold=0.5",
                "eval.stop.state=next",
                "eval.stop.min_len=0",
                *common,
            ]
        )
        == 0
    )
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0 and report["strategy"]["stop"]["state"] == "next"


def test_acceptance_head_trains_and_drives_adaptive_decoding(specdec_run, tmp_path):
    import yaml

    from draftsmith.eval import sweep
    from draftsmith.recipes.loader import find_recipe, load_recipe

    root, draft, common = specdec_run
    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "acceptance_head", "draft": str(draft), "n_layers": 1}
    recipe = tmp_path / "tiny-accept.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    run = root / "head"
    assert main(["train", str(recipe), f"out_dir={run}", "train.steps=4", *common]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["accept_pred"] <= 1 and 0 <= r["accept_label"] <= 1 for r in rows if r["stage"] == "train")
    from safetensors.torch import load_file

    keys = load_file(str(run / "checkpoints" / "final" / "model.safetensors"))
    assert keys and not [k for k in keys if k.startswith("draft.")]  # the head's checkpoint holds no draft weights
    # eval: the head's checkpoint stands for its draft decoded with the SpecDec++ rule; lossless
    args = ["eval", str(recipe), f"out_dir={run}", "target.dtype=float64", "eval.stop.threshold=0.5", *common]
    assert main(args) == 0
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0 and report["strategy"]["stop"]["rule"] == "specdecpp"
    assert (
        main(
            [
                "eval",
                "tiny",
                f"out_dir={run}",
                f"eval.checkpoint={draft}",
                "eval.stop.rule=entropy",
                "eval.stop.threshold=0.5",
                "target.dtype=float64",
                *common,
            ]
        )
        == 0
    )
    assert json.loads((run / "eval" / "report.json").read_text())["lossless_match"] == 1.0
    # threshold sweep on the same prompts
    r = sweep.sweep(
        load_recipe(str(recipe), [f"out_dir={run}", "target.dtype=float64", *[c for c in common if c != "-q"]]),
        [0.2, 0.8],
        [1, 3],
    )
    assert r["lossless_mismatches"] == 0 and set(r["configs"]) == {"ar", "fixed-1", "fixed-3", "stop-0.2", "stop-0.8"}
    assert r["configs"]["stop-0.2"]["drafted_per_step"] <= r["configs"]["stop-0.8"]["drafted_per_step"]
    assert (run / "eval" / "sweep.json").is_file()
    assert r["machine"]["other_cpu_share"] is None or 0.0 <= r["machine"]["other_cpu_share"] <= 1.0
    # the training-free entropy rule crossed with min_len 0 (may skip drafting) and 1, on the plain draft
    plain = [
        f"out_dir={run}",
        f"eval.checkpoint={draft}",
        "eval.stop.rule=entropy",
        "target.dtype=float64",
        *[c for c in common if c != "-q"],
    ]
    r = sweep.sweep(load_recipe("tiny", plain), [0.05, 50.0], [1], min_lens=[0, 1])
    assert r["lossless_mismatches"] == 0 and r["best_min_len"] in (0, 1)
    assert {"stop-0.05-m0", "stop-0.05-m1", "stop-50-m0", "stop-50-m1"} <= set(r["configs"])
    assert r["configs"]["stop-0.05-m0"]["drafted_per_step"] < r["configs"]["stop-0.05-m1"]["drafted_per_step"]
    # --oracle alone: the bound on per-draft stop rules, reported apart from the rules (there are none here)
    plain = [c for c in plain if c != "eval.stop.rule=entropy"] + ["eval.draft_len=3"]
    r = sweep.sweep(load_recipe("tiny", plain), None, [1, 3], oracle=True)
    assert r["lossless_mismatches"] == 0
    assert set(r["configs"]) == {"ar", "fixed-1", "fixed-3", "oracle", "oracle-skip"}
    o, s, f3 = r["configs"]["oracle"], r["configs"]["oracle-skip"], r["configs"]["fixed-3"]
    assert o["tau"] == s["tau"] == f3["tau"] and o["drafted_per_step"] <= f3["drafted_per_step"]
    assert o["wasted_per_step"] <= 1 and s["wasted_per_step"] == 0
    assert r["best_stop"] is None and "gain_vs_best_fixed" not in r
    assert {"oracle", "oracle-skip"} <= set(r["per_category"]["all"])
    for per in r["per_category"].values():  # per category: speed, tau and waste; both oracles take the cap's tau
        assert per["oracle"]["tau"] == per["oracle-skip"]["tau"] >= 1 and per["oracle-skip"]["wasted_per_step"] == 0
        assert all(v["speedup_vs_ar"] > 0 and v["wasted_per_step"] >= 0 for v in per.values())
    for n, key in (("oracle", "oracle_gain_vs_best_fixed"), ("oracle-skip", "oracle_skip_gain_vs_best_fixed")):
        assert r[key] == pytest.approx(
            r["configs"][n]["tokens_per_s"] / r["configs"][r["best_fixed"]]["tokens_per_s"] - 1
        )
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match="--oracle needs eval.temperature=0"):
        sweep.sweep(load_recipe("tiny", plain + ["eval.temperature=1.0"]), None, [1], oracle=True)
    with pytest.raises(DraftsmithError, match="min-lens 0 needs eval.stop.rule=entropy"):
        sweep.sweep(
            load_recipe(str(recipe), [f"out_dir={run}", *[c for c in common if c != "-q"]]), [0.5], [1], min_lens=[0]
        )
    # bad input: a specdecpp rule without a head on a plain draft is a one-line error
    assert main(["eval", "tiny", f"out_dir={run}", f"eval.checkpoint={draft}", *common]) == 0
    assert (
        main(["eval", "tiny", f"out_dir={run}", f"eval.checkpoint={draft}", "eval.stop.rule=specdecpp", *common]) == 2
    )


def test_acceptance_head_on_an_eagle_drafter(specdec_run, tmp_path):
    """SpecDec++ for EAGLE: labels made in the loop (any target-written records, no stored labels), the head
    trains, and its checkpoint decodes its EAGLE drafter with the stop rule, losslessly; the sweep runs."""
    import shutil

    import yaml

    from draftsmith.eval import sweep
    from draftsmith.recipes.loader import find_recipe, load_recipe

    root, _, common = specdec_run
    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "eagle", "version": 3}
    (tmp_path / "tiny-eagle.yaml").write_text(yaml.safe_dump(spec))
    shutil.copytree(root / "draft" / "data", tmp_path / "eagle" / "data")
    assert (
        main(["train", str(tmp_path / "tiny-eagle.yaml"), f"out_dir={tmp_path / 'eagle'}", "train.steps=2", *common])
        == 0
    )
    eagle = tmp_path / "eagle" / "checkpoints" / "final"
    spec["drafter"] = {"kind": "acceptance_head", "draft": str(eagle), "n_layers": 1}
    recipe = tmp_path / "tiny-eagle-head.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    run = tmp_path / "head"
    shutil.copytree(root / "draft" / "data", run / "data")  # plain records: no SpecDec++ labels in them
    assert main(["train", str(recipe), f"out_dir={run}", "train.steps=3", *common]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["stage"] == "train"]
    assert len(train_rows) == 3 and all(
        r["accept_label"] in (0.0, 1.0) or 0 < r["accept_label"] < 1 for r in train_rows
    )
    assert json.loads((run / "checkpoints" / "final" / "drafter.json").read_text())["config"]["draft_kind"] == "eagle"
    assert (
        main(["eval", str(recipe), f"out_dir={run}", "target.dtype=float64", "eval.stop.threshold=0.5", *common]) == 0
    )
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0 and report["strategy"]["stop"]["rule"] == "specdecpp"
    r = sweep.sweep(
        load_recipe(str(recipe), [f"out_dir={run}", "target.dtype=float64", *[c for c in common if c != "-q"]]),
        [0.2, 0.9],
        [1, 3],
    )
    assert r["lossless_mismatches"] == 0
    assert r["configs"]["stop-0.2"]["drafted_per_step"] <= r["configs"]["stop-0.9"]["drafted_per_step"]
    # a ``before`` head on the same EAGLE drafter: the state that drafted y, no second TTT step; lossless
    spec["drafter"]["state"] = "before"
    recipe.write_text(yaml.safe_dump(spec))
    assert main(["train", str(recipe), f"out_dir={run}", "train.steps=2", "train.resume=false", *common]) == 0
    assert json.loads((run / "checkpoints" / "final" / "drafter.json").read_text())["config"]["state"] == "before"
    assert (
        main(["eval", str(recipe), f"out_dir={run}", "target.dtype=float64", "eval.stop.threshold=0.5", *common]) == 0
    )
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0 and report["strategy"]["stop"]["state"] == "before"


# ---- the skip rule (eval.stop.state=next) and acceptance heads on feature heads ------------------------------------


def _slot_head(values, n_layers=1):
    """A before head with one slot per value whose logit is that value, whatever the state."""
    head = AcceptanceHead(AcceptanceConfig(dim=4, n_layers=n_layers, state="before", n_slots=len(values)))
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.slots.weight[:, 0] = torch.tensor(values)
        head.out.weight[0, 0] = 1.0  # zeroed blocks are identities: logit = slot value
    return head


def test_skip_rule_judges_the_next_draft_with_its_heads_slot():
    from draftsmith.errors import DraftsmithError

    head = _slot_head([2.0, 0.0, -2.0])  # p_hat per head: 0.88, 0.5, 0.12
    x, logits = torch.zeros(4), torch.zeros(8)
    rule = AcceptanceStop(head, threshold=0.3, min_len=0, skip=True)
    assert not rule.before_feed  # asked in the after slot, before the judged draft exists
    # n = 0: about draft 1 (head 0): 1 - 0.88 <= 0.3; n = 1: about draft 2 (head 1): 1 - 0.44 > 0.3 -> stop at 1
    assert [rule(0, logits, x), rule(1, logits, x)] == [False, True]
    assert rule(0, logits, x) is False  # a new block resets the product
    assert AcceptanceStop(head, 0.1, min_len=0, skip=True)(0, logits, x) is True  # draft nothing
    assert AcceptanceStop(head, 0.1, min_len=1, skip=True)(1, logits, x) is True  # min_len 1: asked from n = 1
    # before (asked right after draft n is picked, keeping it): draft n came from head n - 1
    before = AcceptanceStop(head, threshold=0.3)
    y = torch.tensor(0)
    assert before.before_feed and [before(1, logits, x, y), before(2, logits, x, y)] == [False, True]
    with pytest.raises(DraftsmithError, match="state=next needs a head trained with drafter.state=before"):
        AcceptanceStop(AcceptanceHead(AcceptanceConfig(dim=4)), 0.5, skip=True)


def _feature_heads(kind, tgt, counts=None):
    from draftsmith.models.registry import build_drafter

    params = {
        "medusa": {"n_heads": 3},
        "hydra": {"n_heads": 3, "prefix_attention": True, "draft_vocab": 40},
        "mlp_speculator": {"n_predict": 3, "inner_dim": 48},
    }.get(kind, {})  # another kind: its defaults
    torch.manual_seed(0)
    counts = torch.arange(tgt.cfg.vocab_size).float() if counts is None else counts  # for hydra's 40-row heads
    heads = build_drafter(kind, params, tgt, counts=counts, eos_ids={0})
    with torch.no_grad():  # untrained heads copy the target's head: perturb them so labels are mixed
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return heads.float().requires_grad_(False)


@pytest.mark.parametrize("kind", drafter_kinds(interface="heads"))
def test_feature_head_labels_and_states_match_the_decoders(kind, tiny_model_dir):
    """Row by row: the loop's input for head k at position t is what the chain decoder hands the skip rule before
    draft k + 1 (``draft_step`` from the context state at t after the target's tokens t+1..t+k+1), and the label
    is whether the target's greedy token at t + k + 1 is that draft."""
    from draftsmith.eval.decoder import autoregressive_generate
    from draftsmith.models.loading import load_model
    from draftsmith.train.objectives import Context, heads_acceptance_inputs

    tgt = load_model(str(tiny_model_dir)).model.float()
    # the target's own greedy text (as in the records): heads that copy its LM head then agree with it sometimes
    ids = torch.tensor([p + autoregressive_generate(tgt, torch.tensor(p), 8) for p in ([1, 5, 9, 13], [2, 7, 3, 8])])
    heads = _feature_heads(kind, tgt, counts=torch.bincount(ids.flatten(), minlength=tgt.cfg.vocab_size).float())
    if kind == "hydra":  # its wide first blocks start random: pass the context state through, as Medusa's do
        with torch.no_grad():
            for block in heads.blocks:
                block[0].linear.weight.zero_()
                block[0].proj.weight.zero_()
                block[0].proj.weight[:, : tgt.cfg.dim] = torch.eye(tgt.cfg.dim)
    pm = torch.zeros_like(ids, dtype=torch.bool)
    pm[:, 4:11] = True  # positions 4..10 predict response tokens
    pm[1, 9:] = False
    x, s, slot, start = heads_acceptance_inputs(
        heads,
        {"input_ids": ids, "predict_mask": pm},
        Context(unwrapped=heads, target=tgt, generator=torch.Generator(), params=AcceptanceHeadConfig(draft="-")),
        positions=True,
    )
    with torch.no_grad():
        h = tgt(ids, return_hidden=True)  # (B, T, D)
        ctx = heads.read_context(h)
        rows, labels, slots, starts = [], [], [], []
        for k in range(heads.max_draft_len):
            for b in range(2):
                for t in range(12 - k - 1):
                    if not (pm[b, t] and pm[b, t + k + 1]):
                        continue
                    path = [ids[b, t + 1 + j].view(1) for j in range(k + 1)]
                    logits, state = heads.draft_step(ctx[b, t], path)
                    y = logits.argmax()
                    rows.append(acceptance_features(state, logits, y))
                    labels.append(float(int(y) == int(tgt.lm_head(h[b, t + k + 1]).argmax())))
                    slots.append(k)
                    starts.append(b * ids.shape[1] + t)
    assert len(rows) == len(x) and slot.tolist() == slots and start.tolist() == starts  # same rows, same order
    torch.testing.assert_close(x, torch.stack(rows), rtol=1e-4, atol=1e-4)
    assert s.tolist() == labels
    # both classes present where the heads start near the target's own head (the label code is shared)
    w = tgt.lm_head.weight if heads.head_ids is None else tgt.lm_head.weight[heads.head_ids]
    lms = getattr(heads, "lm_heads", [])
    near = len(lms) > 0 and all(lm.weight.shape == w.shape and (lm.weight - w).abs().max() < 0.5 for lm in lms)
    assert not near or 0 < sum(labels) < len(labels)
    # sampled labels (label_temperature 1): y drawn from q, s = min(1, p(y)/q(y)), in the same order
    from draftsmith.data.engine import Sampling, specdec_labels

    x1, s1, _ = heads_acceptance_inputs(
        heads,
        {"input_ids": ids, "predict_mask": pm},
        Context(
            unwrapped=heads,
            target=tgt,
            generator=torch.Generator().manual_seed(3),
            params=AcceptanceHeadConfig(draft="-", label_temperature=1.0),
        ),
    )
    gen, ref_s = torch.Generator().manual_seed(3), []
    with torch.no_grad():
        for k in range(heads.max_draft_len):
            rows_k = [(b, t) for b in range(2) for t in range(12 - k - 1) if pm[b, t] and pm[b, t + k + 1]]
            q = torch.stack(
                [heads.draft_step(ctx[b, t], [ids[b, t + 1 + j].view(1) for j in range(k + 1)])[0] for b, t in rows_k]
            )
            p = tgt.lm_head(torch.stack([h[b, t + k + 1] for b, t in rows_k]))
            ref_s.append(specdec_labels(p, q, Sampling(temperature=1.0), [gen] * len(q))[1])
    torch.testing.assert_close(s1, torch.cat(ref_s), rtol=1e-4, atol=1e-5)
    assert 0 < float(s1.min()) and float(s1.max()) <= 1  # soft labels: p(y) > 0 for every sample
    assert x.shape[1] == heads.state_dim + 2


@pytest.mark.parametrize("kind", drafter_kinds(interface="heads"))
def test_skip_rule_on_feature_heads_is_lossless_and_can_draft_nothing(kind, tiny_model_dir):
    from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
    from draftsmith.models.loading import load_model

    tgt = load_model(str(tiny_model_dir)).model.float()
    heads = _feature_heads(kind, tgt)
    prompt = torch.tensor([1, 5, 9, 13, 17, 21])
    ar = autoregressive_generate(tgt, prompt, 24)
    torch.manual_seed(2)
    head = AcceptanceHead(
        AcceptanceConfig(dim=heads.state_dim, n_layers=1, state="before", n_slots=heads.max_draft_len, draft_kind=kind)
    )
    for h, expect in ((0.5, None), (1e-6, 0), (0.999999, None)):
        rule = AcceptanceStop(head, h, min_len=0, skip=True)
        out, st = speculative_generate(tgt, heads, prompt, 24, draft_len=3, stop_drafting=rule)
        assert out == ar
        if expect is not None:
            assert st.drafted == expect  # every step judged draft 1 unsure: plain target steps
    never = AcceptanceHead(
        AcceptanceConfig(dim=heads.state_dim, n_layers=0, state="before", n_slots=heads.max_draft_len)
    )
    with torch.no_grad():
        for p in never.parameters():
            p.zero_()
        never.out.bias.fill_(30.0)
    if heads.head_ids is not None:  # a reduced vocabulary: features from the kept rows give the same estimates
        logits, state = heads.draft_step(torch.randn(tgt.cfg.dim), [prompt[-1:]])
        full, kept = (AcceptanceStop(head, 0.5, min_len=0, skip=True, keep=k) for k in (None, heads.head_ids))
        full(0, logits, state), kept(0, logits, state)
        assert kept.p_all == pytest.approx(full.p_all, rel=1e-5) and 0 < full.p_all < 1
        rule = AcceptanceStop(head, 0.5, min_len=0, skip=True, keep=heads.head_ids)
        assert speculative_generate(tgt, heads, prompt, 24, draft_len=3, stop_drafting=rule)[0] == ar
    _, fixed = speculative_generate(tgt, heads, prompt, 24, draft_len=3)
    _, st = speculative_generate(
        tgt, heads, prompt, 24, draft_len=3, stop_drafting=AcceptanceStop(never, 0.5, min_len=0, skip=True)
    )
    assert st.drafted == fixed.drafted and st.accepted == fixed.accepted


def test_acceptance_head_on_hydra_heads_trains_decodes_and_sweeps(specdec_run, tmp_path):
    """The pipeline on feature heads: labels made in the loop, the head trains, its checkpoint decodes its Hydra++
    heads with the skip rule (min_len 0) losslessly, and the sweep crosses thresholds with min_len 0 and 1."""
    import shutil

    import yaml

    from draftsmith.eval import sweep
    from draftsmith.recipes.loader import find_recipe, load_recipe

    root, _, common = specdec_run
    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "hydra", "n_heads": 3, "prefix_attention": True}
    (tmp_path / "tiny-hydra.yaml").write_text(yaml.safe_dump(spec))
    shutil.copytree(root / "draft" / "data", tmp_path / "hydra" / "data")
    assert (
        main(["train", str(tmp_path / "tiny-hydra.yaml"), f"out_dir={tmp_path / 'hydra'}", "train.steps=2", *common])
        == 0
    )
    hydra = tmp_path / "hydra" / "checkpoints" / "final"
    spec["drafter"] = {"kind": "acceptance_head", "draft": str(hydra), "n_layers": 1, "state": "after"}
    recipe = tmp_path / "tiny-hydra-head.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    run = tmp_path / "head"
    shutil.copytree(root / "draft" / "data", run / "data")
    assert main(["train", str(recipe), f"out_dir={run}", "train.steps=2", *common]) == 2  # heads: before only
    spec["drafter"]["state"] = "before"
    spec["eval"]["stop"] = {"rule": "specdecpp", "state": "next", "min_len": 0, "threshold": 0.5}
    recipe.write_text(yaml.safe_dump(spec))
    assert main(["train", str(recipe), f"out_dir={run}", "train.steps=3", *common]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    assert len(rows) == 3 and all(0 <= r["accept_label_head0"] <= 1 and "brier_head2" in r for r in rows)
    cfg = json.loads((run / "checkpoints" / "final" / "drafter.json").read_text())["config"]
    assert cfg["draft_kind"] == "hydra" and cfg["n_slots"] == 3
    assert main(["eval", str(recipe), f"out_dir={run}", "target.dtype=float64", *common]) == 0
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0 and report["strategy"]["stop"]["state"] == "next"
    r = sweep.sweep(
        load_recipe(
            str(recipe),
            [f"out_dir={run}", "target.dtype=float64", "eval.draft_len=3", *[c for c in common if c != "-q"]],
        ),
        [1e-6, 0.9],
        [1, 3],
        min_lens=[0, 1],
        oracle=True,
    )
    assert r["lossless_mismatches"] == 0 and r["configs"]["stop-1e-06-m0"]["drafted_per_step"] == 0
    c = r["configs"]  # min_len 1: draft 1 always, never draft 2 (as fixed-1; the last step may draft nothing)
    assert c["stop-1e-06-m1"]["drafted_per_step"] == c["fixed-1"]["drafted_per_step"] > 0
    assert main(["eval", str(recipe), f"out_dir={run}", "eval.stop.state=after", *common]) == 2
