"""Draft trees for speculative decoding (docs/algorithms.md A11): static trees from a Medusa-style choices list, the
tree attention mask and positions from parent pointers, greedy acceptance over a tree, and KV-cache compaction of
the accepted path.

Nodes are numbered in breadth-first order (a parent always precedes its children); ``parents[i] == -1`` marks a
child of the root, the current token. Row/column 0 of a mask is the root, row i + 1 is node i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftsmith.kernels.kv import compact_kv
from draftsmith.kernels.tree import tree_mask
from draftsmith.recipes.schema import tree_paths


@dataclass(frozen=True)
class TreeSpec:
    """A static tree: node i is the ``ranks[i]``-th most likely child (0 = top-1) of node ``parents[i]``."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> list[int]:
        """1-based depth of every node (children of the root have depth 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2-style dynamic tree (docs/algorithms.md A6.2): per step, expand the ``top_k`` best frontier nodes by
    cumulative draft log-prob for ``depth`` levels, then keep the ``total_tokens`` best nodes overall."""

    top_k: int = 8
    depth: int = 5
    total_tokens: int = 48

    def __post_init__(self):
        if min(self.top_k, self.depth, self.total_tokens) < 1:
            raise ValueError(f"dynamic tree needs top_k, depth, total_tokens >= 1, got {self}")


def best_nodes(scores: torch.Tensor, depths: torch.Tensor, budget: int) -> torch.Tensor:
    """Ids of the ``budget`` best nodes by (-score, id), sorted by (depth, id) so parents come first (per row of
    (B, n) scores and depths, or of one tree's (n,)).

    Ancestor-closed whenever every child has a larger id than its parent and no higher score, as cumulative draft
    log-probs recorded parents-first are: ties included, a parent precedes its child in the stable sort. So the
    result has a fixed size and needs no host sync (tested against a closure-by-walking reference)."""
    keep = torch.sort(-scores, stable=True).indices[..., :budget]
    return keep.gather(-1, (depths.gather(-1, keep) * scores.shape[-1] + keep).argsort(-1))


def tree_from_choices(choices: Sequence[Sequence[int]]) -> TreeSpec:
    """Medusa-style choices: each entry is a path of child ranks from the root, e.g. ``[[0], [1], [0, 0]]`` is the
    root's top-2 children plus the top child of the best one. Every prefix of a path must be listed too."""
    paths = tree_paths(choices)  # checked as the recipe checks them
    index: dict[tuple[int, ...], int] = {(): -1}
    for i, p in enumerate(paths):
        index[p] = i
    return TreeSpec(tuple(index[p[:-1]] for p in paths), tuple(p[-1] for p in paths))


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


TREE_HELP = (
    "A Medusa tree per node count from a heads run's last logged per-head rank accuracies (metrics.jsonl), "
    "with its expected tau, printed as an eval.tree.choices override."
)


def add_arguments(p) -> None:
    """The options of ``draftsmith tree`` (draftsmith/cli.py adds RUN)."""
    p.add_argument(
        "--nodes",
        default="2,3,4,6,8,12,16",
        help="comma-separated node counts (tree sizes, root excluded) to build a tree for",
    )


def run_cli(args, run_dir) -> list[str]:
    """``draftsmith tree RECIPE|RUN_DIR --nodes 2,4,8``: one line per node count -> the printed lines."""
    import json

    try:
        sizes = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--nodes {args.nodes!r}: give node counts >= 1")
    table = run_accuracies(run_dir)
    lines = []
    for n in sizes:
        choices = choices_from_accuracies(table, n)
        lines.append(
            f"nodes {n:>3}  expected tau {expected_tau(table, choices):.3f}  "
            f"eval.tree.choices={json.dumps(choices, separators=(',', ':'))}"
        )
        print(lines[-1])
    return lines
