"""Kangaroo: self-speculative drafting from the target's own first layers plus a small trained adapter
(docs/algorithms.md A19).

The drafter is the target cut after ``exit_layer`` layers (the shallow sub-network: frozen copies of the target's
layers 0..exit_layer-1, its embeddings), then an adapter (one attention layer with its input norm, and a final
norm), then the target's frozen LM head. Only the adapter trains, distilled towards the target's next-token
distribution with the draft LM objective, so the drafter costs exit_layer + 1 layer steps per draft and shares
its first layers' weights with the target.

It is built as a plain Llama of exit_layer + 1 layers whose last layer's MLP is zero and frozen: that layer
computes exactly an attention-only adapter, and every consumer of a draft LM (draftsmith's token decoder, the
``hf`` and vLLM ``draft_model`` exports, transformers' assisted generation) runs it unchanged. Kangaroo's second
early exit, stop drafting once the draft's top-1 probability falls below a threshold, is the ``confidence`` stop
rule (``eval.stop: {rule: confidence, threshold: 0.6}``; recipe ``kangaroo-smollm2``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch
from pydantic import Field

from draftsmith.errors import DraftsmithError
from draftsmith.models.draft_lm import SPEC as DRAFT_LM
from draftsmith.models.hf_target import io_weights, layer_state
from draftsmith.models.llama import Llama
from draftsmith.models.spec import DrafterSpec, Strict, as_section


class KangarooConfig(Strict):
    """The target's first layers (frozen) plus a trained attention adapter and the target's LM head."""

    kind: Literal["kangaroo"] = "kangaroo"
    exit_layer: int = Field(2, ge=0)
    """The shallow sub-network: the target's layers 0..exit_layer-1, copied and frozen (the paper exits after 2 of
    Vicuna-7B's 32 layers; 0 = the adapter reads the embeddings). Must leave at least one target layer after it."""
    adapter_init: Literal["target", "random"] = "target"
    """target: the adapter's attention and norms start as the target's layer exit_layer (the layer the shallow
    states feed in the target); random: fresh."""
    train_shallow: bool = False
    """Also train the copied shallow layers (then they no longer share the target's weights)."""


def build_kangaroo(cfg: KangarooConfig | dict, target: Llama, **_) -> Llama:
    """A Llama of exit_layer + 1 layers: the target's first exit_layer layers, the adapter (its MLP zero), the
    target's embeddings, final norm (trainable: the adapter's output norm) and LM head."""
    p = as_section(KangarooConfig, cfg)
    n = target.cfg.n_layers
    if p.exit_layer >= n:
        raise DraftsmithError(f"drafter.exit_layer={p.exit_layer} leaves none of the target's {n} layers after it")
    shallow = [layer_state(target, i, "drafter.kind=kangaroo") for i in range(p.exit_layer)]  # Llama-shaped only
    start = layer_state(target, p.exit_layer, "drafter.kind=kangaroo")
    draft = Llama(replace(target.cfg, n_layers=p.exit_layer + 1)).to(target.embed_tokens.weight.dtype)
    embed, norm, head = io_weights(target, "drafter.kind=kangaroo")
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(embed)
        draft.norm.weight.copy_(norm)
        if not draft.cfg.tie_embeddings:
            draft.lm_head.weight.copy_(head)
        for i, sd in enumerate(shallow):
            draft.layers[i].load_state_dict(sd)
        last = draft.layers[-1]
        if p.adapter_init == "target":
            last.load_state_dict(start)
        for w in last.mlp.parameters():
            w.zero_()  # down(silu(gate x) * up x) = 0: the layer is attention only
    adapter = f"layers.{p.exit_layer}."
    for name, w in draft.named_parameters():
        if name.startswith(adapter):  # its MLP stays zero; its second norm only feeds that MLP
            w.requires_grad_(".mlp." not in name and "post_attention_layernorm" not in name)
        else:
            w.requires_grad_(name == "norm.weight" or (p.train_shallow and name.startswith("layers.")))
    return draft


SPEC = DrafterSpec(
    kind="kangaroo",
    config=KangarooConfig,
    build=build_kangaroo,
    from_config=DRAFT_LM.from_config,
    interface="tokens",
    causal_lm=True,
    objective=DRAFT_LM.objective,
    signals=DRAFT_LM.signals,
    fsdp_wrap=DRAFT_LM.fsdp_wrap,
    packs=True,
    exports=DRAFT_LM.exports,
    engines=DRAFT_LM.engines,
)
