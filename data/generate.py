"""`draftsmith generate`: turn prompts into distillation records (see data/records.py for the format).

Every (prompt, sample) becomes one conversation, produced turn by turn (data/chat.py splices responses into the
chat template by token id) by one of three writers:
- target: the target regenerates every assistant turn; teacher signals are captured while it generates;
- drafter: on-policy data (DistillSpec): a drafter writes the turns, the target scores them afterwards;
- dataset: the dataset's own replies are kept ("fixed data") and only scored.
Work is cut into shards of ``data.shard_size`` prompts: the unit of resume (a finished shard is never redone,
``manifest.json`` comes last) and of data parallelism (rank r of N takes shards r, r+N, ...). Randomness is
seeded per (seed, prompt, sample), so resuming, batch size and rank count never change the data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.data.chat import ChatLayout, chat_layout, encode
from draftsmith.data.engine import Capture, Generated, Refill, Sampling, decode_batch, score_batch, write_batch
from draftsmith.data.records import (
    FORMAT,
    SOURCES,
    Record,
    ShardWriter,
    bytes_per_token,
    quantize_fp8,
    shard_done,
    shard_entry,
    shard_name,
    write_manifest,
    write_shard,
)
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import reads_target
from draftsmith.eval.prompts import prompts_from
from draftsmith.flops import Meter, count_flops, peak_flops
from draftsmith.models.eagle import default_aux_layers
from draftsmith.models.loading import load_model, stop_ids, tokenizer_hash
from draftsmith.models.registry import drafter_spec, load_drafter
from draftsmith.models.sampling import row_generator
from draftsmith.runlog import RunLog, save_recipe, significant
from draftsmith.runtime import barrier, init_distributed, resolve_device, resolve_dtype

log = logging.getLogger("draftsmith.data")
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def data_hash(recipe, with_n: bool = False) -> str:
    """Everything that changes the records: the target, the seed and the data section (not `enabled`, not the
    batch sizes, refill, CUDA graphs or the writer queue, ``prompts.n`` or ``prompts.streaming``; not
    ``target.backend`` either: both paths compute the same model, like two devices, and each shard names the path
    that wrote it).

    ``prompts.n`` stays out because the first n prompts are a prefix of the first n' > n (shuffling happens before
    the cut) and each prompt's sampling seed is its global index: raising n to grow a dataset keeps every complete
    shard, and each shard's metadata records the prompt span it covers. ``with_n``: the hash as written before
    spans were recorded, so such shards still resume."""
    d = {
        "target": recipe.target.model_dump(exclude={"device", "backend"}),
        "seed": recipe.seed,
        "data": recipe.data.model_dump(
            exclude={"enabled", "batch_size", "batch_tokens", "refill", "cuda_graphs", "write_queue"}
        ),
    }
    prompts = d["data"]["prompts"]
    prompts.pop("streaming")  # the same prompts either way
    for key in ("subset", "columns"):  # unset: left out, so data written before these keys existed still resumes
        if not prompts[key]:
            prompts.pop(key)
    if not with_n:
        prompts.pop("n")
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Unit:
    """One conversation to produce: a (prompt, sample) pair, its layout and who writes its responses."""

    prompt_index: int
    sample_index: int
    layout: ChatLayout
    n_turns: int
    source: str  # "target" | "drafter" | "dataset"
    gen: torch.Generator | None = None
    share: float = 1.0  # the fraction of its prompt this unit is (progress: 1 / n_samples, 1 / pieces of a text)
    seq: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[Generated] = field(default_factory=list)

    def est_tokens(self, max_new: int) -> int:
        """Upper bound of the final length: template tokens plus a full response per turn."""
        return sum(len(s) + 1 for s in self.layout.segments[: self.n_turns]) + self.n_turns * max_new


@dataclass
class Stats:
    """Per-shard tallies; they travel in the shard's manifest entry, so resumed and multi-rank runs sum exactly."""

    skipped_too_long: int = 0
    truncated: int = 0
    turns_dropped_too_long: int = 0
    skipped_no_response: int = 0


