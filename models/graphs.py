"""CUDA-graph replay of batch-1 decoding forwards for our Llama (gpt-fast's "reduce-overhead" idea, without
torch.compile).

At batch 1 a ~1B model's decode step is bound by launching a few hundred small kernels from Python, not by the
GPU (benchmarks/RESULTS.md, GPU section). ``GraphedLlama`` keeps one static KV cache and runs every forward of T
new tokens (a decode step, a γ+1 verify, a tree) through a static-shape variant of the model: new K/V are written
at slot indices held in a tensor and attention reads the whole cache buffer under a full-width mask, so nothing in
the forward depends on a Python integer. Each (T, mask kind, captured layers) is captured once into a CUDA graph
and replayed: a verify that also returns hidden states (EAGLE's features, a head's last state) is one more shape,
not an eager forward (eager, an EAGLE verify of the packaged SmolLM2 took 33-47 ms on an H100 against 2.6 ms for a
graphed decode step, benchmarks/RESULTS.md session 18). Prefills (writes at slot 0), padded batches, ``logits_at``
and ``head_fn`` calls run eagerly on the same cache.

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
    out: object = None  # logits, or (logits, {layer: hidden})
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
        self._runs: dict[tuple, _Run] = {}  # (T, own mask, own positions, captured layers)
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

    def forward(self, ids, pos=None, cache=None, valid=None, attn_mask=None, capture_layers=(), logits_at=None,
                return_hidden=False, head_fn=None, s0: torch.Tensor | None = None):
        """``s0`` (a 0-d long tensor): the static-shape forward itself, with the first written slot held on the
        device and ``attn_mask`` (1, T, max_len) over the whole cache; no capture, no Python ints, so a caller can
        capture it inside its own graph (a whole dynamic tree, ``TreeGraph``). The cache's ``length`` is left as
        it was."""
        if s0 is not None:
            return self._forward_at(ids, pos, attn_mask, s0, tuple(capture_layers))
        T = ids.shape[1]
        eager = (cache is None or cache is not self._cache or ids.shape[0] != 1 or valid is not None
                 or cache.padded or logits_at is not None or return_hidden
                 or head_fn is not None or T > self.max_graph_tokens
                 or cache.length == 0)  # a prefill: one graph per prompt length would cost more than it saves
        if eager:
            return self.model(ids, pos=pos, cache=cache, valid=valid, attn_mask=attn_mask,
                              capture_layers=capture_layers, logits_at=logits_at, return_hidden=return_hidden,
                              head_fn=head_fn)
        s0 = cache.length
        if s0 + T > cache.max_len:
            raise ValueError(f"KV cache overflow: {s0}+{T} > {cache.max_len}")
        key = (T, attn_mask is not None, pos is not None, tuple(capture_layers))
        run = self._runs.get(key) or self._new_run(*key)
        # Few launches outside the graph: every one costs about as much as a small kernel at batch 1.
        run.ids.copy_(ids)
        self._s0.fill_(s0)
        if run.mask is not None:  # the caller's mask covers the filled slots; later slots are never attended
            run.mask.zero_()
            run.mask[:, :, :s0 + T] = attn_mask
        if run.pos is not None:
            run.pos.copy_(pos)
        if self.graphs and run.graph is None:
            try:
                self._capture(run)
            except RuntimeError as e:  # an op that cannot be captured: stay correct uncaptured, say so once
                run.graph = False
                log.warning("CUDA-graph capture failed for a %d-token forward (%s); it runs uncaptured",
                            T, str(e).splitlines()[0])
        if run.graph:
            run.graph.replay()
            out = run.out
        else:
            out = self._static_forward(run)
        cache.length = s0 + T
        # The graph's output buffers are overwritten by the next replay.
        return (out[0].clone(), {k: v.clone() for k, v in out[1].items()}) if run.layers else out.clone()

    def _new_run(self, T: int, custom_mask: bool, custom_pos: bool, layers: tuple[int, ...] = ()) -> _Run:
        dev = self._arange.device
        run = _Run(ids=torch.zeros(1, T, dtype=torch.long, device=dev),
                   pos=torch.zeros(1, T, dtype=torch.long, device=dev) if custom_pos else None,
                   mask=torch.zeros(1, T, self.max_len, dtype=torch.bool, device=dev) if custom_mask else None,
                   layers=layers)
        self._runs[(T, custom_mask, custom_pos, layers)] = run
        return run

    def _static_forward(self, run: _Run) -> torch.Tensor:
        mask = run.mask
        if mask is None:  # causal in slot order, as KVCache's own mask
            mask = self._arange[None, None, :] <= (self._s0 + self._arange[:run.ids.shape[1]])[None, :, None]
        return self._forward_at(run.ids, run.pos, mask, self._s0, run.layers)

    def _forward_at(self, ids, pos, mask, s0: torch.Tensor, capture_layers: tuple[int, ...] = ()):
        cache, T = self._cache, ids.shape[1]
        slots = s0 + self._arange[:T]  # (T,): everything below reads the slot offset from a tensor
        cache.valid.index_fill_(1, slots, True)
        cache.slots = slots
        try:
            return self.model(ids, pos=slots.view(1, T) if pos is None else pos, cache=cache,
                              attn_mask=mask & cache.valid[:, None, :],  # (1, T, max_len)
                              capture_layers=capture_layers)
        finally:
            cache.slots = None

    def _capture(self, run: _Run) -> None:
        run.graph, run.out = self.capture(lambda: self._static_forward(run))

    def capture(self, fn):
        """-> (graph, fn's output): ``fn`` captured into a CUDA graph in this model's memory pool (replays never
        overlap). Warmed up on a side stream first, as torch.cuda.graphs asks; the inputs are the real ones, so the
        warm-up writes the very K/V the replay writes again: capturing changes nothing."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA work (the online learner trains in the serving process) must not
        # invalidate this thread's capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = fn()
        self._pool = graph.pool()
        return graph, out


def graph_decoding(model: nn.Module, max_len: int, graphs: bool = True) -> nn.Module:
    """``model`` wrapped in a GraphedLlama when it is one of our Llamas (targets and draft LMs); else as is."""
    return GraphedLlama(model, max_len, graphs) if type(model) is Llama else model
