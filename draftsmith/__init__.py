"""draftsmith: train draft models for speculative decoding.

The code lives in sibling folders mapped to subpackages (draftsmith.models -> models/, draftsmith.data -> data/,
draftsmith.train -> train/, draftsmith.eval -> eval/, draftsmith.kernels -> kernels/, draftsmith.recipes ->
recipes/). This package holds the CLI (``draftsmith.cli``) and the shared error type.
"""

from draftsmith.errors import DraftsmithError

__version__ = "0.1.0"
__all__ = ["DraftsmithError", "__version__"]
