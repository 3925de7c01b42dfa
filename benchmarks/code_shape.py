"""How the code is shaped where a newcomer adds a drafter kind: counts to compare before and after a refactor.

- kind branches: places in product code (not tests), outside a kind's own model file, that decide something by a
  specific drafter kind: a string literal equal to a registered kind in a comparison or a registry lookup, or an
  ``isinstance`` against a kind's model class;
- other kind-name strings: the remaining string literals equal to a kind name, listed so each can be read (engine
  vocabulary such as vLLM's method "eagle", the "medusa" export format, signal groups, report keys, defaults).
  Their sum with the branches is the older single count "kind names";
- own-vocabulary branches: product lines that mention ``own_vocab`` or ``draft_tokenizer``;
- test kind lists: list / tuple / set literals in tests/ holding two or more registered kind names;
- long functions: product functions over --max-lines lines (default 80), longest first;
- package cycles: pairs of top-level packages (data, eval, train, models, recipes, kernels, the CLI's draftsmith)
  that import each other, at module level or inside functions.

    python benchmarks/code_shape.py [--max-lines 80] [--json FILE]

Reading the output: one line per count, then the items behind each (file:line). Nothing is timed.
"""

from __future__ import annotations

import argparse
import ast
import json
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "eval", "train", "models", "recipes", "kernels", "draftsmith")


def product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def kinds() -> dict[str, str]:
    """Registered kind -> the module that defines it (models/<file>.py)."""
    from draftsmith.models.registry import DRAFTERS

    out = {}
    for name, spec in DRAFTERS.items():
        mod = getattr(spec, "module", None) or getattr(spec.build, "__module__", "")
        out[name] = mod.rsplit(".", 1)[-1]
    return out


def kind_classes() -> dict[str, str]:
    """Model class name -> its kind (classes defined in a kind's own module)."""
    import importlib

    out = {}
    for name, mod in kinds().items():
        try:
            m = importlib.import_module(f"draftsmith.models.{mod}")
        except ImportError:
            continue
        for attr, obj in vars(m).items():
            if isinstance(obj, type) and obj.__module__ == m.__name__ and issubclass(obj, object):
                if attr[0].isupper() and ("Drafter" in attr or attr.lower().startswith(name.split("_")[0])):
                    out[attr] = name
    return out


LOOKUPS = ("drafter_spec", "kinds", "build_drafter", "objective_for")  # registry calls that take a kind


def _branch_parents(tree: ast.AST) -> set[int]:
    """ids of the string constants that decide something by a kind: compared (==, !=, in, not in; alone or in a
    tuple/list/set compared against), a registry subscript (``DRAFTERS["x"]``) or a registry lookup's argument."""
    out = set()
    for node in ast.walk(tree):
        operands = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "DRAFTERS":
            operands = [node.slice]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in LOOKUPS:
            operands = [*node.args, *(k.value for k in node.keywords)]
        for op in operands:
            for e in op.elts if isinstance(op, ast.Tuple | ast.List | ast.Set) else [op]:
                out.add(id(e))
    return out


def kind_names(names: dict[str, str], classes: dict[str, str]) -> tuple[list[str], list[str]]:
    """(branches, other mentions): product places outside a kind's own model file that decide by a specific kind
    (a comparison, registry lookup or isinstance), and the other string constants equal to a kind name (engine
    vocabulary such as vLLM's method "eagle" or the "medusa" export format, signal groups, report keys, defaults)."""
    branches, other = [], []
    for p in product_files():
        rel = p.relative_to(ROOT)
        tree = ast.parse(p.read_text(), filename=str(p))
        deciding = _branch_parents(tree)
        for node in ast.walk(tree):
            kind, decides = None, False
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                kind, decides = node.value, id(node) in deciding
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                cls = node.args[1]
                for n in cls.elts if isinstance(cls, ast.Tuple) else [cls]:
                    kind = kind or classes.get(getattr(n, "id", None) or getattr(n, "attr", None))
                decides = True
            if kind is None:
                continue
            own = rel.parts[0] == "models" and p.stem == names[kind]
            if not own and not (rel.parts[0] == "models" and p.stem == "registry"):
                (branches if decides else other).append(f"{rel}:{node.lineno} {kind}")
    return sorted(set(branches)), sorted(set(other))


def own_vocab_branches() -> list[str]:
    out = []
    for p in product_files():
        for i, line in enumerate(p.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if "own_vocab" in code or "draft_tokenizer" in code:
                out.append(f"{p.relative_to(ROOT)}:{i}")
    return out


def test_kind_lists(names: dict[str, str]) -> list[str]:
    out = []
    for p in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(p.read_text(), filename=str(p))
        for node in ast.walk(tree):
            if isinstance(node, ast.List | ast.Tuple | ast.Set):
                found = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                if len(found) >= 2:
                    out.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    return sorted(set(out))


def long_functions(limit: int) -> list[tuple[int, str]]:
    out = []
    for p in product_files():
        tree = ast.parse(p.read_text(), filename=str(p))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append((n, f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(out, reverse=True)


def package_cycles() -> list[str]:
    edges = defaultdict(set)
    for p in product_files():
        src = p.relative_to(ROOT).parts[0]
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            for m in mods:
                parts = m.split(".")
                if parts[0] == "draftsmith" and len(parts) > 1 and parts[1] in PACKAGES and parts[1] != src:
                    edges[src].add(parts[1])
    return sorted({f"{a} <-> {b}" for a in edges for b in edges[a] if a in edges.get(b, ()) and a < b})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-lines", type=int, default=80, help="a product function longer than this is counted")
    ap.add_argument("--json", default=None, help="also write the counts and items to this JSON file")
    a = ap.parse_args()
    names = kinds()
    branches, other = kind_names(names, kind_classes())
    res = {
        "kind branches": branches,
        "other kind-name strings": other,
        "own-vocabulary branches": own_vocab_branches(),
        "test kind lists": test_kind_lists(names),
        f"functions over {a.max_lines} lines": [f"{n} {s}" for n, s in long_functions(a.max_lines)],
        "package cycles": package_cycles(),
    }
    for k, v in res.items():
        print(f"{k}: {len(v)}")
    for k, v in res.items():
        print(f"\n{k}:")
        for item in v:
            print(f"  {item}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
