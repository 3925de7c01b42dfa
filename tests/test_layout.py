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


PACKAGES = ("data", "eval", "train", "models", "recipes", "kernels", "draftsmith")


def _package_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for m in _imports(path):
                parts = m.split(".")
                if parts[0] == "draftsmith" and len(parts) > 1 and parts[1] in PACKAGES and parts[1] != pkg:
                    edges[pkg].add(parts[1])
    return edges


def test_no_two_packages_import_each_other():
    """Imports inside functions count too: a lazy import is still a dependency."""
    edges = _package_edges()
    cycles = {tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges[b]}
    assert not cycles, sorted(cycles)


def test_test_support_stays_in_tests():
    bad = {
        f"{p.relative_to(ROOT)}: {m}"
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        for m in _imports(p)
        if m.split(".")[0] in ("unittest", "pytest", "hypothesis")
    }
    assert not bad, sorted(bad)


def test_no_product_function_is_over_80_lines():
    """Glue that grows past a screen is split into named steps."""
    long = []
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 80:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not long, long


def test_the_checkout_root_on_sys_path_does_not_shadow_installed_packages():
    """`python -m draftsmith` or `python -m pytest` run from the checkout put its root on sys.path, where kernels/
    would hide the hub's `kernels` package that transformers imports. Importing draftsmith takes the root off."""
    import subprocess
    import sys

    code = (
        "import sys; sys.path.insert(0, ''); import draftsmith, importlib.util as u; "
        "s = u.find_spec('kernels'); print(s.origin if s else 'absent'); print('' in sys.path)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    origin, empty_on_path = out.stdout.split()
    assert origin != str(ROOT / "kernels" / "__init__.py")
    assert empty_on_path == "False"
