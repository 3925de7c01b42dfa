"""`draftsmith train`: the one training loop for every drafter kind (accelerate: CPU, DDP, FSDP, DeepSpeed).

Multi-GPU: ``accelerate launch -m draftsmith train RECIPE``. The drafter is built from the target (registry);
what differs between kinds comes from the kind's spec (models/spec.py): its objective (train/objectives.py), the
record signals it reads, whether the frozen target runs in the loop, and what FSDP wraps. Nothing else here knows
about drafter kinds.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.data.dataset import RecordDataset, collate, collate_packed, record_lengths, token_counts
from draftsmith.data.records import read_manifest
from draftsmith.errors import DraftsmithError
from draftsmith.eval.hetero import OwnVocabDrafter
from draftsmith.eval.quick import tau_from_alpha
from draftsmith.flops import Meter, peak_flops
from draftsmith.models.loading import load_model, read_json, stop_ids, tokenizer_hash
from draftsmith.models.registry import build_drafter, drafter_spec, load_weights_into, save_drafter
from draftsmith.recipes.loader import dump_recipe
from draftsmith.runlog import RunLog, save_recipe, significant
from draftsmith.runtime import refuse_independent_machines, resolve_device, resolve_precision
from draftsmith.train import own_vocab
from draftsmith.train.objectives import Context, check_packing, features_stored, objective_for
from draftsmith.train.state import gather, gather_rng_states, latest_resumable, prune, read_state, write_state

log = logging.getLogger(__name__)


def build_optimizer(model: torch.nn.Module, tc):
    # A drafter may split its parameters into groups with their own learning-rate multipliers (Medusa-2's
    # adapters train slower than its heads); the schedule below scales every group alike.
    groups = (
        model.param_groups()
        if hasattr(model, "param_groups")
        else [([p for p in model.parameters() if p.requires_grad], 1.0)]
    )
    opt = torch.optim.AdamW(
        [{"params": ps, "lr": tc.lr * mult} for ps, mult in groups if ps],
        lr=tc.lr,
        weight_decay=tc.weight_decay,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:  # linear warmup, then cosine / linear decay to min_lr_ratio, or constant
        if step < tc.warmup_steps:
            return (step + 1) / (tc.warmup_steps + 1)
        progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps))
        lo = tc.min_lr_ratio
        if tc.lr_schedule == "cosine":
            return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))
        if tc.lr_schedule == "linear":
            return lo + (1 - lo) * (1 - progress)
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


class GlobalBatches(torch.utils.data.Sampler):
    """Each epoch a seeded permutation, cut into global batches of ``per_rank * world`` records; rank r takes
    slice r of each. One process with batch 4 and two with batch 2 see the same global batches, and resuming
    at micro-batch n is arithmetic (no data is read to skip)."""

    def __init__(self, n: int, per_rank: int, rank: int, world: int, seed: int, start: int = 0):
        self.n, self.per_rank, self.rank, self.world, self.seed = n, per_rank, rank, world, seed
        self.per_epoch = n // (per_rank * world)
        if self.per_epoch == 0:
            raise DraftsmithError(
                f"{n} training sequences cannot fill one global batch of "
                f"{per_rank} x {world} processes: lower train.micro_batch_size"
            )
        self.start = start

    def __iter__(self):
        b = self.start
        while True:
            epoch, i = divmod(b, self.per_epoch)
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))
            g = perm[i * self.per_rank * self.world : (i + 1) * self.per_rank * self.world]
            yield g[self.rank * self.per_rank : (self.rank + 1) * self.per_rank].tolist()
            b += 1


class TokenBatches(torch.utils.data.Sampler):
    """``train.batch_tokens``: micro-batches of as many records as fit ``budget`` input tokens (each record counted
    at its truncated length; a record alone may fill one). Each epoch the seeded permutation is cut, in order, into
    such micro-batches, ``world`` consecutive ones make a global batch and rank r takes the r-th; an epoch's tail
    that cannot fill a global batch waits for the next epoch's permutation, as in ``GlobalBatches``. The cuts are a
    function of the permutation and the lengths alone, so resuming at micro-batch n is arithmetic too."""

    def __init__(self, lengths: list[int], budget: int, rank: int, world: int, seed: int, start: int = 0):
        self.lengths, self.budget, self.rank, self.world, self.seed = lengths, budget, rank, world, seed
        self.start, self._cuts = start, {}
        if self.per_epoch(0) == 0:
            raise DraftsmithError(
                f"{len(lengths)} training sequences cannot fill one global batch of {world} micro-batches of "
                f"train.batch_tokens={budget} tokens: lower train.batch_tokens"
            )

    def _epoch(self, epoch: int) -> list[list[int]]:
        if epoch not in self._cuts:
            gen = torch.Generator().manual_seed(self.seed * 100003 + epoch)  # GlobalBatches' permutation
            perm = torch.randperm(len(self.lengths), generator=gen)
            batches, cur, used = [], [], 0
            for i in perm.tolist():
                n = self.lengths[i]
                if cur and used + n > self.budget:
                    batches.append(cur)
                    cur, used = [], 0
                cur.append(i)
                used += n
            if cur:
                batches.append(cur)
            self._cuts = {epoch: batches[: len(batches) // self.world * self.world]}  # one epoch kept
        return self._cuts[epoch]

    def per_epoch(self, epoch: int) -> int:
        """Global batches in ``epoch``."""
        return len(self._epoch(epoch)) // self.world

    def __iter__(self):
        b, epoch = self.start, 0
        while b >= self.per_epoch(epoch):  # skip whole epochs first: their cut points depend on their permutation
            b -= self.per_epoch(epoch)
            epoch += 1
        while True:
            if b >= self.per_epoch(epoch):
                b, epoch = 0, epoch + 1
                continue
            yield self._epoch(epoch)[b * self.world + self.rank]
            b += 1


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _quick_eval_setup(recipe, tgt, acc):
    """A closure that decodes the first train.eval_prompts eval prompts with the drafter as ``draftsmith eval``
    would: eval.strategy (chain of eval.draft_len, or the tree), eval.stop and eval.temperature (eval/quick.py)."""
    from draftsmith.eval.prompts import prompts_from
    from draftsmith.eval.quick import quick_eval
    from draftsmith.models.loading import encode_chat, first_turn

    tc, ec = recipe.train, recipe.eval
    pc = ec.prompts
    prompts = prompts_from(pc, tc.eval_prompts)
    encoded = [encode_chat(tgt.tokenizer, first_turn(p.messages)) for p in prompts]
    target, eos = tgt.model.to(acc.device), stop_ids(tgt.path, tgt.tokenizer)

    def run(drafter):
        was_training = drafter.training
        drafter.eval()
        try:  # Medusa-2 decodes with its adapted target
            from draftsmith.eval.bench import build_tree, stop_rule

            t = target if getattr(drafter, "base", None) is None else drafter.base
            if getattr(drafter, "draft_tokenizer", None) is not None:  # its own vocabulary: eval/hetero.py
                ov = ec.own_vocab
                opts = (ov.method, ov.ngram_cache) if ov is not None else ("auto", False)
                drafter = OwnVocabDrafter(drafter, drafter.draft_tokenizer, tgt.tokenizer, *opts)
            tree = build_tree(ec, getattr(drafter, "max_draft_len", None))
            stop = None
            if ec.stop is not None:
                dtype = next(drafter.parameters()).dtype
                stop = stop_rule(ec, drafter, {"kind": recipe.drafter.kind}, None, dtype, acc.device)[2]
            return quick_eval(
                t, drafter, encoded, tc.eval_max_new_tokens, ec.draft_len, ec.temperature, eos, recipe.seed, tree, stop
            )
        finally:
            drafter.train(was_training)

    return run


def train(recipe) -> Path:
    """Train the recipe's drafter on its records; returns the final checkpoint folder. Reruns resume from the
    newest resumable checkpoint (train.save_every) unless train.resume is false."""
    from accelerate.utils import set_seed

    tc, run = recipe.train, recipe.run_dir
    acc = _accelerator(recipe)
    data_dir, ckpt_dir = run / "data", run / "checkpoints"
    manifest = read_manifest(data_dir)
    # The target initialises the drafter (embeddings, layers), checks the tokenizer, may teach in the loop and,
    # with eval_every, verifies. Either path (target.backend); seeded after the load, which may draw random numbers
    # on the transformers path, so the drafter starts the same on both.
    t = recipe.target
    tgt = load_model(t.model, torch.float32, "cpu", t.trust_remote_code, t.revision, backend=t.backend)
    set_seed(recipe.seed)
    meta = _checkpoint_meta(recipe, tgt, manifest, data_dir)
    kind, spec = recipe.drafter.kind, drafter_spec(recipe.drafter.kind)
    drafter, own_tok = _build(recipe, tgt, data_dir)
    quick = _quick_eval_setup(recipe, tgt, acc) if tc.eval_every and acc.is_main_process else None
    teacher, stored = _teacher(recipe, spec, drafter, manifest, tgt, acc)
    target_tok = tgt.tokenizer
    del tgt
    signals = spec.signals_for(drafter) - (set() if stored else {"hidden_last", "hidden_aux"})
    ds = RecordDataset(data_dir, tc.max_seq_len, signals=signals if own_tok is None else set())
    if own_tok is not None:  # the target's answers in the draft's tokens
        ds = own_vocab.RetokenizedDataset(ds, target_tok, own_tok, tc.max_seq_len)
    if len(ds) == 0:
        raise DraftsmithError(f"{data_dir}: no records to train on")
    opt, sched = build_optimizer(drafter, tc)
    # Counted before ZeRO-3 partitions the parameters (its module then holds empty tensors).
    n_params, n_trainable = drafter.num_params(), sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    loss_gen = torch.Generator(device=acc.device).manual_seed(recipe.seed * 1000 + acc.process_index)
    drafter, opt, counters, resume_from = _start(acc, tc, spec, drafter, opt, sched, loss_gen, ckpt_dir)
    batches = iter(_loader(acc, tc, ds, data_dir, recipe.seed, counters["batches"]))
    ctx = Context(unwrapped=acc.unwrap_model(drafter), target=teacher, generator=loss_gen, params=recipe.drafter,
                  seed=recipe.seed)  # fmt: skip
    save_recipe(recipe, acc.is_main_process)
    runlog = RunLog(run, "train", wandb=tc.wandb, tensorboard=tc.tensorboard, config=recipe.model_dump(mode="json"),
                    enabled=acc.is_main_process)  # fmt: skip
    step = counters["step"]
    runlog.drop_after(step)  # a killed run's rows past the step resumed from (all of them when starting afresh)
    if acc.is_main_process:
        prune(ckpt_dir, tc.keep_last)  # what a prune killed mid-way left
        print(
            f"train: {kind} drafter, {n_params / 1e6:.1f}M params "
            f"({n_trainable / 1e6:.1f}M trainable), {len(ds)} sequences, {tc.steps} steps, "
            f"{acc.num_processes} process(es) ({acc.distributed_type.value})"
            + (f", resuming at step {step} from {resume_from}" if resume_from is not None else "")
        )
    loop = _Loop(recipe, acc, drafter, opt, sched, batches, ctx, counters, runlog, quick)
    loop.run(step, lambda at: _save_resumable(acc, ckpt_dir / f"step-{at:06d}", drafter, opt, sched, kind, meta,
                                              dict(counters), loss_gen, tc.keep_last, loop.recipe_yaml))  # fmt: skip
    final = ckpt_dir / "final"
    acc.wait_for_everyone()
    full, _ = _gathered(acc, drafter)  # every rank: a collective under FSDP2 / ZeRO-3
    if acc.is_main_process:
        unwrapped, step_meta = acc.unwrap_model(drafter), {**meta, "step": loop.step}
        save_drafter(final, unwrapped, kind, step_meta, recipe_yaml=loop.recipe_yaml, state=full)
        took = time.perf_counter() - loop.t0
        print(f"train: {loop.step} steps, {counters['tokens']} target tokens, {took:.0f}s -> {final}")
    runlog.close()
    return final


def _accelerator(recipe):
    """accelerate's Accelerator for the recipe's device and precision, checked against the launch."""
    from accelerate import Accelerator

    tc = recipe.train
    refuse_independent_machines()
    device = resolve_device(recipe.target.device)
    precision = resolve_precision(tc.precision, device)
    if tc.precision == "auto":
        log.info("train.precision=auto -> %s on %s", precision, device)
    acc = Accelerator(mixed_precision=precision, cpu=device == "cpu")
    _check_sharding(acc, tc)
    _configure_deepspeed(acc, tc)
    return acc


def _checkpoint_meta(recipe, tgt, manifest: dict, data_dir: Path) -> dict:
    """What every checkpoint's drafter.json says about the target (records of another tokenizer are refused)."""
    if manifest["tokenizer_hash"] != tokenizer_hash(tgt.tokenizer):
        raise DraftsmithError(
            f"{data_dir}: records were made with a different tokenizer than target {recipe.target.model!r}"
        )
    # checkpoints say which path ran the target; exports name the verifier by its architecture (speculators config)
    conf = tgt.path / "config.json"
    arch = read_json(conf).get("architectures") if conf.is_file() else None
    meta = {"target": recipe.target.model, "tokenizer_hash": manifest["tokenizer_hash"], "recipe": recipe.name}
    meta["target_path"] = tgt.backend  # own | transformers, as in data manifests and eval reports
    if isinstance(arch, list):
        meta["target_architectures"] = arch
    return meta


