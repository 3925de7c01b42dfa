"""On-disk distillation records: safetensors shards plus a ``manifest.json`` written last.

A shard stores ragged sequences flat. Per sequence: ``offsets`` (int64, n+1), ``prompt_index`` (int64),
``sample_index`` (int32), ``source`` (uint8: 0 target, 1 drafter, 2 dataset). Per token: ``input_ids`` (uint16
when the vocabulary fits, else int32) and ``loss_mask`` (uint8, 1 = a response token, i.e. a training label).
Teacher signals, each optional (see ``SIGNALS``), live on one of two axes:
- ``token``: one row per token of the sequence (hidden states: EAGLE-style drafters read every position);
- ``loss``: one row per loss token, in order (top-k log-probs, SpecDec++ labels).
fp8 hidden states carry a per-row float32 scale in ``<name>_scale``.

Shards are written to a temp name and renamed, so a killed run never leaves a partial shard that looks complete;
each shard also carries its own manifest entry in its metadata, so the manifest can be rebuilt from the shards.
Each shard stores the sha256 of its tensor data (metadata ``sha256``, copied into its manifest entry); reading a
shard through its manifest entry verifies it (``verify_shard``), and a resumed ``generate`` writes a shard that
fails it again. Metadata keys are written in sorted order, so clean runs give byte-identical shards.
Reading is lazy: a record's rows are sliced out of the memory-mapped file, never the whole shard.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError, disk_full
from draftsmith.integrity import data_start, open_safetensors, read_json, save_safetensors, verify_file

log = logging.getLogger("draftsmith.data")
REGENERATE = "; rerun `draftsmith generate` with the same recipe: it resumes and writes what is bad again"

FORMAT = "draftsmith-records/2"
SOURCES = {"target": 0, "drafter": 1, "dataset": 2}
# signal tensor -> axis. GROUPS names the unit a recipe turns on and bytes/token is reported for; per-sequence
# arrays (offsets, prompt_index, ...) count towards "tokens".
SIGNALS = {
    "topk_ids": "loss",
    "topk_logprobs": "loss",
    "hidden_last": "token",
    "hidden_last_scale": "token",
    "hidden_aux": "token",
    "hidden_aux_scale": "token",
    "spec_token": "loss",
    "spec_accept": "loss",
    "judge_label": "loss",
    "judge_base_ok": "loss",
    "judge_swap_ok": "loss",
}
GROUPS = {
    "tokens": ("input_ids", "loss_mask"),
    "topk": ("topk_ids", "topk_logprobs"),
    "hidden_last": ("hidden_last", "hidden_last_scale"),
    "hidden_aux": ("hidden_aux", "hidden_aux_scale"),
    "specdec": ("spec_token", "spec_accept"),
    "judge": ("judge_label", "judge_base_ok", "judge_swap_ok"),
}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class Record:
    input_ids: list[int] | torch.Tensor  # prompt + response tokens (T,)
    loss_mask: list[int] | torch.Tensor  # (T,) 1 where the token is a response token (a training label)
    prompt_index: int
    sample_index: int = 0
    source: int = 0  # SOURCES value
    signals: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (T, ...) or (n_loss, ...)


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (fp8 values (..., D), float32 scale (...,)): one absmax scale per row."""
    scale = (x.float().abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    return (x.float() / scale[..., None]).to(FP8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None].float()


def _id_dtype(ids: torch.Tensor) -> torch.dtype:
    return torch.uint16 if ids.numel() == 0 or int(ids.max()) < 65536 else torch.int32


def write_shard(path: Path, records: list[Record], meta: dict[str, str], counts: dict | None = None) -> dict:
    """Write records to ``path`` atomically; returns the shard's manifest entry (also stored in its metadata).
    ``counts``: extra per-shard tallies kept in the entry (the manifest sums them across shards and ranks)."""
    for r in records:
        if len(r.loss_mask) and r.loss_mask[0]:
            raise ValueError("the first token of a record cannot be a loss token (nothing predicts it)")
    ids = torch.cat([torch.as_tensor(r.input_ids, dtype=torch.int64) for r in records] or [torch.zeros(0)]).long()
    mask = torch.cat([torch.as_tensor(r.loss_mask, dtype=torch.uint8) for r in records] or [torch.zeros(0)]).to(
        torch.uint8
    )
    lengths = torch.tensor([len(r.input_ids) for r in records], dtype=torch.int64)
    tensors = {
        "input_ids": ids.to(_id_dtype(ids)),
        "loss_mask": mask,
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "prompt_index": torch.tensor([r.prompt_index for r in records], dtype=torch.int64),
        "sample_index": torch.tensor([r.sample_index for r in records], dtype=torch.int32),
        "source": torch.tensor([r.source for r in records], dtype=torch.uint8),
    }
    for name in sorted(records[0].signals) if records else []:
        if name not in SIGNALS:
            raise ValueError(f"unknown signal {name!r}")
        rows = torch.cat([r.signals[name] for r in records])
        for r in records:  # each row set must match its axis: a misaligned signal would train on wrong targets
            want = len(r.input_ids) if SIGNALS[name] == "token" else int(torch.as_tensor(r.loss_mask).sum())
            if len(r.signals[name]) != want:
                raise ValueError(f"signal {name}: {len(r.signals[name])} rows, expected {want} ({SIGNALS[name]})")
        tensors[name] = rows.to(_id_dtype(rows)) if name in ("topk_ids", "spec_token") else rows.contiguous()
    entry = {
        "file": path.name,
        "n_sequences": len(records),
        "n_tokens": int(len(ids)),
        "n_loss_tokens": int(mask.sum()),
        "tensor_bytes": {k: v.nbytes for k, v in tensors.items()},
        "counts": counts or {},
    }
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    digest = save_safetensors(tensors, tmp, {"format": FORMAT, **meta, "entry": json.dumps(entry)}, data_sha256=True)
    os.replace(tmp, path)
    entry["bytes"], entry["sha256"] = path.stat().st_size, digest
    return entry


class ShardWriter:
    """Writes finished shards from a background thread while the next ones are generated.

    ``write(path, records, meta, counts) -> entry`` does the writing (``write_shard``: temp name, then rename, so a
    kill at any moment leaves either a complete shard or a ``.tmp`` file that is never read); ``on_written(path,
    entry)`` runs after each. At most ``queue_size`` shards wait; ``submit`` blocks while the queue is full, so
    memory stays bounded. 0: no thread, ``submit`` writes at once. The writer's first error stops it (later shards
    are not written: a rerun resumes and generates them again) and is raised in the caller's thread at its next
    ``submit`` or at ``close``: a one-line ``DraftsmithError`` naming the shard (a full disk and an interrupt are
    raised as they are, for the command's own handlers)."""

    def __init__(self, write, queue_size: int, on_written=None):
        self.write, self.on_written = write, on_written
        self.error: BaseException | None = None
        self.failed: Path | None = None
        self.thread = None
        if queue_size > 0:
            self.q: queue.Queue = queue.Queue(maxsize=queue_size)
            self.thread = threading.Thread(target=self._loop, name="draftsmith-shard-writer", daemon=True)
            self.thread.start()

    def _write(self, path: Path, args: tuple) -> None:
        try:
            entry = self.write(path, *args)
            if self.on_written is not None:
                self.on_written(path, entry)
        except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
            self.error, self.failed = e, path

    def _loop(self) -> None:
        while (item := self.q.get()) is not None:
            if self.error is None:
                self._write(*item)

    def check(self) -> None:
        """Raise the writer's error, if any, in the calling thread."""
        e = self.error
        if e is None:
            return
        if isinstance(e, (KeyboardInterrupt, DraftsmithError)) or disk_full(e):
            raise e
        first = (str(e).splitlines() or [""])[0]
        raise DraftsmithError(
            f"{self.failed}: writing the shard failed ({type(e).__name__}: {first}); the shards written before it "
            f"are kept, rerun the same command to resume"
        ) from None

    def submit(self, path: Path, records: list[Record], meta: dict, counts: dict) -> None:
        self.check()
        if self.thread is None:
            self._write(path, (records, meta, counts))
            return self.check()
        while True:  # a writer that failed takes nothing more: do not wait on its full queue
            try:
                return self.q.put((path, (records, meta, counts)), timeout=0.2)
            except queue.Full:
                self.check()

    def close(self) -> None:
        """Wait until every submitted shard is written; raise the writer's error, if any."""
        if self.thread is not None:
            self.q.put(None)
            self.thread.join()
        self.check()

    def abort(self) -> None:
        """The caller failed: finish the shard being written (it is complete, or a temp file), drop the rest."""
        if self.thread is None:
            return
        while True:
            try:
                self.q.get_nowait()
            except queue.Empty:
                break
        self.q.put(None)
        self.thread.join()


def shard_done(path: Path, data_hash: str, span: str | None = None, legacy_hash: str | None = None) -> bool:
    """Whether a shard of this data recipe is already written (resume); a shard of another recipe is an error.

    span: the prompt range "start:end" the shard must cover. A shard of this recipe over another range (the short
    last shard of a run with a smaller ``prompts.n``) is not done: it is rewritten. legacy_hash: the recipe's hash
    as written before spans were recorded; such a shard counts as done as it is."""
    if not path.exists():
        return False
    try:
        meta = read_shard_meta(path)
    except DraftsmithError as e:  # a damaged header: written again
        log.warning("%s; writing it again", e)
        return False
    if legacy_hash is not None and meta.get("data_hash") == legacy_hash:
        return True
    if meta.get("data_hash") != data_hash:
        raise DraftsmithError(
            f"{path} was written by a different recipe (data hash differs): use a new out_dir or delete {path.parent}"
        )
    if span is not None and meta.get("prompt_span") != span:
        return False
    try:
        verify_file(path, meta.get("sha256"), data_start(path))
    except DraftsmithError as e:
        log.warning("%s; writing it again", e)
        return False
    return True


def read_shard_meta(path: Path, hint: str = "") -> dict[str, str]:
    with open_safetensors(path, hint) as fh:
        return fh.metadata() or {}


def shard_entry(path: Path) -> dict:
    """The manifest entry a finished shard carries in its metadata, with its size and data checksum."""
    meta = read_shard_meta(path)
    entry = json.loads(meta["entry"])
    entry["bytes"] = path.stat().st_size
    if "sha256" in meta:  # shards written before checksums have none
        entry["sha256"] = meta["sha256"]
    return entry


def check_shard_size(path: Path, entry: dict) -> None:
    """The cheap check: the shard exists and has the size its manifest entry records (not truncated)."""
    if not path.is_file():
        raise DraftsmithError(f"{path}: missing{REGENERATE}")
    if "bytes" in entry and path.stat().st_size != entry["bytes"]:
        raise DraftsmithError(
            f"{path}: {path.stat().st_size} bytes, manifest.json says {entry['bytes']} (truncated?){REGENERATE}"
        )


def verify_shard(path: Path, entry: dict) -> None:
    """A shard against its manifest entry: size, a readable header and the sha256 of its tensor data (when the
    entry has one). One-line DraftsmithError naming the shard otherwise."""
    check_shard_size(path, entry)
    open_safetensors(path, REGENERATE).__exit__(None, None, None)
    if entry.get("sha256"):
        verify_file(path, entry["sha256"], data_start(path), REGENERATE)


class Shard:
    """A shard opened for lazy reading: small per-sequence arrays in memory, signals sliced on demand."""

    def __init__(self, path: Path, signals: set[str] | None = None, entry: dict | None = None):
        self.path = Path(path)
        if entry is not None:
            verify_shard(self.path, entry)
        self._fh = open_safetensors(path, REGENERATE)  # memory-mapped; slices read only what they cover
        keys = set(self._fh.keys())
        self.signals = sorted(k for k in keys if k in SIGNALS and (signals is None or _group(k) in signals))
        self.offsets = self._fh.get_tensor("offsets")
        self.loss_mask = self._fh.get_tensor("loss_mask")
        csum = torch.cat([torch.zeros(1, dtype=torch.int64), self.loss_mask.long().cumsum(0)])
        self.loss_offsets = csum[self.offsets]  # loss-row offset of each sequence
        self.prompt_index = self._fh.get_tensor("prompt_index")
        self.sample_index = self._fh.get_tensor("sample_index")
        self.source = self._fh.get_tensor("source")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def keys(self) -> list[str]:
        return sorted(self._fh.keys())

    def tensor(self, name: str) -> torch.Tensor:
        return self._fh.get_tensor(name)

    def record(self, i: int) -> Record:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        la, lb = int(self.loss_offsets[i]), int(self.loss_offsets[i + 1])
        raw = {
            n: self._fh.get_slice(n)[(a if SIGNALS[n] == "token" else la) : (b if SIGNALS[n] == "token" else lb)]
            for n in self.signals
        }
        sig = {}
        for n, t in raw.items():
            if n.endswith("_scale"):
                continue
            if t.dtype == FP8:
                t = dequantize_fp8(t, raw[n + "_scale"])
            elif n in ("topk_ids", "spec_token"):
                t = t.long()
            elif t.is_floating_point():
                t = t.float()
            sig[n] = t
        return Record(
            self._fh.get_slice("input_ids")[a:b].long(),
            self.loss_mask[a:b].bool(),
            int(self.prompt_index[i]),
            int(self.sample_index[i]),
            int(self.source[i]),
            sig,
        )


def _group(name: str) -> str:
    return next((g for g, names in GROUPS.items() if name in names), "tokens")


def load_shard(path: Path, signals: set[str] | None = None, entry: dict | None = None) -> Shard:
    """Open a shard; ``signals``: the signal groups to read (None = all), e.g. {"topk"}. ``entry``: its manifest
    entry, to verify the shard against first (``verify_shard``)."""
    return Shard(path, signals, entry)


def bytes_per_token(entries: list[dict]) -> dict:
    """Stored bytes per token and per loss token, for each signal group present (tensor payload, exact)."""
    n_tok = sum(e["n_tokens"] for e in entries) or 1
    n_loss = sum(e["n_loss_tokens"] for e in entries) or 1
    per_group: dict[str, int] = {}
    for e in entries:
        for name, nb in e["tensor_bytes"].items():
            per_group[_group(name)] = per_group.get(_group(name), 0) + nb
    total = sum(e["bytes"] for e in entries)
    return {
        "per_token": {g: round(b / n_tok, 2) for g, b in per_group.items()},
        "per_loss_token": {g: round(b / n_loss, 2) for g, b in per_group.items()},
        "file_per_token": round(total / n_tok, 2),
        "file_per_loss_token": round(total / n_loss, 2),
    }


def read_manifest(data_dir: Path) -> dict:
    m = Path(data_dir) / "manifest.json"
    if not m.is_file():
        raise DraftsmithError(f"{data_dir}: no manifest.json (run `draftsmith generate` first, or it was interrupted)")
    manifest = read_json(m, REGENERATE)
    if manifest.get("format") != FORMAT:
        raise DraftsmithError(
            f"{m}: unsupported records format {manifest.get('format')!r} (expected {FORMAT}; regenerate the data)"
        )
    if not isinstance(manifest.get("shards"), list) or not all(
        isinstance(e, dict) and isinstance(e.get("file"), str) for e in manifest["shards"]
    ):
        raise DraftsmithError(f"{m}: no list of shard entries{REGENERATE}")
    seen = set()
    for e in manifest["shards"]:  # plain file names inside the data folder, each once
        name = e["file"]
        if name != Path(name).name or name in ("", ".", ".."):
            raise DraftsmithError(f"{m}: shard entry {name!r} is not a file name inside {data_dir}{REGENERATE}")
        if name in seen:
            raise DraftsmithError(f"{m}: shard {name!r} is listed twice{REGENERATE}")
        seen.add(name)
    return manifest


def write_json_atomic(path: Path, obj) -> None:
    """A JSON file that is either the old one or the whole new one, never half-written (tmp + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def write_manifest(data_dir: Path, manifest: dict) -> None:
    write_json_atomic(Path(data_dir) / "manifest.json", manifest)
