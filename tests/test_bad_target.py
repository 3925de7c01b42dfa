"""Bad input about the target, the device and the prompts, through the real CLI: exit code 2, exactly one stderr
line that names the file, key or value, no traceback, and nothing half-written that looks complete. Pickled
weights next to a target are never read, and serve refuses a drafter that does not fit its target exactly as eval
does, before it binds a port."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama

from draftsmith.cli import main
from draftsmith.models.draft_lm import build_draft_lm
from draftsmith.models.loading import load_model, tokenizer_hash
from draftsmith.models.registry import save_drafter

ROOT = Path(__file__).resolve().parent.parent
MISSING_GPU = f"cuda:{max(3, torch.cuda.device_count())}"  # cuda:3 unless this machine has four GPUs or more


@pytest.fixture(scope="module")
def kit(tmp_path_factory, tiny_model_dir, tiny_tokenizer):
    """Drafter checkpoints for the tiny target (fitting, another tokenizer, another vocabulary size), a tiny GPT-2
    target (the transformers fallback) and a deeply nested prompts file, built once."""
    root = tmp_path_factory.mktemp("bad-target")
    tgt = load_model(str(tiny_model_dir))
    torch.manual_seed(0)
    meta = {"target": str(tiny_model_dir), "recipe": "tiny", "tokenizer_hash": tokenizer_hash(tgt.tokenizer)}
    drafter = build_draft_lm({"n_layers": 1}, tgt.model)
    good = save_drafter(root / "good", drafter, "draft_lm", meta)
    other_tok = save_drafter(root / "other-tok", drafter, "draft_lm", {**meta, "tokenizer_hash": "0123456789abcdef"})
    # The same tokenizer with its embedding rows padded (as many hub models do): another vocabulary size.
    padded = load_model(
        str(save_tiny_llama(root / "padded-target", tiny_tokenizer, vocab_size=len(tiny_tokenizer) + 20))
    )
    other_vocab = save_drafter(root / "other-vocab", build_draft_lm({"n_layers": 1}, padded.model), "draft_lm", meta)

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = root / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tiny_tokenizer), n_positions=128, n_embd=32, n_layer=1, n_head=4)
    ).save_pretrained(gpt2, safe_serialization=True)
    tiny_tokenizer.save_pretrained(gpt2)
    deep = root / "deep.jsonl"
    deep.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' + "[" * 200_000 + "]" * 200_000 + "\n")
    deep_array = root / "deep.json"
    deep_array.write_text('[{"messages": [{"role": "user", "content": "hi"}]}, ' + "[" * 200_000 + "]" * 200_000 + "]")
    return {
        "deep_array": deep_array,
        "good": good,
        "other_tok": other_tok,
        "other_vocab": other_vocab,
        "gpt2": gpt2,
        "deep": deep,
    }


def _pickle_beside(folder: Path, kit: dict | None = None) -> None:
    """A benign weights-only pickle where transformers would look for one, and the safetensors under another name
    (the own loader reads any *.safetensors; transformers only model.safetensors[.index.json])."""
    from safetensors.torch import load_file

    src = folder / "model.safetensors"
    torch.save(load_file(str(src)), folder / "pytorch_model.bin")
    src.rename(folder / "weights.safetensors")


def _gpt2_with_pickle(d: Path, kit: dict) -> None:
    """The target becomes a GPT-2 folder (decoded through the transformers fallback) with a pickle beside it."""
    shutil.rmtree(d)
    shutil.copytree(kit["gpt2"], d)
    _pickle_beside(d)


def _truncate(f: Path) -> None:
    b = f.read_bytes()
    f.write_bytes(b[: len(b) // 2])


def _corrupt_header(f: Path) -> None:
    b = bytearray(f.read_bytes())
    b[8:24] = b"#" * 16  # the JSON header right after its 8-byte length
    f.write_bytes(bytes(b))


def _json_edit(f: Path, **kv) -> None:
    f.write_text(json.dumps({**json.loads(f.read_text()), **kv}))


def _remote_code_tokenizer(d: Path, kit: dict) -> None:
    (d / "tokenizer.json").unlink()
    _json_edit(
        d / "tokenizer_config.json",
        tokenizer_class="ShinyTokenizer",
        auto_map={"AutoTokenizer": ["tok.ShinyTokenizer", None]},
    )
    (d / "tok.py").write_text("raise SystemExit('remote code ran')\n")


def _vocab(d: Path, kit: dict) -> None:
    _json_edit(d / "config.json", vocab_size=json.loads((d / "config.json").read_text())["vocab_size"] + 7)


# id -> (command, mutation(target copy, kit) or None, extra overrides, fragments the error line must hold).
# {t} is the target copy, {k[...]} a kit entry; eval and serve use the fitting drafter unless told otherwise.
CASES = {
    "device-banana-generate": ("generate", None, ["target.device=banana"], ["target.device", "banana"]),
    "device-banana-eval": ("eval", None, ["target.device=banana"], ["target.device", "banana"]),
    "device-banana-serve": ("serve", None, ["target.device=banana"], ["target.device", "banana"]),
    "device-cuda3-generate": ("generate", None, [f"target.device={MISSING_GPU}"], ["target.device", MISSING_GPU]),
    "device-cuda3-eval": ("eval", None, [f"target.device={MISSING_GPU}"], ["target.device", MISSING_GPU]),
    "device-cuda3-serve": ("serve", None, [f"target.device={MISSING_GPU}"], ["target.device", MISSING_GPU]),
    "device-cuda3-sweep": ("sweep", None, [f"target.device={MISSING_GPU}"], ["target.device", MISSING_GPU]),
    "device-cuda3-train": ("train", None, [f"target.device={MISSING_GPU}"], ["target.device", MISSING_GPU]),
    "device-banana-show": ("show", None, ["target.device=banana"], ["target.device", "banana"]),
    "prompts-array-nested-200k": ("generate", None, ["data.prompts.path={k[deep_array]}"], ["deep.json", "record 1"]),
    "prompts-nested-200k": ("generate", None, ["data.prompts.path={k[deep]}"], ["deep.jsonl", "line 2", "nested"]),
    "eval-prompts-nested-200k": ("eval", None, ["eval.prompts.path={k[deep]}"], ["deep.jsonl", "line 2", "nested"]),
    "safetensors-truncated": (
        "generate",
        lambda d, k: _truncate(d / "model.safetensors"),
        [],
        ["{t}/model.safetensors", "truncated or corrupt"],
    ),
    "safetensors-bad-header": (
        "eval",
        lambda d, k: _corrupt_header(d / "model.safetensors"),
        [],
        ["{t}/model.safetensors", "truncated or corrupt"],
    ),
    "config-invalid-json": (
        "generate",
        lambda d, k: (d / "config.json").write_text('{"model_type": "llama",'),
        [],
        ["{t}/config.json", "invalid JSON"],
    ),
    "config-nested-json": (
        "eval",
        lambda d, k: (d / "config.json").write_text("[" * 200_000 + "]" * 200_000),
        [],
        ["{t}/config.json", "nested"],
    ),
    "generation-config-invalid-json": (
        "generate",
        lambda d, k: (d / "generation_config.json").write_text("{"),
        [],
        ["{t}/generation_config.json", "invalid JSON"],
    ),
    "tokenizer-invalid-json": (
        "generate",
        lambda d, k: (d / "tokenizer.json").write_text("{not json"),
        [],
        ["{t}/tokenizer.json", "tokenizer"],
    ),
    "config-vocab-size-disagrees": (
        "generate",
        _vocab,
        [],
        ["{t}/config.json", "vocab_size", "model.safetensors"],
    ),
    "tokenizer-needs-remote-code": (
        "generate",
        _remote_code_tokenizer,
        [],
        ["{t}/tokenizer_config.json", "target.trust_remote_code"],
    ),
    "pickle-only-hf-baseline": (
        "eval",
        _pickle_beside,
        ["eval.baseline_hf=true"],
        ["eval.baseline_hf", "no safetensors weights in {t}"],
    ),
    "pickle-only-fallback": ("eval", _gpt2_with_pickle, [], ["target.model", "no safetensors weights in {t}"]),
    "eval-drafter-other-tokenizer": ("eval", None, ["eval.checkpoint={k[other_tok]}"], ["{k[other_tok]}", "tokenizer"]),
    "eval-drafter-other-vocab": (
        "eval",
        None,
        ["eval.checkpoint={k[other_vocab]}"],
        ["{k[other_vocab]}", "vocabulary"],
    ),
    "serve-drafter-other-tokenizer": (
        "serve",
        None,
        ["eval.checkpoint={k[other_tok]}"],
        ["{k[other_tok]}", "tokenizer"],
    ),
    "serve-drafter-other-vocab": (
        "serve",
        None,
        ["eval.checkpoint={k[other_vocab]}"],
        ["{k[other_vocab]}", "vocabulary"],
    ),
}


@pytest.fixture
def never_pickle_nor_bind(monkeypatch):
    """torch.load (the pickle reader transformers falls back to) and the HTTP server's bind fail the test."""
    import draftsmith.serving.server as server

    def no_pickle(*a, **k):
        raise AssertionError("torch.load was called: a pickle was read")

    def no_bind(*a, **k):
        raise AssertionError("serve bound a port before refusing")

    monkeypatch.setattr(torch, "load", no_pickle)
    monkeypatch.setattr(server, "_bind", no_bind)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_target_device_and_prompts_are_one_line_errors(
    case, kit, tiny_model_dir, tiny_overrides, tmp_path, capsys, never_pickle_nor_bind
):
    command, mutate, extra, fragments = CASES[case]
    target = tmp_path / "target"  # every case corrupts its own copy of the tiny target
    shutil.copytree(tiny_model_dir, target)
    if mutate is not None:
        mutate(target, kit)
    fill = {"t": target, "k": kit}
    overrides = [o for o in tiny_overrides if not o.startswith("target.model=")] + [f"target.model={target}"]
    overrides += [f"eval.checkpoint={kit['good']}", "online.port=0", "online.learn=false", "-q"]
    overrides += [o.format(**fill) for o in extra]
    capsys.readouterr()
    assert main([command, "tiny", *overrides]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("draftsmith: error: "), err
    for f in fragments:
        assert f.format(**fill) in err[0], err[0]
    run = tmp_path / "run"
    for done in ("data/manifest.json", "checkpoints/final", "eval/report.json", "online/current.json"):
        assert not (run / done).exists(), done


def test_the_real_cli_prints_one_line_for_a_device_without_cuda(tmp_path, tiny_overrides):
    """The console entry as a user runs it (a subprocess): no traceback, exit 2, one stderr line."""
    res = subprocess.run(
        [sys.executable, "-m", "draftsmith", "generate", "tiny", *tiny_overrides, f"target.device={MISSING_GPU}", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "target.device" in lines[0] and MISSING_GPU in lines[0], (
        res.stderr
    )


def test_every_transformers_model_load_in_the_product_is_safetensors_only():
    """Each from_pretrained of a model (not a tokenizer or config) passes use_safetensors=True (the GGUF alias
    reads its packaged GGUF file); no product module calls torch.load or reads a pickle."""
    import ast

    calls = []
    for folder in ("models", "eval", "data", "train", "draftsmith", "kernels", "recipes"):
        for f in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(f.read_text())
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                owner = ast.unparse(node.func.value)
                assert not (owner in ("torch", "pickle") and node.func.attr == "load"), f"{f}:{node.lineno}"
                assert owner != "pickle", f"{f}:{node.lineno}"
                if node.func.attr == "from_pretrained" and not re.search("Tokenizer|Config", owner):
                    kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                    assert kw.get("use_safetensors") == "True" or "gguf_file" in kw, f"{f}:{node.lineno}"
                    calls.append(f"{f.name}:{node.lineno}")
    assert len(calls) >= 2, calls  # the HF loader for a target folder and the GGUF alias


DEEP = "[" * 200_000 + "]" * 200_000


def test_a_request_or_request_log_nested_too_deeply_is_refused_not_a_crash(kit, tiny_model_dir, tmp_path):
    """serve answers a request body nested 200,000 deep with a 400 (the handler does not die, the server goes on
    answering); the online log follower skips such a line like any other that is not a request record."""
    import threading
    import urllib.error
    import urllib.request

    from draftsmith.recipes.loader import load_recipe
    from draftsmith.serving.online import LogFollower
    from draftsmith.serving.server import make_server
    from draftsmith.serving.traffic import TrafficBuffer

    recipe = load_recipe(
        "tiny",
        [
            f"target.model={tiny_model_dir}",
            f"out_dir={tmp_path / 'run'}",
            f"eval.checkpoint={kit['good']}",
            "online.port=0",
            "online.learn=false",
            "online.max_tokens=4",
        ],
    )
    httpd, engine = make_server(recipe)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/chat/completions"

    def post(body: bytes):
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    try:
        code, body = post(DEEP.encode())
        assert code == 400 and "nested too deeply" in body, (code, body)
        ok = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        assert post(ok)[0] == 200
    finally:
        httpd.shutdown()
        httpd.server_close()

    log_file = tmp_path / "requests.jsonl"
    log_file.write_text(DEEP + "\n" + json.dumps({"prompt": [5, 6, 7], "response": [8, 9]}) + "\n")
    buf = TrafficBuffer(tmp_path / "traffic")
    follower = LogFollower([str(log_file)], buf, tmp_path / "offsets.json", engine.tok, engine.eos)
    assert follower.poll() == 1 and buf.read()[0]["prompt"] == [5, 6, 7]
