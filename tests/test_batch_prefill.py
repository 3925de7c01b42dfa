"""One-forward ragged prefill (eval/batch_decoder.py ``BatchDecoder._prefill``): rows of different prompt lengths added
in one wave are prefilled together, right-aligned with left padding that no cache ever attends. Every row still
decodes exactly as its prompt alone (greedy tokens and accept counts), for every proposer kind; the wave costs one
target forward (and one drafter call), or a few when ``max_prefill_tokens`` or ``max_prefill_pad`` split it
longest-first."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import PROPOSER_KINDS, TINY_CFG, tiny_model
from test_batch_decode import check_caches, make_drafter, run

from draftsmith.eval.batch_decoder import BatchDecoder, RowCache
from draftsmith.eval.decoder import autoregressive_generate, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")

CFG16 = replace(TINY_CFG, vocab_size=16)
LENS = [1, 3, 7, 12, 2, 9, 5, 4]  # one ragged wave; B rows take the first B (all lengths distinct)
NEW, GAMMA = 24, 3
KINDS = ("plain", *PROPOSER_KINDS)


@pytest.fixture(scope="module")
def tgt():
    return tiny_model(1, CFG16)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, CFG16.vocab_size, (n,), generator=g) for n in LENS]


@pytest.fixture(scope="module")
def ar(tgt, prompts):
    return [autoregressive_generate(tgt, p, NEW) for p in prompts]


@pytest.fixture(scope="module")
def singles(tgt, prompts):
    cache = {}

    def get(kind):
        if kind not in cache:
            d = make_drafter(kind, tgt)
            ref = [speculative_generate(tgt, d, p, NEW, draft_len=GAMMA) for p in prompts] if d is not None else None
            cache[kind] = d, ref
        return cache[kind]

    return get


class Count:
    """Counts calls of ``obj.name`` (an instance attribute shadows the method)."""

    def __init__(self, obj, name: str):
        self.n, fn = 0, getattr(obj, name)

        def counted(*a, **kw):
            self.n += 1
            return fn(*a, **kw)

        self.obj, self.name = obj, name
        setattr(obj, name, counted)

    def close(self):
        delattr(self.obj, self.name)


@pytest.mark.parametrize("B", [2, 5, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_a_ragged_wave_decodes_every_row_as_alone(tgt, prompts, ar, singles, kind, B):
    drafter, ref = singles(kind)
    dec = BatchDecoder(tgt, drafter, draft_len=GAMMA, max_len=max(LENS[:B]) + NEW + 2 * GAMMA + 4)
    ids = [dec.add(p, NEW) for p in prompts[:B]]
    fwd = Count(tgt, "forward")
    try:
        dec._prefill()
    finally:
        fwd.close()
    assert fwd.n == 1 and len(dec.rows) == B
    check_caches(dec)
    assert dec.rc.view.padded  # the shorter rows' padding is holes
    first = {r.id: list(r.out) for r in dec.rows}  # the prefill's tokens
    outs = run(dec, ids)
    for b, i in enumerate(ids):
        assert first[i] + outs[i] == ar[b], (kind, B, b)
        if ref is not None:
            assert dec.stats[i].accepted_per_step == ref[b][1].accepted_per_step, (kind, B, b)


@pytest.mark.parametrize("kind", ["plain", "draft_lm", "eagle3", "hydra++"])
def test_one_target_forward_and_one_drafter_forward_per_wave(tgt, prompts, singles, kind):
    """The wave of 5 distinct lengths costs one target forward, and the draft LM / EAGLE / Hydra++ prefix layer
    read it in one call of their own."""
    drafter, _ = singles(kind)
    dec = BatchDecoder(tgt, drafter, draft_len=GAMMA, max_len=64)
    for p in prompts[:5]:
        dec.add(p, NEW)
    name = {"plain": None, "draft_lm": "forward", "eagle3": "step", "hydra++": "read_context"}[kind]
    counts = [Count(tgt, "forward")] + ([] if name is None else [Count(drafter, name)])
    try:
        dec._prefill()
    finally:
        for c in counts:
            c.close()
    assert [c.n for c in counts] == [1] * len(counts)
    check_caches(dec)


def test_max_prefill_tokens_splits_a_wave_longest_first(tgt, prompts, ar):
    """Padded tokens per forward are capped: lengths 12, 7 | 3, 2, 1 with a cap of 24; a prompt longer than the
    cap goes alone. Rows still decode as alone."""
    dec = BatchDecoder(tgt, None, max_len=64, max_prefill_tokens=24)
    ids = [dec.add(p, NEW) for p in prompts[:5]]
    fwd = Count(tgt, "forward")
    try:
        dec._prefill()
    finally:
        fwd.close()
    assert fwd.n == 2 and [r.prompt.numel() for r in dec.rows] == [12, 7, 3, 2, 1]
    first = {r.id: list(r.out) for r in dec.rows}
    outs = run(dec, ids)
    assert [first[i] + outs[i] for i in ids] == ar[:5]
    dec = BatchDecoder(tgt, None, max_len=64, max_prefill_tokens=4)
    ids = [dec.add(p, NEW) for p in prompts[:5]]
    outs = run(dec, ids)
    assert [outs[i] for i in ids] == ar[:5]
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        BatchDecoder(tgt, None, max_prefill_tokens=0)


@pytest.mark.parametrize("pad, forwards", [(4, [[12], [7, 3], [2, 1]]), (0, [[12], [7], [3], [2], [1]])])
def test_max_prefill_pad_keeps_short_prompts_out_of_long_forwards(tgt, prompts, ar, pad, forwards):
    """A prompt shares a longer one's forward only while it needs at most ``max_prefill_pad`` padding tokens (0:
    one forward per length); the default on CPU puts the test wave in one forward."""
    dec = BatchDecoder(tgt, None, max_len=64, max_prefill_pad=pad)
    ids = [dec.add(p, NEW) for p in prompts[:5]]
    widths, fwd = [], tgt.forward

    def spy(x, **kw):
        widths.append([int(v.sum()) for v in kw["valid"]] if kw["valid"] is not None else [x.shape[1]] * len(x))
        return fwd(x, **kw)

    tgt.forward = spy
    try:
        dec._prefill()
    finally:
        del tgt.forward
    assert widths == forwards and BatchDecoder(tgt, None).max_prefill_pad == 16
    first = {r.id: list(r.out) for r in dec.rows}
    outs = run(dec, ids)
    assert [first[i] + outs[i] for i in ids] == ar[:5]
    with pytest.raises(ValueError, match="max_prefill_pad"):
        BatchDecoder(tgt, None, max_prefill_pad=-1)


@pytest.mark.parametrize("kind", ["plain", "draft_lm", "hydra++", "eagle1"])
def test_a_ragged_wave_joins_a_running_batch(tgt, prompts, ar, singles, kind):
    """Rows already decoding (with holes of their own) take a second ragged wave whose longest prompt is longer
    than the batch's cache: the batch makes room, then every row goes on as alone."""
    drafter, ref = singles(kind)
    dec = BatchDecoder(tgt, drafter, draft_len=GAMMA, max_len=60)
    outs: dict[int, list[int]] = {}

    def step():
        for i, toks in dec.step().items():
            outs.setdefault(i, []).extend(toks)
        if dec.rows:
            check_caches(dec)

    first = [dec.add(prompts[b], NEW) for b in (0, 4)]  # lengths 1, 2
    step()
    step()
    second = [dec.add(prompts[b], NEW) for b in (3, 1, 6)]  # lengths 12, 3, 5
    while dec.active():
        step()
    assert dec.rc.compactions > 0  # the 12-token prompt made room on the left of the running rows
    for i, b in zip(first + second, (0, 4, 3, 1, 6)):
        assert outs[i] == ar[b], (kind, b)
        if ref is not None:
            assert dec.stats[i].accepted_per_step == ref[b][1].accepted_per_step, (kind, b)


