"""What one decoding step drafts, verifies and accepts, for every row of a batch at once (batch 1 is B = 1;
docs/algorithms.md A1, A11): a chain of up to γ drafts (``Chain``; with a stop hook, adaptive length), a static
tree (``StaticTree``, Medusa-style choices), an EAGLE-2 dynamic tree (``DynamicShape``) rebuilt every step from
the drafter's confidence, or a lossy judged chain (``Judged``, Judge Decoding). A shape drafts through its proposer
(eval/proposers.py), tells the verify where its nodes sit (``Drafted``: a chain is causal; a tree gives each row's
ancestor mask and depths) and accepts by its rule, row by row or, for chains, as one batch: the greedy prefix or
rejection sampling (eval/accept.py), a tree's deepest argmax path, point-mass walk or multi-draft rule
(eval/tree.py). The loop that runs them is eval/batch_decoder.py ``BatchDecoder.step``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftsmith.eval.accept import Sampler, judge_accept
from draftsmith.eval.tree import (
    DynamicTree,
    Kids,
    TreeSpec,
    best_nodes,
    greedy_tree_accept,
    multi_draft_accept,
    sample_tree_accept,
)
from draftsmith.kernels.tree import tree_mask


@dataclass
class Drafted:
    """One step's drafts for B rows. tokens (B, N): row b's first count[b] are its drafts (a tree's nodes in
    depth-sorted order), the rest padding the verify ignores. q: the distributions sampled drafts were drawn from,
    None when no row sampled them: a chain's (B, N, V), one per draft; a tree's (B, N+1, V), one per parent (row 0
    the root's), drawn under a recursive or spectr rule (top-k children need none). A tree's structure, root
    first: parents (B, N), anc (B, N+1, N+1) ancestors, depths (B, N+1); None for a chain (causal)."""

    tokens: torch.Tensor
    count: list[int]
    q: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    anc: torch.Tensor | None = None
    depths: torch.Tensor | None = None


@dataclass
class Verdict:
    """What each row's rule kept: its accepted drafts, the verify positions kept (cur first, then the accepted
    drafts' positions), the next token (the target's correction or bonus) and how many drafts a judge kept that
    the target would not have chosen. ``n``: accepted counts (B,) on the device, for chain proposers."""

    accepted: list[list[int]]
    kept: list[list[int]]
    nxt: list[int]
    judged: list[int]
    n: torch.Tensor | None = None

    @property
    def prefix(self) -> bool:
        """Every row kept a prefix of its verify positions (a chain), not a tree path."""
        return self.n is not None


class Chain:
    """Up to ``draft_len`` drafts in a row (a drafter's own cap, a heads drafter's head count, bounds it). Every
    row's chain is drafted as one batch; the greedy prefix and rejection sampling run for all rows at once."""

    layers: tuple[int, ...] = ()  # target states the verify must capture for the acceptance rule

    def __init__(self, prop, draft_len: int):
        if draft_len < 0:
            raise ValueError(f"draft_len must be >= 0, got {draft_len}")
        self.prop = prop
        self.depth = int(min(draft_len, prop.depth))  # the longest accepted run: DecodeStats.accept_counts' range
        self.room = 2 * self.depth  # KV-cache slots a step may fill beyond the tokens it keeps

    def check(self, sampler: Sampler) -> int:
        """Refuse at ``add`` what this shape does not do with ``sampler`` -> the row's longest accepted run (a
        proposer may draft less for some samplers: ``row_depth``)."""
        row_depth = getattr(self.prop, "row_depth", None)
        return self.depth if row_depth is None else min(self.depth, row_depth(sampler))

    def join(self, rows, ids, valid, pos, captured: dict, live: list[int]) -> None:
        self.prop.join(rows, ids, valid, pos, captured, live)

    def draft(self, dec, rows, cur: torch.Tensor, budgets: list[int] | None) -> Drafted:
        """Row b drafts up to min(depth, budgets[b]) (a step emits at most γ+1 tokens: never past max_new_tokens);
        ``budgets`` None: a plain step, nothing drafted (the drafter still reads what is committed)."""
        gam = [0] * len(rows) if budgets is None else [min(self.depth, b) for b in budgets]
        out = self.prop.draft(rows, cur, gam, lambda lg, live: dec.pick(rows, lg, live))
        if out is None or not out[0]:
            return Drafted(cur.new_zeros(len(rows), 0), [0] * len(rows))
        toks, qs, count = out  # count: what each row drafted (its budget, or where its stop hook ended it)
        return Drafted(torch.stack(toks, 1), count, None if qs[0] is None else torch.stack(qs, 1))

    def accept(self, dec, rows, d: Drafted, logits: torch.Tensor, captured: dict) -> Verdict:
        n, nxt = dec.accept_chains(rows, d.tokens, d.q, logits, torch.tensor(d.count, device=logits.device))
        n_l, nxt_l, d_l = n.tolist(), nxt.tolist(), d.tokens.tolist()  # the acceptance synced
        return Verdict([x[:k] for x, k in zip(d_l, n_l)], [list(range(k + 1)) for k in n_l], nxt_l, [0] * len(rows), n)

    def commit(self, rows, cur: torch.Tensor, d: Drafted, v: Verdict, captured: dict) -> None:
        self.prop.commit(rows, cur, d.tokens, v, captured)


