"""Export a trained drafter for hubs and serving engines: ``draftsmith export RECIPE|CHECKPOINT --format F``, or a
recipe's ``export:`` section at the end of ``draftsmith run``.

Formats (their tensor-name contracts live in draftsmith/export/formats.py):
- ``hf``: a self-contained folder (config.json, model.safetensors, tokenizer files, the resolved recipe,
  drafter.json and a model card with the eval table). A draft LM is a plain ``LlamaForCausalLM`` (transformers,
  vLLM's and SGLang's draft-model paths); other kinds keep draftsmith's tensor names.
- ``vllm``: the speculators format vLLM detects (EAGLE-3 and draft LMs).
- ``sglang``: the EAGLE-3 layout SGLang loads (fc, midlayer, norm, lm_head, d2t, t2d).
- ``medusa``: the Medusa heads layout TensorRT-LLM and TGI read.
- ``mlp-speculator``: IBM's MLP speculator layout (vLLM, TGI).
EAGLE-1 goes to ``vllm`` / ``sglang`` in the layout those engines' EAGLE loaders read.

Every folder is written under ``<out>.tmp`` and renamed into place, so a killed export never leaves a complete-
looking folder; each also carries ``drafter.json`` so ``load_export`` reads it back into draftsmith's decoder
(round trip: same greedy output and τ, tested). Hub pushes read the token from the environment and never print it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.export import formats as sf
from draftsmith.models.loading import ALIASES, resolve_model_path
from draftsmith.models.registry import DRAFTERS, load_drafter

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


def export(ckpt: Path, fmt: str, out: Path, recipe=None, include_embeddings: bool = False) -> Path:
    """Write checkpoint ``ckpt`` in format ``fmt`` to folder ``out`` (replaced atomically); returns ``out``."""
    if fmt not in FORMATS:
        raise DraftsmithError(f"export: unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    ckpt, out = Path(ckpt), Path(out)
    model, info = load_drafter(ckpt)
    if DRAFTERS[info["kind"]].interface is None:  # an acceptance head, the judge (load_drafter knows the kind)
        raise DraftsmithError(f"export: a {info['kind']} is not a drafter a serving engine runs; export its draft")
    if getattr(model, "target_adapter", None) is not None and fmt != "hf":
        raise DraftsmithError(
            f"export: {ckpt} is Medusa-2 (LoRA-adapted target); engines need the merged target "
            f"too: use --format hf, which keeps target_adapter.safetensors"
        )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    target = info.get("target", "")
    if fmt == "hf":
        tensors, config = sf.to_hf(model, info)
    else:
        verifier = _verifier(recipe, target)
        writer = {
            "vllm": sf.to_speculators,
            "sglang": sf.to_sglang_eagle3,
            "medusa": sf.to_medusa,
            "mlp-speculator": sf.to_mlp_speculator,
        }[fmt]
        if sf.usage_kind(info) == "eagle1" and fmt in ("vllm", "sglang"):  # the engines' EAGLE-1 layout
            writer = sf.to_eagle1(fmt)
        tensors, config = writer(model, info, verifier, include_embeddings)
    save_file(tensors, str(tmp / sf.weights_file(fmt)), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    meta, files = sf.side_outputs(model, info, fmt)
    (tmp / "drafter.json").write_text(json.dumps({**info, **meta, "export_format": fmt}, indent=2))
    for name, write in files.items():
        write(tmp / name)
    if (ckpt / sf.ADAPTER_FILE).is_file():
        shutil.copy2(ckpt / sf.ADAPTER_FILE, tmp / sf.ADAPTER_FILE)
    _copy_tokenizer(target, tmp, required=fmt == "hf" and info["kind"] == "draft_lm")
    run_dir = recipe.run_dir if recipe is not None else ckpt.parent.parent
    trained_by = next((p for p in (ckpt / "recipe.yaml", run_dir / "recipe.yaml") if p.is_file()), None)
    if trained_by is not None:  # the checkpoint's own copy first: the run folder's is the last command's
        shutil.copy2(trained_by, tmp / "recipe.yaml")
    report = run_dir / "eval" / "report.json"
    (tmp / "README.md").write_text(model_card(info, fmt, json.loads(report.read_text()) if report.is_file() else None))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _verifier(recipe, target: str) -> str:
    """The target as a serving engine should name it: the recipe's hub id or folder. A packaged alias (a GGUF
    de-quantised into the local cache) becomes that folder, the only name an engine can load."""
    name = recipe.target.model if recipe is not None else target
    if name in ALIASES:
        try:
            return str(resolve_model_path(name))
        except DraftsmithError:  # the alias's package is not installed here: keep the name, say so in the card
            log.warning("export: target alias %r does not resolve here; the verifier is named as is", name)
    return name


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


def model_card(info: dict, fmt: str, report: dict | None) -> str:
    """README.md for the hub: what it is, the target it was trained for, how to serve it, the measured eval."""
    kind, target = info.get("kind", "?"), info.get("target", "?")
    lines = [
        "---",
        f"base_model: {target}" if "/" in target else f"# target: {target}",
        "library_name: draftsmith",
        "tags: [speculative-decoding, draftsmith, " + kind.replace("_", "-") + "]",
        "---",
        "",
        f"# {kind} drafter for `{target}`",
        "",
        f"Trained with [draftsmith](https://pypi.org/project/draftsmith/) (recipe `{info.get('recipe', '?')}`, "
        f"step {info.get('step', '?')}). Exported as `{fmt}`.",
        "",
        "## Use",
        "",
        sf.usage(fmt, sf.usage_kind(info), target),
        "",
    ]
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
    The token comes from HF_TOKEN (or huggingface_hub's own login) and is never printed or written."""
    files = sorted((str(p.relative_to(folder)), p.stat().st_size) for p in Path(folder).rglob("*") if p.is_file())
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
        msg = re.sub(r"hf_[A-Za-z0-9]+", "hf_***", (str(e).splitlines() or [""])[0][:200])
        raise DraftsmithError(f"push to hub {repo!r} failed: {type(e).__name__}: {msg}") from None
    return files


def load_export(folder: Path, target=None, dtype=None, device="cpu"):
    """An exported folder (any format) back into draftsmith's decoder: (drafter, info). Formats that omit the
    embeddings (vllm / sglang EAGLE-3) take them from ``target``, as the engines do."""
    return sf.load_export(Path(folder), target, dtype, device)


def run_export_stage(recipe) -> list[Path]:
    """The recipe's ``export:`` section: every listed format, then the optional hub push of the first."""
    ec, ckpt = recipe.export, checkpoint_of(recipe)
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
