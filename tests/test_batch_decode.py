"""Batched speculative decoding (eval/batch_decoder.py): every row of a batch decodes exactly as its prompt would alone.
Greedy rows equal ``autoregressive_generate`` and ``speculative_generate`` token for token, with the same accept
count at every step, for every proposer kind and plain decoding, at B in {1, 2, 5, 8} with ragged prompts, under
a cache so tight that ragged accepts must be compacted many times; the caches' valid slots always equal each row's
committed length; EOS inside an accepted block ends only its row; rows join and leave mid-run; a row does not
depend on its neighbours; sampled rows follow the target's distribution."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from conftest import (
    PROPOSER_KINDS,
    TINY_CFG,
    TINY_CFG8,
    exact_joint,
    is_heads,
    noisy_copy,
    tiny_drafter,
    tiny_eagle,
    tiny_heads,
    tiny_model,
    tv,
)

from draftsmith.errors import DraftsmithError
from draftsmith.eval.batch_decoder import BatchDecoder, speculative_generate_batch
from draftsmith.eval.decoder import autoregressive_generate, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")

# A 16-token target whose greedy outputs do not collapse into one repeated token, so random heads and EAGLE
# drafters accept different amounts on different prompts (the rows' accepts are ragged).
CFG16 = replace(TINY_CFG, vocab_size=16)
LENS = [1, 5, 30, 7, 12, 3, 19, 2]  # ragged prompt lengths; B rows take the first B
NEW, GAMMA = 40, 3
KINDS = ("plain", *PROPOSER_KINDS)


@pytest.fixture(scope="module")
def tgt():
    return tiny_model(1, CFG16)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CFG16.vocab_size, (n,), generator=g) for n in LENS]


@pytest.fixture(scope="module")
def ar(tgt, prompts):
    return [autoregressive_generate(tgt, p, NEW) for p in prompts]


def make_drafter(kind: str, t):
    """A drafter of ``kind`` for the 16-token target (None: plain decoding)."""
    torch.manual_seed(3)
    if kind == "plain":
        return None
    if kind == "draft_lm":
        return noisy_copy(t, 0.5)
    if kind == "draft_lm-vocab":
        from draftsmith.models.registry import build_drafter

        counts = torch.arange(t.cfg.vocab_size, dtype=torch.float)
        d = build_drafter("draft_lm", {"n_layers": t.cfg.n_layers, "draft_vocab": 10}, t, counts=counts, eos_ids={2})
        d.layers.load_state_dict(noisy_copy(t, 0.5).layers.state_dict())
        return d.double().eval()
    if kind.startswith("eagle"):
        return tiny_eagle(int(kind[5]), t, 0.05, **({"draft_vocab": 10} if kind.endswith("vocab") else {}))
    if is_heads(kind):
        return tiny_heads(kind, t, 4, 0.05)
    return tiny_drafter(kind, t)


def check_caches(dec: BatchDecoder) -> None:
    """Every cache holds exactly each row's committed positions: the target's all but the current token, the
    drafter's its own committed count (``dpos``); and a cache attends unmasked only while it has no hole."""
    caches = [(dec.rc, [r.pos for r in dec.rows])]
    caches += [(c, [r.dpos for r in dec.rows]) for c in ([] if dec.prop is None else dec.prop.caches)]
    for c, want in caches:
        assert c.counts().tolist() == want
        assert c.view.padded or min(want) == c.length  # unmasked attention only while no row has a hole


def run(dec: BatchDecoder, ids: list[int], check: bool = True) -> dict[int, list[int]]:
    outs = {i: [] for i in ids}
    while dec.active():
        for i, toks in dec.step().items():
            outs.setdefault(i, []).extend(toks)
        if check and dec.rows:
            check_caches(dec)
    return outs


