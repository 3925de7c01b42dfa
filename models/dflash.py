"""DFlash (block-diffusion drafting): a few non-causal layers that draft a whole block of tokens in one forward,
conditioned on the target's hidden states (docs/algorithms.md A14).

The context is not tokens but target features. At every committed position the target's hidden states at
``target_layers`` are concatenated and fused by ``fc`` into one vector per position; ``hidden_norm`` normalises
it, and each draft layer projects it through its own k/v projections (k RMS-normed per head, RoPE at the
position) into that layer's keys and values. Those context keys are written once, when the position is
committed, and never change (``read_context``).

A step's query block is the current token (the target's last sample, whose features do not exist yet) followed
by ``mask`` placeholders, at the next positions. Every block slot attends to all context keys before the block and
to every slot of the block (no causal mask inside it). The output at mask slot j is the distribution of the token
at that slot's position: draft j. No draft depends on another, so all of a step's drafts come from one forward
(``block``), and sampling each from its own q_j is a valid proposal for the chain's rejection rule, as for PARD.

The layers are Qwen3-style (q/k RMS norm per head), the embeddings and LM head are the target's (copied, frozen),
and the mask placeholder has its own trained embedding (``mask_embed``) under a target token id (``mask_token``),
the layout vLLM's ``dflash`` method loads (draftsmith/export/formats.py ``to_dflash``).

Training (train/objectives.py ``dflash_objective``): random anchors a over each record's response; the block at
a is [x_a, mask, ...] at positions a..a+K-1 and sees the features of positions < a; mask slot j learns token
x_{a+j} from the teacher's distribution for it, weighted exp(-(j-1)/decay_gamma). Many anchors train per record
in one forward, each block masked to its own context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import Block, KVCache, LlamaConfig, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from draftsmith.models.spec import EXPORT, OBJ, DrafterSpec, Strict, as_section


class DFlashDrafterConfig(Strict):
    """A DFlash block drafter: a few non-causal Qwen3-style layers over the target's fused hidden states."""

    kind: Literal["dflash"] = "dflash"
    n_layers: int = Field(2, gt=0)
    """Draft layers (each one target layer's shape, with q/k norms)."""
    block_size: int = Field(8, ge=2)
    """Block length in training: the current token plus block_size - 1 masks. Decoding drafts at most
    block_size - 1 tokens per step, fewer when eval.draft_len or a tree asks for less."""
    target_layers: list[int] | None = None
    """Target layers (0-based, their outputs) whose hidden states are fused. None: n_features layers evenly spaced
    from layer 1 to layer L-3."""
    n_features: int = Field(3, gt=0)
    """How many target layers are fused when target_layers is None."""
    mask_token: int | None = Field(None, ge=0)
    """The target token id that stands for a mask slot (its embedding is the drafter's own trained vector). None:
    the target's last id."""
    anchors: int = Field(8, gt=0)
    """Blocks trained per record and step, at random response positions."""
    decay_gamma: float | None = Field(7.0, gt=0)
    """Mask slot j's loss weight exp(-(j-1)/decay_gamma): early drafts matter most. None: every slot weighs 1."""
    init_layers: list[int] | None = None
    """Target layers whose weights start the draft layers (one per layer); None: random layers."""
    sliding_window: int | None = Field(None, gt=1)
    """Each block slot at position p sees the context at positions > p - N only (the whole block always), in
    training and decoding alike, so a drafter trained on short records meets familiar distances on long contexts.
    vLLM's DFlash reads it as dflash_config.use_swa / swa_window_size. Not below block_size; None = all context."""

    @model_validator(mode="after")
    def _window(self):
        if self.sliding_window is not None and self.sliding_window < self.block_size:
            raise ValueError(
                f"drafter.sliding_window={self.sliding_window} is below drafter.block_size={self.block_size}: "
                "every block slot must see its whole block"
            )
        return self


@dataclass(frozen=True)
class DFlashConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    head_dim: int
    target_layers: tuple[int, ...]
    mask_id: int
    block_size: int = 8
    target_dim: int | None = None  # the fused features' width per layer (the target's hidden size)
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    sliding_window: int | None = None  # a slot at p sees context positions > p - sliding_window; None = all

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d

    def layer_cfg(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            hidden_dim=self.hidden_dim,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            norm_eps=self.norm_eps,
            max_seq_len=self.max_seq_len,
            qk_norm=True,
        )


