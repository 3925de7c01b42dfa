"""The batched decoder's fused bookkeeping (eval/batch_decoder.py): row compaction of every cache in one operation, and
one rejection-sampling acceptance for every sampled row of a step.

- ``compact_rows`` (kernels/kv.py) equals the per-row loop it replaced, slot for slot, on random masks (rows with
  no valid slot, rows already right-aligned, moves in both directions overlapping their sources); the Triton kernel
  runs under the CPU interpreter (TRITON_INTERPRET=1, set in conftest).
- ``verify_sampling_rows`` (kernels/verify.py) gives every row exactly what ``rejection_accept`` gives it alone on
  the same generator state: the PyTorch rule draws the same numbers, the kernel takes one Philox seed per row.
- ``BatchDecoder`` routes through both; its sampled tokens equal the per-row loop's."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CFG8, noisy_copy, tiny_model

from draftsmith.eval.accept import rejection_accept
from draftsmith.kernels.kv import compact_rows, compact_rows_reference
from draftsmith.kernels.launch import HAS_TRITON
from draftsmith.kernels.verify import verify_sampling_rows

pytestmark = pytest.mark.usefixtures("one_thread")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = [
    "reference",
    "plane by plane",  # the reference with a temporary too small for two (K/V, layer) planes
    "planes in groups",  # ... or for a few of them
    "loop",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
]


def _compact(kv, valid, length, S, impl):
    if impl.startswith("plane"):
        return compact_rows_reference(kv, valid, length, S, chunk=1 if impl == "plane by plane" else 2000)
    return compact_rows(kv, valid, length, S, impl=impl)


def loop_compact(kv: torch.Tensor, valid: torch.Tensor, length: int, S: int) -> None:
    """The per-row loop RowCache.compact used before (kept verbatim as the reference)."""
    counts = valid[:, :length].sum(1).tolist()
    for b, c in enumerate(counts):
        idx = valid[b, :length].nonzero()[:, 0]
        if c and not (idx[0] == S - c and idx[-1] == S - 1):
            row = kv[:, :, b]
            row[:, :, :, S - c : S] = row.index_select(3, idx)
        valid[b] = False
        valid[b, S - c : S] = True


def _case(B, L, H, dtype, seed, max_len=24, cap=None):
    """A cache (2, L, cap, H, max_len, D) with B active rows of random validity up to ``length``: row 0 has no
    valid slot, row 1 is already right-aligned, the rest random (B permitting)."""
    g = torch.Generator().manual_seed(seed)
    cap, D = cap or B, 5
    kv = torch.randn(2, L, cap, H, max_len, D, generator=g, dtype=dtype)
    length = max_len - 3
    valid = torch.rand(cap, max_len, generator=g) < 0.6
    valid[:, length:] = False
    if B > 1:
        valid[0] = False
    if B > 2:
        S = int(valid[2:B, :length].sum(1).max())
        valid[1] = False
        valid[1, S - 3 : S] = True
    return kv.to(DEV), valid.to(DEV), length


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,L,H", [(1, 1, 1), (2, 3, 2), (5, 2, 3), (8, 4, 1)])
def test_compact_rows_equals_the_loop(B, L, H, dtype, impl):
    for seed in range(3):
        for extra in (0, 2):  # S = the largest count, or more (RowCache.join's min_len)
            kv, valid, length = _case(B, L, H, dtype, seed=100 * B + 10 * seed + L, cap=B + 2)
            S = int(valid[:B, :length].sum(1).max()) + extra
            kv_r, valid_r = kv.clone(), valid.clone()
            loop_compact(kv_r, valid_r[:B], length, S)
            _compact(kv, valid[:B], length, S, impl)  # the first B rows of a bigger cache
            assert torch.equal(valid, valid_r)
            assert torch.equal(kv, kv_r)  # every slot: moved ones and untouched ones (rows past B too)


@pytest.mark.parametrize("impl", IMPLS)
def test_compact_rows_moves_overlapping_their_sources(impl):
    """Row 0's slots move right onto slots still to be read (2 -> 3 -> 4 -> 5); row 1's move left onto them
    (3 -> 1, 4 -> 2, 5 -> 3); row 2's go both ways (0 -> 2, 9 -> 3). Any in-place walk in one direction breaks
    one of them."""
    L, H, D, max_len = 2, 2, 3, 12
    kv = torch.arange(2 * L * 3 * H * max_len * D, dtype=torch.float32).view(2, L, 3, H, max_len, D).to(DEV)
    valid = torch.zeros(3, max_len, dtype=torch.bool)
    valid[0, [2, 3, 4]] = True
    valid[1, [3, 4, 5]] = True
    valid[2, [0, 9]] = True
    valid = valid.to(DEV)
    want = kv.clone()
    for b, srcs, dsts in [(0, [2, 3, 4], [3, 4, 5]), (1, [3, 4, 5], [3, 4, 5]), (2, [0, 9], [4, 5])]:
        want[:, :, b, :, dsts] = kv[:, :, b, :, srcs]
    # S = 6: row 0 -> slots 3..5, row 1 already there; then S = 4 for rows 1 and 2 (row 1 moves left)
    _compact(kv, valid, 10, 6, impl)
    assert torch.equal(kv, want)
    assert valid.sum(1).tolist() == [3, 3, 2] and valid[:, 3:6].sum().item() == 8 and valid[2, 4:6].all()
    kv, valid = kv[:, :, 1:].contiguous(), valid[1:].clone()
    want = kv.clone()
    want[:, :, 0, :, [1, 2, 3]] = kv[:, :, 0, :, [3, 4, 5]]
    want[:, :, 1, :, [2, 3]] = kv[:, :, 1, :, [4, 5]]
    _compact(kv, valid, 6, 4, impl)
    assert torch.equal(kv, want)
    assert valid[0].nonzero()[:, 0].tolist() == [1, 2, 3] and valid[1].nonzero()[:, 0].tolist() == [2, 3]


def test_compact_rows_checks_its_arguments():
    kv, valid, length = _case(2, 1, 1, torch.float32, seed=0)
    with pytest.raises(ValueError, match="compact_rows"):
        compact_rows(kv[0], valid, length, 4)
    with pytest.raises(ValueError, match="compact_rows"):
        compact_rows(kv, valid, length, valid.shape[1] + 1)
    with pytest.raises(ValueError, match="compact_rows"):
        compact_rows(kv[:, :, :1], valid, length, 4)  # fewer cache rows than valid rows
    with pytest.raises(ValueError, match="contiguous"):
        compact_rows(kv.transpose(3, 5), valid, length, 4)
    with pytest.raises(ValueError, match="impl"):
        compact_rows(kv, valid, length, 4, impl="fast")


def test_row_cache_compacts_all_rows_in_one_call(monkeypatch):
    """RowCache.compact hands every row to one compact_rows call and ends as the loop would."""
    from draftsmith.eval import batch_decoder as batch
    from draftsmith.models.llama import KVCache

    cfg = TINY_CFG8
    rc = batch.RowCache(lambda b, m: KVCache(cfg, b, m, torch.float64, "cpu"), 20)
    tmp = KVCache(cfg, 5, 12, torch.float64, "cpu")
    tmp.kv.normal_(generator=torch.Generator().manual_seed(0))
    tmp.valid[:] = True  # as a prefill leaves it: join copies each slot's validity
    rc.join(tmp, [0, 1, 2, 3, 4], 12)
    g = torch.Generator().manual_seed(1)
    rc.view.valid[:, :12] &= torch.rand(5, 12, generator=g) < 0.5
    rc.view.valid[2] = False  # a row with nothing valid
    kv_r, valid_r = rc.full.kv.clone(), rc.full.valid.clone()
    loop_compact(kv_r, valid_r[:5], 12, int(valid_r[:5, :12].sum(1).max()))
    from draftsmith.eval import row_cache

    calls = []
    real = row_cache.compact_rows
    monkeypatch.setattr(row_cache, "compact_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    rc.compact()
    assert calls == [1]
    assert torch.equal(rc.full.valid, valid_r) and torch.equal(rc.full.kv, kv_r)
    assert rc.length == int(valid_r.sum(1).max()) and rc.view.padded


# ---- sampled rows ----------------------------------------------------------------------------------------------


def _rows_case(B, G, V, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(B, G + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(B, G, V, generator=g) * 2, -1)
    q = 0.5 * q + 0.5 * p[:, :G]  # overlaps p: accepts and rejections both common
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, G) if G else torch.zeros(B, 0).long()
    gam = torch.randint(0, G + 1, (B,), generator=g)
    gam[0] = G
    if B > 1 and G:
        p[1, 0] = 0.5 * q[1, 0]  # max(0, p - q) empty at row 1's first position: a rejection falls back to p
    return draft.to(DEV), q.to(DEV), p.to(DEV), gam.to(DEV)


def _alone(draft, q, p, gam, gens, impl):
    out = [rejection_accept(draft[b, :g], q[b, :g], p[b, : g + 1], gens[b], impl) for b, g in enumerate(gam.tolist())]
    return [o[0] for o in out], [o[1] for o in out]


@pytest.mark.parametrize("B,G,V", [(1, 3, 7), (5, 2, 11), (16, 4, 33), (6, 0, 9)])
@pytest.mark.parametrize("shared", [False, True])
def test_sampling_rows_equal_each_row_alone(B, G, V, shared):
    """Row b's (accepted, next) equals ``rejection_accept`` on its first gam[b] drafts with the same generator
    state: one generator per row, or one shared by all (then drawn from in row order)."""
    draft, q, p, gam = _rows_case(B, G, V, seed=B + G)
    for seed in range(4):

        def gens(seed=seed):
            if shared:
                return [torch.Generator(DEV).manual_seed(seed)] * B
            return [torch.Generator(DEV).manual_seed(1000 * seed + b) for b in range(B)]

        n, nxt = verify_sampling_rows(draft, q, p, gam, gens(), impl="reference")
        wn, wnxt = _alone(draft, q, p, gam, gens(), "reference")
        assert n.tolist() == wn and nxt.tolist() == wnxt
        assert (n <= gam).all()


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("B,G,V", [(4, 3, 1030), (6, 2, 9), (3, 0, 5)])
def test_sampling_rows_kernel_equals_each_row_alone(B, G, V):
    """One launch for all rows, one Philox seed per row drawn from its generator: row b gets exactly the batch-1
    kernel's answer on that seed (what rejection_accept runs on CUDA), whatever its neighbours and their gam."""
    draft, q, p, gam = _rows_case(B, G, V, seed=7 * B + G)
    seen = set()
    for seed in range(5):
        gens = [torch.Generator().manual_seed(10 * seed + b) for b in range(B)]
        n, nxt = verify_sampling_rows(draft, q, p, gam, gens, impl="triton")
        gens = [torch.Generator().manual_seed(10 * seed + b) for b in range(B)]
        wn, wnxt = _alone(draft, q, p, gam, gens, "triton")
        assert n.tolist() == wn and nxt.tolist() == wnxt
        seen.add((*wn, *wnxt))
    assert len(seen) > 1  # the seeds matter: equal answers come from equal draws


