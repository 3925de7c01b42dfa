"""`draftsmith serve RECIPE`: an OpenAI-compatible HTTP server on the bundled speculative decoder that records its
traffic and keeps the drafter learning from it (online distillation, draftsmith/serving/online.py).

Endpoints (an ASGI app, FastAPI on uvicorn):
- POST /v1/chat/completions, POST /v1/completions, with ``"stream": true`` as server-sent events;
- GET /v1/models, GET /health;
- GET /metrics in Prometheus text (prometheus_client): requests, tokens, τ, acceptance, tokens/s, queue depth,
  running requests, latency and time-to-first-token histograms, drafter version, swaps.

Serving:
- Continuous batching: one decode thread owns the models. Requests wait in a bounded queue; between steps the
  thread admits them into the running batch (up to ``online.max_batch`` rows), steps every row, pushes each row's
  committed tokens to its request as they come, and drops rows that finished, were cancelled (the client left) or
  ran out of time.
- Hot swap: when ``current.json`` names another version (a learner publish, a rollback), new requests start on
  the new drafter while rows already running keep the drafter they started with, in their own decoder, until they
  drain; no answer mixes two drafters.
- Loopback bind by default, optional API key (``DRAFTSMITH_API_KEY``) on /v1, bounded body, ``max_tokens``,
  queue, decode time and connection idle time. Prompts and tokens are never logged.
- Output is the target's own (greedy, or lossless sampling), whatever the drafter.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import h11
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from draftsmith import __version__
from draftsmith.errors import DraftsmithError, redact
from draftsmith.eval.accept import Adjust
from draftsmith.eval.batch_decoder import BatchDecoder
from draftsmith.eval.bench import build_tree, fast_drafter, fast_model, stop_rule, stops
from draftsmith.eval.own_vocab import for_decoding, own_vocab_options
from draftsmith.models.loading import encode_chat, load_model, read_json, stop_ids
from draftsmith.models.registry import check_fits_target, load_drafter
from draftsmith.runtime import resolve_device, resolve_dtype
from draftsmith.serving.online import Learner, Versions, online_dir
from draftsmith.serving.traffic import TrafficBuffer

log = logging.getLogger("draftsmith.serve")

API_KEY_ENV = "DRAFTSMITH_API_KEY"
BACKLOG = 2048  # pending connections the kernel queues before accept (socketserver's default is 5)
MIN_TEMPERATURE = 1e-5  # below it sampling is greedy: logits / t overflow fp32
# fp32 reads a smaller top_p as 0, which drops every token (NaN probabilities). With under 10^6 tokens the most
# probable one always holds more mass than this, so the clamp keeps exactly what the asked top_p keeps: that token.
MIN_TOP_P = 1e-6
DRAFT_ROOM = 1024  # cache slots past prompt + answer for a step's drafts (trees stay under 512)


def make_decoder(target, drafter, *, draft_len: int, eos_ids, max_len: int, stop_drafting=None, tree=None):
    """The one place the server picks its decoder: rows that join and leave between steps (add / step / remove /
    active / stats), every row verified in one batched target forward per step (eval/batch_decoder.py; trees draft
    as one batch, eval/proposers.py). It takes the models without CUDA-graph wrappers, whose one static cache holds one
    row."""
    return BatchDecoder(target, drafter, draft_len=draft_len, eos_ids=eos_ids, max_len=max_len,
                        stop_drafting=stop_drafting, tree=None if drafter is None else tree)  # fmt: skip


class TextStream:
    """A streamed answer's text, sent in whole characters: a character whose bytes span tokens is held back until it
    completes (``push``), and what is still held when the answer ends goes out with ``finish``, so the streamed
    pieces always join to the non-streamed answer's text."""

    def __init__(self, tok, eos: set[int]):
        self.tok, self.eos, self.tokens, self.sent = tok, eos, [], ""

    def _text(self) -> str:
        return self.tok.decode([t for t in self.tokens if t not in self.eos], skip_special_tokens=True)

    def push(self, tokens: list[int]) -> str:
        self.tokens += tokens
        text = self._text()
        if len(text) <= len(self.sent) or text.endswith("\ufffd"):  # whole characters only
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta

    def finish(self) -> str:
        text = self._text()
        delta, self.sent = text[len(self.sent) :], text
        return delta


def _requeue_first(events: asyncio.Queue, first) -> None:
    """Put ``first`` back at the head of ``events`` (later events may already wait behind it)."""
    rest = [events.get_nowait() for _ in range(events.qsize())]
    for e in (first, *rest):
        events.put_nowait(e)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: int = 400):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass
class Job:
    """One choice of a request: its prompt and sampling, decoded in one row. A request's choices (``n``) share one
    event queue, each event tagged with its choice's index."""

    prompt: list[int]
    max_tokens: int
    sampling: dict  # BatchDecoder.add's temperature, top_p, top_k, adjust, logprobs
    seed: int | None  # its own generator from this seed; None: the server's
    events: asyncio.Queue  # (index, "tokens", (ids, logprob entries | None)).. then (index, "done" | "error", ..)
    loop: asyncio.AbstractEventLoop
    index: int = 0
    deadline: float = math.inf  # set when it gets a decoding row: request_timeout_s counts decoding, not queueing
    cancelled: bool = False  # set by the request's side when its client left, or a stop string ended the choice
    tokens: list[int] = field(default_factory=list)  # the decode thread's copy
    versions: set[str] = field(default_factory=set)  # the drafter versions that produced its tokens (one)
    start: float = field(default_factory=time.perf_counter)
    queued: float = field(default_factory=time.monotonic)

    def push(self, kind: str, val) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, kind, val))
        except RuntimeError:  # the event loop is gone (server stopped): nobody waits for this answer
            self.cancelled = True