def _build(recipe, tgt, data_dir: Path):
    """The fresh drafter from its section and the target -> (drafter, its own tokenizer or None)."""
    tc, kind, params = recipe.train, recipe.drafter.kind, recipe.drafter  # params: the kind's typed section
    if tc.packing:
        check_packing(kind)
    facts = {"tokenizer": tgt.tokenizer, "eos_ids": stop_ids(tgt.path, tgt.tokenizer)}
    own_tok = None
    if getattr(params, "tokenizer", None):  # a draft with its own vocabulary (train/own_vocab.py)
        own_vocab.check_loss(tc)
        own_tok = facts["draft_tokenizer"] = own_vocab.draft_tokenizer(params, recipe.run_dir, tgt.tokenizer, data_dir)
    if getattr(params, "draft_vocab", None):  # (a field of the kinds that can reduce their vocabulary)
        facts["counts"] = token_counts(data_dir, tgt.model.cfg.vocab_size)
    return build_drafter(kind, params, tgt.model, **facts).float().train(), own_tok


def _teacher(recipe, spec, drafter, manifest: dict, tgt, acc):
    """The frozen target in the loop, when it teaches (full-distribution teachers), feeds hidden states the records
    do not store, or the kind asks for it (``needs_target``: the judge, acceptance heads on EAGLE and heads)
    -> (the target on the training device or None, whether the records store the features)."""
    tc = recipe.train
    stored = spec.reads_features and features_stored(drafter, manifest["signals"])
    in_loop = tc.loss.teacher == "target" or (spec.reads_features and not stored) or spec.needs_target_for(drafter)
    teacher = tgt.model.requires_grad_(False) if in_loop else None
    if teacher is not None and tc.shard_target and acc.num_processes > 1:
        _shard_frozen_target(teacher, acc)  # before the move: no device ever holds the whole target
    return (teacher.to(acc.device) if teacher is not None else None), stored


