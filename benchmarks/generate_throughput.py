"""Batched data generation (draftsmith.data.engine.decode_batch: left-padded, one KV cache, top-k teacher
log-probs captured) vs one-prompt-at-a-time HF ``generate`` on the same prompts and target, side by side in one
run. Prints target tokens/s for both and the ratio. Usage:
python benchmarks/generate_throughput.py [--n 32] [--batch 16] [--max-new 64] [--topk 32]
"""
from __future__ import annotations

import argparse
import time

import torch

from draftsmith.data.engine import Capture, Sampling, decode_batch
from draftsmith.data.prompts import load_prompts
from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--n", type=int, default=32, help="prompts (ShareGPT, first turn, <= 256 tokens)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--topk", type=int, default=32)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    tgt = load_model(a.target)
    hf = AutoModelForCausalLM.from_pretrained(str(tgt.path), dtype=torch.float32).eval()
    eos = stop_ids(tgt.path, tgt.tokenizer)
    enc = [encode_chat(tgt.tokenizer, first_turn(p.messages)) for p in load_prompts("sharegpt", n=4 * a.n)]
    prompts = [ids for ids in enc if len(ids) <= 256][:a.n]
    with torch.no_grad():
        t0, hf_tokens = time.perf_counter(), 0
        for ids in prompts:
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=a.max_new, do_sample=False,
                              eos_token_id=sorted(eos), pad_token_id=min(eos))
            hf_tokens += out.shape[1] - len(ids)
        t_hf = time.perf_counter() - t0
        order = sorted(prompts, key=len)  # as the generate stage does: similar lengths share a batch
        t0, ours = time.perf_counter(), 0
        for b in range(0, len(order), a.batch):
            batch = order[b:b + a.batch]
            res = decode_batch(tgt.model, batch, a.max_new, eos, Sampling(), [None] * len(batch), Capture(a.topk))
            ours += sum(len(g.tokens) for g in res)
        t_ours = time.perf_counter() - t0
    print(f"prompts {len(prompts)}, max_new_tokens {a.max_new}, threads {torch.get_num_threads()}")
    print(f"HF generate, one prompt at a time: {hf_tokens} tokens in {t_hf:.1f}s = {hf_tokens / t_hf:.1f} tok/s")
    print(f"draftsmith decode_batch, batch {a.batch}, top-{a.topk} captured: {ours} tokens in {t_ours:.1f}s = "
          f"{ours / t_ours:.1f} tok/s")
    print(f"ratio: {(ours / t_ours) / (hf_tokens / t_hf):.2f}x")


if __name__ == "__main__":
    main()