class Judged(Chain):
    """**Lossy** Judge-Decoding verification (models/judge.py ``Judge``), greedy chains of a draft LM: a draft the
    target would not have chosen is still kept when the judge accepts the target's final state at it
    (``judge_accept``), row by row. The verify also returns those states."""

    def __init__(self, prop, draft_len: int, judge, target):
        super().__init__(prop, draft_len)
        self.judge, self.norm, self.layers = judge, target.norm, (target.cfg.n_layers,)

    def check(self, sampler: Sampler) -> int:
        if not sampler.greedy:
            raise ValueError("judge verification is implemented for greedy chain decoding with a standalone draft LM")
        return self.depth

    def accept(self, dec, rows, d: Drafted, logits: torch.Tensor, captured: dict) -> Verdict:
        states = self.norm(captured[self.layers[0]])  # (B, W, D) after the final norm
        acc, nxt, judged = [], [], []
        for b, c in enumerate(d.count):
            n, t, j = judge_accept(d.tokens[b, :c], logits[b, : c + 1], self.judge.accepts(states[b, 1 : c + 1]))
            acc.append(d.tokens[b, :n].tolist())
            nxt.append(t)
            judged.append(j)
        n_t = torch.tensor([len(a) for a in acc], device=logits.device)
        return Verdict(acc, [list(range(len(a) + 1)) for a in acc], nxt, judged, n_t)


class _Tree:
    """What static and dynamic trees share: every row's tree drafted as one batch, verified under its own tree
    mask, and accepted by its own row's rule: greedy (the deepest argmax path), or under sampling the tree's rule
    (``TreeSpec.sampling``: the point-mass walk, or recursive / SpecTr rejection over sampled children)."""

    layers: tuple[int, ...] = ()
    depth: int

    def _check_depth(self, prop) -> None:
        if self.depth > prop.depth:
            raise ValueError(f"tree depth {self.depth} exceeds the drafter's {prop.depth} heads")

    def check(self, sampler: Sampler) -> int:
        return self.depth

    def join(self, rows, ids, valid, pos, captured: dict, live: list[int]) -> None:
        self.prop.join(rows, ids, valid, pos, captured, live)

    def accept(self, dec, rows, d: Drafted, logits: torch.Tensor, captured: dict) -> Verdict:
        acc, kept, nxt = [], [], []
        for b, (r, c) in enumerate(zip(rows, d.count)):
            s = r.sampler
            if c == 0:  # a plain step: the target's own next token
                path, t = [], int(s.pick(logits[b, 0])[0])
            elif s.greedy:
                path, t = greedy_tree_accept(d.tokens[b], d.parents[b], logits[b, : c + 1])
            elif self.spec.sampling == "point_mass":
                path, t = sample_tree_accept(d.tokens[b], d.parents[b], s.probs(logits[b, : c + 1]), s.generator)
            else:
                probs = s.probs(logits[b, : c + 1])
                path, t = multi_draft_accept(self.spec.sampling, d.tokens[b], d.parents[b], probs, d.q[b], s.generator)
            acc.append(d.tokens[b, path].tolist())
            kept.append([0] + [i + 1 for i in path])
            nxt.append(int(t))
        return Verdict(acc, kept, nxt, [0] * len(rows))

    def commit(self, rows, cur: torch.Tensor, d: Drafted, v: Verdict, captured: dict) -> None:
        accepted = [cur.new_tensor(a) for a in v.accepted]
        self.prop.commit_tree(rows, accepted, v.kept, captured, None if d.count[0] else cur)


