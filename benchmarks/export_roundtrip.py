"""Export round trip on the real target (issue 8): every format of each trained drafter is written, read back
with ``load_export`` and decoded next to the original checkpoint on the same MT-bench prompts; prints export time,
folder size, whether the greedy output and τ are identical, and the tensors the engines would read.

    python benchmarks/export_roundtrip.py runs/quickstart:hf,vllm runs/eagle3-smollm2:hf,vllm,sglang \\
        runs/medusa-smollm2:hf,medusa [--prompts 3 --new-tokens 64]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from draftsmith.data.prompts import load_prompts
from draftsmith.eval.decoder import speculative_generate
from draftsmith.export.writer import export, load_export
from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids
from draftsmith.models.registry import load_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="RUN_DIR:fmt1,fmt2 (the run's checkpoints/final is exported)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=3, help="MT-bench prompts decoded per drafter and format")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--out", default="runs/export-roundtrip")
    a = ap.parse_args()
    tgt = load_model(a.target)
    eos = stop_ids(tgt.path, tgt.tokenizer)
    prompts = [torch.tensor(encode_chat(tgt.tokenizer, first_turn(p.messages)))
               for p in load_prompts("mt_bench", None, a.prompts, shuffle=True, seed=0)]

    def decode(drafter):
        outs, taus = [], []
        for ids in prompts:
            out, stats = speculative_generate(tgt.model, drafter, ids, a.new_tokens, draft_len=a.draft_len,
                                              eos_ids=eos)
            outs.append(out)
            taus.append(round(stats.tau, 6))
        return outs, taus

    print("| drafter | format | export s | MB | files | same output | same τ | τ |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in a.runs:
        run, fmts = spec.split(":")
        ckpt = Path(run) / "checkpoints" / "final"
        original, info = load_drafter(ckpt)
        ref_out, ref_tau = decode(original)
        for fmt in fmts.split(","):
            t0 = time.perf_counter()
            folder = export(ckpt, fmt, Path(a.out) / Path(run).name / fmt)
            dt = time.perf_counter() - t0
            back, _ = load_export(folder, tgt.model)
            out, tau = decode(back)
            files = sorted(p.name for p in folder.iterdir())
            size = sum(p.stat().st_size for p in folder.iterdir()) / 2 ** 20
            print(f"| {info['kind']} ({Path(run).name}) | {fmt} | {dt:.1f} | {size:.1f} | {len(files)} | "
                  f"{out == ref_out} | {tau == ref_tau} | {sum(tau) / len(tau):.2f} |", flush=True)


if __name__ == "__main__":
    main()
