"""Kangaroo (models/kangaroo.py): the target's first layers, frozen, plus an attention adapter and the target's head.
Decoding, batches, trees and exports come from the shared suites (the kind is a token drafter); here: what the
drafter computes, what trains, and a run with Kangaroo's early exit (the confidence stop rule)."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.errors import DraftsmithError


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_tokenizer):
    from draftsmith.models.loading import load_model
    from draftsmith.models.tiny import save_tiny_llama

    path = save_tiny_llama(tmp_path_factory.mktemp("t3"), tiny_tokenizer, num_hidden_layers=3)
    return load_model(str(path)).model.double().eval()


def test_the_drafter_is_the_targets_first_layers_then_an_attention_only_adapter(target):
    """Its first exit_layer layers give the target's hidden states there; the adapter adds attention only (its MLP
    is exactly zero); logits = the target's head on the final norm of that; only the adapter and the norm train."""
    from draftsmith.models.kangaroo import build_kangaroo

    d = build_kangaroo({"exit_layer": 2}, target).double()
    ids = torch.randint(3, target.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, theirs = target(ids, capture_layers=(2,))
        logits, ours = d(ids, capture_layers=(2, 3))
        h = ours[2]
        torch.testing.assert_close(h, theirs[2], rtol=0, atol=0)
        last = d.layers[2]
        assert not last.mlp(last.post_attention_layernorm(ours[3])).any()
        torch.testing.assert_close(logits, d.lm_head(d.norm(ours[3])))
    trained = sorted(n for n, w in d.named_parameters() if w.requires_grad)
    assert trained == sorted(
        ["norm.weight", "layers.2.input_layernorm.weight"] + [f"layers.2.self_attn.{p}_proj.weight" for p in "qkvo"]
    )


def test_exit_layers_outside_the_target_are_refused(target):
    from draftsmith.models.kangaroo import build_kangaroo

    with pytest.raises(DraftsmithError, match="exit_layer=3 leaves none of the target's 3 layers"):
        build_kangaroo({"exit_layer": 3}, target)
    d = build_kangaroo({"exit_layer": 1, "adapter_init": "random", "train_shallow": True}, target)
    assert d.layers[0].self_attn.q_proj.weight.requires_grad and not d.layers[1].mlp.down_proj.weight.requires_grad


def test_a_run_trains_the_adapter_only_and_decodes_losslessly_with_its_early_exit(
    train_run, tiny_model_dir, prompts_file, tmp_path
):
    """`draftsmith train` then `eval` with the confidence stop rule (Kangaroo's second exit): the shallow layers and
    the head stay the target's, the adapter moves, the MLP stays zero, the output is the target's."""
    import yaml

    from draftsmith.cli import main
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import load_drafter
    from draftsmith.recipes.loader import find_recipe

    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "kangaroo", "exit_layer": 1}
    recipe = tmp_path / "tiny-kangaroo.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    run = train_run("kangaroo", "train.steps=3", "train.lr=1e-2", recipe=str(recipe))
    d, info = load_drafter(run / "checkpoints" / "final")
    t = load_model(str(tiny_model_dir)).model
    assert info["kind"] == "kangaroo" and d.cfg.n_layers == 2
    assert all(torch.equal(v, t.layers[0].state_dict()[k]) for k, v in d.layers[0].state_dict().items())
    assert not any(w.any() for w in d.layers[1].mlp.parameters())
    assert not torch.equal(d.layers[1].self_attn.q_proj.weight, t.layers[1].self_attn.q_proj.weight)
    args = ["eval", str(recipe), f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}",
            f"out_dir={run}", "target.dtype=float64", "eval.strategy=chain", "eval.draft_len=6",
            "eval.stop.rule=confidence", "eval.stop.threshold=0.6", "-q"]  # fmt: skip
    assert main(args) == 0
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0
