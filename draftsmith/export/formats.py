"""Tensor-name and config contracts of the formats serving engines load, both ways (draftsmith/export/writer.py writes,
``load_export`` reads back for the round-trip test).

- **speculators / vLLM** (EAGLE-3): config.json with ``speculators_model_type: eagle3`` and ``speculators_config``
  (proposal method, verifier) and *no* top-level ``model_type`` (vLLM routes on that); the layer under
  ``layers.0.*``; ``d2t`` int64 offsets (target id = draft id + d2t[id]) and ``t2d`` a bool mask over the target
  vocabulary. ``transformer_layer_config.model_type`` picks the engine's layer class: qwen3 for a q/k-norm layer,
  else llama. Checked against the ``speculators`` package 0.9.0 (it loads the export as ``Eagle3DraftModel``:
  same tensors, same forward). A draft LM exports as a plain HF Llama folder, which vLLM's draft-model
  speculation loads.
- **SGLang** (EAGLE-3, ``LlamaForCausalLMEagle3``): the layer under ``midlayer.*``; SGLang silently skips names it
  does not know, and its layer has no q/k-norm and no q/k/v bias, so such layers are refused. Its aux-layer ids
  name layer *outputs* (0-indexed), the same as our ``aux_layers``; vLLM captures the residual *entering* layer
  i, hence ids + 1 (written at the top level, which vLLM reads first).
- **Medusa** (TensorRT-LLM, TGI): ``medusa_lm_head.safetensors`` with ``{head}.{block}.linear.{weight,bias}`` and
  ``{head}.{n_blocks}.weight``; config.json has medusa_num_heads / medusa_num_layers / base_model_name_or_path and
  no ``architectures`` (TGI would disable the heads).
- **EAGLE-1** (vLLM ``EagleLlamaForCausalLM``, SGLang ``LlamaForCausalLMEagle``): config.json is a Llama config with
  ``num_hidden_layers`` = the drafter's depth and ``architectures: [LlamaForCausalLM]`` for vLLM (its EAGLE config
  prefixes ``Eagle`` and knows no other name), ``[LlamaForCausalLMEagle]`` for SGLang; tensors ``fc.*`` and
  ``layers.{i}.*``, layer 0 without ``input_layernorm``, no final norm; the engines take the embeddings and the LM
  head from the target. SGLang's fc has a bias, vLLM's has none (a drafter with a nonzero ``fc.bias`` is refused
  there; ``drafter.fc_bias: false`` trains one vLLM loads). A reduced head is refused: vLLM cannot express it and
  SGLang reads it only as a pickled hot-token map, which draftsmith does not write.
- **MLP speculator** (IBM's layout, TGI and fms-extras; vLLM 0.32 refuses it): config.json with
  ``model_type: mlp_speculator`` (emb_dim, inner_dim, n_predict, ...) and tensors
  ``speculator.{emb,proj,ln,head}.{i}.*``. IBM's stage norm has no mean
  subtraction and eps 1e-6; ours is a LayerNorm (eps 1e-5): the export centres ``proj`` / ``emb`` and scales them
  by sqrt(1e-6 / 1e-5), which makes IBM's norm compute ours exactly (``to_mlp_speculator``).
- **PARD** (hf, and vllm's parallel drafting: ``"method": "draft_model", "parallel_drafting": true``): a plain
  LlamaForCausalLM whose config.json adds ``pard_token`` (the mask id vLLM feeds for the masked slots, as PARD's
  own checkpoints name it) and ``pard_k``; the mask's embedding is its row of embed_tokens. vLLM's draft-model path
  needs the target's vocabulary size, so ``--format vllm`` wants the mask on a reserved id (``drafter.mask_token``);
  an appended mask is one extra row (hf only). Checked against vLLM's ``llm_base_proposer.py`` (82720b1).
- **Native MTP** (vLLM's ``mtp`` method): the target's config.json with one MTP layer, the layer under the names
  the target's checkpoint gives it (``model.layers.{L}.*``, experts one tensor each, ``shared_head.norm``; Qwen3-Next
  ``mtp.*``), ``model.embed_tokens.weight`` and ``lm_head.weight`` (vLLM's ``shared_head.head``).
- **Draft LM with a reduced head**: written as a plain LlamaForCausalLM whose head has every target row; a dropped
  row is the mean of the kept rows, so its logit (the mean of the kept logits) never exceeds the best kept one.
Embeddings of EAGLE drafters are frozen copies of the target's: written unless turned off (speculators reads them
from the checkpoint), taken from the target on import when absent.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
from dataclasses import fields, replace
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.integrity import load_tensors, read_json, verify_config, verify_file
from draftsmith.models.eagle import EagleConfig
from draftsmith.models.llama import LlamaConfig
from draftsmith.models.loading import config_from_hf, config_to_hf, hf_to_own_key, own_to_hf_key
from draftsmith.models.medusa import ADAPTER_FILE
from draftsmith.models.registry import checkpoint_tensors, drafter_from_state, drafter_spec

__all__ = [
    "ADAPTER_FILE",
    "weights_file",
    "to_own_layout",
    "to_draft_lm_hf",
    "to_pard_hf",
    "to_speculators",
    "to_sglang_eagle3",
    "to_medusa",
    "to_mlp_speculator",
    "to_eagle1",
    "to_eagle1_vllm",
    "to_eagle1_sglang",
    "to_pard_vllm",
    "to_mtp_vllm",
    "export_meta",
    "export_entry",
    "usage",
    "load_export",
]

SPECULATORS_VERSION = "0.1.0"


log = logging.getLogger("draftsmith.export")


def weights_file(info: dict, fmt: str) -> str:
    """The weights file's name in an export: the kind's entry may name its engine's (``"weights"``)."""
    return export_entry(info, fmt).get("weights", "model.safetensors")


