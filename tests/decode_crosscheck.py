"""Decodes of every proposer kind x shape x strategy x hook, at B = 1 and B = 4, written to one JSON file: the
before/after cross-check of a decoder change. Run it on two trees and compare the files (``--compare A B``):

    python tests/decode_crosscheck.py --out runs/before.json      # on the old tree
    python tests/decode_crosscheck.py --out runs/after.json       # on the new tree
    python tests/decode_crosscheck.py --compare runs/before.json runs/after.json

Each entry is one row's tokens, accepted drafts per step, drafted count and judged count. Sampled rows draw from
their own seeded generators, so their streams are reproducible too.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import PROPOSER_KINDS, TINY_CFG, tiny_model  # noqa: E402
from test_batch_decode import make_drafter  # noqa: E402

from draftsmith.eval.batch_decoder import BatchDecoder  # noqa: E402
from draftsmith.eval.decoder import speculative_generate  # noqa: E402
from draftsmith.eval.tree import DynamicTree, tree_from_choices  # noqa: E402
from draftsmith.models.acceptance import ConfidenceStop, EntropyStop  # noqa: E402

CFG16 = replace(TINY_CFG, vocab_size=16)
LENS = [1, 5, 30, 7]
NEW = 32
SHAPES = {
    "chain": {},
    "static": {"tree": tree_from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])},
    "dynamic": {"tree": DynamicTree(top_k=3, depth=3, total_tokens=8)},
    "stop-conf": {"stop_drafting": ConfidenceStop(0.5, min_len=0)},
    "stop-entropy-before": {"stop_drafting": EntropyStop(1.5, before_feed=True)},
}


class _Judge:
    def accepts(self, states):
        return states[:, 0] > 0


def cases():
    for kind in PROPOSER_KINDS:
        for shape in SHAPES:
            for temp in (0.0, 1.0):
                yield kind, shape, temp, None
    yield "draft_lm", "judged", 0.0, _Judge()


def run() -> dict:
    torch.set_num_threads(1)
    tgt = tiny_model(1, CFG16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CFG16.vocab_size, (n,), generator=g) for n in LENS]
    out, drafters = {}, {}
    for kind, shape, temp, judge in cases():
        if kind not in drafters:
            drafters[kind] = make_drafter(kind, tgt)
        d, kw = drafters[kind], dict(SHAPES.get(shape, {}))
        key = f"{kind}/{shape}/T{temp}"
        try:
            for b, p in enumerate(prompts):
                gen = torch.Generator().manual_seed(100 + b)
                toks, st = speculative_generate(tgt, d, p, NEW, draft_len=3, temperature=temp, generator=gen,
                                                judge=judge, **kw)  # fmt: skip
                out[f"{key}/B1/{b}"] = [toks, st.accepted_per_step, st.drafted, st.judge_accepted]
            dec = BatchDecoder(tgt, d, draft_len=3, max_len=160, judge=judge, **kw)
            ids = [dec.add(p, NEW, temperature=temp, generator=torch.Generator().manual_seed(100 + b))
                   for b, p in enumerate(prompts)]  # fmt: skip
            toks = {i: [] for i in ids}
            while dec.active():
                for i, t in dec.step().items():
                    toks[i] += t
            for b, i in enumerate(ids):
                st = dec.stats[i]
                out[f"{key}/B4/{b}"] = [toks[i], st.accepted_per_step, st.drafted, st.judge_accepted]
        except ValueError as e:  # a combination the decoder refuses (a stop hook on heads that take none, ...)
            out[f"{key}/refused"] = str(e).splitlines()[0]
    return out


def compare(a: Path, b: Path) -> int:
    x, y = json.loads(a.read_text()), json.loads(b.read_text())
    diff = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
    for k in diff[:20]:
        print("differs:", k, x.get(k), y.get(k))
    print(f"{len(x)} entries before, {len(y)} after, {len(diff)} differ")
    return 1 if diff else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the decodes here")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"))
    a = ap.parse_args()
    if a.compare:
        sys.exit(compare(*a.compare))
    res = run()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res))
    print(f"{len(res)} entries -> {a.out}")
