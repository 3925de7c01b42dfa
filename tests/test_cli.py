"""The CLI as a user meets it: --help everywhere, and every bad input is one line on stderr, exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from draftsmith.cli import STAGES, main


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "draftsmith", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )


@pytest.mark.parametrize("command", list(STAGES))
def test_help_explains_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "RECIPE" in out and "KEY=VALUE" in out and "--quiet" in out and STAGES[command][:30] in out


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--deltas", "1.5"], "--deltas '1.5': each δ must lie in (0, 1)"),
        (["--fixed", "two"], "--fixed 'two': expected comma-separated numbers"),
        (["--max-accuracy-drop", "2"], "--max-accuracy-drop 2.0: must lie in [0, 1]"),
    ],
)
def test_sweep_subcommand_refuses_bad_options_in_one_line(args, fragment, capsys):
    assert main(["sweep", "tiny", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("draftsmith: error:") and fragment in err[0], err


def test_show_prints_resolved_recipe(capsys):
    assert main(["show", "quickstart", "train.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "steps: 3" in out and "generate -> train -> eval" in out


def _assert_one_line_error(res, *fragments):
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("draftsmith: error:")]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_bad_inputs_are_one_line_errors(tmp_path, tiny_model_dir):
    _assert_one_line_error(run_cli("show", tmp_path / "missing.yaml"), "recipe not found")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndata: {prompts: [\n")
    _assert_one_line_error(run_cli("show", bad), "bad.yaml line", "YAML syntax error")
    _assert_one_line_error(run_cli("show", "quickstart", "train.bogus=1"), "unknown key train.bogus")
    _assert_one_line_error(run_cli("show", "quickstart", "train.steps=-2"), "train.steps")
    _assert_one_line_error(
        run_cli("generate", "tiny", "target.model=no-such-model", f"out_dir={tmp_path}/r"),
        "unknown target 'no-such-model'",
    )


@pytest.mark.parametrize(
    "content,fragment",
    [
        (None, "missing.jsonl"),  # unreadable / missing file
        ('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [\n', "line 2"),
        ('{"messages": [{"role": "user", "content": "   "}]}\n', "empty prompt set"),
    ],
)
def test_bad_prompt_files(tmp_path, tiny_model_dir, content, fragment):
    path = tmp_path / "missing.jsonl"
    if content is not None:
        path.write_text(content)
    res = run_cli(
        "generate", "tiny", f"target.model={tiny_model_dir}", f"data.prompts.path={path}", f"out_dir={tmp_path}/r"
    )
    _assert_one_line_error(res, fragment)
    assert not (tmp_path / "r" / "data" / "manifest.json").exists()  # nothing half-written that looks complete


def test_python_dash_m_and_console_script_agree(tmp_path):
    """The installed `draftsmith` console script and `python -m draftsmith` print the same, and fail the same."""
    import os
    import shutil
    from pathlib import Path

    script = Path(sys.executable).with_name("draftsmith")
    script = str(script) if script.is_file() else shutil.which("draftsmith")
    assert script, "the draftsmith console script is not installed next to this interpreter"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for args in (["show", "tiny", f"out_dir={tmp_path}"], ["show", "tiny", "train.steps=-1"]):
        by_module = run_cli(*args)
        by_script = subprocess.run([script, *args], capture_output=True, text=True, timeout=120, env=env)
        assert (by_script.returncode, by_script.stdout, by_script.stderr) == (
            by_module.returncode,
            by_module.stdout,
            by_module.stderr,
        )
    assert by_module.returncode == 2 and by_module.stderr.startswith("draftsmith: error:")
    ok = run_cli("show", "tiny", f"out_dir={tmp_path}")
    assert ok.returncode == 0 and "name: tiny" in ok.stdout


def test_a_run_leaves_its_process_group_before_exit(tmp_path):
    """A gloo group still alive at interpreter exit can abort a finished run (SIGABRT, "terminate called without
    an active exception"), and the launcher then reports failure: main() must leave the group itself."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert main(["show", "tiny"]) == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
