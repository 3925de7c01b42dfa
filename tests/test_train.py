"""The one training loop on the tiny recipe: every loss, exact resume after a kill, gradient accumulation and two
gloo processes equal one big batch, reduced draft vocabularies, in-loop teacher, init from an existing model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SMALL_SECTIONS, drafter_kinds, free_port, run_two_ranks, small_section, tiny_mtp
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.models.registry import drafter_spec, load_drafter
from draftsmith.recipes.schema import LossConfig

KINDS = LossConfig.model_fields["kind"].annotation.__args__  # loss kinds (drafter kinds: the registry)


# Two processes need two devices: on a one-GPU machine both ranks would share it (NCCL refuses) and the
# one-process run would use the GPU while a CPU fallback would not. CPU-only machines (CI) and 2+ GPUs run it.
ONE_GPU_SKIP = pytest.mark.skipif(torch.cuda.device_count() == 1, reason="two ranks on one GPU")


def _rows(run, stage="train"):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["stage"] == stage]


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def _close(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


@pytest.mark.parametrize("kind", KINDS)
def test_every_loss_trains_and_logs(train_run, kind):
    run = train_run(kind, f"train.loss.kind={kind}", "train.steps=4", "train.lr=3e-3")
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert all(
            k in r for k in ("loss", "top1", "alpha", "tau_estimate", "tokens_per_s", "peak_mem_mb", "lr", "grad_norm")
        )
        assert r["loss"] == r["loss"] and abs(r["loss"]) < 1e3  # finite
        assert 0 <= r["alpha"] <= 1 and r["tau_estimate"] >= 1


def test_wandb_and_tensorboard_mirror_metrics_jsonl(train_run, monkeypatch):
    """train.wandb / train.tensorboard: every numeric metrics.jsonl value of each step reaches both mirrors (stand-in
    modules here, so the test needs neither package nor a network); without the package, a one-line error."""
    import types

    seen = {"wandb": [], "tb": [], "closed": []}

    class Run:
        def log(self, metrics, step=None):
            seen["wandb"].append((step, metrics))

        def finish(self):
            seen["closed"].append("wandb")

    class SummaryWriter:
        def __init__(self, log_dir):
            seen["closed"].append(("tb-dir", Path(log_dir).name))

        def add_scalar(self, tag, value, step):
            seen["tb"].append((tag, value, step))

        def close(self):
            seen["closed"].append("tb")

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: Run()))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    run = train_run("mirrored", "train.steps=2", "train.wandb=true", "train.tensorboard=true")
    rows = _rows(run)
    assert [s for s, _ in seen["wandb"] if s is not None][-2:] == [1, 2]
    for r in rows:
        logged = next(m for s, m in seen["wandb"] if s == r["step"])
        assert logged["loss"] == r["loss"] and ("train/loss", r["loss"], r["step"]) in seen["tb"]
    assert "wandb" in seen["closed"] and "tb" in seen["closed"] and ("tb-dir", "train") in seen["closed"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: import fails
    train_run("no-wandb", "train.steps=1", "train.wandb=true", expect=2)


def test_a_draft_of_any_size_from_scratch(train_run, tiny_model_dir, prompts_file):
    """A Llama-style draft of its own shape (narrower than the target, 3 layers, GQA), randomly initialised
    (init_from_target=false): it trains, checkpoints its shape, decodes losslessly; copying the target's
    embeddings into a narrower draft is refused in one line."""
    from draftsmith.models.loading import load_model

    shape = [
        "drafter.init_from_target=false",
        "drafter.init_layers=null",
        "drafter.dim=32",
        "drafter.n_layers=3",
        "drafter.n_heads=4",
        "drafter.n_kv_heads=2",
        "drafter.hidden_dim=48",
    ]
    run = train_run("scratch", *shape, "train.steps=2")
    model, info = load_drafter(run / "checkpoints" / "final")
    c = model.cfg
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.hidden_dim) == (32, 3, 4, 2, 48)
    tgt = load_model(str(tiny_model_dir)).model
    assert c.vocab_size == tgt.cfg.vocab_size and tgt.cfg.dim == 64  # same tokenizer, its own width
    assert (
        main(
            [
                "eval",
                "tiny",
                f"target.model={tiny_model_dir}",
                f"eval.prompts.path={prompts_file}",
                f"out_dir={run}",
                "target.dtype=float64",
                "-q",
            ]
        )
        == 0
    )
    assert json.loads((run / "eval" / "report.json").read_text())["lossless_match"] == 1.0
    train_run("narrow-copy", *[o for o in shape if "init_from_target" not in o], "train.steps=1", expect=2)


def test_training_lowers_the_loss_and_raises_alpha(train_run):
    rows = _rows(
        train_run("long", "train.steps=24", "train.lr=1e-2", "train.warmup_steps=0", "drafter.freeze_embeddings=false")
    )
    first, last = rows[:4], rows[-4:]
    assert sum(r["loss"] for r in last) < 0.8 * sum(r["loss"] for r in first)
    assert sum(r["alpha"] for r in last) > sum(r["alpha"] for r in first)


def test_kill_and_resume_equals_uninterrupted(train_run, monkeypatch):
    common = ["train.steps=6", "train.save_every=2", "train.keep_last=1", "train.loss.kind=tvdpp", "train.lr=3e-3"]
    full = train_run("full", *common)
    from draftsmith.train import loop

    real = loop._optimizer_step
    calls = {"n": 0}

    def dies_in_step_5(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # a kill after step 4's checkpoint, mid-way to the next one
        return real(*a, **kw)

    monkeypatch.setattr(loop, "_optimizer_step", dies_in_step_5)
    train_run("resumed", *common, expect=130)  # the CLI reports the interrupt and exits 130
    ckpts = sorted(p.name for p in (full.parent / "resumed" / "checkpoints").iterdir())
    assert ckpts == ["step-000004"]  # keep_last=1: step 4's checkpoint replaced step 2's
    monkeypatch.setattr(loop, "_optimizer_step", real)
    resumed = train_run("resumed", *common)
    _close(_weights(full / "checkpoints" / "final"), _weights(resumed / "checkpoints" / "final"), tol=1e-6)
    a, b = _rows(full), _rows(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]  # nothing logged twice, nothing lost
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-7)
    # keep_last=1: the newest resumable checkpoint stays; the final one always does
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["final", "step-000004"]


def test_a_kill_anywhere_resumes_to_the_uninterrupted_run(train_run, monkeypatch):
    """Kills that the step-boundary test above does not reach: before the first checkpoint (the killed run's
    metric rows must not stay), mid-prune (no half-deleted step folder under a checkpoint's name, and keep_last
    holds after the rerun), and the training state a resumed run writes later (its RNG included) equal to the
    uninterrupted run's, file for file."""
    from safetensors.torch import load_file

    from draftsmith.models.registry import load_drafter
    from draftsmith.train import loop, state

    common = ["train.steps=10", "train.save_every=2", "train.keep_last=2", "train.loss.kind=tvdpp", "train.lr=3e-3"]
    full = train_run("full", *common)
    real_step, real_rmtree = loop._optimizer_step, state.shutil.rmtree

    def dies_in(n):
        calls = {"n": 0}

        def step(*a, **kw):
            calls["n"] += 1
            if calls["n"] == n:
                raise KeyboardInterrupt
            return real_step(*a, **kw)

        return step

    monkeypatch.setattr(loop, "_optimizer_step", dies_in(2))  # before the first checkpoint (step 2)
    train_run("early", *common, expect=130)
    monkeypatch.setattr(loop, "_optimizer_step", real_step)
    early = train_run("early", *common)
    assert [r["step"] for r in _rows(early)] == list(range(1, 11))  # the killed run's step-1 row is gone

    def dies_mid_delete(path, *a, **kw):  # the first folder prune deletes loses a file, then the kill comes
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        if not (Path(path).name.startswith("step-") and files):
            return real_rmtree(path, *a, **kw)
        files[0].unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(state.shutil, "rmtree", dies_mid_delete)
    monkeypatch.setattr(loop, "_optimizer_step", dies_in(7))
    mid = full.parent / "mid"
    train_run("mid", *common, expect=130)  # killed inside the prune after step 6's checkpoint
    for p in (mid / "checkpoints").iterdir():
        if state.STEP_DIR.match(p.name):
            load_drafter(p)  # every folder under a checkpoint's name is whole
    monkeypatch.setattr(state.shutil, "rmtree", real_rmtree)
    monkeypatch.setattr(loop, "_optimizer_step", real_step)
    mid = train_run("mid", *common)  # resumes at step 6
    assert sorted(p.name for p in (mid / "checkpoints").iterdir()) == ["final", "step-000006", "step-000008"]
    assert [r["step"] for r in _rows(mid)] == list(range(1, 11))
    for step in ("step-000006", "step-000008"):  # step 8 written after the resume: the same state, RNG's included
        a = load_file(str(full / "checkpoints" / step / "train_state.safetensors"))
        b = load_file(str(mid / "checkpoints" / step / "train_state.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step
    _close(_weights(full / "checkpoints" / "final"), _weights(mid / "checkpoints" / "final"), tol=0)


def test_grad_accumulation_equals_one_big_batch(train_run):
    big = train_run("big", "train.micro_batch_size=4", "train.grad_accum=1", "train.steps=3")
    acc = train_run("acc", "train.micro_batch_size=2", "train.grad_accum=2", "train.steps=3")
    _close(_weights(big / "checkpoints" / "final"), _weights(acc / "checkpoints" / "final"))
    for ra, rb in zip(_rows(big), _rows(acc)):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4)  # float32 sums in another order, on a loss near 1e-4


def train_two_ranks(out, tiny_model_dir, prompts_file, *overrides: str):
    """`draftsmith train tiny` on 2 gloo processes into ``out`` (its records already there) -> the subprocess."""
    return run_two_ranks(
        "-m",
        "draftsmith",
        "train",
        "tiny",
        f"target.model={tiny_model_dir}",
        f"eval.prompts.path={prompts_file}",
        f"out_dir={out}",
        "-q",
        *overrides,
    )


@ONE_GPU_SKIP
def test_two_gloo_processes_equal_one(train_run, tiny_model_dir, prompts_file):
    one = train_run("one", "train.micro_batch_size=4", "train.steps=3")
    two = one.parent / "two"
    shutil.copytree(one / "data", two / "data")
    res = train_two_ranks(two, tiny_model_dir, prompts_file, "train.micro_batch_size=2", "train.steps=3")
    assert res.returncode == 0, res.stderr[-3000:]
    _close(_weights(one / "checkpoints" / "final"), _weights(two / "checkpoints" / "final"))
    for ra, rb in zip(_rows(one), _rows(two), strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4)  # float32 sums in another order, on a loss near 1e-4


@ONE_GPU_SKIP
def test_a_sharded_target_teaches_like_a_replicated_one(train_run, tiny_model_dir, prompts_file):
    """train.shard_target: 2 gloo processes keep half of each frozen target layer (FSDP2) and teach from the full
    distribution (teacher: target) with the same losses and weights as one process holding the whole target;
    with the periodic eval (rank 0 decodes alone) it is refused in one line."""
    common = ("train.loss.teacher=target", "train.loss.kind=fkl", "train.steps=3")
    one = train_run("one", "train.micro_batch_size=4", *common)
    two = one.parent / "sharded"
    shutil.copytree(one / "data", two / "data")
    res = train_two_ranks(
        two, tiny_model_dir, prompts_file, "train.micro_batch_size=2", "train.shard_target=true", *common
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "target layers sharded over 2 processes" in res.stdout
    _close(_weights(one / "checkpoints" / "final"), _weights(two / "checkpoints" / "final"))
    for ra, rb in zip(_rows(one), _rows(two), strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
    train_run("eval-too", "train.shard_target=true", "train.eval_every=1", "train.steps=1", expect=2)


@ONE_GPU_SKIP
def test_two_gloo_processes_resume_each_ranks_own_sampling(data_dir, tiny_model_dir, prompts_file, tmp_path):
    """Each rank seeds its loss generator apart (TVD++ samples its own tokens), so an exact multi-process resume
    needs every rank's RNG states in the checkpoint, not rank 0's for all: resuming 2 gloo processes from
    step 2 ends with the uninterrupted run's weights and losses."""

    def two_procs(out):
        if not (out / "data").exists():
            shutil.copytree(data_dir, out / "data")
        res = train_two_ranks(
            out,
            tiny_model_dir,
            prompts_file,
            "train.micro_batch_size=2",
            "train.steps=4",
            "train.save_every=2",
            "train.keep_last=2",
            "train.loss.kind=tvdpp",
            "train.lr=3e-3",
        )
        assert res.returncode == 0, res.stderr[-3000:]
        return out

    full = two_procs(tmp_path / "full")
    saved = load_file(str(full / "checkpoints" / "step-000002" / "train_state.safetensors"))
    assert not torch.equal(saved["rng.rank0.gen.loss"], saved["rng.rank1.gen.loss"])
    resumed = tmp_path / "resumed"  # as if killed after step 2's checkpoint
    shutil.copytree(full / "checkpoints" / "step-000002", resumed / "checkpoints" / "step-000002")
    two_procs(resumed)
    _close(_weights(full / "checkpoints" / "final"), _weights(resumed / "checkpoints" / "final"), tol=1e-6)
    assert [r["step"] for r in _rows(resumed)] == [3, 4]
    for ra, rb in zip(_rows(full)[2:], _rows(resumed), strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-7)


@ONE_GPU_SKIP
def test_shipped_fsdp2_config_launches_and_matches_one_process(train_run, tiny_model_dir, prompts_file, tmp_path):
    """`accelerate launch --config_file recipes/accelerate/fsdp2.yaml`: with 2+ GPUs it shards for real; on CPU
    accelerate runs DDP over gloo instead, and the loop says so. Either way the numbers equal one process's."""
    import yaml

    from draftsmith.recipes.loader import RECIPE_DIR

    common = ("drafter.init_layers=null", "train.steps=3")  # a random draft: a loss clearly above zero
    one = train_run("one", "train.micro_batch_size=4", *common)
    two = one.parent / "fsdp"
    shutil.copytree(one / "data", two / "data")
    cfg = yaml.safe_load((RECIPE_DIR / "accelerate" / "fsdp2.yaml").read_text())
    cfg.update(num_processes=2, mixed_precision="no", main_process_port=free_port())
    (tmp_path / "fsdp2.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(tmp_path / "fsdp2.yaml"),
        "-m",
        "draftsmith",
        "train",
        "tiny",
        f"target.model={tiny_model_dir}",
        f"eval.prompts.path={prompts_file}",
        f"out_dir={two}",
        "train.micro_batch_size=2",
        *common,
        "-q",
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 process(es)" in res.stdout
    if not torch.cuda.is_available():
        assert "asks for FSDP but this run is MULTI_CPU" in res.stderr
    _close(_weights(one / "checkpoints" / "final"), _weights(two / "checkpoints" / "final"))
    for ra, rb in zip(_rows(one), _rows(two), strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5) and ra["loss"] > 1e-3


def test_fsdp2_checkpoints_gather_and_resume_sharded_or_not(tmp_path):
    """FSDP2 shards parameters as DTensors (safetensors cannot save them; found on an H100): checkpoints gather the
    full weights and optimizer state, in the unsharded layout, and resume onto shards or a plain model alike.
    Two gloo ranks on CPU with ``fully_shard`` applied directly (accelerate shards on GPUs only)."""
    worker = str(Path(__file__).parent / "fsdp2_worker.py")
    res = run_two_ranks(worker, str(tmp_path / "step-000002"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_deepspeed_refuses_resumable_checkpoints_up_front_and_saves_through_accelerate():
    """DeepSpeed's optimizer keeps its own partitioned state: train.save_every is refused before any work, with
    the fix in the message. Checkpoint weights come from accelerate's consolidation (ZeRO-3 leaves the module's
    own tensors empty), which the shipped ZeRO-3 config enables. (DeepSpeed needs GPUs: a stand-in accelerator.)"""
    from types import SimpleNamespace

    import yaml
    from accelerate.utils import DistributedType

    from draftsmith.errors import DraftsmithError
    from draftsmith.recipes.loader import RECIPE_DIR
    from draftsmith.train.loop import _check_sharding, _gathered

    ds = SimpleNamespace(
        distributed_type=DistributedType.DEEPSPEED, device="cuda", get_state_dict=lambda model: {"w": torch.ones(2)}
    )
    with pytest.raises(DraftsmithError, match="train.save_every: .*DeepSpeed.*fsdp2.yaml"):
        _check_sharding(ds, SimpleNamespace(save_every=100, shard_target=False, eval_every=0))
    _check_sharding(ds, SimpleNamespace(save_every=0, shard_target=False, eval_every=0))
    model = torch.nn.Linear(2, 1)
    assert _gathered(ds, model)[0]["w"].tolist() == [1.0, 1.0]
    plain = SimpleNamespace(distributed_type=DistributedType.NO, device="cpu")
    assert _gathered(plain, model) == (None, None)  # the unwrapped module's own state dict is already full
    cfg = yaml.safe_load((RECIPE_DIR / "accelerate" / "deepspeed_zero3.yaml").read_text())
    assert cfg["deepspeed_config"]["zero3_save_16bit_model"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["ddp.yaml", "fsdp2.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"])
def test_shipped_launcher_configs_run_on_one_gpu(train_run, tiny_model_dir, prompts_file, tmp_path, config):
    """The shipped launcher configs through `accelerate launch` on a real GPU (NCCL; FSDP2 shards the draft's
    blocks as DTensors and ZeRO-3 partitions every parameter even at one rank); weights and losses equal a plain
    one-process run's on the same device. DDP / FSDP2: a resumable checkpoint mid-run, then a rerun that resumes
    from it. DeepSpeed (which refuses resumable checkpoints): two micro-batches per step, accumulated inside its
    engine with the recipe's clipping."""
    import yaml

    from draftsmith.recipes.loader import RECIPE_DIR

    ds = config.startswith("deepspeed")
    if ds:
        pytest.importorskip("deepspeed")
    common = (
        "drafter.init_layers=null",
        "train.steps=4",
        *(
            ("train.micro_batch_size=1", "train.grad_accum=2", "train.grad_clip=0.5")
            if ds
            else ("train.save_every=2", "train.micro_batch_size=2")
        ),
    )
    one = train_run("one", *common)
    two = one.parent / config.split(".")[0]
    shutil.copytree(one / "data", two / "data")
    cfg = yaml.safe_load((RECIPE_DIR / "accelerate" / config).read_text())
    cfg.update(num_processes=1, mixed_precision="no", main_process_port=free_port())
    (tmp_path / config).write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(tmp_path / config),
        "-m",
        "draftsmith",
        "train",
        "tiny",
        f"target.model={tiny_model_dir}",
        f"eval.prompts.path={prompts_file}",
        f"out_dir={two}",
        *common,
        "-q",
    ]
    for attempt in ("fresh",) if ds else ("fresh", "resumed"):  # the rerun resumes at step 2, trains 3-4 again
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        kind = {"fsdp2.yaml": "FSDP"}.get(config, "DEEPSPEED" if ds else None)
        if kind:
            assert f"1 process(es) ({kind})" in res.stdout, res.stdout[-2000:]
        assert ("resuming at step 2" in res.stdout) == (attempt == "resumed"), res.stdout[-2000:]
        _close(_weights(one / "checkpoints" / "final"), _weights(two / "checkpoints" / "final"), tol=1e-4)
        for ra, rb in zip(_rows(one), _rows(two), strict=True):
            assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4) and ra["loss"] > 1e-3
            assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-3)


def test_reduced_draft_vocabulary_trains_and_decodes_losslessly(train_run, tiny_model_dir, prompts_file):
    run = train_run("vocab", "drafter.draft_vocab=40", "train.steps=3")
    ce = train_run("vocab-ce", "drafter.draft_vocab=40", "train.steps=2", "train.loss.kind=ce")
    assert all(0 <= r["alpha"] <= 1 for r in _rows(ce))  # CE drops out-of-vocabulary labels, alpha is still logged
    drafter, info = load_drafter(run / "checkpoints" / "final")
    assert drafter.lm_head.weight.shape[0] == 40 and drafter.cfg.head_vocab_size == 40
    kept = torch.arange(40) + drafter.d2t
    assert torch.equal(drafter.t2d[kept], torch.arange(40)) and int((drafter.t2d >= 0).sum()) == 40
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(tiny_model_dir)).eos_token_id
    assert eos in kept.tolist()  # EOS is always kept
    args = [
        "eval",
        "tiny",
        f"target.model={tiny_model_dir}",
        f"eval.prompts.path={prompts_file}",
        f"out_dir={run}",
        "target.dtype=float64",
        "-q",
    ]
    assert main(args) == 0
    assert json.loads((run / "eval" / "report.json").read_text())["lossless_match"] == 1.0
    # DistillSpec on-policy data written by this drafter: every response token is one of its 40 target ids
    gen = [
        "generate",
        "tiny",
        f"target.model={tiny_model_dir}",
        f"data.prompts.path={prompts_file}",
        f"out_dir={run.parent / 'on-policy'}",
        f"data.on_policy.checkpoint={run / 'checkpoints' / 'final'}",
        "data.on_policy.fraction=1.0",
        "-q",
    ]
    assert main(gen) == 0
    from draftsmith.data.dataset import RecordDataset

    written = torch.cat([r.input_ids[r.loss_mask] for r in RecordDataset(run.parent / "on-policy" / "data", 512)])
    assert len(written) > 0 and torch.isin(written, kept).all()


def test_teacher_from_the_target_in_the_loop(train_run):
    """The full target teacher in the loop; with the vocabulary in blocks too (train.loss.vocab_chunk) the run's
    losses and acceptance metrics are the same."""
    common = ("train.loss.teacher=target", "train.loss.kind=jsd", "train.steps=3", "train.loss.chunk=7")
    rows = _rows(train_run("in-loop", *common))
    assert len(rows) == 3 and all(0 <= r["alpha"] <= 1 for r in rows)
    blocked = _rows(train_run("in-loop-blocks", *common, "train.loss.vocab_chunk=10"))
    for a, b in zip(rows, blocked, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4) and a["alpha"] == pytest.approx(b["alpha"], rel=1e-4)


def test_init_from_an_existing_model_with_the_same_tokenizer(train_run, tiny_model_dir, tiny_tokenizer, tmp_path):
    run = train_run("init", f"drafter.init_from={tiny_model_dir}", "train.steps=2")
    drafter, _ = load_drafter(run / "checkpoints" / "final")
    assert drafter.cfg.n_layers == 2  # the source model's architecture, not drafter.n_layers
    # a smaller model with the same tokenizer: its weights, exactly, with the embeddings frozen by default
    from conftest import build_tokenizer, save_tiny_llama

    from draftsmith.errors import DraftsmithError
    from draftsmith.models.draft_lm import build_draft_lm
    from draftsmith.models.loading import load_model

    small = save_tiny_llama(
        tmp_path / "small",
        tiny_tokenizer,
        seed=5,
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    tgt = load_model(str(tiny_model_dir))
    draft = build_draft_lm({"init_from": str(small)}, tgt.model, tokenizer=tgt.tokenizer)
    want = load_model(str(small)).model.state_dict()
    assert draft.cfg.n_layers == 1 and draft.cfg.dim == 32 and draft.state_dict().keys() == want.keys()
    assert all(torch.equal(v, want[k]) for k, v in draft.state_dict().items())
    assert not draft.embed_tokens.weight.requires_grad and draft.layers[0].self_attn.q_proj.weight.requires_grad
    thawed = build_draft_lm({"init_from": str(small), "freeze_embeddings": False}, tgt.model, tokenizer=tgt.tokenizer)
    assert thawed.embed_tokens.weight.requires_grad
    # another tokenizer (one token more) is refused, even where the ids it shares would line up
    other = build_tokenizer()
    other.add_tokens(["<extra>"])
    foreign = save_tiny_llama(tmp_path / "foreign", other)
    with pytest.raises(DraftsmithError, match="different tokenizer"):
        build_draft_lm({"init_from": str(foreign)}, tgt.model, tokenizer=tgt.tokenizer)


# Every registered heads kind (its small section, tests/conftest.py), then variants of the shipped ones.
VARIANTS = {
    "hydra++": ("hydra", {"n_heads": 3, "prefix_attention": True}),
    "medusa-2": ("medusa", {"n_heads": 3, "lora_r": 4}),
    "hydra-vocab": ("hydra", {"n_heads": 3, "draft_vocab": 64}),
    "medusa-2-vocab": ("medusa", {"n_heads": 3, "lora_r": 4, "draft_vocab": 64}),
    "eagle1": ("eagle", {"version": 1, "ttt_steps": 2}),
    "fspad": ("eagle", {"version": 1, "ttt_steps": 2, "feature_sampling": True, "partial_alignment": True}),
}
HEADS = [*drafter_kinds(interface="heads"), "hydra++", "medusa-2", "hydra-vocab", "medusa-2-vocab"]


def _case(name: str):
    """A test case name -> (drafter.kind, its typed section)."""
    kind, fields = VARIANTS.get(name, (name, {}))
    return kind, small_section(kind, **fields)


def _check_written(data_dir, tgt, drafter):
    """On-policy records by a drafter that reads the target's states: the drafter-written responses are exactly
    what the one-row writer gives row by row (greedy; tests/test_data_writer.py shows it writes the drafter's
    text, and that the data stage's batched writer equals it)."""
    from draftsmith.data.dataset import RecordDataset
    from draftsmith.data.engine import write_one
    from draftsmith.data.records import SOURCES

    ds = RecordDataset(data_dir, 10_000)
    recs = [ds[i] for i in range(len(ds))]
    written = [r for r in recs if r.source == SOURCES["drafter"]]
    assert written and len(written) < len(recs)
    for r in written:
        start = int(r.loss_mask.nonzero()[0])  # one turn: the context, then the response
        ctx, resp = r.input_ids[:start], r.input_ids[start:][r.loss_mask[start:]].tolist()
        assert resp == write_one(tgt, drafter, ctx, len(resp))[0]


@pytest.mark.parametrize("kind", HEADS)
def test_feature_heads_train_from_stored_or_in_loop_features_and_decode_losslessly(
    kind, train_run, tiny_model_dir, prompts_file, tmp_path
):
    """Medusa-1 and the MLP speculator are plug-ins of the same loop: features from the frozen target in the
    loop or from stored hidden_last records give the same loss on the same batch; the trained heads decode
    losslessly."""
    import yaml

    from draftsmith.data.dataset import RecordDataset, collate, token_counts
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import build_drafter
    from draftsmith.recipes.loader import find_recipe
    from draftsmith.train import objectives

    drafter_kind, section = _case(kind)
    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = section.model_dump(exclude_defaults=True) | {"kind": drafter_kind}
    recipe = tmp_path / f"tiny-{kind}.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    run = train_run(kind, "train.steps=3", "train.loss.kind=fkl", recipe=str(recipe))
    rows = _rows(run)
    drafter, info = load_drafter(run / "checkpoints" / "final")
    n = drafter.max_draft_len  # the checkpoint keeps the number of heads
    assert info["kind"] == drafter_kind and (n == 3 or drafter_kind not in SMALL_SECTIONS)
    assert len(rows) == 3 and all(
        k in rows[-1] for k in ("top1_head0", f"alpha_head{n - 1}", "tau_estimate", f"acc_head{n - 1}_rank2")
    )
    from draftsmith.eval.tree import choices_from_run, tree_from_choices

    choices = choices_from_run(run, 5)  # a Medusa tree from the measured per-head rank accuracies
    assert len(choices) == 5 and len(tree_from_choices(choices)) == 5
    assert (drafter.new_context(4) is not None) == (kind == "hydra++")
    medusa2 = kind.startswith("medusa-2")
    assert (getattr(drafter, "target_adapter", None) is not None and "top1_target" in rows[-1]) == medusa2
    args = [
        "eval",
        str(recipe),
        f"target.model={tiny_model_dir}",
        f"eval.prompts.path={prompts_file}",
        f"out_dir={run}",
        "target.dtype=float64",
        "-q",
    ]
    assert main(args) == 0
    assert json.loads((run / "eval" / "report.json").read_text())["lossless_match"] == 1.0
    dyn = ["eval.strategy=dynamic_tree", "eval.tree.top_k=2", "eval.tree.total_tokens=5", "eval.tree.choices=null"]
    assert main(args + dyn + [f"eval.tree.depth={n}"]) == 0  # one level per head
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0 and report["strategy"]["kind"] == "dynamic_tree"
    assert main(args + dyn + [f"eval.tree.depth={n + 1}"]) == 2  # deeper than the heads: refused in one line
    # the same batch, features stored vs computed, on on-policy records half written by these heads
    stored = tmp_path / "stored"
    gen = [
        "generate",
        "tiny",
        f"target.model={tiny_model_dir}",
        f"data.prompts.path={prompts_file}",
        f"out_dir={stored}",
        "data.signals.hidden_last=true",
        "-q",
    ]
    on_policy = [f"data.on_policy.checkpoint={run / 'checkpoints' / 'final'}", "data.on_policy.fraction=0.5"]
    tgt = load_model(str(tiny_model_dir)).model
    if medusa2:  # its heads read the adapted target's states: it cannot write for the original target
        assert main(gen + on_policy) == 2 and main(gen) == 0
    else:
        assert main(gen + on_policy) == 0
        _check_written(stored / "data", tgt, drafter)
    facts = {"counts": token_counts(stored / "data", tgt.cfg.vocab_size)} if section.draft_vocab else {}
    heads = build_drafter(drafter_kind, section, tgt, **facts)
    if facts:  # a reduced head vocabulary: 64 target rows, and target-vocabulary logits outside them are -inf
        assert heads.lm_heads[0].weight.shape[0] == 64 == int((drafter.t2d >= 0).sum())
        torch.testing.assert_close(heads.lm_heads[0].weight, tgt.lm_head.weight[heads.head_ids])
    batch = collate([RecordDataset(stored / "data", 128, signals={"topk", "hidden_last"})[i] for i in range(4)])
    cfg = __import__("draftsmith.recipes.schema", fromlist=["LossConfig"]).LossConfig(kind="fkl")
    objective = objectives.objective_for(drafter_kind)
    with_stored = objective(heads, batch, cfg, objectives.Context(unwrapped=heads, params=section))
    del batch["hidden_last"]
    in_loop = objective(heads, batch, cfg, objectives.Context(unwrapped=heads, target=tgt, params=section))
    assert with_stored.n == in_loop.n > 0
    torch.testing.assert_close(with_stored.loss_sum, in_loop.loss_sum, rtol=1e-2, atol=1e-3)  # bf16 storage


@pytest.mark.parametrize(
    "drafter",
    [*drafter_kinds(interface="heads"), *drafter_kinds(interface="features"), "medusa-2", "hydra++", "eagle1", "fspad"],
)
def test_every_head_kind_trains_with_every_loss_and_teacher(drafter, data_dir, tiny_model_dir):
    """Each head kind (Medusa-2 with its LoRA target too) works with every loss of the menu, from the
    stored top-k and from the full target (teacher: target): a finite loss over the same positions, and a gradient
    that reaches the head's weights."""
    from draftsmith.data.dataset import RecordDataset, collate
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import build_drafter
    from draftsmith.train import objectives

    torch.manual_seed(0)  # the drafter's init: the same whatever ran before
    tgt = load_model(str(tiny_model_dir)).model
    kind, params = _case(drafter)
    model = build_drafter(kind, params, tgt).float().train()
    if kind == "mtp":  # a fresh MTP layer drafts near-uniformly: every TVD++ reward ties at 0, so start it sharp
        model = tiny_mtp(tgt, 0.05).float().train()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # off the zero-initialised start, where TVD++'s standardised rewards can all tie
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    batch = collate([RecordDataset(data_dir, 128, signals={"topk"})[i] for i in range(4)])
    n_seen = set()
    for loss_kind in KINDS:
        for teacher in ("records", "target"):
            cfg = LossConfig(kind=loss_kind, teacher=teacher)
            model.zero_grad()
            out = objectives.objective_for(kind)(
                model, batch, cfg, objectives.Context(unwrapped=model, target=tgt, generator=gen, params=params)
            )
            assert torch.isfinite(out.loss_sum) and out.n > 0, (loss_kind, teacher)
            out.loss_sum.backward()
            grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
            assert grads and any(g.abs().sum() > 0 for g in grads), (loss_kind, teacher)
            n_seen.add(out.n)
    assert len(n_seen) == 1  # every loss and teacher trains on the same positions


def test_head_and_ttt_labels_are_the_tokens_k_plus_2_ahead(data_dir):
    """The training side of the off-by-one check (the decoder side is tests/test_decode_heads.py's oracles): for head k
    (or EAGLE TTT step k) at position t, objectives.shifted_teachers hands the token at t + k + 2, the target's
    top-k from the position that predicts it (t + k + 1, the feature a chain decoder reads), and that position's
    flat index; only where both t and t + k + 1 predict response tokens."""
    from draftsmith.data.dataset import RecordDataset, collate
    from draftsmith.train import objectives

    batch = collate([RecordDataset(data_dir, 128, signals={"topk"})[i] for i in range(4)])
    ids, pm = batch["input_ids"], batch["predict_mask"]
    B, T = pm.shape
    rows = {(b, t): r for r, (b, t) in enumerate(pm.nonzero().tolist())}  # loss-axis row of each position
    selects, teachers, future = objectives.shifted_teachers(batch, LossConfig(kind="fkl"), None, 3, None)
    for k in range(3):
        where = [list(divmod(i, T)) for i in selects[k].tolist()]  # flat indices of t, row-major
        assert where == sorted(where) and len(set(map(tuple, where))) == len(where)
        assert where and len(where) == len(teachers[k].labels) == len(future[k])
        for j, (b, t) in enumerate(where):
            assert pm[b, t] and pm[b, t + k + 1]
            assert int(teachers[k].labels[j]) == int(ids[b, t + k + 2])
            assert torch.equal(teachers[k].topk_ids[j], batch["topk_ids"][rows[b, t + k + 1]])
            assert int(future[k][j]) == b * T + t + k + 1
        # every position whose k + 1-th successor still predicts a response token is trained
        assert len(where) == int((pm[:, : T - k - 1] & pm[:, k + 1 :]).sum())


def test_a_deeper_eagle_grows_from_a_one_layer_checkpoint(train_run, tiny_model_dir, prompts_file, tmp_path):
    """drafter.n_layers=2 warm-started from a 1-layer EAGLE-3 run (train.init_checkpoint): its added block starts as
    the identity, trains, checkpoints with its depth and decodes losslessly (the eval reads the depth from the
    checkpoint)."""
    import yaml

    from draftsmith.recipes.loader import find_recipe

    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "eagle", "version": 3, "ttt_steps": 2}
    recipe = tmp_path / "tiny-eagle3.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    one = train_run("one", "train.steps=2", recipe=str(recipe))
    deep = train_run(
        "deep",
        "train.steps=2",
        "drafter.n_layers=2",
        f"train.init_checkpoint={one / 'checkpoints' / 'final'}",
        recipe=str(recipe),
    )
    model, info = load_drafter(deep / "checkpoints" / "final")
    assert info["config"]["n_layers"] == 2 and len(model.extra) == 1
    assert model.extra[0].self_attn.o_proj.weight.abs().sum() > 0  # trained away from the identity start
    assert len([r for r in _rows(deep) if "loss" in r]) == 2
    args = [
        "eval",
        str(recipe),
        f"target.model={tiny_model_dir}",
        f"eval.prompts.path={prompts_file}",
        f"out_dir={deep}",
        "target.dtype=float64",
        "-q",
    ]
    assert main(args) == 0
    assert json.loads((deep / "eval" / "report.json").read_text())["lossless_match"] == 1.0


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_trains_from_stored_or_in_loop_features_and_decodes_losslessly(
    version, train_run, tiny_model_dir, prompts_file, tmp_path
):
    """EAGLE-1 (feature + token loss) and EAGLE-3 (TTT, reduced vocabulary) in the one loop: per-step metrics,
    a lossless eval (chain and dynamic tree), and the same loss from stored or in-loop target features."""
    import yaml

    from draftsmith.data.dataset import RecordDataset, collate, token_counts
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import build_drafter
    from draftsmith.recipes.loader import find_recipe
    from draftsmith.recipes.schema import EagleDrafterConfig
    from draftsmith.train import objectives

    drafter = {"kind": "eagle", "version": version, "ttt_steps": 3, "draft_vocab": 120}
    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = drafter
    recipe = tmp_path / f"tiny-eagle{version}.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    run = train_run(f"eagle{version}", "train.steps=3", "train.loss.kind=fkl", "train.eval_every=3", recipe=str(recipe))
    rows = [r for r in _rows(run) if "loss" in r]
    assert any("tau_measured" in r for r in _rows(run))  # the in-training decode (train.eval_every)
    assert len(rows) == 3 and all(k in rows[-1] for k in ("top1_step0", "alpha_step2", "tau_estimate"))
    model, info = load_drafter(run / "checkpoints" / "final")
    assert info["kind"] == "eagle" and model.cfg.version == version
    assert model.cfg.head_vocab_size == 120 and int((model.t2d >= 0).sum()) == 120
    for strategy in ("chain", "dynamic_tree"):
        args = [
            "eval",
            str(recipe),
            f"target.model={tiny_model_dir}",
            f"eval.prompts.path={prompts_file}",
            f"out_dir={run}",
            "target.dtype=float64",
            f"eval.strategy={strategy}",
            "-q",
        ]
        assert main(args) == 0
        assert json.loads((run / "eval" / "report.json").read_text())["lossless_match"] == 1.0
    # the same batch, features stored vs computed by the target in the loop, on records half written by this EAGLE
    stored = tmp_path / "stored"
    gen = [
        "generate",
        "tiny",
        f"target.model={tiny_model_dir}",
        f"data.prompts.path={prompts_file}",
        f"out_dir={stored}",
        "data.signals.hidden_last=true",
        "data.signals.hidden_layers=eagle3",
        f"data.on_policy.checkpoint={run / 'checkpoints' / 'final'}",
        "data.on_policy.fraction=0.5",
        "-q",
    ]
    assert main(gen) == 0
    tgt = load_model(str(tiny_model_dir)).model
    _check_written(stored / "data", tgt, model)
    params = EagleDrafterConfig(**drafter)
    eagle = build_drafter("eagle", params, tgt, counts=token_counts(stored / "data", tgt.cfg.vocab_size))
    ds = RecordDataset(stored / "data", 128, signals=drafter_spec("eagle").signals_for(eagle))
    assert objectives.features_stored(eagle, json.loads((stored / "data" / "manifest.json").read_text())["signals"])
    batch = collate([ds[i] for i in range(4)])
    cfg = LossConfig(kind="fkl")
    with_stored = objectives.eagle_objective(eagle, batch, cfg, objectives.Context(unwrapped=eagle, params=params))
    for k in ("hidden_last", "hidden_aux"):
        del batch[k]
    in_loop = objectives.eagle_objective(
        eagle, batch, cfg, objectives.Context(unwrapped=eagle, target=tgt, params=params)
    )
    assert with_stored.n == in_loop.n > 0
    torch.testing.assert_close(with_stored.loss_sum, in_loop.loss_sum, rtol=2e-2, atol=1e-3)  # bf16 storage


def test_hass_trains_eagle3_with_its_top_k_loss_and_context_alignment(
    train_run, tiny_model_dir, prompts_file, tmp_path
):
    """HASS on EAGLE-3 through the one loop (drafter.ttt_detach, train.loss.hod_weight / hod_k): its first loss is
    the plain run's plus the top-k term (same seed, same batch), and the drafter decodes losslessly."""
    import yaml

    from draftsmith.recipes.loader import find_recipe

    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "eagle", "version": 3, "ttt_steps": 3}
    recipe = tmp_path / "tiny-eagle3.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    plain = train_run("plain", "train.steps=2", "train.log_every=1", recipe=str(recipe))
    hass = train_run("hass", "train.steps=2", "train.log_every=1", "drafter.ttt_detach=true",
                     "train.loss.hod_weight=1.0", "train.loss.hod_k=4", recipe=str(recipe))  # fmt: skip
    first = [next(r for r in _rows(run) if "loss" in r) for run in (plain, hass)]
    assert first[1]["loss"] > first[0]["loss"] and first[1]["top1_step0"] == first[0]["top1_step0"]
    args = ["eval", str(recipe), f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}",
            f"out_dir={hass}", "target.dtype=float64", "-q"]  # fmt: skip
    assert main(args) == 0
    assert json.loads((hass / "eval" / "report.json").read_text())["lossless_match"] == 1.0


