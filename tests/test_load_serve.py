"""`draftsmith serve` without speculation (online.speculate: false, plain decoding with the target alone, the
baseline benchmarks/load_serve.py compares against) and a smoke run of that load benchmark on its tiny target."""

from __future__ import annotations

import http.client
import json
import threading

import pytest
import torch

from draftsmith.eval.decoder import autoregressive_generate
from draftsmith.models.draft_lm import build_draft_lm
from draftsmith.models.loading import encode_chat, load_model, stop_ids
from draftsmith.models.registry import save_drafter
from draftsmith.recipes.loader import load_recipe

TEXT = "Tell me about foxes."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("serve-plain")
    tgt = load_model(str(tiny_model_dir))
    torch.manual_seed(0)
    drafter = build_draft_lm({"n_layers": 1}, tgt.model)
    ckpt = save_drafter(root / "ckpt", drafter, "draft_lm", {"target": str(tiny_model_dir), "recipe": "t", "step": 0})
    eos = stop_ids(tgt.path, tgt.tokenizer)
    ids = encode_chat(tgt.tokenizer, [{"role": "user", "content": TEXT}])
    ref = autoregressive_generate(tgt.model, torch.tensor(ids), 16, eos_ids=eos)
    text = tgt.tokenizer.decode([t for t in ref if t not in eos], skip_special_tokens=True)
    return {"dir": tiny_model_dir, "ckpt": ckpt, "ref": text}


@pytest.mark.parametrize("speculate", [True, False])
def test_serve_without_speculation(tiny, tmp_path, speculate):
    from draftsmith.serving.server import make_server

    recipe = load_recipe(
        "tiny",
        [
            f"target.model={tiny['dir']}",
            f"out_dir={tmp_path / 'run'}",
            f"eval.checkpoint={tiny['ckpt']}",
            f"online.dir={tmp_path / 'online'}",
            "online.port=0",
            "online.learn=false",
            f"online.speculate={str(speculate).lower()}",
        ],
    )
    httpd, engine = make_server(recipe)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=60)
        body = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 16, "temperature": 0}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        assert json.loads(r.read())["choices"][0]["message"]["content"] == tiny["ref"]
        assert (engine.live[engine.version].drafter is None) is not speculate
        assert (engine.m["drafted"] > 0) is speculate  # plain decoding drafts nothing
    finally:
        httpd.shutdown()
        httpd.server_close()
