"""Proposers: a drafter's side of a decoding step, for every row of a batch at once (batch 1 is B = 1), one class
per way a drafter reads the sequence. ``proposer_for`` is the one place that maps a drafter to its proposer.

- ``TokenRows``: a standalone draft LM (also with a reduced vocabulary, ``d2t``, and PARD's parallel drafts over
  mask tokens, ``parallel_drafts``) with its own ``RowCache``;
- ``HeadRows``: feature heads (Medusa, Hydra, Hydra++, MLP speculator: ``reads_target_hidden``) reading the
  target's final hidden state; Hydra++'s prefix layer keeps a ``RowCache``;
- ``FeatureRows``: EAGLE (``reads_target_features``), reading (target feature, token) pairs with its own
  ``RowCache``; ``ParallelFeatureRows``: P-EAGLE (``drafts_parallel``), the same pairs plus mask slots that draft
  several positions in one forward; ``HybridRows``: Gumiho (``drafts_hybrid``), EAGLE for the first positions and
  MLP heads on its pairs for the later ones; ``BlockFeatureRows``: Falcon (``drafts_blocks``), k drafts per forward
  in blocks, each block read from the cache without writing to it;
- ``GlimpseRows``: GliDe (``reads_target_cache``), a draft LM that also reads the target's KV cache;
- ``BlockRows``: DFlash (``drafts_block``), a whole block of drafts in one forward over the target's fused
  features at committed positions, kept in its own ``RowCache``;
- a draft LM with its own tokenizer has its own proposer, eval/hetero.py ``OwnVocabRows``.

What the decoder (eval/batch_decoder.py) and the step shapes (eval/shapes.py) call: ``layers`` (the target states
every verify must capture for it), ``depth`` (how deep it can draft), ``caches``; ``join`` after the target's
prefill of new rows; chains: ``draft(rows, cur, gam, pick)`` and ``commit`` after the verify; trees: ``root`` /
``expand`` / ``seek`` under ``static_tree`` and ``dynamic_tree``, then ``commit_tree``. Per row the proposer keeps
``dpos`` (its committed positions) and what it has not read yet (``unread``, EAGLE's ``feats``, the heads' ``h``).
"""

from __future__ import annotations

import logging
from functools import partial
from types import SimpleNamespace

import torch

from draftsmith.eval.graphs import GraphedLlama
from draftsmith.eval.row_cache import RowCache, aligned
from draftsmith.eval.shapes import tree_levels
from draftsmith.eval.tree import DynamicTree, StaticKids, pick_children
from draftsmith.models.feature_heads import first_stop, split_stop
from draftsmith.models.glide import key_order

log = logging.getLogger(__name__)


def proposer_for(drafter) -> type:
    """The proposer class that decodes with ``drafter``: heads read the target's final hidden state, EAGLE its
    feature layers; anything else is a token drafter (PARD included)."""
    if getattr(drafter, "reads_target_hidden", False):
        return HeadRows
    if getattr(drafter, "drafts_parallel", 0):
        return ParallelFeatureRows
    if getattr(drafter, "drafts_hybrid", None):
        return HybridRows
    if getattr(drafter, "drafts_blocks", 0):
        return BlockFeatureRows
    if getattr(drafter, "reads_target_features", False):
        return FeatureRows
    if getattr(drafter, "drafts_block", False):
        return BlockRows
    if getattr(drafter, "reads_target_cache", False):
        return GlimpseRows
    return TokenRows


def _run_drafter(drafter, ids: torch.Tensor, **kw):
    """The drafter's forward with its logits in the target's vocabulary. A drafter with a reduced vocabulary
    carries ``d2t`` (V_draft,) offsets, EAGLE-3 style: draft id i is target id i + d2t[i]
    (algorithms.md A10). Its logits are scattered into a -inf row of the target's size, so drafting, q and every
    acceptance rule work on target ids unchanged (the drafter still reads target ids)."""
    out = drafter(ids, **kw)
    d2t = getattr(drafter, "d2t", None)
    logits, extra = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    if d2t is None or logits.shape[-1] == drafter.target_vocab_size:  # already in target ids (ReducedHead)
        return out
    ids_t = torch.arange(len(d2t), device=d2t.device) + d2t
    full = logits.new_full((*logits.shape[:-1], drafter.target_vocab_size), float("-inf"))
    full[..., ids_t] = logits
    return (full, *extra) if extra else full


def _chain(rows: list, gam: list[int], logits: torch.Tensor, state, pick, expand):
    """Every row's chain after its root: logits (B, V) for the first draft, state (B, S) or None (what stop hooks
    read), ``expand(tok (B,), i) -> (logits, state)`` feeds draft i to the drafter. Row b drafts until gam[b] or
    until its stop hook ends its block; the loop runs while any row
    drafts. -> (drafts [(B,)], q [(B, V) or None], drafts per row, drafts fed)."""
    hooks = [split_stop(r.stop) for r in rows]
    firsts = [first_stop(after) for after, _ in hooks]
    count, live = [0] * len(rows), [g > 0 for g in gam]
    toks, qs, fed = [], [], 0
    for i in range(max(gam)):
        for b, (after, _) in enumerate(hooks):
            st = None if state is None else state[b]
            if live[b] and after is not None and i >= firsts[b] and after(i, logits[b], st):
                live[b] = False
        if not any(live):
            break
        tok, q = pick(logits, live)  # a row past its own budget draws nothing: its stream is its own
        toks.append(tok)
        qs.append(q)
        for b, (_, before) in enumerate(hooks):
            if not live[b]:
                continue
            count[b] = i + 1
            st = None if state is None else state[b]
            if i + 1 >= gam[b] or (before is not None and before(i + 1, logits[b], st, tok[b : b + 1])):
                live[b] = False  # its last draft is never fed: the verify decides whether it survives
        if not any(live):
            break
        logits, state = expand(tok, i)
        fed += 1
    return toks, qs, count, fed


