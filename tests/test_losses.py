"""KD losses: properties against brute-force references, and the top-k + tail reconstruction bound."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from draftsmith.train import losses


def _fkl(student_logits, ids, lp):
    return losses.fkl(*losses.topk_buckets(F.log_softmax(student_logits.float(), -1), ids, lp))


def _alpha_lb(student_logits, ids, lp):
    logp, logq = losses.topk_buckets(F.log_softmax(student_logits.float(), -1), ids, lp)
    return losses.alpha(logp[:, :-1], logq[:, :-1])


def _topk(teacher_logits, k):
    lp = F.log_softmax(teacher_logits.double(), -1)
    v, i = lp.topk(k, -1)
    return i, v


def test_fkl_with_full_vocab_equals_exact_kl():
    torch.manual_seed(0)
    s, t = torch.randn(6, 11, dtype=torch.float64), torch.randn(6, 11, dtype=torch.float64)
    ids, lp = _topk(t, 11)  # K = V: no tail, so the bucketed KL is the exact KL
    exact = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(_fkl(s, ids, lp).double(), exact, rtol=1e-5, atol=1e-6)


def test_fkl_zero_iff_same_distribution_and_nonnegative():
    torch.manual_seed(0)
    t = torch.randn(5, 50)
    ids, lp = _topk(t, 8)
    assert _fkl(t, ids, lp.float()).abs().max() < 1e-5
    s = torch.randn(5, 50)
    assert (_fkl(s, ids, lp.float()) >= -1e-6).all()


def test_topk_tail_bucket_lower_bounds_full_kl():
    # Merging the tail into one bucket can only lose information (data processing inequality): KL_bucket <= KL.
    torch.manual_seed(1)
    s, t = torch.randn(20, 64, dtype=torch.float64), torch.randn(20, 64, dtype=torch.float64) * 3
    full = _fkl(s, *_topk(t, 64))
    for k in (1, 4, 16, 32):
        assert (_fkl(s, *_topk(t, k)) <= full + 1e-9).all()


def test_gradient_only_through_student():
    t = torch.randn(3, 10)
    ids, lp = _topk(t, 4)
    s = torch.randn(3, 10, requires_grad=True)
    _fkl(s, ids, lp.float()).sum().backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()


def test_cross_entropy_and_acceptance_bound():
    torch.manual_seed(0)
    s, y = torch.randn(4, 9), torch.randint(0, 9, (4,))
    torch.testing.assert_close(losses.ce(s, y), F.cross_entropy(s, y, reduction="none"))
    t = torch.randn(4, 9)
    p, q = F.softmax(t, -1), F.softmax(s, -1)
    exact_alpha = torch.minimum(p, q).sum(-1)  # 1 - TVD
    bound = _alpha_lb(s, *_topk(t, 3))
    assert (bound <= exact_alpha + 1e-6).all()
    torch.testing.assert_close(_alpha_lb(s, *_topk(t, 9)), exact_alpha, rtol=1e-5, atol=1e-6)


# ---- the full menu against brute-force references, and the chunked head driver ----------------------------------


def _brute(kind, p, q, beta=0.5, kl_scale=1.0, kl_decay=1.0):
    """Textbook definitions with explicit per-token loops over the support (float64)."""
    out = []
    for pi, qi in zip(p, q):
        a = sum(min(float(x), float(y)) for x, y in zip(pi, qi))
        kl_pq = sum(float(x) * math.log(float(x) / float(y)) for x, y in zip(pi, qi) if x > 0)
        if kind == "fkl":
            v = kl_pq
        elif kind == "rkl":
            v = sum(float(y) * math.log(float(y) / float(x)) for x, y in zip(pi, qi) if y > 0)
        elif kind == "jsd":
            m = [beta * float(x) + (1 - beta) * float(y) for x, y in zip(pi, qi)]
            v = beta * sum(float(x) * math.log(float(x) / mm) for x, mm in zip(pi, m) if x > 0) + (1 - beta) * sum(
                float(y) * math.log(float(y) / mm) for y, mm in zip(qi, m) if y > 0
            )
        elif kind == "tvd":
            v = 0.5 * sum(abs(float(x) - float(y)) for x, y in zip(pi, qi))
        elif kind == "neg_log_alpha":
            v = -math.log(a)
        elif kind == "lk":
            lam = kl_scale * math.exp(-kl_decay * a)
            v = lam * kl_pq + (1 - lam) * (1 - a)
        elif kind == "tvdpp_full":
            r = [1.0 if x > y else 0.0 for x, y in zip(pi, qi)]
            mu = sum(r) / len(r)
            sd = math.sqrt(sum((x - mu) ** 2 for x in r) / (len(r) - 1))
            v = -sum((ri - mu) / (sd + losses.EPS) * math.log(float(y)) for ri, y in zip(r, qi)) / len(r)
        out.append(v)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd", "tvd", "neg_log_alpha", "lk", "tvdpp_full"])
def test_divergences_match_brute_force(kind):
    torch.manual_seed(0)
    s, t = torch.randn(7, 13, dtype=torch.float64), torch.randn(7, 13, dtype=torch.float64) * 2
    logp, logq = F.log_softmax(t, -1), F.log_softmax(s, -1)
    got = losses.DIVERGENCES[kind](logp, logq, beta=0.3, kl_scale=0.7, kl_decay=2.0)
    ref = _brute(kind, logp.exp(), logq.exp(), beta=0.3, kl_scale=0.7, kl_decay=2.0)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-8)
    if kind != "tvdpp_full":  # a divergence: zero at q = p, non-negative
        same = losses.DIVERGENCES[kind](logp, logp, beta=0.3, kl_scale=0.7, kl_decay=2.0)
        assert same.abs().max() < 1e-9 and (got >= -1e-12).all()


def test_tvdpp_samples_follow_q():
    """tvdpp_rewards' inverse-CDF draws (one uniform per row, shared with the vocabulary-blocked driver) have the
    frequencies of q, and the reward is 1[p(x) > q(x)]."""
    q = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05])
    p = torch.tensor([0.1, 0.3, 0.3, 0.25, 0.05])
    n = 40000
    x, r = losses.tvdpp_rewards(p.log().expand(n, -1), q.log().expand(n, -1), torch.Generator().manual_seed(0))
    freq = torch.bincount(x, minlength=5).float() / n
    torch.testing.assert_close(freq, q, atol=0.01, rtol=0)
    assert freq[1] == 0  # never a token q gives no mass
    torch.testing.assert_close(r, (p[x] > q[x]).float())


def test_tvd_gradient_is_the_policy_gradient():
    """A3.2: grad TVD = -E_{x~q}[1[p(x) > q(x)] grad log q(x)], checked exactly by enumerating x."""
    torch.manual_seed(0)
    s = torch.randn(3, 9, dtype=torch.float64, requires_grad=True)
    logp = F.log_softmax(torch.randn(3, 9, dtype=torch.float64), -1)
    losses.tvd(logp, F.log_softmax(s, -1)).sum().backward()
    logq = F.log_softmax(s, -1)
    r = (logp > logq).double().detach()
    (-(logq.exp().detach() * r * logq).sum()).backward()
    g = s.grad.clone()
    s.grad = None
    losses.tvd(logp, F.log_softmax(s, -1)).sum().backward()
    torch.testing.assert_close(s.grad, g / 2)  # the autograd pass above ran twice into .grad


def test_tvdpp_sampled_descends_tvd_on_average():
    """Many TVD++ steps with sampled x ~ q and standardised rewards lower the exact TVD."""
    torch.manual_seed(0)
    s = torch.zeros(64, 12, requires_grad=True)
    logp = F.log_softmax(torch.randn(64, 12) * 2, -1)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD([s], lr=5.0)  # the loss is a mean over 64 rows: each row gets 1/64 of it
    before = losses.tvd(logp, F.log_softmax(s, -1)).mean().item()
    for _ in range(200):
        logq = F.log_softmax(s, -1)
        x, r = losses.tvdpp_rewards(logp, logq, gen)
        loss = losses.tvdpp_sampled(logq, x, (r - r.mean()) / (r.std() + losses.EPS)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = losses.tvd(logp, F.log_softmax(s, -1)).mean().item()
    assert after < 0.25 * before


def _teachers(t_logits, h_t, w_t, k):
    ids, lp = _topk(t_logits, k)
    labels = t_logits.argmax(-1)
    return {
        "topk": losses.Teacher(labels=labels, topk_ids=ids, topk_logprobs=lp.float()),
        "logits": losses.Teacher(labels=labels, logits=t_logits),
        "hidden": losses.Teacher(labels=labels, hidden=h_t, head=w_t),
    }


@pytest.mark.parametrize("kind", list(losses.LOSS_KINDS))
@pytest.mark.parametrize("form", ["topk", "logits", "hidden"])
@pytest.mark.parametrize("fused", [True, False])
def test_head_loss_chunked_equals_unchunked_reference(kind, form, fused):
    """head_loss over chunks of 1, 7 and all positions = the naive full-logits computation, value and grads, on
    the fused path (CE and top-k teachers: in-place softmax gradient) and through autograd; and with the
    vocabulary in blocks of 1, 4 and 13 of 31 (a ragged last block), where every loss takes the blocked path."""
    torch.manual_seed(0)
    N, D, V = 23, 8, 31
    h = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    h_t, w_t = torch.randn(N, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64)
    teacher = _teachers(h_t @ w_t.t(), h_t, w_t, 5)[form]
    results = []
    blocked = [(7, 4), (N, 13), (5, 1)] if fused else []  # the blocked path ignores `fused`
    for chunk, vocab_chunk in [(1, 0), (7, 0), (N, 0), *blocked]:
        spec = losses.LossSpec(kind=kind, chunk=chunk, beta=0.4, fused=fused, vocab_chunk=vocab_chunk)
        gen = torch.Generator().manual_seed(3)
        h.grad = w.grad = None
        loss = losses.head_loss(h, w, teacher, spec, gen)
        loss.backward()
        results.append((loss.detach(), h.grad.clone(), w.grad.clone()))
    # naive reference: full (N, V) logits, autograd end to end
    h.grad = w.grad = None
    logits = h @ w.t()
    if kind == "ce":
        ref = losses.ce(logits, teacher.labels).mean()
    elif kind == "tvdpp":
        logp, logq = teacher.log_pair(logits)
        x, r = losses.tvdpp_rewards(logp, logq.detach(), torch.Generator().manual_seed(3))
        ref = losses.tvdpp_sampled(logq, x, (r - r.mean()) / (r.std() + losses.EPS)).mean()
    else:
        ref = losses.DIVERGENCES[kind](*teacher.log_pair(logits), beta=0.4).mean()
    ref.backward()
    for loss, gh, gw in results:
        torch.testing.assert_close(
            loss,
            ref.detach().float() if loss.dtype == torch.float32 else ref.detach(),
            rtol=1e-5,
            atol=1e-6,
            check_dtype=False,
        )
        torch.testing.assert_close(gh, h.grad, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("form", ["topk", "logits", "hidden"])
def test_head_metrics_with_the_vocabulary_in_blocks_are_unchanged(form):
    torch.manual_seed(2)
    N, D, V = 17, 8, 29
    h, w = torch.randn(N, D), torch.randn(V, D)
    h_t, w_t = torch.randn(N, D), torch.randn(V, D)
    teacher = _teachers(h_t @ w_t.t(), h_t, w_t, 5)[form]
    teacher.labels = (h @ w.t()).topk(3, -1).indices[torch.arange(N), torch.arange(N) % 3]  # ranks 0, 1, 2 all hit
    ref = losses.head_metrics(h, w, teacher, chunk=6, ranks=3)
    assert min(ref["rank_acc"]) > 0.25 and 0 < ref["alpha"] < 1
    for vocab_chunk in (1, 5, 28):
        got = losses.head_metrics(h, w, teacher, chunk=6, ranks=3, vocab_chunk=vocab_chunk)
        assert got.keys() == ref.keys() and got["top1"] == ref["top1"] and torch.equal(got["rank_acc"], ref["rank_acc"])
        assert float(got["alpha"]) == pytest.approx(float(ref["alpha"]), rel=1e-5)


@pytest.mark.parametrize("kind", list(losses.LOSS_KINDS))
def test_fused_path_equals_autograd_with_ids_outside_the_vocabulary_and_in_bf16(kind):
    """Teacher ids of -1 (outside a reduced student vocabulary) on the fused path and with the vocabulary in
    blocks; and a bf16 head, where the fused path never upcasts the chunk: all match autograd through
    log-softmax."""
    torch.manual_seed(1)
    N, D, V, K = 19, 8, 40, 6
    h, w = torch.randn(N, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64)
    ids, lp = _topk(torch.randn(N, V + 9, dtype=torch.float64) * 2, K)
    ids = torch.where(ids >= V, -1, ids)  # teacher ids the student lacks
    teacher = losses.Teacher(labels=torch.randint(0, V, (N,)), topk_ids=ids, topk_logprobs=lp.float())
    assert (ids < 0).any()
    for dtype, tol in ((torch.float64, 1e-6), (torch.bfloat16, 3e-2)):
        out = []
        for fused, vocab_chunk in ((False, 0), (True, 0), (True, 7)):
            hh, ww = h.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_()
            spec = losses.LossSpec(kind=kind, chunk=7, fused=fused, vocab_chunk=vocab_chunk)
            loss = losses.head_loss(hh, ww, teacher, spec, torch.Generator().manual_seed(5))
            loss.backward()
            out.append((loss.detach().double(), hh.grad.double(), ww.grad.double()))
        for other in out[1:]:
            for a, b in zip(out[0], other):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_reduced_vocabulary_teacher_mass_goes_to_the_tail():
    """Teacher top-k ids outside the draft vocabulary (-1) add to the tail: finite losses, alpha not overstated."""
    torch.manual_seed(0)
    logq = F.log_softmax(torch.randn(4, 6), -1)
    ids = torch.tensor([[0, -1, 2], [-1, -1, 5], [1, 2, 3], [4, -1, 0]])
    lp = F.log_softmax(torch.randn(4, 3), -1) - 0.5  # some tail mass
    logp_b, logq_b = losses.topk_buckets(logq, ids, lp)
    torch.testing.assert_close(logp_b.exp().sum(-1), torch.ones(4), rtol=1e-4, atol=1e-4)
    for kind in ("fkl", "rkl", "jsd", "tvd", "lk"):
        assert torch.isfinite(losses.DIVERGENCES[kind](logp_b, logq_b)).all()
    exact_in_vocab = torch.where(ids >= 0, torch.minimum(lp.exp(), logq.gather(-1, ids.clamp_min(0)).exp()), 0)
    torch.testing.assert_close(losses.alpha(logp_b[:, :-1], logq_b[:, :-1]), exact_in_vocab.sum(-1))


def test_hidden_regression_is_smooth_l1():
    a, b = torch.randn(5, 7), torch.randn(5, 7)
    torch.testing.assert_close(losses.hidden_regression(a, b), F.smooth_l1_loss(a, b, reduction="none").mean(-1))


@pytest.mark.parametrize("t", [0.25, 0.5, 0.9])
def test_sharpened_teacher_matches_brute_force(t):
    """Teacher.sharpened(t) = softmax(logits / t): exactly for full logits and hidden states, and for stored top-k
    with no tail; with a tail, the top-k probabilities are lower bounds on the exact ones and the implied tail
    mass an upper bound, and both get closer as K grows."""
    torch.manual_seed(1)
    N, D, V = 9, 6, 40
    h_t, w_t = torch.randn(N, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64)
    logits = 2 * h_t @ w_t.t()
    exact = F.log_softmax(logits / t, -1)
    student = torch.randn(N, V, dtype=torch.float64)
    full = _teachers(logits, 2 * h_t, w_t, 5)
    assert full["logits"].sharpened(1.0) is full["logits"]
    for form in ("logits", "hidden"):
        logp, _ = full[form].sharpened(t).log_pair(student)
        torch.testing.assert_close(logp, exact.float())
    ids, lp = _topk(logits, V)  # every id stored: no tail, so the sharpening is exact
    sharp = losses.Teacher(topk_ids=ids, topk_logprobs=lp).sharpened(t).topk_logprobs
    torch.testing.assert_close(sharp, exact.gather(-1, ids).float())
    gaps = []
    for k in (4, 12, 30):
        ids, lp = _topk(logits, k)
        sharp = losses.Teacher(topk_ids=ids, topk_logprobs=lp).sharpened(t).topk_logprobs.double()
        ref = exact.gather(-1, ids)
        assert (sharp.exp() <= ref.exp() + 1e-6).all()  # the tail bound over-counts the tail, never the top-k
        assert (sharp.exp().sum(-1) <= 1 + 1e-6).all()
        gaps.append((ref.exp().sum(-1) - sharp.exp().sum(-1)).max().item())
        if k == 4:  # the bound is the point of it: sharper than leaving the tail's mass as it was
            naive = lp / t - torch.logaddexp(
                (lp / t).logsumexp(-1, keepdim=True), (1 - lp.exp().sum(-1, keepdim=True)).log()
            )
            assert (sharp >= naive - 1e-9).all() and (sharp > naive + 1e-6).any()
    assert gaps[0] >= gaps[1] >= gaps[2] >= 0


def test_teacher_temperature_applies_to_the_loss_only():
    """LossSpec.teacher_temperature trains against the sharpened teacher (same value and gradient as passing it
    sharpened); head_metrics' alpha is measured against the true teacher; CE ignores it."""
    torch.manual_seed(2)
    N, D, V = 17, 8, 29
    h = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64)
    ids, lp = _topk(torch.randn(N, V, dtype=torch.float64) * 3, 6)
    teacher = losses.Teacher(labels=ids[:, 0], topk_ids=ids, topk_logprobs=lp)
    for kind in ("fkl", "tvd", "ce"):
        a = losses.head_loss(h, w, teacher, losses.LossSpec(kind=kind, teacher_temperature=0.5))
        (ga,) = torch.autograd.grad(a, h)
        ref_teacher = teacher if kind == "ce" else teacher.sharpened(0.5)
        b = losses.head_loss(h, w, ref_teacher, losses.LossSpec(kind=kind))
        (gb,) = torch.autograd.grad(b, h)
        torch.testing.assert_close((a, ga), (b, gb))
        if kind == "fkl":
            c = losses.head_loss(h, w, teacher, losses.LossSpec(kind=kind))
            assert not torch.allclose(a, c)
    alpha = losses.head_metrics(h.detach(), w, teacher)["alpha"]
    logp, logq = teacher.log_pair(h.detach() @ w.t())
    true_alpha = torch.minimum(logp.exp(), logq.exp())[:, :-1].sum(-1).mean().item()  # top-k buckets, no tail
    assert float(alpha) == pytest.approx(true_alpha, rel=1e-5)


