"""`draftsmith train`: the one training loop for every drafter kind (accelerate: CPU, DDP, FSDP, DeepSpeed).

Multi-GPU: ``accelerate launch -m draftsmith train RECIPE``. The drafter is built from the target (registry),
the per-kind objective comes from train/objectives.py; nothing else here knows about drafter kinds.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.data.dataset import RecordDataset, collate
from draftsmith.data.records import read_manifest
from draftsmith.errors import DraftsmithError
from draftsmith.models.hf import load_model, tokenizer_hash
from draftsmith.models.registry import build_drafter, save_drafter
from draftsmith.runlog import RunLog
from draftsmith.runtime import resolve_device
from draftsmith.train.objectives import OBJECTIVES, SIGNALS_NEEDED


def build_optimizer(model: torch.nn.Module, tc):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:  # linear warmup, then cosine to 10% of the peak
        if step < tc.warmup_steps:
            return (step + 1) / (tc.warmup_steps + 1)
        progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def forever(loader):
    """Re-iterate the loader each epoch (itertools.cycle would cache every batch in memory)."""
    epoch = 0
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def _quick_eval_setup(recipe, tgt, acc):
    """A closure that decodes the first train.eval_prompts eval prompts with the drafter as chains of
    eval.draft_len at eval.temperature (see eval/quick.py)."""
    from draftsmith.data.prompts import load_prompts
    from draftsmith.eval.quick import quick_eval
    from draftsmith.models.hf import encode_chat, first_turn, stop_ids

    tc, ec = recipe.train, recipe.eval
    pc = ec.prompts
    prompts = load_prompts(pc.source, pc.path, tc.eval_prompts, shuffle=pc.shuffle, seed=pc.seed, split=pc.split,
                           max_turns=pc.max_turns)
    encoded = [encode_chat(tgt.tokenizer, first_turn(p.messages)) for p in prompts]
    target, eos = tgt.model.to(acc.device), stop_ids(tgt.path, tgt.tokenizer)

    def run(drafter):
        was_training = drafter.training
        drafter.eval()
        try:
            return quick_eval(target, drafter, encoded, tc.eval_max_new_tokens, ec.draft_len, ec.temperature, eos,
                              recipe.seed)
        finally:
            drafter.train(was_training)

    return run


def train(recipe) -> Path:
    """Train the recipe's drafter on its records; returns the final checkpoint folder."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    tc, run = recipe.train, recipe.run_dir
    device = resolve_device(recipe.target.device)
    acc = Accelerator(gradient_accumulation_steps=tc.grad_accum, mixed_precision=tc.precision,
                      cpu=device == "cpu")
    set_seed(recipe.seed)
    data_dir = run / "data"
    manifest = read_manifest(data_dir)
    # The target initialises the drafter (embeddings, layers), checks the tokenizer and, with eval_every, verifies.
    tgt = load_model(recipe.target.model, torch.float32, "cpu", recipe.target.trust_remote_code,
                     recipe.target.revision)
    if manifest["tokenizer_hash"] != tokenizer_hash(tgt.tokenizer):
        raise DraftsmithError(f"{data_dir}: records were made with a different tokenizer than target "
                              f"{recipe.target.model!r}")
    kind = recipe.drafter.kind
    drafter = build_drafter(kind, recipe.drafter.model_dump(exclude={"kind"}), tgt.model).float().train()
    quick = _quick_eval_setup(recipe, tgt, acc) if tc.eval_every and acc.is_main_process else None
    del tgt
    ds = RecordDataset(data_dir, tc.max_seq_len, signals=SIGNALS_NEEDED[kind])
    if len(ds) == 0:
        raise DraftsmithError(f"{data_dir}: no records to train on")
    loader = torch.utils.data.DataLoader(ds, batch_size=tc.micro_batch_size, shuffle=True, collate_fn=collate,
                                         generator=torch.Generator().manual_seed(recipe.seed))
    opt, sched = build_optimizer(drafter, tc)
    drafter, opt, loader, sched = acc.prepare(drafter, opt, loader, sched)
    objective = OBJECTIVES[kind]
    runlog = RunLog(run, "train", wandb=tc.wandb, tensorboard=tc.tensorboard,
                    config=recipe.model_dump(mode="json"), enabled=acc.is_main_process)
    n_trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    if acc.is_main_process:
        print(f"train: {kind} drafter, {acc.unwrap_model(drafter).num_params() / 1e6:.1f}M params "
              f"({n_trainable / 1e6:.1f}M trainable), {len(ds)} sequences, {tc.steps} steps")
    meta = {"target": recipe.target.model, "tokenizer_hash": manifest["tokenizer_hash"], "recipe": recipe.name}
    step, tokens, t0, window = 0, 0, time.perf_counter(), []
    bar = tqdm(total=tc.steps, desc="train", unit="step", disable=not acc.is_main_process, dynamic_ncols=True)
    for batch in forever(loader):
        with acc.accumulate(drafter):
            out = objective(drafter, batch, tc.loss)
            acc.backward(out.loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad()
        tokens += out.metrics.get("tokens", 0)
        window.append({"loss": out.loss.item(), **out.metrics})
        if not acc.sync_gradients:
            continue
        step += 1
        bar.update(1)
        if step % tc.log_every == 0 or step == tc.steps:
            m = {k: sum(w[k] for w in window) / len(window) for k in window[0] if k != "tokens"}
            m.update(lr=sched.get_last_lr()[0], tokens_per_s=tokens / (time.perf_counter() - t0))
            bar.set_postfix(loss=f"{m['loss']:.3f}", top1=f"{m.get('top1', 0):.2f}", tok_s=f"{m['tokens_per_s']:.0f}")
            runlog.log({k: round(v, 5) for k, v in m.items()}, step=step)
            window = []
        if quick is not None and step % tc.eval_every == 0:
            m = quick(acc.unwrap_model(drafter))
            runlog.log({k: round(v, 5) for k, v in m.items()}, step=step)
            bar.set_postfix(tau=f"{m['tau_measured']:.2f}", tau_est=f"{m['tau_estimate']:.2f}")
        if tc.save_every and step % tc.save_every == 0 and acc.is_main_process:
            save_drafter(run / "checkpoints" / f"step-{step:06d}", acc.unwrap_model(drafter), kind,
                         {**meta, "step": step})
        if step >= tc.steps:
            break
    bar.close()
    final = run / "checkpoints" / "final"
    acc.wait_for_everyone()
    if acc.is_main_process:
        save_drafter(final, acc.unwrap_model(drafter), kind, {**meta, "step": step})
        print(f"train: {step} steps, {tokens} target tokens, {time.perf_counter() - t0:.0f}s -> {final}")
    runlog.close()
    return final
