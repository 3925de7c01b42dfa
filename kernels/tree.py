"""Tree attention buffers from parent pointers, on device (docs/algorithms.md A11.2, B3): for every node the ancestor
mask row (itself, its ancestors and the root) and its depth (the RoPE position offset).

One program per node walks up its parent chain, so building a 60-node EAGLE-2 tree costs one launch and no host
round trip. ``impl`` as in kernels/launch.py.
"""

from __future__ import annotations

import torch

from draftsmith.kernels.launch import HAS_TRITON, pick_impl, tl, triton


def tree_mask_reference(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parents (N,) int (-1 = child of the root; parents precede children) -> (mask (N+1, N+1) bool, depth (N+1,)
    int32). Row/column 0 is the root; row i+1 is node i: mask[i+1] = mask[parent(i)+1] | {i+1}."""
    n = parents.numel()
    mask = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    mask[1:, 0] = True
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i + 1] |= mask[p + 1]
    return mask, (mask.sum(-1) - 1).int()


if HAS_TRITON:

    @triton.jit
    def _tree_mask_kernel(parents_ptr, mask_ptr, depth_ptr, N, MAX_DEPTH):
        i = tl.program_id(0)  # node i, row i + 1
        row = mask_ptr + (i + 1) * (N + 1)
        tl.store(row, 1)  # the root
        node = i
        depth = 0
        for _ in range(0, MAX_DEPTH):  # bounded walk: a malformed (cyclic) input cannot hang the GPU
            live = node >= 0
            tl.store(row + node + 1, 1, mask=live)
            depth += live.to(tl.int32)
            node = tl.where(live, tl.load(parents_ptr + tl.maximum(node, 0)), -1)
        tl.store(depth_ptr + i + 1, depth)


def tree_mask(parents: torch.Tensor, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(mask (N+1, N+1) bool, depth (N+1,) int32) from parent pointers (see tree_mask_reference)."""
    if parents.dim() != 1:
        raise ValueError(f"tree_mask: parents must be (N,), got {tuple(parents.shape)}")
    if pick_impl(impl, parents) == "reference":
        return tree_mask_reference(parents)
    n = parents.numel()
    mask = torch.zeros(n + 1, n + 1, dtype=torch.int8, device=parents.device)
    mask[0, 0] = 1
    depth = torch.zeros(n + 1, dtype=torch.int32, device=parents.device)
    if n:
        _tree_mask_kernel[(n,)](parents.to(torch.int32).contiguous(), mask, depth, n, n)
    return mask.bool(), depth
