"""KD losses: properties against brute-force references, and the top-k + tail reconstruction bound."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.train import losses


def _topk(teacher_logits, k):
    lp = F.log_softmax(teacher_logits.double(), -1)
    v, i = lp.topk(k, -1)
    return i, v


def test_fkl_with_full_vocab_equals_exact_kl():
    torch.manual_seed(0)
    s, t = torch.randn(6, 11, dtype=torch.float64), torch.randn(6, 11, dtype=torch.float64)
    ids, lp = _topk(t, 11)  # K = V: no tail, so the bucketed KL is the exact KL
    exact = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(losses.forward_kl(s, ids, lp).double(), exact, rtol=1e-5, atol=1e-6)


def test_fkl_zero_iff_same_distribution_and_nonnegative():
    torch.manual_seed(0)
    t = torch.randn(5, 50)
    ids, lp = _topk(t, 8)
    assert losses.forward_kl(t, ids, lp.float()).abs().max() < 1e-5
    s = torch.randn(5, 50)
    assert (losses.forward_kl(s, ids, lp.float()) >= -1e-6).all()


def test_topk_tail_bucket_lower_bounds_full_kl():
    # Merging the tail into one bucket can only lose information (data processing inequality): KL_bucket <= KL.
    torch.manual_seed(1)
    s, t = torch.randn(20, 64, dtype=torch.float64), torch.randn(20, 64, dtype=torch.float64) * 3
    full = losses.forward_kl(s, *_topk(t, 64))
    for k in (1, 4, 16, 32):
        assert (losses.forward_kl(s, *_topk(t, k)) <= full + 1e-9).all()


def test_gradient_only_through_student():
    t = torch.randn(3, 10)
    ids, lp = _topk(t, 4)
    s = torch.randn(3, 10, requires_grad=True)
    losses.forward_kl(s, ids, lp.float()).sum().backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()


def test_cross_entropy_and_acceptance_bound():
    torch.manual_seed(0)
    s, y = torch.randn(4, 9), torch.randint(0, 9, (4,))
    torch.testing.assert_close(losses.cross_entropy(s, y), F.cross_entropy(s, y, reduction="none"))
    t = torch.randn(4, 9)
    p, q = F.softmax(t, -1), F.softmax(s, -1)
    exact_alpha = torch.minimum(p, q).sum(-1)  # 1 - TVD
    bound = losses.acceptance_lower_bound(s, *_topk(t, 3))
    assert (bound <= exact_alpha + 1e-6).all()
    torch.testing.assert_close(losses.acceptance_lower_bound(s, *_topk(t, 9)), exact_alpha, rtol=1e-5, atol=1e-6)
