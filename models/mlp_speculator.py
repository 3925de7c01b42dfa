"""MLP speculator (IBM fms-extras style): a recurrent chain of small MLP stages over the target's final hidden
state. Stage k mixes its running state with the embedding of the previous token (the target's next token for
k = 0, then its own drafts) and predicts the token k+2 positions ahead, the same alignment as Medusa head k.

    state_0 = h_t;  state_{k+1} = GELU(LN_k(P_k state_k + c * E_k[x_{t+k+1}]));  logits_k = H_k state_{k+1}

The state and embedding weights follow the reference's scaling (state weight 0.5^(0.5/K), embedding weight
sqrt((1 - w^2) * inner / 2)) so the running state keeps a stable norm across stages. Training is teacher
forced (true tokens feed the stages); decoding feeds the drafts, one stage per draft.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from draftsmith.models.feature_heads import HEADS_ACCEPTANCE, FeatureHeads, head_vocab
from draftsmith.models.spec import EXPORT, DrafterSpec, Strict, as_section


class MLPSpeculatorDrafterConfig(Strict):
    """IBM-style MLP speculator: recurrent MLP stages over the target's final hidden state and the previous
    token's embedding."""

    kind: Literal["mlp_speculator"] = "mlp_speculator"
    n_predict: int = Field(3, gt=0)
    """Stages; stage k predicts the token k+2 positions ahead (the draft length is at most n_predict)."""
    inner_dim: int | None = Field(None, gt=0)
    """Stage width; None = the target's (then the heads and embeddings start as the target's)."""
    head_decay: float = Field(0.8, gt=0, le=1)
    """Loss weight of stage k is head_decay**k."""
    draft_vocab: int | None = Field(None, gt=1)
    """Every stage's LM head keeps only the N most frequent response tokens (as for Medusa / Hydra heads)."""


@dataclass(frozen=True)
class MLPSpeculatorConfig:
    dim: int
    vocab_size: int
    n_predict: int = 3
    inner_dim: int | None = None
    head_vocab_size: int | None = None  # reduced draft vocabulary (models/feature_heads.py); None = full

    @property
    def inner(self) -> int:
        return self.inner_dim or self.dim

    def to_dict(self) -> dict:
        return asdict(self)


