"""Peak memory and time of one KD loss step (forward + backward through the LM head), four ways on the same
random inputs: naive (full (T, V) logits, autograd end to end) vs train/losses.py head_loss (LM head + loss
chunked over positions), with each chunk's gradient through autograd ("unfused") or from the in-place softmax
passes of kernels/softmax.py ("chunked", the default: train.loss.fused), and with the vocabulary in blocks too
("blocked": train.loss.vocab_chunk). Each variant runs in a fresh subprocess, one after the other, so peaks do
not mix.

Reading the output: one line per variant (peak memory above the inputs, seconds, loss, gradient norms), then the
ratios: peak memory and time of chunked / naive, fused / unfused chunks, and vocabulary blocks / chunks, with the
loss's relative difference for each pair (all variants compute the same loss and gradients, to rounding). The
last line names the machine and the largest share of its CPU other processes took while a variant was timed.

--teacher topk: stored top-k + tail (train.loss.teacher=records); --teacher target: the full target distribution
from its final hidden states (T, D) and LM head (V, D) (teacher=target), where the teacher's logits are chunked
(and blocked) as well.

Usage: python benchmarks/loss_memory.py [--tokens 2048] [--vocab 49152] [--dim 576] [--k 32] [--kind fkl]
       [--teacher topk|target] [--vocab-chunk 4096] [--device cuda] [--reps 10]
On CPU one step is timed and the peak is the process's RSS; on CUDA the peak is the allocator's and the time is the
median of --reps steps after an untimed one (Triton compiles its kernels there; eval/timing.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from draftsmith.eval.contention import CpuShare
from draftsmith.eval.timing import machine_note, time_call


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def _reset_peak() -> float:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM); returns the RSS to measure from."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_mb("VmRSS")


def one(variant: str, a) -> dict:
    import torch
    import torch.nn.functional as F

    from draftsmith.train import losses

    dev = a.device
    g = torch.Generator().manual_seed(0)
    h = torch.randn(a.tokens, a.dim, generator=g).to(dev).requires_grad_(True)
    w = (torch.randn(a.vocab, a.dim, generator=g) * 0.05).to(dev).requires_grad_(True)
    if a.teacher == "target":  # the target's final hidden states and head: logits made chunk by chunk
        h_t = torch.randn(a.tokens, a.dim, generator=g).to(dev)
        w_t = (torch.randn(a.vocab, a.dim, generator=g) * 0.1).to(dev)
        labels = torch.randint(0, a.vocab, (a.tokens,), generator=g).to(dev)
        teacher = losses.Teacher(labels=labels, hidden=h_t, head=w_t)
    else:  # Teacher top-k built 64 rows at a time (no (T, V) teacher tensor in any variant).
        lp, ids = map(
            torch.cat,
            zip(
                *(
                    F.log_softmax(torch.randn(min(64, a.tokens - i), a.vocab, generator=g) * 2, -1).topk(a.k, -1)
                    for i in range(0, a.tokens, 64)
                )
            ),
        )
        teacher = losses.Teacher(labels=ids[:, 0].to(dev), topk_ids=ids.to(dev), topk_logprobs=lp.half().to(dev))
    cuda = dev.startswith("cuda")

    def step():
        h.grad = w.grad = None
        if variant == "naive":
            logits = h @ w.t()
            if a.kind == "ce":
                loss = losses.ce(logits, teacher.labels).mean()
            else:
                loss = losses.DIVERGENCES[a.kind](*teacher.log_pair(logits)).mean()
        else:
            spec = losses.LossSpec(
                kind=a.kind,
                chunk=a.chunk,
                fused=variant != "unfused",
                vocab_chunk=a.vocab_chunk if variant == "blocked" else 0,
            )
            loss = losses.head_loss(h, w, teacher, spec)
        loss.backward()
        return loss

    if cuda:
        # GPU: one untimed step first (Triton JIT, cuBLAS handles), then the median of --reps timed steps.
        step()
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
        with CpuShare() as meter:
            t = time_call(step, warmup=0, repeats=a.reps, device=dev)
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:  # one step: a second one would start from the first one's freed memory
        base = _reset_peak()
        with CpuShare() as meter:
            t = time_call(step, warmup=0, repeats=1)
        peak = _status_mb("VmHWM")
    loss, seconds = t.last, t.median
    return {
        "variant": variant,
        "peak_mb": peak - base,
        "seconds": seconds,
        "other_cpu": meter.other,
        "loss": float(loss),
        "grad_h_norm": float(h.grad.norm()),
        "grad_w_norm": float(w.grad.norm()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="trained positions T")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary V (SmolLM2: 49152)")
    ap.add_argument("--dim", type=int, default=576, help="hidden size D (SmolLM2-135M: 576)")
    ap.add_argument("--k", type=int, default=32, help="stored teacher top-k")
    ap.add_argument(
        "--kind",
        default="fkl",
        choices=["ce", "fkl", "rkl", "jsd", "tvd", "neg_log_alpha", "lk", "tvdpp_full"],
        help="loss kind (train.loss.kind)",
    )
    ap.add_argument("--chunk", type=int, default=256, help="positions per chunk for head_loss")
    ap.add_argument(
        "--teacher",
        default="topk",
        choices=["topk", "target"],
        help="stored top-k + tail, or the full target distribution from hidden states + head",
    )
    ap.add_argument("--vocab-chunk", type=int, default=4096, help="vocabulary block of the 'blocked' variant")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--reps", type=int, default=10, help="timed steps on CUDA (median; after one untimed step)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(one(a.variant, a)))
        return
    res = {}
    for v in ("naive", "unfused", "chunked", "blocked"):
        keys = ("tokens", "vocab", "dim", "k", "kind", "chunk", "teacher", "vocab_chunk", "device", "reps")
        cmd = [sys.executable, __file__, "--variant", v] + [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in keys]
        # glibc keeps freed heap memory resident, which would hide later allocations from RSS; a fixed, low
        # mmap threshold makes every large tensor its own mapping, returned on free, so RSS tracks live tensors.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout.strip().splitlines()[-1]
        res[v] = json.loads(out)
        print(
            f"{v:8s}  peak +{res[v]['peak_mb']:.0f} MB  {res[v]['seconds']:.2f} s  loss {res[v]['loss']:.6f}  "
            f"|grad h| {res[v]['grad_h_norm']:.6f}  |grad W| {res[v]['grad_w_norm']:.6f}"
        )
    n, u, c, b = res["naive"], res["unfused"], res["chunked"], res["blocked"]
    print(
        f"T={a.tokens} V={a.vocab} D={a.dim} k={a.k} kind={a.kind} teacher={a.teacher} chunk={a.chunk} "
        f"device={a.device}: "
        f"peak memory chunked/naive = {c['peak_mb'] / n['peak_mb']:.3f}, time chunked/naive = "
        f"{c['seconds'] / n['seconds']:.2f}, loss rel diff {abs(c['loss'] - n['loss']) / abs(n['loss']):.1e}"
    )
    print(
        f"fused vs unfused chunks: peak memory {c['peak_mb'] / u['peak_mb']:.3f}, time "
        f"{c['seconds'] / u['seconds']:.2f}, loss rel diff {abs(c['loss'] - u['loss']) / abs(u['loss']):.1e}"
    )
    print(
        f"vocabulary blocks of {a.vocab_chunk} vs chunks: peak memory {b['peak_mb'] / c['peak_mb']:.3f} "
        f"({b['peak_mb'] / n['peak_mb']:.3f} of naive), time {b['seconds'] / c['seconds']:.2f}, "
        f"loss rel diff {abs(b['loss'] - c['loss']) / abs(c['loss']):.1e}"
    )
    others = [r["other_cpu"] for r in res.values() if r["other_cpu"] is not None]
    print(machine_note(a.device, max(others) if others else None) + " (the most of any variant)")


if __name__ == "__main__":
    main()
