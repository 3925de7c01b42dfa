"""Medusa-1 heads (docs/algorithms.md A5.1-A5.2): K heads on the frozen target's final hidden state h_t (after its
final norm). Head k (0-based) predicts token t+k+2 (the target's own LM head predicts t+1).

Head k = ResBlock^L then its own LM head. ResBlock(x) = x + SiLU(W x + b) with W zero-initialised, so every
head starts as the target's LM head (each head's LM head is a copy of it). Unlike the reference code, the L
blocks of a head are separate modules, not one instance repeated (A5.1's quirk).

Decoder protocol: models/feature_heads.py. Medusa's drafts do not depend on each other, which rejection sampling
allows (each draft is drawn from the q it reports).

**Medusa-2** (``lora`` set): the heads train jointly with LoRA adapters (peft) on a copy of the target, which then
computes the features inside the forward, with gradients. The objective adds the adapted target's own LM loss
(self-distillation towards the original target's distribution) and scales the heads' losses by
``heads_coefficient``. Checkpoints hold the heads plus ``target_adapter.safetensors`` (the LoRA tensors only); the
decoder serves the target with the adapters merged in (``merge_adapter``), and is lossless with respect to that
adapted target.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.feature_heads import (
    HEADS_ACCEPTANCE,
    FeatureHeads,
    HeadsConfig,
    HeadsSection,
    copy_target_head,
    head_vocab,
)
from draftsmith.models.hf_target import HFTarget
from draftsmith.models.llama import Block
from draftsmith.models.spec import EXPORT, DrafterSpec, as_section

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_FILE = "target_adapter.safetensors"


class MedusaDrafterConfig(HeadsSection):
    """Medusa-1 heads on the frozen target's final hidden state (docs/algorithms.md A5.1-A5.2); decay 0.8. With
    lora_r > 0, Medusa-2 (A5.3): joint training with LoRA adapters on the target."""

    kind: Literal["medusa"] = "medusa"
    lora_r: int = Field(0, ge=0)
    """Medusa-2: LoRA rank of the adapters trained on (a copy of) the target together with the heads; 0 =
    Medusa-1 (frozen target). The eval serves the target with the adapters merged."""
    lora_alpha: float = Field(16.0, gt=0)
    """LoRA scale numerator: the update is (lora_alpha / lora_r) B A."""
    lora_modules: list[str] | None = None
    """Target linear layers that get adapters; None = q/k/v/o and gate/up/down projections."""
    lora_lr_ratio: float = Field(0.25, gt=0)
    """Medusa-2: the adapters train at train.lr x this (the heads at train.lr). A5.3 gives the heads 4x the
    backbone's rate; a higher ratio lets the adapted target drift further from the original."""
    heads_coefficient: float = Field(0.2, gt=0)
    """Medusa-2: loss = target loss (self-distillation to the original target) + this x sum_k decay^k head_k."""


@dataclass(frozen=True)
class MedusaConfig(HeadsConfig):
    lora: dict | None = None  # Medusa-2: {"r", "alpha", "modules", "lr_ratio"} of the target's LoRA adapters


def attach_lora(model: nn.Module, lora: dict) -> nn.Module:
    """Inject LoRA adapters (peft) into ``model``'s named linear layers; only the adapters train."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise DraftsmithError("Medusa-2 (drafter.lora_r > 0) needs peft: pip install peft") from e
    model.requires_grad_(False)
    return inject_adapter_in_model(
        LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=list(lora["modules"]), lora_dropout=0.0), model
    )


def adapter_state(model: nn.Module, state: dict | None = None) -> dict[str, torch.Tensor]:
    """The LoRA tensors of an adapted model, peft's key format (``layers.0.self_attn.q_proj.lora_A.weight``).
    ``state``: the adapted model's full state dict when it had to be gathered first (FSDP2, train/state.py)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(model, state).items()}


