"""Triton kernels against their PyTorch references: bit-for-bit for greedy verification, tree masks and KV
compaction on odd and block-boundary shapes; sampling verification row for row against its rule fed the same
Philox uniforms, and in distribution. On CPU they run in Triton's interpreter (TRITON_INTERPRET=1, set in
conftest); the `gpu` tests run them natively on CUDA."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from draftsmith.kernels.kv import compact_kv, compact_kv_reference  # noqa: E402
from draftsmith.kernels.softmax import row_logsumexp, softmax_scale_  # noqa: E402
from draftsmith.kernels.tree import tree_mask, tree_mask_reference  # noqa: E402
from draftsmith.kernels.verify import verify_greedy, verify_greedy_reference, verify_sampling  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _greedy_case(B, G, V, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, G + 1, V, generator=g)
    best = logits.argmax(-1)
    draft = best[:, :G].clone()
    for b in range(B):  # row b matches its first b % (G+1) drafts, then differs
        m = b % (G + 1)
        if m < G:
            draft[b, m] = (best[b, m] + 1) % V
    return draft.to(device), logits.to(device)


@pytest.mark.parametrize("B,G,V", [(1, 0, 7), (3, 1, 64), (4, 5, 1000), (5, 4, 1025), (2, 7, 2048), (6, 3, 3)])
def test_verify_greedy_matches_reference(B, G, V):
    draft, logits = _greedy_case(B, G, V, seed=B * 100 + G)
    n, nxt = verify_greedy(draft, logits, impl="triton")
    rn, rnxt = verify_greedy_reference(draft, logits)
    assert torch.equal(n.cpu(), rn.cpu()) and torch.equal(nxt.cpu(), rnxt.cpu())
    assert n.tolist() == [min(b % (G + 1), G) for b in range(B)]


def test_verify_greedy_ties_take_the_first_index():
    logits = torch.zeros(1, 2, 1030)
    logits[0, 0, [3, 1029]] = 5.0  # tie across a block boundary: argmax is the first (3)
    logits[0, 1, [700, 1027]] = 2.0
    n, nxt = verify_greedy(torch.tensor([[3]], device=DEV), logits.to(DEV), impl="triton")
    assert n.item() == 1 and nxt.item() == 700


def _probs(*shape, seed, sharp=2.0):
    return torch.softmax(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * sharp, -1)


def test_verify_sampling_special_cases():
    B, G, V = 32, 3, 10
    p = _probs(B, G + 1, V, seed=0).to(DEV)
    draft = torch.multinomial(p[:, :G].reshape(-1, V).cpu(), 1, generator=torch.Generator().manual_seed(1))
    draft = draft.view(B, G).to(DEV)
    n, _ = verify_sampling(draft, p[:, :G].clone(), p, seed=3, impl="triton")
    assert (n == G).all()  # q == p: every draft is accepted
    q = torch.zeros(B, G, V, device=DEV)
    q[..., 0] = 1.0
    p0 = p.clone()
    p0[..., 0] = 0.0
    p0 /= p0.sum(-1, keepdim=True)
    n, nxt = verify_sampling(torch.zeros(B, G, dtype=torch.long, device=DEV), q, p0, seed=4, impl="triton")
    assert (n == 0).all() and (nxt != 0).all()  # drafts outside p's support never survive or come back


@triton.jit
def _philox_uniforms(out_ptr, seed, N, BLOCK: tl.constexpr):
    """The uniforms ``tl.rand(seed, offset)`` gives any kernel at offsets 0..N-1."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.rand(seed, offs), mask=offs < N)


def _uniforms(n, seed):
    out = torch.empty(n, dtype=torch.float32, device=DEV)
    _philox_uniforms[(triton.cdiv(n, 4096),)](out, seed, n, BLOCK=4096)
    return out


