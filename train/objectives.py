"""Objectives: (model, batch, loss config, context) -> StepOutput(loss sum, metrics), one per drafter kind.

The train loop is shared; only this function differs between drafters. Each kind's spec names its objective
(models/spec.py ``DrafterSpec.objective``; ``objective_for`` resolves it). Objectives return the loss *summed* over
trained positions plus the count, so the loop can normalise by the global token count of the optimizer step
(exact under gradient accumulation and data parallelism, whatever the per-rank token counts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel

from draftsmith.errors import DraftsmithError
from draftsmith.models.acceptance import N_EXTRA, acceptance_features
from draftsmith.models.glide import key_order, lagged, target_kv
from draftsmith.models.registry import DRAFTERS, drafter_spec
from draftsmith.models.spec import dotted
from draftsmith.train import losses


@dataclass
class StepOutput:
    loss_sum: torch.Tensor
    n: int
    metrics: dict = field(default_factory=dict)  # name -> float, or a device tensor the host has not read yet

    def host_metrics(self) -> dict:
        """The metrics as host numbers (a vector one as a list): for callers outside the train loop, which reads
        its steps' metrics a logging window at a time."""
        out = {}
        for k, v in self.metrics.items():
            if isinstance(v, torch.Tensor):
                v = v.detach().cpu()
                v = v.tolist() if v.dim() else float(v)
            out[k] = v
        return out


@dataclass
class Context:
    """What an objective may need besides its model and batch."""

    unwrapped: torch.nn.Module  # the drafter without DDP/FSDP wrappers (its config and vocabulary maps)
    target: torch.nn.Module | None = None  # frozen target, for loss.teacher = target
    generator: torch.Generator | None = None  # sampling inside losses (TVD++), checkpointed with the run
    params: BaseModel | None = None  # the recipe's drafter section (the kind's typed config, models/spec.py)
    seed: int = 0  # the recipe's seed and ...
    step: int = 0  # ... the optimizer step being taken (the loop sets it): draws that must not depend on the rank
    host_cache: dict = field(default_factory=dict)  # host copies of the drafter's small maps (``_host_map``)

    def __post_init__(self):
        if isinstance(self.params, dict):
            raise TypeError(
                "Context.params is the drafter's typed section (e.g. EagleDrafterConfig(...)), not a "
                "dict: build it with draftsmith.models.registry.drafter_spec(kind).section(fields)"
            )


def objective_for(kind: str) -> Callable:
    """The training objective of ``kind``: its spec's function, imported when the spec names it as a string."""
    return dotted(drafter_spec(kind).objective)


def check_packing(kind: str) -> None:
    """train.packing: refuse, in one line, a kind whose objective has no packed layout (``DrafterSpec.packs``)."""
    if not drafter_spec(kind).packs:
        raise DraftsmithError(
            f"train.packing: drafter.kind={kind} trains on one record per row (its objective has no packed "
            f"layout); set train.packing=false"
        )


def host_batch(batch: dict) -> dict:
    """The host's copy of a batch the train loop moved to the device (``batch["host"]``), or the batch itself.
    Bookkeeping that only reads the records (which positions train, row and document layout) runs on it, in
    NumPy (``_np``), so the host never waits for the device to read them back."""
    return batch.get("host", batch)


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    """A host tensor as a NumPy array (no copy); a device one is copied (callers outside the train loop)."""
    return None if t is None else (t if t.device.type == "cpu" else t.cpu()).numpy()


def trained_index(batch: dict) -> torch.Tensor:
    """Flat indices b * T + t of the batch's predicting positions, row-major (the labels' order), found on the
    host copy and moved to the batch's device."""
    at = np.flatnonzero(_np(host_batch(batch)["predict_mask"]))
    return torch.from_numpy(at).to(batch["predict_mask"].device, non_blocking=True)


def _host_map(ctx: Context | None, t2d: torch.Tensor) -> np.ndarray:
    """A host copy of a drafter's target -> draft vocabulary map, made once per run."""
    cache = ctx.host_cache if ctx is not None else {}
    key = ("t2d", id(t2d))
    if key not in cache:
        cache[key] = _np(t2d)
    return cache[key]


def doc_mask(batch: dict) -> torch.Tensor | None:
    """A packed batch's attention mask (B, T, T) bool, causal inside each document (data/dataset.py
    ``collate_packed``: ``doc``), or None for a padded batch (plain causal attention). Padding sees only itself and
    earlier padding, so no softmax row is empty.

    This dense mask costs B x T x T bytes and SDPA still computes the blocks it masks. On GPU the same layout is
    what FlexAttention's block mask (a document mask_mod over ``doc``) or a varlen kernel (cu_seqlens from the
    documents' lengths) takes, skipping the cross-document blocks; neither is built here."""
    doc = batch.get("doc")
    if doc is None:
        return None
    T = doc.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
    return (doc[:, :, None] == doc[:, None, :]) & causal


def packed_kw(batch: dict) -> dict:
    """Keyword arguments that give a forward a packed batch's layout (per-document positions and mask); none for a
    padded batch. Every forward that mixes positions (the target in the loop, draft LMs, EAGLE's layer, Hydra++'s
    prefix layer, Medusa-2's adapted target) takes them."""
    return {} if "doc" not in batch else {"pos": batch["pos"], "attn_mask": doc_mask(batch)}


def _features_dtype(ctx: Context) -> torch.dtype:
    """Features enter the drafter in float32 (stored ones are often bf16), or float64 for a float64 drafter (the
    exactness tests)."""
    p = next(ctx.unwrapped.parameters(), None)
    return torch.float64 if p is not None and p.dtype == torch.float64 else torch.float32


