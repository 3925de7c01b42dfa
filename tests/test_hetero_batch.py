"""Drafts with their own tokenizer at B > 1 (eval/hetero.py ``OwnVocabRows`` through ``BatchDecoder``): every
row decodes exactly as its prompt would alone with ``hetero_generate`` (tokens and accepted count at every step),
greedy with slem and tli, with and without the n-gram cache, B in {1, 2, 5} with ragged prompts under a cache
tight enough to compact; sampled rows equal their own batch-1 decode with the same generator and follow the
target's distribution; rows join and leave; EOS ends only its row. Then the same drafter through eval.batch_sizes,
``draftsmith serve`` (concurrent clients) and the online learner, and the eval.own_vocab recipe keys."""

# ruff: noqa: F811  (the module fixture toks is test_hetero_vocab's)
from __future__ import annotations

import pytest
import torch
from conftest import tiny_model, tv
from test_hetero_vocab import TEXT, FromTarget, cfg, toks, two_token_joint  # noqa: F401

from draftsmith.eval.batch_decoder import BatchDecoder, speculative_generate_batch
from draftsmith.eval.decoder import autoregressive_generate
from draftsmith.eval.hetero import BAD, OwnVocabDrafter, Vocabs, hetero_generate

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 30
TEXTS = [
    "The quick brown",
    "Speculative decoding lets a small draft model propose tokens that a large target",
    "def add(a, b):\n   ",
    "What is the capital",
    "Write a short poem about the sea and the stars at night. The quick brown fox jumps over",
    "Paris",
]


class Echo(FromTarget):
    """``FromTarget`` whose noise depends only on the token read, not on a shared generator: a row's drafts are the
    same whichever rows ran before it, so its accepted counts can be compared with its batch-1 decode's."""

    def __init__(self, target, vocabs: Vocabs, noise: float = 0.05):
        super().__init__(target, vocabs, 0.0)
        g = torch.Generator().manual_seed(7)
        self.table = noise * torch.randn(len(vocabs.d2t), len(vocabs.d2t), generator=g, dtype=torch.float64)

    def forward(self, ids, cache=None, **kw):
        return super().forward(ids, cache=cache, **kw) + self.table[ids]


@pytest.fixture(scope="module")
def tgt(toks):
    return tiny_model(0, cfg(len(toks[0])))


@pytest.fixture(scope="module")
def prompts(toks):
    return [torch.tensor(Vocabs.ids(toks[0], s)) for s in TEXTS]


def drafter(tgt, toks, kind: str, method: str, ngram: bool = False, vocab: int = 400) -> OwnVocabDrafter:
    t, ds = toks
    lm = Echo(tgt, Vocabs(t, ds[vocab])) if kind == "echo" else tiny_model(1, cfg(len(ds[vocab])))
    return OwnVocabDrafter(lm, ds[vocab], t, method=method, ngram=ngram)


def tight(tgt, d, B: int, prompts, **kw) -> BatchDecoder:
    """A decoder whose cache holds only the longest row's own need: rejected candidates' holes force compaction."""
    room = BatchDecoder(tgt, d, **kw).room
    return BatchDecoder(tgt, d, max_len=max(p.numel() for p in prompts[:B]) + NEW + room + 4, **kw)


def run(dec: BatchDecoder, ids: list[int]) -> dict[int, list[int]]:
    outs = {i: [] for i in ids}
    while dec.active():
        for i, new in dec.step().items():
            outs.setdefault(i, []).extend(new)
    return outs


