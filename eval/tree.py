"""Draft trees for speculative decoding (docs/algorithms.md A11): static trees from a Medusa-style choices list, the
tree attention mask and positions from parent pointers, greedy acceptance over a tree, and KV-cache compaction of
the accepted path.

Nodes are numbered in breadth-first order (a parent always precedes its children); ``parents[i] == -1`` marks a
child of the root, the current token. Row/column 0 of a mask is the root, row i + 1 is node i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from draftsmith.kernels.kv import compact_kv
from draftsmith.kernels.tree import tree_mask
from draftsmith.recipes.schema import tree_paths

TREE_RULES = ("point_mass", "recursive", "spectr")
"""How a sampled row's tree is drafted and verified (docs/algorithms.md A11.4): point_mass = the drafter's top-k
children, accepted by the point-mass walk; recursive = children drawn without replacement from the drafter's q,
accepted by recursive rejection; spectr = children drawn i.i.d. from q, accepted by SpecTr's k-sequential rule.
Greedy rows always take the top-k children and the deepest argmax path."""


def check_rule(rule: str) -> None:
    if rule not in TREE_RULES:
        raise ValueError(f"tree sampling rule {rule!r}: choose one of {', '.join(TREE_RULES)}")


@dataclass(frozen=True)
class TreeSpec:
    """A static tree: node i is the ``ranks[i]``-th most likely child (0 = top-1) of node ``parents[i]``; under a
    sampled rule (``sampling``) it is its parent's ``slots[i]``-th draw instead (its place among its siblings)."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]
    sampling: str = "point_mass"

    def __post_init__(self):
        check_rule(self.sampling)

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def slots(self) -> list[int]:
        """Node i's place among its parent's children ordered by rank (0, 1, ... with no gaps)."""
        seen: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            seen.setdefault(p, []).append(i)
        slot = [0] * len(self.parents)
        for kids in seen.values():
            for j, i in enumerate(sorted(kids, key=lambda i: self.ranks[i])):
                slot[i] = j
        return slot

    @property
    def depths(self) -> list[int]:
        """1-based depth of every node (children of the root have depth 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2-style dynamic tree (docs/algorithms.md A6.2): per step, expand the ``frontier`` (default ``top_k``)
    best frontier nodes by cumulative draft log-prob, ``top_k`` children each, for ``depth`` levels, then keep the
    ``total_tokens`` best nodes overall. ``frontier=1`` is confidence-aware proposal expansion (CaPE, A11.7): the
    top-1 chain is drafted, and the node budget goes to its siblings where the draft is unsure. ``min_prob``
    (DySpec, A11.8): a level is drafted only while some frontier node's cumulative draft probability reaches it,
    and only the nodes that reach it are verified (at least one, at most ``total_tokens``): the tree's size and
    depth follow the draft's confidence, step by step."""

    top_k: int = 8
    depth: int = 5
    total_tokens: int = 48
    sampling: str = "point_mass"  # TREE_RULES
    frontier: int | None = None
    min_prob: float | None = None  # DySpec (A11.8): grow and keep only nodes of cumulative draft probability >= it

    def __post_init__(self):
        if min(self.top_k, self.depth, self.total_tokens) < 1:
            raise ValueError(f"dynamic tree needs top_k, depth, total_tokens >= 1, got {self}")
        if self.frontier is not None and not 1 <= self.frontier <= self.top_k:
            raise ValueError(f"dynamic tree needs 1 <= frontier <= top_k, got {self}")
        if self.min_prob is not None and not 0 < self.min_prob < 1:
            raise ValueError(f"dynamic tree needs 0 < min_prob < 1, got {self}")
        check_rule(self.sampling)

    @property
    def width(self) -> int:
        """Nodes expanded per level."""
        return self.top_k if self.frontier is None else self.frontier

    @property
    def max_nodes(self) -> int:
        """Nodes drafted per step before the final selection."""
        return self.top_k + (self.depth - 1) * self.width * self.top_k


