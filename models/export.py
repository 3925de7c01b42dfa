"""Export a trained drafter. For now: HF-hub layout for standalone draft LMs (a plain LlamaForCausalLM folder
that `transformers`, vLLM's draft-model path and `huggingface-cli upload` all take as is).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.models.hf import config_to_hf, own_to_hf_key, resolve_model_path
from draftsmith.models.registry import load_drafter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def export_hf(recipe) -> Path:
    ckpt = Path(recipe.eval.checkpoint) if recipe.eval.checkpoint else recipe.run_dir / "checkpoints" / "final"
    model, info = load_drafter(ckpt)
    if info["kind"] != "draft_lm":
        raise DraftsmithError(f"export: drafter kind {info['kind']!r} has no HF-hub export yet")
    out = recipe.run_dir / "export" / "hf"
    tmp = out.with_name("hf.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sd = {own_to_hf_key(k): v.contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = config_to_hf(model.cfg)
    cfg.update(torch_dtype="float32", draftsmith={k: v for k, v in info.items() if k != "config"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    src = resolve_model_path(recipe.target.model, recipe.target.revision)
    for name in TOKENIZER_FILES:  # the drafter shares the target's tokenizer by construction
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
