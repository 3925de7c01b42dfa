"""Step costs that bound speculative speedup on this machine, measured side by side in one process: one target
decode step, a verify forward over k+1 tokens for each --k (48 ~ a dynamic tree's node budget), one draft step of
--drafter (if it loads), and one Medusa-style head step with the full and with reduced LM heads.

Models run as the eval decoder runs them (``optimize_for_inference``: fused, pre-packed matmuls) unless
--no-optimize. Every measurement runs in every round, round-robin (eval/timing.py), so a machine that speeds up or
slows down shifts all of them alike; a round's time is the mean of --reps forwards, and the median over --rounds is
printed.

Reading the output: ratios, not absolute times, are the result. "verify k=K: X x a decode step" is the verify's
cost in decode steps (close to 1 while the target is memory-bound); "draft step: c = Y" is the draft/target cost
ratio c of the speedup formulas; "head step" rows give a Medusa-style head's cost (ResBlock + LM head + the scatter
into the target vocabulary, what ``logits_after`` costs the decoder per draft; random weights, since only the
shapes set the cost) as a share of a target step. The last line names the machine and how much of its CPU other
processes took meanwhile.

--threads 1 2: every forward is timed at each torch thread count (set before each call, round-robin in one
process), and with --drafter the lines end with the bound of drafting in parallel with verification (PEARL) on a
2-core CPU: the sequential step (k drafts, then the verify, each on both cores) against the parallel one (the verify
on one core while the drafter drafts the next k on the other: the slower of the two, with no contention counted).

--pack-ab: the same target pre-packed for oneDNN with batch hint 1 and with the current hint
(``FusedLinear.pack_batch``), round-robin in one process; prints each forward's time under both, their ratio and
the max logit difference (CPU).

    python benchmarks/step_costs.py [--target smollm2-135m-instruct] [--drafter CKPT] [--k 1 2 3 4 6 48]
                                    [--head-vocab 8192 4096]
    python benchmarks/step_costs.py --pack-ab
    python benchmarks/step_costs.py --threads 1 2 --drafter CKPT --k 1 2 3 4
"""

from __future__ import annotations

import argparse
import copy

import torch

from draftsmith.eval.sizing import cached_forward as forward
from draftsmith.eval.timing import interleave
from draftsmith.models.llama import FusedLinear
from draftsmith.models.loading import load_model
from draftsmith.models.registry import load_drafter


def head_models(tgt, sizes: list[int]) -> dict:
    """One-head Medusa drafters, full and reduced vocabularies, pre-packed as eval runs them (built from the plain
    target: its LM head rows are copied)."""
    from draftsmith.models.medusa import build_medusa

    counts = torch.ones(tgt.cfg.vocab_size)  # which rows are kept does not change the cost
    out = {}
    for n in [None, *sizes]:
        heads = build_medusa({"n_heads": 1, **({"draft_vocab": n} if n else {})}, tgt, counts=counts)
        out[n or tgt.cfg.vocab_size] = heads.optimize_for_inference()
    return out


def head_step(heads, dim: int, device: str):
    """A callable: one head step (``logits_after``) from a random hidden state."""
    h, cur = torch.randn(dim, device=device), torch.tensor([100], device=device)

    def fn():
        with torch.no_grad():
            return heads.logits_after(h, [cur])

    return fn


def pack_ab(base, a) -> None:
    current = FusedLinear.pack_batch
    FusedLinear.pack_batch = 1
    old = copy.deepcopy(base).optimize_for_inference()
    FusedLinear.pack_batch = current
    new = copy.deepcopy(base).optimize_for_inference()
    print(f"oneDNN pack hint 1 vs {current}, ctx {a.ctx}, mean of {a.reps} forwards, median of {a.rounds} rounds")
    print(f"| tokens | hint 1 (ms) | hint {current} (ms) | hint 1 / hint {current} | max logit diff |")
    print("|---|---|---|---|---|")
    for t in [1] + [k + 1 for k in a.k]:
        # round-robin, so drift on a shared machine hits both sides
        tm = interleave(
            {"old": forward(old, a.ctx, t, "cpu"), "new": forward(new, a.ctx, t, "cpu")},
            warmup=1,
            repeats=a.rounds,
            number=a.reps,
        )
        diff = (tm["old"].last - tm["new"].last).abs().max().item()
        print(
            f"| {t} | {tm['old'].median * 1e3:.1f} | {tm['new'].median * 1e3:.1f} | {tm.ratio('old', 'new'):.2f} | "
            f"{diff:.1e} |",
            flush=True,
        )
    print(tm.note)


def on_threads(fn, n: int):
    def run():
        if torch.get_num_threads() != n:  # setting it, even to the same count, restarts the thread pool
            torch.set_num_threads(n)
        return fn()

    return run


