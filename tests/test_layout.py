"""The folders show the stages: serving and export sit at the top of the import graph, next to the CLI, and
no stage below them imports them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOWER = ("models", "data", "train", "eval", "kernels", "recipes")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("folder", LOWER)
def test_lower_stages_never_import_serving_or_export(folder):
    bad = {
        f"{p.relative_to(ROOT)}: {m}"
        for p in (ROOT / folder).rglob("*.py")
        for m in _imports(p)
        if m.startswith(("draftsmith.serving", "draftsmith.export"))
    }
    assert not bad, sorted(bad)


def test_kernels_import_no_other_stage():
    bad = {
        f"{p.relative_to(ROOT)}: {m}"
        for p in (ROOT / "kernels").rglob("*.py")
        for m in _imports(p)
        if m.startswith("draftsmith.") and not m.startswith(("draftsmith.kernels", "draftsmith.errors"))
    }
    assert not bad, sorted(bad)


def test_models_import_no_training_code():
    """Drafter specs name their objectives lazily ("draftsmith.train.objectives:..."): models sit below train."""
    bad = {
        f"{p.relative_to(ROOT)}: {m}"
        for p in (ROOT / "models").rglob("*.py")
        for m in _imports(p)
        if m.startswith(("draftsmith.train", "draftsmith.recipes"))
    }
    assert not bad, sorted(bad)
