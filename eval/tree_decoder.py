"""Tree speculative decoding, batch 1: static trees (Medusa-style choices) and EAGLE-2 dynamic trees, for draft
LMs, EAGLE drafters and feature heads (docs/algorithms.md A11). It is the one speculative loop
(eval/decoder.py ``speculative_generate``) with a tree shape (eval/shapes.py).
"""

from __future__ import annotations

import torch

from draftsmith.eval.decoder import DecodeStats, speculative_generate
from draftsmith.eval.tree import DynamicTree, TreeSpec


def tree_speculative_generate(
    target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int, tree: TreeSpec | DynamicTree, **options
) -> tuple[list[int], DecodeStats]:
    """Tree speculative decoding over a static tree (``tree_from_choices``) or an EAGLE-2-style ``DynamicTree``
    rebuilt every step from the drafter's confidence. ``options``: ``speculative_generate``'s sampling and
    streaming keywords (temperature, top_k, top_p, eos_ids, generator, on_token).

    Each step drafts the whole tree, verifies it in one target forward under the tree mask, and compacts the target
    KV cache to the accepted path. Greedy: the drafter's top-k children, and the deepest path whose tokens are the
    target's argmax; output equals the target's greedy decoding token for token. Sampling: the tree's rule
    (``tree.sampling``): the point-mass walk over top-k children (``sample_tree_accept``), or recursive / SpecTr
    rejection over children drawn from the drafter (``multi_draft_accept``); output follows the target's processed
    distribution. The drafter
    re-reads the accepted path next step (its cache is rolled back to the root), keeping it trivially consistent.
    """
    return speculative_generate(target, drafter, prompt_ids, max_new_tokens, tree=tree, **options)