def _start(acc, tc, spec, drafter, opt, sched, loss_gen, ckpt_dir: Path):
    """Resume from the newest resumable checkpoint (or warm-start from train.init_checkpoint), then wrap for the
    launch -> (drafter, optimizer, counters, the checkpoint resumed from or None)."""
    counters = {"step": 0, "batches": 0, "tokens": 0, "seconds": 0.0}
    resume_from = latest_resumable(ckpt_dir) if tc.resume else None
    fresh = (
        f" (resuming: delete {resume_from} to resume from an earlier step, or set train.resume=false to start fresh)"
    )
    if resume_from is not None:
        load_weights_into(resume_from, drafter, hint=fresh)
    elif tc.init_checkpoint:
        load_weights_into(Path(tc.init_checkpoint), drafter, grow=True, hint=" (train.init_checkpoint)")
    # The scheduler is stepped by hand once per optimizer step: accelerate's wrapper would step it once per
    # process, which changes the schedule with the process count.
    _fsdp_wrap(acc, spec, drafter)
    drafter, opt = acc.prepare(drafter, opt)
    if getattr(acc, "is_fsdp2", False) and acc.is_main_process:
        print(f"train: FSDP2 units: {fsdp_units(drafter)}; the rest of the drafter is the root unit")
    if resume_from is not None:
        counters = read_state(
            resume_from, opt, sched, {"loss": loss_gen}, model=drafter, rank=acc.process_index, hint=fresh
        )
    return drafter, opt, counters, resume_from


