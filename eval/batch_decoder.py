"""The speculative decoder: one loop (``BatchDecoder.step``) for every drafter, every step shape and every batch
size, with rows that join and leave between steps (continuous batching). Batch 1 is B = 1 (eval/decoder.py
``speculative_generate``). Greedy output of every row equals that prompt's own plain decoding token for token, and
sampled rows follow the target's distribution (docs/decoding.md); only the judge shape is lossy, by design.

A step: new rows are prefilled (prompts of different lengths together), then the shape (eval/shapes.py) drafts
for every active row at once through the drafter's proposer (eval/proposers.py), one target forward verifies
every row's drafts, each row accepts by its own rule (greedy or rejection sampling with its own sampler; a tree's
path), and the proposer reads what was kept. A row that hits EOS or its token budget reports its last tokens and
leaves the batch.

The target's cache is one of two:

- ``SlotTarget`` (any B): every cache (the target's, a draft LM's or EAGLE's, Hydra++'s prefix context) is a
  ``RowCache`` (eval/row_cache.py): rows share slots, and a step writes the same slots for every row. Each row
  keeps its own committed length, which is the RoPE position of its next token, so rows of different prompt
  lengths and different accept counts never need padding to line up. What a row rejects stays in its slots but is
  marked invalid (a hole); slots past the longest kept run are rolled back for all rows at once, and the cache is
  compacted when a write would not fit. Keys carry their RoPE rotation from when they were written and queries
  only ever see valid slots at or before their own, so moving slots changes no attention score. A tree's rows are
  written at the same slots, each under its own tree mask at RoPE positions ``pos_b + depth``.
- ``DenseTarget`` (one row): the target's own contiguous cache, a tree's accepted path compacted into place: any
  target (a transformers model without the slot cache too) and its batch-1 CUDA-graph wrapper (eval/graphs.py).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from draftsmith.errors import DraftsmithError
from draftsmith.eval.accept import Adjust, Sampler
from draftsmith.eval.decoder import DecodeStats, _sync, emit, target_pass
from draftsmith.eval.graphs import GraphedLlama
from draftsmith.eval.proposers import proposer_for
from draftsmith.eval.row_cache import RowCache, aligned
from draftsmith.eval.shapes import Drafted, Verdict, shape_for
from draftsmith.eval.tree import compact_cache
from draftsmith.kernels.verify import verify_greedy, verify_sampling_rows
from draftsmith.models.llama import KVCache

# A prefill forward's fixed cost in prompt tokens, per device type: a prompt pads to a longer one's length (and
# shares its forward) only while that padding costs less than a forward of its own. CPU: SmolLM2-135M in float32
# on one thread takes about 55 ms per forward plus 3.7 ms per token (15 tokens); CUDA: launches and weight reads
# cost a few hundred tokens' compute (an estimate).
PREFILL_PAD = {"cpu": 16, "cuda": 256}

__all__ = ["BatchDecoder", "RowCache", "speculative_generate_batch", "step_room", "PREFILL_PAD"]


@dataclass
class _Row:
    id: int
    prompt: torch.Tensor  # (P,) long on the target's device
    max_new: int
    sampler: Sampler
    stats: DecodeStats
    out: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)  # tokens emitted during the current step()
    done: bool = False
    cur: int = 0  # the current token: committed, not yet in the target's cache
    pos: int = 0  # tokens in the target's cache = RoPE position of cur
    dpos: int = 0  # the drafter's committed positions (draft LM, EAGLE, Hydra++ context)
    unread: torch.Tensor | None = None  # draft LM: committed tokens its cache has not read; EAGLE: their ids
    feats: torch.Tensor | None = None  # EAGLE: the unread features (len(unread) + 1, F)
    h: torch.Tensor | None = None  # heads: the context state that produced cur (D,)
    stop: object = None  # this row's own copy of the stop hook (rules keep per-block state)
    hetero: object = None  # a drafter with its own tokenizer: the row's draft side (eval/hetero.py HeteroRow)
    adjust: Adjust | None = None  # penalties, logit bias, min_tokens: applied to the target's logits
    top_logprobs: int | None = None  # report the target's logprobs of each emitted token (and this many best)

    @property
    def key(self):
        s = self.sampler
        return (s.temperature, s.top_k, s.top_p, None if s.generator is None else id(s.generator))


class SlotTarget:
    """The target's side of a batch on the slot-addressed cache (module docstring): any B."""

    def __init__(self, target, max_len: int):
        self.target, self.rc, self.batch = target, RowCache(target.new_cache, max_len), True

    @property
    def kv(self):
        """The target's cache of the active rows."""
        return self.rc.view

    def prefill(self, ids, valid, pos, layers: tuple[int, ...]):
        """Prompts (k, W), right-aligned -> (logits at each last position (k, V), captured states)."""
        self.tmp = self.target.new_cache(*ids.shape)
        at = torch.zeros_like(ids, dtype=torch.bool)
        at[:, -1] = True
        out = self.target(ids, pos=pos, cache=self.tmp, valid=valid, capture_layers=layers, logits_at=at)
        return out if layers else (out, {})

    def join(self, live: list[int], width: int) -> None:
        self.rc.join(self.tmp, live, width)
        self.tmp = None

    def verify(self, rows, ids: torch.Tensor, d: Drafted, layers: tuple[int, ...]):
        """Every row's cur and drafts (B, W) in one forward -> (logits (B, W, V), captured states)."""
        B, W = ids.shape
        self.rc.ensure(W)
        self.s0 = self.rc.length
        base = torch.tensor([r.pos for r in rows], device=ids.device)[:, None]
        if d.anc is None:  # chains: causal
            pos, mask = base + torch.arange(W, device=ids.device), None
        else:  # trees: each node sees the committed prefix and its ancestors (a padding node only itself)
            pos = base + d.depths
            mask = torch.ones(B, W, self.s0 + W, dtype=torch.bool, device=ids.device)
            mask[:, :, self.s0 :] = d.anc
        out = self.target(ids, pos=pos, cache=self.rc.view, attn_mask=mask, capture_layers=layers)
        return out if layers else (out, {})

    def keep(self, v: Verdict, width: int) -> None:
        if v.prefix:
            self.rc.keep(self.s0, width, v.n + 1)
            return
        keep = torch.zeros(len(v.kept), width, dtype=torch.bool, device=self.rc.view.valid.device)
        for b, k in enumerate(v.kept):
            keep[b, k] = True
        self.rc.keep_slots(self.s0, keep)

    def remove(self, i: int) -> None:
        self.rc.remove(i)