@pytest.mark.parametrize("B", [1, 2, 5])
@pytest.mark.parametrize("ngram", [False, True])
@pytest.mark.parametrize("method", ["slem", "tli"])
@pytest.mark.parametrize("kind", ["echo", "random"])
def test_greedy_rows_equal_their_own_decode(tgt, toks, prompts, kind, method, ngram, B):
    d = drafter(tgt, toks, kind, method, ngram)
    dec = tight(tgt, d, B, prompts, draft_len=3)
    ids = [dec.add(p, NEW) for p in prompts[:B]]
    outs = run(dec, ids)
    for b, i in enumerate(ids):
        ref, st = hetero_generate(tgt, d, prompts[b], NEW, draft_len=3)
        assert outs[i] == ref == autoregressive_generate(tgt, prompts[b], NEW), (kind, method, ngram, B, b)
        got = dec.stats[i]
        assert got.accepted_per_step == st.accepted_per_step and got.drafted == st.drafted, (kind, method, B, b)
        assert got.accept_counts == st.accept_counts and got.ngram_candidates == st.ngram_candidates
        assert got.new_tokens == NEW
    if kind == "echo":
        assert sum(dec.stats[i].accepted for i in ids) > 0  # some candidates were kept
    if B == 5 and kind == "echo":  # rows keep different counts: the cache outgrows the longest row's need
        assert dec.rc.compactions > 0


def test_slem_rows_verify_chains_of_different_lengths(tgt, toks, prompts):
    """slem re-tokenizes each row's drafted text: in one step the rows' candidate chains have different lengths."""
    dec = BatchDecoder(tgt, drafter(tgt, toks, "echo", "slem"), draft_len=3, max_len=200)
    ids = [dec.add(p, NEW) for p in prompts[:5]]
    draft, sizes = dec.prop.draft, []

    def counted(*a):
        drafts = draft(*a)  # (candidates per position, q per position, candidates per row)
        if drafts is not None:
            sizes.append(set(drafts[2]))
        return drafts

    dec.prop.draft = counted
    run(dec, ids)
    assert any(len(s) > 1 for s in sizes)


@pytest.mark.parametrize("method", ["slem", "tli"])
def test_sampled_rows_equal_their_own_decode_with_the_same_generator(tgt, toks, prompts, method):
    d = drafter(tgt, toks, "echo", method)
    gens = lambda: [torch.Generator().manual_seed(10 + b) for b in range(5)]  # noqa: E731
    dec = tight(tgt, d, 5, prompts, draft_len=3)
    ids = [dec.add(p, NEW, temperature=1.0, top_k=20, generator=g) for p, g in zip(prompts, gens())]
    outs = run(dec, ids)
    for b, (i, g) in enumerate(zip(ids, gens())):
        ref, st = hetero_generate(tgt, d, prompts[b], NEW, draft_len=3, temperature=1.0, top_k=20, generator=g)
        assert outs[i] == ref, (method, b)
        assert dec.stats[i].accepted_per_step == st.accepted_per_step
    assert sum(dec.stats[i].accepted for i in ids) > 0


@pytest.mark.parametrize("method", ["tli", "slem"])
def test_sampled_rows_follow_the_target_distribution(toks, method):
    """4,000 rows of one prompt in one batch, temperature 1: the joint of their first two tokens is the target's
    (as tests/test_hetero_vocab.py checks at batch 1); greedy rows in the same batch stay exact."""
    t, ds = toks
    target = tiny_model(0, cfg(len(t)), logit_scale=12.0)
    d = OwnVocabDrafter(FromTarget(target, Vocabs(t, ds[400])), ds[400], t, method=method)
    prompt = Vocabs.ids(t, "The quick brown")
    joint = two_token_joint(target, prompt)
    gen, N = torch.Generator().manual_seed(0), 4000
    dec = BatchDecoder(target, d, draft_len=2, max_len=len(prompt) + 16)
    ids = [dec.add(torch.tensor(prompt), 3, temperature=1.0, generator=gen) for _ in range(N)]
    greedy = [dec.add(torch.tensor(prompt), 3) for _ in range(2)]
    outs = run(dec, ids + greedy)
    assert all(outs[i] == autoregressive_generate(target, torch.tensor(prompt), 3) for i in greedy)
    counts = torch.zeros_like(joint)
    for i in ids:
        counts[outs[i][0], outs[i][1]] += 1
    emp = counts / N
    acc = sum(dec.stats[i].accepted for i in ids) / sum(dec.stats[i].drafted for i in ids)
    assert 0.05 < acc < 0.95, acc  # both the accept and the reject path ran
    assert tv(emp.sum(1), joint.sum(1)) < 0.04
    assert tv(emp, joint) < 0.07


