"""Native MTP heads: the target's own multi-token-prediction layer as the drafter (docs/algorithms.md A16).

DeepSeek-V3, GLM-4.5 and Qwen3-Next ship, after their decoder layers, one (or more) MTP layer trained with the
model: at position i it reads the target's final hidden state h_i and the embedding of the next token x_{i+1},
``x = eh_proj([enorm(e(x_{i+1})), hnorm(h_i)])``, runs one decoder layer *of the target's own kind* (DeepSeek's
latent attention and experts, GLM's experts, Qwen3-Next's gated full attention and experts) and predicts x_{i+2}
through a final norm and the target's LM head. The layer's output (before that norm) is the state its next draft
reads, so one layer drafts any depth, as vLLM's ``mtp`` method runs it.

``build_mtp`` reads the layer's weights from the target's own safetensors (transformers' ``MtpModel`` classes and
weight conversions, ``drafter.init: target``) or starts it fresh (``random``); a target whose config declares no MTP
layers is refused in one line. Training is EAGLE's training-time test (train/objectives.py ``eagle_objective``):
step s re-runs the layer over the concatenation of all earlier steps' inputs under a block mask, so a query at i
sees the real pairs <= i and its own earlier drafts, exactly what decoding shows it. Decoding is EAGLE's
(eval/proposers.py ``FeatureRows``): the layer's keys and values live in the own slot ``KVCache`` behind
transformers' cache calls (models/hf_target.py ``SlotView``), so chains, trees and batches work as for EAGLE.
``checkpoint_names`` writes the layer back under the target checkpoint's own names, the folder vLLM's ``mtp`` method
loads (``--format vllm``); DeepSeek and GLM layers read a zero embedding at position 0, as vLLM runs them.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.eagle import ttt_result, ttt_window
from draftsmith.models.hf_target import HFTarget, _slot_view_class, hf_sizes
from draftsmith.models.llama import KVCache, cache_mask, default_pos, prepare_cache, window_mask
from draftsmith.models.spec import DrafterSpec, Strict, as_section


class MTPDrafterConfig(Strict):
    """The target's own MTP layer as the drafter (DeepSeek-V3, GLM-4.5, Qwen3-Next), fine-tuned with EAGLE's
    training-time test on the target's answers."""

    kind: Literal["mtp"] = "mtp"
    layer: int = Field(0, ge=0)
    """Which of the target's MTP layers drafts (the released models ship one: 0)."""
    init: Literal["target", "random"] = "target"
    """target: the layer's weights from the target's checkpoint; random: the same layer freshly initialised (an
    ablation: what the shipped weights are worth)."""
    ttt_steps: int = Field(3, gt=0, le=16)
    """Training-time-test unroll: the layer is trained at draft depths 1..ttt_steps, reading its own output at the
    later ones as it does when it drafts them."""
    head_decay: float = Field(0.8, gt=0, le=1)
    """Loss weight of TTT step s is head_decay**s."""
    token_loss_weight: float = Field(1.0, ge=0)
    """Weight of the token loss (train.loss.kind)."""
    feature_noise: float = Field(0.0, ge=0)
    """Uniform noise in [-a, a] added to the input hidden states while training."""
    sliding_window: int | None = Field(None, gt=1)
    """Attend to the last N positions only (a query at p sees keys at positions > p - N), in training and decoding
    alike, whatever the target's layer does; None = the layer's full attention. Above ttt_steps."""

    @model_validator(mode="after")
    def _window(self):
        if self.sliding_window is not None and self.sliding_window <= self.ttt_steps:
            raise ValueError(
                f"drafter.sliding_window={self.sliding_window} must exceed drafter.ttt_steps={self.ttt_steps}: "
                "each TTT step keeps its row's earlier steps in view"
            )
        return self


