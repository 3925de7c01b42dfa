"""Throughput of the bundled decoder at batch sizes B: plain batched decoding against batched speculative decoding
(eval/batch_decoder.py ``speculative_generate_batch``), on the same MT-bench first turns and target, in one process.

The drafter is ``--drafter`` (a checkpoint folder, e.g. a quickstart run's ``checkpoints/final``), else a draft LM
built from the target's own layers ``--layers`` (with its embeddings, norm and LM head): an untrained self-draft,
whose acceptance is low. For each B the --n prompts are decoded in batches of B, plain and speculative alternating
chunk by chunk after an untimed warm-up, greedy; tokens/s = tokens emitted / wall seconds. Each row's output is
checked against its own B=1 plain decode of the same prompt (float32: a batch may round differently, which the
"match" column counts; list B=1 first).

    python benchmarks/batch_decode.py [--n 16] [--batch 1,4,16] [--max-new 64] [--draft-len 3]
        [--drafter RUN/checkpoints/final | --layers 0,29]

``--tree dynamic|static`` times tree decoding at each B > 1 instead: every row's tree drafted and verified as one
batch (one drafter forward per tree level for all rows, eval/proposers.py) against the same prompts decoded one at
a time (``speculative_generate``), alternated chunk by chunk. Static: the 6-node tree of the tests; dynamic: top-3,
depth 3, 8 nodes.

``--compaction`` times only the batch cache's compaction (kernels/kv.py ``compact_rows``) at the largest --batch
on CPU, on a cache of SmolLM2-135M's KV shape (30 layers, 3 KV heads, head dim 64, 256 slots) and a tiny one, 30%
of slots holes: the per-row loop it replaced against the vectorised gather/scatter (its CPU path), median of 15.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from draftsmith.eval.batch_decoder import speculative_generate_batch
from draftsmith.eval.contention import CpuShare
from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.eval.prompts import load_prompts
from draftsmith.kernels.kv import compact_rows
from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids
from draftsmith.models.registry import build_drafter, load_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="target model: a packaged alias or folder")
    ap.add_argument("--n", type=int, default=16, help="MT-bench first turns")
    ap.add_argument("--batch", default="1,4,16", help="batch sizes")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per prompt (greedy)")
    ap.add_argument("--draft-len", type=int, default=3, help="drafts per verify step (chain)")
    ap.add_argument("--layers", default="0,29", help="target layers the self-draft copies (no --drafter)")
    ap.add_argument("--drafter", default=None, help="a drafter checkpoint folder (registry load_drafter)")
    ap.add_argument("--optimize", type=int, default=1, help="fused, pre-packed matmuls (eval.optimize)")
    ap.add_argument("--tree", choices=["static", "dynamic"], help="time batched tree drafting against row by row")
    ap.add_argument(
        "--compaction",
        action="store_true",
        help="time only the batch cache compaction, per-row loop vs fused, at the largest --batch",
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    if a.compaction:
        return compaction(max(int(x) for x in a.batch.split(",")))
    loaded = load_model(a.target)
    target, tok = loaded.model.eval(), loaded.tokenizer
    if a.drafter:
        drafter = load_drafter(Path(a.drafter))[0].eval()
    else:
        layers = [int(x) for x in a.layers.split(",")]
        drafter = build_drafter("draft_lm", {"n_layers": len(layers), "init_layers": layers}, target).eval()
    if a.optimize:
        target.optimize_for_inference()
        drafter.optimize_for_inference()
    eos = stop_ids(loaded.path, tok)
    prompts = [torch.tensor(encode_chat(tok, first_turn(p.messages))) for p in load_prompts("mt_bench", n=a.n)]
    if a.tree:
        return trees(a, target, drafter, prompts, eos)
    ref = {}
    name = a.drafter or f"self-draft from layers {a.layers}"
    print(f"{a.n} MT-bench first turns, {a.max_new} new tokens max, greedy, draft_len {a.draft_len}, ", end="")
    print(f"threads {torch.get_num_threads()}, drafter {name}")
    print(f"{'B':>3} {'mode':>6} {'tok/s':>8} {'tokens':>7} {'s':>7} {'tau':>5} {'match':>6}")

    def batched(d):
        return lambda chunk, n: speculative_generate_batch(target, d, chunk, n, draft_len=a.draft_len, eos_ids=eos)

    def plain1(chunk, n):  # eval/decoder.py's batch-1 loops, timed beside the batched ones at B = 1
        return [autoregressive_generate(target, chunk[0], n, eos_ids=eos)], [None]

    def spec1(chunk, n):
        out, st = speculative_generate(target, drafter, chunk[0], n, draft_len=a.draft_len, eos_ids=eos)
        return [out], [st]

    share = CpuShare().start()
    for B in [int(x) for x in a.batch.split(",")]:
        modes = {"plain": batched(None), "spec": batched(drafter)}
        if B == 1:
            modes.update(plain1=plain1, spec1=spec1)
        for fn in modes.values():  # untimed: first calls at new shapes build oneDNN kernels
            fn(prompts[:B], 8)
        res = {m: [0, 0.0, 0, 0] for m in modes}  # tokens, seconds, accepted, verify forwards
        got: dict = {m: {} for m in modes}
        for k, i in enumerate(range(0, a.n, B)):
            chunk = prompts[i : i + B]
            for mode in list(modes)[:: 1 if k % 2 == 0 else -1]:  # alternate the order: noise hits both alike
                t0 = time.perf_counter()
                outs, stats = modes[mode](chunk, a.max_new)
                r = res[mode]
                r[1] += time.perf_counter() - t0
                for j, (o, st) in enumerate(zip(outs, stats)):
                    got[mode][i + j] = o
                    r[0] += len(o)
                    if st is not None:
                        r[2], r[3] = r[2] + st.accepted, r[3] + st.target_forwards
        if B == 1:
            ref = got["plain"]
        for mode, (toks, secs, acc, fwd) in res.items():
            tau = (acc + fwd) / fwd if fwd else 1.0
            match = sum(o == ref.get(k) for k, o in got[mode].items())
            print(f"{B:>3} {mode:>6} {toks / secs:8.1f} {toks:7d} {secs:7.1f} {tau:5.2f} {match:>3}/{a.n}", flush=True)
    other = share.stop()
    print(f"machine: {os.cpu_count()} CPUs; other processes used {other or 0:.0%} of them meanwhile")


def trees(a, target, drafter, prompts, eos) -> None:
    """Tree decoding at each B: the B rows as one batch against the same prompts one at a time (module docstring)."""
    from draftsmith.eval.tree import DynamicTree, tree_from_choices

    spec = {"static": tree_from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
            "dynamic": DynamicTree(top_k=3, depth=3, total_tokens=8)}[a.tree]  # fmt: skip

    def batched(chunk, n):
        return speculative_generate_batch(target, drafter, chunk, n, tree=spec, eos_ids=eos)

    def single(chunk, n):
        res = [speculative_generate(target, drafter, p, n, tree=spec, eos_ids=eos) for p in chunk]
        return [o for o, _ in res], [st for _, st in res]

    print(f"{a.tree} tree; {'B':>3} {'mode':>8} {'tok/s':>8} {'tokens':>7} {'s':>7} {'tau':>5}")
    share = CpuShare().start()
    for B in [int(x) for x in a.batch.split(",")]:
        modes = {"batched": batched, "single": single}
        for fn in modes.values():
            fn(prompts[:B], 8)
        res = {m: [0, 0.0, 0, 0] for m in modes}
        outs: dict = {m: [] for m in modes}
        for k, i in enumerate(range(0, a.n, B)):
            for mode in list(modes)[:: 1 if k % 2 == 0 else -1]:
                t0 = time.perf_counter()
                got, stats = modes[mode](prompts[i : i + B], a.max_new)
                r = res[mode]
                r[1] += time.perf_counter() - t0
                outs[mode] += got
                r[0] += sum(len(o) for o in got)
                r[2] += sum(st.accepted for st in stats)
                r[3] += sum(st.target_forwards for st in stats)
        same = sum(x == y for x, y in zip(outs["batched"], outs["single"]))
        for mode, (toks, secs, acc, fwd) in res.items():
            print(f"{B:>3} {mode:>8} {toks / secs:8.1f} {toks:7d} {secs:7.1f} {(acc + fwd) / fwd:5.2f}", flush=True)
        ratio = (res["batched"][0] / res["batched"][1]) / (res["single"][0] / res["single"][1])
        print(f"{B:>3} batched/single {ratio:.2f}x; outputs identical {same}/{len(outs['batched'])}")
    other = share.stop()
    print(f"machine: {os.cpu_count()} CPUs; other processes used {other or 0:.0%} of them meanwhile")


def compaction(B: int, reps: int = 15) -> None:
    """Median seconds of compact_rows, loop against fused, calls interleaved (the machine may be shared)."""
    print(f"compaction at B={B}, fp32, 30% holes, threads {torch.get_num_threads()}")
    shapes = {"SmolLM2-135M KV (30 layers, 3 heads, hd 64), 256 slots": (30, 3, 64, 256),
              "tiny (2 layers, 1 head, hd 16), 64 slots": (2, 1, 16, 64)}  # fmt: skip
    for name, (layers, heads, hd, slots) in shapes.items():
        g = torch.Generator().manual_seed(0)
        kv = torch.randn(2, layers, B, heads, slots, hd, generator=g)
        length = slots - 16
        valid = torch.rand(B, slots, generator=g) < 0.7
        valid[:, length:] = False
        S = int(valid.sum(1).max())
        times: dict = {"loop": [], "reference": []}
        for _ in range(reps + 1):  # the first round is a warm-up
            for impl, ts in times.items():
                k, v = kv.clone(), valid.clone()
                t0 = time.perf_counter()
                compact_rows(k, v, length, S, impl=impl)
                ts.append(time.perf_counter() - t0)
        loop, fused = (sorted(ts[1:])[reps // 2] for ts in times.values())
        print(f"{name}: loop {loop * 1e3:.2f} ms, fused {fused * 1e3:.2f} ms, loop/fused {loop / fused:.2f}x")


if __name__ == "__main__":
    main()