def _spec(cfg) -> losses.LossSpec:
    return losses.LossSpec(
        kind=cfg.kind,
        beta=cfg.beta,
        kl_scale=cfg.kl_scale,
        kl_decay=cfg.kl_decay,
        chunk=cfg.chunk,
        fused=cfg.fused,
        vocab_chunk=cfg.vocab_chunk,
        teacher_temperature=cfg.teacher_temperature,
        hod_weight=cfg.hod_weight,
        hod_k=cfg.hod_k,
    )


def _metrics(h, head, teacher: losses.Teacher, cfg, ranks: int = 0) -> dict:
    return losses.head_metrics(h.detach(), head.detach(), teacher, cfg.chunk, ranks, cfg.vocab_chunk)


def draft_lm_teacher(batch: dict, cfg, ctx: Context) -> losses.Teacher:
    """Labels and teacher distribution at the trained positions, mapped into the draft's head vocabulary (t2d:
    (V_target,) draft index or -1, for a reduced draft vocabulary)."""
    return records_teacher(batch, cfg, ctx, getattr(ctx.unwrapped, "t2d", None))  # t2d: reduced vocabularies only


def records_teacher(batch: dict, cfg, ctx: Context, t2d: torch.Tensor | None) -> losses.Teacher:
    """Labels and teacher distribution at the trained positions, in the vocabulary ``t2d`` maps target ids into
    (None: the target's own, e.g. for a model with the full LM head)."""
    labels = batch["labels"] if t2d is None else t2d[batch["labels"]]
    teacher = losses.Teacher(labels=labels)
    if cfg.kind == "ce" and "topk_ids" not in batch and not cfg.hod_weight:
        return teacher  # labels are all CE needs; stored top-k, when present, still feeds the alpha metric
    if cfg.teacher == "target":
        if ctx.target is None:
            raise DraftsmithError("train.loss.teacher=target needs the target loaded in the loop")
        with torch.no_grad():
            h = ctx.target(batch["input_ids"], logits_at=batch["predict_mask"], return_hidden=True, **packed_kw(batch))
        if t2d is not None:  # teacher restricted to the draft vocabulary, un-renormalised tail via top-k form
            raise DraftsmithError(
                "train.loss.teacher=target with drafter.draft_vocab is not supported: use teacher=records"
            )
        return target_teacher(teacher, h, ctx)
    if "topk_ids" not in batch:  # (plain ce returned above)
        what = "train.loss.hod_weight" if cfg.kind == "ce" else f"train.loss.kind={cfg.kind}"
        raise DraftsmithError(
            f"{what} needs teacher top-k log-probs: set data.signals.topk > 0 and regenerate, or use "
            f"train.loss.teacher=target"
        )
    ids = batch["topk_ids"]
    teacher.topk_ids = ids if t2d is None else t2d[ids]
    teacher.topk_logprobs = batch["topk_logprobs"]
    return teacher


def target_teacher(t: losses.Teacher, hidden: torch.Tensor, ctx: Context, head=None) -> losses.Teacher:
    """``t`` with the target's distribution at ``hidden`` (N, D), its final normed states: hidden + the head's
    weight (logits made chunk by chunk), or, for a head that soft-caps or scales after the linear map (a
    transformers-path target, models/hf_target.py ``LogitHead``), the full logits. ``head``: the kept rows of a
    reduced draft vocabulary."""
    lm = ctx.target.lm_head
    if getattr(lm, "plain", True):
        t.hidden, t.head = hidden, lm.weight if head is None else head
    elif head is None:
        with torch.no_grad():
            t.logits = lm(hidden)
    else:
        raise DraftsmithError(
            "train.loss.teacher=target with drafter.draft_vocab: this target soft-caps or scales its logits; "
            "use train.loss.teacher=records"
        )
    return t


def draft_lm_objective(model, batch: dict, cfg, ctx: Context) -> StepOutput:
    """Standalone draft LM: final hidden states only where a target token is predicted; the LM head and loss
    run chunked in train/losses.py. With a reduced vocabulary, positions whose label is outside it still count
    for the divergence (their teacher mass sits in the tail) but not for CE."""
    teacher = draft_lm_teacher(batch, cfg, ctx)
    reduced = getattr(ctx.unwrapped, "t2d", None) is not None

    def head_fn(h, head):  # runs inside the drafter's forward (see Llama.forward head_fn)
        t = teacher
        if cfg.kind == "ce" and reduced:  # labels outside the draft vocabulary cannot be CE targets
            keep = t.labels >= 0
            h, t = (
                h[keep],
                losses.Teacher(
                    labels=t.labels[keep],
                    topk_ids=None if t.topk_ids is None else t.topk_ids[keep],
                    topk_logprobs=None if t.topk_logprobs is None else t.topk_logprobs[keep],
                ),
            )
        loss = losses.head_loss(h, head, t, _spec(cfg), ctx.generator) * h.shape[0]
        return loss, h.shape[0], _metrics(h, head, t, cfg)

    loss, n, m = model(batch["input_ids"], logits_at=trained_index(batch), head_fn=head_fn, **packed_kw(batch))
    return StepOutput(loss, n, m)