def best_nodes(scores: torch.Tensor, depths: torch.Tensor, budget: int) -> torch.Tensor:
    """Ids of the ``budget`` best nodes by (-score, id), sorted by (depth, id) so parents come first (per row of
    (B, n) scores and depths, or of one tree's (n,)).

    Ancestor-closed whenever every child has a larger id than its parent and no higher score, as cumulative draft
    log-probs recorded parents-first are: ties included, a parent precedes its child in the stable sort. So the
    result has a fixed size and needs no host sync (tested against a closure-by-walking reference)."""
    keep = torch.sort(-scores, stable=True).indices[..., :budget]
    return keep.gather(-1, (depths.gather(-1, keep) * scores.shape[-1] + keep).argsort(-1))


def tree_from_choices(choices: Sequence[Sequence[int]], sampling: str = "point_mass") -> TreeSpec:
    """Medusa-style choices: each entry is a path of child ranks from the root, e.g. ``[[0], [1], [0, 0]]`` is the
    root's top-2 children plus the top child of the best one. Every prefix of a path must be listed too."""
    paths = tree_paths(choices)  # checked as the recipe checks them
    index: dict[tuple[int, ...], int] = {(): -1}
    for i, p in enumerate(paths):
        index[p] = i
    return TreeSpec(tuple(index[p[:-1]] for p in paths), tuple(p[-1] for p in paths), sampling)


def choices_from_accuracies(acc: Sequence[Sequence[float]], n_nodes: int) -> list[list[int]]:
    """Medusa's tree construction from measured head accuracies: ``acc[d][r]`` = P(the rank-r token of head d is
    the target's next token). A path's value is the product of its ranks' accuracies (the probability that the
    whole path is accepted, heads assumed independent); the ``n_nodes`` most valuable paths are kept, and since a
    prefix is never worth less than its extensions, the set is prefix-closed. Expected accepted length = the sum
    of the kept paths' values."""
    import heapq

    best: list[tuple[float, tuple[int, ...]]] = []
    frontier = [(-acc[0][r], (r,)) for r in range(len(acc[0]))]
    heapq.heapify(frontier)
    while frontier and len(best) < n_nodes:
        neg, path = heapq.heappop(frontier)
        best.append((-neg, path))
        if len(path) < len(acc):  # children: one more head, any rank
            for r in range(len(acc[len(path)])):
                heapq.heappush(frontier, (neg * acc[len(path)][r], (*path, r)))
    return [list(p) for _, p in best]


_ACC = ("head", "step", "draft")  # metrics.jsonl prefixes: heads, EAGLE TTT steps, PARD distances


def run_accuracies(run_dir) -> list[list[float]]:
    """``acc[k][r]``: the per-head rank accuracies a heads run logged last (``acc_head{k}_rank{r}`` in
    metrics.jsonl), or an EAGLE run's per-TTT-step ones (``acc_step{k}_rank{r}``: step k's accuracy after k
    teacher-forced-by-its-own-drafts steps, so a path's product treats depth k like head k), or a PARD run's
    per-distance ones (``acc_draft{k}_rank{r}``: distance k + 1 from the last accepted token)."""
    import json
    import re
    from pathlib import Path

    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    last = next(
        (r for r in reversed(rows) if r.get("stage") == "train" and any(f"acc_{k}0_rank0" in r for k in _ACC)),
        None,
    )
    if last is None:
        raise ValueError(
            f"{run_dir}: no per-head, per-step or per-distance accuracies logged (train a medusa / hydra / "
            f"mlp_speculator / eagle / pard first)"
        )
    acc: dict[int, dict[int, float]] = {}
    for key, v in last.items():
        if m := re.fullmatch(rf"acc_(?:{'|'.join(_ACC)})(\d+)_rank(\d+)", key):
            acc.setdefault(int(m.group(1)), {})[int(m.group(2))] = v
    return [[acc[k][r] for r in sorted(acc[k])] for k in sorted(acc)]


def choices_from_run(run_dir, n_nodes: int) -> list[list[int]]:
    """Tree choices from the per-head rank accuracies a heads run logged last, e.g. for ``eval.tree.choices``."""
    return choices_from_accuracies(run_accuracies(run_dir), n_nodes)


