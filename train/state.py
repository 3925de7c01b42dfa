"""Resumable training state, without pickle: tensors in safetensors, everything else in JSON.

A resumable checkpoint folder ``checkpoints/step-NNNNNN/`` holds the drafter (model.safetensors + drafter.json,
models/registry.py) plus ``train_state.safetensors`` (optimizer moments, RNG states) and ``train_state.json``
(optimizer hyper-parameters and step counters, scheduler, step, data position, counters). The folder is
written under a temporary name and renamed, so a folder with the final name is always complete.
"""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.errors import DraftsmithError

STEP_DIR = re.compile(r"^step-(\d+)$")


def _jsonable(x):
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if torch.is_tensor(x):
        return x.item()
    return x


def sharded(model: torch.nn.Module) -> bool:
    """FSDP2 (``fully_shard``, what accelerate's FSDP v2 applies) holds parameters as DTensors: each rank has a
    shard, so a checkpoint needs the full tensors gathered first, a collective every rank must join."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _fqns(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's order: position i is key i of an unsharded optimizer's state dict."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in opt.param_groups for p in g["params"]]


_FULL = {"full_state_dict": True, "cpu_offload": True}


def gather(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> tuple[dict | None, dict | None]:
    """Collective under FSDP2 (every rank calls it; rank 0 gets the tensors, on CPU): (model state dict, optimizer
    state dict keyed by parameter position, as an unsharded optimizer's), so a checkpoint written under FSDP2 is
    the same file a single-process run writes and resumes under any launcher. (None, None) when not sharded."""
    if not sharded(model):
        return None, None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(**_FULL)
    msd = get_model_state_dict(model, options=options)
    if opt is None:
        return msd, None
    osd = get_optimizer_state_dict(model, opt, options=options)
    if not osd:  # ranks other than 0 get empty dicts (cpu_offload gathers onto rank 0 only)
        return msd, None
    pos = {n: i for i, n in enumerate(_fqns(model, opt))}
    return msd, {"state": {pos[n]: st for n, st in osd["state"].items()},
                 "param_groups": [{**g, "params": [pos[n] for n in g["params"]]} for g in osd["param_groups"]]}


def _load_optimizer(model, opt: torch.optim.Optimizer, osd: dict) -> None:
    if model is None or not sharded(model):
        opt.load_state_dict(osd)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _fqns(model, opt)
    if len(names) != sum(len(g["params"]) for g in osd["param_groups"]):
        raise ValueError("the saved optimizer has a different number of parameters")
    full = {"state": {names[i]: st for i, st in osd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]}
    set_optimizer_state_dict(model, opt, full, options=StateDictOptions(full_state_dict=True))


def write_state(folder: Path, opt: torch.optim.Optimizer, sched, counters: dict,
                generators: dict[str, torch.Generator], osd: dict | None = None) -> None:
    """Write train_state.{safetensors,json} into ``folder`` (the caller renames the folder into place).
    ``osd``: the optimizer state dict when it had to be gathered first (``gather``)."""
    osd = opt.state_dict() if osd is None else osd
    tensors, scalars = {}, {}
    for pid, st in osd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                tensors[f"opt.{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pid), {})[k] = _jsonable(v)
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    for name, g in generators.items():
        tensors[f"rng.gen.{name}"] = g.get_state().cpu()
    save_file(tensors, str(folder / "train_state.safetensors"))
    meta = {"param_groups": _jsonable(osd["param_groups"]), "scalars": scalars,
            "scheduler": _jsonable(sched.state_dict()), "counters": counters,
            "python_random": _jsonable(random.getstate())}
    (folder / "train_state.json").write_text(json.dumps(meta))


def read_state(folder: Path, opt: torch.optim.Optimizer, sched, generators: dict[str, torch.Generator],
               model: torch.nn.Module | None = None) -> dict:
    """Restore optimizer, scheduler and RNG states from ``folder``; returns the saved counters. ``model``: the
    prepared drafter, needed when it is sharded (FSDP2) to scatter the full optimizer state onto its shards."""
    meta = json.loads((folder / "train_state.json").read_text())
    tensors = load_file(str(folder / "train_state.safetensors"))
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        if key.startswith("opt."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = v
    for pid, st in meta["scalars"].items():
        for k, v in st.items():
            state.setdefault(int(pid), {})[k] = torch.tensor(v, dtype=torch.float32) if k == "step" else v
    groups = meta["param_groups"]
    try:
        osd = {"state": state, "param_groups": groups}
        _load_optimizer(model, opt, osd)
    except ValueError as e:
        raise DraftsmithError(f"{folder}: optimizer state does not fit this drafter ({e})") from None
    sched.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    for name, g in generators.items():
        if f"rng.gen.{name}" in tensors:
            g.set_state(tensors[f"rng.gen.{name}"])
    v, internal, gauss = meta["python_random"]
    random.setstate((v, tuple(internal), gauss))
    return meta["counters"]


def latest_resumable(ckpt_dir: Path) -> Path | None:
    """The newest complete step-N folder with a training state, or None."""
    if not ckpt_dir.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir()
             if (m := STEP_DIR.match(p.name)) and (p / "train_state.json").is_file()]
    return max(found)[1] if found else None


def prune(ckpt_dir: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` step-N folders (the final checkpoint is not a step folder)."""
    steps = sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_DIR.match(p.name)))
    for _, p in steps[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)
