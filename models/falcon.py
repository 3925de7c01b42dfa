"""Falcon (docs/algorithms.md A22): a semi-autoregressive feature drafter, k drafts per forward in blocks.

An EAGLE-1 layer (models/eagle.py: fc([e(x_{i+1}); f_i]), one Llama layer, the target's frozen LM head, SmoothL1 onto
the target's features) whose output at position j predicts the feature k positions on, f_{j+k}, and so the token
x_{j+k+1}. The k positions of a block attend to each other in full, so one forward over the last k pairs drafts
k tokens: block slot s (position n-k+1+s, seeing up to n) drafts x_{n+s+2}, draft s+1 after the current token
x_{n+1}. The next block reads those k predicted features with the k drafted tokens and drafts the next k.

**Training** (teacher-forced, the target's features): pass a = 0..k-1 lets the query at j see the pairs up to j+a
(in its document) and predicts f_{j+k}: exactly what block slot k-1-a sees and predicts, so every position
trains every slot, and the first block's drafts are the objective's predictions (tests/test_train_serve_match.py).
**CSGD** (coupled sequential glancing distillation, ``glance``): a no-gradient run of pass a counts the positions
whose top-1 misses; ``glance`` x that many positions, drawn at random, see the next 1..k-1-a real (feature,
token) pairs too: the ground truth of drafts of their own block, feature and token together, a run from the
first on (GLAT's glancing, which the reference decays over epochs from 0.45 to 0.1).

One layer: a position's keys and values depend on its own input only, so the decoder writes every drafted pair
once, as EAGLE's tree nodes, and a block's outputs are queries over the cache (``read``) that write nothing.
Decoding: eval/proposers.py ``BlockFeatureRows``. No serving engine has the layout: export --format hf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from draftsmith.models.eagle import Eagle, EagleConfig, EagleDrafterConfig, build_on_eagle, ttt_result
from draftsmith.models.llama import apply_rope, fuse_for_inference, rope_cos_sin
from draftsmith.models.spec import DrafterSpec, as_section


class FalconDrafterConfig(EagleDrafterConfig):
    """Falcon: an EAGLE-1 layer drafting ``block_size`` tokens per forward in blocks, trained on every block slot
    with coupled sequential glancing; decodes as a chain or a tree."""

    kind: Literal["falcon"] = "falcon"
    version: Literal[1] = 1
    """Falcon's layer is EAGLE-1's (its blocks read predicted features, so it regresses them)."""
    block_size: int = Field(2, ge=2, le=8)
    """k: drafts per forward; the output at j predicts the token k + 1 positions on."""
    max_blocks: int = Field(4, ge=1, le=16)
    """Blocks a step may draft: draft length and tree depth up to block_size * max_blocks."""
    glance: float = Field(0.3, ge=0, le=1)
    """CSGD: this fraction of the positions whose top-1 misses in a first, no-gradient pass see the true next pairs
    of their block in the training pass (0 = off)."""

    @model_validator(mode="before")
    @classmethod
    def _block(cls, data):
        if not isinstance(data, dict):
            return data
        for f in ("parallel_drafts", "partial_alignment", "ttt_detach", "sliding_window"):
            if data.get(f):
                raise ValueError(f"drafter.{f} does not apply to Falcon's blocks (drafter.kind=falcon)")
        if data.get("n_layers", 1) != 1:
            raise ValueError(
                "drafter.n_layers: Falcon here is one layer (a drafted pair's keys then depend on that pair alone, "
                "so the decoder reads each block as training did)"
            )
        k, t = data.get("block_size", 2), data.get("ttt_steps")
        if t is not None and t != k:
            raise ValueError(f"drafter.ttt_steps is {t}: Falcon trains one pass per block slot, block_size = {k}")
        return {"version": 1, **data, "ttt_steps": k}  # (EAGLE's defaults read the version next)


@dataclass(frozen=True)
class FalconConfig(EagleConfig):
    block: int = 2  # drafts per forward
    max_blocks: int = 4


class Falcon(Eagle):
    graphable = False  # ``read`` attends over the cache without writing to it: no static-shape CUDA graph

    @property
    def drafts_blocks(self) -> int:
        """Drafts per forward: eval/proposers.py ``BlockFeatureRows`` decodes it."""
        return self.cfg.block

    @property
    def max_draft_len(self) -> int:
        return self.cfg.block * self.cfg.max_blocks

    def draft_positions(self, steps: int) -> int:
        return self.cfg.block

    def output_lag(self, s: int) -> int:
        """Draft s + 1 after the pair at t (the anchor) is the output at t - (block - 1 - s): the block slot s."""
        return self.cfg.block - 1 - s

    def logits(self, feats: torch.Tensor) -> torch.Tensor:
        """Predicted features -> token logits in the target's vocabulary (the frozen head)."""
        return self.lm_head(self.head_input(feats))

    def _layer(self, state, ids, pos, allowed):
        e = self.embed(ids)
        x, resid = self._inputs(e, state)
        cos, sin = rope_cos_sin(pos, self.inv_freq, x.dtype)
        return self._finish(resid + self.self_attn(x, cos, sin, allowed[:, None], None, 0))

    def read(self, state, ids, pos, cache, allowed) -> torch.Tensor:
        """The layer's outputs (B, n, d) for pairs (state, ids) at positions ``pos`` (B, n), attending to the
        cache's slots where ``allowed`` (B, n, S = cache.length) and valid; nothing is written."""
        a, lc = self.self_attn, self.cfg.layer_config()
        B, n = ids.shape
        x, resid = self._inputs(self.embed(ids), state)
        cos, sin = rope_cos_sin(pos, self.inv_freq, x.dtype)
        q = a.q_proj(x).view(B, n, lc.n_heads, lc.hd)
        if lc.qk_norm:
            q = a.q_norm(q)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        S = cache.length
        mask = (allowed & cache.valid[:, None, :S])[:, None]
        k, v = cache.k[0][:, :, :S], cache.v[0][:, :, :S]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=lc.n_kv_heads != lc.n_heads)
        return self._finish(resid + a.o_proj(y.transpose(1, 2).reshape(B, n, -1)))

    @torch.no_grad()
    def optimize_for_inference(self) -> Falcon:
        """The LM head pre-packed; the layer stays unfused (``read`` uses its q projection on its own)."""
        return fuse_for_inference(self, [])

    def forward(self, feats, ids, steps=1, select=None, head_fn=None, pos=None, attn_mask=None, glance=None, **_):
        """Pass a (a = block-1 .. 0, returned as draft s + 1 = block - a) over the whole sequence: pair i is
        (f_i, x_{i+1}); the query at j sees the pairs up to j + a of its document and predicts f_{j+block}.
        ``select[s]`` are anchors t (the last known pair): result s reads the output at t - ``output_lag(s)``.
        ``glance`` (ratio, selects, labels per result, generator): CSGD's extra look for missed positions.
        Returns ``Eagle.forward``'s contract."""
        k, (B, T) = self.cfg.block, ids.shape
        tok = torch.zeros_like(ids)
        tok[:, : T - 1] = ids[:, 1:]
        state = self.project(feats)
        base = torch.arange(T, device=ids.device).expand(B, T) if pos is None else pos
        ahead = torch.arange(T, device=ids.device)[None, :] - torch.arange(T, device=ids.device)[:, None]  # i - j
        doc = None if attn_mask is None else attn_mask | attn_mask.transpose(1, 2)  # same document, either way
        outs = []
        for s in range(k):
            a = torch.full((B, T), k - 1 - s, device=ids.device)
            at = None if select is None else select[s] - self.output_lag(s)  # the outputs result s reads
            if glance is not None and glance[0] > 0 and s > 0:
                a = a + self._glance(state, tok, base, a, ahead, doc, (glance[0], at, glance[2][s], glance[3]), s)
            allowed = ahead[None] <= a[:, :, None]
            outs.append(self._layer(state, tok, base, allowed if doc is None else allowed & doc))
        if head_fn is None:
            return torch.stack(outs)
        sel = None if select is None else [select[s] - self.output_lag(s) for s in range(k)]
        return [ttt_result(self, s, out, sel, head_fn) for s, out in enumerate(outs)]

    @torch.no_grad()
    def _glance(self, state, tok, base, a, ahead, doc, glance, s) -> torch.Tensor:
        """CSGD for the pass drafting s + 1: its top-1 misses counted at the trained positions (no gradient), then
        round(ratio x misses) of those positions drawn to see 1..s more real pairs -> extra look (B, T)."""
        ratio, sel, labels, gen = glance
        allowed = ahead[None] <= a[:, :, None]
        out = self._layer(state, tok, base, allowed if doc is None else allowed & doc)
        x = self.head_input(out).flatten(0, 1)[sel]
        misses = int((x @ self.lm_head.weight.t()).argmax(-1).ne(labels).sum())
        extra = torch.zeros(a.numel(), dtype=a.dtype, device=a.device)
        n = min(round(ratio * misses), len(sel))
        if n:
            pick = sel[torch.randperm(len(sel), generator=gen, device=gen.device)[:n].to(sel.device)]
            draw = torch.randint(1, s + 1, (n,), generator=gen, device=gen.device).to(a.device)
            extra[pick] = draw
        return extra.view_as(a)


def build_falcon(cfg: FalconDrafterConfig | dict, target, **data) -> Falcon:
    """The layer built as ``build_eagle`` builds an EAGLE-1 drafter, its weights moved into a Falcon."""
    p = as_section(FalconDrafterConfig, cfg)
    return build_on_eagle(Falcon, FalconConfig, p, {"block": p.block_size, "max_blocks": p.max_blocks}, target, **data)


REFUSED = "refused: no serving engine drafts Falcon's blocks; export --format hf"

SPEC = DrafterSpec(
    kind="falcon",
    config=FalconDrafterConfig,
    build=build_falcon,
    from_config=lambda c: Falcon(FalconConfig(**c)),
    interface="features",
    objective="draftsmith.train.objectives:eagle_objective",
    signals=frozenset({"topk", "hidden_last"}),
    packs=True,
    exports={"vllm": REFUSED, "sglang": REFUSED},
)
