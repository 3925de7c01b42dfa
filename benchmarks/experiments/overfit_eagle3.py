"""Overfit EAGLE-3 on SmolLM2-135M's own greedy answers, then decode the same prompts: the train/serve match at full
size (docs/decoding.md, "Train/serve match"), CPU, offline.

A drafter that fits its training records must draft them in the decoder: when training top-1 is high, a greedy
chain on the same prompts must accept about as often at its first position as teacher forcing says, and τ must
be well above 2. A low τ next to a high training top-1 is the train/serve mismatch users of other toolkits hit
(wrong feature layers, norms, shifts, vocabulary maps).

1. ``draftsmith generate eagle3-smollm2``: the target answers N prompts greedily (T = 0, max_new_tokens short),
   the fused EAGLE-3 features stored with the records (bf16);
2. ``draftsmith train``: EAGLE-3 (the recipe's: TTT 7 steps, 8k draft vocabulary) on them for many epochs, CE
   on the target's tokens;
3. ``draftsmith eval``: chain γ = --draft-len, T = 0, on the same prompts: τ and per-position acceptance;
4. the match (tests/match.py), in this process on the records: the objective's teacher-forced top-1 per TTT step
   over all trained positions, next to the decoder's per-position acceptance, and at every chain start the
   decoder's draft k against TTT step k - 1 (after accepted drafts), with the features from the records (bf16,
   as trained) and from the target (float32, as served).

The eval stage's per-position acceptance counts the steps whose γ the answer's end cut short as rejections past
their last draft; with short answers that pulls it down, so the match also prints the acceptance of each draft
where it was drafted, the number that should sit next to teacher-forced top-1 (a little below it: chains start
after rejections, at the harder positions).

Each stage prints its wall time. The defaults are meant to fit ~20 minutes on 2 quiet CPU cores (the training
stage dominates: lower --steps or --max-prompt-tokens if not); check it runs with tiny settings first:

    python benchmarks/experiments/overfit_eagle3.py                      # 200 ShareGPT prompts, 32 new tokens
    python benchmarks/experiments/overfit_eagle3.py --n 4 --max-new-tokens 8 --steps 4 --root runs/oe3-smoke
    python benchmarks/experiments/overfit_eagle3.py --source mt_bench --n 80 --set train.lr=2e-3
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from pathlib import Path

import torch

from draftsmith.cli import main as draftsmith


def stage(name: str, args: list[str], times: dict) -> None:
    t = time.perf_counter()
    print("$ draftsmith " + " ".join(args), flush=True)
    if draftsmith(args) != 0:
        raise SystemExit(f"{name} failed")
    times[name] = time.perf_counter() - t
    print(f"[{name}: {times[name]:.0f}s]", flush=True)


def fmt(xs) -> str:
    return " ".join(f"{x:.3f}" for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default="sharegpt", choices=["sharegpt", "mt_bench"], help="packaged prompt set")
    ap.add_argument("--n", type=int, default=200, help="prompts (records, and the eval prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="answer length (data and eval)")
    ap.add_argument("--max-prompt-tokens", type=int, default=128, help="longer prompts are skipped (training cost)")
    ap.add_argument("--steps", type=int, default=500, help="train steps (micro-batch 4: ~10 epochs of 200 records)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--draft-len", type=int, default=6, help="chain γ in eval and in the match")
    ap.add_argument("--match-n", type=int, default=None, help="records in the per-position match (default all)")
    ap.add_argument("--root", default="runs/overfit-eagle3", help="run folder (emptied first)")
    ap.add_argument("--reuse-data", action="store_true", help="keep the records of an earlier run of the same settings")
    ap.add_argument("--set", nargs="*", default=[], help="more recipe overrides for every stage (key=value)")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    root = Path(a.root)
    keep = ("data", "eval_prompts.jsonl") if a.reuse_data else ()
    for p in root.glob("*") if root.is_dir() else ():  # a fresh run (generate resumes on records of the same recipe)
        if p.name not in keep:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    prompts = f"{{source: {a.source}, n: {a.n}, shuffle: true, seed: 1, max_turns: 1}}"
    common = ["eagle3-smollm2", f"out_dir={root}", *a.set]
    data = [
        f"data.prompts={prompts}",
        "data.temperature=0",
        f"data.max_new_tokens={a.max_new_tokens}",
        f"data.max_prompt_tokens={a.max_prompt_tokens}",  # longer ones are skipped; eval decodes the records' prompts
        "data.signals.topk=0",
        "data.signals.hidden_layers=eagle3",
    ]
    train = [
        f"train.steps={a.steps}",
        f"train.lr={a.lr}",
        "train.warmup_steps=20",
        "train.loss.kind=ce",
        "train.save_every=0",
        "train.eval_every=0",
        f"train.max_seq_len={a.max_prompt_tokens + a.max_new_tokens}",
        f"train.log_every={max(1, a.steps // 20)}",
    ]
    ev = [
        f"eval.prompts={{source: file, path: {root.resolve() / 'eval_prompts.jsonl'}}}",
        "eval.strategy=chain",
        f"eval.draft_len={a.draft_len}",
        "eval.temperature=0",
        f"eval.max_new_tokens={a.max_new_tokens}",
        "eval.baseline_hf=false",
        "eval.warmup=0",
    ]
    times: dict[str, float] = {}
    stage("generate", ["generate", *common, *data, "-q"], times)
    write_eval_prompts(common + data, root)
    stage("train", ["train", *common, *data, *train, "-q"], times)
    stage("eval", ["eval", *common, *data, *ev, "-q"], times)
    t = time.perf_counter()
    match = run_match(a, root, common + data + train + ev)
    times["match"] = time.perf_counter() - t
    rows = [json.loads(x) for x in (root / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r.get("stage") == "train" and "top1_step0" in r][-1]
    rep = json.loads((root / "eval" / "report.json").read_text())
    steps = sorted(int(k.removeprefix("top1_step")) for k in last if k.startswith("top1_step"))
    print("\n== overfit EAGLE-3 on SmolLM2-135M-Instruct ==")
    n_rec = rep["prompts"]["n"]
    print(f"prompts: {n_rec} records of {a.n} {a.source} prompts (<= {a.max_prompt_tokens} tokens), "
          f"{a.max_new_tokens} new tokens, chain γ = {a.draft_len}, T = 0")  # fmt: skip
    print(f"train: {a.steps} steps of 4 records = {a.steps * 4 / max(1, n_rec):.1f} epochs")
    print(
        f"train (last logged window, step {last['step']}): top1 per TTT step "
        + fmt(last[f"top1_step{s}"] for s in steps)
    )
    print(f"eval stage: τ = {rep['tau']:.2f}, per-position acceptance {fmt(rep['per_position_acceptance'])}")
    print(f"            lossless_match {rep['lossless_match']}, {rep['prompts']['n']} prompts")
    print_match(match)
    print("stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))


def write_eval_prompts(overrides: list[str], root: Path) -> None:
    """The first turns of the prompts the records kept, as the eval stage's prompt file (same order)."""
    from draftsmith.data.dataset import RecordDataset
    from draftsmith.eval.prompts import prompts_from
    from draftsmith.models.loading import first_turn
    from draftsmith.recipes.loader import load_recipe

    pc = load_recipe(overrides[0], overrides[1:]).data.prompts
    prompts, ds = prompts_from(pc, pc.n, text_ok=True), RecordDataset(root / "data", 1 << 20, signals=set())
    kept = [ds[i].prompt_index for i in range(len(ds))]
    lines = [json.dumps({"messages": first_turn(prompts[i].messages)}) for i in kept]
    (root / "eval_prompts.jsonl").write_text("\n".join(lines) + "\n")