def _loader(acc, tc, ds, data_dir: Path, seed: int, start: int):
    """This process's micro-batches from batch ``start`` on: by record count or by input tokens, packed or padded."""
    if tc.batch_tokens:  # micro-batches by input tokens: steady work per step whatever the records' lengths
        lengths = [min(n, tc.max_seq_len) for n in record_lengths(data_dir)]
        sampler = TokenBatches(lengths, tc.batch_tokens, acc.process_index, acc.num_processes, seed, start=start)
    else:
        sampler = GlobalBatches(len(ds), tc.micro_batch_size, acc.process_index, acc.num_processes, seed, start=start)
    # train.packing: the sampler's micro-batch of records, packed into rows (a function of the records only, so a
    # resumed run packs as the uninterrupted one did)
    coll = partial(collate_packed, row_tokens=tc.pack_tokens or tc.max_seq_len) if tc.packing else collate
    coll = partial(counted_batch, coll)  # the step's token counts, made where the batch is (a loader worker)
    # its own generator: the loader's seed draw must not move the global RNG a resumed run has just restored
    cuda = acc.device.type == "cuda"
    workers = tc.loader_workers if tc.loader_workers is not None else (2 if cuda else 0)
    return torch.utils.data.DataLoader(
        ds,
        batch_sampler=sampler,
        collate_fn=coll,
        generator=torch.Generator(),
        num_workers=workers,
        pin_memory=cuda,
        prefetch_factor=4 if workers else None,
        persistent_workers=workers > 0,
    )


