"""Hydra heads (docs/algorithms.md A5.5): sequentially dependent Medusa-style heads. Head k reads the target's final
hidden state h_t *and* the embeddings of the tokens before the one it predicts:

    input_k = concat[h_t, e(x_{t+1}), ..., e(x_{t+k+1})]        ((k+2) d wide)
    head_k  = ResBlock((k+2)d -> d, linear residual projection), (L-1) ResBlock(d), LM head (copy of the target's)

e() is the target's input embedding, kept frozen (a copy travels with the checkpoint). In training the tokens
are the true ones (teacher forcing); in decoding, the target's token for x_{t+1} and the drafts after it.
Head k predicts token t+k+2, as Medusa head k does.

**Hydra++** (``prefix_attention``): h_t is replaced by the output of one extra Llama decoder layer run causally over
the target's final hidden states h_0..h_t, so the heads see the context, not one position. Its output
projections start at zero, so the layer starts as the identity (Hydra++ starts as Hydra). In decoding the layer
keeps its own KV cache over the committed positions (``new_context`` / ``read_context``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from draftsmith.models.feature_heads import (
    HEADS_ACCEPTANCE,
    FeatureHeads,
    HeadsConfig,
    HeadsSection,
    copy_target_head,
    head_vocab,
)
from draftsmith.models.llama import Block, KVCache, LlamaConfig, prepare_cache, rope_cos_sin, rope_inv_freq
from draftsmith.models.spec import DrafterSpec, as_section


class HydraDrafterConfig(HeadsSection):
    """Hydra heads: Medusa-style heads that also read the embeddings of the tokens drafted before them (the
    first block narrows (k+2)*d to d; n_layers >= 1). Hydra weighs heads equally: head_decay 1.0."""

    kind: Literal["hydra"] = "hydra"
    n_layers: int = Field(1, gt=0)
    """Blocks per head (>= 1: the first narrows the concatenated inputs to the model width)."""
    head_decay: float = Field(1.0, gt=0, le=1)
    """Loss weight of head k is head_decay**k (Hydra weighs heads equally)."""
    prefix_attention: bool = False
    """Hydra++: one extra decoder layer (the target's shapes, its own KV cache in decoding) runs causally over the
    target's hidden states and the heads read its output, so they see the context, not one position."""


@dataclass(frozen=True)
class HydraConfig(HeadsConfig):
    prefix: dict | None = None  # Hydra++: the LlamaConfig (one layer, the target's shapes) of the prefix layer


class WideResBlock(nn.Module):
    """x (n_in) -> proj(x) + SiLU(W x + b) (d): a residual block whose input is wider than its output."""

    def __init__(self, n_in: int, dim: int):
        super().__init__()
        self.linear = nn.Linear(n_in, dim)
        self.proj = nn.Linear(n_in, dim, bias=False) if n_in != dim else nn.Identity()

    def forward(self, x):
        return self.proj(x) + F.silu(self.linear(x))


class HydraHeads(FeatureHeads):
    def __init__(self, cfg: HydraConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.embed = nn.Embedding(cfg.vocab_size, d)  # the target's input embedding, frozen
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(
            nn.Sequential(WideResBlock((k + 2) * d, d), *(WideResBlock(d, d) for _ in range(cfg.n_layers - 1)))
            for k in range(cfg.n_heads)
        )
        self.lm_heads = nn.ModuleList(
            nn.Linear(d, cfg.head_vocab_size or cfg.vocab_size, bias=False) for _ in range(cfg.n_heads)
        )
        if cfg.head_vocab_size:
            self._init_vocab_maps(cfg.head_vocab_size, cfg.vocab_size)
        if cfg.prefix is not None:
            self.prefix_cfg = LlamaConfig(**cfg.prefix)
            self.prefix = Block(self.prefix_cfg)
            nn.init.zeros_(self.prefix.self_attn.o_proj.weight)  # identity at init
            nn.init.zeros_(self.prefix.mlp.down_proj.weight)
            self.register_buffer("inv_freq", rope_inv_freq(self.prefix_cfg), persistent=False)

    @property
    def max_draft_len(self) -> int:
        return self.cfg.n_heads

    def new_context(self, max_len: int, batch: int = 1):
        if self.cfg.prefix is None:
            return None
        p = self.embed.weight  # (the LM heads may be pre-packed, without a weight)
        return KVCache(self.prefix_cfg, batch, max_len, p.dtype, p.device)

    def read_context(
        self,
        hs: torch.Tensor,
        cache: KVCache | None = None,
        pos: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(n, D) or (B, n, D) with a cache (decoding, appended after the committed positions; ``pos`` / ``valid``
        (B, n) for left-padded rows) or (B, T, D) without (training, causal over the whole sequence, or over each
        document of a packed row: ``pos`` and ``attn_mask`` (B, T, T)) -> the prefix layer's outputs, same shape."""
        if self.cfg.prefix is None:
            return hs
        x = hs if hs.dim() == 3 else hs[None]
        B, T, _ = x.shape
        start = cache.length if cache is not None else 0
        if pos is None:
            pos = torch.arange(start, start + T, device=x.device).expand(B, T)
        cos, sin = rope_cos_sin(pos, self.inv_freq, x.dtype)
        mask = prepare_cache(cache, T, valid, None) if cache is not None else None
        if cache is None and attn_mask is not None:
            mask = attn_mask[:, None]
        y = self.prefix(x, cos, sin, mask, cache, 0)
        if cache is not None:
            cache.length += T
        return y if hs.dim() == 3 else y[0]

    def optimize_for_inference(self) -> HydraHeads:
        """The prefix layer's q/k/v and gate/up matmuls fused like the target's, then every matmul pre-packed."""
        from draftsmith.models.llama import fuse_layers

        counts = (self.num_params(), self.num_params(exclude_embeddings=True))
        if self.cfg.prefix is not None:
            fuse_layers([(self.prefix.self_attn, self.prefix.mlp)])
        super().optimize_for_inference()
        self.num_params = lambda exclude_embeddings=False: counts[exclude_embeddings]  # as before the fusion
        return self

    def forward(
        self, h: torch.Tensor, ids: torch.Tensor | None = None, select=None, head_fn=None, pos=None, attn_mask=None
    ):
        """Teacher-forced pass: h (B, T, D), ids (B, T); head k at t reads tokens t+1..t+k+1. Returns
        ``[head_fn(k, x_k[select[k]], lm_head_k.weight)]`` or the (K, B, T, V) logits. pos / attn_mask: a packed
        batch's documents, for the prefix layer (``read_context``)."""
        h = self.read_context(h, pos=pos, attn_mask=attn_mask)
        B, T, D = h.shape
        parts, outs = [h], []
        for k in range(self.cfg.n_heads):
            nxt = torch.zeros_like(ids)
            if k + 1 < T:
                nxt[:, : T - k - 1] = ids[:, k + 1 :]  # past the end: token 0, never selected for a loss
            parts.append(self.embed(nxt).to(h.dtype))
            x = self.blocks[k](torch.cat(parts, -1))
            flat = x.reshape(B * T, D)
            if head_fn is not None:
                outs.append(head_fn(k, flat if select is None else flat[select[k]], self.lm_heads[k].weight))
            else:
                outs.append(self.to_target(self.lm_heads[k](x), self.cfg.vocab_size))
        return outs if head_fn is not None else torch.stack(outs)

    def draft_step(self, h: torch.Tensor, path: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k = len(path) - 1
        x = self.blocks[k](torch.cat([h, *(self.embed(t.reshape(h.shape[:-1])).to(h.dtype) for t in path)], -1))
        return self.to_target(self.lm_heads[k](x), self.cfg.vocab_size), x

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embeddings else n


def build_hydra(
    cfg: HydraDrafterConfig | dict, target, counts: torch.Tensor | None = None, eos_ids=frozenset(), **_
) -> HydraHeads:
    cfg, tcfg = as_section(HydraDrafterConfig, cfg), target.cfg
    prefix = None
    if cfg.prefix_attention:  # Hydra++: one decoder layer shaped like the target's
        prefix = {**tcfg.to_dict(), "n_layers": 1, "head_vocab_size": None}
    keep = head_vocab(cfg.draft_vocab, target, counts, eos_ids)
    heads = HydraHeads(
        HydraConfig(
            dim=tcfg.dim,
            vocab_size=tcfg.vocab_size,
            n_heads=cfg.n_heads,
            n_layers=cfg.n_layers,
            prefix=prefix,
            head_vocab_size=None if keep is None else len(keep),
        )
    )
    if keep is not None:
        heads.set_head_vocab(keep)
    with torch.no_grad():
        heads.embed.weight.copy_(target.embed_tokens.weight)
    copy_target_head(heads.lm_heads, target, cfg.freeze_lm_heads, keep)
    return heads.to(target.embed_tokens.weight.dtype)


SPEC = DrafterSpec(
    kind="hydra",
    config=HydraDrafterConfig,
    build=build_hydra,
    from_config=lambda c: HydraHeads(HydraConfig(**c)),
    interface="heads",
    acceptance=HEADS_ACCEPTANCE,
    objective="draftsmith.train.objectives:heads_objective",
    signals=frozenset({"topk", "hidden_last"}),
    fsdp_wrap=(WideResBlock, Block),
    packs=True,
)  # Block: Hydra++'s prefix layer