class StaticTree(_Tree):
    """The same tree every step; node i is the ``ranks[i]``-th best child of its parent."""

    def __init__(self, prop, spec: TreeSpec, device):
        self.prop, self.spec, self.depth = prop, spec, max(spec.depths)
        self._check_depth(prop)
        self.room = len(spec) + self.depth + 2
        self.parents = torch.tensor(spec.parents, dtype=torch.long, device=device)
        self.anc, self.depths = tree_mask(self.parents)  # (N+1, N+1) ancestors, (N+1,) depths, root first

    def draft(self, dec, rows, cur: torch.Tensor, budgets: list[int] | None) -> Drafted:
        B = len(rows)
        if budgets is None:  # a plain step (a tree is drafted whole whatever the budget: emit truncates)
            return Drafted(cur.new_zeros(B, 0), [0] * B)
        tokens, q = self.prop.static_tree(rows, cur, self.spec, self.anc, self.room)
        return Drafted(tokens, [len(self.spec)] * B, q, self.parents.expand(B, -1),
                       self.anc.expand(B, -1, -1), self.depths.expand(B, -1))  # fmt: skip


class DynamicShape(_Tree):
    """EAGLE-2's tree, rebuilt every step from the drafter's cumulative log-probs (``tree_levels``)."""

    def __init__(self, prop, spec: DynamicTree):
        self.prop, self.spec, self.depth = prop, spec, spec.depth
        self._check_depth(prop)
        self.room = spec.max_nodes + self.depth + 2  # every node a step records

    def draft(self, dec, rows, cur: torch.Tensor, budgets: list[int] | None) -> Drafted:
        B = len(rows)
        if budgets is None:
            return Drafted(cur.new_zeros(B, 0), [0] * B)
        tokens, parents, anc, depths, q = self.prop.dynamic_tree(rows, cur, self.spec, self.room)
        return Drafted(tokens, [tokens.shape[1]] * B, q, parents, anc, depths)


def shape_for(target, prop, tree: TreeSpec | DynamicTree | None, draft_len: int, judge=None, stop=None):
    """The step's shape: a chain (``tree`` None, verified by the judge when one is given) or a tree. Refuses
    combinations that are not implemented: a judge outside chains of a standalone draft LM, a stop hook on a
    tree."""
    if judge is not None and (prop.reads_target or tree is not None):
        raise ValueError("judge verification is implemented for greedy chain decoding with a standalone draft LM")
    if tree is None:
        return Chain(prop, draft_len) if judge is None else Judged(prop, draft_len, judge, target)
    if stop is not None:
        raise ValueError("stop_drafting adapts a chain's length; tree decoding takes no stop hook")
    if isinstance(tree, DynamicTree):
        return DynamicShape(prop, tree)
    return StaticTree(prop, tree, next(target.parameters()).device)