class _Rows:
    """What the row proposers share: tree drafting over their ``root`` / ``expand`` for B rows at once. After
    ``root``, ``s_root`` is the slot after every row's root and ``root_pos`` (B,) each root's RoPE position; a
    node at depth d sits at ``root_pos + d``."""

    passes_state = False  # a drafted node's output state is its children's input (EAGLE)
    rc: RowCache | None = None

    def seek(self, slot: int) -> None:
        """The drafter's cache ends at ``slot``: where the next level's nodes are written."""
        self.rc.view.length = slot

    def static_tree(self, rows: list, cur: torch.Tensor, spec, anc: torch.Tensor, room: int):
        """Every row's static tree -> (node tokens (B, N), the distributions sampled children were drawn from
        (B, N+1, V) or None): one forward per depth level for all rows' nodes, node i the ``ranks[i]``-th best of
        its parent's distribution (a sampled row: its ``slots[i]``-th draw, eval/tree.py ``StaticKids``); the
        deepest level is never fed."""
        B, dev, depths = len(rows), cur.device, spec.depths
        root_logits, root_state = self.root(rows, cur, room, max(depths))
        logits, states = {-1: root_logits}, {-1: root_state}  # parent node -> (B, V), (B, S)
        base, pos0 = self.s_root, self.root_pos(rows)
        tokens, kids = cur.new_zeros(B, len(spec)), StaticKids(rows, spec)
        for d in range(1, max(depths) + 1):
            level = [i for i, di in enumerate(depths) if di == d]
            for i in level:
                tokens[:, i] = kids.token(logits[spec.parents[i]], i)
            if d == max(depths):
                break
            lo, hi = level[0], level[-1] + 1
            mask = torch.ones(B, hi - lo, base + hi, dtype=torch.bool, device=dev)
            mask[:, :, base:] = anc[lo + 1 : hi + 1, 1 : hi + 1]
            self.seek(base + lo)  # levels are fed in order, so the cache ends where this level starts
            st = torch.stack([states[spec.parents[i]] for i in level], 1) if self.passes_state else None
            paths = torch.stack([tokens[:, _path(spec.parents, i)] for i in level], 1)  # (B, n, d): root down
            out, out_st = self.expand(tokens[:, lo:hi], st, (pos0 + d)[:, None].expand(B, hi - lo), mask, d, paths)
            logits.update({i: out[:, i - lo] for i in level})
            if self.passes_state:
                states.update({i: out_st[:, i - lo] for i in level})
        return tokens, kids.q()

    def dynamic_tree(self, rows: list, cur: torch.Tensor, spec, room: int):
        """Every row's EAGLE-2 tree -> (tokens (B, N), parents (B, N), mask (B, N+1, N+1), depths (B, N+1), the
        draft distributions sampled children were drawn from (B, N+1, V) or None: ``tree_levels``)."""
        root_logits, root_state = self.root(rows, cur, room, spec.depth)
        self._pos0 = self.root_pos(rows)
        return self._levels(root_logits, root_state, spec, partial(pick_children, rows, spec.sampling))

    def _levels(self, root_logits: torch.Tensor, root_state, spec, pick=None):
        return tree_levels(self, root_logits, root_state, self.s_root, spec, _feed_rows, pick)

    def root_pos(self, rows: list) -> torch.Tensor:
        return torch.tensor([r.dpos - 1 for r in rows], device=self.rc.view.valid.device)


def _path(parents, i: int) -> list[int]:
    """Node i and its ancestors, from the root's child down."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def _unwrapped(model):
    """The plain model inside a batch-1 CUDA-graph wrapper (eval/graphs.py): a temporary prefill cache must not be
    the wrapper's one static cache."""
    return model.model if isinstance(model, GraphedLlama) else model


def _feed_rows(run: _Rows, tokens, states, d: int, base: int, n_fed: int, anc, paths):
    """One level of every row's dynamic tree: the frontiers (B, k) in one forward after the n_fed nodes already
    in the cache, each row under its own ancestor mask anc (B, k, n_fed + k)."""
    B, k = tokens.shape
    mask = torch.cat([torch.ones(B, k, base, dtype=torch.bool, device=tokens.device), anc], 2)
    run.seek(base + n_fed)
    return run.expand(tokens, states, (run._pos0 + d)[:, None].expand(B, k), mask, d, paths)