def _kernel_rule(draft, q, p, u):
    """The sampling kernel's rule written in torch and fed the kernel's own Philox stream: u[b(γ+1) + i] decides
    draft i of row b, and u[(B(γ+1) + b)V + v] is token v's clock in row b's exponential race."""
    B, G = draft.shape
    V = p.shape[-1]
    px = p[:, :G].gather(-1, draft[..., None])[..., 0]
    qx = q.gather(-1, draft[..., None])[..., 0]
    ok = (qx > 0) & (u[: B * (G + 1)].view(B, G + 1)[:, :G] * qx < px)
    n = ok.int().cumprod(-1).sum(-1)
    rows = torch.arange(B, device=p.device)
    pn = p[rows, n.long()]
    qn = torch.cat([q, torch.zeros_like(p[:, :1])], 1)[rows, n.long()]
    e = -torch.log(u[B * (G + 1) * V : B * (G + 2) * V].view(B, V).clamp_min(1e-20))
    r = (pn - qn).clamp_min(0) / e
    return n.int(), torch.where(r.max(-1).values > 0, r.argmax(-1), (pn / e).argmax(-1))


def _sampling_case(B, G, V, seed):
    p = _probs(B, G + 1, V, seed=seed)
    q = 0.5 * p[:, :G] + 0.5 * _probs(B, G, V, seed=seed + 1)  # overlaps p: accepts and rejections both common
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=torch.Generator().manual_seed(seed + 2)) if G else None
    draft = draft.view(B, G) if G else torch.zeros(B, 0, dtype=torch.long)
    return draft.to(DEV), q.contiguous().to(DEV), p.to(DEV)


@pytest.mark.parametrize("B,G,V", [(96, 1, 6), (24, 3, 1030), (8, 0, 9)])
def test_verify_sampling_kernel_is_its_rule_on_its_own_uniforms(B, G, V):
    """Row for row, the kernel's (accepted, next) equal the rule in torch fed the same Philox uniforms: across
    vocabulary blocks (V = 1030 > BLOCK_V), after rejections and full acceptances, and with nothing drafted."""
    draft, q, p = _sampling_case(B, G, V, seed=B + G)
    n, nxt = verify_sampling(draft, q, p, seed=13, impl="triton")
    rn, rnxt = _kernel_rule(draft, q, p, _uniforms(B * (G + 2) * V, seed=13))
    assert torch.equal(n.cpu(), rn.cpu()) and torch.equal(nxt.cpu(), rnxt.cpu())
    if G:
        assert 0 < (n == G).sum() < B  # full acceptances and rejections both exercised


def test_verify_sampling_keeps_the_target_distribution():
    """The first emitted token (the draft if accepted, else the correction) is distributed as p_0, and after a
    full acceptance the bonus follows p_γ. Measured on the kernel's rule over its own Philox stream (equal to the
    kernel row for row, test above), so 20,000 rows cost what 200 interpreted kernel rows would."""
    B, G, V = 20000, 1, 6
    p = _probs(1, G + 1, V, seed=10).expand(B, -1, -1).contiguous()
    q = (0.5 * p[:, :G] + 0.5 * _probs(1, G, V, seed=11)).contiguous()
    draft = torch.multinomial(q[0, 0], B, replacement=True, generator=torch.Generator().manual_seed(12))[:, None]
    n, nxt = _kernel_rule(draft.to(DEV), q.to(DEV), p.to(DEV), _uniforms(B * (G + 2) * V, seed=13))
    n, nxt = n.cpu(), nxt.cpu()
    first = torch.where(n >= 1, draft[:, 0], nxt)
    emp = torch.bincount(first, minlength=V).double() / B
    assert 0.5 * (emp - p[0, 0].double()).abs().sum() < 0.015  # ~3x the expected sampling error at B = 20,000
    assert 0.2 < (n == 1).double().mean() < 0.95  # both branches exercised
    bonus = nxt[n == 1]
    emp_b = torch.bincount(bonus, minlength=V).double() / len(bonus)
    assert 0.5 * (emp_b - p[0, 1].double()).abs().sum() < 0.025


def _parents(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([-1 if i == 0 else int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)])


@pytest.mark.parametrize("n", [1, 5, 17, 60])
def test_tree_mask_matches_reference(n):
    parents = _parents(n, seed=n)
    mask, depth = tree_mask(parents.to(DEV), impl="triton")
    rmask, rdepth = tree_mask_reference(parents)
    assert torch.equal(mask.cpu(), rmask) and torch.equal(depth.cpu(), rdepth)