def glide_objective(model, batch: dict, cfg, ctx: Context) -> StepOutput:
    """GliDe (models/glide.py): the draft LM objective once per lag s = 1..lags, the cross-attention reading the
    target's keys up to s positions before each query (``lagged``), as draft depth s - 1 reads them when decoding.
    The loss is the mean over the lags; metrics per lag as per draft step (``top1_step{s-1}``)."""
    if ctx.target is None:
        raise DraftsmithError("drafter.kind=glide reads the target's KV cache: the target must run in the loop")
    m = ctx.unwrapped
    teacher, at, spec = draft_lm_teacher(batch, cfg, ctx), trained_index(batch), _spec(cfg)
    k, v = target_kv(ctx.target, batch["input_ids"], m.cfg.cache_layer)
    order = key_order(ctx.target)

    def head_fn(h, head):
        return (
            losses.head_loss(h, head, teacher, spec, ctx.generator) * h.shape[0],
            h.shape[0],
            _metrics(h, head, teacher, cfg),
        )

    outs = [model(batch["input_ids"], logits_at=at, head_fn=head_fn, glimpse=lagged(k, v, s, order))
            for s in range(1, m.cfg.lags + 1)]  # fmt: skip
    loss = sum(o[0] for o in outs) / len(outs)
    return StepOutput(loss, outs[0][1], _per_step_metrics(outs, "step"))


def _take(t: losses.Teacher, idx: torch.Tensor) -> losses.Teacher:
    """The teacher at some of its positions (a bool mask or row indices); the LM head is shared."""
    f = {n: getattr(t, n) for n in ("labels", "topk_ids", "topk_logprobs", "logits", "hidden")}
    return losses.Teacher(**{n: None if v is None else v[idx] for n, v in f.items()}, head=t.head)


def _row_generators(batch: dict, ctx: Context) -> list:
    """One generator per row, seeded by (recipe seed, step, the row's tokens): a record's random draws are the same
    whichever process or micro-batch it lands in, so data-parallel training equals one process. A packed batch:
    one list per row, a generator per document, each seeded as that record alone in a padded row."""
    import zlib

    src = host_batch(batch)
    ids = src["input_ids"].cpu()
    real = src.get("attention_mask", torch.ones_like(ids)).cpu().bool()  # padding depends on the neighbours
    base = (ctx.seed * 1_000_003 + ctx.step) % (1 << 31)
    dev = batch["input_ids"].device

    def gen(tokens: torch.Tensor) -> torch.Generator:
        return torch.Generator(device=dev).manual_seed((base << 32) | zlib.crc32(tokens.numpy().tobytes()))

    if "doc" in batch:
        doc = src["doc"].cpu()
        return [[gen(row[d == j]) for j in range(int(d.max()) + 1)] for row, d in zip(ids, doc)]
    return [gen(row[m]) for row, m in zip(ids, real)]


def pard_objective(model, batch: dict, cfg, ctx: Context) -> StepOutput:
    """PARD: the records' sequences with COD mask segments added (models/pard.py ``cod_layout``); every trained
    position, plain or mask, is scored like a draft LM's against the teacher's distribution for the token it
    predicts (its predict_mask row), all with the same weight. The loss is summed over them, so a step weighs
    every distance's positions (about 2.5x the response tokens at the default retention). Metrics per distance
    (``top1_draft{j}``: draft j+1; ``acc_draft{j}_rank{r}``, what ``draftsmith tree`` builds static trees from) and
    the chain tau they imply."""
    from draftsmith.models.pard import cod_layout

    m, p = ctx.unwrapped, ctx.params
    retain, retain_min = (p.cod_retain, p.cod_retain_min) if p is not None else (0.7, 0.2)
    lay = cod_layout(
        batch["input_ids"],
        batch["predict_mask"],
        m.cfg.pard_k,
        m.cfg.mask_id,
        retain,
        retain_min,
        _row_generators(batch, ctx),
        batch.get("doc"),
        batch.get("pos"),
    )
    teacher, dist, keep = _take(draft_lm_teacher(batch, cfg, ctx), lay.rows), lay.dist, None
    if cfg.kind == "ce" and getattr(m, "t2d", None) is not None:  # labels outside the draft vocabulary: no CE
        keep = teacher.labels >= 0
        teacher, dist = _take(teacher, keep), dist[keep]
    counts = [(j, int((dist == j).sum())) for j in range(1, m.cfg.pard_k + 1)]

    def head_fn(h, head):  # inside the drafter's forward (Llama.forward head_fn)
        h = h if keep is None else h[keep]
        loss = losses.head_loss(h, head, teacher, _spec(cfg), ctx.generator) * h.shape[0]
        sub = [(n, dist == j) for j, n in counts if n]
        return loss, [(None, n, _metrics(h[s], head, _take(teacher, s), cfg, ranks=3)) for n, s in sub]

    loss, outs = model(lay.ids, pos=lay.pos, attn_mask=lay.attn_mask, logits_at=lay.train, head_fn=head_fn)
    metrics = _per_step_metrics(outs, "draft")
    metrics["cod_tokens"] = float(lay.train.sum()) / max(1, outs[0][1])  # trained positions per response token
    return StepOutput(loss, outs[0][1], metrics)


def target_features(batch: dict, ctx: Context) -> torch.Tensor:
    """The target's final hidden states after its norm (B, T, D): stored (data.signals.hidden_last) or computed
    by the frozen target in the loop (both give the same loss; tested)."""
    dtype = _features_dtype(ctx)
    if "hidden_last" in batch:
        return batch["hidden_last"].to(dtype)
    if ctx.target is None:
        raise DraftsmithError(
            "this drafter reads target hidden states: store them (data.signals.hidden_last) "
            "or let the loop run the target"
        )
    with torch.no_grad():
        return ctx.target(batch["input_ids"], return_hidden=True, **packed_kw(batch)).to(dtype)