class _Collector:
    """Prometheus view of the engine's counters, read under its lock at scrape time."""

    def __init__(self, engine: Engine):
        self.e = engine

    def collect(self):
        e = self.e
        with e.lock:
            m, running, live = dict(e.m), e.running, len(e.live)
        tau = m["tokens"] / m["forwards"] if m["forwards"] else 0.0
        acc = m["accepted"] / m["drafted"] if m["drafted"] else 0.0
        tps = m["tokens"] / m["decode_s"] if m["decode_s"] else 0.0
        for name, help_text, value in (
            ("requests", "Requests decoded.", m["requests"]),
            ("errors", "Requests that failed in the decoder.", m["errors"]),
            ("generated_tokens", "Tokens generated.", m["tokens"]),
            ("target_forwards", "Target verify forwards.", m["forwards"]),
            ("drafter_swaps", "Hot swaps of the drafter.", m["swaps"]),
            ("online_rounds", "Online updates run by this server.", m["rounds"]),
            ("recorded_requests", "Requests recorded to the traffic buffer.", m["recorded"]),
            ("rejected_requests", "Requests refused with 503 because the queue was full.", m["rejected"]),
            ("decode_steps", "Batched decode steps.", m["steps"]),
            (
                "plain_steps",
                "Decode steps that drafted nothing (more rows than online.speculate_max_batch).",
                m["plain_steps"],
            ),  # fmt: skip
        ):
            yield CounterMetricFamily(f"draftsmith_{name}", help_text, value=value)
        for name, help_text, value in (
            ("tau", "Tokens per target forward since start.", round(tau, 4)),
            ("acceptance_rate", "Accepted / drafted tokens since start.", round(acc, 4)),
            ("tokens_per_second", "Generated tokens per second of decode-loop time since start.", round(tps, 2)),
            ("queue_depth", "Requests waiting for a row in the decode batch.", e.queue.qsize()),
            ("running_requests", "Requests in the running decode batch.", running),
            ("live_drafters", "Drafter versions with rows decoding (2 while an old version drains).", live),
            ("drafter_version", "Serving drafter version number.", int(e.version[1:])),
        ):
            yield GaugeMetricFamily(f"draftsmith_{name}", help_text, value=value)