@dataclass(frozen=True)
class MTPConfig:
    hf_config: dict  # the target's transformers config (config.json's fields): the layer is built from it
    layer: int = 0
    ttt_steps: int = 3
    version: int = 1  # reads the target's final normed hidden state, as EAGLE-1 does (train/objectives.py)
    sliding_window: int | None = None  # attend to the last N positions only; None = all
    blank_first_position: bool = False  # zero the token embedding at position 0 (vLLM's DeepSeek / GLM MTP layers)
    head_vocab_size: None = None  # the target's whole vocabulary

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def sizes(self):
        return hf_sizes(self.hf_config)


def _text_config(hf_config: dict):
    """transformers' config object for the dict, with an MTP count where the family names it its own way."""
    from transformers import AutoConfig

    d = dict(hf_config)
    conf = AutoConfig.for_model(d.pop("model_type"), **d)
    conf = conf.get_text_config(decoder=True)
    if getattr(conf, "num_mtp_layers", None) is None and getattr(conf, "mtp_num_hidden_layers", None):
        conf.num_mtp_layers = conf.mtp_num_hidden_layers  # Qwen3-Next: full-attention MTP layers under mtp.*
        conf.mtp_layer_types = ["full_attention"] * conf.num_mtp_layers
        conf.mtp_mlp_layer_types = None
    return conf


# Families whose MTP layer vLLM runs with a zero token embedding at position 0 (its deepseek_mtp / glm4_moe_mtp:
# "not needed by MTP"); the drafter trains and decodes the same way, so that served drafts are its own.
BLANK_FIRST_POSITION = ("deepseek_v3", "glm4_moe")


def mtp_count(conf) -> int:
    return int(getattr(conf, "num_mtp_layers", None) or 0)


def _mtp_model(main, conf):
    """transformers' ``MtpModel`` of ``main`` (a causal LM, real or on the meta device) with config ``conf``."""
    from transformers.modeling_layers import MtpModel

    saved = main.config
    main.config = conf  # MtpModel reads the MTP count and layer types from the main model's config
    try:
        conf._attn_implementation = "sdpa"  # prepared 4-D masks (trees, batches) go through SDPA
        mtp = MtpModel(main, mtp_count(conf))
    finally:
        main.config = saved
    with torch.no_grad():  # MtpModel's own init leaves the target family's expert tensors uninitialised
        mtp.layers.apply(main._init_weights)
    return mtp