def shifted_teachers(
    batch: dict, cfg, ctx: Context, n: int, hidden: torch.Tensor | None, t2d=None, head=None, lags=None
):
    """Targets of "head (or TTT step) k at position t predicts token t+k+2", for k < n: trained where both t and
    t+k+1 predict response tokens (and, with ``lags``, where position t - lags[k], whose output step k reads, is
    in t's row and document). Returns (selects [(N_k,) flat index into B*T of each trained t, in row-major
    order], teachers [Teacher], future [(N_k,) flat index of t+k+1]). ``hidden`` (B, T, D): the target's final
    states, for teacher=target. With a reduced draft vocabulary (``t2d``), labels and top-k ids are mapped into
    it, positions whose label it lacks are dropped (EAGLE-3's mask), and a target teacher is restricted to the
    kept rows ``head`` of the target's LM head.

    Which positions train depends on the records only: it is worked out on the host copy (``host_batch``) and
    the indices move to the device, so the step indexes with integers and never waits on a boolean mask."""
    src = host_batch(batch)
    pm, doc, dev = _np(src["predict_mask"]).astype(bool), _np(src.get("doc")), batch["predict_mask"].device
    B, T = pm.shape
    row = np.cumsum(pm.ravel()) - 1  # loss-axis row of each predicting position (flat)
    host_labels = _np(src["labels"]) if t2d is None else _host_map(ctx, t2d)[_np(src["labels"])]
    labels_all = batch["labels"] if t2d is None else t2d[batch["labels"]]
    hidden_flat = None if hidden is None else hidden.reshape(B * T, -1)
    selects, teachers, future = [], [], []
    for k in range(n):
        s = k + 1
        sel = np.zeros_like(pm)
        if s < T:
            sel[:, : T - s] = pm[:, : T - s] & pm[:, s:]
            if doc is not None:  # packed rows: t + s must lie in t's own document
                sel[:, : T - s] &= doc[:, : T - s] == doc[:, s:]
            if t2d is not None:
                sel[:, : T - s] &= host_labels[np.maximum(row.reshape(B, T)[:, s:], 0)] >= 0
        lag = lags[k] if lags else 0
        if lag:  # Falcon: the output step k reads sits lag positions before t
            sel[:, :lag] = False
            if doc is not None:
                sel[:, lag:] &= doc[:, lag:] == doc[:, :-lag]
        at = np.flatnonzero(sel)  # flat index b * T + t of each trained t, row-major
        nxt = at + s  # t + s, in the same row (sel is False in the last s columns)
        rows = row[nxt]
        at, nxt, rows = (torch.from_numpy(x).to(dev, non_blocking=True) for x in (at, nxt, rows))
        t = losses.Teacher(labels=labels_all[rows])
        if cfg.kind != "ce" or cfg.hod_weight:  # HASS's top-k term needs the distribution under CE too
            if cfg.teacher == "target":
                target_teacher(t, hidden_flat[nxt], ctx, head)
            elif "topk_ids" in batch:
                ids = batch["topk_ids"][rows]
                t.topk_ids, t.topk_logprobs = (ids if t2d is None else t2d[ids]), batch["topk_logprobs"][rows]
            else:
                what = "train.loss.hod_weight" if cfg.kind == "ce" else f"train.loss.kind={cfg.kind}"
                raise DraftsmithError(
                    f"{what} needs teacher top-k log-probs (data.signals.topk) or train.loss.teacher=target"
                )
        selects.append(at)
        teachers.append(t)
        future.append(nxt)
    return selects, teachers, future


def _per_step_metrics(outs: list, prefix: str) -> dict:
    """top-1 / alpha / rank accuracies of each head (or TTT step) and the chain tau they imply."""
    m, alphas = {}, []
    for k, (_, _, mk) in enumerate(outs):
        m[f"top1_{prefix}{k}"] = mk["top1"]
        for r, v in enumerate(mk.get("rank_acc", [])):  # eval/tree.py choices_from_run builds a tree from these
            m[f"acc_{prefix}{k}_rank{r}"] = v
        if "alpha" in mk:
            m[f"alpha_{prefix}{k}"] = mk["alpha"]
            alphas.append(mk["alpha"])
    m["top1"] = outs[0][2]["top1"]
    if alphas:
        m["alpha"] = alphas[0]
        # a chain that stops at the first miss: tau = 1 + a0 + a0 a1 + ...
        m["tau_estimate"] = 1 + sum(math.prod(alphas[: j + 1]) for j in range(len(alphas)))
    return m


