"""Stream distillation records into training: a map-style Dataset over all shards (shards are opened lazily,
a few at a time, and each record's rows are sliced from the memory-mapped file), the collate that aligns
teacher rows with student positions, and a ``datasets`` view for users who want the HF ecosystem.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils.data import Dataset

from draftsmith.data.records import (
    SIGNALS,
    Record,
    Shard,
    check_shard_size,
    load_shard,
    read_manifest,
    verify_shard,
)

log = logging.getLogger("draftsmith.data")


class RecordDataset(Dataset):
    """All records of a data folder. ``signals``: signal groups to read (None = all stored), e.g. {"topk"}:
    a drafter that does not need hidden states never reads them from disk. Every shard is verified against its
    manifest entry (size, header, checksum) before the first record is read."""

    def __init__(self, data_dir: Path, max_seq_len: int, signals: set[str] | None = None, cache_shards: int = 4):
        self.dir = Path(data_dir)
        self.manifest = read_manifest(self.dir)
        self.max_seq_len, self.signals = max_seq_len, signals
        entries = self.manifest["shards"]
        verify_shards(self.dir, entries)
        self.index = [(si, j) for si, e in enumerate(entries) for j in range(e["n_sequences"])]
        self._cache: OrderedDict[int, Shard] = OrderedDict()
        self._cache_size = cache_shards

    def __len__(self) -> int:
        return len(self.index)

    def _shard(self, si: int) -> Shard:
        if si not in self._cache:
            self._cache[si] = load_shard(self.dir / self.manifest["shards"][si]["file"], self.signals)
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(si)
        return self._cache[si]

    def __getitem__(self, i: int) -> Record:
        si, j = self.index[i]
        return truncate(self._shard(si).record(j), self.max_seq_len)


def token_counts(data_dir: Path, vocab_size: int) -> torch.Tensor:
    """How often each token id occurs among the response (loss) tokens of a data folder (V,) int64: the
    frequency statistic a reduced draft vocabulary is chosen from (docs/algorithms.md A10)."""
    data_dir = Path(data_dir)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in read_manifest(data_dir)["shards"]:
        sh = load_shard(data_dir / e["file"], signals=set(), entry=e)
        ids = sh.tensor("input_ids").long()[sh.loss_mask.bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def record_lengths(data_dir: Path) -> list[int]:
    """Every record's token count, in ``RecordDataset`` order (from the shards' token offsets; no tokens read)."""
    data_dir, out = Path(data_dir), []
    for e in read_manifest(data_dir)["shards"]:
        out += load_shard(data_dir / e["file"], signals=set(), entry=e).offsets.diff().tolist()
    return out


def verify_shards(data_dir: Path, entries: list[dict]) -> None:
    """Every shard of a data folder against its manifest entry (``verify_shard``: one read of the data, hashed on
    a few threads); shards whose entry has no checksum (written before shards had one) are named in a warning."""
    for e in entries:  # the cheap checks first: a missing or truncated shard is reported before any hashing
        check_shard_size(data_dir / e["file"], e)
    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL on large blocks
        list(pool.map(lambda e: verify_shard(data_dir / e["file"], e), entries))
    old = [e["file"] for e in entries if not e.get("sha256")]
    if old:
        log.warning(
            "%s: no checksums in manifest.json for %d shard(s) (written before shards had them); read unverified",
            data_dir,
            len(old),
        )


def truncate(r: Record, T: int) -> Record:
    """Cut a record to T tokens; keep the teacher rows of the tokens that remain."""
    if len(r.input_ids) <= T:
        return r
    keep = int(r.loss_mask[:T].sum())
    sig = {k: v[:T] if SIGNALS[k] == "token" else v[:keep] for k, v in r.signals.items()}
    return Record(r.input_ids[:T], r.loss_mask[:T], r.prompt_index, r.sample_index, r.source, sig)


def collate(records: list[Record]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence.

    Returns input_ids (B, T); attention_mask (B, T) bool; predict_mask (B, T): position t is trained to predict
    token t+1, which must be a response token; labels (N,); loss-axis signals (topk_ids, topk_logprobs (N, K),
    spec_token, spec_accept (N,)) in the row-major order of predict_mask's True entries, which is the order they
    are stored in; token-axis signals (hidden_last (B, T, D), hidden_aux (B, T, A, D)) zero-padded.
    """
    B, T = len(records), max(len(r.input_ids) for r in records)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.bool)
    predict = torch.zeros(B, T, dtype=torch.bool)
    for b, r in enumerate(records):
        n = len(r.input_ids)
        ids[b, :n] = r.input_ids
        attn[b, :n] = True
        predict[b, : n - 1] = r.loss_mask[1:]
    batch = {
        "input_ids": ids,
        "attention_mask": attn,
        "predict_mask": predict,
        "labels": ids[:, 1:][predict[:, :-1]],
        "source": torch.tensor([r.source for r in records]),
    }
    for name in records[0].signals:
        rows = [r.signals[name] for r in records]
        if SIGNALS[name] == "loss":
            batch[name] = torch.cat(rows)
        else:
            padded = rows[0].new_zeros((B, T, *rows[0].shape[1:]))
            for b, x in enumerate(rows):
                padded[b, : len(x)] = x
            batch[name] = padded
    return batch


