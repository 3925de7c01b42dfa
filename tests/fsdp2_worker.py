"""Run by tests/test_train.py under `torch.distributed.run --nproc_per_node=2` (gloo, CPU): a draft Llama sharded
with FSDP2's ``fully_shard`` (what accelerate applies on GPUs), trained two steps, checkpointed through
train/state.py's ``gather`` + models/registry.py's ``save_drafter`` / ``write_state``; then resumed twice, sharded
(``read_state(model=...)``) and unsharded on rank 0, and both resumed runs take one more step: the weights must
agree with each other. Prints OK on rank 0."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from draftsmith.models.llama import Llama, LlamaConfig
from draftsmith.models.registry import save_drafter
from draftsmith.train.state import gather, read_state, sharded, write_state

CFG = LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)


def build(shard: bool):
    torch.manual_seed(0)
    model = Llama(CFG)
    if shard:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def step(model, opt, sched, seed: int) -> None:
    ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def full(model) -> dict:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def main(folder: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt, sched = build(shard=True)
    assert sharded(model)
    for s in range(2):
        step(model, opt, sched, s)
    msd, osd = gather(model, opt)  # collective
    if rank == 0:
        save_drafter(
            folder,
            model,
            "draft_lm",
            {"step": 2},
            state=msd,
            extra=lambda tmp: write_state(tmp, opt, sched, {"step": 2}, {}, osd),
        )
        saved = load_file(str(folder / "model.safetensors"))
        want = {k: v for k, v in full(model).items() if k in saved}
    else:
        full(model)  # full_tensor() is a collective too
    dist.barrier()
    # Resume sharded: fresh model and optimizer, the saved weights and optimizer state scattered onto the shards.
    model2, opt2, sched2 = build(shard=True)
    sd = load_file(str(folder / "model.safetensors"))
    for name, p in model2.named_parameters():
        p.data.copy_(torch.distributed.tensor.distribute_tensor(sd[name], p.device_mesh, p.placements))
    read_state(folder, opt2, sched2, {}, model=model2)
    step(model2, opt2, sched2, 7)
    after_sharded = full(model2)
    if rank == 0:
        assert saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in saved), "saved weights"
        # Resume unsharded from the same files: one more step must land on the same weights.
        plain, popt, psched = build(shard=False)
        plain.load_state_dict(sd, strict=False)
        read_state(folder, popt, psched, {})
        assert popt.state_dict()["state"][0]["exp_avg"].abs().sum() > 0, "optimizer moments restored"
        step(plain, popt, psched, 7)
        for k, v in plain.state_dict().items():
            torch.testing.assert_close(after_sharded[k], v, rtol=1e-5, atol=1e-6, msg=k)
        print("OK")
    dist.barrier()
    dist.destroy_process_group()
    # The sharded models still hold the group; skip the teardown its gloo threads can abort (draftsmith.cli.entry).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