class TokenRows(_Rows):
    """A draft LM. Per row: ``dpos`` committed positions in its cache and ``unread``, the committed tokens the
    next step reads first: after a chain step that kept all γ drafts, the last one (never fed); after a tree step,
    the accepted path (its nodes were drafted in tree slots, which are rolled back); after a step that drafted
    nothing, the current token too. The prompt is read at ``join``, which also checks the vocabulary (draft ids
    are fed to the target as they are)."""

    reads_target = False

    def __init__(self, target, drafter, max_len: int, stop=None):
        self.t, self.d, self.depth = target, drafter, float("inf")
        self.pard = getattr(drafter, "parallel_drafts", 0)  # PARD: every draft from one forward over masks
        if self.pard:
            self.depth = self.pard
        self.layers: tuple[int, ...] = ()
        self.rc = RowCache(drafter.new_cache, max_len)
        self.caches = [self.rc]
        self.hidden = stop is not None and hasattr(drafter, "cfg")  # stop hooks see the drafter's final state

    def _call(self, ids: torch.Tensor, last: int = 0, **kw):
        """ids (B, T) -> (logits at the last position (B, V), its final state after the norm (B, D) or None);
        last > 0: at the last ``last`` positions instead ((B, last, V), (B, last, D))."""
        at = slice(-last, None) if last else -1
        if not self.hidden:
            return _run_drafter(self.d, ids, cache=self.rc.view, **kw)[:, at], None
        L = self.d.cfg.n_layers
        logits, cap = _run_drafter(self.d, ids, cache=self.rc.view, capture_layers=(L,), **kw)
        return logits[:, at], self.d.norm(cap[L][:, at])

    def join(self, rows: list, ids, valid, pos, captured: dict, live: list[int]) -> None:
        k, W = ids.shape
        tmp = _unwrapped(self.d).new_cache(k, W)  # not a CUDA-graph wrapper's static cache: ``rc`` gets that one
        v = _run_drafter(self.d, ids, cache=tmp, pos=pos, valid=valid).shape[-1]
        if v != self.t.cfg.vocab_size:  # draft ids are fed to the target as they are: the vocabularies must agree
            raise ValueError(f"drafter vocabulary {v} != target vocabulary {self.t.cfg.vocab_size}")
        self.rc.join(tmp, live, W)
        for j in live:
            rows[j].dpos, rows[j].unread = rows[j].prompt.numel(), ids.new_empty(0)

    def draft(self, rows: list, cur: torch.Tensor, gam: list[int], pick):
        """Every row's chain: the root read, then one forward per fed draft. PARD (models/pard.py) reads G-1 mask
        tokens with the root, whose logits at cur and at mask i are the distributions of draft 1 and draft i+1,
        none depending on another draft, so nothing is fed after it; it drafts at most ``parallel_drafts`` deep,
        the distances it was trained for."""
        G = max(gam)
        if G == 0:
            self.fed = None
            for b, r in enumerate(rows):
                r.unread = torch.cat([r.unread, cur[b : b + 1]])
            return None
        logits, state = self.root(rows, cur, G - 1, G)
        if self.pard:

            def expand(tok, i):
                return self.dists[:, i + 1], None if self.dstates is None else self.dstates[:, i + 1]
        else:
            base = torch.tensor([r.dpos for r in rows], device=cur.device)[:, None]

            def expand(tok, i):
                return self._call(tok[:, None], pos=base + i)

        toks, qs, count, fed = _chain(rows, gam, logits, state, pick, expand)
        self.fed = 0 if self.pard else fed
        return toks, qs, count

    def seek(self, slot: int) -> None:
        if not self.pard:  # PARD feeds no node: its cache ends at the root
            self.rc.view.length = slot

    def root(self, rows: list, cur: torch.Tensor, room: int, width: int = 1):
        """A step's root for every row: read each row's unread tokens and cur (PARD: and ``width`` - 1 mask
        tokens, whose distributions ``expand`` and chains hand out; their slots are rolled back at once) ->
        (logits (B, V), the drafter's final state there or None). ``room``: the slots the nodes drafted after it
        will take."""
        seqs = [torch.cat([r.unread, cur[b : b + 1]]) for b, r in enumerate(rows)]
        ids, valid, pos = aligned(seqs, [r.dpos for r in rows])
        self.rc.ensure(ids.shape[1] + max(room, width - 1))
        if self.pard:
            B, ar = len(rows), torch.arange(1, width, device=ids.device)
            ids = torch.cat([ids, ids.new_full((B, width - 1), self.d.cfg.mask_id)], 1)
            valid = None if valid is None else torch.cat([valid, valid.new_ones(B, width - 1)], 1)
            pos = torch.cat([pos, pos[:, -1:] + ar], 1)
            self.dists, self.dstates = self._call(ids, last=width, pos=pos, valid=valid)  # (B, width, V), states
            self.rc.keep(self.rc.length - (width - 1), width - 1, torch.zeros(B, dtype=torch.long, device=ids.device))
            logits, state = self.dists[:, 0], None if self.dstates is None else self.dstates[:, 0]
        else:
            logits, state = self._call(ids, pos=pos, valid=valid)
        for r, s in zip(rows, seqs):
            r.dpos, r.unread = r.dpos + len(s), s[:0]
        self.s_root = self.rc.length
        return logits, state

    def expand(self, tokens: torch.Tensor, states, pos: torch.Tensor, mask: torch.Tensor, depth: int, paths=None):
        """Nodes at ``depth`` of every row's tree (B, n) at RoPE positions ``pos`` under ``mask`` (B, n, slots)
        -> (their children's logits (B, n, V), None). PARD runs nothing: depth d's distribution for every node."""
        if self.pard:
            return self.dists[:, depth, None].expand(-1, tokens.shape[1], -1), None
        return self._call(tokens, last=tokens.shape[1], pos=pos, attn_mask=mask)

    def _levels(self, root_logits: torch.Tensor, root_state, spec, pick=None):
        """A draft LM in a ``GraphedLlama`` at batch 1 drafts every level after the root from one captured graph
        (``TreeGraph``; top-k children only); otherwise the levels run as for any proposer."""
        graphed = isinstance(self.d, GraphedLlama) and not self.hidden and not self.pard
        graphed = graphed and spec.sampling == "point_mass" and spec.min_prob is None  # (fixed shapes, no host reads)
        if graphed and root_logits.shape[0] == 1 and self.rc.view is self.d._cache:
            graph = TreeGraph.of(self.d, spec)
            if graph.usable:
                return (*(x[None] for x in graph(root_logits[0], self.rc.length)), None)
        return super()._levels(root_logits, root_state, spec, pick)

    def commit_tree(self, rows: list, accepted: list, kept: list, captured: dict, cur=None) -> None:
        """The tree's slots are rolled back; each row's accepted path is read with its next root. ``cur`` given:
        no tree was drafted (a plain step), and the current tokens join the unread ones."""
        if cur is not None:
            for b, r in enumerate(rows):
                r.unread = torch.cat([r.unread, cur[b : b + 1]])
            return
        self.rc.view.length = self.s_root
        for r, a in zip(rows, accepted):
            r.unread = a

    def commit(self, rows: list, cur, drafts: torch.Tensor, v, captured: dict) -> None:
        """After a chain's verify: ``v`` (eval/shapes.py ``Verdict``) says what each row accepted (``v.n``)."""
        if self.fed is None:  # it read nothing this step
            return
        n = v.n
        kept = n.clamp(max=self.fed)
        self.rc.keep(self.s_root, self.fed, kept)
        for b, (r, k, m) in enumerate(zip(rows, kept.tolist(), n.tolist())):
            r.dpos, r.unread = r.dpos + k, drafts[b, k:m]