def _one_layer(info: dict, fmt: str) -> None:
    """SGLang's EAGLE-3 (LlamaForCausalLMEagle3) is one layer; vLLM's stacks plain Llama layers after the first."""
    n = info["config"].get("n_layers", 1)
    if n > 1 and fmt == "sglang":
        raise DraftsmithError(
            f"export --format {fmt}: the engine loads a one-layer EAGLE-3, this one has "
            f"drafter.n_layers={n} (use --format vllm or hf)"
        )


# ---- EAGLE-3: our names <-> an engine's ------------------------------------------------------------------------

_LAYER_KEYS = {
    "embed_norm.": "input_layernorm.",
    "hidden_norm.": "hidden_norm.",
    "post_attention_layernorm.": "post_attention_layernorm.",
    "self_attn.": "self_attn.",
    "mlp.": "mlp.",
}


def _eagle3_tensors(model, layer_prefix: str, include_embeddings: bool) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in checkpoint_tensors(model).items():
        if k == "embed_tokens.weight" and not include_embeddings:
            continue
        if k == "t2d":  # ours: draft index or -1; the engines': a bool mask of the kept target ids
            v = v >= 0
        for ours, theirs in _LAYER_KEYS.items():
            if k.startswith(ours):
                k = layer_prefix + theirs + k[len(ours) :]
                break
        if k.startswith("extra."):  # the plain blocks after the EAGLE layer: vLLM's layers 1.. (HF Llama names)
            j, rest = k[len("extra.") :].split(".", 1)
            k = f"layers.{int(j) + 1}.{rest}"
        out[k] = v
    if model.cfg.attention_bias:  # attention_bias means q, k, v *and* o to HF Llama, vLLM and speculators: ours
        out[layer_prefix + "self_attn.o_proj.bias"] = torch.zeros(model.cfg.dim)  # has no o bias, i.e. zero
    return out


def _eagle3_back(sd: dict, layer_prefix: str) -> dict:
    out = {}
    o_bias = sd.pop(layer_prefix + "self_attn.o_proj.bias", None)
    if o_bias is not None and o_bias.any():
        raise DraftsmithError(
            f"the export's {layer_prefix}self_attn.o_proj.bias is not zero: draftsmith's layer has none"
        )
    for k, v in sd.items():
        if k.startswith(layer_prefix):
            rest = k[len(layer_prefix) :]
            for ours, theirs in _LAYER_KEYS.items():
                if rest.startswith(theirs):
                    k = ours + rest[len(theirs) :]
                    break
        elif k.startswith("layers."):  # vLLM's layers 1..: our plain blocks
            i, rest = k[len("layers.") :].split(".", 1)
            k = f"extra.{int(i) - 1}.{rest}"
        out[k] = v
    return out


def _layer_config(cfg: dict) -> dict:
    """The EAGLE layer as an HF config (vocab_size = the target's, one layer): Qwen3's with q/k-norm (vLLM then
    builds its Qwen3 EAGLE-3 layer, speculators its Qwen3 one), else Llama's. num_aux_hidden_states sizes the
    engines' fc (vLLM and SGLang assume 3 without it)."""
    qwen3 = cfg.get("qk_norm", False)
    d = {
        "model_type": "qwen3" if qwen3 else "llama",
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["dim"],
        "num_hidden_layers": cfg.get("n_layers", 1),
        "num_attention_heads": cfg["n_heads"],
        "num_key_value_heads": cfg["n_kv_heads"],
        "intermediate_size": cfg["hidden_dim"],
        "head_dim": cfg.get("head_dim") or cfg["dim"] // cfg["n_heads"],
        "rms_norm_eps": cfg["norm_eps"],
        "rope_theta": cfg["rope_theta"],
        "max_position_embeddings": 8192,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": cfg.get("attention_bias", False),
        "num_aux_hidden_states": len(cfg["aux_layers"]),
        "rope_parameters": {**(cfg.get("rope_scaling") or {"rope_type": "default"}), "rope_theta": cfg["rope_theta"]},
    }
    if cfg.get("rope_scaling"):
        d["rope_scaling"] = cfg["rope_scaling"]
    if cfg.get("sliding_window"):  # vLLM's EAGLE-3 layers read layer_types; Qwen3's config also use_sliding_window
        d["layer_types"] = ["sliding_attention"] * d["num_hidden_layers"]
        d["sliding_window"] = cfg["sliding_window"]
        d["use_sliding_window"] = True
    return d


