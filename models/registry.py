"""Drafter plug-ins: a dict literal from ``kind`` to its builder, plus save/load of drafter checkpoints.

Adding a drafter = a model file, a builder entry here, a schema section and an objective in train/.
A checkpoint folder holds ``model.safetensors`` (drafter weights only) and ``drafter.json`` (kind, config, meta).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.errors import DraftsmithError
from draftsmith.models.acceptance import AcceptanceConfig, AcceptanceHead, build_acceptance_head
from draftsmith.models.draft_lm import build_draft_lm
from draftsmith.models.eagle import build_eagle, eagle_from_config
from draftsmith.models.hydra import HydraConfig, HydraHeads, build_hydra
from draftsmith.models.judge import JudgeConfig, JudgeHead, build_judge
from draftsmith.models.llama import Llama, LlamaConfig
from draftsmith.models.medusa import ADAPTER_FILE, MedusaConfig, MedusaHeads, adapter_state, build_medusa
from draftsmith.models.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig, build_mlp_speculator

DRAFTERS = {
    "draft_lm": build_draft_lm,
    "medusa": build_medusa,
    "mlp_speculator": build_mlp_speculator,
    "hydra": build_hydra,
    "eagle": build_eagle,
    "acceptance_head": build_acceptance_head,
    "judge": build_judge,
}
# How to rebuild each kind from the config stored in drafter.json.
_FROM_CONFIG = {
    "draft_lm": lambda cfg: Llama(LlamaConfig(**cfg)),
    "medusa": lambda cfg: MedusaHeads(MedusaConfig(**cfg)),
    "mlp_speculator": lambda cfg: MLPSpeculator(MLPSpeculatorConfig(**cfg)),
    "hydra": lambda cfg: HydraHeads(HydraConfig(**cfg)),
    "eagle": eagle_from_config,
    "acceptance_head": lambda cfg: AcceptanceHead(AcceptanceConfig(**cfg)),
    "judge": lambda cfg: JudgeHead(JudgeConfig(**cfg)),
}


def build_drafter(kind: str, params: dict, target: Llama, **data) -> torch.nn.Module:
    """data: optional keyword facts about the training data some builders use (counts = token frequencies of
    the responses, tokenizer, eos_ids)."""
    if kind not in DRAFTERS:
        raise DraftsmithError(f"drafter.kind {kind!r} unknown (known: {', '.join(DRAFTERS)})")
    return DRAFTERS[kind](params, target, **data)


def checkpoint_tensors(model: torch.nn.Module, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint (or an export) holds: no excluded parts, no tied copy, contiguous, on CPU.
    ``state``: the model's full state dict when it had to be gathered first (FSDP2, train/state.py)."""
    skip = getattr(model, "checkpoint_exclude", ())
    sd = model.state_dict() if state is None else state
    sd = {k: v for k, v in sd.items() if not k.startswith(skip)} if skip else sd
    if getattr(model, "cfg", None) is not None and getattr(model.cfg, "tie_embeddings", False):
        sd.pop("lm_head.weight", None)  # tied: safetensors refuses shared storage, and it is redundant
    return {k: v.detach().contiguous().cpu() for k, v in sd.items()}


def save_drafter(path: Path, model: torch.nn.Module, kind: str, meta: dict, extra=None,
                 recipe_yaml: str | None = None, state: dict | None = None) -> Path:
    """Write atomically: a half-written checkpoint never sits under the final name. ``extra(folder)`` may add
    files (the training state) before the folder is renamed into place. ``recipe_yaml``: the resolved recipe that
    trained it, kept with the weights as ``recipe.yaml`` (the run folder's copy is rewritten by every later
    command on that folder, e.g. an eval with other overrides). ``state``: see ``checkpoint_tensors``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(checkpoint_tensors(model, state), str(tmp / "model.safetensors"))
    if getattr(model, "base", None) is not None:  # Medusa-2: the target's LoRA adapters
        save_file(adapter_state(model.base), str(tmp / ADAPTER_FILE))
    info = {"kind": kind, "config": model.cfg.to_dict(), **meta}
    (tmp / "drafter.json").write_text(json.dumps(info, indent=2))
    if recipe_yaml is not None:
        (tmp / "recipe.yaml").write_text(recipe_yaml)
    if extra is not None:
        extra(tmp)
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def load_weights_into(path: Path, model: torch.nn.Module, grow: bool = False) -> None:
    """Resume: a checkpoint's weights into an already built drafter of the same shape. ``grow`` (a warm start,
    train.init_checkpoint): parts the model marks ``growable`` (an EAGLE's added blocks) may be missing and keep
    their initialisation."""
    sd = load_file(str(Path(path) / "model.safetensors"))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    skip = getattr(model, "checkpoint_exclude", ()) + (getattr(model, "growable", ()) if grow else ())
    missing = [m for m in missing if m != "lm_head.weight" and not (skip and m.startswith(skip))]
    if getattr(model, "base", None) is not None:
        from peft import set_peft_model_state_dict

        adapter = Path(path) / ADAPTER_FILE
        if not adapter.is_file():
            raise DraftsmithError(f"{path}: no {ADAPTER_FILE} for this Medusa-2 drafter")
        set_peft_model_state_dict(model.base, load_file(str(adapter)))
    if missing or unexpected:
        raise DraftsmithError(f"{path}: checkpoint does not fit this recipe's drafter (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}); change the recipe back or set train.resume=false")


def load_drafter(path: Path, dtype=torch.float32, device="cpu") -> tuple[torch.nn.Module, dict]:
    path = Path(path)
    meta_file = path / "drafter.json"
    if not meta_file.is_file():
        raise DraftsmithError(f"{path}: not a drafter checkpoint (no drafter.json)")
    info = json.loads(meta_file.read_text())
    model = drafter_from_state(info, load_file(str(path / "model.safetensors")), path)
    return model.to(device=device, dtype=dtype).eval(), info


def drafter_from_state(info: dict, sd: dict[str, torch.Tensor], path: Path) -> torch.nn.Module:
    """Rebuild the drafter drafter.json describes and load ``sd`` (our tensor names) into it, strictly; a Medusa-2
    folder's LoRA tensors are attached for the caller (eval) to merge into the target."""
    kind = info.get("kind")
    if kind not in _FROM_CONFIG:
        raise DraftsmithError(f"{path / 'drafter.json'}: unknown drafter kind {kind!r}")
    model = _FROM_CONFIG[kind](info["config"])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise DraftsmithError(f"{path}: weights do not match drafter.json (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    if getattr(model.cfg, "tie_embeddings", False):
        model.lm_head.weight = model.embed_tokens.weight
    if (path / ADAPTER_FILE).is_file():  # Medusa-2: merged into the target by the caller (eval)
        model.target_adapter = load_file(str(path / ADAPTER_FILE))
    return model
