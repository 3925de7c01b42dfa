"""Export a trained drafter for hubs and serving engines: ``draftsmith export RECIPE|CHECKPOINT --format F``, or a
recipe's ``export:`` section at the end of ``draftsmith run``.

Formats (their tensor-name contracts live in draftsmith/export/formats.py):
- ``hf``: a self-contained folder (config.json, model.safetensors, tokenizer files, the resolved recipe,
  drafter.json and a model card with the eval table). A draft LM is a plain ``LlamaForCausalLM`` (transformers,
  vLLM's and SGLang's draft-model paths); other kinds keep draftsmith's tensor names.
- ``vllm``: the speculators format vLLM detects (EAGLE-3 and draft LMs).
- ``sglang``: the EAGLE-3 layout SGLang loads (fc, midlayer, norm, lm_head, d2t, t2d).
- ``medusa``: the Medusa heads layout TensorRT-LLM and TGI read.
- ``mlp-speculator``: IBM's MLP speculator layout (TGI, fms-extras; vLLM serves no MLP speculator).
EAGLE-1 goes to ``vllm`` / ``sglang`` in the layout those engines' EAGLE loaders read.

Every folder is written under ``<out>.tmp`` and renamed into place, so a killed export never leaves a complete-
looking folder; each also carries ``drafter.json`` so ``load_export`` reads it back into draftsmith's decoder
(round trip: same greedy output and τ, tested). Hub pushes read the token from the environment and never print it.

The target is named by its hub id only (``Target``): a packaged alias by the hub model its GGUF came from, a hub
target by its id, a local folder by ``target.hub_id`` when the recipe sets it. An unknown hub id is written as null
and the card says how to name the target; a local path never reaches a config, the card or drafter.json, and a push
that would carry one is refused. A folder's config.json ``_name_or_path`` is only a hint in the log: transformers
stopped saving it, and where present it names the model the folder was loaded from, e.g. a fine-tune's base.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError, redact
from draftsmith.eval.own_vocab import refuse_own_vocab
from draftsmith.export import formats as sf
from draftsmith.integrity import checksums, config_digest
from draftsmith.models.loading import ALIAS_HUB, resolve_model_path
from draftsmith.models.registry import DRAFTERS, load_drafter
from draftsmith.recipes.schema import hub_repo_id

log = logging.getLogger("draftsmith.export")
FORMATS = ("hf", "vllm", "sglang", "medusa", "mlp-speculator")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def checkpoint_of(recipe) -> Path:
    return Path(recipe.eval.checkpoint) if recipe.eval.checkpoint else recipe.run_dir / "checkpoints" / "final"


def export(ckpt: Path, fmt: str, out: Path, recipe=None, include_embeddings: bool = True) -> Path:
    """Write checkpoint ``ckpt`` in format ``fmt`` to folder ``out`` (replaced atomically); returns ``out``."""
    if fmt not in FORMATS:
        raise DraftsmithError(f"export: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    ckpt, out = Path(ckpt), Path(out)
    check_out_folder(out)
    src, dst = ckpt.resolve(), out.resolve()
    if dst == src or dst in src.parents:  # the export replaces its folder whole: the checkpoint would go with it
        raise DraftsmithError(f"export: output folder {out} is or contains the checkpoint {ckpt}; name another folder")
    model, info = load_drafter(ckpt)
    refuse_own_vocab(ckpt, info, "export")
    if DRAFTERS[info["kind"]].interface is None:  # an acceptance head, the judge (load_drafter knows the kind)
        raise DraftsmithError(f"export: a {info['kind']} is not a drafter a serving engine runs; export its draft")
    if getattr(model, "target_adapter", None) is not None and fmt != "hf":
        raise DraftsmithError(
            f"export: {ckpt} is Medusa-2 (LoRA-adapted target); engines need the merged target "
            f"too: use --format hf, which keeps target_adapter.safetensors"
        )
    tmp = out.with_name(out.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        target = info.get("target") or ""
        run_dir = recipe.run_dir if recipe is not None else ckpt.parent.parent
        trained_by = next((p for p in (ckpt / "recipe.yaml", run_dir / "recipe.yaml") if p.is_file()), None)
        tgt = _verifier(recipe, target, trained_by)
        own = {k: v for k, v in info.items() if k != "sha256"}  # the checkpoint's checksums; the export gets its own
        named = {**own, "target": tgt.hub_id if is_local_path(target) else target}  # what the export's files say
        tensors, config = _writer(info, fmt)(model, named, tgt.hub_id, include_embeddings)
        save_file(tensors, str(tmp / sf.weights_file(info, fmt)), metadata={"format": "pt"})  # one key: a fixed order
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if (ckpt / sf.ADAPTER_FILE).is_file():
            shutil.copy2(ckpt / sf.ADAPTER_FILE, tmp / sf.ADAPTER_FILE)
        sums = checksums(tmp)  # load_export and `eval.checkpoint=EXPORT` verify them, as for a checkpoint
        meta = {**named, **sf.export_meta(model, info, fmt), "export_format": fmt, "sha256": sums}
        meta["config_sha256"] = config_digest(meta["config"])  # the config as exported
        (tmp / "drafter.json").write_text(json.dumps(meta, indent=2))
        _copy_tokenizer(target, tmp, required=fmt == "hf" and bool(sf.export_entry(info, fmt).get("plain_lm")))
        if trained_by is not None:  # the checkpoint's own copy first: the run folder's is the last command's
            _copy_recipe(trained_by, tmp / "recipe.yaml", tgt)
        report = run_dir / "eval" / "report.json"
        card = model_card(info, fmt, json.loads(report.read_text()) if report.is_file() else None, tgt, _tokens(config))
        (tmp / "README.md").write_text(card)
        if tgt.hub_id is None:
            log.warning(
                "export: no hub id is known for target %r, so %s names no target (set "
                "target.hub_id=org/name to name one%s); serve with: %s",
                target,
                out,
                f"; its config.json says it was loaded from {tgt.hint}" if tgt.hint else "",
                sf.usage(fmt, info, None, _tokens(config)),
            )
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except OSError as e:  # a read-only mount, a full disk: one line, and no half-written folder left
        shutil.rmtree(tmp, ignore_errors=True)
        raise DraftsmithError(f"export: cannot write {out} ({e.strerror or e})") from None
    except BaseException:  # a writer's refusal (a config its layout cannot carry), an interrupt: nothing left either
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _writer(info: dict, fmt: str):
    """The writer of ``fmt`` for this kind (its DrafterSpec.exports), or a one-line refusal naming its formats."""
    kind = info["kind"]
    formats = {f: e["write"] for f, e in DRAFTERS[kind].export_formats(info).items()}
    target = formats.get(fmt)
    if target is None:
        usable = ", ".join(f for f, w in formats.items() if not w.startswith("refused: "))
        raise DraftsmithError(f"export --format {fmt}: drafter.kind {kind} exports as {usable} (not {fmt})")
    if target.startswith("refused: "):
        raise DraftsmithError(f"export --format {fmt}: {target.removeprefix('refused: ')}")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def check_out_folder(out: Path) -> None:
    """Refuse, before anything is written, an output folder that is an existing file or lies under one."""
    for p in (out, *out.parents):
        if p.is_dir():
            return
        if p.exists() or p.is_symlink():
            where = "is a file" if p == out else f"lies under {p}, which is a file"
            raise DraftsmithError(f"export: output folder {out} (--out or export.out) {where}; name a folder")


@dataclass(frozen=True)
class Target:
    """The target as an export names it. ``hub_id`` is what engines and the card get (None: unknown, and then
    nothing is named); a local folder's path is never kept."""

    hub_id: str | None
    license: str | None = None
    packaged: str | None = None  # the alias of a packaged (GGUF, de-quantised) target
    hint: str | None = None  # a local folder's config.json _name_or_path, when it looks like a hub id (log only)