class GlimpseRows(TokenRows):
    """GliDe (models/glide.py): a draft LM whose every draft forward also reads the target's KV cache of the
    committed context. ``bind(side)``: the decoder's target side, whose ``kv`` is the target's cache now (before a
    step's verify: each row's committed tokens, holes and padding invalid)."""

    def __init__(self, target, drafter, max_len: int, stop=None):
        super().__init__(target, drafter, max_len, stop)
        self.side, self.order = None, key_order(target)

    def bind(self, side) -> None:
        self.side = side

    def _call(self, ids: torch.Tensor, last: int = 0, **kw):
        if self.side is None:
            raise RuntimeError("GlimpseRows drafts only after bind(target side)")
        return super()._call(ids, last, glimpse=self.d.glimpse_of(self.side.kv, self.order), **kw)


class HeadRows(_Rows):
    """Feature heads draft from the context state at the position that produced cur: the target's final hidden
    state after its norm, through the drafter's context layer when it has one (Hydra++'s prefix attention reads
    only committed positions, in its ``RowCache``). Every verify returns the next one, so the heads run no model
    over drafted nodes. Chains: ``draft_step`` per position; static trees: one ``logits_after`` per distinct
    parent; dynamic trees: head d scores the children of every depth-d frontier node in one ``logits_after``."""

    reads_target = True

    def __init__(self, target, drafter, max_len: int, stop=None):
        self.t, self.d, self.depth = target, drafter, drafter.max_draft_len
        self.layers = (target.cfg.n_layers,)
        has_ctx = drafter.new_context(1, 1) is not None
        self.rc = RowCache(lambda b, m: drafter.new_context(m, b), max_len) if has_ctx else None
        self.caches = [self.rc] if has_ctx else []

    def join(self, rows: list, ids, valid, pos, captured: dict, live: list[int]) -> None:
        k, W = ids.shape
        hs = self.t.norm(captured[self.layers[0]])  # (k, W, D)
        if self.rc is None:
            out = self.d.read_context(hs)
        else:  # the prefix layer attends only to each row's own prompt, at its own positions
            tmp = self.d.new_context(W, k)
            out = self.d.read_context(hs, tmp, pos, valid)
            self.rc.join(tmp, live, W)
        for j in live:
            rows[j].h, rows[j].dpos = out[j, -1], rows[j].prompt.numel()

    def draft(self, rows: list, cur: torch.Tensor, gam: list[int], pick):
        if max(gam) == 0:
            return None
        h, path = torch.stack([r.h for r in rows]), [cur]

        def expand(tok, i):
            path.append(tok)
            return self.d.draft_step(h, path)  # (B, V), the state head i + 1 read them from

        toks, qs, count, _ = _chain(rows, gam, *self.d.draft_step(h, path), pick, expand)
        return toks, qs, count

    def root(self, rows: list, cur: torch.Tensor, room: int, width: int = 1):
        self.h, self.cur, self.s_root = torch.stack([r.h for r in rows]), cur, 0
        return self.d.logits_after(self.h, [cur]), None

    def expand(self, tokens: torch.Tensor, states, pos, mask, depth: int, paths: torch.Tensor):
        """paths (B, n, depth): each node's tokens from the root down -> its children's logits (B, n, V), None."""
        B, n = tokens.shape
        h = self.h[:, None].expand(-1, n, -1).reshape(B * n, -1)
        flat = paths.reshape(B * n, -1)
        logits = self.d.logits_after(h, [self.cur[:, None].expand(-1, n).reshape(-1), *flat.t()])
        return logits.view(B, n, -1), None

    def seek(self, slot: int) -> None:
        pass  # heads keep no cache of drafted nodes

    def root_pos(self, rows: list) -> torch.Tensor:
        return self.cur.new_zeros(len(rows))  # heads read no positions

    def static_tree(self, rows: list, cur: torch.Tensor, spec, anc, room: int):
        """Node i of every row is the ``ranks[i]``-th best token of its parent's distribution (``StaticKids``): one
        ``logits_after`` per distinct parent for all rows at once -> (tokens (B, N), q (B, N+1, V) or None)."""
        h = torch.stack([r.h for r in rows])
        tokens, kids = cur.new_zeros(len(rows), len(spec)), StaticKids(rows, spec)
        child = {}  # parent node (-1: the root) -> its children's logits (B, V)
        for i, par in enumerate(spec.parents):
            if par not in child:
                path, n = [], par
                while n >= 0:
                    path.append(tokens[:, n])
                    n = spec.parents[n]
                child[par] = self.d.logits_after(h, [cur, *reversed(path)])
            tokens[:, i] = kids.token(child[par], i)
        return tokens, kids.q()

    def commit_tree(self, rows: list, accepted: list, kept: list, captured: dict, cur=None) -> None:
        self.read_kept(rows, captured, kept)

    def commit(self, rows: list, cur, drafts: torch.Tensor, v, captured: dict) -> None:
        self.read_kept(rows, captured, v.kept)  # kept: cur and the accepted drafts

    def read_kept(self, rows: list, captured: dict, kept: list[list[int]]) -> None:
        """Read the target's states at each row's kept verify positions (kept[b], ascending) into the context."""
        hs = self.t.norm(captured[self.layers[0]])  # (B, W, D)
        if self.rc is None:
            out = self.d.read_context(hs)
            for b, r in enumerate(rows):
                r.h = out[b, kept[b][-1]]
            return
        seqs = [hs[b, k] for b, k in enumerate(kept)]
        x, valid, pos = aligned(seqs, [r.dpos for r in rows])
        self.rc.ensure(x.shape[1])
        out = self.d.read_context(x, self.rc.view, pos, valid)
        for b, (r, s) in enumerate(zip(rows, seqs)):
            r.h, r.dpos = out[b, -1], r.dpos + len(s)