def plan_units(prompts, start: int, tok, eos: set[int], dc, seed: int, stats: Stats) -> list[Unit]:
    """The units of ``prompts`` (global indices from ``start``): n_samples each; unusable prompts are counted."""
    units = []
    for pi, p in enumerate(prompts, start):
        if p.text is not None:
            pieces = text_units(pi, p, tok, dc)
            stats.skipped_no_response += int(not pieces)
            units += pieces
            continue
        layout = chat_layout(tok, p.messages, eos)
        n_turns = layout.n_turns
        if dc.responses == "dataset":
            n_turns = next((i for i, r in enumerate(layout.responses) if r is None), n_turns)
        if n_turns == 0:
            stats.skipped_no_response += 1
            continue
        if len(layout.segments[0]) > dc.max_prompt_tokens:
            if dc.too_long == "skip":
                stats.skipped_too_long += 1
                continue
            layout.segments[0] = layout.segments[0][-dc.max_prompt_tokens :]  # keep the end: the question
            stats.truncated += 1
        units += [
            Unit(pi, si, layout, n_turns, _writer(dc, seed, pi, si), share=1 / dc.n_samples)
            for si in range(dc.n_samples)
        ]
    return units


def text_units(pi: int, p, tok, dc) -> list[Unit]:
    """A raw text record ({"text": ...}: a pretraining corpus, FastDraft stage 1) in fixed-data mode: its tokens
    cut into pieces of ``max_new_tokens`` labels. Piece i starts with the last label of piece i - 1 as its only
    context, so every token after the document's first is a label exactly once. The sample index numbers the
    pieces (n_samples does not apply: the text is kept as written)."""
    if dc.responses != "dataset":
        raise DraftsmithError(
            f"data.prompts: record {p.id} is raw text (a 'text' key, no messages): it needs "
            f"data.responses=dataset (there is no question for the target to answer)"
        )
    toks, n = encode(tok, p.text), dc.max_new_tokens
    starts = range(0, len(toks) - 1, n)
    return [
        Unit(
            pi, i, ChatLayout([toks[a : a + 1]], [None], [toks[a + 1 : a + n + 1]]), 1, "dataset", share=1 / len(starts)
        )
        for i, a in enumerate(starts)
    ]


def _writer(dc, seed: int, pi: int, si: int) -> str:
    if dc.responses == "dataset":
        return "dataset"
    if dc.on_policy is not None and random.Random(f"{seed}:{pi}:{si}").random() < dc.on_policy.fraction:
        return "drafter"
    return "target"


def pack(units: list[Unit], batch_size: int, batch_tokens: int | None, max_new: int) -> list[list[Unit]]:
    """Length-sorted batches (less padding) of at most batch_size units and, if set, batch_tokens KV slots."""
    batches, cur = [], []
    for u in sorted(units, key=lambda u: u.est_tokens(max_new)):
        full = len(cur) == batch_size or (batch_tokens and (len(cur) + 1) * u.est_tokens(max_new) > batch_tokens)
        if cur and full:
            batches.append(cur)
            cur = []
        cur.append(u)
    return batches + ([cur] if cur else [])


def turn_context(u: Unit, turn: int, eos: set[int], max_ctx: int, stats: Stats) -> list[int] | None:
    """The context of ``u``'s turn ``turn`` (its sequence so far plus the template up to the reply), or None when
    the conversation ends there: no such turn, or a later turn whose context would exceed ``max_ctx``."""
    if turn >= u.n_turns:
        return None
    ctx = u.seq + (u.layout.segments[0] if turn == 0 else u.layout.glue(turn, u.turns[-1].tokens, eos))
    if turn and len(ctx) > max_ctx:
        stats.turns_dropped_too_long += 1
        u.n_turns = turn
        return None
    return ctx


def add_turn(u: Unit, ctx: list[int], g: Generated) -> None:
    u.mask += [0] * (len(ctx) - len(u.seq)) + [1] * len(g.tokens)
    u.seq = ctx + g.tokens
    u.turns.append(g)


