"""Stream distillation records into training: a map-style Dataset over all shards (shards are loaded lazily
and kept in a small cache, never all at once) and the collate that aligns teacher rows with student positions.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch
from torch.utils.data import Dataset

from draftsmith.data.records import Record, load_shard, read_manifest


class RecordDataset(Dataset):
    def __init__(self, data_dir: Path, max_seq_len: int, cache_shards: int = 4):
        self.dir = Path(data_dir)
        self.manifest = read_manifest(self.dir)
        self.max_seq_len = max_seq_len
        self.index = [(si, j) for si, e in enumerate(self.manifest["shards"]) for j in range(e["n_sequences"])]
        self._cache: OrderedDict = OrderedDict()
        self._cache_size = cache_shards

    def __len__(self) -> int:
        return len(self.index)

    def _shard(self, si: int):
        if si not in self._cache:
            self._cache[si] = load_shard(self.dir / self.manifest["shards"][si]["file"])
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(si)
        return self._cache[si]

    def __getitem__(self, i: int) -> Record:
        si, j = self.index[i]
        r = self._shard(si).record(j)
        T = self.max_seq_len
        if len(r.input_ids) > T:  # cut the tail; keep the teacher rows of the loss tokens that remain
            keep = int(r.loss_mask[:T].sum())
            r = Record(r.input_ids[:T], r.loss_mask[:T], r.prompt_index,
                       None if r.topk_ids is None else r.topk_ids[:keep],
                       None if r.topk_logprobs is None else r.topk_logprobs[:keep])
        return r


def collate(records: list[Record]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence.

    Returns input_ids (B, T); predict_mask (B, T): position t is trained to predict token t+1, which must be a
    target-written token; labels (N,) and, if stored, topk_ids / topk_logprobs (N, K), in the row-major order of
    predict_mask's True entries (which is the order teacher rows are stored in).
    """
    B, T = len(records), max(len(r.input_ids) for r in records)
    ids = torch.zeros(B, T, dtype=torch.long)
    predict = torch.zeros(B, T, dtype=torch.bool)
    for b, r in enumerate(records):
        n = len(r.input_ids)
        ids[b, :n] = r.input_ids
        predict[b, :n - 1] = r.loss_mask[1:]
    batch = {"input_ids": ids, "predict_mask": predict, "labels": ids[:, 1:][predict[:, :-1]]}
    if records[0].topk_ids is not None:
        batch["topk_ids"] = torch.cat([r.topk_ids for r in records])
        batch["topk_logprobs"] = torch.cat([r.topk_logprobs for r in records])
    return batch