@pytest.fixture(scope="module")
def singles(tgt, prompts):
    """Per kind: the drafter and each prompt's own speculative decode (tokens, stats)."""
    cache = {}

    def get(kind):
        if kind not in cache:
            d = make_drafter(kind, tgt)
            ref = [speculative_generate(tgt, d, p, NEW, draft_len=GAMMA) for p in prompts] if d is not None else None
            cache[kind] = d, ref
        return cache[kind]

    return get


@pytest.mark.parametrize("B", [1, 2, 5, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_rows_equal_their_own_decode(tgt, prompts, ar, singles, kind, B):
    drafter, ref = singles(kind)
    # max_len: the longest row's own need, so holes from ragged accepts force compaction again and again
    max_len = max(LENS[:B]) + NEW + 2 * GAMMA + 4
    dec = BatchDecoder(tgt, drafter, draft_len=GAMMA, max_len=max_len)
    ids = [dec.add(p, NEW) for p in prompts[:B]]
    outs = run(dec, ids)
    for b, i in enumerate(ids):
        assert outs[i] == ar[b], (kind, B, b)
        assert dec.stats[i].new_tokens == NEW
        if ref is not None:
            assert dec.stats[i].accepted_per_step == ref[b][1].accepted_per_step, (kind, B, b)
    if B == 8 and drafter is not None:
        assert len({dec.stats[i].accepted for i in ids}) > 1  # the rows' accepts really were ragged
    if B == 8 and kind not in ("plain", "hydra++"):  # plain rows make no holes, these Hydra++ rows too few
        assert dec.rc.compactions > 0  # (the prompts, prefilled in one wave, need none)


@pytest.mark.parametrize("quality", ["bad", "oracle", "anti"])
def test_draft_lms_of_every_quality(tgt, prompts, ar, quality):
    """A random draft LM, the target drafting for itself (every draft accepted: the drafter's unread last draft
    every step) and one that is always wrong (every draft rejected: holes everywhere), at B = 8, tight cache."""
    from conftest import AntiDrafter

    drafter = {"bad": tiny_model(7, CFG16), "oracle": tgt, "anti": AntiDrafter(tgt)}[quality]
    dec = BatchDecoder(tgt, drafter, draft_len=GAMMA, max_len=max(LENS) + NEW + 2 * GAMMA + 4)
    ids = [dec.add(p, NEW) for p in prompts]
    outs = run(dec, ids)
    assert [outs[i] for i in ids] == ar
    accepted = [dec.stats[i].accepted for i in ids]
    if quality == "oracle":
        assert all(a == dec.stats[i].drafted for a, i in zip(accepted, ids))
    if quality == "anti":
        assert not any(accepted)


def test_plain_batch_builds_on_one_forward_per_step(tgt, prompts, ar):
    outs, stats = speculative_generate_batch(tgt, None, prompts, NEW)
    assert outs == ar
    assert all(s.target_forwards == NEW - 1 and s.drafted == 0 for s in stats)


@pytest.mark.parametrize("kind", KINDS)
def test_eos_inside_an_accepted_block_ends_only_its_row(tgt, prompts, ar, kind):
    """EOS ids the target does emit: one row hits one mid-block (the target drafting for itself accepts whole
    blocks), the others go on to their budget or their own EOS."""
    drafter = tgt if kind == "draft_lm" else make_drafter(kind, tgt)
    first = {}
    for k, t in enumerate(ar[2]):
        first.setdefault(t, k)
    # a token row 2 first emits inside a block (blocks: the prefill's token, then 4 per step: ends at 4, 8, ...)
    k = min(k for k in first.values() if k >= 5 and k % 4)
    eos = {ar[2][k]}
    want = []
    for a in ar:
        cut = next((j + 1 for j, t in enumerate(a) if t in eos), len(a))
        want.append(a[:cut])
    assert len(want[2]) == k + 1 and len({len(w) for w in want}) > 1
    outs, stats = speculative_generate_batch(tgt, drafter, prompts, NEW, draft_len=GAMMA, eos_ids=eos)
    assert outs == want
    assert [s.new_tokens for s in stats] == [len(w) for w in want]


@pytest.mark.parametrize("kind", KINDS)
def test_rows_join_and_leave_mid_run(tgt, prompts, ar, kind):
    drafter = make_drafter(kind, tgt)
    dec = BatchDecoder(tgt, drafter, draft_len=GAMMA, max_len=100)
    outs: dict[int, list[int]] = {}

    def step(n=1):
        for _ in range(n):
            for i, toks in dec.step().items():
                outs.setdefault(i, []).extend(toks)
            if dec.rows:
                check_caches(dec)

    a, b, c = dec.add(prompts[1], NEW), dec.add(prompts[5], NEW), dec.add(prompts[7], 2)  # c: a 2-token budget
    step(3)
    assert c not in dec.active() and outs[c] == ar[7][:2]
    d = dec.add(prompts[2], NEW)  # 30 tokens: longer than anything in the cache, which must make room on the left
    e = dec.add(prompts[0], 5)
    step(2)
    dec.remove(b)  # client gone mid-run
    assert b not in dec.active()
    f = dec.add(prompts[6], 1)  # done at its prefill
    step()
    assert outs[f] == ar[6][:1] and f not in dec.active()
    dec.remove(dec.add(prompts[3], NEW))  # removed before its prefill
    step(200)
    assert not dec.active()
    assert outs[a] == ar[1] and outs[d] == ar[2] and outs[e] == ar[0][:5]
    assert outs[b] == ar[5][: len(outs[b])] and 0 < len(outs[b]) < NEW
    g = dec.add(prompts[4], NEW)  # a fresh row after the batch emptied
    step(200)
    assert outs[g] == ar[4]
    with pytest.raises(KeyError):
        dec.remove(a)


@pytest.mark.parametrize("kind", ["plain", "draft_lm", "hydra++", "eagle3"])
def test_rows_in_lockstep_until_their_accepts_differ(tgt, singles, kind):
    """Prompts of one length start with no padding (attention unmasked for a lone token); the first ragged accept
    makes holes, and from then on every cache must mask them."""
    drafter, _ = singles(kind)
    g = torch.Generator().manual_seed(1)
    same = [torch.randint(0, CFG16.vocab_size, (9,), generator=g) for _ in range(4)]
    dec = BatchDecoder(tgt, drafter, draft_len=GAMMA, max_len=9 + NEW + 2 * GAMMA + 4)
    ids = [dec.add(p, NEW) for p in same]
    first = dec.step()
    assert not dec.rc.view.padded or drafter is not None
    outs = run(dec, ids)
    assert all(first[i] + outs[i] == autoregressive_generate(tgt, p, NEW) for i, p in zip(ids, same))
    if drafter is not None:
        assert len({dec.stats[i].accepted for i in ids}) > 1


@pytest.mark.parametrize("kind", ["draft_lm", "hydra++", "eagle3"])
def test_a_row_does_not_depend_on_its_neighbours(tgt, prompts, singles, kind):
    drafter, _ = singles(kind)
    x = prompts[3]
    runs = [[x], [prompts[2], x, prompts[0]], [x, *prompts[4:8]], [prompts[1]] * 3 + [x]]
    results = []
    for batch in runs:
        dec = BatchDecoder(tgt, drafter, draft_len=GAMMA, max_len=120)
        ids = [dec.add(p, NEW) for p in batch]
        outs = run(dec, ids, check=False)
        i = ids[[k for k, p in enumerate(batch) if p is x][0]]
        results.append((outs[i], dec.stats[i].accepted_per_step))
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_rows_follow_the_target_distribution(kind):
    """4,000 rows of one prompt in one batch, temperature 1: the joint of their first three tokens (the 2nd and
    3rd from a verify that accepted or rejected a draft) matches the target's exact joint; greedy rows in the same
    batch stay exact."""
    t = tiny_model(0, TINY_CFG8, logit_scale=3.0)
    torch.manual_seed(5)
    drafter = None if kind == "plain" else tiny_drafter(kind, t, heads=2, noise=0.3, lm_noise=0.5)
    prompt, N = [1, 2, 3, 4], 4000
    gen = torch.Generator().manual_seed(0)
    dec = BatchDecoder(t, drafter, draft_len=2, max_len=16)
    ids = [dec.add(torch.tensor(prompt), 3, temperature=1.0, generator=gen) for _ in range(N)]
    greedy = [dec.add(torch.tensor(prompt), 3) for _ in range(3)]
    outs = run(dec, ids + greedy, check=False)
    want = autoregressive_generate(t, torch.tensor(prompt), 3)
    assert all(outs[i] == want for i in greedy)
    counts = torch.zeros(*[t.cfg.vocab_size] * 3)
    for i in ids:
        counts[tuple(outs[i])] += 1
    emp, joint = counts / N, exact_joint(t, prompt, 3)
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert tv(emp.sum(dims), joint.sum(dims)) < 0.03, dims
    assert tv(emp.sum(2), joint.sum(2)) < 0.06
    if drafter is not None:
        acc = sum(dec.stats[i].accepted for i in ids)
        assert 0.05 * N < acc < 0.95 * dec.stats[ids[0]].drafted * N  # drafts both accepted and rejected


def test_bad_arguments(tgt, prompts):
    with pytest.raises(DraftsmithError, match="max_len"):
        BatchDecoder(tgt, None, max_len=20).add(prompts[2], NEW)
    with pytest.raises(ValueError, match="stop_drafting"):
        BatchDecoder(tgt, None, stop_drafting=lambda *a: True)
    with pytest.raises(ValueError, match="prompt"):
        BatchDecoder(tgt, None).add(torch.zeros(2, 3, dtype=torch.long), 4)
    dec = BatchDecoder(tgt, None)
    i = dec.add(prompts[0], 0)
    assert dec.step() == {i: []} and not dec.active()

    class NotSlotCached(torch.nn.Module):  # e.g. a transformers-fallback target
        def new_cache(self, batch, max_len):
            return object()

    with pytest.raises(DraftsmithError, match="batch 1"):
        BatchDecoder(NotSlotCached(), None)


def test_cuda_graph_wrappers_are_decoded_through_their_models(tgt, prompts, ar):
    """eval's fast path wraps models for batch-1 CUDA graphs around one static cache (uncaptured on CPU): the batch
    decoder uses the models inside, whose caches rows do not share."""
    from draftsmith.eval.graphs import GraphedLlama

    d = GraphedLlama(noisy_copy(tgt, 0.5), 200, graphs=False)
    outs, _ = speculative_generate_batch(GraphedLlama(tgt, 200, graphs=False), d, prompts[:3], NEW, draft_len=GAMMA)
    assert outs == ar[:3]


def _filtered_joint(model, prompt: list[int], depth: int, **sampling) -> torch.Tensor:
    """P(t1..t_depth | prompt) under ``process_logits(**sampling)`` at every step, by enumeration."""
    from draftsmith.models.sampling import process_logits

    V = model.cfg.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(V)] * depth).view(-1, depth)
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs[:, :-1]], dim=1)
    with torch.no_grad():
        probs = process_logits(model(ids)[:, len(prompt) - 1 :], **sampling)
    return probs.gather(-1, seqs[..., None]).squeeze(-1).prod(-1).view(*[V] * depth)


