"""Batched target passes for the data stage, on draftsmith's own Llama.

- ``decode_batch``: left-padded batched generation with one KV cache. Teacher signals are captured while the
  target generates (top-k log-probs at each new token, hidden states at every position, SpecDec++ labels from a
  drafter run in lock-step), so the target never runs twice over its own responses.
- ``Refill`` (``decode_refill``): the same output per context, generated with continuous refill: a row that ends
  is replaced by the next waiting context at once (the generate stage's default on the own model).
- ``write_batch``: on-policy responses written by a drafter that reads the target's states (heads, EAGLE);
  ``write_one`` is its one-row reference, on the decoder's proposers (eval/proposers.py).
- ``score_batch``: one teacher-forced forward over finished sequences (dataset responses, drafter-written or
  vLLM-written responses) giving the same signals.

Signals (``Capture``): top-k log-probs are the target's raw distribution (temperature 1) whatever the sampling
settings, the teacher that KD losses match. Hidden states: ``hidden_last`` is the post-final-norm state the LM
head reads (Medusa / EAGLE-1 feature); ``hidden_aux`` stacks the outputs of chosen layers (EAGLE-3 fusion).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.eval.accept import Sampler
from draftsmith.eval.decoder import DecodeStats, emit, prepare_prompt, target_pass
from draftsmith.models.llama import Llama
from draftsmith.models.sampling import process_logits, sample_rows


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def pick(self, logits: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
        """logits (B, V) -> tokens (B,): argmax when greedy, else row b sampled with gens[b]."""
        if self.temperature <= 0:
            return logits.argmax(-1)
        return sample_rows(process_logits(logits, self.temperature, self.top_k, self.top_p), gens)


@dataclass(frozen=True)
class Capture:
    topk: int = 0
    hidden_last: bool = False
    aux_layers: tuple[int, ...] = ()  # 0-indexed target layers whose *output* is stored (EAGLE-3: [1, L/2-1, L-4])

    @property
    def hidden(self) -> bool:
        return self.hidden_last or bool(self.aux_layers)

    def layer_ids(self, n_layers: int) -> tuple[int, ...]:
        """Llama.capture_layers indices: i is the output of block i-1; n_layers the final (pre-norm) state."""
        ids = {layer + 1 for layer in self.aux_layers}
        if self.hidden_last:
            ids.add(n_layers)
        return tuple(sorted(ids))

    def hidden_rows(self, model: Llama, captured: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Captured {index: (B, T, D)} -> {"hidden_last": (B, T, D), "hidden_aux": (B, T, A, D)}."""
        out = {}
        if self.hidden_last:
            out["hidden_last"] = model.norm(captured[model.cfg.n_layers])
        if self.aux_layers:
            out["hidden_aux"] = torch.stack([captured[layer + 1] for layer in self.aux_layers], dim=2)
        return out


@dataclass
class Generated:
    """One row's output. ``tokens``: the response (EOS included when hit). ``loss_signals``: one row per response
    token. ``hidden``: one row per position of context + response."""

    tokens: list[int]
    loss_signals: dict[str, torch.Tensor] = field(default_factory=dict)
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)