def _eagle3_engine_checks(info: dict, fmt: str) -> None:
    """Refuse, in one line, a drafter the engine would load as another function (docs/export.md has the table)."""
    _one_layer(info, fmt)
    cfg = info["config"]
    aux = list(cfg["aux_layers"])
    if any(b <= a for a, b in zip(aux, aux[1:])):  # both capture in layer order, each layer once
        raise DraftsmithError(
            f"export --format {fmt}: vLLM and SGLang pass the aux layers' states in ascending order, once each; "
            f"drafter.aux_layers={aux} is not (use --format hf, or train with ascending distinct layers)"
        )
    qk, bias = cfg.get("qk_norm", False), cfg.get("attention_bias", False)
    if fmt == "sglang" and cfg.get("parallel"):
        raise DraftsmithError(
            "export --format sglang: draftsmith writes P-EAGLE (drafter.parallel_drafts) in speculators' layout "
            "only: use --format vllm"
        )
    if fmt == "sglang" and cfg.get("sliding_window"):
        raise DraftsmithError(
            "export --format sglang: SGLang's EAGLE-3 layer attends to every position (its Llama attention takes "
            "no window), so this drafter's drafter.sliding_window would be dropped: use --format vllm"
        )
    if fmt == "sglang" and cfg.get("fc_norm"):
        raise DraftsmithError(
            "export --format sglang: SGLang's EAGLE-3 layer has no per-layer fc norms (EAGLE-3.1, drafter.fc_norm): "
            "use --format vllm"
        )
    if fmt == "sglang" and (qk or bias):
        what = "q/k-norm" if qk else "q/k/v bias"
        raise DraftsmithError(
            f"export --format sglang: SGLang's EAGLE-3 layer (LlamaForCausalLMEagle3) has no {what} and would drop "
            f"this drafter's (drafter.layer_style=target on a Qwen target): use --format vllm, or train with "
            f"drafter.layer_style=llama"
        )
    if fmt == "vllm" and qk and bias:
        raise DraftsmithError(
            "export --format vllm: a layer with both q/k-norm and q/k/v bias loads differently in vLLM (no o_proj "
            "bias) and speculators (an o_proj bias): use --format hf"
        )


def _vllm_aux_ids(cfg: dict) -> list[int]:
    """vLLM's (and speculators') aux ids: it captures the residual entering layer i, our output of layer i - 1.
    Always written: the engines' defaults ((2, L/2, L-3), three layers) need not be ours."""
    return [i + 1 for i in cfg["aux_layers"]]


def _speculators_block(info: dict, verifier: str | None, tokens: int, algorithm: str = "eagle3") -> dict:
    arch = info.get("target_architectures") or ["LlamaForCausalLM"]
    return {
        "algorithm": algorithm,
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "default_proposal_method": "greedy",
        # the verifier's hub id, or null when unknown (vLLM's `serve ./folder` then needs the target named), and
        # its architecture as training read it (checkpoints from before that was kept: a Llama)
        "verifier": {"name_or_path": verifier, "architectures": arch},
    }


def _meta(info: dict) -> dict:
    return {k: v for k, v in info.items() if k != "config"}


def to_own_layout(model, info: dict, verifier: str, include_embeddings: bool):
    """``--format hf`` of a kind with no engine layout of its own: draftsmith's tensor names, drafter.json's
    config; draftsmith loads it back."""
    return checkpoint_tensors(model), {
        "architectures": [f"draftsmith:{info['kind']}"],
        "draftsmith": _meta(info),
        "note": "draftsmith's own layout: load with draftsmith (drafter.json holds the config)",
    }


def to_draft_lm_hf(model, info: dict, verifier: str, include_embeddings: bool):
    """A draft LM as a plain LlamaForCausalLM: transformers' assisted generation and vLLM's draft-model method
    read it (speculators 0.9 has no standalone type: its "independent" was dropped). A reduced head is written
    with every target row (``full_vocab_head``)."""
    sd = checkpoint_tensors(model)
    if "d2t" in sd:  # a reduced head: every target row, so transformers loads a plain LlamaForCausalLM
        keep = _kept_ids(sd.pop("d2t"))
        sd.pop("t2d")
        sd["lm_head.weight"] = full_vocab_head(sd["lm_head.weight"], keep, model.cfg.vocab_size)
    tensors = {own_to_hf_key(k): v for k, v in sd.items()}
    return tensors, {**config_to_hf(model.cfg), "torch_dtype": "float32", "draftsmith": _meta(info)}


def to_pard_hf(model, info: dict, verifier: str, include_embeddings: bool):
    """PARD's HF folder (``_pard_hf``)."""
    return _pard_hf(model, _meta(info))


def to_pard_vllm(model, info: dict, verifier: str, include_embeddings: bool):
    """PARD for vLLM's parallel drafting: the HF folder, with the mask token inside the target's vocabulary."""
    if info["config"].get("mask_token") is None:
        raise DraftsmithError(
            "export --format vllm: vLLM's parallel drafting needs the PARD mask inside the target's vocabulary; "
            "this drafter appends it (train with drafter.mask_token=<a reserved id>, or use --format hf)"
        )
    return to_pard_hf(model, info, verifier, include_embeddings)


def to_speculators(model, info: dict, verifier: str, include_embeddings: bool):
    """EAGLE-3 in speculators' layout (vLLM reads it). P-EAGLE (``parallel``) is speculators' peagle: the same
    layer plus ``mask_hidden`` (the mask slots' pre-fc feature) and ``mask_token_id``, whose embedding row carries
    our trained mask vector (the embeddings are then always written: vLLM would otherwise share the target's row);
    vLLM serves it as eagle3 with parallel drafting."""
    cfg = info["config"]
    _eagle3_engine_checks(info, "vllm")
    k = cfg.get("parallel", 0)
    config = {
        "architectures": ["PEagleSpeculator" if k else "Eagle3Speculator"],
        "speculators_model_type": "peagle" if k else "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _layer_config(cfg),
        "draft_vocab_size": cfg.get("head_vocab_size") or cfg["vocab_size"],
        "norm_before_residual": False,
        "fc_norm": bool(cfg.get("fc_norm", False)),  # EAGLE-3.1: tensors fc_norm.{i}.weight
        "target_hidden_size": cfg["dim"],
        "embed_requires_grad": False,
        "speculators_config": _speculators_block(
            info, verifier, k or max(cfg.get("ttt_steps", 1), 3), "peagle" if k else "eagle3"
        ),
        "eagle_aux_hidden_state_layer_ids": _vllm_aux_ids(cfg),  # speculators sizes fc by these, vLLM captures them
    }
    tensors = _eagle3_tensors(model, "layers.0.", include_embeddings or bool(k))
    if k:
        config["mask_token_id"] = cfg["mask_id"]
        embed = tensors["embed_tokens.weight"].clone()
        embed[cfg["mask_id"]] = tensors.pop("mask_embed")
        tensors["embed_tokens.weight"] = embed
        tensors["mask_hidden"] = tensors["mask_hidden"].view(1, 1, -1)  # speculators' parameter shape
    return tensors, config


