"""Tree speculative decoding, batch 1: static trees (Medusa-style choices) and EAGLE-2 dynamic trees, for draft
LMs, EAGLE drafters and feature heads, with one target forward under the tree mask per step and the target's KV
cache compacted to the accepted path (docs/algorithms.md A11). Lossless like the chain decoder in
eval/decoder.py, whose drafter runner (``_Drafting``), stats and token plumbing it shares.
"""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from draftsmith.eval.decoder import (
    DecodeStats,
    _Drafting,
    _emit,
    _pick,
    _prepare,
    _run_drafter,
    _sync,
    _target_pass,
    _with_hidden,
)
from draftsmith.eval.graphs import GraphedLlama
from draftsmith.eval.tree import (
    DynamicTree,
    TreeSpec,
    best_nodes,
    compact_cache,
    greedy_tree_accept,
    sample_tree_accept,
)
from draftsmith.kernels.tree import tree_mask
from draftsmith.models.sampling import process_logits

log = logging.getLogger(__name__)


class _HeadDrafting:
    """Feature heads behind ``_Drafting``'s interface, for dynamic trees: no cache to fill; a node's children are
    head d's logits after the node's path (``logits_after``), all frontier nodes of a level in one batched call."""
    eagle = False

    def __init__(self, drafter, h: torch.Tensor):
        self.d, self.h = drafter, h  # h (D,): the context state at the position that produced cur
        self.cache = SimpleNamespace(length=0)  # written by _draft_dynamic, read by nothing

    def root(self, cur: torch.Tensor):
        self.cur = cur
        return self.d.logits_after(self.h, [cur]), None

    def expand(self, tokens, states, pos=None, mask=None, paths=None):
        n = paths.shape[0]
        return self.d.logits_after(self.h.expand(n, -1), [self.cur.expand(n), *paths.t()]), None


def _draft_tree(run: _Drafting, cur: torch.Tensor, tree: TreeSpec, anc: torch.Tensor) -> torch.Tensor:
    """Greedy static-tree drafting -> node tokens (N,) in the tree's (depth-sorted) order.

    After the root, one forward per depth level over that level's nodes: node i sits at slot ``base + i`` and
    attends to the committed prefix and its ancestors (``anc`` = ancestor_mask). Node i's token is the
    ``ranks[i]``-th best of its parent's distribution. The deepest level is never fed (nothing below it is drafted).
    """
    device = cur.device
    root_logits, root_state = run.root(cur)
    logits, states = {-1: root_logits}, {-1: root_state}  # parent node -> its logits (V,) and state
    base = run.cache.length  # unpadded batch 1: slot index == RoPE position; the root is at base - 1
    depths = tree.depths
    tokens = torch.zeros(len(tree), dtype=torch.long, device=device)
    for d in range(1, max(depths) + 1):
        level = [i for i, di in enumerate(depths) if di == d]
        for i in level:
            tokens[i] = torch.topk(logits[tree.parents[i]], tree.ranks[i] + 1).indices[-1]
        if d == max(depths):
            break
        lo, hi = level[0], level[-1] + 1
        mask = torch.ones(1, hi - lo, base + hi, dtype=torch.bool, device=device)
        mask[0, :, base:] = anc[lo + 1:hi + 1, 1:hi + 1]
        pos = torch.full((hi - lo,), base - 1 + d, device=device)
        run.cache.length = base + lo  # levels are fed in order, so the cache ends where this level starts
        st = torch.stack([states[tree.parents[i]] for i in level]) if run.eagle else None
        out, out_st = run.expand(tokens[lo:hi], st, pos, mask)  # (n, V)
        logits.update({i: out[i - lo] for i in level})
        if run.eagle:
            states.update({i: out_st[i - lo] for i in level})
    return tokens