class _Loop:
    """The optimizer steps from a step on: a logged metrics window every train.log_every steps (non-finite values
    stop training), a quick eval every train.eval_every, a resumable checkpoint every train.save_every."""

    def __init__(self, recipe, acc, drafter, opt, sched, batches, ctx, counters: dict, runlog, quick):
        self.recipe, self.tc, self.acc, self.drafter, self.opt, self.sched = (
            recipe,
            recipe.train,
            acc,
            drafter,
            opt,
            sched,
        )
        self.batches, self.ctx, self.counters, self.runlog, self.quick = batches, ctx, counters, runlog, quick
        self.objective = objective_for(recipe.drafter.kind)
        self.ckpt_dir = recipe.run_dir / "checkpoints"
        self.recipe_yaml = dump_recipe(recipe)  # every checkpoint keeps the exact recipe that trained it
        self.t0, self.step = time.perf_counter() - counters["seconds"], counters["step"]

    def run(self, step: int, save) -> None:
        tc, acc, counters = self.tc, self.acc, self.counters
        window, self.step = [], step
        bar = tqdm(total=tc.steps, initial=step, desc="train", unit="step", disable=not acc.is_main_process,
                   dynamic_ncols=True)  # fmt: skip
        meter, self.tw = _meter(acc, self.drafter, counters.get("flops_per_token")), time.perf_counter()
        args = (acc, self.drafter, self.opt, self.sched, self.batches, self.objective, tc, self.ctx)
        while self.step < tc.steps:
            self.ctx.step = self.step
            if self.step == 1:  # the second step's FLOPs, counted once per run (a resumed run keeps the figure): MFU
                out, meter = _counted_step(*args)
                counters["flops_per_token"] = None if meter is None else meter.flops_per_token
            else:
                out = _optimizer_step(*args)
            counters["batches"] += tc.grad_accum
            counters["tokens"] += out["tokens"]
            window.append(out)
            self.step += 1
            bar.update(1)
            if self.step % tc.log_every == 0 or self.step == tc.steps:
                self._log(window, meter, bar)
                window = []
            if self.quick is not None and self.step % tc.eval_every == 0:
                m = self.quick(acc.unwrap_model(self.drafter))
                self.runlog.log(significant(m), step=self.step)
                bar.set_postfix(tau=f"{m['tau_measured']:.2f}", tau_est=f"{m.get('tau_estimate', float('nan')):.2f}")
            if tc.save_every and self.step % tc.save_every == 0 and self.step < tc.steps:
                self._check_before_save(window)
                counters.update(step=self.step, seconds=time.perf_counter() - self.t0)
                save(self.step)
        bar.close()

    def _log(self, window: list[dict], meter, bar) -> None:
        """One metrics row for the steps in ``window`` (stops training on a non-finite loss or gradient)."""
        acc, step = self.acc, self.step
        m = _window_metrics(window, self.counters, self.t0, self.recipe.eval.draft_len)
        _stop_if_not_finite(m, step - len(window) + 1, step, self.ckpt_dir)
        now = time.perf_counter()
        rate = sum(w["real"] for w in window) / max(1e-9, now - self.tw) / acc.num_processes  # per device
        m["input_tokens_per_s"] = rate
        if meter is not None:
            m.update(tflops=meter.tflops(rate), mfu=meter.mfu(rate))
        self.tw = now
        m.update(lr=self.sched.get_last_lr()[0], peak_mem_mb=peak_memory_mb(str(acc.device)))
        bar.set_postfix(loss=f"{m['loss']:.3f}", top1=f"{m.get('top1', 0):.2f}", tok_s=f"{m['tokens_per_s']:.0f}")
        self.runlog.log(significant(m), step=step)

    def _check_before_save(self, window: list[dict]) -> None:
        """Never save weights a not-yet-logged step made non-finite, nor weights the update itself overflowed."""
        step = self.step
        if window:
            settled = _settle(window)
            worst = {"loss": sum(w["loss"] for w in settled), "grad_norm": sum(w["grad_norm"] for w in settled)}
            _stop_if_not_finite(worst, step - len(window) + 1, step, self.ckpt_dir)
        if not _weights_finite(self.drafter):  # one read per save
            _stop_if_not_finite({"loss": math.nan, "grad_norm": math.nan}, step, step, self.ckpt_dir)


def _shard_frozen_target(model, acc) -> None:
    """train.shard_target: FSDP2 over the frozen target's decoder layers. Each rank keeps 1/N of every layer and
    the forward all-gathers one layer at a time (and frees it after), so the target costs ~1/N of its layers per
    device. Embeddings, final norm and LM head stay whole: objectives read the LM head's weight directly
    (teacher: target). Every rank runs the teacher once per micro-batch, so the collectives line up."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(acc.device.type, (acc.num_processes,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    if acc.is_main_process:
        print(f"train: target layers sharded over {acc.num_processes} processes (FSDP2)")


def fsdp_wrap_names(spec, drafter) -> list[str]:
    """Class names of the spec's FSDP units that this drafter has (an optional block, e.g. Hydra++'s prefix layer
    or a deeper EAGLE's blocks, may be absent; accelerate refuses a name it cannot find)."""
    present = {type(m) for m in drafter.modules()}
    return [c.__name__ for c in spec.fsdp_wrap if c in present]


