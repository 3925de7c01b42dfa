"""Integrity: checkpoints and data shards carry checksums that every load verifies, two clean runs write
byte-identical files, and every bad checkpoint or data folder is one line on stderr with exit code 2."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir, tiny_model_dir, prompts_file):
    """One tiny run, trained once for the module: data, resumable step-N checkpoints and the final one."""
    out = tmp_path_factory.mktemp("integrity-run")
    shutil.copytree(data_dir, out / "data")
    args = ["train", "tiny", f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}", f"out_dir={out}"]
    assert main([*args, "train.save_every=2", "-q"]) == 0
    return out


def _flip(path: Path, n: int = 64, where: float = 0.5) -> None:
    """Flip ``n`` bytes in the middle of a safetensors file's tensor data (the header stays valid)."""
    b = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(b[:8], "little")
    at = start + int((len(b) - start - n) * where)
    for i in range(at, at + n):
        b[i] ^= 0xFF
    path.write_bytes(bytes(b))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _bad_header(path: Path) -> None:
    b = bytearray(path.read_bytes())
    b[8:24] = b"not a json head!"
    path.write_bytes(bytes(b))


def _drop_field(folder: Path) -> None:
    info = json.loads((folder / "drafter.json").read_text())
    del info["config"]["dim"]
    (folder / "drafter.json").write_text(json.dumps(info))


def _edit_config(folder: Path) -> None:
    """rope_theta x 10 (no shape changes, the weights' checksums still match)."""
    info = json.loads((folder / "drafter.json").read_text())
    info["config"]["rope_theta"] = info["config"].get("rope_theta", 10000.0) * 10
    (folder / "drafter.json").write_text(json.dumps(info))


def _random_files(folder: Path) -> None:
    g = torch.Generator().manual_seed(0)
    for f in ("drafter.json", "model.safetensors"):
        (folder / f).write_bytes(bytes(torch.randint(0, 256, (4096,), generator=g, dtype=torch.uint8).tolist()))


# name -> (how the copy is damaged, the file the message must name)
CORRUPT = {
    "random-bytes": (_random_files, "drafter.json"),
    "no-weights": (lambda f: (f / "model.safetensors").unlink(), "model.safetensors"),
    "truncated-weights": (lambda f: _truncate(f / "model.safetensors"), "model.safetensors"),
    "bad-header": (lambda f: _bad_header(f / "model.safetensors"), "model.safetensors"),
    "flipped-bytes": (lambda f: _flip(f / "model.safetensors"), "model.safetensors"),
    "not-json": (lambda f: (f / "drafter.json").write_text("{kind: draft_lm,"), "drafter.json"),
    "config-missing-field": (_drop_field, "drafter.json"),
    "config-edited": (_edit_config, "drafter.json"),
}


def _corrupt_copy(src: Path, dst: Path, case: str) -> Path:
    shutil.copytree(src, dst)
    CORRUPT[case][0](dst)
    return dst


def _one_line_error(capsys, rc: int, names: str) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("draftsmith: error:") and names in err, err
    return err


def test_checkpoints_and_shards_record_checksums(trained):
    """drafter.json lists a sha256 per tensor file (train_state too); manifest entries one per shard."""
    for folder in (trained / "checkpoints" / "final", trained / "checkpoints" / "step-000004"):
        sums = json.loads((folder / "drafter.json").read_text())["sha256"]
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        assert sorted(sums) == files and "model.safetensors" in files
        for name, digest in sums.items():
            assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest
    assert (
        "train_state.safetensors"
        in json.loads((trained / "checkpoints" / "step-000004" / "drafter.json").read_text())["sha256"]
    )
    for e in json.loads((trained / "data" / "manifest.json").read_text())["shards"]:
        b = (trained / "data" / e["file"]).read_bytes()
        assert hashlib.sha256(b[8 + int.from_bytes(b[:8], "little") :]).hexdigest() == e["sha256"]


