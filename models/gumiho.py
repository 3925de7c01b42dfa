"""Gumiho (docs/algorithms.md A21): a hybrid drafter that spends its capacity on the first draft positions.

A draft is only worth something when every draft before it was accepted, so the first positions matter most.
Gumiho drafts them with a serial Transformer and the later ones with cheap parallel MLP heads:

- **serial part**: the EAGLE drafter (models/eagle.py, either version, ``n_layers`` deep: two by default) drafts
  positions 1..S (``serial_drafts``) autoregressively, as EAGLE does, trained with the same training-time test
  over S steps;
- **parallel part**: ``mlp_heads`` MLP heads draft positions S+1..S+M in one go. Every head reads the S (state,
  token) pairs the serial part read or would read next, as its attention input sees them (``Eagle._inputs``:
  EAGLE-1's fc output, EAGLE-3's [norm(e), norm(state)]): pair j is (the state that drafted d_j, d_j). Head i is a
  narrowing block SiLU(W u + b) (S·w -> d) and ``mlp_layers`` - 1 residual blocks x + SiLU(W x + b) (zero at
  init), and drafts d_{S+1+i} through the serial part's own LM head (``head_input``). The heads read no draft after
  d_S: in a tree every node below a depth-S node takes that node's head distributions.
- **loss**: TTT step s weighs ``head_decay``**s as in EAGLE; head i weighs ``mlp_weight`` * ``mlp_decay``**(i+1), so
  the budget leans to the early positions (the reference code scales its heads by a further 1/9: mlp_weight 0.11).

Decoding: eval/proposers.py ``HybridRows``. No serving engine has the layout: export --format hf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from draftsmith.models.eagle import Eagle, EagleConfig, EagleDrafterConfig, build_on_eagle, ttt_result
from draftsmith.models.llama import Block
from draftsmith.models.spec import DrafterSpec, as_section


class GumihoDrafterConfig(EagleDrafterConfig):
    """Gumiho: an EAGLE drafter (the serial part, two layers by default) drafts the first ``serial_drafts``
    positions, ``mlp_heads`` parallel MLP heads the later ones; decodes as a chain or a tree."""

    kind: Literal["gumiho"] = "gumiho"
    n_layers: int = Field(2, gt=0, le=32)
    """Depth of the serial part: the EAGLE layer plus n_layers - 1 Llama blocks (Gumiho's serial Transformer: 2)."""
    serial_drafts: int = Field(2, ge=1, le=8)
    """Draft positions the serial part drafts autoregressively (its TTT steps); the heads draft the ones after."""
    mlp_heads: int = Field(5, ge=1, le=16)
    """Parallel MLP heads: draft positions serial_drafts + 1 .. serial_drafts + mlp_heads."""
    mlp_layers: int = Field(6, ge=1, le=16)
    """Blocks per head: one narrowing the serial pairs to the model width, then mlp_layers - 1 residual blocks."""
    mlp_weight: float = Field(1.0, ge=0)
    """Loss weight of the heads against the serial part (head i weighs mlp_weight * mlp_decay**(i+1)); the
    reference code's is 1/9."""
    mlp_decay: float = Field(0.8, gt=0, le=1)
    """Per-head decay of the heads' loss weight: earlier heads get more of the budget."""

    @model_validator(mode="before")
    @classmethod
    def _serial(cls, data):
        if not isinstance(data, dict):
            return data
        for f in ("parallel_drafts", "partial_alignment"):
            if data.get(f):
                raise ValueError(f"drafter.{f} does not combine with Gumiho's heads (drafter.kind=gumiho)")
        s, t = data.get("serial_drafts", 2), data.get("ttt_steps")
        if t is not None and t != s:
            raise ValueError(
                f"drafter.ttt_steps is {t} but Gumiho's serial part trains one step per serial draft: leave it unset "
                f"or set it to drafter.serial_drafts = {s}"
            )
        return {**data, "ttt_steps": s}


@dataclass(frozen=True)
class GumihoConfig(EagleConfig):
    serial: int = 2  # draft positions of the serial part
    mlp_heads: int = 5
    mlp_layers: int = 6


class Narrow(nn.Module):
    """u (n_in) -> SiLU(W u + b) (d): a head's first block, no residual (its input is wider than its output)."""

    def __init__(self, n_in: int, dim: int):
        super().__init__()
        self.linear = nn.Linear(n_in, dim)

    def forward(self, x):
        return F.silu(self.linear(x))


class Residual(nn.Module):
    """x -> x + SiLU(W x + b), W zero at init."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class Gumiho(Eagle):
    def __init__(self, cfg: GumihoConfig):
        super().__init__(cfg)
        d = cfg.dim
        self.heads = nn.ModuleList(
            nn.Sequential(Narrow(cfg.serial * self.pair_width, d), *(Residual(d) for _ in range(cfg.mlp_layers - 1)))
            for _ in range(cfg.mlp_heads)
        )

    @property
    def pair_width(self) -> int:
        """Width of one (state, token) pair as the serial part's attention reads it."""
        return self.cfg.dim * (1 if self.cfg.version == 1 else 2)

    @property
    def drafts_hybrid(self) -> tuple[int, int]:
        """(serial draft positions, MLP heads): eval/proposers.py ``HybridRows`` decodes it."""
        return self.cfg.serial, self.cfg.mlp_heads

    @property
    def max_draft_len(self) -> int:
        return self.cfg.serial + self.cfg.mlp_heads

    def pair(self, ids: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """ids (..., ) with the states (..., d) that drafted them -> the pairs as the attention reads them."""
        return self._inputs(self.embed(ids), state)[0]

    def head_states(self, pairs: torch.Tensor) -> torch.Tensor:
        """The S pairs side by side (..., S * pair_width) -> every head's output state (..., M, d)."""
        return torch.stack([h(pairs) for h in self.heads], -2)

    def head_logits(self, states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.head_input(states))

    def draft_positions(self, steps: int) -> int:
        return self.cfg.serial + self.cfg.mlp_heads

    def position_weight(self, s: int, p) -> float:
        S = self.cfg.serial
        return p.head_decay**s if s < S else p.mlp_weight * p.mlp_decay ** (s - S + 1)

    def forward(self, feats, ids, steps: int = 1, select=None, head_fn=None, step_tokens=None, **kw):
        """The serial part's TTT unroll over its S steps (``Eagle.forward``), then the heads at every position:
        head i at t reads pairs j = 1..S, (TTT step j-1's output, x_{t+j+1}), and drafts x_{t+S+i+2}, as TTT step
        S+i would. Returns the S + M results in ``Eagle.forward``'s contract (step s of the list is draft s+1)."""
        S, T = self.cfg.serial, ids.shape[1]
        outs = super().forward(feats, ids, steps=S, step_tokens=step_tokens, **kw)  # (S, B, T, d)
        pairs = []
        for j in range(1, S + 1):
            tok = torch.zeros_like(ids)
            if j + 1 < T:
                tok[:, : T - j - 1] = ids[:, j + 1 :]  # past the end: token 0, never selected for a loss
            pairs.append(self.pair(tok, self.next_state(outs[j - 1])))
        hs = self.head_states(torch.cat(pairs, -1)).movedim(-2, 0)  # (M, B, T, d)
        if head_fn is None:
            return torch.cat([outs, hs])
        return [ttt_result(self, s, o, select, head_fn) for s, o in enumerate([*outs, *hs])]


def build_gumiho(cfg: GumihoDrafterConfig | dict, target, **data) -> Gumiho:
    """The serial part built as ``build_eagle`` builds an EAGLE drafter (its weights moved into a Gumiho), fresh
    MLP heads."""
    p = as_section(GumihoDrafterConfig, cfg)
    own = {"serial": p.serial_drafts, "mlp_heads": p.mlp_heads, "mlp_layers": p.mlp_layers}
    return build_on_eagle(Gumiho, GumihoConfig, p, own, target, **data)


REFUSED = "refused: no serving engine has Gumiho's MLP heads; export --format hf"

SPEC = DrafterSpec(
    kind="gumiho",
    config=GumihoDrafterConfig,
    build=build_gumiho,
    from_config=lambda c: Gumiho(GumihoConfig(**c)),
    interface="features",
    objective="draftsmith.train.objectives:eagle_objective",
    signals=frozenset({"topk", "hidden_last", "hidden_aux"}),
    fsdp_wrap=(Block,),
    packs=True,
    exports={"vllm": REFUSED, "sglang": REFUSED},
)  # Block: the serial part's layers after the first
