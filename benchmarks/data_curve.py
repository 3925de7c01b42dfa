"""τ as training data grows: one recipe's drafter trained on nested data sets of growing size, from the same
prompts, each evaluated the same way.

The data stage grows one data folder: raising ``data.prompts.n`` keeps every finished shard and appends the next
prompts (they are a prefix of one shuffled order), so the sets are nested. For each --tokens budget (target
tokens in the records, prompt + response, as the manifest counts them) the script generates until the folder
holds at least that many, copies the records into a fresh run, trains for --epochs passes over them (steps =
epochs × records / micro-batch, at least --min-steps), and evaluates the final checkpoint as a chain of
--draft-len and with the recipe's tree, T = 0, lossless checked against plain decoding. Every stage runs as the
CLI runs it (``python -m draftsmith``), so the numbers are the product's.

Reading the output: one row per size with its records, tokens, training seconds and training tokens/s (loss
tokens, as the training log counts them), τ for the chain and the tree, and the speedup over plain decoding (the
tree's, else the chain's); then "slope per doubling": the least-squares change in τ per doubling of the data
(log2 tokens), for the chain and the tree. A positive slope that holds across the sizes is the signal; its size
says how much more data is worth. The last lines name the machine. --json writes the rows.

    python benchmarks/data_curve.py [--recipe eagle3-smollm2] [--tokens 500000 2000000 4000000] [--epochs 2]
        [--eval-prompts 80] [--out runs/data-curve] [--set train.precision=bf16 ...]
Quick check on a CPU (minutes): --tokens 20000 40000 --epochs 1 --eval-prompts 4 --set eval.max_new_tokens=32
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _run(args: list[str], log: Path) -> float:
    """``python -m draftsmith ARGS``; its output goes to ``log``; -> seconds. A failure stops the script."""
    t0 = time.perf_counter()
    with log.open("a") as f:
        f.write(f"$ draftsmith {' '.join(args)}\n")
        f.flush()
        rc = subprocess.call([sys.executable, "-m", "draftsmith", *args], stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        sys.exit(f"data_curve: `draftsmith {' '.join(args[:2])}` failed (exit {rc}); see {log}")
    return time.perf_counter() - t0


def _manifest(data: Path) -> dict:
    return json.loads((data / "manifest.json").read_text())


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over log2(xs): τ gained per doubling of the data."""
    if len(xs) < 2:
        return None
    lx = [math.log2(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ys)) / den if den else None