def test_medusa2_adapters_merge_into_the_target_and_resume(tiny_model_dir, tmp_path):
    """Medusa-2's LoRA: the merged target equals the peft-adapted one; a checkpoint round-trips the adapters
    (resume) and serves them merged (eval), without saving the target itself."""
    from draftsmith.models.loading import load_model
    from draftsmith.models.medusa import ADAPTER_FILE, merge_adapter
    from draftsmith.models.registry import build_drafter, load_weights_into, save_drafter

    tgt = load_model(str(tiny_model_dir), torch.float64).model
    heads = build_drafter("medusa", {"n_heads": 2, "lora_r": 4, "lora_alpha": 8}, tgt)
    with torch.no_grad():  # non-zero adapters (B starts at zero)
        for n, p in heads.base.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)
    assert {n for n, p in heads.named_parameters() if p.requires_grad and n.startswith("base.")} == {
        n for n, _ in heads.base.named_parameters(prefix="base") if "lora_" in n
    }
    ids = torch.randint(0, tgt.cfg.vocab_size, (1, 9))
    ckpt = save_drafter(tmp_path / "ckpt", heads, "medusa", {})
    assert (ckpt / ADAPTER_FILE).is_file() and not any(
        k.startswith("base.") for k in load_file(str(ckpt / "model.safetensors"))
    )
    loaded, info = load_drafter(ckpt, dtype=torch.float64)
    served = load_model(str(tiny_model_dir), torch.float64).model
    merge_adapter(served, loaded.target_adapter, info["config"]["lora"])
    with torch.no_grad():
        torch.testing.assert_close(served(ids), heads.base(ids))
        assert not torch.allclose(served(ids), tgt(ids))  # the original target is untouched and differs
    fresh = build_drafter("medusa", {"n_heads": 2, "lora_r": 4, "lora_alpha": 8}, tgt)
    load_weights_into(ckpt, fresh)
    with torch.no_grad():
        torch.testing.assert_close(fresh.base(ids), heads.base(ids))