def by_threads(jobs: dict, drafted: bool, a) -> None:
    """Every job at every thread count, round-robin; then the parallel-drafting bound (module docstring)."""
    names = [n for n in jobs if not n.startswith("head")]
    t = interleave(
        {f"{n}@{th}": on_threads(jobs[n], th) for n in names for th in a.threads},
        warmup=1,
        repeats=a.rounds,
        number=a.reps,
        device=a.device,
    )
    print(f"ctx {a.ctx}, mean of {a.reps} forwards per round, median of {a.rounds} round-robin rounds")
    for n in names:
        cells = [f"{th} thread(s) {t[f'{n}@{th}'].median * 1e3:.2f} ms" for th in a.threads]
        print(f"{n}: " + ", ".join(cells) + "".join(
            f"; {th} / {a.threads[0]} threads = {t.ratio(f'{n}@{th}', f'{n}@{a.threads[0]}'):.2f}"
            for th in a.threads[1:]
        ))  # fmt: skip
    if drafted and {1, 2} <= set(a.threads):
        for k in a.k:
            seq = k * t["draft@2"].median + t[f"verify {k}@2"].median
            par = max(k * t["draft@1"].median, t[f"verify {k}@1"].median)
            print(
                f"k={k}: sequential step {seq * 1e3:.2f} ms, parallel (1 core each) {par * 1e3:.2f} ms: "
                f"bound of parallel drafting {seq / par:.2f}x the sequential loop"
            )
    print(t.note)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="target model (alias, folder or hub id)")
    ap.add_argument(
        "--drafter",
        default="runs/quickstart/checkpoints/final",
        help="draft LM checkpoint for the draft-step row (skipped, with a note, when it does not load)",
    )
    ap.add_argument(
        "--k",
        type=int,
        nargs="+",
        default=[1, 2, 3, 4, 6, 48],
        help="draft lengths to verify (k + 1 tokens; 48 ~ a dynamic tree's node budget)",
    )
    ap.add_argument("--ctx", type=int, default=256, help="tokens already in the KV cache")
    ap.add_argument("--reps", type=int, default=30, help="forwards per measurement and round (their mean)")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin rounds over all measurements (median)")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda (bfloat16 on CUDA, float32 on CPU)",
    )
    ap.add_argument("--no-optimize", action="store_true", help="time the plain (unfused) models instead")
    ap.add_argument(
        "--threads",
        type=int,
        nargs="*",
        default=[],
        help="time every forward at each of these torch thread counts (1 2: the parallel-drafting bound)",
    )
    ap.add_argument("--pack-ab", action="store_true", help="CPU: A/B the oneDNN pack hint (see above)")
    ap.add_argument(
        "--head-vocab",
        type=int,
        nargs="*",
        default=[8192, 4096],
        help="reduced head vocabularies to time next to the full one (empty: no head timings)",
    )
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    tgt = load_model(a.target, dtype, a.device).model
    if a.pack_ab:
        return pack_ab(tgt, a)
    heads = head_models(tgt, a.head_vocab) if a.head_vocab and not a.no_optimize else {}
    if not a.no_optimize:
        tgt.optimize_for_inference()
    try:
        drafter, _ = load_drafter(a.drafter, dtype=dtype, device=a.device)
        if not a.no_optimize:
            drafter.optimize_for_inference()
    except Exception as e:  # the drafter is optional
        drafter = None
        print(f"no drafter ({e})")
    jobs = {"decode": forward(tgt, a.ctx, 1, a.device)}
    jobs.update({f"verify {k}": forward(tgt, a.ctx, k + 1, a.device) for k in a.k})
    jobs.update({f"head {n}": head_step(m, tgt.cfg.dim, a.device) for n, m in heads.items()})
    if drafter is not None:
        jobs["draft"] = forward(drafter, a.ctx, 1, a.device)
    if a.threads:
        return by_threads(jobs, drafter is not None, a)
    t = interleave(jobs, warmup=1, repeats=a.rounds, number=a.reps, device=a.device)
    base = t["decode"].median
    print(
        f"device {a.device}, dtype {dtype}, ctx {a.ctx}, optimized {not a.no_optimize}, mean of {a.reps} forwards "
        f"per round, median of {a.rounds} round-robin rounds"
    )
    print(f"target decode step: {base * 1e3:.2f} ms (rounds: {' '.join(f'{x * 1e3:.1f}' for x in t['decode'].times)})")
    for k in a.k:
        v = t[f"verify {k}"]
        print(
            f"verify k={k} ({k + 1} tokens): {v.median * 1e3:.2f} ms = {t.ratio(f'verify {k}', 'decode'):.2f}x "
            f"a decode step"
        )
    for n in heads:
        h = t[f"head {n}"]
        print(
            f"head step, {n}-token LM head: {h.median * 1e3:.2f} ms = {t.ratio(f'head {n}', 'decode'):.3f} of a "
            f"target step"
        )
    if drafter is not None:
        print(
            f"draft step: {t['draft'].median * 1e3:.2f} ms = c = {t.ratio('draft', 'decode'):.3f} of a target step "
            f"({drafter.num_params() / 1e6:.1f}M vs {tgt.num_params() / 1e6:.1f}M params)"
        )
    print(t.note)


if __name__ == "__main__":
    main()
