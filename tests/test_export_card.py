"""Export metadata: which target an export names (packaged alias, local folder with or without a hub id), that no
local path reaches a pushed config or card, the card's front matter (base_model, license, library_name) and serve
commands, and the hub repo id check before anything is written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import drafter_kinds, small_section

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.export import formats
from draftsmith.export.writer import export, model_card, push_to_hub
from draftsmith.models.loading import load_model
from draftsmith.models.registry import build_drafter, drafter_spec, save_drafter

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FIELDS = {"pard": {"mask_token": 0}}  # PARD's mask a reserved id of the target, as vLLM's layout needs


def build(kind: str, target):
    """A drafter of ``kind`` from its small section (conftest), as every test here exports it."""
    return build_drafter(kind, small_section(kind, **FIELDS.get(kind, {})), target)


def _exportable(kind: str) -> list[str]:
    info = {"kind": kind, "config": small_section(kind, **FIELDS.get(kind, {})).model_dump()}
    entries = drafter_spec(kind).export_formats(info)
    return [f for f, e in entries.items() if not e["write"].startswith("refused: ")]


# Every kind in every format it writes: each names its target where its engine reads it, or nowhere.
CASES = [(kind, fmt) for kind in drafter_kinds(role="drafter") for fmt in _exportable(kind)]


def _named(conf: dict, card: str, hub: str = SMOL) -> str | None:
    """The target's hub id where an engine (or the hub, through the card) reads it: ``hub`` when config.json
    carries it, else the card's base_model, else None."""
    m = re.search(r"^base_model: (\S+)$", card, re.M)
    return hub if hub in json.dumps(conf) else (m and m.group(1))


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def _texts(folder: Path) -> str:
    return "\n".join(p.read_text() for p in folder.iterdir() if p.suffix in (".json", ".md", ".yaml"))


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(str(tiny_model_dir)).model


@pytest.fixture(scope="module")
def local_target(tmp_path_factory, tiny_tokenizer):
    """A local target folder whose README declares a licence (as a hub download's does)."""
    from conftest import save_tiny_llama

    d = save_tiny_llama(tmp_path_factory.mktemp("local") / "my-llama", tiny_tokenizer)
    (d / "README.md").write_text("---\nlicense: mit\nlanguage: [en]\n---\n# my llama\n")
    return d


def _ckpt(root: Path, kind: str, model, target_name: str) -> Path:
    torch.manual_seed(0)
    return save_drafter(
        root / kind / "checkpoints" / "final", model, kind, {"target": target_name, "recipe": "r", "step": 1}
    )


@pytest.mark.parametrize("kind,fmt", CASES)
def test_packaged_alias_names_its_hub_id_and_licence(tmp_path, monkeypatch, target, tiny_model_dir, kind, fmt):
    """The packaged alias is a de-quantised GGUF in a local cache: engines and the card get its hub id."""
    monkeypatch.setattr("draftsmith.export.writer.resolve_model_path", lambda name, *a: tiny_model_dir)
    ckpt = _ckpt(tmp_path, kind, build(kind, target), "smollm2-135m-instruct")
    out = export(ckpt, fmt, tmp_path / "out")
    card = (out / "README.md").read_text()
    assert _named(json.loads((out / "config.json").read_text()), card) == SMOL
    fm = _front_matter(card)
    assert fm["base_model"] == SMOL and fm["license"] == "apache-2.0"
    plain = formats.export_entry({"kind": kind, "config": {}}, fmt).get("plain_lm", False)
    assert fm["library_name"] == ("transformers" if plain else "draftsmith")
    assert "Q4_1" in card  # says the drafter was trained on the packaged quantisation
    assert str(tiny_model_dir) not in _texts(out) and ".cache" not in _texts(out)
    push_to_hub(out, "me/drafter", dry_run=True)  # nothing local: the push is allowed


@pytest.mark.parametrize("kind,fmt", CASES)
def test_local_target_without_hub_id_writes_no_path(tmp_path, target, local_target, kind, fmt):
    ckpt = _ckpt(tmp_path, kind, build(kind, target), str(local_target))
    out = export(ckpt, fmt, tmp_path / "out")
    card = (out / "README.md").read_text()
    assert _named(json.loads((out / "config.json").read_text()), card) is None
    fm = _front_matter(card)
    assert "base_model" not in fm and fm["license"] == "mit"  # the licence from the folder's README
    assert "target.hub_id" in card  # says how to name the target
    assert str(local_target) not in _texts(out)
    push_to_hub(out, "me/drafter", dry_run=True)


def test_local_target_card_prints_the_command_that_works(tmp_path, target, local_target):
    """vLLM's `vllm serve ./folder` swaps in the verifier named in the config: with no hub id the card gives the
    explicit form, with the target named on the command line and the drafter in --speculative-config."""
    ckpt = _ckpt(tmp_path, "eagle", build("eagle", target), str(local_target))
    out = export(ckpt, "vllm", tmp_path / "v")
    card, conf = (out / "README.md").read_text(), json.loads((out / "config.json").read_text())
    n = conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    cmd = (
        "vllm serve TARGET --speculative-config "
        f'\'{{"model": "./this-folder", "method": "eagle3", "num_speculative_tokens": {n}}}\''
    )
    assert cmd in card and "vllm serve ./this-folder`" not in card
    sg = (export(ckpt, "sglang", tmp_path / "s") / "README.md").read_text()
    assert "--model TARGET --speculative-algorithm EAGLE3 --speculative-draft-model-path ./this-folder" in sg