def test_medusa2_adapters_train_at_their_own_learning_rate(tiny_model_dir):
    """The optimizer gives Medusa-2's adapters lr x lora_lr_ratio and its heads lr; the schedule scales both and
    every trainable parameter is in exactly one group."""
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import build_drafter
    from draftsmith.recipes.schema import TrainConfig
    from draftsmith.train.loop import build_optimizer

    tgt = load_model(str(tiny_model_dir), torch.float32).model
    heads = build_drafter("medusa", {"n_heads": 2, "lora_r": 4, "lora_lr_ratio": 0.1}, tgt)
    opt, sched = build_optimizer(heads, TrainConfig(lr=2e-3, warmup_steps=0, steps=10, lr_schedule="constant"))
    by_id = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    trainable = dict((n, p) for n, p in heads.named_parameters() if p.requires_grad)
    assert len(by_id) == len(trainable) and all(id(p) in by_id for p in trainable.values())
    assert (
        {n for n, p in trainable.items() if by_id[id(p)] == pytest.approx(2e-4)}
        == {n for n in trainable if n.startswith("base.")}
        != set()
    )
    assert all(by_id[id(p)] == pytest.approx(2e-3) for n, p in trainable.items() if not n.startswith("base."))
    medusa1 = build_drafter("medusa", {"n_heads": 2}, tgt)
    opt1, _ = build_optimizer(medusa1, TrainConfig(lr=2e-3))
    assert len(opt1.param_groups) == 1