def to_sglang_eagle3(model, info: dict, verifier: str, include_embeddings: bool):
    _eagle3_engine_checks(info, "sglang")
    cfg = info["config"]
    config = {
        **_layer_config(cfg),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": cfg.get("head_vocab_size") or cfg["vocab_size"],
        "target_hidden_size": cfg["dim"],
        # SGLang reads eagle_config's ids (layer outputs, ours); vLLM, loading this folder, reads the top-level
        # ones first (inputs: ours + 1) and would take eagle_config's as inputs without them.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg["aux_layers"]), "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": _vllm_aux_ids(cfg),
        "draftsmith_verifier": verifier,
    }
    return _eagle3_tensors(model, "midlayer.", include_embeddings), config


# ---- DFlash ----------------------------------------------------------------------------------------------------


def to_dflash(model, info: dict, verifier: str, include_embeddings: bool):
    """DFlash in the layout vLLM's ``dflash`` method loads (its qwen3_dflash model): Qwen3 layers, ``fc`` and
    ``hidden_norm`` over the fused target layers ``dflash_config.target_layer_ids`` (layer outputs, as ours), the
    mask slot embedded as ``embed_tokens[mask_token_id]``. Our trained mask vector therefore replaces that row of
    the exported embeddings (our model never embeds that id as a token: every occurrence is a mask, in vLLM too),
    and the embeddings and LM head are always written (vLLM would otherwise share the target's unchanged row)."""
    cfg = info["config"]
    sd = checkpoint_tensors(model)
    embed = sd["embed_tokens.weight"].clone()
    embed[cfg["mask_id"]] = sd.pop("mask_embed")
    sd["embed_tokens.weight"] = embed
    config = {
        **config_to_hf(model.cfg.layer_cfg()),  # its layers' shape, Qwen3-style (q/k norms)
        "architectures": ["DFlashDraftModel"],
        "target_hidden_size": cfg.get("target_dim") or cfg["dim"],
        "block_size": cfg["block_size"],
        "dflash_config": {
            "mask_token_id": cfg["mask_id"],
            "target_layer_ids": list(cfg["target_layers"]),
            "causal": False,
            **({"use_swa": True, "swa_window_size": cfg["sliding_window"]} if cfg.get("sliding_window") else {}),
        },
        "draftsmith_verifier": verifier,
        "torch_dtype": "float32",
    }
    return sd, config


def read_dflash(sd: dict, info: dict, target, folder: Path) -> dict:
    """The mask vector back from its embedding row (the row itself is never read as a token's embedding)."""
    sd = dict(sd)
    sd["mask_embed"] = sd["embed_tokens.weight"][info["config"]["mask_id"]].clone()
    return sd


def usage_dflash(fmt: str, info: dict, target: str | None, tokens: int) -> str:
    n = info.get("config", {}).get("block_size", tokens + 1) - 1
    return (
        f"`{_vllm_serve(target or 'TARGET', 'dflash', n)}` (vLLM's DFlash: the block's drafts from one forward); "
        "draftsmith: `draftsmith eval RECIPE eval.checkpoint=./this-folder`."
    )


# ---- native MTP ------------------------------------------------------------------------------------------------


def to_mtp_vllm(model, info: dict, verifier: str, include_embeddings: bool):
    """The MTP layer as vLLM's ``mtp`` method loads a target's own: the target's config.json with one MTP layer,
    the layer under the checkpoint's names (models/mtp.py ``checkpoint_names``), embeddings and LM head always
    (vLLM reads the layer's head from ``lm_head.weight``)."""
    from draftsmith.models.mtp import checkpoint_names, under_mtp_names

    hf = {k: v for k, v in info["config"]["hf_config"].items() if k not in ("_name_or_path", "dtype", "torch_dtype")}
    count = "mtp_num_hidden_layers" if under_mtp_names(hf["model_type"]) else "num_nextn_predict_layers"
    config = {**hf, count: 1, "num_nextn_predict_layers": 1, "draftsmith_verifier": verifier}
    return checkpoint_names(model), {**config, "torch_dtype": "float32"}


def read_mtp_vllm(sd: dict, info: dict, target, folder: Path) -> dict:
    from draftsmith.models.mtp import from_checkpoint_names, mtp_from_config

    return from_checkpoint_names(mtp_from_config(info["config"]), sd, folder)


def usage_mtp(fmt: str, info: dict, target: str | None, tokens: int) -> str:
    return (
        f"`{_vllm_serve(target or 'TARGET', 'mtp', tokens)}` (vLLM's MTP method with this fine-tuned layer in place "
        "of the target's own; one layer drafts every position); draftsmith: "
        "`draftsmith eval RECIPE eval.checkpoint=./this-folder`."
    )


# ---- Medusa ----------------------------------------------------------------------------------------------------


