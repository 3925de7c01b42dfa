"""FSDP2 (recipes/accelerate/fsdp2.yaml) through the real train loop for every drafter family: each kind's own
sharding units (``DrafterSpec.fsdp_wrap``) or, without any, the whole drafter as one unit.

How close to `accelerate launch --config_file recipes/accelerate/fsdp2.yaml -m draftsmith train RECIPE` on GPUs:
the shipped config (fsdp_version 2, TRANSFORMER_BASED_WRAP, FULL_STATE_DICT, reshard_after_forward) goes through
`accelerate launch` with 2 processes, so accelerate builds its FSDP plugin from it as on GPUs; the recipe goes
through cli.dispatch into train/loop.py, whose ``prepare`` applies FSDP2's ``fully_shard`` (parameters become
DTensors, one shard per rank), and checkpoints are gathered from the shards. What differs: CPU and gloo instead
of GPUs and NCCL; mixed_precision "no" instead of bf16 (so the numbers can equal one process's exactly); and
accelerate itself turns FSDP into DDP on CPU, so tests/fsdp2_loop_worker.py overrides that one choice."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import SMALL_SECTIONS, free_port
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.models.medusa import ADAPTER_FILE
from draftsmith.models.registry import KIND_MODULES, load_drafter
from draftsmith.recipes.loader import RECIPE_DIR, find_recipe

# run name -> (drafter section, the FSDP units the loop reports). "draft" stands for the one-process EAGLE-3
# checkpoint trained first: an acceptance head judges it (its labels are made in the loop, with the target).
FAMILIES = {
    "draft_lm": ({"kind": "draft_lm", "n_layers": 1, "init_layers": None}, "Block x1, RMSNorm x1"),
    "pard": ({"kind": "pard", "n_layers": 1, "init_layers": None, "pard_k": 3}, "Block x1, RMSNorm x1"),
    "eagle3": ({"kind": "eagle", "version": 3, "ttt_steps": 2}, "RMSNorm x1"),  # one layer: no Block
    "eagle3-2layers": ({"kind": "eagle", "version": 3, "ttt_steps": 2, "n_layers": 2}, "Block x1, RMSNorm x1"),
    "medusa": ({"kind": "medusa", "n_heads": 3}, "ResBlock x3"),
    "medusa2": ({"kind": "medusa", "n_heads": 3, "lora_r": 2}, "Block x2, ResBlock x3"),  # the adapted target
    "hydra++": ({"kind": "hydra", "n_heads": 3, "prefix_attention": True}, "Block x1, WideResBlock x3"),
    "mlp_speculator": ({"kind": "mlp_speculator", "n_predict": 3}, "none"),
    "acceptance_head": ({"kind": "acceptance_head", "draft": "draft", "n_layers": 1, "state": "before"}, "none"),
    "judge": ({"kind": "judge", "balance": False}, "none"),  # balance weighs per process: off, to compare
    # a fresh adapter: started from the tiny target's last layer the loss is ~0 and the comparison vacuous
    "kangaroo": ({"kind": "kangaroo", "exit_layer": 1, "adapter_init": "random"}, None),
    "glide": ({"kind": "glide", "init_layer": None, "lags": 2}, "GlideBlock x1, RMSNorm x1"),  # (likewise)
}
STEPS = 3


def _judge_records(src: Path, dst: Path) -> None:
    """Judge records (data.judge_labels' layout) from ordinary ones: each ends at its first response token, the
    record's one loss position, labelled acceptable on every other record. Mining real ones needs tasks."""
    from draftsmith.data.dataset import RecordDataset
    from draftsmith.data.records import Record, read_manifest, shard_entry, shard_name, write_manifest, write_shard

    manifest = read_manifest(src)
    ds = RecordDataset(src, 4096, signals=set())
    records = []
    for i in range(len(ds)):
        ids, mask = torch.as_tensor(ds[i].input_ids), torch.as_tensor(ds[i].loss_mask)
        end = int(mask.nonzero()[0]) + 1
        label = torch.tensor([float(i % 2)])
        signals = {"judge_label": label, "judge_base_ok": torch.ones(1), "judge_swap_ok": label}
        records.append(Record(ids[:end], [0] * (end - 1) + [1], i, signals=signals))
    dst.mkdir(parents=True)
    meta = {k: manifest[k] for k in ("data_hash", "target", "tokenizer_hash")}
    for si in range(2):
        write_shard(dst / shard_name(si), records[si * 8 : (si + 1) * 8], meta)
    entries = [shard_entry(dst / shard_name(si)) for si in range(2)]
    keep = ("format", "data_hash", "target", "tokenizer_hash", "recipe")
    write_manifest(
        dst,
        {
            **{k: manifest[k] for k in keep},
            "responses": "judge_labels",
            "n_sequences": len(records),
            "n_tokens": sum(e["n_tokens"] for e in entries),
            "n_loss_tokens": len(records),
            "signals": {"judge": {"axis": "loss"}},
            "shards": entries,
        },
    )


def _recipe(path: Path, out: Path, section: dict, model: Path, prompts: Path, **train) -> Path:
    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["target"].update(model=str(model), device="cpu")  # on CPU wherever the test runs (the launch hides GPUs)
    spec["eval"]["prompts"]["path"] = str(prompts)
    spec.update(drafter=section, out_dir=str(out))
    spec["train"].update(steps=STEPS, lr=3e-3, warmup_steps=0, save_every=1, keep_last=2, **train)
    path.write_text(yaml.safe_dump(spec))
    return path


def _rows(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "train"]


def _close(a: Path, b: Path, name: str = "model.safetensors") -> None:
    wa, wb = load_file(str(a / name)), load_file(str(b / name))
    assert wa.keys() == wb.keys(), (a, b)
    for k in wa:
        # Adam's first steps move a weight by ~lr (3e-3) whatever its gradient's size: where that gradient is
        # near zero (an EAGLE block's zero-initialised output projection), reduction-order rounding shows as ~1e-5
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=5e-5, msg=f"{a}: {k}")


