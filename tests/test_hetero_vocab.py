"""Drafts with their own tokenizer (eval/hetero.py): two different tiny byte-level BPEs on the same text, a float64
target on one and a draft LM on the other. Greedy output equals the target's own greedy output (string-level
exact match, token-level intersection, with and without the n-gram cache); sampling follows the target's
distribution over the first two tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import CORPUS, tiny_model, tv

from draftsmith.eval.decoder import DecodeStats, autoregressive_generate, speculative_generate
from draftsmith.eval.hetero import NgramCache, OwnVocabDrafter, Vocabs, hetero_generate
from draftsmith.models.llama import LlamaConfig
from draftsmith.models.tiny import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = " ".join(s.strip() for s in dict.fromkeys(CORPUS)) + " The quick brown fox jumps over the lazy dog again."
NEW = 40


def cfg(vocab: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=512)


@pytest.fixture(scope="module")
def toks():
    """The target's 300-token BPE and two draft BPEs whose token boundaries differ from it (260 and 400 tokens,
    the second trained on lower-cased text)."""
    t = tiny_tokenizer(CORPUS)
    return t, {260: tiny_tokenizer(CORPUS, 260), 400: tiny_tokenizer([s.lower() for s in CORPUS] + [TEXT], 400)}


class TextOracle(torch.nn.Module):
    """A random Llama whose argmax continues ``text`` at the string level: while the decoded context is a prefix
    of the text, the first token of the rest's encoding gets +50 (also under a KV cache: it records the ids at
    every slot, so rollbacks are seen)."""

    def __init__(self, model, tok, text: str):
        super().__init__()
        self.m, self.tok, self.text, self.cfg = model, tok, text, model.cfg
        self.slots: list[int] = []

    def new_cache(self, batch: int, max_len: int):
        return self.m.new_cache(batch, max_len)

    def forward(self, ids, cache=None, logits_at=None, **kw):
        s0 = 0 if cache is None else cache.length
        self.slots = self.slots[:s0] + ids[0].tolist()
        logits = self.m(ids, cache=cache, logits_at=logits_at, **kw)
        rows = range(ids.shape[1]) if logits_at is None else logits_at[0].nonzero()[:, 0].tolist()
        for r, j in enumerate(rows):
            ctx = Vocabs.text(self.tok, self.slots[: s0 + j + 1])
            if self.text.startswith(ctx) and len(ctx) < len(self.text):
                nxt = Vocabs.ids(self.tok, self.text[len(ctx) :])[0]
                if logits_at is None:
                    logits[0, j, nxt] += 50
                else:
                    logits[r, nxt] += 50
        return logits


class Const(torch.nn.Module):
    """A draft that always proposes one token (here <pad>, which the target never writes): every draft rejected."""

    def __init__(self, vocab: int, tok: int):
        super().__init__()
        self.w, self.tok, self.cfg = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64)), tok, cfg(vocab)

    def new_cache(self, batch: int, max_len: int):
        return type("Cache", (), {"length": 0})()

    def forward(self, ids, cache=None, **kw):
        cache.length += ids.shape[1]
        out = torch.zeros(1, ids.shape[1], self.cfg.vocab_size, dtype=torch.float64)
        out[..., self.tok] = 1.0
        return out


def prompts(tok) -> list[list[int]]:
    texts = ["The quick brown", "Speculative decoding lets a", "def add(a, b):\n   "]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Write a poem"}], add_generation_prompt=True, tokenize=False
    )
    return [Vocabs.ids(tok, s) for s in [*texts, chat]]


def text_prompts(tok) -> list[list[int]]:
    """Prefixes of TEXT, cut before a space (so their tokens start TEXT's tokenization)."""
    cuts = [i for i, c in enumerate(TEXT) if c == " "]
    return [Vocabs.ids(tok, TEXT[:i]) for i in (cuts[2], cuts[12], cuts[30])]


def check(target, drafter, draft_len: int, oracle: bool = False) -> DecodeStats:
    total = DecodeStats(accept_counts=[0] * (2 * draft_len + 1))
    for p in (text_prompts if oracle else prompts)(drafter.target_tokenizer):
        ref = autoregressive_generate(target, torch.tensor(p), NEW)
        out, st = speculative_generate(target, drafter, torch.tensor(p), NEW, draft_len=draft_len)
        assert out == ref, (p, draft_len)
        assert st.new_tokens == NEW and sum(st.accept_counts) == st.target_forwards
        total.merge(st)
    return total


@pytest.mark.parametrize("draft_len", [1, 3, 5])
@pytest.mark.parametrize("method", ["slem", "tli"])
@pytest.mark.parametrize("vocab", [260, 400])
def test_greedy_equals_target_random_draft(toks, vocab, method, draft_len):
    t, ds = toks
    target = tiny_model(0, cfg(len(t)))
    drafter = OwnVocabDrafter(tiny_model(1, cfg(len(ds[vocab]))), ds[vocab], t, method=method)
    check(target, drafter, draft_len)


@pytest.mark.parametrize("ngram", [False, True])
@pytest.mark.parametrize("draft_len", [2, 4, 6])
@pytest.mark.parametrize("vocab", [260, 400])
def test_greedy_string_perfect_draft_accepts_most(toks, vocab, draft_len, ngram):
    """Target and draft both continue TEXT, each in its own tokenization: the drafts are right at the string level,
    so slem accepts most of them (all but where the re-tokenization cuts a word differently)."""
    t, ds = toks
    target = TextOracle(tiny_model(0, cfg(len(t))), t, TEXT)
    lm = TextOracle(tiny_model(1, cfg(len(ds[vocab]))), ds[vocab], TEXT)
    drafter = OwnVocabDrafter(lm, ds[vocab], t, method="slem", ngram=ngram)
    st = check(target, drafter, draft_len, oracle=True)
    assert st.acceptance_rate > 0.6 and st.tau > 1 + 0.5 * draft_len * 0.6, (st.acceptance_rate, st.tau)


def test_ngram_cache_learns_and_translates(toks):
    t, ds = toks
    target = TextOracle(tiny_model(0, cfg(len(t))), t, TEXT)
    lm = TextOracle(tiny_model(1, cfg(len(ds[260]))), ds[260], TEXT)
    drafter = OwnVocabDrafter(lm, ds[260], t, method="slem", ngram=True, shared_ngram=True)
    cache = drafter.shared  # one table for both decodes
    assert isinstance(cache, NgramCache)
    p = Vocabs.ids(t, "The quick brown")
    ref = autoregressive_generate(target, torch.tensor(p), NEW)
    runs = [hetero_generate(target, drafter, torch.tensor(p), NEW, draft_len=4) for _ in range(2)]
    assert [out for out, _ in runs] == [ref, ref]
    assert cache.table and cache.hits >= runs[1][1].target_forwards - 1  # the second decode: (nearly) every step
    assert runs[0][1].accept_counts == runs[1][1].accept_counts  # as the tokenizer would have
    for d, tt in cache.table.items():  # every entry writes the same text in both vocabularies
        assert Vocabs.text(ds[260], list(d)) == Vocabs.text(t, list(tt))


@pytest.mark.parametrize("method", ["slem", "tli"])
def test_greedy_always_wrong_draft(toks, method):
    t, ds = toks
    target = TextOracle(tiny_model(0, cfg(len(t))), t, TEXT)
    drafter = OwnVocabDrafter(Const(len(ds[400]), ds[400].pad_token_id), ds[400], t, method=method)
    st = check(target, drafter, 3, oracle=True)
    assert st.accepted == 0 and st.tau == 1.0 and st.target_forwards == 3 * (NEW - 1)


def test_vocab_intersection(toks):
    t, ds = toks
    v = Vocabs(t, ds[400])
    assert 256 + 3 <= int(v.shared.sum()) < len(ds[400])  # every byte and special token, not every merge
    for i in v.shared.nonzero()[:, 0].tolist():
        assert Vocabs.text(ds[400], [i]) == Vocabs.text(t, [int(v.d2t[i])])


class FromTarget(torch.nn.Module):
    """A draft LM over the draft vocabulary that reads like the target: shared tokens get the target's logits
    (through the id map, with noise), draft-only tokens a logit near the top (mass the intersection must drop)."""

    def __init__(self, target, vocabs: Vocabs, noise: float = 0.5):
        super().__init__()
        self.t, self.v, self.noise, self.cfg = target, vocabs, noise, cfg(len(vocabs.d2t))
        self.gen = torch.Generator().manual_seed(5)

    def new_cache(self, batch: int, max_len: int):
        return self.t.new_cache(batch, max_len)

    def forward(self, ids, cache=None, **kw):
        lt = self.t(self.v.d2t[ids].clamp_min(0), cache=cache)  # (1, T, V_target)
        out = lt.new_full((*lt.shape[:-1], len(self.v.d2t)), 0.0)
        out[..., self.v.shared] = lt[..., self.v.d2t[self.v.shared]]
        out[..., ~self.v.shared] = lt.max(-1, keepdim=True).values - 1.0
        return out + self.noise * torch.randn(out.shape, generator=self.gen, dtype=out.dtype)


def two_token_joint(target, prompt: list[int]) -> torch.Tensor:
    """P(t1, t2 | prompt) at temperature 1 (V × V), from one batched forward over every t1."""
    V = target.cfg.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt]))[0, -1].double(), -1)
        ids = torch.cat([torch.tensor(prompt).expand(V, -1), torch.arange(V)[:, None]], 1)
        p2 = torch.softmax(target(ids)[:, -1].double(), -1)
    return p1[:, None] * p2


