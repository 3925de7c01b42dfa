"""Falcon (models/falcon.py): training pass s is what block slot s reads in decoding, a block read writes nothing,
glancing widens the look of the positions it draws and only those, and what Falcon cannot take is refused in one
line. Lossless decoding (chains, trees, batches) comes from the shared suites; tests/test_train_serve_match.py
checks that the first block's drafts are the objective's teacher-forced predictions."""

from __future__ import annotations

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.falcon import build_falcon
from draftsmith.models.llama import Llama, LlamaConfig
from draftsmith.models.registry import drafter_spec

CFG = LlamaConfig(vocab_size=50, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=64)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Llama(CFG).double().eval()


def _falcon(target, k=3):
    torch.manual_seed(1)
    f = build_falcon({"block_size": k}, target).double()
    with torch.no_grad():
        for p in f.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return f


def test_training_pass_s_is_block_slot_s_read_over_the_cache(target):
    """Pass s at j (the pairs up to j + k-1-s visible) equals a query over a cache holding every pair, allowed the
    slots up to j + k-1-s; reading writes nothing (the cache's length and contents stay)."""
    k, f = 3, _falcon(target)
    ids = torch.randint(0, CFG.vocab_size, (1, 12))
    _, cap = target(ids, capture_layers=f.capture_layers)
    feats = f.features(cap, target)
    outs = f(feats, ids)  # (k, 1, T, d)
    T = ids.shape[1] - 1
    cache = f.new_cache(1, 16)
    f.step(f.project(feats[:, :T]), ids[:, 1 : T + 1], cache=cache)  # pair i = (f_i, x_{i+1})
    before = cache.kv.clone()
    for s in range(k):
        a = k - 1 - s
        for j in range(T - a):
            allowed = (torch.arange(T) <= j + a)[None, None]
            got = f.read(f.project(feats[:, j : j + 1]), ids[:, j + 1 : j + 2], torch.tensor([[j]]), cache, allowed)
            torch.testing.assert_close(got[0, 0], outs[s, 0, j])
    assert cache.length == T and torch.equal(cache.kv, before)


def test_glancing_widens_the_look_of_as_many_missed_positions_as_its_ratio_says(target):
    """CSGD: round(ratio x misses) of the trained positions see 1..s more pairs, drawn with the run's generator;
    nowhere else changes, and ratio 0 draws none."""
    k, f = 3, _falcon(target)
    ids = torch.randint(0, CFG.vocab_size, (2, 10))
    _, cap = target(ids, capture_layers=f.capture_layers)
    state, tok = f.project(f.features(cap, target)), torch.cat([ids[:, 1:], ids[:, :1] * 0], 1)
    base = torch.arange(10).expand(2, 10)
    ahead = torch.arange(10)[None, :] - torch.arange(10)[:, None]
    sel, labels = torch.tensor([1, 3, 4, 12, 15]), torch.full((5,), -1)  # labels no id has: every one a miss
    for ratio, s in ((0.6, 2), (1.0, 1), (0.0, 2)):
        a = torch.full((2, 10), k - 1 - s)
        extra = f._glance(state, tok, base, a, ahead, None, (ratio, sel, labels, torch.Generator().manual_seed(0)), s)
        hit = extra.flatten().nonzero().flatten()
        assert len(hit) == round(ratio * 5) and set(hit.tolist()) <= set(sel.tolist())
        assert extra.flatten()[hit].min() >= 1 if len(hit) else True
        assert extra.max() <= s


def test_falcon_refuses_what_its_blocks_cannot_take_in_one_line(target):
    spec = drafter_spec("falcon")
    assert spec.section({"block_size": 4}).ttt_steps == 4 and spec.section({}).version == 1
    assert (spec.section({}).feature_loss_weight, spec.section({}).token_loss_weight) == (1.0, 0.1)  # EAGLE-1's
    with pytest.raises(DraftsmithError, match="n_layers: Falcon here is one layer"):
        spec.section({"n_layers": 2})
    with pytest.raises(DraftsmithError, match="ttt_steps is 2: .*block_size = 3"):
        spec.section({"block_size": 3, "ttt_steps": 2})
    with pytest.raises(DraftsmithError, match="drafter.sliding_window does not apply"):
        spec.section({"sliding_window": 8})
    with pytest.raises(DraftsmithError, match="version"):
        spec.section({"version": 3})
    assert spec.export_formats({"config": {}})["vllm"]["write"].startswith("refused: no serving engine")
    f = build_falcon({"block_size": 2, "max_blocks": 3}, target)
    assert f.max_draft_len == 6 and [f.output_lag(s) for s in range(2)] == [1, 0]


def test_training_with_glancing_runs_and_draws_from_the_misses(target, monkeypatch):
    """A few training steps with glance on: every pass after the first draws its glances from that pass's misses
    at the trained positions (with the run's generator), and the loss stays finite."""
    from conftest import tiny_model, trained_falcon

    from draftsmith.models.falcon import Falcon

    calls, real = [], Falcon._glance

    def spy(self, *a):
        out = real(self, *a)
        calls.append((a[-1], int((out > 0).sum())))
        return out

    monkeypatch.setattr(Falcon, "_glance", spy)
    f = trained_falcon(tiny_model(0), steps=2, glance=0.5, block_size=3)
    assert sorted({s for s, _ in calls}) == [1, 2] and any(n > 0 for _, n in calls)
    assert all(torch.isfinite(p).all() for p in f.parameters())