def specdec_labels(
    p_logits: torch.Tensor, q_logits: torch.Tensor, sampling: Sampling, gens: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecDec++ labels (algorithms.md A7). p_logits / q_logits (N, V): target and drafter at the same positions.

    Returns (y (N,) the drafter's sample, accept (N,) float32 = min(1, p(y)/q(y))), the exact probability that
    speculative sampling accepts y. p and q get the same processing (B7.2); q(y) = 0 cannot happen for a sample.
    """
    p = process_logits(p_logits, sampling.temperature, sampling.top_k, sampling.top_p)
    q = process_logits(q_logits, sampling.temperature, sampling.top_k, sampling.top_p)
    y = q.argmax(-1) if sampling.temperature <= 0 else sample_rows(q, gens)
    py, qy = p.gather(-1, y[:, None])[:, 0], q.gather(-1, y[:, None])[:, 0]
    return y, torch.where(qy > 0, (py / qy.clamp_min(1e-30)).clamp(max=1.0), torch.zeros_like(py))


def _topk_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V) fp32
    v, i = logp.topk(k, dim=-1)
    return i, v


def _left_pad(contexts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, L = len(contexts), max(len(c) for c in contexts)
    ids = torch.zeros(B, L, dtype=torch.long, device=device)
    valid = torch.zeros(B, L, dtype=torch.bool, device=device)
    for b, c in enumerate(contexts):
        ids[b, L - len(c) :] = torch.tensor(c, device=device)
        valid[b, L - len(c) :] = True
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)  # each row's RoPE positions start at 0 after its padding
    return ids, valid, pos


@torch.no_grad()
def decode_batch(
    model: Llama,
    contexts: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling,
    gens: list[torch.Generator],
    capture: Capture = Capture(),
    companion: Llama | None = None,
    label_sampling: Sampling | None = None,
) -> list[Generated]:
    """Generate a response for every context (left-padded into one batch, one KV cache).

    contexts: token lists (ragged). gens: one generator per row (sampling and labels draw from it, so a row's
    output does not depend on its batch-mates). companion: a drafter fed the same tokens in lock-step; with it,
    each response token gets SpecDec++ labels (``spec_token``, ``spec_accept``) under ``label_sampling``.
    """
    dev = model.embed_tokens.weight.device
    B, L = len(contexts), max(len(c) for c in contexts)
    ids, valid, pos = _left_pad(contexts, dev)
    layer_ids = capture.layer_ids(model.cfg.n_layers)
    cache = model.new_cache(B, L + max_new_tokens)
    last = torch.zeros(B, L, dtype=torch.bool, device=dev)
    last[:, -1] = True  # the LM head only where the next token is predicted: prefill is compute-bound on CPU
    none = torch.zeros(B, 1, dtype=torch.bool, device=dev)

    def step(x, p, v, at):
        out = model(x, pos=p, cache=cache, valid=v, capture_layers=layer_ids, logits_at=at)
        logits, captured = out if layer_ids else (out, {})
        hidden.append(capture.hidden_rows(model, captured))
        return logits

    hidden: list[dict[str, torch.Tensor]] = []
    logits = step(ids, pos, valid, last)  # (B, V)
    dcache = q_logits = None
    if companion is not None:
        dcache = companion.new_cache(B, L + max_new_tokens)
        q_logits = companion(ids, pos=pos, cache=dcache, valid=valid, logits_at=last)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    toks, rows = [], {"topk_ids": [], "topk_logprobs": [], "spec_token": [], "spec_accept": []}
    next_pos = pos[:, -1:] + 1
    for t in range(max_new_tokens):
        # Only rows still writing draw from their generators: a finished row's generator must not advance with
        # its batch-mates' steps, or its next turn (multi-turn sampling) would depend on who shared the batch.
        live = (~done).nonzero()[:, 0].tolist()
        live_gens = [gens[b] for b in live]
        tok = torch.zeros(B, dtype=torch.long, device=dev)
        tok[live] = sampling.pick(logits[live], live_gens)
        toks.append(tok)
        if capture.topk:
            i, v = _topk_rows(logits, capture.topk)
            rows["topk_ids"].append(i)
            rows["topk_logprobs"].append(v)
        if companion is not None:
            y, acc = torch.zeros_like(tok), torch.zeros(B, device=dev)
            y[live], acc[live] = specdec_labels(logits[live], q_logits[live], label_sampling or sampling, live_gens)
            rows["spec_token"].append(y)
            rows["spec_accept"].append(acc)
        done |= torch.isin(tok, eos)
        if done.all() or t == max_new_tokens - 1:
            break
        logits = step(tok[:, None], next_pos, None, None)[:, -1]
        if companion is not None:
            q_logits = companion(tok[:, None], pos=next_pos, cache=dcache)[:, -1]
        next_pos = next_pos + 1
    if layer_ids:  # the last token's hidden state: one more forward, LM head skipped
        step(tok[:, None], next_pos, None, none)
    return _split_rows(contexts, L, torch.stack(toks, 1).cpu(), eos_ids, rows, hidden)


@dataclass
class _Job:
    """One context to answer in ``Refill``: its own generator and budget; ``slot`` its rows in the signal buffers."""

    key: object
    ctx: list[int]
    gen: torch.Generator | None
    budget: int
    slot: int = -1
    t: int = 0  # tokens picked so far
    ctx_hidden: dict[str, torch.Tensor] = field(default_factory=dict)  # (len(ctx), ...) on the device


def batch_buckets(batch_size: int) -> tuple[int, ...]:
    """The static row counts a refill decode step runs at: powers of two below ``batch_size``, then it."""
    return tuple(sorted({min(1 << i, batch_size) for i in range(batch_size.bit_length() + 1)}))


class StaticDecode:
    """``Refill``'s decode forward at static shapes, so a GPU can replay it as a CUDA graph: n active rows run as
    rows [0, b) of the row cache's buffer, b the smallest bucket >= n (``batch_buckets``); the new K/V go to slot
    s0 held in a tensor and attention reads the whole buffer under a mask built from it (the static mode of
    models/llama.py, ``KVCache.slots``, which eval/graphs.py uses at batch 1; every row writes the same slot, so it
    holds for a batch). Rows [n, b) compute garbage nobody reads: their slots are reset when a row joins there.
    The buffer is allocated for ``batch_size`` rows up front and never moves. Joins (prefills) and compaction run
    eagerly between steps. ``graphs``: capture each bucket on first use (CUDA only; elsewhere the same static
    forward runs uncaptured, which the tests use to check it against the eager step)."""

    def __init__(self, model: Llama, rc, batch_size: int, layer_ids: tuple[int, ...], graphs: bool):
        self.model, self.rc, self.layer_ids = model, rc, layer_ids
        self.buckets = batch_buckets(batch_size)
        self.graphs = graphs and model.embed_tokens.weight.device.type == "cuda"
        rc.reserve(batch_size)
        dev = rc.full.valid.device
        self.s0 = torch.zeros((), dtype=torch.long, device=dev)
        self.slots = torch.arange(rc.max_len, device=dev)
        self.runs: dict[int, dict] = {}
        self.pool = None

    def _run(self, b: int) -> dict:
        c = self.rc.full.rows(b, 0, True)
        dev = self.s0.device
        run = {"cache": c, "ids": torch.zeros(b, 1, dtype=torch.long, device=dev), "graph": None}
        run["pos"] = torch.zeros(b, 1, dtype=torch.long, device=dev)
        self.runs[b] = run
        return run

    def _forward(self, run: dict):
        c, at = run["cache"], self.s0.view(1)
        c.valid.index_fill_(1, at, True)
        mask = (self.slots <= self.s0)[None, None, :] & c.valid[:, None, :]  # (b, 1, max_len)
        c.slots = at
        try:
            out = self.model(run["ids"], pos=run["pos"], cache=c, attn_mask=mask, capture_layers=self.layer_ids)
        finally:
            c.slots = None
        return out if self.layer_ids else (out, {})

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor):
        """tok (n,), pos (n, 1) -> (logits (n, 1, V), {layer: hidden (n, 1, D)}); advances the cache by a slot."""
        from draftsmith.eval.graphs import capture_graph

        n, s0 = len(tok), self.rc.length
        if s0 + 1 > self.rc.max_len:
            raise ValueError(f"KV cache overflow: {s0}+1 > {self.rc.max_len}")
        b = next(x for x in self.buckets if x >= n)
        run = self.runs.get(b) or self._run(b)
        run["ids"][:n, 0] = tok
        run["pos"][:n] = pos
        self.s0.fill_(s0)
        if self.graphs and run["graph"] is None:
            run["graph"], run["out"] = capture_graph(lambda: self._forward(run), self.pool)
            self.pool = run["graph"].pool()
        if run["graph"] is not None:
            run["graph"].replay()
            logits, captured = run["out"]
        else:
            logits, captured = self._forward(run)
        self.rc.view.length = s0 + 1
        return logits[:n].clone(), {k: v[:n].clone() for k, v in captured.items()}


class Refill:
    """Generation that keeps ``batch_size`` rows busy (continuous batching): when a row ends (EOS or its budget),
    the next pending context is prefilled and joins the decode in its place. Output per context equals
    ``decode_batch`` on that context alone: the same signals, the same draws from its own generator.

    The caches are eval/batch_decoder.py ``RowCache``s (rows of one slot-addressed KV cache that join and leave,
    compacted when full, kernels/kv.py ``compact_rows``), one for the target and one for the SpecDec++ labeller. Joining
    rows are prefilled together, right-aligned with their left padding invalid (eval/batch_decoder.py
    ``_aligned``), while the longest needs at most ``max_prefill_pad`` padding tokens more than another.

    Host syncs: tokens, top-k rows, labels and hidden states are written into per-slot device buffers and copied
    to the host once per step for the rows that finished in it (one gather per signal), never per token. A step
    syncs once: the (B,) EOS flags, read after the next forward is queued, so the device runs it meanwhile. A
    row that finished is fed its last token in that forward anyway (its hidden state is a signal) and leaves after.
    """

    def __init__(
        self,
        model: Llama,
        batch_size: int,
        max_new_tokens: int,
        eos_ids: set[int],
        sampling: Sampling,
        capture: Capture = Capture(),
        companion: Llama | None = None,
        label_sampling: Sampling | None = None,
        max_len: int = 0,
        max_prefill_pad: int | None = None,
        static: bool = False,
        graphs: bool = True,
        min_join: int = 1,
    ):
        from draftsmith.eval.batch_decoder import PREFILL_PAD

        self.model, self.B, self.N = model, batch_size, max_new_tokens
        self.eos_ids, self.sampling, self.capture = eos_ids, sampling, capture
        self.companion, self.label_sampling = companion, label_sampling or sampling
        self.dev = model.embed_tokens.weight.device
        self.layer_ids = capture.layer_ids(model.cfg.n_layers)
        self.max_len = max_len  # slots per cache row; 0: twice the longest context + budget, set at the first run
        self.pad = PREFILL_PAD.get(self.dev.type, PREFILL_PAD["cpu"]) if max_prefill_pad is None else max_prefill_pad
        self.pending: list[_Job] = []
        self.prefills = 0  # prefill forwards run (rows joining)
        self.min_join = max(1, min_join)  # free rows to wait for before a join, while rows are decoding
        # static: decode steps at static shapes per batch bucket (``StaticDecode``), captured as CUDA graphs when
        # ``graphs`` and the model is on a GPU; a sliding-window target always runs eagerly (its mask is per step)
        self.static = static and isinstance(model, Llama) and model.cfg.sliding_window is None
        self.graphs = graphs

    @staticmethod
    def supports(model) -> bool:
        """Refill needs the slot cache (models/llama.py KVCache): the own model, or a transformers target whose
        attention takes a prepared 4-D mask (models/hf_target.py ``slots_ok``; it runs eagerly, without graphs)."""
        return isinstance(model, Llama) or bool(getattr(model, "slots_ok", False))

    def add(self, key, context: list[int], gen: torch.Generator | None, max_new_tokens: int | None = None) -> None:
        """Queue a context; ``run``'s callback gets ``key`` and its Generated. Callable from that callback."""
        budget = self.N if max_new_tokens is None else max_new_tokens
        if budget > self.N:
            raise ValueError(f"a budget of {budget} tokens is over the generator's max_new_tokens={self.N}")
        if self.max_len and len(context) + budget + 1 > self.max_len:
            raise ValueError(f"context of {len(context)} tokens + {budget} new exceeds max_len={self.max_len}")
        self.pending.append(_Job(key, list(context), gen, budget))

    @torch.no_grad()
    def run(self, on_done) -> None:
        """Generate until nothing is pending or running; ``on_done(key, Generated)`` as each context finishes (it
        may ``add`` more: the next turn of a conversation)."""
        from draftsmith.eval.row_cache import RowCache

        self.on_done = on_done
        if not self.max_len:
            self.max_len = 2 * (max((len(j.ctx) for j in self.pending), default=0) + self.N + 1)
        self.rc = RowCache(self.model.new_cache, self.max_len)
        self.step_fn = StaticDecode(self.model, self.rc, self.B, self.layer_ids, self.graphs) if self.static else None
        self.dc = RowCache(self.companion.new_cache, self.max_len) if self.companion is not None else None
        self.rows: list[_Job] = []  # active, in cache-row order
        self.free = list(range(self.B))[::-1]
        self.bufs: dict[str, torch.Tensor] = {}  # signal -> (B, N + 1, ...): column t of slot s = token t of its row
        self.logits = self.q = None  # (n, V): what the next token of each row is picked from
        self.at = torch.zeros(0, 2, dtype=torch.long, device=self.dev)  # (n, 2): each row's (slot, t) on the device
        self.pos = torch.zeros(0, 1, dtype=torch.long, device=self.dev)  # (n, 1): RoPE position of its next token
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=self.dev)
        step = torch.tensor([0, 1], device=self.dev)
        while True:
            self._join()
            if not self.rows:
                return
            gens = [r.gen for r in self.rows]
            tok = self.sampling.pick(self.logits, gens)
            slot, t = self.at[:, 0], self.at[:, 1]
            self._put("tokens", slot, t, tok)
            if self.capture.topk:
                i, v = _topk_rows(self.logits, self.capture.topk)
                self._put("topk_ids", slot, t, i)
                self._put("topk_logprobs", slot, t, v)
            if self.companion is not None:
                y, acc = specdec_labels(self.logits, self.q, self.label_sampling, gens)
                self._put("spec_token", slot, t, y)
                self._put("spec_accept", slot, t, acc)
            self.rc.ensure(1)
            if self.step_fn is not None:
                logits, captured = self.step_fn(tok, self.pos)
            else:
                out = self.model(tok[:, None], pos=self.pos, cache=self.rc.view, capture_layers=self.layer_ids)
                logits, captured = out if self.layer_ids else (out, {})
            self.logits = logits[:, -1]
            for k, h in self.capture.hidden_rows(self.model, captured).items():
                self._put(k, slot, t, h[:, 0])
            if self.companion is not None:
                self.dc.ensure(1)
                self.q = self.companion(tok[:, None], pos=self.pos, cache=self.dc.view)[:, -1]
            self.at = self.at + step
            self.pos = self.pos + 1
            stop = torch.isin(tok, eos).tolist()  # the step's one sync, while the forward above runs
            for r in self.rows:
                r.t += 1
            fin = [b for b, r in enumerate(self.rows) if stop[b] or r.t >= r.budget]
            if fin:
                self._finish(fin)

    def _put(self, name: str, slot: torch.Tensor, t: torch.Tensor, x: torch.Tensor) -> None:
        buf = self.bufs.get(name)
        if buf is None:
            buf = self.bufs[name] = x.new_zeros((self.B, self.N + 1, *x.shape[1:]))
        buf[slot, t] = x

    def _join(self) -> None:
        """Prefill pending contexts into the free slots: longest first, a context shares the forward of longer
        ones while it needs at most ``pad`` padding tokens."""
        from draftsmith.eval.row_cache import aligned as _aligned

        while any(j.budget <= 0 for j in self.pending):  # nothing to generate (its callback may add more)
            j = next(j for j in self.pending if j.budget <= 0)
            self.pending.remove(j)
            self.on_done(j.key, Generated([]))
        k = min(len(self.free), len(self.pending))
        if not k or (self.rows and k < min(self.min_join, len(self.pending))):  # let a few rows free up first
            return
        order, self.pending = sorted(self.pending[:k], key=lambda j: -len(j.ctx)), self.pending[k:]
        while order:
            n = 1
            while n < len(order) and len(order[0].ctx) - len(order[n].ctx) <= self.pad:
                n += 1
            group, order = order[:n], order[n:]
            self._prefill(group, *_aligned([torch.tensor(j.ctx, device=self.dev) for j in group], [0] * n))

    def _prefill(self, group: list[_Job], ids, valid, pos) -> None:
        n, W = ids.shape
        last = torch.zeros(n, W, dtype=torch.bool, device=self.dev)
        last[:, -1] = True  # the LM head only where the next token is predicted
        tmp = self.model.new_cache(n, W)
        out = self.model(ids, pos=pos, cache=tmp, valid=valid, capture_layers=self.layer_ids, logits_at=last)
        logits, captured = out if self.layer_ids else (out, {})
        self.prefills += 1
        for k, h in self.capture.hidden_rows(self.model, captured).items():
            for b, j in enumerate(group):
                j.ctx_hidden[k] = h[b, W - len(j.ctx) :]
        self.rc.join(tmp, list(range(n)), W)
        if self.companion is not None:
            dtmp = self.companion.new_cache(n, W)
            q = self.companion(ids, pos=pos, cache=dtmp, valid=valid, logits_at=last)
            self.dc.join(dtmp, list(range(n)), W)
            self.q = q if self.q is None or not len(self.rows) else torch.cat([self.q, q])
        for j in group:
            j.slot, j.t = self.free.pop(), 0
        self.rows += group
        grown = self.logits is not None and len(self.rows) > n
        self.logits = torch.cat([self.logits, logits]) if grown else logits
        at = torch.tensor([[j.slot, 0] for j in group], device=self.dev)
        self.at = torch.cat([self.at, at]) if grown else at
        self.pos = torch.cat([self.pos, pos[:, -1:] + 1]) if grown else pos[:, -1:] + 1

    def _finish(self, fin: list[int]) -> None:
        """Hand the finished rows' outputs over (one host copy per signal for all of them) and drop their rows:
        as RowCache.remove does, the last active row takes a dropped row's place."""
        jobs = [self.rows[b] for b in fin]
        slots = torch.tensor([j.slot for j in jobs], device=self.dev)
        most = max(j.t for j in jobs)
        host = {k: v.index_select(0, slots)[:, :most].cpu() for k, v in self.bufs.items()}
        order = list(range(len(self.rows)))
        for b in reversed(fin):
            for c in (self.rc, self.dc):
                if c is not None:
                    c.remove(b)
            order[b] = order[-1]
            order.pop()
            self.rows[b] = self.rows[-1]
            self.rows.pop()
        if self.rows:
            idx = torch.tensor(order, device=self.dev)
            self.logits, self.at, self.pos = self.logits[idx], self.at[idx], self.pos[idx]
            self.q = None if self.q is None else self.q[idx]
        self.free += [j.slot for j in jobs]
        for i, j in enumerate(jobs):
            n = j.t
            toks = host["tokens"][i, :n].tolist()
            signals = {
                k: host[k][i, :n] for k in ("topk_ids", "topk_logprobs", "spec_token", "spec_accept") if k in host
            }
            hidden = {k: torch.cat([h.cpu(), host[k][i, :n]]) for k, h in j.ctx_hidden.items()}
            j.ctx_hidden = {}
            self.on_done(j.key, Generated(toks, signals, hidden))


def decode_refill(
    model: Llama,
    contexts: list[list[int]],
    max_new_tokens: int | list[int],
    eos_ids: set[int],
    sampling: Sampling,
    gens: list[torch.Generator | None],
    capture: Capture = Capture(),
    companion: Llama | None = None,
    label_sampling: Sampling | None = None,
    batch_size: int = 16,
    static: bool = False,
    min_join: int = 1,
) -> list[Generated]:
    """``decode_batch``'s output for every context, generated by ``Refill`` with ``batch_size`` rows at a time.
    ``max_new_tokens``: one budget for all, or one per context. ``static``: decode steps at static shapes per batch
    bucket, CUDA graphs on a GPU (``StaticDecode``). ``min_join``: free rows to wait for before prefilling."""
    budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(contexts)
    n = max(budgets, default=0)
    gen = Refill(
        model, batch_size, n, eos_ids, sampling, capture, companion, label_sampling, static=static, min_join=min_join
    )
    for i, (c, g, n) in enumerate(zip(contexts, gens, budgets, strict=True)):
        gen.add(i, c, g, n)
    out: list[Generated | None] = [None] * len(contexts)
    gen.run(lambda i, g: out.__setitem__(i, g))
    return out


@torch.no_grad()
def write_batch(
    model: Llama,
    drafter,
    contexts: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling,
    gens: list[torch.Generator],
) -> list[Generated]:
    """On-policy responses written by a drafter that reads the target's states (heads, EAGLE): ``write_one`` for
    a batch of rows, on the decoder's proposers (eval/proposers.py) and its slot cache (one target cache, the
    drafter's caches).

    The first token is the target's; every later one is the drafter's first draft after the last token. The
    target only runs one step behind, over the token just written, for the state the drafter reads next: its
    final hidden state (heads, through Hydra++'s prefix layer when there is one) or the captured feature layers
    (EAGLE, read in (feature, next token) pairs). Row b draws only from gens[b] and stops drawing at its EOS, so
    its text does not depend on its batch-mates: it equals ``write_one``'s.
    """
    from draftsmith.eval.accept import Sampler
    from draftsmith.eval.batch_decoder import SlotTarget, _Row
    from draftsmith.eval.proposers import proposer_for
    from draftsmith.eval.row_cache import aligned
    from draftsmith.eval.shapes import Drafted, Verdict

    if max_new_tokens <= 0:
        return [Generated([]) for _ in contexts]
    dev = model.embed_tokens.weight.device
    B, max_len = len(contexts), max(len(c) for c in contexts) + max_new_tokens + 2
    proposer, tside = proposer_for(drafter)(model, drafter, max_len), SlotTarget(model, max_len)
    prompts = [torch.tensor(c, device=dev) for c in contexts]
    ids, valid, pos = aligned(prompts, [0] * B)
    logits, captured = tside.prefill(ids, valid, pos, proposer.layers)
    tside.join(list(range(B)), ids.shape[1])
    rows = [_Row(b, p, max_new_tokens, Sampler(), DecodeStats(), pos=p.numel()) for b, p in enumerate(prompts)]
    proposer.join(rows, ids, valid, pos, captured, list(range(B)))
    cur = sampling.pick(logits, gens)

    def pick(lg: torch.Tensor, live: list[bool]):  # a finished row draws nothing: its stream is its own
        nxt, idx = lg.argmax(-1), [b for b, x in enumerate(live) if x]
        nxt[idx] = sampling.pick(lg[idx], [gens[b] for b in idx])
        return nxt, None

    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=dev)
    active = torch.ones(B, dtype=torch.bool, device=dev)
    nothing = Drafted(cur.new_zeros(B, 0), [0] * B)  # the verify reads cur alone and keeps it
    kept = Verdict([[] for _ in rows], [[0] for _ in rows], [0] * B, [0] * B, cur.new_zeros(B))
    toks = []
    for t in range(max_new_tokens):
        toks.append(cur)
        active &= ~torch.isin(cur, eos)
        if not active.any() or t == max_new_tokens - 1:
            break
        drafts, _, _ = proposer.draft(rows, cur, [int(a) for a in active.tolist()], pick)
        _, captured = tside.verify(rows, cur[:, None], nothing, proposer.layers)  # the states at cur, one behind
        tside.keep(kept, 1)
        proposer.commit(rows, cur, drafts[0][:, None], kept, captured)  # of the verify only cur's state
        for r in rows:
            r.pos += 1
        cur = torch.where(active, drafts[0], cur)  # finished rows repeat a token nobody keeps
    out = []
    for row in torch.stack(toks, 1).tolist():
        k = next((j + 1 for j, x in enumerate(row) if x in eos_ids), len(row))  # keep EOS, drop what follows
        out.append(Generated(row[:k]))
    return out


