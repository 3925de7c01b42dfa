"""What drafting an EAGLE-2-style dynamic tree costs per decode step, next to the other ways the decoder drafts,
on a tiny drafter where Python, launches and host syncs, not the model, set the cost (the regime of a small drafter
on a GPU).

Four decodes of the same prompt run round-robin in one process (eval/timing.py), --rounds timed rounds after one
untimed round, through the public decoders only:
  * dynamic tree: ``tree_speculative_generate`` with ``DynamicTree(top_k, depth, nodes)``, the drafter as is;
  * dynamic tree, static-shape drafter: the same with the drafter wrapped as the eval decoder runs it
    (eval/graphs.py ``graph_decoding``: each tree drafted by one captured CUDA graph on cuda; uncaptured elsewhere);
  * static tree: ``tree_speculative_generate`` over a fixed tree of the same node count (the ``nodes`` best paths
    by rank sum, children per node <= top_k, depth <= depth);
  * chain: ``speculative_generate`` with draft_len = depth.
Target and drafter are tiny random float32 Llamas, one CPU thread. Every output is checked against the target's
greedy AR decoding.

The measure is the decoder's own drafting time (``DecodeStats.draft_time_s``, synchronised) per verify step, so
the target's cost does not enter it. Reading the output: per row, ms of drafting per step (median of the rounds,
each round's values after it), nodes drafted per step, τ, and the row's drafting time as a multiple of the
dynamic tree's (paired by round). The last line names the machine and how much of its CPU other processes took
meanwhile. --profile adds an operator profile of one whole tree decode per drafter form (aten ops, kernel
launches, graph replays and syncs per step: drafting and the tiny target's verify together).

    python benchmarks/dynamic_tree_draft.py [--device cpu] [--rounds 5] [--new-tokens 64] [--profile]
"""

from __future__ import annotations

import argparse
import time

import torch

from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.eval.graphs import graph_decoding
from draftsmith.eval.timing import interleave, sync
from draftsmith.eval.tree import DynamicTree, tree_from_choices
from draftsmith.eval.tree_decoder import tree_speculative_generate
from draftsmith.models.llama import Llama, LlamaConfig

TINY = LlamaConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=1024)


def tiny_model(seed: int, device: str) -> Llama:
    torch.manual_seed(seed)
    return Llama(TINY).float().to(device).eval().requires_grad_(False)


def static_choices(top_k: int, depth: int, nodes: int) -> list[list[int]]:
    """The ``nodes`` paths of child ranks with the smallest rank sum + length (ranks < top_k, length <= depth):
    a parent always sorts before its children, so every prefix is in the list."""
    paths, frontier = [], [()]
    for _ in range(depth):
        frontier = [p + (r,) for p in frontier for r in range(top_k)]
        paths += frontier
        if len(paths) > 50 * nodes:  # enough candidates: deeper levels only add longer, costlier paths
            break
    paths.sort(key=lambda p: (sum(p) + len(p), len(p), p))
    return [list(p) for p in paths[:nodes]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--top-k", type=int, default=8, help="dynamic tree: children per expanded node (and static)")
    ap.add_argument("--depth", type=int, default=6, help="dynamic tree depth; the chain drafts this many tokens")
    ap.add_argument("--nodes", type=int, default=48, help="draft nodes per tree (dynamic and static)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per decode")
    ap.add_argument("--rounds", type=int, default=5, help="timed round-robin rounds (median reported)")
    ap.add_argument("--profile", action="store_true", help="also profile one tree decode per drafter form")
    a = ap.parse_args()
    torch.set_num_threads(1)
    dev = a.device
    target, drafter = tiny_model(0, dev), tiny_model(3, dev)
    graphed = graph_decoding(tiny_model(3, dev), TINY.max_seq_len)
    prompt = torch.arange(1, 30, device=dev)
    dyn = DynamicTree(top_k=a.top_k, depth=a.depth, total_tokens=a.nodes)
    static = tree_from_choices(static_choices(a.top_k, a.depth, a.nodes))
    n = a.new_tokens
    jobs = {
        "dynamic tree": lambda: tree_speculative_generate(target, drafter, prompt, n, dyn),
        "dynamic tree, static-shape drafter": lambda: tree_speculative_generate(target, graphed, prompt, n, dyn),
        f"static tree ({len(static)} nodes)": lambda: tree_speculative_generate(target, drafter, prompt, n, static),
        f"chain γ={a.depth}": lambda: speculative_generate(target, drafter, prompt, n, draft_len=a.depth),
    }
    with torch.no_grad():
        ref = autoregressive_generate(target, prompt, n)
        t = interleave(
            jobs,
            warmup=1,
            repeats=a.rounds,
            device=dev,
            measure=lambda out: out[1].draft_time_s / out[1].target_forwards,
        )
    print(
        f"device {dev}, 1 thread, tiny float32 drafter ({drafter.num_params() / 1e3:.0f}k params), dynamic tree "
        f"top-{a.top_k} depth {a.depth} {a.nodes} nodes, {n} new tokens per decode, median of {a.rounds} rounds"
    )
    print(
        "| drafting | ms per step | rounds | nodes per step | τ | x dynamic tree | output = AR |\n"
        "|---|---|---|---|---|---|---|"
    )
    for name, tm in t.items():
        out, stats = tm.last
        print(
            f"| {name} | {tm.median * 1e3:.3f} | {' '.join(f'{x * 1e3:.2f}' for x in tm.times)} | "
            f"{stats.drafted / stats.target_forwards:.1f} | {stats.tau:.2f} | {t.ratio(name, 'dynamic tree'):.2f} | "
            f"{out == ref} |"
        )
    print(t.note)
    if a.profile:
        with torch.no_grad():
            for name, d in (("drafter as is", drafter), ("static-shape drafter", graphed)):
                profile(lambda d=d: tree_speculative_generate(target, d, prompt, n, dyn), name, dev)


def profile(decode, name: str, device: str) -> None:
    """Operator and launch counts per decode step of one tree decode, device time against wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    decode()  # warm-up (captures the graphs)
    with prof(activities=acts) as p:
        t = time.perf_counter()
        _, stats = decode()
        sync(device)
        wall = time.perf_counter() - t
    steps = stats.target_forwards
    ev = p.key_averages()
    count = {e.key: e.count for e in ev}
    aten = sum(e.count for e in ev if e.key.startswith("aten::"))
    launches = sum(
        v
        for k, v in count.items()
        if k in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
    )
    syncs = sum(v for k, v in count.items() if "Synchronize" in k or k.startswith("cudaMemcpy"))
    replays = count.get("cudaGraphLaunch", 0)
    dev_ms = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA") / 1e3
    print(
        f"[profile, {name}] per step: {wall / steps * 1e3:.2f} ms wall (under the profiler), "
        f"{dev_ms / steps:.2f} ms device, {aten / steps:.0f} aten ops, {launches / steps:.0f} kernel launches, "
        f"{replays / steps:.0f} graph replays, {syncs / steps:.1f} syncs/copies"
    )
    print(ev.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


if __name__ == "__main__":
    main()
