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
- **EAGLE-1** (vLLM ``EagleLlamaForCausalLM``, SGLang ``LlamaForCausalLMEagle``): config.json is a Llama config with
  ``architectures: [LlamaForCausalLMEagle]`` and ``num_hidden_layers`` = the drafter's depth; tensors ``fc.*`` and
  ``layers.{i}.*``, layer 0 without ``input_layernorm``, no final norm; the engines take the embeddings and the LM
  head from the target. SGLang's fc has a bias, vLLM's has none (a drafter with a nonzero ``fc.bias`` is refused
  there). A reduced head becomes SGLang's hot-token map (``hot_token_map.pt``).
- **MLP speculator** (IBM's layout, vLLM and TGI): config.json with ``model_type: mlp_speculator`` (emb_dim,
  inner_dim, n_predict, ...) and tensors ``speculator.{emb,proj,ln,head}.{i}.*``. IBM's stage norm has no mean
  subtraction and eps 1e-6; ours is a LayerNorm (eps 1e-5): the export centres ``proj`` / ``emb`` and scales them
  by sqrt(1e-6 / 1e-5), which makes IBM's norm compute ours exactly (``to_mlp_speculator``).
- **Draft LM with a reduced head**: written as a plain LlamaForCausalLM whose head has every target row; a dropped
  row is the mean of the kept rows, so its logit (the mean of the kept logits) never exceeds the best kept one.
Embeddings of EAGLE drafters are frozen copies of the target's: omitted unless asked, and taken from the target
on import, as the engines do.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle import EagleConfig
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
    "to_mlp_speculator",
    "to_eagle1",
    "side_outputs",
    "usage_kind",
    "usage",
    "load_export",
]

SPECULATORS_VERSION = "0.1.0"


log = logging.getLogger("draftsmith.export")


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