class FeatureRows(_Rows):
    """EAGLE reads (feature f_i, token x_{i+1}) pairs: committed positions with the target's features from every
    verify (``capture_layers``, ``features``), drafted nodes with its own output state, which is what its
    training-time test simulates. So every step's root re-reads the accepted drafts with the real features, and
    drafted slots are rolled back (only committed pairs are ever kept). Per row: ``unread`` ids (k,) with
    ``feats`` (k + 1, F), the last feature pairing with cur."""

    reads_target = True
    passes_state = True  # a drafted node's output state is its children's input

    def __init__(self, target, drafter, max_len: int, stop=None):
        self.t, self.d, self.depth = target, drafter, float("inf")
        self.layers = drafter.capture_layers
        self.rc = RowCache(drafter.new_cache, max_len)
        self.caches = [self.rc]

    def join(self, rows: list, ids, valid, pos, captured: dict, live: list[int]) -> None:
        k, W = ids.shape
        f = self.d.features(captured, self.t)  # (k, W, F): pair i is (f_i, x_{i+1}) at i; the last waits for cur
        tmp = _unwrapped(self.d).new_cache(k, W - 1)
        if W > 1:  # a pair is valid where its feature is (a 1-token prompt has none)
            v = None if valid is None else valid[:, :-1]
            self.d.step(self.d.project(f[:, :-1]), ids[:, 1:], pos=pos[:, :-1], cache=tmp, last_only=True, valid=v)
        self.rc.join(tmp, live, W - 1)
        for j in live:
            rows[j].dpos, rows[j].unread, rows[j].feats = rows[j].prompt.numel() - 1, ids.new_empty(0), f[j, -1:]

    needs_paths = False  # expand reads each node's path (Falcon's blocks): the chain passes its drafts so far

    def draft(self, rows: list, cur: torch.Tensor, gam: list[int], pick):
        """Every row's chain: the root read, then one ``expand`` per fed draft (a one-node level with no mask),
        each drafted node's output state its child's input."""
        self.root_end = None
        if max(gam) == 0:
            return None
        logits, state = self.root(rows, cur, max(gam) - 1)
        base = torch.tensor([r.dpos for r in rows], device=cur.device)[:, None]
        carry, path = [state[:, None]], []  # (B, 1, S)

        def expand(tok, i):  # feeds draft i + 1
            paths = None
            if self.needs_paths:
                path.append(tok)
                paths = torch.stack(path, 1)[:, None]
            logits, out = self.expand(tok[:, None], carry[0], base + i, None, i + 1, paths)
            carry[0] = out
            return logits[:, -1], out[:, -1]

        toks, qs, count, _ = _chain(rows, gam, logits, state, pick, expand)
        return toks, qs, count

    def root(self, rows: list, cur: torch.Tensor, room: int, width: int = 1):
        seqs = [torch.cat([r.unread, cur[b : b + 1]]) for b, r in enumerate(rows)]
        starts = [r.dpos for r in rows]
        ids, valid, pos = aligned(seqs, starts)
        feats, _, _ = aligned([r.feats for r in rows], starts)
        self.rc.ensure(ids.shape[1] + room)
        logits, out = self.d.step(self.d.project(feats), ids, pos=pos, cache=self.rc.view, valid=valid, last_only=True)
        for r, s in zip(rows, seqs):
            r.dpos += len(s)
        self.s_root = self.root_end = self.rc.length
        return logits[:, -1], out[:, -1]

    def expand(self, tokens: torch.Tensor, states, pos: torch.Tensor, mask: torch.Tensor, depth: int, paths=None):
        return self.d.step(states, tokens, pos=pos, cache=self.rc.view, attn_mask=mask)

    def commit_tree(self, rows: list, accepted: list, kept: list, captured: dict, cur=None) -> None:
        f = self.d.features(captured, self.t)  # (B, W, F)
        if cur is not None:  # no tree was drafted: the new pairs queue up behind the unread ones
            for b, r in enumerate(rows):
                r.unread, r.feats = torch.cat([r.unread, cur[b : b + 1]]), torch.cat([r.feats, f[b, :1]])
            return
        self.rc.view.length = self.root_end  # drafted nodes are never kept
        for b, (r, a, k) in enumerate(zip(rows, accepted, kept)):
            r.unread, r.feats = a, f[b, k]

    def commit(self, rows: list, cur, drafts: torch.Tensor, v, captured: dict) -> None:
        f, n = self.d.features(captured, self.t), v.n  # (B, G+1, F)
        read = self.root_end is not None
        if read:
            self.rc.view.length = self.root_end  # drafted nodes are never kept: roll back every row at once
        for b, (r, m) in enumerate(zip(rows, n.tolist())):
            if not read:  # it read nothing this step: the new pairs queue up behind the unread ones
                r.unread, r.feats = torch.cat([r.unread, cur[b : b + 1]]), torch.cat([r.feats, f[b, :1]])
            else:
                r.unread, r.feats = drafts[b, :m], f[b, : m + 1]


