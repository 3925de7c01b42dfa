"""Gumiho (models/gumiho.py): its serial part is an EAGLE drafter, its heads read the serial part's (state, token)
pairs, its loss leans to the early positions, and what it cannot take is refused in one line. Lossless decoding
(chains, trees, batches) comes from the shared suites; tests/test_train_serve_match.py checks that the decoder's
drafts are the objective's teacher-forced predictions, heads included."""

from __future__ import annotations

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle import build_eagle
from draftsmith.models.gumiho import build_gumiho
from draftsmith.models.llama import Llama, LlamaConfig
from draftsmith.models.registry import drafter_spec

CFG = LlamaConfig(vocab_size=50, dim=32, n_layers=6, n_heads=4, n_kv_heads=2, hidden_dim=64)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Llama(CFG).double().eval()


@pytest.mark.parametrize("version", [1, 3])
def test_the_serial_part_is_eagle_and_the_heads_read_its_pairs(target, version):
    """The first S outputs are the EAGLE drafter's TTT unroll with the same weights; head i at t is the head applied
    to the pairs (step j-1's output, x_{t+j+1}), j = 1..S, as the decoder forms them from its cached steps."""
    torch.manual_seed(1)
    g = build_gumiho({"version": version, "serial_drafts": 2, "mlp_heads": 3, "mlp_layers": 2}, target).double()
    with torch.no_grad():
        for p in g.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    e = build_eagle({"version": version, "n_layers": 2, "ttt_steps": 2}, target).double()
    e.load_state_dict({k: v for k, v in g.state_dict().items() if not k.startswith("heads.")})
    ids = torch.randint(0, CFG.vocab_size, (2, 11))
    _, cap = target(ids, capture_layers=g.capture_layers)
    f = g.features(cap, target)
    outs = g(f, ids, steps=2)
    assert outs.shape[0] == 2 + 3
    torch.testing.assert_close(outs[:2], e(f, ids, steps=2))
    for i in range(6):  # the decoder's path: the root over the real pairs 0..i, then draft 1 fed with its state
        cache = g.new_cache(1, 32)
        _, s0 = g.step(g.project(f[:1, : i + 1]), ids[:1, 1 : i + 2], cache=cache)
        _, s1 = g.step(s0[:, -1:], ids[:1, i + 2 : i + 3], cache=cache)
        pairs = torch.cat([g.pair(ids[:1, i + 2], s0[:, -1]), g.pair(ids[:1, i + 3], s1[:, -1])], -1)
        torch.testing.assert_close(g.head_states(pairs)[0], outs[2:, 0, i])


def test_the_loss_budget_leans_to_the_early_positions(target):
    g = build_gumiho({"serial_drafts": 2, "mlp_heads": 3, "mlp_layers": 1}, target)
    p = drafter_spec("gumiho").section({"serial_drafts": 2, "mlp_heads": 3, "head_decay": 0.9, "mlp_weight": 0.5})
    w = [g.position_weight(s, p) for s in range(g.draft_positions(p.ttt_steps))]
    assert w == pytest.approx([1.0, 0.9, 0.5 * 0.8, 0.5 * 0.64, 0.5 * 0.512])
    assert g.max_draft_len == 5 and g.drafts_hybrid == (2, 3)
    trained = {n.split(".")[0] for n, q in g.named_parameters() if q.requires_grad}
    assert "heads" in trained and "embed_tokens" not in trained


def test_what_gumiho_cannot_take_is_refused_in_one_line(target):
    spec = drafter_spec("gumiho")
    assert spec.section({"serial_drafts": 3}).ttt_steps == 3  # one TTT step per serial draft
    with pytest.raises(DraftsmithError, match="ttt_steps is 4 .*serial_drafts = 2"):
        spec.section({"ttt_steps": 4})
    for field in ("parallel_drafts", "partial_alignment"):
        with pytest.raises(DraftsmithError, match=f"drafter.{field} does not combine"):
            spec.section({field: 3 if field == "parallel_drafts" else True})
    assert spec.export_formats({"config": {}})["vllm"]["write"].startswith("refused: no serving engine")
