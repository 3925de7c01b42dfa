"""Where an EAGLE decode's time goes: each step eager vs the eval decoder's fast path, per dtype.

An EAGLE decode runs verifies that also return the target's layer features and draft steps of the EAGLE drafter;
the eval decoder replays both from CUDA graphs (eval/graphs.py GraphedLlama with captured layers, GraphedEagle).
This script measures, round-robin in one process (eval/timing.py), for a SmolLM2-135M-shaped target (random weights:
only costs matter here) and an EAGLE-3 drafter built from it (one layer, 32k-row reduced head, as the shipped
recipe):

  * target: a decode step (T = 1), a verify of γ + 1 tokens, the same verify returning EAGLE's feature layers;
  * EAGLE: a root step (3 accepted tokens with their features, last position's logits), one chain draft step,
    and a whole chain block as the decoder drafts it (root + γ − 1 steps + greedy picks, eval/decoder.py);

each eager (plain modules) and fast (`eval.optimize` fused matmuls, plus CUDA graphs on CUDA: what `draftsmith eval`
runs), as milliseconds and as multiples of the fast target decode step. ``--profile`` adds the top ops of eager
draft steps per dtype (where a bf16 draft step spends its time next to an fp32 one).

    python benchmarks/experiments/eagle_steps.py                        # CUDA if present, fp32 and bf16
    python benchmarks/experiments/eagle_steps.py --device cpu --dtypes float32 --reps 20

It calls the decoder's drafting piece (eval/proposers.py ``FeatureRows.draft``, one row) to time one draft block on
its own.
"""

from __future__ import annotations

import argparse
import copy
import json
from types import SimpleNamespace

import torch

from draftsmith.eval.accept import Sampler
from draftsmith.eval.bench import fast_model
from draftsmith.eval.proposers import FeatureRows
from draftsmith.eval.timing import interleave, sync
from draftsmith.models.eagle import build_eagle
from draftsmith.models.llama import Llama, LlamaConfig

SMOLLM2 = dict(
    vocab_size=49152,
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    hidden_dim=1536,
    rope_theta=100000.0,
    max_seq_len=8192,
    tie_embeddings=True,
)
TINY = dict(vocab_size=2048, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=2048)


def build(shape: dict, device: str, dtype, draft_vocab: int):
    torch.manual_seed(0)
    with torch.device(device):
        target = Llama(LlamaConfig(**shape)).to(dtype).eval().requires_grad_(False)
    counts = torch.rand(shape["vocab_size"], generator=torch.Generator().manual_seed(1))
    drafter = build_eagle({"version": 3, "draft_vocab": draft_vocab}, target, counts=counts).to(device).eval()
    return target, drafter.requires_grad_(False)


def step_jobs(target, drafter, args, device: str) -> dict:
    """One callable per step for one (target, drafter) pair, eager or already made fast; run under no_grad."""
    g, ctx, dev = args.gamma, args.ctx, device
    max_len = cache_len(args)

    def ids(t):
        return torch.randint(0, 1000, (1, t), device=dev)

    jobs = {}
    with torch.no_grad():
        tcache = target.new_cache(1, max_len)
        target(ids(ctx), cache=tcache)  # the prompt (prefills run eagerly either way)
        x1, xg = ids(1), ids(g + 1)
        layers = drafter.capture_layers
        for name, x, kw in (
            ("decode", x1, {}),
            (f"verify {g + 1}", xg, {}),
            (f"verify {g + 1} + features", xg, {"capture_layers": layers}),
        ):

            def step(x=x, kw=kw):
                tcache.length = ctx
                target(x, cache=tcache, **kw)

            jobs[name] = step
        dcache = drafter.new_cache(1, max_len)
        d, dt = drafter.cfg.dim, drafter.fc.weight.dtype
        drafter.step(torch.randn(1, ctx, d, device=dev, dtype=dt), ids(ctx), cache=dcache)
        for name, t, last in (("eagle root 3", 3, True), ("eagle draft step", 1, False)):
            st, x = torch.randn(1, t, d, device=dev, dtype=dt), ids(t)

            def dstep(st=st, x=x, last=last):
                dcache.length = ctx
                drafter.step(st, x, cache=dcache, last_only=last)

            jobs[name] = dstep
        # A whole block as the decoder drafts it: root over the accepted token, γ - 1 fed drafts, greedy picks.
        prompt = ids(ctx)[0]
        feats = torch.randn(ctx, drafter.cfg.feature_dim, device=dev, dtype=dt)
        run = FeatureRows(target, drafter, max_len)
        row = SimpleNamespace(dpos=0, unread=prompt[1:], feats=feats, stop=None)  # as after a prefill
        run.rc.join(drafter.new_cache(1, 1), [0], 0)
        cur, sampler = ids(1)[0], Sampler()

        def pick(lg, live):
            return sampler.pick(lg[0])[0].view(1), None

        def block():
            run.draft([row], cur, [g], pick)
            # nothing accepted: roll back to the root, and the next root reads one pair
            run.rc.view.length = run.root_end
            row.unread, row.feats = cur.new_empty(0), feats[:1]

        jobs[f"chain block γ={g}"] = block
    return jobs