class Engine:
    """The target, the drafter versions, the traffic buffer, the metrics and the decode thread."""

    def __init__(self, recipe):
        self.recipe, self.oc, self.ec = recipe, recipe.online, recipe.eval
        if self.ec.judge is not None:
            raise DraftsmithError("eval.judge: serve decodes losslessly; judge verification (lossy) is eval-only")
        self.device = resolve_device(recipe.target.device)
        self.dtype = resolve_dtype(recipe.target.dtype, self.device)
        t = recipe.target
        self.tgt = load_model(t.model, self.dtype, self.device, t.trust_remote_code, t.revision, backend=t.backend)
        if self.tgt.backend == "transformers":  # rows come and go on the slot cache: refused before any state
            self.tgt.model.require_slots("serve")
        self.tok, self.eos = self.tgt.tokenizer, stop_ids(self.tgt.path, self.tgt.tokenizer)
        self.root = online_dir(recipe)
        ckpt = Path(self.ec.checkpoint) if self.ec.checkpoint else recipe.run_dir / "checkpoints" / "final"
        if not (self.root / "current.json").is_file() and (ckpt / "drafter.json").is_file():
            # before it becomes version v0000: a drafter for another target is refused, and no state is written
            info = read_json(ckpt / "drafter.json")
            if own_vocab_options(ckpt, info, self.ec) is None:  # (one with its own tokenizer: any target)
                check_fits_target(ckpt, info, self.tgt)
        self.versions = Versions(self.root, ckpt)
        self.buffer = TrafficBuffer(self.root / "traffic", self.oc.buffer_max_records)
        self.max_len = min(4096, self.tgt.model.cfg.max_seq_len)  # prompt + answer
        self.target = self._fast(self.tgt.model)
        self.version, self.drafter, self.tree, self.stop = None, None, None, None
        self.live: dict[str, object] = {}  # version -> its decoder, while it has rows (or is current)
        self._load_current()
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=self.oc.max_queue)
        self.closing = False  # set on SIGTERM: new requests get 503 while the running ones drain
        self.lock = threading.Lock()
        self.running = 0
        self.m = dict.fromkeys(
            ("requests", "errors", "tokens", "forwards", "drafted", "accepted", "decode_s", "swaps", "rounds"), 0
        ) | {"recorded": 0, "rejected": 0, "plain_steps": 0, "steps": 0}
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.latency = Histogram(
            "draftsmith_request_seconds", "Request time from queueing to the last token.", buckets=buckets,
            registry=self.registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "draftsmith_time_to_first_token_seconds", "Request time from queueing to its first token.",
            buckets=buckets, registry=self.registry,
        )  # fmt: skip
        self.gen = torch.Generator(device=self.device).manual_seed(recipe.seed)
        self._stop = threading.Event()
        self._records: queue.Queue = queue.Queue()
        threading.Thread(target=self._decode_loop, args=(self.queue,), daemon=True, name="decode").start()
        threading.Thread(target=self._recorder, daemon=True, name="recorder").start()
        if self.oc.learn:
            threading.Thread(target=self._learn, daemon=True, name="learner").start()

    def _fast(self, model):
        return fast_model(model, self.ec, self.device, self.max_len + DRAFT_ROOM)

    def _load_current(self) -> bool:
        version, path = self.versions.current()
        if version == self.version:
            return False
        drafter, info = load_drafter(path, dtype=self.dtype, device=self.device)
        drafter = for_decoding(path, drafter, info, self.tok, self.ec)  # its own tokenizer: eval.own_vocab
        stop = None
        if stops(info, self.ec):  # eval.stop, as eval decodes
            drafter, info, stop, _ = stop_rule(self.ec, drafter, info, path, self.dtype, self.device)
        if not info.get("draft_tokenizer"):  # as eval does: refused at start, not with a 500 per request
            check_fits_target(path, info, self.tgt)
        if getattr(drafter, "target_adapter", None) is not None:
            raise DraftsmithError(
                f"{path}: a Medusa-2 drafter carries target adapters, which serve does not merge into the served "
                f"target; serve Medusa-1 heads (drafter.lora_r=0) or evaluate it with draftsmith eval"
            )
        tree = build_tree(self.ec, getattr(drafter, "max_draft_len", None))  # eval.strategy: chain or a tree
        drafter = fast_drafter(drafter, self.ec, self.device, self.max_len + DRAFT_ROOM)
        self.drafter, self.tree, self.stop, self.version = drafter, tree, stop, version
        log.info("serve: drafter %s loaded from %s", version, path)
        return True

    def _decoder(self):
        """The current version's decoder; a new version gets a new one, the old one drains its rows."""
        try:
            if self._load_current():
                with self.lock:
                    self.m["swaps"] += 1
        except Exception:  # a broken publish must not stop serving: the loaded version goes on
            log.exception("serve: loading the new drafter version failed; %s keeps serving", self.version)
        if self.version not in self.live:
            self.live[self.version] = make_decoder(
                self.target,
                self.drafter if self.oc.speculate else None,  # online.speculate: false decodes plainly
                draft_len=self.ec.draft_len,
                eos_ids=self.eos,
                max_len=self.max_len + DRAFT_ROOM,
                stop_drafting=self.stop,
                tree=self.tree,
            )
        return self.live[self.version]

    # ---- the decode thread ---------------------------------------------------------------------------------

    def _decode_loop(self, pending: queue.Queue) -> None:
        rows: dict[tuple[str, int], Job] = {}  # (version, row id) -> its request
        while not self._stop.is_set():
            if not rows:
                try:
                    job = pending.get(timeout=0.2)
                except queue.Empty:
                    continue
                self._admit(job, rows)
            while len(rows) < self.oc.max_batch:
                try:
                    self._admit(pending.get_nowait(), rows)
                except queue.Empty:
                    break
            for version, dec in list(self.live.items()):
                if dec.active():
                    self._step(version, dec, rows)
                if not dec.active() and version != self.version:
                    del self.live[version]  # an old version drained
            with self.lock:
                self.running = len(rows)

    def _admit(self, job: Job, rows: dict) -> None:
        if job.cancelled:
            return
        waited = time.monotonic() - job.queued
        if waited > self.oc.queue_timeout_s:  # refused before any token, never cut short for a busy server
            with self.lock:
                self.m["rejected"] += 1
            job.push("busy", f"server busy: waited {waited:.0f} s for a decoding row (online.queue_timeout_s)")
            return
        job.deadline = time.monotonic() + self.oc.request_timeout_s
        try:
            dec = self._decoder()
            gen = self.gen
            if job.seed is not None:  # its own stream: the same seed gives the same answer, whatever the batch
                gen = torch.Generator(device=self.device).manual_seed(job.seed)
            rid = dec.add(torch.tensor(job.prompt), job.max_tokens, generator=gen, **job.sampling)
        except Exception as e:  # a bad request must not take the loop down
            log.exception("serve: admitting a request failed")
            self._fail(job, e)
            return
        rows[(self.version, rid)] = job

    def _step(self, version: str, dec, rows: dict) -> None:
        t0 = time.perf_counter()
        cap = self.oc.speculate_max_batch
        speculate = cap is None or len(dec.rows) + len(dec.pending) <= cap
        try:
            new = dec.step(speculate=speculate)
        except Exception as e:  # the decoder's state is suspect: its rows fail, a fresh one serves new requests
            log.exception("serve: decode step failed")
            for key in [k for k in rows if k[0] == version]:
                self._fail(rows.pop(key), e)
            del self.live[version]
            return
        with self.lock:
            self.m["decode_s"] += time.perf_counter() - t0
            self.m["plain_steps"] += not speculate
            self.m["steps"] += 1
        for rid, toks in new.items():
            job = rows.get((version, rid))
            if job is not None and toks:
                if not job.tokens:
                    self.ttft.observe(time.perf_counter() - job.start)
                job.tokens += toks
                job.versions.add(version)
                lps = dec.logprobs.get(rid)
                if lps is not None:  # this step's entries, one per token
                    lps, dec.logprobs[rid] = lps[:], []
                job.push("tokens", (toks, lps))
        active, now = set(dec.active()), time.monotonic()
        for key in [k for k in rows if k[0] == version]:
            job, rid = rows[key], key[1]
            if rid in active and (job.cancelled or now > job.deadline):
                dec.remove(rid)
                active.discard(rid)
            if rid not in active:
                del rows[key]
                dec.logprobs.pop(rid, None)
                self._finish(job, version, dec.stats.pop(rid, None))

    def _fail(self, job: Job, e: Exception) -> None:
        with self.lock:
            self.m["errors"] += 1
        job.push("error", f"{type(e).__name__}: {e}")

    def _finish(self, job: Job, version: str, stats) -> None:
        tokens = job.tokens
        finish = "stop" if tokens and tokens[-1] in self.eos else "length"
        self.latency.observe(time.perf_counter() - job.start)
        with self.lock:
            m = self.m
            m["requests"] += 1
            m["tokens"] += len(tokens)
            if stats is not None:
                m["forwards"] += stats.target_forwards
                m["drafted"] += stats.drafted
                m["accepted"] += stats.accepted
        record = None
        if tokens:  # the target's own continuation, whatever the drafter proposed: a valid teacher sequence
            record = {
                "prompt": job.prompt,
                "response": tokens,
                "version": version,
                "tau": stats.tau if stats else None,
                "accept_counts": stats.accept_counts if stats else None,
                "target_positions": stats.target_positions() if stats else None,
            }
        info = {"finish_reason": finish, "completion_tokens": len(tokens), "prompt_tokens": len(job.prompt)}
        self._records.put((job, record, info))

    def _recorder(self) -> None:
        """Writes each finished request to the traffic log (fsync'd) before its answer completes, off the decode
        thread."""
        while True:
            job, record, info = self._records.get()
            if record is not None:
                try:
                    self.buffer.append(record)
                    with self.lock:
                        self.m["recorded"] += 1
                except Exception:
                    log.exception("serve: recording a request failed")
            job.push("done", info)

    def _learn(self) -> None:
        learner = None
        while not self._stop.is_set():
            time.sleep(1.0)
            try:
                learner = learner or Learner(self.recipe, self.buffer, self.versions)
                if learner.due():
                    learner.round()
                    with self.lock:
                        self.m["rounds"] += 1
            except Exception:  # a failed update keeps the current version serving
                log.exception("serve: online update failed; the current drafter keeps serving")
                time.sleep(30)

    # ---- requests ------------------------------------------------------------------------------------------

    def submit(self, req: Params) -> list[Job]:
        """Queue a request's ``n`` choices (all or none: queue.Full when they do not fit)."""
        events, loop = asyncio.Queue(), asyncio.get_running_loop()
        jobs = [
            Job(req.prompt, req.max_tokens, req.sampling, req.seed_of(i), events, loop, index=i) for i in range(req.n)
        ]
        with self.lock:
            if self.closing or self.queue.qsize() + len(jobs) > self.oc.max_queue:
                self.m["rejected"] += 1
                raise queue.Full
            for job in jobs:
                self.queue.put_nowait(job)
        return jobs

    def metrics_text(self) -> str:
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        self._stop.set()


