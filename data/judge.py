"""Judge labels without humans (docs/algorithms.md A8, AutoJudge-style): ``draftsmith generate`` with data.judge_labels.

For each task (eval/tasks.py: HumanEval unit tests, GSM8K-style final answers):
1. the target answers greedily; its outcome O is recorded (pass/fail, or the final answer);
2. the draft LM reads the target's answer teacher-forced; where its argmax differs from the target's token
   (a draft/target mismatch a lossless verifier would reject), up to ``max_swaps`` positions per task:
3. the draft's token is substituted, the target continues greedily from there, and the new outcome O' is
   checked. Label 1 (acceptable) when O' == O, else 0 (the swap changed the result). Both outcomes are kept:
   each record also stores whether O and O' are right (``judge_base_ok``, ``judge_swap_ok``), and the manifest
   counts the swaps that broke a right answer and those that fixed a wrong one.

Each what-if becomes one record: the context up to and including the substituted token, with that token as the
only loss position and a ``judge_label`` signal; the judge trains on the target's state there (read in the loop).
Shards of ``shard_size`` tasks are written atomically and skipped on a rerun, so a killed run resumes; the
manifest is written last. No text is logged, only counts. With ``only_correct`` only tasks the target solves get
swaps, so every 0 label is a swap that broke a right answer (a weak target fails most tasks, and a failing answer
mostly stays failing whatever is swapped in).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.data.generate import data_hash
from draftsmith.data.records import (
    FORMAT,
    SOURCES,
    Record,
    bytes_per_token,
    shard_done,
    shard_entry,
    shard_name,
    write_manifest,
    write_shard,
)
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import autoregressive_generate
from draftsmith.eval.tasks import load_tasks, outcome, outcome_correct
from draftsmith.models.loading import encode_chat, load_model, stop_ids, tokenizer_hash
from draftsmith.models.registry import drafter_spec, load_drafter
from draftsmith.runlog import RunLog, save_recipe
from draftsmith.runtime import resolve_device, resolve_dtype

COUNTS = ("tasks", "swaps", "acceptable", "base_pass", "broke", "fixed")  # per shard and in the manifest


@torch.no_grad()
def task_records(
    target,
    draft,
    tok,
    task,
    prompt_index: int,
    max_new: int,
    eos: set[int],
    max_swaps: int,
    timeout: float,
    only_correct: bool = False,
) -> tuple[list[Record], dict]:
    """The what-if records of one task and its tallies (none when ``only_correct`` and the target got it wrong)."""
    ids = encode_chat(tok, task.messages)
    resp = autoregressive_generate(target, torch.tensor(ids), max_new, eos_ids=eos)
    text = tok.decode(resp, skip_special_tokens=True)
    base = outcome(task, text, timeout)
    solved = outcome_correct(task, base)
    if only_correct and not solved:
        return [], {"tasks": 1, "swaps": 0, "acceptable": 0, "base_pass": 0, "broke": 0, "fixed": 0}
    seq = torch.tensor([ids + resp], device=next(draft.parameters()).device)
    pred = draft(seq)[0, len(ids) - 1 : -1].argmax(-1).tolist()  # the draft's choice for each response token
    swaps = [i for i, (p, r) in enumerate(zip(pred, resp)) if p != r][:max_swaps]
    records, acceptable, broke, fixed = [], 0, 0, 0
    for i in swaps:
        prefix = ids + resp[:i] + [pred[i]]
        cont = (
            []
            if pred[i] in eos
            else autoregressive_generate(target, torch.tensor(prefix), max_new - i - 1, eos_ids=eos)
        )
        swapped = outcome(task, tok.decode(resp[:i] + [pred[i]] + cont, skip_special_tokens=True), timeout)
        label, swap_ok = float(swapped == base), outcome_correct(task, swapped)
        acceptable += int(label)
        broke, fixed = broke + int(solved and not swap_ok), fixed + int(swap_ok and not solved)
        records.append(
            Record(
                prefix,
                [0] * (len(prefix) - 1) + [1],
                prompt_index,
                i,
                SOURCES["drafter"],
                {
                    "judge_label": torch.tensor([label]),
                    "judge_base_ok": torch.tensor([float(solved)]),
                    "judge_swap_ok": torch.tensor([float(swap_ok)]),
                },
            )
        )
    return records, {
        "tasks": 1,
        "swaps": len(swaps),
        "acceptable": acceptable,
        "base_pass": int(solved),
        "broke": broke,
        "fixed": fixed,
    }


def mine(recipe) -> Path:
    """Run the judge-label data stage; returns the data folder (with manifest.json)."""
    dc, jc, out = recipe.data, recipe.data.judge_labels, recipe.run_dir / "data"
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.tmp*"):  # left by a killed run; never read
        stale.unlink()
    tgt, draft, tok_hash = _mining_models(recipe)
    tasks = load_tasks(jc.tasks, jc.path, jc.n, jc.start)
    save_recipe(recipe)
    eos = stop_ids(tgt.path, tgt.tokenizer)
    dhash, legacy_hash = data_hash(recipe), data_hash(recipe, with_n=True)
    meta = {"data_hash": dhash, "target": recipe.target.model, "tokenizer_hash": tok_hash, "target_path": tgt.backend}
    starts = range(0, len(tasks), dc.shard_size)
    runlog = RunLog(recipe.run_dir, "generate")
    bar = tqdm(total=len(tasks), unit="task", desc="judge labels", dynamic_ncols=True)
    t0 = time.perf_counter()
    for si, start in enumerate(starts):
        path, shard = out / shard_name(si), tasks[start : start + dc.shard_size]
        if shard_done(path, dhash, legacy_hash=legacy_hash):
            bar.update(len(shard))
            continue
        records, counts = [], dict.fromkeys(COUNTS, 0)
        for j, task in enumerate(shard):
            recs, c = task_records(tgt.model, draft, tgt.tokenizer, task, start + j, dc.max_new_tokens, eos,
                                   jc.max_swaps, jc.timeout, jc.only_correct)  # fmt: skip
            records += recs
            counts = {k: counts[k] + c[k] for k in counts}
            bar.update(1)
        write_shard(path, records, meta, counts)
        runlog.log({"shard": si, **counts, "seconds": round(time.perf_counter() - t0, 1)})
    bar.close()
    totals = _write_judge_manifest(recipe, out, meta, len(starts), len(tasks))
    runlog.log({"done": True, **totals})
    print(
        f"generate: {totals['swaps']} what-if swaps on {totals['tasks']} tasks ({totals['acceptable']} kept the "
        f"outcome, {totals['broke']} broke a right answer, {totals['fixed']} fixed a wrong one; the target passed "
        f"{totals['base_pass']}) in {time.perf_counter() - t0:.0f}s -> {out}"
    )
    return out


def _mining_models(recipe):
    """The target (its fused decode path) and the draft LM whose what-if swaps are labelled -> (target, draft,
    tokenizer hash); a checkpoint of another kind or tokenizer is refused."""
    jc, t = recipe.data.judge_labels, recipe.target
    device = resolve_device(t.device)
    dtype = resolve_dtype(t.dtype, device)
    tgt = load_model(t.model, dtype, device, t.trust_remote_code, t.revision, backend=t.backend)
    tgt.model.optimize_for_inference()  # decode-only here: the fused fast path (same logits to float rounding)
    draft, info = load_drafter(Path(jc.checkpoint), dtype=dtype, device=device)
    if not drafter_spec(info["kind"]).causal_lm:  # the swaps are a standalone draft LM's tokens
        raise DraftsmithError(
            f"data.judge_labels.checkpoint {jc.checkpoint!r} is a {info.get('kind')} checkpoint; "
            f"the what-if swaps come from a standalone draft LM"
        )
    tok_hash = tokenizer_hash(tgt.tokenizer)
    if info.get("tokenizer_hash") not in (None, tok_hash):
        raise DraftsmithError(f"data.judge_labels.checkpoint {jc.checkpoint!r} uses a different tokenizer")
    return tgt, draft, tok_hash


def _write_judge_manifest(recipe, out: Path, meta: dict, n_shards: int, n_tasks: int) -> dict:
    """The manifest over every shard (shards from an earlier run included) -> the label counts; no what-if swap at
    all is refused with the reason."""
    jc = recipe.data.judge_labels
    entries = [shard_entry(out / shard_name(i)) for i in range(n_shards)]
    totals = {k: sum(e["counts"].get(k, 0) for e in entries) for k in COUNTS}  # shards from before broke/fixed
    if totals["swaps"] == 0:
        why = (
            f"the target solved none of the {n_tasks} tasks (data.judge_labels.only_correct)"
            if jc.only_correct and totals["base_pass"] == 0
            else f"the draft agreed with the target everywhere on {n_tasks} tasks"
        )
        raise DraftsmithError(f"data.judge_labels: {why}; no what-if swaps to label (use more tasks or a weaker draft)")
    manifest = {
        "format": FORMAT,
        **meta,
        "recipe": recipe.name,
        "responses": "judge_labels",
        "n_sequences": sum(e["n_sequences"] for e in entries),
        "n_tokens": sum(e["n_tokens"] for e in entries),
        "n_loss_tokens": sum(e["n_loss_tokens"] for e in entries),
        "judge": {**jc.model_dump(), **totals},
        "signals": {"judge": {"axis": "loss"}},
        "bytes_per_token": bytes_per_token(entries),
        "shards": entries,
    }
    write_manifest(out, manifest)
    return totals
