"""The train step never makes the host wait for the device: kernels are queued back to back and read back once per
logging window (train/loop.py ``_optimizer_step`` / ``_settle``). Counted with draftsmith/flops.py ``HostOps`` on
CPU tensors, where every such wait (.item(), boolean-mask indexing, .tolist(), .cpu()) is still visible as a call.
Every kind that packs is covered except PARD, whose mask segments are laid out on the device (docs/training.md)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from draftsmith.data.dataset import collate, collate_packed
from draftsmith.data.records import Record
from draftsmith.flops import HostOps
from draftsmith.models.llama import Llama, LlamaConfig
from draftsmith.models.registry import build_drafter, drafter_spec
from draftsmith.recipes.schema import LossConfig
from draftsmith.train import loop, objectives

V = 96
SECTIONS = {
    "eagle3": ("eagle", {"version": 3, "ttt_steps": 3, "draft_vocab": 48}),
    "eagle1": ("eagle", {"version": 1, "ttt_steps": 2}),
    "medusa": ("medusa", {"n_heads": 3}),
    "hydra": ("hydra", {"n_heads": 3}),
    "mlp_speculator": ("mlp_speculator", {"n_predict": 3}),
    "draft_lm": ("draft_lm", {"n_layers": 1}),
}


def _records(n: int = 6) -> list[Record]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        m = int(torch.randint(12, 40, (), generator=g))
        mask = torch.zeros(m, dtype=torch.bool)
        mask[m // 3 :] = True
        k = int(mask.sum())
        top = torch.log_softmax(torch.randn(k, 8, generator=g), -1)
        sig = {"topk_ids": torch.randint(0, V, (k, 8), generator=g), "topk_logprobs": top}
        out.append(Record(torch.randint(3, V, (m,), generator=g), mask, i, 0, 0, sig))
    return out


class _TC:
    grad_accum, grad_clip = 2, 1.0
    loss = LossConfig(kind="fkl")


def _step_syncs(name: str, packed: bool) -> tuple[HostOps, dict]:
    from accelerate import Accelerator

    torch.manual_seed(0)
    target = Llama(LlamaConfig(vocab_size=V, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=64))
    target.requires_grad_(False)
    kind, fields = SECTIONS[name]
    params = drafter_spec(kind).section(fields)
    drafter = build_drafter(kind, params, target, counts=torch.arange(V) + 1).float().train()
    acc = Accelerator(cpu=True)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    drafter, opt = acc.prepare(drafter, opt)
    recs = _records()
    coll = partial(collate_packed, row_tokens=64) if packed else collate
    batches = [loop.counted_batch(coll, recs[:3]), loop.counted_batch(coll, recs[3:])]
    ctx = objectives.Context(unwrapped=acc.unwrap_model(drafter), target=target, params=params)
    objective = objectives.objective_for(kind)
    loop._optimizer_step(acc, drafter, opt, sched, iter(batches), objective, _TC, ctx)  # first step: state, maps
    ops = HostOps()
    # torch's AdamW (not fused) keeps its step counts on the host: their reads wait for nothing
    opt.step = ops.in_phase("optimizer", opt.step)
    with ops.counting():
        out = loop._optimizer_step(acc, drafter, opt, sched, iter(batches), objective, _TC, ctx)
    return ops, out


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("name", list(SECTIONS))
def test_a_train_step_never_waits_for_the_device(name, packed):
    ops, out = _step_syncs(name, packed)
    waits = {op: n for (phase, op), n in ops.what.items() if phase != "optimizer"}
    assert not waits, f"{name}: the step reads device data back: {waits}"
    assert ops.kernels["step"] > 100  # (the counter saw the step)
    # ... and what it returns is read once, afterwards, with the loss and metrics of the global batch
    (m,) = loop._settle([out])
    assert (
        m["loss"] > 0
        and 0 <= m["top1"] <= 1
        and m["grad_norm"] > 0
        and m["real"] == sum(len(r.input_ids) for r in _records())
    )


def test_the_counter_sees_every_kind_of_wait():
    """HostOps counts .item(), boolean-mask indexing (and its backward), data-dependent shapes, .tolist() and
    .cpu(), and no waits for integer indexing or plain arithmetic."""
    x = torch.randn(6, 3, requires_grad=True)
    m = torch.tensor([True, False, True, True, False, False])
    ops = HostOps()
    with ops.counting():
        y = (x * 2 + 1)[torch.tensor([0, 2, 3])]  # integer index: no wait
        assert not ops.syncs
        float(y.detach().sum())
        x[m].sum().backward()
        m.nonzero()
        y.tolist()
        y.detach().cpu()
    assert {op for _, op in ops.what} == {"_local_scalar_dense", "index[bool]", "index_put[bool]", "nonzero",
                                          "tolist", "cpu"}  # fmt: skip
