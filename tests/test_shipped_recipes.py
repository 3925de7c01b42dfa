"""Every shipped recipe runs as its header says from a fresh folder: each path it names is a shipped thing (a
packaged model alias or data file whose package the README's install command installs), its own run's output, or
the output of a shipped recipe that a ``# needs: draftsmith run NAME`` header line names (docs/recipes.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from draftsmith.recipes.loader import RECIPE_DIR, find_recipe, load_recipe, shipped_recipes

ROOT = Path(__file__).resolve().parent.parent
NEEDS = re.compile(r"# needs: (?:draftsmith run (?P<recipe>[\w.-]+)|(?P<hub>hub))")

# Every recipe key that names a path, a model or a hub repo, and what it is: "read" (must exist before the
# stage that reads it), "written" (a folder the run creates), "target" (target.model), "hub" (a hub repo id).
PATH_KEYS = {
    "target.model": "target",
    "out_dir": "written",
    "data.prompts.path": "prompts",
    "eval.prompts.path": "prompts",
    "data.on_policy.checkpoint": "read",
    "data.specdec_labels.checkpoint": "read",
    "data.judge_labels.checkpoint": "read",
    "data.judge_labels.path": "read",
    "drafter.init_from": "read",
    "drafter.draft": "read",
    "train.init_checkpoint": "read",
    "eval.checkpoint": "read",
    "eval.judge.head": "read",
    "eval.judge.tasks_path": "read",
    "eval.stop.head": "read",
    "export.out": "written",
    "export.push_to_hub": "hub",
    "online.dir": "written",
    "online.logs": "read",
}
# Key names that look like paths: a new key with such a name must be classified in PATH_KEYS above.
PATHLIKE_NAME = re.compile(r"(path|dir|checkpoint|init_from|draft|head|model|out|logs)$")


def readme_packages() -> set[str]:
    """The pip packages the README's install command installs (its `pip install --no-deps ...` part)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"pip install --no-deps ([\w -]+?) &&", text)
    assert m, "README.md: no `pip install --no-deps ...` in the install command"
    return set(m.group(1).split())


def header(name: str) -> list[str]:
    lines = []
    for line in find_recipe(name).read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return lines


def needs(name: str) -> tuple[list[str], bool]:
    """(recipes named by `# needs: draftsmith run NAME` lines, in order; whether `# needs: hub` is there)."""
    recipes, hub = [], False
    for line in header(name):
        if line.startswith("# needs:"):
            m = NEEDS.fullmatch(line.strip())
            assert m, f"{name}: malformed header line {line!r} (expected '# needs: draftsmith run NAME' or hub)"
            hub |= bool(m["hub"])
            if m["recipe"]:
                recipes.append(m["recipe"])
    return recipes, hub


def outputs(name: str) -> set[str]:
    """What `draftsmith run NAME` writes that another stage or recipe may read."""
    r = load_recipe(name)
    run, out = r.run_dir, set()
    if r.data.enabled:
        out.add(run / "data")
    if r.train.enabled:
        out.add(run / "checkpoints" / "final")
    if r.export.enabled:
        out |= {Path(r.export.out or run / "export") / f for f in r.export.formats}
    return {Path(p).as_posix() for p in out}