def test_rows_join_and_leave_mid_run(tgt, toks, prompts):
    d = drafter(tgt, toks, "echo", "slem", ngram=True)
    ref = [hetero_generate(tgt, d, p, NEW, draft_len=3) for p in prompts]
    dec = BatchDecoder(tgt, d, draft_len=3, max_len=120)
    outs: dict[int, list[int]] = {}

    def step(n=1):
        for _ in range(n):
            for i, new in dec.step().items():
                outs.setdefault(i, []).extend(new)

    a, b, c = dec.add(prompts[1], NEW), dec.add(prompts[5], NEW), dec.add(prompts[4], 2)
    step(3)
    assert c not in dec.active() and outs[c] == ref[4][0][:2]
    e, f = dec.add(prompts[2], NEW), dec.add(prompts[0], NEW)
    step(2)
    dec.remove(b)
    g = dec.add(prompts[3], 1)
    step()
    assert outs[g] == ref[3][0][:1] and g not in dec.active()
    step(200)
    assert not dec.active()
    for i, k in ((a, 1), (e, 2), (f, 0)):
        assert outs[i] == ref[k][0] and dec.stats[i].accepted_per_step == ref[k][1].accepted_per_step, k
    assert outs[b] == ref[5][0][: len(outs[b])] and 0 < len(outs[b]) < NEW


@pytest.mark.parametrize("method", ["slem", "tli"])
def test_eos_ends_only_its_row(tgt, toks, prompts, method):
    d = drafter(tgt, toks, "echo", method)
    ar = [autoregressive_generate(tgt, p, NEW) for p in prompts]
    eos = {ar[1][9]}
    want = [a[: next((j + 1 for j, x in enumerate(a) if x in eos), len(a))] for a in ar]
    assert len({len(w) for w in want}) > 1
    outs, stats = speculative_generate_batch(tgt, d, prompts, NEW, draft_len=3, eos_ids=eos)
    assert outs == want
    for p, st, w in zip(prompts, stats, want):
        _, ref = hetero_generate(tgt, d, p, NEW, draft_len=3, eos_ids=eos)
        assert st.new_tokens == len(w) and st.accepted_per_step == ref.accepted_per_step


def test_what_batch_one_refuses_is_refused(tgt, toks):
    from draftsmith.eval.tree import TreeSpec

    d = drafter(tgt, toks, "random", "auto")
    with pytest.raises(ValueError, match="chains only"):
        BatchDecoder(tgt, d, tree=TreeSpec(parents=(-1, 0), ranks=(0, 0)))
    with pytest.raises(ValueError, match="chains only"):
        BatchDecoder(tgt, d, stop_drafting=lambda *a: True)
    with pytest.raises(ValueError, match="draft_len must be >= 1"):
        BatchDecoder(tgt, d, draft_len=0)
    with pytest.raises(ValueError, match="slem, tli or auto"):
        BatchDecoder(tgt, drafter(tgt, toks, "random", "exact"))
    dec = BatchDecoder(tgt, d, draft_len=3)  # auto: slem for greedy rows, tli for sampled rows
    greedy, sampled = dec.add(torch.tensor([5, 6]), 4), dec.add(torch.tensor([5, 6]), 4, temperature=1.0)
    assert len(dec.stats[greedy].accept_counts) == 7 and len(dec.stats[sampled].accept_counts) == 4


def test_rows_count_ngram_candidates_and_stays_lossless(toks, prompts):
    """The counter the report shows: an echoing slem draft with the cache writes some candidates from it (a target
    that repeats itself), at batch 1 and B > 1 alike, and the output stays the target's."""
    tgt = tiny_model(3, cfg(len(toks[0])))
    d = drafter(tgt, toks, "echo", "slem", ngram=True)
    outs, stats = speculative_generate_batch(tgt, d, prompts[:3], 80, draft_len=3)
    for p, o, st in zip(prompts, outs, stats):
        ref, st1 = hetero_generate(tgt, d, p, 80, draft_len=3)
        assert o == ref == autoregressive_generate(tgt, p, 80) and st.ngram_candidates == st1.ngram_candidates
    assert 0 < sum(st.ngram_candidates for st in stats) <= sum(st.drafted for st in stats)