def test_sampling_rows_check_shapes():
    draft, q, p, gam = _rows_case(3, 2, 5, seed=0)
    with pytest.raises(ValueError, match="verify_sampling_rows"):
        verify_sampling_rows(draft, q[:, :1], p, gam, [None] * 3)
    with pytest.raises(ValueError, match="verify_sampling_rows"):
        verify_sampling_rows(draft, q, p, gam[:2], [None] * 3)
    with pytest.raises(ValueError, match="verify_sampling_rows"):
        verify_sampling_rows(draft, q, p, gam, [None] * 2)


def _loop_accept(self, rows, drafts, qs, logits, gam):
    """BatchDecoder.accept_chains as a loop: one rejection_accept per sampled row."""
    from draftsmith.kernels.verify import verify_greedy

    G = logits.shape[1] - 1
    past = torch.arange(G, device=drafts.device)[None] >= gam[:, None]
    n, nxt = verify_greedy(drafts.masked_fill(past, -1), logits, self.impl)
    n = n.long()
    for b, r in enumerate(rows):
        s = r.sampler
        if s.greedy:
            continue
        g = int(gam[b])
        p = s.probs(logits[b, : g + 1])
        q = p.new_empty(0, p.shape[-1]) if g == 0 else qs[b, :g]
        nb, tb = rejection_accept(drafts[b, :g], q, p, s.generator, s.impl)
        n[b], nxt[b] = nb, tb
    return n, nxt