@pytest.mark.parametrize(
    "B,H,S,D,start,keep",
    [
        (1, 3, 20, 64, 4, [0, 3, 5]),
        (2, 2, 33, 17, 10, [0, 1, 2]),
        (1, 4, 70, 96, 0, [0, 7, 8, 30, 69]),
        (3, 1, 9, 8, 2, []),
    ],
)
def test_compact_kv_matches_reference(B, H, S, D, start, keep):
    x = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(S)).to(DEV)
    ref = x.clone().cpu()
    k = torch.tensor(keep, dtype=torch.long)
    compact_kv(x, start, k.to(DEV), impl="triton")
    compact_kv_reference(ref, start, k)
    assert torch.equal(x.cpu(), ref)


@pytest.mark.parametrize("N,V", [(1, 7), (3, 1024), (5, 1025), (2, 3001), (0, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softmax_passes_match_reference(N, V, dtype):
    """The fused KD-loss passes: logsumexp per row, then z <- coef * softmax(z) in place (train/losses.py)."""
    g = torch.Generator().manual_seed(N * 7 + V)
    z = (torch.randn(N, V, generator=g) * 4).to(dtype)
    coef = torch.randn(N, generator=g)
    lse = row_logsumexp(z.to(DEV), impl="triton")
    ref = torch.logsumexp(z.float(), -1)
    torch.testing.assert_close(lse.cpu(), ref, rtol=1e-5, atol=1e-5)
    zk = z.clone().to(DEV)
    softmax_scale_(zk, lse, coef.to(DEV), impl="triton")
    want = (torch.softmax(z.float(), -1) * coef[:, None]).to(dtype)
    torch.testing.assert_close(zk.cpu().float(), want.float(), rtol=1e-3 if dtype == torch.float16 else 1e-5, atol=1e-6)
    zr = z.clone()
    softmax_scale_(zr, ref, coef, impl="reference")
    torch.testing.assert_close(zr.float(), want.float(), rtol=1e-3 if dtype == torch.float16 else 1e-5, atol=1e-6)


def test_launchers_check_shapes_and_fall_back():
    draft, logits = _greedy_case(2, 3, 11, seed=0, device="cpu")
    with pytest.raises(ValueError, match="expected"):
        verify_greedy(draft, logits[:, :3])
    with pytest.raises(ValueError, match="ascending"):
        compact_kv(torch.zeros(1, 1, 8, 4), 0, torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="unit stride"):
        row_logsumexp(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="lse and coef"):
        softmax_scale_(torch.zeros(4, 6), torch.zeros(3), torch.zeros(4))
    n, nxt = verify_greedy(draft, logits)  # auto on CPU = the reference
    assert torch.equal(n, verify_greedy_reference(draft, logits)[0])


@pytest.mark.gpu
def test_kernels_natively_on_cuda():
    draft, logits = _greedy_case(8, 5, 32000, seed=1, device="cuda")
    n, nxt = verify_greedy(draft, logits)  # auto on CUDA = the Triton kernel
    rn, rnxt = verify_greedy_reference(draft, logits)
    assert torch.equal(n, rn) and torch.equal(nxt, rnxt)
    z = torch.randn(300, 49152, device="cuda", dtype=torch.bfloat16) * 4  # auto on CUDA = the Triton passes
    lse = row_logsumexp(z)
    torch.testing.assert_close(lse, torch.logsumexp(z.float(), -1), rtol=1e-5, atol=1e-4)
    coef = torch.randn(300, device="cuda")
    want = torch.softmax(z.float(), -1) * coef[:, None]
    torch.testing.assert_close(softmax_scale_(z, lse, coef).float(), want, rtol=2e-2, atol=1e-5)
    mask, depth = tree_mask(_parents(60, 0).cuda())
    assert torch.equal(mask.cpu(), tree_mask_reference(_parents(60, 0))[0])


def test_the_decoder_verifies_through_the_kernels_where_auto_picks_them(monkeypatch):
    """The chain decoder's acceptance runs the fused kernels where ``impl`` picks them (auto: on CUDA; forced here
    under the interpreter): one sampling launch per verify step, its Philox seed one draw from the decode's
    generator (so a seeded decode repeats), and greedy decoding through the greedy kernel stays exact."""

    from conftest import noisy_copy, tiny_model

    from draftsmith.eval import batch_decoder, decoder
    from draftsmith.eval.accept import rejection_accept

    target = tiny_model(0).double()
    drafter = noisy_copy(target).double()
    prompt = torch.arange(3, 11)
    calls = {"sampling": 0, "greedy": 0}
    for name, fn in (("sampling", "verify_sampling_rows"), ("greedy", "verify_greedy")):
        real = getattr(batch_decoder, fn)

        def spy(*args, _real=real, _name=name):
            calls[_name] += args[-1] == "triton"
            return _real(*args)

        monkeypatch.setattr(batch_decoder, fn, spy)
    monkeypatch.setattr(batch_decoder.BatchDecoder, "impl", "triton")

    def run(temperature, seed):
        gen = torch.Generator().manual_seed(seed)
        return decoder.speculative_generate(
            target, drafter, prompt, 12, draft_len=3, temperature=temperature, generator=gen
        )

    out, st = run(1.0, 7)
    assert calls["sampling"] == st.target_forwards and calls["greedy"] == 0
    assert out == run(1.0, 7)[0]
    greedy, st = run(0.0, 0)
    assert calls["greedy"] == st.target_forwards
    assert greedy == decoder.autoregressive_generate(target, prompt, 12)
    # the rule's answer is the kernel's on the seed drawn from the generator
    p = torch.softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(1)), -1)
    q, d = p[:2].flip(-1).contiguous(), torch.tensor([2, 5])
    seed = int(torch.randint(2**31 - 1, (1,), generator=torch.Generator().manual_seed(3)))
    n, nxt = verify_sampling(d[None], q[None], p[None], seed, impl="triton")
    assert rejection_accept(d, q, p, torch.Generator().manual_seed(3), impl="triton") == (int(n[0]), int(nxt[0]))


@pytest.mark.gpu
def test_sampling_acceptance_runs_the_kernel_on_cuda():
    """On CUDA, ``auto`` sends the decoder's rejection sampling through the fused kernel, seeded from the generator."""
    from draftsmith.eval.accept import rejection_accept

    p = torch.softmax(torch.randn(5, 32000, device="cuda"), -1)
    q, d = p[:4].roll(1, -1).contiguous(), torch.tensor([3, 1, 4, 1], device="cuda")
    seed = int(torch.randint(2**31 - 1, (1,), generator=torch.Generator("cuda").manual_seed(9), device="cuda"))
    n, nxt = verify_sampling(d[None], q[None], p[None], seed, impl="triton")
    assert rejection_accept(d, q, p, torch.Generator("cuda").manual_seed(9)) == (int(n[0]), int(nxt[0]))


def test_the_batched_decoder_verifies_greedy_rows_through_the_kernel(monkeypatch):
    """Rows of a batch accept through one fused greedy launch per step (forced here under the interpreter; auto
    picks it on CUDA); each row's own draft budget masks the drafts past it; outputs stay every row's own."""
    from conftest import noisy_copy, tiny_model

    from draftsmith.eval import batch_decoder as batch
    from draftsmith.eval.decoder import autoregressive_generate

    target = tiny_model(0).double()
    drafter = noisy_copy(target).double()
    launches = {"n": 0}
    real = batch.verify_greedy

    def spy(draft, logits, impl):
        launches["n"] += impl == "triton"
        return real(draft, logits, impl)

    monkeypatch.setattr(batch, "verify_greedy", spy)
    dec = batch.BatchDecoder(target, drafter, draft_len=3, max_len=128)
    dec.impl = "triton"
    prompts = [torch.arange(3, 3 + n) for n in (5, 9, 7)]
    rows = {dec.add(p, 10 + 3 * i): i for i, p in enumerate(prompts)}
    outs = {i: [] for i in range(len(prompts))}
    steps = 0
    while dec.active() or steps == 0:
        for rid, toks in dec.step().items():
            outs[rows[rid]] += toks
        steps += 1
    assert launches["n"] >= steps - 1 > 0
    for i, p in enumerate(prompts):
        assert outs[i] == autoregressive_generate(target, p, 10 + 3 * i)