class HybridRows(FeatureRows):
    """Gumiho (models/gumiho.py): ``FeatureRows`` for the serial part's S draft positions, then its M heads on the S
    (state, token) pairs of the path: feeding the depth-S node runs the heads once, and its descendants take their
    distributions from them (a head reads no draft after d_S). A node's state carries what its children need, one
    fixed width for every depth (the dynamic tree keeps one state tensor): [serial output state (d) | the path's
    pairs so far (S x w) | the heads' output states (M x d)], zeros where not yet known."""

    def __init__(self, target, drafter, max_len: int, stop=None):
        super().__init__(target, drafter, max_len, stop)
        (self.S, self.M), self.depth = drafter.drafts_hybrid, drafter.max_draft_len
        self.dim, self.w = drafter.cfg.dim, drafter.pair_width

    def root(self, rows: list, cur: torch.Tensor, room: int, width: int = 1):
        logits, out = super().root(rows, cur, room, width)
        return logits, torch.cat([out, out.new_zeros(*out.shape[:-1], self.S * self.w + self.M * self.dim)], -1)

    def expand(self, tokens: torch.Tensor, states, pos: torch.Tensor, mask, depth: int, paths=None):
        """Feed the depth-``depth`` nodes tokens (B, n) whose parents' states are ``states`` (B, n, C) -> their
        children's logits (B, n, V) and their own states (B, n, C)."""
        d, S, w, dim = self.d, self.S, self.w, self.dim
        if depth > S:  # below the depth-S node: its heads' next distribution, the state passed on as it is
            heads = states[..., dim + S * w :].unflatten(-1, (self.M, dim))
            return d.head_logits(heads[..., depth - S, :]), states
        out, pairs = states[..., :dim], states[..., dim : dim + S * w].clone()
        pairs[..., (depth - 1) * w : depth * w] = d.pair(tokens, out)
        if depth == S:
            heads = d.head_states(pairs)  # (B, n, M, d)
            return d.head_logits(heads[..., 0, :]), torch.cat([out, pairs, heads.flatten(-2)], -1)
        logits, nxt = d.step(out, tokens, pos=pos, cache=self.rc.view, attn_mask=mask)
        return logits, torch.cat([nxt, pairs, states[..., dim + S * w :]], -1)


class BlockFeatureRows(FeatureRows):
    """Falcon (models/falcon.py): ``FeatureRows``' committed pairs and one cache slot per drafted pair, written as
    EAGLE writes its nodes; a block's k outputs are queries over the cache (``read``) that write nothing. The root
    block is the last k committed pairs (``tail``: the k - 1 before the current token's pair, kept per row), its
    slot s drafting draft s + 1; the node at depth d, a multiple of k, reads the block of its path's last k pairs,
    whose slot s drafts d + s + 1. A node's state is its block's k predicted features (k x d): the input feature
    of each of its pairs and the distribution of the drafts up to the next block."""

    needs_paths = True

    def __init__(self, target, drafter, max_len: int, stop=None):
        super().__init__(target, drafter, max_len, stop)
        self.k, self.depth, self.dim = drafter.drafts_blocks, drafter.max_draft_len, drafter.cfg.dim

    def join(self, rows: list, ids, valid, pos, captured: dict, live: list[int]) -> None:
        super().join(rows, ids, valid, pos, captured, live)
        W, h = ids.shape[1], self.k - 1
        f = self.d.features(captured, self.t)
        for j in live:
            at = [i for i in range(max(0, W - 1 - h), W - 1) if valid is None or bool(valid[j, i])]  # (f_i, x_{i+1})
            rows[j].tail = ids[j, [i + 1 for i in at]], f[j, at]

    def root(self, rows: list, cur: torch.Tensor, room: int, width: int = 1):
        """Read the unread pairs and cur as ``FeatureRows`` does, then the block of the last k committed pairs:
        its outputs, the features of drafts 1..k -> draft 1's logits (B, V), the state (B, k x d)."""
        k, ids, feats = self.k, [], []
        for b, r in enumerate(rows):  # the block: the tail, the unread pairs, cur's pair; the last k of them
            t_ids = torch.cat([r.tail[0], r.unread, cur[b : b + 1]])[-k:]
            t_f = torch.cat([r.tail[1], r.feats])[-k:]
            r.tail = t_ids[-(k - 1) :], t_f[-(k - 1) :]  # with cur's pair: the next step's block
            pad = k - len(t_ids)  # a row with fewer than k pairs: queries in front that see every slot
            ids.append(torch.cat([t_ids.new_zeros(pad), t_ids]))
            feats.append(torch.cat([t_f.new_zeros(pad, t_f.shape[-1]), t_f]))
        super().root(rows, cur, room, width)
        ids, feats = torch.stack(ids), torch.stack(feats)
        pos = torch.tensor([r.dpos - k for r in rows], device=cur.device)[:, None] + torch.arange(k, device=cur.device)
        allowed = torch.ones(len(rows), k, self.rc.length, dtype=torch.bool, device=cur.device)
        out = self.d.read(self.d.project(feats), ids, pos, self.rc.view, allowed)  # (B, k, d)
        return self.d.logits(out[:, 0]), out.flatten(1)

    def expand(self, tokens: torch.Tensor, states, pos: torch.Tensor, mask, depth: int, paths=None):
        """Write the depth-``depth`` nodes' pairs (B, n) (input feature: their block's, from the parents' states);
        their children's logits from the block, or, at a block's last depth, from the next block read over the
        path's last k pairs (``paths`` (B, n, depth))."""
        d, k, dim = self.d, self.k, self.dim
        blk = states.unflatten(-1, (k, dim))  # (B, n, k, d): the features of drafts D+1..D+k
        at = (depth - 1) % k  # this node's slot in its block
        d.step(blk[:, :, at], tokens, pos=pos, cache=self.rc.view, attn_mask=mask)
        if at < k - 1:
            return d.logits(blk[:, :, at + 1]), states
        B, n = tokens.shape
        S = self.rc.length
        allowed = torch.ones(B, n, S, dtype=torch.bool, device=tokens.device) if mask is None else mask[:, :, :S]
        q_pos = pos[:, :, None] - (k - 1) + torch.arange(k, device=pos.device)
        out = d.read(
            blk.flatten(1, 2), paths[:, :, -k:].flatten(1), q_pos.flatten(1), self.rc.view,
            allowed.repeat_interleave(k, 1),
        ).unflatten(1, (n, k))  # fmt: skip
        return d.logits(out[:, :, 0]), out.flatten(2)