def expected_tau(acc: Sequence[Sequence[float]], choices: Sequence[Sequence[int]]) -> float:
    """1 + the sum of the paths' acceptance probabilities (``choices_from_accuracies``' model): the tau a tree
    of these choices reaches if the heads are as accurate as measured and independent."""
    import math

    return 1 + sum(math.prod(acc[d][r] for d, r in enumerate(c)) for c in choices)


def chain_tree(depth: int) -> TreeSpec:
    """A chain of ``depth`` top-1 drafts as a tree (what chain speculative decoding verifies)."""
    return tree_from_choices([[0] * d for d in range(1, depth + 1)])


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents (N,) long -> (N+1, N+1) bool: row j attends to itself and its ancestors, the root included
    (kernels/tree.py: Triton on CUDA, the PyTorch reference elsewhere)."""
    return tree_mask(parents)[0]


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """(N,) 1-based depths: the number of ancestors a node attends to, root excluded."""
    return tree_mask(parents)[1][1:].long()


def greedy_tree_accept(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy verification of a tree. tokens (N,) node tokens; logits (N+1, V): row 0 at the root, row i+1 at node i.

    A node is accepted when its token is the target's argmax at its parent and its parent is accepted. Returns the
    deepest accepted root-to-node path (node indices; the first of equally deep paths, i.e. the higher-ranked
    one) and the next token, the target's argmax after the path (a correction, or the bonus at a leaf).
    """
    best = logits.argmax(-1)  # (N+1,)
    par = parents.tolist()
    ok = (tokens == best[parents + 1]).tolist()
    accepted = [False] * len(par)
    depth = [0] * len(par)
    last, last_depth = -1, 0
    for i, p in enumerate(par):  # parents first: one pass settles every node
        accepted[i] = ok[i] and (p < 0 or accepted[p])
        depth[i] = 1 if p < 0 else depth[p] + 1
        if accepted[i] and depth[i] > last_depth:
            last, last_depth = i, depth[i]
    path = []
    node = last
    while node >= 0:
        path.append(node)
        node = par[node]
    return path[::-1], int(best[last + 1])