def is_local_path(name) -> bool:
    """Whether ``name`` names a filesystem path rather than an alias or a hub id."""
    if not isinstance(name, str) or not name:
        return False
    if name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or name.count("/") > 1 or name in (".", ".."):
        return True
    return Path(name).expanduser().exists()


def _hub_id(name) -> str | None:
    if not isinstance(name, str) or is_local_path(name) or name.count("/") != 1:
        return None
    try:
        return hub_repo_id(name)
    except ValueError:
        return None


def _verifier(recipe, target: str, trained_by: Path | None = None) -> Target:
    """How the export names its target: a packaged alias by its hub model, a hub id as itself, a local folder by
    ``target.hub_id`` (the recipe's, else the one in the checkpoint's recipe.yaml) or not at all."""
    name = recipe.target.model if recipe is not None else target
    hub = recipe.target.hub_id if recipe is not None else _recipe_hub_id(trained_by)
    if name in ALIAS_HUB:
        alias_hub, lic = ALIAS_HUB[name]
        return Target(hub or alias_hub, lic, packaged=name)
    if is_local_path(name):
        folder = Path(name).expanduser()
        return Target(hub, _readme_license(folder), hint=None if hub else _name_or_path(folder))
    return Target(hub or _hub_id(name))


def _recipe_hub_id(path: Path | None) -> str | None:
    try:
        doc = yaml.safe_load(path.read_text()) if path is not None else None
    except (OSError, yaml.YAMLError):
        return None
    hub = doc.get("target", {}).get("hub_id") if isinstance(doc, dict) and isinstance(doc.get("target"), dict) else None
    try:
        return hub_repo_id(hub) if isinstance(hub, str) else None
    except ValueError:
        return None


