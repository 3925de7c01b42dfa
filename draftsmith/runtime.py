"""Device and dtype resolution shared by every stage (``auto`` = cuda + bf16 if available, else cpu + fp32)."""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def parse_device(device: str) -> torch.device:
    """``device`` as a torch device, or ValueError naming what it accepts (the recipe checks it when read)."""
    try:
        return torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError("not a torch device: auto, cpu, cuda, cuda:N, mps, ...") from None


def resolve_device(device: str, key: str = "target.device") -> str:
    """``auto`` -> cuda if available, else cpu; an explicit device only if this machine has it (a one-line error
    naming ``key`` otherwise, before any model is built)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        d = parse_device(device)
    except ValueError as e:
        raise DraftsmithError(f"{key}={device!r}: {e}") from None
    if d.type == "cpu":
        return device
    mod = getattr(torch, d.type, None)  # torch.cuda, torch.mps, torch.xpu, ...
    backend = torch.backends.mps if d.type == "mps" else mod
    if backend is None or not backend.is_available():
        raise DraftsmithError(f"{key}={device!r}: this machine has no {d.type} device (use auto or cpu)")
    count = mod.device_count() if hasattr(mod, "device_count") else 1
    if d.index is not None and d.index >= count:
        raise DraftsmithError(f"{key}={device!r}: no such device, this machine has {count} {d.type} device(s)")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return _DTYPES[dtype]


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), where bf16 autocast speeds training up;
    on other CPUs torch emulates it and it is several times slower than fp32."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    try:
        return any(getattr(torch.cpu, p)() for p in probes if hasattr(torch.cpu, p))
    except RuntimeError:  # pragma: no cover - a torch build without the probes' backend
        return False


def resolve_precision(precision: str, device: str) -> str:
    """``train.precision`` for accelerate: ``auto`` -> bf16 on a CUDA device that supports it and on a CPU with
    native bf16 (``cpu_has_bf16``), else ``no`` (fp32); other values pass through."""
    if precision != "auto":
        return precision
    if device.startswith("cuda"):
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    if device == "cpu" or device.startswith("cpu:"):
        return "bf16" if cpu_has_bf16() else "no"
    return "no"


def refuse_independent_machines() -> None:
    """``accelerate launch --num_machines N`` without a distributed mode (``--multi_gpu``, FSDP, DeepSpeed) uses
    accelerate's simple launcher: each machine runs one process on its own, with no process group, so N
    independent trainings would write the same out_dir. That launcher sets MASTER_ADDR for the machines but no
    WORLD_SIZE: refused in one line before anything is read or written."""
    import os

    env = os.environ
    if "ACCELERATE_MIXED_PRECISION" in env and "MASTER_ADDR" in env and "WORLD_SIZE" not in env:
        raise DraftsmithError(
            "accelerate launch started this process alone although --num_machines (or --num_processes) asks for "
            "more: each machine would train on its own into the same out_dir; add --multi_gpu (or an FSDP / "
            "DeepSpeed config) so the machines join one process group"
        )


def init_distributed() -> tuple[int, int, int]:
    """(rank, world size, local rank). Under torchrun / accelerate launch (WORLD_SIZE > 1) this joins the process
    group (gloo on CPU, nccl on CUDA) unless someone already did; a plain run is rank 0 of 1."""
    import datetime
    import os

    import torch.distributed as dist

    refuse_independent_machines()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # Ranks meet only at the start and the end; the end waits for the slowest rank, so allow hours.
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=6))
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
    return 0, 1, 0


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def shutdown_distributed(ok: bool = True) -> bool:
    """Leave the process group, if this process joined one (returns whether it had). On success ranks first
    meet, so no rank leaves while another still talks to it; after an error they leave at once (a peer may never
    arrive). Leaving is not enough on its own: DDP / FSDP2 objects still hold the group, and gloo's worker threads
    can abort the interpreter's teardown ("terminate called without an active exception", SIGABRT, after the work
    succeeded), so the command-line entry also skips that teardown (``draftsmith.cli.entry``)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return False
    try:
        if ok:
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return True