def heads_objective(model, batch: dict, cfg, ctx: Context) -> StepOutput:
    """Feature heads (Medusa-1, Hydra, MLP speculator): head k at position t predicts token t+k+2, i.e. the token the
    target predicts at position t+k+1 (``shifted_teachers``). Loss = sum_k decay^k * loss_k, any loss kind (CE on
    the target's tokens, or a divergence to the target's distribution at t+k+1). Sequential heads also read the
    true tokens t+1..t+k+1 (teacher forcing)."""
    joint = ctx.unwrapped.base is not None  # Medusa-2: the adapted target runs in forward
    # The original target's states: the heads' input, or (Medusa-2) only a full-distribution teacher.
    h = target_features(batch, ctx) if not joint or cfg.teacher == "target" else None  # (B, T, D)
    t2d, kept = getattr(ctx.unwrapped, "t2d", None), ctx.unwrapped.head_ids  # reduced vocab (None: full)
    kept_head = ctx.target.lm_head.weight[kept] if kept is not None and cfg.teacher == "target" else None
    selects, teachers, _ = shifted_teachers(batch, cfg, ctx, ctx.unwrapped.max_draft_len, h, t2d, kept_head)
    decay = ctx.params.head_decay
    # Medusa-2: L = L_target + heads_coefficient * sum_k decay^k L_k, where L_target keeps the adapted target close
    # to the original (self-distillation: its own records' teacher at every predicted position).
    coef = ctx.params.heads_coefficient if joint else 1.0
    # The adapted target keeps the full LM head: its teacher stays in target ids even when the heads are reduced.
    base_teacher = records_teacher(batch, cfg, ctx, None) if joint else None

    def head_fn(k, x, w):  # inside the heads' forward (see MedusaHeads.forward); k = -1: the adapted target
        t, weight = (base_teacher, 1.0) if k < 0 else (teachers[k], coef * decay**k)
        n = x.shape[0]
        loss = losses.head_loss(x, w, t, _spec(cfg), ctx.generator) * n if n else x.sum() * 0
        return loss * weight, n, _metrics(x, w, t, cfg, ranks=3)

    extra = {"base_select": trained_index(batch)} if joint else {}
    outs = model(h, ids=batch["input_ids"], select=selects, head_fn=head_fn, **extra, **packed_kw(batch))
    m = _per_step_metrics(outs[1:] if joint else outs, "head")
    if joint:  # how far the adapted target drifted from the original (1.0 = the same argmax everywhere)
        m["top1_target"] = outs[0][2]["top1"]
        m.update({"alpha_target": outs[0][2]["alpha"]} if "alpha" in outs[0][2] else {})
    return StepOutput(sum(o[0] for o in outs), outs[1 if joint else 0][1], m)


def eagle_features(batch: dict, ctx: Context) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (f (B, T, F) the drafter's input features, the target's final normed states (B, T, D) or None).
    Stored records (hidden_last for EAGLE-1, hidden_aux for EAGLE-3) or the frozen target in the loop."""
    eagle, dtype = ctx.unwrapped, _features_dtype(ctx)
    if eagle.cfg.version == 1 and "hidden_last" in batch:
        f = batch["hidden_last"].to(dtype)
        return f, f
    if eagle.cfg.version == 3 and "hidden_aux" in batch and ctx.target is None:
        a = batch["hidden_aux"].to(dtype)  # (B, T, A, D) in aux_layers order
        return a.reshape(*a.shape[:2], -1), None
    if ctx.target is None:
        raise DraftsmithError(
            "this EAGLE drafter reads target hidden states: store them (data.signals."
            "hidden_last / hidden_layers) or let the loop run the target"
        )
    with torch.no_grad():
        h, cap = ctx.target(
            batch["input_ids"], capture_layers=eagle.capture_layers, return_hidden=True, **packed_kw(batch)
        )
        return eagle.features(cap, ctx.target).to(dtype), h.to(dtype)


def eagle_objective(model, batch: dict, cfg, ctx: Context) -> StepOutput:
    """EAGLE-1 / EAGLE-3 with training-time test: TTT step s at position t predicts token t+s+2 (the same shift
    as Medusa head s, ``shifted_teachers``), weighted decay^s (the drafter's ``position_weight``; Gumiho's heads
    are positions after the unroll's; Falcon's pass s sits ``output_lag(s)`` positions before its anchor t).
    Token loss of any kind through the drafter's LM head (weight token_loss_weight); EAGLE-1 adds SmoothL1 between
    its output and the target's feature at t+s+1 (weight feature_loss_weight)."""
    eagle, p = ctx.unwrapped, ctx.params
    feats, last = eagle_features(batch, ctx)
    steps = p.ttt_steps or eagle.cfg.ttt_steps
    reduced = eagle.cfg.head_vocab_size is not None
    kept_head = None
    if reduced and cfg.teacher == "target":  # EAGLE-3's p~: target logits restricted to the draft vocabulary
        kept_head = ctx.target.lm_head.weight[eagle.lm_head.target_ids]
    n_pos = getattr(eagle, "draft_positions", lambda n: n)(steps)  # (MTP layers train through this objective too)
    weight = getattr(eagle, "position_weight", lambda s, p: p.head_decay**s)
    lags = [getattr(eagle, "output_lag", lambda s: 0)(s) for s in range(n_pos)]
    selects, teachers, future = shifted_teachers(
        batch, cfg, ctx, n_pos, last, eagle.t2d if reduced else None, kept_head, lags
    )
    w_tok = p.token_loss_weight
    w_feat = getattr(p, "feature_loss_weight", 0.0) if eagle.cfg.version == 1 else 0.0
    target_feats = last.reshape(-1, last.shape[-1]) if w_feat else None
    noise = p.feature_noise
    if noise and model.training:  # EAGLE-1's augmentation: uniform noise on the input features
        u = torch.rand(feats.shape, generator=ctx.generator, device=feats.device)
        feats = feats + noise * (2 * u - 1)

    def head_fn(s, x, w, out):  # inside the drafter's forward (see Eagle.forward)
        n = x.shape[0]
        if not n:
            return x.sum() * 0, 0, _metrics(x, w, teachers[s], cfg, ranks=3)
        loss = losses.head_loss(x, w, teachers[s], _spec(cfg), ctx.generator) * n * w_tok
        if w_feat:
            loss = loss + w_feat * losses.hidden_regression(out, target_feats[future[s]]).sum()
        return loss * weight(s, p), n, _metrics(x, w, teachers[s], cfg, ranks=3)

    kw = {"detach": True} if getattr(p, "ttt_detach", False) else {}  # HASS's context alignment
    if getattr(p, "glance", 0) and model.training:  # Falcon's CSGD: its misses at the trained positions
        kw["glance"] = (p.glance, selects, [t.labels for t in teachers], ctx.generator or torch.Generator())
    outs = model(feats, batch["input_ids"], steps=steps, select=selects, head_fn=head_fn, **packed_kw(batch), **kw)
    return StepOutput(sum(o[0] for o in outs), outs[0][1], _per_step_metrics(outs, "step"))


