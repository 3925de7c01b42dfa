"""Sequence packing (train.packing) against padded batches: the same records, the same drafter, one optimizer step
per micro-batch, side by side round by round.

Records of mixed lengths (log-uniform between --min-len and --max-len tokens, the last two thirds of each a response)
carry stored top-k teachers and, for heads and EAGLE, stored target features, as `draftsmith generate` writes
them. Every round both modes train the next micro-batch of the same seeded order (--micro-batch records): padded
(data/dataset.py collate: every record padded to the longest) and packed (collate_packed: rows of --pack-tokens
tokens, per-document masks and positions), each on its own copy of the drafter, through the training objective
and an AdamW step, as the train loop runs them.

Reading the output: per mode, the median seconds per step, target tokens per second (the trained response tokens,
never padding: the loop's tokens_per_s), the token slots per step the forwards ran on and the share of them that
was padding (pad_frac in metrics.jsonl); then packed / padded tokens per second. Both modes train the same tokens
each round, so the ratio is the packing speedup. The last line names the machine and how much CPU other processes
took while timing.

Usage: python benchmarks/packing.py [--kind draft_lm|medusa|hydra|mlp_speculator|eagle|pard] [--records 64]
       [--micro-batch 16] [--min-len 32] [--max-len 1024] [--pack-tokens 1024] [--rounds 5] [--dim 256]
       [--layers 4] [--vocab 8192] [--device cpu]
"""

from __future__ import annotations

import argparse
import copy
import math

import torch

from draftsmith.data.dataset import collate, collate_packed
from draftsmith.data.records import Record
from draftsmith.eval.timing import interleave
from draftsmith.models.llama import Llama, LlamaConfig
from draftsmith.models.registry import build_drafter, drafter_spec
from draftsmith.recipes.schema import LossConfig
from draftsmith.train import objectives

SECTIONS = {"draft_lm": {"n_layers": 1}, "eagle": {"version": 3, "ttt_steps": 3}}


def records(a, target: Llama, n_aux: int) -> list[Record]:
    g = torch.Generator().manual_seed(0)
    out, V, D = [], target.cfg.vocab_size, target.cfg.dim
    lo, hi = math.log(a.min_len), math.log(a.max_len)
    for i in range(a.records):
        n = int(math.exp(lo + (hi - lo) * float(torch.rand((), generator=g))))
        ids = torch.randint(3, V, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3 :] = True
        m = int(mask.sum())
        sig = {
            "topk_ids": torch.randint(0, V, (m, a.topk), generator=g),
            "topk_logprobs": torch.log_softmax(torch.randn(m, a.topk, generator=g), -1) - 0.1,
        }
        if a.kind != "draft_lm":
            sig["hidden_last"] = torch.randn(n, D, generator=g).bfloat16()
            if n_aux:
                sig["hidden_aux"] = torch.randn(n, n_aux, D, generator=g).bfloat16()
        out.append(Record(ids, mask, i, 0, 0, sig))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kind", default="draft_lm", help="drafter kind (one that packs)")
    p.add_argument("--records", type=int, default=64, help="records in the seeded order the rounds walk through")
    p.add_argument("--micro-batch", type=int, default=16, help="records per micro-batch (train.micro_batch_size)")
    p.add_argument("--min-len", type=int, default=32, help="shortest record, tokens")
    p.add_argument("--max-len", type=int, default=1024, help="longest record, tokens (train.max_seq_len)")
    p.add_argument("--pack-tokens", type=int, default=None, help="tokens per packed row; default --max-len")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (each: one step per mode)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--dim", type=int, default=256, help="the random target's hidden size")
    p.add_argument("--layers", type=int, default=4, help="the random target's layers")
    p.add_argument("--vocab", type=int, default=8192, help="the random target's vocabulary")
    p.add_argument("--topk", type=int, default=32, help="stored teacher top-k")
    p.add_argument("--loss", default="fkl", help="train.loss.kind")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    a = p.parse_args()
    if not drafter_spec(a.kind).packs:
        raise SystemExit(f"--kind {a.kind}: this kind does not pack")
    torch.manual_seed(0)
    heads = max(1, a.dim // 64)
    cfg = LlamaConfig(
        vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=heads, n_kv_heads=heads, hidden_dim=a.dim * 3
    )
    target = Llama(cfg).requires_grad_(False)
    params = drafter_spec(a.kind).section(SECTIONS.get(a.kind, {}))
    drafter = build_drafter(a.kind, params, target).float().train()
    n_aux = len(drafter.cfg.aux_layers) if a.kind == "eagle" and drafter.cfg.version == 3 else 0
    recs = records(a, target, n_aux)
    order = torch.randperm(len(recs), generator=torch.Generator().manual_seed(1)).tolist()
    dev = torch.device(a.device)
    target = target.to(dev)
    loss, objective = LossConfig(kind=a.loss), objectives.objective_for(a.kind)
    rows = a.pack_tokens or a.max_len
    modes = {"padded": collate, "packed": lambda rs: collate_packed(rs, rows)}
    stats = {m: {"tokens": [], "slots": []} for m in modes}

    def stepper(mode: str):
        model = copy.deepcopy(drafter).to(dev)
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)
        ctx = objectives.Context(unwrapped=model, target=target, params=params)
        cursor = {"i": 0}

        def step():
            i = cursor["i"]
            batch_recs = [recs[order[(i + j) % len(recs)]] for j in range(a.micro_batch)]
            cursor["i"] = i + a.micro_batch
            b = {k: v.to(dev) for k, v in modes[mode](batch_recs).items()}
            out = objective(model, b, loss, ctx)
            (out.loss_sum / max(1, int(b["predict_mask"].sum()))).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            stats[mode]["tokens"].append(int(b["predict_mask"].sum()))
            stats[mode]["slots"].append((b["input_ids"].numel(), int(b["attention_mask"].sum())))

        return step

    t = interleave({m: stepper(m) for m in modes}, warmup=a.warmup, repeats=a.rounds, device=dev)
    print(
        f"{a.kind}, {a.records} records of {a.min_len}-{a.max_len} tokens, {a.micro_batch} per micro-batch, "
        f"rows of {rows} tokens; target dim {a.dim} x {a.layers} layers, vocab {a.vocab}; {a.rounds} rounds"
    )
    tps = {}
    for m in modes:
        toks = stats[m]["tokens"][a.warmup :]
        slots = stats[m]["slots"][a.warmup :]
        tps[m] = sum(toks) / sum(t[m].times)
        pad = 1 - sum(r for _, r in slots) / sum(s for s, _ in slots)
        print(
            f"{m:7s} {t[m].median:.3f} s/step  {tps[m]:9.0f} target tokens/s  "
            f"{sum(s for s, _ in slots) / len(slots):8.0f} slots/step  pad_frac {pad:.3f}"
        )
    print(f"packed / padded: {tps['packed'] / tps['padded']:.2f}x target tokens/s")
    print(t.note)


if __name__ == "__main__":
    main()
