"""Trees and judged chains at B > 1, for ``BatchDecoder`` (eval/batch_decoder.py): every drafter kind, static and
dynamic trees, greedy and sampled, and lossy Judge-Decoding chains.

Each row drafts with its own batch-1 proposer and step shape (eval/proposers.py, eval/shapes.py: the same drafting
and acceptance code as ``speculative_generate``), so a row's drafts and accepted path are exactly its batch-1 ones.
What is batched is the target: one forward verifies every row's tree. Row b's nodes are written at the same slots
``[s0, s0 + W)`` for every row, each under its own tree mask (the committed prefix, its ancestors and itself) at RoPE
positions ``pos_b + depth``; a row with fewer nodes than W pads with nodes no real node attends to (they attend
only to themselves and are never kept). After each row's acceptance rule, the slots of its root and accepted path
stay valid and every other slot becomes a hole in the key-validity mask: the path's keys were written at exactly
the RoPE positions they hold as committed tokens, and later queries see every valid slot before their own, so
nothing needs to move (the cache's compaction squeezes holes out when it runs out of room).
"""

from __future__ import annotations

import copy
import time

import torch

from draftsmith.eval.accept import Sampler
from draftsmith.eval.decoder import _sync
from draftsmith.eval.hetero import HeteroRow, resolve_method
from draftsmith.eval.proposers import proposer_for
from draftsmith.eval.shapes import Draft, shape_for
from draftsmith.eval.tree import DynamicTree