def cache_len(args) -> int:
    """Room for the prompt and every (warm-up and timed) chain block's commits."""
    return args.ctx + (args.reps + 3) * (args.gamma + 2) + 64


def profile_drafts(drafter, device: str, n: int = 20) -> str:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    dcache = drafter.new_cache(1, 512)
    d, dt = drafter.cfg.dim, drafter.fc.weight.dtype
    with torch.no_grad():
        drafter.step(
            torch.randn(1, 64, d, device=device, dtype=dt), torch.randint(0, 1000, (1, 64), device=device), cache=dcache
        )
        st, x = torch.randn(1, 1, d, device=device, dtype=dt), torch.randint(0, 1000, (1, 1), device=device)
        with profile(activities=acts) as prof:
            for _ in range(n):
                dcache.length = 64
                drafter.step(st, x, cache=dcache)
            sync(device)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--gamma", type=int, default=6, help="chain draft length (the verify is γ + 1 tokens)")
    ap.add_argument("--ctx", type=int, default=256, help="tokens already in the caches")
    ap.add_argument("--reps", type=int, default=50, help="timed repetitions per step (median reported)")
    ap.add_argument("--draft-vocab", type=int, default=32000, help="rows of the EAGLE-3 head")
    ap.add_argument("--tiny", action="store_true", help="a tiny config (smoke test)")
    ap.add_argument("--profile", action="store_true", help="also print the top ops of eager draft steps")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    shape = TINY if args.tiny else SMOLLM2
    ec = SimpleNamespace(optimize=True, cuda_graphs=True)
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"device {dev_name}, torch {torch.__version__}, target {'tiny' if args.tiny else 'SmolLM2-135M'}-shaped, "
        f"ctx {args.ctx}, γ {args.gamma}, median of {args.reps}"
    )
    results, notes = {}, []
    for dt in args.dtypes:
        dtype = getattr(torch, dt)
        target, drafter = build(shape, args.device, dtype, min(args.draft_vocab, shape["vocab_size"] // 2))
        if args.profile:
            print(f"\n--- eager EAGLE draft steps, {dt} ---\n{profile_drafts(drafter, args.device)}")
        max_len = cache_len(args)
        fast_t = fast_model(copy.deepcopy(target), ec, args.device, max_len)
        fast_d = fast_model(copy.deepcopy(drafter), ec, args.device, max_len)
        # Every step, eager and fast, in every round (3 warm-up rounds, then --reps), round-robin.
        jobs = {f"eager {k}": fn for k, fn in step_jobs(target, drafter, args, args.device).items()}
        jobs.update({f"fast {k}": fn for k, fn in step_jobs(fast_t, fast_d, args, args.device).items()})
        with torch.no_grad():
            times = interleave(jobs, warmup=3, repeats=args.reps, device=args.device)
        eager = {k.split(" ", 1)[1]: t.median for k, t in times.items() if k.startswith("eager ")}
        fast = {k.split(" ", 1)[1]: t.median for k, t in times.items() if k.startswith("fast ")}
        notes.append(f"{dt}: {times.note}")
        print(f"\n{dt}: {'step':28s} {'eager ms':>9s} {'fast ms':>8s} {'eager/fast':>10s} {'fast, decode steps':>18s}")
        for k in eager:
            print(
                f"{'':{len(dt) + 2}s}{k:28s} {eager[k] * 1e3:9.3f} {fast[k] * 1e3:8.3f} "
                f"{times.ratio(f'eager {k}', f'fast {k}'):10.2f} {times.ratio(f'fast {k}', 'fast decode'):18.3f}"
            )
        results[dt] = {"eager_s": eager, "fast_s": fast}
    if len(results) == 2:
        a, b = (results[d] for d in args.dtypes)
        print(f"\n{args.dtypes[1]} / {args.dtypes[0]}, per step (eager; fast):")
        for k in a["eager_s"]:
            print(f"  {k:28s} {b['eager_s'][k] / a['eager_s'][k]:6.2f}  {b['fast_s'][k] / a['fast_s'][k]:6.2f}")
    print("\n".join(notes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev_name, "torch": torch.__version__, "args": vars(args), **results}, f, indent=1)


if __name__ == "__main__":
    main()
