"""Find a recipe (shipped name or path), parse YAML, apply dotted ``a.b=c`` overrides, validate once.

Every failure becomes a one-line DraftsmithError naming the file, line or dotted key.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import ValidationError

from draftsmith.errors import DraftsmithError
from draftsmith.models.registry import DRAFTERS
from draftsmith.recipes.schema import Recipe

RECIPE_DIR = Path(__file__).parent


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def recipe_folders() -> list[Path]:
    """The shipped recipes' folder, then the folders listed in DRAFTSMITH_RECIPES (os.pathsep-separated): a
    recipe name is looked up in them in this order, so a shipped name is never shadowed."""
    extra = os.environ.get("DRAFTSMITH_RECIPES", "")
    return [RECIPE_DIR, *(Path(d).expanduser() for d in extra.split(os.pathsep) if d)]


def find_recipe(spec: str) -> Path:
    p = Path(spec).expanduser()
    if p.is_file():
        return p
    if p.exists() or p.is_symlink():  # there, but not a file to read (a FIFO would block the read)
        what = "a directory" if p.is_dir() else "a broken or looping link" if p.is_symlink() else "not a regular file"
        raise DraftsmithError(f"recipe {spec}: is {what}; name a recipe YAML file or a shipped recipe")
    if "/" not in spec:
        for folder in recipe_folders():
            if (found := folder / f"{spec.removesuffix('.yaml')}.yaml").is_file():
                return found
    where = " or in the DRAFTSMITH_RECIPES folders" if len(recipe_folders()) > 1 else ""
    raise DraftsmithError(
        f"recipe not found: {spec} (no such file, and not a shipped recipe{where}: {', '.join(shipped_recipes())})"
    )


MAX_ALIASES = 32  # YAML aliases (*name) a recipe may use: enough for shared defaults, far from a "billion laughs"


class _StrictLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (YAML keeps the last silently) and more than
    ``MAX_ALIASES`` aliases (nested aliases expand exponentially once the recipe is validated and printed)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases = getattr(self, "aliases", 0) + 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(None, None, f"more than {MAX_ALIASES} aliases", mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:  # the keys written here (merged ones, <<: *x, may be overridden)
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    where = key_node.start_mark
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key_node.value!r}", where)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DraftsmithError(f"{path}: cannot read recipe ({type(e).__name__})") from None
    try:
        doc = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise DraftsmithError(f"{path}{where}: YAML syntax error: {problem}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise DraftsmithError(f"{path}: a recipe must be a YAML mapping, got {type(doc).__name__}")
    return doc


def apply_overrides(doc: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` strings; values are parsed as YAML scalars/lists ("3" -> 3, "[0,29]" -> list)."""
    for ov in overrides:
        if "=" not in ov:
            raise DraftsmithError(f"override {ov!r}: expected dotted.key=value")
        key, raw = ov.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise DraftsmithError(f"override {ov!r}: empty key segment")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = doc
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise DraftsmithError(f"override {ov!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return doc


def _format_error(err: dict) -> str:
    loc = [str(x) for x in err["loc"]]
    # Discriminated unions put the chosen tag into the path (drafter.draft_lm.x): drop it.
    if len(loc) > 1 and loc[0] == "drafter" and loc[1] in DRAFTERS:
        loc.pop(1)
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        return f"unknown key {key}"
    msg = err["msg"].removeprefix("Value error, ")
    if not key:
        return msg
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        return f"{key}: {msg}"
    return f"{key}: {msg} (got {err.get('input')!r})"


def validate(doc: dict, origin: str) -> Recipe:
    try:
        return Recipe.model_validate(doc)
    except ValidationError as e:
        errors = e.errors()
        more = f" (+{len(errors) - 3} more)" if len(errors) > 3 else ""
        raise DraftsmithError(f"{origin}: " + "; ".join(_format_error(x) for x in errors[:3]) + more) from None


def load_recipe(spec: str, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    path = find_recipe(spec)
    doc = apply_overrides(read_yaml(path), list(overrides))
    recipe = validate(doc, str(path))
    for p in (recipe.run_dir, *recipe.run_dir.parents):  # a run folder is made (or read) under it: a file breaks that
        if p.is_dir():
            break
        if p.exists() or p.is_symlink():
            where = "is" if p == recipe.run_dir else f"lies under {p}, which is"
            raise DraftsmithError(f"{path}: out_dir {recipe.run_dir} {where} not a folder; name a folder")
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