def dflash_objective(model, batch: dict, cfg, ctx: Context) -> StepOutput:
    """DFlash (models/dflash.py): up to ``anchors`` random blocks per record, each [x_a, mask, ...] over the
    target's fused features of the positions before a (computed by the frozen target in the loop); mask slot j is
    scored like a draft LM's position against the teacher's distribution for token x_{a+j}, weighted
    exp(-(j-1)/decay_gamma). Metrics per slot (``top1_draft{j-1}``: draft j; ``acc_draft{j-1}_rank{r}``, what
    ``draftsmith tree`` builds static trees from) and the chain tau they imply."""
    from draftsmith.models.dflash import anchor_layout

    m, p = ctx.unwrapped, ctx.params
    if ctx.target is None:
        raise DraftsmithError("drafter.kind=dflash reads the target's hidden states: the loop must run the target")
    with torch.no_grad():
        _, cap = ctx.target(batch["input_ids"], capture_layers=m.capture_layers, return_hidden=True)
        feats = m.features(cap, ctx.target).to(_features_dtype(ctx))
    K, gamma = m.cfg.block_size, p.decay_gamma if p is not None else 7.0
    lay = anchor_layout(
        batch["input_ids"], batch["predict_mask"], K, p.anchors if p is not None else 8, m.cfg.mask_id,
        _row_generators(batch, ctx), m.cfg.sliding_window,
    )  # fmt: skip
    teacher = draft_lm_teacher(batch, cfg, ctx)

    def head_fn(j, h, w):  # inside the drafter's forward (DFlash.forward)
        t, n = _take(teacher, lay.rows[j - 1]), h.shape[0]
        if not n:
            return h.sum() * 0, 0, _metrics(h, w, t, cfg, ranks=3)
        weight = 1.0 if gamma is None else math.exp(-(j - 1) / gamma)
        return losses.head_loss(h, w, t, _spec(cfg), ctx.generator) * n * weight, n, _metrics(h, w, t, cfg, ranks=3)

    outs = model(feats, lay.ids, lay.pos, lay.mask, lay.select, head_fn)
    return StepOutput(sum(o[0] for o in outs), outs[0][1], _per_step_metrics(outs, "draft"))


def acceptance_objective(model, batch: dict, cfg, ctx: Context) -> StepOutput:
    """SpecDec++ acceptance head (docs/algorithms.md A7): the frozen draft reads Z, the response with each token
    replaced by the draft's own sample y with probability 1 - mixing_ratio; at every replaced position the head
    predicts the acceptance of y from the draft's state there. Weighted soft-label BCE on s = min(1, p(y)/q(y)):
    w (1 - s) (-log(1 - a)) + s (-log a), w = weight_mismatch on the rejected class.

    A ``before`` head (models/acceptance.py) reads instead the state that produced y, on the target's own text
    (no mixing), with log q(y) and the entropy of q: every labelled token is a training example. Feature heads:
    ``heads_acceptance_inputs`` (before only), with the index of the head that drafted each token."""
    head, p = ctx.unwrapped, ctx.params
    inputs = dotted(DRAFTERS[head.cfg.draft_kind].acceptance["inputs"])  # per drafter kind: its DrafterSpec
    x, s, slot = (*inputs(head.draft, batch, ctx, before=head.cfg.state == "before"), None)[:3]
    logit = model(x, slot)
    w = p.weight_mismatch
    loss = (w * (1 - s) * F.softplus(logit) + s * F.softplus(-logit)).sum()
    a = torch.sigmoid(logit.detach())
    n = len(s)
    m = {  # device tensors: the loop reads them once per logging window
        "accept_label": s.mean() if n else 0.0,
        "accept_pred": a.mean() if n else 0.0,
        "brier": ((a - s) ** 2).mean() if n else 0.0,
        "top1": ((a > 0.5) == (s > 0.5)).float().mean() if n else 0.0,
    }  # agreement on accept vs reject
    if slot is not None:  # each head's own acceptance rate and how well the head tells its drafts apart
        for k in range(head.cfg.n_slots):
            at = slot == k
            if at.any():
                m[f"accept_label_head{k}"] = float(s[at].mean())
                m[f"brier_head{k}"] = float(((a[at] - s[at]) ** 2).mean())
    return StepOutput(loss, n, m)