def _front_matter(text: str) -> dict:
    if not text.startswith("---"):
        return {}
    try:
        doc = yaml.safe_load(text.split("---", 2)[1])
    except (IndexError, yaml.YAMLError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _readme_license(folder: Path) -> str | None:
    """The ``license:`` of a model folder's README.md front matter (hub model cards have one)."""
    try:
        lic = _front_matter((folder / "README.md").read_text())
    except OSError:
        return None
    lic = lic.get("license")
    return lic if isinstance(lic, str) and re.fullmatch(r"[\w.+-]+", lic) else None


def _name_or_path(folder: Path) -> str | None:
    try:
        return _hub_id(json.loads((folder / "config.json").read_text()).get("_name_or_path"))
    except (OSError, ValueError, AttributeError):
        return None


def _copy_recipe(src: Path, dst: Path, tgt: Target) -> None:
    """The recipe that trained the checkpoint, except that a local target.model becomes the hub id (or, when none
    is known, the folder's name): the path stays on this machine."""
    text = src.read_text()
    doc = _try_yaml(text)
    t = doc.get("target") if isinstance(doc, dict) else None
    if isinstance(t, dict) and is_local_path(t.get("model")):
        t["model"] = tgt.hub_id or Path(t["model"]).name
        note = "its hub id (target.hub_id)" if tgt.hub_id else "the folder's name"
        text = f"# target.model was a local folder, named here by {note}\n" + yaml.safe_dump(doc, sort_keys=False)
    dst.write_text(text)


def _try_yaml(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None


def _tokens(config: dict) -> int:
    """Draft tokens per step as the export's speculators config proposes them (3 where it has none)."""
    try:
        return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        return 3


def _copy_tokenizer(target: str, folder: Path, required: bool) -> None:
    """The drafter shares its target's tokenizer by construction: copy its files when the target resolves."""
    try:
        src = resolve_model_path(target)
    except DraftsmithError as e:
        if required:
            raise DraftsmithError(f"export: cannot copy the tokenizer of target {target!r}: {e}") from None
        log.warning("export: no tokenizer files copied (%s)", e)
        return
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)


def model_card(info: dict, fmt: str, report: dict | None, target: Target | None = None, tokens: int = 3) -> str:
    """README.md for the hub: what it is, the target it was trained for, how to serve it, the measured eval. Its
    front matter names the target by hub id only (``target``; default: from ``info["target"]``)."""
    kind = info.get("kind", "?")
    tgt = target or _verifier(None, info.get("target") or "")
    meta = {"base_model": tgt.hub_id, "license": tgt.license}
    meta = {k: v for k, v in meta.items() if v}
    meta["library_name"] = "transformers" if sf.export_entry(info, fmt).get("plain_lm") else "draftsmith"
    meta["tags"] = ["speculative-decoding", "draftsmith", kind.replace("_", "-")]
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False, default_flow_style=None).strip(),
        "---",
        "",
        f"# {kind} drafter for " + (f"`{tgt.hub_id}`" if tgt.hub_id else "a local target model"),
        "",
        f"Trained with [draftsmith](https://pypi.org/project/draftsmith/) (recipe `{info.get('recipe', '?')}`, "
        f"step {info.get('step', '?')}). Exported as `{fmt}`.",
        "",
    ]
    if tgt.packaged:
        lines += [
            f"The target during training was draftsmith's packaged `{tgt.packaged}`: the Q4_1 GGUF of "
            f"`{tgt.hub_id}` de-quantised to float32. Engines serve the hub model, whose outputs can differ "
            "slightly from the quantised copy's, so its acceptance may differ a little from draftsmith's.",
            "",
        ]
    elif tgt.hub_id is None:
        lines += [
            "The target was a local model folder with no hub id, so this folder's config names no target "
            "(null). Replace `TARGET` below with the target's hub id or its folder on the serving machine. "
            "To record a hub id, set `target.hub_id=org/name` in the recipe and export again.",
            "",
        ]
    lines += ["## Use", "", sf.usage(fmt, info, tgt.hub_id, tokens), ""]
    if report:
        sp = report.get("speedup", {})
        pr = report.get("prompts", {})
        lines += [
            "## Measured by draftsmith's eval",
            "",
            "| prompts | strategy | τ | acceptance | speedup vs own AR | vs HF generate | lossless | device |",
            "|---|---|---|---|---|---|---|---|",
            f"| {pr.get('source', '?')} × {pr.get('n', '?')} | {_strategy(report.get('strategy'))} "
            f"| {report.get('tau', float('nan')):.2f} | {report.get('acceptance_rate', float('nan')):.2f} "
            f"| {_x(sp.get('vs_ar'))} | {_x(sp.get('vs_ar_hf'))} | {report.get('lossless_match', '?')} "
            f"| {report.get('device', '?')}, {report.get('dtype', '?')} |",
            "",
            f"Temperature {report.get('temperature')}, {report.get('max_new_tokens')} new tokens per prompt.",
            "",
        ]
    else:
        lines += [
            "No eval report was found next to the checkpoint: run `draftsmith eval` before exporting to get "
            "the τ / speedup table here.",
            "",
        ]
    return "\n".join(lines)


