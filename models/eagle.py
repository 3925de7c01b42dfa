"""EAGLE-1 and EAGLE-3 drafters (docs/algorithms.md A6): a decoder layer that autoregresses on the target's features.

Both read, at position i, a *state* (the target's feature f_i, or the drafter's own output once it drafts past the
verified prefix) and the embedding of the next token x_{i+1}, and predict x_{i+2}:

- **EAGLE-1** (version 1): f = the target's final hidden state after its norm. x = fc(concat[e(x_{i+1}), state])
  (2d -> d, bias), then one Llama layer *without* an input norm and no final norm; its output f_hat is both the
  next state and the input of the frozen target LM head. Loss: SmoothL1(f_hat, f_{i+1}) (weight 1.0) plus a soft
  CE through the head (weight 0.1).
- **EAGLE-3** (version 3): f = concat of the outputs of target layers ``aux_layers`` (default [1, L/2-1, L-4]),
  projected by fc (3d -> d, no bias) into the state. The layer's attention reads concat[norm(e), norm(state)] (2d
  wide q/k/v), its residual stream starts from the state; the output a (pre-norm) is the next state and
  norm(a) feeds a draft-owned LM head, usually on a reduced vocabulary (d2t / t2d from token frequencies).
  Trained with training-time test (TTT): the layer is unrolled ``ttt_steps`` times over the whole sequence in
  parallel; at step s a query at i sees the step-0 keys <= i plus only its own key of steps 1..s, i.e. each
  row simulates one drafting trajectory (``forward``).

**Deeper stacks** (``n_layers`` > 1, both versions): plain Llama blocks after that first layer, each with its own
K/V, unrolled by TTT like the first; their output is the next state. The blocks start as the identity (zeroed
output projections: a 1-layer checkpoint grows into a deeper one unchanged) or as copies of target layers
(``init_layers``), as the standalone draft LM's depth came from the target's layers
(benchmarks/journal/2026-11-24-deep-draft-lm.md).

Decoding (eval/proposers.py ``FeatureRows``): ``step(state, ids, pos, cache, attn_mask)`` runs the layer on
new positions with a KV cache, for the chain and for EAGLE-2 dynamic trees (on CUDA replayed from graphs:
eval/graphs.py GraphedEagle);
``features(captured, target)`` turns a target forward's captured hidden states into f.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.hf_target import layer_state
from draftsmith.models.llama import (
    MLP,
    Attention,
    Block,
    KVCache,
    LlamaConfig,
    ReducedHead,
    ReducedVocab,
    RMSNorm,
    apply_rope,
    default_pos,
    fuse_for_inference,
    rope_cos_sin,
    rope_inv_freq,
    step_mask,
    window_mask,
)
from draftsmith.models.spec import EXPORT, OBJ, DrafterSpec, Strict, as_section


class EagleDrafterConfig(Strict):
    """EAGLE-1 / EAGLE-3 (docs/algorithms.md A6): one decoder layer that autoregresses on the target's features, trained
    with training-time test (TTT); decodes as a chain or an EAGLE-2 dynamic tree."""

    kind: Literal["eagle"] = "eagle"
    version: Literal[1, 3] = 3
    """1 = EAGLE-1 (final feature, frozen target LM head, feature regression); 3 = EAGLE-3 (fused low/mid/high
    features, draft-owned LM head, token loss only)."""
    aux_layers: list[int] | None = None
    """EAGLE-3: 0-indexed target layers whose outputs are fused; None = [1, L/2-1, L-4]."""
    draft_vocab: int | None = Field(None, gt=1)
    """The draft LM head keeps the N most frequent response tokens (d2t / t2d maps); None = full. EAGLE-3 trains
    those rows; EAGLE-1 keeps them frozen, a slice of the target's head (FR-Spec, docs/algorithms.md A10)."""
    ttt_steps: int | None = Field(None, gt=0, le=16)
    """Training-time-test unroll length; None = 7 for EAGLE-3, 1 for EAGLE-1 (its original teacher forcing)."""
    head_decay: float = Field(0.8, gt=0, le=1)
    """Loss weight of TTT step s is head_decay**s."""
    ttt_detach: bool = False
    """HASS's harmonized context alignment: each TTT step reads the earlier steps' outputs as constants (no
    gradient flows back through the unroll; every step still trains the weights). False = gradients through the
    whole unroll (EAGLE-3's training-time test)."""
    hidden_dim: int | None = Field(None, gt=0)
    """MLP width of the layer; None = the target's."""
    token_loss_weight: float | None = Field(None, ge=0)
    """Weight of the token loss (train.loss.kind); None = 0.1 for EAGLE-1 (p_w), 1.0 for EAGLE-3."""
    feature_loss_weight: float | None = Field(None, ge=0)
    """EAGLE-1: weight of SmoothL1(predicted feature, target feature); None = 1.0 (v_w)."""
    feature_noise: float = Field(0.0, ge=0)
    """Uniform noise in [-a, a] added to the input features while training (EAGLE-1's augmentation)."""
    freeze_lm_head: bool = False
    """EAGLE-3: keep the draft LM head at its start (the target's rows) and train only the layer."""
    n_layers: int = Field(1, gt=0, le=32)
    """Depth: the EAGLE layer plus n_layers - 1 plain Llama blocks (each with its own KV cache in decoding). The
    blocks start as the identity, so train.init_checkpoint may name a shallower EAGLE checkpoint to grow from, or
    as copies of target layers (init_layers). vLLM / SGLang load one layer: export a deeper one with --format hf."""
    init_layers: list[int] | None = None
    """Target layers (0-indexed) copied into the n_layers - 1 added blocks; None = identity blocks."""
    fc_bias: bool = True
    """EAGLE-1: a bias on fc (the EAGLE-1 paper's layout, which SGLang loads). false trains the bias-free fc that
    vLLM's EAGLE-1 loads (export --format vllm refuses a nonzero bias). EAGLE-3's fc never has one."""
    fc_norm: bool = False
    """EAGLE-3.1: RMS-normalise each fused target layer's state on its own (a learned norm per layer) before fc, so
    no layer's scale dominates the fusion. speculators and vLLM call it fc_norm; --format sglang refuses it."""
    feature_sampling: bool = False
    """FSPAD's feature sampling (EAGLE-1): the fused input fc([e; f]) is refined by a gated MLP whose gate reads the
    token embedding, x + W_down(SiLU(W_gate e) * W_up norm(x)), so the token picks out what the layer reads of the
    feature. The refinement starts at zero (EAGLE-1 at init). vLLM and SGLang have no such layer: export --format hf."""
    partial_alignment: bool = False
    """FSPAD's partial alignment distillation (EAGLE-1, n_layers 1): the layer's MLP writes two outputs over one
    residual stream, one read by the LM head (token loss only), the other regressed onto the target's next feature
    and fed to the next draft step as its state. Both start equal (EAGLE-1 at init). Export --format hf."""
    parallel_drafts: int = Field(0, ge=0, le=16)
    """P-EAGLE: draft this many tokens in one forward; 0 = autoregressive EAGLE. After the real (feature, token)
    pair, parallel_drafts - 1 mask slots (a learned mask embedding and a learned mask feature) each draft one
    later position, trained as the TTT unroll with mask inputs at every step after the first (ttt_steps =
    parallel_drafts). EAGLE-3 only; vLLM serves the export as eagle3 with parallel drafting (speculators' peagle)."""
    mask_token: int | None = Field(None, ge=0)
    """P-EAGLE: the token id of the mask slots (every occurrence of it is embedded as the mask); None = the last
    id of the target's vocabulary."""
    sliding_window: int | None = Field(None, gt=1)
    """Attend to the last N positions only (a query at p sees keys at positions > p - N), in training (the TTT
    mask) and decoding alike: a drafter trained on short records then sees the same distances on long contexts.
    Exported for vLLM as a sliding-window layer (layer_types, sliding_window); None = full attention."""
    layer_style: Literal["llama", "target"] = "llama"
    """The layer's attention. llama: plain Llama attention (no q/k-norm, no q/k/v bias) for every target, as
    SpecForge trains EAGLE-3 for Qwen targets: its vllm and sglang exports load in vLLM, SGLang and speculators.
    target: the target's own (Qwen2's q/k/v bias, Qwen3's q/k-norm); vLLM and speculators load those exports,
    SGLang's EAGLE-3 layer has neither, so --format sglang refuses them. Decoding stays exact either way; init_layers
    from a Qwen target needs target."""

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data):
        if not isinstance(data, dict):
            return data
        v1 = data.get("version", 3) == 1
        if v1 and data.get("fc_norm"):
            raise ValueError("drafter.fc_norm needs drafter.version=3 (EAGLE-1 fuses no layers)")
        if not v1 and data.get("fc_bias") is False:
            raise ValueError("drafter.fc_bias needs drafter.version=1 (EAGLE-3's fc has no bias)")
        if v1 and data.get("aux_layers") is not None:
            raise ValueError("drafter.aux_layers needs drafter.version=3")
        if not v1 and data.get("feature_loss_weight"):
            raise ValueError("drafter.feature_loss_weight needs drafter.version=1 (EAGLE-3 has no feature loss)")
        fspad = [f for f in ("feature_sampling", "partial_alignment") if data.get(f)]
        if fspad and not v1:
            raise ValueError(f"drafter.{fspad[0]} (FSPAD) needs drafter.version=1: it refines EAGLE-1's feature loss")
        if data.get("partial_alignment") and data.get("n_layers", 1) > 1:
            raise ValueError("drafter.partial_alignment (FSPAD) splits one layer's output: it needs drafter.n_layers=1")
        k = data.get("parallel_drafts") or 0
        if k and (v1 or k < 2):
            raise ValueError("drafter.parallel_drafts (P-EAGLE) needs drafter.version=3 and at least 2 drafts")
        if not k and data.get("mask_token") is not None:
            raise ValueError("drafter.mask_token needs drafter.parallel_drafts (P-EAGLE)")
        if k and data.get("ttt_steps") not in (None, k):
            raise ValueError(
                f"drafter.ttt_steps is {data['ttt_steps']} but P-EAGLE trains one step per parallel draft: "
                f"leave it unset or set it to drafter.parallel_drafts = {k}"
            )
        if data.get("init_layers") is not None and len(data["init_layers"]) != data.get("n_layers", 1) - 1:
            raise ValueError(
                f"drafter.init_layers has {len(data['init_layers'])} entries: it names the target "
                f"layers copied into the n_layers - 1 = {data.get('n_layers', 1) - 1} added blocks"
            )
        w, steps = data.get("sliding_window"), data.get("ttt_steps") or (1 if v1 else (k or 7))
        if w is not None and w <= steps:
            raise ValueError(
                f"drafter.sliding_window={w} must exceed drafter.ttt_steps={steps}: each TTT step keeps its row's "
                "earlier steps in view"
            )
        defaults = {
            "ttt_steps": 1 if v1 else (k or 7),
            "token_loss_weight": 0.1 if v1 else 1.0,
            "feature_loss_weight": 1.0 if v1 else 0.0,
        }
        return {**data, **{k: v for k, v in defaults.items() if data.get(k) is None}}


