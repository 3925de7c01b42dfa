"""One objective per drafter kind: (model, batch, loss config, context) -> StepOutput(loss sum, metrics).

The train loop is shared; only this function differs between drafters. Objectives return the loss *summed* over
trained positions plus the count, so the loop can normalise by the global token count of the optimizer step
(exact under gradient accumulation and data parallelism, whatever the per-rank token counts).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.train import losses


@dataclass
class StepOutput:
    loss_sum: torch.Tensor
    n: int
    metrics: dict = field(default_factory=dict)


@dataclass
class Context:
    """What an objective may need besides its model and batch."""
    unwrapped: torch.nn.Module  # the drafter without DDP/FSDP wrappers (its config and vocabulary maps)
    target: torch.nn.Module | None = None  # frozen target, for loss.teacher = target
    generator: torch.Generator | None = None  # sampling inside losses (TVD++), checkpointed with the run


def _spec(cfg) -> losses.LossSpec:
    return losses.LossSpec(kind=cfg.kind, beta=cfg.beta, kl_scale=cfg.kl_scale, kl_decay=cfg.kl_decay,
                           chunk=cfg.chunk)


def draft_lm_teacher(batch: dict, cfg, ctx: Context) -> losses.Teacher:
    """Labels and teacher distribution at the trained positions, mapped into the draft's head vocabulary."""
    model = ctx.unwrapped
    t2d = getattr(model, "t2d", None)  # (V_target,) draft index or -1, for a reduced draft vocabulary
    labels = batch["labels"] if t2d is None else t2d[batch["labels"]]
    teacher = losses.Teacher(labels=labels)
    if cfg.kind == "ce" and "topk_ids" not in batch:
        return teacher  # labels are all CE needs; stored top-k, when present, still feeds the alpha metric
    if cfg.teacher == "target":
        if ctx.target is None:
            raise DraftsmithError("train.loss.teacher=target needs the target loaded in the loop")
        with torch.no_grad():
            h = ctx.target(batch["input_ids"], logits_at=batch["predict_mask"], return_hidden=True)
        head = ctx.target.lm_head.weight
        if t2d is not None:  # teacher restricted to the draft vocabulary, un-renormalised tail via top-k form
            raise DraftsmithError("train.loss.teacher=target with drafter.draft_vocab is not supported: use "
                                  "teacher=records")
        teacher.hidden, teacher.head = h, head
        return teacher
    if "topk_ids" not in batch:  # (ce returned above)
        raise DraftsmithError(f"train.loss.kind={cfg.kind} needs teacher top-k log-probs: set data.signals.topk "
                              f"> 0 and regenerate, or use train.loss.teacher=target")
    ids = batch["topk_ids"]
    teacher.topk_ids = ids if t2d is None else t2d[ids]
    teacher.topk_logprobs = batch["topk_logprobs"]
    return teacher


def draft_lm_objective(model, batch: dict, cfg, ctx: Context) -> StepOutput:
    """Standalone draft LM: final hidden states only where a target token is predicted; the LM head and loss
    run chunked in train/losses.py. With a reduced vocabulary, positions whose label is outside it still count
    for the divergence (their teacher mass sits in the tail) but not for CE."""
    teacher = draft_lm_teacher(batch, cfg, ctx)
    reduced = getattr(ctx.unwrapped, "t2d", None) is not None

    def head_fn(h, head):  # runs inside the drafter's forward (see Llama.forward head_fn)
        t = teacher
        if cfg.kind == "ce" and reduced:
            keep = t.labels >= 0
            h, t = h[keep], losses.Teacher(labels=t.labels[keep])
        loss = losses.head_loss(h, head, t, _spec(cfg), ctx.generator) * h.shape[0]
        return loss, h.shape[0], losses.head_metrics(h.detach(), head.detach(), t, cfg.chunk)

    loss, n, m = model(batch["input_ids"], logits_at=batch["predict_mask"], head_fn=head_fn)
    return StepOutput(loss, n, m)


OBJECTIVES = {
    "draft_lm": draft_lm_objective,
}
# Signal groups each kind reads from the records (the rest, e.g. hidden states, is never read from disk).
SIGNALS_NEEDED = {
    "draft_lm": {"topk"},
}