class MTP(nn.Module):
    reads_target_features = True

    def __init__(self, cfg: MTPConfig, main=None):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        conf = _text_config(cfg.hf_config)
        if main is None:  # only the classes of the target are needed: build it on the meta device
            with torch.device("meta"):
                main = AutoModelForCausalLM.from_config(conf)
        mtp = _mtp_model(main, conf)
        self.mtp_model = [mtp, main]  # kept out of the module tree: the weights load (and export) through them
        self.layer = mtp.layers[cfg.layer]
        s = cfg.sizes
        self.embed_tokens = nn.Embedding(s.vocab_size, s.dim)  # frozen copies of the target's
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head = nn.Linear(s.dim, s.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        mconf = mtp.config
        self.rotary = type(main.get_decoder().rotary_emb)(config=mconf)
        attn = getattr(self.layer.mtp_block, "self_attn", None)
        if attn is not None and hasattr(attn, "layer_idx"):
            attn.layer_idx = 0  # the drafter's cache holds this one layer
        params = inspect.signature(self.layer.mtp_block.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ---- shared by training and decoding ------------------------------------------------------------------------

    @property
    def target_vocab_size(self) -> int:
        return self.cfg.sizes.vocab_size

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return (self.cfg.sizes.n_layers,)

    def features(self, captured: dict, target) -> torch.Tensor:
        """The target's final hidden state after its norm (what transformers and vLLM hand an MTP layer)."""
        return target.norm(captured[self.cfg.sizes.n_layers])

    def features_in(self, signals: dict) -> bool:
        return "hidden_last" in signals

    def project(self, feats: torch.Tensor) -> torch.Tensor:
        return feats

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        return self.layer.post_norm(out)

    def _inputs(self, ids: torch.Tensor, state: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        e, L = self.embed(ids), self.layer
        if self.cfg.blank_first_position:  # the token embedding at position 0 is zeros, as vLLM runs these layers
            e = e.masked_fill((pos == 0)[..., None], 0.0)
        return L.eh_proj(torch.cat([L.enorm(e), L.hnorm(state.to(e.dtype))], -1))

    def _block(self, x: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, view=None) -> torch.Tensor:
        """The target-kind decoder layer over x (B, T, d) at positions pos, keys allowed by ``allowed``
        (B|1, 1, T, S) bool, writing its keys and values through ``view`` (a SlotView) when given."""
        dtype = x.dtype
        if dtype == torch.float64:  # transformers' grouped expert kernel has no float64
            self.layer.config._experts_implementation = "eager"
        mask = torch.zeros(allowed.shape, dtype=dtype, device=x.device).masked_fill(~allowed, torch.finfo(dtype).min)
        kw = {"attention_mask": mask, "position_ids": pos, "position_embeddings": self.rotary(x, position_ids=pos)}
        if view is not None:
            kw.update({self._cache_kw: view, "use_cache": True})
        out = self.layer.mtp_block(x, **kw)
        return out[0] if isinstance(out, tuple) else out

    # ---- decoding -------------------------------------------------------------------------------------------------

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        w = self.embed_tokens.weight
        if not hasattr(self, "_kv_shape"):
            shapes: dict = {}
            with torch.no_grad():
                x = torch.zeros(1, 2, w.shape[1], dtype=w.dtype, device=w.device)
                pos = torch.arange(2, device=w.device)[None]
                self._block(x, pos, torch.ones(1, 1, 2, 2, dtype=torch.bool), _slot_view_class()(None, 0, 2, shapes))
            ((heads, dk, dv),) = shapes.values()
            self._kv_shape = (heads, max(dk, dv))
        heads, hd = self._kv_shape
        lc = replace(self.cfg.sizes, n_layers=1, n_kv_heads=heads, head_dim=hd)
        return KVCache(lc, batch, max_len, w.dtype, w.device)

    def step(self, state, ids, pos=None, cache: KVCache | None = None, attn_mask=None, last_only=False, valid=None):
        """state (B, T, d), ids (B, T) -> (logits (B, T, V), next state (B, T, d)), appending to ``cache`` (the
        EAGLE step contract, models/eagle.py ``Eagle.step``)."""
        B, T = ids.shape
        own_pos, W = pos is not None, self.cfg.sliding_window
        pos = default_pos(ids, cache) if pos is None else pos
        x = self._inputs(ids, state, pos)
        if cache is None:
            allowed = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()[None, None]
            out = self._block(x, pos, window_mask(W, allowed, pos, None, None, False, True))
        else:
            s0 = cache.length
            allowed = prepare_cache(cache, T, valid, attn_mask)
            if allowed is None:
                allowed = cache_mask(cache, T, None)
            allowed = window_mask(W, allowed, pos, cache, attn_mask, False, own_pos)
            out = self._block(x, pos, allowed, _slot_view_class()(cache, s0, T))
            cache.length += T
        h = out[:, -1:] if last_only else out
        return self.lm_head(self.head_input(h)), out

    # ---- training: training-time test -----------------------------------------------------------------------------

    def forward(self, feats, ids, steps=1, select=None, head_fn=None, step_tokens=None, pos=None, attn_mask=None):
        """TTT unroll with the EAGLE forward's contract (models/eagle.py ``Eagle.forward``). Step s runs the layer
        over the inputs of steps 0..s side by side, (s + 1) T queries, under a block mask: step 0 causal (or the
        packed documents' mask), step a > 0 at i sees step 0's keys <= i and its own keys of steps 1..a at i."""
        B, T = ids.shape
        base = torch.arange(T, device=ids.device).expand(B, T) if pos is None else pos
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()[None] if attn_mask is None else attn_mask
        eye = torch.eye(T, dtype=torch.bool, device=ids.device)[None].expand(causal.shape[0], T, T)
        none = torch.zeros_like(eye)
        state, xs, results = feats, [], []
        for s in range(steps):
            tok = torch.zeros_like(ids)
            if s + 1 < T:
                tok[:, : T - s - 1] = ids[:, s + 1 :]  # past the end: token 0, never selected for a loss
            if step_tokens and s in step_tokens:
                tok = step_tokens[s]
            xs.append(self._inputs(tok, state, base + s))
            seen = [ttt_window(causal[:, None], base, a, self.cfg.sliding_window)[:, 0] for a in range(s + 1)]
            own = [m.expand(seen[0].shape[0], T, T) for m in (eye, none)]  # a window makes the mask per row
            rows = [[seen[a]] + [own[0] if 0 < b <= a else own[1] for b in range(1, s + 1)] for a in range(s + 1)]
            allowed = torch.cat([torch.cat(r, -1) for r in rows], -2)[:, None]
            positions = torch.cat([base + a for a in range(s + 1)], -1)
            out = self._block(torch.cat(xs, 1), positions, allowed)[:, s * T :]
            results.append(ttt_result(self, s, out, select, head_fn))
            state = out
        return torch.stack(results) if head_fn is None else results

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed_tokens.weight.numel() - self.lm_head.weight.numel() if exclude_embeddings else n


def _checkpoint_keys(folder: Path) -> dict[str, Path]:
    """{tensor name: its safetensors file} of a transformers checkpoint folder."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update(dict.fromkeys(h.keys(), f))
    return out


def mtp_prefixes(n_layers: int, n_mtp: int) -> tuple[str, ...]:
    """Checkpoint name prefixes of the MTP layers of a target with ``n_layers`` decoder layers: DeepSeek-V3 and
    GLM-4.5 number them after the decoder layers, Qwen3-Next keeps them under ``mtp.``."""
    return (*(f"model.layers.{n_layers + j}." for j in range(n_mtp)), "mtp.")


def _conversions(mtp, main) -> list:
    """transformers' weight conversions from the target checkpoint's MTP names onto ``MtpModel`` (its own method
    where the installed transformers has one; else the same list built as transformers builds it)."""
    own = getattr(mtp, "get_weight_conversions", None)
    if own is not None:
        return own(main)
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    n = main.config.get_text_config().num_hidden_layers
    out = [WeightRenaming(f"layers.{j}.", f"layers.{j - n}.mtp_block.") for j in range(n, n + mtp.num_mtp_layers)]
    out += get_model_conversion_mapping(mtp, add_legacy=False)
    return out + (getattr(main, "_weight_conversions", None) or get_model_conversion_mapping(main))


def _load_layer(model: MTP, tensors: dict, where) -> None:
    """The MTP layers' tensors (checkpoint names -> tensors or safetensors slices) into ``model``'s, through
    transformers' renamings and expert merges; the drafting layer's missing tensors are refused in one line."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    mtp, main = model.mtp_model
    config = LoadStateDictConfig(weight_mapping=_conversions(mtp, main), dtype=model.embed_tokens.weight.dtype)
    info, _ = convert_and_load_state_dict_in_model(model=mtp, state_dict=tensors, load_config=config)
    missing = sorted(k for k in info.missing_keys if k.startswith(f"layers.{model.cfg.layer}."))
    if missing:
        raise DraftsmithError(f"drafter.kind=mtp: {where} lacks MTP tensors for {missing[:3]} (and maybe more)")


def load_target_layer(model: MTP, main, folder: Path) -> None:
    """The MTP layers' tensors from the target's checkpoint (its ``MtpModel`` mapping); a checkpoint without them
    is refused in one line."""
    from safetensors import safe_open

    where = {
        k: f
        for k, f in _checkpoint_keys(folder).items()
        if k.startswith(mtp_prefixes(model.cfg.sizes.n_layers, model.mtp_model[0].num_mtp_layers))
    }
    if not where:
        raise DraftsmithError(
            f"drafter.kind=mtp: {folder} declares MTP layers but its safetensors hold none of their tensors "
            f"(a checkpoint saved without them); set drafter.init=random to train the layer from scratch"
        )
    sd, handles = {}, {}
    for k, f in where.items():
        if f not in handles:
            handles[f] = safe_open(str(f), "pt")
        sd[k] = handles[f].get_slice(k)
    _load_layer(model, sd, folder)


# ---- the target checkpoint's names: vLLM's ``mtp`` method loads the layer under them ------------------------------

_MTP_SLOT = ("mtp.",)  # Qwen3-Next keeps its MTP layer under mtp.*, the others after the decoder layers
_QWEN_NEXT_NAMES = {"enorm.": "pre_fc_norm_embedding.", "hnorm.": "pre_fc_norm_hidden.", "eh_proj.": "fc.",
                    "post_norm.": "norm.", "mtp_block.": "layers.0."}  # fmt: skip


def under_mtp_names(model_type: str) -> bool:
    """Whether the family keeps its MTP layer under ``mtp.*`` (Qwen3-Next), not ``model.layers.{L}.*``."""
    return model_type.startswith("qwen3_next")


def checkpoint_names(model: MTP) -> dict[str, torch.Tensor]:
    """The drafting layer as the target's checkpoint stores its first MTP layer (experts unmerged, as transformers
    saves them): ``model.layers.{L}.*`` with the final norm as ``shared_head.norm`` (DeepSeek-V3, GLM-4.5), or
    Qwen3-Next's ``mtp.*``; plus the embeddings and the LM head under the target's names."""
    from transformers.core_model_loading import WeightConverter, revert_weight_conversion

    mtp, main = model.mtp_model
    mtp._weight_conversions = [c for c in _conversions(mtp, main) if isinstance(c, WeightConverter)]
    try:  # only the expert merges are undone by transformers: the renamings are the family's, below
        sd = revert_weight_conversion(mtp, {k: v.detach() for k, v in model.layer.state_dict().items()})
    finally:
        del mtp._weight_conversions
    qwen = under_mtp_names(model.cfg.hf_config["model_type"])
    out = {}
    for k, v in sd.items():
        if qwen:
            name = "mtp." + next((k.replace(a, b, 1) for a, b in _QWEN_NEXT_NAMES.items() if k.startswith(a)), k)
        else:
            name = f"model.layers.{model.cfg.sizes.n_layers}." + k.removeprefix("mtp_block.").replace(
                "post_norm.", "shared_head.norm."
            )
        out[name] = v.detach().contiguous().cpu().clone()
    out["model.embed_tokens.weight"] = model.embed_tokens.weight.detach().cpu().clone()
    out["lm_head.weight"] = model.lm_head.weight.detach().cpu().clone()
    return out


def from_checkpoint_names(model: MTP, sd: dict, where) -> dict[str, torch.Tensor]:
    """``checkpoint_names`` back: {the drafter's state-dict name: tensor}, the layer read into ``model``."""
    n, j = model.cfg.sizes.n_layers, model.cfg.layer
    layer = {}
    for k, v in sd.items():
        if k.startswith(f"model.layers.{n}."):  # the export's one layer is the drafter's layer j
            layer[k.replace(f"model.layers.{n}.", f"model.layers.{n + j}.", 1)] = v
        elif k.startswith(_MTP_SLOT) and not k.startswith("mtp.layers."):
            layer[k] = v
        elif k.startswith("mtp.layers.0."):
            layer[k.replace("mtp.layers.0.", f"mtp.layers.{j}.", 1)] = v
    _load_layer(model, layer, where)
    out = {f"layer.{k}": v for k, v in model.layer.state_dict().items()}
    return {**out, "embed_tokens.weight": sd["model.embed_tokens.weight"], "lm_head.weight": sd["lm_head.weight"]}


def build_mtp(cfg: MTPDrafterConfig | dict, target, **_) -> MTP:
    """The target's MTP layer ``drafter.layer`` as a drafter: its weights from the target's checkpoint (or fresh),
    embeddings and LM head copied frozen from the target."""
    p = as_section(MTPDrafterConfig, cfg)
    hf = target.hf if isinstance(target, HFTarget) else None
    if hf is not None:
        hf_config = hf.config.get_text_config(decoder=True).to_dict()
    else:  # a target on the own code: its transformers twin's config (models/loading.py)
        from draftsmith.models.loading import config_to_hf

        hf_config = config_to_hf(target.cfg)
    n = mtp_count(_text_config(hf_config))
    if p.init == "target" and n == 0:
        name = hf_config.get("model_type")
        raise DraftsmithError(
            f"drafter.kind=mtp: the {name!r} target has no MTP layers (its config sets no num_nextn_predict_layers "
            f"/ mtp_num_hidden_layers); set drafter.init=random to train a fresh one, or use an eagle drafter"
        )
    if n == 0:  # a fresh layer of the target's kind: one full-attention MTP layer
        hf_config = {**hf_config, "num_mtp_layers": 1}
        if hf_config.get("layer_types"):
            hf_config["mtp_layer_types"] = ["full_attention"]
    if p.layer >= max(n, 1):
        raise DraftsmithError(f"drafter.layer {p.layer} is outside the target's {max(n, 1)} MTP layer(s)")
    dtype = target.embed_tokens.weight.dtype
    blank = hf_config.get("model_type") in BLANK_FIRST_POSITION
    cfg = MTPConfig(hf_config=hf_config, layer=p.layer, ttt_steps=p.ttt_steps, sliding_window=p.sliding_window,
                    blank_first_position=blank)  # fmt: skip
    model = MTP(cfg, main=hf).to(dtype)
    if p.init == "target":  # hf is set: a target on the own code declares no MTP layers
        load_target_layer(model, hf, Path(hf.config.name_or_path))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.embed_tokens.weight)
        model.lm_head.weight.copy_(target.lm_head.weight)
    return model


def mtp_from_config(cfg: dict) -> MTP:
    return MTP(MTPConfig(**cfg))


VLLM_MTP_FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_next")  # targets whose MTP layer vLLM's mtp method runs


def mtp_exports(info: dict) -> dict:
    """``--format vllm``: the layer under the target checkpoint's own names, for vLLM's ``mtp`` method; refused in
    one line where vLLM's MTP layer for the family could not run it as trained."""
    cfg = info.get("config", {})
    family = cfg.get("hf_config", {}).get("model_type", "?")
    e = "draftsmith.export.formats:"
    if family not in VLLM_MTP_FAMILIES:
        why = f"vLLM's mtp method runs the MTP layers of {', '.join(VLLM_MTP_FAMILIES)} targets, not {family!r}"
    elif cfg.get("sliding_window"):
        why = "vLLM's MTP layer attends to the whole context: a drafter.sliding_window layer has no vLLM layout"
    else:
        return {"vllm": {"write": e + "to_mtp_vllm", "read": e + "read_mtp_vllm", "usage": e + "usage_mtp"}}
    return {"vllm": f"refused: {why}; use --format hf"}


SPEC = DrafterSpec(
    kind="mtp",
    config=MTPDrafterConfig,
    build=build_mtp,
    from_config=mtp_from_config,
    interface="features",
    objective="draftsmith.train.objectives:eagle_objective",
    signals=frozenset({"topk", "hidden_last"}),
    needs_target=True,
    packs=True,
    exports=mtp_exports,
    engines={"vllm": {"method": "mtp", "formats": ("vllm",)}},
)
