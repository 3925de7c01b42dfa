"""CUDA-graph replay of batch-1 decoding forwards for our Llama and EAGLE drafters (gpt-fast's "reduce-overhead"
idea, without torch.compile).

At batch 1 a ~1B model's decode step is bound by launching a few hundred small kernels from Python, not by the
GPU (benchmarks/RESULTS.md, GPU section). ``GraphedLlama`` keeps one static KV cache and runs every forward of T
new tokens (a decode step, a γ+1 verify, a tree) through a static-shape variant of the model: new K/V are written
at slot indices held in a tensor and attention reads the whole cache buffer under a full-width mask, so nothing in
the forward depends on a Python integer. Each (T, mask kind, captured layers) is captured once into a CUDA graph
and replayed: a verify that also returns hidden states (EAGLE's features, a head's last state) is one more shape,
not an eager forward (eager, an EAGLE verify of the packaged SmolLM2 took 33-47 ms on an H100 against 2.6 ms for a
graphed decode step, benchmarks/journal/2026-11-24-h100-deepspeed-eagle3.md). Prefills (writes at slot 0), padded
batches, ``logits_at`` and ``head_fn`` calls run eagerly on the same cache.

``GraphedEagle`` does the same for an EAGLE drafter's ``step(state, ids, ...)``: the state is one more static
input, and each (T, mask kind, last-only) is a graph. An eager EAGLE draft step cost 1.7 ms in fp32 on the H100
(2026-11-24), most of a graphed 30-layer verify, for a one-layer model: launch overhead again.

With ``graphs=False`` (any device) the same static-shape forward runs without capture: the tests use it on CPU to
check that the static path equals the eager one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from draftsmith.models.llama import KVCache, Llama

log = logging.getLogger(__name__)


@dataclass
class _Run:
    """Static buffers of one captured forward shape."""

    ids: torch.Tensor  # (1, T)
    pos: torch.Tensor | None  # (1, T) the caller's RoPE positions (a tree), or None: the slots themselves
    mask: torch.Tensor | None  # (1, T, max_len): the caller's (tree) mask, or None for causal-in-slot-order
    layers: tuple[int, ...] = ()  # hidden states returned with the logits (Llama.forward's capture_layers)
    state: torch.Tensor | None = None  # (1, T, d) EAGLE's input states
    last_only: bool = False  # EAGLE: logits of the last position only
    out: object = None  # logits, (logits, {layer: hidden}) or EAGLE's (logits, states)
    graph: object = None  # None: not captured yet; False: capture failed, runs uncaptured


class GraphedLlama(nn.Module):
    """Wraps a ``Llama`` for batch-1 decoding; same call signature, same outputs (to float rounding)."""

    def __init__(self, model: Llama, max_len: int, graphs: bool = True, max_graph_tokens: int = 128):
        super().__init__()
        self.model = model
        self.max_len = max_len
        self.max_graph_tokens = max_graph_tokens
        device = model.embed_tokens.weight.device
        self.graphs = graphs and device.type == "cuda"
        self.register_buffer("_arange", torch.arange(max_len, device=device), persistent=False)
        self.register_buffer("_s0", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self._cache: KVCache | None = None
        self._runs: dict[tuple, _Run] = {}  # (T, own mask, own positions, captured layers | EAGLE's last-only)
        self._pool = None

    def __getattr__(self, name):  # cfg, lm_head, norm, d2t, num_params ... come from the wrapped model
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """The one static cache, emptied (its buffers stay where the graphs read them); an ordinary cache for
        shapes it does not cover. One decode at a time per model: a second live cache would share the buffers."""
        if batch != 1 or max_len > self.max_len:
            return self.model.new_cache(batch, max_len)
        if self._cache is None:
            self._cache = self.model.new_cache(1, self.max_len)
        c = self._cache
        c.length, c.padded, c.slots = 0, False, None
        c.valid.zero_()
        return c

    def forward(
        self,
        ids,
        pos=None,
        cache=None,
        valid=None,
        attn_mask=None,
        capture_layers=(),
        logits_at=None,
        return_hidden=False,
        head_fn=None,
        s0: torch.Tensor | None = None,
    ):
        """``s0`` (a 0-d long tensor): the static-shape forward itself, with the first written slot held on the
        device and ``attn_mask`` (1, T, max_len) over the whole cache; no capture, no Python ints, so a caller can
        capture it inside its own graph (a whole dynamic tree, ``TreeGraph``). The cache's ``length`` is left as
        it was."""
        if s0 is not None:
            return self._forward_at(ids, pos, attn_mask, s0, tuple(capture_layers))
        T = ids.shape[1]
        eager = (
            cache is None
            or cache is not self._cache
            or ids.shape[0] != 1
            or valid is not None
            or cache.padded
            or logits_at is not None
            or return_hidden
            or head_fn is not None
            or T > self.max_graph_tokens
            or cache.length == 0
        )  # a prefill: one graph per prompt length would cost more than it saves
        if eager:
            return self.model(
                ids,
                pos=pos,
                cache=cache,
                valid=valid,
                attn_mask=attn_mask,
                capture_layers=capture_layers,
                logits_at=logits_at,
                return_hidden=return_hidden,
                head_fn=head_fn,
            )
        key = (T, attn_mask is not None, pos is not None, tuple(capture_layers))
        return self._replay(key, cache, ids, pos, attn_mask, layers=tuple(capture_layers))

    def _replay(
        self,
        key: tuple,
        cache: KVCache,
        ids,
        pos,
        attn_mask,
        layers: tuple[int, ...] = (),
        state=None,
        last_only: bool = False,
    ):
        """One static-shape call: inputs into the run's buffers, then the graph (captured on first use)."""
        T, s0 = ids.shape[1], cache.length
        if s0 + T > cache.max_len:
            raise ValueError(f"KV cache overflow: {s0}+{T} > {cache.max_len}")
        run = self._runs.get(key) or self._new_run(
            key, T, attn_mask is not None, pos is not None, layers, state, last_only
        )
        # Few launches outside the graph: every one costs about as much as a small kernel at batch 1.
        run.ids.copy_(ids)
        self._s0.fill_(s0)
        if run.state is not None:
            run.state.copy_(state)
        if run.mask is not None:  # the caller's mask covers the filled slots; later slots are never attended
            run.mask.zero_()
            run.mask[:, :, : s0 + T] = attn_mask
        if run.pos is not None:
            run.pos.copy_(pos)
        if self.graphs and run.graph is None:
            try:
                self._capture(run)
            except RuntimeError as e:  # an op that cannot be captured: stay correct uncaptured, say so once
                run.graph = False
                log.warning(
                    "CUDA-graph capture failed for a %d-token forward (%s); it runs uncaptured",
                    T,
                    str(e).splitlines()[0],
                )
        if run.graph:
            run.graph.replay()
            out = run.out
        else:
            out = self._static_forward(run)
        cache.length = s0 + T
        return _clone(out)  # a graph's output buffers are overwritten by the next replay

    def _new_run(
        self,
        key: tuple,
        T: int,
        custom_mask: bool,
        custom_pos: bool,
        layers: tuple[int, ...] = (),
        state: torch.Tensor | None = None,
        last_only: bool = False,
    ) -> _Run:
        dev = self._arange.device
        run = _Run(
            ids=torch.zeros(1, T, dtype=torch.long, device=dev),
            pos=torch.zeros(1, T, dtype=torch.long, device=dev) if custom_pos else None,
            mask=torch.zeros(1, T, self.max_len, dtype=torch.bool, device=dev) if custom_mask else None,
            layers=layers,
            state=None if state is None else torch.zeros_like(state),
            last_only=last_only,
        )
        self._runs[key] = run
        return run

    def _static_forward(self, run: _Run) -> torch.Tensor:
        mask = run.mask
        if mask is None:  # causal in slot order, as KVCache's own mask
            mask = self._arange[None, None, :] <= (self._s0 + self._arange[: run.ids.shape[1]])[None, :, None]
        return self._forward_at(run.ids, run.pos, mask, self._s0, run.layers, run)

    def _forward_at(self, ids, pos, mask, s0: torch.Tensor, capture_layers: tuple[int, ...] = (), run=None):
        cache, T = self._cache, ids.shape[1]
        slots = s0 + self._arange[:T]  # (T,): everything below reads the slot offset from a tensor
        cache.valid.index_fill_(1, slots, True)
        cache.slots = slots
        try:
            return self._call(
                ids, slots.view(1, T) if pos is None else pos, mask & cache.valid[:, None, :], run, capture_layers
            )
        finally:
            cache.slots = None

    def _call(self, ids, pos, mask, run, capture_layers):
        """The wrapped model's own forward in static mode; mask (1, T, max_len)."""
        return self.model(ids, pos=pos, cache=self._cache, attn_mask=mask, capture_layers=capture_layers)

    def _capture(self, run: _Run) -> None:
        run.graph, run.out = self.capture(lambda: self._static_forward(run))

    def capture(self, fn):
        """-> (graph, fn's output): ``fn`` captured into a CUDA graph in this model's memory pool (replays never
        overlap); see ``capture_graph``."""
        graph, out = capture_graph(fn, self._pool)
        self._pool = graph.pool()
        return graph, out