@torch.no_grad()
def merge_adapter(target: nn.Module, state: dict[str, torch.Tensor], lora: dict) -> None:
    """W += (alpha / r) B A for every adapted linear of a plain target (serving needs no peft)."""
    scale = lora["alpha"] / lora["r"]
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key[: -len(".lora_A.weight")]
        b = state[f"{name}.lora_B.weight"]
        try:
            lin = target.get_submodule(name)
        except AttributeError as e:
            raise DraftsmithError(f"{ADAPTER_FILE}: the target has no layer {name!r} (a different target?)") from e
        lin.weight += scale * (b.to(lin.weight) @ a.to(lin.weight))


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)  # identity at init: the head starts as the target's LM head

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaHeads(FeatureHeads):
    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(cfg.dim) for _ in range(cfg.n_layers))) for _ in range(cfg.n_heads)
        )
        n_out = cfg.head_vocab_size or cfg.vocab_size
        self.lm_heads = nn.ModuleList(nn.Linear(cfg.dim, n_out, bias=False) for _ in range(cfg.n_heads))
        if cfg.head_vocab_size:
            self._init_vocab_maps(cfg.head_vocab_size, cfg.vocab_size)
        # self.base (FeatureHeads), Medusa-2 training: the LoRA-adapted copy of the target (never saved whole)
        self.target_adapter = None  # a loaded Medusa-2 checkpoint: the LoRA tensors to merge into the target

    checkpoint_exclude = ("base.",)  # the adapted target is saved as its adapters only (ADAPTER_FILE)

    @property
    def max_draft_len(self) -> int:
        return self.cfg.n_heads

    def param_groups(self) -> list[tuple[list[nn.Parameter], float]]:
        """(trainable parameters, learning-rate multiplier) groups for the optimizer: Medusa-2's adapters train
        at ``lr_ratio`` x the heads' rate (A5.3: the heads get 4x the backbone's rate), so the adapted target
        stays close to the original."""
        heads = [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith("base.")]
        if self.base is None:
            return [(heads, 1.0)]
        adapters = [p for p in self.base.parameters() if p.requires_grad]
        return [(heads, 1.0), (adapters, self.cfg.lora.get("lr_ratio", 1.0))]

    def forward(
        self,
        h: torch.Tensor | None,
        ids: torch.Tensor | None = None,
        select: list[torch.Tensor] | None = None,
        head_fn=None,
        base_select: torch.Tensor | None = None,
        pos: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ):
        """h (..., D) target hidden states -> (K, N, V) logits over the flattened positions; or, with ``head_fn``,
        ``[head_fn(k, block_k(h[select[k]]), lm_head_k.weight)]`` (chunked losses run inside forward, where
        sharding wrappers have the weights gathered). Medusa-2: h is computed here by the adapted target from ids,
        and ``head_fn(-1, its states at base_select, its LM head)`` comes first in the list; pos / attn_mask: a
        packed batch's documents for that forward (each head reads one position only)."""
        first = []
        if self.base is not None:
            h = self.base(ids, pos=pos, attn_mask=attn_mask, return_hidden=True)
            if head_fn is not None:
                hb = h.reshape(-1, h.shape[-1])
                first = [head_fn(-1, hb if base_select is None else hb[base_select], self.base.lm_head.weight)]
        h = h.reshape(-1, h.shape[-1])
        if head_fn is not None:
            return first + [
                head_fn(k, blk(h if select is None else h[select[k]]), lm.weight)
                for k, (blk, lm) in enumerate(zip(self.blocks, self.lm_heads))
            ]
        return torch.stack(
            [self.to_target(lm(blk(h)), self.cfg.vocab_size) for blk, lm in zip(self.blocks, self.lm_heads)]
        )

    def draft_step(self, h: torch.Tensor, path: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        k = len(path) - 1  # Medusa heads ignore the drafted tokens: head k reads only h
        x = self.blocks[k](h)
        return self.to_target(self.lm_heads[k](x), self.cfg.vocab_size), x

    def num_params(self, exclude_embeddings: bool = False) -> int:
        return sum(p.numel() for p in self.parameters())


def build_medusa(
    cfg: MedusaDrafterConfig | dict, target, counts: torch.Tensor | None = None, eos_ids=frozenset(), **_
) -> MedusaHeads:
    cfg, tcfg = as_section(MedusaDrafterConfig, cfg), target.cfg
    lora = None
    if cfg.lora_r > 0 and isinstance(target, HFTarget):  # adapter names would be transformers' module paths
        raise DraftsmithError(
            f"drafter.lora_r: Medusa-2 adapts the own model's layers, and this {target.model_type!r} target runs "
            f"through transformers (target.backend): set drafter.lora_r=0"
        )
    if cfg.lora_r > 0:
        lora = {
            "r": cfg.lora_r,
            "alpha": cfg.lora_alpha,
            "modules": list(cfg.lora_modules or LORA_MODULES),
            "lr_ratio": cfg.lora_lr_ratio,
        }
    keep = head_vocab(cfg.draft_vocab, target, counts, eos_ids)
    heads = MedusaHeads(
        MedusaConfig(
            dim=tcfg.dim,
            vocab_size=tcfg.vocab_size,
            n_heads=cfg.n_heads,
            n_layers=cfg.n_layers,
            lora=lora,
            head_vocab_size=None if keep is None else len(keep),
        )
    )
    if keep is not None:
        heads.set_head_vocab(keep)
    copy_target_head(heads.lm_heads, target, cfg.freeze_lm_heads, keep)
    heads = heads.to(target.embed_tokens.weight.dtype)
    if lora is not None:  # a copy: the loop's frozen teacher (if any) must stay the original target
        heads.base = attach_lora(copy.deepcopy(target), lora)
    return heads


def check_recipe(recipe) -> None:
    """Medusa against the rest of the recipe (DrafterSpec.check): the Medusa layout has full-vocabulary heads."""
    ex = recipe.export
    if recipe.drafter.draft_vocab and ex.enabled and "medusa" in ex.formats:
        raise ValueError(
            "export.formats has medusa, but drafter.draft_vocab reduces the heads' vocabulary, "
            "which the Medusa layout cannot express: drop one of them (hf exports either)"
        )


SPEC = DrafterSpec(
    kind="medusa",
    config=MedusaDrafterConfig,
    build=build_medusa,
    from_config=lambda c: MedusaHeads(MedusaConfig(**c)),
    interface="heads",
    acceptance=HEADS_ACCEPTANCE,
    objective="draftsmith.train.objectives:heads_objective",
    signals=frozenset({"topk", "hidden_last"}),
    fsdp_wrap=(ResBlock, Block),
    packs=True,
    check=check_recipe,
    exports={
        "medusa": {  # the layout of FasterDecoding's Medusa repository (and TGI, vLLM, TensorRT-LLM after it)
            "write": EXPORT + "to_medusa",
            "read": EXPORT + "read_medusa",
            "usage": EXPORT + "usage_medusa",
            "weights": "medusa_lm_head.safetensors",
        }
    },
    engines={"vllm": {"method": "medusa", "formats": ("medusa",)}},
)  # Block: Medusa-2's adapted target