@pytest.mark.parametrize("method", ["tli", "slem"])
def test_sampling_follows_target(toks, method):
    t, ds = toks
    target = tiny_model(0, cfg(len(t)), logit_scale=12.0)
    drafter = OwnVocabDrafter(FromTarget(target, Vocabs(t, ds[400])), ds[400], t, method=method)
    prompt = Vocabs.ids(t, "The quick brown")
    joint = two_token_joint(target, prompt)
    gen = torch.Generator().manual_seed(0)
    N, counts, st = 4000, torch.zeros_like(joint), DecodeStats(accept_counts=[0] * 5)
    for _ in range(N):
        out, s = speculative_generate(target, drafter, torch.tensor(prompt), 3, draft_len=2, temperature=1.0,
                                      generator=gen)  # fmt: skip
        counts[out[0], out[1]] += 1
        st.merge(s)
    emp = counts / N
    assert 0.05 < st.acceptance_rate < 0.95, st.acceptance_rate  # both the accept and the reject path ran
    assert tv(emp.sum(1), joint.sum(1)) < 0.04
    assert tv(emp, joint) < 0.07


def test_refuses_trees_and_hooks(toks):
    from draftsmith.eval.tree import TreeSpec

    t, ds = toks
    target = tiny_model(0, cfg(len(t)))
    drafter = OwnVocabDrafter(tiny_model(1, cfg(len(ds[260]))), ds[260], t)
    with pytest.raises(ValueError, match="chains only"):
        speculative_generate(target, drafter, torch.tensor([5, 6]), 4, tree=TreeSpec(parents=(-1, 0), ranks=(0, 0)))


