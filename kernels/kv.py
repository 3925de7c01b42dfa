"""KV-cache compaction after a tree verify (docs/algorithms.md A11.3): keep the accepted path's K/V slots and move
them to consecutive slots, in place, in every layer.

Slots ``start + keep[j]`` move to ``start + j`` with ``keep`` ascending, so keep[j] >= j: walking j upwards
never overwrites a source that is still to be read. One program per (batch row, head) does that walk, each step a
vector copy of one head_dim row. ``impl`` as in kernels/launch.py.
"""

from __future__ import annotations

import torch

from draftsmith.kernels.launch import HAS_TRITON, pick_impl, tl, triton


def compact_kv_reference(x: torch.Tensor, start: int, keep: torch.Tensor) -> None:
    """x (B, H, S, D): x[:, :, start + j] = x[:, :, start + keep[j]] for all j (advanced indexing copies first)."""
    n = keep.numel()
    x[:, :, start : start + n] = x[:, :, start + keep.long()]


if HAS_TRITON:

    @triton.jit
    def _compact_kernel(x_ptr, keep_ptr, start, n, S, D, BLOCK_D: tl.constexpr):
        bh = tl.program_id(0)
        base = x_ptr + bh * S * D
        offs = tl.arange(0, BLOCK_D)
        m = offs < D
        for j in range(0, n):  # ascending: sources at keep[j] >= j are never already overwritten
            src = tl.load(keep_ptr + j)
            row = tl.load(base + (start + src) * D + offs, mask=m)
            tl.store(base + (start + j) * D + offs, row, mask=m)


def compact_kv(x: torch.Tensor, start: int, keep: torch.Tensor, impl: str = "auto", check: bool = True) -> None:
    """In place on one K or V buffer x (B, H, S, D), contiguous. keep (n,) ascending slot offsets from start.
    ``check=False`` skips validating keep's values, which costs a device sync (for callers that checked them)."""
    if x.dim() != 4 or not x.is_contiguous():
        raise ValueError(f"compact_kv: expected a contiguous (B, H, S, D) buffer, got {tuple(x.shape)}")
    if check and keep.numel() and (start + int(keep.max()) >= x.shape[2] or bool((keep.diff() <= 0).any())):
        raise ValueError("compact_kv: keep must be strictly ascending and inside the buffer")
    if pick_impl(impl, x) == "reference":
        return compact_kv_reference(x, start, keep)
    B, H, S, D = x.shape
    if keep.numel():
        _compact_kernel[(B * H,)](
            x, keep.to(torch.int32).contiguous(), start, keep.numel(), S, D, BLOCK_D=triton.next_power_of_2(D)
        )
