"""The data stage's two ways of generating target answers, side by side in one process on the same prompts and
target: fixed batches (draftsmith.data.engine.decode_batch: length-sorted batches of --batch left-padded rows,
each batch running until its longest row ends, finished rows idle meanwhile) against continuous refill
(decode_refill: --batch rows, a finished row's slot prefilled with the next prompt at once). Both capture the
teacher's top-k log-probs at every token, greedy. With --hf, transformers' ``generate`` answers the same prompts one
at a time too (no capture). After one short untimed prompt each, all sides run --repeats times, round-robin
(eval/timing.py).

Reading the output: response tokens/s for each side (tokens written / median seconds); "idle row-steps", the share
of the fixed path's decode rows that were finished rows waiting for their batch (refill has none: it is what
refill removes); "refill / fixed", the throughput ratio from the paired rounds (> 1: refill wins), and whether
both wrote the same tokens (they must, greedy). With --graphs, refill with static-shape decode steps replayed as
CUDA graphs (data.cuda_graphs) too; with --hf, "fixed / HF" too. The last line names the machine and
how much of its CPU other processes took meanwhile.

    python benchmarks/generate_throughput.py [--n 32] [--batch 16] [--max-new 64] [--topk 32] [--repeats 1]
        [--prompts FILE.jsonl] [--target MODEL] [--device cpu|cuda] [--graphs] [--hf]
"""

from __future__ import annotations

import argparse

import torch