def test_auto_chunk_fits_a_logits_budget_on_a_gpu_and_keeps_256_on_a_cpu():
    """train.loss.chunk unset: 256 positions on a CPU; on a GPU as many as keep a chunk's logits within
    LOGITS_BUDGET values, so a step runs few large kernels; the loss is the same whatever the chunk."""
    from types import SimpleNamespace

    gpu = lambda v: SimpleNamespace(device=torch.device("cuda"), shape=(v, 64))  # noqa: E731
    assert losses.auto_chunk(torch.zeros(8192, 4)) == 256
    assert [losses.auto_chunk(gpu(v)) for v in (8192, 49152, 128256, 10**9)] == [8192, 1365, 523, 256]
    h, w = torch.randn(300, 8, dtype=torch.float64), torch.randn(29, 8, dtype=torch.float64)
    ids, lp = _topk(torch.randn(300, 29, dtype=torch.float64), 5)
    teacher = losses.Teacher(labels=ids[:, 0], topk_ids=ids, topk_logprobs=lp)
    auto = losses.head_loss(h, w, teacher, losses.LossSpec(kind="fkl", chunk=None))
    torch.testing.assert_close(auto, losses.head_loss(h, w, teacher, losses.LossSpec(kind="fkl", chunk=300)))


@pytest.mark.parametrize("form", ["topk", "logits", "hidden"])
@pytest.mark.parametrize("fused,vocab_chunk", [(True, 0), (False, 0), (True, 4)])
def test_hass_top_k_loss_adds_the_teachers_best_k_tokens_cross_entropy(form, fused, vocab_chunk):
    """train.loss.hod_weight: head_loss = the loss + w x mean over positions of -sum over the teacher's k most
    likely tokens of p log q (HASS), value and gradients against a brute-force reference, whatever the teacher's
    form (stored top-5 with k = 3; full logits; hidden states) and path (fused, autograd, vocabulary blocks)."""
    torch.manual_seed(1)
    N, D, V, k, w8 = 13, 8, 31, 3, 0.7
    h = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    h_t, w_t = torch.randn(N, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64)
    teacher = _teachers(h_t @ w_t.t(), h_t, w_t, 5)[form]
    spec = losses.LossSpec(kind="fkl", chunk=5, fused=fused, vocab_chunk=vocab_chunk, hod_weight=w8, hod_k=k)
    loss = losses.head_loss(h, w, teacher, spec)
    loss.backward()
    got = (loss.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    logq = F.log_softmax(h @ w.t(), -1)
    logp = F.log_softmax(h_t @ w_t.t(), -1)
    top = logp.topk(k, -1).indices
    hod = -(logp.gather(-1, top).exp() * logq.gather(-1, top)).sum(-1)
    ref = (losses.fkl(*teacher.log_pair(h @ w.t())) + w8 * hod).mean()
    ref.backward()
    torch.testing.assert_close(got[0].double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[2], w.grad, rtol=1e-4, atol=1e-6)


def test_hass_top_k_loss_needs_a_teacher_distribution():
    with pytest.raises(ValueError, match="hod_weight needs the teacher's distribution"):
        losses.Teacher(labels=torch.zeros(3, dtype=torch.long)).top(2)


def test_hass_top_k_loss_adds_to_cross_entropy_too():
    """kind=ce with hod_weight: CE on the labels plus the top-k term on the teacher's distribution."""
    torch.manual_seed(2)
    N, D, V = 9, 8, 31
    h, w = torch.randn(N, D, dtype=torch.float64), torch.randn(V, D, dtype=torch.float64)
    t_logits = torch.randn(N, V, dtype=torch.float64)
    teacher = _teachers(t_logits, None, None, 6)["topk"]
    got = losses.head_loss(h, w, teacher, losses.LossSpec(kind="ce", hod_weight=0.5, hod_k=4))
    logq, logp = F.log_softmax(h @ w.t(), -1), F.log_softmax(t_logits, -1)
    top = logp.topk(4, -1).indices
    ref = losses.ce(h @ w.t(), teacher.labels) - 0.5 * (logp.gather(-1, top).exp() * logq.gather(-1, top)).sum(-1)
    torch.testing.assert_close(got.double(), ref.mean(), rtol=1e-5, atol=1e-6)