# ---- the offline setting: a BPE learned on the run's records, a draft LM trained on the re-tokenized answers -------


def test_retokenize_keeps_the_answer_mask(toks):
    from draftsmith.data.records import Record
    from draftsmith.train.own_vocab import retokenize

    t, ds = toks
    prompt, answer = Vocabs.ids(t, "What is the capital of France?"), Vocabs.ids(t, " Paris is the capital.")
    r = Record(torch.tensor(prompt + answer), torch.tensor([0] * len(prompt) + [1] * len(answer)), 0)
    out = retokenize(r, t, ds[400], 512)
    ids, mask = out.input_ids.tolist(), out.loss_mask.tolist()
    assert Vocabs.text(ds[400], [i for i, m in zip(ids, mask) if m]) == " Paris is the capital."
    assert Vocabs.text(ds[400], ids) == Vocabs.text(t, prompt + answer) and not out.signals


def test_own_vocab_needs_ce_and_no_target_embeddings(train_run, capsys):
    own = ("drafter.tokenizer=train", "drafter.vocab_size=280")
    train_run("kl", *own, "drafter.init_from_target=false", "train.loss.kind=fkl", expect=2)
    assert "train.loss.kind=ce" in capsys.readouterr().err
    train_run("emb", *own, "train.loss.kind=ce", expect=2)
    assert "set drafter.init_from_target to false" in capsys.readouterr().err