def _strategy(s) -> str:
    if not isinstance(s, dict):
        return str(s)
    return " ".join(f"{k}={v}" for k, v in s.items())


def _x(v) -> str:
    return f"{v:.2f}×" if isinstance(v, (int, float)) else "–"


def push_to_hub(folder: Path, repo: str, dry_run: bool = False, private: bool = False) -> list[tuple[str, int]]:
    """Upload an exported folder to the hub repo ``repo``; returns the (file, bytes) list. ``dry_run`` only lists.
    The token comes from HF_TOKEN (or huggingface_hub's own login) and is never printed or written. Refused, dry
    run included, when ``repo`` is no repo id or a file would carry a local path where the target is named."""
    check_repo_id(repo, "push to hub")
    files = sorted((str(p.relative_to(folder)), p.stat().st_size) for p in Path(folder).rglob("*") if p.is_file())
    local = _local_paths(Path(folder))
    if local:
        raise DraftsmithError(
            f"push to hub {repo!r}: {local[0]} is a local path, which would be published and names nothing "
            f"elsewhere; set target.hub_id=org/name (or clear the field) and export again"
        )
    if dry_run:
        return files
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise DraftsmithError("push to hub: HF_HUB_OFFLINE=1 is set; unset it (or use --dry-run to list the files)")
    from huggingface_hub import HfApi

    api = HfApi(token=os.environ.get("HF_TOKEN") or None)
    try:
        api.create_repo(repo, exist_ok=True, private=private)
        api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="draftsmith export")
    except Exception as e:  # auth, network, permissions: one line, never the token
        msg = redact(str(e)).splitlines() or [""]  # masked whole, then cut: a cut never splits a token
        raise DraftsmithError(f"push to hub {repo!r} failed: {type(e).__name__}: {msg[0][:200]}") from None
    return files