def sample_tree_accept(
    tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Lossless sampling over a tree of deterministic (top-k) children (docs/algorithms.md A11.4, point-mass rule).

    probs (N+1, V): the target's processed distribution at the root and at each node. From the root: draw
    y ~ p(node); if a child of the node carries y, descend into it and repeat; otherwise emit y and stop. Every
    emitted token is an exact sample of the target given the tokens before it, so the output follows the target.
    Returns (accepted path of node indices, the token drawn where the walk stopped).
    """
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens.tolist(), parents.tolist())):
        children.setdefault(p, {}).setdefault(t, i)  # siblings are distinct top-k tokens; keep the first if not
    node, path = -1, []
    while True:
        y = int(torch.multinomial(probs[node + 1], 1, generator=generator))
        child = children.get(node, {}).get(y)
        if child is None:
            return path, y
        path.append(child)
        node = child


class Kids(NamedTuple):
    """A parent's children for B rows: tokens (B, *, k) in the order the verify tries them, scores (B, *, k) that
    rank them for a dynamic tree's shape, the distributions sampled rows drew them from (q (B, *, V) fp32, zero for
    top-k rows; None when no row sampled), and which rows sampled (B,) bool."""

    tokens: torch.Tensor
    scores: torch.Tensor
    q: torch.Tensor | None
    sampled: torch.Tensor


def pick_children(rows: list, rule: str, logits: torch.Tensor, k: int) -> Kids:
    """The ``k`` children of every parent in ``logits`` (B, *, V), row b by ``rows[b].sampler`` under ``rule``.

    Greedy rows, and every row under point_mass: the top-k tokens, scored by draft log-prob. Sampled rows under
    recursive: k draws without replacement from q = the row's processed draft distribution (Gumbel top-k: the
    order of the perturbed scores is the order of the draws); under spectr: k i.i.d. draws from q. Their scores
    are q's k largest log-probs, in rank order, whatever was drawn: a dynamic tree's shape then depends only on
    the distributions of a node's ancestors, never on which tokens its own children are, which keeps the
    verification exact. Rows of equal settings and generator draw together (the generator advances as alone)."""
    lp = torch.log_softmax(logits.float(), -1)
    top = lp.topk(k, -1)
    sampled = torch.tensor([rule != "point_mass" and not r.sampler.greedy for r in rows], device=logits.device)
    if not bool(sampled.any()):
        return Kids(top.indices, top.values, None, sampled)
    tokens, scores = top.indices.clone(), top.values.clone()
    q = torch.zeros(lp.shape, dtype=torch.float32, device=logits.device)
    groups: dict = {}
    for b, r in enumerate(rows):
        if sampled[b]:
            groups.setdefault(r.key, []).append(b)
    for idx in groups.values():
        s, ix = rows[idx[0]].sampler, torch.tensor(idx, device=logits.device)
        qi = s.probs(logits[ix])
        lq = qi.log()
        scores[ix] = lq.topk(k, -1).values
        if rule == "recursive":
            u = torch.rand(qi.shape, generator=s.generator, device=qi.device).clamp_min(torch.finfo(qi.dtype).tiny)
            tokens[ix] = (lq - torch.log(-torch.log(u))).topk(k, -1).indices  # + Gumbel noise
        else:
            draws = torch.multinomial(qi.reshape(-1, qi.shape[-1]), k, replacement=True, generator=s.generator)
            tokens[ix] = draws.view(*qi.shape[:-1], k)
        q[ix] = qi
    return Kids(tokens, scores, q, sampled)


class StaticKids:
    """A static tree's node tokens for B rows, drawn from their parents' draft logits as they are computed:
    ``token(logits, i)`` is node i's token, (B,) (``pick_children`` once per parent: a top-k row takes the
    ``ranks[i]``-th best, a sampled row its parent's ``slots[i]``-th draw); ``q()`` then gives the distributions
    sampled rows drew each parent's children from, (B, N+1, V) root first, or None when no row sampled."""

    def __init__(self, rows: list, spec: TreeSpec):
        self.rows, self.spec, self.slots = rows, spec, spec.slots
        self.width: dict[int, int] = {}
        for p, r in zip(spec.parents, spec.ranks):
            self.width[p] = max(self.width.get(p, 0), r + 1)
        self.kids: dict[int, Kids] = {}

    def token(self, logits: torch.Tensor, i: int) -> torch.Tensor:
        """logits (B, V): node i's parent's children's draft logits -> node i's token (B,)."""
        par = self.spec.parents[i]
        if par not in self.kids:
            self.kids[par] = pick_children(self.rows, self.spec.sampling, logits, self.width[par])
        k = self.kids[par]
        top = k.tokens[:, self.spec.ranks[i]]
        return top if k.q is None else torch.where(k.sampled, k.tokens[:, self.slots[i]], top)

    def q(self) -> torch.Tensor | None:
        drawn = {p: k.q for p, k in self.kids.items() if k.q is not None}
        if not drawn:
            return None
        first = next(iter(drawn.values()))
        q = first.new_zeros(first.shape[0], len(self.spec) + 1, first.shape[-1])
        for p, qp in drawn.items():
            q[:, p + 1] = qp
        return q


