"""What bounds data generation and EAGLE-3 training on a GPU, measured on any machine: kernels, host syncs, host
time, FLOPs and bytes per step of the real code paths, and the tokens/s each of them allows on a given GPU.

A 135M target is small for a GPU: its steps are short, so the host (Python, the dispatcher, kernel launches) and
the syncs where the host waits for the device can cap throughput long before FLOPs or memory bandwidth do. This
script measures those costs without a GPU, so the design can be judged before a GPU window is spent:

1. generate: ``Refill`` (data/engine.py, what ``draftsmith generate`` runs) on --prompts random prompts of 32-256
   tokens with budgets of 16-128 new tokens (the recipe's range; the budget stands in for EOS), --gen-batch rows,
   top-k --topk captured, freed rows joining --refill-join at a time (data.refill_join's GPU default) and sharing
   prefills within --prefill-pad padding tokens (the GPU default), matmuls fused as data.optimize does. Per
   decode step: rows (tokens), kernels launched, host syncs, host time; prefills and finished-row hand-overs are
   amortised per step. Eager and static (``data.cuda_graphs``' shapes, run uncaptured here) paths.
2. train: one optimizer step of the real loop (train/loop.py ``_optimizer_step``, bf16 autocast) of the
   eagle3-smollm2 recipe's drafter with the target in the loop, on --micro-batch records of 96-384 tokens packed
   into rows of the recipe's max_seq_len. Host time per kernel is timed on short records (4-12 tokens, rows of
   12, heads 2 wide, where the arithmetic vanishes; in fp32, as a CPU's bf16 matmuls at tiny shapes are slow) and
   scaled by the kernels of the real-length bf16 step (the chunked losses launch more kernels for more
   positions). AdamW's reads of its host-side step counts are not waits. The
   fused loss's row passes count as the one Triton launch each that a GPU runs (``gpu_kernels``).

Kernels: every ATen call that is not a view (on a GPU each launches at least one kernel). Host syncs: calls whose
result the host must wait for: .item()/int()/float() (``_local_scalar_dense``), nonzero, boolean-mask indexing,
other ops of data-dependent output shape, .tolist() and .cpu() on device data (counted as called here).

Kernels and syncs are counted on a model with the target's structure (layers, heads, the code path) but tiny
widths (--tiny-head-dim, a vocabulary of --tiny-vocab). Host time is timed with heads 2 wide in runs small enough
(--host-batch rows; short training records) that the arithmetic is negligible: host seconds per kernel, per phase,
times the kernels of the full-size step is the host's cost per step. On a GPU the device cannot finish a step
faster than the host issues it, unless CUDA graphs replay the step. FLOPs (PyTorch's FlopCounterMode) and bytes
come from the real widths (SmolLM2-135M's config).

Ceilings (tokens/s), each an upper bound with all else free:
- host (eager): tokens per step / host seconds per step on this machine (a GPU host's CPU may be faster or slower);
- host (graphed, generation): the same without the target forward, which a CUDA graph replays in one launch;
- compute: FLOPs per token against --peak-tflops (default the H100 SXM bf16 dense data-sheet figure) at
  --mfu utilisation;
- memory: bytes per step (weights once per forward in bf16, plus the KV slots a decode step reads) against
  --hbm-tbs;
- syncs: not a ceiling by themselves, but each drains the device's queue: a step's host time and device time add
  up instead of overlapping once a step syncs in its middle.
Reading the output: one line per path with these columns; the lowest ceiling is what the design allows, next to
the goal (--goal-gen, --goal-train). The last lines name the machine and what else was running.

    python benchmarks/gpu_bounds.py [--prompts 512] [--gen-batch 256] [--micro-batch 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from functools import partial

import torch

from draftsmith.eval.contention import CpuShare
from draftsmith.eval.timing import machine_note
from draftsmith.flops import HostOps


def smollm2_config():
    from draftsmith.models.loading import config_from_hf, read_json, resolve_model_path

    return config_from_hf(read_json(resolve_model_path("smollm2-135m-instruct") / "config.json"))


def tiny(cfg, head_dim: int, vocab: int):
    """The target's structure (layers, heads, K/V heads, the code path) at negligible widths."""
    return dataclasses.replace(
        cfg, dim=cfg.n_heads * head_dim, head_dim=head_dim, hidden_dim=3 * cfg.n_heads * head_dim, vocab_size=vocab
    )