def to_medusa(model, info: dict, verifier: str, include_embeddings: bool):
    cfg, out = info["config"], {}
    if cfg.get("head_vocab_size"):  # the layout has no d2t map: its heads must cover the whole vocabulary
        raise DraftsmithError(
            f"export --format medusa: these heads keep {cfg['head_vocab_size']} of "
            f"{cfg['vocab_size']} tokens (drafter.draft_vocab), which the Medusa layout cannot "
            f"express; export --format hf"
        )
    for k, v in checkpoint_tensors(model).items():
        parts = k.split(".")  # blocks.{h}.{j}.linear.{w,b} / lm_heads.{h}.weight
        if parts[0] == "blocks":
            out[".".join(parts[1:])] = v
        elif parts[0] == "lm_heads":
            out[f"{parts[1]}.{cfg['n_layers']}.weight"] = v
        else:
            raise DraftsmithError(f"export --format medusa: unexpected tensor {k!r}")
    config = {
        "medusa_num_heads": cfg["n_heads"],
        "medusa_num_layers": cfg["n_layers"],
        "medusa_fc_bias": True,  # vLLM builds the blocks without a bias otherwise, and drops ours silently
        "hidden_size": cfg["dim"],
        "vocab_size": cfg["vocab_size"],
        "base_model_name_or_path": verifier,
    }
    return out, config


def _medusa_back(sd: dict, cfg: dict) -> dict:
    out = {}
    for k, v in sd.items():
        h, j, *rest = k.split(".")
        out[f"lm_heads.{h}.weight" if int(j) == cfg["n_layers"] else f"blocks.{h}.{j}.{'.'.join(rest)}"] = v
    return out


# ---- reduced heads, EAGLE-1, MLP speculator -----------------------------------------------------------------------


def _kept_ids(d2t: torch.Tensor) -> torch.Tensor:
    return torch.arange(len(d2t)) + d2t


