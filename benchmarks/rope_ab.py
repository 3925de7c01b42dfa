"""Side-by-side A/B of the decoder's interleaved RoPE (models/llama.py ``Attention.interleave_rope``): the same
SmolLM2 target fused and pre-packed with the old rotate-half RoPE and with the complex-multiply one, alternating in
one process (ctx 256, median of 15 forwards, 3 rounds), for a decode step and a 3-token verify.
Usage: python benchmarks/rope_ab.py
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from draftsmith.models.llama import fuse_for_inference
from draftsmith.models.loading import load_model


def step(model, T: int, ctx: int = 256, reps: int = 15) -> tuple[float, torch.Tensor]:
    """Median seconds of a cached forward of T tokens after ctx tokens, and its logits."""
    cache = model.new_cache(1, ctx + T + 1)
    ts = []
    with torch.no_grad():
        model(torch.arange(100, 100 + ctx)[None], cache=cache)
        x = torch.arange(500, 500 + T)[None]  # the same tokens for both models
        for _ in range(reps):
            cache.length = ctx
            t0 = time.perf_counter()
            out = model(x, cache=cache)
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def main() -> None:
    base = load_model("smollm2-135m-instruct", torch.float32, "cpu").model
    old = copy.deepcopy(base)  # fused and pre-packed exactly as before: no q/k reordering
    fuse_for_inference(old, [(b.self_attn, b.mlp) for b in old.layers])
    new = copy.deepcopy(base).optimize_for_inference()
    assert new._rope_interleaved and not getattr(old, "_rope_interleaved", False)
    for T in (1, 3):
        for r in range(3):
            (t_old, y_old), (t_new, y_new) = step(old, T), step(new, T)
            print(f"T={T} round {r}: old {t_old * 1e3:.1f} ms, interleaved {t_new * 1e3:.1f} ms, "
                  f"ratio {t_old / t_new:.3f}, max |logit diff| {(y_old - y_new).abs().max():.2e}", flush=True)


if __name__ == "__main__":
    main()
