"""`draftsmith serve` under concurrent load (draftsmith/serving/server.py): the continuous-batching decode loop and
its row-wise decoder, exact greedy answers with 16 clients at once, the drafter swap rule (a request keeps the
version it started on), and the HTTP hardening: pipelined requests stay in sync after a 404 or 413, half-sent
requests are timed out, the listen backlog, malformed bodies and fields refused with OpenAI-shaped 4xx errors,
tiny top_p, client disconnects mid-stream, 64 concurrent clients, and the optional API key."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch

from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.models.draft_lm import build_draft_lm
from draftsmith.models.loading import encode_chat, load_model, stop_ids
from draftsmith.models.registry import load_drafter, save_drafter
from draftsmith.recipes.loader import load_recipe

TEXTS = [
    "Tell me about foxes.",
    "Write a poem about the sea.",
    "What is 2+2?",
    "Count to five.",
    "Say something about stars.",
    "def add(a, b):",
    "Why is the sky blue?",
    "List three colours.",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model_dir):
    """The tiny target, a 1-layer drafter checkpoint (scrambled, so drafts are often rejected), the reference
    greedy answers."""
    root = tmp_path_factory.mktemp("serve")
    tgt = load_model(str(tiny_model_dir))
    torch.manual_seed(0)
    drafter = build_draft_lm({"n_layers": 1}, tgt.model)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith("layers."):
                p.copy_(torch.randn_like(p) * 0.3)
    ckpt = save_drafter(
        root / "ckpt", drafter, "draft_lm", {"target": str(tiny_model_dir), "recipe": "tiny", "step": 0}
    )
    tok, eos = tgt.tokenizer, stop_ids(tgt.path, tgt.tokenizer)
    ref, ref_ids = {}, {}
    for text in TEXTS:
        ids = encode_chat(tok, [{"role": "user", "content": text}])
        ref_ids[text] = autoregressive_generate(tgt.model, torch.tensor(ids), 16, eos_ids=eos)
        ref[text] = tok.decode([t for t in ref_ids[text] if t not in eos], skip_special_tokens=True)
    return {"tgt": tgt, "ckpt": ckpt, "model_dir": tiny_model_dir, "ref": ref, "ref_ids": ref_ids, "eos": eos}


def _start(tiny, tmp_path, *extra):
    from draftsmith.serving.server import make_server

    recipe = load_recipe(
        "tiny",
        [
            f"target.model={tiny['model_dir']}",
            f"out_dir={tmp_path / 'run'}",
            f"eval.checkpoint={tiny['ckpt']}",
            f"online.dir={tmp_path / 'online'}",
            "online.port=0",
            "online.learn=false",
            "online.max_tokens=16",
            "online.max_body_bytes=4000",
            *extra,
        ],
    )
    httpd, engine = make_server(recipe)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, engine


@pytest.fixture
def server(tiny, tmp_path):
    httpd, engine = _start(tiny, tmp_path)
    yield httpd.server_address[1], engine
    httpd.shutdown()
    httpd.server_close()


def _request(port, method, path, body=None, headers=None, timeout=60):
    """One request on a fresh connection -> (status, headers dict, body text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read().decode()
    conn.close()
    return out


def _chat(port, text, **kw):
    return _request(port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], **kw})


