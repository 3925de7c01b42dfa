"""Device and dtype resolution shared by every stage (``auto`` = cuda + bf16 if available, else cpu + fp32)."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return _DTYPES[dtype]


def init_distributed() -> tuple[int, int, int]:
    """(rank, world size, local rank). Under torchrun / accelerate launch (WORLD_SIZE > 1) this joins the process
    group (gloo on CPU, nccl on CUDA) unless someone already did; a plain run is rank 0 of 1."""
    import datetime
    import os

    import torch.distributed as dist

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
