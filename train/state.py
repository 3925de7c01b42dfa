"""Resumable training state, without pickle: tensors in safetensors, everything else in JSON.

A resumable checkpoint folder ``checkpoints/step-NNNNNN/`` holds the drafter (model.safetensors + drafter.json,
models/registry.py) plus ``train_state.safetensors`` (optimizer moments, RNG states) and ``train_state.json``
(optimizer hyper-parameters and step counters, scheduler, step, data position, counters). RNG states are
stored per rank, so a multi-process run resumes each rank's own sampling. The folder is written under a
temporary name and renamed, so a folder with the final name is always complete; drafter.json, written last, holds
the sha256 of train_state.safetensors too, checked before a resume reads anything.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.integrity import load_tensors, read_json, save_safetensors

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
    return msd, {
        "state": {pos[n]: st for n, st in osd["state"].items()},
        "param_groups": [{**g, "params": [pos[n] for n in g["params"]]} for g in osd["param_groups"]],
    }


def _load_optimizer(model, opt: torch.optim.Optimizer, osd: dict) -> None:
    if model is None or not sharded(model):
        opt.load_state_dict(osd)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _fqns(model, opt)
    if len(names) != sum(len(g["params"]) for g in osd["param_groups"]):
        raise ValueError("the saved optimizer has a different number of parameters")
    full = {
        "state": {names[i]: st for i, st in osd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]],
    }
    set_optimizer_state_dict(model, opt, full, options=StateDictOptions(full_state_dict=True))


def rng_states(generators: dict[str, torch.Generator]) -> dict[str, torch.Tensor]:
    """This process's RNG states (torch, CUDA when present, the named generators) as uint8 tensors on CPU."""
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    out.update({f"gen.{name}": g.get_state().cpu() for name, g in generators.items()})
    return out


def gather_rng_states(acc, generators: dict[str, torch.Generator]) -> list[dict[str, torch.Tensor]]:
    """Every rank (a collective): each rank's ``rng_states``, in rank order. Each rank seeds its loss generator
    differently (TVD++ samples, EAGLE's feature noise, SpecDec++ mixing), so a resume that handed every rank
    rank 0's states would draw other numbers than the uninterrupted run. The states have the same layout on
    every rank, so one flat tensor per rank is gathered."""
    mine = rng_states(generators)
    sizes = {k: v.numel() for k, v in mine.items()}
    flat = torch.cat([v.flatten() for v in mine.values()]).to(torch.int32).to(acc.device)  # gloo and nccl
    every = acc.gather(flat[None]).view(acc.num_processes, -1).cpu().to(torch.uint8)  # (world, n)
    out = []
    for row in every:
        parts = dict(zip(sizes, torch.split(row, list(sizes.values())), strict=True))
        out.append({k: v.clone() for k, v in parts.items()})
    return out


def write_state(
    folder: Path,
    opt: torch.optim.Optimizer,
    sched,
    counters: dict,
    generators: dict[str, torch.Generator],
    osd: dict | None = None,
    rank_rngs: list[dict[str, torch.Tensor]] | None = None,
) -> None:
    """Write train_state.{safetensors,json} into ``folder`` (the caller renames the folder into place).
    ``osd``: the optimizer state dict when it had to be gathered first (``gather``). ``rank_rngs``: every rank's
    RNG states (``gather_rng_states``), stored per rank so each resumes its own."""
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
    for r, states in enumerate(rank_rngs or ()):
        tensors.update({f"rng.rank{r}.{k}": v for k, v in states.items()})
    save_safetensors(tensors, folder / "train_state.safetensors")
    meta = {
        "param_groups": _jsonable(osd["param_groups"]),
        "scalars": scalars,
        "scheduler": _jsonable(sched.state_dict()),
        "counters": counters,
        "python_random": _jsonable(random.getstate()),
    }
    (folder / "train_state.json").write_text(json.dumps(meta))


def read_state(
    folder: Path,
    opt: torch.optim.Optimizer,
    sched,
    generators: dict[str, torch.Generator],
    model: torch.nn.Module | None = None,
    rank: int = 0,
    hint: str = "",
) -> dict:
    """Restore optimizer, scheduler and RNG states from ``folder``; returns the saved counters. ``model``: the
    prepared drafter, needed when it is sharded (FSDP2) to scatter the full optimizer state onto its shards.
    ``rank``: this process's rank, whose own RNG states are restored when the checkpoint has them (else the
    saving process's: a checkpoint from a single process, or resumed on more processes than wrote it).
    ``hint``: appended to every error (how to start fresh)."""
    meta = read_json(folder / "train_state.json", hint)
    tensors = load_tensors(folder / "train_state.safetensors", hint)
    try:
        return _restore(folder, meta, tensors, opt, sched, generators, model, rank)
    except (KeyError, TypeError, ValueError) as e:
        raise DraftsmithError(f"{folder / 'train_state.json'}: not a training state ({e!r}){hint}") from None


def _restore(folder, meta, tensors, opt, sched, generators, model, rank) -> dict:
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
    pre = f"rng.rank{rank}." if f"rng.rank{rank}.torch" in tensors else "rng."
    torch.set_rng_state(tensors[pre + "torch"])
    if pre + "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors[pre + "cuda"])
    for name, g in generators.items():
        if f"{pre}gen.{name}" in tensors:
            g.set_state(tensors[f"{pre}gen.{name}"])
    v, internal, gauss = meta["python_random"]
    random.setstate((v, tuple(internal), gauss))
    return meta["counters"]


def latest_resumable(ckpt_dir: Path) -> Path | None:
    """The newest complete step-N folder with a training state, or None."""
    if not ckpt_dir.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in ckpt_dir.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / "train_state.json").is_file()
    ]
    return max(found)[1] if found else None


def prune(ckpt_dir: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` step-N folders (the final checkpoint is not a step folder). Each is
    renamed out of the step-N names before it is deleted, so a kill mid-delete never leaves a half-deleted folder
    under a checkpoint's name; what a killed prune left (``*.deleting``) goes on the next call."""
    if not ckpt_dir.is_dir():
        return
    for p in ckpt_dir.glob("*.deleting"):
        shutil.rmtree(p, ignore_errors=True)
    steps = sorted((int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := STEP_DIR.match(p.name)))
    for _, p in steps[:-keep_last]:
        remove_dir(p)


def remove_dir(path: Path) -> None:
    """Delete a folder so that a kill at any moment leaves it whole or gone from its name (renamed, then deleted)."""
    gone = path.with_name(path.name + ".deleting")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(path, gone)
    shutil.rmtree(gone, ignore_errors=True)
