"""Judge module (Judge Decoding, docs/algorithms.md A8): a tiny head on the *target's* final hidden states at drafted
tokens that predicts whether a draft token is an acceptable continuation even where it differs from the target's
own choice.

``JudgeHead``: Linear(d -> 1) (``hidden`` = 0, the paper's linear probe) or a one-hidden-layer MLP. The verify
forward already computes the states it reads, so judging costs one dot product per draft.

Decoding with a judge is **lossy** (eval.judge, off by default): a draft is accepted when standard greedy
verification accepts it *or* its judge score exceeds delta; the block keeps the longest such prefix and the
target's token follows as usual (eval/decoder.py). Labels come from automatic what-if continuations
(data/judge.py); the objective is class-balanced BCE (train/objectives.py ``judge_objective``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from draftsmith.models.spec import DrafterSpec, Strict, as_section


class JudgeDrafterConfig(Strict):
    """Judge Decoding's judge (docs/algorithms.md A8): a linear probe (or tiny MLP) on the frozen target's final states
    at drafted tokens, trained on mined what-if labels (data.judge_labels) with class-balanced BCE."""

    kind: Literal["judge"] = "judge"
    hidden: int = Field(0, ge=0)
    """0 = linear probe (the paper's); > 0 = one hidden layer of this width."""
    balance: bool = True
    """Weigh the classes inversely to their frequency in each batch."""


@dataclass(frozen=True)
class JudgeConfig:
    dim: int
    hidden: int = 0  # 0 = linear probe

    def to_dict(self) -> dict:
        return asdict(self)


class JudgeHead(nn.Module):
    def __init__(self, cfg: JudgeConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.hidden:
            self.net = nn.Sequential(nn.Linear(cfg.dim, cfg.hidden), nn.SiLU(), nn.Linear(cfg.hidden, 1))
        else:
            self.net = nn.Linear(cfg.dim, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Target states (..., d) -> acceptability logits (...)."""
        return self.net(h.to(next(self.net.parameters()).dtype)).squeeze(-1)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        return sum(p.numel() for p in self.parameters())


def build_judge(cfg: JudgeDrafterConfig | dict, target, **_) -> JudgeHead:
    cfg = as_section(JudgeDrafterConfig, cfg)
    return JudgeHead(JudgeConfig(dim=target.cfg.dim, hidden=cfg.hidden)).to(target.embed_tokens.weight.dtype)


class Judge:
    """The decoder's view of a trained head: ``scores(states (γ, d)) -> P(acceptable) (γ,)`` and the threshold."""

    def __init__(self, head: JudgeHead, delta: float):
        self.head, self.delta = head, delta

    @torch.no_grad()
    def accepts(self, states: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(states)) > self.delta


# needs_target: the loop runs the frozen target, whose states at the what-if tokens the judge reads.
def check_recipe(recipe) -> None:
    """The judge against the rest of the recipe (DrafterSpec.check)."""
    if recipe.train.eval_every:
        raise ValueError("train.eval_every does not apply to a judge: run `draftsmith eval` with eval.judge")


SPEC = DrafterSpec(
    kind="judge",
    config=JudgeDrafterConfig,
    build=build_judge,
    from_config=lambda c: JudgeHead(JudgeConfig(**c)),
    interface=None,
    role="judge_head",
    objective="draftsmith.train.objectives:judge_objective",
    signals=frozenset({"judge"}),
    needs_target=True,
    check=check_recipe,
)