class DenseTarget:
    """The target's side of one row on its own contiguous cache (module docstring): the batch-1 decoder's."""

    batch = False

    def __init__(self, target, max_len: int):
        self.target, self.max_len, self.rc = target, max_len, None

    @property
    def kv(self):
        """The target's cache."""
        return self.cache

    def prefill(self, ids, valid, pos, layers: tuple[int, ...]):
        self.cache = self.target.new_cache(1, self.max_len)
        logits, captured = target_pass(self.target, ids, self.cache, layers, last_only=True)
        return logits[None], captured

    def join(self, live: list[int], width: int) -> None:
        pass

    def verify(self, rows, ids: torch.Tensor, d: Drafted, layers: tuple[int, ...]):
        self.t_len, kw = self.cache.length, {}
        if d.anc is not None:  # a tree: RoPE position slot(cur) + depth, the committed prefix and its ancestors
            W = ids.shape[1]
            mask = torch.ones(1, W, self.t_len + W, dtype=torch.bool, device=ids.device)
            mask[0, :, self.t_len :] = d.anc[0]
            kw = {"pos": self.t_len + d.depths[:1], "attn_mask": mask}
        return target_pass(self.target, ids, self.cache, layers, **kw)

    def keep(self, v: Verdict, width: int) -> None:
        compact_cache(self.cache, self.t_len, v.kept[0])

    def remove(self, i: int) -> None:
        self.cache = None