class MLPSpeculator(FeatureHeads):
    def __init__(self, cfg: MLPSpeculatorConfig):
        super().__init__()
        self.cfg = cfg
        K, d, inner = cfg.n_predict, cfg.dim, cfg.inner
        self.emb = nn.ModuleList(nn.Embedding(cfg.vocab_size, inner) for _ in range(K))
        self.proj = nn.ModuleList(nn.Linear(d if k == 0 else inner, inner, bias=False) for k in range(K))
        self.ln = nn.ModuleList(nn.LayerNorm(inner) for _ in range(K))
        self.head = nn.ModuleList(nn.Linear(inner, cfg.head_vocab_size or cfg.vocab_size, bias=False) for _ in range(K))
        if cfg.head_vocab_size:
            self._init_vocab_maps(cfg.head_vocab_size, cfg.vocab_size)
        self.state_weight = 0.5 ** (0.5 / K)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (inner / 2))

    @property
    def max_draft_len(self) -> int:
        return self.cfg.n_predict

    def _stage(self, k: int, state, tokens):
        mixed = self.proj[k](state) + self.emb[k](tokens) * (self.emb_weight / self.state_weight)
        return F.gelu(self.ln[k](mixed))

    def forward(
        self, h: torch.Tensor, ids: torch.Tensor | None = None, select=None, head_fn=None, pos=None, attn_mask=None
    ):
        """Teacher-forced training pass. h (B, T, D) target hidden states and ids (B, T) the sequence; stage k at
        position t reads token t+k+1. Returns ``[head_fn(k, state_k[select[k]], head_k.weight)]``, or the
        (K, B, T, V) logits without head_fn. pos / attn_mask (a packed batch) change nothing: no stage mixes
        positions, and the selected ones read tokens of their own document."""
        B, T, _ = h.shape
        state, outs = h, []
        for k in range(self.cfg.n_predict):
            nxt = torch.zeros_like(ids)
            if k + 1 < T:
                nxt[:, : T - k - 1] = ids[:, k + 1 :]  # past the end: token 0, never selected for a loss
            state = self._stage(k, state, nxt)
            flat = state.reshape(B * T, -1)
            if head_fn is not None:
                outs.append(head_fn(k, flat if select is None else flat[select[k]], self.head[k].weight))
            else:
                outs.append(self.to_target(self.head[k](state), self.cfg.vocab_size))
        return outs if head_fn is not None else torch.stack(outs)

    def draft_step(self, h: torch.Tensor, path: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        state = h
        for k, tok in enumerate(path):  # stage k reads the token after the k-th state
            state = self._stage(k, state, tok.reshape(state.shape[:-1]))
        return self.to_target(self.head[len(path) - 1](state), self.cfg.vocab_size), state

    @property
    def state_dim(self) -> int:
        return self.cfg.inner

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - sum(e.weight.numel() for e in self.emb) if exclude_embeddings else n


def build_mlp_speculator(
    cfg: MLPSpeculatorDrafterConfig | dict, target, counts: torch.Tensor | None = None, eos_ids=frozenset(), **_
) -> MLPSpeculator:
    cfg, tcfg = as_section(MLPSpeculatorDrafterConfig, cfg), target.cfg
    keep = head_vocab(cfg.draft_vocab, target, counts, eos_ids)
    model = MLPSpeculator(
        MLPSpeculatorConfig(
            dim=tcfg.dim,
            vocab_size=tcfg.vocab_size,
            n_predict=cfg.n_predict,
            inner_dim=cfg.inner_dim,
            head_vocab_size=None if keep is None else len(keep),
        )
    )
    if keep is not None:
        model.set_head_vocab(keep)
    if model.cfg.inner == tcfg.dim:  # start the heads and embeddings from the target's own
        with torch.no_grad():
            for k in range(model.cfg.n_predict):
                model.head[k].weight.copy_(target.lm_head.weight if keep is None else target.lm_head.weight[keep])
                model.emb[k].weight.copy_(target.embed_tokens.weight)
    return model.to(target.embed_tokens.weight.dtype)


# No block to wrap: the stages are loose linears, embeddings and norms (FSDP shards the whole speculator as one unit).
# vLLM 0.32 refuses MLPSpeculatorPreTrainedModel and 0.33 removed it: an export for it would not load
VLLM_REFUSAL = (
    "refused: vLLM serves no mlp_speculator (0.32 refuses MLPSpeculatorPreTrainedModel, 0.33 removed it); "
    "--format mlp-speculator writes IBM's layout for TGI and fms-extras"
)


def check_recipe(recipe) -> None:
    """The MLP speculator against the rest of the recipe (DrafterSpec.check): IBM's layout has full-vocabulary
    heads."""
    ex = recipe.export
    if recipe.drafter.draft_vocab and ex.enabled and "mlp-speculator" in ex.formats:
        raise ValueError(
            "export.formats has mlp-speculator, but drafter.draft_vocab reduces the heads' vocabulary, "
            "which IBM's layout cannot express: drop one of them (hf exports either)"
        )


SPEC = DrafterSpec(
    kind="mlp_speculator",
    config=MLPSpeculatorDrafterConfig,
    build=build_mlp_speculator,
    from_config=lambda c: MLPSpeculator(MLPSpeculatorConfig(**c)),
    interface="heads",
    acceptance=HEADS_ACCEPTANCE,
    objective="draftsmith.train.objectives:heads_objective",
    signals=frozenset({"topk", "hidden_last"}),
    packs=True,
    check=check_recipe,
    exports={
        "mlp-speculator": {
            "write": EXPORT + "to_mlp_speculator",
            "read": EXPORT + "read_mlp_speculator",
            "usage": EXPORT + "usage_mlp",
        },
        "vllm": VLLM_REFUSAL,
    },
)
