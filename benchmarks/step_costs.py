"""Side-by-side step costs that bound speculative speedup on this machine: one target decode step vs a verify
forward over k+1 tokens, and one draft step, all measured in one run (ratios, not absolute times, are the
result). Usage: python benchmarks/step_costs.py [--target smollm2-135m-instruct] [--drafter CKPT] [--k 1 2 3 4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftsmith.models.hf import load_model
from draftsmith.models.registry import load_drafter


def step_time(model, ctx: int, t: int, device: str, reps: int) -> float:
    """Median seconds of one cached forward of t tokens after a ctx-token prefix."""
    cache = model.new_cache(1, ctx + t + 1)
    ids = torch.randint(100, 1000, (1, ctx), device=device)
    with torch.no_grad():
        model(ids, cache=cache)
        times = []
        for _ in range(reps):
            cache.length = ctx
            x = torch.randint(100, 1000, (1, t), device=device)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(x, cache=cache)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="runs/quickstart/checkpoints/final")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    tgt = load_model(a.target, dtype, a.device).model
    base = step_time(tgt, a.ctx, 1, a.device, a.reps)
    print(f"device {a.device}, dtype {dtype}, ctx {a.ctx}, threads {torch.get_num_threads()}")
    print(f"target decode step: {base * 1e3:.2f} ms")
    for k in a.k:
        v = step_time(tgt, a.ctx, k + 1, a.device, a.reps)
        print(f"verify k={k} ({k + 1} tokens): {v * 1e3:.2f} ms = {v / base:.2f}x a decode step")
    try:
        drafter, _ = load_drafter(a.drafter, dtype=dtype, device=a.device)
    except Exception as e:  # the drafter is optional: report and stop
        print(f"no drafter ({e})")
        return
    d = step_time(drafter, a.ctx, 1, a.device, a.reps)
    print(f"draft step: {d * 1e3:.2f} ms = c = {d / base:.3f} of a target step "
          f"({drafter.num_params() / 1e6:.1f}M vs {tgt.num_params() / 1e6:.1f}M params)")


if __name__ == "__main__":
    main()
