"""On-policy writing by drafters that read the target's states (heads, EAGLE): the data stage's batched writer
(draftsmith.data.engine.write_batch) vs the decoder's write mode one row at a time (what the data stage used
before), on the same prompts, target and checkpoints, side by side in one run. The target's own batched generation
(decode_batch) runs alongside as the reference for what a batch costs. Prints tokens/s, the ratios, and how many
rows the two writers wrote identically (greedy). Usage:
python benchmarks/writer_throughput.py CKPT [CKPT ...] [--n 16] [--batch 16] [--max-new 128]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from draftsmith.data.engine import Sampling, decode_batch, write_batch
from draftsmith.data.prompts import load_prompts
from draftsmith.eval.decoder import speculative_generate
from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids
from draftsmith.models.registry import load_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", type=Path, help="drafter checkpoints (heads or EAGLE) to write with")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=16, help="prompts (ShareGPT first turns, <= 256 tokens)")
    ap.add_argument("--seed", type=int, default=5, help="prompt shuffle seed")
    ap.add_argument("--batch", type=int, default=16, help="rows per batch for the batched writer and the target")
    ap.add_argument("--max-new", type=int, default=128, help="tokens written per prompt (at most)")
    a = ap.parse_args()

    tgt = load_model(a.target)
    eos = stop_ids(tgt.path, tgt.tokenizer)
    enc = [encode_chat(tgt.tokenizer, first_turn(p.messages))
           for p in load_prompts("sharegpt", n=4 * a.n, shuffle=True, seed=a.seed)]
    prompts = sorted([ids for ids in enc if len(ids) <= 256][:a.n], key=len)  # as the generate stage packs them
    batches = [prompts[b:b + a.batch] for b in range(0, len(prompts), a.batch)]
    greedy = Sampling()

    def timed(fn):
        t0 = time.perf_counter()
        rows = fn()
        return rows, sum(len(r) for r in rows) / (time.perf_counter() - t0)

    print(f"prompts {len(prompts)}, batch {a.batch}, max_new_tokens {a.max_new}, threads {torch.get_num_threads()}")
    with torch.no_grad():
        decode_batch(tgt.model, batches[0], 4, eos, greedy, [None] * len(batches[0]))  # warm-up: first-call costs
        _, t_tps = timed(lambda: [g.tokens for b in batches
                                  for g in decode_batch(tgt.model, b, a.max_new, eos, greedy, [None] * len(b))])
        print(f"target decode_batch: {t_tps:.1f} tok/s")
        for ck in a.checkpoints:
            drafter, info = load_drafter(ck)
            one, one_tps = timed(lambda d=drafter: [speculative_generate(tgt.model, d, torch.tensor(p), a.max_new,
                                                                         eos_ids=eos, write=True)[0] for p in prompts])
            bat, bat_tps = timed(lambda d=drafter: [g.tokens for b in batches
                                                    for g in write_batch(tgt.model, d, b, a.max_new, eos, greedy,
                                                                         [None] * len(b))])
            same = sum(x == y for x, y in zip(one, bat))
            print(f"{info.get('kind')} ({ck}): one row at a time {one_tps:.1f} tok/s, batched {bat_tps:.1f} tok/s, "
                  f"ratio {bat_tps / one_tps:.2f}x; batched writer vs target decode_batch {bat_tps / t_tps:.2f}x; "
                  f"identical rows {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
