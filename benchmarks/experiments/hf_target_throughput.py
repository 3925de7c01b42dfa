"""Data-generation throughput of the own model against the transformers path, on the same Llama-family target.

Both load the same weights through ``load_model`` (``backend="own"`` and ``backend="transformers"``, the recipe's
``target.backend``) and answer the same --n ShareGPT first turns with the data stage's generator
(draftsmith.data.engine.decode_batch: left-padded batches of --batch, greedy, top-k log-probs captured at every
token, and with --hidden the final-norm and EAGLE-3 hidden states too). Both run as ``data.optimize`` has them
(the own model fused and pre-packed, the transformers model pre-packed) unless --no-optimize. After one short
untimed prompt each, both run --repeats times, round-robin (eval/timing.py).

Reading the output: response tokens/s for each path (tokens written / median seconds), "ratio" the own model's
throughput over the transformers path's from the paired rounds (> 1: the own model is faster), and how many rows
the two paths answered token for token alike (fp32 can flip a near-tied argmax; fp64 cannot). The last line names
the machine and how much of its CPU other processes took meanwhile.

    python benchmarks/experiments/hf_target_throughput.py [--target smollm2-135m-instruct] [--n 32] [--batch 16]
        [--max-new 64] [--topk 32] [--hidden] [--repeats 3]
"""

from __future__ import annotations

import argparse

import torch

from draftsmith.data.engine import Capture, Sampling, decode_batch
from draftsmith.eval.prompts import load_prompts
from draftsmith.eval.timing import interleave
from draftsmith.models.eagle import default_aux_layers
from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="Llama-family target (alias, folder, hub id)")
    ap.add_argument("--n", type=int, default=32, help="prompts (ShareGPT, first turn, <= 256 tokens)")
    ap.add_argument("--batch", type=int, default=16, help="rows per decode_batch call, both paths")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per prompt (at most; EOS ends a row)")
    ap.add_argument("--topk", type=int, default=32, help="teacher log-probs captured per token")
    ap.add_argument("--hidden", action="store_true", help="also capture hidden_last and the EAGLE-3 layers")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--no-optimize", action="store_true", help="both paths unpacked / unfused (data.optimize=false)")
    ap.add_argument("--repeats", type=int, default=3, help="round-robin rounds of both paths (median)")
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    own = load_model(a.target, dtype, backend="own")
    hft = load_model(a.target, dtype, backend="transformers")
    if not a.no_optimize:  # as the data stage does (data.optimize): fused + packed own, packed transformers
        own.model.optimize_for_inference()
        hft.model.optimize_for_inference()
    eos = stop_ids(own.path, own.tokenizer)
    n_layers = own.model.cfg.n_layers
    cap = Capture(a.topk, a.hidden, default_aux_layers(n_layers) if a.hidden else ())
    enc = [encode_chat(own.tokenizer, first_turn(p.messages)) for p in load_prompts("sharegpt", n=4 * a.n)]
    order = sorted([ids for ids in enc if len(ids) <= 256][: a.n], key=len)  # as generate packs: similar lengths

    def run(model):
        def go() -> list[list[int]]:
            out = []
            for b in range(0, len(order), a.batch):
                rows = order[b : b + a.batch]
                res = decode_batch(model, rows, a.max_new, eos, Sampling(), [None] * len(rows), cap)
                out += [g.tokens for g in res]
            return out

        return go

    with torch.no_grad():
        for m in (own.model, hft.model):  # first-call costs out of the timed rounds
            decode_batch(m, order[:1], 2, eos, Sampling(), [None], cap)
        t = interleave({"own": run(own.model), "transformers": run(hft.model)}, warmup=0, repeats=a.repeats)
    toks = {k: sum(map(len, t[k].last)) for k in t}
    same = sum(x == y for x, y in zip(t["own"].last, t["transformers"].last))
    print(
        f"{a.target}, {a.dtype}, {len(order)} prompts, batch {a.batch}, max_new_tokens {a.max_new}, top-{a.topk}"
        f"{', hidden states' if a.hidden else ''}; median of {a.repeats} round-robin rounds"
    )
    for k in t:
        print(f"{k:>12}: {toks[k]} tokens in {t[k].median:.2f}s = {toks[k] / t[k].median:.1f} response tok/s")
    # tokens/s ratio, round by round: (own tokens / own s) / (transformers tokens / transformers s)
    print(f"ratio own / transformers: {t.ratio('transformers', 'own') * toks['own'] / toks['transformers']:.2f}x")
    print(f"rows answered alike: {same} of {len(order)}")
    print(t.note)


if __name__ == "__main__":
    main()