@pytest.mark.parametrize("case", list(CORRUPT))
def test_bad_checkpoint_is_one_line_everywhere(case, trained, tmp_path, capsys, tiny_model_dir, prompts_file):
    """The same bad checkpoint through the API, `export`, `eval` and `train.init_checkpoint`: one line, exit 2."""
    from draftsmith.models.registry import load_drafter

    ckpt = _corrupt_copy(trained / "checkpoints" / "final", tmp_path / "ckpt", case)
    names = str(ckpt / CORRUPT[case][1])
    with pytest.raises(DraftsmithError, match=CORRUPT[case][1]):
        load_drafter(ckpt)
    _one_line_error(capsys, main(["export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "x"), "-q"]), names)
    assert not (tmp_path / "x").exists()
    common = [f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}", "-q"]
    rc = main(["eval", "tiny", f"eval.checkpoint={ckpt}", f"out_dir={tmp_path / 'e'}", *common])
    _one_line_error(capsys, rc, names)
    shutil.copytree(trained / "data", tmp_path / "t" / "data")
    rc = main(["train", "tiny", f"train.init_checkpoint={ckpt}", f"out_dir={tmp_path / 't'}", *common])
    _one_line_error(capsys, rc, names)
    assert not (tmp_path / "t" / "checkpoints" / "final").exists()


def test_random_bytes_as_the_checkpoint_path(tmp_path, capsys):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(os.urandom(2048))
    _one_line_error(capsys, main(["export", str(junk), "--format", "hf", "--out", str(tmp_path / "x")]), str(junk))


@pytest.mark.parametrize(
    "damage,file",
    [
        (lambda f: _flip(f / "model.safetensors"), "model.safetensors"),
        (lambda f: _flip(f / "train_state.safetensors"), "train_state.safetensors"),
        (lambda f: _truncate(f / "train_state.safetensors"), "train_state.safetensors"),
        (lambda f: (f / "train_state.json").write_text("{"), "train_state.json"),
    ],
    ids=["weights", "train-state", "train-state-truncated", "train-state-json"],
)
def test_corrupt_resumable_checkpoint_says_how_to_start_fresh(damage, file, trained, tmp_path, capsys):
    """`train` resuming from a damaged step-N: one line naming the file and train.resume=false; that then works."""
    run = tmp_path / "run"
    shutil.copytree(trained / "data", run / "data")
    shutil.copytree(trained / "checkpoints" / "step-000004", run / "checkpoints" / "step-000004")
    damage(run / "checkpoints" / "step-000004")
    recipe = run_args(trained)
    err = _one_line_error(capsys, main(["train", "tiny", *recipe, f"out_dir={run}", "-q"]), file)
    assert "train.resume=false" in err and "step-000004" in err
    assert main(["train", "tiny", *recipe, f"out_dir={run}", "train.resume=false", "-q"]) == 0


def run_args(trained: Path) -> list[str]:
    """The target, prompts and data settings of the module's run (the ``data_dir`` fixture's)."""
    import yaml

    r = yaml.safe_load((trained / "recipe.yaml").read_text())
    prompts = r["eval"]["prompts"]["path"]
    paths = [f"target.model={r['target']['model']}", f"eval.prompts.path={prompts}", f"data.prompts.path={prompts}"]
    return [*paths, "data.n_samples=2", "data.temperature=1.0"]


def _manifest_not_json(d: Path) -> None:
    (d / "manifest.json").write_text('{"format": "draftsmith-records/2", "shards": [')


@pytest.mark.parametrize(
    "damage,names",
    [
        (_manifest_not_json, "manifest.json"),
        (lambda d: _truncate(d / "shard-00001.safetensors"), "shard-00001.safetensors"),
        (lambda d: _flip(d / "shard-00001.safetensors"), "shard-00001.safetensors"),
        (lambda d: _bad_header(d / "shard-00001.safetensors"), "shard-00001.safetensors"),
        (lambda d: (d / "shard-00001.safetensors").unlink(), "shard-00001.safetensors"),
    ],
    ids=["manifest-not-json", "shard-truncated", "shard-flipped", "shard-bad-header", "shard-missing"],
)
def test_corrupt_data_is_one_line_and_generate_repairs_it(damage, names, trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained / "data", run / "data")
    damage(run / "data")
    err = _one_line_error(capsys, main(["train", "tiny", *run_args(trained), f"out_dir={run}", "-q"]), names)
    assert "draftsmith generate" in err
    # generate resumes: it rewrites the bad shard (or manifest) and keeps the good ones
    assert main(["generate", "tiny", *run_args(trained), f"out_dir={run}", "-q"]) == 0
    for f in sorted((trained / "data").glob("shard-*.safetensors")):
        assert (run / "data" / f.name).read_bytes() == f.read_bytes(), f.name
    assert (
        json.loads((run / "data" / "manifest.json").read_text())["shards"]
        == json.loads((trained / "data" / "manifest.json").read_text())["shards"]
    )


def test_legacy_files_without_checksums_load_with_a_warning(trained, tmp_path, caplog):
    """Checkpoints and data written before checksums existed still load (and resume), with a warning."""
    from draftsmith.data.dataset import RecordDataset
    from draftsmith.models.registry import load_drafter

    ckpt = shutil.copytree(trained / "checkpoints" / "final", tmp_path / "old")
    info = json.loads((ckpt / "drafter.json").read_text())
    del info["sha256"]
    (ckpt / "drafter.json").write_text(json.dumps(info))
    with caplog.at_level("WARNING"):
        load_drafter(ckpt)
    assert "no checksums" in caplog.text
    data = shutil.copytree(trained / "data", tmp_path / "data")
    m = json.loads((data / "manifest.json").read_text())
    for e in m["shards"]:
        del e["sha256"]
    (data / "manifest.json").write_text(json.dumps(m))
    caplog.clear()
    with caplog.at_level("WARNING"):
        ds = RecordDataset(data, 128)
        assert len(ds[0].input_ids) > 0
    assert "no checksums" in caplog.text


def test_two_clean_runs_write_byte_identical_files(tmp_path, tiny_model_dir, prompts_file):
    """generate + train in two processes with different hash seeds: every shard, the manifest, every checkpoint
    and training state are the same bytes (safetensors metadata is written in a fixed order)."""
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"run{seed}"
        cmd = [sys.executable, "-m", "draftsmith", "run", "tiny", f"target.model={tiny_model_dir}"]
        cmd += [f"data.prompts.path={prompts_file}", f"eval.prompts.path={prompts_file}", f"out_dir={out}"]
        cmd += ["eval.enabled=false", "export.enabled=false", "train.steps=2", "train.save_every=1", "-q"]
        env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"}
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        outs.append(out)
    # every file but train_state.json, which counts the seconds trained
    files = sorted(str(p.relative_to(outs[0])) for p in outs[0].rglob("*.safetensors"))
    files += ["data/manifest.json", "checkpoints/final/drafter.json", "checkpoints/step-000001/drafter.json"]
    assert any(f.startswith("data/shard-") for f in files) and "checkpoints/final/model.safetensors" in files
    assert "checkpoints/step-000001/train_state.safetensors" in files
    for f in files:
        assert (outs[0] / f).read_bytes() == (outs[1] / f).read_bytes(), f


def test_medusa2_target_adapter_is_verified(tmp_path):
    """A Medusa-2 checkpoint's target_adapter.safetensors has its checksum in drafter.json; damage is named."""
    from conftest import tiny_model

    from draftsmith.models.registry import build_drafter, load_drafter, save_drafter

    m2 = build_drafter("medusa", {"n_heads": 2, "lora_r": 2}, tiny_model(0).float())
    ckpt = save_drafter(tmp_path / "m2", m2, "medusa", {})
    assert "target_adapter.safetensors" in json.loads((ckpt / "drafter.json").read_text())["sha256"]
    assert load_drafter(ckpt)[0].target_adapter
    _flip(ckpt / "target_adapter.safetensors", n=8)
    with pytest.raises(DraftsmithError, match="target_adapter.safetensors: checksum mismatch"):
        load_drafter(ckpt)


def test_the_console_script_prints_one_line_and_exits_2(trained, tmp_path):
    """The real entry point (python -m draftsmith), not main(): exit code 2, one stderr line, no traceback."""
    ckpt = _corrupt_copy(trained / "checkpoints" / "final", tmp_path / "ckpt", "flipped-bytes")
    cmd = [sys.executable, "-m", "draftsmith", "export", str(ckpt), "--format", "hf", "--out", str(tmp_path / "x")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"{ckpt / 'model.safetensors'}: checksum mismatch" in p.stderr