def _raw(port, payload: bytes, timeout=10.0, settle=1.0) -> bytes:
    """Send raw bytes on one connection; everything the server answers until it closes or is quiet for settle s."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        s.settimeout(settle)
        got = b""
        while True:
            try:
                part = s.recv(65536)
            except TimeoutError:
                return got
            if not part:
                return got
            got += part


def _statuses(raw: bytes) -> list[int]:
    """The status codes of the responses in raw (a body need not end in a newline)."""
    return [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)]


# ---- the server's decoder ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [None, "static", "dynamic"])
def test_server_decoder_rows_join_between_steps_and_match_the_single_request_decoder(tiny, tree):
    """``make_decoder`` (chains, static and dynamic trees, plain decoding): rows added at different steps give
    exactly speculative_generate's (and the target's greedy) tokens, leave when done, and keep their stats."""
    from draftsmith.eval.tree import DynamicTree, tree_from_choices
    from draftsmith.serving.server import make_decoder

    spec = {None: None, "static": tree_from_choices([[0], [1], [0, 0]]), "dynamic": DynamicTree(2, 2, 4)}[tree]
    tgt, eos = tiny["tgt"], tiny["eos"]
    drafter, _ = load_drafter(tiny["ckpt"])
    prompts = [torch.tensor(encode_chat(tgt.tokenizer, [{"role": "user", "content": t}])) for t in TEXTS[:4]]
    want = [speculative_generate(tgt.model, drafter, p, 16, draft_len=3, eos_ids=eos, tree=spec)[0] for p in prompts]
    assert want == [autoregressive_generate(tgt.model, p, 16, eos_ids=eos) for p in prompts]
    for d in (drafter, None):
        dec = make_decoder(tgt.model, d, draft_len=3, eos_ids=eos, max_len=1024, tree=spec)
        got, rid_of = {}, {}
        for step in range(200):
            if step < len(prompts):  # one more row joins before each of the first steps
                rid_of[dec.add(prompts[step], 16)] = step
            for rid, toks in dec.step().items():
                got.setdefault(rid_of[rid], []).extend(toks)
            if not dec.active() and len(rid_of) == len(prompts):
                break
        assert [got[i] for i in range(len(prompts))] == want
        assert all(dec.stats[r].new_tokens == len(want[i]) for r, i in rid_of.items())
    dec = make_decoder(tgt.model, drafter, draft_len=3, eos_ids=eos, max_len=1024, tree=spec)
    rid = dec.add(prompts[0], 16)
    dec.step()
    dec.remove(rid)
    assert dec.active() == [] and dec.step() == {}


@pytest.mark.parametrize("strategy", ["chain", "tree"])
def test_above_speculate_max_batch_rows_decode_plainly_and_exactly(tiny, tmp_path, strategy):
    """online.speculate_max_batch=2 with 8 concurrent clients: steps with more than 2 rows draft nothing (counted
    in /metrics as plain steps), the others speculate; every answer is still the prompt's greedy answer."""
    extra = ["online.speculate_max_batch=2"] + (["eval.strategy=tree"] if strategy == "tree" else [])
    httpd, engine = _start(tiny, tmp_path, *extra)
    port, results = httpd.server_address[1], {}
    try:

        def ask(i):
            text = TEXTS[i % len(TEXTS)]
            code, _, body = _chat(port, text, max_tokens=16)
            results[i] = (code, text, json.loads(body)["choices"][0]["message"]["content"])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        ask(8)  # alone: it speculates
        assert len(results) == 9
        for code, text, answer in results.values():
            assert code == 200 and answer == tiny["ref"][text], text
        metrics = _request(port, "GET", "/metrics")[2]
        value = {k: float(re.search(rf"^draftsmith_{k}(?:_total)? (\S+)$", metrics, re.M).group(1))
                 for k in ("plain_steps", "decode_steps", "generated_tokens", "target_forwards")}  # fmt: skip
        assert 0 < value["plain_steps"] < value["decode_steps"]
        assert engine.m["drafted"] > 0  # the steps with few rows drafted
    finally:
        httpd.shutdown()
        httpd.server_close()


# ---- exactness and swaps under load ------------------------------------------------------------------------------


def test_16_concurrent_clients_each_get_their_prompts_greedy_answer(server, tiny):
    port, engine = server
    results = {}

    def ask(i):
        text = TEXTS[i % len(TEXTS)]
        stream = i % 3 == 0
        code, _, body = _chat(port, text, max_tokens=16, stream=stream)
        if stream:
            events = [json.loads(x[6:]) for x in body.split("\n\n") if x.startswith("data: {")]
            answer = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        else:
            answer = json.loads(body)["choices"][0]["message"]["content"]
        results[i] = (code, text, answer)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 16
    for code, text, answer in results.values():
        assert code == 200 and answer == tiny["ref"][text], text
    code, _, body = _request(port, "GET", "/health")
    assert code == 200 and json.loads(body)["status"] == "ok"
    assert engine.running == 0 and engine.queue.qsize() == 0 and len(engine.buffer.read()) == 16
    assert "draftsmith_requests_total 16.0" in engine.metrics_text()