def multi_draft_accept(
    rule: str,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    probs: torch.Tensor,
    q: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Lossless sampling over a tree of sampled children (docs/algorithms.md A11.4). probs (N+1, V): the target's
    processed distribution at the root and at each node; q (N+1, V): the draft distribution each node's children
    were drawn from (``pick_children``). Siblings are tried in node order (their draw order); at each node the
    ``rule`` (recursive or spectr) either accepts a child and descends, or emits a token and stops. Returns (the
    accepted path of node indices, the token drawn where the walk stopped)."""
    node_rule = {"recursive": _recursive_node, "spectr": _kseq_node}[rule]
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents.tolist()):
        children.setdefault(p, []).append(i)
    toks = tokens.tolist()
    node, path = -1, []
    while True:
        kids = children.get(node, [])
        j, y = node_rule(probs[node + 1].float(), q[node + 1], [toks[c] for c in kids], generator)
        if j is None:
            return path, y
        path.append(kids[j])
        node = kids[j]


def _draw(p: torch.Tensor, generator) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def _coin(p: torch.Tensor, generator) -> float:
    return float(torch.rand((), generator=generator, device=p.device))


def _recursive_node(p, q, xs: list[int], generator) -> tuple[int | None, int]:
    """Recursive rejection over children drawn without replacement from q: child j is accepted with probability
    min(1, p(x_j) / q_j(x_j)), q_j being q without the earlier children, renormalised; a rejection sets
    p <- normalised max(0, p - q_j). After the last child (or once q has no mass left) emit y ~ p."""
    q = q.clone()
    for j, x in enumerate(xs):
        mass = float(q.sum())
        if not mass > 0 or not float(q[x]) > 0:  # q's support is exhausted: the later draws carry no mass
            break
        qj = q / mass
        if _coin(p, generator) * float(qj[x]) < float(p[x]):
            return j, x
        rest = (p - qj).clamp_min(0)
        if float(rest.sum()) > 0:  # else p == q_j up to rounding, where a rejection has probability ~0
            p = rest / rest.sum()
        q[x] = 0
    return None, _draw(p, generator)


def kseq_rho(p: torch.Tensor, q: torch.Tensor, k: int, rounds: int = 3) -> float:
    """SpecTr's k-sequential rule accepts a draft with probability min(1, p / (rho q)); the residual is a
    distribution iff c(rho) = (1 - (1 - beta)^k) / beta <= rho, beta = sum min(q, p / rho). The smallest such rho in
    [1, k] accepts most (c(k) <= k always). With the tokens sorted by p / q, beta at any rho is a prefix sum of p
    (the tokens under rho, over rho) plus a suffix sum of q, so each round checks a 65-point grid at the cost of a
    binary search per point and narrows the bracket 64-fold; any valid rho keeps the rule exact."""
    if k <= 1:
        return 1.0
    p, q = p.double(), q.double()
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), float("inf"))
    rs, order = ratio.sort()
    zero = p.new_zeros(1)
    p_below = torch.cat([zero, p[order].cumsum(0)])  # p mass of the first j tokens by ratio
    q_above = q.sum() - torch.cat([zero, q[order].cumsum(0)])  # q mass of the rest

    def valid(rho: torch.Tensor) -> torch.Tensor:
        j = torch.searchsorted(rs, rho)  # tokens with p / q < rho contribute p / rho, the others q
        beta = p_below[j] / rho + q_above[j]
        c = torch.where(beta > 0, (1 - (1 - beta) ** k) / beta.clamp_min(1e-300), float(k))
        return c <= rho

    lo, hi = 1.0, float(k)
    if bool(valid(torch.tensor([lo], dtype=p.dtype, device=p.device))[0]):
        return lo
    for _ in range(rounds):
        grid = torch.linspace(lo, hi, 65, dtype=p.dtype, device=p.device)
        ok = valid(grid)
        ok[-1] = True  # hi: rho = k, or the previous round's valid point
        i = int(ok.long().argmax())  # >= 1: lo is never valid
        lo, hi = float(grid[i - 1]), float(grid[i])
    return hi


def _kseq_node(p, q, xs: list[int], generator) -> tuple[int | None, int]:
    """SpecTr's k-sequential selection over k children drawn i.i.d. from q: child i is accepted with probability
    min(1, p(x_i) / (rho q(x_i))) (p fixed); if none is, emit y from the residual p - c(rho) min(q, p / rho),
    normalised (``kseq_rho``)."""
    if not xs:
        return None, _draw(p, generator)
    p, q = p.double(), q.double()
    rho = kseq_rho(p, q, len(xs))
    for j, x in enumerate(xs):
        if _coin(p, generator) * rho * float(q[x]) < float(p[x]):
            return j, x
    m = torch.minimum(q, p / rho)
    beta = float(m.sum())
    c = len(xs) if beta <= 0 else (1 - (1 - beta) ** len(xs)) / beta
    rest = (p - c * m).clamp_min(0)
    return None, _draw(rest if float(rest.sum()) > 0 else p, generator)


def compact_cache(cache, start: int, keep: list[int]) -> None:
    """Keep slots ``start + keep[j]`` as slots ``start + j`` (keep ascending), in every layer and the validity mask,
    then cut the cache after them. Used after a tree verify: only the accepted path's K/V survive
    (kernels/kv.py: Triton on CUDA, the PyTorch reference elsewhere; a transformers target's cache, models/hf_target.py
    ``HFCache``, by its own ``compact_path``)."""
    if hasattr(cache, "compact_path"):
        return cache.compact_path(start, keep)
    if keep != list(range(len(keep))):  # already in place (a chain, or the top path) needs no copy
        if any(b <= a for a, b in zip(keep, keep[1:])) or start + keep[-1] >= cache.max_len:
            raise ValueError(f"compact_cache: keep must be ascending slots inside the cache, got {keep}")
        idx = torch.tensor(keep, dtype=torch.int32, device=cache.valid.device)
        kv = cache.kv.view(-1, *cache.kv.shape[3:])  # every layer's K and V as one (2·L·B, H, S, D) buffer
        compact_kv(kv, start, idx, check=False)  # checked above on the host list: no device sync
        cache.valid[:, start : start + len(keep)] = cache.valid[:, start + idx.long()]
    cache.length = start + len(keep)


def add_arguments(p) -> None:
    """The options of ``draftsmith tree`` (draftsmith/cli.py adds RUN)."""
    p.add_argument(
        "--nodes",
        default="2,3,4,6,8,12,16",
        help="comma-separated node counts (tree sizes, root excluded) to build a tree for",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="time the run's target verifying each tree size on --device (in decode steps) and choose, per size, "
        "the depth, and overall the size, with the highest expected tau per step cost",
    )
    p.add_argument(
        "--draft-cost",
        type=float,
        default=0.0,
        help="--measure: the drafter's cost per tree level as a fraction of a target decode step (about 0 for "
        "heads; benchmarks/step_costs.py prints it as c for a draft LM or EAGLE)",
    )
    p.add_argument("--device", default="cpu", help="--measure: the device to time the target on")
    p.add_argument("--ctx", type=int, default=256, help="--measure: tokens already in the KV cache when timing")


def run_cli(args, run_dir) -> list[str]:
    """``draftsmith tree RECIPE|RUN_DIR --nodes 2,4,8 [--measure]``: one line per node count -> the printed lines."""
    import json

    try:
        sizes = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--nodes {args.nodes!r}: give node counts >= 1")
    table = run_accuracies(run_dir)
    lines = []
    if getattr(args, "measure", False):
        from draftsmith.eval.sizing import load_target, sized_trees, verify_costs

        costs, note = verify_costs(load_target(run_dir, args.device), sizes, args.ctx, device=args.device)
        rows = sized_trees(table, costs, args.draft_cost)
        for r in rows:
            lines.append(
                f"nodes {r['nodes']:>3}  depth {r['depth']}  expected tau {r['tau']:.3f}  step cost {r['cost']:.3f}  "
                f"tau per cost {r['speed']:.3f}  eval.tree.choices={json.dumps(r['choices'], separators=(',', ':'))}"
            )
            print(lines[-1])
        best = max(rows, key=lambda r: r["speed"])
        lines.append(f"chosen: nodes {best['nodes']}, depth {best['depth']} ({note})")
        print(lines[-1])
        return lines
    for n in sizes:
        choices = choices_from_accuracies(table, n)
        lines.append(
            f"nodes {n:>3}  expected tau {expected_tau(table, choices):.3f}  "
            f"eval.tree.choices={json.dumps(choices, separators=(',', ':'))}"
        )
        print(lines[-1])
    return lines
