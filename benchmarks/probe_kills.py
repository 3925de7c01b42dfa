"""SIGKILL at any moment, then rerun: does `generate` / `train` end exactly as an uninterrupted run? Every run is
`python -m draftsmith ...` in a subprocess on a tiny random Llama target built in a temporary folder (offline,
CPU, sampled data at temperature 1, about 3 minutes on 2 cores with the defaults).

First one uninterrupted `generate` and one `train` are timed and their outputs kept: shards, manifest,
checkpoints, final weights and the train rows of metrics.jsonl; their folders are polled every 2 ms, so the
moments each shard, checkpoint folder or metrics.jsonl appeared are known. Then each kill point starts the same
command in a fresh run folder (same path; train: with a copy of the uninterrupted data), sends SIGKILL at that
moment, checks what the kill left (a `manifest.json` or a shard must be complete and equal to the uninterrupted
one; every `checkpoints/*` folder without `.tmp` in its name must load with `load_drafter`, hold a training state
if it is a step, and hold the uninterrupted run's weights for that step if that run kept it), reruns the
command to completion and compares. Kill points: half of them (rounded up) at even fractions of the
uninterrupted run between its first output and its last (`first output+S`), the others right after a shard,
checkpoint or metrics.jsonl appeared (`after NAME`, spread over those the uninterrupted run wrote).

Reading the output: one line per kill: the stage, when it was killed (`t=` seconds from the start), what
existed then (shards or checkpoint folders, `+tmp` when a temporary file or folder was there), `lost` (generate:
(prompt, sample) records of the uninterrupted manifest missing after the rerun; train: steps whose metrics row
is missing), `dup` (records or train metrics rows that appear twice), and `identical` or the differences found:
files not byte-identical (shards, manifest.json, model.safetensors, train_state.safetensors, drafter.json),
train_state.json apart from its wall-clock counter, per-step losses, the final weights (max abs difference),
leftover temporary files, or a bad state after the kill. Then the totals `kills N: lost records L, duplicated D,
runs identical I/N`. The exit status is 1 on any loss, duplication or difference.

    python benchmarks/probe_kills.py [--generate-kills 7] [--train-kills 7] [--prompts 24] [--steps 400] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load

from draftsmith.data.records import load_shard, read_manifest, shard_entry, verify_shard
from draftsmith.models.registry import load_drafter

RECIPE = """\
name: killprobe
seed: 3
target: {{model: {model}, dtype: float32}}
data:
  prompts: {{source: file, path: {prompts}}}
  max_prompt_tokens: 64
  max_new_tokens: 128
  temperature: 1.0
  top_k: 50
  batch_size: 1
  signals: {{topk: 8}}
  shard_size: 4
drafter: {{kind: draft_lm, n_layers: 1, init_layers: [0]}}
train: {{steps: {steps}, micro_batch_size: 2, max_seq_len: 128, save_every: {save_every}, log_every: 1}}
out_dir: {run}
"""
TOPICS = ["foxes", "the sea", "rivers", "stars", "bread", "chess", "rain", "trains", "owls", "copper", "tea", "maps"]
POLL_S = 0.002


def prompts(n: int) -> list[dict]:
    asks = ["Tell me about {}.", "Write a short poem about {}.", "Why do people like {}?"]
    return [
        {"messages": [{"role": "user", "content": asks[i // len(TOPICS) % len(asks)].format(TOPICS[i % len(TOPICS)])}]}
        for i in range(n)
    ]


def build_target(path: Path, corpus: list[str]) -> None:
    """A tiny random Llama (2 layers, hidden 64) with a byte-level BPE tokenizer and a ChatML template."""
    from draftsmith.models.tiny import build_tiny_target

    build_tiny_target(path, corpus)


def command(stage: str, recipe: Path, run: Path) -> list[str]:
    return [sys.executable, "-m", "draftsmith", stage, str(recipe), f"out_dir={run}", "-q"]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def watched(stage: str, run: Path) -> set[str]:
    """The names that mark the stage's progress: data/ entries, or checkpoints/ folders and metrics.jsonl."""
    d = run / ("data" if stage == "generate" else "checkpoints")
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        names = []
    if stage == "train" and (run / "metrics.jsonl").exists():
        names.append("metrics.jsonl")
    # temporary names carry a pid or random letters: "shard-00001.safetensors.tmp", ".tmp*" (the safetensors
    # library's own temporary file while it writes)
    return {n if ".tmp" not in n else ".tmp*" if n.startswith(".tmp") else n.split(".tmp")[0] + ".tmp" for n in names}