class DFlash(nn.Module):
    """Decoder protocol (eval/proposers.py ``BlockRows``): ``drafts_block``, ``capture_layers`` and ``features``
    (what a target forward must capture), ``new_cache`` (context keys per layer), ``read_context`` (commit
    positions' features) and ``block`` (one step's drafts)."""

    drafts_block = True
    checkpoint_exclude = ()

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        lc = cfg.layer_cfg()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.mask_embed = nn.Parameter(torch.zeros(cfg.dim))
        self.fc = nn.Linear(len(cfg.target_layers) * (cfg.target_dim or cfg.dim), cfg.dim, bias=False)
        self.hidden_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.layers = nn.ModuleList(Block(lc) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(lc), persistent=False)
        for p in (self.embed_tokens.weight, self.lm_head.weight):  # the target's, frozen
            p.requires_grad_(False)

    @property
    def target_vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def max_draft_len(self) -> int:
        return self.cfg.block_size - 1

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return tuple(i + 1 for i in self.cfg.target_layers)  # capture index i = output of layer i - 1

    def features(self, captured: dict, target) -> torch.Tensor:
        """A target forward's captured hidden states -> (B, T, n_features * D_target)."""
        return torch.cat([captured[i] for i in self.capture_layers], -1)

    def features_in(self, signals: dict) -> bool:
        return list(signals.get("hidden_aux", {}).get("layers", [])) == list(self.cfg.target_layers)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        return torch.where((ids == self.cfg.mask_id)[..., None], self.mask_embed.to(x.dtype), x)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.fc.weight
        return KVCache(self.cfg.layer_cfg(), batch, max_len, p.dtype, p.device)

    def _context(self, feats: torch.Tensor, pos: torch.Tensor):
        """feats (B, T, F) at RoPE positions pos (B, T) -> (fused normed context c (B, T, D), cos, sin)."""
        c = self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))
        return (c, *rope_cos_sin(pos, self.inv_freq, c.dtype))

    def _layer_kv(self, a, c, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's context keys and values (B, Hkv, T, hd) from the fused context c: its k/v projections,
        the k norm, RoPE."""
        B, T, hd = c.shape[0], c.shape[1], self.cfg.head_dim
        k = a.k_norm(a.k_proj(c).view(B, T, -1, hd)).transpose(1, 2)
        return apply_rope(k, cos, sin), a.v_proj(c).view(B, T, -1, hd).transpose(1, 2)

    def read_context(self, feats: torch.Tensor, cache: KVCache, pos: torch.Tensor, valid=None) -> None:
        """Commit positions: their features' keys and values join the context (cache slots from ``length``)."""
        T, s0 = feats.shape[1], cache.length
        if s0 + T > cache.max_len:
            raise ValueError(f"KV cache overflow: {s0}+{T} > {cache.max_len}")
        c, cos, sin = self._context(feats, pos)
        for i, layer in enumerate(self.layers):
            k, v = self._layer_kv(layer.self_attn, c, cos, sin)
            cache.k[i][:, :, s0 : s0 + T] = k
            cache.v[i][:, :, s0 : s0 + T] = v
        cache.advance(T, valid)

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor, context, mask: torch.Tensor) -> torch.Tensor:
        """Query blocks ids (B, Q) at pos (B, Q) under mask (B, 1, Q, C + Q) -> final normed states (B, Q, D).
        ``context(i, self_attn)`` gives layer i's context keys and values; it runs inside the layer's own call
        (``Block.forward``'s ``attend``), where sharding wrappers (FSDP2's per-layer units) gather its weights."""
        x = self.embed(ids).to(self.fc.weight.dtype)
        cos, sin = rope_cos_sin(pos, self.inv_freq, x.dtype)
        B, Q, hd = *ids.shape, self.cfg.head_dim
        gqa = self.cfg.n_kv_heads != self.cfg.n_heads
        for i, layer in enumerate(self.layers):

            def attend(a, h, i=i):
                ck, cv = context(i, a)
                q = apply_rope(a.q_norm(a.q_proj(h).view(B, Q, -1, hd)).transpose(1, 2), cos, sin)
                k = apply_rope(a.k_norm(a.k_proj(h).view(B, Q, -1, hd)).transpose(1, 2), cos, sin)
                v = a.v_proj(h).view(B, Q, -1, hd).transpose(1, 2)
                k, v = torch.cat([ck, k], 2), torch.cat([cv, v], 2)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
                return a.o_proj(y.transpose(1, 2).reshape(B, Q, -1))

            x = layer(x, None, None, None, None, i, attend=attend)
        return self.norm(x)

    def block(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache, n: int | None = None) -> torch.Tensor:
        """One step's block for every row: ids (B, K) = [current token, mask, ...] at pos (B, K), over the
        context in ``cache`` -> the first ``n`` (default all) mask slots' logits (B, n, V): [:, j - 1] is draft
        j's distribution (the current token's slot drafts nothing, so the LM head skips it, and the later slots
        when fewer drafts are wanted)."""
        B, K, L = *ids.shape, cache.length
        seen = cache.valid[:, None, :L].expand(B, K, L)
        if self.cfg.sliding_window is not None:  # the context holds positions 0..pos[:, 0] - 1 in slot order
            after = seen.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)  # context keys at or after each slot
            seen = seen & (after <= (self.cfg.sliding_window - 1 - (pos - pos[:, :1]))[..., None])
        mask = torch.cat([seen, ids.new_ones(B, K, K, dtype=torch.bool)], 2)
        h = self.hidden(ids, pos, lambda i, a: (cache.k[i][:, :, :L], cache.v[i][:, :, :L]), mask[:, None])
        return self.lm_head(h[:, 1 : None if n is None else 1 + n])

    def forward(self, feats, ids, pos, mask, select: list, head_fn):
        """Training: query blocks ids (B, Q) at pos (B, Q) over every position's features feats (B, T, F) at
        positions 0..T-1, under mask (B, Q, T + Q) (``anchor_layout``) -> [head_fn(j, states at select[j - 1],
        lm_head weight)] for mask slots j = 1..K-1. The LM head is read inside forward, where sharding wrappers
        have it gathered."""
        B, T = feats.shape[:2]
        c, cos, sin = self._context(feats, torch.arange(T, device=feats.device).expand(B, T))
        h = self.hidden(ids, pos, lambda i, a: self._layer_kv(a, c, cos, sin), mask[:, None])
        h = h.reshape(B * ids.shape[1], -1)
        return [head_fn(j + 1, h[sel], self.lm_head.weight) for j, sel in enumerate(select)]

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed_tokens.weight.numel() - self.lm_head.weight.numel() if exclude_embeddings else n