def run_turns(units: list[Unit], write_turn, eos: set[int], max_ctx: int, stats: Stats) -> None:
    """Produce every unit's conversation turn by turn. ``write_turn(contexts, units, turn)`` returns one
    Generated per context. A later turn whose context would exceed ``max_ctx`` ends that conversation."""
    for turn in range(max(u.n_turns for u in units)):
        active, contexts = [], []
        for u in units:
            ctx = turn_context(u, turn, eos, max_ctx, stats)
            if ctx is not None:
                active.append(u)
                contexts.append(ctx)
        if not active:
            break
        for u, ctx, g in zip(active, contexts, write_turn(contexts, active, turn)):
            add_turn(u, ctx, g)


def run_refill(units: list[Unit], gen: Refill, eos: set[int], max_ctx: int, stats: Stats, on_unit) -> None:
    """``run_turns`` on a ``Refill`` generator: a unit's next turn is queued the moment its previous one ends (no
    wait for the other conversations' turns); ``on_unit(u)``, if given, once its conversation is complete."""
    contexts: dict[int, list[int]] = {}

    def start(i: int) -> None:
        u = units[i]
        ctx = turn_context(u, len(u.turns), eos, max_ctx, stats)
        if ctx is None:
            if on_unit is not None:
                on_unit(u)
        else:
            contexts[i] = ctx
            gen.add(i, ctx, u.gen)

    def done(i: int, g: Generated) -> None:
        add_turn(units[i], contexts.pop(i), g)
        start(i)

    for i in range(len(units)):
        start(i)
    gen.run(done)


