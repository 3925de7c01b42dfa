"""draftsmith: train draft models for speculative decoding.

The code lives in sibling folders mapped to subpackages (draftsmith.models -> models/, draftsmith.data -> data/,
draftsmith.train -> train/, draftsmith.eval -> eval/, draftsmith.kernels -> kernels/, draftsmith.recipes ->
recipes/). This package holds the CLI (``draftsmith.cli``) and the shared error type.
"""

import sys
from pathlib import Path

from draftsmith.errors import DraftsmithError


def _unshadow_checkout() -> None:
    """Keep a source checkout's root off ``sys.path``.

    ``python -m ...`` run from the checkout puts its root on ``sys.path``, where the top-level folders (kernels/,
    data/, eval/, ...) would shadow installed packages of the same name: transformers imports the hub's
    ``kernels`` package. Those folders are importable only as ``draftsmith.*``, so the root is never needed."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file() or not (root / "kernels" / "__init__.py").is_file():
        return  # an installed wheel: nothing to shadow
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != root]
    shadowed = sys.modules.get("kernels")
    if shadowed is not None and Path(getattr(shadowed, "__file__", "") or "").resolve().parent.parent == root:
        del sys.modules["kernels"]


_unshadow_checkout()

__version__ = "0.1.0"
__all__ = ["DraftsmithError", "__version__"]