def tree_levels(run, root_logits, root_state, base, spec: DynamicTree, level, pick=None):
    """The levels and the final selection of a dynamic tree for B rows at once: root_logits (B, V), root_state
    (B, S) or None -> (tokens (B, N), parents (B, N), tree mask (B, N+1, N+1), depths (B, N+1), q (B, N+1, V) or
    None); every row's tree has the same N. ``level(run, tokens (B, k), states, d, base, n_fed, anc (B, k, n_fed +
    k), paths (B, k, d))`` runs the drafter on a frontier -> (logits (B, k, V), states or None). ``pick(logits, k)``
    draws each parent's children (eval/tree.py ``pick_children``; default the top-k by draft log-prob); q row 0 is
    the root's, row i + 1 node i's (zero where nothing was drawn from it), None when no row sampled. Node ids are
    assigned level by level (children after their parents), an ancestor matrix grows with them, and a stable sort
    by score ranks them; ``base`` (the root's slot + 1) may be a device tensor (proposers.py ``TreeGraph``)."""
    k, f, device, B = spec.top_k, spec.width, root_logits.device, root_logits.shape[0]
    pick = pick or _top_children
    n_max = spec.max_nodes
    rows = torch.arange(B, device=device)[:, None]
    top = pick(root_logits, k)
    tok = torch.zeros(B, n_max, dtype=torch.long, device=device)
    score = torch.full((B, n_max), float("-inf"), device=device)
    par = torch.full((B, n_max), -1, dtype=torch.long, device=device)
    depth = torch.ones(B, n_max, dtype=torch.long, device=device)
    anc = torch.eye(n_max, dtype=torch.bool, device=device).repeat(B, 1, 1)  # [b, n]: n and its ancestors
    tok[:, :k], score[:, :k] = top.tokens, top.scores
    bank = None if top.q is None else [top.q[:, None]]  # the q each expanded node's children were drawn from
    qidx = torch.full((B, n_max), -1, dtype=torch.long, device=device)  # node -> its row in the bank
    passes = run.passes_state
    state = root_state[:, None].expand(-1, n_max, -1).clone() if passes else None  # a node's input: its parent's
    path = torch.zeros(B, n_max, spec.depth, dtype=torch.long, device=device)  # node tokens from the root down
    path[:, :k, 0] = top.tokens
    frontier = torch.arange(k, device=device).expand(B, k) if f == k else score[:, :k].topk(f, -1).indices
    fed = frontier[:, :0]  # node ids in slot order after base
    floor = None if spec.min_prob is None else math.log(spec.min_prob)
    for d in range(1, spec.depth):
        if floor is not None and float(score[rows, frontier].max()) < floor:
            break  # (DySpec) no frontier node, nor any descendant, can be kept: nothing deeper is drafted
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
        kids = pick(out, k)  # (B, f, k)
        if bank is not None:
            bank.append(kids.q)
            qidx[rows, frontier] = 1 + (d - 1) * f + torch.arange(f, device=device)
        new = torch.arange(k + (d - 1) * f * k, k + d * f * k, device=device)  # children, row by row
        tok[:, new] = kids.tokens.flatten(1)
        score[:, new] = (score[rows, frontier][:, :, None] + kids.scores).flatten(1)
        par[:, new] = frontier.repeat_interleave(k, 1)
        depth.index_fill_(1, new, d + 1)  # a scalar through index_put_ would be a host copy (no CUDA graph)
        path[:, new] = path[rows, par[:, new]]
        path[:, new, d] = tok[:, new]
        anc[:, new] |= anc[rows, par[:, new]]
        if passes:
            state[:, new] = out_st.repeat_interleave(k, 1)
        frontier = new[score[:, new].topk(f, -1).indices]
    budget = min(spec.total_tokens, n_max)
    if floor is not None:  # the nodes that reach min_prob (the most any row has; each row keeps its best)
        budget = max(1, min(budget, int((score >= floor).sum(1).max())))
    keep = best_nodes(score, depth, budget)  # ancestor-closed, parents first
    n = keep.shape[1]
    index = torch.full((B, n_max), -1, dtype=torch.long, device=device)
    index[rows, keep] = torch.arange(n, device=device).expand(B, n)
    kp = par[rows, keep]
    parents = torch.where(kp >= 0, index[rows, kp.clamp_min(0)], -1)
    mask = torch.zeros(B, n + 1, n + 1, dtype=torch.bool, device=device)
    mask[:, :, 0] = True
    mask[:, 1:, 1:] = anc[rows[:, :, None], keep[:, :, None], keep[:, None, :]]
    depths = torch.cat([depth.new_zeros(B, 1), depth[rows, keep]], 1).int()
    q = None
    if bank is not None:
        qb, qi = torch.cat(bank, 1), torch.cat([qidx.new_zeros(B, 1), qidx[rows, keep]], 1)  # (B, n + 1)
        q = torch.where((qi >= 0)[..., None], qb[rows, qi.clamp_min(0)], 0.0)
    return tok[rows, keep], parents, mask, depths, q


def _top_children(logits: torch.Tensor, k: int):
    """Every parent's top-k children by draft log-prob (what greedy rows and the point-mass rule verify)."""
    top = torch.log_softmax(logits.float(), -1).topk(k, -1)
    return Kids(top.indices, top.values, None, None)
