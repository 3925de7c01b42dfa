"""Peak memory of a KD loss step: naive (full (T, V) logits, autograd end to end) vs train/losses.py head_loss
(LM head + loss chunked over positions). Each variant runs in a fresh subprocess so peaks do not mix; the
result is the ratio, plus a check that both give the same loss and gradients.

Usage: python benchmarks/loss_memory.py [--tokens 2048] [--vocab 49152] [--dim 576] [--k 32] [--kind fkl]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one(variant: str, a) -> dict:
    import resource

    import torch
    import torch.nn.functional as F

    from draftsmith.train import losses

    dev = a.device
    g = torch.Generator().manual_seed(0)
    h = torch.randn(a.tokens, a.dim, generator=g).to(dev).requires_grad_(True)
    w = (torch.randn(a.vocab, a.dim, generator=g) * 0.05).to(dev).requires_grad_(True)
    t_logits = torch.randn(a.tokens, a.vocab, generator=g) * 2
    lp, ids = F.log_softmax(t_logits, -1).topk(a.k, -1)
    del t_logits
    teacher = losses.Teacher(labels=ids[:, 0].to(dev), topk_ids=ids.to(dev), topk_logprobs=lp.half().to(dev))
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _rss_mb()
    t0 = time.perf_counter()
    if variant == "naive":
        logits = h @ w.t()
        if a.kind == "ce":
            loss = losses.ce(logits, teacher.labels).mean()
        else:
            loss = losses.DIVERGENCES[a.kind](*teacher.log_pair(logits)).mean()
    else:
        loss = losses.head_loss(h, w, teacher, losses.LossSpec(kind=a.kind, chunk=a.chunk))
    loss.backward()
    if dev.startswith("cuda"):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "peak_mb": peak - base, "seconds": time.perf_counter() - t0, "loss": float(loss),
            "grad_h_norm": float(h.grad.norm()), "grad_w_norm": float(w.grad.norm())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="trained positions T")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary V (SmolLM2: 49152)")
    ap.add_argument("--dim", type=int, default=576, help="hidden size D (SmolLM2-135M: 576)")
    ap.add_argument("--k", type=int, default=32, help="stored teacher top-k")
    ap.add_argument("--kind", default="fkl", help="loss kind (train.loss.kind)")
    ap.add_argument("--chunk", type=int, default=256, help="positions per chunk for head_loss")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(one(a.variant, a)))
        return
    res = {}
    for v in ("naive", "chunked"):
        cmd = [sys.executable, __file__, "--variant", v] + [f"--{k}={getattr(a, k)}" for k in
                                                            ("tokens", "vocab", "dim", "k", "kind", "chunk", "device")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        res[v] = json.loads(out)
        print(f"{v:8s} peak +{res[v]['peak_mb']:.0f} MB  {res[v]['seconds']:.2f} s  loss {res[v]['loss']:.6f}  "
              f"|grad h| {res[v]['grad_h_norm']:.6f}  |grad W| {res[v]['grad_w_norm']:.6f}")
    n, c = res["naive"], res["chunked"]
    print(f"T={a.tokens} V={a.vocab} D={a.dim} k={a.k} kind={a.kind} chunk={a.chunk} device={a.device}: "
          f"peak memory chunked/naive = {c['peak_mb'] / n['peak_mb']:.3f}, time chunked/naive = "
          f"{c['seconds'] / n['seconds']:.2f}, loss rel diff {abs(c['loss'] - n['loss']) / abs(n['loss']):.1e}")


if __name__ == "__main__":
    main()
