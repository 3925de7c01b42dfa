"""Standalone draft LM (FastDraft / DistillSpec): a small Llama sharing the target's tokenizer.

It is built from the target so it can start from the target's embeddings, final norm and LM head, and
optionally from a chosen subset of the target's layers (a "layer-skip" initialisation that gives non-trivial
acceptance before any training).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from draftsmith.errors import DraftsmithError
from draftsmith.models.hf_target import io_weights, layer_state
from draftsmith.models.llama import Block, Llama, LlamaConfig
from draftsmith.models.spec import EXPORT, OBJ, DrafterSpec, Strict, as_section


class DraftLMConfig(Strict):
    """A standalone small Llama-style draft LM (FastDraft / DistillSpec), sharing the target's tokenizer unless
    ``tokenizer`` gives it its own."""

    kind: Literal["draft_lm"] = "draft_lm"
    n_layers: int = Field(2, gt=0)
    """Transformer blocks of the draft."""
    dim: int | None = Field(None, gt=0)
    """Hidden size; None = the target's (needed to copy its embeddings)."""
    n_heads: int | None = Field(None, gt=0)
    """Attention heads; None = the target's when dim is the target's, else dim // 64."""
    n_kv_heads: int | None = Field(None, gt=0)
    """Key/value heads (grouped-query attention); None = the target's when dim is the target's, else n_heads."""
    hidden_dim: int | None = Field(None, gt=0)
    """MLP width; None = the target's."""
    init_from_target: bool = True
    """Copy the target's token embeddings, final norm and LM head (requires dim == target dim)."""
    init_layers: list[int] | None = None
    """Target layer indices copied into the draft's layers (len == n_layers). None = random init."""
    freeze_embeddings: bool = True
    """Keep the copied embeddings / LM head frozen (they dominate the parameter count of small drafters)."""
    init_from: str | None = None
    """Start from an existing small model with the target's tokenizer (HF folder of safetensors, or alias);
    its architecture replaces n_layers / dim / n_heads / hidden_dim."""
    draft_vocab: int | None = Field(None, gt=1)
    """Keep only the N most frequent tokens of the training responses in the draft's LM head (VocabTrim /
    FR-Spec, docs/algorithms.md A10); EOS ids are always kept. The head rows start from the target's LM head."""
    tokenizer: str | None = None
    """The draft's own tokenizer (a vocabulary unlike the target's): a tokenizer folder, or ``train`` to learn a
    byte-level BPE of ``vocab_size`` tokens on the run's records (prompts and the target's answers), kept in
    RUN/draft_tokenizer. The draft trains on the answers re-tokenized (train.loss.kind=ce: stored top-k log-probs
    are over the target's vocabulary) and decodes with eval/hetero.py (string-level exact match, or the
    intersection of the vocabularies when sampling). Needs init_from_target=false; None = the target's."""
    vocab_size: int = Field(8192, gt=256)
    """Tokens of the BPE learned for tokenizer=train."""

    @model_validator(mode="after")
    def _init_layers_fit(self):
        if self.init_layers is not None and len(self.init_layers) != self.n_layers:
            raise ValueError(f"drafter.init_layers has {len(self.init_layers)} entries but n_layers is {self.n_layers}")
        return self