@torch.no_grad()
def write_one(
    target,
    drafter,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_ids: set[int] | None = None,
    generator: torch.Generator | None = None,
):
    """One row written by a drafter that reads the target's states (heads, EAGLE): the reference ``write_batch``
    is tested equal to, built on the decoder's proposers. prompt_ids (T,) -> (tokens, EOS included if hit; stats).

    The first token is the target's; every later one is the drafter's first draft after the last token (a chain
    of one, picked with the given sampling settings), committed unverified. The target runs once per token only
    to give the drafter the states it reads next. Not lossless, by design: it makes training data, never an eval.
    A standalone draft LM writes through the batched generator (``decode_batch``) instead. The stats count the
    steps (one target forward and one draft per token after the first), not their time.
    """
    from draftsmith.eval.batch_decoder import _Row
    from draftsmith.eval.decoder import reads_target
    from draftsmith.eval.proposers import proposer_for
    from draftsmith.eval.shapes import Verdict

    if not reads_target(drafter):
        raise ValueError(
            "write mode is for drafters that read the target's states; a standalone draft LM writes "
            "through the batched generator (data/engine.py decode_batch)"
        )
    stats = DecodeStats(accept_counts=[0, 0])
    if max_new_tokens <= 0:
        return [], stats
    sampler = Sampler(temperature, top_k, top_p, generator)
    prompt = prepare_prompt(target, prompt_ids)
    max_len = prompt.shape[1] + max_new_tokens + 2
    proposer = proposer_for(drafter)(target, drafter, max_len)
    cache = target.new_cache(1, max_len)
    logits, captured = target_pass(target, prompt, cache, proposer.layers, last_only=True)
    cur, _ = sampler.pick(logits)
    row = _Row(0, prompt[0], max_new_tokens, sampler, stats)
    proposer.join([row], prompt, None, torch.arange(prompt.shape[1], device=prompt.device)[None], captured, [0])
    nothing = Verdict([[]], [[0]], [0], [0], torch.zeros(1, dtype=torch.long, device=prompt.device))  # cur kept
    out: list[int] = []
    done = emit(out, [int(cur)], eos_ids, max_new_tokens)
    while not done:
        toks, _, _ = proposer.draft([row], cur.view(1), [1], lambda lg, live: (sampler.pick(lg[0])[0].view(1), None))
        _, captured = target_pass(target, cur.view(1, 1), cache, proposer.layers)  # the states at cur, one behind
        proposer.commit([row], cur.view(1), toks[0][:, None], nothing, captured)  # of the verify only cur's state
        cur = toks[0]
        done = emit(out, [int(cur)], eos_ids, max_new_tokens)
        stats.step(1, 0, 0.0, 0.0)
    stats.new_tokens = len(out)
    return out, stats