def check_repo_id(repo: str, what: str) -> str:
    """``repo`` if it is a hub repo id, else a one-line DraftsmithError (checked before anything is written)."""
    try:
        return hub_repo_id(repo)
    except ValueError as e:
        raise DraftsmithError(f"{what}: {e}") from None


def _local_paths(folder: Path) -> list[str]:
    """Where the files of an export name the target by a local path: ``file: key = value`` for each."""

    def read(name, parse):
        try:
            return parse((folder / name).read_text())
        except (OSError, ValueError, yaml.YAMLError):
            return None

    def get(doc, *keys):
        for k in keys:
            doc = doc.get(k) if isinstance(doc, dict) else None
        return doc

    conf, meta = read("config.json", json.loads), read("drafter.json", json.loads)
    card, recipe = read("README.md", _front_matter), read("recipe.yaml", yaml.safe_load)
    fields = [
        (
            "config.json",
            "speculators_config.verifier.name_or_path",
            get(conf, "speculators_config", "verifier", "name_or_path"),
        ),
        ("config.json", "draftsmith_verifier", get(conf, "draftsmith_verifier")),
        ("config.json", "base_model_name_or_path", get(conf, "base_model_name_or_path")),
        ("config.json", "draftsmith.target", get(conf, "draftsmith", "target")),
        ("drafter.json", "target", get(meta, "target")),
        ("README.md", "base_model", get(card, "base_model")),
        ("recipe.yaml", "target.model", get(recipe, "target", "model")),
    ]
    return [f"{f}: {k} = {v!r}" for f, k, v in fields if is_local_path(v)]


def load_export(folder: Path, target=None, dtype=None, device="cpu"):
    """An exported folder (any format) back into draftsmith's decoder: (drafter, info). A vllm / sglang EAGLE-3
    export written without its embeddings takes them from ``target``."""
    return sf.load_export(Path(folder), target, dtype, device)


def run_export_stage(recipe) -> list[Path]:
    """The recipe's ``export:`` section: every listed format, then the optional hub push of the first."""
    ec, ckpt = recipe.export, checkpoint_of(recipe)
    if ec.push_to_hub:  # the recipe loader checked it too; nothing is written before this
        check_repo_id(ec.push_to_hub, "export.push_to_hub")
    base = Path(ec.out) if ec.out else recipe.run_dir / "export"
    outs = [export(ckpt, fmt, base / fmt, recipe, ec.include_embeddings) for fmt in ec.formats]
    for out in outs:
        log.info("export: %s", out)
    if ec.push_to_hub:
        files = push_to_hub(outs[0], ec.push_to_hub, dry_run=ec.dry_run)
        log.info(
            "export: %s %d files (%d bytes) to %s",
            "would push" if ec.dry_run else "pushed",
            len(files),
            sum(n for _, n in files),
            ec.push_to_hub,
        )
    return outs
