"""Every shipped recipe validates; strictness (unknown keys, types, ranges); overrides re-validate."""

from __future__ import annotations

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.recipes.loader import dump_recipe, load_recipe, shipped_recipes, validate


@pytest.mark.parametrize("name", shipped_recipes())
def test_shipped_recipes_validate(name):
    r = load_recipe(name)
    assert r.name and "train" in r.stages() and set(r.stages()) <= {"generate", "train", "eval", "export"}
    assert validate(__import__("yaml").safe_load(dump_recipe(r)), name) == r  # dump/load round-trips


def test_shipped_accelerate_configs_parse():
    import yaml

    from draftsmith.recipes.loader import RECIPE_DIR

    configs = {p.stem: yaml.safe_load(p.read_text()) for p in (RECIPE_DIR / "accelerate").glob("*.yaml")}
    assert {"ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"} <= set(configs)
    assert configs["fsdp2"]["fsdp_config"]["fsdp_version"] == 2
    assert [configs[f"deepspeed_zero{z}"]["deepspeed_config"]["zero_stage"] for z in (2, 3)] == [2, 3]


def test_shipped_names_and_paths_both_work():
    assert "quickstart" in shipped_recipes()
    from draftsmith.recipes.loader import RECIPE_DIR

    assert load_recipe(str(RECIPE_DIR / "quickstart.yaml")) == load_recipe("quickstart")