def _draft_dynamic(run: _Drafting, cur: torch.Tensor, spec: DynamicTree):
    """EAGLE-2 dynamic tree -> (node tokens (N,), parents (N,), tree mask (N+1, N+1), depths (N+1,)) in depth-sorted
    order, mask and depths as kernels/tree.py ``tree_mask`` gives them.

    Root: the drafter's top-k tokens. Each level: feed the k frontier nodes in one forward (tree mask: committed
    prefix + own ancestors), score their top-k children by cumulative log-prob, keep the k best as the next
    frontier. Finally keep the ``total_tokens`` best of all recorded nodes. Every shape is fixed by (k, depth), so
    the whole step stays on the device with no host sync: node ids are assigned level by level (children after
    their parents), an ancestor matrix grows with them, and a stable sort by score ranks them. A draft LM wrapped
    for CUDA graphs (eval/graphs.py) drafts every level after the root from one captured graph (``TreeGraph``).
    """
    root_logits, root_state = run.root(cur)
    base = run.cache.length  # the root (current token) sits at slot base - 1; slot index == position
    if isinstance(run.d, GraphedLlama) and root_state is None and run.cache is run.d._cache:
        graph = TreeGraph.of(run.d, spec)
        if graph.usable:
            return graph(root_logits, base)
    return _tree_levels(run, root_logits, root_state, base, spec, _level)


def _level(run, tokens, states, d: int, base: int, n_fed: int, anc, paths):
    """One level of a dynamic tree: the k frontier nodes in one forward, after the n_fed nodes already in the
    cache; anc (k, n_fed + k) is their ancestor mask over the tree slots."""
    k = tokens.numel()
    mask = torch.cat([torch.ones(k, base, dtype=torch.bool, device=tokens.device), anc], 1)
    run.cache.length = base + n_fed
    pos = torch.full((k,), base - 1 + d, device=tokens.device)
    return run.expand(tokens, states, pos, mask[None], paths=paths)


def _tree_levels(run, root_logits, root_state, base, spec: DynamicTree, level):
    """The levels and the final selection of ``_draft_dynamic``; ``level`` runs the drafter on a frontier."""
    k, device = spec.top_k, root_logits.device
    n_max = k + (spec.depth - 1) * k * k
    top = torch.log_softmax(root_logits.float(), -1).topk(k)
    tok = torch.zeros(n_max, dtype=torch.long, device=device)
    score = torch.full((n_max,), float("-inf"), device=device)
    par = torch.full((n_max,), -1, dtype=torch.long, device=device)
    depth = torch.ones(n_max, dtype=torch.long, device=device)
    anc = torch.eye(n_max, dtype=torch.bool, device=device)  # row n: n and its ancestors (root excluded)
    tok[:k], score[:k] = top.indices, top.values
    state = root_state.expand(n_max, -1).clone() if run.eagle else None  # each node's input: its parent's output
    path = torch.zeros(n_max, spec.depth, dtype=torch.long, device=device)  # node tokens from the root down
    path[:k, 0] = top.indices
    frontier = torch.arange(k, device=device)
    fed = frontier[:0]  # node ids in slot order after base
    for d in range(1, spec.depth):
        order = torch.cat([fed, frontier])
        out, out_st = level(run, tok[frontier], state[frontier] if run.eagle else None, d, base, fed.numel(),
                            anc[frontier][:, order], path[frontier, :d])  # (k, V)
        fed = order
        cv, ci = torch.log_softmax(out.float(), -1).topk(k, -1)  # (k, k)
        new = torch.arange(k + (d - 1) * k * k, k + d * k * k, device=device)  # children, row by row
        tok[new], score[new] = ci.flatten(), (score[frontier, None] + cv).flatten()
        par[new] = frontier.repeat_interleave(k)
        depth.index_fill_(0, new, d + 1)  # a scalar through index_put_ would be a host copy (no CUDA graph)
        path[new] = path[par[new]]
        path[new, d] = tok[new]
        anc[new] |= anc[par[new]]
        if run.eagle:
            state[new] = out_st.repeat_interleave(k, 0)
        frontier = new[score[new].topk(k).indices]
    keep = best_nodes(score, depth, min(spec.total_tokens, n_max))  # ancestor-closed, parents first
    index = torch.full((n_max,), -1, dtype=torch.long, device=device)
    index[keep] = torch.arange(keep.numel(), device=device)
    parents = torch.where(par[keep] >= 0, index[par[keep].clamp_min(0)], -1)
    n = keep.numel()
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=device)
    mask[:, 0] = True
    mask[1:, 1:] = anc[keep][:, keep]
    depths = torch.cat([depth.new_zeros(1), depth[keep]]).int()
    return tok[keep], parents, mask, depths


