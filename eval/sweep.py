"""Pick a decoding threshold on held-out prompts: SpecDec++'s stop threshold (docs/algorithms.md A7) or the judge's δ
(Judge Decoding, A8).

Decodes the recipe's eval prompts (choose a held-out set with eval.prompts.seed / split / source, or
eval.judge.tasks_start for tasks) with plain AR, every fixed draft length, every threshold of the stop rule
(eval.stop, or the acceptance-head checkpoint's SpecDec++ rule) and every judge δ (eval.judge's head, **lossy**),
interleaved prompt by prompt in one process so machine noise hits all configurations alike. Prints tau, drafted
tokens wasted per verify, tokens/s, speedup vs AR and, when eval.judge.tasks is set, task accuracy, per
configuration (speed, tau and waste also per category for the best fixed length, the best rule and the oracles);
writes ``<out_dir>/eval/sweep.json`` with the best threshold and its gain over the best fixed draft length. A judge
δ is lossy, so it is picked only when task accuracy was scored and it stays within ``--max-accuracy-drop`` of AR's.

    draftsmith sweep RECIPE --thresholds 0.1,0.3,0.5,0.7 --fixed 1,2,3,4,6 [a.b=c ...]
    draftsmith sweep RECIPE --deltas 0.5,0.7,0.9 --fixed 2     # a judge recipe
    draftsmith sweep RECIPE eval.stop.rule=entropy --thresholds 1,2,3 --min-lens 0,1   # any drafter
    draftsmith sweep RECIPE eval.stop.rule=confidence --thresholds 0.5,0.7,0.9 --min-lens 0 --oracle
    draftsmith sweep RECIPE --oracle --fixed 1,2,3 eval.draft_len=6   # the headroom of any stop rule

``--oracle`` (greedy only) adds two configs no real rule can match. Both know the target's greedy output (the AR
config's, decoded just before them on the same prompt) and accept exactly what the cap accepts (same tau):
- ``oracle`` (``OracleStop``) ends each block right after the first draft the target will reject: a SpecDec++
  ``before`` rule with a perfect acceptance head, wasting at most one draft per verify. Its gain over the best
  fixed length bounds what a rule that judges each picked draft (min_len >= 1) can gain.
- ``oracle-skip`` (``OracleStop(skip=True)``) ends each block *before* the first draft the target will reject
  (min_len 0): no verify ever carries a rejected draft, and a block whose first draft would fail is a plain target
  step. It bounds rules that may also draft nothing (entropy or SpecDec++ ``after`` rules with min_len 0).
Their gains are reported apart from the real rules, never as the best rule.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.errors import DraftsmithError
from draftsmith.eval.bench import load_for_eval
from draftsmith.eval.contention import CpuShare
from draftsmith.eval.decoder import DecodeStats, autoregressive_generate, speculative_generate
from draftsmith.eval.report import shared_warning
from draftsmith.eval.tasks import correct
from draftsmith.models.judge import Judge

DEFAULT_THRESHOLDS = [0.1, 0.2, 0.3, 0.5, 0.7]


class OracleStop:
    """A stop rule that knows the target's greedy continuation ``want`` (T = 0). By default it is asked right after
    draft n is picked (``before_feed``, so stopping costs no drafter forward) and ends the block iff the target will
    reject draft n, which the verify then drops. With ``skip`` it is asked once the drafter has read n drafts
    (n >= 0, min_len 0) and ends the block iff the next draft, the argmax of the drafter's logits at T = 0, would
    be rejected: the same drafter forwards, and no rejected draft in any verify. The decoder's ``on_token`` feeds it
    the committed tokens, so it knows where each block starts."""

    def __init__(self, want: list[int], skip: bool = False):
        self.want, self.emitted = want, 0
        self.before_feed, self.min_len = not skip, 0 if skip else 1

    def on_token(self, _token: int) -> None:
        self.emitted += 1

    def __call__(self, n: int, logits, hidden, token=None) -> bool:
        # the committed tokens end with cur, and draft 1 continues after it: draft m sits at want[emitted + m - 1]
        i, tok = (self.emitted + n - 1, token) if self.before_feed else (self.emitted + n, logits.argmax())
        return i >= len(self.want) or int(tok) != self.want[i]


def best_rule(rules: list[str], rate: dict, accuracy: dict | None, max_drop: float) -> tuple[str | None, list[str]]:
    """The fastest rule config, and the judge configs left out of the pick. A judge δ is lossy, so it qualifies only
    when task accuracy was scored and it keeps AR's accuracy within ``max_drop`` (absolute); stop rules are lossless
    and always qualify."""
    floor = None if accuracy is None else accuracy["ar"] - max_drop - 1e-12
    left_out = [n for n in rules if n.startswith("judge-") and (floor is None or accuracy[n] < floor)]
    ok = [n for n in rules if n not in left_out]
    return (max(ok, key=rate.get) if ok else None), left_out


def sweep(
    recipe,
    thresholds: list[float] | None,
    fixed: list[int],
    deltas: list[float] = (),
    min_lens: list[int] = (),
    oracle: bool = False,
    max_accuracy_drop: float = 0.0,
) -> dict:
    """thresholds None: the default list when the recipe has a stop rule, else none. min_lens: each threshold is
    tried with each of these eval.stop.min_len values (empty: the recipe's). oracle: add ``OracleStop``.
    max_accuracy_drop: the most task accuracy (absolute) a judge δ may lose against AR and still be picked."""
    ec = recipe.eval
    if oracle and ec.temperature > 0:
        raise DraftsmithError(
            "--oracle needs eval.temperature=0 (it stops at the first draft the target's greedy "
            "output does not continue with)"
        )
    setup = load_for_eval(recipe)
    thresholds = _check_arguments(setup, thresholds, fixed, deltas, min_lens, oracle)
    cfg = _Configs(recipe, setup, fixed, thresholds, deltas, min_lens, oracle)
    runs = _Runs()
    meter = CpuShare().start()
    with torch.no_grad():
        for i, (prompt, ids) in enumerate(tqdm(setup.encoded, desc="sweep", unit="prompt", dynamic_ncols=True)):
            runs.prompt(cfg, setup, i, prompt.category or "all", torch.tensor(ids, device=setup.device), ec)
    meter.stop()
    if not runs.secs:
        raise DraftsmithError("no prompts left after eval.warmup: raise eval.prompts.n")
    report = _report(recipe, setup, cfg, runs, deltas, max_accuracy_drop, meter)
    out_dir = recipe.run_dir / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(report, indent=2))
    _print(report, setup, cfg, deltas, max_accuracy_drop, oracle, out_dir)
    return report


def _check_arguments(setup, thresholds, fixed, deltas, min_lens, oracle) -> list[float]:
    """The sweep's arguments against what the recipe loaded (a stop rule, a judge) -> the thresholds to try."""
    hook = setup.stop_drafting
    if thresholds is None:
        thresholds = DEFAULT_THRESHOLDS if hook is not None and not deltas and not oracle else []
    if thresholds and hook is None:
        raise DraftsmithError(
            "--thresholds needs a stop rule: set eval.stop or point eval.checkpoint at an acceptance head"
        )
    if deltas and setup.judge is None:
        raise DraftsmithError("--deltas needs a judge: set eval.judge.head (a drafter.kind judge checkpoint)")
    if not (thresholds or deltas or oracle):
        raise DraftsmithError("nothing to sweep: give --thresholds (a stop rule), --deltas (a judge) or --oracle")
    if not fixed:
        raise DraftsmithError("--fixed needs at least one draft length to compare against")
    if min_lens and (not thresholds or any(m < 0 for m in min_lens)):
        raise DraftsmithError("--min-lens needs --thresholds and values >= 0")
    si = setup.stop_info or {}
    if 0 in min_lens and si.get("rule") not in ("entropy", "confidence") and si.get("state") != "next":
        raise DraftsmithError(
            "--min-lens 0 needs eval.stop.rule=entropy or confidence, or eval.stop.state=next "
            "(a SpecDec++ head asked after or before a draft scores drafted tokens)"
        )
    if 0 in min_lens and si.get("state") == "before":
        raise DraftsmithError("--min-lens 0 needs eval.stop.state=after (a before rule judges a picked draft)")
    return thresholds


class _Configs:
    """The decoders a sweep compares, by name: "ar", "fixed-K", "stop-H[-mM]" (the stop rule at threshold H and
    min_len M), "judge-D" (lossy) and the oracles, each ``x -> (tokens, stats or None)``."""

    def __init__(self, recipe, setup, fixed, thresholds, deltas, min_lens, oracle: bool):
        ec = recipe.eval
        self.ec, self.setup, self.fixed = ec, setup, fixed
        self.sampling = {"temperature": ec.temperature, "top_k": ec.top_k, "top_p": ec.top_p}
        self.gen = torch.Generator(device=setup.device).manual_seed(recipe.seed)
        self.ar_out: list[int] = []  # this prompt's AR output: "ar" runs first, the oracle after it
        self.stop_of = (
            {f"stop-{h:g}": (h, None) for h in thresholds}
            if not min_lens
            else {f"stop-{h:g}-m{m}": (h, m) for h in thresholds for m in min_lens}
        )  # config name -> (threshold, min_len)
        self.oracles = ("oracle", "oracle-skip") if oracle else ()
        tgt, eos, n = setup.tgt.model, setup.eos, ec.max_new_tokens
        self.fns = {
            "ar": lambda x: (autoregressive_generate(tgt, x, n, eos_ids=eos, generator=self.gen, **self.sampling), None)
        }
        self.fns.update({f"fixed-{k}": self._spec(k) for k in fixed})
        self.fns.update({name: self._stop(h, m) for name, (h, m) in self.stop_of.items()})
        self.fns.update({f"judge-{d:g}": self._spec(ec.draft_len, judge=Judge(setup.judge.head, d)) for d in deltas})
        self.fns.update({name: self._oracle(name == "oracle-skip") for name in self.oracles})

    def _spec(self, k: int, **kw):
        s, ec = self.setup, self.ec
        return lambda x: speculative_generate(s.tgt.model, s.drafter, x, ec.max_new_tokens, draft_len=k,
                                              eos_ids=s.eos, generator=self.gen, **self.sampling, **kw)  # fmt: skip

    def _stop(self, h: float, m: int | None):
        hook = self.setup.stop_drafting

        def run(x):
            hook.threshold = h
            if m is not None:
                hook.min_len = m
            return self._spec(self.ec.draft_len, stop_drafting=hook)(x)

        return run

    def _oracle(self, skip: bool):
        def run(x):
            rule = OracleStop(self.ar_out, skip)
            return self._spec(self.ec.draft_len, stop_drafting=rule, on_token=rule.on_token)(x)

        return run


class _Runs:
    """Seconds, tokens, decode stats and solved tasks per config (overall and per category), and the greedy
    configs' mismatches against AR."""

    def __init__(self):
        self.solved = defaultdict(int)
        self.secs, self.toks, self.stats = defaultdict(float), defaultdict(int), defaultdict(DecodeStats)
        self.cat_secs, self.cat_toks, self.cat_stats = defaultdict(float), defaultdict(int), defaultdict(DecodeStats)
        self.mismatches = 0

    def prompt(self, cfg: _Configs, setup, i: int, cat: str, x, ec) -> None:
        outs = {}
        for name, fn in cfg.fns.items():
            t0 = time.perf_counter()
            out, st = fn(x)
            if setup.device.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if name == "ar":
                cfg.ar_out[:] = out
            if i < ec.warmup:
                continue  # first calls pay one-off allocation costs
            outs[name] = out
            self.secs[name] += dt
            self.toks[name] += len(out)
            self.cat_secs[cat, name] += dt
            self.cat_toks[cat, name] += len(out)
            if st is not None:
                self.stats[name].merge(st)
                self.cat_stats[cat, name].merge(st)
            if setup.tasks:
                self.solved[name] += correct(setup.tasks[i], setup.tgt.tokenizer.decode(out, skip_special_tokens=True))
        if ec.temperature == 0 and outs:
            self.mismatches += sum(o != outs["ar"] for n, o in outs.items() if not n.startswith("judge-"))

    def per_category(self, c: str, n: str) -> dict:
        """Speed vs AR on this category's prompts, tau and drafts wasted per verify."""
        st = self.cat_stats[c, n]
        return {
            "speedup_vs_ar": self.cat_toks[c, n]
            / self.cat_secs[c, n]
            / (self.cat_toks[c, "ar"] / self.cat_secs[c, "ar"]),
            "tau": st.tau,
            "wasted_per_step": (st.drafted - st.accepted) / max(1, st.target_forwards),
        }


def _report(recipe, setup, cfg: _Configs, runs: _Runs, deltas, max_accuracy_drop: float, meter) -> dict:
    ec, fns, n_scored = recipe.eval, cfg.fns, len(setup.encoded) - recipe.eval.warmup
    rate = {n: runs.toks[n] / runs.secs[n] for n in fns}
    results = {}
    for n in fns:
        st = runs.stats.get(n)
        steps = (
            {"tau": st.tau, "drafted_per_step": st.drafted / st.target_forwards,
             "wasted_per_step": (st.drafted - st.accepted) / st.target_forwards}
            if st else {}
        )  # fmt: skip
        results[n] = {
            "tokens_per_s": rate[n],
            "speedup_vs_ar": rate[n] / rate["ar"],
            **steps,
            **({"task_accuracy": runs.solved[n] / n_scored} if setup.tasks else {}),
            **({"judge_accepted": st.judge_accepted} if n.startswith("judge-") else {}),
        }
    best_fixed = max((f"fixed-{k}" for k in cfg.fixed), key=rate.get)
    rules = [n for n in fns if n.startswith(("stop-", "judge-"))]
    accuracy = {n: r["task_accuracy"] for n, r in results.items()} if setup.tasks else None
    best, left_out = best_rule(rules, rate, accuracy, max_accuracy_drop)
    cats = sorted({c for c, _ in runs.cat_secs})
    shown = [n for n in (best_fixed, best, *cfg.oracles) if n]
    report = {
        "prompts": {
            "source": ec.prompts.source,
            "n": n_scored,
            "seed": ec.prompts.seed,
            **({"tasks": ec.judge.tasks, "tasks_start": ec.judge.tasks_start} if setup.tasks else {}),
        },
        "drafter": str(setup.ckpt),
        "stop": setup.stop_info,
        "cap": ec.draft_len,
        "temperature": ec.temperature,
        "configs": results,
        "best_fixed": best_fixed,
        "best_stop": best,
    }
    if best:
        stop = cfg.stop_of.get(best)
        report["best_threshold"] = stop[0] if stop else float(best.split("-", 1)[1])
        report["gain_vs_best_fixed"] = rate[best] / rate[best_fixed] - 1
        if stop and stop[1] is not None:
            report["best_min_len"] = stop[1]
    report |= {f"{n.replace('-', '_')}_gain_vs_best_fixed": rate[n] / rate[best_fixed] - 1 for n in cfg.oracles}
    report["per_category"] = {c: {n: runs.per_category(c, n) for n in shown} for c in cats}
    report["lossless_mismatches"] = runs.mismatches if ec.temperature == 0 else None
    if deltas:
        report["lossy"] = {"judge": ec.judge.head, "deltas": list(deltas), "max_accuracy_drop": max_accuracy_drop,
                           "not_picked": left_out}  # fmt: skip
    report["machine"] = meter.machine()
    return report


def _print(report: dict, setup, cfg: _Configs, deltas, max_accuracy_drop: float, oracle: bool, out_dir: Path):
    """The sweep's table (per config, and per category when there are several) and its verdict line."""
    acc, results = setup.tasks is not None, report["configs"]
    if warning := shared_warning(report):
        print("sweep: warning: " + warning)
    print(
        f"{'config':<14} {'tok/s':>7} {'vs AR':>6} {'tau':>5} {'drafted':>8} {'wasted':>7}"
        + (f" {'accuracy':>8}" if acc else "")
    )
    for n, r in results.items():
        print(
            f"{n:<14} {r['tokens_per_s']:7.2f} {r['speedup_vs_ar']:6.2f} {r.get('tau', 1.0):5.2f} "
            f"{r.get('drafted_per_step', 0):8.2f} {r.get('wasted_per_step', 0):7.2f}"
            + (f" {r['task_accuracy']:8.3f}" if acc else "")
        )
    cats = report["per_category"]
    if len(cats) > 1:
        per = "; ".join(
            f"{c}: " + ", ".join(f"{n} {v['speedup_vs_ar']:.2f}x/{v['tau']:.2f}/{v['wasted_per_step']:.2f}"
                                 for n, v in cats[c].items())
            for c in cats
        )  # fmt: skip
        print("per category (speed vs AR / tau / wasted per verify): " + per)
    best, best_fixed = report["best_stop"], report["best_fixed"]
    left_out = report.get("lossy", {}).get("not_picked", [])  # judge configs only
    if left_out:
        why = (
            f"task accuracy below AR's {results['ar']['task_accuracy']:.3f} - {max_accuracy_drop:g}"
            if acc
            else "no task accuracy scored (set eval.judge.tasks)"
        )
        print(f"sweep: not picked, {why}: {', '.join(left_out)}")
    lossy = " (judge configs are LOSSY: compare their task accuracy with AR's)" if deltas else ""
    found = f", best {best} ({report['gain_vs_best_fixed']:+.1%} tokens/s){lossy}" if best else ""
    bound = (
        f"; bounds: oracle {report['oracle_gain_vs_best_fixed']:+.1%} (rules judging each draft), oracle-skip "
        f"{report['oracle_skip_gain_vs_best_fixed']:+.1%} (rules that may draft nothing)"
        if oracle
        else ""
    )
    print(f"sweep: best fixed {best_fixed}{found}{bound}; -> {out_dir / 'sweep.json'}")


def add_arguments(p) -> None:
    """The options of ``draftsmith sweep`` (draftsmith/cli.py adds RECIPE, the overrides and -q)."""
    p.add_argument(
        "--thresholds",
        default=None,
        help="comma-separated stop thresholds (specdecpp, confidence: probability in (0, 1); entropy: "
        f"nats); default {','.join(map(str, DEFAULT_THRESHOLDS))} when the recipe has a stop rule "
        "and no --deltas",
    )
    p.add_argument(
        "--deltas",
        default="",
        help="comma-separated judge thresholds δ in (0, 1) for lossy Judge-Decoding verification at "
        "eval.draft_len (needs eval.judge.head; task accuracy is scored with eval.judge.tasks)",
    )
    p.add_argument("--fixed", default="1,2,3,4,6", help="comma-separated fixed draft lengths to compare against")
    p.add_argument(
        "--min-lens",
        default="",
        help="comma-separated eval.stop.min_len values to cross with every threshold (config names "
        "stop-<h>-m<n>); 0 lets the entropy or confidence rule skip drafting where even the first "
        "draft looks unsure; default: the recipe's min_len only",
    )
    p.add_argument(
        "--oracle",
        action="store_true",
        help="also decode with two oracle stop rules (greedy only) that know the target's output, at the "
        "cap eval.draft_len: 'oracle' ends each block right after the first draft the target will "
        "reject, 'oracle-skip' right before it (it may draft nothing). Their gains over the best "
        "fixed length bound what a stop rule can gain with this drafter here: one judging each "
        "picked draft (SpecDec++, entropy with min_len >= 1), or one that may draft nothing "
        "(min_len 0)",
    )
    p.add_argument(
        "--max-accuracy-drop",
        type=float,
        default=0.0,
        help="judge δs only: the most task accuracy (absolute, e.g. 0.02) a lossy δ may lose against AR "
        "and still be picked as the best; δs scored without tasks are never picked (default 0)",
    )


def run_cli(args, recipe) -> dict:
    """``draftsmith sweep RECIPE [options]``: the parsed options -> ``sweep``; bad values are DraftsmithErrors."""

    def numbers(text, kind, flag):
        try:
            return [kind(t) for t in text.split(",") if t.strip()]
        except ValueError:
            raise DraftsmithError(f"{flag} {text!r}: expected comma-separated numbers") from None

    deltas = numbers(args.deltas, float, "--deltas")
    if any(not 0 < d < 1 for d in deltas):
        raise DraftsmithError(f"--deltas {args.deltas!r}: each δ must lie in (0, 1)")
    if not 0 <= args.max_accuracy_drop <= 1:
        raise DraftsmithError(f"--max-accuracy-drop {args.max_accuracy_drop}: must lie in [0, 1]")
    thresholds = None if args.thresholds is None else numbers(args.thresholds, float, "--thresholds")
    try:
        return sweep(
            recipe,
            thresholds,
            numbers(args.fixed, int, "--fixed"),
            deltas,
            numbers(args.min_lens, int, "--min-lens"),
            args.oracle,
            args.max_accuracy_drop,
        )
    except ValueError as e:
        raise DraftsmithError(str(e)) from None
