"""Online distillation on the real SmolLM2 target: does τ rise while serving a shifted distribution, and does
learning survive a crash in the middle of an update?

1. `draftsmith serve RECIPE` starts with the recipe's trained drafter (the quickstart one saw ShareGPT chat) and
   learning on.
2. A traffic generator sends a shifted distribution (HumanEval code prompts) through the real `openai` client
   (`pip install openai`).
3. τ is recorded per request (the traffic buffer keeps it with the serving drafter version). The script prints τ
   per window of requests and per version: τ over time must rise.
4. While the learner is in the middle of an update, the server is killed with SIGKILL. Every answered request
   must be in the buffer, and a restarted server must serve the last published version and keep learning.

Reading the output: a table of τ (mean per request) per window of --window requests with the drafter versions
that served them, then one row per learner round (its train records, held-out τ of the serving drafter against
the candidate, and the version published if the candidate won), and "τ last window / first window", measured on
the same server in one run (> 1: serving got faster). The kill line says how many answered requests the traffic
buffer kept (all of them) and which version was serving. The last line names the machine and how much of its CPU
other processes took during the run (the server and learner are this script's children, so their CPU time counts
as other processes').

    python benchmarks/online_proof.py [--recipe quickstart] [--requests 96] [--window 16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from draftsmith.eval.contention import CpuShare
from draftsmith.eval.timing import machine_note
from draftsmith.serving.traffic import TrafficBuffer


def humaneval_prompts() -> list[list[dict]]:
    from draftsmith.eval.tasks import load_tasks

    return [t.messages for t in load_tasks("humaneval")]


def start(args: list[str], log) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(
        [sys.executable, "-m", "draftsmith", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    line = p.stdout.readline()
    if not line.startswith("serve: http://"):
        raise SystemExit(f"server did not start: {line!r}")
    print(line.strip(), flush=True)
    return p, line.split()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--recipe",
        default="quickstart",
        help="recipe served (its trained drafter: the run's checkpoints/final or eval.checkpoint)",
    )
    ap.add_argument("--out", default="runs/online-proof", help="the server's online.dir (traffic, rounds, versions)")
    ap.add_argument("--requests", type=int, default=96, help="requests before the kill; as many again after")
    ap.add_argument("--window", type=int, default=16, help="requests per τ window in the printout")
    ap.add_argument("--max-tokens", type=int, default=96, help="max_tokens of every request (online.max_tokens)")
    ap.add_argument(
        "--update-every",
        type=int,
        default=16,
        help="requests between learner updates (online.update_every_requests and online.min_records)",
    )
    ap.add_argument("--steps", type=int, default=60, help="train steps per update (online.steps_per_update)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more recipe overrides for the server")
    a = ap.parse_args()
    from openai import OpenAI

    root = Path(a.out)
    args = [
        a.recipe,
        f"online.dir={root}",
        "online.port=0",
        f"online.max_tokens={a.max_tokens}",
        f"online.update_every_requests={a.update_every}",
        f"online.min_records={a.update_every}",
        "online.holdout=6",
        f"online.steps_per_update={a.steps}",
        "online.eval_tokens=64",
        "eval.draft_len=3",
        *a.set,
    ]
    prompts = humaneval_prompts()
    log = open(root.parent / f"{root.name}-server.log", "a") if root.parent.exists() else None
    meter = CpuShare().start()
    p, url = start(args, log)
    answered = 0

    def send(n: int, url: str) -> None:
        nonlocal answered
        client = OpenAI(base_url=url, api_key="local")
        for _ in range(n):
            client.chat.completions.create(
                model="target", messages=prompts[answered % len(prompts)], max_tokens=a.max_tokens, temperature=0.0
            )
            answered += 1
            if answered % 8 == 0:
                print(f"  {answered} requests answered", flush=True)

    t0 = time.time()
    send(a.requests, url)
    # Kill while an update is running: wait for a round that has not finished yet.
    rounds = root / "rounds"
    deadline = time.time() + 900
    done = len(list(rounds.glob("r*"))) if rounds.exists() else 0
    while time.time() < deadline:
        cur = sorted(rounds.glob("r*")) if rounds.exists() else []
        state = root / "learner.json"
        finished = json.loads(state.read_text())["rounds"] if state.is_file() else 0
        if len(cur) > finished:  # a round folder exists that learner.json does not count yet: mid-update
            break
        send(1, url)
        time.sleep(0.5)
    version_before = json.loads((root / "current.json").read_text())["version"]
    p.send_signal(signal.SIGKILL)
    p.wait()
    kept = TrafficBuffer(root / "traffic").read()
    print(
        f"killed mid-update after {answered} answered requests; buffer holds {len(kept)} "
        f"(lost {answered - len(kept)}); current version {version_before} (rounds started {len(cur)}, "
        f"finished {finished}; {done} before the wait)",
        flush=True,
    )
    p, url = start(args, log)
    try:
        send(a.requests, url)
        time.sleep(2)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait()
    recs = TrafficBuffer(root / "traffic").read()
    print(f"\n{len(recs)} requests recorded in {time.time() - t0:.0f}s")
    print("| requests | τ (mean per request) | drafter versions serving |")
    print("|---|---|---|")
    taus = []
    for i in range(0, len(recs), a.window):
        w = [r for r in recs[i : i + a.window] if r.get("tau")]
        if w:
            taus.append(sum(r["tau"] for r in w) / len(w))
            print(f"| {i + 1}–{i + len(w)} | {taus[-1]:.3f} | {', '.join(sorted({r['version'] for r in w}))} |")
    metrics = root / "metrics.jsonl"
    if metrics.is_file():
        print("\n| round | train records | held-out τ current → candidate | published |")
        print("|---|---|---|---|")
        for line in metrics.read_text().splitlines():
            m = json.loads(line)
            if "round" in m:
                print(
                    f"| {m['round']} | {m['records']} | {m['tau_current']:.3f} → {m['tau_candidate']:.3f} | "
                    f"{m['version'] if m['swapped'] else '—'} |"
                )
    if len(taus) > 1:
        print(f"\nτ last window / first window: {taus[-1] / taus[0]:.3f}")
    print(machine_note("cuda" if torch.cuda.is_available() else "cpu", meter.stop()))


if __name__ == "__main__":
    main()