class Producer:
    """Holds the models and settings of one generate run and turns a shard's units into records."""

    def __init__(self, recipe, device: str):
        dc = self.dc = recipe.data
        dtype = resolve_dtype(recipe.target.dtype, device)
        self.device, self.seed = device, recipe.seed
        t = recipe.target
        self.tgt = load_model(t.model, dtype, device, t.trust_remote_code, t.revision, backend=t.backend)
        self.trust_remote_code = t.trust_remote_code
        self.eos = stop_ids(self.tgt.path, self.tgt.tokenizer)
        self.tok_hash = tokenizer_hash(self.tgt.tokenizer)
        self.sampling = Sampling(dc.temperature, dc.top_k, dc.top_p)
        n = self.tgt.model.cfg.n_layers
        layers = dc.signals.hidden_layers
        aux = default_aux_layers(n) if layers == "eagle3" else tuple(layers or ())
        for i in aux:
            if not 0 <= i < n:
                raise DraftsmithError(f"data.signals.hidden_layers: layer {i} is outside the target's {n} layers")
        self.capture = Capture(dc.signals.topk, dc.signals.hidden_last, aux)
        self.drafter = self._drafter(dc.on_policy, "data.on_policy.checkpoint", dtype, writer=True)
        self.labeller = self._drafter(dc.specdec_labels, "data.specdec_labels.checkpoint", dtype)
        lc = dc.specdec_labels
        self.label_sampling = Sampling(lc.temperature, lc.top_k, lc.top_p) if lc else None
        self._vllm = None
        self.meter = self._meter(dtype) if dc.backend == "native" else None  # before packing: counted matmuls
        if dc.optimize:  # inference only from here on: fused, pre-packed matmuls
            # (benchmarks/journal/2026-11-24-quickstart-avx2-host.md)
            for m in (self.tgt.model, self.drafter, self.labeller):
                if m is not None and hasattr(m, "optimize_for_inference"):
                    m.optimize_for_inference()

    def close(self) -> None:
        if self._vllm is not None:  # its engine, memory and process group
            self._vllm.close()
            self._vllm = None

    @torch.no_grad()
    def _meter(self, dtype) -> Meter | None:
        """The target's FLOPs per generated token, for the log's tflops and mfu: one counted forward over
        ``max_prompt_tokens + max_new_tokens`` tokens (at most 1024), whose mean attention context is a decode
        step's at mid-answer. None where counting fails."""
        n = min(1024, self.dc.max_prompt_tokens + self.dc.max_new_tokens)
        try:
            ids = torch.zeros(1, n, dtype=torch.long, device=self.device)
            flops, _ = count_flops(self.tgt.model, ids)
            return Meter(flops / n, *peak_flops(self.device, dtype))
        except Exception as e:  # pragma: no cover - a model or device the counter does not handle
            log.warning("generate: no MFU in the logs (%s)", e)
            return None

    def _drafter(self, section, key: str, dtype, writer: bool = False):
        """The drafter that writes on-policy responses (``writer``) or labels SpecDec++ tokens. A standalone
        draft LM writes in the batched generator. A drafter that reads the target's states (heads, EAGLE) writes
        in ``write_batch``, with the target one step behind supplying those states."""
        if section is None:
            return None
        model, info = load_drafter(Path(section.checkpoint), dtype=dtype, device=self.device)
        if not drafter_spec(info["kind"]).causal_lm and not (writer and reads_target(model)):
            what = "write sequences" if writer else "label sequences on its own"
            raise DraftsmithError(f"{key}: {section.checkpoint} is a {info.get('kind')!r} drafter, which cannot {what}")
        if getattr(model, "target_adapter", None) is not None:
            raise DraftsmithError(
                f"{key}: {section.checkpoint} is a Medusa-2 drafter: its heads read the states of "
                f"its adapted target, not of {self.tgt.name!r}"
            )
        if (
            info.get("tokenizer_hash", self.tok_hash) != self.tok_hash
            or model.cfg.vocab_size != self.tgt.model.cfg.vocab_size
        ):
            raise DraftsmithError(
                f"{key}: {section.checkpoint} was trained with a different tokenizer than target {self.tgt.name!r}"
            )
        return model

    def shard_records(self, units: list[Unit], stats: Stats, on_batch) -> list[Record]:
        dc = self.dc
        wants_signals = bool(self.capture.topk or self.capture.hidden or self.labeller is not None)
        for u in units:
            u.gen = row_generator(self.device, self.seed, u.prompt_index, u.sample_index)
        for source in ("target", "drafter", "dataset"):
            group = [u for u in units if u.source == source]
            scored = (source != "target" or self._vllm_scores()) and wants_signals
            batches = pack(group, dc.batch_size, dc.batch_tokens, dc.max_new_tokens)
            refill = bool(group) and self._refill_model(source) is not None
            if refill:  # every conversation of the group through one refilling generator
                self._refill(group, source, stats, None if scored else lambda u: on_batch([u]))
            for batch in batches:
                if not refill:
                    run_turns(batch, self._writer(source), self.eos, dc.max_prompt_tokens, stats)
                if scored:
                    self._score(batch)
                if scored or not refill:
                    on_batch(batch)
        return [self._record(u) for u in sorted(units, key=lambda u: (u.prompt_index, u.sample_index))]

    def _vllm_scores(self) -> bool:
        """vLLM wrote the target's responses and some signal must come from draftsmith's model."""
        if self.dc.backend != "vllm":
            return False
        own_topk = bool(self.capture.topk) and not self.dc.vllm_topk
        return own_topk or self.capture.hidden or self.labeller is not None

    def _refill_model(self, source: str):
        """The model that writes ``source``'s responses with continuous refill (data.refill), or None for the
        fixed-batch path: a vLLM target, dataset replies, a drafter that reads the target's states (it writes in
        ``write_batch``) and a transformers-path target whose attention takes no 4-D mask keep it."""
        if not self.dc.refill:
            return None
        if source == "target" and self.dc.backend == "native":
            model = self.tgt.model
        elif source == "drafter" and not reads_target(self.drafter):
            model = self.drafter
        else:
            return None
        return model if Refill.supports(model) else None

    def _refill(self, group: list[Unit], source: str, stats: Stats, on_unit) -> None:
        dc = self.dc
        longest = max(u.est_tokens(dc.max_new_tokens) for u in group)  # bounds every context + its response
        rows = dc.batch_size if dc.batch_tokens is None else max(1, min(dc.batch_size, dc.batch_tokens // longest))
        target = source == "target"
        gen = Refill(
            self._refill_model(source),
            rows,
            dc.max_new_tokens,
            self.eos,
            self.sampling,
            self.capture if target else Capture(),
            self.labeller if target else None,
            self.label_sampling,
            max_len=2 * (min(longest, dc.max_prompt_tokens + dc.max_new_tokens) + 1),
            static=dc.cuda_graphs and torch.device(self.device).type == "cuda",  # graphs stay off on CPU
            min_join=dc.refill_join or (max(1, rows // 16) if torch.device(self.device).type == "cuda" else 1),
        )
        order = sorted(group, key=lambda u: u.est_tokens(dc.max_new_tokens))  # similar lengths prefill together
        run_refill(order, gen, self.eos, dc.max_prompt_tokens, stats, on_unit)

    def _writer(self, source: str):
        dc = self.dc

        def target(contexts, units, turn):
            return decode_batch(
                self.tgt.model,
                contexts,
                dc.max_new_tokens,
                self.eos,
                self.sampling,
                [u.gen for u in units],
                self.capture,
                self.labeller,
                self.label_sampling,
            )

        def drafter(contexts, units, turn):
            if not reads_target(self.drafter):
                return decode_batch(
                    self.drafter, contexts, dc.max_new_tokens, self.eos, self.sampling, [u.gen for u in units]
                )
            return write_batch(
                self.tgt.model,
                self.drafter,
                contexts,
                dc.max_new_tokens,
                self.eos,
                self.sampling,
                [u.gen for u in units],
            )

        def dataset(contexts, units, turn):
            return [Generated(u.layout.responses[turn][: dc.max_new_tokens]) for u in units]

        def vllm(contexts, units, turn):
            from draftsmith.data.backends import vllm_generate

            return vllm_generate(self, contexts, [(self.seed, u.prompt_index, u.sample_index, turn) for u in units])

        if source == "target" and dc.backend == "vllm":
            return vllm
        return {"target": target, "drafter": drafter, "dataset": dataset}[source]

    def _score(self, units: list[Unit]) -> None:
        """Teacher signals for responses the target did not write during capture: one forward per batch."""
        keep = self.dc.backend == "vllm" and self.dc.vllm_topk and units[0].source == "target"  # vLLM's top-k
        scored = score_batch(
            self.tgt.model,
            [u.seq for u in units],
            [u.mask for u in units],
            replace(self.capture, topk=0) if keep else self.capture,
            self.labeller,
            self.label_sampling,
            [u.gen for u in units],
        )
        for u, g in zip(units, scored):
            own = {k: torch.cat([t.loss_signals[k] for t in u.turns]) for k in u.turns[0].loss_signals} if keep else {}
            u.turns = [Generated([t for turn in u.turns for t in turn.tokens], {**g.loss_signals, **own}, g.hidden)]

    def _record(self, u: Unit) -> Record:
        signals = {k: torch.cat([g.loss_signals[k] for g in u.turns]) for k in u.turns[0].loss_signals}
        if "topk_logprobs" in signals:
            signals["topk_logprobs"] = signals["topk_logprobs"].to(_DTYPES[self.dc.signals.topk_dtype])
        if "spec_accept" in signals:
            signals["spec_accept"] = signals["spec_accept"].float()
        for name, h in u.turns[-1].hidden.items():  # the last turn's pass saw the whole sequence
            if self.dc.signals.hidden_dtype == "float8":
                signals[name], signals[name + "_scale"] = quantize_fp8(h)
            else:
                signals[name] = h.to(_DTYPES[self.dc.signals.hidden_dtype])
        return Record(u.seq, u.mask, u.prompt_index, u.sample_index, SOURCES[u.source], signals)


def generate(recipe) -> Path:
    """Run the data stage; returns the data folder (with manifest.json)."""
    dc, out = recipe.data, recipe.run_dir / "data"
    rank, world, local_rank = init_distributed()
    device = resolve_device(recipe.target.device)
    if device == "cuda" and world > 1:
        device = f"cuda:{local_rank}"
    prod = Producer(recipe, device)  # the target and the prompts load first: a bad input changes nothing on disk
    prompts = prompts_from(dc.prompts, dc.prompts.n, text_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        for stale in out.glob("*.tmp*"):  # left by a killed run; never read
            stale.unlink()
        # Written again last: a kill while a dataset grows must not leave the smaller run's manifest looking complete.
        (out / "manifest.json").unlink(missing_ok=True)
        save_recipe(recipe)
    barrier()
    dhash, legacy_hash = data_hash(recipe), data_hash(recipe, with_n=True)
    meta = {
        "data_hash": dhash,
        "target": recipe.target.model,
        "target_path": prod.tgt.backend,  # own | transformers: which code computed the target's signals
        "tokenizer_hash": prod.tok_hash,
    }
    starts = range(0, len(prompts), dc.shard_size)
    mine = [si for si in range(len(starts)) if si % world == rank]
    total = sum(min(dc.shard_size, len(prompts) - starts[si]) for si in mine)
    progress = _Progress(recipe, prod, rank, world, total)
    # write_shard is looked up at each call (tests replace it); shards are written while the next ones generate
    writer = ShardWriter(lambda *a: write_shard(*a), dc.write_queue, progress.written)
    try:
        for si in mine:
            path, start = out / shard_name(si), starts[si]
            shard_prompts = prompts[start : start + dc.shard_size]
            span = f"{start}:{start + len(shard_prompts)}"
            if shard_done(path, dhash, span, legacy_hash):
                progress.bar.update(len(shard_prompts))
                continue
            stats = Stats()
            units = plan_units(shard_prompts, start, prod.tgt.tokenizer, prod.eos, dc, recipe.seed, stats)
            progress.bar.update(len(shard_prompts) - sum(u.share for u in units))  # unusable prompts: done at once
            records = prod.shard_records(units, stats, progress.on_batch) if units else []
            counts = {**asdict(stats), **{s: sum(u.source == s for u in units) for s in SOURCES}}
            writer.submit(path, records, {**meta, "prompt_span": span}, counts)
    except BaseException:
        progress.bar.close()  # an error message starts on a line of its own
        writer.abort()
        prod.close()
        raise
    progress.bar.close()
    writer.close()
    prod.close()
    barrier()
    if rank == 0:
        _finish(recipe, out, meta, prod, len(starts), len(prompts), progress)
    barrier()
    return out


class _Progress:
    """The data stage's progress bar (prompts, new tokens/s) and its metrics rows, one per written shard."""

    def __init__(self, recipe, prod: Producer, rank: int, world: int, total: int):
        self.prod, self.rank = prod, rank
        self.runlog = RunLog(recipe.run_dir, "generate", enabled=rank == 0)
        desc = f"generate[{rank}]" if world > 1 else "generate"
        self.bar = tqdm(total=total, unit="prompt", desc=desc, dynamic_ncols=True)
        self.t0 = time.perf_counter()
        self.new_tokens, self.last = 0, {"t": self.t0, "tokens": 0}

    def on_batch(self, batch: list[Unit]) -> None:
        self.new_tokens += sum(sum(u.mask) for u in batch)
        bar = self.bar
        bar.update(min(sum(u.share for u in batch), bar.total - bar.n))  # shares of 1/k may round past the total
        bar.set_postfix(tok_s=f"{self.new_tokens / (time.perf_counter() - self.t0):.0f}")

    def written(self, path: Path, entry: dict) -> None:  # in the writer thread, after each shard
        now, done, last, meter = time.perf_counter(), self.new_tokens, self.last, self.prod.meter
        rate = (done - last["tokens"]) / max(1e-9, now - last["t"])  # since the previous row: this window's pace
        last.update(t=now, tokens=done)
        util = {} if meter is None else {"tflops": meter.tflops(rate), "mfu": meter.mfu(rate)}
        self.runlog.log(
            {
                "shard": int(path.name.split("-")[1].split(".")[0]),
                "rank": self.rank,
                "target_path": self.prod.tgt.backend,
                "sequences": entry["n_sequences"],
                "new_tokens": done,
                "tokens_per_s": round(done / (now - self.t0), 1),
                "window_tokens_per_s": round(rate, 1),
                **significant(util),
            }
        )


def _finish(recipe, out: Path, meta: dict, prod: Producer, n_shards: int, n_prompts: int, progress: _Progress):
    """Rank 0, after every rank wrote its shards: the manifest (none when no prompt was usable), the last metrics
    row and the summary line."""
    entries = [shard_entry(out / shard_name(i)) for i in range(n_shards)]
    manifest = _manifest(recipe, meta, prod, entries, n_prompts)
    c = manifest["prompts"]
    if manifest["n_sequences"] == 0:
        raise DraftsmithError(
            f"data.prompts: none of the {n_prompts} prompts is usable "
            f"({c['skipped_too_long']} longer than data.max_prompt_tokens, "
            f"{c['skipped_no_response']} without a reply to keep)"
        )
    write_manifest(out, manifest)
    dt = time.perf_counter() - progress.t0
    progress.runlog.log(
        {
            "done": True,
            "target_path": prod.tgt.backend,
            "n_sequences": manifest["n_sequences"],
            "n_loss_tokens": manifest["n_loss_tokens"],
            "seconds": round(dt, 1),
            "bytes_per_token": manifest["bytes_per_token"]["per_token"],
        }
    )
    print(
        f"generate: {manifest['n_sequences']} sequences ({manifest['n_loss_tokens']} response tokens) from "
        f"{n_prompts} prompts in {dt:.0f}s; skipped {c['skipped_too_long']} too long, "
        f"{c['skipped_no_response']} without a reply; "
        f"{manifest['bytes_per_token']['file_per_loss_token']} bytes/response token "
        f"({prod.tgt.backend} target path) -> {out}"
    )


def _manifest(recipe, meta: dict, prod: Producer, entries: list[dict], n_prompts: int) -> dict:
    dc, cap = recipe.data, prod.capture
    signals = {}
    if cap.topk:
        signals["topk"] = {
            "k": cap.topk,
            "dtype": dc.signals.topk_dtype,
            "axis": "loss",
            "tail": "1 - sum(exp(topk_logprobs))",
        }
    hidden = {"dtype": dc.signals.hidden_dtype, "dim": prod.tgt.model.cfg.dim, "axis": "token"}
    if cap.hidden_last:
        signals["hidden_last"] = {**hidden, "layer": "final_norm"}
    if cap.aux_layers:
        signals["hidden_aux"] = {**hidden, "layers": list(cap.aux_layers)}
    if dc.specdec_labels:
        signals["specdec"] = {"axis": "loss", **dc.specdec_labels.model_dump()}
    # Every count comes from the shards' own entries: exact after a resume and across ranks.
    return {
        "format": FORMAT,
        **meta,
        "recipe": recipe.name,
        "responses": dc.responses,
        "n_sequences": sum(e["n_sequences"] for e in entries),
        "n_tokens": sum(e["n_tokens"] for e in entries),
        "n_loss_tokens": sum(e["n_loss_tokens"] for e in entries),
        "prompts": {"loaded": n_prompts, **{k: sum(e["counts"][k] for e in entries) for k in asdict(Stats())}},
        "sequences_by_writer": {s: sum(e["counts"][s] for e in entries) for s in SOURCES},
        "sampling": {"temperature": dc.temperature, "top_k": dc.top_k, "top_p": dc.top_p, "n_samples": dc.n_samples},
        "on_policy": dc.on_policy.model_dump() if dc.on_policy else None,
        "signals": signals,
        "bytes_per_token": bytes_per_token(entries),
        "shards": entries,
    }
