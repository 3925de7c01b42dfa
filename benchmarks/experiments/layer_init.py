"""How good is a draft LM made of a subset of the target's own layers, before any training?

`drafter.init_layers` copies chosen target layers into a standalone draft (with the target's embeddings, final
norm and LM head). This measures, for each candidate subset, the teacher-forced top-1 agreement with the target
on target-written records: at every response position, does the draft's argmax equal the target's? That is the
greedy acceptance rate of the first draft, with no training. It tells whether a layer-skip draft can be used as
is (self-speculation style) or only as a starting point for training.

Usage: python benchmarks/experiments/layer_init.py --data runs/fd-big/data [--records 24]
       [--target smollm2-135m-instruct] [--subset first8last8=0-7,22-29 ...]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from draftsmith.data.records import load_shard, read_manifest
from draftsmith.models.llama import Llama
from draftsmith.models.loading import load_model


def parse_layers(spec: str) -> list[int]:
    """'0-7,22-29' -> [0, ..., 7, 22, ..., 29]."""
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def layer_draft(target: Llama, layers: list[int]) -> Llama:
    """The target's embeddings, final norm, LM head and the chosen layers, in order."""
    draft = Llama(replace(target.cfg, n_layers=len(layers))).to(target.embed_tokens.weight.dtype)
    sd = {k: v for k, v in target.state_dict().items() if not k.startswith("layers.")}
    for i, src in enumerate(layers):
        sd.update({f"layers.{i}.{k}": v for k, v in target.layers[src].state_dict().items()})
    draft.load_state_dict(sd)
    return draft.eval()


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a records folder written by `draftsmith generate`")
    ap.add_argument("--records", type=int, default=24, help="records read from the folder's last shard(s)")
    ap.add_argument("--target", default="smollm2-135m-instruct", help="the target the records were written by")
    ap.add_argument(
        "--subset",
        nargs="*",
        default=None,
        help="NAME=LAYERS candidates, LAYERS as '0-3,26-29'; default: a set of 8- and 16-layer "
        "subsets for a 30-layer target",
    )
    args = ap.parse_args()
    target = load_model(args.target).model.eval()
    L = target.cfg.n_layers
    subsets = (
        dict(s.split("=", 1) for s in args.subset)
        if args.subset
        else {
            "first4+last4": f"0-3,{L - 4}-{L - 1}",
            "every4th(8)": ",".join(str(i) for i in range(0, L, 4)[:8]),
            "first12+last4": f"0-11,{L - 4}-{L - 1}",
            "first8+last8": f"0-7,{L - 8}-{L - 1}",
            "first10+last6": f"0-9,{L - 6}-{L - 1}",
            "every2nd(16)": ",".join(str(i) for i in range(0, L, 2)[:16]),
            "all": f"0-{L - 1}",
        }
    )
    shards = [Path(args.data) / e["file"] for e in read_manifest(Path(args.data))["shards"]]
    records = []
    for path in reversed(shards):  # the newest shards: answers a draft trained on the early ones may not have seen
        shard = load_shard(path, signals=set())
        records += [shard.record(i) for i in range(len(shard))][: args.records - len(records)]
        if len(records) >= args.records:
            break
    rows = []  # (ids, positions whose logits predict a response token, the target's argmax there)
    for r in records:
        pos = r.loss_mask[1:].nonzero()[:, 0]
        rows.append((r.input_ids.view(1, -1), pos, target(r.input_ids.view(1, -1))[0, pos].argmax(-1)))
    n = sum(len(p) for _, p, _ in rows)
    print(f"{len(records)} records, {n} response positions, target {args.target} ({L} layers)\n")
    print("| subset | layers | top-1 agreement |\n|---|---|---|")
    for name, spec in subsets.items():
        layers = parse_layers(spec)
        if not all(0 <= i < L for i in layers):
            raise SystemExit(f"--subset {name}: layers {spec} outside the target's 0-{L - 1}")
        draft = layer_draft(target, layers)
        hit = sum(int((draft(ids)[0, pos].argmax(-1) == want).sum()) for ids, pos, want in rows)
        print(f"| {name} | {len(layers)} | {hit / n:.3f} |", flush=True)


if __name__ == "__main__":
    main()
