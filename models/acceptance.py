"""SpecDec++ acceptance predictor (algorithms.md A7) and the adaptive draft-length rules that use it.

The head reads a frozen draft LM's final hidden state at the position of a just-drafted token and predicts the
probability that speculative sampling accepts that token: ``ResBlock^L -> Linear(d -> 1)`` (one logit instead of
the reference's two-way softmax; the same model). It trains on the data stage's SpecDec++ labels (the draft's
sample y at each response position and min(1, p(y)/q(y))) with weighted soft-label BCE (train/objectives.py).

In the decoder, a *stop rule* decides after each draft whether to end the block (eval/decoder.py ``_draft``):
- ``AcceptanceStop``: keep P = prod of predicted acceptances of this block's drafts; stop once 1 - P > threshold
  (the paper's threshold policy);
- ``EntropyStop``: training-free baseline (SVIP-style): stop once the draft's next-token entropy exceeds a
  threshold (nats).
Both respect ``min_len``; ``eval.draft_len`` stays the cap. Neither changes the output (lossless either way).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.medusa import ResBlock


@dataclass(frozen=True)
class AcceptanceConfig:
    dim: int
    n_layers: int = 3
    draft: str | None = None  # the draft LM checkpoint folder the head was trained on

    def to_dict(self) -> dict:
        return asdict(self)


class AcceptanceHead(nn.Module):
    """Predicted acceptance logit from a draft hidden state (..., d) -> (...)."""

    checkpoint_exclude = ("draft.",)  # the frozen draft LM has its own checkpoint (cfg.draft)

    def __init__(self, cfg: AcceptanceConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.Sequential(*(ResBlock(cfg.dim) for _ in range(cfg.n_layers)))  # separate instances
        self.out = nn.Linear(cfg.dim, 1)
        self.draft = None  # training only: the frozen draft LM whose states the head reads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(h)).squeeze(-1)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if not n.startswith("draft."))


def build_acceptance_head(params: dict, target, **_) -> AcceptanceHead:
    """A fresh head on the frozen draft LM ``params['draft']`` (a draftsmith draft_lm checkpoint)."""
    from draftsmith.models.registry import load_drafter

    path = params.get("draft")
    if not path:
        raise DraftsmithError("drafter.draft: the draft LM checkpoint whose acceptance the head predicts is required")
    draft, info = load_drafter(Path(path))
    if info.get("kind") != "draft_lm":
        raise DraftsmithError(f"drafter.draft {path!r} is a {info.get('kind')} checkpoint; the acceptance head "
                              f"reads a standalone draft LM")
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise DraftsmithError(f"drafter.draft {path!r}: vocabulary {draft.cfg.vocab_size} != target "
                              f"{target.cfg.vocab_size}")
    head = AcceptanceHead(AcceptanceConfig(dim=draft.cfg.dim, n_layers=params.get("n_layers", 3),
                                           draft=str(path)))
    head.draft = draft.float().requires_grad_(False)  # frozen: only the head trains (as in the reference)
    return head


class AcceptanceStop:
    """SpecDec++ threshold rule: stop once P(some draft of this block is rejected) = 1 - prod p_hat > threshold."""

    def __init__(self, head: AcceptanceHead, threshold: float, min_len: int = 1):
        self.head, self.threshold, self.min_len = head, threshold, min_len
        self.p_all = 1.0

    def __call__(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        if hidden is None:
            raise DraftsmithError("the SpecDec++ stop rule needs a drafter that returns its hidden states")
        if n == 1:  # a new block: the verified token's factor is 1
            self.p_all = 1.0
        with torch.no_grad():
            self.p_all *= float(torch.sigmoid(self.head(hidden.to(self.head.out.weight.dtype))))
        return n >= self.min_len and 1.0 - self.p_all > self.threshold


class EntropyStop:
    """Training-free baseline: stop once the draft's next-token entropy (nats) exceeds the threshold."""

    def __init__(self, threshold: float, min_len: int = 1):
        self.threshold, self.min_len = threshold, min_len

    def __call__(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        logp = torch.log_softmax(logits.float(), -1)
        entropy = float(-(logp.exp() * logp.nan_to_num(neginf=0.0)).sum())
        return n >= self.min_len and entropy > self.threshold