def _speculators_block(info: dict, verifier: str, tokens: int) -> dict:
    return {
        "algorithm": "eagle3",
        "proposal_methods": [
            {"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1, "accept_tolerance": 0.0}
        ],
        "default_proposal_method": "greedy",
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


def side_outputs(model, info: dict, fmt: str) -> tuple[dict, dict]:
    """What an export writes besides the weights and config: keys for drafter.json, and {file name: writer(path)}
    (SGLang's hot-token map for a reduced EAGLE-1 head)."""
    meta, files = {}, {}
    reduced = getattr(model, "d2t", None) is not None
    if info["kind"] == "draft_lm" and fmt in ("hf", "vllm") and reduced:
        meta = _vocab_meta(model)
    if _is_eagle1(info) and fmt in ("vllm", "sglang"):
        meta = _vocab_meta(model)
        if reduced:
            ids = meta["head_vocab_ids"]  # SGLang reads torch.tensor(torch.load(path, weights_only=True))
            files["hot_token_map.pt"] = lambda path: torch.save(ids, path)
    return meta, files


def _vocab_back(info: dict) -> dict:
    ids = info.get("head_vocab_ids")
    if ids is None:
        return {}
    keep = torch.tensor(ids, dtype=torch.long)
    t2d = torch.full((info["config"]["vocab_size"],), -1, dtype=torch.long)
    t2d[keep] = torch.arange(len(keep))
    return {"keep": keep, "d2t": keep - torch.arange(len(keep)), "t2d": t2d}


def _is_eagle1(info: dict) -> bool:
    return info.get("kind") == "eagle" and info.get("config", {}).get("version") == 1


def to_eagle1(fmt: str):
    """EAGLE-1 writer for ``fmt`` (vllm / sglang): both engines read the same names; they differ in fc's bias."""

    def write(model, info: dict, verifier: str, include_embeddings: bool):
        cfg = info["config"]
        if cfg.get("qk_norm"):
            raise DraftsmithError(f"export --format {fmt}: the engines' EAGLE-1 is a Llama layer, without q/k norms")
        sd = checkpoint_tensors(model)
        if fmt == "vllm":
            if cfg.get("head_vocab_size"):
                raise DraftsmithError(
                    f"export --format vllm: this EAGLE-1 head keeps {cfg['head_vocab_size']} of "
                    f"{cfg['vocab_size']} tokens (drafter.draft_vocab), which vLLM's EAGLE-1 cannot express; use "
                    f"--format sglang (hot-token map) or train with drafter.draft_vocab=null"
                )
            bias = sd.pop("fc.bias")
            if bool(bias.any()):
                raise DraftsmithError(
                    f"export --format vllm: vLLM's EAGLE-1 fc has no bias, and this drafter's fc.bias is nonzero "
                    f"(max |b| = {bias.abs().max():.3g}); use --format sglang"
                )
            if include_embeddings:  # vLLM skips them on load yet marks them as the draft's own
                log.warning("export --format vllm: EAGLE-1 embeddings are never written (vLLM shares the target's)")
            include_embeddings = False
        out = {}
        for k, v in sd.items():
            if k in ("lm_head.weight", "d2t", "t2d") or (k == "embed_tokens.weight" and not include_embeddings):
                continue  # the engines take the LM head (sliced by the hot-token map) from the target
            if k.startswith("extra."):
                j, rest = k[len("extra.") :].split(".", 1)
                k = f"layers.{int(j) + 1}.{rest}"
            elif k.split(".")[0] in ("self_attn", "post_attention_layernorm", "mlp"):
                k = "layers.0." + k
            out[k] = v
        layer = EagleConfig(**{**cfg, "aux_layers": tuple(cfg.get("aux_layers", ()))}).layer_config()
        config = {
            **config_to_hf(replace(layer, n_layers=cfg.get("n_layers", 1))),
            "architectures": ["LlamaForCausalLMEagle"],
            "torch_dtype": "float32",
            "draftsmith_verifier": verifier,
        }
        return out, config

    return write


def _eagle1_back(sd: dict, info: dict, target, folder: Path) -> dict:
    out = {}
    for k, v in sd.items():
        if k.startswith("layers.0."):
            k = k[len("layers.0.") :]
        elif k.startswith("layers."):
            i, rest = k[len("layers.") :].split(".", 1)
            k = f"extra.{int(i) - 1}.{rest}"
        out[k] = v
    if "fc.bias" not in out:  # vLLM's layout: a bias-free fc
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


_IBM_NORM_EPS = 1e-6  # fms-extras' LayerNormParameterized, as vLLM and TGI restate it


def to_mlp_speculator(model, info: dict, verifier: str, include_embeddings: bool):
    """IBM's MLP speculator layout (fms-extras; vLLM and TGI load it). IBM's stage norm is x / sqrt(mean(x^2) + 1e-6)
    with a learned scale and shift; ours is a LayerNorm, (x - mean) / sqrt(var + eps). Centring proj and emb (so
    their sum has zero mean) and scaling both by a = sqrt(1e-6 / eps) gives IBM's norm a x' with mean(x'^2) =
    a^2 var(x): exactly our LayerNorm of x."""
    if info["kind"] != "mlp_speculator":
        raise DraftsmithError(f"export --format mlp-speculator: IBM's MLP speculator layout, not {info['kind']}")
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


def usage_kind(info: dict) -> str:
    """The kind ``usage`` explains: EAGLE-1 serves differently from EAGLE-3."""
    return "eagle1" if _is_eagle1(info) else info.get("kind", "?")


# ---- hf ----------------------------------------------------------------------------------------------------------


def to_hf(model, info: dict):
    """A draft LM as a plain LlamaForCausalLM; any other kind with draftsmith's own tensor names."""
    meta = {k: v for k, v in info.items() if k != "config"}
    if info["kind"] == "draft_lm":
        sd = checkpoint_tensors(model)
        if "d2t" in sd:  # a reduced head: every target row, so transformers loads a plain LlamaForCausalLM
            keep = _kept_ids(sd.pop("d2t"))
            sd.pop("t2d")
            sd["lm_head.weight"] = full_vocab_head(sd["lm_head.weight"], keep, model.cfg.vocab_size)
        tensors = {own_to_hf_key(k): v for k, v in sd.items()}
        return tensors, {**config_to_hf(model.cfg), "torch_dtype": "float32", "draftsmith": meta}
    return checkpoint_tensors(model), {
        "architectures": [f"draftsmith:{info['kind']}"],
        "draftsmith": meta,
        "note": "draftsmith's own layout: load with draftsmith (drafter.json holds the config)",
    }


def usage(fmt: str, kind: str, target: str) -> str:
    if kind == "eagle1" and fmt in ("vllm", "sglang"):
        return {
            "vllm": f'`vllm serve {target} --speculative-config \'{{"method": "eagle", "model": "./this-folder", '
            f"\"num_speculative_tokens\": 4}}'` (EAGLE-1; vLLM shares the target's embeddings and LM head).",
            "sglang": f"`python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE "
            f"--speculative-draft-model-path ./this-folder` (EAGLE-1; with a reduced head add "
            f"`--speculative-token-map ./this-folder/hot_token_map.pt`).",
        }[fmt]
    if fmt == "vllm" and kind == "draft_lm":
        return (
            f'`vllm serve {target} --speculative-config \'{{"model": "./this-folder", '
            f'"num_speculative_tokens": 4}}\'` (a plain HF Llama folder: vLLM versions with draft-model '
            f"speculation)."
        )
    return {
        "vllm": "`vllm serve ./this-folder` (vLLM reads the speculators config: the verifier named inside is served "
        "with this EAGLE-3 drafter).",
        "sglang": f"`python -m sglang.launch_server --model {target} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path ./this-folder`",
        "mlp-speculator": f'vLLM: `vllm serve {target} --speculative-config \'{{"model": "./this-folder", '
        f'"num_speculative_tokens": N}}\'`; TGI: `text-generation-launcher --model-id ./this-folder` '
        f"(base_model_name_or_path names the target). IBM's MLP speculator layout.",
        "medusa": "TGI: `text-generation-launcher --model-id ./this-folder` (base_model_name_or_path names the "
        "target). TensorRT-LLM: `examples/medusa/convert_checkpoint.py --medusa_model_dir ./this-folder "
        "--num_medusa_heads N`.",
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
    info = json.loads(meta.read_text())
    fmt, cfg = info.get("export_format", "hf"), info["config"]
    sd = load_file(str(folder / weights_file(fmt)))
    if fmt == "medusa":
        sd = _medusa_back(sd, cfg)
    elif fmt == "mlp-speculator":
        sd = _mlp_speculator_back(sd)
    elif fmt in ("vllm", "sglang") and _is_eagle1(info):
        sd = _eagle1_back(sd, info, target, folder)
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
        vocab = _vocab_back(info)
        if vocab:  # the full-vocabulary head back to the kept rows and their maps
            sd["lm_head.weight"] = sd["lm_head.weight"][vocab["keep"]].clone()
            sd["d2t"], sd["t2d"] = vocab["d2t"], vocab["t2d"]
        hf_cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
        if (hf_cfg.vocab_size, hf_cfg.dim, hf_cfg.n_layers) != (cfg["vocab_size"], cfg["dim"], cfg["n_layers"]):
            raise DraftsmithError(f"{folder}: config.json does not describe the drafter in drafter.json")
    model = drafter_from_state(info, sd, folder)
    return model.to(device=device, dtype=dtype or torch.float32).eval(), info