def params_bytes(model: torch.nn.Module, nbytes: int = 2) -> int:
    return sum(p.numel() for p in model.parameters()) * nbytes


# ---------------------------------------------------------------------------------------------------------- generate


def gen_prompts(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(32, 257, (n,), generator=g).tolist()
    budgets = torch.randint(16, 129, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens], budgets


def run_refill(
    model,
    prompts,
    budgets,
    batch: int,
    topk: int,
    static: bool,
    ops: HostOps | None,
    count: bool,
    join: int = 1,
    pad: int | None = None,
) -> dict:
    """One Refill run: decode steps, rows and KV slots read over them; host seconds by phase into ``ops``, and with
    ``count`` its kernels and syncs (the counting slows the host, so time and count in separate runs)."""
    from draftsmith.data.engine import Capture, Refill, Sampling

    gen = Refill(
        model,
        batch,
        max(budgets),
        set(),
        Sampling(),
        Capture(topk=topk),
        max_prefill_pad=pad,
        static=static,
        graphs=False,
        min_join=join,
    )
    for i, (c, n) in enumerate(zip(prompts, budgets, strict=True)):
        gen.add(i, c, None, n)
    stats = {"steps": 0, "rows": 0, "slots": 0}
    if ops is not None:
        fwd = model.forward

        def forward(ids, *a, **k):
            decode = ids.shape[1] == 1
            if decode:
                stats["steps"] += 1
                stats["rows"] += ids.shape[0]
                stats["slots"] += gen.rc.length
            with ops.phase("forward" if decode else "prefill"):
                return fwd(ids, *a, **k)

        model.forward = forward
        for name in ("_join", "_finish"):
            setattr(gen, name, ops.in_phase(name, getattr(gen, name)))
    done = []
    t0 = time.perf_counter()
    try:
        with ops.counting() if count else contextlib.nullcontext():
            gen.run(lambda i, g: done.append(len(g.tokens)))
    finally:
        if ops is not None:
            del model.forward
    stats["wall"] = time.perf_counter() - t0
    if ops is not None:
        ops.seconds["step"] += stats["wall"]  # the rest of the loop: what no named phase took
    stats["tokens"] = sum(done)
    stats["max_len"] = gen.max_len
    return stats


def generation(a, cfg) -> list[dict]:
    from draftsmith.models.llama import Llama

    torch.manual_seed(0)
    small = Llama(tiny(cfg, a.tiny_head_dim, a.tiny_vocab)).eval()
    host_model = Llama(tiny(cfg, 2, a.tiny_vocab)).eval()  # for host time: the arithmetic must vanish
    if not a.no_optimize:  # data.optimize (default on): fused q/k/v and gate/up matmuls, as the data stage runs
        small, host_model = small.optimize_for_inference(), host_model.optimize_for_inference()
    prompts, budgets = gen_prompts(a.prompts, a.tiny_vocab)
    # FLOPs per decode token at real widths: one decode step of a few rows over a cache of the mean context
    real = Llama(cfg).eval()
    ctx = 144 + 36  # mean prompt (32..256) + half the mean budget (16..128)
    rows = 4
    cache = real.new_cache(rows, ctx + 1)
    with torch.no_grad():
        real(torch.randint(0, cfg.vocab_size, (rows, ctx)), cache=cache)
        from draftsmith.flops import count_flops

        flops, _ = count_flops(real, torch.randint(0, cfg.vocab_size, (rows, 1)), cache=cache)
    flops_per_token = flops / rows
    weights = params_bytes(real)
    kv_per_slot = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.hd * 2  # K and V, bf16, every layer
    del real, cache
    out, join = [], a.refill_join or max(1, a.gen_batch // 16)
    for static in (False, True):
        ops, few, timed = HostOps(), HostOps(), HostOps()
        hb, n_few = a.host_batch, 8 * a.host_batch
        with torch.no_grad():
            run_refill(small, prompts[:8], budgets[:8], a.gen_batch, a.topk, static, None, False)  # warm-up
            s = run_refill(small, prompts, budgets, a.gen_batch, a.topk, static, ops, True, join, a.prefill_pad)
            # host seconds per kernel, phase by phase, where the rows are too few for the arithmetic to count
            run_refill(host_model, prompts[:n_few], budgets[:n_few], hb, a.topk, static, few, True)
            run_refill(host_model, prompts[:n_few], budgets[:n_few], hb, a.topk, static, timed, False)
        steps = s["steps"]
        per = {k: v / steps for k, v in ops.kernels.items()}
        sync = {k: v / steps for k, v in ops.syncs.items()}
        us = {k: timed.seconds[k] / few.kernels[k] for k in few.kernels if few.kernels[k]}
        sec = {k: n * us.get(k, max(us.values())) for k, n in per.items()}  # host seconds per step, by phase
        rows_per_step = s["rows"] / steps
        host = sum(sec.values())
        host_graphed = host - sec.get("forward", 0.0)  # a CUDA graph replays the forward in one launch
        slots = s["max_len"] if static else s["slots"] / steps  # a static step reads the whole row buffer
        step_bytes = weights + rows_per_step * slots * kv_per_slot
        name = "generate, static shapes" if static else "generate, eager"
        out.append(
            {
                "path": name,
                "tokens_per_step": rows_per_step,
                "kernels_per_step": sum(per.values()),
                "kernels_forward": per.get("forward", 0.0),
                "syncs_per_step": sum(sync.values()),
                "syncs_by_op": {f"{p}:{o}": n / steps for (p, o), n in sorted(ops.what.items())},
                "host_ms_per_step": 1e3 * host,
                "host_ms_by_phase": {k: 1e3 * v for k, v in sorted(sec.items())},
                "host_us_per_kernel": {k: 1e6 * v for k, v in sorted(us.items())},
                "ceiling_host": rows_per_step / host,
                "ceiling_host_graphed": rows_per_step / host_graphed if static else None,
                "flops_per_token": flops_per_token,
                "ceiling_compute": a.peak_tflops * 1e12 * a.mfu / flops_per_token,
                "bytes_per_step": step_bytes,
                "ceiling_memory": rows_per_step * a.hbm_tbs * 1e12 / step_bytes,
                "goal": a.goal_gen,
            }
        )
    return out


# ------------------------------------------------------------------------------------------------------------- train


def train_records(n: int, vocab: int, topk: int, seed: int = 1, lengths: tuple[int, int] = (96, 384)):
    from draftsmith.data.records import Record

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        m = int(torch.randint(lengths[0], lengths[1] + 1, (), generator=g))
        ids = torch.randint(3, vocab, (m,), generator=g)
        mask = torch.zeros(m, dtype=torch.bool)
        mask[m // 3 :] = True
        k = int(mask.sum())
        sig = {
            "topk_ids": torch.randint(0, vocab, (k, topk), generator=g),
            "topk_logprobs": torch.log_softmax(torch.randn(k, topk, generator=g), -1),
        }
        out.append(Record(ids, mask, i, 0, 0, sig))
    return out


@contextlib.contextmanager
def gpu_kernels(ops: HostOps | None):
    """The fused KD loss's two row passes as on a GPU: one Triton launch each (kernels/softmax.py), where a CPU runs
    a reference that loops over blocks of 64 rows. Same arithmetic, counted (and costing the host) as one kernel."""
    from draftsmith.kernels import softmax

    ref_lse, ref_scale = softmax.row_logsumexp_reference, softmax.softmax_scale_reference_
    one = ops.one_kernel if ops is not None else contextlib.nullcontext

    def lse(z):
        with one():
            return torch.logsumexp(z.float(), -1)

    def scale_(z, lse, coef):
        with one():
            return z.copy_((z.float() - lse[:, None]).exp_().mul_(coef[:, None]))

    softmax.row_logsumexp_reference, softmax.softmax_scale_reference_ = lse, scale_
    try:
        yield
    finally:
        softmax.row_logsumexp_reference, softmax.softmax_scale_reference_ = ref_lse, ref_scale


def train_step(cfg, recipe, records, ops: HostOps | None, flops: bool = False, precision: str = "bf16") -> dict:
    """One optimizer step of the loop on ``records`` (packed into rows of max_seq_len), the target in the loop."""
    from accelerate import Accelerator

    from draftsmith.data.dataset import collate_packed
    from draftsmith.models.llama import Llama
    from draftsmith.models.registry import build_drafter
    from draftsmith.train import loop
    from draftsmith.train.objectives import Context, objective_for

    torch.manual_seed(0)
    tc, params = recipe.train, recipe.drafter
    target = Llama(cfg).requires_grad_(False)
    if params.draft_vocab is not None:
        params = params.model_copy(update={"draft_vocab": min(params.draft_vocab, cfg.vocab_size // 2)})
    counts = torch.randint(1, 100, (cfg.vocab_size,))
    drafter = build_drafter("eagle", params, target, counts=counts).float().train()
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # a new precision in the same process
    GradientState._reset_state()
    acc = Accelerator(mixed_precision=precision, cpu=True)
    opt, sched = loop.build_optimizer(drafter, tc)
    drafter, opt = acc.prepare(drafter, opt)
    batch = loop.counted_batch(partial(collate_packed, row_tokens=tc.pack_tokens or tc.max_seq_len), records)
    tokens = batch[1][1]
    if ops is not None:  # torch's AdamW keeps its step counts on the host (not fused): its .item()s wait for nothing
        opt.step = ops.in_phase("optimizer", opt.step)
    ctx = Context(unwrapped=acc.unwrap_model(drafter), target=target, generator=torch.Generator(), params=params)
    objective = objective_for("eagle")

    def once():
        return loop._optimizer_step(acc, drafter, opt, sched, iter([batch]), objective, tc, ctx)

    once()  # warm-up (allocations, the optimizer's state)
    t0 = time.perf_counter()
    if flops:
        from draftsmith.flops import count_flops

        n, _ = count_flops(once)
        return {"flops": n, "tokens": tokens}
    with ops.counting() if ops is not None else contextlib.nullcontext(), gpu_kernels(ops):
        once()
    return {"seconds": time.perf_counter() - t0, "tokens": tokens}


def training(a, cfg) -> list[dict]:
    from draftsmith.recipes.loader import load_recipe
    from draftsmith.train.losses import LOGITS_BUDGET

    base = load_recipe("eagle3-smollm2", [])
    chunk = a.loss_chunk or max(256, LOGITS_BUDGET // base.drafter.draft_vocab)  # what auto_chunk picks on a GPU
    sets = ["train.packing=true", f"train.micro_batch_size={a.micro_batch}", f"train.loss.chunk={chunk}"]
    recipe = load_recipe("eagle3-smollm2", sets)
    small = tiny(cfg, a.tiny_head_dim, a.tiny_vocab)
    topk = recipe.data.signals.topk
    ops = HostOps()
    s = train_step(small, recipe, train_records(a.micro_batch, a.tiny_vocab, topk), ops)
    # host time: the same records' count and code path on short records, where attention's T^2 work vanishes too
    short = train_records(a.micro_batch, a.tiny_vocab, topk, lengths=(4, 12))
    rows12 = load_recipe("eagle3-smollm2", [*sets, "train.max_seq_len=12"])
    host_cfg = tiny(cfg, 2, a.tiny_vocab)
    quick = HostOps()
    # timed in fp32: a CPU's bf16 matmuls at these tiny shapes cost far more than the host's dispatch, which is
    # what is being measured (the bf16 step's extra cast kernels are in the counts above)
    train_step(host_cfg, rows12, short, quick, precision="no")
    timed = train_step(host_cfg, rows12, short, None, precision="no")
    f = train_step(cfg, recipe, train_records(a.flops_records, cfg.vocab_size, topk), None, flops=True)
    flops_per_token = f["flops"] / f["tokens"]
    weights = params_bytes(Llama_like(cfg))
    # host seconds per kernel on the short records, times the kernels at the real lengths (the chunked losses
    # launch more kernels for more positions)
    tokens = s["tokens"]
    host = timed["seconds"] / sum(quick.kernels.values()) * sum(ops.kernels.values())
    device_syncs = {o: n for (p, o), n in sorted(ops.what.items()) if p != "optimizer"}
    return [
        {
            "path": f"train EAGLE-3, packed, {a.micro_batch} records/step, loss chunk {chunk}",
            "tokens_per_step": tokens,
            "kernels_per_step": sum(ops.kernels.values()),
            "kernels_short_records": sum(quick.kernels.values()),
            "syncs_per_step": sum(device_syncs.values()),
            "syncs_by_op": device_syncs,
            "host_ms_per_step": 1e3 * host,
            "host_us_per_kernel": 1e6 * timed["seconds"] / sum(quick.kernels.values()),
            "ceiling_host": tokens / host,
            "flops_per_token": flops_per_token,
            "ceiling_compute": a.peak_tflops * 1e12 * a.mfu / flops_per_token,
            # weights read: the target's forward once (the drafter's are small and read from cache-sized chunks)
            "bytes_per_step": weights,
            "ceiling_memory": tokens * a.hbm_tbs * 1e12 / weights,
            "goal": a.goal_train,
        }
    ]


def Llama_like(cfg):
    from draftsmith.models.llama import Llama

    with torch.device("meta"):
        return Llama(cfg)


def fmt(x) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--stages", nargs="+", default=["generate", "train"], choices=["generate", "train"], help="what to bound"
    )
    p.add_argument("--prompts", type=int, default=512, help="prompts generated (32-256 tokens, 16-128 new each)")
    p.add_argument("--gen-batch", type=int, default=256, help="generation rows (data.batch_size)")
    p.add_argument("--prefill-pad", type=int, default=256, help="max_prefill_pad of the joins (its GPU default)")
    p.add_argument("--host-batch", type=int, default=4, help="rows of the run that times the host per kernel")
    p.add_argument("--no-optimize", action="store_true", help="generate with data.optimize=false (plain modules)")
    p.add_argument("--refill-join", type=int, default=0, help="data.refill_join; 0: its GPU default, batch // 16")
    p.add_argument("--topk", type=int, default=32, help="top-k captured per token (data.signals.topk)")
    p.add_argument("--micro-batch", type=int, default=64, help="records per training step (train.micro_batch_size)")
    p.add_argument("--loss-chunk", type=int, default=0, help="train.loss.chunk; 0: what it is on a GPU (auto)")
    p.add_argument("--flops-records", type=int, default=4, help="records of the real-width step FLOPs are counted on")
    p.add_argument("--tiny-head-dim", type=int, default=8, help="head width of the host-time model")
    p.add_argument("--tiny-vocab", type=int, default=1024, help="vocabulary of the host-time model")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="device peak, dense bf16 (H100 SXM: 989)")
    p.add_argument("--hbm-tbs", type=float, default=3.35, help="device memory bandwidth, TB/s (H100 SXM: 3.35)")
    p.add_argument("--mfu", type=float, default=0.4, help="utilisation the compute ceiling assumes")
    p.add_argument("--goal-gen", type=float, default=20000, help="generation goal, response tokens/s")
    p.add_argument("--goal-train", type=float, default=100000, help="training goal, input tokens/s")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args()
    torch.set_grad_enabled(True)
    cfg = smollm2_config()
    rows = []
    meter = CpuShare().start()
    if "generate" in a.stages:
        rows += generation(a, cfg)
    if "train" in a.stages:
        rows += training(a, cfg)
    cols = (
        "tok/step kernels/step syncs/step host-ms/step | ceilings tok/s: host host-graphed "
        f"compute@{a.mfu:.0%} memory | goal"
    )
    print(cols)
    for r in rows:
        ceil = [r["ceiling_host"], r.get("ceiling_host_graphed"), r["ceiling_compute"], r["ceiling_memory"]]
        print(
            f"{r['path']}: {fmt(r['tokens_per_step'])} {fmt(r['kernels_per_step'])} {fmt(r['syncs_per_step'])} "
            f"{r['host_ms_per_step']:.1f} | {' '.join(fmt(c) for c in ceil)} | {fmt(r['goal'])}"
        )
        low = min(c for c in ceil if c is not None and not (r.get("ceiling_host_graphed") and c is r["ceiling_host"]))
        print(f"  bound {fmt(low)} tokens/s ({low / r['goal']:.2f}x the goal); syncs: {r['syncs_by_op']}")
        if "host_ms_by_phase" in r:
            print(f"  host ms per step by phase: { {k: round(v, 2) for k, v in r['host_ms_by_phase'].items()} }")
    print(f"FLOPs and bytes at SmolLM2-135M widths; peak {a.peak_tflops:g} TFLOP/s, {a.hbm_tbs:g} TB/s")
    print(f"host times: {machine_note('cpu', meter.stop())}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
