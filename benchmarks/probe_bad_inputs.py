"""Bad inputs through the real CLI: every case runs `python -m draftsmith ...` in a subprocess on a tiny random
Llama target built in a temporary folder (offline, CPU, about a minute on 2 cores), after one good `run` made the
run folder the cases damage copies of: missing and corrupt recipes (a directory, a FIFO, a symlink loop, a
duplicate key, a YAML alias bomb), bad overrides (out of range, a seed past 2^32, 1e20 tokens), bad and corrupt
targets, an unavailable target device, a target that only a pickle or remote code would load, bad prompt files (a
FIFO, a 50 MB line), an out_dir that is a file, corrupt or bit-flipped records and checkpoints, manifests naming a
file outside the data folder or a shard twice, a non-finite learning rate, a config edited after the weights,
`export --out` onto a file, onto its own checkpoint or a read-only mount, hub repo ids, online rollbacks outside
the version store.

Reading the output: one line per case, then the totals. `clean` is what every bad input should give: exit code 2,
exactly one `draftsmith: error: ...` line on stderr and no traceback. `traceback` means a Python traceback reached
the user; `silent` means the command exited 0 (the bad input was accepted); `other` is any other ending (its exit
code and the last stderr line are shown). The exit status is 1 when any case is not clean.

    python benchmarks/probe_bad_inputs.py [--jobs 2] [--only NAME ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RECIPE = """\
name: probe
target: {{model: {model}, dtype: float32}}
data:
  prompts: {{source: file, path: {prompts}}}
  max_prompt_tokens: 64
  max_new_tokens: 8
  batch_size: 4
  signals: {{topk: 8}}
  shard_size: 4
drafter: {{kind: draft_lm, n_layers: 1, init_layers: [0]}}
train: {{steps: 4, micro_batch_size: 2, max_seq_len: 128, save_every: 2}}
eval: {{prompts: {{source: file, path: {prompts}, n: 2}}, max_new_tokens: 8, draft_len: 3, warmup: 0}}
export: {{enabled: true, formats: [hf]}}
out_dir: {run}
"""
BINARY = b"\x00\xff\xfe\x80" * 64
PROMPTS = [
    {"messages": [{"role": "user", "content": "Tell me about foxes."}]},
    {"messages": [{"role": "user", "content": "Write a poem about the sea."}]},
    {"messages": [{"role": "user", "content": "What is 2+2?"}]},
    {"messages": [{"role": "user", "content": "Explain speculative decoding."}]},
]


def build_target(path: Path) -> None:
    """A tiny random Llama (2 layers, hidden 64) with a byte-level BPE tokenizer and a ChatML template."""
    from draftsmith.models.tiny import build_tiny_target

    build_tiny_target(path, [json.dumps(p) for p in PROMPTS] * 4)


def cli(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "draftsmith", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def flip(path: Path, n: int = 64) -> None:
    """Invert ``n`` bytes in the middle of a safetensors file's tensor data (its header stays valid)."""
    b = bytearray(path.read_bytes())
    start = 8 + struct.unpack("<Q", bytes(b[:8]))[0]
    mid = start + (len(b) - start - n) // 2
    b[mid : mid + n] = bytes(x ^ 0xFF for x in b[mid : mid + n])
    path.write_bytes(bytes(b))


def edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def cases(root: Path) -> dict:
    """name -> (prepare(case folder) -> argv). Every case works on its own copy of what it damages."""
    run, model = root / "run", root / "target"
    recipe = root / "recipe.yaml"
    final = run / "checkpoints" / "final"

    def copy(src: Path, dst: Path) -> Path:
        shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
        return dst

    def run_copy(d: Path, *names: str) -> Path:
        (d / "run").mkdir()
        for n in names:
            copy(run / n, d / "run" / n)
        return d / "run"

    def text(d: Path, name: str, body: str | bytes) -> Path:
        p = d / name
        p.write_bytes(body) if isinstance(body, bytes) else p.write_text(body)
        return p

    def corrupt_target(d: Path, how: str) -> Path:
        t = copy(model, d / "target")
        w = t / "model.safetensors"
        if how == "config":
            text(t, "config.json", "{not json")
        elif how == "weights":
            truncate(w)
        elif how == "header":
            w.write_bytes(struct.pack("<Q", 19) + b"{not a header json}" + w.read_bytes()[8:])
        elif how == "tokenizer":
            text(t, "tokenizer.json", "{")
        elif how == "vocab":
            edit_json(t / "config.json", lambda c: c.update(vocab_size=c["vocab_size"] + 16))
        elif how == "remote-code":
            edit_json(t / "tokenizer_config.json", lambda c: c.update(auto_map={"AutoTokenizer": ["tok.Tok", None]}))
        elif how == "pickle":
            import torch
            from safetensors.torch import load_file

            torch.save(load_file(str(w)), t / "pytorch_model.bin")  # a benign weights-only pickle
            w.unlink()
        else:
            w.unlink()
        return t

    def corrupt_shard(d: Path) -> list:
        r = run_copy(d, "data")
        truncate(r / "data" / "shard-00000.safetensors")
        return ["train", recipe, f"out_dir={r}"]

    def corrupt_step(d: Path) -> list:
        r = run_copy(d, "data", "checkpoints")
        shutil.rmtree(r / "checkpoints" / "final")
        step = sorted((r / "checkpoints").glob("step-*"))[-1]
        truncate(step / "model.safetensors")
        return ["train", recipe, f"out_dir={r}", "train.steps=6"]

    def ckpt_copy(d: Path, damage) -> Path:
        c = copy(final, d / "final")
        damage(c)
        return c

    def random_ckpt(c: Path) -> None:
        for f in c.iterdir():
            f.write_bytes(os.urandom(f.stat().st_size or 64))

    def data_run(d: Path, damage) -> list:
        r = run_copy(d, "data")
        damage(r / "data")
        return ["train", recipe, f"out_dir={r}"]

    def drop_dim(doc: dict) -> None:
        doc["config"].pop("dim")

    def rope_x10(doc: dict) -> None:
        doc["config"]["rope_theta"] = doc["config"].get("rope_theta", 10000.0) * 10

    def manifest(change):
        return lambda data: edit_json(data / "manifest.json", change)

    def outside(m: dict) -> None:
        m["shards"][0]["file"] = "../../outside.safetensors"

    def twice(m: dict) -> None:
        m["shards"].append(dict(m["shards"][0]))

    def fifo(d: Path, name: str) -> Path:
        os.mkfifo(d / name)
        return d / name

    def loop(d: Path) -> Path:
        (d / "a.yaml").symlink_to(d / "b.yaml")
        (d / "b.yaml").symlink_to(d / "a.yaml")
        return d / "a.yaml"

    def long_line(d: Path) -> Path:
        line = json.dumps({"messages": [{"role": "user", "content": "x" * (50 << 20)}]})
        return text(d, "big.jsonl", line + "\n")

    bomb = (
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
            for p, c in zip("abcdefgh", "bcdefghi")
        )
        + "name: *i\n"
    )

    def bad_target(how: str):
        return lambda d: ["generate", recipe, f"target.model={corrupt_target(d, how)}", f"out_dir={d}/r"]

    return {
        "recipe: missing file": lambda d: ["show", d / "missing.yaml"],
        "recipe: YAML syntax error": lambda d: ["show", text(d, "r.yaml", "name: x\ndata: {prompts: [\n")],
        "recipe: a list, not a mapping": lambda d: ["show", text(d, "r.yaml", "- 1\n- 2\n")],
        "recipe: binary file": lambda d: ["show", text(d, "r.yaml", BINARY)],
        "override: unknown key": lambda d: ["show", recipe, "train.bogus=1"],
        "override: out of range": lambda d: ["show", recipe, "train.steps=-2"],
        "override: wrong type": lambda d: ["show", recipe, "train.steps=[1,2]"],
        "override: unparsable YAML value": lambda d: ["show", recipe, "train.steps={"],
        "override: into a scalar": lambda d: ["show", recipe, "train.steps.x=1"],
        "override: empty key": lambda d: ["show", recipe, "=3"],
        "target: unknown name": lambda d: ["generate", recipe, "target.model=no-such-model", f"out_dir={d}/r"],
        "target: missing folder": lambda d: ["generate", recipe, f"target.model={d}/nothing/", f"out_dir={d}/r"],
        "target: corrupt config.json": lambda d: [
            "generate",
            recipe,
            f"target.model={corrupt_target(d, 'config')}",
            f"out_dir={d}/r",
        ],
        "target: truncated weights": lambda d: [
            "generate",
            recipe,
            f"target.model={corrupt_target(d, 'weights')}",
            f"out_dir={d}/r",
        ],
        "target: no weights file": lambda d: [
            "generate",
            recipe,
            f"target.model={corrupt_target(d, 'none')}",
            f"out_dir={d}/r",
        ],
        "target: unavailable device": lambda d: ["generate", recipe, "target.device=cuda:7", f"out_dir={d}/r"],
        "target: device banana": lambda d: ["generate", recipe, "target.device=banana", f"out_dir={d}/r"],
        "target: corrupt safetensors header": bad_target("header"),
        "target: invalid tokenizer.json": bad_target("tokenizer"),
        "target: vocab_size disagrees with the weights": bad_target("vocab"),
        "target: tokenizer needs remote code": bad_target("remote-code"),
        "target: only a pickled pytorch_model.bin": bad_target("pickle"),
        "target: pickle only, eval's HF baseline": lambda d: [
            "eval",
            recipe,
            f"target.model={corrupt_target(d, 'pickle')}",
            f"eval.checkpoint={final}",
            f"out_dir={d}/r",
        ],
        "prompts: missing file": lambda d: ["generate", recipe, f"data.prompts.path={d}/no.jsonl", f"out_dir={d}/r"],
        "prompts: bad JSON line": lambda d: [
            "generate",
            recipe,
            f"data.prompts.path={text(d, 'p.jsonl', json.dumps(PROMPTS[0]) + chr(10) + '{oops' + chr(10))}",
            f"out_dir={d}/r",
        ],
        "prompts: only empty prompts": lambda d: [
            "generate",
            recipe,
            f"data.prompts.path={text(d, 'p.jsonl', json.dumps({'messages': [{'role': 'user', 'content': ' '}]}))}",
            f"out_dir={d}/r",
        ],
        "prompts: binary file": lambda d: [
            "generate",
            recipe,
            f"data.prompts.path={text(d, 'p.jsonl', BINARY)}",
            f"out_dir={d}/r",
        ],
        "prompts: a folder": lambda d: ["generate", recipe, f"data.prompts.path={d}", f"out_dir={d}/r"],
        "prompts: a line nested 200,000 deep": lambda d: [
            "generate",
            recipe,
            f"data.prompts.path={text(d, 'p.jsonl', '[' * 200_000 + chr(10))}",
            f"out_dir={d}/r",
        ],
        "train: corrupt manifest.json": lambda d: data_run(d, lambda p: text(p, "manifest.json", "{")),
        "train: 64 flipped bytes in a shard": lambda d: data_run(d, lambda p: flip(p / "shard-00000.safetensors")),
        "train: init_checkpoint is garbage": lambda d: [
            "train",
            recipe,
            f"out_dir={run_copy(d, 'data')}",
            f"train.init_checkpoint={ckpt_copy(d, random_ckpt)}",
        ],
        "train: no records": lambda d: ["train", recipe, f"out_dir={d}/r"],
        "train: truncated shard": corrupt_shard,
        "train: truncated resume checkpoint": corrupt_step,
        "eval: missing checkpoint": lambda d: ["eval", recipe, f"eval.checkpoint={d}/none", f"out_dir={d}/r"],
        "eval: 64 flipped bytes in the weights": lambda d: [
            "eval",
            recipe,
            f"eval.checkpoint={ckpt_copy(d, lambda c: flip(c / 'model.safetensors'))}",
            f"out_dir={d}/r",
        ],
        "eval: drafter.json config missing a field": lambda d: [
            "eval",
            recipe,
            f"eval.checkpoint={ckpt_copy(d, lambda c: edit_json(c / 'drafter.json', drop_dim))}",
            f"out_dir={d}/r",
        ],
        "export: truncated checkpoint weights": lambda d: [
            "export",
            ckpt_copy(d, lambda c: truncate(c / "model.safetensors")),
            "--out",
            d / "out",
        ],
        "export: checkpoint of random bytes": lambda d: ["export", ckpt_copy(d, random_ckpt), "--out", d / "out"],
        "export: no model.safetensors": lambda d: [
            "export",
            ckpt_copy(d, lambda c: (c / "model.safetensors").unlink()),
            "--out",
            d / "out",
        ],
        "export: 64 flipped bytes in the weights": lambda d: [
            "export",
            ckpt_copy(d, lambda c: flip(c / "model.safetensors")),
            "--out",
            d / "out",
        ],
        "export: corrupt drafter.json": lambda d: [
            "export",
            ckpt_copy(d, lambda c: text(c, "drafter.json", "{")),
            "--out",
            d / "out",
        ],
        "export: --out is a file": lambda d: ["export", final, "--format", "hf", "--out", text(d, "f.bin", "x")],
        "export: --out under a file": lambda d: ["export", final, "--out", text(d, "f.bin", "x") / "hf"],
        "export: bad hub repo id": lambda d: ["export", final, "--out", d / "o", "--push-to-hub", "a/b/c", "--dry-run"],
        "online: rollback ../x": lambda d: ["online", recipe, f"online.dir={d}", "--rollback", "../x"],
        "online: rollback to an absolute path": lambda d: ["online", recipe, f"online.dir={d}", "--rollback", final],
        "online: rollback to an unknown version": lambda d: [
            "online",
            recipe,
            f"online.dir={d}",
            "--rollback",
            "v0042",
        ],
        "tree: not a run folder": lambda d: ["tree", text(d, "metrics.jsonl", "{bad\n").parent],
        "export: --out is the checkpoint": lambda d: ["export", ckpt_copy(d, lambda c: None), "--out", d / "final"],
        "export: --out holds the checkpoint": lambda d: ["export", ckpt_copy(d, lambda c: None), "--out", d],
        "export: --out on a read-only mount": lambda d: ["export", final, "--out", "/sys/draftsmith-probe"],
        "export: rope_theta x10 in drafter.json": lambda d: [
            "export",
            ckpt_copy(d, lambda c: edit_json(c / "drafter.json", rope_x10)),
            "--out",
            d / "out",
        ],
        "train: train.lr=.inf": lambda d: ["train", recipe, f"out_dir={run_copy(d, 'data')}", "train.lr=.inf"],
        "train: manifest entry ../../outside": lambda d: data_run(d, manifest(outside)),
        "train: a shard listed twice": lambda d: data_run(d, manifest(twice)),
        "recipe: duplicate top-level key": lambda d: ["show", text(d, "r.yaml", recipe.read_text() + "name: again\n")],
        "recipe: YAML alias bomb": lambda d: ["show", text(d, "r.yaml", bomb)],
        "recipe: a directory": lambda d: ["show", d],
        "recipe: a symlink loop": lambda d: ["show", loop(d)],
        "recipe: a FIFO": lambda d: ["show", fifo(d, "r.yaml")],
        "prompts: a 50 MB line": lambda d: ["generate", recipe, f"data.prompts.path={long_line(d)}", f"out_dir={d}/r"],
        "prompts: a FIFO": lambda d: ["generate", recipe, f"data.prompts.path={fifo(d, 'p.jsonl')}", f"out_dir={d}/r"],
        "out_dir: an existing file": lambda d: ["generate", recipe, f"out_dir={text(d, 'f', 'x')}"],
        "override: seed 2^32": lambda d: ["show", recipe, "seed=4294967296"],
        "override: data.max_new_tokens=1e20": lambda d: ["show", recipe, "data.max_new_tokens=1e20"],
    }