def draft_lm_config(cfg: DraftLMConfig, target_cfg: LlamaConfig) -> LlamaConfig:
    """Fill None sizes from the target; the vocabulary is always the target's."""
    t = target_cfg
    dim = cfg.dim or t.dim
    n_heads = cfg.n_heads or (t.n_heads if dim == t.dim else max(1, dim // 64))
    n_kv = cfg.n_kv_heads or (t.n_kv_heads if dim == t.dim else n_heads)
    return replace(
        t,
        dim=dim,
        n_layers=cfg.n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=t.hd if dim == t.dim and n_heads == t.n_heads else None,
        hidden_dim=cfg.hidden_dim or t.hidden_dim,
    )


def select_vocab(counts: torch.Tensor, n: int, always: set[int]) -> torch.Tensor:
    """Sorted target ids of the n most frequent tokens (ties by id), with ``always`` (EOS) forced in."""
    if n >= len(counts):
        return torch.arange(len(counts))
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: ties keep id order
    forced = sorted(i for i in always if 0 <= i < len(counts))
    rest = order[~torch.isin(order, torch.tensor(forced, dtype=order.dtype))][: n - len(forced)]
    return torch.cat([torch.tensor(forced, dtype=order.dtype), rest]).sort().values


def _init_from(path: str, target: Llama, tokenizer) -> Llama:
    """The draft's starting point: a draftsmith draft_lm checkpoint (e.g. FastDraft's pretraining stage), or an
    existing small model with the target's tokenizer (HF folder or alias)."""
    from draftsmith.models.loading import load_model, tokenizer_hash
    from draftsmith.models.registry import load_drafter

    if (Path(path) / "drafter.json").is_file():
        model, info = load_drafter(Path(path))
        if info.get("kind") != "draft_lm":
            raise DraftsmithError(f"drafter.init_from {path!r} is a {info.get('kind')} checkpoint, not a draft_lm")
        if tokenizer is not None and info.get("tokenizer_hash") not in (None, tokenizer_hash(tokenizer)):
            raise DraftsmithError(f"drafter.init_from {path!r} was trained with a different tokenizer")
    else:
        src = load_model(path)
        if tokenizer is not None and tokenizer_hash(src.tokenizer) != tokenizer_hash(tokenizer):
            raise DraftsmithError(f"drafter.init_from {path!r} has a different tokenizer than the target")
        model = src.model
    if model.cfg.vocab_size != target.cfg.vocab_size:
        raise DraftsmithError(
            f"drafter.init_from {path!r}: vocabulary {model.cfg.vocab_size} != target {target.cfg.vocab_size}"
        )
    return model


def build_draft_lm(
    cfg: DraftLMConfig | dict,
    target: Llama,
    counts: torch.Tensor | None = None,
    tokenizer=None,
    eos_ids: set[int] = frozenset(),
    draft_tokenizer=None,
) -> Llama:
    """counts: token frequencies of the training responses (needed for draft_vocab); draft_tokenizer: the loaded
    tokenizer drafter.tokenizer names (train/own_vocab.py)."""
    cfg = as_section(DraftLMConfig, cfg)
    if cfg.tokenizer is not None:
        return _build_own_vocab(cfg, target, draft_tokenizer)
    if cfg.init_from:
        draft = _init_from(cfg.init_from, target, tokenizer)
        if cfg.freeze_embeddings:
            draft.embed_tokens.weight.requires_grad_(False)
            draft.lm_head.weight.requires_grad_(False)
    else:
        draft = _build_from_target(cfg, target)
    n_vocab = cfg.draft_vocab
    if n_vocab and draft.cfg.head_vocab_size not in (None, n_vocab):
        raise DraftsmithError(
            f"drafter.draft_vocab={n_vocab} but drafter.init_from already has a {draft.cfg.head_vocab_size}-token head"
        )
    if n_vocab and draft.cfg.head_vocab_size is None:
        if counts is None:
            raise DraftsmithError("drafter.draft_vocab needs training records to count token frequencies")
        draft = _reduce_head(draft, select_vocab(counts, n_vocab, eos_ids))
        if cfg.freeze_embeddings and (cfg.init_from_target or cfg.init_from):
            draft.lm_head.weight.requires_grad_(False)
    return draft


def _reduce_head(draft: Llama, keep: torch.Tensor) -> Llama:
    """The same drafter with only the ``keep`` rows of its LM head (untied), plus the d2t / t2d maps."""
    small = Llama(replace(draft.cfg, head_vocab_size=len(keep), tie_embeddings=False))
    small = small.to(draft.embed_tokens.weight.dtype)
    sd = draft.state_dict()
    head = sd["lm_head.weight"] if "lm_head.weight" in sd else sd["embed_tokens.weight"]
    sd["lm_head.weight"] = head[keep].clone()
    small.load_state_dict(sd, strict=False)
    small.set_head_vocab(keep)
    small.embed_tokens.weight.requires_grad_(draft.embed_tokens.weight.requires_grad)
    return small


def _build_own_vocab(section: DraftLMConfig, target: Llama, tok) -> Llama:
    """A draft over its own tokenizer's vocabulary: embeddings and head start random (untied); init_layers may
    still copy target layers of the same shape. The model carries the tokenizer (saved with its checkpoints)."""
    if tok is None:
        raise DraftsmithError("drafter.tokenizer: the training loop loads the draft tokenizer (none was given)")
    bad = [k for k in ("init_from_target", "init_from", "draft_vocab") if getattr(section, k)]
    if bad:
        raise DraftsmithError(
            f"drafter.tokenizer: the draft's vocabulary is its own; set drafter.{bad[0]} to "
            f"{'false' if bad[0] == 'init_from_target' else 'null'}"
        )
    layer_cfg = draft_lm_config(section, target.cfg)
    cfg = replace(layer_cfg, vocab_size=len(tok), tie_embeddings=False, head_vocab_size=None)
    draft = Llama(cfg).to(target.embed_tokens.weight.dtype)
    if section.init_layers is not None:
        if layer_cfg != replace(target.cfg, n_layers=layer_cfg.n_layers):
            raise DraftsmithError("drafter.init_layers needs the draft's layer shape to equal the target's")
        for i, src in enumerate(section.init_layers):
            if not 0 <= src < target.cfg.n_layers:
                raise DraftsmithError(f"drafter.init_layers[{i}] = {src} is outside the target's layers")
            draft.layers[i].load_state_dict(layer_state(target, src, "drafter.init_layers"))
    draft.draft_tokenizer = tok
    return draft


def _build_from_target(section: DraftLMConfig, target: Llama) -> Llama:
    cfg = draft_lm_config(section, target.cfg)
    if cfg.n_heads % cfg.n_kv_heads:
        raise DraftsmithError(f"drafter: n_heads {cfg.n_heads} is not a multiple of n_kv_heads {cfg.n_kv_heads}")
    dtype = target.embed_tokens.weight.dtype
    draft = Llama(cfg).to(dtype)
    if section.init_from_target:
        if cfg.dim != target.cfg.dim:
            raise DraftsmithError(
                f"drafter.dim {cfg.dim} != target dim {target.cfg.dim}: set "
                f"drafter.init_from_target=false or drop drafter.dim"
            )
        embed, norm, head = io_weights(target, "drafter.init_from_target")  # (a transformers target: checked)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(embed)
            draft.norm.weight.copy_(norm)
            if not cfg.tie_embeddings:
                draft.lm_head.weight.copy_(head)
    layers = section.init_layers
    if layers is not None:
        for i, src in enumerate(layers):
            if not 0 <= src < target.cfg.n_layers:
                raise DraftsmithError(
                    f"drafter.init_layers[{i}] = {src} is outside the target's {target.cfg.n_layers} layers"
                )
        copied = [layer_state(target, src, "drafter.init_layers") for src in layers]  # Llama-shaped targets only
        if cfg != replace(target.cfg, n_layers=cfg.n_layers):
            raise DraftsmithError("drafter.init_layers needs the draft's layer shape to equal the target's")
        for i, sd in enumerate(copied):
            draft.layers[i].load_state_dict(sd)
    if section.freeze_embeddings and section.init_from_target:
        # Frozen copies of the target's big vocab matrices: cheaper steps and no drift of the shared space.
        draft.embed_tokens.weight.requires_grad_(False)
        draft.lm_head.weight.requires_grad_(False)
        draft.norm.weight.requires_grad_(True)
    return draft


SPEC = DrafterSpec(
    kind="draft_lm",
    config=DraftLMConfig,
    build=build_draft_lm,
    from_config=lambda c: Llama(LlamaConfig(**c)),
    interface="tokens",
    causal_lm=True,
    objective="draftsmith.train.objectives:draft_lm_objective",
    # an acceptance head reads the frozen draft LM on the data stage's stored SpecDec++ labels
    acceptance={"inputs": OBJ + "draft_lm_acceptance_inputs", "signals": frozenset({"specdec"}), "needs_target": False},
    signals=frozenset({"topk"}),
    fsdp_wrap=(Block,),
    packs=True,
    exports={  # a plain transformers Llama folder; vLLM's draft_model method reads the same
        fmt: {
            "write": EXPORT + "to_draft_lm_hf",
            "read": EXPORT + "read_draft_lm_hf",
            "usage": EXPORT + "usage_draft_lm",
            "plain_lm": True,
        }
        for fmt in ("hf", "vllm")
    },
    engines={"vllm": {"method": "draft_model", "formats": ("hf", "vllm")}},
)