def test_overrides_are_typed_and_revalidated():
    r = load_recipe(
        "pard-smollm2",
        ["train.steps=7", "drafter.init_layers=[3, 4]", "eval.baseline_hf=false", "data.prompts.n=5", "out_dir=/tmp/x"],
    )
    assert r.train.steps == 7 and r.drafter.init_layers == [3, 4] and r.eval.baseline_hf is False
    assert r.data.prompts.n == 5 and str(r.run_dir) == "/tmp/x"
    with pytest.raises(DraftsmithError, match=r"train.steps: Input should be greater than 0"):
        load_recipe("quickstart", ["train.steps=0"])
    with pytest.raises(DraftsmithError, match=r"init_layers has 1 entries but n_layers is 2"):
        load_recipe("pard-smollm2", ["drafter.init_layers=[1]"])


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.stepz=3", "unknown key train.stepz"),
        ("drafter.n_layrs=3", "unknown key drafter.n_layrs"),
        ("data.prompts.colour=red", "unknown key data.prompts.colour"),
        ("train.lr=fast", "train.lr: Input should be a valid number"),
        ("eval.draft_len=99", "eval.draft_len: Input should be less than or equal to 32"),
        ("data.temperature=-1", "data.temperature: Input should be greater than or equal to 0"),
        ("drafter.kind=medusa9", "drafter: Input tag 'medusa9' found using 'kind' does not match"),
        ("data.prompts.source=file", "prompts.path is required"),
        ("train.steps", "expected dotted.key=value"),
        ("train.steps.x=1", "train.steps is not a section"),
        ("eval.stop.min_len=0", "eval.stop.min_len=0 needs rule=entropy"),
        ("train.loss.teacher_temperature=2", "train.loss.teacher_temperature: Input should be less than or equal to 1"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(DraftsmithError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_recipe("quickstart", [override])


def test_documented_precision_values_survive_yaml(tmp_path):
    """`no` is a YAML 1.1 boolean: as an override and in a recipe file it still means no mixed precision."""
    assert load_recipe("quickstart", ["train.precision=no"]).train.precision == "no"
    assert load_recipe("quickstart", ["train.precision=bf16"]).train.precision == "bf16"
    p = tmp_path / "r.yaml"
    dumped = dump_recipe(load_recipe("quickstart", ["train.precision=no"]))
    p.write_text(dumped.replace("precision: 'no'", "precision: no"))
    assert "precision: no\n" in p.read_text() and load_recipe(str(p)).train.precision == "no"
    with pytest.raises(DraftsmithError, match="train.precision"):
        load_recipe("quickstart", ["train.precision=yes"])


def test_auto_precision_picks_bf16_only_where_the_hardware_multiplies_it(monkeypatch):
    """train.precision=auto: bf16 on a CPU with AVX512-BF16 / AMX and on a bf16-capable GPU, fp32 elsewhere
    (emulated bf16 is several times slower than fp32); explicit values pass through."""
    from draftsmith import runtime

    for have, want in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(runtime, "cpu_has_bf16", lambda have=have: have)
        assert runtime.resolve_precision("auto", "cpu") == want
        assert runtime.resolve_precision("bf16", "cpu") == "bf16" and runtime.resolve_precision("no", "cpu") == "no"
    for have, want in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda have=have: have)
        assert runtime.resolve_precision("auto", "cuda:0") == want
    assert runtime.resolve_precision("auto", "mps") == "no"
    assert isinstance(runtime.cpu_has_bf16(), bool)
    assert load_recipe("quickstart").train.precision == "auto"


def test_medusa_layout_needs_full_vocabulary_heads():
    with pytest.raises(DraftsmithError, match="export.formats has medusa, but drafter.draft_vocab"):
        load_recipe("medusa-smollm2", ["export.formats=[hf,medusa]"])
    assert load_recipe("medusa-smollm2", ["export.formats=[hf,medusa]", "drafter.draft_vocab=null"])


def test_deeper_eagle_options_are_checked():
    r = load_recipe("eagle3-smollm2", ["drafter.n_layers=3", "drafter.init_layers=[27,28]", "export.formats=[hf]"])
    assert r.drafter.n_layers == 3 and r.drafter.init_layers == [27, 28]
    with pytest.raises(DraftsmithError, match=r"init_layers has 1 entries.*n_layers - 1 = 2"):
        load_recipe("eagle3-smollm2", ["drafter.n_layers=3", "drafter.init_layers=[27]", "export.formats=[hf]"])
    with pytest.raises(DraftsmithError, match="export.formats has sglang.*n_layers is 2"):
        load_recipe("eagle3-smollm2", ["drafter.n_layers=2", "export.formats=[hf,vllm,sglang]"])
    assert load_recipe("eagle3-smollm2", ["drafter.n_layers=2", "export.formats=[vllm]"]).drafter.n_layers == 2


def test_yaml_errors_name_the_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\ntrain:\n  steps: 3\n  lr: [1, 2\n")
    with pytest.raises(DraftsmithError, match=r"bad.yaml line \d+: YAML syntax error"):
        load_recipe(str(p))
    p.write_text("- a\n- b\n")
    with pytest.raises(DraftsmithError, match="must be a YAML mapping"):
        load_recipe(str(p))
    with pytest.raises(DraftsmithError, match="recipe not found: nope.yaml"):
        load_recipe("nope.yaml")


def test_a_recipe_path_that_is_no_file_says_what_it_is(tmp_path):
    import os

    (tmp_path / "dir.yaml").mkdir()
    os.mkfifo(tmp_path / "fifo.yaml")  # reading it would block until a writer comes
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    for name, what in (("dir.yaml", "a directory"), ("fifo.yaml", "not a regular file"), ("loop.yaml", "link")):
        with pytest.raises(DraftsmithError, match=f"recipe .*{name}: is .*{what}"):
            load_recipe(str(tmp_path / name))


def test_an_out_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(DraftsmithError, match="out_dir .*/f is not a folder"):
        load_recipe("tiny", [f"out_dir={tmp_path / 'f'}"])
    with pytest.raises(DraftsmithError, match="out_dir .*/f/run lies under .*/f, which is not a folder"):
        load_recipe("tiny", [f"out_dir={tmp_path / 'f' / 'run'}"])


def test_duplicate_keys_and_alias_bombs_are_one_line_errors(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text("name: a\ntrain:\n  steps: 3\nname: b\n")  # YAML itself would keep the last name silently
    with pytest.raises(DraftsmithError, match=r"dup.yaml line 4: YAML syntax error: duplicate key 'name'"):
        load_recipe(str(p))
    p.write_text("name: a\ntrain:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(DraftsmithError, match=r"line 4: .*duplicate key 'steps'"):
        load_recipe(str(p))
    levels = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\nname: *i\n")  # 9^9 strings once expanded
    with pytest.raises(DraftsmithError, match=r"bomb.yaml line \d+: YAML syntax error: more than 32 aliases"):
        load_recipe(str(bomb))
    ok = tmp_path / "ok.yaml"  # a few aliases and merge keys stay fine
    ok.write_text("base: &b {steps: 3}\nname: ok\ntrain:\n  <<: *b\n  lr: 0.001\n")
    with pytest.raises(DraftsmithError, match="base"):  # parsed; the schema then names the unknown key
        load_recipe(str(ok))


def test_recipe_reference_page_is_generated_from_the_schema_and_documents_every_key():
    """docs/recipes.md equals what the schema renders (regenerate it after a schema change, see
    recipes/reference.py), and every key of every section and drafter kind has its docstring."""
    from pathlib import Path

    from draftsmith.recipes.reference import render

    page = render()
    committed = (Path(__file__).resolve().parents[1] / "docs" / "recipes.md").read_text()
    assert committed == page, (
        'docs/recipes.md is out of date: run python -c "from draftsmith.recipes.reference import write; write()"'
    )
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    undocumented = [row.split("|")[1].strip() for row in rows if row.rstrip().endswith("|  |")]
    assert rows and not undocumented, undocumented
    from draftsmith.models.registry import DRAFTERS

    for kind in DRAFTERS:
        assert f"`drafter` with `kind: {kind}`" in page
