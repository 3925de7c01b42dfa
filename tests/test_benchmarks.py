"""The benchmark scripts stay runnable: every maintained benchmark and every experiment imports (without running
its main), every maintained one answers --help with a description for each option, and none reaches around the
installed package (no import path edits, no old git revisions, no imports between benchmark files, no private
package names in the maintained ones)."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
MAINTAINED = [
    "step_costs",
    "generate_throughput",
    "writer_throughput",
    "loss_memory",
    "gpu_decoder",
    "dynamic_tree_draft",
    "export_roundtrip",
    "online_proof",
    "kind_table",
    "export_prompts",
    "probe_bad_inputs",
    "batch_decode",
    "probe_kills",
    "load_serve",
    "data_curve",
    "utilisation",
    "packing",
    "gpu_bounds",
    "vllm_throughput",
    "sglang_exports",
    "code_shape",
    "drafter_compare",
    "long_context",
    "tree_sampling",
]
EXPERIMENTS = sorted(p.stem for p in (BENCH / "experiments").glob("*.py"))
# Private package names the experiments still use; the maintained benchmarks use none.
PRIVATE = {"self_speculation": {"_DTYPES"}}


def _path(name: str) -> Path:
    return BENCH / f"{name}.py" if name in MAINTAINED else BENCH / "experiments" / f"{name}.py"


def test_every_script_is_listed():
    assert sorted(p.stem for p in BENCH.glob("*.py")) == sorted(MAINTAINED)
    assert EXPERIMENTS, "benchmarks/experiments/ holds the one-off studies"


@pytest.mark.parametrize("name", MAINTAINED + EXPERIMENTS)
def test_imports_without_running(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", _path(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # main() runs only under __main__
    assert callable(mod.main)
    assert mod.__doc__ and len(mod.__doc__.strip()) > 80, "the docstring says what it measures and how to read it"


def _imports(name: str) -> list[tuple[str, list[str]]]:
    tree = ast.parse(_path(name).read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append(("." * node.level + (node.module or ""), [a.name for a in node.names]))
    return out


@pytest.mark.parametrize("name", MAINTAINED + EXPERIMENTS)
def test_imports_the_package_only(name):
    scripts = set(MAINTAINED) | set(EXPERIMENTS)
    private = set()
    for module, names in _imports(name):
        top = module.split(".")[0]
        assert not module.startswith("."), f"{name}: relative import {module}"
        assert top not in scripts and not top.startswith("test"), f"{name} imports {module}: import the package"
        if top == "draftsmith":
            private |= {n for n in names if n.startswith("_")}
    assert private == PRIVATE.get(name, set()), f"{name}: private package names {sorted(private)}"


def test_no_path_edits_or_old_revisions():
    bad = []
    for f in sorted(BENCH.rglob("*")):
        if f.is_file():
            text = f.read_text(errors="ignore")
            bad += [f"{f.relative_to(BENCH)}: {s}" for s in ("sys.path", "git show") if s in text]
    assert not bad


_HELP = r"""
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    buf = io.StringIO()
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
        code = None
    except SystemExit as e:
        code = e.code
    out[path] = [code, buf.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[int, str]]:
    """--help of every maintained benchmark, all in one child interpreter (one torch import)."""
    paths = [str(_path(n)) for n in MAINTAINED]
    res = subprocess.run(
        [sys.executable, "-c", _HELP, *paths], capture_output=True, text=True, timeout=300, cwd=BENCH.parent
    )
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return {Path(p).stem: (code, text) for p, (code, text) in got.items()}


def undocumented(text: str) -> list[str]:
    """Arguments in argparse's help listing with no description (same line after 2+ spaces, or the next line)."""
    lines, out, listing = text.splitlines(), [], False
    for i, line in enumerate(lines):
        if line and not line.startswith(" "):
            listing = line in ("options:", "optional arguments:", "positional arguments:")
            continue
        if listing and re.match(r"^  \S", line):
            inline = re.search(r"\S {2,}\S", line.strip())
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if not inline and not re.match(r"^ {4,}\S", nxt):
                out.append(line.strip())
    return out


def test_undocumented_finds_bare_options():
    text = "usage: x\n\noptions:\n  -h, --help  show this help\n  --bare\n  --long LONG\n      its help\n"
    assert undocumented(text) == ["--bare"]


@pytest.mark.parametrize("name", MAINTAINED)
def test_help(helps, name):
    code, text = helps[name]
    assert code == 0 and text.startswith("usage:"), text[:500]
    assert "options:" in text or "optional arguments:" in text
    assert not undocumented(text), f"{name}: options without help: {undocumented(text)}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_run_help():
    res = subprocess.run(["bash", str(BENCH / "gpu_run.sh"), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0
    for stage in ("tests", "gpu-tests", "loss", "decoder", "trees", "eagle-steps", "stash", "eagle3"):
        assert f"{stage}:" in res.stdout