class RowShapes:
    """The drafter's side of a batch whose steps draft trees (``tree``: a ``TreeSpec`` or ``DynamicTree``) or
    judged chains (``judge``). Drafter caches are per row, inside each row's proposer."""

    def __init__(self, target, drafter, *, tree, judge, draft_len: int, stop=None):
        self.t, self.d, self.tree, self.judge, self.draft_len, self.stop = target, drafter, tree, judge, draft_len, stop
        prop = self._probe = self._proposer()
        probe = self._shape(prop, Sampler(0.0))  # refuses what batch 1 refuses (a stop hook on a tree, ...)
        self.depth, self.room = probe.depth, probe.room
        self.layers = tuple(dict.fromkeys(prop.layers + probe.layers))
        self.caches: list = []  # no shared drafter cache: each row's proposer holds its own

    def _proposer(self):
        stop = None if self.stop is None else copy.copy(self.stop)  # stop rules keep per-block state
        return proposer_for(self.d)(self.t, self.d, stop)

    def _shape(self, prop, sampler: Sampler):
        return shape_for(self.t, prop, self.tree, self.draft_len, sampler, self.judge)

    def check(self, sampler: Sampler) -> int:
        """Refuse at ``add`` what the shape would refuse at prefill (a judge decodes greedily) -> the longest run a
        row with this sampler accepts (its ``DecodeStats.accept_counts`` range)."""
        self._shape(self._proposer(), sampler)
        return self.depth

    def join(self, rows, ids: torch.Tensor, valid, pos, captured: dict, live: list[int]) -> None:
        """Rows ``live`` of a prefill wave (``ids`` right-aligned, as ``captured``): each gets its proposer and
        shape, prefilled on its own prompt and the target's states at it."""
        W = ids.shape[1]
        for j in live:
            r = rows[j]
            P = r.prompt.numel()
            r.prop = self._proposer()
            r.shape = self._shape(r.prop, r.sampler)
            cap = {layer: c[j : j + 1, W - P :] for layer, c in captured.items()}
            r.prop.prefill(r.prompt[None], cap, P + r.max_new + self.room + 2, check_vocab=self.tree is None)

    def draft(self, dec, rows, cur: torch.Tensor) -> list[Draft]:
        """Every row's draft, each by its own batch-1 proposer and shape."""
        return [r.shape.draft(r.prop, cur[b : b + 1], r.max_new - len(r.out) - 1) for b, r in enumerate(rows)]

    def commit(self, rows, drafts: list[Draft], accepted: list, kept: list[list[int]], captured: dict) -> None:
        """Each row's proposer reads its accepted path (``captured``: the verify's states, every row's nodes)."""
        for b, (r, d, a, k) in enumerate(zip(rows, drafts, accepted, kept)):
            r.prop.commit(d, a, k, {layer: c[b : b + 1, : d.tokens.numel() + 1] for layer, c in captured.items()})

    @torch.no_grad()
    def step(self, dec, rows, cur: torch.Tensor, speculate: bool = True):
        """One draft + batched verify + per-row accept -> (accepted tokens per row, next token per row, drafts per
        row, judged per row, draft seconds, verify seconds, {b: logprob entries} for rows reporting logprobs).
        ``speculate=False`` drafts nothing: every row takes
        the target's next token by its own sampler."""
        t0 = time.perf_counter()
        if speculate:
            drafts = self.draft(dec, rows, cur)
        else:
            drafts = [Draft(cur[b : b + 1], cur.new_empty(0)) for b in range(len(rows))]
        _sync(dec.device)
        t1 = time.perf_counter()
        sizes = [d.tokens.numel() for d in drafts]
        B, W, dev = len(rows), max(sizes) + 1, cur.device
        ids = cur.new_zeros(B, W)
        ids[:, 0] = cur
        depth = torch.zeros(B, W, dtype=torch.long, device=dev)
        anc = torch.eye(W, dtype=torch.bool, device=dev).repeat(B, 1, 1)  # a padding node sees only itself
        for b, (d, n) in enumerate(zip(drafts, sizes)):
            ids[b, 1 : n + 1] = d.tokens
            if d.anc is None:  # a chain: each draft's ancestors are the drafts before it
                anc[b, : n + 1, : n + 1] = torch.ones(n + 1, n + 1, dtype=torch.bool, device=dev).tril()
                depth[b, : n + 1] = torch.arange(n + 1, device=dev)
            else:
                anc[b, : n + 1, : n + 1] = d.anc
                depth[b, : n + 1] = d.depths
        dec.rc.ensure(W)
        s0 = dec.rc.length
        mask = torch.ones(B, W, s0 + W, dtype=torch.bool, device=dev)
        mask[:, :, s0:] = anc
        pos = torch.tensor([r.pos for r in rows], device=dev)[:, None] + depth
        out = dec.target(ids, pos=pos, cache=dec.rc.view, attn_mask=mask, capture_layers=self.layers)
        logits, captured = out if self.layers else (out, {})
        raw = dec._adjusted(rows, logits, ids, anc, depth)  # a request's penalties and bias, before acceptance
        keep = torch.zeros(B, W, dtype=torch.bool, device=dev)
        accepted, kept, nxt, judged, lps = [], [], [], [], {}
        for b, (r, d, n) in enumerate(zip(rows, drafts, sizes)):
            cap = {layer: c[b : b + 1, : n + 1] for layer, c in captured.items()}
            if speculate:
                a, k, t, j = r.shape.accept(d, logits[b, : n + 1], cap)
            else:  # a plain step: the target's own next token
                a, k, t, j = d.tokens, [0], r.sampler.pick(logits[b, 0])[0], 0
            keep[b, k] = True
            if b in raw:  # the target's logprobs at the kept nodes: each chose the next emitted token
                lps[b] = dec._entries(r, raw[b][k], a.tolist() + [int(t)])
            accepted.append(a)
            kept.append(k)
            nxt.append(int(t))
            judged.append(j)
        self.commit(rows, drafts, accepted, kept, captured)
        dec.rc.keep_slots(s0, keep)
        t2 = time.perf_counter()
        return [a.tolist() for a in accepted], nxt, sizes, judged, t1 - t0, t2 - t1, lps