def _unwrapped(model):
    """The plain model inside a batch-1 CUDA-graph wrapper (eval/graphs.py), whose single static cache rows of a
    batch would share."""
    return model.model if isinstance(model, GraphedLlama) else model


def plan(target, drafter, draft_len: int, max_len: int, tree=None, judge=None, stop=None):
    """The drafter's proposer and the step's shape (None, None: plain decoding). Refuses what is not implemented
    (eval/shapes.py ``shape_for``; a drafter with its own tokenizer decodes chains only)."""
    if drafter is None:
        if stop is not None:
            raise ValueError("stop_drafting adapts a drafter's chains; plain decoding (drafter None) has none")
        if tree is not None or judge is not None:
            raise ValueError("a tree or a judge needs a drafter; plain decoding (drafter None) has none")
        return None, None
    if getattr(drafter, "own_vocab", False):  # a draft LM with its own tokenizer (eval/hetero.py)
        from draftsmith.eval.hetero import OwnVocabRows
        from draftsmith.eval.shapes import Chain

        if tree is not None or judge is not None or stop is not None:
            raise ValueError("a drafter with its own vocabulary decodes chains only: no tree, judge or stop hook")
        prop = OwnVocabRows(target, drafter, draft_len)
        return prop, Chain(prop, prop.depth)
    prop = proposer_for(drafter)(target, drafter, max_len, stop)
    return prop, shape_for(target, prop, tree, draft_len, judge, stop)


