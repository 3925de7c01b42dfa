"""How much the order of timed runs moves eval's "speculative vs own AR" ratio on a CPU.

Loads a recipe's target and trained drafter exactly as ``draftsmith eval`` does (``load_for_eval`` and
``optimize_models``), takes the eval's prompts, and times the speculative decoder (the recipe's chain or tree) and
plain decoding on every prompt under three protocols in one process: blocks (all prompts plain, then all
speculative, --blocks times), alternating per prompt (speculative first on even prompts, plain first on odd ones),
and speculative first on every prompt (the eval's own order). One untimed prompt of each warms up first.

Reading the output: tokens/s of each decoder under each protocol and the speculative / plain ratio per protocol.
If the ratios differ by more than the run-to-run noise, the order of runs, not the drafter, is moving the eval's
number; quote the block ratio or a longer eval.

    python benchmarks/experiments/eval_order.py [--recipe quickstart] [--set out_dir=runs/quickstart ...]
        [--prompts 16] [--blocks 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from draftsmith.eval.bench import build_tree, load_for_eval, optimize_models
from draftsmith.eval.contention import CpuShare
from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.eval.tree_decoder import tree_speculative_generate
from draftsmith.recipes.loader import load_recipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="quickstart", help="recipe name or file whose trained drafter is timed")
    ap.add_argument("--set", nargs="*", default=[], help="recipe overrides, e.g. out_dir=runs/quickstart")
    ap.add_argument("--prompts", type=int, default=16, help="eval prompts (the recipe's eval.prompts, first N)")
    ap.add_argument("--blocks", type=int, default=2, help="rounds of the block protocol")
    args = ap.parse_args()

    recipe = load_recipe(args.recipe, [*args.set, f"eval.prompts.n={args.prompts}", "eval.baseline_hf=false"])
    ec = recipe.eval
    s = load_for_eval(recipe, optimize=False)
    optimize_models(s, ec)
    tree = build_tree(ec, getattr(s.drafter, "max_draft_len", None))
    device = next(s.tgt.model.parameters()).device
    prompts = [torch.tensor(ids, device=device) for _, ids in s.encoded]
    n_new = ec.max_new_tokens

    def plain(x):
        return autoregressive_generate(s.tgt.model, x, n_new, eos_ids=s.eos)

    def spec(x):
        if tree is not None:
            return tree_speculative_generate(s.tgt.model, s.drafter, x, n_new, tree, eos_ids=s.eos)[0]
        return speculative_generate(s.tgt.model, s.drafter, x, n_new, draft_len=ec.draft_len, eos_ids=s.eos)[0]

    acc: dict[str, list[float]] = {}

    def timed(tag: str, fn, x) -> None:
        t = time.perf_counter()
        n = len(fn(x))
        a = acc.setdefault(tag, [0, 0.0])
        a[0] += n
        a[1] += time.perf_counter() - t

    meter = CpuShare().start()
    with torch.no_grad():
        plain(prompts[0]), spec(prompts[0])
        for _ in range(args.blocks):
            for x in prompts:
                timed("blocks plain", plain, x)
            for x in prompts:
                timed("blocks spec", spec, x)
        for i, x in enumerate(prompts):
            order = (("spec", spec), ("plain", plain)) if i % 2 == 0 else (("plain", plain), ("spec", spec))
            for name, fn in order:
                timed(f"alternating {name}", fn, x)
        for x in prompts:
            timed("spec-first spec", spec, x)
            timed("spec-first plain", plain, x)
    meter.stop()
    rate = {k: n / t for k, (n, t) in acc.items()}
    for k, v in rate.items():
        print(f"{k}: {v:.1f} tok/s")
    for p in ("blocks", "alternating", "spec-first"):
        print(f"{p}: speculative / plain {rate[p + ' spec'] / rate[p + ' plain']:.3f}")
    print(f"other processes took {meter.other:.1%} of the CPUs while timing")


if __name__ == "__main__":
    main()