MIXED = [{"temperature": 1.0}, {}, {"temperature": 0.7, "top_k": 3}, {"temperature": 1.3, "top_p": 0.8}]


@pytest.mark.parametrize(
    "drafter,settings", [("draft_lm", MIXED), ("plain", MIXED), ("draft_lm", [{"temperature": 1}])]
)
def test_the_batch_decoder_accepts_sampled_rows_in_one_call(monkeypatch, drafter, settings):
    """Sampled rows (their own generators, ragged budgets), with mixed settings beside greedy rows or all alike:
    one verify_sampling_rows call per step, and every row's tokens equal the per-row loop's on the same seeds."""
    from draftsmith.eval import batch_decoder as batch

    t = tiny_model(0, TINY_CFG8, logit_scale=3.0)
    d = noisy_copy(t, 0.5) if drafter == "draft_lm" else None

    def decode():
        dec = batch.BatchDecoder(t, d, draft_len=3, max_len=40)
        ids = [
            dec.add(torch.tensor([1, 2, 3, 4][: 1 + i % 4]), 6 + i, generator=torch.Generator().manual_seed(i), **kw)
            for i, kw in enumerate(settings * 3)
        ]
        outs, steps = {i: [] for i in ids}, 0
        while dec.active():
            steps += 1
            for i, toks in dec.step().items():
                outs[i] += toks
        return outs, steps

    calls = []
    real = batch.verify_sampling_rows
    monkeypatch.setattr(batch, "verify_sampling_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused, steps = decode()
    assert 0 < len(calls) <= steps
    monkeypatch.setattr(batch.BatchDecoder, "accept_chains", _loop_accept)
    looped, _ = decode()
    assert fused == looped


@pytest.mark.gpu
def test_batch_kernels_natively_on_cuda():
    kv, valid, length = _case(8, 4, 2, torch.bfloat16, seed=3, max_len=300, cap=10)
    S = int(valid[:8, :length].sum(1).max())
    kv_r, valid_r = kv.clone(), valid.clone()
    loop_compact(kv_r, valid_r[:8], length, S)
    compact_rows(kv, valid[:8], length, S)  # auto on CUDA = the kernel
    assert torch.equal(kv, kv_r) and torch.equal(valid, valid_r)
    draft, q, p, gam = _rows_case(16, 4, 32000, seed=1)
    n, nxt = verify_sampling_rows(draft, q, p, gam, [torch.Generator("cuda").manual_seed(b) for b in range(16)])
    wn, wnxt = _alone(draft, q, p, gam, [torch.Generator("cuda").manual_seed(b) for b in range(16)], "auto")
    assert n.tolist() == wn and nxt.tolist() == wnxt
