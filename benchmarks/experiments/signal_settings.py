"""Bytes per token and generation speed for each teacher-signal setting of the data stage, side by side in one
run on the same prompts (the full `draftsmith generate` stage: batching, capture, shard writing).

Prints one row per setting: response tokens/s, its ratio to the tokens-only run, and the stored bytes per token
(all tokens) and per response token, total and per signal group. Usage:
python benchmarks/experiments/signal_settings.py [--n 32] [--max-new 64] [--target smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from draftsmith.data.generate import generate
from draftsmith.models.loading import load_model, tokenizer_hash
from draftsmith.models.registry import build_drafter, save_drafter
from draftsmith.recipes.loader import load_recipe

SETTINGS = {
    "tokens only": ["data.signals.topk=0"],
    "top-32 fp16 (default)": [],
    "top-32 bf16": ["data.signals.topk_dtype=bfloat16"],
    "top-8 fp16": ["data.signals.topk=8"],
    "top-32 + last hidden bf16": ["data.signals.hidden_last=true"],
    "top-32 + EAGLE-3 layers bf16": ["data.signals.hidden_layers=eagle3"],
    "top-32 + EAGLE-3 layers fp8": ["data.signals.hidden_layers=eagle3", "data.signals.hidden_dtype=float8"],
    "top-32 + last + EAGLE-3 bf16": ["data.signals.hidden_last=true", "data.signals.hidden_layers=eagle3"],
    "top-32 + SpecDec++ labels": ["data.specdec_labels.checkpoint={drafter}"],
    "on-policy (lambda=1) + top-32": ["data.on_policy.checkpoint={drafter}"],
    "fixed data (ShareGPT replies) + top-32": ["data.responses=dataset"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=32, help="ShareGPT prompts (first turn, <= 256 prompt tokens)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--only", nargs="*", help="run only these settings (names as printed)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="draftsmith-bench-"))
    tgt = load_model(a.target)
    drafter = build_drafter("draft_lm", {"n_layers": 2, "init_layers": [0, tgt.model.cfg.n_layers - 1]}, tgt.model)
    ckpt = save_drafter(tmp / "drafter", drafter, "draft_lm", {"tokenizer_hash": tokenizer_hash(tgt.tokenizer)})
    base = [
        f"target.model={a.target}",
        "data.prompts.source=sharegpt",
        f"data.prompts.n={a.n}",
        "data.prompts.max_turns=1",
        "data.max_prompt_tokens=256",
        f"data.max_new_tokens={a.max_new}",
        "data.batch_size=16",
        f"data.shard_size={a.n}",
    ]
    print(f"target {a.target}, {a.n} ShareGPT prompts, <= {a.max_new} new tokens, threads {torch.get_num_threads()}")
    print(
        "| setting | sequences | response tokens | time s | resp tok/s | x tokens-only | B/token | B/resp token "
        "| per signal (B/token) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    ref = None
    for name, overrides in SETTINGS.items():
        if a.only and name not in a.only:
            continue
        out = tmp / name.replace(" ", "_").replace("/", "")
        ov = [o.format(drafter=ckpt) for o in overrides]
        recipe = load_recipe("quickstart", [*base, *ov, f"out_dir={out}"])
        t0 = time.perf_counter()
        generate(recipe)
        dt = time.perf_counter() - t0
        m = json.loads((out / "data" / "manifest.json").read_text())
        rate = m["n_loss_tokens"] / dt
        ref = ref or rate
        bpt = m["bytes_per_token"]
        groups = ", ".join(f"{g} {v}" for g, v in bpt["per_token"].items())
        print(
            f"| {name} | {m['n_sequences']} | {m['n_loss_tokens']} | {dt:.1f} | {rate:.0f} | {rate / ref:.2f} | "
            f"{bpt['file_per_token']} | {bpt['file_per_loss_token']} | {groups} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