def capture_graph(fn, pool=None):
    """-> (graph, fn's output): ``fn`` captured into a CUDA graph (in memory pool ``pool``, e.g. another graph's
    ``pool()``, when given). Warmed up on a side stream first, as torch.cuda.graphs asks; the inputs are the real
    ones, so the warm-up writes the very K/V the replay writes again: capturing changes nothing."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: other threads' CUDA work (the online learner trains in the serving process) must not
    # invalidate this thread's capture.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


class GraphedEagle(GraphedLlama):
    """Wraps an EAGLE drafter (models/eagle.py) for batch-1 decoding: ``step`` as the model's, captured per
    (T, own mask, own positions, last-only). Its first call on an empty cache (the prompt) runs eagerly."""

    def forward(self, *args, **kwargs):  # EAGLE's forward is its training-time unroll: never captured
        return self.model(*args, **kwargs)

    def step(self, state, ids, pos=None, cache=None, attn_mask=None, last_only: bool = False, valid=None):
        T = ids.shape[1]
        if (
            cache is None
            or cache is not self._cache
            or ids.shape[0] != 1
            or valid is not None
            or cache.padded
            or T > self.max_graph_tokens
            or cache.length == 0
        ):
            return self.model.step(
                state, ids, pos=pos, cache=cache, attn_mask=attn_mask, last_only=last_only, valid=valid
            )
        key = (T, attn_mask is not None, pos is not None, last_only)
        return self._replay(key, cache, ids, pos, attn_mask, state=state, last_only=last_only)

    def _call(self, ids, pos, mask, run, capture_layers):
        return self.model.step(run.state, ids, pos=pos, cache=self._cache, attn_mask=mask, last_only=run.last_only)


def _clone(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, dict):
        return {k: v.clone() for k, v in out.items()}
    return tuple(_clone(o) for o in out)


def graph_decoding(model: nn.Module, max_len: int, graphs: bool = True) -> nn.Module:
    """``model`` wrapped for CUDA graphs when it is one of our Llamas (targets and draft LMs) or a feature drafter
    (EAGLE: ``reads_target_features``, stepped through ``step``); else as is (sliding-window models too: their window
    mask is built per step, eagerly)."""
    windowed = getattr(getattr(model, "cfg", None), "sliding_window", None) is not None
    if windowed or not getattr(model, "graphable", True):  # (Falcon's block reads attend without writing)
        return model
    if type(model) is Llama:
        return GraphedLlama(model, max_len, graphs)
    return GraphedEagle(model, max_len, graphs) if getattr(model, "reads_target_features", False) else model
