"""GliDe: a one-layer draft LM whose cross-attention reads the target's KV cache of the context
(docs/algorithms.md A23).

The drafter is one decoder layer over the target's (frozen) token embeddings: causal self-attention over its own
tokens, then a cross-attention whose keys and values are the target's cached keys and values of one layer
(``cache_layer``, the last by default), then an MLP, the final norm and the target's frozen LM head. The
cross-attention has only a query and an output projection: what it reads the target already computed, so the
drafter sees the whole context through the target's own representation at the cost of one attention read.

When decoding, the target's cache holds the committed tokens, up to the one before the current token, while the
drafter runs at the current token and at the drafts after it: a query at draft depth d reads keys that end d + 1
positions before it. Training reproduces that: ``lags`` passes per batch, pass s letting the query at position j
read the target's keys at positions <= j - s, so the distribution behind each draft depth 0 .. lags-1 is trained
exactly as decoding asks for it (tests/test_glide.py). One layer keeps the drafter's own keys independent of what
the cross-attention read, so the tokens it reads late (an accepted path, at the next step's root) leave the same
keys as in training.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.hf_target import io_weights, layer_state
from draftsmith.models.llama import (
    Block,
    KVCache,
    Llama,
    LlamaConfig,
    RMSNorm,
    apply_rope,
    default_pos,
    rope_cos_sin,
)
from draftsmith.models.spec import DrafterSpec, Strict, as_section


class GlideDrafterConfig(Strict):
    """One decoder layer that reads the target's KV cache through a cross-attention (GliDe)."""

    kind: Literal["glide"] = "glide"
    cache_layer: int = -1
    """The target layer whose cached keys and values the cross-attention reads (negative: from the last)."""
    lags: int = Field(4, gt=0)
    """Training passes per batch: pass s reads the target's keys up to s positions before each query, as drafts at
    depth s - 1 do when decoding. Set it to the draft length (or tree depth) you decode with."""
    init_layer: int | None = 0
    """The target layer the self-attention, MLP and norms start from (0, the first: its weights expect token
    embeddings); the cross-attention's query projection and norm start as ``cache_layer``'s and its output
    projection at zero, so the drafter starts as that one-layer draft LM and learns what to read from the cache.
    None: all fresh."""
    hidden_dim: int | None = Field(None, gt=0)
    """MLP width; None = the target's (needed by init_layer)."""


@dataclass(frozen=True)
class GlideConfig(LlamaConfig):
    """The draft layer's sizes (the target's, one layer) plus the cache layer it reads and its training lags."""

    cache_layer: int = 0  # absolute index into the target's layers
    lags: int = 4


@dataclass
class Glimpse:
    """What the cross-attention reads: the target's keys and values (B, Hkv, S, hd), a (B|1, 1, T|1, S) bool mask of
    the keys each query may read (None: all), ``order`` when the target stores its keys in interleaved-RoPE order
    (models/llama.py ``interleave_rope``: the query is permuted the same way), ``dead`` (B|1, T) queries that read
    nothing (their output is zero). ``cos`` / ``sin`` are set by the drafter's forward."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None
    order: torch.Tensor | None = None
    dead: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class CrossAttention(nn.Module):
    """Queries from the drafter, keys and values from the target's cache (already projected and rotated)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.hd, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.hd, cfg.norm_eps)

    def forward(self, x: torch.Tensor, g: Glimpse) -> torch.Tensor:
        B, T, _ = x.shape
        H, hd = self.cfg.n_heads, self.cfg.hd
        q = self.q_proj(x).view(B, T, H, hd)
        if self.cfg.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), g.cos, g.sin)
        if g.order is not None:
            q = q[..., g.order]
        k, v = g.k.to(q.dtype), g.v.to(q.dtype)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, enable_gqa=k.shape[1] != H)
        if g.dead is not None:
            y = y.masked_fill(g.dead[:, None, :, None], 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))