# ---- the HTTP side -----------------------------------------------------------------------------------------------


def _number(req: dict, name: str, default, integer: bool = False):
    v = req.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise BadRequest(f"{name} must be a finite number", name)
    if (isinstance(v, int) and abs(v) > 2**53) or not math.isfinite(v):  # a huge int would overflow float()
        raise BadRequest(f"{name} must be a finite number of sensible size", name)
    if integer:
        if isinstance(v, float) and not v.is_integer():
            raise BadRequest(f"{name} must be an integer", name)
        return int(v)
    return float(v)


ROLES = ("system", "user", "assistant")
# The request fields served. Any other field is a 400 naming it (never ignored: an ignored field answers something
# else than asked), unless it holds a value that asks for nothing (echo: false, tools: [], ...).
FIELDS = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "stream", "stream_options", "user", "n", "stop", "seed", "min_tokens", "presence_penalty",
          "frequency_penalty", "logit_bias", "logprobs", "top_logprobs"}  # fmt: skip
NEUTRAL = {
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
}
MAX_N = 16  # choices per request
MAX_STOP = 4  # stop strings per request (OpenAI's bound)
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (completions' logprobs: 5)
MAX_LOGIT_BIAS = 300  # entries of logit_bias (OpenAI's bound)


def _unsupported(req: dict, chat: bool) -> None:
    for name, value in req.items():
        if name == "top_logprobs" and not chat and value is not None:  # completions say it with logprobs: k
            raise BadRequest("top_logprobs is a chat field; completions take logprobs: k (0-5)", name)
        if name in FIELDS or value is None or value in NEUTRAL.get(name, ()):
            continue
        raise BadRequest(f"{name} is not supported by this server (draftsmith serve)", name)


@dataclass
class Params:
    """A parsed request: what the decode thread needs for each of its ``n`` choices, and how to answer."""

    prompt: list[int]
    max_tokens: int
    n: int = 1
    sampling: dict = field(default_factory=dict)  # BatchDecoder.add's temperature, top_p, top_k, adjust, logprobs
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    usage: bool = False  # stream_options.include_usage

    def seed_of(self, i: int) -> int | None:
        """Choice i's seed: the request's for the first, one derived from it for the others."""
        if self.seed is None:
            return None
        return self.seed % 2**64 if i == 0 else hash((self.seed, i)) % 2**64


def _integer(req: dict, name: str, lo: int, hi: int, default: int | None = None) -> int | None:
    v = _number(req, name, default, integer=True)
    if v is not None and not lo <= v <= hi:
        raise BadRequest(f"{name} must be an integer in [{lo}, {hi}]", name)
    return v


def _sampling(req: dict, chat: bool, temperature: float, top_p: float, max_tokens: int, vocab: int, eos) -> dict:
    """The decoder's sampling keywords from a request (temperature and top_p already read)."""
    top_k = _integer(req, "top_k", -1, vocab, 0)
    presence, frequency = _number(req, "presence_penalty", 0.0), _number(req, "frequency_penalty", 0.0)
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2 <= v <= 2:
            raise BadRequest(f"{name} must be in [-2, 2]", name)
    min_tokens = _integer(req, "min_tokens", 0, max_tokens, 0)
    bias = req.get("logit_bias") or {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    pairs = []
    for k, v in bias.items():
        if not (isinstance(k, str) and k.isdecimal() and len(k) < 10 and int(k) < vocab):
            raise BadRequest(f"logit_bias key {k[:20]!r} is not a token id below {vocab}", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, int | float) or not -100 <= v <= 100:
            raise BadRequest(f"logit_bias values must be numbers in [-100, 100] (token {k})", "logit_bias")
        pairs.append((int(k), float(v)))
    adjust = None
    if presence or frequency or pairs or min_tokens:
        adjust = Adjust(presence, frequency, tuple(pairs), min_tokens, tuple(sorted(eos)))
    if chat:
        want = req.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise BadRequest("logprobs must be true or false (top_logprobs: how many alternatives)", "logprobs")
        top = _integer(req, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not want:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _integer(req, "logprobs", 0, 5)
    return {"temperature": temperature, "top_p": top_p, "top_k": max(top_k, 0), "adjust": adjust,
            "logprobs": logprobs}  # fmt: skip


def _stops(req: dict) -> tuple[str, ...]:
    stop = req.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(x, str) and x for x in stop)):
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    if any(len(x) > 1000 for x in stop):
        raise BadRequest("stop strings must be at most 1000 characters", "stop")
    return tuple(_unicode(x, "stop") for x in stop)


class Choice:
    """One choice's answer as its tokens arrive: whole characters (``TextStream``), ended at the first stop string
    (excluded from the text, as OpenAI does, wherever token boundaries fall), with text that could still begin a
    stop string held back until it cannot; the target's logprobs of its tokens."""

    def __init__(self, tok, eos: set[int], stop: tuple[str, ...]):
        self.text, self.stop = TextStream(tok, eos), stop
        self.full, self.sent = "", 0  # whole characters so far, and how many went out
        self.tokens, self.entries = 0, []  # tokens so far, logprob entries not yet sent
        self.finish: str | None = None

    def push(self, tokens: list[int], entries) -> str:
        """-> text to send now. Sets ``finish`` to "stop" when a stop string came."""
        self.tokens += len(tokens)
        self.entries += list(zip(tokens, entries or ()))
        self.full += self.text.push(tokens)
        return self._release(False)

    def end(self, reason: str) -> str:
        if self.finish is None:
            self.full += self.text.finish()
            tail = self._release(True)
            self.finish = self.finish or reason
            return tail
        return ""

    def _release(self, final: bool) -> str:
        if self.finish is not None:
            return ""
        end = len(self.full)
        if self.stop:
            # an occurrence starts at or after what was sent: text that could begin a stop string is never sent
            at = [i for x in self.stop if (i := self.full.find(x, self.sent)) >= 0]
            if at:
                end, self.finish = min(at), "stop"
            elif not final:
                for x in self.stop:  # hold back the longest tail that begins a stop string
                    for k in range(min(len(x) - 1, end - self.sent), 0, -1):
                        if self.full.endswith(x[:k]):
                            end = min(end, len(self.full) - k)
                            break
        delta, self.sent = self.full[self.sent : end], max(self.sent, end)
        return delta

    def take_entries(self) -> list:
        out, self.entries = self.entries, []
        return out


def _logprobs(tok, entries: list, chat: bool, k: int, offset: int = 0):
    """OpenAI's logprobs object for ``entries`` ((logprob, [(token, logprob)..]) per token): chat's ``content``
    list, or completions' parallel lists (``offset``: characters before the first token, for text_offset)."""
    word = lambda t: tok.decode([t])  # noqa: E731
    finite = lambda v: max(v, -9999.0)  # noqa: E731  (JSON has no -inf)
    if chat:

        def item(t, v):
            w = word(t)
            return {"token": w, "logprob": finite(v), "bytes": list(w.encode())}

        return {"content": [
            {**item(t, v), "top_logprobs": [item(a, b) for a, b in top]} for t, (v, top) in entries
        ]}  # fmt: skip
    words = [word(t) for t, _ in entries]
    offsets = []
    for w in words:
        offsets.append(offset)
        offset += len(w)
    return {
        "tokens": words,
        "token_logprobs": [finite(v) for _, (v, _) in entries],
        "top_logprobs": [{word(a): finite(b) for a, b in top} for _, (_, top) in entries] if k else None,
        "text_offset": offsets,
    }


def _unicode(text: str, name: str) -> str:
    """A request string that the tokenizer can encode: JSON allows lone surrogates (\\ud800), UTF-8 does not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(f"{name} is not valid Unicode (a lone surrogate)", name) from None
    return text


def _text(content) -> str | None:
    """A message's content: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        if all(isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
    return None


def _error(code: int, msg: str, kind: str = "invalid_request_error", param=None, headers=None) -> JSONResponse:
    """OpenAI's error shape."""
    body = {"error": {"message": redact(msg), "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=code, headers=headers)


def _busy(msg: str) -> JSONResponse:
    return _error(503, msg, "server_error", headers={"Retry-After": "1"})


def _cancel(jobs: list[Job]) -> None:
    for job in jobs:
        job.cancelled = True  # the decode loop frees its row after its next step


def _json_object(body: bytes) -> dict:
    try:
        req = json.loads(body)
    except RecursionError:
        raise BadRequest("request JSON nested too deeply") from None
    except ValueError as e:
        raise BadRequest(f"body is not valid JSON ({e})") from None
    if not isinstance(req, dict):
        raise BadRequest("the request body must be a JSON object")
    return req


def _messages(req: dict) -> list[dict]:
    """Chat messages, validated: roles and text content ({role, content: text})."""
    msgs = req.get("messages")
    if not (
        isinstance(msgs, list)
        and msgs
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and _text(m.get("content")) is not None
                for m in msgs)
    ):  # fmt: skip
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    for m in msgs:
        if m["role"] not in ROLES:
            raise BadRequest(f"role {m['role'][:40]!r} is not one of {', '.join(ROLES)}", "messages")
    return [{"role": m["role"], "content": _unicode(_text(m["content"]), "messages")} for m in msgs]


def _usage_option(req: dict, stream) -> bool:
    options = req.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest("stream_options supports include_usage only", "stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool) or (usage and not stream):
        raise BadRequest("stream_options.include_usage must be true or false, with stream: true", "stream_options")
    return usage


class Api:
    """The HTTP side: requests parsed into ``Params``, queued on the ``Engine`` and answered from its events, whole
    or streamed (server-sent events), in OpenAI's shapes."""

    def __init__(self, engine: Engine):
        self.engine, self.oc, self.tok, self.eos = engine, engine.oc, engine.tok, engine.eos
        self.model_name = engine.recipe.target.model
        self.vocab = engine.tgt.model.cfg.vocab_size
        self.api_key = os.environ.get(API_KEY_ENV, "").strip()
        # parse runs on a thread pool; a literal chat encode sets a flag on the shared tokenizer
        # (split_special_tokens) that another thread's encode would see, so encodes take turns (microseconds)
        self.encoding = threading.Lock()

    def denied(self, request: Request) -> JSONResponse | None:
        if not self.api_key:
            return None
        given = request.headers.get("authorization", "").encode("utf-8", "replace")
        if hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
            return None
        msg = f"a valid API key is required (Authorization: Bearer <{API_KEY_ENV}>)"
        return _error(401, msg, "authentication_error")

    async def read_body(self, request: Request) -> bytes:
        limit = self.oc.max_body_bytes
        size = request.headers.get("content-length")
        if size is not None and int(size) > limit:  # uvicorn refuses a non-numeric Content-Length
            raise BadRequest(f"body of {size} bytes exceeds online.max_body_bytes={limit}", code=413)
        chunks, total = [], 0

        async def read():
            nonlocal total
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    raise BadRequest(f"body exceeds online.max_body_bytes={limit}", code=413)
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), self.oc.idle_timeout_s)
        except asyncio.TimeoutError:
            msg = f"body not received within online.idle_timeout_s={self.oc.idle_timeout_s}"
            raise BadRequest(msg, code=408) from None
        if not total:
            raise BadRequest("a JSON body is required")
        return b"".join(chunks)

    def prompt_ids(self, req: dict, chat: bool) -> tuple[list[int], str]:
        """The prompt's token ids and the field they came from."""
        if chat:
            msgs = _messages(req)
            with self.encoding:  # literal: a user's "<|im_start|>" is text, not a control token opening a turn
                return encode_chat(self.tok, msgs, literal=True), "messages"
        p = req.get("prompt")
        if not isinstance(p, str) or not p:
            raise BadRequest("prompt must be a non-empty string", "prompt")
        with self.encoding:
            return self.tok.encode(_unicode(p, "prompt")), "prompt"

    def parse(self, body: bytes, chat: bool) -> Params:
        req = _json_object(body)
        _unsupported(req, chat)
        model = req.get("model")
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {str(model)[:200]!r} is not served here; GET /v1/models lists it", "model")
        name = "max_tokens" if req.get("max_tokens") is not None else "max_completion_tokens"
        max_tokens = _number(req, name, self.oc.max_tokens, integer=True)
        if max_tokens < 1:
            raise BadRequest(f"{name} must be at least 1", name)
        max_tokens = min(max_tokens, self.oc.max_tokens)
        temperature, top_p = _number(req, "temperature", 0.0), _number(req, "top_p", 1.0)
        if not 0 <= temperature <= 2:  # OpenAI's range
            raise BadRequest("temperature must be in [0, 2]", "temperature")
        if not 0 < top_p <= 1:
            raise BadRequest("top_p must be in (0, 1]", "top_p")
        stream = req.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise BadRequest("stream must be true or false", "stream")
        ids, field_name = self.prompt_ids(req, chat)
        if len(ids) + max_tokens > self.engine.max_len:
            msg = f"prompt of {len(ids)} tokens plus max_tokens={max_tokens} exceeds the {self.engine.max_len}-token "
            raise BadRequest(msg + "context", field_name)
        temperature = 0.0 if temperature < MIN_TEMPERATURE else temperature
        sampling = _sampling(req, chat, temperature, max(top_p, MIN_TOP_P), max_tokens, self.vocab, self.eos)
        seed = _number(req, "seed", None, integer=True)
        n = _integer(req, "n", 1, MAX_N, 1)
        return Params(ids, max_tokens, n, sampling, seed, _stops(req), bool(stream), _usage_option(req, stream))

    async def complete(self, request: Request, chat: bool):
        if (refused := self.denied(request)) is not None:
            return refused
        try:
            req = await run_in_threadpool(self.parse, await self.read_body(request), chat)
        except BadRequest as e:
            return _error(e.code, e.message, param=e.param)
        except Exception as e:  # never a plain-text 500 that closes the connection: OpenAI's shape, logged
            log.exception("serve: request failed")
            return _error(500, f"internal error ({type(e).__name__})", "server_error")
        try:
            jobs = self.engine.submit(req)
        except queue.Full:
            why = "the server is shutting down" if self.engine.closing else None
            return _busy(f"server busy: {why or f'{self.oc.max_queue} requests queued (online.max_queue)'}")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if not req.stream:
            return await self.answer(request, jobs, req, rid, chat)
        events = jobs[0].events  # the status line waits for the first event: one refused while queued gets its 503
        first = await events.get()
        if first[1] == "busy":
            _cancel(jobs)
            return _busy(first[2])
        _requeue_first(events, first)
        stream = self.events(jobs, req, rid, chat)
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def answer(self, request: Request, jobs: list[Job], req: Params, rid: str, chat: bool):
        """The whole answer of a request that does not stream."""
        choices = [Choice(self.tok, self.eos, req.stop) for _ in jobs]
        texts, check = [""] * len(jobs), time.monotonic() + 0.5
        try:
            while any(c.finish is None for c in choices):
                try:
                    i, kind, val = await asyncio.wait_for(jobs[0].events.get(), 0.5)
                except asyncio.TimeoutError:
                    kind = None
                if time.monotonic() > check:  # twice a second: has the client left?
                    check = time.monotonic() + 0.5
                    if await request.is_disconnected():
                        return Response(status_code=499)
                if kind is None or choices[i].finish is not None:
                    continue
                if kind == "tokens":
                    texts[i] += choices[i].push(*val)
                    if choices[i].finish is not None:  # a stop string: this choice is answered, its row freed
                        _cancel([jobs[i]])
                elif kind == "done":
                    texts[i] += choices[i].end(val["finish_reason"])
                else:
                    return _busy(val) if kind == "busy" else _error(500, val, "server_error")
        finally:
            _cancel([j for j, c in zip(jobs, choices) if c.finish is None or c.finish == "stop"])
        k, out = req.sampling["logprobs"], []
        for i, (c, text) in enumerate(zip(choices, texts)):
            lp = None if k is None else _logprobs(self.tok, c.take_entries(), chat, k)
            body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            out.append({"index": i, **body, "logprobs": lp, "finish_reason": c.finish})
        obj = "chat.completion" if chat else "text_completion"
        usage = _usage(len(req.prompt), sum(c.tokens for c in choices))
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name, "choices": out,
                "usage": usage}  # fmt: skip

    async def events(self, jobs: list[Job], req: Params, rid: str, chat: bool):
        """A streamed answer's server-sent events: each choice's chunks as its text comes, then the usage chunk
        (stream_options.include_usage) and [DONE]."""
        sse = _Chunks(self, req, rid, chat, len(jobs))
        ended = False
        try:
            if chat:
                for i in range(len(jobs)):
                    yield sse.send({"index": i, "delta": {"role": "assistant"}, "finish_reason": None})
            while any(c.finish is None for c in sse.choices):
                i, kind, val = await jobs[0].events.get()
                c = sse.choices[i]
                if c.finish is not None:
                    continue
                if kind == "tokens":
                    if delta := c.push(*val):
                        yield sse.chunk(i, delta)
                    if c.finish is not None:  # a stop string ended it
                        jobs[i].cancelled = True
                        yield sse.chunk(i, None, c.finish)
                elif kind == "done":
                    if tail := c.end(val["finish_reason"]):  # held text, or a character left incomplete
                        yield sse.chunk(i, tail)
                    yield sse.chunk(i, None, c.finish)
                else:  # an error (a queued request is refused before the stream starts)
                    yield _sse({"error": {"message": redact(str(val)), "type": "server_error", "param": None}})
                    break
            ended = True
            if req.usage:  # OpenAI's last chunk: no choices, the counts
                yield sse.send(None, _usage(len(req.prompt), sum(c.tokens for c in sse.choices)))
            yield b"data: [DONE]\n\n"
        finally:
            _cancel([j for j, c in zip(jobs, sse.choices) if not ended or c.finish == "stop"])


