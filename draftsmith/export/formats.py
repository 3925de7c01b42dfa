"""Tensor-name and config contracts of the formats serving engines load, both ways (draftsmith/export/writer.py writes,
``load_export`` reads back for the round-trip test).

- **speculators / vLLM** (EAGLE-3): config.json with ``speculators_model_type: eagle3`` and ``speculators_config``
  (proposal method, verifier) and *no* top-level ``model_type`` (vLLM routes on that); the layer under
  ``layers.0.*``; ``d2t`` int64 offsets (target id = draft id + d2t[id]) and ``t2d`` a bool mask over the target
  vocabulary. Checked against the ``speculators`` package 0.9.0 (it loads the export as ``Eagle3DraftModel``).
  A draft LM exports as a plain HF Llama folder, which vLLM's draft-model speculation loads.
- **SGLang** (EAGLE-3, ``LlamaForCausalLMEagle3``): the layer under ``midlayer.*``; SGLang silently skips names it
  does not know, so the contract is checked here by the round trip. Its aux-layer ids name layer *outputs*
  (0-indexed), the same as our ``aux_layers``; vLLM captures the residual *entering* layer i, hence ids + 1.
- **Medusa** (TensorRT-LLM, TGI): ``medusa_lm_head.safetensors`` with ``{head}.{block}.linear.{weight,bias}`` and
  ``{head}.{n_blocks}.weight``; config.json has medusa_num_heads / medusa_num_layers / base_model_name_or_path and
  no ``architectures`` (TGI would disable the heads).
Embeddings of EAGLE drafters are frozen copies of the target's: omitted unless asked, and taken from the target
on import, as the engines do.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.integrity import load_tensors, read_json, verify_file
from draftsmith.models.loading import config_from_hf, config_to_hf, hf_to_own_key, own_to_hf_key
from draftsmith.models.medusa import ADAPTER_FILE
from draftsmith.models.registry import checkpoint_tensors, drafter_from_state

__all__ = [
    "ADAPTER_FILE",
    "weights_file",
    "to_hf",
    "to_speculators",
    "to_sglang_eagle3",
    "to_medusa",
    "usage",
    "load_export",
]

SPECULATORS_VERSION = "0.1.0"


def weights_file(fmt: str) -> str:
    return "medusa_lm_head.safetensors" if fmt == "medusa" else "model.safetensors"


def _is_eagle3(info: dict) -> bool:
    return info["kind"] == "eagle" and info["config"].get("version") == 3


def _one_layer(info: dict, fmt: str) -> None:
    n = info["config"].get("n_layers", 1)
    if n > 1:
        raise DraftsmithError(
            f"export --format {fmt}: the engine loads a one-layer EAGLE-3, this one has "
            f"drafter.n_layers={n} (use --format hf: draftsmith's own layout)"
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
        out[k] = v
    return out


def _eagle3_back(sd: dict, layer_prefix: str) -> dict:
    out = {}
    for k, v in sd.items():
        if k.startswith(layer_prefix):
            rest = k[len(layer_prefix) :]
            for ours, theirs in _LAYER_KEYS.items():
                if rest.startswith(theirs):
                    k = ours + rest[len(theirs) :]
                    break
        out[k] = v
    return out


def _layer_config(cfg: dict) -> dict:
    """The EAGLE layer as an HF Llama config (vocab_size = the target's, one layer)."""
    d = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["dim"],
        "num_hidden_layers": 1,
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
    }
    if cfg.get("rope_scaling"):
        d["rope_scaling"] = cfg["rope_scaling"]
    return d


def _default_aux(cfg: dict) -> list[int]:
    L = cfg["target_layers"]
    return [1, L // 2 - 1, L - 4]  # EAGLE-3's; the engines' default capture (inputs 2, L/2, L-3) is the same


def _speculators_block(info: dict, verifier: str | None, tokens: int) -> dict:
    return {
        "algorithm": "eagle3",
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "default_proposal_method": "greedy",
        # the verifier's hub id, or null when unknown (vLLM's `serve ./folder` then needs the target named)
        "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
    }


def to_speculators(model, info: dict, verifier: str, include_embeddings: bool):
    cfg = info["config"]
    if info["kind"] == "draft_lm":  # vLLM's draft-model path takes a plain HF folder (speculators 0.9 has no
        return to_hf(model, info)  # standalone type: its "independent" was dropped)
    if not _is_eagle3(info):
        raise DraftsmithError(
            f"export --format vllm: supported for EAGLE-3 and draft LMs, not {info['kind']} "
            f"(use --format hf, or medusa for Medusa heads)"
        )
    _one_layer(info, "vllm")
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": _layer_config(cfg),
        "draft_vocab_size": cfg.get("head_vocab_size") or cfg["vocab_size"],
        "norm_before_residual": False,
        "target_hidden_size": cfg["dim"],
        "embed_requires_grad": False,
        "speculators_config": _speculators_block(info, verifier, max(cfg.get("ttt_steps", 1), 3)),
    }
    if list(cfg["aux_layers"]) != _default_aux(cfg):  # vLLM captures the input of layer i: our output index + 1
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in cfg["aux_layers"]]
    return _eagle3_tensors(model, "layers.0.", include_embeddings), config


def to_sglang_eagle3(model, info: dict, verifier: str, include_embeddings: bool):
    if not _is_eagle3(info):
        raise DraftsmithError(
            f"export --format sglang: the SGLang layout is EAGLE-3's, not {info['kind']} "
            f"(a draft LM serves as is from --format hf)"
        )
    _one_layer(info, "sglang")
    cfg = info["config"]
    config = {
        **_layer_config(cfg),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": cfg.get("head_vocab_size") or cfg["vocab_size"],
        "target_hidden_size": cfg["dim"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg["aux_layers"]), "use_aux_hidden_state": True},
        "draftsmith_verifier": verifier,
    }
    return _eagle3_tensors(model, "midlayer.", include_embeddings), config


