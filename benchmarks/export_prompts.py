"""Write prompts from a packaged source to a JSONL file (``{"messages": [...]}`` per line), the same prompts a
recipe with those settings would use, for machines without the dataset packages (a GPU machine running
``benchmarks/gpu_run.sh eagle3``: pass the file with ``data.prompts.source=file data.prompts.path=...
data.prompts.shuffle=false``). A helper of gpu_run.sh, not a benchmark: it measures nothing and prints the number
of prompts written.

    python benchmarks/export_prompts.py --source sharegpt --n 6000 --seed 1 --out .gpu/sharegpt.jsonl
    python benchmarks/export_prompts.py --source mt_bench --n 8 --seed 0 --out .gpu/mtbench.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsmith.eval.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--source",
        required=True,
        choices=["sharegpt", "mt_bench", "humaneval"],
        help="packaged prompt source (the recipe's data.prompts.source)",
    )
    ap.add_argument("--n", type=int, default=None, help="first n usable prompts after shuffling (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed (the recipe's prompts.seed)")
    ap.add_argument("--no-shuffle", action="store_true", help="keep the source's order")
    ap.add_argument("--max-turns", type=int, default=1, help="user turns kept per conversation")
    ap.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    a = ap.parse_args()
    prompts = load_prompts(a.source, None, a.n, shuffle=not a.no_shuffle, seed=a.seed, max_turns=a.max_turns)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(a.out.suffix + ".tmp")  # never a half-written file under the final name
    with tmp.open("w") as f:
        for p in prompts:
            f.write(json.dumps({"messages": p.messages}) + "\n")
    tmp.replace(a.out)
    print(f"{len(prompts)} prompts -> {a.out}")


if __name__ == "__main__":
    main()
