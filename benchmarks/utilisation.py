"""How far the pipeline runs below the hardware: tokens/s, TFLOP/s and model FLOPs utilisation (MFU) of data
generation and of each drafter kind's training step, next to a plain HF ``generate`` and a plain training step at the
same batch, on one device, in one run.

1. generate: ``draftsmith generate`` on --prompts ShareGPT first turns at --gen-batch rows (the recipe's signals:
   top-k log-probs), then transformers' ``generate`` on the same prompts in batches of --gen-batch (left-padded,
   greedy, no capture). Tokens are response tokens.
2. train: for each --kinds, ``draftsmith train`` of its shipped SmolLM2 recipe on those records for --steps steps at
   --micro-batch, --precision, packing as the recipe says unless --set changes it; then one plain training step
   loop: transformers' LlamaForCausalLM with the target's own config (every weight trained, cross-entropy, AdamW)
   on micro-batches of the same records at the same micro-batch size. Tokens are input tokens (prompt + response,
   no padding).
FLOPs are counted by PyTorch's FlopCounterMode on one step (draftsmith/flops.py; matmuls and attention, forward and
backward), the stages log them per row in metrics.jsonl (``tflops``, ``mfu``), and the peak is the data-sheet dense
figure of a known GPU or, elsewhere, the best large matmul measured on this machine in that dtype. Rates are steady
state: the first logged window (start-up, compilation, the counted step) is left out.

Reading the output: one line per row: tokens/s, TFLOP/s, MFU, and "x plain" = its tokens/s over the plain
counterpart's (generation over HF generate; a drafter's training over the plain full-model training step, which
does far more work per token, so compare their MFU too). The last lines name the machine and the peak used.

    python benchmarks/utilisation.py [--device cpu] [--prompts 64] [--gen-batch 16] [--max-new 128]
        [--kinds draft_lm medusa hydra mlp_speculator eagle3] [--steps 30] [--micro-batch 8] [--precision auto]
        [--set train.packing=true ...] [--json FILE]
GPU (an H100): --device cuda --prompts 4096 --gen-batch 256 --max-new 256 --steps 200 --micro-batch 64
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

RECIPES = {  # kind -> the shipped recipe whose drafter section is trained
    "draft_lm": "fastdraft-kd",
    "medusa": "medusa-smollm2",
    "hydra": "hydra-smollm2",
    "mlp_speculator": "mlp-speculator-smollm2",
    "eagle3": "eagle3-smollm2",
    "eagle1": "eagle1-smollm2",
    "pard": "pard-smollm2",
}


def _cli(args: list[str], log: Path) -> None:
    with log.open("a") as f:
        f.write(f"$ draftsmith {' '.join(args)}\n")
        f.flush()
        rc = subprocess.call([sys.executable, "-m", "draftsmith", *args], stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        sys.exit(f"utilisation: `draftsmith {' '.join(args[:2])}` failed (exit {rc}); see {log}")


def _steady(run: Path, stage: str, tokens_key: str) -> dict:
    """Steady-state tokens/s, TFLOP/s and MFU from a run's metrics.jsonl rows of ``stage`` (the first left out)."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("stage") == stage and tokens_key in r]
    if len(rows) < 2:
        sys.exit(f"utilisation: {run}: fewer than 2 {stage} rows with {tokens_key}; run longer or log more often")
    use = rows[1:]
    rate = sum(r[tokens_key] for r in use) / len(use)  # each row's rate over its own window
    mfu = [r["mfu"] for r in use if r.get("mfu") is not None]
    tfl = [r["tflops"] for r in use if r.get("tflops") is not None]
    return {
        "tokens_per_s": rate,
        "mfu": sum(mfu) / len(mfu) if mfu else None,
        "tflops": sum(tfl) / len(tfl) if tfl else None,
    }


def _hf_generate(path: Path, prompts: list[list[int]], batch: int, max_new: int, eos: set[int], device, dtype):
    """transformers' batched greedy ``generate``, left-padded -> (response tokens/s, flops per token)."""
    from transformers import AutoModelForCausalLM

    from draftsmith.flops import count_flops

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    pad = min(eos)
    ids = torch.tensor([prompts[0][:64]], device=device)
    with torch.no_grad():
        per_token = count_flops(hf, ids)[0] / ids.shape[1]
    tokens, t0 = 0, None
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(map(len, group))
        x = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        with torch.no_grad():
            out = hf.generate(x, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                              eos_token_id=sorted(eos), pad_token_id=pad)  # fmt: skip
        new = out[:, width:].tolist()
        if t0 is None:  # the first batch warms up: timing starts after it
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            continue
        for row in new:
            ends = [j for j, t in enumerate(row) if t in eos]
            tokens += ends[0] + 1 if ends else len(row)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / max(1e-9, time.perf_counter() - t0), per_token