@pytest.mark.parametrize("vocab", [None, 64])
def test_medusa2_self_distils_the_target_in_its_own_vocabulary(
    vocab, train_run, tiny_model_dir, prompts_file, tmp_path
):
    """On greedy records, step 1 (adapters still zero, so the adapted target is the original) must agree with
    every label. Reduced heads once mapped the adapted target's labels into the heads' draft ids too, and the
    self-distillation then pulled the target away from itself."""
    import yaml

    from draftsmith.recipes.loader import find_recipe

    out = tmp_path / f"m2-{vocab}"
    assert (
        main(
            [
                "generate",
                "tiny",
                f"target.model={tiny_model_dir}",
                f"data.prompts.path={prompts_file}",
                f"out_dir={out}",
                "data.temperature=0",
                "-q",
            ]
        )
        == 0
    )
    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "medusa", "n_heads": 2, "lora_r": 4, "draft_vocab": vocab}
    recipe = tmp_path / "tiny-m2.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    rows = _rows(train_run(out.name, "train.steps=1", "train.loss.kind=fkl", recipe=str(recipe)))
    assert rows[0]["top1_target"] > 0.99, rows[0]


def test_medusa2_eval_report_names_the_reference_it_compared_against(train_run, tiny_model_dir, prompts_file):
    """A Medusa-2 eval skips the HF baseline (HF would run the target without the adapters), so its lossless
    check compares against draftsmith's own AR on the adapted target, and the report must say "ar", not "ar_hf"."""
    import json

    from draftsmith.cli import main

    run = train_run("medusa2", "drafter={kind: medusa, n_heads: 2, lora_r: 4}", "train.steps=2")
    args = [f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}", f"out_dir={run}", "-q"]
    assert main(["eval", "tiny", *args, "eval.baseline_hf=true", "eval.prompts.n=2"]) == 0
    report = json.loads((run / "eval" / "report.json").read_text())
    assert "vs_ar_hf" not in report["speedup"] and report["lossless_match"] == 1.0
    assert report["lossless_reference"] == "ar"