def named_values(node, key: str = ""):
    """(dotted key, string value) for every string in a dumped recipe; list items share their list's key."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from named_values(v, f"{key}.{k}" if key else k)
    elif isinstance(node, list):
        for v in node:
            yield from named_values(v, key)
    elif isinstance(node, str):
        yield key, node


def unresolved(name: str) -> list[str]:
    """Every path the recipe names that a fresh folder, following its header, would not have."""
    from draftsmith.eval.prompts import PACKAGED
    from draftsmith.models.loading import ALIASES

    r = load_recipe(name)
    dump = r.model_dump(mode="json")
    wanted, hub = needs(name)
    installed = readme_packages()
    available = outputs(name) | {p for n in wanted for p in outputs(n)}
    used: set[str] = set()
    bad = []

    def packaged(source: str) -> str | None:
        pip = PACKAGED[source][1]
        return None if pip in installed else f"packaged source {source!r} needs {pip}, not in the README install"

    for key, value in named_values(dump):
        kind = PATH_KEYS.get(key)
        if kind is None:
            if "/" in value or PATHLIKE_NAME.search(key.rsplit(".", 1)[-1]):
                bad.append(f"{key}={value!r}: a path-like key this test does not classify (add it to PATH_KEYS)")
            continue
        if kind == "written":
            continue
        if kind == "target":
            if value in ALIASES:
                pip = ALIASES[value][0].replace("_", "-")
                if pip not in installed:
                    bad.append(f"{key}={value!r}: its package {pip} is not in the README install command")
            elif not hub:
                bad.append(f"{key}={value!r}: not a packaged alias, and the header has no '# needs: hub'")
            continue
        if kind == "hub":
            if not hub:
                bad.append(f"{key}={value!r}: a hub repo, and the header has no '# needs: hub'")
            continue
        if kind == "prompts":
            source = dump[key.split(".")[0]]["prompts"]["source"]
            if source == "hub" and hub:
                continue
            bad.append(f"{key}={value!r}: a {source} path that no shipped package or needed recipe provides")
            continue
        path = Path(value).as_posix()
        if path not in available:
            bad.append(f"{key}={value!r}: neither shipped nor written by this recipe or one its header needs")
        used |= {n for n in wanted if path in outputs(n)}
    for section, prompts in (("data", r.data.prompts), ("eval", r.eval.prompts)):
        if prompts.source in PACKAGED and prompts.path is None and (msg := packaged(prompts.source)):
            bad.append(f"{section}.prompts: {msg}")
    if r.data.judge_labels and r.data.judge_labels.tasks == "humaneval" and r.data.judge_labels.path is None:
        bad += [f"data.judge_labels: {m}"] if (m := packaged("humaneval")) else []
    if r.eval.judge and r.eval.judge.tasks == "humaneval" and r.eval.judge.tasks_path is None:
        bad += [f"eval.judge: {m}"] if (m := packaged("humaneval")) else []
    # A needed recipe is used directly or needed by a later one; what it needs comes before it (run order).
    for i, n in enumerate(wanted):
        if n not in shipped_recipes():
            bad.append(f"header needs {n!r}, not a shipped recipe")
            continue
        theirs, their_hub = needs(n)
        if missing := [m for m in theirs if m not in wanted[:i]]:
            bad.append(f"header needs {n!r}, which needs {missing} first: list them above it")
        if their_hub and not hub:
            bad.append(f"header needs {n!r}, which needs the hub: add '# needs: hub'")
        if n not in used and not any(n in needs(later)[0] for later in wanted[i + 1 :]):
            bad.append(f"header needs {n!r}, but nothing in the recipe reads its output")
    return bad


@pytest.mark.parametrize("name", shipped_recipes())
def test_shipped_recipe_paths_resolve_from_a_fresh_folder(name):
    assert unresolved(name) == []


def test_the_check_catches_a_missing_needs_line(tmp_path, monkeypatch):
    """The resolver is not vacuous: the same recipe without its needs lines, or naming a folder nothing writes,
    is reported."""
    src = (RECIPE_DIR / "specdecpp-smollm2.yaml").read_text()
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "no-needs.yaml").write_text(re.sub(r"(?m)^# needs:.*\n", "", src).replace("specdecpp-smollm2", "x"))
    (folder / "elsewhere.yaml").write_text(src.replace("runs/fastdraft-finetune/", "runs/kd/fkl/"))
    monkeypatch.setenv("DRAFTSMITH_RECIPES", str(folder))
    assert any("data.specdec_labels.checkpoint" in b for b in unresolved("no-needs"))
    assert any("drafter.draft" in b for b in unresolved("elsewhere"))


def test_judge_reads_the_drafter_that_fastdraft_finetune_writes():
    r = load_recipe("judge-smollm2")
    assert needs("judge-smollm2")[0] == ["fastdraft-pretrain", "fastdraft-finetune"]
    final = "runs/fastdraft-finetune/checkpoints/final"
    assert final in outputs("fastdraft-finetune")
    assert r.data.judge_labels.checkpoint == final and r.eval.checkpoint == final


def test_tiny_is_a_test_recipe_found_through_the_recipe_path():
    """`tiny` needs a model and prompts built by the tests: it lives in tests/recipes, which conftest puts on
    DRAFTSMITH_RECIPES; it is not shipped."""
    assert "tiny" not in shipped_recipes() and not (RECIPE_DIR / "tiny.yaml").exists()
    assert find_recipe("tiny") == ROOT / "tests" / "recipes" / "tiny.yaml"
    assert load_recipe("tiny").name == "tiny"


def test_recipe_path_folders(tmp_path, monkeypatch):
    from draftsmith.errors import DraftsmithError

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
    (b / "mine.yaml").write_text("name: mine\n")
    (b / "quickstart.yaml").write_text("name: shadow\n")
    monkeypatch.setenv("DRAFTSMITH_RECIPES", f"{a}{__import__('os').pathsep}{b}")
    assert find_recipe("mine") == b / "mine.yaml"
    assert find_recipe("quickstart") == RECIPE_DIR / "quickstart.yaml"  # shipped names are not shadowed
    with pytest.raises(DraftsmithError, match=r"recipe not found: nope .*DRAFTSMITH_RECIPES"):
        find_recipe("nope")