class _OneForward:
    """Proposers whose root forward drafts every position at once (``root`` keeps drafts 1..width's
    distributions in ``dists``): a chain feeds nothing after the root, and a tree's depth-d nodes all take the
    depth-d distribution."""

    def draft(self, rows: list, cur: torch.Tensor, gam: list[int], pick):
        G = max(gam)
        if G == 0:
            return None
        logits, _ = self.root(rows, cur, 0, G)

        def expand(tok, i):
            return self.dists[:, i + 1], None

        toks, qs, count, _ = _chain(rows, gam, logits, None, pick, expand)
        return toks, qs, count

    def expand(self, tokens: torch.Tensor, states, pos, mask, depth: int, paths=None):
        return self.dists[:, depth, None].expand(-1, tokens.shape[1], -1), None

    def seek(self, slot: int) -> None:
        pass  # drafted nodes are never written


class ParallelFeatureRows(_OneForward, FeatureRows):
    """P-EAGLE (models/eagle.py ``parallel``): EAGLE's committed pairs, read as ``FeatureRows`` reads them, with
    mask slots after the root's last pair in the same forward; slot j's logits are draft j + 1's distribution, none
    depending on another draft. Chains feed nothing after the root and a tree's depth-d nodes all take the depth-d
    distribution (as ``BlockRows``). The slots attend causally, so a shorter run of them drafts the same
    distributions: each step runs only as many as it takes. Mask slots are rolled back with every draft."""

    passes_state = False

    def __init__(self, target, drafter, max_len: int, stop=None):
        super().__init__(target, drafter, max_len, stop)
        self.depth = drafter.drafts_parallel

    def draft(self, rows: list, cur: torch.Tensor, gam: list[int], pick):
        self.root_end = None  # a step that drafts nothing reads nothing
        return super().draft(rows, cur, gam, pick)

    def root(self, rows: list, cur: torch.Tensor, room: int, width: int = 1):
        """The unread pairs and cur, then width - 1 mask slots at the following positions -> draft 1's logits
        (B, V), None; drafts 1..width's distributions kept in ``dists`` (B, width, V)."""
        seqs = [torch.cat([r.unread, cur[b : b + 1]]) for b, r in enumerate(rows)]
        starts = [r.dpos for r in rows]
        ids, valid, pos = aligned(seqs, starts)
        feats, _, _ = aligned([r.feats for r in rows], starts)
        B, n = ids.shape[0], width - 1
        ids = torch.cat([ids, ids.new_full((B, n), self.d.cfg.mask_id)], 1)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, n + 1, device=pos.device)], 1)
        if valid is not None:
            valid = torch.cat([valid, valid.new_ones(B, n)], 1)
        state = torch.cat([self.d.project(feats), self.d.mask_state((B, n)).to(feats.dtype)], 1)
        self.rc.ensure(ids.shape[1] + room)
        logits, _ = self.d.step(state, ids, pos=pos, cache=self.rc.view, valid=valid)
        for r, s in zip(rows, seqs):
            r.dpos += len(s)
        self.root_end = self.rc.length - n  # the mask slots are drafts: never kept
        self.s_root = self.rc.length
        self.dists = logits[:, -width:]
        return self.dists[:, 0], None