@dataclass
class AnchorLayout:
    """Training blocks of one batch (``anchor_layout``): ids, pos (B, Q) with Q = n_blocks * K; mask (B, Q, T + Q);
    for mask slot j = 1..K-1: ``select[j-1]`` flat indices b * Q + q of its trained slots and ``rows[j-1]`` the
    loss-axis row (the predict_mask position a + j - 1) whose teacher scores it."""

    ids: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor
    select: list
    rows: list


def anchor_layout(
    ids, predict_mask, K: int, n: int, mask_id: int, generators: list, window: int | None = None
) -> AnchorLayout:
    """Up to ``n`` random anchors per row among the positions a whose next token is trained (predict_mask[a]):
    block [x_a, mask * (K-1)] at positions a..a+K-1 sees the context positions < a (with a sliding ``window``:
    slot j only those > a + j - window) and its own block (no causal mask); slot j trains where
    predict_mask[a + j - 1] (the token it drafts is a response token)."""
    B, T = ids.shape
    dev = ids.device
    pm = predict_mask.bool().cpu()
    rowid = (pm.reshape(-1).long().cumsum(0) - 1).view(B, T)  # loss-axis row of each predicting position
    anchors = []
    for b in range(B):
        cand = pm[b].nonzero().flatten()
        order = torch.randperm(len(cand), generator=generators[b], device=generators[b].device).cpu()
        anchors.append(cand[order[:n]].sort().values.tolist())
    nb = max(1, max(len(a) for a in anchors))
    Q = nb * K
    q_ids = torch.full((B, Q), mask_id, dtype=ids.dtype)
    q_pos = torch.zeros(B, Q, dtype=torch.long)
    mask = torch.zeros(B, Q, T + Q, dtype=torch.bool)
    select = [[] for _ in range(K - 1)]
    rows = [[] for _ in range(K - 1)]
    host_ids = ids.cpu()
    for b, al in enumerate(anchors):
        for i in range(nb):
            sl = slice(i * K, (i + 1) * K)
            mask[b, sl, T + i * K : T + (i + 1) * K] = True  # its own block, every slot (also a padding block)
            if i >= len(al):
                continue
            a = al[i]
            q_ids[b, i * K] = host_ids[b, a]
            q_pos[b, sl] = torch.arange(a, a + K)
            for j in range(K):
                mask[b, i * K + j, 0 if window is None else max(0, a + j - window + 1) : a] = True
            for j in range(1, K):
                t = a + j - 1
                if t < T and pm[b, t]:
                    select[j - 1].append(b * Q + i * K + j)
                    rows[j - 1].append(int(rowid[b, t]))
    as_t = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
    return AnchorLayout(q_ids.to(dev), q_pos.to(dev), mask.to(dev), [as_t(x) for x in select], [as_t(x) for x in rows])


