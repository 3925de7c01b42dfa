"""Batched data generation against one-prompt-at-a-time HF ``generate``, on the same prompts and target, side by
side in one process.

The data stage's generator (draftsmith.data.engine.decode_batch: left-padded rows, one KV cache, the teacher's
top-k log-probs captured at every token) writes --n ShareGPT first turns in batches of --batch; transformers'
``generate`` answers the same prompts one at a time (greedy, no capture). After one short untimed prompt each,
both run --repeats times, round-robin (eval/timing.py).

Reading the output: target tokens/s for each side (tokens written / median seconds) and "ratio", the batched
generator's throughput over HF's, from the paired rounds (> 1: batching wins). The last line names the machine and
how much of its CPU other processes took meanwhile.

    python benchmarks/generate_throughput.py [--n 32] [--batch 16] [--max-new 64] [--topk 32] [--repeats 1]
"""

from __future__ import annotations

import argparse

import torch

from draftsmith.data.engine import Capture, Sampling, decode_batch
from draftsmith.data.prompts import load_prompts
from draftsmith.eval.timing import interleave
from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="target model (alias, folder or hub id)")
    ap.add_argument("--n", type=int, default=32, help="prompts (ShareGPT, first turn, <= 256 tokens)")
    ap.add_argument("--batch", type=int, default=16, help="rows per decode_batch call")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per prompt (at most; EOS ends a row)")
    ap.add_argument("--topk", type=int, default=32, help="teacher log-probs captured per token by decode_batch")
    ap.add_argument("--repeats", type=int, default=1, help="round-robin rounds of both sides (median)")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    tgt = load_model(a.target)
    hf = AutoModelForCausalLM.from_pretrained(str(tgt.path), dtype=torch.float32).eval()
    eos = stop_ids(tgt.path, tgt.tokenizer)
    enc = [encode_chat(tgt.tokenizer, first_turn(p.messages)) for p in load_prompts("sharegpt", n=4 * a.n)]
    prompts = [ids for ids in enc if len(ids) <= 256][: a.n]
    order = sorted(prompts, key=len)  # as the generate stage does: similar lengths share a batch

    def run_hf() -> int:
        tokens = 0
        for ids in prompts:
            x = torch.tensor([ids])
            out = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=a.max_new,
                do_sample=False,
                eos_token_id=sorted(eos),
                pad_token_id=min(eos),
            )
            tokens += out.shape[1] - len(ids)
        return tokens

    def run_ours() -> int:
        tokens = 0
        for b in range(0, len(order), a.batch):
            batch = order[b : b + a.batch]
            res = decode_batch(tgt.model, batch, a.max_new, eos, Sampling(), [None] * len(batch), Capture(a.topk))
            tokens += sum(len(g.tokens) for g in res)
        return tokens

    with torch.no_grad():
        # warm-up: one short prompt through each side takes the first-call costs out of the timed rounds
        x = torch.tensor([order[0]])
        hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=2, do_sample=False, pad_token_id=min(eos))
        decode_batch(tgt.model, order[:1], 2, eos, Sampling(), [None], Capture(a.topk))
        t = interleave({"hf": run_hf, "ours": run_ours}, warmup=0, repeats=a.repeats)
    hf_tps, our_tps = t["hf"].last / t["hf"].median, t["ours"].last / t["ours"].median
    print(f"prompts {len(prompts)}, max_new_tokens {a.max_new}, median of {a.repeats} round-robin rounds")
    print(f"HF generate, one prompt at a time: {t['hf'].last} tokens in {t['hf'].median:.1f}s = {hf_tps:.1f} tok/s")
    print(
        f"draftsmith decode_batch, batch {a.batch}, top-{a.topk} captured: {t['ours'].last} tokens in "
        f"{t['ours'].median:.1f}s = {our_tps:.1f} tok/s"
    )
    # tokens/s ratio, round by round: (ours tokens / ours s) / (hf tokens / hf s)
    print(f"ratio: {t.ratio('hf', 'ours') * t['ours'].last / t['hf'].last:.2f}x")
    print(t.note)


if __name__ == "__main__":
    main()
