"""The hub prompt source on a local `datasets` folder (offline): subsets, column mapping, streaming, one-line
errors, and the recipe keys that reach it (data.prompts.subset / columns / streaming)."""

from __future__ import annotations

import json

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.eval.prompts import load_prompts
from draftsmith.recipes.loader import load_recipe

README = """---
configs:
- config_name: chat
  default: true
  data_files:
  - split: train
    path: chat/*.jsonl
- config_name: sharegpt
  data_files:
  - split: train
    path: sharegpt/*.jsonl
---
"""


@pytest.fixture
def hub_folder(tmp_path, monkeypatch):
    """A dataset folder with two subsets: `chat` (default; role/content messages in a `dialog` column, `topic`,
    `uid`, and a `messages` column the mapping must override) and `sharegpt` (a `conversations` column)."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    root = tmp_path / "ds"
    (root / "chat").mkdir(parents=True)
    (root / "sharegpt").mkdir()
    (root / "README.md").write_text(README)
    chat = [
        {
            "uid": f"u{i}",
            "topic": "math" if i % 2 else "writing",
            "dialog": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}],
            "messages": [{"role": "user", "content": "not this one"}],
        }
        for i in range(7)
    ]
    chat[2]["dialog"][0]["content"] = " "  # unusable: skipped, so n counts usable prompts, not rows
    sharegpt = [{"conversations": [{"from": "human", "value": f"hello {i}"}]} for i in range(5)]
    (root / "chat" / "part-0.jsonl").write_text("\n".join(json.dumps(r) for r in chat) + "\n")
    (root / "sharegpt" / "part-0.jsonl").write_text("\n".join(json.dumps(r) for r in sharegpt) + "\n")
    return str(root)


def view(prompts):
    return [(p.id, p.category, p.messages) for p in prompts]


def test_subset_choice(hub_folder):
    sg = load_prompts("hub", hub_folder, subset="sharegpt")
    assert [p.id for p in sg] == [f"hub:{i}" for i in range(5)]
    assert [p.messages[0]["content"] for p in sg] == [f"hello {i}" for i in range(5)]
    # No subset: the folder's default (chat), read as it is: its own `messages` column
    assert {p.messages[0]["content"] for p in load_prompts("hub", hub_folder)} == {"not this one"}


def test_column_mapping(hub_folder):
    cols = {"messages": "dialog", "category": "topic", "id": "uid"}
    prompts = load_prompts("hub", hub_folder, subset="chat", columns=cols, max_turns=1)
    assert [p.id for p in prompts] == ["hub:u0", "hub:u1", "hub:u3", "hub:u4", "hub:u5", "hub:u6"]
    assert prompts[1].category == "math" and prompts[0].category == "writing"
    assert prompts[0].messages == [
        {"role": "user", "content": "question 0"},
        {"role": "assistant", "content": "answer 0"},
    ]


@pytest.mark.parametrize("subset, cols", [("chat", {"messages": "dialog"}), ("sharegpt", {})])
def test_streaming_gives_the_same_first_prompts(hub_folder, subset, cols):
    for n in (1, 3, 4):
        streamed = load_prompts("hub", hub_folder, n, subset=subset, columns=cols, streaming=True)
        assert len(streamed) == n
        assert view(streamed) == view(load_prompts("hub", hub_folder, n, subset=subset, columns=cols))
    every = load_prompts("hub", hub_folder, subset=subset, columns=cols, streaming=True)
    assert view(every) == view(load_prompts("hub", hub_folder, subset=subset, columns=cols))
    with pytest.raises(DraftsmithError, match="streaming.*shuffle"):
        load_prompts("hub", hub_folder, 2, subset=subset, streaming=True, shuffle=True)


@pytest.mark.parametrize("streaming", [False, True])
def test_missing_column_and_unknown_subset_are_one_line_errors(hub_folder, streaming):
    with pytest.raises(DraftsmithError) as e:
        load_prompts("hub", hub_folder, subset="chat", columns={"messages": "chat"}, streaming=streaming)
    msg = str(e.value)
    assert "\n" not in msg and "prompts.columns.messages: no column 'chat'" in msg
    assert "dialog" in msg and "subset 'chat'" in msg  # names the columns it has, and where
    with pytest.raises(DraftsmithError) as e:
        load_prompts("hub", hub_folder, subset="nope", streaming=streaming)
    msg = str(e.value)
    assert "\n" not in msg and "subset 'nope'" in msg and "'chat'" in msg and "'sharegpt'" in msg


def hub_recipe(folder, *extra):
    base = ["data.prompts.source=hub", f"data.prompts.path={folder}", "data.prompts.shuffle=false"]
    return load_recipe("quickstart", [*base, *extra])


def test_recipe_keys_are_checked(hub_folder):
    r = hub_recipe(
        hub_folder, "data.prompts.subset=chat", "data.prompts.columns={messages: dialog}", "data.prompts.streaming=true"
    )
    pc = r.data.prompts
    assert (pc.subset, pc.columns, pc.streaming) == ("chat", {"messages": "dialog"}, True)
    bad = [
        (["data.prompts.columns={prompt: dialog}"], "data.prompts.columns"),
        (["data.prompts.streaming=true", "data.prompts.shuffle=true"], "streaming.*shuffle"),
        (["data.prompts.source=sharegpt", "data.prompts.subset=chat"], "subset.*source=hub"),
        (["data.prompts.source=file", "data.prompts.columns={text: body}"], "columns.*source=hub"),
        (["eval.prompts.streaming=true"], "streaming.*source=hub"),
    ]
    for overrides, match in bad:
        with pytest.raises(DraftsmithError, match=match) as e:
            hub_recipe(hub_folder, *overrides)
        assert "\n" not in str(e.value)


def test_streaming_leaves_the_data_hash_and_subset_columns_change_it(hub_folder):
    from draftsmith.data.generate import data_hash

    plain = data_hash(hub_recipe(hub_folder))
    assert data_hash(hub_recipe(hub_folder, "data.prompts.streaming=true")) == plain
    assert data_hash(hub_recipe(hub_folder, "data.prompts.subset=chat")) != plain
    assert data_hash(hub_recipe(hub_folder, "data.prompts.columns={messages: dialog}")) != plain


def test_generate_reads_a_hub_subset_by_streaming(hub_folder, tiny_overrides, tmp_path):
    """The recipe keys reach the data stage: 3 prompts streamed from the chat subset's dialog column."""
    from draftsmith.cli import main
    from draftsmith.data.records import read_manifest

    args = [
        *tiny_overrides,
        "data.prompts.source=hub",
        f"data.prompts.path={hub_folder}",
        "data.prompts.subset=chat",
        "data.prompts.columns={messages: dialog}",
        "data.prompts.streaming=true",
        "data.prompts.n=3",
        "-q",
    ]
    assert main(["generate", "tiny", *args]) == 0
    assert read_manifest(tmp_path / "run" / "data")["n_sequences"] == 3
