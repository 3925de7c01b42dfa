"""Pick the adaptive draft-length threshold on held-out prompts (SpecDec++, algorithms.md A7).

Decodes the recipe's eval prompts (choose a held-out set with eval.prompts.seed / split / source) with plain AR,
every fixed draft length and every threshold of the stop rule (eval.stop, or the acceptance-head checkpoint's
SpecDec++ rule), interleaved prompt by prompt in one process so machine noise hits all configurations alike.
Prints tau, drafted tokens wasted per verify, tokens/s and speedup vs AR, per configuration and per category;
writes ``<out_dir>/eval/sweep.json`` with the best threshold and its gain over the best fixed draft length.

    python -m draftsmith.eval.sweep RECIPE --thresholds 0.1,0.3,0.5,0.7 --fixed 1,2,3,4,6 [a.b=c ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch
from tqdm.auto import tqdm

from draftsmith.errors import DraftsmithError
from draftsmith.eval.bench import load_for_eval
from draftsmith.eval.decoder import DecodeStats, autoregressive_generate, speculative_generate


def sweep(recipe, thresholds: list[float], fixed: list[int]) -> dict:
    ec = recipe.eval
    setup = load_for_eval(recipe)
    hook = setup.stop_drafting
    if hook is None:
        raise DraftsmithError("the sweep needs a stop rule: set eval.stop or point eval.checkpoint at an "
                              "acceptance head")
    tgt, drafter, eos = setup.tgt.model, setup.drafter, setup.eos
    sampling = {"temperature": ec.temperature, "top_k": ec.top_k, "top_p": ec.top_p}
    gen = torch.Generator(device=setup.device).manual_seed(recipe.seed)

    def spec(k, stop=None):
        return lambda x: speculative_generate(tgt, drafter, x, ec.max_new_tokens, draft_len=k, eos_ids=eos,
                                              generator=gen, stop_drafting=stop, **sampling)

    def with_threshold(h):
        def run(x):
            hook.threshold = h
            return spec(ec.draft_len, hook)(x)
        return run

    configs = {"ar": lambda x: (autoregressive_generate(tgt, x, ec.max_new_tokens, eos_ids=eos, generator=gen,
                                                        **sampling), None)}
    configs.update({f"fixed-{k}": spec(k) for k in fixed})
    configs.update({f"stop-{h:g}": with_threshold(h) for h in thresholds})
    secs, toks, stats = defaultdict(float), defaultdict(int), defaultdict(DecodeStats)
    cat_secs, cat_toks = defaultdict(float), defaultdict(int)
    mismatches = 0
    with torch.no_grad():
        for i, (prompt, ids) in enumerate(tqdm(setup.encoded, desc="sweep", unit="prompt", dynamic_ncols=True)):
            x = torch.tensor(ids, device=setup.device)
            outs = {}
            for name, fn in configs.items():
                t0 = time.perf_counter()
                out, st = fn(x)
                if setup.device.startswith("cuda"):
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if i < ec.warmup:
                    continue  # first calls pay one-off allocation costs
                outs[name] = out
                secs[name] += dt
                toks[name] += len(out)
                cat = prompt.category or "all"
                cat_secs[cat, name] += dt
                cat_toks[cat, name] += len(out)
                if st is not None:
                    stats[name].merge(st)
            if ec.temperature == 0 and outs:
                mismatches += sum(o != outs["ar"] for o in outs.values())
    if not secs:
        raise DraftsmithError("no prompts left after eval.warmup: raise eval.prompts.n")
    rate = {n: toks[n] / secs[n] for n in configs}
    results = {}
    for n in configs:
        st = stats.get(n)
        results[n] = {"tokens_per_s": rate[n], "speedup_vs_ar": rate[n] / rate["ar"],
                      **({"tau": st.tau, "drafted_per_step": st.drafted / st.target_forwards,
                          "wasted_per_step": (st.drafted - st.accepted) / st.target_forwards} if st else {})}
    best_fixed = max((f"fixed-{k}" for k in fixed), key=rate.get)
    best_stop = max((f"stop-{h:g}" for h in thresholds), key=rate.get)
    cats = sorted({c for c, _ in cat_secs})
    report = {
        "prompts": {"source": ec.prompts.source, "n": len(setup.encoded) - ec.warmup, "seed": ec.prompts.seed},
        "drafter": str(setup.ckpt), "stop": setup.stop_info, "cap": ec.draft_len, "temperature": ec.temperature,
        "configs": results, "best_fixed": best_fixed, "best_stop": best_stop,
        "best_threshold": float(best_stop.removeprefix("stop-")),
        "gain_vs_best_fixed": rate[best_stop] / rate[best_fixed] - 1,
        "per_category": {c: {n: cat_toks[c, n] / cat_secs[c, n] / (cat_toks[c, "ar"] / cat_secs[c, "ar"])
                             for n in (best_fixed, best_stop)} for c in cats},
        "lossless_mismatches": mismatches if ec.temperature == 0 else None,
    }
    out_dir = recipe.run_dir / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(report, indent=2))
    print(f"{'config':<12} {'tok/s':>7} {'vs AR':>6} {'tau':>5} {'drafted':>8} {'wasted':>7}")
    for n, r in results.items():
        print(f"{n:<12} {r['tokens_per_s']:7.2f} {r['speedup_vs_ar']:6.2f} {r.get('tau', 1.0):5.2f} "
              f"{r.get('drafted_per_step', 0):8.2f} {r.get('wasted_per_step', 0):7.2f}")
    print(f"sweep: best fixed {best_fixed}, best {best_stop} ({report['gain_vs_best_fixed']:+.1%} tokens/s); "
          f"-> {out_dir / 'sweep.json'}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftsmith.eval.sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe name or YAML path (its eval section and checkpoint are used)")
    p.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. eval.prompts.seed=7")
    p.add_argument("--thresholds", default="0.1,0.2,0.3,0.5,0.7",
                   help="comma-separated stop thresholds (SpecDec++: probability in (0, 1); entropy: nats)")
    p.add_argument("--fixed", default="1,2,3,4,6", help="comma-separated fixed draft lengths to compare against")
    args = p.parse_args(argv)
    from draftsmith.recipes.loader import load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        sweep(recipe, [float(t) for t in args.thresholds.split(",")], [int(k) for k in args.fixed.split(",")])
    except (DraftsmithError, ValueError) as e:
        print(f"draftsmith sweep: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