def fsdp_kept_whole(drafter) -> list[torch.nn.Module]:
    """Frozen parts a drafter leaves out of its checkpoint (``checkpoint_exclude``: an acceptance head's draft).
    Its objective runs them outside the drafter's forward, where FSDP2 would hand it shards, so every rank keeps
    them whole, as it keeps the frozen target. (Medusa-2's adapted target trains: it is sharded.)"""
    parts = [getattr(drafter, p.rstrip("."), None) for p in getattr(drafter, "checkpoint_exclude", ())]
    return [m for m in parts if isinstance(m, torch.nn.Module) and not any(p.requires_grad for p in m.parameters())]


def _fsdp_wrap(acc, spec, drafter) -> None:
    """Under FSDP, wrap the drafter kind's own blocks (``DrafterSpec.fsdp_wrap``) as sharding units and keep its
    frozen parts whole (``fsdp_kept_whole``), whatever the launcher config names (recipes/accelerate/fsdp2.yaml
    leaves both to the loop); the rest shards with the root."""
    plugin = getattr(acc.state, "fsdp_plugin", None)
    if acc.distributed_type.value == "FSDP" and plugin is not None:
        plugin.transformer_cls_names_to_wrap = fsdp_wrap_names(spec, drafter)
        whole = fsdp_kept_whole(drafter)
        plugin.ignored_modules = [m.to(acc.device) for m in whole] or None  # fully_shard moves what it shards


def fsdp_units(drafter) -> str:
    """The FSDP2 units ``prepare`` made below the root, by class: "Block x2, RMSNorm x1" (accelerate adds the final
    norm), or "none" (the drafter is one unit)."""
    from collections import Counter

    from torch.distributed.fsdp import FSDPModule

    def name(m) -> str:  # fully_shard swaps a module's class for FSDP<name>, a subclass of the original
        return next(c for c in type(m).__mro__ if not issubclass(c, FSDPModule)).__name__

    units = Counter(name(m) for m in drafter.modules() if isinstance(m, FSDPModule) and m is not drafter)
    return ", ".join(f"{name} x{n}" for name, n in sorted(units.items())) or "none"


def _check_sharding(acc, tc) -> None:
    """Say so when a launcher config asked for FSDP / DeepSpeed and accelerate fell back (on CPU it runs DDP over
    gloo, which is correct but replicates everything), instead of letting the config be ignored silently. Refuse
    resumable checkpoints under DeepSpeed up front rather than at the first save: its optimizer keeps its own
    partitioned state layout, which train/state.py does not write."""
    if tc.shard_target and tc.eval_every:  # the in-training decode runs on rank 0 alone: it cannot gather shards
        raise DraftsmithError(
            "train.shard_target: the periodic eval (train.eval_every) decodes on one process and "
            "needs the whole target; set train.eval_every=0 and run draftsmith eval afterwards"
        )
    if acc.distributed_type.value == "DEEPSPEED" and tc.save_every:
        raise DraftsmithError(
            "train.save_every: resumable checkpoints are not supported under DeepSpeed yet; use "
            "recipes/accelerate/fsdp2.yaml (shards as well) or set train.save_every=0"
        )
    asked = [
        name
        for name, env in (("FSDP", "ACCELERATE_USE_FSDP"), ("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED"))
        if os.environ.get(env, "").lower() in ("1", "true")
    ]
    if asked and acc.distributed_type.value not in asked:
        log.warning(
            "the accelerate config asks for %s but this run is %s on %s: nothing is sharded (accelerate "
            "shards on GPUs only)",
            asked[0],
            acc.distributed_type.value,
            acc.device,
        )


