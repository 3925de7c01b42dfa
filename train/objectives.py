"""One objective per drafter kind: (model, batch, loss config) -> StepOutput(loss, metrics).

The train loop is shared; only this function differs between drafters.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.train import losses


@dataclass
class StepOutput:
    loss: torch.Tensor
    metrics: dict = field(default_factory=dict)


def draft_lm_objective(model, batch: dict, loss_cfg) -> StepOutput:
    """Standalone draft LM: logits only where a target token is predicted (skips most of the vocab matmul)."""
    logits = model(batch["input_ids"], logits_at=batch["predict_mask"])  # (N, V)
    if loss_cfg.kind == "fkl":
        if "topk_ids" not in batch:
            raise DraftsmithError("train.loss.kind=fkl needs teacher top-k logits: set data.topk > 0 and regenerate")
        per_pos = losses.forward_kl(logits, batch["topk_ids"], batch["topk_logprobs"])
    else:
        per_pos = losses.cross_entropy(logits, batch["labels"])
    with torch.no_grad():
        m = {"top1": (logits.argmax(-1) == batch["labels"]).float().mean().item(), "tokens": per_pos.numel()}
        if "topk_ids" in batch:
            bound = losses.acceptance_lower_bound(logits, batch["topk_ids"], batch["topk_logprobs"])
            m["accept_lb"] = bound.mean().item()
    return StepOutput(per_pos.mean(), m)


OBJECTIVES = {
    "draft_lm": draft_lm_objective,
}
# Signal groups each kind reads from the records (the rest, e.g. hidden states, is never read from disk).
SIGNALS_NEEDED = {
    "draft_lm": {"topk"},
}
