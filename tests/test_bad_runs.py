"""Bad runs end cleanly: a full disk, an export onto a file, a failed command on a run folder, a rollback outside
the version store, a hub token in an error, and the code-running task scorers staying off unless a recipe asks.
Each failure is one line (exit 2) and leaves nothing that looks complete; a rerun after a full disk resumes."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
from conftest import shard_tensors
from safetensors import SafetensorError
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError, redact


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln[ln.index("draftsmith: error:") :] for ln in err.splitlines() if "draftsmith: error:" in ln]
    assert len(lines) == 1 and "Traceback" not in err, err  # (after a progress bar's last redraw, if one ran)
    return lines[0]


def _fills_the_disk(module, after: int, exc=None):
    """``module.save_file`` that writes ``after`` files, then writes half a file and fails as a full disk does."""
    real, calls = module.save_file, {"n": 0}

    def save_file(tensors, filename, *a, **kw):
        calls["n"] += 1
        if calls["n"] > after:
            Path(filename).write_bytes(b"\0" * 64)  # the partial file a full disk leaves
            raise exc or OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, filename, *a, **kw)

    return save_file


# ---- a full disk ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exc", [None, SafetensorError('IoError(Os { code: 28, kind: StorageFull, message: "x" })')])
def test_generate_on_a_full_disk_keeps_finished_shards_and_resumes(
    exc, tmp_path, tiny_model_dir, prompts_file, data_dir, monkeypatch, capsys
):
    from draftsmith import integrity

    out = tmp_path / "run"
    args = ["generate", "tiny", f"target.model={tiny_model_dir}", f"data.prompts.path={prompts_file}"]
    args += [f"out_dir={out}", "data.n_samples=2", "data.temperature=1.0", "-q"]  # data_dir's recipe: 2 shards
    monkeypatch.setattr(integrity, "save_file", _fills_the_disk(integrity, after=1, exc=exc))  # every safetensors write
    assert main(args) == 2
    line = _error_line(capsys)
    assert "out of disk space" in line and str(out / "data") in line, line
    assert "kept 1 finished shard" in line and "rerun" in line, line
    assert sorted(p.name for p in (out / "data").iterdir()) == ["shard-00000.safetensors"]  # no tmp, no manifest
    monkeypatch.undo()
    assert main(args) == 0
    assert shard_tensors(out / "data").keys() == shard_tensors(data_dir).keys()
    for name, tensors in shard_tensors(data_dir).items():
        got = shard_tensors(out / "data")[name]
        assert all(torch.equal(got[k], v) for k, v in tensors.items()), name


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_dir, tiny_model_dir, prompts_file):
    """An uninterrupted `train tiny` run (checkpoints at steps 2 and 4) -> (run folder, its train arguments)."""

    def args(out: Path) -> list[str]:
        return [
            "train",
            "tiny",
            f"target.model={tiny_model_dir}",
            f"eval.prompts.path={prompts_file}",
            f"out_dir={out}",
            "train.save_every=2",
            "-q",
        ]

    out = tmp_path_factory.mktemp("trained") / "run"
    shutil.copytree(data_dir, out / "data")
    assert main(args(out)) == 0
    return out, args


def test_train_on_a_full_disk_keeps_the_last_checkpoint_and_resumes(trained, tmp_path, monkeypatch, capsys):
    from draftsmith import integrity

    full, args = trained
    out = tmp_path / "run"
    shutil.copytree(full / "data", out / "data")
    # step 2's weights and training state saved, step 4's not
    monkeypatch.setattr(integrity, "save_file", _fills_the_disk(integrity, after=2))
    assert main(args(out)) == 2
    line = _error_line(capsys)
    assert "out of disk space" in line and str(out / "checkpoints") in line, line
    assert "step 2" in line and "rerun" in line, line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]  # no half-written step 4
    monkeypatch.undo()
    assert main(args(out)) == 0
    a = load_file(str(full / "checkpoints" / "final" / "model.safetensors"))
    b = load_file(str(out / "checkpoints" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


# ---- export onto a file -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_export_out_onto_a_file_is_refused_and_leaves_nothing(where, trained, tmp_path, capsys):
    full, _ = trained
    f = tmp_path / "model.bin"
    f.write_bytes(b"mine")
    out = f if where == "file" else f / "hf"
    assert main(["export", str(full / "checkpoints" / "final"), "--format", "hf", "--out", str(out)]) == 2
    line = _error_line(capsys)
    assert str(f) in line and "--out" in line, line
    assert f.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.iterdir()) == ["model.bin"]


# ---- the run folder's recipe.yaml ---------------------------------------------------------------------------------


def test_a_failed_command_leaves_the_run_folders_recipe(trained, tmp_path, capsys):
    full, args = trained
    out = tmp_path / "run"
    shutil.copytree(full / "data", out / "data")
    assert main([*args(out), "train.steps=2"]) == 0
    before = (out / "recipe.yaml").read_bytes()
    assert main([*args(out), "train.steps=-1"]) == 2  # the override does not validate
    assert main([*args(out), f"target.model={tmp_path / 'no-such-folder'}"]) == 2  # fails at start
    target = args(out)[2]
    assert main(["generate", "tiny", target, "data.prompts.path=/no/such.jsonl", f"out_dir={out}", "-q"]) == 2
    capsys.readouterr()
    assert (out / "recipe.yaml").read_bytes() == before
    assert (out / "data" / "manifest.json").is_file()  # the failed generate left the records as they were


# ---- online rollback ----------------------------------------------------------------------------------------------


def test_rollback_names_only_versions_in_the_store(trained, tmp_path):
    from draftsmith.serving.online import Versions

    full, _ = trained
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(full / "checkpoints" / "final", elsewhere)  # a real drafter, outside the store
    v = Versions(tmp_path / "online", full / "checkpoints" / "final")
    assert v.publish(full / "checkpoints" / "final") == "v0001"
    for bad in ("../x", "../../elsewhere", str(elsewhere), "v0042", "versions", "v0001/..", ""):
        with pytest.raises(DraftsmithError, match="online: no version") as e:
            v.rollback(bad) if bad else v.rollback("v0001.tmp")
        assert "\n" not in str(e.value)
        assert v.current()[0] == "v0001"
    assert v.rollback("v0000") == "v0000" and v.current() == ("v0000", tmp_path / "online" / "versions" / "v0000")


def test_cli_rollback_outside_the_store_is_one_line(trained, tmp_path, capsys):
    full, args = trained
    online = [f"online.dir={tmp_path / 'online'}", f"eval.checkpoint={full / 'checkpoints' / 'final'}"]
    base = ["online", "tiny", *args(full)[2:5], *online, "-q"]
    shutil.copytree(full / "checkpoints" / "final", tmp_path / "elsewhere")  # exists: ../../elsewhere from versions/
    assert main([*base, "--rollback", "../../elsewhere"]) == 2
    assert "no version '../../elsewhere'" in _error_line(capsys)
    assert (tmp_path / "online" / "current.json").read_text().count("elsewhere") == 0
    assert main([*base, "--rollback", "v0000"]) == 0


# ---- hub tokens ---------------------------------------------------------------------------------------------------


SECRETS = ["hf_oauth_SeCrEt123", "hf_a-b_C-d_9", "hf_-_x"]


@pytest.mark.parametrize("secret", SECRETS)
def test_redact_masks_whole_tokens(secret, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    text = redact(f"401 for {secret}, header 'Bearer {secret}'.")
    assert "SeCrEt" not in text and secret not in text and secret[3:] not in text
    assert text == "401 for hf_***, header 'Bearer hf_***'."
    monkeypatch.setenv("HF_TOKEN", "my-Plain_token42")  # a token of any shape, by its exact value
    assert redact("auth my-Plain_token42 failed") == "auth *** failed"


def test_push_error_never_shows_the_token(tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    from draftsmith.export.writer import push_to_hub

    secret = "hf_oauth_SeCrEt123"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", secret)

    def refuse(self, *a, **kw):
        raise RuntimeError(f"401 Client Error: token {secret} (also hf_x-y_Z) rejected")

    monkeypatch.setattr(HfApi, "create_repo", refuse)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DraftsmithError) as e:
        push_to_hub(tmp_path, "org/name")
    msg = str(e.value)
    assert "401" in msg and "SeCrEt" not in msg and "oauth" not in msg and "x-y" not in msg and "_Z" not in msg


def test_cli_errors_are_redacted(capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "s3cret-Value_1")
    assert main(["show", "hf_oauth_SeCrEt123+s3cret-Value_1"]) == 2  # an unknown recipe name, echoed
    line = _error_line(capsys)
    assert "SeCrEt" not in line and "s3cret" not in line and "hf_***" in line, line


# ---- code-running task scorers stay off by default ----------------------------------------------------------------


def test_default_recipes_never_run_generated_code(trained, tmp_path, tiny_model_dir, prompts_file, monkeypatch):
    from draftsmith.eval import tasks
    from draftsmith.recipes.loader import load_recipe

    r = load_recipe("tiny", [])
    assert r.data.judge_labels is None and r.eval.judge is None

    def never(*a, **kw):
        raise AssertionError("generated code ran")

    monkeypatch.setattr(tasks, "run_tests", never)  # the one place generated code runs (eval/tasks.py)
    full, args = trained
    out = tmp_path / "run"
    shutil.copytree(full, out)
    common = [f"target.model={tiny_model_dir}", f"data.prompts.path={prompts_file}", f"out_dir={out}", "-q"]
    assert main(["eval", "tiny", *common, f"eval.prompts.path={prompts_file}"]) == 0


# ---- safe defaults and the bad-input probe ------------------------------------------------------------------------


def test_safe_defaults():
    """The server binds to loopback and remote model code stays off unless a recipe says otherwise; no source file
    turns remote code on by itself."""
    from draftsmith.recipes.loader import load_recipe

    r = load_recipe("tiny", [])
    assert r.online.host == "127.0.0.1" and r.target.trust_remote_code is False
    root = Path(__file__).resolve().parents[1]
    for folder in ("draftsmith", "data", "train", "eval", "models", "recipes"):
        for f in (root / folder).rglob("*.py"):
            assert "trust_remote_code=True" not in f.read_text().replace(" ", ""), f


def test_probe_classifies_each_ending():
    import importlib.util
    from subprocess import CompletedProcess

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_bad_inputs.py"
    spec = importlib.util.spec_from_file_location("probe_bad_inputs", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)

    def ending(code: int, err: str) -> str:
        return probe.classify(CompletedProcess([], code, "", err))[0]

    assert ending(2, "bar 50%\rdraftsmith: error: x.yaml: bad\n") == "clean"
    assert ending(1, "Traceback (most recent call last):\n  ...\nValueError: x\n") == "traceback"
    assert ending(0, "") == "silent"
    assert ending(2, "usage: draftsmith\ndraftsmith: error: a\ndraftsmith: error: b\n") == "other"
    assert ending(1, "draftsmith: error: x\n") == "other"
    assert {"export: --out is a file", "online: rollback ../x"} <= set(probe.cases(Path("/nonexistent")))


@pytest.mark.parametrize("entry", ["../../outside.safetensors", "sub/shard.safetensors", "twice"])
def test_manifest_entries_are_file_names_in_the_data_folder_each_once(entry, data_dir, tmp_path, capsys):
    import json

    from draftsmith.data.records import read_manifest

    data = shutil.copytree(data_dir, tmp_path / "data")
    m = json.loads((data / "manifest.json").read_text())
    first = m["shards"][0]
    m["shards"].append(dict(first) if entry == "twice" else {**first, "file": entry})
    (data / "manifest.json").write_text(json.dumps(m))
    want = "listed twice" if entry == "twice" else "is not a file name inside"
    with pytest.raises(DraftsmithError, match=want):
        read_manifest(data)


def test_a_diverging_run_stops_with_one_line_and_keeps_the_last_good_checkpoint(train_run, capsys):
    """A finite but absurd learning rate: the weights blow up after the first steps. Training stops at the first
    window whose loss or gradient norm is not finite, names the steps, writes no final checkpoint and keeps the
    last periodic one. (train.lr=.inf itself is refused by the schema.)"""
    run = train_run("diverge", "train.lr=1e30", "train.steps=8", "train.save_every=1",
                    expect=2)  # fmt: skip
    line = _error_line(capsys)
    assert "not finite at step" in line and "the last good checkpoint is" in line and "train.lr" in line
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "final" not in saved and saved, saved
    from draftsmith.models.registry import load_drafter

    model, _ = load_drafter(run / "checkpoints" / saved[-1])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert main(["train", "tiny", "train.lr=.inf"]) == 2 and "finite number" in _error_line(capsys)