def _configure_deepspeed(acc, tc) -> None:
    """DeepSpeed steps, clips and accumulates inside ``backward``: hand it the recipe's micro-batch, accumulation
    and clipping before ``prepare`` (accelerate would look for a dataloader this loop does not give it, and clip
    at its own default). ``_optimizer_step`` marks the accumulation boundary itself."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if acc.distributed_type.value != "DEEPSPEED" or plugin is None:
        return
    plugin.deepspeed_config.update(
        train_micro_batch_size_per_gpu=tc.micro_batch_size,
        gradient_accumulation_steps=tc.grad_accum,
        train_batch_size=tc.micro_batch_size * tc.grad_accum * acc.num_processes,
        gradient_clipping=tc.grad_clip,
    )
    acc.gradient_accumulation_steps = tc.grad_accum  # accelerate's copy, which it checks against DeepSpeed's


def counted_batch(collate_fn, records) -> tuple[dict, tuple[int, int, int]]:
    """(the collated batch, (trained positions, real input tokens, token slots incl. padding)): counted by the
    loader on the host copy, so the step never reads them back from the device."""
    b = collate_fn(records)
    return b, (int(b["predict_mask"].sum()), int(b["attention_mask"].sum()), b["input_ids"].numel())


def _optimizer_step(acc, drafter, opt, sched, batches, objective, tc, ctx) -> dict:
    """One optimizer step over grad_accum micro-batches per process. The loss is normalised by the number of
    trained tokens in the whole step across all processes, so the update equals one big batch's exactly.

    The host never waits for the device here on one process: token counts come with each micro-batch from the
    loader (``counted_batch``); the loss, grad norm and metrics stay on the device (``sums``) until
    ``_settle`` reads a logging window's worth in one copy. Several processes wait once per step, for the
    all-reduced token count the loss is normalised by."""
    host = [next(batches) for _ in range(tc.grad_accum)]  # (batch, counts): ``counted_batch``
    # each micro-batch on the device, with its host copy for bookkeeping (train/objectives.py ``host_batch``)
    micro = [{**{k: v.to(acc.device, non_blocking=True) for k, v in b.items()}, "host": b} for b, _ in host]
    # trained positions, real input tokens and the token slots the forwards ran on (pad_frac in the metrics)
    n_global, real, slots = (float(sum(c[i] for _, c in host)) for i in range(3))
    if acc.num_processes > 1:  # the step's one wait: every process's counts
        counts = torch.tensor([n_global, real, slots], dtype=torch.float64, device=acc.device)
        n_global, real, slots = acc.reduce(counts, "sum").tolist()
    scale = acc.num_processes / max(1.0, n_global)  # DDP averages gradients over processes
    loss_sum, metrics, n_metric = torch.zeros((), device=acc.device), {}, 0
    # DeepSpeed: its engine steps inside backward at the boundary accelerate's sync flag marks, and must not
    # divide the loss by the accumulation count again (it is normalised over the whole step already).
    ds = {"scale_wrt_gas": False} if acc.distributed_type.value == "DEEPSPEED" else {}
    for i, b in enumerate(micro):
        sync = i == len(micro) - 1
        if ds:
            acc.gradient_state._set_sync_gradients(sync)
        with contextlib.nullcontext() if sync else acc.no_sync(drafter):
            out = objective(drafter, b, tc.loss, ctx)
            acc.backward(out.loss_sum * scale, **ds)
        loss_sum += out.loss_sum.detach()
        n_metric += out.n  # metrics are means over the objective's own positions (heads: fewer than predicted)
        for k, v in out.metrics.items():  # token-weighted means over the micro-batches (device tensors or floats)
            if k != "tokens":
                metrics[k] = metrics.get(k, 0.0) + v * out.n
    grad_norm = acc.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    # One all-reduce for the loss and every metric: logged numbers describe the global batch, not rank 0's part.
    keys = sorted(metrics)
    parts = [loss_sum, n_metric, *(metrics[k] for k in keys)]
    sums = torch.stack([torch.as_tensor(x, device=acc.device).to(torch.float64).reshape(()) for x in parts])
    if acc.num_processes > 1:
        sums = acc.reduce(sums, "sum")
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    norm = torch.as_tensor(0.0 if grad_norm is None else grad_norm, device=acc.device).to(torch.float64).reshape(1)
    return {
        "n": int(n_global),
        "tokens": int(n_global),
        "real": real,
        "slots": slots,
        "keys": keys,
        "sums": torch.cat([sums, norm]),  # loss sum, metric count, metric sums..., grad norm: read by _settle
    }


def _weights_finite(drafter) -> bool:
    """Every weight finite, on every process: each checks its own shard (FSDP2 DTensors hold local ones) and the
    processes agree, so all of them stop or none does."""
    import torch.distributed as dist

    ok = None
    for p in drafter.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        f = torch.isfinite(local.detach()).all()
        ok = f if ok is None else ok & f
    flag = torch.tensor(1.0 if ok is None else float(ok), device="cpu")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = flag.to(next(drafter.parameters()).device) if dist.get_backend() == "nccl" else flag
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


def _stop_if_not_finite(m: dict, first: int, last: int, ckpt_dir: Path) -> None:
    """A non-finite loss or gradient norm ends training with one line; no checkpoint is written after it, so the
    last one saved (train.save_every) stays the newest."""
    if math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]):
        return
    steps = f"step {last}" if first == last else f"steps {first}-{last}"
    saved = sorted(ckpt_dir.glob("step-*"))
    keep = f"the last good checkpoint is {saved[-1]}" if saved else "no checkpoint was written"
    raise DraftsmithError(
        f"train: the loss or gradient norm is not finite at {steps} (loss {m['loss']}, grad norm {m['grad_norm']}): "
        f"{keep}; lower train.lr or raise train.warmup_steps"
    )


def _settle(window: list[dict]) -> list[dict]:
    """The steps' outputs with their device sums read (one copy for the whole window): loss, grad_norm and the
    token-weighted metric means as floats."""
    values = torch.cat([w["sums"] for w in window]).tolist() if window else []
    out, at = [], 0
    for w in window:
        v = values[at : at + len(w["sums"])]
        at += len(w["sums"])
        n_global, n_metric = max(1.0, w["n"]), max(1.0, v[1])
        out.append(
            {
                **{k: w[k] for k in ("n", "tokens", "real", "slots")},
                "loss": v[0] / n_global,
                "grad_norm": v[-1],
                **{k: x / n_metric for k, x in zip(w["keys"], v[2:-1])},
            }
        )
    return out


def _counted_step(acc, drafter, opt, sched, batches, objective, tc, ctx) -> tuple[dict, Meter | None]:
    """One optimizer step with its FLOPs counted (draftsmith/flops.py): (its output, a Meter for the logs' tflops
    and mfu per device, or None where counting fails: the step's result stands either way). Every run counts the
    same step (step index 1), so a resumed run computes what an uninterrupted one does, bit for bit."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        out = _optimizer_step(acc, drafter, opt, sched, batches, objective, tc, ctx)
    try:
        return out, _meter(acc, drafter, counter.get_total_flops() / max(1.0, out["real"] / acc.num_processes))
    except Exception as e:  # pragma: no cover - no peak for this device
        log.warning("train: no MFU in the logs (%s)", e)
        return out, None


def _meter(acc, drafter, flops_per_token: float | None) -> Meter | None:
    """A Meter for ``flops_per_token`` against this device's peak in the step's dtype (None: nothing counted)."""
    if flops_per_token is None:
        return None
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(acc.mixed_precision))
    dtype = amp or next(p for p in acc.unwrap_model(drafter).parameters()).dtype
    return Meter(flops_per_token, *peak_flops(acc.device, dtype))