# ---- eval.batch_sizes and eval.own_vocab through `draftsmith eval` -------------------------------------------------

OWN = ("drafter.tokenizer=train", "drafter.vocab_size=280", "drafter.init_from_target=false", "train.loss.kind=ce")


def test_eval_batch_sizes_and_own_vocab_keys(train_run, tiny_model_dir, prompts_file, capsys):
    import json

    from draftsmith.cli import main

    run = train_run("own", *OWN)
    common = [f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}", f"out_dir={run}", "-q"]
    common += ["eval.baseline_hf=false"]

    def report(*extra: str) -> dict:
        assert main(["eval", "tiny", *common, *extra]) == 0
        return json.loads((run / "eval" / "report.json").read_text())

    r = report("eval.batch_sizes=[1,2,3]")
    rows = r["batches"]["rows"]
    assert [x["batch_size"] for x in rows] == [1, 2, 3] and r["lossless_match"] == 1.0
    assert all(x["batch1_match"] == 1.0 and x["lossless_match"] == 1.0 for x in rows), rows
    r = report("eval.own_vocab.ngram_cache=true", "eval.batch_sizes=[2]")
    tok = r["drafter"]["tokenizer"]
    assert r["lossless_match"] == 1.0 and r["batches"]["rows"][0]["batch1_match"] == 1.0
    assert tok["method"] == "slem" and tok["ngram_cache"] is True
    assert 0 <= tok["ngram_candidates"] <= tok["drafted"] > 0
    r = report("eval.own_vocab.method=tli")
    assert r["lossless_match"] == 1.0 and r["drafter"]["tokenizer"] == {"vocab_size": 280, "method": "tli"}
    plain = train_run("plain")
    common[2] = f"out_dir={plain}"
    capsys.readouterr()
    assert main(["eval", "tiny", *common, "eval.own_vocab.ngram_cache=true"]) == 2
    err = capsys.readouterr().err
    assert "eval.own_vocab" in err and "drafts in the target's vocabulary" in err and len(err.strip().splitlines()) == 1


