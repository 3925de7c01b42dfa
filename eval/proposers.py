"""Proposers: a drafter's side of a decode, one class per way a drafter reads the sequence. ``proposer_for`` is
the one place that maps a drafter to its proposer.

- ``TokenProposer``: a standalone draft LM (Llama-like: ``drafter(ids, cache=c)``, ``new_cache``), also with a
  reduced vocabulary (``d2t``); it reads tokens with its own KV cache.
- ``HeadProposer``: feature heads (Medusa, Hydra, MLP speculator: ``reads_target_hidden``); they read the target's
  final hidden state and keep no cache.
- ``FeatureProposer``: EAGLE (``reads_target_features``); it reads (target feature, token) pairs with its own cache.

The interface the loop (eval/decoder.py) and the shapes (eval/shapes.py) call:

- ``layers``: the target hidden states every target forward must capture for it (Llama ``capture_layers``);
  ``max_draft_len``: how deep it can draft (a heads drafter's head count); ``reads_target``.
- ``prefill(prompt, captured, max_len, check_vocab)``: after the target's prefill, whose captured states it reads.
- ``chain(cur, γ, pick)`` -> ``Draft``; ``static_tree(cur, spec, anc)`` -> node tokens; ``dynamic_tree(cur, spec)``
  -> (tokens, parents, mask, depths): one step's drafts for each shape. By default the shapes' own algorithms over
  the primitives ``root`` / ``expand`` (eval/shapes.py); heads draft chains and static trees their own way.
- ``commit(draft, accepted, keep, captured)``: after the verify. accepted (n,): the drafts kept; keep: the verify
  positions kept (cur first, then the accepted drafts); captured: the verify's states at all positions.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from types import SimpleNamespace

import torch

from draftsmith.eval.graphs import GraphedLlama
from draftsmith.eval.shapes import Draft, draft_chain, draft_dynamic, draft_static, tree_levels
from draftsmith.eval.tree import DynamicTree, TreeSpec

log = logging.getLogger(__name__)


def proposer_for(drafter) -> type[Proposer]:
    """The proposer class that decodes with ``drafter``: heads read the target's final hidden state, EAGLE its
    feature layers; anything else is a token drafter."""
    if getattr(drafter, "reads_target_hidden", False):
        return HeadProposer
    if getattr(drafter, "reads_target_features", False):
        return FeatureProposer
    if getattr(drafter, "parallel_drafts", 0):
        return PardProposer
    return TokenProposer


class Proposer:
    """What every proposer shares: the shapes' drafting algorithms over its ``root`` / ``expand``, and the chain's
    stop hook. Subclasses add ``prefill``, ``root``, ``expand`` and ``commit`` (module docstring)."""

    reads_target = False
    max_draft_len = math.inf
    layers: tuple[int, ...] = ()
    passes_state = False  # a drafted node's output state is its children's input (EAGLE)
    root_len: int | None = None  # the drafter's cache length after this step's root; None before it is read

    def __init__(self, target, drafter, stop=None):
        self.target, self.d, self.stop = target, drafter, stop  # stop: the chain's stop hook (shapes.draft_chain)

    def chain(self, cur: torch.Tensor, gamma: int, pick) -> Draft:
        return draft_chain(self, cur, gamma, pick, self.stop)

    def static_tree(self, cur: torch.Tensor, spec: TreeSpec, anc: torch.Tensor) -> torch.Tensor:
        return draft_static(self, cur, spec, anc)

    def dynamic_tree(self, cur: torch.Tensor, spec: DynamicTree):
        return draft_dynamic(self, cur, spec)


def _placed(pos, mask) -> dict:
    """A drafted node's RoPE positions and mask as the drafters' forwards take them (none: causal after the cache)."""
    return {**({} if pos is None else {"pos": pos.view(1, -1)}), **({} if mask is None else {"attn_mask": mask})}


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


class TokenProposer(Proposer):
    """A draft LM. Cache invariant: its cache holds every committed token except the current one and ``unread``,
    the tokens the next root reads first: after a chain step that kept all γ drafts, the last one (never fed);
    after a tree step, the accepted path (its nodes were drafted in tree slots, which are rolled back); after a
    step that drafted nothing, the current token too. Chains read the prompt at prefill, to check the vocabulary
    (drafters promise the plain Llama call only); trees read it with the first root."""

    def __init__(self, target, drafter, stop=None):
        super().__init__(target, drafter, stop)
        self.hidden = stop is not None and hasattr(drafter, "cfg")  # stop hooks see the drafter's final state

    def prefill(self, prompt: torch.Tensor, captured: dict, max_len: int, check_vocab: bool = False) -> None:
        self.cache, self.unread = self.d.new_cache(1, max_len), prompt[0]
        if check_vocab:  # draft ids are fed to the target as they are: the vocabularies must agree
            v_draft = _run_drafter(self.d, prompt, cache=self.cache).shape[-1]
            if v_draft != self.target.cfg.vocab_size:
                raise ValueError(f"drafter vocabulary {v_draft} != target vocabulary {self.target.cfg.vocab_size}")
            self.unread = prompt[0, :0]

    def _call(self, ids: torch.Tensor, **kw):
        """ids (T,) -> (logits (T, V), the final state after the norm at the last position (1, D) when a stop hook
        reads it, else None)."""
        if not self.hidden:
            return _run_drafter(self.d, ids.view(1, -1), cache=self.cache, **kw)[0], None
        L = self.d.cfg.n_layers
        logits, cap = _run_drafter(self.d, ids.view(1, -1), cache=self.cache, capture_layers=(L,), **kw)
        return logits[0], self.d.norm(cap[L][0, -1:])

    def root(self, cur: torch.Tensor):
        logits, hidden = self._call(torch.cat([self.unread, cur]))
        self.root_len = self.cache.length
        return logits[-1], None if hidden is None else hidden[-1]

    def expand(self, tokens: torch.Tensor, states, pos=None, mask=None, paths=None):
        return self._call(tokens, **_placed(pos, mask))

    def dynamic_tree(self, cur: torch.Tensor, spec: DynamicTree):
        """A draft LM in a ``GraphedLlama`` drafts every level after the root from one captured graph."""
        graphed = isinstance(self.d, GraphedLlama) and not self.hidden and self.cache is self.d._cache
        graph = TreeGraph.of(self.d, spec) if graphed else None
        if graph is None or not graph.usable:
            return super().dynamic_tree(cur, spec)
        root_logits, _ = self.root(cur)
        return graph(root_logits, self.cache.length)

    def commit(self, draft: Draft, accepted: torch.Tensor, keep: list[int], captured: dict) -> None:
        if self.root_len is None:  # it read nothing this step
            self.unread = torch.cat([self.unread, draft.cur, accepted])
            return
        kept = min(accepted.numel(), draft.fed)  # accepted drafts it read in order after the root (a chain's)
        self.cache.length = self.root_len + kept
        self.unread, self.root_len = accepted[kept:], None


class PardProposer(TokenProposer):
    """PARD (models/pard.py): every step is ONE drafter forward over (unread + cur + γ-1 mask tokens); its logits at
    cur and at mask i are the distributions of draft 1 and draft i+1, none depending on another draft. The mask
    slots are rolled back at once, so the cache invariant is TokenProposer's with nothing fed after the root: the
    accepted drafts become ``unread``. Chains pick each draft from its own distribution (stop hooks are asked as
    for any chain, over the precomputed distributions); a tree node at depth d is a top token of distribution d
    (static: the ranks[i]-th best; dynamic: EAGLE-2's scoring, children of every frontier node from the same
    distribution). Drafts at most ``pard_k`` deep, the distances it was trained for."""

    def __init__(self, target, drafter, stop=None):
        super().__init__(target, drafter, stop)
        self.max_draft_len, self.mask_id = drafter.parallel_drafts, drafter.cfg.mask_id
        self.width = 1  # distributions the next root reads: set by the shape before it

    def root(self, cur: torch.Tensor):
        n = self.width
        ids = torch.cat([self.unread, cur, cur.new_full((n - 1,), self.mask_id)]).view(1, -1)
        if self.hidden:
            L = self.d.cfg.n_layers
            logits, cap = _run_drafter(self.d, ids, cache=self.cache, capture_layers=(L,))
            self.states = self.d.norm(cap[L][0, -n:])
        else:
            logits, self.states = _run_drafter(self.d, ids, cache=self.cache), None
        self.logits, self.depth = logits[0, -n:], 0  # (n, V): draft i+1's distribution in row i
        self.cache.length -= n - 1  # the masks' slots: rolled back at once
        self.root_len = self.cache.length
        return self.logits[0], None if self.states is None else self.states[0]

    def expand(self, tokens: torch.Tensor, states, pos=None, mask=None, paths=None):
        """No forward: the next depth's distribution for every node (depth from ``paths`` in a dynamic tree,
        else the next one in a chain)."""
        self.depth = paths.shape[1] if paths is not None else self.depth + 1
        n = tokens.numel()
        st = None if self.states is None else self.states[self.depth].expand(n, -1)
        return self.logits[self.depth].expand(n, -1), st

    def chain(self, cur: torch.Tensor, gamma: int, pick) -> Draft:
        self.width = max(gamma, 1)
        return replace(draft_chain(self, cur, gamma, pick, self.stop), fed=0)  # no draft was fed

    def static_tree(self, cur: torch.Tensor, spec: TreeSpec, anc: torch.Tensor) -> torch.Tensor:
        self.width = max(spec.depths)
        self.root(cur)
        top = self.logits.topk(max(spec.ranks) + 1, -1).indices  # (depth, r)
        return top[torch.tensor(spec.depths, device=cur.device) - 1, torch.tensor(spec.ranks, device=cur.device)]

    def dynamic_tree(self, cur: torch.Tensor, spec: DynamicTree):
        self.width = spec.depth
        return draft_dynamic(self, cur, spec)


class FeatureProposer(Proposer):
    """EAGLE reads (feature f_i, token x_{i+1}) pairs: committed positions with the target's features from every
    target forward (``capture_layers``, ``features``), drafted nodes with its own output state, which is what its
    training-time test simulates. So every root re-reads the accepted drafts with the real features; drafted
    nodes are rolled back. Unread: ``ids`` (k,) with ``feats`` (k + 1, F), the last feature pairing with cur."""

    reads_target = True
    passes_state = True

    def __init__(self, target, drafter, stop=None):
        super().__init__(target, drafter, stop)
        self.layers = drafter.capture_layers

    def prefill(self, prompt: torch.Tensor, captured: dict, max_len: int, check_vocab: bool = False) -> None:
        self.cache = self.d.new_cache(1, max_len)
        self.ids, self.feats = prompt[0, 1:], self.d.features(captured, self.target)[0]  # pair i holds token i+1

    def _call(self, ids: torch.Tensor, states: torch.Tensor, **kw):
        logits, out = self.d.step(states[None], ids.view(1, -1), cache=self.cache, **kw)
        return logits[0], out[0]

    def root(self, cur: torch.Tensor):
        logits, out = self._call(torch.cat([self.ids, cur]), self.d.project(self.feats), last_only=True)
        self.root_len = self.cache.length
        return logits[-1], out[-1]

    def expand(self, tokens: torch.Tensor, states: torch.Tensor, pos=None, mask=None, paths=None):
        return self._call(tokens, states, last_only=False, **_placed(pos, mask))

    def commit(self, draft: Draft, accepted: torch.Tensor, keep: list[int], captured: dict) -> None:
        feats = self.d.features(captured, self.target)[0][keep]  # (n + 1, F): at cur and at the accepted drafts
        if self.root_len is None:  # it read nothing this step: the new pairs queue up behind the unread ones
            self.ids, self.feats = torch.cat([self.ids, draft.cur, accepted]), torch.cat([self.feats, feats])
            return
        self.cache.length, self.root_len = self.root_len, None
        self.ids, self.feats = accepted, feats


class HeadProposer(Proposer):
    """Feature heads draft from the context state at the position that produced cur: the target's final hidden
    state after its norm, through the drafter's context layer when it has one (Hydra++'s prefix attention reads
    only committed positions). Every target forward returns the next one, so the drafter runs no model of its own
    over the sequence and has no cache. Chains: ``propose``. Static trees: node (r1..rd) is the r_d-th best token of
    head d-1 after its ancestors' tokens, one ``logits_after`` per distinct parent. Dynamic trees: head d scores
    the children of every depth-d frontier node in one batched ``logits_after`` (``root`` / ``expand``)."""

    reads_target = True

    def __init__(self, target, drafter, stop=None):
        super().__init__(target, drafter, stop)
        self.max_draft_len, self.layers = drafter.max_draft_len, (target.cfg.n_layers,)
        self.cache = SimpleNamespace(length=0)  # written by dynamic-tree drafting, read by nothing

    def prefill(self, prompt: torch.Tensor, captured: dict, max_len: int, check_vocab: bool = False) -> None:
        self.context = self.d.new_context(max_len)
        self._read(captured[self.layers[0]][0])

    def _read(self, hs: torch.Tensor) -> None:
        """Final hidden states of newly committed positions (n, D) -> the context state at the last one, whose
        LM-head output is the current token."""
        self.h = self.d.read_context(self.target.norm(hs), self.context)[-1]

    def chain(self, cur: torch.Tensor, gamma: int, pick) -> Draft:
        drafts, q = self.d.propose(self.h, cur, gamma, pick, **({} if self.stop is None else {"stop": self.stop}))
        return Draft(cur, drafts, q)

    def static_tree(self, cur: torch.Tensor, spec: TreeSpec, anc: torch.Tensor) -> torch.Tensor:
        tokens = torch.zeros(len(spec), dtype=torch.long, device=cur.device)
        child_logits = {}  # parent node (-1 = root) -> logits of its children
        for i, (par, rank) in enumerate(zip(spec.parents, spec.ranks)):
            if par not in child_logits:
                path, n = [], par
                while n >= 0:
                    path.append(tokens[n : n + 1])
                    n = spec.parents[n]
                child_logits[par] = self.d.logits_after(self.h, [cur, *reversed(path)])
            tokens[i] = torch.topk(child_logits[par], rank + 1).indices[-1]
        return tokens

    def root(self, cur: torch.Tensor):
        self.cur = cur
        return self.d.logits_after(self.h, [cur]), None

    def expand(self, tokens: torch.Tensor, states, pos=None, mask=None, paths=None):
        n = paths.shape[0]  # the nodes' tokens from the root down
        return self.d.logits_after(self.h.expand(n, -1), [self.cur.expand(n), *paths.t()]), None

    def commit(self, draft: Draft, accepted: torch.Tensor, keep: list[int], captured: dict) -> None:
        self._read(captured[self.layers[0]][0, keep])


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
        return tuple(x[0] for x in tree_levels(self.run, self.root[None], None, self.base, self.spec, self._level))

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
