"""Every reference in the docs and the code resolves inside the repo: markdown links (and their #anchors), repo
paths cited in code, docs and recipes, and the section ids cited in the algorithms reference."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = "docs|benchmarks|models|data|train|eval|kernels|recipes|tests|draftsmith"
PATH = re.compile(rf"(?<![\w/.-])(?:{FOLDERS})/[\w./-]*\w\.(?:py|md|yaml|sh)\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SECTION = r"[AB]\d+(?:\.\d+)*"
CITE = re.compile(
    rf"algorithms\.md(?:\)|,)?,?\s+(?:\(?sections?\s+)?({SECTION}(?:\s*(?:,|/|and|-|–)\s*[AB]?\d+(?:\.\d+)*)*)"
)


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split()]


def _docs() -> list[Path]:
    return [p for p in _tracked("*.md") if "journal" not in p.parts]


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", md.read_text(), re.M)}


@pytest.mark.parametrize("md", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_and_anchors_resolve(md):
    bad = []
    for target in LINK.findall(md.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    assert not bad, f"{md.relative_to(ROOT)}: {bad}"


def test_repo_paths_cited_in_code_docs_and_recipes_exist():
    files = [p for p in _tracked("*.py", "*.md", "*.yaml", "*.sh") if "journal" not in p.parts and p.exists()]
    missing = set()
    for f in files:
        for ref in PATH.findall(f.read_text()):
            if "NAME" not in ref and not (ROOT / ref).exists():
                missing.add(f"{f.relative_to(ROOT)}: {ref}")
    assert not missing, sorted(missing)


def test_cited_algorithm_sections_exist():
    ids = set(re.findall(r"^#+\s+([AB]\d+(?:\.\d+)*)\b", (ROOT / "docs" / "algorithms.md").read_text(), re.M))
    files = [p for p in _tracked("*.py", "*.md", "*.yaml") if "journal" not in p.parts and p.exists()]
    missing = set()
    for f in files:
        for group in CITE.findall(f.read_text()):
            letter = group[0]
            for ref in re.findall(r"[AB]?\d+(?:\.\d+)*", group):
                ref = ref if ref[0] in "AB" else letter + ref
                if ref not in ids and ref.split(".")[0] not in ids:
                    missing.add(f"{f.relative_to(ROOT)}: {ref}")
    assert ids and not missing, sorted(missing)


def test_results_stay_short():
    """benchmarks/RESULTS.md holds one short row per current figure (history lives in benchmarks/journal/)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md"
    text = path.read_text()
    long = [line[:60] for line in text.splitlines() if line.startswith("|") and len(line) > 300]
    assert len(text.encode()) <= 25_000 and not long, long