class BlockRows(_OneForward, _Rows):
    """DFlash (models/dflash.py). The drafter's context is the target's fused features at committed positions,
    read into its ``RowCache`` once they are committed (the prompt at ``join``, each verify's kept positions at
    ``commit``): it reads no tokens. A step's root runs the block [cur, mask, ...] at the next positions, whose
    slot j is draft j's distribution, none depending on another draft (as PARD's): chains feed nothing after the
    root, and a tree's depth-d nodes all take the depth-d distribution. Nothing drafted is ever written."""

    reads_target = True

    def __init__(self, target, drafter, max_len: int, stop=None):
        self.t, self.d, self.depth = target, drafter, drafter.max_draft_len
        self.layers = drafter.capture_layers
        self.rc = RowCache(drafter.new_cache, max_len)
        self.caches = [self.rc]

    def join(self, rows: list, ids, valid, pos, captured: dict, live: list[int]) -> None:
        k, W = ids.shape
        tmp = _unwrapped(self.d).new_cache(k, W)
        self.d.read_context(self.d.features(captured, self.t), tmp, pos, valid)  # every prompt position
        self.rc.join(tmp, live, W)
        for j in live:
            rows[j].dpos = rows[j].prompt.numel()

    def root(self, rows: list, cur: torch.Tensor, room: int, width: int = 1):
        """The whole trained block [cur, masks] at each row's next positions -> draft 1's logits (B, V), None; the
        distributions of drafts 1..width are kept in ``dists`` (B, width, V). The block is always as long as in
        training: its slots attend to each other, so a shorter one would change every draft's distribution (and
        a chain cut short by its budget or a stop rule would draft other tokens than a shorter draft length)."""
        B, dev, K = len(rows), cur.device, self.depth + 1
        ids = torch.cat([cur[:, None], cur.new_full((B, K - 1), self.d.cfg.mask_id)], 1)
        pos = torch.tensor([r.dpos for r in rows], device=dev)[:, None] + torch.arange(K, device=dev)
        self.dists = self.d.block(ids, pos, self.rc.view, n=width)
        self.s_root = self.rc.length
        return self.dists[:, 0], None

    def commit_tree(self, rows: list, accepted: list, kept: list, captured: dict, cur=None) -> None:
        self.read_kept(rows, captured, kept)

    def commit(self, rows: list, cur, drafts: torch.Tensor, v, captured: dict) -> None:
        self.read_kept(rows, captured, v.kept)  # kept: cur and the accepted drafts

    def read_kept(self, rows: list, captured: dict, kept: list[list[int]]) -> None:
        """The target's features at each row's kept verify positions join its context."""
        f = self.d.features(captured, self.t)  # (B, W, F)
        seqs = [f[b, k] for b, k in enumerate(kept)]
        x, valid, pos = aligned(seqs, [r.dpos for r in rows])
        self.rc.ensure(x.shape[1])
        self.d.read_context(x, self.rc.view, pos, valid)
        for r, sq in zip(rows, seqs):
            r.dpos += len(sq)


class TreeGraph:
    """Every level of a dynamic tree after the root, for a draft LM in a ``GraphedLlama``: the same
    ``tree_levels``, with the tree's first slot (``base``) held in a device tensor and each level's mask built
    over the whole static cache, so no shape or Python value depends on the step. On CUDA it is captured once per
    (drafter, tree spec) and replayed: one launch instead of a few hundred small kernels per tree (the eager tree
    was launch-bound on an H100, benchmarks/RESULTS.md). Elsewhere (``graphs=False``) it runs uncaptured, which is
    how the tests check it against the eager levels on CPU."""

    def __init__(self, model: GraphedLlama, spec: DynamicTree):
        self.model, self.spec = model, spec
        self.root = None  # the root's logits: allocated at the first call, from their shape
        self.base = torch.zeros((), dtype=torch.long, device=model._arange.device)
        self.run = SimpleNamespace(d=model, passes_state=False)
        self.graph, self.out = None, None
        self.capturing = model.graphs  # on CUDA; elsewhere the levels run uncaptured
        self.usable = True  # False once a capture failed: the caller drafts level by level instead

    @staticmethod
    def of(model: GraphedLlama, spec: DynamicTree) -> TreeGraph:
        graphs = model.__dict__.setdefault("_tree_graphs", {})
        if spec not in graphs:
            graphs[spec] = TreeGraph(model, spec)
        return graphs[spec]

    def _levels(self):
        levels = tree_levels(self.run, self.root[None], None, self.base, self.spec, self._level)
        return tuple(x[0] for x in levels[:4])

    def _level(self, run, tokens, states, d: int, base: torch.Tensor, n_fed: int, anc, paths):
        (k, m), tokens, anc = (tokens.shape[1], self.model), tokens[0], anc[0]
        mask = (m._arange < base).expand(k, -1).clone()  # the committed prefix, then this tree's slots
        mask[:, base + m._arange[: anc.shape[1]]] = anc
        pos = (base - 1 + d).expand(k)
        return _run_drafter(
            m, tokens.view(1, -1), cache=m._cache, pos=pos.view(1, -1), attn_mask=mask[None], s0=base + n_fed
        ), None

    def __call__(self, root_logits: torch.Tensor, base: int):
        if self.root is None:
            self.root = torch.empty_like(root_logits)
        self.root.copy_(root_logits)
        self.base.fill_(base)
        if not self.capturing:
            return self._levels()
        if self.graph is None:
            try:
                self.graph, self.out = self.model.capture(self._levels)
            except RuntimeError as e:  # an op of this drafter that cannot be captured: stay correct, say so once
                self.usable = False
                log.warning(
                    "dynamic tree: CUDA-graph capture failed (%s); drafting level by level instead",
                    str(e).splitlines()[0],
                )
                return self._levels()
        self.graph.replay()
        return tuple(t.clone() for t in self.out)  # the next replay overwrites the graph's outputs
