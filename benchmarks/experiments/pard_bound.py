"""What bounds a PARD draft's speedup on this CPU: the cost of one speculative step against a target decode step.

A chain step of γ drafts costs the target's verify of γ + 1 tokens plus the drafting: an autoregressive draft LM
runs γ forwards (the root over its unread token and the current one, then γ − 1 one-token feeds); a PARD draft runs
ONE forward over the same tokens and γ − 1 mask tokens. Speedup = τ / (step cost in decode steps), so a goal of S×
needs τ ≥ S · cost. This script times, round-robin in one process (eval/timing.py), SmolLM2-135M-shaped models with
random weights (only costs matter) after a 256-token context:

  * target: a decode step (T = 1) and a verify of γ + 1 tokens;
  * drafts of depth 2 / 8 / 16 layers, with the full 49,152-row LM head and an 8,192-row one: the AR chain's γ
    forwards and PARD's one forward;

and prints each step's cost in decode steps and the τ it needs for --goal. Compare with the τ the same depths reach
(benchmarks/RESULTS.md, "Draft LM size"): PARD's acceptance is at most an AR draft's of the same depth.

    python benchmarks/experiments/pard_bound.py --gamma 3 --goal 1.3
"""

from __future__ import annotations

import argparse

import torch

from draftsmith.eval.timing import interleave
from draftsmith.models.llama import Llama, LlamaConfig

SMOL = dict(dim=576, n_heads=9, n_kv_heads=3, hidden_dim=1536, rope_theta=100000.0, tie_embeddings=True)


def model(n_layers: int, head_vocab: int | None = None) -> Llama:
    tie = head_vocab is None  # a reduced head is its own matrix
    cfg = LlamaConfig(
        vocab_size=49152, n_layers=n_layers, head_vocab_size=head_vocab, **{**SMOL, "tie_embeddings": tie}
    )
    torch.manual_seed(0)
    return Llama(cfg).eval().optimize_for_inference()  # the decoder's fast path (eval.optimize)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gamma", type=int, default=3, help="drafts per step")
    ap.add_argument("--goal", type=float, default=1.3, help="speedup over own plain decoding to price in τ")
    ap.add_argument("--depths", default="2,8,16", help="draft depths (layers), comma-separated")
    ap.add_argument("--context", type=int, default=256, help="tokens already in every cache")
    ap.add_argument("--reps", type=int, default=20, help="timed rounds")
    args = ap.parse_args()
    g, ctx = args.gamma, args.context
    ids = torch.randint(0, 49152, (1, ctx + g + 1))

    def after_context(m: Llama):
        cache = m.new_cache(1, ctx + 2 * g + 4)
        with torch.no_grad():
            m(ids[:, :ctx], cache=cache)
        return cache

    def call(m, cache, T):
        def run():
            with torch.no_grad():
                m(ids[:, ctx : ctx + T], cache=cache)
            cache.length = ctx

        return run

    def ar_chain(m, cache):
        def run():
            with torch.no_grad():
                m(ids[:, ctx : ctx + 2], cache=cache)  # root: an unread token and the current one
                for i in range(g - 1):
                    m(ids[:, ctx + 2 + i : ctx + 3 + i], cache=cache)
            cache.length = ctx

        return run

    target = model(30)
    tc = after_context(target)
    fns = {"target decode": call(target, tc, 1), f"target verify {g + 1}": call(target, tc, g + 1)}
    for d in [int(x) for x in args.depths.split(",")]:
        for hv, name in ((None, "49k"), (8192, "8k")):
            m = model(d, hv)
            c = after_context(m)
            fns[f"AR draft {d}L {name}"] = ar_chain(m, c)
            fns[f"PARD draft {d}L {name}"] = call(m, c, 2 + g - 1)  # unread + cur + γ-1 masks in one forward
    torch.set_grad_enabled(False)
    res = interleave(fns, warmup=2, repeats=args.reps)
    unit, verify = res["target decode"].median, res.ratio(f"target verify {g + 1}", "target decode")
    other = "unknown" if res.other_cpu is None else f"{res.other_cpu:.1%}"
    print(f"threads {torch.get_num_threads()}, γ = {g}, target decode {unit * 1e3:.1f} ms, verify {verify:.2f} steps, "
          f"other processes {other} of the CPU")  # fmt: skip
    print(f"{'draft':<22}{'draft cost':>11}{'step cost':>11}{f'τ for {args.goal}x':>12}")
    for k in res:
        if "draft" in k:
            c = res.ratio(k, "target decode")
            print(f"{k:<22}{c:>11.3f}{verify + c:>11.3f}{args.goal * (verify + c):>12.2f}")


if __name__ == "__main__":
    main()
