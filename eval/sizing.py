"""Tree sizes for the hardware (docs/algorithms.md A11.5): Sequoia's choice of the tree that maximises expected
accepted tokens per unit of step cost, with the target's verify cost of every tree size measured on this device.

A step costs the verify of n + 1 tokens (measured, in decode steps) plus the drafter's levels (``draft_cost`` per
level, a fraction of a decode step: about 0 for heads, ``benchmarks/step_costs.py``' c for a draft LM or EAGLE).
For each size n and depth limit D, the best tree is the n most valuable paths of at most D levels (values: products
of the logged rank accuracies, ``choices_from_accuracies``); that is optimal under its independence model, because a
path is never worth more than its prefix. The (n, D) with the highest expected tau per step cost is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.eval.timing import interleave
from draftsmith.eval.tree import choices_from_accuracies, expected_tau


def cached_forward(model, ctx: int, t: int, device: str):
    """A callable: one cached forward of t fixed tokens after a ctx-token prefix (prefilled once, here), returning
    its logits (the tokens are fixed, so two models given the same call see the same input)."""
    cache = model.new_cache(1, ctx + t + 1)
    x = (torch.arange(t, device=device) * 7 % 61 + 1)[None]  # ids every vocabulary has: the values set no cost
    with torch.no_grad():
        model((torch.arange(ctx, device=device) * 5 % 61 + 1)[None], cache=cache)

    def fn():
        cache.length = ctx
        with torch.no_grad():
            return model(x, cache=cache)

    return fn


def verify_costs(model, sizes: Sequence[int], ctx: int = 256, reps: int = 10, rounds: int = 3, device: str = "cpu"):
    """Each size n's verify (n + 1 tokens after a ctx-token cache) in decode steps (one token), every forward timed
    round-robin in one process (eval/timing.py) -> ({n: cost}, the machine and CPU-share note)."""
    jobs = {"decode": cached_forward(model, ctx, 1, device)}
    jobs.update({f"n{n}": cached_forward(model, ctx, n + 1, device) for n in sorted(set(sizes))})
    t = interleave(jobs, warmup=1, repeats=rounds, number=reps, device=device)
    return {n: t.ratio(f"n{n}", "decode") for n in sizes}, t.note


def sized_trees(acc: Sequence[Sequence[float]], costs: dict[int, float], draft_cost: float = 0.0) -> list[dict]:
    """Per size n of ``costs`` ({n: verify cost in decode steps}): the depth limit whose best tree has the highest
    expected tau per step cost -> rows {nodes, depth, tau, cost, speed (tau / cost), choices}, in size order."""
    rows = []
    for n in sorted(costs):
        best = None
        for limit in range(1, len(acc) + 1):
            choices = choices_from_accuracies(acc[:limit], n)
            depth = max(len(c) for c in choices)
            cost = costs[n] + depth * draft_cost
            tau = expected_tau(acc, choices)
            row = {"nodes": n, "depth": depth, "tau": tau, "cost": cost, "speed": tau / cost, "choices": choices}
            if best is None or row["speed"] > best["speed"] + 1e-12:
                best = row
        rows.append(best)
    return rows


def load_target(run_dir, device: str):
    """The target of the run's recipe.yaml, as the decoder runs it (fused, pre-packed matmuls)."""
    from pathlib import Path

    from draftsmith.models.loading import load_model
    from draftsmith.recipes.loader import load_recipe
    from draftsmith.runtime import resolve_dtype

    recipe = load_recipe(Path(run_dir) / "recipe.yaml", [])
    t = recipe.target
    model = load_model(t.model, resolve_dtype(t.dtype, device), device, t.trust_remote_code, t.revision, t.backend)
    model = model.model
    if hasattr(model, "optimize_for_inference"):
        model.optimize_for_inference()
    return model