class TreeGraph:
    """Every level of a dynamic tree after the root, for a draft LM in a ``GraphedLlama``: the same
    ``_tree_levels``, with the tree's first slot (``base``) held in a device tensor and each level's mask built
    over the whole static cache, so no shape or Python value depends on the step. On CUDA it is captured once per
    (drafter, tree spec) and replayed: one launch instead of a few hundred small kernels per tree (the eager tree
    was launch-bound on an H100, benchmarks/RESULTS.md). Elsewhere (``graphs=False``) it runs uncaptured, which is
    how the tests check it against the eager levels on CPU."""

    def __init__(self, model: GraphedLlama, spec: DynamicTree):
        self.model, self.spec = model, spec
        self.root = None  # the root's logits: allocated at the first call, from their shape
        self.base = torch.zeros((), dtype=torch.long, device=model._arange.device)
        self.run = SimpleNamespace(d=model, eagle=False)
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
        return _tree_levels(self.run, self.root, None, self.base, self.spec, self._level)

    def _level(self, run, tokens, states, d: int, base: torch.Tensor, n_fed: int, anc, paths):
        k, m = tokens.numel(), self.model
        mask = (m._arange < base).expand(k, -1).clone()  # the committed prefix, then this tree's slots
        mask[:, base + m._arange[:anc.shape[1]]] = anc
        pos = (base - 1 + d).expand(k)
        return _run_drafter(m, tokens.view(1, -1), cache=m._cache, pos=pos.view(1, -1), attn_mask=mask[None],
                            s0=base + n_fed)[0], None

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
                log.warning("dynamic tree: CUDA-graph capture failed (%s); drafting level by level instead",
                            str(e).splitlines()[0])
                return self._levels()
        self.graph.replay()
        return tuple(t.clone() for t in self.out)  # the next replay overwrites the graph's outputs


