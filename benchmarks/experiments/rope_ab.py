"""A/B of the decoder's interleaved RoPE (models/llama.py ``Attention.interleave_rope``) against rotate-half RoPE:
the same SmolLM2 target fused and pre-packed both ways (``fuse_for_inference`` alone keeps rotate-half;
``optimize_for_inference`` reorders q/k for the complex-multiply form), timed round-robin in one process for a
decode step and a 3-token verify (ctx 256). Prints per round each side's time per forward, the ratio
rotate-half / interleaved (> 1: interleaved is faster) and the largest logit difference between the two.

Usage: python benchmarks/experiments/rope_ab.py [--reps 15] [--rounds 3]
"""

from __future__ import annotations

import argparse
import copy

import torch

from draftsmith.eval.timing import interleave
from draftsmith.models.llama import fuse_for_inference
from draftsmith.models.loading import load_model


def forward(model, T: int, ctx: int):
    """A callable: one cached forward of T fixed tokens after a ctx-token prefix (the same input for both)."""
    cache = model.new_cache(1, ctx + T + 1)
    with torch.no_grad():
        model(torch.arange(100, 100 + ctx)[None], cache=cache)
    x = torch.arange(500, 500 + T)[None]

    def fn():
        cache.length = ctx
        with torch.no_grad():
            return model(x, cache=cache)

    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15, help="forwards per round and side (their mean is the round's)")
    ap.add_argument("--rounds", type=int, default=3, help="round-robin rounds (one line each)")
    ap.add_argument("--ctx", type=int, default=256, help="tokens already in the KV cache")
    a = ap.parse_args()
    base = load_model("smollm2-135m-instruct", torch.float32, "cpu").model
    old = copy.deepcopy(base)  # fused and pre-packed, no q/k reordering: rotate-half RoPE
    fuse_for_inference(old, [(b.self_attn, b.mlp) for b in old.layers])
    new = copy.deepcopy(base).optimize_for_inference()
    assert new._rope_interleaved and not getattr(old, "_rope_interleaved", False)
    for T in (1, 3):
        t = interleave(
            {"rotate-half": forward(old, T, a.ctx), "interleaved": forward(new, T, a.ctx)},
            warmup=1,
            repeats=a.rounds,
            number=a.reps,
        )
        diff = (t["rotate-half"].last - t["interleaved"].last).abs().max()
        for r, (x, y) in enumerate(zip(t["rotate-half"].times, t["interleaved"].times)):
            print(f"T={T} round {r}: rotate-half {x * 1e3:.1f} ms, interleaved {y * 1e3:.1f} ms, ratio {x / y:.3f}")
        print(
            f"T={T}: rotate-half / interleaved {t.ratio('rotate-half', 'interleaved'):.3f} (median of rounds), "
            f"max |logit diff| {diff:.2e}",
            flush=True,
        )
    print(t.note)


if __name__ == "__main__":
    main()
