"""Export round trip on the real target: every requested format of each trained drafter is written with
``export``, read back with ``load_export`` and decoded next to the original checkpoint on the same MT-bench
prompts (chain speculative decoding, greedy), the original and every format round-robin in one process
(eval/timing.py) after a short untimed decode each.

Reading the output: one table row per drafter and format: the export's seconds, folder size and file count,
whether the exported drafter's greedy output and τ are identical to the original's (they must be: an export
changes the file layout, not the weights), its τ, and its decode time over the original's, paired by round (about
1.00: the loaded export decodes as fast as the checkpoint). The last line names the machine and how much of its
CPU other processes took meanwhile.

    python benchmarks/export_roundtrip.py runs/quickstart:hf,vllm runs/eagle3-smollm2:hf,vllm,sglang \\
        runs/medusa-smollm2:hf,medusa [--prompts 3 --new-tokens 64]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from draftsmith.eval.decoder import speculative_generate
from draftsmith.eval.prompts import load_prompts
from draftsmith.eval.timing import interleave, time_call
from draftsmith.export.writer import export, load_export
from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids
from draftsmith.models.registry import load_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="RUN_DIR:fmt1,fmt2 (the run's checkpoints/final is exported)")
    ap.add_argument("--target", default="smollm2-135m-instruct", help="target model (alias, folder or hub id)")
    ap.add_argument("--prompts", type=int, default=3, help="MT-bench prompts decoded per drafter and format")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--draft-len", type=int, default=4, help="chain draft length γ")
    ap.add_argument("--repeats", type=int, default=1, help="round-robin decode rounds (median)")
    ap.add_argument("--out", default="runs/export-roundtrip", help="where the exports are written")
    a = ap.parse_args()
    tgt = load_model(a.target)
    eos = stop_ids(tgt.path, tgt.tokenizer)
    prompts = [
        torch.tensor(encode_chat(tgt.tokenizer, first_turn(p.messages)))
        for p in load_prompts("mt_bench", None, a.prompts, shuffle=True, seed=0)
    ]

    def decode(drafter, prompts=prompts, new_tokens=a.new_tokens):
        outs, taus = [], []
        for ids in prompts:
            out, stats = speculative_generate(tgt.model, drafter, ids, new_tokens, draft_len=a.draft_len, eos_ids=eos)
            outs.append(out)
            taus.append(round(stats.tau, 6))
        return outs, taus

    print("| drafter | format | export s | MB | files | same output | same τ | τ | decode time / original |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in a.runs:
        run, fmts = spec.split(":")
        ckpt = Path(run) / "checkpoints" / "final"
        original, info = load_drafter(ckpt)
        drafters, rows = {"original": original}, {}
        for fmt in fmts.split(","):
            dest = Path(a.out) / Path(run).name / fmt
            made = time_call(lambda c=ckpt, f=fmt, d=dest: export(c, f, d), warmup=0, repeats=1)
            folder = made.last
            drafters[fmt], _ = load_export(folder, tgt.model)
            files = sorted(p.name for p in folder.iterdir())
            rows[fmt] = (made.median, sum(p.stat().st_size for p in folder.iterdir()) / 2**20, len(files))
        for d in drafters.values():  # warm-up: first-call costs stay out of the timed rounds
            decode(d, prompts[:1], 4)
        t = interleave({name: (lambda d=d: decode(d)) for name, d in drafters.items()}, warmup=0, repeats=a.repeats)
        ref_out, ref_tau = t["original"].last
        for fmt, (export_s, size, n_files) in rows.items():
            out, tau = t[fmt].last
            print(
                f"| {info['kind']} ({Path(run).name}) | {fmt} | {export_s:.1f} | {size:.1f} | {n_files} | "
                f"{out == ref_out} | {tau == ref_tau} | {sum(tau) / len(tau):.2f} | "
                f"{t.ratio(fmt, 'original'):.2f} |",
                flush=True,
            )
    print(t.note)


if __name__ == "__main__":
    main()
