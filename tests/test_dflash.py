"""DFlash (models/dflash.py): the training layout sees exactly what decoding shows the drafter, a run trains and
decodes losslessly end to end, and bad sections are refused. Lossless decoding at every batch size and shape is
in the shared suites (tests/test_decode_common.py, test_batch_*.py: DFlash joins them from the registry)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import TINY_CFG, tiny_model

from draftsmith.errors import DraftsmithError
from draftsmith.models.dflash import anchor_layout, build_dflash, default_target_layers


def _drafter(target, **section):
    torch.manual_seed(1)
    d = build_dflash({"n_layers": 2, "block_size": 4, **section}, target).double()
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return d


@pytest.mark.parametrize("window", [None, 6])
def test_training_blocks_see_what_decoding_shows(window):
    """Every trained mask slot's state in the training forward (many anchors in one row, each masked to its own
    context) equals the decoder's: context read position by position into the cache, then the block. With a
    sliding window both cut the context, and the states differ from the full-context ones past the window."""
    t = tiny_model(0)
    d = _drafter(t, sliding_window=window)
    T, K = 30, d.cfg.block_size
    ids = torch.randint(3, 97, (2, T), generator=torch.Generator().manual_seed(3))
    pm = torch.ones(2, T, dtype=torch.bool)
    pm[:, :5] = False
    pm[1, 20:] = False
    with torch.no_grad():
        _, cap = t(ids, capture_layers=d.capture_layers, return_hidden=True)
    feats = d.features(cap, t)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    lay = anchor_layout(ids, pm, K, 5, d.cfg.mask_id, gens, window)
    got, full = {}, {}
    d(feats, lay.ids, lay.pos, lay.mask, lay.select, lambda j, h, w: got.setdefault(j, h @ w.t()))
    if window is not None:  # the same blocks over the whole context
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        lf = anchor_layout(ids, pm, K, 5, d.cfg.mask_id, gens)
        assert torch.equal(lf.ids, lay.ids) and torch.equal(lf.pos, lay.pos)
        d(feats, lf.ids, lf.pos, lf.mask, lf.select, lambda j, h, w: full.setdefault(j, h @ w.t()))
        assert (got[1] - full[1]).abs().amax(-1).max() > 1e-6
    Q = lay.ids.shape[1]
    n = 0
    for j, sel in enumerate(lay.select, start=1):
        for r, flat in enumerate(sel.tolist()):
            b, q = divmod(flat, Q)
            a = int(lay.pos[b, q]) - j  # the block's anchor
            cache = d.new_cache(1, T)
            d.read_context(feats[b : b + 1, :a], cache, torch.arange(a)[None])
            block = torch.tensor([[int(ids[b, a])] + [d.cfg.mask_id] * (K - 1)])
            want = d.block(block, torch.arange(a, a + K)[None], cache)[0, j - 1]
            torch.testing.assert_close(got[j][r], want)
            assert pm[b, a + j - 1]  # the slot drafts a trained (response) token
            n += 1
    assert n >= 10


def test_target_layers_and_mask_are_checked():
    t = tiny_model(0)
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layers(2, 3) == (1,)
    with pytest.raises(DraftsmithError, match="target_layers"):
        build_dflash({"target_layers": [5]}, t)
    with pytest.raises(DraftsmithError, match="mask_token"):
        build_dflash({"mask_token": TINY_CFG.vocab_size}, t)


def test_a_run_trains_decodes_losslessly_and_exports(tmp_path, tiny_model_dir, prompts_file):
    """generate -> train -> eval (chain and a dynamic tree, lossless) -> export vllm; the export reads back to the
    same drafter."""
    from draftsmith.cli import main
    from draftsmith.export.writer import load_export
    from draftsmith.models.registry import load_drafter
    from draftsmith.recipes.loader import find_recipe

    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "dflash", "n_layers": 1, "block_size": 4, "anchors": 4}
    recipe = tmp_path / "dflash.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    out = tmp_path / "run"
    args = [f"target.model={tiny_model_dir}", f"data.prompts.path={prompts_file}",
            f"eval.prompts.path={prompts_file}", f"out_dir={out}", "train.steps=4", "eval.prompts.n=3",
            "eval.max_new_tokens=16", "export.formats=[vllm]", "-q"]  # fmt: skip
    assert main(["run", str(recipe), *args]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["stage"] == "train" and "loss" in r]
    assert train and all(r["loss"] == r["loss"] for r in train) and "top1_draft2" in train[-1]
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0
    assert main(["eval", str(recipe), *args[:-2], "eval.strategy=dynamic_tree", "eval.tree.depth=3", "-q"]) == 0
    assert json.loads((out / "eval" / "report.json").read_text())["lossless_match"] == 1.0
    ckpt, _ = load_drafter(out / "checkpoints" / "final")
    back, info = load_export(out / "export" / "vllm")
    assert info["export_format"] == "vllm"
    a, b = ckpt.state_dict(), back.state_dict()
    m = ckpt.cfg.mask_id  # the mask vector travels in its embedding row, which our model never reads as a token
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "embed_tokens.weight")
    rows = torch.arange(ckpt.cfg.vocab_size) != m
    assert torch.equal(a["embed_tokens.weight"][rows], b["embed_tokens.weight"][rows])
    assert torch.equal(b["embed_tokens.weight"][m], a["mask_embed"])