def default_target_layers(n_layers: int, n: int) -> tuple[int, ...]:
    """n target layers evenly spaced from layer 1 to layer L-3 (clamped to the layers a small target has)."""
    lo, hi = min(1, n_layers - 1), max(min(1, n_layers - 1), n_layers - 3)
    if n == 1:
        return (hi,)
    return tuple(sorted({round(lo + (hi - lo) * i / (n - 1)) for i in range(n)}))


def build_dflash(cfg: DFlashDrafterConfig | dict, target, **_) -> DFlash:
    """A fresh DFlash drafter shaped like the target's layers, its embeddings and LM head copied from the target."""
    cfg = as_section(DFlashDrafterConfig, cfg)
    tc = target.cfg
    if getattr(tc, "head_vocab_size", None) or getattr(target, "lm_head", None) is None:
        raise DraftsmithError("drafter.kind=dflash needs a target with a plain LM head")
    layers = tuple(cfg.target_layers) if cfg.target_layers else default_target_layers(tc.n_layers, cfg.n_features)
    if any(not 0 <= i < tc.n_layers for i in layers):
        raise DraftsmithError(f"drafter.target_layers {list(layers)}: the target has layers 0..{tc.n_layers - 1}")
    mask = tc.vocab_size - 1 if cfg.mask_token is None else cfg.mask_token
    if mask >= tc.vocab_size:
        raise DraftsmithError(f"drafter.mask_token {mask} is outside the target's vocabulary ({tc.vocab_size})")
    dc = DFlashConfig(
        vocab_size=tc.vocab_size,
        dim=tc.dim,
        n_layers=cfg.n_layers,
        n_heads=tc.n_heads,
        n_kv_heads=tc.n_kv_heads,
        hidden_dim=tc.hidden_dim,
        head_dim=tc.hd,
        target_layers=layers,
        mask_id=mask,
        block_size=cfg.block_size,
        sliding_window=cfg.sliding_window,
        target_dim=tc.dim,
        rope_theta=tc.rope_theta,
        rope_scaling=tc.rope_scaling,
        norm_eps=tc.norm_eps,
        max_seq_len=tc.max_seq_len,
    )
    model = DFlash(dc)
    w = next(target.parameters())
    model.to(device=w.device, dtype=w.dtype if w.dtype.is_floating_point else torch.float32)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.embed_tokens.weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
        model.mask_embed.copy_(target.embed_tokens.weight.float().mean(0))
        if cfg.init_layers:
            if len(cfg.init_layers) != cfg.n_layers:
                raise DraftsmithError(
                    f"drafter.init_layers has {len(cfg.init_layers)} layers for drafter.n_layers={cfg.n_layers}"
                )
            for dst, i in zip(model.layers, cfg.init_layers, strict=True):
                _copy_layer(dst, target.layers[i])
    return model


def _copy_layer(dst: Block, src) -> None:
    """A target layer's weights into a draft layer (q/k norms stay at 1 where the target has none)."""
    own = dst.state_dict()
    for k, v in src.state_dict().items():
        if k in own and own[k].shape == v.shape:
            own[k].copy_(v)


def from_config(c: dict) -> DFlash:
    c = dict(c)
    c["target_layers"] = tuple(c["target_layers"])
    return DFlash(DFlashConfig(**c))


SPEC = DrafterSpec(
    kind="dflash",
    config=DFlashDrafterConfig,
    build=build_dflash,
    from_config=from_config,
    interface="block",
    objective=OBJ + "dflash_objective",
    signals=frozenset({"topk"}),
    needs_target=True,  # the fused features are computed by the frozen target in the loop
    fsdp_wrap=(Block,),
    exports={
        "vllm": {"write": EXPORT + "to_dflash", "read": EXPORT + "read_dflash", "usage": EXPORT + "usage_dflash"},
        "sglang": "refused: SGLang loads DFlash drafts from z-lab's layout; export --format vllm or hf",
    },
    engines={"vllm": {"method": "dflash", "formats": ("vllm",)}},
)