def classify(res: subprocess.CompletedProcess) -> tuple[str, str]:
    err = res.stderr.replace("\r", "\n")
    errors = [ln[ln.index("draftsmith: error:") :] for ln in err.splitlines() if "draftsmith: error:" in ln]
    last = errors[-1] if errors else next((ln for ln in reversed(err.splitlines()) if ln.strip()), "")
    if "Traceback" in err:  # the exception line, not a progress bar's redraw after it
        raised = [ln for ln in err.splitlines() if re.match(r"[\w.]+(Error|Exception|Interrupt)\b", ln)]
        return "traceback", raised[-1] if raised else last
    if res.returncode == 0:
        return "silent", "exit 0"
    if res.returncode == 2 and len(errors) == 1:
        return "clean", errors[0]
    return "other", f"exit {res.returncode}: {last}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (one thread each)")
    ap.add_argument("--only", nargs="*", default=None, help="run only the cases whose name contains one of these")
    ap.add_argument("--keep", default=None, help="work in this folder and keep it (default: a temporary folder)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    root = Path(a.keep or tempfile.mkdtemp(prefix="probe-bad-inputs-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    try:
        build_target(root / "target")
        (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
        fields = {"model": root / "target", "prompts": root / "prompts.jsonl"}
        (root / "recipe.yaml").write_text(RECIPE.format(**fields, run=root / "run"))
        good = cli("run", root / "recipe.yaml", "-q", cwd=root)
        if good.returncode != 0:
            raise SystemExit(f"the good run failed (exit {good.returncode}):\n{good.stderr[-3000:]}")
        todo = {k: v for k, v in cases(root).items() if not a.only or any(s in k for s in a.only)}

        def one(item):
            i, (name, prepare) = item
            d = root / "cases" / f"{i:02d}"
            d.mkdir(parents=True)
            return name, classify(cli(*prepare(d), "-q", cwd=d))

        with ThreadPoolExecutor(a.jobs) as pool:
            results = list(pool.map(one, enumerate(todo.items())))
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    width = max(len(n) for n, _ in results)
    for name, (kind, line) in results:
        print(f"{kind:9s} {name:{width}s}  {line[:160]}")
    counts = {k: sum(r[1][0] == k for r in results) for k in ("clean", "traceback", "silent", "other")}
    print(
        f"tried {len(results)}: clean {counts['clean']}, tracebacks {counts['traceback']}, "
        f"silent {counts['silent']}, other {counts['other']} ({time.perf_counter() - t0:.0f}s)"
    )
    for kind in ("traceback", "silent", "other"):
        names = [n for n, (k, _) in results if k == kind]
        if names:
            print(f"{kind}: {'; '.join(names)}")
    raise SystemExit(1 if counts["clean"] < len(results) else 0)


if __name__ == "__main__":
    main()
