"""What a stop rule costs per call next to the drafting it decides on, for feature heads (Hydra++, Medusa, MLP
speculator) on this machine: one head step (``draft_step``, what the chain decoder runs per draft), the context
layer reading one new position (Hydra++'s prefix attention; nothing for the others), and one SpecDec++ rule call
split into its two parts (the head's input features from a target-vocabulary logit row, and the head's forward);
with a reduced head vocabulary, also the call as eval builds it (features from the kept rows only).
Round-robin rounds in one process (eval/timing.py), medians: the ratios between the rows are the result, not the
absolute times.

The rule's share of a decode step is calls per step x the rule row / the step; a skip rule (eval.stop.state=next)
is asked before every draft, so once more than the number of drafts it lets through.

Usage: python benchmarks/experiments/rule_costs.py --heads runs/hydra/checkpoints/final \
           --head runs/skip-head/checkpoints/final [--reps 200 --rounds 3]
"""

from __future__ import annotations

import argparse

import torch

from draftsmith.eval.timing import interleave
from draftsmith.models.acceptance import AcceptanceStop, acceptance_features
from draftsmith.models.registry import load_drafter


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", required=True, help="a medusa / hydra / mlp_speculator checkpoint folder")
    ap.add_argument("--head", required=True, help="an acceptance-head checkpoint trained on those heads")
    ap.add_argument("--reps", type=int, default=200, help="calls per timing")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin rounds; the median is printed")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    heads, _ = load_drafter(args.heads)
    heads = heads.float().optimize_for_inference()  # as the eval decoder runs them (eval.optimize)
    head, _ = load_drafter(args.head)
    head = head.float()
    torch.manual_seed(0)
    h, cur = torch.randn(heads.cfg.dim), torch.tensor([42])
    logits, state = heads.draft_step(h, [cur])
    rule = AcceptanceStop(head, 0.9, min_len=0, skip=True)
    kept = AcceptanceStop(head, 0.9, min_len=0, skip=True, keep=heads.head_ids)  # what eval builds for reduced heads
    x = acceptance_features(state, logits, logits.argmax())
    ctx = heads.new_context(4096)

    def read_one():
        if ctx is not None:
            heads.read_context(h[None], ctx)
            ctx.length = 100  # keep the context at a fixed length

    rows = {
        "head step (draft 1)": lambda: heads.draft_step(h, [cur]),
        "head step (draft 2)": lambda: heads.draft_step(h, [cur, cur]),
        "context layer, 1 position": read_one,
        "rule call, target-vocab row": lambda: rule(0, logits, state),
        "rule call, kept rows only": lambda: kept(0, logits, state),
        "  features": lambda: acceptance_features(state, logits, logits.argmax()),
        "  head forward": lambda: head(x, 0),
    }
    # one warm-up round (allocator and oneDNN first-call setup), then the timed rounds
    times = interleave(rows, warmup=1, repeats=args.rounds, number=args.reps)
    print(f"per call, median of {args.rounds} rounds x {args.reps} calls; share of a head step (draft 1)")
    for name, t in times.items():
        print(f"{name:30s} {t.median * 1e3:7.3f} ms  {times.ratio(name, 'head step (draft 1)'):6.2f}")
    print(times.note)


if __name__ == "__main__":
    main()