def full_vocab_head(head: torch.Tensor, keep: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """An N-row head as a full-vocabulary one (no bias: a plain Llama's head): the kept rows at their target ids,
    every dropped row the mean of the kept rows. A dropped id's logit is then the mean of the kept logits, never
    above the best kept one (equal only when every kept logit is equal), so it never wins the argmax; zero rows
    would win wherever every kept logit is negative."""
    full = head.mean(0, keepdim=True).expand(vocab_size, -1).clone()
    full[keep] = head
    return full


def _vocab_meta(model) -> dict:
    """Kept target ids of a reduced head, for ``load_export`` (the engines' folders drop d2t / t2d)."""
    d2t = getattr(model, "d2t", None)
    return {} if d2t is None else {"head_vocab_ids": _kept_ids(d2t.cpu()).tolist()}


def export_meta(model, info: dict, fmt: str) -> dict:
    """Keys an export adds to drafter.json: the kept target ids of a reduced head where the engine's layout drops
    d2t / t2d (a draft LM's full-vocabulary head, EAGLE-1's engine layouts), for ``load_export``."""
    entry = export_entry(info, fmt)
    if entry.get("head_ids") or (entry.get("plain_lm") and getattr(model, "d2t", None) is not None):
        return _vocab_meta(model)
    return {}


def export_entry(info: dict, fmt: str) -> dict:
    """The kind's entry for ``fmt`` (DrafterSpec.exports): its writer, reader, usage line and flags."""
    return drafter_spec(info["kind"]).export_formats(info).get(fmt, {})


def _call(name: str):
    module, fn = name.split(":")
    return getattr(importlib.import_module(module), fn)


def _vocab_back(info: dict) -> dict:
    ids = info.get("head_vocab_ids")
    if ids is None:
        return {}
    keep = torch.tensor(ids, dtype=torch.long)
    t2d = torch.full((info["config"]["vocab_size"],), -1, dtype=torch.long)
    t2d[keep] = torch.arange(len(keep))
    return {"keep": keep, "d2t": keep - torch.arange(len(keep)), "t2d": t2d}


def to_eagle1(fmt: str):
    """EAGLE-1 writer for ``fmt`` (vllm / sglang): both engines read the same names; they differ in fc's bias."""

    def write(model, info: dict, verifier: str, include_embeddings: bool):
        cfg = info["config"]
        if cfg.get("qk_norm"):
            raise DraftsmithError(f"export --format {fmt}: the engines' EAGLE-1 is a Llama layer, without q/k norms")
        if cfg.get("sliding_window"):
            raise DraftsmithError(
                f"export --format {fmt}: the engines' EAGLE-1 layer attends to every position and would drop "
                "drafter.sliding_window; use --format hf (or EAGLE-3 with --format vllm)"
            )
        sd = checkpoint_tensors(model)
        if cfg.get("head_vocab_size"):
            raise DraftsmithError(
                f"export --format {fmt}: this EAGLE-1 head keeps {cfg['head_vocab_size']} of {cfg['vocab_size']} "
                f"tokens (drafter.draft_vocab), which "
                + (
                    "vLLM's EAGLE-1 cannot express"
                    if fmt == "vllm"
                    else "SGLang takes only as a pickled hot-token map, and draftsmith writes no pickles"
                )
                + "; train with drafter.draft_vocab=null, or use --format hf"
            )
        if fmt == "vllm":
            bias = sd.pop("fc.bias", None)
            if bias is not None and bool(bias.any()):
                raise DraftsmithError(
                    f"export --format vllm: vLLM's EAGLE-1 fc has no bias, and this drafter's fc.bias is nonzero "
                    f"(max |b| = {bias.abs().max():.3g}); use --format sglang, or train with drafter.fc_bias=false"
                )
            if include_embeddings:  # vLLM skips them on load yet marks them as the draft's own
                log.warning("export --format vllm: EAGLE-1 embeddings are never written (vLLM shares the target's)")
            include_embeddings = False
        elif "fc.bias" not in sd:  # drafter.fc_bias=false: SGLang's fc has a bias, loaded as zeros
            sd["fc.bias"] = torch.zeros(sd["fc.weight"].shape[0], dtype=sd["fc.weight"].dtype)
        out = {}
        for k, v in sd.items():
            if k in ("lm_head.weight", "d2t", "t2d") or (k == "embed_tokens.weight" and not include_embeddings):
                continue  # the engines take the LM head from the target
            if k.startswith("extra."):
                j, rest = k[len("extra.") :].split(".", 1)
                k = f"layers.{int(j) + 1}.{rest}"
            elif k.split(".")[0] in ("self_attn", "post_attention_layernorm", "mlp"):
                k = "layers.0." + k
            out[k] = v
        layer = EagleConfig(**{**cfg, "aux_layers": tuple(cfg.get("aux_layers", ()))}).layer_config()
        config = {
            **config_to_hf(replace(layer, n_layers=cfg.get("n_layers", 1))),
            # vLLM names its class from the target's (LlamaForCausalLM -> EagleLlamaForCausalLM) and knows no
            # LlamaForCausalLMEagle; SGLang registers that name for its EAGLE-1 layer
            "architectures": ["LlamaForCausalLM" if fmt == "vllm" else "LlamaForCausalLMEagle"],
            "torch_dtype": "float32",
            "draftsmith_verifier": verifier,
        }
        return out, config

    return write


to_eagle1_vllm, to_eagle1_sglang = to_eagle1("vllm"), to_eagle1("sglang")


def _eagle1_back(sd: dict, info: dict, target, folder: Path) -> dict:
    out = {}
    for k, v in sd.items():
        if k.startswith("layers.0."):
            k = k[len("layers.0.") :]
        elif k.startswith("layers."):
            i, rest = k[len("layers.") :].split(".", 1)
            k = f"extra.{int(i) - 1}.{rest}"
        out[k] = v
    if not info["config"].get("fc_bias", True):  # a bias-free fc: SGLang's layout carries a zero bias
        if bool(out.pop("fc.bias", torch.zeros(1)).any()):
            raise DraftsmithError(f"{folder}: fc.bias is nonzero but drafter.json says the drafter has none")
    elif "fc.bias" not in out:  # vLLM's layout: a bias-free fc
        out["fc.bias"] = torch.zeros(out["fc.weight"].shape[0], dtype=out["fc.weight"].dtype)
    if target is None:
        raise DraftsmithError(f"{folder}: EAGLE-1 exports take the LM head from the target; pass the target")
    if "embed_tokens.weight" not in out:
        out["embed_tokens.weight"] = target.embed_tokens.weight.detach().cpu().clone()
    head = target.lm_head.weight.detach().cpu()
    vocab = _vocab_back(info)
    if vocab:
        head = head[vocab["keep"]]
        out["d2t"], out["t2d"] = vocab["d2t"], vocab["t2d"]
    out["lm_head.weight"] = head.clone()
    return out


_IBM_NORM_EPS = 1e-6  # fms-extras' LayerNormParameterized, as TGI (and vLLM before 0.33) restate it


def to_mlp_speculator(model, info: dict, verifier: str, include_embeddings: bool):
    """IBM's MLP speculator layout (fms-extras and TGI load it). IBM's stage norm is x / sqrt(mean(x^2) + 1e-6)
    with a learned scale and shift; ours is a LayerNorm, (x - mean) / sqrt(var + eps). Centring proj and emb (so
    their sum has zero mean) and scaling both by a = sqrt(1e-6 / eps) gives IBM's norm a x' with mean(x'^2) =
    a^2 var(x): exactly our LayerNorm of x."""
    cfg = info["config"]
    if cfg.get("head_vocab_size"):
        raise DraftsmithError(
            f"export --format mlp-speculator: these heads keep {cfg['head_vocab_size']} of {cfg['vocab_size']} "
            f"tokens (drafter.draft_vocab), which IBM's layout cannot express; export --format hf"
        )
    out = {}
    for k, (emb, proj, ln, head) in enumerate(zip(model.emb, model.proj, model.ln, model.head, strict=True)):
        a = math.sqrt(_IBM_NORM_EPS / ln.eps)
        e, p = emb.weight.detach().cpu(), proj.weight.detach().cpu()
        out[f"speculator.emb.{k}.weight"] = (a * (e - e.mean(1, keepdim=True))).contiguous()
        out[f"speculator.proj.{k}.weight"] = (a * (p - p.mean(0, keepdim=True))).contiguous()
        out[f"speculator.ln.{k}.weight"] = ln.weight.detach().cpu().clone()
        out[f"speculator.ln.{k}.bias"] = ln.bias.detach().cpu().clone()
        out[f"speculator.head.{k}.weight"] = head.weight.detach().cpu().contiguous()
    n = cfg["n_predict"]
    config = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "vocab_size": cfg["vocab_size"],
        "emb_dim": cfg["dim"],
        "inner_dim": cfg.get("inner_dim") or cfg["dim"],  # explicit: TGI reads it as is (0 would break it)
        "n_predict": n,
        "top_k_tokens_per_head": [1] * n,  # a chain, as draftsmith drafts by default
        "n_candidates": 1,
        "tie_weights": False,
        "scale_input": False,
        "base_model_name_or_path": verifier,
        "torch_dtype": "float32",
    }
    return out, config