# ---- `draftsmith serve` and the online learner -----------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """The tiny target and a random 1-layer draft LM with its own 280-token BPE, saved as a checkpoint; the
    reference greedy answers."""
    from conftest import CORPUS
    from test_serve_batch import TEXTS as SERVE_TEXTS

    from draftsmith.models.draft_lm import build_draft_lm
    from draftsmith.models.loading import encode_chat, load_model, stop_ids
    from draftsmith.models.registry import save_drafter
    from draftsmith.train.own_vocab import train_bpe

    root = tmp_path_factory.mktemp("serve-own")
    tgt = load_model(str(tiny_model_dir))
    tok = train_bpe(CORPUS + SERVE_TEXTS, 280, tgt.tokenizer)
    torch.manual_seed(0)
    lm = build_draft_lm(
        {"n_layers": 1, "tokenizer": "train", "vocab_size": 280, "init_from_target": False},
        tgt.model,
        draft_tokenizer=tok,
    )
    with torch.no_grad():  # its argmax never a partial character (a greedy slem draft of only those drafts nothing)
        bad = [i for i in range(len(tok)) if BAD in Vocabs.text(tok, [i])]
        lm.lm_head.weight.mul_(10.0)[bad] = 0.0
    meta = {"target": str(tiny_model_dir), "recipe": "tiny", "step": 0}
    ckpt = save_drafter(root / "run" / "checkpoints" / "final", lm, "draft_lm", meta)
    eos = stop_ids(tgt.path, tgt.tokenizer)
    ref, traffic = {}, []
    for text in SERVE_TEXTS:
        ids = encode_chat(tgt.tokenizer, [{"role": "user", "content": text}])
        out = autoregressive_generate(tgt.model, torch.tensor(ids), 16, eos_ids=eos)
        ref[text] = tgt.tokenizer.decode([t for t in out if t not in eos], skip_special_tokens=True)
        traffic.append({"prompt": ids, "response": out})
    traffic *= 3  # 24 requests: repeated prompts, something to learn
    return {"tgt": tgt, "ckpt": ckpt, "model_dir": tiny_model_dir, "ref": ref, "traffic": traffic, "eos": eos}


def _recipe(served, tmp_path, *extra):
    from draftsmith.recipes.loader import load_recipe

    return load_recipe(
        "tiny",
        [
            f"target.model={served['model_dir']}",
            f"out_dir={tmp_path / 'run'}",
            f"eval.checkpoint={served['ckpt']}",
            f"online.dir={tmp_path / 'online'}",
            "online.port=0",
            "online.learn=false",
            "online.max_tokens=16",
            *OWN,
            *extra,
        ],
    )


@pytest.mark.parametrize("settings", [(), ("eval.own_vocab.ngram_cache=true", "online.speculate_max_batch=3")])
def test_serve_answers_concurrent_clients_with_the_targets_greedy_answer(served, tmp_path, settings):
    """12 clients at once against an own-vocabulary checkpoint: every answer is the prompt's greedy answer (with
    the n-gram cache, and with steps above online.speculate_max_batch decoding plainly)."""
    import json
    import threading

    from test_serve_batch import _chat

    from draftsmith.serving.server import make_server

    httpd, engine = make_server(_recipe(served, tmp_path, *settings))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port, results = httpd.server_address[1], {}
    try:
        assert getattr(engine.drafter, "own_vocab", False)
        texts = list(served["ref"])

        def ask(i):
            code, _, body = _chat(port, texts[i % len(texts)], max_tokens=16)
            results[i] = (code, texts[i % len(texts)], json.loads(body)["choices"][0]["message"]["content"])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        ask(12)  # alone: it speculates
        assert len(results) == 13
        for code, text, answer in results.values():
            assert code == 200 and answer == served["ref"][text], text
        assert engine.m["forwards"] > 0 and engine.m["drafted"] > 0
        assert (engine.m["plain_steps"] > 0) == bool(settings)  # above speculate_max_batch: plain steps
    finally:
        httpd.shutdown()
        httpd.server_close()
        engine.close()


def test_serve_refuses_own_vocab_keys_for_a_target_vocabulary_drafter(served, tmp_path, tiny_model_dir):
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.draft_lm import build_draft_lm
    from draftsmith.models.registry import save_drafter
    from draftsmith.recipes.loader import load_recipe
    from draftsmith.serving.server import make_server

    ckpt = save_drafter(tmp_path / "plain", build_draft_lm({"n_layers": 1}, served["tgt"].model), "draft_lm", {})
    r = load_recipe(
        "tiny",
        [f"target.model={tiny_model_dir}", f"out_dir={tmp_path / 'run'}", f"eval.checkpoint={ckpt}",
         f"online.dir={tmp_path / 'online'}", "online.port=0", "online.learn=false", "eval.own_vocab.method=tli"],
    )  # fmt: skip
    with pytest.raises(DraftsmithError, match="eval.own_vocab: .* drafts in the target's vocabulary"):
        make_server(r)


def test_an_online_round_keeps_the_tokenizer_and_its_version_loads_back(served, tmp_path, monkeypatch):
    """The learner retrains an own-vocabulary drafter on the traffic re-tokenized by the serving version's own
    tokenizer (not a BPE learned anew), measures τ with it, and the version it publishes carries that tokenizer
    and decodes losslessly."""
    from draftsmith.eval.own_vocab import for_decoding
    from draftsmith.models.registry import load_drafter
    from draftsmith.serving.online import Learner, Versions
    from draftsmith.serving.traffic import TrafficBuffer

    r = _recipe(served, tmp_path, "online.holdout=3", "online.min_records=8", "online.steps_per_update=20",
                "online.eval_tokens=16", "train.micro_batch_size=4", "eval.own_vocab.ngram_cache=true")  # fmt: skip
    buf = TrafficBuffer(tmp_path / "online" / "traffic")
    versions = Versions(tmp_path / "online", served["ckpt"])
    for t in served["traffic"]:
        buf.append(t)
    learner = Learner(r, buf, versions, tgt=served["tgt"])
    assert learner.held_out_tau(versions.current()[1], served["traffic"][:3]) >= 1.0
    real, calls = Learner.held_out_tau, []

    def better(self, ckpt, hold):  # the candidate wins, whatever it measures: a version is published
        calls.append(real(self, ckpt, hold))
        return calls[-1] + (len(calls) == 2)

    monkeypatch.setattr(Learner, "held_out_tau", better)
    out = learner.round()
    assert out["swapped"] and versions.current()[0] == "v0001" and len(calls) == 2
    v0, v1 = versions.dir / "v0000", versions.dir / "v0001"
    assert (v1 / "tokenizer" / "tokenizer.json").read_text() == (v0 / "tokenizer" / "tokenizer.json").read_text()
    lm, info = load_drafter(v1)
    d = for_decoding(v1, lm, info, served["tgt"].tokenizer, r.eval)
    assert d.own_vocab and d.ngram and len(d.tokenizer) == lm.cfg.vocab_size
    before = load_drafter(v0)[0].state_dict()
    assert any(not torch.equal(before[k], v) for k, v in lm.state_dict().items())  # it was trained
    for t in served["traffic"][:4]:
        p = torch.tensor(t["prompt"])
        assert hetero_generate(served["tgt"].model, d, p, 16, draft_len=3, eos_ids=served["eos"])[0] == t["response"]


def test_a_shared_ngram_table_learns_across_decodes_and_stays_lossless(toks, prompts):
    """eval.own_vocab.ngram_scope=drafter: one table for every decode of the drafter (OmniDraft's online
    adaptation). A prompt decoded again, after itself and others, gets more candidates from the table than a fresh
    per-decode table gives it, at batch 1 and in the batched decoder, and every output is still the target's."""
    t, ds = toks
    tgt = tiny_model(3, cfg(len(t)))
    echo = Echo(tgt, Vocabs(t, ds[400]))
    own = OwnVocabDrafter(echo, ds[400], t, method="slem", ngram=True)
    shared = OwnVocabDrafter(echo, ds[400], t, method="slem", ngram=True, shared_ngram=True)
    assert own.shared is None and shared.shared is not None
    p = prompts[0]
    ref = autoregressive_generate(tgt, p, 80)
    fresh = hetero_generate(tgt, own, p, 80, draft_len=3)
    for q in (p, *prompts[1:3]):  # earlier traffic, this prompt included
        assert hetero_generate(tgt, shared, q, 80, draft_len=3)[0] == autoregressive_generate(tgt, q, 80)
    learned = hetero_generate(tgt, shared, p, 80, draft_len=3)
    assert fresh[0] == learned[0] == ref
    assert learned[1].ngram_candidates > fresh[1].ngram_candidates and len(shared.shared.table) > 0
    outs, _ = speculative_generate_batch(tgt, shared, prompts[:3], 80, draft_len=3)
    assert outs == [autoregressive_generate(tgt, q, 80) for q in prompts[:3]]


def test_a_shared_ngram_table_stays_bounded(toks, prompts):
    """A table shared by a long-running server keeps at most max_entries n-grams (the oldest go first), and
    decoding with a full table stays lossless."""
    t, ds = toks
    tgt = tiny_model(3, cfg(len(t)))
    d = OwnVocabDrafter(Echo(tgt, Vocabs(t, ds[400])), ds[400], t, method="slem", ngram=True, shared_ngram=True)
    d.shared.max_entries = 4
    seen = []
    for p in prompts[:3]:
        assert hetero_generate(tgt, d, p, 80, draft_len=3)[0] == autoregressive_generate(tgt, p, 80)
        seen.append(list(d.shared.table))
    assert 0 < len(d.shared.table) <= 4 and seen[0] != seen[-1]  # it kept learning: old n-grams made room
