"""Eval at the batch sizes users serve at (``eval.batch_sizes``): for each B, the prompts are decoded with B rows in
flight at once (a finished row is replaced by the next prompt, as a continuously batching server does), once by
draftsmith's own plain decoding and once speculatively, with the same batched decoder (eval/batch_decoder.py).
Reports, per B, τ, tokens/s of both, the speedup and the lossless match against each prompt's own batch-1 output;
the crossover is the smallest B at which speculation stops paying (speedup < 1). ``write_batch_plot`` draws speedup
against B.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from draftsmith.eval.batch_decoder import BatchDecoder, step_room
from draftsmith.eval.decoder import DecodeStats, _sync


def decode_at(target, drafter, prompts: list[torch.Tensor], B: int, max_new_tokens: int, *, draft_len: int,
              eos_ids: set[int], sampling: dict, generator, stop_drafting=None, tree=None,
              judge=None):  # fmt: skip
    """All ``prompts`` through one ``BatchDecoder`` holding at most ``B`` rows -> (outputs in prompt order (lists of
    ints), merged ``DecodeStats``, seconds). ``drafter`` None: plain decoding; ``tree`` / ``judge``: as at batch 1."""
    room = step_room(target, drafter, draft_len, tree, judge, stop_drafting)
    max_len = max(len(p) for p in prompts) + max_new_tokens + room + 4  # what BatchDecoder.add asks
    dec = BatchDecoder(target, drafter, draft_len=draft_len, eos_ids=eos_ids, max_len=max_len,
                       stop_drafting=stop_drafting, tree=None if drafter is None else tree,
                       judge=None if drafter is None else judge)  # fmt: skip
    pending, owner, outs, total = list(range(len(prompts))), {}, [[] for _ in prompts], DecodeStats()
    _sync(prompts[0].device)
    t0 = time.perf_counter()
    while pending or dec.active():
        while pending and len(dec.active()) < B:
            i = pending.pop(0)
            owner[dec.add(prompts[i], max_new_tokens, generator=generator, **sampling)] = i
        for rid, toks in dec.step().items():
            outs[owner[rid]] += toks
        for rid in [r for r in owner if r not in dec.active()]:  # finished: take its stats, free the entry
            st = dec.stats.pop(rid, None)
            if st is not None:
                total.merge(st)
            owner.pop(rid)
    _sync(prompts[0].device)
    return outs, total, time.perf_counter() - t0


def batch_sweep(target, drafter, prompts: list[torch.Tensor], sizes: list[int], max_new_tokens: int, *,
                draft_len: int, eos_ids: set[int], sampling: dict, seed: int, reference: list[list[int]] | None,
                stop_drafting=None, tree=None, judge=None, batch1: list[list[int]] | None = None) -> dict:  # fmt: skip
    """-> {"rows": [{B, tau, tokens_per_s: {ar, spec}, speedup, lossless_match, ...}], "crossover": B or None}.
    ``reference``: each prompt's own greedy output, which every lossless row must equal; ``batch1``: each prompt's
    batch-1 speculative output (greedy), which every row must equal at every B, lossy judge or not."""
    rows = []
    device = prompts[0].device
    for B in sizes:
        gen = torch.Generator(device=device).manual_seed(seed)
        common = {"draft_len": draft_len, "eos_ids": eos_ids, "sampling": sampling, "generator": gen}
        ar, _, t_ar = decode_at(target, None, prompts, B, max_new_tokens, **common)
        spec, st, t_spec = decode_at(target, drafter, prompts, B, max_new_tokens, stop_drafting=stop_drafting,
                                     tree=tree, judge=judge, **common)  # fmt: skip
        n_ar, n_spec = sum(map(len, ar)), sum(map(len, spec))
        row = {
            "batch_size": B,
            "tau": st.tau,
            "acceptance_rate": st.acceptance_rate,
            "tokens_per_s": {"ar": n_ar / t_ar, "spec": n_spec / t_spec},
            "speedup": (n_spec / t_spec) / (n_ar / t_ar),
        }
        if reference is not None:
            row["lossless_match"] = sum(a == b for a, b in zip(spec, reference)) / len(reference)
            row["ar_match"] = sum(a == b for a, b in zip(ar, reference)) / len(reference)
        if batch1 is not None:
            row["batch1_match"] = sum(a == b for a, b in zip(spec, batch1)) / len(batch1)
        rows.append(row)
    slow = [r["batch_size"] for r in rows if r["speedup"] < 1]
    return {"rows": rows, "crossover": min(slow) if slow else None}


def write_batch_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = report["batches"]
    bs = [r["batch_size"] for r in sweep["rows"]]
    sp = [r["speedup"] for r in sweep["rows"]]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(bs, sp, "o-", color="#4c72b0")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    if sweep["crossover"] is not None:
        ax.axvline(sweep["crossover"], color="#c44e52", lw=1, label=f"crossover: B = {sweep['crossover']}")
        ax.legend()
    ax.set(xscale="log", xticks=bs, xlabel="batch size B", ylabel="speedup vs own AR at B",
           title="Speculative speedup vs batch size")  # fmt: skip
    ax.set_xticklabels([str(b) for b in bs])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