def _plain_train(path: Path, data: Path, micro: int, steps: int, max_len: int, device, precision: str):
    """A plain training loop of the whole target (transformers' LlamaForCausalLM, CE, AdamW) on the records ->
    (input tokens/s, flops per token)."""
    from transformers import AutoModelForCausalLM

    from draftsmith.data.dataset import RecordDataset
    from draftsmith.flops import count_flops

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ds = RecordDataset(data, max_len, signals=set())
    seqs = [torch.as_tensor(ds[i].input_ids) for i in range(len(ds))]
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def batch(k: int):
        group = [seqs[(k * micro + j) % len(seqs)] for j in range(micro)]
        width = max(len(s) for s in group)
        x = torch.zeros(micro, width, dtype=torch.long)
        m = torch.zeros(micro, width, dtype=torch.long)
        for j, s in enumerate(group):
            x[j, : len(s)], m[j, : len(s)] = s, 1
        labels = x.masked_fill(m == 0, -100)
        return x.to(device), m.to(device), labels.to(device), int(m.sum())

    def step(k: int) -> int:
        x, m, labels, n = batch(k)
        with amp:
            loss = model(input_ids=x, attention_mask=m, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return n

    flops, n0 = count_flops(step, 0)
    step(1)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0, tokens = time.perf_counter(), 0
    for k in range(2, steps + 2):
        tokens += step(k)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0), flops / n0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (every stage and the baselines run there)")
    ap.add_argument("--prompts", type=int, default=64, help="ShareGPT first turns to answer")
    ap.add_argument("--gen-batch", type=int, default=16, help="rows per batch, ours and HF generate's")
    ap.add_argument("--max-new", type=int, default=128, help="new tokens per answer at most")
    ap.add_argument("--kinds", nargs="*", default=["draft_lm", "medusa", "hydra", "mlp_speculator", "eagle3"],
                    help=f"drafter kinds to train, from {', '.join(RECIPES)}")  # fmt: skip
    ap.add_argument("--steps", type=int, default=30, help="training steps per kind (and of the plain loop)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per training step, every kind and plain")
    ap.add_argument("--max-len", type=int, default=384, help="train.max_seq_len (tokens per sequence at most)")
    ap.add_argument("--precision", default="auto", help="train.precision: auto, bf16 or no (fp32)")
    ap.add_argument("--set", nargs="*", default=[], help="extra overrides for every draftsmith stage")
    ap.add_argument("--out", default="runs/utilisation", help="work folder (records, one run per kind, log)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    from draftsmith.flops import Meter, peak_flops
    from draftsmith.models.loading import load_model, stop_ids
    from draftsmith.runtime import resolve_dtype, resolve_precision

    device = torch.device(a.device)
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    log = out / "log.txt"
    gen_dtype = resolve_dtype("auto", a.device)
    precision = resolve_precision(a.precision, a.device)
    common = [f"target.device={a.device}", *a.set]
    rows = []

    # 1. generation
    gen = out / "gen"
    _cli(["generate", "eagle3-smollm2", f"out_dir={gen}", f"data.prompts.n={a.prompts}",
          f"data.batch_size={a.gen_batch}", f"data.max_new_tokens={a.max_new}", f"data.shard_size={a.gen_batch}",
          "-q", *common], log)  # fmt: skip
    ours = _steady(gen, "generate", "window_tokens_per_s")
    tgt = load_model("smollm2-135m-instruct")
    eos = stop_ids(tgt.path, tgt.tokenizer)
    from draftsmith.data.dataset import RecordDataset

    ds = RecordDataset(gen / "data", 4096, signals=set())
    prompts = [ds[i].input_ids[: int((torch.as_tensor(ds[i].loss_mask) == 0).sum())] for i in range(len(ds))]
    prompts = [list(map(int, p)) for p in prompts]
    hf_rate, per_token = _hf_generate(tgt.path, prompts, a.gen_batch, a.max_new, eos, device, gen_dtype)
    meter = Meter(per_token, *peak_flops(device, gen_dtype))
    rows.append({"row": f"generate, ours (B={a.gen_batch})", **ours, "x_plain": ours["tokens_per_s"] / hf_rate})
    rows.append({"row": f"generate, HF generate (B={a.gen_batch})", "tokens_per_s": hf_rate,
                 "tflops": meter.tflops(hf_rate), "mfu": meter.mfu(hf_rate), "x_plain": 1.0})  # fmt: skip
    peaks = {"generate": meter.peak_source}

    # 2. training
    plain_rate, plain_fpt = _plain_train(tgt.path, gen / "data", a.micro_batch, a.steps, a.max_len, device, precision)
    train_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    pm = Meter(plain_fpt, *peak_flops(device, train_dtype))
    peaks["train"] = pm.peak_source
    for kind in a.kinds:
        run = out / f"train-{kind}"
        shutil.copytree(gen / "data", run / "data")
        _cli(["train", RECIPES[kind], f"out_dir={run}", f"train.steps={a.steps}",
              f"train.micro_batch_size={a.micro_batch}", f"train.max_seq_len={a.max_len}",
              f"train.precision={precision}", "train.save_every=0", f"train.log_every={max(1, a.steps // 6)}",
              "train.eval_every=0", "-q", *common], log)  # fmt: skip
        r = _steady(run, "train", "input_tokens_per_s")
        rows.append(
            {"row": f"train {kind} (micro-batch {a.micro_batch})", **r, "x_plain": r["tokens_per_s"] / plain_rate}
        )
    rows.append({"row": f"train plain: whole target, CE (micro-batch {a.micro_batch})", "tokens_per_s": plain_rate,
                 "tflops": pm.tflops(plain_rate), "mfu": pm.mfu(plain_rate), "x_plain": 1.0})  # fmt: skip

    print(f"\n{'':<52} {'tokens/s':>10} {'TFLOP/s':>9} {'MFU':>7} {'x plain':>8}")
    for r in rows:
        tfl = "n/a" if r.get("tflops") is None else f"{r['tflops']:.3f}"
        mfu = "n/a" if r.get("mfu") is None else f"{r['mfu']:.1%}"
        print(f"{r['row']:<52} {r['tokens_per_s']:>10.0f} {tfl:>9} {mfu:>7} {r['x_plain']:>8.2f}")
    print(f"peaks: generate {peaks['generate']}; train {peaks['train']} (precision {precision})")
    from draftsmith.eval.timing import machine_note

    print(machine_note(device))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "peaks": peaks, "precision": precision}, indent=1))


if __name__ == "__main__":
    main()
