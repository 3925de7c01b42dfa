"""Batch-1 decode speed of two versions of the code, side by side: each round runs one process per version,
alternating which goes first, and each process times ``speculative_generate`` on the same MT-bench first turns
(greedy) for a few drafter / strategy cases, after an untimed warm-up. Prints tokens/s per version and case and
the ratio new/old (median over rounds), and checks that both versions wrote the same tokens.

    bash benchmarks/snapshot.sh 75a2198 /tmp/old      # an importable copy of draftsmith at that commit
    python benchmarks/decode_ab.py --old /tmp/old [--rounds 3] [--n 6] [--max-new 64] [--eagle RUN/checkpoints/final]

The cases: a self-draft (a 2-layer draft LM from the target's layers 0 and 29, chain of 3), and with --eagle an
EAGLE-3 checkpoint on a chain of 3 and on a dynamic tree (top-3, depth 3, 8 nodes). Nothing else should run
meanwhile (the machine's other load is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, sys, time
import torch
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
if sys.argv[1] != "-":
    sys.path.insert(0, sys.argv[1])
import draftsmith
from draftsmith.data.prompts import load_prompts
from draftsmith.eval.decoder import speculative_generate
from draftsmith.eval.tree import DynamicTree
from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids
from draftsmith.models.registry import build_drafter, load_drafter
n, max_new, eagle = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
loaded = load_model("smollm2-135m-instruct")
target, tok = loaded.model.eval(), loaded.tokenizer
eos = stop_ids(loaded.path, tok)
prompts = [torch.tensor(encode_chat(tok, first_turn(p.messages))) for p in load_prompts("mt_bench", n=n)]
self_draft = build_drafter("draft_lm", {"n_layers": 2, "init_layers": [0, 29]}, target).eval()
cases = {"self-draft chain 3": (self_draft, None)}
if eagle != "-":
    from pathlib import Path
    d = load_drafter(Path(eagle))[0].eval()
    cases["eagle3 chain 3"] = (d, None)
    cases["eagle3 dynamic tree"] = (d, DynamicTree(top_k=3, depth=3, total_tokens=8))
target.optimize_for_inference()  # the self-draft shares the target's layers: fused with them
if eagle != "-":
    d.optimize_for_inference()
out = {}
for name, (d, tree) in cases.items():
    speculative_generate(target, d, prompts[0], 8, draft_len=3, tree=tree, eos_ids=eos)  # warm-up
    toks, t0 = [], time.perf_counter()
    for p in prompts:
        toks.append(speculative_generate(target, d, p, max_new, draft_len=3, tree=tree, eos_ids=eos)[0])
    out[name] = {"s": time.perf_counter() - t0, "tokens": sum(map(len, toks)), "out": toks}
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="a folder holding the old version's draftsmith package")
    ap.add_argument("--new", default="-", help="the new version's folder (default: the installed draftsmith)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=6, help="MT-bench first turns")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--eagle", default="-", help="an EAGLE-3 checkpoint folder (adds its chain and tree cases)")
    a = ap.parse_args()
    rates: dict = {}
    outs: dict = {}
    for r in range(a.rounds):
        order = [("old", a.old), ("new", a.new)][:: 1 if r % 2 == 0 else -1]
        for version, code in order:
            cmd = [sys.executable, "-c", WORKER, code, str(a.n), str(a.max_new), a.eagle]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            for case, v in res.items():
                rates.setdefault(case, {}).setdefault(version, []).append(v["tokens"] / v["s"])
                outs.setdefault(case, {})[version] = v["out"]
    print(f"{a.n} MT-bench first turns, {a.max_new} new tokens, greedy, batch 1, median of {a.rounds} rounds")
    print(f"{'case':<22} {'old tok/s':>9} {'new tok/s':>9} {'new/old':>8}  same tokens")
    for case, v in rates.items():
        old, new = statistics.median(v["old"]), statistics.median(v["new"])
        same = outs[case]["old"] == outs[case]["new"]
        print(f"{case:<22} {old:9.1f} {new:9.1f} {new / old:8.3f}  {same}   (old {v['old']}, new {v['new']})")
    print(f"machine: {os.cpu_count()} CPUs (the workers run one at a time; keep the machine otherwise quiet)")


if __name__ == "__main__":
    main()
