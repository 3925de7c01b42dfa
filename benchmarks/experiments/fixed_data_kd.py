"""Fixed-data KD for FastDraft's stage 1 (DistillSpec's "fixed dataset" setting) vs plain CE, on SmolLM2.

FastDraft's stage 1 pretrains the draft with CE on raw chat text. The target can instead *score* that same text
(teacher-forced, no generation: ~300 response tokens/s on a 2-core CPU, against ~64/s to write answers) and the
draft can be distilled on the target's top-k distribution. This script runs both arms side by side:

1. `draftsmith generate fastdraft-pretrain data.signals.topk=K`: ShareGPT replies kept as they are, scored by the
   target (its top-K log-probs at every reply token).
2. For each stage-1 loss (default ce, fkl): the same 2-layer draft (same init, same records, same steps).
3. Each stage-1 draft is fine-tuned with the same loss on the same target-written records (fastdraft-finetune),
   same steps: an all-CE pipeline against an all-KD one.
4. Every draft is evaluated in the bundled decoder (chain, gamma = 5, MT-bench) at each --temperatures, before and
   after stage 2.

Prints a markdown table of tau, per-position acceptance and speedup vs the own AR decoder; runs stay under --root.
--train-args changes the draft for every arm alike, e.g. a 16-layer draft from the target's first and last 8 layers:
  --train-args drafter.n_layers=16 "drafter.init_layers=[0,1,2,3,4,5,6,7,22,23,24,25,26,27,28,29]" train.lr=3e-4
               train.precision=bf16

Usage: python benchmarks/experiments/fixed_data_kd.py [--prompts 1500] [--topk 32] [--losses ce fkl] [--steps 300]
                                                      [--finetune-steps 250] [--eval-n 16] [--temperatures 0 1]
                                                      [--train-args KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path


def sh(*args: str) -> None:
    """Run ``draftsmith ARGS`` in a child process (echoed first); stop on failure."""
    print("$ draftsmith " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "draftsmith", *args], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=1500, help="ShareGPT conversations the target scores")
    ap.add_argument("--topk", type=int, default=32, help="top-k log-probs the target stores per reply token")
    ap.add_argument("--losses", nargs="+", default=["ce", "fkl"], help="stage-1 train.loss.kind values to compare")
    ap.add_argument("--steps", type=int, default=300, help="stage-1 steps per loss (same budget for all)")
    ap.add_argument("--finetune-steps", type=int, default=250, help="stage-2 steps (0 = stage 1 only)")
    ap.add_argument("--eval-n", type=int, default=16, help="MT-bench prompts in each eval")
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0], help="eval.temperature values")
    ap.add_argument("--train-args", nargs="*", default=[], help="recipe overrides for every arm's training")
    ap.add_argument("--root", default="runs/fdkd", help="where the runs go")
    a = ap.parse_args()
    root = Path(a.root)
    scored = root / "score"
    if not (scored / "data" / "manifest.json").exists():
        sh(
            "generate",
            "fastdraft-pretrain",
            f"data.prompts.n={a.prompts}",
            f"data.signals.topk={a.topk}",
            f"out_dir={scored}",
            "-q",
        )
    if a.finetune_steps:
        sh("generate", "fastdraft-finetune", "-q")  # resumes: a no-op when the records are complete
    rows = []
    for loss in a.losses:
        s1 = root / loss
        if not (s1 / "data").exists():
            shutil.copytree(scored / "data", s1 / "data")
        sh(
            "train",
            "fastdraft-pretrain",
            f"out_dir={s1}",
            f"train.loss.kind={loss}",
            f"train.steps={a.steps}",
            *a.train_args,
            "-q",
        )
        runs = [(f"{loss} (stage 1)", s1, [f"eval.checkpoint={s1 / 'checkpoints' / 'final'}"])]
        if a.finetune_steps:
            s2 = root / f"{loss}-ft"
            if not (s2 / "data").exists():
                shutil.copytree(Path("runs/fastdraft-finetune/data"), s2 / "data")
            sh(
                "train",
                "fastdraft-finetune",
                f"out_dir={s2}",
                f"drafter.init_from={s1 / 'checkpoints' / 'final'}",
                f"train.loss.kind={loss}",
                f"train.steps={a.finetune_steps}",
                *a.train_args,
                "-q",
            )
            runs.append((f"{loss}, then {loss} fine-tune", s2, []))
        for label, out, extra in runs:
            for temp in a.temperatures:
                sh(
                    "eval",
                    "fastdraft-finetune",
                    f"out_dir={out}",
                    f"eval.prompts.n={a.eval_n}",
                    f"eval.temperature={temp}",
                    *extra,
                    "-q",
                )
                ev = out / f"eval-t{temp:g}"  # eval writes <run>/eval: keep one copy per temperature
                shutil.rmtree(ev, ignore_errors=True)
                shutil.copytree(out / "eval", ev)
                r = json.loads((ev / "report.json").read_text())
                rows.append(
                    (
                        label,
                        temp,
                        r["tau"],
                        r["per_position_acceptance"],
                        r["speedup"].get("vs_ar"),
                        r["lossless_match"],
                    )
                )
    print(
        "\n| stage-1 loss | T | tau | per-position acceptance | speedup vs own AR | lossless |\n"
        "|---|---|---|---|---|---|"
    )
    for label, temp, tau, pos, sp, ll in rows:
        ll = "-" if ll is None else f"{ll:.2f}"  # sampled runs have no greedy reference to match
        print(f"| {label} | {temp:g} | {tau:.2f} | {' '.join(f'{p:.2f}' for p in pos)} | {sp:.2f}x | {ll} |")


if __name__ == "__main__":
    main()
