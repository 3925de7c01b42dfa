"""Exactness by dtype: the target drafts for itself, so in exact arithmetic every draft is accepted and the
speculative output is the AR output token for token. Whatever differs is rounding: a (γ+1)-token verify and
one-token AR steps go through different kernels. Prints, per dtype, how many prompts match AR exactly and the
share of its own drafts the target accepted.

    python benchmarks/experiments/self_speculation.py [--prompts 6] [--new-tokens 96] [--draft-len 4]
                                                      [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse

import torch

from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.eval.prompts import load_prompts
from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids
from draftsmith.runtime import _DTYPES, resolve_device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="target (alias, folder or hub name)")
    ap.add_argument("--prompts", type=int, default=6, help="MT-bench prompts (shuffled, seed 0)")
    ap.add_argument("--new-tokens", type=int, default=96, help="new tokens per prompt")
    ap.add_argument("--draft-len", type=int, default=4, help="chain length γ")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=sorted(_DTYPES))
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto")
    a = ap.parse_args()
    device = resolve_device(a.device)
    prompts = load_prompts("mt_bench", None, a.prompts, shuffle=True, seed=0, max_turns=1)
    for name in a.dtypes:
        tgt = load_model(a.model, _DTYPES[name], device)
        model, eos = tgt.model.eval(), stop_ids(tgt.path, tgt.tokenizer)
        same, accepted, drafted = 0, 0, 0
        for p in prompts:
            ids = torch.tensor(encode_chat(tgt.tokenizer, first_turn(p.messages)), device=device)
            with torch.no_grad():
                ar = autoregressive_generate(model, ids, a.new_tokens, eos_ids=eos)
                spec, st = speculative_generate(model, model, ids, a.new_tokens, draft_len=a.draft_len, eos_ids=eos)
            same += spec == ar
            accepted, drafted = accepted + st.accepted, drafted + st.drafted
        print(
            f"{name}: {same}/{len(prompts)} prompts identical to AR; {accepted / max(1, drafted):.1%} of the "
            f"target's own drafts accepted",
            flush=True,
        )


if __name__ == "__main__":
    main()