def _mlp_speculator_back(sd: dict) -> dict:
    """Undo the scale (the centring stays: our LayerNorm is blind to it, so the function is the same)."""
    a = math.sqrt(_IBM_NORM_EPS / torch.nn.LayerNorm(1).eps)  # models/mlp_speculator.py's stage norms
    out = {}
    for k, v in sd.items():
        k = k.removeprefix("speculator.")
        out[k] = v / a if k.startswith(("emb.", "proj.")) else v
    return out


# ---- hf ----------------------------------------------------------------------------------------------------------


def _pard_hf(model, meta: dict):
    """PARD as the folder PARD's checkpoints and vLLM's parallel drafting read: a LlamaForCausalLM whose config
    names the mask id (``pard_token``) and the drafts per forward (``pard_k``). The mask's input embedding is its
    row of embed_tokens: a reserved id's row is overwritten, an appended mask adds row V, and the head gets a
    row V too, the mean of the others (its logit never the argmax). The head is written untied: with tied
    embeddings the mask row would change its logit."""
    cfg, sd = model.cfg, checkpoint_tensors(model)
    mask = sd.pop("mask_embed")
    embed = sd["embed_tokens.weight"].clone()
    head = sd.get("lm_head.weight", sd["embed_tokens.weight"]).clone()
    if "d2t" in sd:  # a reduced head: every target row, as for a draft LM
        keep = _kept_ids(sd.pop("d2t"))
        sd.pop("t2d")
        head = full_vocab_head(head, keep, cfg.vocab_size)
    if cfg.mask_token is None:
        embed = torch.cat([embed, mask[None]])
        head = torch.cat([head, head.mean(0, keepdim=True)])
    else:
        embed[cfg.mask_token] = mask
    sd["embed_tokens.weight"], sd["lm_head.weight"] = embed, head
    llama = LlamaConfig(**{f.name: getattr(cfg, f.name) for f in fields(LlamaConfig)})
    hf = config_to_hf(replace(llama, vocab_size=embed.shape[0], tie_embeddings=False))
    extra = {"pard_token": cfg.mask_id, "pard_k": cfg.pard_k, "spd_type": "pard"}
    return {own_to_hf_key(k): v for k, v in sd.items()}, {**hf, **extra, "torch_dtype": "float32", "draftsmith": meta}


def _pard_back(sd: dict, cfg: dict, vocab: dict) -> dict:
    """``_pard_hf`` undone: mask_embed from its embedding row, V rows, the original tied / reduced head."""
    sd = {hf_to_own_key(k): v for k, v in sd.items()}
    V, mask_id = cfg["vocab_size"], cfg["mask_token"] if cfg.get("mask_token") is not None else cfg["vocab_size"]
    embed, head = sd["embed_tokens.weight"], sd["lm_head.weight"][:V]
    sd["mask_embed"] = embed[mask_id].clone()
    embed = embed[:V].clone()
    if cfg.get("mask_token") is not None:
        embed[mask_id] = head[mask_id]  # never read (the mask reads mask_embed); a tied head needs it back
    sd["embed_tokens.weight"] = embed
    if cfg.get("tie_embeddings"):
        sd.pop("lm_head.weight")
    elif vocab:
        sd["lm_head.weight"] = head[vocab["keep"]].clone()
        sd["d2t"], sd["t2d"] = vocab["d2t"], vocab["t2d"]
    else:
        sd["lm_head.weight"] = head.clone()
    return sd


def usage(fmt: str, info: dict, target: str | None, tokens: int = 3) -> str:
    """How an engine serves the export, as the card and the export log print it (the kind's ``usage`` for the
    format, DrafterSpec.exports; else draftsmith's own layout). ``target``: the verifier's hub id; None (a local
    target) prints ``TARGET`` for the user to fill in, and never the ``vllm serve ./this-folder`` short form,
    which serves the verifier named in config.json (null then)."""
    fn = export_entry(info, fmt).get("usage")
    if fn is None:
        return "draftsmith: `draftsmith eval RECIPE eval.checkpoint=./this-folder` (draftsmith's own layout)."
    return _call(fn)(fmt, info, target, tokens)


def _vllm_serve(t: str, method: str, tokens: int, extra: str = "") -> str:
    return (
        f'vllm serve {t} --speculative-config \'{{"model": "./this-folder", "method": "{method}", '
        f'"num_speculative_tokens": {tokens}{extra}}}\''
    )


def usage_eagle1(fmt: str, info: dict, target: str | None, tokens: int) -> str:
    t = target or "TARGET"
    if fmt == "vllm":
        return f"`{_vllm_serve(t, 'eagle', tokens)}` (EAGLE-1; vLLM shares the target's embeddings and LM head)."
    return (
        f"`python -m sglang.launch_server --model {t} --speculative-algorithm EAGLE "
        "--speculative-draft-model-path ./this-folder` (EAGLE-1)."
    )


def usage_eagle3(fmt: str, info: dict, target: str | None, tokens: int) -> str:
    t = target or "TARGET"
    if fmt == "sglang":
        return (
            f"`python -m sglang.launch_server --model {t} --speculative-algorithm EAGLE3 "
            "--speculative-draft-model-path ./this-folder`"
        )
    k = info.get("config", {}).get("parallel", 0)
    if k:  # P-EAGLE: every draft from one forward, so as many as it was trained to draft
        eagle = "`" + _vllm_serve(t, "eagle3", k, ', "parallel_drafting": true') + "`"
    else:
        eagle = f"`{_vllm_serve(t, 'eagle3', tokens)}`"
    what = f"P-EAGLE drafter ({k} drafts per forward)" if k else "EAGLE-3 drafter"
    if target:
        return (
            f"`vllm serve ./this-folder` (vLLM reads the speculators config and serves the verifier named in it, "
            f"`{target}`, with this {what}), or explicitly: {eagle}."
        )
    return f"{eagle} (vLLM's speculators format; with no verifier named in config.json, name the target)."


