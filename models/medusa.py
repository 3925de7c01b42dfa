"""Medusa-1 heads (algorithms.md A5.1-A5.2): K heads on the frozen target's final hidden state h_t (after its
final norm). Head k (0-based) predicts token t+k+2 (the target's own LM head predicts t+1).

Head k = ResBlock^L then its own LM head. ResBlock(x) = x + SiLU(W x + b) with W zero-initialised, so every
head starts as the target's LM head (each head's LM head is a copy of it). Unlike the reference code, the L
blocks of a head are separate modules, not one instance repeated (A5.1's quirk).

Decoder protocol: models/feature_heads.py. Medusa's drafts do not depend on each other, which rejection sampling
allows (each draft is drawn from the q it reports).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.feature_heads import FeatureHeads, HeadsConfig, copy_target_head

MedusaConfig = HeadsConfig  # kept as a name: registry and drafter.json configs refer to it


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)  # identity at init: the head starts as the target's LM head

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaHeads(FeatureHeads):
    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(cfg.dim) for _ in range(cfg.n_layers)))
                                    for _ in range(cfg.n_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(cfg.dim, cfg.vocab_size, bias=False) for _ in range(cfg.n_heads))

    @property
    def max_draft_len(self) -> int:
        return self.cfg.n_heads

    def forward(self, h: torch.Tensor, ids: torch.Tensor | None = None, select: list[torch.Tensor] | None = None,
                head_fn=None):
        """h (..., D) target hidden states -> (K, N, V) logits over the flattened positions; or, with ``head_fn``,
        ``[head_fn(k, block_k(h[select[k]]), lm_head_k.weight)]`` (chunked losses run inside forward, where
        sharding wrappers have the weights gathered). ids is unused: Medusa heads read only h."""
        h = h.reshape(-1, h.shape[-1])
        if head_fn is not None:
            return [head_fn(k, blk(h if select is None else h[select[k]]), lm.weight)
                    for k, (blk, lm) in enumerate(zip(self.blocks, self.lm_heads))]
        return torch.stack([lm(blk(h)) for blk, lm in zip(self.blocks, self.lm_heads)])

    def logits_after(self, h: torch.Tensor, path: list[torch.Tensor]) -> torch.Tensor:
        k = len(path) - 1  # Medusa heads ignore the drafted tokens: head k reads only h
        return self.lm_heads[k](self.blocks[k](h))

    def num_params(self, exclude_embeddings: bool = False) -> int:
        return sum(p.numel() for p in self.parameters())


def build_medusa(params: dict, target, **_) -> MedusaHeads:
    tcfg = target.cfg
    if params.get("n_heads", 4) < 1 or params.get("n_layers", 1) < 0:
        raise DraftsmithError("drafter.n_heads must be >= 1 and drafter.n_layers >= 0")
    heads = MedusaHeads(MedusaConfig(dim=tcfg.dim, vocab_size=tcfg.vocab_size, n_heads=params.get("n_heads", 4),
                                     n_layers=params.get("n_layers", 1)))
    copy_target_head(heads.lm_heads, target, params.get("freeze_lm_heads", False))
    return heads.to(target.embed_tokens.weight.dtype)