def _slow_steps(monkeypatch, seconds: float) -> dict:
    """Every decoder the server makes sleeps before each step (so requests overlap); the returned dict's "s" sets
    the sleep from then on."""
    import draftsmith.serving.server as srv

    make, delay = srv.make_decoder, {"s": seconds}

    def slow(*a, **k):
        dec = make(*a, **k)
        step = dec.step

        def slow_step(**kw):
            time.sleep(delay["s"])
            return step(**kw)

        dec.step = slow_step
        return dec

    monkeypatch.setattr(srv, "make_decoder", slow)
    return delay


def test_a_request_keeps_the_drafter_it_started_on_across_a_hot_swap(server, tiny, monkeypatch):
    """A publish while a request decodes: the running request finishes on v0000 (its own decoder drains), the
    next one starts on v0001 while the first is still running, and each answer is the target's own."""
    port, engine = server
    _slow_steps(monkeypatch, 0.2)
    live_max = []
    first_token = threading.Event()
    results = {}

    def ask(name, text):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 16, "stream": True}
        conn.request(
            "POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        r = conn.getresponse()
        text_out = ""
        for line in r:
            if line.startswith(b"data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                text_out += delta
                if delta:
                    first_token.set()
                    live_max.append(len(engine.live))
        results[name] = text_out

    a = threading.Thread(target=ask, args=("a", TEXTS[0]))
    a.start()
    assert first_token.wait(30)
    engine.versions.publish(tiny["ckpt"])
    b = threading.Thread(target=ask, args=("b", TEXTS[1]))
    b.start()
    a.join(60)
    b.join(60)
    assert results == {"a": tiny["ref"][TEXTS[0]], "b": tiny["ref"][TEXTS[1]]}
    assert max(live_max) == 2  # both versions decoded at once: the old one drained its row
    recs = engine.buffer.read()
    assert [r["version"] for r in recs] == ["v0000", "v0001"]
    assert engine.version == "v0001" and list(engine.live) == ["v0001"]
    assert "draftsmith_drafter_swaps_total 1.0" in engine.metrics_text()


def test_a_client_that_leaves_mid_stream_frees_its_row_and_others_go_on(server, tiny, monkeypatch):
    port, engine = server
    _slow_steps(monkeypatch, 0.1)
    body = json.dumps({"messages": [{"role": "user", "content": TEXTS[0]}], "max_tokens": 16, "stream": True})
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    other = {}
    t = threading.Thread(target=lambda: other.update(r=_chat(port, TEXTS[2], max_tokens=16)))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body.encode())
        got = b""
        while b'"content"' not in got:  # the first token arrived: the row is decoding
            part = s.recv(4096)
            assert part, got  # the server closed the stream before a token
            got += part
        t.start()
    deadline = time.time() + 20
    while engine.running and time.time() < deadline:
        time.sleep(0.05)
    t.join(30)
    assert engine.running == 0
    code, _, body = other["r"]
    assert code == 200 and json.loads(body)["choices"][0]["message"]["content"] == tiny["ref"][TEXTS[2]]
    recs = engine.buffer.read()
    left = [r for r in recs if r["response"] != tiny["ref_ids"][TEXTS[2]]]
    assert len(recs) == 2 and len(left) == 1
    assert 0 < len(left[0]["response"]) < len(tiny["ref_ids"][TEXTS[0]]), "the abandoned request decoded to the end"


def test_64_concurrent_clients_are_served_not_rejected(server):
    port, engine = server
    codes = []

    def ask(i):
        codes.append(_request(port, "POST", "/v1/completions", {"prompt": f"request {i}", "max_tokens": 4})[0])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert codes.count(200) == 64, sorted(codes)


def test_a_full_queue_gets_503_with_retry_after(server):
    import queue

    port, engine = server
    engine.queue = queue.Queue(maxsize=1)  # the decode loop drains its own queue: nothing drains this one
    engine.queue.put(None)
    code, headers, body = _request(port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert code == 503 and headers.get("retry-after") == "1" and json.loads(body)["error"]["type"] == "server_error"


# ---- HTTP hardening ------------------------------------------------------------------------------------------------


def test_pipelined_requests_stay_in_sync_after_a_404_and_a_413(server):
    """Two requests sent back to back on one kept-alive connection: the first one's body (unread by a 404 route or
    refused by size) must not be read as the next request line."""
    port, _ = server
    body = b'{"prompt": "GET /health HTTP/1.1"}'
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    bogus = b"POST /v1/bogus HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    got = _raw(port, bogus + health)
    assert _statuses(got) == [404, 200], got
    big = b"x" * 5000
    too_big = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big)
    got = _statuses(_raw(port, too_big + health))
    assert got == [413, 200], got


def test_a_half_sent_request_neither_holds_the_server_nor_its_connection(tiny, tmp_path):
    httpd, engine = _start(tiny, tmp_path, "online.idle_timeout_s=1")
    port = httpd.server_address[1]
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=10) as half,
            socket.create_connection(("127.0.0.1", port), timeout=10) as silent,
        ):
            half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")  # and nothing more
            assert _request(port, "GET", "/health")[0] == 200  # another client is served meanwhile
            t0 = time.time()
            half.settimeout(5)
            silent.settimeout(5)
            assert half.recv(100) == b"" and silent.recv(100) == b""  # both closed by the server
            assert time.time() - t0 < 3
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow_body:
            slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            slow_body.settimeout(5)
            assert _statuses(slow_body.recv(4096)) == [408]
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listening socket's backlog")
def test_the_listen_backlog_is_larger_than_5(server):
    port, _ = server
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout.split()
    assert int(out[2]) >= 128, out  # a listening socket's Send-Q column is its backlog