def launch(stage: str, recipe: Path, run: Path, kill_at: float | None = None, kill_after: str | None = None):
    """Run the stage, polling its folder. Returns (exit code, seconds, {name: first seen at}, killed?).
    kill_at: SIGKILL that many seconds after the first output (startup time varies with the machine's load);
    kill_after: SIGKILL as soon as that name appears."""
    seen: dict[str, float] = {}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        command(stage, recipe, run), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    killed = False
    while proc.poll() is None:
        now = time.perf_counter() - t0
        for n in watched(stage, run):
            seen.setdefault(n, now)
        if (kill_at is not None and seen and now >= min(seen.values()) + kill_at) or (
            kill_after is not None and kill_after in seen
        ):
            proc.send_signal(signal.SIGKILL)
            killed = True
            break
        time.sleep(POLL_S)
    err = proc.communicate()[1]
    dt = now if killed else time.perf_counter() - t0
    if not killed and proc.returncode != 0:
        raise SystemExit(f"{stage} in {run} failed (exit {proc.returncode}):\n{err[-3000:]}")
    for n in watched(stage, run):
        seen.setdefault(n, dt)
    return proc.returncode, dt, seen, killed


class Outcome:
    """What a run folder holds, reduced to what must match the uninterrupted run."""

    def __init__(self, leftovers: list[str]):
        self.files: dict[str, bytes] = {}  # relative path -> bytes (tensor files, manifest, jsons)
        self.records: list[tuple[int, int]] = []  # generate: (prompt, sample) of every manifest record
        self.steps: list[int] = []  # train: the step of every train metrics row
        self.losses: dict[int, float] = {}  # train: step -> loss
        self.weights: dict[str, torch.Tensor] = {}  # train: the final drafter's state dict
        self.leftovers = leftovers  # temporary files still there


def state_json(path: Path) -> bytes:
    """train_state.json without its wall-clock counter (`seconds` differs between any two runs)."""
    meta = json.loads(path.read_text())
    meta["counters"].pop("seconds", None)
    return json.dumps(meta, sort_keys=True).encode()


def collect(stage: str, run: Path) -> Outcome:
    out = Outcome(leftovers=sorted(str(p.relative_to(run)) for p in run.rglob("*.tmp*")))
    if stage == "generate":
        data = run / "data"
        out.files = {f"data/{p.name}": p.read_bytes() for p in sorted(data.iterdir()) if p.is_file()}
        for e in read_manifest(data)["shards"]:
            s = load_shard(data / e["file"], entry=e)
            out.records += list(zip(s.prompt_index.tolist(), s.sample_index.tolist()))
        return out
    for folder in sorted((run / "checkpoints").iterdir()):
        for p in sorted(folder.iterdir()):
            key = f"checkpoints/{folder.name}/{p.name}"
            out.files[key] = state_json(p) if p.name == "train_state.json" else p.read_bytes()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("stage") == "train" and "loss" in row:
            out.steps.append(row["step"])
            out.losses[row["step"]] = row["loss"]
    out.weights = load_drafter(run / "checkpoints" / "final")[0].state_dict()
    return out


