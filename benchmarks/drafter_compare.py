"""The drafters side by side: DFlash, P-EAGLE, EAGLE-3.1, a fresh MTP layer and HASS (with its two changes alone)
against EAGLE-3, Hydra++ and PARD, FSPAD against EAGLE-1, Gumiho against Hydra++, Falcon against Medusa and PARD,
Kangaroo against a draft LM of as many trained parameters, and GliDe against the same one-layer draft LM without its
cross-attention over the target's KV cache, each trained on the same records with the same
steps, micro-batch and loss (FKL; HASS adds its top-k term), then decoded on the same prompts.

    python benchmarks/drafter_compare.py                    # generate the records once, train + eval each arm
    python benchmarks/drafter_compare.py --steps 100 --prompts 80 --max-new-tokens 64 --arms eagle3 dflash
    python benchmarks/drafter_compare.py --table-only       # print the table from existing runs

Records: the quickstart's data section (SmolLM2-135M-Instruct answering ShareGPT prompts, top-32 and the final
hidden state), written once under runs/compare/data and copied into each arm's run. Each arm's drafter section
and learning rate come from its shipped recipe; train.steps, micro-batch 4, FKL, the sequence length and the
precision are the same for every arm. The MTP arm is a fresh MTP layer of the target's kind (SmolLM2 ships none).

Per arm: drafter parameters (without the frozen embeddings / head copies), train tokens/s (the loop's mean over
the run), teacher-forced top-1 of the first three draft positions at the last logged step, then `draftsmith eval`
with a chain of 3, the static tree [[0], [0, 0], [1]], (exit6) up to 6 drafts cut by the confidence rule at 0.6,
4-node dynamic trees of depth 3 expanding 3 nodes per level (dyn4) or only the top-1 chain (cape4: CaPE), and
DySpec's confidence-sized tree (dyspec: up to 8 nodes and 5 levels, nodes of cumulative draft probability >= 0.3),
at T = 0 on MT-bench: τ, speed against own plain decoding measured in the same process, and the lossless count.
Compare speeds only within one run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ARMS = {  # arm -> (shipped recipe whose drafter section and lr it takes, drafter fields changed[, loss fields])
    "eagle3": ("eagle3-smollm2", {"ttt_steps": 3}),
    "eagle3.1": ("eagle3-smollm2", {"ttt_steps": 3, "fc_norm": True}),
    "peagle": ("peagle-smollm2", {"parallel_drafts": 3}),
    "dflash": ("dflash-smollm2", {}),
    "hydra++": ("quickstart", {}),
    "pard": ("pard-smollm2", {}),
    "mtp": ("eagle1-smollm2", None),  # None: the section is replaced (below)
    "hass": ("hass-smollm2", {"ttt_steps": 3}, {"hod_weight": 1.0, "hod_k": 10}),  # both of HASS's changes
    "hass-hod": ("eagle3-smollm2", {"ttt_steps": 3}, {"hod_weight": 1.0, "hod_k": 10}),  # its top-k loss only
    "hass-hca": ("hass-smollm2", {"ttt_steps": 3}),  # its context alignment only (ttt_detach)
    "kangaroo": ("kangaroo-smollm2", {}),  # the target's first 2 layers + a trained attention adapter
    "draft-lm-0.9m": ("kangaroo-smollm2", {"kind": "draft_lm", "n_layers": 1, "hidden_dim": 8}),  # as many trained
    "eagle1": ("eagle1-smollm2", {}),  # FSPAD's baseline: EAGLE-1, teacher-forced, feature + token loss
    "fspad": ("fspad-smollm2", {}),  # both of FSPAD's changes
    "gumiho": ("gumiho-smollm2", {}),  # 2-layer EAGLE-3 for drafts 1-2, 5 MLP heads for drafts 3-7
    "falcon": ("falcon-smollm2", {}),  # semi-autoregressive: 2 drafts per forward, CSGD
    "medusa": ("medusa-smollm2", {}),  # Falcon's baselines: Medusa-1 heads, and PARD
    "glide": ("glide-smollm2", {"lags": 3}),  # one layer + a cross-attention over the target's KV cache
    "draft-lm-1l": ("glide-smollm2", {"kind": "draft_lm", "n_layers": 1, "init_layers": [0]}),  # GliDe without it
}
MTP = {"kind": "mtp", "init": "random", "ttt_steps": 3}
DYN4 = ["eval.strategy=dynamic_tree", "eval.tree.top_k=3", "eval.tree.depth=3", "eval.tree.total_tokens=4"]
SETTINGS = {
    "chain3": ["eval.strategy=chain", "eval.draft_len=3"],
    "tree3": ["eval.strategy=tree", "eval.tree.choices=[[0],[0,0],[1]]"],
    "exit6": ["eval.strategy=chain", "eval.draft_len=6", "eval.stop.rule=confidence", "eval.stop.threshold=0.6"],
    "dyn4": [*DYN4],
    "cape4": [*DYN4, "eval.tree.frontier=1"],
    "dyspec": [
        "eval.strategy=dynamic_tree",
        "eval.tree.top_k=3",
        "eval.tree.depth=5",
        "eval.tree.total_tokens=8",
        "eval.tree.min_prob=0.3",
    ],  # fmt: skip
}  # exit6: up to 6 drafts, stopping once the draft's top-1 probability is below 0.6 (Kangaroo's early exit)
ROOT = Path("runs/compare")
POS = ("step", "draft", "head")  # metric names of the draft positions: TTT steps, block / PARD drafts, heads


def _recipes() -> Path:
    from draftsmith.recipes.loader import find_recipe

    return find_recipe("quickstart").parent


def arm_recipe(arm: str, steps: int) -> Path:
    """runs/compare/<arm>/recipe.yaml: the quickstart's data section, the arm's drafter, the shared train setup."""
    base = yaml.safe_load((_recipes() / "quickstart.yaml").read_text())
    name, fields, loss = (*ARMS[arm], {})[:3]
    src = yaml.safe_load((_recipes() / f"{name}.yaml").read_text())
    base["name"] = f"compare-{arm}"
    if fields is None or "kind" in fields:  # a section of its own (MTP; a draft LM beside Kangaroo)
        base["drafter"] = MTP if fields is None else fields
    else:
        base["drafter"] = {**src["drafter"], **fields}
    base["train"].update({"steps": steps, "lr": src["train"]["lr"], "micro_batch_size": 4, "packing": False})
    base["train"]["loss"] = {"kind": "fkl", **loss}  # the same loss for every arm, HASS's top-k term where named
    base["export"] = {"enabled": False}
    base["eval"]["baseline_hf"] = False
    out = ROOT / arm
    out.mkdir(parents=True, exist_ok=True)
    path = out / "recipe-arm.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def run(*args: str) -> None:
    print("+ draftsmith", " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "draftsmith", *args], check=True)


def records() -> Path:
    data = ROOT / "gen" / "data"
    if not (data / "manifest.json").is_file():
        run("generate", "quickstart", f"out_dir={ROOT / 'gen'}", "-q")
    return data


def train_and_eval(arm: str, steps: int, prompts: int, new: int, settings: list[str]) -> None:
    recipe, out = arm_recipe(arm, steps), ROOT / arm
    common = [f"out_dir={out}", f"eval.prompts.n={prompts}", f"eval.max_new_tokens={new}", "-q"]
    if not (out / "data").exists():
        shutil.copytree(records(), out / "data")
    if not (out / "checkpoints" / "final" / "drafter.json").is_file():
        run("train", str(recipe), *common)
    for setting in settings:
        extra = SETTINGS[setting]
        if not (out / setting / "report.json").is_file():
            run("eval", str(recipe), *common, *extra)
            shutil.copytree(out / "eval", out / setting, dirs_exist_ok=True)


def train_facts(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("stage") == "train" and "loss" in r]
    last = train[-1]
    top1 = []
    for j in range(3):
        keys = [f"top1_{p}{j}" for p in POS if f"top1_{p}{j}" in last]
        top1.append(last[keys[0]] if keys else None)
    rates = [r["tokens_per_s"] for r in train if r.get("tokens_per_s")]
    info = json.loads((out / "checkpoints" / "final" / "drafter.json").read_text())
    return {"top1": top1, "tok_s": sum(rates) / len(rates) if rates else None, "step": last.get("step"), **info}


def n_params(out: Path) -> int:
    from draftsmith.models.registry import load_drafter

    model, _ = load_drafter(out / "checkpoints" / "final")
    return model.num_params(exclude_embeddings=True)


def table(arms: list[str]) -> str:
    lines = [
        f"| drafter | params | train tok/s | top-1 d1 / d2 / d3 | {' | '.join(f'{s}: τ, × own AR' for s in SETTINGS)} "
        "| lossless |",
        "|---|---|---|---|" + "---|" * len(SETTINGS) + "---|",
    ]
    for arm in arms:
        out = ROOT / arm
        if not (out / "checkpoints" / "final" / "drafter.json").is_file():
            continue
        t = train_facts(out)
        top1 = " / ".join("—" if x is None else f"{x:.3f}" for x in t["top1"])
        cells, lossless = [], []
        for setting in SETTINGS:
            f = out / setting / "report.json"
            if not f.is_file():
                cells.append("—")
                continue
            r = json.loads(f.read_text())
            cells.append(f"{r['tau']:.3f}, {r['speedup']['vs_ar']:.2f}×")
            n = r["prompts"]["n"]
            lossless.append(f"{round(r['lossless_match'] * n)}/{n}")
        rate = "—" if t["tok_s"] is None else f"{t['tok_s']:.0f}"
        params = f"{n_params(out) / 1e6:.1f} M"
        lines.append(f"| {arm} | {params} | {rate} | {top1} | {' | '.join(cells)} | {', '.join(lossless)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS), help="which drafters (default: all)")
    ap.add_argument("--steps", type=int, default=100, help="train steps of every arm (micro-batch 4)")
    ap.add_argument("--prompts", type=int, default=80, help="MT-bench prompts per eval")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS), help="eval settings")
    ap.add_argument("--table-only", action="store_true", help="print the table from existing runs, run nothing")
    a = ap.parse_args()
    if not a.table_only:
        for arm in a.arms:
            train_and_eval(arm, a.steps, a.prompts, a.max_new_tokens, a.settings)
    print(table(a.arms))


if __name__ == "__main__":
    main()