def test_rows_keep_their_own_sampling_settings():
    """Rows with different temperature / top-k / top-p in one batch: each group's first three tokens follow the
    target under its own settings."""
    t = tiny_model(0, TINY_CFG8, logit_scale=3.0)
    torch.manual_seed(5)
    drafter, prompt, N = noisy_copy(t, 0.5), [1, 2, 3, 4], 3000
    settings = [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 3}, {"temperature": 1.3, "top_p": 0.8}]
    dec = BatchDecoder(t, drafter, draft_len=2, max_len=16)
    gen = torch.Generator().manual_seed(0)
    ids = {
        k: [dec.add(torch.tensor(prompt), 3, generator=gen, **kw) for _ in range(N)] for k, kw in enumerate(settings)
    }
    outs = run(dec, [i for v in ids.values() for i in v], check=False)
    for k, kw in enumerate(settings):
        counts = torch.zeros(*[t.cfg.vocab_size] * 3)
        for i in ids[k]:
            counts[tuple(outs[i])] += 1
        emp, joint = counts / N, _filtered_joint(t, prompt, 3, **{"top_k": 0, "top_p": 1.0, **kw})
        for dims in [(1, 2), (0, 2), (0, 1)]:
            assert tv(emp.sum(dims), joint.sum(dims)) < 0.035, (kw, dims)


