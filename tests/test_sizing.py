"""Tree sizes for the hardware (eval/sizing.py): the chosen size and depth follow the measured verify costs and the
drafter's per-level cost; ``draftsmith tree --measure`` times the run's target and prints the choice."""

from __future__ import annotations

import json

import pytest

from draftsmith.eval.sizing import sized_trees, verify_costs
from draftsmith.eval.tree import choices_from_accuracies, expected_tau

ACC = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.45, 0.1, 0.05]]


def test_free_verifies_choose_the_biggest_tree_and_costly_ones_a_small_one():
    flat = sized_trees(ACC, {n: 1.0 for n in (1, 4, 12)})
    assert max(flat, key=lambda r: r["speed"])["nodes"] == 12
    for r in flat:  # with nothing to pay per level, each size's tree is the unconstrained best one
        assert r["choices"] == choices_from_accuracies(ACC, r["nodes"])
        assert r["tau"] == pytest.approx(expected_tau(ACC, r["choices"])) and r["speed"] == pytest.approx(r["tau"])
    steep = sized_trees(ACC, {1: 1.02, 4: 1.5, 12: 3.0})  # a CPU-like verify that grows with the tree
    assert max(steep, key=lambda r: r["speed"])["nodes"] == 1


def test_a_costly_drafter_makes_the_chosen_tree_shallower():
    cheap = {r["nodes"]: r for r in sized_trees(ACC, {6: 1.0}, draft_cost=0.0)}[6]
    dear = {r["nodes"]: r for r in sized_trees(ACC, {6: 1.0}, draft_cost=0.5)}[6]
    assert dear["depth"] < cheap["depth"]
    assert dear["cost"] == pytest.approx(1.0 + 0.5 * dear["depth"])
    assert all(len(c) <= dear["depth"] for c in dear["choices"])


def test_verify_costs_are_measured_in_decode_steps(target):
    costs, note = verify_costs(target, [1, 8], ctx=16, reps=2, rounds=2)
    assert set(costs) == {1, 8} and all(c > 0 for c in costs.values())
    assert "torch" in note


def test_tree_cli_measures_and_chooses(tmp_path, capsys, monkeypatch, target):
    """``draftsmith tree RUN --measure``: one line per size with its depth, expected tau and step cost, then the
    chosen size (the run's target is timed; a tiny one here)."""
    from draftsmith.cli import main
    from draftsmith.eval import sizing

    monkeypatch.setattr(sizing, "load_target", lambda run_dir, device: target)
    row = {"stage": "train", "step": 5, **{f"acc_head{k}_rank{r}": ACC[k][r] for k in range(3) for r in range(3)}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert main(["tree", str(tmp_path), "--nodes", "1,4", "--measure", "--ctx", "16", "--draft-cost", "0.1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[0].startswith("nodes   1  depth 1") and "step cost" in lines[1]
    assert lines[2].startswith("chosen: nodes ") and "torch" in lines[2]