def pack_rows(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """First-fit decreasing: record indices grouped into rows of at most ``row_tokens`` tokens, longest record first
    (ties in index order), each into the first row with room; a record is never split. A function of the lengths
    only, so a resumed run packs its micro-batches as the uninterrupted one did."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n > row_tokens:
            raise ValueError(f"a record of {n} tokens cannot fit a packed row of {row_tokens}")
        r = next((r for r, free in enumerate(room) if n <= free), None)
        if r is None:
            rows.append([])
            room.append(row_tokens)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= n
    return rows


def collate_packed(records: list[Record], row_tokens: int) -> dict[str, torch.Tensor]:
    """Pack records into rows of at most ``row_tokens`` tokens (``pack_rows``), right-padded to the fullest row.

    The keys of ``collate`` with the same meanings, plus pos (B, T): each token's position in its own record (RoPE
    restarts at 0 per document) and doc (B, T): the record's index within its row, -1 on padding (attention masks
    and shifted targets stay inside a document: train/objectives.py ``doc_mask``). A record's last token predicts
    nothing, so no label crosses into the next record; loss-axis signals follow the row-major order of
    predict_mask, token-axis signals sit at their record's tokens.
    """
    lengths = [len(r.input_ids) for r in records]
    rows = pack_rows(lengths, row_tokens)
    B, T = len(rows), max(sum(lengths[i] for i in row) for row in rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.bool)
    predict = torch.zeros(B, T, dtype=torch.bool)
    pos = torch.zeros(B, T, dtype=torch.long)
    doc = torch.full((B, T), -1, dtype=torch.long)
    token_sig = {k: v for k, v in records[0].signals.items() if SIGNALS[k] == "token"}
    padded = {k: v.new_zeros((B, T, *v.shape[1:])) for k, v in token_sig.items()}
    order = []
    for b, row in enumerate(rows):
        s = 0
        for j, i in enumerate(row):
            r, n = records[i], lengths[i]
            ids[b, s : s + n] = r.input_ids
            attn[b, s : s + n] = True
            predict[b, s : s + n - 1] = r.loss_mask[1:]
            pos[b, s : s + n] = torch.arange(n)
            doc[b, s : s + n] = j
            for k in padded:
                padded[k][b, s : s + n] = r.signals[k]
            order.append(i)
            s += n
    batch = {
        "input_ids": ids,
        "attention_mask": attn,
        "predict_mask": predict,
        "labels": ids[:, 1:][predict[:, :-1]],
        "source": torch.tensor([records[i].source for i in order]),
        "pos": pos,
        "doc": doc,
        **padded,
    }
    for name in records[0].signals:
        if SIGNALS[name] == "loss":  # row-major over the rows = the records in placement order
            batch[name] = torch.cat([records[i].signals[name] for i in order])
    return batch


def hf_dataset(data_dir: Path, signals: set[str] | None = None):
    """The records as a streaming ``datasets.IterableDataset`` (one row per sequence, nothing loaded up front).

    Columns: input_ids, loss_mask, prompt_index, sample_index, source, and each stored signal as nested lists.
    """
    import datasets

    manifest = read_manifest(Path(data_dir))
    files = [str(Path(data_dir) / e["file"]) for e in manifest["shards"]]
    entries = {f: e for f, e in zip(files, manifest["shards"])}

    def rows(shard_files):
        for f in shard_files:
            shard = load_shard(Path(f), signals, entries[f])
            for i in range(len(shard)):
                r = shard.record(i)
                yield {
                    "input_ids": r.input_ids.tolist(),
                    "loss_mask": r.loss_mask.tolist(),
                    "prompt_index": r.prompt_index,
                    "sample_index": r.sample_index,
                    "source": r.source,
                    **{k: v.tolist() for k, v in r.signals.items()},
                }

    return datasets.IterableDataset.from_generator(rows, gen_kwargs={"shard_files": files})
