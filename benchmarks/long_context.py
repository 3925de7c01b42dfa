"""A sliding-window EAGLE-3 against the full-attention one on long contexts: the same records, steps and weights
budget, then τ and speed per context length.

    python benchmarks/long_context.py                       # train both arms, eval at 1k / 2k / 4k / 8k tokens
    python benchmarks/long_context.py --window 256 --lengths 1024 4096 --n 2
    python benchmarks/long_context.py --table-only          # print the table from existing runs

Records: the quickstart's data section (SmolLM2-135M-Instruct answering ShareGPT prompts: records of at most
384 tokens), generated once under runs/long_context/gen (or copied from runs/compare/gen when
benchmarks/drafter_compare.py made them). Both arms take eagle3-smollm2's drafter section and learning rate with
ttt_steps 3; the window arm adds drafter.sliding_window. Each is then evaluated with eval.long_context: prompts of
each length built from ShareGPT conversations, a chain of 3 at T = 0, own plain decoding timed in the same
process. The lengths stop below SmolLM2's 8,192 positions (the prompt, the answer and a draft must fit).
Compare speeds only within one run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path("runs/long_context")
LENGTHS = [1024, 2048, 4096, 8000]


def arm_recipe(arm: str, steps: int, window: int) -> Path:
    """runs/long_context/<arm>/recipe-arm.yaml: the quickstart's data, EAGLE-3 (windowed or not), one train setup."""
    from draftsmith.recipes.loader import find_recipe

    folder = find_recipe("quickstart").parent
    base = yaml.safe_load((folder / "quickstart.yaml").read_text())
    src = yaml.safe_load((folder / "eagle3-smollm2.yaml").read_text())
    base["name"] = f"long-context-{arm}"
    base["drafter"] = {**src["drafter"], "ttt_steps": 3, **({"sliding_window": window} if arm == "window" else {})}
    base["train"].update({"steps": steps, "lr": src["train"]["lr"], "micro_batch_size": 4, "packing": False})
    base["export"] = {"enabled": False}
    base["eval"]["baseline_hf"] = False
    out = ROOT / arm
    out.mkdir(parents=True, exist_ok=True)
    path = out / "recipe-arm.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def run(*args: str) -> None:
    print("+ draftsmith", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "draftsmith", *args], check=True)


def records() -> Path:
    data = ROOT / "gen" / "data"
    shared = Path("runs/compare/gen/data")
    if not (data / "manifest.json").is_file():
        if (shared / "manifest.json").is_file():
            shutil.copytree(shared, data)
        else:
            run("generate", "quickstart", f"out_dir={ROOT / 'gen'}", "-q")
    return data


def train_and_eval(arm: str, a) -> None:
    recipe, out = arm_recipe(arm, a.steps, a.window), ROOT / arm
    common = [f"out_dir={out}", "eval.prompts.n=4", f"eval.max_new_tokens={a.max_new_tokens}", "-q"]
    if not (out / "data").exists():
        shutil.copytree(records(), out / "data")
    if not (out / "checkpoints" / "final" / "drafter.json").is_file():
        run("train", str(recipe), *common)
    if not (out / "eval" / "report.json").is_file() or "long_context" not in _report(out):
        lc = [f"eval.long_context.lengths={json.dumps(a.lengths)}", f"eval.long_context.n={a.n}"]
        run("eval", str(recipe), *common, "eval.strategy=chain", "eval.draft_len=3", *lc)


def _report(out: Path) -> dict:
    return json.loads((out / "eval" / "report.json").read_text())


def table() -> str:
    arms = [arm for arm in ("full", "window") if (ROOT / arm / "eval" / "report.json").is_file()]
    if len(arms) < 2:
        return "both arms need an eval report first"
    reports = {arm: _report(ROOT / arm) for arm in arms}
    w = json.loads((ROOT / "window" / "checkpoints" / "final" / "drafter.json").read_text())["config"]["sliding_window"]
    lines = [
        f"| context tokens | full attention: τ, × own AR | window {w}: τ, × own AR | τ window / full | lossless |",
        "|---|---|---|---|---|",
    ]
    cells = [f"{r['tau']:.3f}, {r['speedup']['vs_ar']:.2f}×" for r in reports.values()]
    ratio = reports["window"]["tau"] / reports["full"]["tau"]
    lines.append(f"| MT-bench, 4 prompts | {cells[0]} | {cells[1]} | {ratio:.3f} | — |")
    full, win = reports["full"]["long_context"], reports["window"]["long_context"]
    for length in full:
        f, g = full[length], win.get(length)
        if g is None:
            continue
        lossless = ", ".join(f"{round(r['lossless_match'] * r['prompts'])}/{r['prompts']}" for r in (f, g))
        lines.append(
            f"| {f['prompt_tokens']:.0f} | {f['tau']:.3f}, {f['speedup_vs_ar']:.2f}× | "
            f"{g['tau']:.3f}, {g['speedup_vs_ar']:.2f}× | {g['tau'] / f['tau']:.3f} | {lossless} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="train steps of both arms (micro-batch 4)")
    ap.add_argument("--window", type=int, default=128, help="the window arm's drafter.sliding_window")
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="prompt lengths in tokens")
    ap.add_argument("--n", type=int, default=3, help="prompts per length")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--table-only", action="store_true", help="print the table from existing runs, run nothing")
    a = ap.parse_args()
    if not a.table_only:
        for arm in ("full", "window"):
            train_and_eval(arm, a)
    print(table())


if __name__ == "__main__":
    main()