# ---- Medusa ----------------------------------------------------------------------------------------------------


def to_medusa(model, info: dict, verifier: str, include_embeddings: bool):
    if info["kind"] != "medusa":
        raise DraftsmithError(f"export --format medusa: only Medusa heads use this layout, not {info['kind']}")
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


# ---- hf ----------------------------------------------------------------------------------------------------------


def to_hf(model, info: dict):
    """A draft LM as a plain LlamaForCausalLM; any other kind with draftsmith's own tensor names."""
    meta = {k: v for k, v in info.items() if k != "config"}
    if info["kind"] == "draft_lm":
        tensors = {own_to_hf_key(k): v for k, v in checkpoint_tensors(model).items()}
        return tensors, {**config_to_hf(model.cfg), "torch_dtype": "float32", "draftsmith": meta}
    return checkpoint_tensors(model), {
        "architectures": [f"draftsmith:{info['kind']}"],
        "draftsmith": meta,
        "note": "draftsmith's own layout: load with draftsmith (drafter.json holds the config)",
    }


def usage(fmt: str, kind: str, target: str | None, tokens: int = 3) -> str:
    """How an engine serves the export, as the card and the export log print it. ``target``: the verifier's hub id;
    None (a local target) prints ``TARGET`` for the user to fill in, and never the ``vllm serve ./this-folder``
    short form, which serves the verifier named in config.json (null then)."""
    t = target or "TARGET"
    spec = 'vllm serve {t} --speculative-config \'{{"model": "./this-folder", "method": "{m}", ' + (
        '"num_speculative_tokens": {n}}}\''
    )
    if fmt == "vllm" and kind == "draft_lm":
        return (
            f"`{spec.format(t=t, m='draft_model', n=4)}` (a plain HF Llama folder: vLLM versions with draft-model "
            f"speculation)."
        )
    eagle = f"`{spec.format(t=t, m='eagle3', n=tokens)}`"
    return {
        "vllm": (
            f"`vllm serve ./this-folder` (vLLM reads the speculators config and serves the verifier named in it, "
            f"`{target}`, with this EAGLE-3 drafter), or explicitly: {eagle}."
            if target
            else f"{eagle} (vLLM's speculators format; with no verifier named in config.json, name the target)."
        ),
        "sglang": f"`python -m sglang.launch_server --model {t} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path ./this-folder`",
        "medusa": f"TGI: `text-generation-launcher --model-id ./this-folder` (config.json's base_model_name_or_path "
        f"names the target{'' if target else ': set it first'}). TensorRT-LLM: `examples/medusa/convert_checkpoint.py "
        "--model_dir TARGET_FOLDER --medusa_model_dir ./this-folder --num_medusa_heads N`. The heads are "
        "`medusa_lm_head.safetensors` only (draftsmith writes no pickles): FasterDecoding/Medusa's own loader, "
        "which reads only `medusa_lm_head.pt`, cannot load them.",
        "hf": (
            "transformers: `model.generate(..., assistant_model=AutoModelForCausalLM.from_pretrained(REPO))`; "
            "draftsmith: `draftsmith eval RECIPE eval.checkpoint=./this-folder`."
            if kind == "draft_lm"
            else "draftsmith: `draftsmith eval RECIPE eval.checkpoint=./this-folder` (draftsmith's own layout)."
        ),
    }[fmt]


# ---- import ----------------------------------------------------------------------------------------------------


def load_export(folder: Path, target=None, dtype=None, device="cpu"):
    meta = folder / "drafter.json"
    if not meta.is_file():
        raise DraftsmithError(f"{folder}: not a draftsmith export (no drafter.json)")
    info = read_json(meta)
    fmt, cfg = info.get("export_format", "hf"), info["config"]
    for name, digest in (info.get("sha256") or {}).items():  # exports written before checksums have none
        verify_file(folder / Path(name).name, digest)
    sd = load_tensors(folder / weights_file(fmt))
    if fmt == "medusa":
        sd = _medusa_back(sd, cfg)
    elif fmt in ("vllm", "sglang") and info["kind"] == "eagle":
        sd = _eagle3_back(sd, "layers.0." if fmt == "vllm" else "midlayer.")
        if "t2d" in sd:  # the engines' bool mask back to draft indices
            mask = sd["t2d"].bool()
            t2d = torch.full(mask.shape, -1, dtype=torch.long)
            t2d[mask] = torch.arange(int(mask.sum()))
            sd["t2d"] = t2d
        if "embed_tokens.weight" not in sd:
            if target is None:
                raise DraftsmithError(f"{folder}: the export omits the embeddings; pass the target to take them from")
            sd["embed_tokens.weight"] = target.embed_tokens.weight.detach().cpu()
    elif info["kind"] == "draft_lm":  # hf and vllm share the HF names
        sd = {hf_to_own_key(k): v for k, v in sd.items()}
        hf_cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
        if (hf_cfg.vocab_size, hf_cfg.dim, hf_cfg.n_layers) != (cfg["vocab_size"], cfg["dim"], cfg["n_layers"]):
            raise DraftsmithError(f"{folder}: config.json does not describe the drafter in drafter.json")
    model = drafter_from_state(info, sd, folder)
    return model.to(device=device, dtype=dtype or torch.float32).eval(), info