class GlideBlock(Block):
    """Self-attention, cross-attention over the target's cache (``glimpse``, set by ``Glide.forward``), MLP."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg)
        self.cross_attn_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.cross_attn = CrossAttention(cfg)
        self.glimpse: Glimpse | None = None

    def forward(self, x, cos, sin, mask, cache, layer, attend=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        if self.glimpse is not None:
            x = x + self.cross_attn(self.cross_attn_layernorm(x), self.glimpse)
        return x + self.mlp(self.post_attention_layernorm(x))


class Glide(Llama):
    """A one-layer draft LM (``Llama``'s cache, heads and decoding contract) whose layer also reads the target's KV
    cache: ``forward(..., glimpse=Glimpse)``. Without a glimpse the cross-attention adds nothing (the decoder's
    prompt read, whose outputs it discards, and whose keys do not depend on it)."""

    reads_target_cache = True

    def __init__(self, cfg: GlideConfig):
        super().__init__(cfg)
        self.layers = nn.ModuleList([GlideBlock(cfg)])

    def forward(self, ids: torch.Tensor, pos: torch.Tensor | None = None, cache=None, glimpse: Glimpse | None = None,
                **kw):  # fmt: skip
        if glimpse is not None:
            p = default_pos(ids, cache) if pos is None else pos
            glimpse.cos, glimpse.sin = rope_cos_sin(p, self.inv_freq, self.embed_tokens.weight.dtype)
        self.layers[0].glimpse = glimpse
        try:
            return super().forward(ids, pos=pos, cache=cache, **kw)
        finally:
            self.layers[0].glimpse = None

    def glimpse_of(self, cache, order: torch.Tensor | None = None) -> Glimpse:
        """The target's cache as the drafter reads it while decoding: layer ``cache_layer``'s keys and values at
        every valid slot (the committed context; a batch's holes and padding masked)."""
        _check_slots(cache)
        S, i = cache.length, self.cfg.cache_layer
        k, v = cache.k[i][:, :, :S], cache.v[i][:, :, :S]
        if k.shape[1] != self.cfg.n_kv_heads or k.shape[-1] != self.cfg.hd:
            raise DraftsmithError(
                f"drafter.kind=glide: the target's cache layer {i} holds {k.shape[1]} heads of {k.shape[-1]} "
                f"channels, the drafter was built for {self.cfg.n_kv_heads} of {self.cfg.hd}"
            )
        return Glimpse(k, v, cache.valid[:, None, None, :S], order)


def _check_slots(cache):
    if not isinstance(cache, KVCache):
        raise DraftsmithError(
            f"drafter.kind=glide reads the target's slot KV cache; this target keeps a {type(cache).__name__} "
            f"(a transformers model without a 4-D attention mask): use another drafter kind"
        )
    return cache


def key_order(target) -> torch.Tensor | None:
    """The channel order of ``target``'s cached keys relative to rotate-half RoPE: None, or the interleaved order
    ``optimize_for_inference`` gives a float32 own-Llama target."""
    target = getattr(target, "model", target)  # a CUDA-graph wrapper's model
    if not getattr(target, "_rope_interleaved", False):
        return None
    hd = target.cfg.hd
    order = torch.stack([torch.arange(hd // 2), torch.arange(hd // 2, hd)], 1).flatten()
    return order.to(target.embed_tokens.weight.device)


@torch.no_grad()
def target_kv(target, ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's keys and values of ``layer`` over ``ids`` (B, T): (B, Hkv, T, hd) each, as its cache holds
    them when decoding (training's side of ``Glide.glimpse_of``)."""
    cache = _check_slots(target.new_cache(*ids.shape))
    target(ids, cache=cache, logits_at=torch.zeros(1, dtype=torch.long, device=ids.device), return_hidden=True)
    T = ids.shape[1]
    return cache.k[layer][:, :, :T], cache.v[layer][:, :, :T]


def lagged(k: torch.Tensor, v: torch.Tensor, lag: int, order: torch.Tensor | None = None) -> Glimpse:
    """Training's glimpse for pass ``lag``: the query at position j reads the target's keys at positions <= j - lag;
    the first ``lag`` positions read nothing."""
    T, dev = k.shape[2], k.device
    j, i = torch.arange(T, device=dev)[:, None], torch.arange(T, device=dev)[None]
    see = i <= j - lag
    dead = ~see.any(1)
    see = see | (dead[:, None] & (i == 0))  # a query with no key reads slot 0, then its output is zeroed
    return Glimpse(k, v, see[None, None], order, dead[None])


def build_glide(cfg: GlideDrafterConfig | dict, target, **_) -> Glide:
    p = as_section(GlideDrafterConfig, cfg)
    t = target.cfg
    n = t.n_layers
    if not -n <= p.cache_layer < n:
        raise DraftsmithError(f"drafter.cache_layer={p.cache_layer} is outside the target's {n} layers")
    layer = p.cache_layer % n
    base = replace(t, n_layers=1, hidden_dim=p.hidden_dim or t.hidden_dim, sliding_window=None, head_vocab_size=None)
    mc = GlideConfig(**{**base.to_dict(), "cache_layer": layer, "lags": p.lags})
    draft = Glide(mc).to(target.embed_tokens.weight.dtype)
    embed, norm, head = io_weights(target, "drafter.kind=glide")
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed)
        draft.norm.weight.copy_(norm)
        if not mc.tie_embeddings:
            draft.lm_head.weight.copy_(head)
        if p.init_layer is not None:
            _init_from_target(draft, target, p.init_layer, layer)
    draft.embed_tokens.weight.requires_grad_(False)
    draft.lm_head.weight.requires_grad_(False)
    return draft


def _init_from_target(draft: Glide, target, start: int, layer: int) -> None:
    """The layer starts as the target's layer ``start``; the cross-attention's query projection and norms as
    ``layer``'s attention, its output projection zero (it adds nothing until trained)."""
    blk, n = draft.layers[0], target.cfg.n_layers
    if not -n <= start < n:
        raise DraftsmithError(f"drafter.init_layer={start} is outside the target's {n} layers")
    if draft.cfg.hidden_dim != target.cfg.hidden_dim:
        raise DraftsmithError("drafter.init_layer needs drafter.hidden_dim to be the target's (or null)")
    try:
        first, src = (layer_state(target, i, "drafter.init_layer") for i in (start % n, layer))
    except DraftsmithError as e:
        raise DraftsmithError(f"{str(e).split(';')[0]}; set drafter.init_layer=null") from None
    blk.load_state_dict(first, strict=False)  # (the cross-attention is not in a plain layer)
    keep = (["self_attn", "q_proj"], ["self_attn", "q_norm"])
    blk.cross_attn.load_state_dict(
        {k.split(".", 1)[1]: w for k, w in src.items() if k.split(".")[:2] in keep}, strict=False
    )
    blk.cross_attn.o_proj.weight.zero_()
    blk.cross_attn_layernorm.weight.copy_(src["input_layernorm.weight"])


REFUSED = "refused: no serving engine runs a drafter that reads the target's KV cache; export --format hf"

SPEC = DrafterSpec(
    kind="glide",
    config=GlideDrafterConfig,
    build=build_glide,
    from_config=lambda c: Glide(GlideConfig(**c)),
    interface="tokens",
    objective="draftsmith.train.objectives:glide_objective",
    signals=frozenset({"topk"}),
    needs_target=True,
    fsdp_wrap=(GlideBlock,),
    exports={"vllm": REFUSED, "sglang": REFUSED},
)
