"""The drafter registry (models/registry.py): one DrafterSpec per kind, and everything that reads it agrees with it:
the recipe schema's drafter union, the objectives, the decoder attributes of each interface, drafter.json round
trips, FSDP's wrap classes. Every test runs over the registered kinds, so a new kind is checked by existing."""

from __future__ import annotations

from typing import get_args

import pytest
import torch
from conftest import drafter_kinds, small_section

from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import Llama, LlamaConfig
from draftsmith.models.registry import DRAFTERS, build_drafter, drafter_spec, load_drafter, save_drafter

CFG = LlamaConfig(vocab_size=96, dim=32, n_layers=6, n_heads=4, n_kv_heads=2, hidden_dim=64)
# What the decoder (eval/proposers.py) calls on a drafter of each interface.
PROTOCOL = {
    "tokens": ("new_cache",),
    "heads": ("reads_target_hidden", "max_draft_len", "draft_step", "logits_after", "new_context", "read_context"),
    "features": ("reads_target_features", "capture_layers", "features", "project", "step"),
    "block": ("drafts_block", "max_draft_len", "capture_layers", "features", "new_cache", "read_context", "block"),
}


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Llama(CFG).eval()


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory, target):
    """A draft LM checkpoint, for kinds that are built on one (the acceptance head)."""
    return save_drafter(
        tmp_path_factory.mktemp("draft") / "final", build_drafter("draft_lm", {"n_layers": 1}, target), "draft_lm", {}
    )


def _build(kind, target, draft_checkpoint, **fields):
    fields = {"draft": str(draft_checkpoint)} if kind == "acceptance_head" and not fields else fields
    torch.manual_seed(0)
    return build_drafter(kind, small_section(kind, **fields), target)


def test_registry_objectives_and_schema_name_the_same_kinds():
    from draftsmith.recipes.loader import validate
    from draftsmith.recipes.schema import Recipe
    from draftsmith.train.objectives import objective_for

    schema = {c.model_fields["kind"].default for c in get_args(Recipe.model_fields["drafter"].annotation)}
    objectives = {k for k in DRAFTERS if callable(objective_for(k))}
    assert schema == objectives == set(DRAFTERS) and len(DRAFTERS) >= 7
    for kind, spec in DRAFTERS.items():
        assert spec.kind == kind and spec.config.model_fields["kind"].default == kind
    with pytest.raises(
        DraftsmithError, match="does not match any of the expected tags: " + ", ".join(f"'{k}'" for k in DRAFTERS)
    ):
        validate({"name": "x", "drafter": {"kind": "nope"}}, "test")


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_each_kind_builds_to_its_interface_and_round_trips_through_drafter_json(
    kind, target, draft_checkpoint, tmp_path
):
    spec = drafter_spec(kind)
    model = _build(kind, target, draft_checkpoint)
    assert getattr(model, "reads_target_hidden", False) == (spec.interface == "heads")
    assert getattr(model, "reads_target_features", False) == (spec.interface == "features")
    assert spec.reads_features == (spec.interface in ("heads", "features"))
    missing = [a for a in PROTOCOL.get(spec.interface, ()) if not hasattr(model, a)]
    assert not missing, f"{kind} ({spec.interface}) lacks {missing}"
    assert isinstance(spec.signals_for(model), set) and isinstance(spec.needs_target_for(model), bool)
    ckpt = save_drafter(tmp_path / kind, model, kind, {"step": 1})
    loaded, info = load_drafter(ckpt)
    assert info["kind"] == kind and info["config"] == model.cfg.to_dict()
    want = model.state_dict()
    for k, v in loaded.state_dict().items():
        if k in want:
            torch.testing.assert_close(v, want[k], msg=k)


@pytest.mark.parametrize("kind", drafter_kinds(interface="heads") + drafter_kinds(interface="tokens"))
def test_builders_take_the_section_or_a_dict_of_its_fields(kind, target):
    """The schema is the one source of defaults: a dict is validated through the kind's section, so both build the
    same drafter; a bad field is one error naming it."""
    fields = small_section(kind).model_dump(exclude_defaults=True)
    torch.manual_seed(0)
    a = build_drafter(kind, fields, target)
    torch.manual_seed(0)
    b = build_drafter(kind, small_section(kind), target)
    assert a.cfg == b.cfg and all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    with pytest.raises(DraftsmithError, match="unknown key drafter.no_such_field"):
        build_drafter(kind, {**fields, "no_such_field": 1}, target)


def test_hydra_trains_with_the_schema_head_decay():
    """The recipe default every hydra run used (the schema's 1.0, equal head weights), now the only one."""
    assert small_section("hydra").head_decay == 1.0
    assert small_section("medusa").head_decay == small_section("mlp_speculator").head_decay == 0.8