def run_match(a, root: Path, overrides: list[str]) -> dict:
    import importlib.util

    from draftsmith.data.dataset import RecordDataset
    from draftsmith.eval.decoder import DecodeStats

    # the match is test support (tests/match.py), loaded from its file
    spec = importlib.util.spec_from_file_location("match", Path(__file__).resolve().parents[2] / "tests" / "match.py")
    match = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(match)
    compare = match.compare
    from draftsmith.models.loading import encode_chat, first_turn, load_model, stop_ids
    from draftsmith.models.registry import load_drafter
    from draftsmith.recipes.loader import load_recipe

    recipe = load_recipe(overrides[0], overrides[1:])
    tgt = load_model(recipe.target.model, torch.float32)
    drafter, _ = load_drafter(root / "checkpoints" / "final")
    ds = RecordDataset(root / "data", 1 << 20)
    records = [ds[i] for i in range(len(ds) if a.match_n is None else min(a.match_n, len(ds)))]
    # the eval stage's prompts, rendered as it renders them, against the records' contexts (the same order)
    from draftsmith.eval.prompts import prompts_from

    encoded = [encode_chat(tgt.tokenizer, first_turn(p.messages)) for p in prompts_from(recipe.eval.prompts, None)]
    contexts = [r.input_ids[: int(r.loss_mask.nonzero()[0, 0])].tolist() for r in records]
    same_prompt = sum(e == c for e, c in zip(encoded, contexts))
    eos = stop_ids(tgt.path, tgt.tokenizer)
    serving = copy.deepcopy(tgt.model).optimize_for_inference(), copy.deepcopy(drafter).optimize_for_inference()
    with torch.no_grad():
        stored = compare(tgt.model, drafter, recipe.drafter, records, a.max_new_tokens, a.draft_len, eos,
                         serving=serving, batch_size=4)  # fmt: skip
        served = compare(tgt.model, drafter, recipe.drafter, records, a.max_new_tokens, a.draft_len, eos,
                         in_loop=True, batch_size=4, decoded=stored.decoded)  # fmt: skip
    total = DecodeStats(accept_counts=[0] * (a.draft_len + 1))
    for _, _, st in stored.decoded:
        total.merge(st)
    return {"stored": stored, "served": served, "total": total, "n": len(records), "same_prompt": same_prompt}


def print_match(m: dict) -> None:
    s, f, total = m["stored"], m["served"], m["total"]
    print(f"match ({m['n']} records; eval-stage prompt == record context for {m['same_prompt']} of them):")
    print(f"  decoder here: τ = {total.tau:.2f}, per-position acceptance {fmt(total.per_position_acceptance())}")
    print(
        "  teacher-forced top-1 per TTT step, all trained positions (record features): "
        + fmt(map(s.top1, range(len(s.compared))))
    )
    print(f"  chain starts {s.starts}: first draft accepted {s.accepted_first / max(1, s.starts):.3f}")
    print(f"  decoder acceptance of draft k where it was drafted (no γ cut at the end): {fmt(s.acceptance())}")
    for name, x in (("record (bf16) features", s), ("target (fp32) features", f)):
        rates = fmt(x.rate(k) for k in range(len(x.compared)))
        print(f"  draft k == TTT step k-1 argmax, {name}: {rates}  (compared {x.compared}; {len(x.mismatches)} differ)")
    print(f"  records the decoder left (an fp32 target argmax flipped): {s.diverged}")


if __name__ == "__main__":
    main()