@pytest.mark.parametrize(
    "settings",
    [[], ["eval.strategy=tree"], ["eval.stop={rule: entropy, threshold: 0.5}"]],
    ids=["chain", "tree", "entropy_stop"],
)
def test_in_training_tau_equals_draftsmith_eval_on_the_same_checkpoint(
    train_run, tiny_model_dir, prompts_file, settings
):
    """train.eval_every decodes like `draftsmith eval`: the same checkpoint, prompts and eval settings (strategy,
    stop rule) give the same measured tau."""
    import json

    from draftsmith.cli import main

    common = ["target.dtype=float64", "eval.prompts.n=3", "eval.max_new_tokens=16", *settings]
    run = train_run(
        "quick-" + "-".join(s.split("=")[0] for s in settings),
        "train.steps=2",
        "train.eval_every=2",
        "train.eval_prompts=3",
        "train.eval_max_new_tokens=16",
        *common,
    )
    quick = [r for r in _rows(run) if "tau_measured" in r]
    assert [r["step"] for r in quick] == [2]
    args = [f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}", f"out_dir={run}", "-q"]
    assert main(["eval", "tiny", *args, *common, "eval.baseline_hf=false"]) == 0
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["tau"] == pytest.approx(quick[0]["tau_measured"], rel=1e-9)