def compare(ref: Outcome, got: Outcome, stage: str) -> tuple[int, int, list[str]]:
    """(lost, duplicated, differences) of a rerun against the uninterrupted run."""
    if stage == "generate":
        lost = len(set(ref.records) - set(got.records))
        dup = len(got.records) - len(set(got.records))
    else:
        lost = len(set(ref.steps) - set(got.steps))
        dup = len(got.steps) - len(set(got.steps))
    diffs = [f"leftover {n}" for n in got.leftovers]
    diffs += [f"missing {n}" for n in sorted(set(ref.files) - set(got.files))]
    diffs += [f"extra {n}" for n in sorted(set(got.files) - set(ref.files))]
    differ: dict[str, list[str]] = {}  # what differs -> the folders it differs in
    for n in sorted(set(ref.files) & set(got.files)):
        if ref.files[n] != got.files[n]:
            folder, name = n.rsplit("/", 1)
            if name.endswith(".safetensors"):  # name the tensors
                a, b = load(ref.files[n]), load(got.files[n])
                keys = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
                name += f" ({', '.join(keys[:3]) or 'header'})"
            differ.setdefault(name, []).append(folder.split("/")[-1])
    diffs += [f"{name} differs in {', '.join(folders)}" for name, folders in differ.items()]
    if stage == "train":
        bad = [s for s in ref.losses if s in got.losses and got.losses[s] != ref.losses[s]]
        if bad:
            diffs.append(f"loss differs at {len(bad)} steps (first {bad[0]})")
        if set(ref.weights) != set(got.weights):
            diffs.append("final weights: other tensor names")
        else:
            worst = max((ref.weights[k] - got.weights[k]).abs().max().item() for k in ref.weights)
            if not all(torch.equal(ref.weights[k], got.weights[k]) for k in ref.weights):
                diffs.append(f"final weights differ (max abs {worst:.3g})")
    return lost, dup, diffs


def after_kill(stage: str, run: Path, ref: Outcome) -> tuple[str, list[str]]:
    """What the kill left (short text) and anything half-written that looks complete."""
    bad, names = [], sorted(watched(stage, run))
    if stage == "generate":
        data = run / "data"
        for n in names:
            if n.endswith(".safetensors"):
                try:
                    verify_shard(data / n, shard_entry(data / n))
                except Exception as e:  # noqa: BLE001 - any failure to read a complete-looking shard is the finding
                    bad.append(f"{n} unreadable after the kill: {str(e)[:80]}")
                    continue
                if (data / n).read_bytes() != ref.files.get(f"data/{n}"):
                    bad.append(f"{n} differs from the uninterrupted shard")
        if "manifest.json" in names and (data / "manifest.json").read_bytes() != ref.files["data/manifest.json"]:
            bad.append("manifest.json present but not the uninterrupted one")
        shards = [n[6:11] for n in names if n.endswith(".safetensors")]
        text = f"shards [{','.join(s.lstrip('0') or '0' for s in shards)}]" + (
            " manifest" if "manifest.json" in names else ""
        )
    else:
        ckpt = run / "checkpoints"
        for n in names:
            if n.endswith(".tmp*") or n.endswith(".tmp") or n == "metrics.jsonl":
                continue
            try:
                model, _ = load_drafter(ckpt / n)
            except Exception as e:  # noqa: BLE001
                bad.append(f"checkpoints/{n} does not load after the kill: {str(e)[:80]}")
                continue
            if n != "final" and not (ckpt / n / "train_state.json").is_file():
                bad.append(f"checkpoints/{n} has no train_state.json")
            want = ref.files.get(f"checkpoints/{n}/model.safetensors")
            if want is not None and (ckpt / n / "model.safetensors").read_bytes() != want:
                bad.append(f"checkpoints/{n} holds other weights than the uninterrupted run")
        steps = [n[5:].lstrip("0") or "0" for n in names if n.startswith("step-") and not n.endswith(".tmp")]
        text = f"steps [{','.join(steps)}]" + (" final" if "final" in names else "")
    if any(".tmp" in n for n in names):
        text += " +tmp"
    return text, bad