@torch.no_grad()
def tree_speculative_generate(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int,
                              tree: TreeSpec | DynamicTree, *,
                              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                              eos_ids: set[int] | None = None,
                              generator: torch.Generator | None = None, on_token=None) -> tuple[list[int], DecodeStats]:
    """Tree speculative decoding, batch 1, over a static tree (``tree_from_choices``) or an EAGLE-2-style
    ``DynamicTree`` rebuilt every step from the drafter's confidence.

    Each step drafts the whole tree (children are the drafter's top-k tokens), verifies it in one target forward
    under the tree mask, and compacts the target KV cache to the accepted path. Greedy: the deepest path whose
    tokens are the target's argmax; output equals the target's greedy decoding token for token. Sampling: the
    point-mass rule of ``sample_tree_accept``; output follows the target's processed distribution. The drafter
    re-reads the accepted path next step (its cache is rolled back to the root), keeping it trivially consistent.
    """
    if getattr(drafter, "reads_target_hidden", False):
        return _head_tree(target, drafter, prompt_ids, max_new_tokens, tree, temperature, top_k, top_p, eos_ids,
                          generator, on_token)
    dynamic, stats, prompt, parents, anc, depths, max_len = _tree_setup(target, prompt_ids, max_new_tokens, tree)
    if max_new_tokens <= 0:
        return [], stats
    device = prompt.device
    tcache = target.new_cache(1, max_len)
    last = torch.zeros_like(prompt, dtype=torch.bool)
    last[:, -1] = True
    logits, feats = _target_pass(target, drafter, prompt, tcache, logits_at=last)
    cur, _ = _pick(logits[-1], temperature, top_k, top_p, generator)  # (1,)
    run = _Drafting(drafter, max_len, prompt[0], feats)  # the drafter has seen nothing yet
    out: list[int] = []
    done = _emit(out, [int(cur)], eos_ids, max_new_tokens, on_token)
    while not done:
        t0 = time.perf_counter()
        if dynamic:
            tokens, parents, anc, depths = _draft_dynamic(run, cur, tree)
        else:
            tokens = _draft_tree(run, cur, tree, anc)
        _sync(device)
        t1 = time.perf_counter()
        t_len = tcache.length
        mask = torch.ones(1, len(tokens) + 1, t_len + len(tokens) + 1, dtype=torch.bool, device=device)
        mask[0, :, t_len:] = anc
        logits, feats = _target_pass(target, drafter, torch.cat([cur, tokens]).view(1, -1), tcache,
                                     pos=(t_len + depths).view(1, -1), attn_mask=mask)
        path, nxt = _tree_accept(tokens, parents, logits[0], temperature, top_k, top_p, generator)  # (N+1, V)
        t2 = time.perf_counter()
        keep = [0] + [i + 1 for i in path]  # cur and the accepted path
        compact_cache(tcache, t_len, keep)
        accepted = tokens[path]
        run.commit(accepted, None if feats is None else feats[keep])
        cur = tokens.new_tensor([nxt])
        done = _emit(out, accepted.tolist() + [nxt], eos_ids, max_new_tokens, on_token)
        stats.step(len(tokens), len(path), t1 - t0, t2 - t1)
    stats.new_tokens = len(out)
    return out, stats


@torch.no_grad()
def _static_head_tree(drafter, h_cur: torch.Tensor, cur: torch.Tensor, tree: TreeSpec) -> torch.Tensor:
    """Node tokens (N,) of a static tree drafted by heads: one ``logits_after`` call per distinct parent."""
    tokens = torch.zeros(len(tree), dtype=torch.long, device=cur.device)
    child_logits = {}  # parent node (-1 = root) -> logits of its children
    for i, (par, rank) in enumerate(zip(tree.parents, tree.ranks)):
        if par not in child_logits:
            path, n = [], par
            while n >= 0:
                path.append(tokens[n:n + 1])
                n = tree.parents[n]
            child_logits[par] = drafter.logits_after(h_cur, [cur, *reversed(path)])
        tokens[i] = torch.topk(child_logits[par], rank + 1).indices[-1]
    return tokens


def _most_nodes(tree: TreeSpec | DynamicTree) -> int:
    """The most draft nodes one step can hold (KV-cache room): every node a dynamic tree records, or the tree."""
    if isinstance(tree, DynamicTree):
        return tree.top_k + (tree.depth - 1) * tree.top_k ** 2
    return len(tree)


def _tree_setup(target, prompt_ids, max_new_tokens: int, tree: TreeSpec | DynamicTree):
    """What both tree decoders set up before the prefill -> (dynamic, stats, prompt (1, P) or None when nothing is
    to be generated, parents, ancestor mask, depths (static trees; None for dynamic ones), KV-cache length)."""
    dynamic = isinstance(tree, DynamicTree)
    max_depth = tree.depth if dynamic else max(tree.depths)
    stats = DecodeStats(accept_counts=[0] * (max_depth + 1))
    if max_new_tokens <= 0:
        return dynamic, stats, None, None, None, None, 0
    prompt = _prepare(target, prompt_ids)
    parents = anc = depths = None
    if not dynamic:
        parents = torch.tensor(tree.parents, dtype=torch.long, device=prompt.device)
        anc, depths = tree_mask(parents)  # (N+1, N+1) ancestors, (N+1,) depths, root first
    max_len = prompt.shape[1] + max_new_tokens + _most_nodes(tree) + max_depth + 2
    return dynamic, stats, prompt, parents, anc, depths, max_len