def _split_rows(contexts, L, toks, eos_ids, rows, hidden) -> list[Generated]:
    stacked = {k: torch.stack(v, 1).cpu() for k, v in rows.items() if v}  # (B, n, ...)
    hid = {k: torch.cat([h[k] for h in hidden], 1).cpu() for k in (hidden[0] if hidden else {})}  # (B, L+n, ...)
    out = []
    for b, c in enumerate(contexts):
        row = toks[b].tolist()
        n = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))  # keep EOS, drop what follows
        out.append(
            Generated(
                row[:n],
                {k: v[b, :n] for k, v in stacked.items()},
                {k: v[b, L - len(c) : L + n] for k, v in hid.items()},
            )
        )
    return out


@torch.no_grad()
def score_batch(
    model: Llama,
    seqs: list[list[int]],
    masks: list[list[int]],
    capture: Capture,
    companion: Llama | None = None,
    label_sampling: Sampling | None = None,
    gens: list[torch.Generator] | None = None,
    chunk: int = 1024,
) -> list[Generated]:
    """Teacher-forced signals for finished sequences (right-padded, no cache). masks[b][t] = 1 marks a response
    token; its loss row comes from position t-1. The LM head runs in chunks of ``chunk`` rows over the loss
    positions only, so (N, V) logits never exist for the whole batch at once."""
    dev = model.embed_tokens.weight.device
    B, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, T, dtype=torch.long, device=dev)
    predict = torch.zeros(B, T, dtype=torch.bool, device=dev)
    for b, (s, m) in enumerate(zip(seqs, masks)):
        ids[b, : len(s)] = torch.tensor(s, device=dev)
        predict[b, : len(s) - 1] = torch.tensor(m[1:], dtype=torch.bool, device=dev)
    h, captured = _final_hidden(model, ids, capture.layer_ids(model.cfg.n_layers))
    hid = {k: v.cpu() for k, v in capture.hidden_rows(model, captured).items()}
    h = h[predict]  # (N, D) row-major over (b, t): the order loss rows are stored in
    hq = _final_hidden(companion, ids, ())[0][predict] if companion is not None else None
    row_gens = [gens[b] for b in range(B) for _ in range(int(predict[b].sum()))] if gens is not None else None
    rows: dict[str, list[torch.Tensor]] = {}
    for a in range(0, len(h), chunk):
        logits = model.lm_head(h[a : a + chunk])  # (n, V)
        if capture.topk:
            i, v = _topk_rows(logits, capture.topk)
            rows.setdefault("topk_ids", []).append(i.cpu())
            rows.setdefault("topk_logprobs", []).append(v.cpu())
        if hq is not None:
            y, acc = specdec_labels(
                logits, companion.lm_head(hq[a : a + chunk]), label_sampling or Sampling(), row_gens[a : a + chunk]
            )
            rows.setdefault("spec_token", []).append(y.cpu())
            rows.setdefault("spec_accept", []).append(acc.cpu())
    flat = {k: torch.cat(v) for k, v in rows.items()}
    counts = predict.sum(1).tolist()
    out, start = [], 0
    for b, s in enumerate(seqs):
        n = counts[b]
        out.append(
            Generated(
                [], {k: v[start : start + n] for k, v in flat.items()}, {k: v[b, : len(s)] for k, v in hid.items()}
            )
        )
        start += n
    return out


def _final_hidden(model: Llama, ids: torch.Tensor, layer_ids: tuple[int, ...]):
    """Post-norm final hidden states (B, T, D) and the captured layers, with the LM head skipped."""
    n = model.cfg.n_layers
    none = torch.zeros_like(ids, dtype=torch.bool)
    _, captured = model(ids, capture_layers=tuple(sorted({*layer_ids, n})), logits_at=none)
    return model.norm(captured[n]), captured
