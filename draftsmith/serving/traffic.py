"""Recorded serving traffic for online distillation (docs/algorithms.md A9): a bounded, crash-safe journal.

Each finished request is one JSON line (prompt and response token ids, the drafter version that served it and
its acceptance counts) appended to the newest segment file and fsync'd before the request is acknowledged as
recorded, so a kill loses nothing that was recorded. A line cut by a kill is incomplete JSON and is skipped on
read. Segments roll over every ``segment_records`` lines; the oldest segments are deleted once more than
``max_records`` lines are kept, which bounds disk and the learner's window. Records carry a global sequence
number so readers (the learner) resume from a cursor.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path


class TrafficBuffer:
    def __init__(self, folder: Path, max_records: int = 2000, segment_records: int = 256):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_records, self.segment_records = max_records, segment_records
        self._lock = threading.Lock()
        self._next = self._last_seq() + 1

    def _segments(self) -> list[Path]:
        return sorted(self.dir.glob("segment-*.jsonl"))

    @staticmethod
    def _lines(path: Path) -> list[dict]:
        out = []
        with open(path, "rb") as f:
            for raw in f:
                try:
                    out.append(json.loads(raw))
                except ValueError:  # the tail a kill cut short: never acknowledged, skipped
                    continue
        return out

    def _last_seq(self) -> int:
        for seg in reversed(self._segments()):
            recs = self._lines(seg)
            if recs:
                return recs[-1]["seq"]
        return -1

    def append(self, record: dict) -> int:
        """Durably append one record; returns its sequence number."""
        with self._lock:
            segs = self._segments()
            if not segs or len(self._lines(segs[-1])) >= self.segment_records:
                segs.append(self.dir / f"segment-{self._next:09d}.jsonl")
            rec = {"seq": self._next, "time": time.time(), **record}
            with open(segs[-1], "ab+") as f:
                f.seek(0, os.SEEK_END)
                if f.tell():  # a line a kill cut short must not swallow this record: end it first
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
                f.write((json.dumps(rec, separators=(",", ":")) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
            self._next += 1
            self._trim(segs)
            return rec["seq"]

    def _trim(self, segs: list[Path]) -> None:
        total = sum(len(self._lines(s)) for s in segs)
        while len(segs) > 1 and total - len(self._lines(segs[0])) >= self.max_records:
            total -= len(self._lines(segs[0]))
            segs.pop(0).unlink()

    def read(self, since: int = -1) -> list[dict]:
        """Every kept record with seq > since, oldest first."""
        with self._lock:
            return [r for s in self._segments() for r in self._lines(s) if r["seq"] > since]

    def __len__(self) -> int:
        return len(self.read())