def _window_metrics(window: list[dict], counters: dict, t0: float, draft_len: int) -> dict:
    window = _settle(window)
    n = sum(w["n"] for w in window)
    skip = ("n", "tokens", "real", "slots")
    m = {k: sum(w[k] * w["n"] for w in window) / max(1, n) for k in window[0] if k not in skip}
    # input tokens per optimizer step (all processes) and the share of the forwards' token slots that was padding
    real, slots = sum(w["real"] for w in window), sum(w["slots"] for w in window)
    m["input_tokens"] = real / len(window)
    m["pad_frac"] = 1 - real / max(1.0, slots)
    m["loss"] = sum(w["loss"] for w in window) / len(window)
    m["grad_norm"] = sum(w["grad_norm"] for w in window) / len(window)
    if "alpha" in m and "tau_estimate" not in m:  # chain of eval.draft_len drafts, i.i.d. acceptance (A1.3)
        m["tau_estimate"] = tau_from_alpha(m["alpha"], draft_len)
    m["tokens_per_s"] = counters["tokens"] / max(1e-9, time.perf_counter() - t0)
    return m


def _gathered(acc, drafter, opt=None) -> tuple[dict | None, dict | None]:
    """Every rank: the full (model, optimizer) state dicts a checkpoint holds, or None where the unwrapped
    module's own are full. ZeRO-3 partitions parameters (the module holds empty tensors): accelerate consolidates
    them (the shipped config sets zero3_save_16bit_model). FSDP2: train/state.py ``gather``."""
    if acc.distributed_type.value == "DEEPSPEED":
        return acc.get_state_dict(drafter), None
    return gather(drafter, opt)


def _save_resumable(
    acc, path: Path, drafter, opt, sched, kind, meta, counters, loss_gen, keep_last, recipe_yaml: str | None = None
) -> None:
    """Drafter + training state, atomically; then prune old step folders."""
    acc.wait_for_everyone()
    full, osd = _gathered(acc, drafter, opt)  # every rank: a collective under FSDP2
    rngs = gather_rng_states(acc, {"loss": loss_gen}) if acc.num_processes > 1 else None  # a collective too
    if acc.is_main_process:
        save_drafter(
            path,
            acc.unwrap_model(drafter),
            kind,
            {**meta, "step": counters["step"]},
            extra=lambda folder: write_state(folder, opt, sched, counters, {"loss": loss_gen}, osd, rngs),
            recipe_yaml=recipe_yaml,
            state=full,
        )
        prune(path.parent, keep_last)
    acc.wait_for_everyone()