def _usage(n_in: int, n_out: int) -> dict:
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def _sse(o: dict) -> bytes:
    return b"data: " + json.dumps(o).encode() + b"\n\n"


class _Chunks:
    """A streamed answer's chunks: each choice's text pieces with their logprobs, in chat or completions shape."""

    def __init__(self, api: Api, req: Params, rid: str, chat: bool, n: int):
        self.api, self.rid, self.chat, self.k = api, rid, chat, req.sampling["logprobs"]
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.choices = [Choice(api.tok, api.eos, req.stop) for _ in range(n)]
        self.sent = [0] * n  # characters sent per choice (completions' text_offset)

    def send(self, choice: dict | None, usage: dict | None = None) -> bytes:
        o = {"id": self.rid, "object": self.obj, "created": int(time.time()), "model": self.api.model_name,
             "choices": [] if choice is None else [choice]}  # fmt: skip
        return _sse(o if usage is None else {**o, "usage": usage})

    def chunk(self, i: int, delta: str | None, finish=None) -> bytes:
        if self.chat:
            c = {"index": i, "delta": {} if delta is None else {"content": delta}}
        else:
            c = {"index": i, "text": delta or ""}
        if self.k is not None:
            c["logprobs"] = _logprobs(self.api.tok, self.choices[i].take_entries(), self.chat, self.k, self.sent[i])
        self.sent[i] += len(delta or "")
        c["finish_reason"] = finish
        return self.send(c)


