"""The end-to-end slice on a tiny random Llama: generate -> train -> eval -> export, and resume after a crash.
The data stage in depth is tested in test_data.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import shard_tensors

from draftsmith.cli import main
from draftsmith.data.records import read_manifest

REPORT_KEYS = {
    "target",
    "drafter",
    "prompts",
    "temperature",
    "max_new_tokens",
    "strategy",
    "tau",
    "acceptance_rate",
    "per_position_acceptance",
    "tokens_per_s",
    "speedup",
    "lossless_match",
    "device",
}


def test_tiny_pipeline_end_to_end(tmp_path, tiny_overrides):
    assert main(["run", "tiny", *tiny_overrides, "target.dtype=float64", "-q"]) == 0
    run = tmp_path / "run"
    manifest = read_manifest(run / "data")
    assert manifest["n_sequences"] == 8 and manifest["n_loss_tokens"] > 0 and len(manifest["shards"]) == 2
    assert (run / "checkpoints" / "final" / "model.safetensors").is_file()
    report = json.loads((run / "eval" / "report.json").read_text())
    assert REPORT_KEYS <= set(report)
    assert report["lossless_match"] == 1.0  # float64: speculative output == HF generate, token for token
    assert report["prompts"] == {"source": "file", "n": 3} and report["strategy"] == {"kind": "chain", "draft_len": 3}
    assert 1.0 <= report["tau"] <= 4.0 and 0.0 <= report["acceptance_rate"] <= 1.0
    assert len(report["per_position_acceptance"]) == 3
    assert {"ar_hf", "ar", "spec", "hf_assisted"} <= set(report["tokens_per_s"])
    assert {"vs_ar_hf", "vs_ar", "vs_hf_assisted"} <= set(report["speedup"])
    assert report["efficiency"] == pytest.approx(report["speedup"]["vs_ar"] / report["tau"])
    m = report["machine"]  # how much of the CPU other processes took while we timed (None off Linux)
    assert m["cpu_count"] >= 1 and m["torch_threads"] >= 1
    assert m["other_cpu_share"] is None or 0.0 <= m["other_cpu_share"] <= 1.0
    assert set(report["by_category"]) == set(report["per_category"])
    assert all(v["speedup"] > 0 and v["tau"] >= 1 for v in report["by_category"].values())
    assert (run / "eval" / "by_category.png").stat().st_size > 1000
    assert (run / "eval" / "report.md").read_text().startswith("# Speculative decoding eval")
    assert (run / "eval" / "acceptance.png").stat().st_size > 1000
    stages = {json.loads(line)["stage"] for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert stages == {"generate", "train", "eval"}
    assert "name: tiny" in (run / "recipe.yaml").read_text()
    assert (run / "export" / "hf" / "README.md").is_file()  # `run` ends with the recipe's export section
    # the checkpoint keeps the recipe that trained it; a later command rewrites only the run folder's copy
    trained_by = (run / "checkpoints" / "final" / "recipe.yaml").read_text()
    assert trained_by == (run / "recipe.yaml").read_text()
    assert main(["eval", "tiny", *tiny_overrides, "target.dtype=float64", "train.steps=999", "-q"]) == 0
    assert "steps: 999" in (run / "recipe.yaml").read_text()
    assert (run / "checkpoints" / "final" / "recipe.yaml").read_text() == trained_by
    assert main(["export", "tiny", *tiny_overrides, "-q"]) == 0
    shipped, trained = yaml.safe_load((run / "export" / "hf" / "recipe.yaml").read_text()), yaml.safe_load(trained_by)
    trained["target"]["model"] = Path(trained["target"]["model"]).name  # a local target's path stays here
    assert shipped == trained  # exports ship the training recipe
    assert main(["export", "tiny", *tiny_overrides, "--format", "vllm", "-q"]) == 0
    card = (run / "export" / "hf" / "README.md").read_text()
    assert f"| file × 3 | kind=chain draft_len=3 | {report['tau']:.2f} |" in card  # the card's eval table
    assert json.loads((run / "export" / "vllm" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    from transformers import AutoModelForCausalLM

    from draftsmith.models.registry import load_drafter

    hf = AutoModelForCausalLM.from_pretrained(str(run / "export" / "hf"), dtype=torch.float32).eval()
    drafter, _ = load_drafter(run / "checkpoints" / "final")
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, drafter(ids), rtol=1e-4, atol=1e-4)


def test_generate_resumes_after_crash(tmp_path, tiny_overrides):
    args = ["generate", "tiny", *tiny_overrides, "-q"]
    assert main(args) == 0
    data = tmp_path / "run" / "data"
    before = shard_tensors(data)
    # Simulate a kill during shard 1: the manifest was never written, a temp file is left behind.
    (data / "manifest.json").unlink()
    (data / "shard-00001.safetensors").rename(data / "shard-00001.safetensors.tmp999")
    assert main(args) == 0
    after = shard_tensors(data)
    assert before.keys() == after.keys()
    for name in before:
        for k in before[name]:
            assert torch.equal(before[name][k], after[name][k]), (name, k)
    # A different data recipe must not silently mix into the same folder.
    assert main([*args, "data.max_new_tokens=5"]) == 2


@pytest.mark.parametrize("strategy", ["tree", "dynamic_tree"])
def test_eval_with_tree_strategies_is_lossless(tmp_path, tiny_overrides, strategy):
    assert (
        main(
            [
                "run",
                "tiny",
                *tiny_overrides,
                "target.dtype=float64",
                f"eval.strategy={strategy}",
                "eval.baseline_hf=false",
                "-q",
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0 and report["strategy"]["kind"] == strategy
    assert report["tau"] >= 1.0 and report["mbsu"] > 0


def test_bad_tree_choices_are_a_recipe_error(tiny_overrides, capsys):
    assert main(["show", "tiny", *tiny_overrides, "eval.strategy=tree", "eval.tree.choices=[[0,0]]"]) == 2
    assert "eval.tree" in capsys.readouterr().err


def test_eval_sampling_with_filters_runs_every_decoder(tmp_path, tiny_overrides):
    assert (
        main(
            [
                "run",
                "tiny",
                *tiny_overrides,
                "eval.temperature=0.8",
                "eval.top_k=20",
                "eval.top_p=0.9",
                "eval.strategy=tree",
                "-q",
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert (report["temperature"], report["top_k"], report["top_p"]) == (0.8, 20, 0.9)
    assert report["lossless_match"] is None  # sampled outputs are checked in distribution by the decoder tests
    assert {"spec", "ar", "ar_hf", "hf_assisted"} <= set(report["tokens_per_s"])


def test_eval_during_training_logs_measured_and_estimated_tau(tmp_path, tiny_overrides):
    assert (
        main(
            [
                "run",
                "tiny",
                *tiny_overrides,
                "train.eval_every=2",
                "train.eval_prompts=2",
                "train.eval_max_new_tokens=8",
                "eval.enabled=false",
                "-q",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["stage"] == "train" and "tau_measured" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert 1.0 <= r["tau_measured"] <= 4.0 and 1.0 <= r["tau_estimate"] <= 4.0 and 0 <= r["alpha"] <= 1


def test_eval_at_several_batch_sizes_reports_each_and_stays_lossless(tmp_path, tiny_overrides, capsys):
    """eval.batch_sizes: per B, tau, both decoders' tokens/s, the speedup and the lossless match of every row
    against that prompt's own batch-1 output; the crossover and the speedup-vs-B plot; trees too."""
    args = ["run", "tiny", *tiny_overrides, "target.dtype=float64", "eval.baseline_hf=false", "-q"]
    assert main([*args, "eval.batch_sizes=[1,2,3]", "eval.prompts.n=5"]) == 0
    out = tmp_path / "run" / "eval"
    report = json.loads((out / "report.json").read_text())
    rows = report["batches"]["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2, 3]
    for r in rows:  # rows join as others finish, so neighbours and positions differ from batch 1
        assert r["lossless_match"] == 1.0 and r["ar_match"] == 1.0 and r["batch1_match"] == 1.0, r
        assert r["tau"] >= 1.0 and r["tokens_per_s"]["ar"] > 0 and r["tokens_per_s"]["spec"] > 0
        assert r["speedup"] == pytest.approx(r["tokens_per_s"]["spec"] / r["tokens_per_s"]["ar"])
    cross = report["batches"]["crossover"]
    assert cross == min((r["batch_size"] for r in rows if r["speedup"] < 1), default=None)
    assert (out / "speedup_vs_batch.png").stat().st_size > 0
    assert "## Speedup by batch size" in (out / "report.md").read_text()
    for bad in ("eval.batch_sizes=[4,1]", "eval.batch_sizes=[0]"):
        assert main(["show", "tiny", *tiny_overrides, bad]) == 2
    assert main([*args, "eval.batch_sizes=[1,3]", "eval.prompts.n=4", "eval.strategy=dynamic_tree"]) == 0
    rows = json.loads((out / "report.json").read_text())["batches"]["rows"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    assert all(r["lossless_match"] == 1.0 and r["batch1_match"] == 1.0 and r["tau"] >= 1.0 for r in rows), rows
