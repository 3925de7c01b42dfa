"""KV-cache compaction, in place, in every layer: ``compact_kv`` keeps a tree verify's accepted path
(docs/algorithms.md A11.3); ``compact_rows`` right-aligns the valid slots of every row of a batch cache
(eval/batch_decoder.py RowCache, below).

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


# ---- row compaction of a batch cache (eval/batch_decoder.py RowCache) -----------------------------------------------
#
# Row b's valid slots in [0, length), in order, move to the right end of [0, S): the r-th of its c valid slots to
# S - c + r. Destinations step by exactly one while sources step by at least one, so dest - src never grows along a
# row: a row's slots that move right (to higher slots) come first, those that move left come last. Moving the
# right-movers from the last down and the left-movers from the first up never overwrites a slot still to be read,
# so the kernel works in place with no copy of the cache. It moves a block of slots at a time, whose elements other
# threads of the program load and store: a barrier between each block's loads and its stores keeps that order.


def compact_rows_loop(kv: torch.Tensor, valid: torch.Tensor, length: int, S: int) -> None:
    """One row at a time (an index_select per row and a host sync per row): the original, kept to compare with."""
    for b, c in enumerate(valid[:, :length].sum(1).tolist()):
        idx = valid[b, :length].nonzero()[:, 0]
        if c and not (idx[0] == S - c and idx[-1] == S - 1):
            row = kv[:, :, b]  # (2, layers, heads, slots, hd), a view
            row[:, :, :, S - c : S] = row.index_select(3, idx)
        valid[b] = False
        valid[b, S - c : S] = True


def _right_aligned(valid: torch.Tensor, length: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """valid (B, max_len) -> (each slot's destination (B, length), each row's valid count (B,))."""
    v = valid[:, :length]
    counts = v.sum(1)
    return S - counts[:, None] + v.cumsum(1) - 1, counts


def _new_valid(valid: torch.Tensor, counts: torch.Tensor, S: int) -> None:
    ar = torch.arange(valid.shape[1], device=valid.device)
    valid.copy_((ar >= S - counts[:, None]) & (ar < S))


def compact_rows_reference(kv: torch.Tensor, valid: torch.Tensor, length: int, S: int, chunk: int = 4 << 20) -> None:
    """Every row at once: each valid slot's destination from a cumsum over ``valid``, then a gather (a copy, so
    overlapping moves are safe) and a scatter of every moved slot's hd-vector, for all rows and heads, over the
    cache viewed as one plane of slot vectors per K/V and layer. Moves never cross planes, so planes go in groups
    whose temporary stays under ``chunk`` bytes: on CPU a fresh temporary the size of the cache costs more in page
    faults than the copy itself."""
    dest, counts = _right_aligned(valid, length, S)
    slot = torch.arange(length, device=valid.device)
    b, s = (valid[:, :length] & (dest != slot)).nonzero(as_tuple=True)  # the slots that move
    if b.numel():
        K, L, cap, H, M, D = kv.shape
        planes = kv.view(K * L, cap * H * M, D)
        at = (b * H + torch.arange(H, device=kv.device)[:, None]) * M  # (heads, moved): each one's (row, head) start
        src, dst = (at + s).view(-1), (at + dest[b, s]).view(-1)
        step = max(1, chunk // (src.numel() * D * kv.element_size()))
        for k0 in range(0, K * L, step):
            group = planes[k0 : k0 + step]
            off = torch.arange(group.shape[0], device=kv.device)[:, None] * group.shape[1]
            flat = group.view(-1, D)
            flat.index_copy_(0, (off + dst).view(-1), flat.index_select(0, (off + src).view(-1)))
    _new_valid(valid, counts, S)


if HAS_TRITON:

    @triton.jit
    def _compact_rows_kernel(
        kv_ptr, src_ptr, S, L, D, s_kv, s_l, s_b, s_h, s_s, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        """Program (K/V and layer, row, head): src (B, S) holds each destination slot's source, -1 for none."""
        kl, b, h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        base = kv_ptr + (kl // L) * s_kv + (kl % L) * s_l + b * s_b + h * s_h
        d = tl.arange(0, BLOCK_D)
        md = d < D
        nt = tl.cdiv(S, BLOCK_S)
        for t in range(0, nt):  # left-movers, first block up; a block loads all its sources before it stores
            j = t * BLOCK_S + tl.arange(0, BLOCK_S)
            src = tl.load(src_ptr + b * S + j, mask=j < S, other=-1)
            m = (src > j)[:, None] & md[None, :]
            x = tl.load(base + src[:, None].to(tl.int64) * s_s + d[None, :], mask=m)
            tl.debug_barrier()  # every thread's loads (this block's, the blocks' before) land before any store
            tl.store(base + j[:, None].to(tl.int64) * s_s + d[None, :], x, mask=m)
        for t in range(0, nt):  # right-movers, last block down
            j = (nt - 1 - t) * BLOCK_S + tl.arange(0, BLOCK_S)
            src = tl.load(src_ptr + b * S + j, mask=j < S, other=-1)
            m = ((src >= 0) & (src < j))[:, None] & md[None, :]
            x = tl.load(base + src[:, None].to(tl.int64) * s_s + d[None, :], mask=m)
            tl.debug_barrier()
            tl.store(base + j[:, None].to(tl.int64) * s_s + d[None, :], x, mask=m)


def compact_rows(kv: torch.Tensor, valid: torch.Tensor, length: int, S: int, impl: str = "auto") -> None:
    """Right-align the valid slots of [0, length) of rows [0, B) in [0, S), in place, in one operation for all rows,
    layers, K and V. kv (2, layers, cap, heads, max_len, hd) contiguous (a batch cache's whole buffer), valid
    (B, max_len) bool for its first B <= cap rows, updated to mark [S - count, S) per row. S must be at least every
    row's count. ``impl``: as in kernels/launch.py, or "loop" (one row at a time, the original)."""
    if kv.dim() != 6 or kv.shape[0] != 2 or kv.shape[2] < valid.shape[0] or kv.shape[4] != valid.shape[1]:
        raise ValueError(
            f"compact_rows: expected kv (2, layers, cap, heads, max_len, hd) and valid (B <= cap, max_len), got "
            f"{tuple(kv.shape)} and {tuple(valid.shape)}"
        )
    if not 0 <= length <= valid.shape[1] or not 0 <= S <= valid.shape[1] or not kv.is_contiguous():
        raise ValueError(f"compact_rows: length={length} and S={S} must be in [0, {valid.shape[1]}], kv contiguous")
    if impl == "loop":
        return compact_rows_loop(kv, valid, length, S)
    if pick_impl(impl, kv) == "reference":
        return compact_rows_reference(kv, valid, length, S)
    B, L, H, D = valid.shape[0], kv.shape[1], kv.shape[3], kv.shape[5]
    dest, counts = _right_aligned(valid, length, S)
    src = torch.full((B, S + 1), -1, dtype=torch.int32, device=kv.device)  # column S collects the invalid slots
    slot = torch.arange(length, dtype=torch.int32, device=kv.device).expand(B, -1)
    src.scatter_(1, torch.where(valid[:, :length], dest, S), slot)
    src = src[:, :S].contiguous()
    if B and S:
        st = kv.stride()
        _compact_rows_kernel[(2 * L, B, H)](
            kv, src, S, L, D, st[0], st[1], st[2], st[3], st[4], BLOCK_S=16, BLOCK_D=triton.next_power_of_2(D)
        )
    _new_valid(valid, counts, S)