def build_app(engine: Engine) -> FastAPI:
    api = Api(engine)
    app = FastAPI(
        title="draftsmith serve",
        version=__version__,
        description=(
            "OpenAI-compatible completions and chat completions from the target with its drafter (lossless "
            f"speculative decoding). Request fields served: {', '.join(sorted(FIELDS))} (include_usage). Penalties, "
            "logit_bias and min_tokens change the target's distribution before the lossless acceptance rule; "
            "logprobs are the target's own (its raw logits). A field that asks for anything else (tools, "
            "response_format, echo, best_of, suffix) is a 400 naming it. Errors are OpenAI's JSON shape."
        ),
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code in (404, 405):
            return _error(exc.status_code, f"no route {request.method} {request.url.path}")
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        return {"status": "ok", "drafter_version": engine.version, "queue_depth": engine.queue.qsize()}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        if (refused := api.denied(request)) is not None:
            return refused
        return {"object": "list", "data": [{"id": api.model_name, "object": "model", "owned_by": "draftsmith"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        """A text completion of `prompt` (OpenAI's legacy completions API); `stream: true` for server-sent events."""
        return await api.complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """A chat completion of `messages` (roles system, user, assistant) through the target's chat template."""
        return await api.complete(request, chat=True)

    return app


class _H11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on a request's head: a connection that sends nothing, or only
    part of a request line and headers, is closed ``timeout_keep_alive`` seconds after it started (uvicorn itself
    times out only the idle time between requests)."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._head_deadline()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_deadline(self) -> None:
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            self._cancel_head_timer()  # the head is in: the body has its own deadline (408), the decode its own
        elif self._head_timer is None:  # armed once per head, so trickling bytes do not extend it
            self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class _Draining(uvicorn.Server):
    """uvicorn's server, which on SIGTERM / SIGINT (or ``shutdown``) stops listening, closes idle connections and
    waits up to its ``timeout_graceful_shutdown`` for the running requests; the engine refuses new ones meanwhile."""

    def __init__(self, config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # drained: a clean exit (0), not death by the signal afterwards

    async def shutdown(self, sockets=None) -> None:
        self.engine.closing = True
        log.warning(
            "serve: draining: %d request(s) running, up to %.0f s",
            self.engine.running,
            self.config.timeout_graceful_shutdown or 0,
        )
        await super().shutdown(sockets)


class Server:
    """uvicorn serving ``build_app(engine)`` on a socket bound up front (so port 0 is known and a bind failure is
    one line before anything runs), with socketserver's serve_forever / shutdown / server_close."""

    def __init__(self, engine: Engine, sock: socket.socket):
        self.engine, self.socket, self.server_address = engine, sock, sock.getsockname()[:2]
        config = uvicorn.Config(
            build_app(engine),
            http=_H11,
            timeout_keep_alive=engine.oc.idle_timeout_s,
            timeout_graceful_shutdown=engine.oc.drain_s,  # SIGTERM: running requests finish first
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,  # request lines stay out of the logs, like prompts
            server_header=False,
        )
        self._uv = _Draining(config, engine)
        self._done = threading.Event()

    def serve_forever(self) -> None:
        try:
            self._uv.run(sockets=[self.socket])
        finally:
            self._done.set()

    def shutdown(self) -> None:
        self._uv.should_exit = True
        self._done.wait(10)

    def server_close(self) -> None:
        self.engine.close()
        self.socket.close()


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise DraftsmithError(f"online.host/port: cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


def make_server(recipe) -> tuple[Server, Engine]:
    engine = Engine(recipe)
    try:
        sock = _bind(recipe.online.host, recipe.online.port)
    except DraftsmithError:
        engine.close()
        raise
    return Server(engine, sock), engine


def serve(recipe) -> None:
    httpd, engine = make_server(recipe)
    host, port = httpd.server_address[:2]
    print(
        f"serve: http://{host}:{port}/v1 (OpenAI-compatible), drafter {engine.version}, traffic -> "
        f"{engine.buffer.dir}, learning {'on' if recipe.online.learn else 'off'}"
        f"{', API key required' if os.environ.get(API_KEY_ENV, '').strip() else ''}",
        flush=True,
    )
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
