"""`draftsmith serve RECIPE`: an OpenAI-compatible HTTP server on the bundled speculative decoder that records its
traffic and keeps the drafter learning from it (online distillation, draftsmith/serving/online.py).

Endpoints:
- POST /v1/chat/completions, POST /v1/completions, with ``"stream": true`` as server-sent events;
- GET /v1/models, GET /health;
- GET /metrics in Prometheus text: requests, tokens, τ, acceptance, tokens/s, queue depth, drafter version, swaps.

Serving:
- One decode worker (the decoder is batch 1) takes requests from a bounded queue; HTTP threads wait on it.
- Between requests the worker reloads the drafter when ``current.json`` names another version (a learner publish
  or a ``draftsmith online --rollback``). A request in flight finishes on the drafter it started with, so
  nothing is dropped.
- The server binds to loopback by default. Request size, ``max_tokens``, queue length and decode time are
  bounded.
- Output is the target's own (greedy, or lossless sampling), whatever the drafter.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from draftsmith.errors import DraftsmithError, redact
from draftsmith.eval.bench import build_tree, fast_model, stop_rule
from draftsmith.eval.decoder import speculative_generate
from draftsmith.models.loading import encode_chat, load_model, read_json, stop_ids
from draftsmith.models.registry import check_fits_target, load_drafter
from draftsmith.runtime import resolve_device, resolve_dtype
from draftsmith.serving.online import Learner, Versions, online_dir
from draftsmith.serving.traffic import TrafficBuffer

log = logging.getLogger("draftsmith.serve")


class _Deadline(Exception):
    pass


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    deadline: float
    events: queue.Queue = field(default_factory=queue.Queue)  # ("token", id) ... then ("done", info) or ("error", msg)
    cancelled: bool = False


class Engine:
    """The target, the current drafter version, the traffic buffer, the metrics and the decode worker."""

    def __init__(self, recipe):
        self.recipe, self.oc, self.ec = recipe, recipe.online, recipe.eval
        if self.ec.judge is not None:
            raise DraftsmithError("eval.judge: serve decodes losslessly; judge verification (lossy) is eval-only")
        self.device = resolve_device(recipe.target.device)
        self.dtype = resolve_dtype(recipe.target.dtype, self.device)
        self.tgt = load_model(
            recipe.target.model, self.dtype, self.device, recipe.target.trust_remote_code, recipe.target.revision
        )
        self.tok, self.eos = self.tgt.tokenizer, stop_ids(self.tgt.path, self.tgt.tokenizer)
        self.root = online_dir(recipe)
        ckpt = Path(self.ec.checkpoint) if self.ec.checkpoint else recipe.run_dir / "checkpoints" / "final"
        if not (self.root / "current.json").is_file() and (ckpt / "drafter.json").is_file():
            # before it becomes version v0000: a drafter for another target is refused, and no state is written
            check_fits_target(ckpt, read_json(ckpt / "drafter.json"), self.tgt)
        self.versions = Versions(self.root, ckpt)
        self.buffer = TrafficBuffer(self.root / "traffic", self.oc.buffer_max_records)
        self.max_len = min(4096, self.tgt.model.cfg.max_seq_len)  # prompt + answer; also the CUDA-graph cache
        self.target = self._fast(self.tgt.model)
        self.version, self.drafter, self.tree, self.stop = None, None, None, None
        self._load_current()
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=self.oc.max_queue)
        self.lock = threading.Lock()
        self.m = {
            "requests": 0,
            "errors": 0,
            "tokens": 0,
            "forwards": 0,
            "drafted": 0,
            "accepted": 0,
            "decode_s": 0.0,
            "swaps": 0,
            "rounds": 0,
            "recorded": 0,
        }
        self.gen = torch.Generator(device=self.device).manual_seed(recipe.seed)
        threading.Thread(target=self._worker, daemon=True, name="decode").start()
        if self.oc.learn:
            threading.Thread(target=self._learn, daemon=True, name="learner").start()

    def _fast(self, model):
        return fast_model(model, self.ec, self.device, self.max_len)

    def _load_current(self) -> bool:
        version, path = self.versions.current()
        if version == self.version:
            return False
        drafter, info = load_drafter(path, dtype=self.dtype, device=self.device)
        stop = None
        if info.get("kind") == "acceptance_head" or self.ec.stop is not None:  # eval.stop, as eval decodes
            drafter, info, stop, _ = stop_rule(self.ec, drafter, info, path, self.dtype, self.device)
        check_fits_target(path, info, self.tgt)  # as eval does: refused at start, not with a 500 per request
        if getattr(drafter, "target_adapter", None) is not None:
            raise DraftsmithError(
                f"{path}: a Medusa-2 drafter carries target adapters, which serve does not merge into the served "
                f"target; serve Medusa-1 heads (drafter.lora_r=0) or evaluate it with draftsmith eval"
            )
        tree = build_tree(self.ec, getattr(drafter, "max_draft_len", None))  # eval.strategy: chain or a tree
        # swapped between requests only
        self.drafter, self.tree, self.stop, self.version = self._fast(drafter), tree, stop, version
        log.info("serve: drafter %s loaded from %s", version, path)
        return True

    # ---- the decode worker ---------------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            job = self.queue.get()
            try:
                if self._load_current():
                    with self.lock:
                        self.m["swaps"] += 1
                self._run(job)
            except Exception as e:  # a bad request must not take the worker down
                log.exception("serve: decode failed")
                with self.lock:
                    self.m["errors"] += 1
                job.events.put(("error", f"{type(e).__name__}: {e}"))

    def _run(self, job: Job) -> None:
        tokens: list[int] = []

        def on_token(t: int) -> None:
            tokens.append(t)
            job.events.put(("token", t))
            if job.cancelled or time.monotonic() > job.deadline:
                raise _Deadline

        t0 = time.perf_counter()
        stats = None
        try:
            _, stats = speculative_generate(
                self.target,
                self.drafter,
                torch.tensor(job.prompt),
                job.max_tokens,
                draft_len=self.ec.draft_len,
                tree=self.tree,
                stop_drafting=self.stop,
                temperature=job.temperature,
                top_p=job.top_p,
                eos_ids=self.eos,
                generator=self.gen,
                on_token=on_token,
            )
        except _Deadline:
            pass
        dt = time.perf_counter() - t0
        finish = "stop" if tokens and tokens[-1] in self.eos else "length"
        if tokens:  # the target's own continuation, whatever the drafter proposed: a valid teacher sequence
            self.buffer.append(
                {
                    "prompt": job.prompt,
                    "response": tokens,
                    "version": self.version,
                    "tau": stats.tau if stats else None,
                    "accept_counts": stats.accept_counts if stats else None,
                    "target_positions": stats.target_positions() if stats else None,
                }
            )
        with self.lock:
            m = self.m
            m["requests"] += 1
            m["recorded"] += bool(tokens)
            m["tokens"] += len(tokens)
            m["decode_s"] += dt
            if stats is not None:
                m["forwards"] += stats.target_forwards
                m["drafted"] += stats.drafted
                m["accepted"] += stats.accepted
        job.events.put(
            ("done", {"finish_reason": finish, "completion_tokens": len(tokens), "prompt_tokens": len(job.prompt)})
        )

    def _learn(self) -> None:
        learner = None
        while True:
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

    def submit(self, prompt: list[int], max_tokens: int, temperature: float, top_p: float) -> Job:
        job = Job(prompt, max_tokens, temperature, top_p, time.monotonic() + self.oc.request_timeout_s)
        self.queue.put_nowait(job)  # queue.Full -> 503
        return job

    def metrics_text(self) -> str:
        with self.lock:
            m = dict(self.m)
        tau = m["tokens"] / m["forwards"] if m["forwards"] else 0.0
        lines = []

        def metric(name, kind, help_text, value):
            lines.extend(
                [
                    f"# HELP draftsmith_{name} {help_text}",
                    f"# TYPE draftsmith_{name} {kind}",
                    f"draftsmith_{name} {value}",
                ]
            )

        metric("requests_total", "counter", "Requests decoded.", m["requests"])
        metric("errors_total", "counter", "Requests that failed in the decoder.", m["errors"])
        metric("generated_tokens_total", "counter", "Tokens generated.", m["tokens"])
        metric("target_forwards_total", "counter", "Target forwards (prefill + verifies).", m["forwards"])
        metric("tau", "gauge", "Tokens per target forward since start.", round(tau, 4))
        metric(
            "acceptance_rate",
            "gauge",
            "Accepted / drafted tokens since start.",
            round(m["accepted"] / m["drafted"], 4) if m["drafted"] else 0.0,
        )
        metric(
            "tokens_per_second",
            "gauge",
            "Generated tokens per second of decoding since start.",
            round(m["tokens"] / m["decode_s"], 2) if m["decode_s"] else 0.0,
        )
        metric("queue_depth", "gauge", "Requests waiting for the decoder.", self.queue.qsize())
        metric("drafter_version", "gauge", "Serving drafter version number.", int(self.version[1:]))
        metric("drafter_swaps_total", "counter", "Hot swaps of the drafter.", m["swaps"])
        metric("online_rounds_total", "counter", "Online updates run by this server.", m["rounds"])
        metric("recorded_requests_total", "counter", "Requests recorded to the traffic buffer.", m["recorded"])
        return "\n".join(lines) + "\n"


def _handler(engine: Engine):
    oc, tok = engine.oc, engine.tok
    model_name = engine.recipe.target.model

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # requests are logged at debug level only: prompts stay out of logs
            log.debug("%s %s", self.address_string(), redact(fmt % args))  # the request line; never headers

        def _send(self, code: int, body, ctype: str = "application/json") -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, msg: str, kind: str = "invalid_request_error") -> None:
            self._send(code, {"error": {"message": redact(msg), "type": kind, "code": code}})

        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                self._send(
                    200, {"status": "ok", "drafter_version": engine.version, "queue_depth": engine.queue.qsize()}
                )
            elif self.path == "/metrics":
                self._send(200, engine.metrics_text(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                self._send(
                    200, {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "draftsmith"}]}
                )
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self):  # noqa: N802
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                return self._error(404, f"no route {self.path}")
            size = int(self.headers.get("Content-Length") or 0)
            if size <= 0:
                return self._error(411, "a JSON body with Content-Length is required")
            if size > oc.max_body_bytes:
                return self._error(413, f"body of {size} bytes exceeds online.max_body_bytes={oc.max_body_bytes}")
            try:
                req = json.loads(self.rfile.read(size))
                chat = self.path == "/v1/chat/completions"
                prompt = self._prompt(req, chat)
                max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or oc.max_tokens)
                temperature, top_p = float(req.get("temperature", 0.0)), float(req.get("top_p", 1.0))
                if not (0 < max_tokens and 0 <= temperature and 0 < top_p <= 1):
                    raise ValueError("max_tokens must be > 0, temperature >= 0 and 0 < top_p <= 1")
            except (ValueError, TypeError, KeyError) as e:
                return self._error(400, str(e))
            except RecursionError:
                return self._error(400, "request JSON nested too deeply")
            try:
                job = engine.submit(prompt, min(max_tokens, oc.max_tokens), temperature, top_p)
            except queue.Full:
                return self._error(503, f"server busy: {oc.max_queue} requests queued", "server_error")
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
            if req.get("stream"):
                return self._stream(job, rid, chat)
            tokens, info = self._collect(job)
            if info is None:
                return
            text = tok.decode([t for t in tokens if t not in engine.eos], skip_special_tokens=True)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text, "logprobs": None}
            )
            choice["finish_reason"] = info["finish_reason"]
            self._send(
                200,
                {
                    "id": rid,
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": model_name,
                    "choices": [choice],
                    "usage": {
                        "prompt_tokens": info["prompt_tokens"],
                        "completion_tokens": info["completion_tokens"],
                        "total_tokens": info["prompt_tokens"] + info["completion_tokens"],
                    },
                },
            )

        def _prompt(self, req: dict, chat: bool) -> list[int]:
            if chat:
                msgs = req.get("messages")
                if (
                    not isinstance(msgs, list)
                    or not msgs
                    or not all(
                        isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in msgs
                    )
                ):
                    raise ValueError("messages must be a non-empty list of {role, content} objects")
                ids = encode_chat(tok, [{"role": m["role"], "content": m["content"]} for m in msgs])
            else:
                p = req.get("prompt")
                if not isinstance(p, str) or not p:
                    raise ValueError("prompt must be a non-empty string")
                ids = tok.encode(p)
            if len(ids) + oc.max_tokens > engine.max_len:
                raise ValueError(f"prompt of {len(ids)} tokens is too long (limit {engine.max_len - oc.max_tokens})")
            return ids

        def _collect(self, job: Job):
            tokens = []
            while True:
                kind, val = job.events.get()
                if kind == "token":
                    tokens.append(val)
                elif kind == "done":
                    return tokens, val
                else:
                    self._error(500, val, "server_error")
                    return tokens, None

        def _stream(self, job: Job, rid: str, chat: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            tokens, sent = [], ""
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(delta: str | None, finish=None) -> dict:
                c = (
                    {"index": 0, "delta": {} if delta is None else {"content": delta}}
                    if chat
                    else {"index": 0, "text": delta or ""}
                )
                c["finish_reason"] = finish
                return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [c]}

            try:
                if chat:
                    self._event(
                        {
                            **chunk(None),
                            "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}],
                        }
                    )
                while True:
                    kind, val = job.events.get()
                    if kind == "token":
                        tokens.append(val)
                        text = tok.decode([t for t in tokens if t not in engine.eos], skip_special_tokens=True)
                        if len(text) > len(sent) and not text.endswith("\ufffd"):  # whole characters only
                            self._event(chunk(text[len(sent) :]))
                            sent = text
                    elif kind == "done":
                        self._event(chunk(None, val["finish_reason"]))
                        break
                    else:
                        self._event({"error": {"message": val, "type": "server_error"}})
                        break
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                job.cancelled = True  # the client left: the decoder stops at its next token

        def _event(self, obj: dict) -> None:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


def make_server(recipe) -> tuple[ThreadingHTTPServer, Engine]:
    engine = Engine(recipe)
    try:
        httpd = ThreadingHTTPServer((recipe.online.host, recipe.online.port), _handler(engine))
    except OSError as e:
        raise DraftsmithError(
            f"online.host/port: cannot listen on {recipe.online.host}:{recipe.online.port} ({e.strerror})"
        ) from None
    httpd.daemon_threads = True
    return httpd, engine


def serve(recipe) -> None:
    httpd, engine = make_server(recipe)
    host, port = httpd.server_address[:2]
    print(
        f"serve: http://{host}:{port}/v1 (OpenAI-compatible), drafter {engine.version}, traffic -> "
        f"{engine.buffer.dir}, learning {'on' if recipe.online.learn else 'off'}",
        flush=True,
    )
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