def _launch_machines(out, tiny_model_dir, prompts_file, multi: bool, *overrides: str):
    """Two `accelerate launch --num_machines 2 --machine_rank R` commands on loopback, one process each (two
    "machines" on this host) -> their finished subprocesses."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "2", "--machine_rank",
               str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--num_processes", "2",
               *(["--multi_gpu"] if multi else ["--cpu"]), "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "draftsmith", "train", "tiny", f"target.model={tiny_model_dir}",
               f"eval.prompts.path={prompts_file}", f"out_dir={out}", "-q", *overrides]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return [(p, *p.communicate(timeout=300)) for p in procs]


@ONE_GPU_SKIP
def test_two_machines_on_loopback_train_as_one_process(train_run, tiny_model_dir, prompts_file):
    """`accelerate launch --num_machines 2 --multi_gpu` twice (machine ranks 0 and 1, one process each, gloo on
    loopback) trains exactly as one process with both micro-batches does; without --multi_gpu, accelerate's
    simple launcher would start two independent one-process trainings on the same out_dir: each machine refuses
    in one line, exit 2, and nothing is trained."""
    one = train_run("one", "train.micro_batch_size=4", "train.steps=3")
    two = one.parent / "two"
    shutil.copytree(one / "data", two / "data")
    for p, _, err in _launch_machines(two, tiny_model_dir, prompts_file, True, "train.micro_batch_size=2",
                                      "train.steps=3"):  # fmt: skip
        assert p.returncode == 0, err[-3000:]
    _close(_weights(one / "checkpoints" / "final"), _weights(two / "checkpoints" / "final"))
    for ra, rb in zip(_rows(one), _rows(two), strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4)
    bad = one.parent / "bad"
    shutil.copytree(one / "data", bad / "data")
    for p, _, err in _launch_machines(bad, tiny_model_dir, prompts_file, False, "train.steps=3"):
        lines = [x for x in err.strip().splitlines() if x.startswith("draftsmith: error:")]
        assert p.returncode != 0 and len(lines) == 1 and "--num_machines" in lines[0], err[-3000:]
    assert not (bad / "checkpoints").exists()