def usage_pard(fmt: str, info: dict, target: str | None, tokens: int) -> str:
    pard = _vllm_serve(target or "TARGET", "draft_model", tokens, ', "parallel_drafting": true')
    return (
        f"vLLM (parallel drafting, the mask id from config.json's pard_token): `{pard}`; "
        "draftsmith: `draftsmith eval RECIPE eval.checkpoint=./this-folder`."
    )


def usage_draft_lm(fmt: str, info: dict, target: str | None, tokens: int) -> str:
    if fmt == "vllm":
        return (
            f"`{_vllm_serve(target or 'TARGET', 'draft_model', 4)}` (a plain HF Llama folder: vLLM versions with "
            "draft-model speculation)."
        )
    return (
        "transformers: `model.generate(..., assistant_model=AutoModelForCausalLM.from_pretrained(REPO))`; "
        "draftsmith: `draftsmith eval RECIPE eval.checkpoint=./this-folder`."
    )


def usage_medusa(fmt: str, info: dict, target: str | None, tokens: int) -> str:
    return (
        f"vLLM: `{_vllm_serve(target or 'TARGET', 'medusa', tokens)}`; "
        f"TGI: `text-generation-launcher --model-id ./this-folder` (config.json's base_model_name_or_path "
        f"names the target{'' if target else ': set it first'}). TensorRT-LLM: `examples/medusa/convert_checkpoint.py "
        "--model_dir TARGET_FOLDER --medusa_model_dir ./this-folder --num_medusa_heads N`. The heads are "
        "`medusa_lm_head.safetensors` only (draftsmith writes no pickles): FasterDecoding/Medusa's own loader, "
        "which reads only `medusa_lm_head.pt`, cannot load them."
    )


def usage_mlp(fmt: str, info: dict, target: str | None, tokens: int) -> str:
    return (
        "TGI: `text-generation-launcher --model-id ./this-folder` (config.json's "
        f"base_model_name_or_path names the target{'' if target else ': set it first'}); IBM's fms-extras. IBM's "
        "MLP speculator layout; vLLM serves no MLP speculator (0.32 refuses it, 0.33 removed it)."
    )


# ---- import: each layout's tensors back to the drafter's (DrafterSpec.exports "read") ---


def read_medusa(sd: dict, info: dict, target, folder: Path) -> dict:
    return _medusa_back(sd, info["config"])


def read_mlp_speculator(sd: dict, info: dict, target, folder: Path) -> dict:
    return _mlp_speculator_back(sd)


def read_eagle1(sd: dict, info: dict, target, folder: Path) -> dict:
    return _eagle1_back(sd, info, target, folder)


def read_eagle3(sd: dict, info: dict, target, folder: Path) -> dict:
    sd = _eagle3_back(sd, "layers.0." if info.get("export_format") == "vllm" else "midlayer.")
    if "t2d" in sd:  # the engines' bool mask back to draft indices
        mask = sd["t2d"].bool()
        t2d = torch.full(mask.shape, -1, dtype=torch.long)
        t2d[mask] = torch.arange(int(mask.sum()))
        sd["t2d"] = t2d
    if "mask_hidden" in sd:  # P-EAGLE: the mask vector back from its embedding row
        sd["mask_hidden"] = sd["mask_hidden"].reshape(-1)
        sd["mask_embed"] = sd["embed_tokens.weight"][info["config"]["mask_id"]].clone()
    if "embed_tokens.weight" not in sd:
        if target is None:
            raise DraftsmithError(f"{folder}: the export omits the embeddings; pass the target to take them from")
        sd["embed_tokens.weight"] = target.embed_tokens.weight.detach().cpu()
    return sd


def read_pard_hf(sd: dict, info: dict, target, folder: Path) -> dict:
    return _pard_back(sd, info["config"], _vocab_back(info))


def read_draft_lm_hf(sd: dict, info: dict, target, folder: Path) -> dict:
    cfg = info["config"]
    sd = {hf_to_own_key(k): v for k, v in sd.items()}
    vocab = _vocab_back(info)
    if vocab:  # the full-vocabulary head back to the kept rows and their maps
        sd["lm_head.weight"] = sd["lm_head.weight"][vocab["keep"]].clone()
        sd["d2t"], sd["t2d"] = vocab["d2t"], vocab["t2d"]
    hf_cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
    if (hf_cfg.vocab_size, hf_cfg.dim, hf_cfg.n_layers) != (cfg["vocab_size"], cfg["dim"], cfg["n_layers"]):
        raise DraftsmithError(f"{folder}: config.json does not describe the drafter in drafter.json")
    return sd


# ---- import ----------------------------------------------------------------------------------------------------


def load_export(folder: Path, target=None, dtype=None, device="cpu"):
    meta = folder / "drafter.json"
    if not meta.is_file():
        raise DraftsmithError(f"{folder}: not a draftsmith export (no drafter.json)")
    info = read_json(meta)
    fmt = info.get("export_format", "hf")
    for name, digest in (info.get("sha256") or {}).items():  # exports written before checksums have none
        verify_file(folder / Path(name).name, digest)
    verify_config(info, meta)
    sd = load_tensors(folder / weights_file(info, fmt))
    read = export_entry(info, fmt).get("read")
    if read is not None:  # the engine's names back to the drafter's
        sd = _call(read)(sd, info, target, folder)
    model = drafter_from_state(info, sd, folder)
    return model.to(device=device, dtype=dtype or torch.float32).eval(), info
