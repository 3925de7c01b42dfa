"""Fallback target for architectures the own model (models/llama.py) does not implement.

The transformers model sits behind the calls the decoder makes: ``new_cache``, and a forward that reads and
extends a KV cache which rolls back when ``cache.length`` is lowered (the transformers cache is cropped before
the next forward). It is slower than the own model (transformers' per-step overhead) but exact. The decoder's
acceptance rules do not depend on the model, so greedy output still equals this target's own greedy output.

Supported: autoregressive and chain speculative decoding at batch 1 (eval). Everything else raises a one-line
error that names the missing piece: tree attention, left-padded batches (data generation), layer capture and
in-loop teachers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import LlamaConfig


class FallbackCache:
    """A transformers DynamicCache with the own cache's ``length`` / ``max_len`` contract."""

    def __init__(self, max_len: int):
        from transformers import DynamicCache

        self.dc = DynamicCache()
        self.length = 0
        self.max_len = max_len


@dataclass(frozen=True)
class _Arch:
    model_type: str


class HFFallback(nn.Module):
    """A transformers causal LM (any architecture with a croppable cache) behind the own model's decode API."""

    def __init__(self, hf_model, cfg: LlamaConfig):
        super().__init__()
        self.hf = hf_model
        self.cfg = cfg  # sizes only (vocabulary, width, depth): what drafter builders and reports read
        self.arch = _Arch(hf_model.config.model_type)

    @property
    def embed_tokens(self):
        return self.hf.get_input_embeddings()

    def new_cache(self, batch: int, max_len: int) -> FallbackCache:
        if batch != 1:
            raise DraftsmithError(
                f"a {self.arch.model_type} target runs through transformers (fallback path), "
                f"which decodes one sequence at a time; batched generation needs a Llama-family "
                f"target"
            )
        return FallbackCache(max_len)

    def forward(
        self,
        ids,
        pos=None,
        cache: FallbackCache | None = None,
        valid=None,
        attn_mask=None,
        capture_layers=(),
        logits_at=None,
        return_hidden=False,
        head_fn=None,
    ):
        unsupported = {
            "tree attention (eval.strategy=tree/dynamic_tree)": attn_mask is not None,
            "padding masks (batched data generation)": valid is not None,
            "hidden-state capture": bool(capture_layers) or return_hidden or head_fn is not None,
        }
        for what, asked in unsupported.items():
            if asked:
                raise DraftsmithError(
                    f"{what} needs a Llama-family target; {self.arch.model_type!r} runs through "
                    f"the transformers fallback, which supports AR and chain decoding only"
                )
        if cache is None:
            logits = self.hf(input_ids=ids).logits
        else:
            if cache.length + ids.shape[1] > cache.max_len:
                raise ValueError(f"KV cache overflow: {cache.length}+{ids.shape[1]} > {cache.max_len}")
            extra = cache.dc.get_seq_length() - cache.length
            if extra > 0:  # a rejected draft: roll back (a negative count means "drop this many" in 4.x and 5.x)
                cache.dc.crop(-extra)
            start = cache.length
            if pos is None:
                pos = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
            cache_position = torch.arange(start, start + ids.shape[1], device=ids.device)
            logits = self.hf(
                input_ids=ids, past_key_values=cache.dc, use_cache=True, position_ids=pos, cache_position=cache_position
            ).logits
            cache.length += ids.shape[1]
        return logits[logits_at] if logits_at is not None else logits

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.hf.parameters())
        return n - self.embed_tokens.weight.numel() if exclude_embeddings else n

    def optimize_for_inference(self) -> HFFallback:
        return self  # transformers' modules as they are


def fallback_config(cfg: dict) -> LlamaConfig:
    """The sizes a drafter builder needs, from any HF config (names differ across families)."""

    def get(*names, default=None):
        for n in names:
            if cfg.get(n) is not None:
                return cfg[n]
        if default is None:
            raise DraftsmithError(f"config.json has none of {names}")
        return default

    dim = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head")
    return LlamaConfig(
        vocab_size=get("vocab_size"),
        dim=dim,
        n_layers=get("num_hidden_layers", "n_layer"),
        n_heads=heads,
        n_kv_heads=get("num_key_value_heads", default=heads),
        hidden_dim=get("intermediate_size", "n_inner", default=4 * dim),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def load_fallback(path, cfg: dict, dtype, device: str, trust_remote_code: bool) -> HFFallback:
    from draftsmith.models.loading import hf_model_from_folder

    hf = hf_model_from_folder(path, "target.model", dtype=dtype, trust_remote_code=trust_remote_code)
    return HFFallback(hf.to(device).eval(), fallback_config(cfg))