@torch.no_grad()
def draft_lm_acceptance_inputs(draft, batch: dict, ctx: Context, chunk: int = 512, before: bool = False):
    """Head inputs from the data stage's SpecDec++ labels for a frozen draft LM -> (inputs (N, ·), s (N,)).
    after: the draft reads Z (each response token swapped for its sample y with probability 1 - mixing_ratio)
    and the head reads its state at every swapped token. before: the draft reads the target's text and the head
    reads the state that drafted each labelled token, with log q(y) and the entropy (every label counts)."""
    if "spec_accept" not in batch:
        raise DraftsmithError(
            "the acceptance head trains on SpecDec++ labels: generate with "
            "data.specdec_labels (checkpoint: the same draft LM)"
        )
    pm, ids = batch["predict_mask"], batch["input_ids"]
    y, s = batch["spec_token"].long(), batch["spec_accept"].float()
    label_pos = torch.zeros_like(pm)
    label_pos[:, 1:] = pm[:, :-1]  # where the response tokens sit (row-major order = the labels' order)
    if before:
        producer = torch.zeros_like(pm)
        producer[:, :-1] = label_pos[:, 1:]  # the position whose logits drafted each labelled token, same order
        h = draft(ids, return_hidden=True)[producer]  # (N, D): the frozen draft on the target's text
        x = (
            torch.cat(
                [
                    acceptance_features(h[a : a + chunk], draft.lm_head(h[a : a + chunk]), y[a : a + chunk])
                    for a in range(0, len(h), chunk)
                ]
            )
            if len(h)
            else h.new_zeros(0, h.shape[-1] + N_EXTRA)
        )
        return x, s
    swap = torch.rand(y.shape, generator=ctx.generator, device=y.device) >= ctx.params.mixing_ratio
    z = ids.clone()
    z[label_pos] = torch.where(swap, y, ids[label_pos])
    h = draft(z, return_hidden=True)  # (B, T, D) final normed states of the frozen draft
    return h[label_pos][swap].float(), s[swap]


@torch.no_grad()
def eagle_acceptance_inputs(eagle, batch: dict, ctx: Context, chunk: int = 512, before: bool = False):
    """SpecDec++ labels for an EAGLE drafter, made in the loop -> (head inputs (N, d), s (N,)).

    At every position t whose next two tokens are response tokens, the drafter (teacher-forced on the target's
    features: TTT step 0) drafts y for x_{t+2} from q; the target's distribution there is p at t+1; the label is
    s = min(1, p(y)/q(y)) under ``label_temperature`` (0: y = argmax q and s = [y == argmax p]). The head input is
    the drafter's state after it reads its own y (a TTT step with y as the token), through its ``head_input``:
    the state the chain decoder hands a stop rule after the first draft of a block. ``before``: the state that
    drafted y instead, with log q(y) and the entropy of q (``acceptance_features``): no second TTT step."""
    from draftsmith.data.engine import Sampling, specdec_labels

    if ctx.target is None:
        raise DraftsmithError("an acceptance head on an EAGLE drafter needs the target in the loop")
    if getattr(eagle.cfg, "partial_alignment", False):
        raise DraftsmithError(
            "an acceptance head reads one drafter state, but drafter.partial_alignment (FSPAD) gives the LM head and "
            "the next step different ones: train the head on a drafter without it"
        )
    pm, ids = batch["predict_mask"], batch["input_ids"]
    T = ids.shape[1]
    sel = torch.zeros_like(pm)
    sel[:, : T - 1] = pm[:, : T - 1] & pm[:, 1:]
    h, cap = ctx.target(ids, capture_layers=eagle.capture_layers, return_hidden=True)
    feats = eagle.features(cap, ctx.target).to(eagle.embed_tokens.weight.dtype)
    first = eagle.head_input(eagle(feats, ids, steps=1)[0][sel])  # (N, d): drafts x_{t+2}
    h_next = h[:, 1:][sel[:, : T - 1]]  # (N, D): the target's states at t+1
    sampling = Sampling(temperature=ctx.params.label_temperature)
    ys, ss, xs = [], [], []
    for a in range(0, len(first), chunk):  # (n, V) logits for a chunk of rows at a time
        q = eagle.lm_head(first[a : a + chunk])
        y, s = specdec_labels(
            ctx.target.lm_head(h_next[a : a + chunk]).float(), q.float(), sampling, [ctx.generator] * len(q)
        )
        ys.append(y)
        ss.append(s)
        if before:
            xs.append(acceptance_features(first[a : a + chunk], q, y))
    if before:
        s_all = torch.cat(ss) if ss else first.new_zeros(0)
        return (torch.cat(xs) if xs else first.new_zeros(0, first.shape[-1] + N_EXTRA)).float(), s_all.float()
    y_at = torch.zeros_like(ids)
    y_at[sel] = torch.cat(ys) if ys else y_at[sel]
    second = eagle(feats, ids, steps=2, step_tokens={1: y_at})[1][sel]  # after reading its own draft
    return eagle.head_input(second).float(), (torch.cat(ss) if ss else first.new_zeros(0)).float()


