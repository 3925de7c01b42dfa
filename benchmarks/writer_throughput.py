"""On-policy writing by drafters that read the target's states (heads, EAGLE): the data stage's batched writer
(draftsmith.data.engine.write_batch) against the decoder's write mode one row at a time
(``write_one``), on the same prompts, target and checkpoints, side by side in one
process. The target's own batched generation (decode_batch) runs alongside as the reference for what a batch of
rows costs.

For each checkpoint the three runs go round-robin (eval/timing.py), --repeats rounds, after an untimed warm-up.

Reading the output: one line per checkpoint with tokens/s one row at a time and batched, "ratio" = batched over
one-row throughput (> 1: batching wins), the batched writer's throughput over the target's decode_batch (how close
writing comes to plain batched generation), and how many rows the two writers wrote identically (greedy: all of
them, up to float rounding of batched matmuls). The last line names the machine and how much of its CPU other
processes took meanwhile.

    python benchmarks/writer_throughput.py CKPT [CKPT ...] [--n 16] [--batch 16] [--max-new 128] [--repeats 1]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from draftsmith.data.engine import Sampling, decode_batch, write_batch, write_one
from draftsmith.eval.prompts import load_prompts
from draftsmith.eval.timing import interleave
from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids
from draftsmith.models.registry import load_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", type=Path, help="drafter checkpoints (heads or EAGLE) to write with")
    ap.add_argument("--target", default="smollm2-135m-instruct", help="target model (alias, folder or hub id)")
    ap.add_argument("--n", type=int, default=16, help="prompts (ShareGPT first turns, <= 256 tokens)")
    ap.add_argument("--seed", type=int, default=5, help="prompt shuffle seed")
    ap.add_argument("--batch", type=int, default=16, help="rows per batch for the batched writer and the target")
    ap.add_argument("--max-new", type=int, default=128, help="tokens written per prompt (at most)")
    ap.add_argument("--repeats", type=int, default=1, help="round-robin rounds per checkpoint (median)")
    a = ap.parse_args()

    tgt = load_model(a.target)
    eos = stop_ids(tgt.path, tgt.tokenizer)
    enc = [
        encode_chat(tgt.tokenizer, first_turn(p.messages))
        for p in load_prompts("sharegpt", n=4 * a.n, shuffle=True, seed=a.seed)
    ]
    prompts = sorted([ids for ids in enc if len(ids) <= 256][: a.n], key=len)  # as the generate stage packs them
    batches = [prompts[b : b + a.batch] for b in range(0, len(prompts), a.batch)]
    greedy = Sampling()

    def target_rows():
        return [g.tokens for b in batches for g in decode_batch(tgt.model, b, a.max_new, eos, greedy, [None] * len(b))]

    def one_row(drafter):
        return [write_one(tgt.model, drafter, torch.tensor(p), a.max_new, eos_ids=eos)[0] for p in prompts]

    def batched(drafter):
        return [
            g.tokens
            for b in batches
            for g in write_batch(tgt.model, drafter, b, a.max_new, eos, greedy, [None] * len(b))
        ]

    print(
        f"prompts {len(prompts)}, batch {a.batch}, max_new_tokens {a.max_new}, median of {a.repeats} round-robin rounds"
    )
    notes = []
    with torch.no_grad():
        decode_batch(tgt.model, batches[0], 4, eos, greedy, [None] * len(batches[0]))  # warm-up: first-call costs
        for ck in a.checkpoints:
            drafter, info = load_drafter(ck)
            write_one(tgt.model, drafter, torch.tensor(prompts[0]), 4, eos_ids=eos)  # warm-up
            t = interleave(
                {"target": target_rows, "one": lambda d=drafter: one_row(d), "batched": lambda d=drafter: batched(d)},
                warmup=0,
                repeats=a.repeats,
            )
            tokens = {k: sum(len(r) for r in v.last) for k, v in t.items()}
            tps = {k: tokens[k] / v.median for k, v in t.items()}

            def speedup(x, y, t=t, tokens=tokens):  # tokens/s of x over y, round by round
                return t.ratio(y, x) * tokens[x] / tokens[y]

            same = sum(x == y for x, y in zip(t["one"].last, t["batched"].last))
            print(
                f"{info.get('kind')} ({ck}): one row at a time {tps['one']:.1f} tok/s, batched {tps['batched']:.1f} "
                f"tok/s, ratio {speedup('batched', 'one'):.2f}x; batched writer vs target decode_batch "
                f"({tps['target']:.1f} tok/s) {speedup('batched', 'target'):.2f}x; identical rows "
                f"{same}/{len(prompts)}",
                flush=True,
            )
            notes.append(t.note)
    print(notes[-1])


if __name__ == "__main__":
    main()
