"""Distillation losses, each defined once (algorithms.md A2.2, A3, A3.4), and one chunked LM-head driver.

Every divergence is a function of (log p, log q) over a common support, per position -> (N,):
- with full target logits the support is the vocabulary;
- with stored top-k log-probs it is K + 1 buckets (the top-k ids plus the tail mass 1 - sum(top-k)), so each
  divergence stays a proper divergence between two distributions, and is a lower bound on the full-vocabulary
  one (data processing inequality; tested).
Gradients flow through the student (q) only; p is a constant.

``head_loss`` computes any of them straight from the student's final hidden states and LM head, chunk by chunk
over positions, with the gradient of each chunk taken immediately (as Liger's fused linear cross-entropy does):
peak memory is O(chunk x V) instead of O(N x V) (benchmarks/loss_memory.py). For CE and top-k teachers the
chunk's gradient skips autograd over (chunk, V) altogether (``_fused_chunk``: two in-place softmax passes, Triton
kernels on GPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

EPS = 1e-8
NEG = -1e4  # log of "no mass": finite so 0 * NEG stays 0 without NaN


@dataclass
class Teacher:
    """The target distribution at the N trained positions, in one of three forms (first one set wins):
    ``topk_ids``/``topk_logprobs`` (N, K) stored top-k; ``logits`` (N, V); or ``hidden`` (N, D) with ``head``
    (V, D), the target's final hidden state and LM head, turned into logits chunk by chunk.
    ``labels`` (N,) are the target-written tokens (CE, metrics)."""
    labels: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    head: torch.Tensor | None = None

    def rows(self, s: int, e: int) -> Teacher:
        return replace(self, **{f.name: getattr(self, f.name)[s:e] for f in fields(self)
                                if f.name != "head" and getattr(self, f.name) is not None})

    def log_pair(self, student_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p, log q) on a common support, float32."""
        logq = F.log_softmax(student_logits.float(), dim=-1)
        if self.topk_ids is not None:
            return topk_buckets(logq, self.topk_ids, self.topk_logprobs)
        if self.logits is not None:
            logits = self.logits
        elif self.hidden is not None:
            logits = self.hidden.to(self.head.dtype) @ self.head.t()
        else:
            raise ValueError("teacher has neither top-k log-probs nor logits nor hidden states")
        return F.log_softmax(logits.float(), dim=-1), logq


def topk_buckets(logq_all: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor):
    """Project both distributions onto K+1 buckets (top-k ids + tail). Returns (log p, log q), each (N, K+1).
    Teacher ids < 0 (outside a reduced student vocabulary) count as no student mass; their teacher mass stays."""
    return gathered_buckets(logq_all.gather(-1, topk_ids.clamp_min(0)), topk_ids, topk_logprobs)


def gathered_buckets(logq_at_ids: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor):
    """``topk_buckets`` from the student's log-probs at the teacher's ids only (N, K): all the buckets need."""
    inside = topk_ids >= 0
    logq_k = torch.where(inside, logq_at_ids, NEG)  # (N, K)
    # Teacher mass on ids the student cannot produce joins the tail (a finite KL, and alpha is not overstated).
    logp_k = torch.where(inside, topk_logprobs.float(), NEG)
    # The tail is clamped away from 0 (fp16 storage can round it negative).
    tail_p = (1 - logp_k.exp().sum(-1, keepdim=True)).clamp_min(EPS)
    tail_q = (1 - logq_k.exp().sum(-1, keepdim=True)).clamp_min(EPS)
    return torch.cat([logp_k, tail_p.log()], -1), torch.cat([logq_k, tail_q.log()], -1)


# ---- divergences on (log p, log q) -> (N,) ------------------------------------------------------------------------

def fkl(logp, logq, **_):
    """KL(p || q): mass-covering; soft cross-entropy against p up to a constant."""
    return (logp.exp() * (logp - logq)).sum(-1)


def rkl(logp, logq, **_):
    """KL(q || p): mode-seeking."""
    return (logq.exp() * (logq - logp)).sum(-1)


def jsd(logp, logq, beta: float = 0.5, **_):
    """beta KL(p || M) + (1 - beta) KL(q || M), M = beta p + (1 - beta) q (GKD's convention)."""
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
    return beta * (logp.exp() * (logp - logm)).sum(-1) + (1 - beta) * (logq.exp() * (logq - logm)).sum(-1)


def tvd(logp, logq, **_):
    """1/2 sum |p - q| = 1 - alpha: exactly the rejection probability of one draft."""
    return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)


def alpha(logp, logq) -> torch.Tensor:
    """Acceptance probability sum min(p, q) per position."""
    return torch.minimum(logp.exp(), logq.exp()).sum(-1)


def neg_log_alpha(logp, logq, **_):
    """-log alpha (the LK "alpha" loss): TVD with a 1/alpha gradient boost where acceptance is low."""
    return -alpha(logp, logq).clamp_min(EPS).log()


