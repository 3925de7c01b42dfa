"""What one decoding step drafts and verifies (docs/algorithms.md A1, A11): a chain of up to γ drafts, a static tree
(``TreeSpec``, Medusa-style choices) or an EAGLE-2 dynamic tree (``DynamicTree``) rebuilt every step from the
drafter's confidence. A shape drafts through a proposer (eval/proposers.py), places its nodes for the target's one
verify forward (none for a chain; a tree mask and RoPE positions for a tree) and accepts by its rule: the chain's
greedy prefix or rejection sampling, a tree's deepest argmax path or point-mass walk, or lossy judge verification
(``Judged``, the judge hook). The loop that runs them is eval/decoder.py ``speculative_generate``.

The drafting algorithms here are generic over a proposer's two primitives: ``root(cur)`` reads what the drafter
has not seen yet plus the current token and returns the root's logits (V,) and state (EAGLE's output; a token
drafter's final hidden state when a stop hook asks for it; else None); ``expand(tokens, states, pos, mask, paths)``
runs drafted nodes after it -> (logits (n, V), states or None). ``cache.length`` is where the next node's slot is
(batch 1, unpadded: slot index == RoPE position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.eval.accept import Sampler, greedy_accept, judge_accept, rejection_accept
from draftsmith.eval.tree import DynamicTree, TreeSpec, best_nodes, greedy_tree_accept, sample_tree_accept
from draftsmith.kernels.tree import tree_mask
from draftsmith.models.feature_heads import first_stop, split_stop


@dataclass
class Draft:
    """One step's proposal after the current token ``cur`` (1,). tokens (N,): the drafts (a tree's nodes in
    depth-sorted order). q (N, V): the distributions chain drafts were sampled from (None when greedy, or for a
    tree). parents (N,), anc (N+1, N+1), depths (N+1,): a tree's structure, root first (None for a chain). fed: how
    many chain drafts the drafter has read, in order after the root (its cache may keep the accepted ones)."""

    cur: torch.Tensor
    tokens: torch.Tensor
    q: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    anc: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    fed: int = 0


# ---- shapes -----------------------------------------------------------------------------------------------------


class Chain:
    """Up to ``draft_len`` drafts in a row; a drafter's own cap (a heads drafter's head count) bounds it."""

    layers: tuple[int, ...] = ()  # target states the verify must capture for the acceptance rule

    def __init__(self, draft_len: int, max_draft_len, sampler: Sampler):
        if draft_len < 0:
            raise ValueError(f"draft_len must be >= 0, got {draft_len}")
        self.depth = min(draft_len, max_draft_len)  # the longest accepted run: DecodeStats.accept_counts' range
        self.room = self.depth  # KV-cache slots a step may fill beyond the tokens it keeps
        self.sampler = sampler

    def draft(self, proposer, cur: torch.Tensor, budget: int) -> Draft:
        # A step emits at most γ+1 tokens: never overshoot max_new_tokens (this also bounds the caches).
        return proposer.chain(cur, min(self.depth, budget), self.sampler.pick)

    def placement(self, draft: Draft, t_len: int) -> dict:
        return {}  # causal, right after the cache

    def accept(self, draft: Draft, logits: torch.Tensor, captured: dict):
        """The chain rule on the verify logits (γ+1, V) -> (accepted drafts (n,), the verify positions kept (cur
        and them), next token, 0 judged)."""
        s = self.sampler
        if s.greedy:
            n, nxt = greedy_accept(draft.tokens, logits, s.impl)
        else:
            p = s.probs(logits)  # (γ+1, V), same processing as the drafts (B7.2)
            q = p.new_empty(0, p.shape[-1]) if draft.q is None else draft.q  # γ = 0: the "bonus" is a plain sample
            n, nxt = rejection_accept(draft.tokens, q, p, s.generator, s.impl)
        return draft.tokens[:n], list(range(n + 1)), nxt, 0


class Judged(Chain):
    """**Lossy** Judge-Decoding verification (models/judge.py ``Judge``), greedy chains of a draft LM: a draft the
    target would not have chosen is still kept when the judge accepts the target's final state at it
    (``judge_accept``). The verify forward also returns those states."""

    def __init__(self, draft_len: int, max_draft_len, sampler: Sampler, judge, target):
        super().__init__(draft_len, max_draft_len, sampler)
        self.judge, self.norm, self.layers = judge, target.norm, (target.cfg.n_layers,)

    def accept(self, draft: Draft, logits: torch.Tensor, captured: dict):
        states = self.norm(captured[self.layers[0]])  # (1, γ+1, D) after the final norm
        n, nxt, judged = judge_accept(draft.tokens, logits, self.judge.accepts(states[0, 1:]))
        return draft.tokens[:n], list(range(n + 1)), nxt, judged


class _Tree:
    """What static and dynamic trees share: the verify under the tree mask, and the tree acceptance rules."""

    layers: tuple[int, ...] = ()
    sampler: Sampler
    depth: int

    def _check(self, max_draft_len) -> None:
        if self.depth > max_draft_len:
            raise ValueError(f"tree depth {self.depth} exceeds the drafter's {max_draft_len} heads")

    def placement(self, draft: Draft, t_len: int) -> dict:
        """Each node attends to the committed prefix and its own ancestors, at RoPE position slot(cur) + depth."""
        n = draft.tokens.numel()
        mask = torch.ones(1, n + 1, t_len + n + 1, dtype=torch.bool, device=draft.tokens.device)
        mask[0, :, t_len:] = draft.anc
        return {"pos": (t_len + draft.depths).view(1, -1), "attn_mask": mask}

    def accept(self, draft: Draft, logits: torch.Tensor, captured: dict):
        """Greedy (deepest argmax path) or point-mass sampling over the tree (N+1, V) -> (the accepted path's
        tokens, the verify positions kept: the root and the path, next token, 0 judged)."""
        s = self.sampler
        if s.greedy:
            path, nxt = greedy_tree_accept(draft.tokens, draft.parents, logits)
        else:
            path, nxt = sample_tree_accept(draft.tokens, draft.parents, s.probs(logits), s.generator)
        return draft.tokens[path], [0] + [i + 1 for i in path], nxt, 0


class StaticTree(_Tree):
    """The same tree every step; node i is the ``ranks[i]``-th best child of its parent."""

    def __init__(self, spec: TreeSpec, max_draft_len, sampler: Sampler, device):
        self.spec, self.sampler, self.depth = spec, sampler, max(spec.depths)
        self._check(max_draft_len)
        self.room = len(spec) + self.depth
        self.parents = torch.tensor(spec.parents, dtype=torch.long, device=device)
        self.anc, self.depths = tree_mask(self.parents)  # (N+1, N+1) ancestors, (N+1,) depths, root first

    def draft(self, proposer, cur: torch.Tensor, budget: int) -> Draft:
        tokens = proposer.static_tree(cur, self.spec, self.anc)
        return Draft(cur, tokens, parents=self.parents, anc=self.anc, depths=self.depths)


class DynamicShape(_Tree):
    """EAGLE-2's tree, rebuilt every step from the drafter's cumulative log-probs (``draft_dynamic``)."""

    def __init__(self, spec: DynamicTree, max_draft_len, sampler: Sampler):
        self.spec, self.sampler, self.depth = spec, sampler, spec.depth
        self._check(max_draft_len)
        self.room = spec.top_k + (spec.depth - 1) * spec.top_k**2 + self.depth  # every node a step records

    def draft(self, proposer, cur: torch.Tensor, budget: int) -> Draft:
        tokens, parents, anc, depths = proposer.dynamic_tree(cur, self.spec)
        return Draft(cur, tokens, parents=parents, anc=anc, depths=depths)


def shape_for(target, proposer, tree: TreeSpec | DynamicTree | None, draft_len: int, sampler: Sampler, judge=None):
    """The step's shape: a chain (``tree`` None, verified by the judge when one is given) or a tree. Refuses
    combinations that are not implemented: a judge outside greedy chains of a draft LM, a stop hook on a tree."""
    if judge is not None and (not sampler.greedy or proposer.reads_target or tree is not None):
        raise ValueError("judge verification is implemented for greedy chain decoding with a standalone draft LM")
    if tree is None:
        if judge is None:
            return Chain(draft_len, proposer.max_draft_len, sampler)
        return Judged(draft_len, proposer.max_draft_len, sampler, judge, target)
    if proposer.stop is not None:
        raise ValueError("stop_drafting adapts a chain's length; tree decoding takes no stop hook")
    if isinstance(tree, DynamicTree):
        return DynamicShape(tree, proposer.max_draft_len, sampler)
    return StaticTree(tree, proposer.max_draft_len, sampler, next(target.parameters()).device)


# ---- drafting, generic over a proposer's root / expand ------------------------------------------------------------


def draft_chain(run, cur: torch.Tensor, gamma: int, pick, stop=None) -> Draft:
    """Up to γ drafts in a row. γ = 0 drafts nothing and runs nothing (the verify is a plain target step).

    The last draft is never fed: the verify decides whether it survives. ``stop(n, logits, state)`` (adaptive
    draft length: SpecDec++, entropy, confidence rules) is asked once the drafter has read draft n < γ: logits (V,)
    its distribution for the next token, state its state at draft n's position; True ends the block with n drafts.
    It is first asked at n = 1, or at n = 0 (the drafter has just read the current token) when the hook's
    ``min_len`` is 0: stopping there drafts nothing. A hook with ``before_feed`` is asked instead right after
    draft n < γ is picked, with the logits and state that produced it and the draft: ``stop(n, logits, state,
    token)``; stopping there costs no drafter forward. pick(logits) -> (token (1,), q (V,) or None).
    """
    if gamma == 0:
        return Draft(cur, cur.new_empty(0))
    logits, state = run.root(cur)
    drafts, qs, fed = [], [], 0
    after, before = split_stop(stop)
    first = first_stop(after)
    for i in range(gamma):
        if after is not None and i >= first and after(i, logits, state):
            break
        tok, q = pick(logits)
        drafts.append(tok)
        qs.append(q)
        if before is not None and i + 1 < gamma and before(i + 1, logits, state, tok):
            break  # draft i + 1 was never fed: the verify decides whether it survives, as at the cap
        if i + 1 < gamma:
            out, st = run.expand(tok, None if state is None else state[None])
            logits, state, fed = out[-1], None if st is None else st[-1], fed + 1
    q = torch.stack(qs) if drafts and qs[0] is not None else None  # (γ, V)
    return Draft(cur, torch.cat(drafts) if drafts else cur.new_empty(0), q, fed=fed)


def draft_static(run, cur: torch.Tensor, tree: TreeSpec, anc: torch.Tensor) -> torch.Tensor:
    """Greedy static-tree drafting -> node tokens (N,) in the tree's (depth-sorted) order.

    After the root, one forward per depth level over that level's nodes: node i sits at slot ``base + i`` and
    attends to the committed prefix and its ancestors (``anc`` = ancestor_mask). Node i's token is the
    ``ranks[i]``-th best of its parent's distribution. The deepest level is never fed (nothing below it is drafted).
    """
    device = cur.device
    root_logits, root_state = run.root(cur)
    logits, states = {-1: root_logits}, {-1: root_state}  # parent node -> its logits (V,) and state
    base = run.cache.length  # the root is at base - 1
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
        mask[0, :, base:] = anc[lo + 1 : hi + 1, 1 : hi + 1]
        pos = torch.full((hi - lo,), base - 1 + d, device=device)
        run.cache.length = base + lo  # levels are fed in order, so the cache ends where this level starts
        st = torch.stack([states[tree.parents[i]] for i in level]) if run.passes_state else None
        out, out_st = run.expand(tokens[lo:hi], st, pos, mask)  # (n, V)
        logits.update({i: out[i - lo] for i in level})
        if run.passes_state:
            states.update({i: out_st[i - lo] for i in level})
    return tokens


def draft_dynamic(run, cur: torch.Tensor, spec: DynamicTree):
    """EAGLE-2 dynamic tree -> (node tokens (N,), parents (N,), tree mask (N+1, N+1), depths (N+1,)) in depth-sorted
    order, mask and depths as kernels/tree.py ``tree_mask`` gives them.

    Root: the drafter's top-k tokens. Each level: feed the k frontier nodes in one forward (tree mask: committed
    prefix + own ancestors), score their top-k children by cumulative log-prob, keep the k best as the next
    frontier. Finally keep the ``total_tokens`` best of all recorded nodes. Every shape is fixed by (k, depth), so
    the whole step stays on the device with no host sync (``tree_levels``, here with one row).
    """
    root_logits, root_state = run.root(cur)
    state = None if root_state is None else root_state[None]
    out = tree_levels(run, root_logits[None], state, run.cache.length, spec, feed_level)
    return tuple(x[0] for x in out)


def feed_level(run, tokens, states, d: int, base: int, n_fed: int, anc, paths):
    """One level of a batch-1 dynamic tree: the k frontier nodes (1, k) in one forward, after the n_fed nodes
    already in the cache; anc (1, k, n_fed + k) is their ancestor mask over the tree slots."""
    k = tokens.shape[1]
    mask = torch.cat([torch.ones(k, base, dtype=torch.bool, device=tokens.device), anc[0]], 1)
    run.cache.length = base + n_fed
    pos = torch.full((k,), base - 1 + d, device=tokens.device)
    out, st = run.expand(tokens[0], None if states is None else states[0], pos, mask[None], paths=paths[0])
    return out[None], None if st is None else st[None]


def tree_levels(run, root_logits, root_state, base, spec: DynamicTree, level):
    """The levels and the final selection of a dynamic tree for B rows at once: root_logits (B, V), root_state
    (B, S) or None -> (tokens (B, N), parents (B, N), tree mask (B, N+1, N+1), depths (B, N+1)); every row's tree
    has the same N. ``level(run, tokens (B, k), states, d, base, n_fed, anc (B, k, n_fed + k), paths (B, k, d))``
    runs the drafter on a frontier -> (logits (B, k, V), states or None). Node ids are assigned level by level
    (children after their parents), an ancestor matrix grows with them, and a stable sort by score ranks them;
    ``base`` (the root's slot + 1) may be a device tensor (proposers.py ``TreeGraph``)."""
    k, device, B = spec.top_k, root_logits.device, root_logits.shape[0]
    n_max = k + (spec.depth - 1) * k * k
    rows = torch.arange(B, device=device)[:, None]
    top = torch.log_softmax(root_logits.float(), -1).topk(k)
    tok = torch.zeros(B, n_max, dtype=torch.long, device=device)
    score = torch.full((B, n_max), float("-inf"), device=device)
    par = torch.full((B, n_max), -1, dtype=torch.long, device=device)
    depth = torch.ones(B, n_max, dtype=torch.long, device=device)
    anc = torch.eye(n_max, dtype=torch.bool, device=device).repeat(B, 1, 1)  # [b, n]: n and its ancestors
    tok[:, :k], score[:, :k] = top.indices, top.values
    passes = run.passes_state
    state = root_state[:, None].expand(-1, n_max, -1).clone() if passes else None  # a node's input: its parent's
    path = torch.zeros(B, n_max, spec.depth, dtype=torch.long, device=device)  # node tokens from the root down
    path[:, :k, 0] = top.indices
    frontier = torch.arange(k, device=device).expand(B, k)
    fed = frontier[:, :0]  # node ids in slot order after base
    for d in range(1, spec.depth):
        order = torch.cat([fed, frontier], 1)
        out, out_st = level(
            run,
            tok[rows, frontier],
            state[rows, frontier] if passes else None,
            d,
            base,
            fed.shape[1],
            anc[rows[:, :, None], frontier[:, :, None], order[:, None, :]],
            path[rows, frontier, :d],
        )  # (B, k, V)
        fed = order
        cv, ci = torch.log_softmax(out.float(), -1).topk(k, -1)  # (B, k, k)
        new = torch.arange(k + (d - 1) * k * k, k + d * k * k, device=device)  # children, row by row
        tok[:, new], score[:, new] = ci.flatten(1), (score[rows, frontier][:, :, None] + cv).flatten(1)
        par[:, new] = frontier.repeat_interleave(k, 1)
        depth.index_fill_(1, new, d + 1)  # a scalar through index_put_ would be a host copy (no CUDA graph)
        path[:, new] = path[rows, par[:, new]]
        path[:, new, d] = tok[:, new]
        anc[:, new] |= anc[rows, par[:, new]]
        if passes:
            state[:, new] = out_st.repeat_interleave(k, 1)
        frontier = new[score[:, new].topk(k, -1).indices]
    keep = best_nodes(score, depth, min(spec.total_tokens, n_max))  # ancestor-closed, parents first
    n = keep.shape[1]
    index = torch.full((B, n_max), -1, dtype=torch.long, device=device)
    index[rows, keep] = torch.arange(n, device=device).expand(B, n)
    kp = par[rows, keep]
    parents = torch.where(kp >= 0, index[rows, kp.clamp_min(0)], -1)
    mask = torch.zeros(B, n + 1, n + 1, dtype=torch.bool, device=device)
    mask[:, :, 0] = True
    mask[:, 1:, 1:] = anc[rows[:, :, None], keep[:, :, None], keep[:, None, :]]
    depths = torch.cat([depth.new_zeros(B, 1), depth[rows, keep]], 1).int()
    return tok[rows, keep], parents, mask, depths
