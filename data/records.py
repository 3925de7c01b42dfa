"""On-disk distillation records: safetensors shards plus a ``manifest.json`` written last.

A shard stores ragged sequences flat: ``input_ids`` (int32), ``loss_mask`` (uint8, 1 = target-written token),
``offsets`` (int64, n+1), ``prompt_index`` (int64, n) and, per loss token, teacher signals ``topk_ids`` (int32,
(N, K)) and ``topk_logprobs`` (float16, (N, K)); teacher row j belongs to the j-th loss token of the shard.
Shards are written to a temp name and renamed, so a killed run never leaves a partial shard that looks complete.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError

FORMAT = "draftsmith-records/1"


@dataclass
class Record:
    input_ids: list[int]  # prompt + response tokens
    loss_mask: list[int]  # 1 where the token was written by the target (a training label)
    prompt_index: int
    topk_ids: torch.Tensor | None = None  # (n_loss, K) int
    topk_logprobs: torch.Tensor | None = None  # (n_loss, K) float


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def write_shard(path: Path, records: list[Record], meta: dict[str, str]) -> dict:
    """Write records to ``path`` atomically; returns the shard's manifest entry."""
    ids = [t for r in records for t in r.input_ids]
    mask = [m for r in records for m in r.loss_mask]
    offsets = [0]
    for r in records:
        if r.loss_mask and r.loss_mask[0]:
            raise ValueError("the first token of a record cannot be a loss token (nothing predicts it)")
        offsets.append(offsets[-1] + len(r.input_ids))
    tensors = {
        "input_ids": torch.tensor(ids, dtype=torch.int32),
        "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "prompt_index": torch.tensor([r.prompt_index for r in records], dtype=torch.int64),
    }
    if records and records[0].topk_ids is not None:
        tensors["topk_ids"] = torch.cat([r.topk_ids for r in records]).to(torch.int32)
        tensors["topk_logprobs"] = torch.cat([r.topk_logprobs for r in records]).to(torch.float16)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, **meta})
    os.replace(tmp, path)
    return {
        "file": path.name,
        "n_sequences": len(records),
        "n_tokens": len(ids),
        "n_loss_tokens": int(sum(mask)),
        "bytes": path.stat().st_size,
    }


def read_shard_meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as fh:
        return fh.metadata() or {}


@dataclass
class Shard:
    """A loaded shard; ``record(i)`` slices one sequence and its teacher rows out of the flat arrays."""

    tensors: dict[str, torch.Tensor]
    loss_offsets: torch.Tensor = field(init=False)

    def __post_init__(self):
        mask = self.tensors["loss_mask"].long()
        off = self.tensors["offsets"]
        csum = torch.cat([torch.zeros(1, dtype=torch.long), mask.cumsum(0)])
        self.loss_offsets = csum[off]  # teacher-row offset of each sequence

    def __len__(self) -> int:
        return len(self.tensors["offsets"]) - 1

    def record(self, i: int) -> Record:
        t, off, loff = self.tensors, self.tensors["offsets"], self.loss_offsets
        a, b, la, lb = off[i].item(), off[i + 1].item(), loff[i].item(), loff[i + 1].item()
        has_topk = "topk_ids" in t
        return Record(
            input_ids=t["input_ids"][a:b].long(),
            loss_mask=t["loss_mask"][a:b].bool(),
            prompt_index=int(t["prompt_index"][i]),
            topk_ids=t["topk_ids"][la:lb].long() if has_topk else None,
            topk_logprobs=t["topk_logprobs"][la:lb].float() if has_topk else None,
        )


def load_shard(path: Path) -> Shard:
    with safe_open(str(path), framework="pt") as fh:
        return Shard({k: fh.get_tensor(k) for k in fh.keys()})


def read_manifest(data_dir: Path) -> dict:
    m = Path(data_dir) / "manifest.json"
    if not m.is_file():
        raise DraftsmithError(f"{data_dir}: no manifest.json (run `draftsmith generate` first, or it was interrupted)")
    manifest = json.loads(m.read_text())
    if manifest.get("format") != FORMAT:
        raise DraftsmithError(f"{m}: unsupported records format {manifest.get('format')!r}")
    return manifest


def write_manifest(data_dir: Path, manifest: dict) -> None:
    tmp = Path(data_dir) / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, Path(data_dir) / "manifest.json")
