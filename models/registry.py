"""Drafter plug-ins: ``DRAFTERS``, one ``DrafterSpec`` per kind (models/spec.py), plus save/load of drafter checkpoints.

Adding a drafter = a model file that ends with ``SPEC = DrafterSpec(...)`` (found by ``_kind_modules`` below) and,
if no existing objective fits, an objective in train/objectives.py (docs/adding-a-drafter.md). Code outside the
package (tests, experiments) may ``register_drafter`` a spec instead. The recipe schema's ``drafter`` union follows
this dict.
A checkpoint folder holds ``model.safetensors`` (drafter weights only) and ``drafter.json`` (kind, config, meta, and
``sha256``: the checksum of every tensor file in the folder, verified by every load; draftsmith/integrity.py).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.integrity import (
    checksums,
    config_digest,
    load_tensors,
    read_json,
    save_safetensors,
    verify_config,
    verify_file,
)
from draftsmith.models.llama import Llama
from draftsmith.models.medusa import ADAPTER_FILE, adapter_state
from draftsmith.models.spec import DrafterSpec, Strict


def _kind_modules() -> tuple:
    """Every module of this package that ends with ``SPEC = DrafterSpec(...)``, by file name: a kind is registered
    by writing its file, with no list to edit (the files are read, and only the kinds' modules imported)."""
    folder = Path(__file__).resolve().parent
    names = sorted(p.stem for p in folder.glob("*.py") if "\nSPEC = DrafterSpec(" in p.read_text(encoding="utf-8"))
    return tuple(importlib.import_module(f"draftsmith.models.{n}") for n in names)


KIND_MODULES = _kind_modules()
DRAFTERS: dict[str, DrafterSpec] = {m.SPEC.kind: m.SPEC for m in KIND_MODULES}
_listeners: list[Callable[[], None]] = []  # called after DRAFTERS changes (the recipe schema rebuilds its union)
log = logging.getLogger("draftsmith.checkpoint")


def register_drafter(spec: DrafterSpec) -> DrafterSpec:
    """Add a drafter kind from outside the package (a plug-in, a test); the recipe schema accepts it from now on.
    Undo with ``unregister_drafter(spec.kind)``."""
    if not isinstance(spec, DrafterSpec):
        raise TypeError(f"register_drafter takes a DrafterSpec, got {type(spec).__name__}")
    if spec.kind in DRAFTERS:
        raise DraftsmithError(f"drafter.kind {spec.kind!r} is already registered")
    DRAFTERS[spec.kind] = spec
    _changed()
    return spec


def unregister_drafter(kind: str) -> None:
    if DRAFTERS.pop(kind, None) is not None:
        _changed()


def on_change(fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever a kind is registered or unregistered."""
    _listeners.append(fn)


def _changed() -> None:
    for fn in _listeners:
        fn()


def drafter_spec(kind: str) -> DrafterSpec:
    if kind not in DRAFTERS:
        raise DraftsmithError(f"drafter.kind {kind!r} unknown (known: {', '.join(DRAFTERS)})")
    return DRAFTERS[kind]


def kinds(**fields) -> list[str]:
    """Registered kinds whose spec fields equal ``fields``, e.g. ``kinds(interface="heads")``."""
    return [k for k, s in DRAFTERS.items() if all(getattr(s, f) == v for f, v in fields.items())]


def build_drafter(kind: str, cfg: Strict | dict, target: Llama, **data) -> torch.nn.Module:
    """A fresh drafter of ``kind`` from its recipe section (or a dict of the section's fields, defaults filled in
    by the schema). data: optional keyword facts about the training data some builders use (counts = token
    frequencies of the responses, tokenizer, eos_ids)."""
    spec = drafter_spec(kind)
    return spec.build(spec.section(cfg), target, **data)


def checkpoint_tensors(model: torch.nn.Module, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint (or an export) holds: no excluded parts, no tied copy, contiguous, on CPU.
    ``state``: the model's full state dict when it had to be gathered first (FSDP2, train/state.py)."""
    skip = getattr(model, "checkpoint_exclude", ())
    sd = model.state_dict() if state is None else state
    sd = {k: v for k, v in sd.items() if not k.startswith(skip)} if skip else sd
    if getattr(model, "cfg", None) is not None and getattr(model.cfg, "tie_embeddings", False):
        sd.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage, and it is redundant
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}


def save_drafter(
    path: Path,
    model: torch.nn.Module,
    kind: str,
    meta: dict,
    extra=None,
    recipe_yaml: str | None = None,
    state: dict | None = None,
) -> Path:
    """Write atomically: a half-written checkpoint never sits under the final name. ``extra(folder)`` may add
    files (the training state) before the folder is renamed into place; drafter.json comes last and lists the
    sha256 of every tensor file, the training state's included. ``recipe_yaml``: the resolved recipe that
    trained it, kept with the weights as ``recipe.yaml`` (the run folder's copy is rewritten by every later
    command on that folder, e.g. an eval with other overrides). ``state``: see ``checkpoint_tensors``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_safetensors(checkpoint_tensors(model, state), tmp / "model.safetensors")
    if getattr(model, "base", None) is not None:  # Medusa-2: the target's LoRA adapters
        base = None if state is None else {k[5:]: v for k, v in state.items() if k.startswith("base.")}
        save_safetensors(adapter_state(model.base, base), tmp / ADAPTER_FILE)
    if recipe_yaml is not None:
        (tmp / "recipe.yaml").write_text(recipe_yaml)
    if extra is not None:
        extra(tmp)
    if (
        getattr(model, "draft_tokenizer", None) is not None
    ):  # a draft with its own vocabulary (train/own_vocab.py, eval/own_vocab.py)
        model.draft_tokenizer.save_pretrained(tmp / "tokenizer")
        meta = {**meta, "draft_tokenizer": "tokenizer"}
    config = model.cfg.to_dict()
    info = {"kind": kind, "config": config, "config_sha256": config_digest(config), **meta, "sha256": checksums(tmp)}
    (tmp / "drafter.json").write_text(json.dumps(info, indent=2))
    old = path.with_name(path.name + ".deleting")  # never a moment with a half-deleted folder under ``path``
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def read_checkpoint(path: Path, hint: str = "") -> dict:
    """A checkpoint folder's drafter.json, after checking every tensor file it lists against its checksum; any
    problem is a one-line DraftsmithError naming the file (``hint`` appended). A checkpoint written before
    checksums existed (no ``sha256``) is read with a warning, unverified."""
    path = Path(path)
    if not (path / "drafter.json").is_file():
        raise DraftsmithError(f"{path}: not a drafter checkpoint (no drafter.json){hint}")
    info = read_json(path / "drafter.json", hint)
    if not isinstance(info.get("kind"), str) or not isinstance(info.get("config"), dict):
        raise DraftsmithError(f"{path / 'drafter.json'}: no drafter kind and config{hint}")
    sums = info.get("sha256")
    if sums is None:
        log.warning("%s: no checksums in drafter.json (written before checkpoints had them); loaded unverified", path)
        sums = {}
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise DraftsmithError(f"{path / 'drafter.json'}: 'sha256' is not a {{file: checksum}} map{hint}")
    for name in sorted({"model.safetensors", *sums}):
        verify_file(path / Path(name).name, sums.get(name), hint=hint)
    verify_config(info, path / "drafter.json", hint)
    with torch.device("meta"):  # the config must describe a drafter (built without memory)
        _from_config(info, path, hint)
    return info


def load_weights_into(path: Path, model: torch.nn.Module, grow: bool = False, hint: str = "") -> None:
    """Resume: a checkpoint's weights into an already built drafter of the same shape. ``grow`` (a warm start,
    train.init_checkpoint): parts the model marks ``growable`` (an EAGLE's added blocks) may be missing and keep
    their initialisation. ``hint``: appended to every error (what the user can do about it)."""
    read_checkpoint(path, hint)
    sd = load_tensors(Path(path) / "model.safetensors", hint)
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # a shape differs
        raise DraftsmithError(f"{path}: checkpoint does not fit this recipe's drafter ({_first(e)}){hint}") from None
    skip = getattr(model, "checkpoint_exclude", ()) + (getattr(model, "growable", ()) if grow else ())
    missing = [m for m in missing if m != "lm_head.weight" and not (skip and m.startswith(skip))]
    if getattr(model, "base", None) is not None:
        from peft import set_peft_model_state_dict

        adapter = Path(path) / ADAPTER_FILE
        if not adapter.is_file():
            raise DraftsmithError(f"{path}: no {ADAPTER_FILE} for this Medusa-2 drafter{hint}")
        set_peft_model_state_dict(model.base, load_tensors(adapter, hint))
    if missing or unexpected:
        raise DraftsmithError(
            f"{path}: checkpoint does not fit this recipe's drafter (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}); change the recipe back or set train.resume=false"
        )


def _from_config(info: dict, path: Path, hint: str = "") -> torch.nn.Module:
    """The (untrained) drafter drafter.json describes; an unknown kind or a bad config is a one-line error."""
    kind = info.get("kind")
    if kind not in DRAFTERS:
        raise DraftsmithError(f"{path / 'drafter.json'}: unknown drafter kind {kind!r}{hint}")
    try:
        return DRAFTERS[kind].from_config(info["config"])
    except (TypeError, KeyError, ValueError) as e:  # a field missing, unknown or invalid
        raise DraftsmithError(
            f"{path / 'drafter.json'}: config is not a {kind} drafter's ({_first(e)}){hint}"
        ) from None


def _first(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


def load_drafter(path: Path, dtype=torch.float32, device="cpu") -> tuple[torch.nn.Module, dict]:
    """A checkpoint folder's drafter, verified (``read_checkpoint``), and its drafter.json."""
    path = Path(path)
    info = read_checkpoint(path)
    model = drafter_from_state(info, load_tensors(path / "model.safetensors"), path)
    return model.to(device=device, dtype=dtype).eval(), info


def check_fits_target(path: Path, info: dict, tgt) -> None:
    """A drafter decodes for a target only if it was trained on that target's tokenizer and vocabulary: draft ids
    go to the target as they are. eval and serve both call this at start, before any prompt is decoded.
    ``info``: the drafter.json of the drafter that decodes; ``tgt``: the loaded target (models.loading)."""
    from draftsmith.models.loading import tokenizer_hash

    if info.get("tokenizer_hash") not in (None, tokenizer_hash(tgt.tokenizer)):
        raise DraftsmithError(f"{path}: drafter was trained with a different tokenizer than {tgt.name!r}")
    v_draft, v_target = info.get("config", {}).get("vocab_size"), tgt.model.cfg.vocab_size
    if v_draft is not None and v_draft != v_target:
        raise DraftsmithError(
            f"{path}: the drafter's vocabulary has {v_draft} tokens, target {tgt.name!r}'s has {v_target}: "
            f"it was trained for another target"
        )


def drafter_from_state(info: dict, sd: dict[str, torch.Tensor], path: Path) -> torch.nn.Module:
    """Rebuild the drafter drafter.json describes and load ``sd`` (our tensor names) into it, strictly; a Medusa-2
    folder's LoRA tensors are attached for the caller (eval) to merge into the target."""
    model = _from_config(info, path)
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # a shape differs
        raise DraftsmithError(f"{path}: weights do not match drafter.json ({_first(e)})") from None
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise DraftsmithError(
            f"{path}: weights do not match drafter.json (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if getattr(model.cfg, "tie_embeddings", False):
        model.lm_head.weight = model.embed_tokens.weight
    if (path / ADAPTER_FILE).is_file():  # Medusa-2: merged into the target by the caller (eval)
        model.target_adapter = load_tensors(path / ADAPTER_FILE)
    return model