from draftsmith.data.engine import Capture, Sampling, decode_batch, decode_refill
from draftsmith.eval.prompts import load_prompts
from draftsmith.eval.timing import interleave
from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="target model (alias, folder or hub id)")
    ap.add_argument("--prompts", default=None, help="a JSONL prompt file (default: the packaged ShareGPT prompts)")
    ap.add_argument("--n", type=int, default=32, help="prompts (first turns, at most --max-prompt tokens)")
    ap.add_argument("--max-prompt", type=int, default=256, help="longest prompt kept, in tokens")
    ap.add_argument("--batch", type=int, default=16, help="rows generated at once, on both paths")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per prompt (at most; EOS ends a row)")
    ap.add_argument("--topk", type=int, default=32, help="teacher log-probs captured per token")
    ap.add_argument("--repeats", type=int, default=1, help="round-robin rounds of every side (median)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="target dtype: float32, bfloat16 or float16")
    ap.add_argument("--hf", action="store_true", help="also time transformers' generate, one prompt at a time")
    ap.add_argument("--graphs", action="store_true", help="also time refill with CUDA-graph decode steps (GPU)")
    ap.add_argument("--no-optimize", action="store_true", help="keep the target's plain matmuls (data.optimize off)")
    a = ap.parse_args()

    dtype = getattr(torch, a.dtype)
    tgt = load_model(a.target, dtype, a.device)
    if not a.no_optimize:  # as the data stage runs it (data.optimize): fused, pre-packed matmuls
        tgt.model.optimize_for_inference()
    eos = stop_ids(tgt.path, tgt.tokenizer)
    src = ("file", a.prompts) if a.prompts else ("sharegpt", None)
    enc = [encode_chat(tgt.tokenizer, first_turn(p.messages)) for p in load_prompts(*src, n=4 * a.n)]
    prompts = [ids for ids in enc if len(ids) <= a.max_prompt][: a.n]
    order = sorted(prompts, key=len)  # as the generate stage does: similar lengths share a batch
    cap, outs = Capture(a.topk), {}

    def run_fixed() -> int:
        res = []
        for b in range(0, len(order), a.batch):
            batch = order[b : b + a.batch]
            res += decode_batch(tgt.model, batch, a.max_new, eos, Sampling(), [None] * len(batch), cap)
        outs["fixed"] = [g.tokens for g in res]
        return sum(len(t) for t in outs["fixed"])

    def run_refill() -> int:
        res = decode_refill(tgt.model, order, a.max_new, eos, Sampling(), [None] * len(order), cap, batch_size=a.batch)
        outs["refill"] = [g.tokens for g in res]
        return sum(len(t) for t in outs["refill"])

    sides = {"fixed": run_fixed, "refill": run_refill}
    if a.graphs:

        def run_graphs() -> int:
            res = decode_refill(
                tgt.model, order, a.max_new, eos, Sampling(), [None] * len(order), cap, batch_size=a.batch, static=True
            )
            outs["graphs"] = [g.tokens for g in res]
            return sum(len(t) for t in outs["graphs"])

        sides["graphs"] = run_graphs
    if a.hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(tgt.path), dtype=dtype).to(a.device).eval()

        def run_hf() -> int:
            tokens = 0
            for ids in prompts:
                x = torch.tensor([ids], device=a.device)
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

        sides["hf"] = run_hf

    with torch.no_grad():
        # warm-up: one short prompt through each path takes the first-call costs out of the timed rounds
        decode_batch(tgt.model, order[:1], 2, eos, Sampling(), [None], cap)
        decode_refill(tgt.model, order[:1], 2, eos, Sampling(), [None], cap, batch_size=1)
        if a.graphs:  # captures every bucket's graph outside the timed rounds
            decode_refill(
                tgt.model, order, 2, eos, Sampling(), [None] * len(order), cap, batch_size=a.batch, static=True
            )
        if a.hf:
            x = torch.tensor([order[0]], device=a.device)
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=2, do_sample=False, pad_token_id=min(eos))
        t = interleave(sides, warmup=0, repeats=a.repeats, device=a.device)
    # idle decode rows on the fixed path: in each batch every row takes as many steps as the longest one
    lens = [len(x) for x in outs["fixed"]]
    batches = [lens[b : b + a.batch] for b in range(0, len(lens), a.batch)]
    steps = sum(len(b) * max(b) for b in batches)
    idle = 1 - sum(lens) / max(steps, 1)
    tps = {k: t[k].last / t[k].median for k in sides}
    print(
        f"prompts {len(prompts)}, batch {a.batch}, max_new_tokens {a.max_new}, top-{a.topk} captured, "
        f"{tgt.name} on {a.device} ({a.dtype}{', plain matmuls' if a.no_optimize else ', pre-packed'}), median of "
        f"{a.repeats} round-robin rounds"
    )
    print(
        f"fixed batches: {t['fixed'].last} tokens in {t['fixed'].median:.2f}s = {tps['fixed']:.1f} tok/s; "
        f"idle row-steps {100 * idle:.0f}%"
    )
    print(f"refill:        {t['refill'].last} tokens in {t['refill'].median:.2f}s = {tps['refill']:.1f} tok/s")
    same = outs["fixed"] == outs["refill"]
    # tokens/s ratio, round by round: (refill tokens / refill s) / (fixed tokens / fixed s)
    print(
        f"refill / fixed: {t.ratio('fixed', 'refill') * t['refill'].last / t['fixed'].last:.2f}x; "
        f"same tokens: {'yes' if same else 'NO'}"
    )
    if a.graphs:
        print(
            f"refill + CUDA graphs{'' if a.device.startswith('cuda') else ' (static shapes, not captured off a GPU)'}: "
            f"{tps['graphs']:.1f} tok/s; over refill: "
            f"{t.ratio('refill', 'graphs') * t['graphs'].last / t['refill'].last:.2f}x; "
            f"same tokens as fixed: {'yes' if outs['graphs'] == outs['fixed'] else 'NO'}"
        )
    if a.hf:
        print(f"HF generate, one prompt at a time: {tps['hf']:.1f} tok/s")
        print(f"fixed / HF: {t.ratio('hf', 'fixed') * t['fixed'].last / t['hf'].last:.2f}x")
    print(t.note)


if __name__ == "__main__":
    main()