@pytest.mark.parametrize(
    "kind,fields,wrapped",
    [
        ("draft_lm", {}, ["Block"]),
        ("medusa", {}, ["ResBlock"]),
        ("medusa", {"lora_r": 2}, ["ResBlock", "Block"]),  # Medusa-2: the adapted target's layers too
        ("hydra", {"prefix_attention": True}, ["WideResBlock", "Block"]),
        ("mlp_speculator", {}, []),
        ("eagle", {}, []),  # one layer: no block
        ("eagle", {"n_layers": 2}, ["Block"]),
        ("judge", {}, []),
    ],
)
def test_fsdp_wraps_each_kinds_own_blocks(kind, fields, wrapped, target, draft_checkpoint):
    """Under FSDP the loop hands accelerate the spec's wrap classes that the built drafter has (the shipped
    fsdp2.yaml names none); accelerate's own policy then finds every such module. (FSDP itself needs GPUs: a
    stand-in accelerator.)"""
    from types import SimpleNamespace

    import yaml
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from draftsmith.recipes.loader import RECIPE_DIR
    from draftsmith.train.loop import _fsdp_wrap, fsdp_wrap_names

    if kind == "medusa" and fields.get("lora_r"):
        pytest.importorskip("peft")
    model = _build(kind, target, draft_checkpoint, **fields)
    spec = drafter_spec(kind)
    assert fsdp_wrap_names(spec, model) == wrapped
    plugin = SimpleNamespace(transformer_cls_names_to_wrap=None, auto_wrap_policy=transformer_auto_wrap_policy)
    acc = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin))
    _fsdp_wrap(acc, spec, model)
    assert plugin.transformer_cls_names_to_wrap == wrapped
    try:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    except ImportError:  # an older accelerate: the names are all it reads
        return
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    units = {type(m).__name__ for m in model.modules() if policy(m)}
    assert units == set(wrapped)
    cfg = yaml.safe_load((RECIPE_DIR / "accelerate" / "fsdp2.yaml").read_text())["fsdp_config"]
    assert "fsdp_transformer_layer_cls_to_wrap" not in cfg and cfg["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"


def test_a_new_kind_is_one_file():
    """docs/adding-a-drafter.md: a kind is its models/<kind>.py. The registry finds every module there that ends
    with a SPEC, and no collection in the code or the tests lists every kind (such a list would need each new one)."""
    import ast
    from pathlib import Path

    from draftsmith.models.registry import KIND_MODULES

    root = Path(__file__).resolve().parents[1]
    files = {p.stem for p in (root / "models").glob("*.py") if "\nSPEC = DrafterSpec(" in p.read_text()}
    assert {m.__name__.rsplit(".", 1)[-1] for m in KIND_MODULES} == files
    kinds, full = set(DRAFTERS), []
    for folder in ("data", "eval", "train", "models", "recipes", "kernels", "draftsmith", "tests", "benchmarks"):
        for p in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
                elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
                if isinstance(node, ast.List | ast.Tuple | ast.Set | ast.Dict) and elts:
                    named = {e.value for e in elts if isinstance(e, ast.Constant) and e.value in kinds}
                    if named == kinds:
                        full.append(f"{p.relative_to(root)}:{node.lineno}")
    assert not full, full
    assert "one code file" in (root / "docs" / "adding-a-drafter.md").read_text()


def test_product_code_decides_by_no_kind_name():
    """Kinds keep their knowledge in their spec: outside a kind's own models/<kind>.py (and the registry), no
    product code compares a value with a registered kind's name or looks a kind up by a literal name, so a new
    kind is never missing from a branch. (Strings that only coincide with a kind's name, such as the "medusa"
    export format or vLLM's method "eagle", are not comparisons against a kind and are not counted.)"""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    own = {spec.kind: getattr(spec.build, "__module__", "").rsplit(".", 1)[-1] for spec in DRAFTERS.values()}
    lookups = {"drafter_spec", "kinds", "build_drafter", "objective_for"}
    bad = []
    for folder in ("data", "eval", "train", "models", "recipes", "kernels", "draftsmith"):
        for p in (root / folder).rglob("*.py"):
            if folder == "models" and p.stem in ("registry", *own.values()):
                continue
            for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
                operands = []
                if isinstance(node, ast.Compare):
                    operands = [node.left, *node.comparators]
                elif isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "DRAFTERS":
                    operands = [node.slice]
                elif (
                    isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in lookups
                ):
                    operands = [*node.args, *(k.value for k in node.keywords)]
                for op in operands:
                    for e in op.elts if isinstance(op, ast.Tuple | ast.List | ast.Set) else [op]:
                        if isinstance(e, ast.Constant) and e.value in own:
                            bad.append(f"{p.relative_to(root)}:{e.lineno} {e.value}")
    assert not bad, bad
