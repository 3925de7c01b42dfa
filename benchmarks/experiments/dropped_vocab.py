"""How often a dropped token would win the argmax of a reduced-vocabulary head expanded to the full vocabulary (the
plain-Llama export of a draft LM with ``drafter.draft_vocab``, draftsmith/export/formats.py ``full_vocab_head``).

The head is the real target's own LM head (a draft LM starts from it), reduced to the ``--keep`` tokens most
frequent in the target's greedy answers to ShareGPT prompts; the hidden states are the target's final (normed) ones
along its greedy answers to other (MT-bench) prompts. For each position it counts whether a dropped id beats every
kept id when the dropped rows are zero (logit 0) and when they are the mean of the kept rows (the export's choice),
and how often the full head itself prefers a dropped id (what the reduction gives up).

    python benchmarks/experiments/dropped_vocab.py [--keep 8192 --count-prompts 24 --eval-prompts 24 --new-tokens 64]
"""

from __future__ import annotations

import argparse

import torch

from draftsmith.eval.prompts import load_prompts
from draftsmith.export.formats import full_vocab_head
from draftsmith.models.draft_lm import select_vocab
from draftsmith.models.loading import encode_chat, first_turn, load_model


@torch.no_grad()
def answers(lm, tok, prompts, new_tokens: int) -> list[torch.Tensor]:
    out = []
    for p in prompts:
        ids = torch.tensor(encode_chat(tok, first_turn(p.messages)))
        for _ in range(new_tokens):
            ids = torch.cat([ids, lm(ids[None])[0, -1].argmax()[None]])
        out.append(ids)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--keep", type=int, default=8192)
    ap.add_argument("--count-prompts", type=int, default=24)
    ap.add_argument("--eval-prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    torch.manual_seed(0)
    loaded = load_model(a.target)
    lm, tok = loaded.model.eval(), loaded.tokenizer
    counts = torch.zeros(lm.cfg.vocab_size, dtype=torch.float64)
    for seq in answers(lm, tok, load_prompts("sharegpt", n=a.count_prompts, max_turns=1), a.new_tokens):
        counts += torch.bincount(seq, minlength=lm.cfg.vocab_size).double()
    keep = select_vocab(counts, a.keep, {tok.eos_token_id})
    head = lm.lm_head.weight.detach()
    kept = head[keep]
    dropped = torch.ones(lm.cfg.vocab_size, dtype=torch.bool)
    dropped[keep] = False
    mean_head = full_vocab_head(kept, keep, lm.cfg.vocab_size)
    n = zero_wins = mean_wins = full_prefers_dropped = 0
    for seq in answers(lm, tok, load_prompts("mt_bench", n=a.eval_prompts, max_turns=1), a.new_tokens):
        with torch.no_grad():
            h = lm(seq[None], return_hidden=True)[0]
        best_kept = (h @ kept.T).max(-1).values
        zero_wins += int((best_kept < 0).sum())
        mean_wins += int(dropped[(h @ mean_head.T).argmax(-1)].sum())
        full_prefers_dropped += int(dropped[(h @ head.T).argmax(-1)].sum())
        n += len(seq)
    print(f"{a.target}: keep {a.keep} of {lm.cfg.vocab_size}, {n} positions")
    print(f"dropped id wins with zero rows:      {zero_wins} ({zero_wins / n:.4%})")
    print(f"dropped id wins with mean-of-kept rows: {mean_wins} ({mean_wins / n:.4%})")
    print(f"full head prefers a dropped id:       {full_prefers_dropped} ({full_prefers_dropped / n:.4%})")


if __name__ == "__main__":
    main()
