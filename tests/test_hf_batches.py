"""Batched decoding on the transformers path (models/hf_target.py): the target runs on the own model's slot KV cache
through ``SlotView``, so eval/batch_decoder.py ``BatchDecoder`` (rows that join and leave, holes, compaction, trees),
`eval.batch_sizes`, `draftsmith serve`, the online learner and judge mining take any architecture whose attention
takes a prepared 4-D mask. Float64 tiny random models; greedy rows must equal their own batch-1 decode."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import noisy_copy, tiny_eagle
from test_hf_pipeline import KINDS, _recipe
from test_hf_target import QUESTIONS, _save_arch

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.eval.batch_decoder import BatchDecoder, speculative_generate_batch
from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.eval.tree import TreeSpec
from draftsmith.models.hf_target import HFCache
from draftsmith.models.llama import KVCache
from draftsmith.models.loading import encode_chat, load_model, stop_ids

NEW = 12
# gemma2: window 8 < prompts, soft-caps, mixed full / windowed layers (one mask per layer type); gpt_oss: sinks,
# windows, MoE; deepseek_v3: latent attention, values narrower than keys; phi3: every layer windowed (none here).
FAMILIES = ["gemma2", "gpt_oss", "deepseek_v3", "phi3", "mixtral"]


def _prompts(tok) -> list[torch.Tensor]:
    return [torch.tensor(encode_chat(tok, [{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def archs(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("hf-batches")
    return {f: _save_arch(root / f, tiny_tokenizer, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_tokenizer):
    from conftest import save_tiny_llama

    path = save_tiny_llama(tmp_path_factory.mktemp("hfb-llama"), tiny_tokenizer, seed=3, num_hidden_layers=4)
    own = load_model(str(path), torch.float64)
    hft = load_model(str(path), torch.float64, backend="transformers")
    return path, own, hft


def test_the_transformers_target_runs_on_the_slot_cache(llama, archs):
    """Every tested architecture gets the own model's slot cache, sized by what its attention writes (probed): for
    DeepSeek-V3 that is what transformers caches, the latent and its rotary part, in the wider one's width."""
    _, own, hft = llama
    assert isinstance(hft.model.new_cache(2, 8), KVCache) and hft.model.slots_ok
    assert hft.model.new_cache(1, 4).kv.shape == own.model.new_cache(1, 4).kv.shape
    ds = load_model(str(archs["deepseek_v3"]), torch.float64, backend="auto").model
    c = ds.new_cache(1, 4)
    assert isinstance(c, KVCache) and c.kv.shape[1:3] == (4, 1) and c.kv.shape[-1] >= 16


