"""Per-drafter-kind table: τ, acceptance, speedup vs AR and efficiency of every drafter kind trained on the same
records.

Each kind trains with its shipped recipe (`recipes/<kind>-smollm2.yaml` for every kind in KINDS; equal data: the
fastdraft-finetune records, equal steps) and is evaluated with `draftsmith eval` in several decoding settings;
this script runs what is missing and prints one markdown table from the eval reports.

    python benchmarks/kind_table.py                 # train + eval what is missing, then print the table
    python benchmarks/kind_table.py --table-only    # print the table from existing reports

Eval settings (names used as folder names under runs/table/): chain-t0 (chain, greedy), dyn-t0 (EAGLE-2 dynamic
tree, greedy), tree-t0 (static tree, greedy; for heads the 10 best nodes by measured head accuracy), chain-t1
(chain, temperature 1).

Reading the output: one row per (kind, setting) with a report. Speedups are the eval's own: the target's AR
decoding and the speculative decoder measured side by side in the same process; efficiency = speedup / τ;
lossless = share of prompts whose greedy output equals AR's (n/a when sampling). The machine column is the one
the eval report names, with the share of its CPU that other processes took while it timed: compare speedups only
between rows measured on the same machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

KINDS = ["eagle3", "eagle1", "hydra", "medusa", "medusa2", "mlp-speculator"]
SETTINGS = {
    "chain-t0": ["eval.strategy=chain"],
    "dyn-t0": ["eval.strategy=dynamic_tree"],
    "tree-t0": ["eval.strategy=tree"],
    "chain-t1": ["eval.strategy=chain", "eval.temperature=1.0"],
}
PLAN = [
    ("eagle3", "chain-t0"),
    ("eagle3", "dyn-t0"),
    ("eagle1", "chain-t0"),
    ("hydra", "chain-t0"),
    ("medusa", "chain-t0"),
    ("eagle1", "dyn-t0"),
    ("eagle3", "chain-t1"),
    ("hydra", "tree-t0"),
    ("medusa", "tree-t0"),
    ("eagle1", "chain-t1"),
    ("hydra", "chain-t1"),
    ("medusa", "chain-t1"),
    ("mlp-speculator", "chain-t0"),
    ("medusa2", "chain-t0"),
]
RUNS, TABLE = Path("runs"), Path("runs/table")
TREE_NODES = 10  # static trees for heads: eval/tree.py choices_from_run over the logged per-head rank accuracies
LABEL = {
    "eagle3": "EAGLE-3",
    "eagle1": "EAGLE-1",
    "hydra": "Hydra++",
    "medusa": "Medusa-1",
    "medusa2": "Medusa-2 (LoRA r=8)",
    "mlp-speculator": "MLP speculator",
}


def _draftsmith(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "draftsmith", *args], check=True)


def ensure(kind: str, setting: str) -> None:
    run, ckpt = RUNS / f"{kind}-smollm2", RUNS / f"{kind}-smollm2" / "checkpoints" / "final"
    if not ckpt.is_dir():
        if not (run / "data").is_dir():  # equal data for every kind: the FastDraft stage-2 records
            shutil.copytree(RUNS / "fastdraft-finetune" / "data", run / "data")
        _draftsmith("train", f"{kind}-smollm2")
    out = TABLE / f"{kind}-{setting}"
    extra = []
    if setting == "tree-t0" and kind in ("medusa", "hydra"):  # the best 10-node tree from the run's head accuracies
        from draftsmith.eval.tree import choices_from_run

        extra = [f"eval.tree.choices={json.dumps(choices_from_run(run, TREE_NODES))}"]
    if not (out / "eval" / "report.json").is_file():
        _draftsmith("eval", f"{kind}-smollm2", f"eval.checkpoint={ckpt}", f"out_dir={out}", *SETTINGS[setting], *extra)


def table() -> str:
    rows = [
        "| kind | setting | tau | acceptance | speedup vs AR | efficiency | lossless | train steps | machine |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, setting in PLAN:
        f = TABLE / f"{kind}-{setting}" / "eval" / "report.json"
        if not f.is_file():
            continue
        r = json.loads(f.read_text())
        s = r["strategy"]
        how = s["kind"] + (
            f" γ={s['draft_len']}"
            if "draft_len" in s
            else f" top-k {s['top_k']} depth {s['depth']} {s['total_tokens']} nodes"
            if "top_k" in s
            else f" {s['nodes']} nodes"
        )
        lossless = "n/a (T>0)" if r["lossless_match"] is None else f"{r['lossless_match']:.2f}"
        other = (r.get("machine") or {}).get("other_cpu_share")
        machine = r.get("device", "?") + ("" if other is None else f", others {other:.0%} of the CPUs")
        rows.append(
            f"| {LABEL[kind]} | {how}, T={r['temperature']:g} | {r['tau']:.2f} | {r['acceptance_rate']:.3f} | "
            f"{r['speedup']['vs_ar']:.2f}x | {r['efficiency']:.2f} | {lossless} | "
            f"{r['drafter']['step']} | {machine} |"
        )
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table-only", action="store_true", help="print the table from existing reports only")
    args = p.parse_args()
    if not args.table_only:
        for kind, setting in PLAN:
            ensure(kind, setting)
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
