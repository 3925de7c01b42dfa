"""Sampled trees under each verify rule: the point-mass walk over top-k children against recursive rejection and
SpecTr's k-sequential rule over sampled children, on the same trained drafter, tree, prompts and temperature.

    python benchmarks/tree_sampling.py                        # the drafter_compare runs of EAGLE-3 and Hydra++
    python benchmarks/tree_sampling.py --runs runs/compare/eagle3 --temperatures 1.0 --prompts 40

Each (run, temperature, rule) is one ``draftsmith eval`` of the run's recipe and final checkpoint on MT-bench at that
temperature: τ, speed against the target's own sampled decoding measured in the same process, and the rule's τ
and speed as a multiple of point_mass's at the same temperature. A run trained by benchmarks/drafter_compare.py
(its recipe.yaml and checkpoints/final) is what it reads; each eval's report is kept under
``<run>/sampling/<shape>-T<temperature>-<rule>``. Compare speeds only within one run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

RULES = ("point_mass", "recursive", "spectr")
SHAPES = {  # run name -> the tree it is decoded with
    "eagle3": ["eval.strategy=dynamic_tree", "eval.tree.top_k=3", "eval.tree.depth=3", "eval.tree.total_tokens=6"],
    "hydra++": ["eval.strategy=tree", "eval.tree.choices=[[0],[1],[0,0],[0,1],[1,0]]"],
}
DEFAULT_SHAPE = SHAPES["hydra++"]


def evaluate(run: Path, temperature: float, rule: str, prompts: int, new: int) -> dict:
    shape = SHAPES.get(run.name, DEFAULT_SHAPE)
    dest = run / "sampling" / f"{shape[0].split('=')[1]}-T{temperature}-{rule}"
    report = dest / "report.json"
    if not report.exists():
        args = [str(run / "recipe.yaml"), f"out_dir={run}", f"eval.prompts.n={prompts}", f"eval.max_new_tokens={new}"]
        args += [f"eval.temperature={temperature}", f"eval.tree.sampling={rule}", *shape, "-q"]
        subprocess.run([sys.executable, "-m", "draftsmith", "eval", *args], check=True)
        shutil.copytree(run / "eval", dest, dirs_exist_ok=True)
    return json.loads(report.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="*", default=["runs/compare/eagle3", "runs/compare/hydra++"], help="trained runs")
    ap.add_argument("--temperatures", nargs="*", type=float, default=[0.6, 1.0], help="sampling temperatures")
    ap.add_argument("--rules", nargs="*", default=list(RULES), choices=RULES, help="tree verify rules")
    ap.add_argument("--prompts", type=int, default=24, help="MT-bench prompts per eval")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer")
    a = ap.parse_args()
    print(f"{'run':<10} {'T':>4} {'rule':<11} {'tau':>6} {'speed':>6} {'tau/pm':>7} {'speed/pm':>8}")
    for run in map(Path, a.runs):
        if not (run / "checkpoints" / "final").exists():
            raise SystemExit(f"{run}: no checkpoints/final (train it with benchmarks/drafter_compare.py first)")
        for t in a.temperatures:
            base = None
            for rule in a.rules:
                r = evaluate(run, t, rule, a.prompts, a.max_new_tokens)
                tau, speed = r["tau"], r["speedup"]["vs_ar"]
                base = base or (tau, speed)
                print(f"{run.name:<10} {t:>4} {rule:<11} {tau:>6.3f} {speed:>6.2f} {tau / base[0]:>7.3f} "
                      f"{speed / base[1]:>8.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