def test_row_cache_join_takes_holes_from_the_temporary_cache(tgt):
    """RowCache.join copies each row's slots with their validity: left padding stays a hole."""
    tmp = tgt.new_cache(3, 4)
    tmp.kv.normal_()
    tmp.valid[:] = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    tmp.length = 4
    rc = RowCache(tgt.new_cache, 10)
    rc.join(tmp, [0, 2], 4)
    assert rc.counts().tolist() == [2, 1] and rc.length == 4 and rc.view.padded
    assert torch.equal(rc.view.kv[:, :, 1, :, :4], tmp.kv[:, :, 2])
    rc.join(tmp, [1], 4)
    assert rc.counts().tolist() == [2, 1, 4] and rc.view.valid[2, :4].all()


def _state(dec: BatchDecoder, b: int) -> list[torch.Tensor]:
    """Row b's valid K/V in every cache, in slot order, and its drafter state (Hydra++ context, EAGLE features)."""
    r, out = dec.rows[b], []
    for c in [dec.rc] + ([] if dec.prop is None else dec.prop.caches):
        idx = c.view.valid[b, : c.length].nonzero()[:, 0]
        out.append(c.view.kv[:, :, b].index_select(3, idx))
    return out + [x for x in (r.h, r.feats) if x is not None]


@pytest.mark.parametrize("kind", ["draft_lm", "hydra++", "eagle1", "eagle3"])
def test_a_ragged_wave_reads_only_each_rows_own_prompt(tgt, prompts, singles, kind):
    """Right after the wave's prefill every row's cached keys / values (target and drafter) and its drafter state
    equal those of its prompt prefilled alone: the left padding reached no cache and no state."""
    drafter, _ = singles(kind)
    dec = BatchDecoder(tgt, drafter, draft_len=GAMMA, max_len=64)
    for p in prompts[:5]:
        dec.add(p, NEW)
    dec._prefill()
    for b, r in enumerate(dec.rows):
        alone = BatchDecoder(tgt, drafter, draft_len=GAMMA, max_len=64)
        alone.add(r.prompt, NEW)
        alone._prefill()
        got, want = _state(dec, b), _state(alone, 0)
        assert len(got) == len(want) and all(torch.allclose(x, y, atol=1e-12) for x, y in zip(got, want)), (kind, b)