def lk(logp, logq, kl_scale: float = 1.0, kl_decay: float = 1.0, **_):
    """LK hybrid: lambda KL(p || q) + (1 - lambda)(1 - alpha), lambda = kl_scale exp(-kl_decay alpha): KL while
    the draft is poor (strong gradients), acceptance once it is good."""
    a = alpha(logp, logq)
    lam = kl_scale * torch.exp(-kl_decay * a.detach())
    return lam * fkl(logp, logq) + (1 - lam) * (1 - a)


def tvdpp_full(logp, logq, **_):
    """TVD++, full-support variant: reward r(v) = 1[p(v) > q(v)] standardised over the support per position,
    loss = -mean_v r_hat(v) log q(v). Weights every outcome equally, not by q: a different estimator from the
    sampled one (algorithms.md A3.3 b)."""
    r = (logp > logq).float()
    r_hat = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + EPS)
    return -(r_hat * logq).mean(-1)


def ce(student_logits, labels):
    """Hard-label CE on the target-written tokens, per position (N,)."""
    return F.cross_entropy(student_logits.float(), labels, reduction="none")


def hidden_regression(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Smooth-L1 between predicted and target hidden states, per position (N,) (EAGLE's feature loss)."""
    return F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)


DIVERGENCES = {"fkl": fkl, "rkl": rkl, "jsd": jsd, "tvd": tvd, "neg_log_alpha": neg_log_alpha, "lk": lk,
               "tvdpp_full": tvdpp_full}
LOSS_KINDS = ("ce", *DIVERGENCES, "tvdpp")


# ---- TVD++ (sampled policy gradient) -------------------------------------------------------------------------------

@torch.no_grad()
def tvdpp_rewards(logp, logq, generator: torch.Generator | None = None):
    """Sample x ~ q per position; reward r = 1[p(x) > q(x)]. Returns (x (N,), r (N,)), on the given support."""
    x = torch.multinomial(logq.exp(), 1, generator=generator).squeeze(-1)
    r = (logp.gather(-1, x[:, None]) > logq.gather(-1, x[:, None])).float().squeeze(-1)
    return x, r


def tvdpp_sampled(logq, x, r_hat):
    """-r_hat(x) log q(x) per position: REINFORCE on the TVD reward with a standardised baseline (A3.2)."""
    return -(r_hat * logq.gather(-1, x[:, None]).squeeze(-1))


# ---- one driver: hidden states + LM head -> loss, chunked over positions ------------------------------------------

@dataclass
class LossSpec:
    kind: str = "fkl"
    beta: float = 0.5
    kl_scale: float = 1.0
    kl_decay: float = 1.0
    chunk: int = 256
    fused: bool = True  # CE and stored top-k teachers: the gradient from two in-place softmax passes (below)


def _per_position(spec: LossSpec, logits, teacher: Teacher, sample=None) -> torch.Tensor:
    if spec.kind == "ce":
        return ce(logits, teacher.labels)
    return _on_support(spec, *teacher.log_pair(logits), sample)


def _on_support(spec: LossSpec, logp, logq, sample=None) -> torch.Tensor:
    if spec.kind == "tvdpp":
        x, r_hat = sample
        return tvdpp_sampled(logq, x, r_hat)
    return DIVERGENCES[spec.kind](logp, logq, beta=spec.beta, kl_scale=spec.kl_scale, kl_decay=spec.kl_decay)


def _fusable(spec: LossSpec, teacher: Teacher) -> bool:
    return spec.fused and (spec.kind == "ce" or teacher.topk_ids is not None)


def _fused_chunk(spec: LossSpec, logits: torch.Tensor, teacher: Teacher, sample, need_grad: bool):
    """Loss (sum over the chunk) and, in place of ``logits``, its gradient, for losses that read the student's
    log-probs at K ids per row only (CE: the label; top-k teachers: the K ids, whose tail bucket is 1 minus their
    mass). With z the logits, lse their logsumexp and g_k = d loss / d log q(id_k) (autograd on (N, K) only):

        d loss / d z_j = sum_k g_k [j = id_k] - softmax(z)_j * sum_k g_k

    so the (N, V) work is a logsumexp pass and one in-place pass writing -sum_k g_k * softmax(z) over the logits
    (kernels/softmax.py: Triton on GPU), then a K-column scatter. No log-softmax, no (N, V) gradient, no fp32 copy
    of a bf16 chunk is ever allocated."""
    from draftsmith.kernels.softmax import row_logsumexp, softmax_scale_

    ids = teacher.labels[:, None] if spec.kind == "ce" else teacher.topk_ids
    lse = row_logsumexp(logits)
    zk = logits.gather(-1, ids.clamp_min(0)).float().requires_grad_(need_grad)
    with torch.enable_grad():
        logq_k = zk - lse[:, None]
        if spec.kind == "ce":
            loss = -logq_k[:, 0].sum()
        else:
            loss = _on_support(spec, *gathered_buckets(logq_k, ids, teacher.topk_logprobs), sample).sum()
    if need_grad:
        (gk,) = torch.autograd.grad(loss, zk)  # ids < 0 (outside a reduced vocabulary) get 0: no student mass
        softmax_scale_(logits, lse, -gk.sum(-1))
        logits.scatter_add_(-1, ids.clamp_min(0), gk.to(logits.dtype))
    return loss.detach()


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum over positions of loss(h @ W^T), chunk by chunk; the gradients w.r.t. h and W are taken per chunk in
    the forward pass and replayed (scaled) in backward, so no (N, V) tensor is ever alive. Backward can run
    once (the saved gradients are scaled in place)."""

    @staticmethod
    def forward(ctx, h, weight, spec, teacher, samples):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        w = weight.detach()
        for s in range(0, h.shape[0], spec.chunk):
            e = min(s + spec.chunk, h.shape[0])
            hc = h[s:e].detach().to(w.dtype)
            sample = None if samples is None else (samples[0][s:e], samples[1][s:e])
            if _fusable(spec, teacher):
                logits = hc @ w.t()
                loss = _fused_chunk(spec, logits, teacher.rows(s, e), sample, need_h or need_w)
                g = logits  # now holds d loss / d logits
            else:
                with torch.enable_grad():
                    logits = (hc @ w.t()).requires_grad_(need_h or need_w)
                    loss = _per_position(spec, logits, teacher.rows(s, e), sample).sum()
                if need_h or need_w:
                    # Back through the loss to the logits only.
                    (g,) = torch.autograd.grad(loss, logits)
            if need_h or need_w:
                # The two head matmuls are done by hand, in place (a fresh (V, D) gradient per chunk would double
                # the head's memory).
                if need_h:
                    grad_h[s:e] = (g @ w).to(h.dtype)
                if need_w:
                    grad_w.addmm_(g.t().to(w.dtype), hc)
                del g
            total += loss.detach()
            del logits, loss
        ctx.save_for_backward(*(g for g in (grad_h, grad_w) if g is not None))
        ctx.flags = (need_h, need_w)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        saved = list(ctx.saved_tensors)
        need_h, need_w = ctx.flags
        # The saved gradients are used once: scale them in place instead of allocating copies.
        gh = saved.pop(0).mul_(grad_out) if need_h else None
        gw = saved.pop(0).mul_(grad_out) if need_w else None
        return gh, gw, None, None, None


def head_loss(h: torch.Tensor, weight: torch.Tensor, teacher: Teacher, spec: LossSpec,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Mean over the N positions of ``spec.kind`` between the student ``h @ weight.T`` and the teacher.

    h (N, D) student final hidden states at the trained positions; weight (V', D) its LM head (V' may be a
    reduced vocabulary: then teacher top-k ids must already be in student index space, -1 where absent).
    TVD++ first draws x ~ q and standardises the rewards over all N positions (a no-grad pass), then takes the
    policy-gradient step on the same samples.
    """
    samples = None
    if spec.kind == "tvdpp":
        xs, rs = [], []
        with torch.no_grad():
            for s in range(0, h.shape[0], spec.chunk):
                e = min(s + spec.chunk, h.shape[0])
                logp, logq = teacher.rows(s, e).log_pair(h[s:e].to(weight.dtype) @ weight.t())
                x, r = tvdpp_rewards(logp, logq, generator)
                xs.append(x)
                rs.append(r)
        r = torch.cat(rs)
        samples = (torch.cat(xs), (r - r.mean()) / (r.std() + EPS) if r.numel() > 1 else r - r.mean())
    return _ChunkedHeadLoss.apply(h, weight, spec, teacher, samples) / max(1, h.shape[0])


@torch.no_grad()
def head_metrics(h: torch.Tensor, weight: torch.Tensor, teacher: Teacher, chunk: int = 1024, ranks: int = 0) -> dict:
    """Chunked metrics at the trained positions: top-1 agreement with the labels, and (with a teacher
    distribution) alpha = sum min(p, q), a lower bound on the exact acceptance when the teacher is top-k.
    ranks > 0 adds ``rank_acc`` [P(label is the r-th best token) for r < ranks] (tree construction)."""
    n, top1, a = h.shape[0], 0.0, 0.0
    hits = torch.zeros(max(ranks, 1))
    has_dist = teacher.topk_ids is not None or teacher.logits is not None or teacher.hidden is not None
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        logits = h[s:e].to(weight.dtype) @ weight.t()
        t = teacher.rows(s, e)
        if t.labels is not None:
            top1 += (logits.argmax(-1) == t.labels).float().sum().item()
            if ranks:
                top = logits.topk(min(ranks, logits.shape[-1]), -1).indices  # (n, ranks)
                hits[:top.shape[1]] += (top == t.labels[:, None]).float().sum(0).cpu()
        if has_dist:
            logp, logq = t.log_pair(logits)
            if t.topk_ids is not None:  # top-k buckets only: the tail bucket could overstate acceptance
                logp, logq = logp[:, :-1], logq[:, :-1]
            a += alpha(logp, logq).sum().item()
    out = {"top1": top1 / max(1, n), "tokens": n}
    if ranks:
        out["rank_acc"] = (hits / max(1, n)).tolist()
    if has_dist:
        out["alpha"] = a / max(1, n)
    return out
