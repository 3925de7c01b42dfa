"""The FastDraft pipeline and a loss table on the real SmolLM2-135M-Instruct target, CPU, offline.

1. `draftsmith run fastdraft-pretrain`: CE pretraining of a 2-layer draft on ShareGPT chat text (target never run).
2. `draftsmith generate fastdraft-finetune`: the target answers ShareGPT prompts (tokens + top-32 log-probs).
3. For each loss: the same stage-1 drafter fine-tuned on the same records with the same step budget, then
   evaluated in the bundled decoder (chain, gamma = eval.draft_len, T = 0, MT-bench). Optionally an on-policy
   round (DistillSpec): the FKL drafter writes a fraction of the responses, the target scores them, train again.
Prints a markdown table of tau, acceptance and speedup vs the own AR decoder; every run stays under runs/kd/.

Usage: python benchmarks/experiments/kd_losses.py [--losses ce fkl tvdpp] [--steps 400] [--on-policy 0.5] [--eval-n 16]
       [--init runs/fdkd-fkl-L8/checkpoints/final --root runs/kd-L8]
       [--data runs/fd-big/data --set train.precision=bf16 train.warmup_steps=40]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path


def sh(*args: str) -> float:
    t = time.perf_counter()
    print("$ draftsmith " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "draftsmith", *args], check=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--losses",
        nargs="*",
        default=["ce", "fkl", "tvdpp"],
        help="train.loss.kind values to compare; none (with --on-policy) = only the on-policy row, "
        "from the FKL run already in --root",
    )
    ap.add_argument("--steps", type=int, default=400, help="fine-tuning steps per loss (same budget for all)")
    ap.add_argument(
        "--on-policy",
        type=float,
        default=0.0,
        help="> 0: after the FKL run, regenerate with this fraction written by the FKL drafter and "
        "train FKL again from stage 1 on that data (DistillSpec); 0 = skip",
    )
    ap.add_argument("--eval-n", type=int, default=16, help="MT-bench prompts in each eval")
    ap.add_argument("--root", default="runs/kd", help="where the per-loss runs go")
    ap.add_argument("--skip-pretrain", action="store_true", help="reuse runs/fastdraft-pretrain as it is")
    ap.add_argument("--pretrain-steps", type=int, help="override fastdraft-pretrain's train.steps")
    ap.add_argument(
        "--init",
        help="stage-1 checkpoint to fine-tune instead of runs/fastdraft-pretrain's (e.g. a "
        "deeper draft from benchmarks/experiments/fixed_data_kd.py); implies "
        "--skip-pretrain",
    )
    ap.add_argument(
        "--data",
        help="target-written records to fine-tune on instead of generating "
        "runs/fastdraft-finetune (e.g. a larger set grown with data.prompts.n)",
    )
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="recipe overrides added to every train and eval (e.g. train.precision=bf16)",
    )
    a = ap.parse_args()
    if a.data and not (Path(a.data) / "manifest.json").exists():
        ap.error(f"--data {a.data}: no manifest.json there (a finished `draftsmith generate` data folder)")
    root = Path(a.root)
    times = {}
    if not (a.skip_pretrain or a.init):
        steps = [f"train.steps={a.pretrain_steps}"] if a.pretrain_steps else []
        times["pretrain"] = sh("run", "fastdraft-pretrain", *steps, "-q")
    if a.losses and not a.data:  # the shared target-written records (the on-policy row writes its own)
        times["generate"] = sh("generate", "fastdraft-finetune", "-q")
    data = Path(a.data or "runs/fastdraft-finetune/data")
    rows = []
    runs = [(kind, kind, data, []) for kind in a.losses]
    if a.on_policy > 0:
        fkl_ckpt = root / "fkl" / "checkpoints" / "final"
        runs.append(
            (
                "fkl+on-policy",
                "fkl",
                None,
                [f"data.on_policy.fraction={a.on_policy}", f"data.on_policy.checkpoint={fkl_ckpt}"],
            )
        )
    for label, kind, src, extra in runs:
        out = root / label.replace("+", "-")
        if src is not None and not (out / "data").exists():
            shutil.copytree(src, out / "data")
        common = [f"out_dir={out}", *extra, *([f"drafter.init_from={a.init}"] if a.init else []), *a.set]
        if src is None:
            times[f"generate {label}"] = sh("generate", "fastdraft-finetune", *common, "-q")
        times[f"train {label}"] = sh(
            "train", "fastdraft-finetune", *common, f"train.loss.kind={kind}", f"train.steps={a.steps}", "-q"
        )
        times[f"eval {label}"] = sh("eval", "fastdraft-finetune", *common, f"eval.prompts.n={a.eval_n}", "-q")
        r = json.loads((out / "eval" / "report.json").read_text())
        rows.append((label, r["tau"], r["acceptance_rate"], r["speedup"].get("vs_ar"), r["lossless_match"]))
    print("\n| loss | tau | acceptance | speedup vs own AR | lossless |\n|---|---|---|---|---|")
    for label, tau, acc, sp, ll in rows:
        print(f"| {label} | {tau:.2f} | {acc:.3f} | {sp:.2f}x | {ll:.2f} |")
    print("\n" + "\n".join(f"{k}: {v / 60:.1f} min" for k, v in times.items()))


if __name__ == "__main__":
    main()
