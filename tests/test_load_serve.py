"""`draftsmith serve` without speculation (online.speculate: false, plain decoding with the target alone, the
baseline benchmarks/load_serve.py compares against) and a smoke run of that load benchmark on its tiny target."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from draftsmith.eval.decoder import autoregressive_generate
from draftsmith.models.draft_lm import build_draft_lm
from draftsmith.models.loading import encode_chat, load_model, stop_ids
from draftsmith.models.registry import save_drafter
from draftsmith.recipes.loader import load_recipe

TEXT = "Tell me about foxes."
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "load_serve.py"


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


@pytest.mark.slow  # three server processes: about 15 s on 2 CPU cores
def test_load_benchmark_tiny_smoke(tmp_path):
    out = tmp_path / "load.json"
    cmd = [sys.executable, str(BENCH), "--tiny", "--requests", "4", "--concurrency", "1,4", "--max-tokens", "16"]
    res = subprocess.run([*cmd, "--prompts", "4", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())["results"]
    assert sorted(got) == ["batch-1", "spec-off", "spec-on"]
    for name, cfg in got.items():
        assert cfg["health"] == "ok", name
        for row in cfg["levels"]:
            assert (row["errors"], row["mismatches"], row["cut"], row["n"]) == (0, 0, 0, 4), (name, row)