def test_recipe_hub_id_names_a_local_target(tmp_path, target, local_target, prompts_file):
    from draftsmith.recipes.loader import load_recipe

    ckpt = _ckpt(tmp_path, "eagle", build("eagle", target), str(local_target))
    (ckpt / "recipe.yaml").write_text(f"name: r\ntarget:\n  model: {local_target}\n  hub_id: me/my-llama\n")
    recipe = load_recipe(
        "tiny",
        [
            f"target.model={local_target}",
            "target.hub_id=me/my-llama",
            f"eval.checkpoint={ckpt}",
            f"out_dir={tmp_path / 'run'}",
            f"data.prompts.path={prompts_file}",
            f"eval.prompts.path={prompts_file}",
        ],
    )
    for fmt in ("vllm", "sglang"):
        out = export(ckpt, fmt, tmp_path / fmt, recipe)
        assert _named(json.loads((out / "config.json").read_text()), "", "me/my-llama") == "me/my-llama"
        card = (out / "README.md").read_text()
        assert _front_matter(card)["base_model"] == "me/my-llama" and "me/my-llama" in formats.usage(
            fmt, {"kind": "eagle"}, "me/my-llama"
        )
        assert str(local_target) not in _texts(out)  # recipe.yaml's target.model included
        assert yaml.safe_load((out / "recipe.yaml").read_text())["target"]["model"] == "me/my-llama"
    # a checkpoint folder exported without its recipe reads target.hub_id from its own recipe.yaml
    out = export(ckpt, "vllm", tmp_path / "bare")
    assert _named(json.loads((out / "config.json").read_text()), "", "me/my-llama") == "me/my-llama"
    with pytest.raises(Exception, match="target.hub_id"):
        load_recipe("tiny", ["target.hub_id=/home/me/model"])


def test_a_push_carrying_a_local_path_is_refused(tmp_path, target, tiny_model_dir):
    out = export(_ckpt(tmp_path, "medusa", build("medusa", target), str(tiny_model_dir)), "medusa", tmp_path / "m")
    conf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**conf, "base_model_name_or_path": str(tiny_model_dir)}))
    with pytest.raises(DraftsmithError) as e:
        push_to_hub(out, "me/medusa", dry_run=True)
    msg = str(e.value)
    assert "\n" not in msg and "config.json" in msg and "base_model_name_or_path" in msg and "local path" in msg


def test_medusa_card_says_which_loaders_read_safetensors():
    text = formats.usage("medusa", {"kind": "medusa"}, "org/m")
    assert "medusa_lm_head.pt" in text and "FasterDecoding" in text and "TGI" in text and "TensorRT-LLM" in text
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_bytes()
    assert b"medusa_lm_head.pt" in readme and len(readme) <= 15_000


@pytest.mark.parametrize("kind,fmt", CASES)
def test_card_front_matter_is_yaml_with_hub_fields(fmt, kind):
    fm = _front_matter(model_card({"kind": kind, "target": "org/m", "recipe": "r"}, fmt, None))
    assert fm["base_model"] == "org/m" and "license" not in fm  # a hub target's licence is not known offline
    plain = formats.export_entry({"kind": kind, "config": {}}, fmt).get("plain_lm", False)
    assert fm["library_name"] == ("transformers" if plain else "draftsmith")
    assert isinstance(fm["tags"], list)
    fm = _front_matter(model_card({"kind": kind, "target": "./some/folder", "recipe": "r"}, fmt, None))
    assert "base_model" not in fm  # never a path, never a comment line


@pytest.mark.parametrize("repo", ["not a repo", "a/b/c", "../x", "/abs/path", "me/x--y"])
def test_push_to_hub_repo_id_is_checked_before_anything(tmp_path, monkeypatch, capsys, target, tiny_model_dir, repo):
    class NoNetwork:
        def __init__(self, *a, **k):
            raise AssertionError("network touched")

    monkeypatch.setattr("huggingface_hub.HfApi", NoNetwork)
    ckpt = _ckpt(tmp_path, "medusa", build("medusa", target), str(tiny_model_dir))
    out = tmp_path / "m"
    assert main(["export", str(ckpt), "--format", "medusa", "--out", str(out), "--push-to-hub", repo]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--push-to-hub" in err and repr(repo) in err
    assert not out.exists()


def test_recipe_push_to_hub_is_checked_at_load(tmp_path, capsys, tiny_overrides):
    assert main(["run", "tiny", *tiny_overrides, "export.push_to_hub=not a repo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "export.push_to_hub" in err
    assert not (tmp_path / "run" / "data").exists()
