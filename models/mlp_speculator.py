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

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.feature_heads import FeatureHeads, head_vocab


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
        self.head = nn.ModuleList(nn.Linear(inner, cfg.head_vocab_size or cfg.vocab_size, bias=False)
                                  for _ in range(K))
        if cfg.head_vocab_size:
            self._init_vocab_maps(cfg.head_vocab_size, cfg.vocab_size)
        self.state_weight = 0.5 ** (0.5 / K)
        self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (inner / 2))

    @property
    def max_draft_len(self) -> int:
        return self.cfg.n_predict

    def _stage(self, k: int, state, tokens):
        mixed = self.proj[k](state) + self.emb[k](tokens) * (self.emb_weight / self.state_weight)
        return F.gelu(self.ln[k](mixed))

    def forward(self, h: torch.Tensor, ids: torch.Tensor | None = None, select=None, head_fn=None):
        """Teacher-forced training pass. h (B, T, D) target hidden states and ids (B, T) the sequence; stage k at
        position t reads token t+k+1. Returns ``[head_fn(k, state_k[select[k]], head_k.weight)]``, or the
        (K, B, T, V) logits without head_fn."""
        B, T, _ = h.shape
        state, outs = h, []
        for k in range(self.cfg.n_predict):
            nxt = torch.zeros_like(ids)
            if k + 1 < T:
                nxt[:, :T - k - 1] = ids[:, k + 1:]  # past the end: token 0, never selected for a loss
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


def build_mlp_speculator(params: dict, target, counts: torch.Tensor | None = None, eos_ids=frozenset(),
                         **_) -> MLPSpeculator:
    tcfg = target.cfg
    if params.get("n_predict", 3) < 1:
        raise DraftsmithError("drafter.n_predict must be >= 1")
    keep = head_vocab(params, target, counts, eos_ids)
    model = MLPSpeculator(MLPSpeculatorConfig(dim=tcfg.dim, vocab_size=tcfg.vocab_size,
                                              n_predict=params.get("n_predict", 3),
                                              inner_dim=params.get("inner_dim"),
                                              head_vocab_size=None if keep is None else len(keep)))
    if keep is not None:
        model.set_head_vocab(keep)
    if model.cfg.inner == tcfg.dim:  # start the heads and embeddings from the target's own
        with torch.no_grad():
            for k in range(model.cfg.n_predict):
                model.head[k].weight.copy_(target.lm_head.weight if keep is None else target.lm_head.weight[keep])
                model.emb[k].weight.copy_(target.embed_tokens.weight)
    return model.to(target.embed_tokens.weight.dtype)