def kill_points(seen: dict[str, float], wall: float, n: int) -> list[tuple[float | None, str | None]]:
    """Half (rounded up) at even fractions of the uninterrupted run between its first output and its last (the
    manifest or the final checkpoint), as seconds after the first output; the rest right after files appeared
    (spread over the shards or checkpoints the uninterrupted run wrote; temporary names live for milliseconds,
    too briefly to be polled reliably)."""
    n_time, n_event = (n + 1) // 2, n // 2
    first, last = min(seen.values(), default=0.0), max(seen.values(), default=wall)
    times = [(last - first) * (i + 1) / (n_time + 1) for i in range(n_time)]
    done = ("manifest.json", "final")
    events = [k for k, _ in sorted(seen.items(), key=lambda kv: kv[1]) if ".tmp" not in k and k not in done]
    picks = [events[round(i * (len(events) - 1) / max(n_event - 1, 1))] for i in range(n_event)] if events else []
    return [(t, None) for t in times] + [(None, e) for e in picks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generate-kills", type=int, default=7, help="kill points in `generate` (0: none)")
    ap.add_argument("--train-kills", type=int, default=7, help="kill points in `train` (0: none)")
    ap.add_argument("--prompts", type=int, default=24, help="prompts generated (4 per shard)")
    ap.add_argument("--steps", type=int, default=400, help="train steps (a checkpoint every steps/8)")
    ap.add_argument("--keep", default=None, help="work in this folder and keep it (default: a temporary folder)")
    a = ap.parse_args()
    t_start = time.perf_counter()
    root = Path(a.keep or tempfile.mkdtemp(prefix="probe-kills-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    rows, fails = [], 0
    try:
        ps = prompts(a.prompts)
        build_target(root / "target", [json.dumps(p) for p in ps])
        (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in ps))
        recipe = root / "recipe.yaml"
        fields = {"model": root / "target", "prompts": root / "prompts.jsonl", "run": root / "unused"}
        recipe.write_text(RECIPE.format(**fields, steps=a.steps, save_every=max(a.steps // 8, 1)))
        for stage, k in (("generate", a.generate_kills), ("train", a.train_kills)):
            run = root / "run"  # every run in the same folder: recipe.yaml names it
            shutil.rmtree(run, ignore_errors=True)
            if stage == "train":
                shutil.copytree(root / "data", run / "data")
            _, wall, seen, _ = launch(stage, recipe, run)
            ref = collect(stage, run)
            if stage == "generate":
                shutil.copytree(run / "data", root / "data")
            print(f"{stage}: uninterrupted {wall:.1f}s, first output at {min(seen.values(), default=0):.1f}s")
            for at, after in kill_points(seen, wall, k):
                shutil.rmtree(run)
                if stage == "train":
                    shutil.copytree(root / "data", run / "data")
                _, t_kill, _, killed = launch(stage, recipe, run, kill_at=at, kill_after=after)
                left, bad = after_kill(stage, run, ref) if killed else ("finished before the kill", [])
                launch(stage, recipe, run)
                lost, dup, diffs = compare(ref, collect(stage, run), stage)
                diffs = bad + diffs
                when = f"t={t_kill:.2f}s " + (f"after {after}" if after else f"first output+{at:.2f}s")
                verdict = "identical" if not diffs else "; ".join(diffs)[:240]
                rows.append((stage, when, left, lost, dup, not diffs))
                fails += bool(lost or dup or diffs)
                print(f"{stage:8s} {when:42s} {left:28s} lost {lost} dup {dup}  {verdict}", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    n = len(rows)
    print(
        f"kills {n}: lost records {sum(r[3] for r in rows)}, duplicated {sum(r[4] for r in rows)}, "
        f"runs identical {sum(r[5] for r in rows)}/{n} ({time.perf_counter() - t_start:.0f}s)"
    )
    raise SystemExit(1 if fails else 0)


if __name__ == "__main__":
    main()
