"""Side-by-side step costs that bound speculative speedup on this machine: one target decode step vs a verify
forward over k+1 tokens (and a tree-sized one), and one draft step, all measured in one run (ratios, not absolute
times, are the result). Models run as the eval decoder runs them (``optimize_for_inference``: fused, pre-packed
matmuls) unless --no-optimize.

--pack-ab: the same target pre-packed for oneDNN with batch hint 1 (before session 8) and with the current hint
(``FusedLinear.pack_batch``), alternating in one process for 3 rounds; prints each forward's time under both and
the max logit difference.

--head-vocab N ...: also time one Medusa-style head step (ResBlock + LM head + the scatter into the target's
vocabulary, what ``logits_after`` costs the decoder per draft) with the full LM head and with N-row reduced heads
(drafter.draft_vocab); random weights, since only the shapes set the cost.

Usage: python benchmarks/step_costs.py [--target smollm2-135m-instruct] [--drafter CKPT] [--k 1 2 3 4 6 48]
                                       [--head-vocab 8192 4096]
       python benchmarks/step_costs.py --pack-ab
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from draftsmith.models.llama import FusedLinear
from draftsmith.models.loading import load_model
from draftsmith.models.registry import load_drafter


def step_time(model, ctx: int, t: int, device: str, reps: int) -> tuple[float, torch.Tensor]:
    """Median seconds of one cached forward of t tokens after a ctx-token prefix, and its logits. The tokens are
    fixed, so two models given the same call see the same input."""
    cache = model.new_cache(1, ctx + t + 1)
    ids = torch.arange(100, 100 + ctx, device=device)[None]
    x = torch.arange(500, 500 + t, device=device)[None]
    with torch.no_grad():
        model(ids, cache=cache)
        times = []
        for _ in range(reps):
            cache.length = ctx
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(x, cache=cache)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out


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


def head_time(heads, dim: int, device: str, reps: int) -> float:
    h, cur = torch.randn(dim, device=device), torch.tensor([100], device=device)
    times = []
    with torch.no_grad():
        heads.logits_after(h, [cur])
        for _ in range(reps):
            t0 = time.perf_counter()
            heads.logits_after(h, [cur])
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pack_ab(base, a) -> None:
    current = FusedLinear.pack_batch
    FusedLinear.pack_batch = 1
    old = copy.deepcopy(base).optimize_for_inference()
    FusedLinear.pack_batch = current
    new = copy.deepcopy(base).optimize_for_inference()
    print(f"oneDNN pack hint 1 vs {current}, ctx {a.ctx}, threads {torch.get_num_threads()}, median of {a.reps}")
    print(f"| tokens | hint 1 (ms) | hint {current} (ms) | hint 1 / hint {current} | max logit diff |")
    print("|---|---|---|---|---|")
    for t in [1] + [k + 1 for k in a.k]:
        rows = []
        for _ in range(3):  # alternate, so drift on a shared machine hits both sides
            (t_old, y_old), (t_new, y_new) = step_time(old, a.ctx, t, "cpu", a.reps), step_time(new, a.ctx, t, "cpu",
                                                                                                 a.reps)
            rows.append((t_old, t_new, (y_old - y_new).abs().max().item()))
        t_old, t_new = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        print(f"| {t} | {t_old * 1e3:.1f} | {t_new * 1e3:.1f} | {t_old / t_new:.2f} | "
              f"{max(r[2] for r in rows):.1e} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="runs/quickstart/checkpoints/final", help="draft LM checkpoint (optional)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 6, 48],
                    help="draft lengths to verify (k + 1 tokens; 48 ~ a dynamic tree's node budget)")
    ap.add_argument("--ctx", type=int, default=256, help="tokens already in the KV cache")
    ap.add_argument("--reps", type=int, default=30, help="forwards per measurement (the median is reported)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all measurements (median)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-optimize", action="store_true", help="time the plain (unfused) model instead")
    ap.add_argument("--pack-ab", action="store_true", help="CPU: A/B the oneDNN pack hint (see above)")
    ap.add_argument("--head-vocab", type=int, nargs="*", default=[8192, 4096],
                    help="reduced head vocabularies to time next to the full one (empty: no head timings)")
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
    # Every measurement in every round, interleaved: a machine that speeds up or slows down during the run
    # shifts all of them alike, and the medians over rounds are compared.
    jobs = {"decode": lambda: step_time(tgt, a.ctx, 1, a.device, a.reps)[0]}
    jobs.update({f"verify {k}": (lambda k=k: step_time(tgt, a.ctx, k + 1, a.device, a.reps)[0]) for k in a.k})
    jobs.update({f"head {n}": (lambda m=m: head_time(m, tgt.cfg.dim, a.device, a.reps)) for n, m in heads.items()})
    if drafter is not None:
        jobs["draft"] = lambda: step_time(drafter, a.ctx, 1, a.device, a.reps)[0]
    times = {name: [] for name in jobs}
    for _ in range(a.rounds):
        for name, job in jobs.items():
            times[name].append(job())
    t = {name: statistics.median(v) for name, v in times.items()}
    base = t["decode"]
    print(f"device {a.device}, dtype {dtype}, ctx {a.ctx}, threads {torch.get_num_threads()}, "
          f"optimized {not a.no_optimize}, median of {a.reps} forwards, median of {a.rounds} interleaved rounds")
    print(f"target decode step: {base * 1e3:.2f} ms (rounds: {' '.join(f'{x * 1e3:.1f}' for x in times['decode'])})")
    for k in a.k:
        v = t[f"verify {k}"]
        print(f"verify k={k} ({k + 1} tokens): {v * 1e3:.2f} ms = {v / base:.2f}x a decode step")
    for n in heads:
        h = t[f"head {n}"]
        print(f"head step, {n}-token LM head: {h * 1e3:.2f} ms = {h / base:.3f} of a target step")
    if drafter is not None:
        d = t["draft"]
        print(f"draft step: {d * 1e3:.2f} ms = c = {d / base:.3f} of a target step "
              f"({drafter.num_params() / 1e6:.1f}M vs {tgt.num_params() / 1e6:.1f}M params)")


if __name__ == "__main__":
    main()
