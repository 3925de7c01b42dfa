"""A stand-in for the batched decoder (``BatchDecoder``: ``add`` rows, ``step`` them all, rows leave when done), for
the server's continuous-batching loop. Each row is its own batch-1 speculative decode (eval/decoder.py's loop,
split into a prefill in ``add`` and one draft-verify-accept step per ``step``), so rows join and leave between
steps and every row's tokens are exactly what ``speculative_generate`` would give it. The rows' forwards run one
after another, not as one batched forward: the win is scheduling (no request waits for another to finish), not
throughput. CUDA-graph wrappers are unwrapped: their one static cache cannot hold several live rows."""

from __future__ import annotations

import time

import torch

from draftsmith.eval.accept import Sampler
from draftsmith.eval.decoder import DecodeStats, _sync, emit, prepare_prompt, target_pass
from draftsmith.eval.graphs import GraphedLlama
from draftsmith.eval.proposers import proposer_for
from draftsmith.eval.shapes import shape_for
from draftsmith.eval.tree import compact_cache


def _eager(model):
    return model.model if isinstance(model, GraphedLlama) else model  # GraphedEagle is a GraphedLlama


class _Row:
    """One request: its caches, its proposer and step shape, its committed tokens."""

    def __init__(self, dec: BatchDecoder, prompt_ids: torch.Tensor, max_new: int, sampler: Sampler):
        self.target, self.max_new, self.eos, self.sampler = dec.target, max_new, dec.eos_ids, sampler
        self.out: list[int] = []
        prompt = prepare_prompt(dec.target, prompt_ids)
        self.device = prompt.device
        if dec.drafter is None:
            self.proposer, self.shape = None, None
            self.stats = DecodeStats(accept_counts=[0])
            room = 0
        else:
            self.proposer = proposer_for(dec.drafter)(dec.target, dec.drafter, dec.stop_drafting)
            self.shape = shape_for(dec.target, self.proposer, dec.tree, dec.draft_len, sampler, None)
            self.stats = DecodeStats(accept_counts=[0] * (self.shape.depth + 1))
            room = self.shape.room
        cache_len = prompt.shape[1] + max_new + room + 2
        if cache_len > dec.max_len:
            raise ValueError(f"prompt of {prompt.shape[1]} tokens plus {max_new} new ones exceeds {dec.max_len}")
        self.cache = dec.target.new_cache(1, cache_len)
        layers = self.proposer.layers if self.proposer else ()
        logits, captured = target_pass(dec.target, prompt, self.cache, layers, last_only=True)
        self.cur, _ = sampler.pick(logits)
        if self.proposer is not None:
            self.proposer.prefill(prompt, captured, cache_len, check_vocab=dec.tree is None)
            self.layers = self.proposer.layers + self.shape.layers
        self.pending = [int(self.cur)]  # the prefill's token: committed by the first step
        self.done = False

    def step(self) -> list[int]:
        n0 = len(self.out)
        if self.pending:
            self.done = emit(self.out, self.pending, self.eos, self.max_new)
            self.pending = []
            return self.out[n0:]
        if self.proposer is None:
            logits = self.target(self.cur.view(1, 1), cache=self.cache)[0, -1]
            self.cur, _ = self.sampler.pick(logits)
            self.done = emit(self.out, [int(self.cur)], self.eos, self.max_new)
            self.stats.step(0, 0, 0.0, 0.0)
            return self.out[n0:]
        t0 = time.perf_counter()
        draft = self.shape.draft(self.proposer, self.cur, self.max_new - len(self.out) - 1)
        _sync(self.device)
        t1 = time.perf_counter()
        t_len = self.cache.length
        ids = torch.cat([self.cur, draft.tokens]).view(1, -1)
        logits, captured = target_pass(self.target, ids, self.cache, self.layers, **self.shape.placement(draft, t_len))
        accepted, keep, nxt, _ = self.shape.accept(draft, logits[0], captured)
        t2 = time.perf_counter()
        compact_cache(self.cache, t_len, keep)
        self.proposer.commit(draft, accepted, keep, captured)
        self.cur = self.cur.new_tensor([nxt])
        self.done = emit(self.out, accepted.tolist() + [nxt], self.eos, self.max_new)
        self.stats.step(draft.tokens.numel(), accepted.numel(), t1 - t0, t2 - t1)
        return self.out[n0:]


class BatchDecoder:
    """Rows decoded step by step with one drafter (None: plain decoding). ``tree`` (a static ``TreeSpec`` or a
    ``DynamicTree``) is this stand-in's extra: tree steps, as eval.strategy asks."""

    def __init__(self, target, drafter, *, draft_len=4, eos_ids=None, max_len=4096, stop_drafting=None, tree=None):
        self.target, self.drafter = _eager(target), None if drafter is None else _eager(drafter)
        self.draft_len, self.eos_ids, self.max_len = draft_len, eos_ids, max_len
        self.stop_drafting, self.tree = stop_drafting, tree
        self.rows: dict[int, _Row] = {}
        self.stats: dict[int, DecodeStats] = {}
        self._next = 0

    @torch.no_grad()
    def add(
        self, prompt_ids: torch.Tensor, max_new_tokens: int, *, temperature=0.0, top_k=0, top_p=1.0, generator=None
    ):
        if max_new_tokens <= 0:
            raise ValueError("max_new_tokens must be > 0")
        row = _Row(self, prompt_ids, max_new_tokens, Sampler(temperature, top_k, top_p, generator))
        rid, self._next = self._next, self._next + 1
        self.rows[rid], self.stats[rid] = row, row.stats
        return rid

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        new = {rid: row.step() for rid, row in list(self.rows.items())}
        for rid in [r for r, row in self.rows.items() if row.done]:
            self.rows[rid].stats.new_tokens = len(self.rows[rid].out)
            del self.rows[rid]
        return new

    def remove(self, row_id: int) -> None:
        row = self.rows.pop(row_id, None)
        if row is not None:
            row.stats.new_tokens = len(row.out)

    def active(self) -> list[int]:
        return list(self.rows)
