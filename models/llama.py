"""A small, self-contained Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) with an explicit KV cache.

Used for the target *and* for standalone draft LMs. The cache is slot-addressed: every row of a batch writes
its new tokens at the same slots, but each row carries its own RoPE positions and a key-validity mask, so
left-padded batches and speculative rollback (``cache.length = n``) are both one-liners.
Parity with ``transformers.LlamaForCausalLM`` is tested in tests/test_models.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    head_dim: int | None = None  # None -> dim // n_heads
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)  # HF "llama3" scaling supported
    norm_eps: float = 1e-5
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts a bias on q/k/v
    qk_norm: bool = False  # Qwen3 RMS-normalises each head of q and k before RoPE
    head_vocab_size: int | None = None  # a drafter's reduced output vocabulary (A10); inputs stay target ids
    # Sliding-window attention: a query at position p sees keys at positions > p - sliding_window, in layers
    # i >= window_from_layer (Mistral: every layer; Qwen2/3: max_window_layers). None: full attention everywhere.
    sliding_window: int | None = None
    window_from_layer: int = 0

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def windowed(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window."""
        return self.sliding_window is not None and layer >= self.window_from_layer

    def to_dict(self) -> dict:
        return asdict(self)


class KVCache:
    """Per-layer K/V buffers of shape (B, n_kv_heads, max_len, head_dim) plus a (B, max_len) validity mask.

    ``length`` is the number of filled slots (shared by all rows). Rolling back after a rejected draft is
    ``cache.length = n``: stale slots beyond ``length`` are never attended because attention is causal in
    slot order and new writes overwrite them.
    """

    def __init__(self, cfg: LlamaConfig, batch: int, max_len: int, dtype, device):
        # One buffer (K/V, layer, B, n_kv_heads, max_len, head_dim): k[i] / v[i] are views, so KV compaction after
        # a tree verify is one kernel launch over every layer (eval/tree.py compact_cache).
        self.kv = torch.zeros(2, cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.hd, dtype=dtype, device=device)
        # One select() view per layer: views from a multi-output op (unbind) may not be written in place under grad.
        self.k = [self.kv[0, i] for i in range(cfg.n_layers)]
        self.v = [self.kv[1, i] for i in range(cfg.n_layers)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0
        self.max_len = max_len
        self.padded = False  # set once any row wrote an invalid (padding) slot; never cleared
        # Static-shape mode (eval/graphs.py, CUDA graphs): new K/V go to these slots (a (T,) device tensor),
        # attention reads the whole buffer under the caller's full-width mask, and ``length`` is the caller's job.
        self.slots: torch.Tensor | None = None

    @classmethod
    def keyless(cls, batch: int, max_len: int, device=None) -> KVCache:
        """A cache with no layers, for a drafter that keeps no keys (a bigram table): only the decoder's
        bookkeeping (``length``, ``valid``), which its forward keeps with ``advance``."""
        return cls(SimpleNamespace(n_layers=0, n_kv_heads=1, hd=1), batch, max_len, torch.float32, device)

    def advance(self, T: int, valid: torch.Tensor | None = None) -> None:
        """T new slots written: valid where ``valid`` (B, T) says (all by default), then ``length`` moves on."""
        prepare_cache(self, T, valid, None)
        self.length += T

    def rows(self, n: int, length: int, padded: bool) -> KVCache:
        """A cache over rows [0, n) of this one's storage (shared, not copied), ``length`` slots filled: what a
        batch of rows that come and go writes through (eval/batch_decoder.py ``RowCache``, data/engine.py)."""
        v = object.__new__(KVCache)
        v.kv, v.valid = self.kv[:, :, :n], self.valid[:n]
        v.k = [v.kv[0, i] for i in range(v.kv.shape[1])]
        v.v = [v.kv[1, i] for i in range(v.kv.shape[1])]
        v.length, v.max_len, v.padded, v.slots = length, self.max_len, padded, None
        return v


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.hd, 2, dtype=torch.float64) / cfg.hd))
    sc = cfg.rope_scaling or {}
    if sc.get("rope_type", sc.get("type")) == "llama3":
        # Llama-3.1 frequency-dependent scaling (same formula as HF `_compute_llama3_parameters`).
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); cos/sin: (B, 1, T, hd). HF's rotate-half convention (not interleaved).
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def cache_mask(cache: KVCache, T: int, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, 1, T, S) boolean mask for T new tokens: key valid AND causal in slot order (or the caller's tree mask)."""
    s0, S = cache.length, cache.length + T
    dev = cache.valid.device
    q_slot = torch.arange(s0, S, device=dev)[:, None]
    k_slot = torch.arange(S, device=dev)[None, :]
    allowed = (k_slot <= q_slot)[None] if attn_mask is None else attn_mask  # (1|B, T, S)
    # A query always sees itself, so a fully padded row gives finite (ignored) values, never NaN.
    m = (allowed & cache.valid[:, None, :S]) | (k_slot == q_slot)[None]
    return m[:, None]


def prepare_cache(cache: KVCache, T: int, valid: torch.Tensor | None, attn_mask: torch.Tensor | None):
    """Mark T new slots valid and return the attention mask for them (None where SDPA needs none)."""
    if cache.length + T > cache.max_len:
        raise ValueError(f"KV cache overflow: {cache.length}+{T} > {cache.max_len}")
    s0 = cache.length
    cache.valid[:, s0 : s0 + T] = True if valid is None else valid
    cache.padded |= valid is not None
    # A single new token with no padding anywhere sees every slot: no mask, the fastest SDPA path.
    if T > 1 or attn_mask is not None or cache.padded:
        return cache_mask(cache, T, attn_mask)
    return None


def step_mask(cache: KVCache | None, T: int, valid: torch.Tensor | None, attn_mask: torch.Tensor | None):
    """-> (attention mask for T new tokens, static). Static-shape mode (eval/graphs.py sets ``cache.slots``): the
    wrapper passes the (B, T, max_len) mask over the whole buffer and keeps ``cache.length`` itself."""
    if cache is None:  # no cache: causal, or the caller's (B|1, T, T) mask (PARD's training layout)
        return (None if attn_mask is None else attn_mask[:, None]), False
    if cache.slots is not None:
        return attn_mask[:, None], True
    return prepare_cache(cache, T, valid, attn_mask), False


def last_keys(allowed: torch.Tensor, window: int) -> torch.Tensor:
    """A sliding window over a cache: ``allowed`` (B|1, 1, T, S) bool with each query keeping only its last
    ``window`` allowed keys. The keys a query may see are its own sequence in slot order, one RoPE position apart
    (a chain, a tree node's ancestors, a batch row with holes and left padding), so the k-th allowed key from the
    end is k - 1 positions back: transformers' window (key position > query position - window), by position."""
    after = allowed.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)  # allowed keys at or after each slot
    return allowed & (after <= window)