@pytest.mark.parametrize(
    "kind,temperature",
    [("plain", 0.0), ("draft_lm", 0.0), ("draft_lm", 1.0), ("eagle3", 0.0), ("eagle3", 1.0), ("tree", 0.0)],
)
def test_llama_batches_are_the_same_on_both_paths(llama, kind, temperature):
    """A Llama loaded both ways decodes a ragged batch of 4 (greedy and sampled, same seed) to the same tokens with
    the same accepted drafts; greedy rows equal plain decoding."""
    path, own, hft = llama
    eos = stop_ids(own.path, own.tokenizer)
    prompts = _prompts(own.tokenizer)
    torch.manual_seed(1)
    drafter = {
        "plain": None,
        "draft_lm": noisy_copy(own.model),
        "eagle3": tiny_eagle(3, own.model, 0.05),
        "tree": noisy_copy(own.model),
    }[kind]
    tree = TreeSpec((-1, -1, 0, 0, 2), (0, 1, 0, 1, 0)) if kind == "tree" else None
    runs = []
    for tgt in (own.model, hft.model):
        gen = torch.Generator().manual_seed(7)
        outs, stats = speculative_generate_batch(
            tgt, drafter, prompts, NEW, draft_len=3, temperature=temperature, eos_ids=eos, generator=gen, tree=tree
        )
        runs.append((outs, [s.accept_counts for s in stats]))
    assert runs[0] == runs[1]
    assert all(len(o) > 0 for o in runs[0][0])
    if temperature == 0:
        assert runs[0][0] == [autoregressive_generate(own.model, p, NEW, eos_ids=eos) for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_other_architectures_decode_batches_as_their_rows_alone(archs, family):
    """Rows join and leave a running batch (the cache compacts to make room), plain and with EAGLE-3 chains, and
    each greedy row equals that prompt's batch-1 decode; on Gemma-2 (windows and soft-caps) a static tree too."""
    tgt = load_model(str(archs[family]), torch.float64, backend="auto")
    assert tgt.backend == "transformers"
    model, eos = tgt.model, stop_ids(tgt.path, tgt.tokenizer)
    prompts = _prompts(tgt.tokenizer)
    ar = [autoregressive_generate(model, p, NEW, eos_ids=eos) for p in prompts]
    torch.manual_seed(0)
    eagle = tiny_eagle(3, model, 0.05)
    drafters = {"plain": (None, None), "eagle3": (eagle, None)}
    if family == "gemma2":
        drafters["tree"] = (eagle, TreeSpec((-1, -1, 0, 1, 2), (0, 1, 0, 0, 0)))
    for name, (drafter, tree) in drafters.items():
        if drafter is not None:
            one = [
                speculative_generate(model, drafter, p, NEW, draft_len=3, eos_ids=eos, tree=tree)[0] for p in prompts
            ]
            assert one == ar, name
        room = BatchDecoder(model, drafter, draft_len=3, max_len=1, tree=tree).room
        tight = max(p.numel() for p in prompts) + NEW + room + 6  # rows must compact to make room
        dec = BatchDecoder(model, drafter, draft_len=3, eos_ids=eos, max_len=tight, tree=tree)
        outs: dict[int, list[int]] = {}

        def step(n: int, dec=dec, outs=outs) -> None:
            for _ in range(n):
                for i, toks in dec.step().items():
                    outs.setdefault(i, []).extend(toks)

        ids = [dec.add(prompts[0], NEW), dec.add(prompts[1], NEW)]
        step(2)
        ids += [dec.add(prompts[3], NEW), dec.add(prompts[2], NEW)]  # the longest prompt joins mid-run
        step(100)
        assert not dec.active()
        assert [outs[i] for i in ids] == [ar[0], ar[1], ar[3], ar[2]], (family, name)
        assert dec.rc.compactions > 0, name


def test_a_model_without_4d_masks_decodes_at_batch_1_and_refuses_batches(llama, monkeypatch):
    """Where transformers' attention takes no prepared mask the target keeps a DynamicCache: chains at batch 1 still
    decode exactly; batched decoding is refused in one line naming what to do."""
    _, own, _ = llama
    hft = load_model(str(llama[0]), torch.float64, backend="transformers").model
    hft._mask_how = "none"
    assert isinstance(hft.new_cache(1, 4), HFCache) and not hft.slots_ok
    eos = stop_ids(own.path, own.tokenizer)
    p = _prompts(own.tokenizer)[1]
    torch.manual_seed(1)
    out, _ = speculative_generate(hft, noisy_copy(own.model), p, NEW, draft_len=3, eos_ids=eos)
    assert out == autoregressive_generate(own.model, p, NEW, eos_ids=eos)
    with pytest.raises(DraftsmithError, match=r"^batched decoding .*takes no 4-D mask; decode chains at batch 1"):
        BatchDecoder(hft, None, max_len=32)


@pytest.fixture(scope="module")
def gemma_run(tmp_path_factory, prompts_file, archs):
    """`draftsmith run` of an EAGLE-3 drafter for Gemma-2 with eval.batch_sizes -> (run folder, recipe path)."""
    root = tmp_path_factory.mktemp("gemma-run")
    drafter, extra = KINDS["eagle"]
    recipe, out = _recipe(root, "eagle", drafter), root / "run"
    args = [
        f"target.model={archs['gemma2']}",
        f"data.prompts.path={prompts_file}",
        f"eval.prompts.path={prompts_file}",
        f"out_dir={out}",
        "target.dtype=float64",
        "train.steps=2",
        "eval.prompts.n=3",
        "eval.max_new_tokens=12",
        "eval.batch_sizes=[1,2,3]",
        "export.enabled=false",
        *extra,
        "-q",
    ]
    assert main(["run", recipe, *args]) == 0
    return out, recipe


def test_eval_batch_sizes_on_the_transformers_path(gemma_run):
    """eval.batch_sizes on Gemma-2: every batch size's greedy rows equal plain decoding and the batch-1 decode."""
    report = json.loads((gemma_run[0] / "eval" / "report.json").read_text())
    assert report["target_path"] == "transformers" and report["lossless_match"] == 1.0
    rows = report["batches"]["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2, 3]
    assert all(r["lossless_match"] == r["ar_match"] == r["batch1_match"] == 1.0 for r in rows)


def test_serve_and_a_learner_round_on_the_transformers_path(tmp_path, archs, gemma_run):
    """`draftsmith serve` on Gemma-2 (target.backend auto -> transformers): concurrent requests answer exactly the
    target's greedy text; a learner round trains EAGLE-3 on that traffic (hidden states from the target in the
    loop) and decodes its held-out prompt."""
    import http.client

    from draftsmith.recipes.loader import load_recipe
    from draftsmith.serving.online import Learner
    from draftsmith.serving.server import make_server

    path = archs["gemma2"]
    tgt = load_model(str(path), torch.float64, backend="auto")
    eos = stop_ids(tgt.path, tgt.tokenizer)
    ckpt, name = gemma_run[0] / "checkpoints" / "final", gemma_run[1]
    recipe = load_recipe(
        name,
        [
            f"target.model={path}",
            f"out_dir={tmp_path / 'run'}",
            f"eval.checkpoint={ckpt}",
            f"online.dir={tmp_path / 'online'}",
            "online.port=0",
            "online.learn=false",
            "online.max_tokens=12",
            "target.dtype=float64",
        ],
    )
    httpd, engine = make_server(recipe)
    assert engine.tgt.backend == "transformers"
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port, answers = httpd.server_address[1], {}

    def ask(q: str) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"messages": [{"role": "user", "content": q}], "max_tokens": 12, "temperature": 0}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        answers[q] = json.loads(conn.getresponse().read())["choices"][0]["message"]["content"]
        conn.close()

    try:
        threads = [threading.Thread(target=ask, args=(q,)) for q in QUESTIONS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        httpd.shutdown()
        httpd.server_close()
    for q in QUESTIONS:
        ids = torch.tensor(encode_chat(tgt.tokenizer, [{"role": "user", "content": q}]))
        ref = autoregressive_generate(tgt.model, ids, 12, eos_ids=eos)
        assert answers[q] == tgt.tokenizer.decode([t for t in ref if t not in eos], skip_special_tokens=True)
    traffic = engine.buffer.read()
    assert len(traffic) == len(QUESTIONS)
    r = load_recipe(
        name,
        [
            f"target.model={path}",
            f"out_dir={tmp_path / 'run'}",
            f"eval.checkpoint={ckpt}",
            f"online.dir={tmp_path / 'online'}",
            "online.holdout=1",
            "online.min_records=2",
            "online.update_every_requests=2",
            "online.steps_per_update=2",
            "online.eval_tokens=8",
        ],
    )
    learner = Learner(r, engine.buffer, engine.versions)
    assert learner.tgt.backend == "transformers"
    out = learner.round()
    assert out["records"] == len(QUESTIONS) - 1 and out["held_out"] == 1
    assert out["tau_candidate"] >= 1.0 and out["tau_current"] >= 1.0


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_generate_refills_rows_on_the_transformers_path(tmp_path, archs, prompts_file, family, monkeypatch):
    """`draftsmith generate` on Gemma-2 / gpt-oss keeps its rows busy (data.refill, the slot cache) and writes the
    records the fixed batches write: the same tokens, the same top-k ids, signals equal to float64 rounding."""
    from conftest import shard_tensors

    from draftsmith.data import engine

    calls = {"n": 0}
    real = engine.Refill.run

    def counted(self, *a, **kw):
        calls["n"] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(engine.Refill, "run", counted)
    runs = {}
    for refill in ("true", "false"):
        out = tmp_path / refill
        args = [
            "generate",
            "tiny",
            f"target.model={archs[family]}",
            f"data.prompts.path={prompts_file}",
            f"out_dir={out}",
            "target.dtype=float64",
            "data.batch_size=3",
            "data.signals.hidden_last=true",
            "data.signals.hidden_layers=eagle3",
            "data.signals.hidden_dtype=float16",
            f"data.refill={refill}",
            "-q",
        ]
        assert main(args) == 0
        runs[refill] = shard_tensors(out / "data")
        if refill == "true":
            assert calls["n"] > 0, "refill ran"
            calls["n"] = 0
    assert calls["n"] == 0
    a, b = runs["true"], runs["false"]
    assert a.keys() == b.keys()
    for shard in a:
        assert a[shard].keys() == b[shard].keys()
        for k, v in a[shard].items():
            w = b[shard][k]
            if v.is_floating_point():
                torch.testing.assert_close(v, w, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
            else:
                assert torch.equal(v, w), k