class _SumStop:
    """A rule whose decision depends on its block's history: stop once the argmaxes seen in this block add up to
    more than ``limit`` (rows sharing one hook's state would decide differently)."""

    def __init__(self, limit: int):
        self.limit, self.total = limit, 0

    def __call__(self, n, logits, hidden, token=None) -> bool:
        self.total = (0 if n == 1 else self.total) + int(logits.argmax())
        return self.total > self.limit


def _stop_rules():
    from draftsmith.models.acceptance import ConfidenceStop, EntropyStop

    rules = [EntropyStop(threshold=2.0), ConfidenceStop(0.5, min_len=0), ConfidenceStop(0.4, before_feed=True)]
    return [*rules, _SumStop(12)]


@pytest.mark.parametrize("kind", PROPOSER_KINDS)
def test_stop_rules_end_each_rows_block_as_alone(tgt, prompts, ar, singles, kind):
    """Adaptive draft length per row: every row drafts, and is verified, exactly as its own decode with the same
    rule (after-feed, min_len 0 skipping, before-feed with per-block state); the output stays the target's."""
    drafter, ref = singles(kind)
    for rule in _stop_rules():
        dec = BatchDecoder(tgt, drafter, draft_len=GAMMA, max_len=100, stop_drafting=rule)
        ids = [dec.add(p, NEW) for p in prompts[:5]]
        outs = run(dec, ids)
        assert sum(dec.stats[i].drafted for i in ids) < sum(r[1].drafted for r in ref[:5])  # the rule did stop
        for b, i in enumerate(ids):
            alone = speculative_generate(tgt, drafter, prompts[b], NEW, draft_len=GAMMA, stop_drafting=copy.copy(rule))
            assert outs[i] == ar[b]
            st = dec.stats[i]
            assert (st.accepted_per_step, st.drafted) == (alone[1].accepted_per_step, alone[1].drafted), (rule, b)


@pytest.mark.parametrize("kind", ["plain", "draft_lm", "eagle3", "hydra++"])
def test_a_seeded_sampled_row_is_the_same_alone_and_in_any_batch(tgt, prompts, kind):
    """A sampled row with its own generator draws only from it, and only what it would draw alone (a row past its
    own draft budget draws nothing while its neighbours draft on): the same tokens alone and among rows with
    other budgets, prompts and settings (a server's `seed`)."""
    drafter = make_drafter(kind, tgt)

    def decode(neighbours: int) -> list[int]:
        dec = BatchDecoder(tgt, drafter, draft_len=3, max_len=200)
        for j in range(neighbours):
            g = torch.Generator().manual_seed(100 + j)
            dec.add(prompts[j + 1], 40 + 7 * j, temperature=0.9, top_k=5 * j, generator=g)
        rid = dec.add(prompts[0], 13, temperature=1.0, generator=torch.Generator().manual_seed(7))
        return run(dec, dec.active(), check=False)[rid]

    alone = decode(0)
    assert len(alone) == 13 and decode(3) == alone and decode(5) == alone