@torch.no_grad()
def heads_acceptance_inputs(
    heads, batch: dict, ctx: Context, chunk: int = 512, positions: bool = False, before: bool = True
):
    """SpecDec++ labels for frozen feature heads (Medusa, Hydra, MLP speculator), made in the loop -> (head inputs
    (N, S + 2), s (N,), slot (N,)), and with ``positions`` the flat index b * T + t of each row's t (where the
    block starts: the target state the heads read) for studies of other features
    (benchmarks/experiments/skip_features.py).

    Head k at position t, teacher-forced on the target's features and the true tokens t+1..t+k+1 (the heads'
    training pass), drafts y for token t+k+2 from q; the target's distribution for that token is p at t+k+1; the
    label is s = min(1, p(y)/q(y)) under ``label_temperature`` (0: y = argmax q, s = [argmax p == y]). Under greedy
    verification draft k + 1 matters only when the drafts before it were accepted, i.e. when they are the target's
    own tokens, so the true-token prefix is the exact conditional the threshold rule multiplies. The input is the
    state head k drafted from (``draft_step``), log q(y) and the entropy of q (``acceptance_features``); slot = k.
    ``before`` is the only state heads have (acceptance heads on heads are built with state=before)."""
    from draftsmith.data.engine import Sampling, specdec_labels

    if ctx.target is None:
        raise DraftsmithError("an acceptance head on feature heads needs the target in the loop")
    pm, ids = batch["predict_mask"], batch["input_ids"]
    B, T = pm.shape
    h = ctx.target(ids, return_hidden=True)  # (B, T, D) final normed states
    flat_h, flat = h.reshape(B * T, -1), torch.arange(B * T, device=pm.device).view(B, T)
    selects, future = [], []
    for k in range(heads.max_draft_len):  # head k is trained where t and t+k+1 both predict response tokens
        s = k + 1
        sel = torch.zeros_like(pm)
        if s < T:
            sel[:, : T - s] = pm[:, : T - s] & pm[:, s:]
        selects.append(sel.flatten())
        future.append(flat[:, s:][sel[:, : T - s]] if s < T else flat.new_empty(0))
    dtype = next(heads.parameters()).dtype
    outs = heads(h.to(dtype), ids, select=selects, head_fn=lambda k, x, w: (x, w))  # states and LM-head weights
    temperature = ctx.params.label_temperature
    sampling, kept = Sampling(temperature=temperature), heads.head_ids  # kept: a reduced vocabulary's target ids
    greedy = None
    if temperature <= 0:  # greedy labels need only the target's argmax, once per position (every head shares them)
        rows = pm.flatten().nonzero()[:, 0]
        greedy = torch.full((B * T,), -1, dtype=torch.long, device=pm.device)
        for a in range(0, len(rows), chunk):
            greedy[rows[a : a + chunk]] = ctx.target.lm_head(flat_h[rows[a : a + chunk]]).argmax(-1)
    xs, ss, slots = [], [], []
    starts = [f - (k + 1) for k, f in enumerate(future)]
    for k, (x, w) in enumerate(outs):
        for a in range(0, len(x), chunk):  # (n, V) logits for a chunk of rows at a time
            xa, at = x[a : a + chunk].float(), future[k][a : a + chunk]
            q = xa @ w.float().T  # the heads' own (maybe reduced) vocabulary: log q(y) and the entropy are the same
            if greedy is not None:
                y = q.argmax(-1)
                s = (greedy[at] == (y if kept is None else kept[y])).float()
                xs.append(acceptance_features(xa, q, y))
            else:  # min(1, p(y)/q(y)) on the full vocabulary (a reduced one leaves -inf rows)
                q = heads.to_target(q, heads.cfg.vocab_size)
                y, s = specdec_labels(ctx.target.lm_head(flat_h[at]).float(), q, sampling, [ctx.generator] * len(q))
                xs.append(acceptance_features(xa, q, y))
            ss.append(s.float())
            slots.append(torch.full_like(y, k))
    if not xs:
        out = flat_h.new_zeros(0, heads.state_dim + N_EXTRA).float(), flat_h.new_zeros(0), pm.new_zeros(0).long()
    else:
        out = torch.cat(xs), torch.cat(ss), torch.cat(slots)
    return (*out, torch.cat(starts)) if positions else out


def judge_objective(model, batch: dict, cfg, ctx: Context) -> StepOutput:
    """Judge head (docs/algorithms.md A8): the frozen target's final state at each what-if draft token (the record's
    only loss position) -> P(acceptable); BCE against the mined label, classes weighted inversely to their
    frequency in the batch when ``balance``."""
    if "judge_label" not in batch:
        raise DraftsmithError("the judge trains on mined labels: generate with data.judge_labels")
    if ctx.target is None:
        raise DraftsmithError("the judge reads the target's states: the loop must run the target")
    pm = batch["predict_mask"]
    at = torch.zeros_like(pm)
    at[:, 1:] = pm[:, :-1]  # the draft token's own position (row-major order = the labels' order)
    with torch.no_grad():
        h = ctx.target(batch["input_ids"], return_hidden=True)[at].float()  # (N, D)
    y = batch["judge_label"].float()
    logit = model(h)
    w = torch.ones_like(y)
    if ctx.params.balance:
        pos, neg = float(y.sum()), float((1 - y).sum())
        if pos and neg:  # each class carries half the batch's weight
            w = torch.where(y > 0.5, len(y) / (2 * pos), len(y) / (2 * neg))
    loss = (w * F.binary_cross_entropy_with_logits(logit, y, reduction="none")).sum()
    a = torch.sigmoid(logit.detach()) > 0.5
    good, bad = y > 0.5, y <= 0.5
    m = {  # device tensors: the loop reads them once per logging window (a recall is 0 without its class)
        "top1": (a == good).float().mean(),
        "label_acceptable": y.mean(),
        "recall_acceptable": (a & good).sum() / good.sum().clamp(min=1),
        "recall_reject": (~a & bad).sum() / bad.sum().clamp(min=1),
    }
    return StepOutput(loss, len(y), m)


def features_stored(drafter, signals: dict) -> bool:
    """Whether records with these signals (the manifest's) hold the features this drafter reads (a Medusa-2
    drafter computes its own with the adapted target): the drafter's ``features_in`` where it has one."""
    features_in = getattr(drafter, "features_in", None)
    return features_in(signals) if features_in is not None else "hidden_last" in signals