class BatchTrees(RowShapes):
    """Trees of every drafter kind drafted as one batch (eval/batch_proposers.py: the row proposer ``prop`` drafts
    every row's static or dynamic tree with one drafter forward per level, and reads the accepted paths as one
    batch). Verify and acceptance are ``RowShapes``': each row's batch-1 tree rule on its own nodes."""

    def __init__(self, target, drafter, *, tree, draft_len: int, prop):
        super().__init__(target, drafter, tree=tree, judge=None, draft_len=draft_len)
        self.prop, self.caches = prop, prop.caches
        self.dynamic = isinstance(tree, DynamicTree)

    def join(self, rows, ids: torch.Tensor, valid, pos, captured: dict, live: list[int]) -> None:
        self.prop.join(rows, ids, valid, pos, captured, live)
        for j in live:
            rows[j].shape = self._shape(self._probe, rows[j].sampler)  # its acceptance rule

    def draft(self, dec, rows, cur: torch.Tensor) -> list[Draft]:
        self.drafted = True
        if not self.dynamic:
            s = rows[0].shape
            tokens = self.prop.static_tree(rows, cur, self.tree, s.anc, self.room)
            return [
                Draft(cur[b : b + 1], t, parents=s.parents, anc=s.anc, depths=s.depths) for b, t in enumerate(tokens)
            ]
        tokens, parents, anc, depths = self.prop.dynamic_tree(rows, cur, self.tree, self.room)
        return [
            Draft(cur[b : b + 1], tokens[b], parents=parents[b], anc=anc[b], depths=depths[b]) for b in range(len(rows))
        ]

    def commit(self, rows, drafts: list[Draft], accepted: list, kept: list[list[int]], captured: dict) -> None:
        cur = None if self.drafted else torch.cat([d.cur for d in drafts])
        self.prop.commit_tree(rows, accepted, kept, captured, cur)

    def step(self, dec, rows, cur: torch.Tensor, speculate: bool = True):
        self.drafted = False
        return super().step(dec, rows, cur, speculate)


class OwnVocabRows(RowShapes):
    """A draft LM with its own tokenizer (eval/hetero.py ``OwnVocabDrafter``): each row keeps its own
    ``HeteroRow`` (committed target ids, draft-side context, draft KV cache, n-gram cache) and drafts as
    ``hetero_generate`` does; its candidates are a chain of 0..2·draft_len target ids (slem re-tokenizes text, so
    rows differ), verified with every other row's in ``RowShapes.step``'s one forward, each accepted by its row's
    batch-1 rule. Greedy rows use slem and sampled rows tli under method auto."""

    def __init__(self, target, drafter, *, draft_len: int):
        resolve_method(drafter.method, Sampler(0.0), draft_len)  # refuses a bad method or draft_len now
        self.t, self.d, self.draft_len = target, drafter, draft_len
        self.tree = self.judge = self.stop = None
        self.depth = 2 * draft_len if drafter.method in ("slem", "auto") else draft_len  # the most a row verifies
        self.room, self.layers, self.caches = self.depth, (), []

    def check(self, sampler: Sampler) -> int:
        return resolve_method(self.d.method, sampler, self.draft_len)[1]

    def join(self, rows, ids: torch.Tensor, valid, pos, captured: dict, live: list[int]) -> None:
        for j in live:
            r = rows[j]
            r.hetero = HeteroRow(self.t, self.d, r.sampler, self.draft_len, r.prompt.tolist() + [r.cur], r.max_new)
            r.shape = _OwnVocabChain(r.hetero)

    def draft(self, dec, rows, cur: torch.Tensor) -> list[Draft]:
        out = []
        for b, r in enumerate(rows):
            cand = r.hetero.propose(r.max_new - len(r.out) - 1)
            out.append(Draft(cur[b : b + 1], torch.tensor(cand, dtype=torch.long, device=cur.device)))
        return out

    def commit(self, rows, drafts: list[Draft], accepted: list, kept: list[list[int]], captured: dict) -> None:
        pass  # a row's draft side reads what it committed at its next step (``HeteroRow.commit`` in ``step``)

    def step(self, dec, rows, cur: torch.Tensor, speculate: bool = True):
        out = super().step(dec, rows, cur, speculate)
        for r, acc, nxt in zip(rows, out[0], out[1]):
            r.stats.ngram_candidates += r.hetero.cached if speculate else 0
            r.hetero.commit(len(acc), nxt)
        return out


class _OwnVocabChain:
    """A row's shape for ``RowShapes.step``: its ``HeteroRow``'s acceptance rule on its chain."""

    def __init__(self, row: HeteroRow):
        self.row = row

    def accept(self, draft: Draft, logits: torch.Tensor, captured: dict):
        n, nxt = self.row.accept(draft.tokens, logits)
        return draft.tokens[:n], list(range(n + 1)), nxt, 0
