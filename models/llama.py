"""A small, self-contained Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) with an explicit KV cache.

Used for the target *and* for standalone draft LMs. The cache is slot-addressed: every row of a batch writes
its new tokens at the same slots, but each row carries its own RoPE positions and a key-validity mask, so
left-padded batches and speculative rollback (``cache.length = n``) are both one-liners.
Parity with ``transformers.LlamaForCausalLM`` is tested in tests/test_models.py.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

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

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


class KVCache:
    """Per-layer K/V buffers of shape (B, n_kv_heads, max_len, head_dim) plus a (B, max_len) validity mask.

    ``length`` is the number of filled slots (shared by all rows). Rolling back after a rejected draft is
    ``cache.length = n``: stale slots beyond ``length`` are never attended because attention is causal in
    slot order and new writes overwrite them.
    """

    def __init__(self, cfg: LlamaConfig, batch: int, max_len: int, dtype, device):
        shape = (batch, cfg.n_kv_heads, max_len, cfg.hd)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0
        self.max_len = max_len


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
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

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int):
        B, T, _ = x.shape
        hd, H, Hkv = self.cfg.hd, self.cfg.n_heads, self.cfg.n_kv_heads
        q = self.q_proj(x).view(B, T, H, hd)
        k = self.k_proj(x).view(B, T, Hkv, hd)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, hd)
        v = self.v_proj(x).view(B, T, Hkv, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            s0 = cache.length
            cache.k[layer][:, :, s0:s0 + T] = k
            cache.v[layer][:, :, s0:s0 + T] = v
            k = cache.k[layer][:, :, :s0 + T]
            v = cache.v[layer][:, :, :s0 + T]
        if Hkv != H:  # grouped-query attention: share each K/V head across H // Hkv query heads
            k = k.repeat_interleave(H // Hkv, dim=1)
            v = v.repeat_interleave(H // Hkv, dim=1)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Decoder-only LM. Parameter names follow HF (minus the ``model.`` prefix) so checkpoints map 1:1."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))  # separate instances, not [b]*L
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg, batch, max_len, p.dtype, p.device)

    def _mask(self, cache: KVCache, T: int, attn_mask: torch.Tensor | None) -> torch.Tensor:
        """(B, 1, T, S) boolean mask: key valid AND causal in slot order (or the caller's tree mask)."""
        s0, S = cache.length, cache.length + T
        dev = cache.valid.device
        q_slot = torch.arange(s0, S, device=dev)[:, None]
        k_slot = torch.arange(S, device=dev)[None, :]
        allowed = (k_slot <= q_slot)[None] if attn_mask is None else attn_mask  # (1|B, T, S)
        # A query always sees itself, so a fully padded row gives finite (ignored) values, never NaN.
        m = (allowed & cache.valid[:, None, :S]) | (k_slot == q_slot)[None]
        return m[:, None]

    def forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor | None = None,
        cache: KVCache | None = None,
        valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        capture_layers: tuple[int, ...] = (),
        logits_at: torch.Tensor | None = None,
    ):
        """ids (B, T) int64 -> logits (B, T, V), or (logits, {layer: hidden (B, T, D)}) if capture_layers.

        pos: (B, T) RoPE positions (default 0..T-1, or continuing after ``cache.length``).
        cache: write K/V at slots [cache.length, cache.length + T) and advance ``length``.
        valid: (B, T) bool, False for padding tokens (only meaningful with a cache).
        attn_mask: (1|B, T, cache.length + T) bool, a custom (tree) mask replacing the causal one.
        capture_layers: indices i of hidden states to return; i is the output of block i-1, 0 the embeddings,
            n_layers the final (pre-norm) hidden state.
        logits_at: optional bool mask (B, T): compute the LM head only there (returns (N, V)), which saves the
            dominant vocab matmul when training on a subset of positions.
        """
        B, T = ids.shape
        if pos is None:
            start = cache.length if cache is not None else 0
            pos = torch.arange(start, start + T, device=ids.device).expand(B, T)
        # RoPE angles in fp32 whatever the model dtype (as HF does): bf16 angles drift at long positions.
        freqs = pos[..., None].float() * self.inv_freq.float()  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed_tokens(ids)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        mask = None
        if cache is not None:
            if cache.length + T > cache.max_len:
                raise ValueError(f"KV cache overflow: {cache.length}+{T} > {cache.max_len}")
            s0 = cache.length
            cache.valid[:, s0:s0 + T] = True if valid is None else valid
            mask = self._mask(cache, T, attn_mask)
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in capture_layers:
                captured[i] = x
            x = layer(x, cos, sin, mask, cache, i)
        if self.cfg.n_layers in capture_layers:
            captured[self.cfg.n_layers] = x
        if cache is not None:
            cache.length += T
        h = self.norm(x)
        logits = self.lm_head(h[logits_at] if logits_at is not None else h)
        return (logits, captured) if capture_layers else logits

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed_tokens.weight.numel()
        return n