def test_own_vocab_trains_evals_losslessly_and_export_refuses(train_run, tiny_model_dir, prompts_file, capsys):
    import json

    from draftsmith.cli import main

    own = ("drafter.tokenizer=train", "drafter.vocab_size=280", "drafter.init_from_target=false")
    run = train_run("own", *own, "train.loss.kind=ce", "train.eval_every=5")  # the in-training decode too
    ckpt = run / "checkpoints" / "final"
    info = json.loads((ckpt / "drafter.json").read_text())
    assert info["draft_tokenizer"] == "tokenizer" and info["config"]["vocab_size"] == 280
    assert (run / "draft_tokenizer" / "tokenizer.json").is_file() and (ckpt / "tokenizer" / "tokenizer.json").is_file()
    common = [f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}", f"out_dir={run}", "-q"]
    assert main(["eval", "tiny", *common]) == 0
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0 and report["drafter"]["tokenizer"] == {"vocab_size": 280, "method": "slem"}
    assert report["tau"] >= 1.0 and "vs_ar" in report["speedup"]
    assert main(["export", str(ckpt), "--out", str(run / "exported"), "-q"]) == 2
    assert "export takes drafters in the target's vocabulary only" in capsys.readouterr().err


@pytest.mark.parametrize("vocab", [260, 400])
def test_draft_context_retokenizes_a_tail_like_the_whole_text(toks, vocab):
    """The draft's context grows by a few target tokens per step; re-tokenizing a window gives what re-tokenizing
    the whole text gives, while its anchor moves on."""
    from draftsmith.eval.hetero import DraftContext

    t, ds = toks
    v = Vocabs(t, ds[vocab])
    seq, ctx, g = Vocabs.ids(t, (TEXT + " ") * 3), DraftContext(v, window=8), torch.Generator().manual_seed(0)
    n = 3
    while n < len(seq):
        assert ctx(seq[:n]) == v.draft_context(seq[:n]), n
        n += int(torch.randint(1, 6, (1,), generator=g))
    assert ctx.n > len(seq) - 40  # only a window is re-tokenized


@pytest.mark.slow
def test_smollm2_with_a_learned_8k_bpe_draft():
    """The real setting (DRAFTSMITH_SLOW=1): SmolLM2-135M-Instruct and an 8,192-token BPE learned on ShareGPT. A
    random draft decodes losslessly by slem and tli; a draft that writes the target's own greedy text in its own
    tokens (the ceiling of string-level matching) keeps nearly every candidate."""
    from draftsmith.eval.prompts import prompts_from
    from draftsmith.models.llama import Llama
    from draftsmith.models.loading import encode_chat, load_model
    from draftsmith.recipes.schema import PromptsConfig
    from draftsmith.train.own_vocab import train_bpe

    tgt = load_model("smollm2-135m-instruct")
    t, model = tgt.tokenizer, tgt.model.eval()
    convs = prompts_from(PromptsConfig(source="sharegpt", n=3000), 3000)
    d = train_bpe([m["content"] for p in convs for m in p.messages], 8192, t)
    assert int(Vocabs(t, d).shared.sum()) > 7000
    small = LlamaConfig(vocab_size=len(d), dim=32, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=64, max_seq_len=4096)
    torch.manual_seed(1)
    rnd = Llama(small).eval()
    total = DecodeStats(accept_counts=[0] * 9)
    for p in prompts_from(PromptsConfig(source="mt_bench", n=4, shuffle=True, seed=0, max_turns=1), 4):
        ids = encode_chat(t, p.messages[:1])
        ar = autoregressive_generate(model, torch.tensor(ids), 48)
        for m in ("slem", "tli"):
            out, _ = speculative_generate(model, OwnVocabDrafter(rnd, d, t, method=m), torch.tensor(ids), 48)
            assert out == ar, m
        oracle = OwnVocabDrafter(TextOracle(rnd, d, Vocabs.text(t, ids + ar)), d, t)
        out, st = speculative_generate(model, oracle, torch.tensor(ids), 48, draft_len=4)
        assert out == ar
        total.merge(st)
    assert total.acceptance_rate > 0.9 and total.tau > 4.0, (total.acceptance_rate, total.tau)