class BatchDecoder:
    """Continuous-batching speculative decoder: ``add`` rows, call ``step`` until ``active()`` is empty. drafter
    None decodes plainly (one target forward per step for the whole batch). ``tree`` (a ``TreeSpec`` or
    ``DynamicTree``), ``judge`` (lossy Judge-Decoding chains) and ``stop_drafting`` (adaptive chain length) choose
    the step's shape; every shape drafts for all rows at once. ``one_row``: a decoder of a single row on the
    target's own contiguous cache (``DenseTarget``: any target, CUDA-graph wrappers kept), which is how
    ``speculative_generate`` decodes.

    ``stats[row_id]`` is kept after the row finishes or is removed (pop it when done). A step's draft and verify
    wall times are added to every row in it, so ``new_tokens / (draft_time_s + verify_time_s)`` is a row's rate,
    not the batch's: time the batch's tokens yourself."""

    impl = "auto"  # the chain acceptance kernels: fused (Triton) on CUDA, the PyTorch rules elsewhere

    def __init__(self, target, drafter, *, draft_len: int = 4, eos_ids=None, max_len: int = 4096,
                 stop_drafting=None, tree=None, judge=None, max_prefill_tokens: int = 8192,
                 max_prefill_pad: int | None = None, one_row: bool = False):  # fmt: skip
        if draft_len < 0:
            raise ValueError(f"draft_len must be >= 0, got {draft_len}")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
        if max_prefill_pad is not None and max_prefill_pad < 0:
            raise ValueError(f"max_prefill_pad must be >= 0, got {max_prefill_pad}")
        if not one_row:
            target, drafter = _unwrapped(target), _unwrapped(drafter)
            self._check_slots(target)
        self.target, self.drafter, self.eos_ids, self.max_len = target, drafter, set(eos_ids or ()), max_len
        self.stop = stop_drafting
        self.prop, self.shape = plan(target, drafter, draft_len, max_len, tree, judge, stop_drafting)
        self.depth = 0 if self.shape is None else self.shape.depth
        self.room = 0 if self.shape is None else self.shape.room  # slots a step may write past a row's tokens
        layers = () if self.prop is None else tuple(self.prop.layers) + tuple(self.shape.layers)
        self.layers = tuple(dict.fromkeys(layers))  # what every target forward captures
        self.device = next(target.parameters()).device
        self.max_prefill_tokens = max_prefill_tokens
        if max_prefill_pad is None:  # about a forward's fixed cost in prompt tokens
            max_prefill_pad = PREFILL_PAD.get(self.device.type, PREFILL_PAD["cpu"])
        self.max_prefill_pad = max_prefill_pad
        self.tside = DenseTarget(target, max_len) if one_row else SlotTarget(target, max_len)
        if hasattr(self.prop, "bind"):  # a drafter that reads the target's cache (GliDe)
            self.prop.bind(self.tside)
        self.one_row = one_row
        self.rows: list[_Row] = []  # active, in cache-row order
        self.pending: list[_Row] = []  # added, not prefilled yet
        self.stats: dict[int, DecodeStats] = {}
        # row id -> (logprob, [(token, logprob), ...]) per emitted token, for rows added with logprobs (pop them)
        self.logprobs: dict[int, list] = {}
        self._next_id, self._finished = 0, []

    @property
    def rc(self) -> RowCache | None:
        """The target's row cache (None for a one-row decoder)."""
        return self.tside.rc

    @staticmethod
    def _check_slots(target) -> None:
        if hasattr(target, "require_slots"):  # a transformers target (models/hf_target.py)
            target.require_slots("batched decoding (eval.batch_sizes, serve, online)")
        if not isinstance(target.new_cache(1, 1), KVCache):
            raise DraftsmithError(
                f"batched decoding needs a Llama-family target on the slot cache (models/llama.py), not "
                f"{type(target).__name__}: decode it at batch 1"
            )

    # ---- rows -------------------------------------------------------------------------------------------------------

    def add(self, prompt_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
            top_p: float = 1.0, generator: torch.Generator | None = None, adjust: Adjust | None = None,
            logprobs: int | None = None) -> int:  # fmt: skip
        """Queue a prompt (T,) -> its row id. It is prefilled at the next ``step`` and joins that step's decode.
        ``adjust``: changes to the target's logits (eval/accept.py ``Adjust``), before every acceptance rule.
        ``logprobs`` k: ``self.logprobs[row id]`` gets, per emitted token, the target's own log-probability of it
        (its raw logits: no temperature, penalty or bias) and its k most probable tokens."""
        if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
            raise ValueError(f"a prompt is a non-empty (T,) tensor; got shape {tuple(prompt_ids.shape)}")
        need = prompt_ids.numel() + max(max_new_tokens, 0) + self.room + 4
        if need > self.max_len:
            raise DraftsmithError(
                f"prompt of {prompt_ids.numel()} tokens + max_new_tokens={max_new_tokens} needs max_len >= {need}, "
                f"the batch decoder has max_len={self.max_len}"
            )
        s = Sampler(temperature, top_k, top_p, generator)
        depth = 0 if self.shape is None else self.shape.check(s)  # refuses what this row's shape refuses
        rid, self._next_id = self._next_id, self._next_id + 1
        st = DecodeStats(accept_counts=[0] * (depth + 1))
        row = _Row(rid, prompt_ids.to(self.device, torch.long), max_new_tokens, s, st)
        # stop rules keep per-block state: each row asks its own copy (one row: the caller's own object, which it
        # may also feed, as eval/sweep.py OracleStop's on_token does)
        row.stop = self.stop if self.one_row or self.stop is None else copy.copy(self.stop)
        row.adjust, row.top_logprobs = adjust, logprobs
        if logprobs is not None:
            self.logprobs[rid] = []
        self.pending.append(row)
        self.stats[rid] = st
        return rid

    def active(self) -> list[int]:
        """Row ids still decoding (pending prefill included)."""
        return [r.id for r in self.rows] + [r.id for r in self.pending]

    def remove(self, row_id: int) -> None:
        """Abandon a row (its client went away)."""
        for i, r in enumerate(self.pending):
            if r.id == row_id:
                del self.pending[i]
                return
        for i, r in enumerate(self.rows):
            if r.id == row_id:
                self._drop(i)
                return
        raise KeyError(f"no active row {row_id}")

    def _caches(self) -> list[RowCache]:
        return ([] if self.rc is None else [self.rc]) + ([] if self.prop is None else self.prop.caches)

    def _drop(self, i: int) -> None:
        self.tside.remove(i)
        for c in [] if self.prop is None else self.prop.caches:
            c.remove(i)
        self.rows[i] = self.rows[-1]
        self.rows.pop()

    # ---- sampling ---------------------------------------------------------------------------------------------------

    def _adjusted(self, rows: list[_Row], logits: torch.Tensor, ids=None, anc=None, depth=None) -> dict:
        """Apply each row's ``adjust`` to its logits (B, W, V) in place (``ids`` (B, W), ``anc`` (B, W, W) and
        ``depth`` (B, W) as ``Adjust.apply`` reads them; None: chains) -> {b: row b's raw logits (W, V)} for the
        rows that report logprobs."""
        raw = {b: logits[b].clone() for b, r in enumerate(rows) if r.top_logprobs is not None}
        for b, r in enumerate(rows):
            if r.adjust is not None:
                ids_b, anc_b, depth_b = (None if x is None else x[b] for x in (ids, anc, depth))
                r.adjust.apply(logits[b], r.out, ids_b, anc_b, depth_b)
        return raw

    @staticmethod
    def _entries(r: _Row, raw: torch.Tensor, tokens: list[int]) -> list:
        """raw (n, V): the target's logits that chose ``tokens`` (n,) -> per token (logprob, [(token, logprob)])."""
        lp = torch.log_softmax(raw.float(), -1)
        got = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
        if not r.top_logprobs:
            return [(g, []) for g in got]
        top = lp.topk(r.top_logprobs, -1)
        pairs = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        return list(zip(got, pairs))

    def pick(self, rows: list[_Row], logits: torch.Tensor, live: list[bool] | None = None):
        """logits (B, V) -> (tokens (B,), the distributions sampled rows drew from (B, V) fp32, or None when every
        row is greedy). Rows that share settings and generator draw together; a row not ``live`` draws nothing
        (its token is the argmax, unused), so a row's generator advances as it would alone."""
        tok = logits.argmax(-1)
        groups: dict = {}
        for i, r in enumerate(rows):
            if not r.sampler.greedy and (live is None or live[i]):
                groups.setdefault(r.key, []).append(i)
        if not groups:
            return tok, None
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        for idx in groups.values():
            s, ix = rows[idx[0]].sampler, torch.tensor(idx, device=logits.device)
            p = s.probs(logits[ix])
            probs[ix] = p
            tok[ix] = torch.multinomial(p, 1, generator=s.generator)[:, 0]
        return tok, probs

    def accept_chains(self, rows, drafts, qs, logits, gam: torch.Tensor):
        """Each row's rule on its first gam[b] drafts -> (n accepted (B,), next tokens (B,))."""
        G, dev = logits.shape[1] - 1, logits.device
        idx = [b for b, r in enumerate(rows) if not r.sampler.greedy]
        if len(idx) < len(rows):
            # greedy for every row at once (fused on CUDA): a draft past a row's gam[b] is -1, which never matches
            past = torch.arange(G, device=drafts.device)[None] >= gam[:, None]
            n, nxt = verify_greedy(drafts.masked_fill(past, -1), logits, self.impl)
            n = n.long()
            if not idx:
                return n, nxt
        # sampled rows: their target distributions (rows of equal settings together), then one rejection-sampling
        # call for all of them, each row drawing only from its own generator (fused on CUDA)
        every = len(idx) == len(rows)
        ix = None if every else torch.tensor(idx, device=dev)
        groups: dict = {}
        for j, b in enumerate(idx):
            s = rows[b].sampler
            groups.setdefault((s.temperature, s.top_k, s.top_p), []).append(j)
        sel = logits if every else logits[ix]
        if len(groups) == 1:
            p = rows[idx[0]].sampler.probs(sel)
        else:
            p = torch.empty(sel.shape, dtype=torch.float32, device=dev)
            for js in groups.values():
                jx = torch.tensor(js, device=dev)
                p[jx] = rows[idx[js[0]]].sampler.probs(sel[jx])
        q = p[:, :0] if not G else qs if every else qs[ix]
        gens = [rows[b].sampler.generator for b in idx]
        if every:
            ns, ts = verify_sampling_rows(drafts, q, p, gam, gens, self.impl)
            return ns.long(), ts
        ns, ts = verify_sampling_rows(drafts[ix], q, p, gam[ix], gens, self.impl)
        n[ix], nxt[ix] = ns.long(), ts
        return n, nxt

    # ---- the step ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _prefill(self) -> None:
        """Prefill pending rows and append those not done to the batch. Prompts of different lengths share a target
        forward (and a drafter join): right-aligned, the left padding invalid in every cache, each row at its own
        positions 0..P-1. Longest first, a prompt joins the forward of the longer ones before it while it needs at
        most ``max_prefill_pad`` padding tokens and the forward stays within ``max_prefill_tokens`` tokens, padding
        included (a longer prompt goes alone)."""
        order = sorted(self.pending, key=lambda r: -r.prompt.numel())
        self.pending = []
        while order:
            W, k = order[0].prompt.numel(), 1
            rows = min(len(order), max(1, self.max_prefill_tokens // W))
            while k < rows and W - order[k].prompt.numel() <= self.max_prefill_pad:
                k += 1
            group, order = order[:k], order[k:]
            ids, valid, pos = aligned([r.prompt for r in group], [0] * len(group))  # (k, W)
            logits, captured = self.tside.prefill(ids, valid, pos, self.layers)  # (k, V)
            raw = self._adjusted(group, logits[:, None])
            tok, _ = self.pick(group, logits)
            live = []
            for j, (r, t) in enumerate(zip(group, tok.tolist())):
                r.cur, r.pos = t, r.prompt.numel()
                r.done = r.max_new <= 0 or emit(r.out, [t], self.eos_ids, r.max_new)
                if j in raw and r.out:
                    self.logprobs[r.id] += self._entries(r, raw[j], [t])
                r.new = list(r.out)
                if not r.done:
                    live.append(j)
            self.tside.join(live, ids.shape[1])
            if self.shape is not None and live:
                self.shape.join(group, ids, valid, pos, captured, live)
            for r in group:
                r.stats.new_tokens = len(r.out)
            self.rows += [group[j] for j in live]
            self._finished += [r for r in group if r.done]

    @torch.no_grad()
    def prefill(self) -> dict[int, list[int]]:
        """Prefill what was added now -> {row id: its first token} (``step`` does it too; streaming callers call
        this first, so the first token is out before anything is drafted). Rows done at once leave."""
        self._finished = []
        for r in self.rows:
            r.new = []
        self._prefill()
        out = {r.id: r.new for r in self._finished}
        out.update({r.id: list(r.new) for r in self.rows if r.new})
        for r in self.rows:
            r.new = []
        return out

    @torch.no_grad()
    def step(self, speculate: bool = True) -> dict[int, list[int]]:
        """Prefill what was added, then one draft + verify for every active row -> {row id: tokens emitted this step}
        (a row that finished reports its last tokens here and leaves the batch). ``speculate=False``: nothing is
        drafted this step, every row takes one plain target step (the drafter still reads what was committed), as
        an engine does above the batch size where speculation stops paying."""
        self._finished: list[_Row] = []
        for r in self.rows:
            r.new = []
        self._prefill()
        rows = self.rows
        result = {r.id: r.new for r in self._finished}
        if not rows:
            return result
        dev, B = self.device, len(rows)
        cur = torch.tensor([r.cur for r in rows], device=dev)
        t0 = time.perf_counter()
        if self.shape is None:
            d = Drafted(cur.new_zeros(B, 0), [0] * B)
        else:
            budgets = [r.max_new - len(r.out) - 1 for r in rows] if speculate else None
            d = self.shape.draft(self, rows, cur, budgets)
        _sync(dev)
        t1 = time.perf_counter()
        ids = torch.cat([cur[:, None], d.tokens], 1)  # (B, W)
        logits, captured = self.tside.verify(rows, ids, d, self.layers)
        raw = self._adjusted(rows, logits, ids, d.anc, d.depths)  # a request's penalties and bias, before acceptance
        if self.shape is None:
            v = self._plain(rows, d, logits)
        else:
            v = self.shape.accept(self, rows, d, logits, captured)
        self.tside.keep(v, ids.shape[1])
        if self.shape is not None:
            self.shape.commit(rows, cur, d, v, captured)
        t2 = time.perf_counter()
        lps = {b: self._entries(rows[b], x[v.kept[b]], v.accepted[b] + [v.nxt[b]]) for b, x in raw.items()}
        for r, j in zip(rows, v.judged):
            r.stats.judge_accepted += j
        return self._commit(rows, v.accepted, v.nxt, d.count, t1 - t0, t2 - t1, result, lps)

    def _plain(self, rows, d: Drafted, logits: torch.Tensor) -> Verdict:
        n, nxt = self.accept_chains(rows, d.tokens, None, logits, torch.zeros(len(rows), dtype=torch.long))
        return Verdict([[] for _ in rows], [[0] for _ in rows], nxt.tolist(), [0] * len(rows), n)

    def _commit(self, rows, acc, nxt, drafted, t_draft: float, t_verify: float, result: dict, lps: dict) -> dict:
        """Emit each row's accepted drafts and next token (and ``lps[b]``, their logprobs, for the rows that report
        them), update its state and stats, drop finished rows."""
        done = []
        for b, r in enumerate(rows):
            k = len(r.out)
            r.done = emit(r.out, acc[b] + [nxt[b]], self.eos_ids, r.max_new)
            if b in lps:
                self.logprobs[r.id] += lps[b][: len(r.out) - k]
            r.new += r.out[k:]
            r.cur, r.pos = nxt[b], r.pos + len(acc[b]) + 1
            r.stats.step(drafted[b], len(acc[b]), t_draft, t_verify)
            r.stats.new_tokens = len(r.out)
            result[r.id] = r.new
            if r.done:
                done.append(b)
        for b in reversed(done):
            self._drop(b)
        return result


def step_room(target, drafter, draft_len: int, tree=None, judge=None, stop=None) -> int:
    """Cache slots a step may write past a row's committed tokens (``BatchDecoder.room``): a row's prompt + its
    max_new_tokens + this + 4 is the ``max_len`` that ``add`` asks for."""
    _, shape = plan(target, drafter, draft_len, 1, tree, judge, stop)
    return 0 if shape is None else shape.room


@torch.no_grad()
def speculative_generate_batch(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int, *,
                               draft_len: int = 4, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                               eos_ids=None, generator: torch.Generator | None = None, stop_drafting=None,
                               max_len: int | None = None, tree=None,
                               judge=None) -> tuple[list[list[int]], list[DecodeStats]]:  # fmt: skip
    """Decode all ``prompts`` as one batch (drafter None: plain decoding) -> (new tokens per prompt, stats per
    prompt), as ``speculative_generate`` would per prompt (``stop_drafting``: its stop rule, per row). ``max_len``
    (slots per cache row) defaults to the longest prompt + 2 * max_new_tokens + room: compaction is then rare.
    ``tree`` / ``judge``: trees and judged chains, as ``speculative_generate`` takes them."""
    if max_len is None:
        room = step_room(target, drafter, draft_len, tree, judge, stop_drafting)
        max_len = max(p.numel() for p in prompts) + 2 * max(max_new_tokens, 0) + room + 4
    dec = BatchDecoder(target, drafter, draft_len=draft_len, eos_ids=eos_ids, max_len=max_len,
                       stop_drafting=stop_drafting, tree=tree, judge=judge)  # fmt: skip
    ids = [dec.add(p, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
           for p in prompts]  # fmt: skip
    outs: dict[int, list[int]] = {i: [] for i in ids}
    while dec.active():
        for i, toks in dec.step().items():
            outs[i] += toks
    return [outs[i] for i in ids], [dec.stats[i] for i in ids]
