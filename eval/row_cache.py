"""The slot-addressed KV cache of a batch whose rows come and go (``RowCache``), and ``aligned``, which lines up
per-row sequences of different lengths for one forward. The batched decoder (eval/batch_decoder.py), its proposers
(eval/proposers.py) and the data stage's generator (data/engine.py) write through them.
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.kernels.kv import compact_rows
from draftsmith.models.llama import KVCache


class RowCache:
    """A ``KVCache`` whose rows come and go. ``view`` is a KVCache over the active rows ``[0, n)`` that the models
    write through (it shares storage with ``full``, which has ``cap`` rows); ``make(batch, max_len)`` builds the
    storage (a model's ``new_cache`` / ``new_context``)."""

    def __init__(self, make, max_len: int):
        self.make, self.max_len, self.n = make, max_len, 0
        self.compactions = 0
        self.full: KVCache | None = None
        self.view: KVCache | None = None

    @property
    def length(self) -> int:
        return 0 if self.view is None else self.view.length

    def _refresh(self, length: int, padded: bool) -> None:
        # padded: some row has an invalid slot below length (a hole, padding), so attention needs the mask; while
        # none has (batch 1, rows in lockstep), a lone new token reads every slot unmasked, as at batch 1
        if self.n == 1 and self.full.valid.shape[0] == 1:  # one row in one-row storage: the storage itself, which a
            self.full.length, self.full.padded = length, padded  # CUDA-graph wrapper recognises as its static cache
            self.view = self.full
            return
        self.view = self.full.rows(self.n, length, padded)

    def _grow(self, rows: int) -> None:
        cap = 0 if self.full is None else self.full.valid.shape[0]
        if rows <= cap:
            return
        new = self.make(max(rows, 2 * cap), self.max_len)
        if self.full is not None:
            new.kv[:, :, : self.n] = self.full.kv[:, :, : self.n]
            new.valid[: self.n] = self.full.valid[: self.n]
        self.full = new

    def reserve(self, rows: int) -> None:
        """Storage for ``rows`` rows now: while no more join, the buffers never move (CUDA graphs read them)."""
        self._grow(rows)

    def counts(self) -> torch.Tensor:
        """Valid slots per active row (n,)."""
        return self.view.valid[:, : self.length].sum(1)

    def compact(self, min_len: int = 0, impl: str = "auto") -> None:
        """Move every row's valid slots, in order, to the right end of [0, S), S = max(largest row count, min_len):
        one operation for all rows, layers, K and V (kernels/kv.py ``compact_rows``; Triton on CUDA)."""
        counts = self.counts().tolist()
        S = max(counts + [min_len])
        self.compactions += 1
        self.view.padded = min(counts) < S
        compact_rows(self.full.kv, self.full.valid[: self.n], self.length, S, impl)
        self.view.length = S

    def ensure(self, width: int) -> None:
        """Room for ``width`` new slots, compacting if needed."""
        if self.length + width > self.max_len:
            self.compact()
            if self.length + width > self.max_len:
                raise DraftsmithError(f"batch KV cache: {self.length}+{width} slots exceed max_len={self.max_len}")

    def keep(self, s0: int, width: int, kept: torch.Tensor) -> None:
        """Of the ``width`` slots written from s0, row b keeps its first kept[b]; the rest become holes, and slots
        no row kept are rolled back."""
        if width == 0:
            return
        ar = torch.arange(width, device=kept.device)
        self.view.valid[:, s0 : s0 + width] &= ar[None] < kept[:, None]
        lo, hi = torch.stack([kept.min(), kept.max()]).tolist()
        self.view.length = s0 + hi
        self.view.padded |= lo < hi

    def keep_slots(self, s0: int, keep: torch.Tensor) -> None:
        """Of the keep.shape[1] slots written from s0, row b keeps those where keep[b] (any subset: a tree's root
        and accepted path); the rest become holes, and slots past the last one any row kept are rolled back."""
        self.view.valid[:, s0 : s0 + keep.shape[1]] &= keep
        hi = int(keep.any(0).nonzero()[-1]) + 1
        self.view.length = s0 + hi
        self.view.padded |= not bool(keep[:, :hi].all())

    def join(self, tmp: KVCache, rows: list[int], count: int) -> None:
        """Append rows ``rows`` of ``tmp`` as new active rows: their first ``count`` slots, each valid where
        ``tmp.valid`` says (a ragged prefill's left padding is invalid there and stays a hole here)."""
        k = len(rows)
        if k == 0:
            return
        self._grow(self.n + k)
        length, padded = self.length, self.n > 0 and self.view.padded
        if self.view is not None and self.n and length < count:
            self.compact(count)
            length = self.length
        length = max(length, count) if self.n else count
        src = torch.tensor(rows, device=self.full.valid.device)
        valid = tmp.valid.index_select(0, src)[:, :count]
        padded |= count < length or (self.n > 0 and bool((self.counts() < length).any()))
        padded |= bool(count and not valid.all())
        dst = slice(self.n, self.n + k)
        self.full.valid[dst] = False
        if count:
            self.full.kv[:, :, dst, :, length - count : length] = tmp.kv.index_select(2, src)[:, :, :, :, :count]
            self.full.valid[dst, length - count : length] = valid
        self.n += k
        self._refresh(length, padded)

    def remove(self, i: int) -> None:
        """Drop active row i: the last active row takes its place."""
        last = self.n - 1
        if i != last:
            self.full.kv[:, :, i] = self.full.kv[:, :, last]
            self.full.valid[i] = self.full.valid[last]
        self.n = last
        self._refresh(self.length if self.n else 0, self.n > 0 and self.view.padded)


def aligned(seqs: list[torch.Tensor], starts: list[int]):
    """Right-align per-row sequences (u_b, ...) into (B, W, ...) -> (padded, valid (B, W) or None when no row is
    padded, pos (B, W)); row b's real entries sit at positions starts[b] .. starts[b] + u_b - 1."""
    lens = [len(s) for s in seqs]
    B, W, dev = len(seqs), max(lens), seqs[0].device
    pad = seqs[0].new_zeros((B, W, *seqs[0].shape[1:]))
    for b, s in enumerate(seqs):
        if len(s):
            pad[b, W - len(s) :] = s
    lead = torch.tensor([W - u for u in lens], device=dev)[:, None]  # padding slots before each row's entries
    ar = torch.arange(W, device=dev)[None]
    pos = torch.tensor(starts, device=dev)[:, None] - lead + ar
    return pad, None if min(lens) == W else ar >= lead, pos