@pytest.mark.parametrize(
    "raw",
    [
        b'["a JSON array"]',
        b'"a JSON string"',
        b'{"prompt": "hi", "max_tokens": 1e400}',
        b"{not json",
    ],
    ids=["array", "string", "max_tokens_1e400", "bad_json"],
)
def test_a_malformed_body_gets_400_not_a_closed_connection(server, raw):
    port, _ = server
    code, _, body = _request(port, "POST", "/v1/completions", raw)
    assert code == 400 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_a_non_numeric_content_length_gets_a_4xx(server):
    port, _ = server
    got = _raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
    assert _statuses(got) and 400 <= _statuses(got)[0] < 500, got


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"model": "gpt-4o"}, "model"),
        ({"stream": "yes"}, "stream"),
        ({"prompt": "fox " * 3000}, "prompt"),
    ],
    ids=["max_tokens_0", "max_tokens_true", "max_tokens_2.5", "temperature_inf", "temperature_neg", "top_p_0",
         "unknown_model", "stream_str", "prompt_too_long"],
)  # fmt: skip
def test_bad_fields_get_400_in_openai_error_shape(tiny, tmp_path, fields, param):
    httpd, _ = _start(tiny, tmp_path, "online.max_body_bytes=100000")
    try:
        body = json.dumps({"prompt": "The quick brown fox", **fields}).encode()  # Infinity, as JS clients write it
        code, _, text = _request(httpd.server_address[1], "POST", "/v1/completions", body)
        err = json.loads(text)["error"]
        assert code == 400 and err["type"] == "invalid_request_error" and err["param"] == param, text
        assert isinstance(err["message"], str) and err["message"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_tiny_top_p_and_temperature_sample_instead_of_failing(server, tiny):
    port, _ = server
    for fields in (
        {"temperature": 1.0, "top_p": 1e-300},
        {"temperature": 1e-300},
        {"temperature": 1.0, "top_p": 1e-30},
    ):
        code, _, body = _chat(port, TEXTS[0], max_tokens=16, **fields)
        assert code == 200, (fields, body)
        assert json.loads(body)["choices"][0]["message"]["content"] == tiny["ref"][TEXTS[0]]  # only the top token


def test_the_model_name_from_v1_models_is_accepted(server):
    port, _ = server
    name = json.loads(_request(port, "GET", "/v1/models")[2])["data"][0]["id"]
    assert _request(port, "POST", "/v1/completions", {"prompt": "hi", "model": name, "max_tokens": 2})[0] == 200


def test_an_api_key_guards_v1_and_never_shows(tiny, tmp_path, monkeypatch, caplog):
    key = "sk-test-0123456789abcdef"
    monkeypatch.setenv("DRAFTSMITH_API_KEY", key)
    httpd, _ = _start(tiny, tmp_path)
    port = httpd.server_address[1]
    try:
        req = {"prompt": "hi", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            code, _, body = _request(port, "POST", "/v1/completions", req, headers)
            assert code == 401 and json.loads(body)["error"]["type"] == "authentication_error" and key not in body
        assert _request(port, "GET", "/v1/models")[0] == 401
        assert _request(port, "POST", "/v1/completions", req, {"Authorization": f"Bearer {key}"})[0] == 200
        assert _request(port, "GET", "/health")[0] == 200 and _request(port, "GET", "/metrics")[0] == 200
        assert key not in caplog.text
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_client_that_leaves_a_plain_request_frees_its_row(server, tiny, monkeypatch):
    port, engine = server
    delay = _slow_steps(monkeypatch, 0.4)
    body = json.dumps({"messages": [{"role": "user", "content": TEXTS[0]}], "max_tokens": 16})
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body.encode())
        deadline = time.time() + 10
        while not engine.running and time.time() < deadline:
            time.sleep(0.02)
        assert engine.running == 1
    deadline = time.time() + 10
    while engine.running and time.time() < deadline:
        time.sleep(0.05)
    assert engine.running == 0
    (rec,) = engine.buffer.read()
    assert len(rec["response"]) < len(tiny["ref_ids"][TEXTS[0]])  # stopped early, not decoded to the end
    delay["s"] = 0.6  # a client that stays, on a decode slower than the disconnect check, is answered
    code, _, body = _chat(port, TEXTS[1], max_tokens=16)
    assert code == 200 and json.loads(body)["choices"][0]["message"]["content"] == tiny["ref"][TEXTS[1]]


def test_prompts_and_answers_never_reach_the_logs(server, tiny, caplog):
    import logging

    port, _ = server
    caplog.set_level(logging.DEBUG)
    marker = "zebra-unicorn-marker"
    code, _, body = _request(port, "POST", "/v1/completions", {"prompt": marker, "max_tokens": 8})
    answer = json.loads(body)["choices"][0]["text"]
    assert _request(port, "POST", "/v1/completions", {"prompt": marker, "max_tokens": "x"})[0] == 400
    assert code == 200 and marker not in caplog.text and (not answer.strip() or answer not in caplog.text)


def test_a_stream_ends_with_the_same_text_as_the_plain_answer(tiny):
    """A character whose bytes span tokens is held back until it completes; when the answer ends first (max_tokens
    cut it), the held bytes go out with the last chunk, so the streamed pieces join to the plain answer's text."""
    from draftsmith.serving.server import TextStream

    tok = tiny["tgt"].tokenizer
    a, b = tok.convert_tokens_to_ids(["Ã", "©"])  # the byte-level tokens of "é" (bytes C3 A9)
    hi = tok.encode("hi", add_special_tokens=False)
    for answer in ([*hi, a, b], [*hi, a], [a]):  # whole; cut after the first byte; nothing but the cut byte
        stream = TextStream(tok, tiny["eos"])
        pieces = [stream.push([t]) for t in answer] + [stream.finish()]
        assert "".join(pieces) == tok.decode(answer, skip_special_tokens=True), answer
        assert all("\ufffd" not in p for p in pieces[:-1])  # never half a character mid-stream
