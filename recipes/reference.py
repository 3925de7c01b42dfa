"""The recipe key reference (docs/recipes.md), generated from the schema: every key with its type, default and the
field's docstring, one section per recipe section and one per drafter kind. tests/test_recipes.py keeps the
committed page equal to ``render()``; after a schema change, regenerate it with

    python -c "from draftsmith.recipes.reference import write; write()"
"""

from __future__ import annotations

import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from draftsmith.recipes.schema import Recipe

HEADER = """\
# Recipe reference

A recipe is one YAML file per pipeline. The schema is strict: an unknown key is an error naming its dotted path,
and every value is type- and range-checked, also after command-line overrides (`draftsmith run RECIPE a.b=c`).
`draftsmith show RECIPE` prints a recipe with every default filled in. `drafter.kind` picks the drafter section.

`RECIPE` on the command line is a file path or a recipe name: the shipped recipes (recipes/*.yaml) first, then
`NAME.yaml` in each folder listed in `DRAFTSMITH_RECIPES` (separated like `PATH`), so a shipped name is never
shadowed.

**What a shipped recipe needs.** Run from a fresh folder after the README's install command, a shipped recipe
finds everything it names: packaged models and data (their packages are in the install command), its own run
folder (`runs/<name>`, e.g. `eval.judge.head` reading the probe its train stage wrote), or the outputs of the
recipes its header names, one per line and in run order:

```yaml
# needs: draftsmith run fastdraft-pretrain
# needs: draftsmith run fastdraft-finetune
```

A recipe that downloads from the hub (a hub target or dataset) says `# needs: hub`.
tests/test_shipped_recipes.py resolves every path-like key of every shipped recipe against these rules.

This page is generated from the schema's field docstrings (recipes/schema.py); do not edit it by hand.
"""


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (a section, or each member of the drafter union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _type(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a!r}`" if isinstance(a, str) else f"`{a}`" for a in args)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if a is Ellipsis else _type(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        kind = annotation.model_fields.get("kind")
        return f"`{typing.get_args(kind.annotation)[0]}` section" if kind is not None else "section"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return "`null`" if value is None else f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _bounds(field) -> str:
    names = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "length >=", "max_length": "length <="}
    out = []
    for m in field.metadata:
        for attr, sym in names.items():
            if getattr(m, attr, None) is not None:
                out.append(f"{sym} {getattr(m, attr)}")
    return f" ({', '.join(out)})" if out else ""


def _doc(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _section(model: type[BaseModel], prefix: str, title: str, out: list[str], nested: list) -> None:
    out += ["", f"## {title}", ""]
    if model.__doc__ and model.__doc__ is not BaseModel.__doc__ and "Usage docs" not in model.__doc__:
        out += [_doc(model.__doc__), ""]
    out += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        members = _models(field.annotation)
        doc = _doc(field.description) or ("Selects this drafter section." if name == "kind" and prefix else "")
        if members:
            nested.append((key, members))
            first = _doc(members[0].__doc__).split(". ")[0].rstrip(".") if len(members) == 1 else ""
            doc = " ".join(filter(None, [doc or (first + "." if first else ""), f"Keys: `{key}.*` below."]))
        out.append(f"| `{key}` | {_type(field.annotation)}{_bounds(field)} | {_default(field)} | {doc} |")


def render() -> str:
    out = [HEADER.rstrip("\n")]
    queue = [("", [Recipe])]
    while queue:
        key, members = queue.pop(0)
        for model in members:
            nested: list = []
            kind = model.model_fields.get("kind")
            if key and len(members) > 1 and kind is not None:
                title = f"`{key}` with `kind: {typing.get_args(kind.annotation)[0]}`"
            else:
                title = f"`{key}`" if key else "Top level"
            _section(model, f"{key}." if key else "", title, out, nested)
            queue += nested
    return "\n".join(out) + "\n"


def write(path: str | Path | None = None) -> Path:
    """Write the reference (default: docs/recipes.md next to the package folders of a source checkout)."""
    path = Path(path) if path else Path(__file__).resolve().parents[1] / "docs" / "recipes.md"
    path.write_text(render())
    return path