def _tree_accept(tokens, parents, logits, temperature, top_k, top_p, generator) -> tuple[list[int], int]:
    """Greedy (deepest argmax path) or point-mass sampling verification of a tree -> (accepted path, next)."""
    if temperature <= 0:
        return greedy_tree_accept(tokens, parents, logits)
    return sample_tree_accept(tokens, parents, process_logits(logits, temperature, top_k, top_p), generator)


def _head_tree(target, drafter, prompt_ids, max_new_tokens, tree: TreeSpec | DynamicTree, temperature, top_k,
               top_p, eos_ids, generator, on_token=None) -> tuple[list[int], DecodeStats]:
    """Tree decoding with feature heads. Static (Medusa-style) trees: node (r1..rd) is the r_d-th best token of
    head d-1 after its ancestors' tokens. Dynamic trees: EAGLE-2's expansion by cumulative draft log-prob
    (``_draft_dynamic``), head d scoring the children of every depth-d frontier node. One target forward under the
    tree mask verifies all nodes and returns the hidden state of the last accepted node for the next step. No
    drafter cache at all (Hydra++'s prefix layer reads only committed positions)."""
    max_depth = tree.depth if isinstance(tree, DynamicTree) else max(tree.depths)
    if max_depth > drafter.max_draft_len:
        raise ValueError(f"tree depth {max_depth} exceeds the drafter's {drafter.max_draft_len} heads")
    dynamic, stats, prompt, parents, anc, depths, max_len = _tree_setup(target, prompt_ids, max_new_tokens, tree)
    if max_new_tokens <= 0:
        return [], stats
    device = prompt.device
    tcache, context = target.new_cache(1, max_len), drafter.new_context(max_len)
    last = torch.zeros_like(prompt, dtype=torch.bool)
    last[:, -1] = True
    logits, h = _with_hidden(target, prompt, tcache, logits_at=last)
    h_cur = drafter.read_context(h[0], context)[-1]
    cur, _ = _pick(logits[-1], temperature, top_k, top_p, generator)
    out: list[int] = []
    done = _emit(out, [int(cur)], eos_ids, max_new_tokens, on_token)
    while not done:
        t0 = time.perf_counter()
        if dynamic:
            tokens, parents, anc, depths = _draft_dynamic(_HeadDrafting(drafter, h_cur), cur, tree)
        else:
            tokens = _static_head_tree(drafter, h_cur, cur, tree)
        _sync(device)
        t1 = time.perf_counter()
        t_len = tcache.length
        mask = torch.ones(1, len(tokens) + 1, t_len + len(tokens) + 1, dtype=torch.bool, device=device)
        mask[0, :, t_len:] = anc
        L = target.cfg.n_layers
        logits, cap = target(torch.cat([cur, tokens]).view(1, -1), pos=(t_len + depths).view(1, -1), cache=tcache,
                             attn_mask=mask, capture_layers=(L,))
        logits = logits[0]
        path, nxt = _tree_accept(tokens, parents, logits, temperature, top_k, top_p, generator)
        t2 = time.perf_counter()
        keep = [0] + [i + 1 for i in path]  # cur and the accepted path; the last one's LM-head output is nxt
        h_cur = drafter.read_context(target.norm(cap[L][0, keep]), context)[-1]
        compact_cache(tcache, t_len, keep)
        accepted = tokens[path]
        cur = tokens.new_tensor([nxt])
        done = _emit(out, accepted.tolist() + [nxt], eos_ids, max_new_tokens, on_token)
        stats.step(len(tokens), len(path), t1 - t0, t2 - t1)
    stats.new_tokens = len(out)
    return out, stats