@dataclass(frozen=True)
class EagleConfig:
    version: int  # 1 or 3
    dim: int
    vocab_size: int  # the target's (inputs, and the decoder's view of the logits)
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    target_layers: int  # the target's depth (its final hidden state is captured at index target_layers)
    head_dim: int | None = None
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: 0-indexed target layers whose outputs are fused
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    norm_eps: float = 1e-5
    attention_bias: bool = False
    qk_norm: bool = False
    head_vocab_size: int | None = None  # reduced draft LM head (EAGLE-3)
    ttt_steps: int = 1  # the unroll length it was trained with (informational; decoding drafts any length)
    n_layers: int = 1  # the EAGLE layer plus n_layers - 1 plain Llama blocks
    fc_bias: bool = True  # EAGLE-1's fc (EAGLE-3's never has one)
    fc_norm: bool = False  # EAGLE-3.1: an RMS norm per fused layer before fc
    feature_sampling: bool = False  # FSPAD: a token-gated refinement of fc's output
    partial_alignment: bool = False  # FSPAD: the layer writes a head output and a separate next state (2d wide)
    parallel: int = 0  # P-EAGLE: drafts per forward (0: autoregressive)
    mask_id: int | None = None  # P-EAGLE: the mask slots' token id
    sliding_window: int | None = None  # attend to the last N positions only; None = full attention

    def layer_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            dim=self.dim,
            n_layers=1,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            hidden_dim=self.hidden_dim,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            norm_eps=self.norm_eps,
            attention_bias=self.attention_bias,
            qk_norm=self.qk_norm,
        )

    @property
    def feature_dim(self) -> int:
        return self.dim * (len(self.aux_layers) if self.version == 3 else 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        return d


class Eagle(ReducedVocab, nn.Module):
    reads_target_features = True
    growable = ("extra.",)  # train.init_checkpoint from a shallower EAGLE: the added blocks keep their init

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        if cfg.version not in (1, 3):
            raise ValueError(f"EAGLE version must be 1 or 3, got {cfg.version}")
        if cfg.version == 3 and not cfg.aux_layers:
            raise ValueError("EAGLE-3 needs aux_layers (the target layers whose outputs it fuses)")
        self.cfg = cfg = type(cfg)(**{**cfg.to_dict(), "aux_layers": tuple(cfg.aux_layers)})
        d, lc = cfg.dim, cfg.layer_config()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)  # a frozen copy of the target's
        self.embed_tokens.weight.requires_grad_(False)
        self.self_attn = Attention(lc)
        if cfg.version == 1:
            self.fc = nn.Linear(2 * d, d, bias=cfg.fc_bias)
        else:
            self.fc = nn.Linear(cfg.feature_dim, d, bias=False)
            if cfg.fc_norm:
                self.fc_norm = nn.ModuleList(RMSNorm(d, cfg.norm_eps) for _ in cfg.aux_layers)
            self.embed_norm = RMSNorm(d, cfg.norm_eps)
            self.hidden_norm = RMSNorm(d, cfg.norm_eps)
            self.norm = RMSNorm(d, cfg.norm_eps)
            hd, a = lc.hd, self.self_attn  # q/k/v read [norm(e), norm(state)]: 2d wide
            a.q_proj = nn.Linear(2 * d, cfg.n_heads * hd, bias=cfg.attention_bias)
            a.k_proj = nn.Linear(2 * d, cfg.n_kv_heads * hd, bias=cfg.attention_bias)
            a.v_proj = nn.Linear(2 * d, cfg.n_kv_heads * hd, bias=cfg.attention_bias)
        if cfg.parallel:  # P-EAGLE's mask slot inputs: a token embedding and a (pre-fc) target feature
            self.mask_embed = nn.Parameter(torch.zeros(d))
            self.mask_hidden = nn.Parameter(torch.zeros(cfg.feature_dim))
        if cfg.feature_sampling:
            self.fs = TokenGate(d, cfg.hidden_dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.norm_eps)
        self.mlp = MLP(lc)
        if cfg.partial_alignment:  # FSPAD: [head output, next state] over one residual stream
            self.mlp.down_proj = nn.Linear(cfg.hidden_dim, 2 * d, bias=False)
        self.extra = nn.ModuleList(Block(lc) for _ in range(cfg.n_layers - 1))
        if cfg.head_vocab_size:
            self.lm_head = ReducedHead(d, cfg.head_vocab_size, cfg.vocab_size)
            self._init_vocab_maps(cfg.head_vocab_size, cfg.vocab_size)
        else:
            self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(lc), persistent=False)

    # ---- shared by training and decoding ------------------------------------------------------------------------

    @property
    def target_vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """Hidden-state indices a target forward must capture (Llama.forward's capture_layers)."""
        if self.cfg.version == 1:
            return (self.cfg.target_layers,)
        return tuple(i + 1 for i in self.cfg.aux_layers)  # index i = output of 0-indexed layer i - 1

    def features(self, captured: dict, target) -> torch.Tensor:
        """A target forward's captured hidden states -> f (B, T, feature_dim)."""
        if self.cfg.version == 1:
            return target.norm(captured[self.cfg.target_layers])
        return torch.cat([captured[i] for i in self.capture_layers], -1)

    @property
    def drafts_parallel(self) -> int:
        """P-EAGLE: drafts per forward (eval/proposers.py ``ParallelFeatureRows``); 0 for autoregressive EAGLE."""
        return self.cfg.parallel

    @property
    def max_draft_len(self) -> int | None:
        return self.cfg.parallel or None  # autoregressive EAGLE drafts any length

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; P-EAGLE embeds every occurrence of its mask id as the learned mask vector."""
        e = self.embed_tokens(ids)
        if not self.cfg.parallel:
            return e
        return torch.where((ids == self.cfg.mask_id)[..., None], self.mask_embed.to(e.dtype), e)

    def mask_state(self, shape: tuple[int, int]) -> torch.Tensor:
        """P-EAGLE: the state input of mask slots, the learned mask feature projected like a target feature,
        expanded to (B, T, d)."""
        return self.project(self.mask_hidden[None, None]).expand(*shape, -1)

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features -> the layer's state input (EAGLE-3 fuses the layers with fc; EAGLE-1 reads f as is)."""
        if self.cfg.version == 1:
            return feats
        if self.cfg.fc_norm:  # EAGLE-3.1: each fused layer normalised on its own
            feats = torch.cat([n(c) for n, c in zip(self.fc_norm, feats.chunk(len(self.fc_norm), -1), strict=True)], -1)
        return self.fc(feats)

    def _inputs(self, e: torch.Tensor, state: torch.Tensor):
        """-> (attention input, residual stream)."""
        if self.cfg.version == 1:  # the reference's layer 0 has no input norm
            x = self.fc(torch.cat([e, state.to(e.dtype)], -1))
            if self.cfg.feature_sampling:
                x = self.fs(x, e)
            return x, x
        return torch.cat([self.embed_norm(e), self.hidden_norm(state)], -1), state

    def _finish(self, h: torch.Tensor) -> torch.Tensor:
        """Residual stream after attention -> the layer output (the next state; with partial_alignment the head
        output and the next state side by side, ``head_input`` / ``next_state`` take them apart)."""
        if self.cfg.partial_alignment:
            return torch.cat([h, h], -1) + self.mlp(self.post_attention_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))

    def features_in(self, signals: dict) -> bool:
        """Whether records with these signals (a manifest's) hold the features this drafter reads: EAGLE-3 the
        target layers it fuses, earlier versions the final hidden state."""
        if self.cfg.version == 3:
            return list(signals.get("hidden_aux", {}).get("layers", [])) == list(self.cfg.aux_layers)
        return "hidden_last" in signals

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        """The layer output as the LM head reads it (EAGLE-1 regresses onto post-norm features: no norm)."""
        if self.cfg.partial_alignment:
            return out[..., : self.cfg.dim]
        return out if self.cfg.version == 1 else self.norm(out)

    def draft_positions(self, steps: int) -> int:
        """Draft positions a ``steps``-step unroll trains (one per TTT step; models/gumiho.py adds its heads')."""
        return steps

    def position_weight(self, s: int, p) -> float:
        """Loss weight of draft position s + 1 under the recipe section ``p``."""
        return p.head_decay**s

    def next_state(self, out: torch.Tensor) -> torch.Tensor:
        """The layer output as the next draft step reads it (and EAGLE-1's feature loss regresses)."""
        return out[..., self.cfg.dim :] if self.cfg.partial_alignment else out

    # ---- decoding -------------------------------------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(replace(self.cfg.layer_config(), n_layers=self.cfg.n_layers), batch, max_len, p.dtype, p.device)

    def step(
        self,
        state: torch.Tensor,
        ids: torch.Tensor,
        pos: torch.Tensor | None = None,
        cache: KVCache | None = None,
        attn_mask: torch.Tensor | None = None,
        last_only: bool = False,
        valid: torch.Tensor | None = None,
    ):
        """state (B, T, d), ids (B, T) -> (logits (B, T, V_target), next state (B, T, d)), appending to ``cache``.
        last_only: logits of the last position only (B, 1, V) (the LM head is the step's largest matmul).
        valid (B, T): False at left padding (the data stage's batched writer)."""
        T, own_pos = ids.shape[1], pos is not None
        pos = default_pos(ids, cache) if pos is None else pos
        e = self.embed(ids)
        cos, sin = rope_cos_sin(pos, self.inv_freq, e.dtype)
        mask, static = step_mask(cache, T, valid, attn_mask)  # static: under eval/graphs.py GraphedEagle
        mask = window_mask(self.cfg.sliding_window, mask, pos, cache, attn_mask, static, own_pos)
        x, resid = self._inputs(e, state)
        out = self._finish(resid + self.self_attn(x, cos, sin, mask, cache, 0))
        for j, block in enumerate(self.extra):
            out = block(out, cos, sin, mask, cache, j + 1)
        if cache is not None and not static:
            cache.length += T
        return self.lm_head(self.head_input(out[:, -1:] if last_only else out)), self.next_state(out)

    @torch.no_grad()
    def optimize_for_inference(self) -> Eagle:
        """Fused q/k/v and gate/up matmuls with pre-packed weights (models/llama.py FusedLinear); decoding only."""
        return fuse_for_inference(self, [(self.self_attn, self.mlp)] + [(b.self_attn, b.mlp) for b in self.extra])

    # ---- training: training-time test -----------------------------------------------------------------------------

    def forward(
        self,
        feats: torch.Tensor,
        ids: torch.Tensor,
        steps: int = 1,
        select=None,
        head_fn=None,
        step_tokens: dict[int, torch.Tensor] | None = None,
        pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        detach: bool = False,
    ):
        """TTT unroll. feats (B, T, F) target features, ids (B, T) the sequence. Step s at position i reads token
        x_{i+s+1} and the state of step s-1 (step 0: the projected f_i) at RoPE position i+s, and predicts
        x_{i+s+2}. P-EAGLE (``parallel``): steps 1.. read the mask token and the mask state instead, so step s is
        the row's mask slot s, drafting x_{i+s+2} in the same forward as the real pair. Returns
        ``[head_fn(s, head input at select[s] (N_s, d), lm_head.weight, out at select[s])]`` or, without head_fn,
        the (steps, B, T, d) outputs. ``step_tokens[s]`` (B, T): the tokens step s reads instead (row i: its own
        draft for position i+s+1, as the SpecDec++ labels need).

        Packed rows (train.packing): ``pos`` (B, T) each token's position in its document and ``attn_mask``
        (B, T, T) the step-0 keys each query may see (causal inside its document). Later steps only ever read the
        row's own keys, so a row whose shifted token lies in the next document is wrong only for itself, and the
        objective never selects it (train/objectives.py ``shifted_teachers``).

        ``detach`` (HASS): later steps read the earlier steps' outputs as constants; the keys and values of every
        step keep their weights' gradient."""
        B, T = ids.shape
        state = self.project(feats)
        base = torch.arange(T, device=ids.device).expand(B, T) if pos is None else pos
        if attn_mask is None:
            causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()[None, None]
        else:
            causal = attn_mask[:, None]  # (B, 1, T, T); on GPU a FlexAttention block mask would go here
        kv = [([], []) for _ in range(self.cfg.n_layers)]  # per layer: the keys / values of every step so far
        results = []
        for s in range(steps):
            tok = torch.zeros_like(ids)
            if s + 1 < T:
                tok[:, : T - s - 1] = ids[:, s + 1 :]  # past the end: token 0, never selected for a loss
            if step_tokens and s in step_tokens:
                tok = step_tokens[s]
            if s and self.cfg.parallel:  # P-EAGLE: every later step is a mask slot of the row's rollout
                tok, state = torch.full_like(ids, self.cfg.mask_id), self.mask_state((B, T))
            x, resid = self._inputs(self.embed(tok), state)
            cos, sin = rope_cos_sin(base + s, self.inv_freq, x.dtype)
            seen = ttt_window(causal, base, s, self.cfg.sliding_window)
            out = self._finish(resid + self._ttt_attention(self.self_attn, x, cos, sin, *kv[0], seen))
            for j, block in enumerate(self.extra):  # through the block's call: FSDP2 gathers its weights there
                ttt = partial(self._ttt_attention, cos=cos, sin=sin, ks=kv[j + 1][0], vs=kv[j + 1][1], causal=seen)
                out = block(out, cos, sin, None, None, j + 1, attend=ttt)
            results.append(ttt_result(self, s, out, select, head_fn))
            state = self.next_state(out.detach() if detach else out)  # HASS: keys / values keep their weight gradient
        return torch.stack(results) if head_fn is None else results

    def _ttt_attention(self, a: Attention, x, cos, sin, ks: list, vs: list, causal) -> torch.Tensor:
        """One TTT step of attention ``a`` over x (B, T, in): the step's keys / values join ``ks`` / ``vs``; a query
        at i sees the step-0 keys <= i (causal) plus its own key of every later step (the row's simulated drafts)."""
        B, T, _ = x.shape
        lc = self.cfg.layer_config()
        H, Hkv, hd = lc.n_heads, lc.n_kv_heads, lc.hd
        q, k, v = a.q_proj(x).view(B, T, H, hd), a.k_proj(x).view(B, T, Hkv, hd), a.v_proj(x).view(B, T, Hkv, hd)
        if lc.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, hd)
        ks.append(apply_rope(k.transpose(1, 2), cos, sin).repeat_interleave(H // Hkv, 1))
        vs.append(v.transpose(1, 2).repeat_interleave(H // Hkv, 1))
        scale = 1.0 / math.sqrt(hd)
        scores = [(q @ ks[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
        scores += [(q * kj).sum(-1, keepdim=True) * scale for kj in ks[1:]]
        p = torch.softmax(torch.cat(scores, -1).to(torch.promote_types(q.dtype, torch.float32)), -1).to(q.dtype)
        y = p[..., :T] @ vs[0]
        for j, vj in enumerate(vs[1:]):
            y = y + p[..., T + j : T + j + 1] * vj
        return a.o_proj(y.transpose(1, 2).reshape(B, T, H * hd))

    def num_params(self, exclude_embeddings: bool = False) -> int:
        if hasattr(self, "_counts"):  # packed weights are not parameters any more
            return self._counts[exclude_embeddings]
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed_tokens.weight.numel() if exclude_embeddings else n


class TokenGate(nn.Module):
    """FSPAD's feature sampling: x + W_down(SiLU(W_gate e) * W_up norm(x)), a SwiGLU whose gate reads the token
    embedding e; W_down starts at zero, so the module starts as the identity."""

    def __init__(self, dim: int, hidden: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        nn.init.zeros_(self.down_proj.weight)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return x + self.down_proj(torch.nn.functional.silu(self.gate_proj(e)) * self.up_proj(self.norm(x)))


def ttt_window(causal: torch.Tensor, base: torch.Tensor, s: int, window: int | None) -> torch.Tensor:
    """The step-0 keys a TTT step-s query may see: ``causal`` (B|1, 1, T, T), cut to a sliding window of ``window``
    positions around the query's position base + s (keys at positions > base + s - window), as decoding cuts it."""
    if window is None:
        return causal
    return causal & (base[:, None, :, None] + s - base[:, None, None, :] < window)


def ttt_result(model, s: int, out: torch.Tensor, select, head_fn):
    """TTT step s's output (B, T, d), or ``head_fn`` of its selected rows through ``model``'s head (the contract of
    ``Eagle.forward``, shared by the other TTT drafters)."""
    if head_fn is None:
        return out
    flat = out.reshape(-1, out.shape[-1])
    sel = flat if select is None else flat[select[s]]
    state = model.next_state(sel) if hasattr(model, "next_state") else sel
    return head_fn(s, model.head_input(sel), model.lm_head.weight, state)


def default_aux_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's fusion layers (SpecForge's aux_hidden_state_layer_ids): outputs of layers 1, L/2-1, L-4."""
    return (1, n_layers // 2 - 1, n_layers - 4) if n_layers >= 5 else tuple(range(min(3, n_layers)))


def _checked_init_layers(layers: list[int], cfg: EagleConfig, t) -> list[int]:
    """drafter.init_layers: the target layers copied into the blocks after the EAGLE layer, checked."""
    if len(layers) not in (0, cfg.n_layers - 1):
        raise DraftsmithError(
            f"drafter.init_layers has {len(layers)} entries: it names the target layers copied "
            f"into the {cfg.n_layers - 1} blocks after the EAGLE layer (drafter.n_layers - 1)"
        )
    if layers and cfg.hidden_dim != t.hidden_dim:
        raise DraftsmithError("drafter.init_layers needs drafter.hidden_dim to be the target's")
    if layers and (cfg.qk_norm, cfg.attention_bias) != (t.qk_norm, t.attention_bias):
        raise DraftsmithError(
            "drafter.init_layers copies target layers with q/k-norm or q/k/v bias into llama-style blocks: "
            "set drafter.layer_style=target"
        )
    for j, src in enumerate(layers):
        if not 0 <= src < t.n_layers:
            raise DraftsmithError(f"drafter.init_layers[{j}] = {src} is outside the target's {t.n_layers} layers")
    return layers


def build_eagle(
    cfg: EagleDrafterConfig | dict, target, counts: torch.Tensor | None = None, eos_ids: set[int] = frozenset(), **_
) -> Eagle:
    """A fresh EAGLE drafter shaped like one target layer (plain Llama attention unless ``layer_style`` is target);
    embeddings (and EAGLE-1's LM head) copied frozen from the target; EAGLE-3's head starts from the target's rows
    of the kept vocabulary and trains. With
    ``draft_vocab``, EAGLE-1's frozen head is the target's rows of the kept vocabulary (FR-Spec): a draft step
    no longer pays for the whole vocabulary."""
    from draftsmith.models.draft_lm import select_vocab

    p = as_section(EagleDrafterConfig, cfg)
    t, version = target.cfg, p.version
    aux = tuple(p.aux_layers or default_aux_layers(t.n_layers)) if version == 3 else ()
    for i in aux:
        if not 0 <= i < t.n_layers:
            raise DraftsmithError(f"drafter.aux_layers: layer {i} is outside the target's {t.n_layers} layers")
    n_vocab = p.draft_vocab
    cfg = EagleConfig(
        version=version,
        dim=t.dim,
        vocab_size=t.vocab_size,
        n_heads=t.n_heads,
        n_kv_heads=t.n_kv_heads,
        hidden_dim=p.hidden_dim or t.hidden_dim,
        target_layers=t.n_layers,
        head_dim=t.head_dim,
        aux_layers=aux,
        rope_theta=t.rope_theta,
        rope_scaling=t.rope_scaling,
        norm_eps=t.norm_eps,
        attention_bias=t.attention_bias and p.layer_style == "target",
        qk_norm=t.qk_norm and p.layer_style == "target",
        head_vocab_size=n_vocab if n_vocab and n_vocab < t.vocab_size else None,
        ttt_steps=p.ttt_steps,
        n_layers=p.n_layers,
        fc_bias=p.fc_bias,
        fc_norm=p.fc_norm,
        feature_sampling=p.feature_sampling,
        partial_alignment=p.partial_alignment,
        parallel=p.parallel_drafts,
        sliding_window=p.sliding_window,
        mask_id=(t.vocab_size - 1 if p.mask_token is None else p.mask_token) if p.parallel_drafts else None,
    )
    if cfg.mask_id is not None and cfg.mask_id >= t.vocab_size:
        raise DraftsmithError(f"drafter.mask_token {cfg.mask_id} is outside the target's vocabulary ({t.vocab_size})")
    layers = _checked_init_layers(p.init_layers or [], cfg, t)
    copied = [layer_state(target, src, "drafter.init_layers") for src in layers]  # Llama-shaped targets only
    model = Eagle(cfg).to(target.embed_tokens.weight.dtype)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.embed_tokens.weight)
        head = target.lm_head.weight
        if cfg.head_vocab_size:
            if counts is None:
                raise DraftsmithError("drafter.draft_vocab needs training records to count token frequencies")
            keep = select_vocab(counts, cfg.head_vocab_size, eos_ids)
            model.lm_head.weight.copy_(head[keep])
            model.set_head_vocab(keep)
        else:
            model.lm_head.weight.copy_(head)
        if cfg.parallel:  # the mask slot starts as an average token; its feature as a small random one
            model.mask_embed.copy_(target.embed_tokens.weight.float().mean(0))
            model.mask_hidden.normal_(0.0, 0.02)
        if cfg.partial_alignment:  # both outputs start as EAGLE-1's one
            w = model.mlp.down_proj.weight
            w[cfg.dim :].copy_(w[: cfg.dim])
        for j, block in enumerate(model.extra):
            if layers:
                block.load_state_dict(copied[j])
            else:  # the identity at init: a deeper drafter starts as the 1-layer one (and can grow from it)
                nn.init.zeros_(block.self_attn.o_proj.weight)
                nn.init.zeros_(block.mlp.down_proj.weight)
    # EAGLE-1 reads tokens through the target's LM head (or a slice of it), frozen; EAGLE-3's head is its own.
    model.lm_head.weight.requires_grad_(version == 3 and not p.freeze_lm_head)
    return model


def build_on_eagle(model_cls, cfg_cls, p, own: dict, target, **data) -> Eagle:
    """A drafter built on EAGLE's layer (Gumiho, Falcon): ``p``'s EAGLE fields built as ``build_eagle`` builds them,
    the weights and their trainability moved into ``model_cls(cfg_cls(EAGLE's config + own))``; parameters of its
    own (absent from EAGLE) keep their init."""
    eagle_fields = {k: v for k, v in p.model_dump().items() if k in EagleDrafterConfig.model_fields and k != "kind"}
    eagle = build_eagle(EagleDrafterConfig(**eagle_fields), target, **data)
    model = model_cls(cfg_cls(**{**eagle.cfg.to_dict(), **own})).to(target.embed_tokens.weight.dtype)
    _, unexpected = model.load_state_dict(eagle.state_dict(), strict=False)
    assert not unexpected, unexpected
    for name, w in eagle.named_parameters():
        model.get_parameter(name).requires_grad_(w.requires_grad)
    return model


def eagle_from_config(cfg: dict) -> Eagle:
    return Eagle(EagleConfig(**cfg))


def export_formats(info: dict) -> dict[str, str]:
    """EAGLE-3 writes speculators' layout for vLLM and SGLang's own; EAGLE-1 the engines' EAGLE-1 layout
    (DrafterSpec.exports)."""
    w, cfg = EXPORT, info.get("config", {})
    if cfg.get("feature_sampling") or cfg.get("partial_alignment"):
        why = "refused: FSPAD's layers (feature_sampling, partial_alignment) have no layout in vLLM or SGLang"
        return {"vllm": why, "sglang": why}
    if cfg.get("version", 3) == 3:
        read, usage = w + "read_eagle3", w + "usage_eagle3"
        return {
            "vllm": {"write": w + "to_speculators", "read": read, "usage": usage},
            "sglang": {"write": w + "to_sglang_eagle3", "read": read, "usage": usage},
        }
    read, usage = w + "read_eagle1", w + "usage_eagle1"  # the engines' EAGLE-1 layouts drop d2t / t2d
    return {
        "vllm": {"write": w + "to_eagle1_vllm", "read": read, "usage": usage, "head_ids": True},
        "sglang": {"write": w + "to_eagle1_sglang", "read": read, "usage": usage, "head_ids": True},
    }


def engine_methods(info: dict) -> dict:
    """vLLM serves EAGLE-3 by its eagle3 method and EAGLE-1 by eagle, from the vllm (or sglang) folder; P-EAGLE by
    eagle3 with parallel drafting, from the vllm folder (DrafterSpec.engines)."""
    cfg = info.get("config", {})
    if cfg.get("feature_sampling") or cfg.get("partial_alignment"):
        return {}
    if cfg.get("parallel"):
        return {"vllm": {"method": "eagle3", "formats": ("vllm",), "parallel_drafting": True}}
    method = "eagle3" if cfg.get("version", 3) == 3 else "eagle"
    return {"vllm": {"method": method, "formats": ("vllm", "sglang")}}


def check_recipe(recipe) -> None:
    """EAGLE against the rest of the recipe (DrafterSpec.check): SGLang loads a one-layer EAGLE-3."""
    d, ex = recipe.drafter, recipe.export
    if d.version == 3 and d.n_layers > 1 and ex.enabled and "sglang" in ex.formats:
        raise ValueError(
            f"export.formats has sglang, which loads a one-layer EAGLE-3, but drafter.n_layers is "
            f"{d.n_layers}: export formats [vllm] or [hf], or train one layer"
        )


SPEC = DrafterSpec(
    kind="eagle",
    config=EagleDrafterConfig,
    build=build_eagle,
    from_config=eagle_from_config,
    interface="features",
    objective="draftsmith.train.objectives:eagle_objective",
    # an acceptance head's labels are made in the loop: they need the target's features and distribution
    acceptance={"inputs": OBJ + "eagle_acceptance_inputs", "signals": frozenset(), "needs_target": True},
    signals=frozenset({"topk", "hidden_last", "hidden_aux"}),
    fsdp_wrap=(Block,),
    packs=True,
    check=check_recipe,
    exports=export_formats,
    engines=engine_methods,
)  # Block: the layers after the first
