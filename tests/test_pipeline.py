"""The thin end-to-end slice on a tiny random Llama: generate -> train -> eval -> export, resume after a crash,
and teacher signals captured during batched generation vs a separate full forward."""
from __future__ import annotations

import json

import pytest
import torch

from draftsmith.cli import main
from draftsmith.data.dataset import RecordDataset, collate
from draftsmith.data.records import Record, load_shard, read_manifest, write_shard
from draftsmith.models.hf import load_llama_dir

REPORT_KEYS = {"target", "drafter", "prompts", "temperature", "max_new_tokens", "strategy", "tau", "acceptance_rate",
               "per_position_acceptance", "tokens_per_s", "speedup", "lossless_match", "device"}


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
    assert {"ar_hf", "ar", "spec"} <= set(report["tokens_per_s"]) and "vs_ar_hf" in report["speedup"]
    assert (run / "eval" / "report.md").read_text().startswith("# Speculative decoding eval")
    assert (run / "eval" / "acceptance.png").stat().st_size > 1000
    stages = {json.loads(line)["stage"] for line in (run / "metrics.jsonl").read_text().splitlines()}
    assert stages == {"generate", "train", "eval"}
    assert "name: tiny" in (run / "recipe.yaml").read_text()
    assert main(["export", "tiny", *tiny_overrides, "-q"]) == 0
    from transformers import AutoModelForCausalLM

    from draftsmith.models.registry import load_drafter

    hf = AutoModelForCausalLM.from_pretrained(str(run / "export" / "hf"), dtype=torch.float32).eval()
    drafter, _ = load_drafter(run / "checkpoints" / "final")
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, drafter(ids), rtol=1e-4, atol=1e-4)


def _shard_tensors(data_dir):
    return {p.name: load_shard(p).tensors for p in sorted(data_dir.glob("shard-*.safetensors"))}


def test_generate_resumes_after_crash(tmp_path, tiny_overrides):
    args = ["generate", "tiny", *tiny_overrides, "-q"]
    assert main(args) == 0
    data = tmp_path / "run" / "data"
    before = _shard_tensors(data)
    # Simulate a kill during shard 1: the manifest was never written, a temp file is left behind.
    (data / "manifest.json").unlink()
    (data / "shard-00001.safetensors").rename(data / "shard-00001.safetensors.tmp999")
    assert main(args) == 0
    after = _shard_tensors(data)
    assert before.keys() == after.keys()
    for name in before:
        for k in before[name]:
            assert torch.equal(before[name][k], after[name][k]), (name, k)
    # A different data recipe must not silently mix into the same folder.
    assert main([*args, "data.max_new_tokens=5"]) == 2


def test_teacher_topk_equals_full_forward(tmp_path, tiny_overrides, tiny_model_dir):
    assert main(["generate", "tiny", *tiny_overrides, "data.batch_size=4", "-q"]) == 0
    model = load_llama_dir(tiny_model_dir)
    ds = RecordDataset(tmp_path / "run" / "data", max_seq_len=512)
    lengths = set()
    for i in range(len(ds)):
        r = ds[i]
        lengths.add(len(r.input_ids))
        with torch.no_grad():
            logp = torch.log_softmax(model(r.input_ids[None])[0].float(), -1)  # (T, V)
        rows = logp[:-1][r.loss_mask[1:]]  # distribution that produced each target token
        torch.testing.assert_close(rows.gather(-1, r.topk_ids), r.topk_logprobs, atol=2e-2, rtol=1e-2)
        # Greedy data: the stored token is the teacher's top-1.
        assert torch.equal(r.input_ids[r.loss_mask], r.topk_ids[:, 0])
    assert len(lengths) > 1  # ragged batch really exercised


def test_records_roundtrip_and_collate_alignment(tmp_path):
    recs = [Record([5, 6, 7, 8], [0, 0, 1, 1], 0, torch.tensor([[7, 1], [8, 2]]), torch.tensor([[-0.1, -3.0]] * 2)),
            Record([9, 10, 11], [0, 1, 1], 1, torch.tensor([[10, 3], [11, 4]]), torch.tensor([[-0.2, -2.0]] * 2))]
    entry = write_shard(tmp_path / "s.safetensors", recs, {"data_hash": "x"})
    assert entry["n_sequences"] == 2 and entry["n_loss_tokens"] == 4
    shard = load_shard(tmp_path / "s.safetensors")
    back = [shard.record(i) for i in range(2)]
    assert back[1].input_ids.tolist() == [9, 10, 11] and back[1].topk_ids.tolist() == [[10, 3], [11, 4]]
    b = collate(back)
    assert b["predict_mask"].sum() == len(b["topk_ids"]) == len(b["labels"]) == 4
    assert b["labels"].tolist() == [7, 8, 10, 11] == b["topk_ids"][:, 0].tolist()
    with pytest.raises(ValueError):
        write_shard(tmp_path / "bad.safetensors", [Record([1, 2], [1, 1], 0)], {})