def test_fsdp2_trains_every_drafter_family_as_one_process_does(data_dir, tiny_model_dir, prompts_file, tmp_path):
    """Every family trains 3 steps under FSDP2 on 2 gloo processes (one launch, the families in turn): the loss
    is finite and equals one process's on the same global batches step by step, the weights move, the gathered
    final checkpoint loads (strictly) and equals one process's, and the resumable checkpoint written from the
    shards (weights and optimizer state) resumes in one process onto the FSDP2 run's final weights."""
    families = dict(FAMILIES)
    for m in KIND_MODULES:  # a kind not listed above trains from its small section; its units are not asserted
        if m.SPEC.kind not in {s["kind"] for s, _ in FAMILIES.values()}:
            families[m.SPEC.kind] = ({"kind": m.SPEC.kind, **SMALL_SECTIONS.get(m.SPEC.kind, {})}, None)
    try:
        import peft  # noqa: F401
    except ImportError:
        families.pop("medusa2")
    judge_data = tmp_path / "judge-data"
    _judge_records(data_dir, judge_data)

    def recipe(name: str, out: Path, **train) -> Path:
        section = dict(families[name][0])
        if section.get("draft") == "draft":
            section["draft"] = str(tmp_path / "one" / "eagle3" / "checkpoints" / "final")
        if not (out / "data").exists():
            shutil.copytree(judge_data if name == "judge" else data_dir, out / "data")
        return _recipe(out.with_suffix(".yaml"), out, section, tiny_model_dir, prompts_file, **train)

    # One process, global batches of 4 (the reference)
    for name in families:
        assert main(["train", str(recipe(name, tmp_path / "one" / name, micro_batch_size=4)), "-q"]) == 0, name
    # FSDP2 on 2 processes: 1 sequence per process per micro-batch, 2 micro-batches per step: the same 4
    recipes = [str(recipe(name, tmp_path / "fsdp" / name, micro_batch_size=1, grad_accum=2)) for name in families]
    cfg = yaml.safe_load((RECIPE_DIR / "accelerate" / "fsdp2.yaml").read_text())
    cfg.update(num_processes=2, mixed_precision="no", main_process_port=free_port())
    (tmp_path / "fsdp2.yaml").write_text(yaml.safe_dump(cfg))
    worker = str(Path(__file__).parent / "fsdp2_loop_worker.py")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "fsdp2.yaml")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([*cmd, worker, *recipes], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "draftsmith: error" not in res.stderr, res.stderr[-4000:]
    assert res.stdout.count("2 process(es) (FSDP)") == len(families), res.stdout[-3000:]
    units = [line.split("units: ")[1].split(";")[0] for line in res.stdout.splitlines() if "FSDP2 units: " in line]
    assert len(units) == len(families), res.stdout[-3000:]
    assert all(want in (None, got) for (_, want), got in zip(families.values(), units)), res.stdout[-3000:]

    for name in families:
        one, fsdp = tmp_path / "one" / name, tmp_path / "fsdp" / name
        a, b = _rows(one), _rows(fsdp)
        assert [r["step"] for r in b] == list(range(1, STEPS + 1)), name
        for ra, rb in zip(a, b, strict=True):
            assert torch.isfinite(torch.tensor(rb["loss"])) and rb["loss"] > 1e-4, (name, rb)
            assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), name
            assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4), name  # gradients are not rescaled
        final = fsdp / "checkpoints" / "final"
        load_drafter(final)  # strict: every tensor of the drafter is in the gathered checkpoint
        _close(one / "checkpoints" / "final", final)
        if name == "medusa2":
            _close(one / "checkpoints" / "final", final, ADAPTER_FILE)
        first = load_file(str(fsdp / "checkpoints" / "step-000001" / "model.safetensors"))
        last = load_file(str(final / "model.safetensors"))
        assert any(not torch.equal(first[k], last[k]) for k in last), f"{name}: the weights did not move"
        # the FSDP2 run's step-2 checkpoint resumes in one process (same global micro-batches of 2)
        again = tmp_path / "resumed" / name
        shutil.copytree(fsdp / "checkpoints" / "step-000002", again / "checkpoints" / "step-000002")
        assert main(["train", str(recipe(name, again, micro_batch_size=2, grad_accum=2)), "-q"]) == 0, name
        assert [r["step"] for r in _rows(again)] == [STEPS], name
        _close(final, again / "checkpoints" / "final")
