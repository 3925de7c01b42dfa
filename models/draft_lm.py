"""Standalone draft LM (FastDraft / DistillSpec): a small Llama sharing the target's tokenizer.

It is built from the target so it can start from the target's embeddings, final norm and LM head, and
optionally from a chosen subset of the target's layers (a "layer-skip" initialisation that gives non-trivial
acceptance before any training).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import Llama, LlamaConfig


def draft_lm_config(params: dict, target_cfg: LlamaConfig) -> LlamaConfig:
    """Fill None sizes from the target; the vocabulary is always the target's."""
    t = target_cfg
    dim = params.get("dim") or t.dim
    n_heads = params.get("n_heads") or (t.n_heads if dim == t.dim else max(1, dim // 64))
    n_kv = params.get("n_kv_heads") or (t.n_kv_heads if dim == t.dim else n_heads)
    return replace(
        t,
        dim=dim,
        n_layers=params.get("n_layers", 2),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=t.hd if dim == t.dim and n_heads == t.n_heads else None,
        hidden_dim=params.get("hidden_dim") or t.hidden_dim,
    )


def build_draft_lm(params: dict, target: Llama) -> Llama:
    cfg = draft_lm_config(params, target.cfg)
    if cfg.n_heads % cfg.n_kv_heads:
        raise DraftsmithError(f"drafter: n_heads {cfg.n_heads} is not a multiple of n_kv_heads {cfg.n_kv_heads}")
    dtype = target.embed_tokens.weight.dtype
    draft = Llama(cfg).to(dtype)
    tsd = target.state_dict()
    if params.get("init_from_target", True):
        if cfg.dim != target.cfg.dim:
            raise DraftsmithError(f"drafter.dim {cfg.dim} != target dim {target.cfg.dim}: set "
                                  f"drafter.init_from_target=false or drop drafter.dim")
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(tsd["embed_tokens.weight"])
            draft.norm.weight.copy_(tsd["norm.weight"])
            if not cfg.tie_embeddings:
                draft.lm_head.weight.copy_(tsd["lm_head.weight"])
    layers = params.get("init_layers")
    if layers is not None:
        if cfg != replace(target.cfg, n_layers=cfg.n_layers):
            raise DraftsmithError("drafter.init_layers needs the draft's layer shape to equal the target's")
        for i, src in enumerate(layers):
            if not 0 <= src < target.cfg.n_layers:
                raise DraftsmithError(f"drafter.init_layers[{i}] = {src} is outside the target's "
                                      f"{target.cfg.n_layers} layers")
            draft.layers[i].load_state_dict(target.layers[src].state_dict())
    if params.get("freeze_embeddings", True) and params.get("init_from_target", True):
        # Frozen copies of the target's big vocab matrices: cheaper steps and no drift of the shared space.
        draft.embed_tokens.weight.requires_grad_(False)
        draft.lm_head.weight.requires_grad_(False)
        draft.norm.weight.requires_grad_(True)
    return draft