def _train_rate(metrics: Path) -> float | None:
    """The training stage's last logged tokens/s (cumulative over the run)."""
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    rates = [r["tokens_per_s"] for r in rows if r.get("stage") == "train" and "tokens_per_s" in r]
    return rates[-1] if rates else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="eagle3-smollm2", help="the recipe whose drafter is trained at every size")
    ap.add_argument("--tokens", type=float, nargs="+", default=[5e5, 2e6, 4e6], help="data sizes in target tokens")
    ap.add_argument("--epochs", type=float, default=2.0, help="passes over each size's records")
    ap.add_argument("--min-steps", type=int, default=10, help="at least this many training steps per size")
    ap.add_argument("--eval-prompts", type=int, default=80, help="MT-bench prompts per evaluation")
    ap.add_argument("--draft-len", type=int, default=6, help="the chain's draft length (γ)")
    ap.add_argument("--no-tree", action="store_true", help="evaluate the chain only (skip the recipe's tree)")
    ap.add_argument("--out", default="runs/data-curve", help="work folder: the growing data, one run per size, logs")
    ap.add_argument("--set", nargs="*", default=[], help="extra recipe overrides for every stage, e.g. "
                    "train.precision=bf16 train.micro_batch_size=64 data.batch_size=256")  # fmt: skip
    ap.add_argument("--max-seconds", type=float, default=None, help="start no new size after this many seconds "
                    "(a device lease's budget): the sizes done so far are reported")  # fmt: skip
    ap.add_argument("--json", help="also write the rows and slopes to this file")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log, grow = out / "log.txt", out / "grow"
    sizes = sorted(a.tokens)
    rows: list[dict] = []
    n = 64  # prompts to start with; raised from the measured tokens per prompt
    start = time.perf_counter()
    for budget in sizes:
        if a.max_seconds is not None and time.perf_counter() - start > a.max_seconds and rows:
            print(f"data_curve: --max-seconds {a.max_seconds:.0f} reached; sizes from {int(budget)} on not run")
            break
        t_gen = 0.0
        while True:
            have = _manifest(grow / "data") if (grow / "data" / "manifest.json").is_file() else None
            if have is not None and have["n_tokens"] >= budget:
                break
            if have is not None:  # prompts loaded so far x the tokens still missing, 5% over
                n = max(n + 1, math.ceil(have["prompts"]["loaded"] * budget / max(1, have["n_tokens"]) * 1.05))
            t_gen += _run(["generate", a.recipe, f"out_dir={grow}", f"data.prompts.n={n}", "-q", *a.set], log)
            if _manifest(grow / "data")["n_tokens"] < budget and have is not None:
                if _manifest(grow / "data")["n_sequences"] == have["n_sequences"]:
                    print(f"data_curve: the prompt source ran out at {have['n_tokens']} tokens", flush=True)
                    break
        man = _manifest(grow / "data")
        run = out / f"size-{int(budget)}"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(grow / "data", run / "data")
        mb = next((int(s.split("=", 1)[1]) for s in a.set if s.startswith("train.micro_batch_size=")), None)
        if mb is None:
            from draftsmith.recipes.loader import load_recipe

            mb = load_recipe(a.recipe, []).train.micro_batch_size
        steps = max(a.min_steps, math.ceil(a.epochs * man["n_sequences"] / mb))
        t_train = _run(["train", a.recipe, f"out_dir={run}", f"train.steps={steps}", "train.save_every=0", "-q",
                        *a.set], log)  # fmt: skip
        row = {
            "target_tokens": man["n_tokens"],
            "records": man["n_sequences"],
            "steps": steps,
            "generate_s": round(t_gen, 1),
            "train_s": round(t_train, 1),
            "train_tokens_per_s": _train_rate(run / "metrics.jsonl"),
        }
        evals = {"chain": ["eval.strategy=chain", f"eval.draft_len={a.draft_len}"]}
        if not a.no_tree:
            evals["tree"] = []
        for name, extra in evals.items():
            dst = run / f"eval-{name}"
            _run(["eval", a.recipe, f"out_dir={dst}", f"eval.checkpoint={run / 'checkpoints' / 'final'}",
                  f"eval.prompts.n={a.eval_prompts}", "eval.prompts.source=mt_bench", "-q", *extra, *a.set],
                 log)  # fmt: skip
            rep = json.loads((dst / "eval" / "report.json").read_text())
            speedup = rep.get("speedup")
            row[name] = {
                "tau": rep.get("tau"),
                "speedup_vs_ar": speedup.get("vs_ar") if isinstance(speedup, dict) else speedup,
                "lossless_match": rep.get("lossless_match"),
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'tokens':>10} {'records':>8} {'train s':>8} {'tok/s':>8} {'τ chain':>8} {'τ tree':>8} {'speedup':>8}")
    for r in rows:
        tree = r.get("tree", {})
        print(f"{r['target_tokens']:>10} {r['records']:>8} {r['train_s']:>8} {r['train_tokens_per_s'] or 0:>8.0f} "
              f"{r['chain']['tau']:>8.3f} {tree.get('tau') or float('nan'):>8.3f} "
              f"{(tree or r['chain']).get('speedup_vs_ar') or float('nan'):>8.2f}")  # fmt: skip
    xs = [r["target_tokens"] for r in rows]
    slopes = {name: _slope(xs, [r[name]["tau"] for r in rows]) for name in ("chain", "tree") if name in rows[0]}
    for name, s in slopes.items():
        print(f"slope per doubling ({name}): " + ("n/a (one size)" if s is None else f"{s:+.3f} τ"))
    import torch

    from draftsmith.eval.timing import machine_note

    print(machine_note("cuda" if torch.cuda.is_available() else "cpu"))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "slope_per_doubling": slopes}, indent=1))


if __name__ == "__main__":
    main()