def window_mask(W: int | None, mask, pos, cache, attn_mask, static: bool, own_pos: bool) -> torch.Tensor | None:
    """A sliding window of W positions on top of ``mask`` (a query at p sees keys at positions > p - W), shared by
    every attention path (prefill, decode, chain and tree verify, batches with holes, the fused modules, the
    feature drafters' steps); ``mask`` itself where no key can fall out of the window or W is None."""
    T = pos.shape[1]
    if W is None:
        return mask
    if static:
        raise ValueError("sliding-window attention runs eagerly: no static-shape (CUDA graph) cache")
    if cache is None:  # the positions are all there: key position > query position - W
        if T <= W and not own_pos:
            return mask
        near = pos[:, None, :, None] - pos[:, None, None, :] < W
        return near & (torch.ones(T, T, dtype=torch.bool, device=pos.device).tril() if mask is None else mask)
    s0, S = cache.length, cache.length + T
    if S <= W:  # fewer keys than the window
        return mask
    if attn_mask is None and not cache.padded:  # every slot valid, causal: positions step with the slots
        near = torch.arange(s0, S, device=pos.device)[:, None] - torch.arange(S, device=pos.device) < W
        return near[None, None] if mask is None else mask & near
    return last_keys(mask, W)


def default_pos(ids: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """RoPE positions (B, T) of new tokens: 0..T-1, or continuing after the cache's filled slots."""
    B, T = ids.shape
    start = cache.length if cache is not None else 0
    return torch.arange(start, start + T, device=ids.device).expand(B, T)


def rope_cis(pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """pos (B, T) -> unit complex rotations (B, T, 1, hd/2) for interleaved RoPE (``Attention.interleave_rope``)."""
    freqs = pos[..., None].float() * inv_freq.float()
    return torch.polar(torch.ones_like(freqs), freqs)[:, :, None]


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos (B, T) -> cos, sin (B, 1, T, hd). Angles in fp32 whatever the model dtype (as HF does): bf16 angles
    drift at long positions."""
    freqs = pos[..., None].float() * inv_freq.float()  # (B, T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if x.dtype == torch.float32:  # one fused op instead of six (decode at batch 1 is op-overhead bound)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 like HF, then cast back: keeps bf16 targets bit-close to the reference.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        hd = cfg.hd
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.norm_eps)
            self.k_norm = RMSNorm(hd, cfg.norm_eps)

    @torch.no_grad()
    def interleave_rope(self) -> None:
        """Reorder each q/k head's rows from HF's rotate-half layout (dim i pairs with i + hd/2) to interleaved pairs
        (2i, 2i + 1), so RoPE over the fused q/k block is one complex multiply instead of a dozen small ops per
        layer (batch-1 CPU decoding is op-overhead bound). Scores are unchanged: q and k share the per-head order,
        V is untouched, and a Qwen3 q/k-norm's RMS ignores order (its weights move with the rows). Call before
        fusing; the K cache then holds keys in this order too."""
        hd = self.cfg.hd
        order = torch.stack([torch.arange(hd // 2), torch.arange(hd // 2, hd)], 1).flatten()  # 0, hd/2, 1, ...
        for proj, n in ((self.q_proj, self.cfg.n_heads), (self.k_proj, self.cfg.n_kv_heads)):
            rows = (torch.arange(n)[:, None] * hd + order).flatten().to(proj.weight.device)
            proj.weight.copy_(proj.weight[rows])
            if proj.bias is not None:
                proj.bias.copy_(proj.bias[rows])
        if self.cfg.qk_norm:
            for norm in (self.q_norm, self.k_norm):
                norm.weight.copy_(norm.weight[order.to(norm.weight.device)])
        self.rope_interleaved = True

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int):
        """cos, sin: (B, 1, T, hd) rotate-half RoPE; after ``interleave_rope``, cos is ``rope_cis`` and sin None."""
        B, T, _ = x.shape
        hd, H, Hkv = self.cfg.hd, self.cfg.n_heads, self.cfg.n_kv_heads
        if sin is None:  # interleaved RoPE on the fused q/k block (optimize_for_inference, float32)
            qk, v = self.qkv_proj(x)
            qk = qk.view(B, T, H + Hkv, hd)
            if self.cfg.qk_norm:
                qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], 2)
            qk = torch.view_as_real(torch.view_as_complex(qk.unflatten(-1, (hd // 2, 2))) * cos).flatten(3)
            q, k = qk.transpose(1, 2).split([H, Hkv], dim=1)  # (B, H, T, hd), (B, Hkv, T, hd)
            v = v.view(B, T, Hkv, hd).transpose(1, 2)
        else:
            if hasattr(self, "qkv_proj"):  # fused by optimize_for_inference()
                q, k, v = self.qkv_proj(x)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k = q.view(B, T, H, hd), k.view(B, T, Hkv, hd)
            if self.cfg.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, hd)
            v = v.view(B, T, Hkv, hd).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None and cache.slots is not None:  # static shapes: no Python ints in the graph
            cache.k[layer].index_copy_(2, cache.slots, k)
            cache.v[layer].index_copy_(2, cache.slots, v)
            k, v = cache.k[layer], cache.v[layer]
        elif cache is not None:
            s0 = cache.length
            cache.k[layer][:, :, s0 : s0 + T] = k
            cache.v[layer][:, :, s0 : s0 + T] = v
            k = cache.k[layer][:, :, : s0 + T]
            v = cache.v[layer][:, :, : s0 + T]
        # Grouped-query attention: SDPA broadcasts each K/V head over H // Hkv query heads (no cache copy).
        gqa = Hkv != H
        if mask is None:  # no cache: plain causal; with a cache, None means one query that sees every slot
            y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))


class FusedLinear(nn.Module):
    """Inference-only stack of linear layers that read the same input: one matmul, outputs split back.

    Batch-1 decoding is a chain of small GEMVs; fewer, larger ones cut per-call overhead. On CPU the weight is
    pre-packed once for oneDNN, whose GEMV streams weights about twice as fast as the default BLAS on the
    machines we measured (benchmarks/step_costs.py); elsewhere, or if the packing op is missing, plain F.linear.
    """

    # Batch-size hint for oneDNN's weight layout. Packed for 1, a 2–8-row matmul (a verify) takes a slow path, 2–3x
    # a 1-row one; packed for 8, those rows cost 1.1–1.7x one row and one row is as fast as before (AVX2 EPYC,
    # benchmarks/step_costs.py --pack-ab). Decode and verify then also share one kernel.
    pack_batch = 8

    def __init__(self, *linears: nn.Linear):
        super().__init__()
        self.sizes = [lin.out_features for lin in linears]
        w = torch.cat([lin.weight.detach() for lin in linears])
        bias = [lin.bias for lin in linears]
        self.bias = None if bias[0] is None else torch.cat([b.detach() for b in bias])
        self.packed = None
        cpu_packable = w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
        if cpu_packable and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, self.pack_batch)
            except (AttributeError, RuntimeError):  # private op: absent or unsupported in this torch build
                self.packed = None
        self.weight = None if self.packed is not None else w

    def forward(self, x):
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else y


class ReducedHead(nn.Linear):
    """LM head over a reduced draft vocabulary (docs/algorithms.md A10) whose output is in the *target's* vocabulary:
    the kept rows' logits scattered into a -inf row, so every consumer (decoder, on-policy writer, SpecDec++
    labeller) sees target ids. Training reads ``weight`` directly (draft index space, train/losses.py)."""

    def __init__(self, dim: int, n_kept: int, vocab_size: int):
        super().__init__(dim, n_kept, bias=False)
        self.vocab_size = vocab_size
        self.register_buffer("target_ids", torch.arange(n_kept), persistent=False)
        self.fused: FusedLinear | None = None

    def forward(self, h):
        small = self.fused(h) if self.fused is not None else F.linear(h, self.weight)
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.target_ids] = small
        return full


class ReducedVocab:
    """Mixin for drafters whose ``lm_head`` may be a ReducedHead: the d2t / t2d maps as checkpointed buffers, and
    the head's id list kept in step with them (after loading or moving). Draft id i is target id i + d2t[i]
    (EAGLE-3's offsets); t2d maps target ids to draft ids or -1."""

    def _init_vocab_maps(self, n_kept: int, vocab_size: int) -> None:
        self.register_buffer("d2t", torch.zeros(n_kept, dtype=torch.long))
        self.register_buffer("t2d", torch.full((vocab_size,), -1, dtype=torch.long))

    def set_head_vocab(self, target_ids: torch.Tensor) -> None:
        """Fill d2t / t2d from the sorted target ids kept in the head."""
        ids = target_ids.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.fill_(-1)
        self.t2d[ids] = torch.arange(len(ids), device=ids.device)
        if isinstance(getattr(self, "lm_head", None), ReducedHead):  # feature heads have several plain heads
            self.lm_head.target_ids = ids.clone()

    def _sync_head_ids(self) -> None:
        if isinstance(getattr(self, "lm_head", None), ReducedHead):  # non-persistent, so rebuilt from d2t
            self.lm_head.target_ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._sync_head_ids()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        res = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._sync_head_ids()
        return res


def fuse_layers(layers: list[tuple[nn.Module, nn.Module]]) -> None:
    """Fuse each (attention, MLP) pair's q/k/v and gate/up matmuls and pre-pack every matmul weight (FusedLinear)."""
    for a, m in layers:
        a.qkv_proj = FusedLinear(a.q_proj, a.k_proj, a.v_proj)
        a.o_proj = FusedLinear(a.o_proj)
        m.gate_up_proj = FusedLinear(m.gate_proj, m.up_proj)
        m.down_proj = FusedLinear(m.down_proj)
        del a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj


def fuse_for_inference(model: nn.Module, layers: list[tuple[nn.Module, nn.Module]]) -> nn.Module:
    """Fuse each (attention, MLP) pair's q/k/v and gate/up matmuls, pre-pack every matmul weight (FusedLinear) and
    the LM head; the model keeps its parameter counts (packed weights are not parameters) and stops training."""
    model._counts = (model.num_params(), model.num_params(exclude_embeddings=True))
    fuse_layers(layers)
    if isinstance(model.lm_head, ReducedHead):
        model.lm_head.fused = FusedLinear(model.lm_head)
    else:
        model.lm_head = FusedLinear(model.lm_head)
    model.requires_grad_(False)
    return model


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        g, u = self.gate_up_proj(x) if hasattr(self, "gate_up_proj") else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(g) * u)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer, attend=None):
        """``attend(self_attn, normed x)``: another attention over this block's weights (EAGLE's TTT unroll). It
        runs inside the block's own call, where sharding wrappers (FSDP2's per-block units) gather the weights."""
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, cos, sin, mask, cache, layer) if attend is None else attend(self.self_attn, h))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(ReducedVocab, nn.Module):
    """Decoder-only LM. Parameter names follow HF (minus the ``model.`` prefix) so checkpoints map 1:1."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))  # separate instances, not [b]*L
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.head_vocab_size:
            self.lm_head = ReducedHead(cfg.dim, cfg.head_vocab_size, cfg.vocab_size)
        else:
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.head_vocab_size:
            if cfg.tie_embeddings:
                raise ValueError("a reduced head vocabulary cannot be tied to the input embeddings")
            self._init_vocab_maps(cfg.head_vocab_size, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def target_vocab_size(self) -> int:
        return self.cfg.vocab_size

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings (B, T, D); a subclass may map extra ids (PARD's mask token, models/pard.py)."""
        return self.embed_tokens(ids)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg, batch, max_len, p.dtype, p.device)

    def forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor | None = None,
        cache: KVCache | None = None,
        valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        capture_layers: tuple[int, ...] = (),
        logits_at: torch.Tensor | None = None,
        return_hidden: bool = False,
        head_fn=None,
    ):
        """ids (B, T) int64 -> logits (B, T, V), or (logits, {layer: hidden (B, T, D)}) if capture_layers.

        pos: (B, T) RoPE positions (default 0..T-1, or continuing after ``cache.length``).
        cache: write K/V at slots [cache.length, cache.length + T) and advance ``length``.
        valid: (B, T) bool, False for padding tokens (only meaningful with a cache).
        attn_mask: (1|B, T, cache.length + T) bool, a custom (tree) mask replacing the causal one (without a cache:
            (1|B, T, T), used as given).
        capture_layers: indices i of hidden states to return; i is the output of block i-1, 0 the embeddings,
            n_layers the final (pre-norm) hidden state.
        logits_at: optional bool mask (B, T), or flat indices (N,) b * T + t in row-major order: compute the LM
            head only there (returns (N, V)), which saves the dominant vocab matmul when training on a subset of
            positions.
        return_hidden: return the final normed hidden states (at ``logits_at`` if given) instead of logits, for
            losses that apply the LM head chunk by chunk (train/losses.py head_loss).
        head_fn: return ``head_fn(hidden at logits_at, lm_head.weight)`` instead: chunked losses run inside
            forward, where sharding wrappers (FSDP2, DeepSpeed ZeRO-3) have the LM head gathered.
        """
        B, T = ids.shape
        own_pos = pos is not None
        pos = default_pos(ids, cache) if pos is None else pos
        x = self.embed(ids)
        if getattr(self, "_rope_interleaved", False):
            cos, sin = rope_cis(pos, self.inv_freq), None
        else:
            cos, sin = rope_cos_sin(pos, self.inv_freq, x.dtype)
        mask, static = step_mask(cache, T, valid, attn_mask)
        wmask = self._window_mask(mask, pos, cache, attn_mask, static, own_pos)
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in capture_layers:
                captured[i] = x
            x = layer(x, cos, sin, wmask if self.cfg.windowed(i) else mask, cache, i)
        if self.cfg.n_layers in capture_layers:
            captured[self.cfg.n_layers] = x
        if cache is not None and not static:
            cache.length += T
        h = self.norm(x)
        if logits_at is not None:  # a (B, T) bool mask, or (N,) flat indices b * T + t (no host wait on a GPU)
            h = h[logits_at] if logits_at.dtype == torch.bool else h.reshape(-1, h.shape[-1])[logits_at]
        if head_fn is not None:
            return head_fn(h, self.lm_head.weight)
        logits = h if return_hidden else self.lm_head(h)
        return (logits, captured) if capture_layers else logits

    def _window_mask(self, mask, pos, cache, attn_mask, static: bool, own_pos: bool) -> torch.Tensor | None:
        """The sliding-window layers' mask (``window_mask``); ``mask`` itself where no layer is windowed."""
        if self.cfg.window_from_layer >= self.cfg.n_layers:
            return mask
        return window_mask(self.cfg.sliding_window, mask, pos, cache, attn_mask, static, own_pos)

    @torch.no_grad()
    def optimize_for_inference(self) -> Llama:
        """Fuse q/k/v and gate/up projections and pre-pack every matmul weight (see FusedLinear).

        For the decoder only: the result has no gradients and no HF-named state dict, so build HF copies
        (``to_hf_model``) before calling this. Logits match the unfused model to float rounding.
        """
        interleave = self.embed_tokens.weight.dtype == torch.float32  # complex RoPE: no bf16 complex dtype
        if interleave:
            for b in self.layers:
                b.self_attn.interleave_rope()
        fuse_for_inference(self, [(b.self_attn, b.mlp) for b in self.layers])
        if interleave:  # the q/k block comes out of the fused matmul as one piece
            for b in self.layers:
                a = b.self_attn
                a.qkv_proj.sizes = [(a.cfg.n_heads + a.cfg.n_kv_heads) * a.cfg.hd, a.cfg.n_kv_heads * a.cfg.hd]
            self._rope_interleaved = True
        return self

    def num_params(self, exclude_embeddings: bool = False) -> int:
        if hasattr(self, "_counts"):
            return self._counts[exclude_embeddings]
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed_tokens.weight.numel()
        return n
