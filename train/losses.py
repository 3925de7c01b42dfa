"""Distillation losses, each defined once (docs/algorithms.md A2.2, A3, A3.4), and one chunked LM-head driver.

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
kernels on GPU). With ``LossSpec.vocab_chunk`` the vocabulary is taken in blocks too (``_Blocks``): every loss is
a function of per-row sums over the vocabulary, so peak memory is O(chunk x block), for the student and a full
target teacher alike, at the price of recomputed head matmuls.
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
        return replace(
            self,
            **{
                f.name: getattr(self, f.name)[s:e]
                for f in fields(self)
                if f.name != "head" and getattr(self, f.name) is not None
            },
        )

    def sharpened(self, temperature: float) -> Teacher:
        """The teacher at ``temperature`` (p^(1/t), renormalised; t < 1 sharpens it towards its argmax, the token
        a greedy verifier accepts). Full teachers are exact (logits / t; hidden / t, since the head is linear).
        Stored top-k: each tail token has p <= p_min (the k-th largest), so its sharpened weight p^(1/t) is at
        most p * p_min^(1/t - 1): the tail keeps that bound, m * p_min^(1/t - 1), and the top-k are renormalised
        with it. For t <= 1 the top-k probabilities are then a lower bound on the exact ones (tested)."""
        if temperature == 1.0:
            return self
        if self.topk_ids is not None:
            lp = self.topk_logprobs.float()
            tail = (1 - lp.exp().sum(-1, keepdim=True)).clamp_min(0)
            s = lp / temperature
            tail_w = tail * (lp.min(-1, keepdim=True).values * (1 / temperature - 1)).exp()
            logz = torch.logaddexp(s.logsumexp(-1, keepdim=True), tail_w.clamp_min(1e-30).log())
            return replace(self, topk_logprobs=s - logz)
        if self.logits is not None:
            return replace(self, logits=self.logits / temperature)
        if self.hidden is not None:
            return replace(self, hidden=self.hidden / temperature)
        return self

    def top(self, k: int, chunk: int = 256) -> Teacher:
        """The teacher's k most likely tokens as a stored top-k teacher (ids, log-probs; best first): stored top-k
        keep their first k, full teachers (logits, or hidden states through the head) are ranked chunk by chunk."""
        if self.topk_ids is not None:
            return replace(self, topk_ids=self.topk_ids[:, :k], topk_logprobs=self.topk_logprobs[:, :k])
        if self.logits is None and self.hidden is None:
            raise ValueError(
                "train.loss.hod_weight needs the teacher's distribution: store data.signals.topk, or set "
                "train.loss.teacher=target"
            )
        ids, lps = [], []
        n = (self.logits if self.logits is not None else self.hidden).shape[0]
        for s in range(0, n, chunk):
            t = self.rows(s, min(n, s + chunk))
            z = t.logits if t.logits is not None else t.hidden.to(self.head.dtype) @ self.head.t()
            v, i = F.log_softmax(z.float(), -1).topk(min(k, z.shape[-1]), -1)
            ids.append(i)
            lps.append(v)
        return Teacher(labels=self.labels, topk_ids=torch.cat(ids), topk_logprobs=torch.cat(lps))

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
# Each is combine(S), S (N, m) the sums over the support of m per-entry terms. Sums over blocks of the vocabulary
# add up, so the vocabulary-blocked driver below (``_blocked_divergence``) computes the same value and gradient
# without ever holding a (chunk, V) tensor; on a whole support this is just the textbook formula.


class Divergence:
    """``terms(logp, logq, beta)`` -> m per-entry tensors, summed over the support; ``combine(S, kl_scale,
    kl_decay)`` -> (N,). Called as ``div(logp, logq, beta=, kl_scale=, kl_decay=)`` on a whole support."""

    def __init__(self, terms, combine=None):
        self.terms, self.combine = terms, combine or (lambda s, **_: s[:, 0])
        self.__doc__ = terms.__doc__

    def sums(self, logp, logq, beta: float = 0.5) -> torch.Tensor:
        return torch.stack([t.sum(-1) for t in self.terms(logp, logq, beta)], -1)

    def __call__(self, logp, logq, beta: float = 0.5, kl_scale: float = 1.0, kl_decay: float = 1.0, **_):
        return self.combine(self.sums(logp, logq, beta), kl_scale=kl_scale, kl_decay=kl_decay)


def _fkl_terms(logp, logq, beta):
    """KL(p || q): mass-covering; soft cross-entropy against p up to a constant."""
    return (logp.exp() * (logp - logq),)


def _rkl_terms(logp, logq, beta):
    """KL(q || p): mode-seeking."""
    return (logq.exp() * (logq - logp),)


def _jsd_terms(logp, logq, beta):
    """beta KL(p || M) + (1 - beta) KL(q || M), M = beta p + (1 - beta) q (GKD's convention)."""
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
    return (beta * logp.exp() * (logp - logm) + (1 - beta) * logq.exp() * (logq - logm),)


def _tvd_terms(logp, logq, beta):
    """1/2 sum |p - q| = 1 - alpha: exactly the rejection probability of one draft."""
    return (0.5 * (logp.exp() - logq.exp()).abs(),)


def _min_terms(logp, logq, beta):
    """-log alpha (the LK "alpha" loss): TVD with a 1/alpha gradient boost where acceptance is low."""
    return (torch.minimum(logp.exp(), logq.exp()),)


def _lk_terms(logp, logq, beta):
    """LK hybrid: lambda KL(p || q) + (1 - lambda)(1 - alpha), lambda = kl_scale exp(-kl_decay alpha): KL while
    the draft is poor (strong gradients), acceptance once it is good."""
    return _min_terms(logp, logq, beta) + _fkl_terms(logp, logq, beta)


def _lk_combine(s, kl_scale=1.0, kl_decay=1.0, **_):
    a, kl = s[:, 0], s[:, 1]
    lam = kl_scale * torch.exp(-kl_decay * a.detach())
    return lam * kl + (1 - lam) * (1 - a)


def _tvdpp_full_terms(logp, logq, beta):
    """TVD++, full-support variant: reward r(v) = 1[p(v) > q(v)] standardised over the support per position,
    loss = -mean_v r_hat(v) log q(v). Weights every outcome equally, not by q: a different estimator from the
    sampled one (docs/algorithms.md A3.3 b)."""
    r = (logp > logq).to(logq.dtype)
    return r, r * logq, logq, torch.ones_like(logq)


def _tvdpp_full_combine(s, **_):
    # sum r (= sum r^2: r is 0/1) and the support size carry no gradient; the std is torch's unbiased one.
    sr, n = s[:, 0].detach(), s[:, 3].detach()
    mu = sr / n
    sd = ((sr - n * mu * mu) / (n - 1).clamp_min(1)).clamp_min(0).sqrt()
    return -(s[:, 1] - mu * s[:, 2]) / (sd + EPS) / n


fkl = Divergence(_fkl_terms)
rkl = Divergence(_rkl_terms)
jsd = Divergence(_jsd_terms)
tvd = Divergence(_tvd_terms)
neg_log_alpha = Divergence(_min_terms, lambda s, **_: -s[:, 0].clamp_min(EPS).log())
lk = Divergence(_lk_terms, _lk_combine)
tvdpp_full = Divergence(_tvdpp_full_terms, _tvdpp_full_combine)


def _hod_terms(logp, logq, beta):
    """-sum over the teacher's top-k of p log q: HASS's harmonized objective distillation, on the top-k buckets of
    ``Teacher.top`` (the last entry, the tail, carries no term)."""
    return (-(logp[..., :-1].exp() * logq[..., :-1]),)


hod = Divergence(_hod_terms)


def alpha(logp, logq) -> torch.Tensor:
    """Acceptance probability sum min(p, q) per position."""
    return _min_terms(logp, logq, 0.5)[0].sum(-1)


def ce(student_logits, labels):
    """Hard-label CE on the target-written tokens, per position (N,)."""
    return F.cross_entropy(student_logits.float(), labels, reduction="none")


def hidden_regression(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Smooth-L1 between predicted and target hidden states, per position (N,) (EAGLE's feature loss)."""
    return F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)


DIVERGENCES = {
    "fkl": fkl,
    "rkl": rkl,
    "jsd": jsd,
    "tvd": tvd,
    "neg_log_alpha": neg_log_alpha,
    "lk": lk,
    "tvdpp_full": tvdpp_full,
}
LOSS_KINDS = ("ce", *DIVERGENCES, "tvdpp")


# ---- TVD++ (sampled policy gradient) -------------------------------------------------------------------------------


@torch.no_grad()
def tvdpp_rewards(logp, logq, generator: torch.Generator | None = None):
    """Sample x ~ q per position; reward r = 1[p(x) > q(x)]. Returns (x (N,), r (N,)), on the given support.
    Inverse-CDF sampling from one uniform per row, so the vocabulary-blocked driver draws the same x."""
    u = torch.rand(logq.shape[0], 1, generator=generator, device=logq.device, dtype=logq.dtype)
    x = inverse_cdf(logq.exp().cumsum(-1), u)
    r = (logp.gather(-1, x[:, None]) > logq.gather(-1, x[:, None])).float().squeeze(-1)
    return x, r


def inverse_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index whose cumulative mass exceeds u (N, 1): P(x = i) = cdf_i - cdf_(i-1). A u beyond the rounded
    total (~1e-7 of draws) takes the last index."""
    return torch.searchsorted(cdf, u, right=True).clamp_max(cdf.shape[-1] - 1).squeeze(-1)


def tvdpp_sampled(logq, x, r_hat):
    """-r_hat(x) log q(x) per position: REINFORCE on the TVD reward with a standardised baseline (A3.2)."""
    return -(r_hat * logq.gather(-1, x[:, None]).squeeze(-1))


@dataclass
class LossSpec:
    kind: str = "fkl"
    beta: float = 0.5
    kl_scale: float = 1.0
    kl_decay: float = 1.0
    chunk: int | None = 256  # positions per chunk; None: ``auto_chunk`` of the head
    fused: bool = True  # CE and stored top-k teachers: the gradient from two in-place softmax passes (below)
    vocab_chunk: int = 0  # > 0: also block the vocabulary (``_Blocks``): peak O(chunk x vocab_chunk), not chunk x V
    teacher_temperature: float = 1.0  # the loss sees Teacher.sharpened(t); metrics (alpha) keep the true teacher
    hod_weight: float = 0.0  # > 0: add hod_weight x HASS's top-k loss (``_hod_terms``) on the teacher's hod_k best
    hod_k: int = 10


LOGITS_BUDGET = 1 << 26  # values in one chunk's logits on a GPU (256 MB in float32)


def auto_chunk(weight: torch.Tensor) -> int:
    """Positions per LM-head chunk for a head ``weight`` (V, D): 256 on a CPU; on a GPU as many as keep a chunk's
    logits within ``LOGITS_BUDGET`` values (8,192 positions for an 8k draft vocabulary, 512 for 128k), at least 256,
    so a step launches a few large kernels rather than hundreds of small ones."""
    if weight.device.type != "cuda":
        return 256
    return max(256, LOGITS_BUDGET // max(1, weight.shape[0]))


def _per_position(spec: LossSpec, logits, teacher: Teacher, sample=None) -> torch.Tensor:
    if spec.kind == "ce":
        return ce(logits, teacher.labels)
    return _on_support(spec, *teacher.log_pair(logits), sample)


def _on_support(spec: LossSpec, logp, logq, sample=None) -> torch.Tensor:
    if spec.kind == "hod":
        return hod(logp, logq)
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

    ids = _gather_ids(spec, teacher, sample)
    lse = row_logsumexp(logits)
    zk = logits.gather(-1, ids.clamp_min(0)).float().requires_grad_(need_grad)
    with torch.enable_grad():
        loss = _gathered_loss(spec, zk - lse[:, None], ids, teacher, sample)
    if need_grad:
        (gk,) = torch.autograd.grad(loss, zk)  # ids < 0 (outside a reduced vocabulary) get 0: no student mass
        softmax_scale_(logits, lse, -gk.sum(-1))
        logits.scatter_add_(-1, ids.clamp_min(0), gk.to(logits.dtype))
    return loss.detach()


def _gather_ids(spec: LossSpec, teacher: Teacher, sample) -> torch.Tensor:
    """The K ids per row a gathered loss reads: the label (CE), the teacher's top-k, or the TVD++ sample."""
    if spec.kind == "ce":
        return teacher.labels[:, None]
    if teacher.topk_ids is not None:
        return teacher.topk_ids
    return sample[0][:, None]  # tvdpp against a full teacher: -r_hat log q(x)


def _gathered_loss(spec: LossSpec, logq_k, ids, teacher: Teacher, sample) -> torch.Tensor:
    if spec.kind == "ce":
        return -logq_k[:, 0].sum()
    if teacher.topk_ids is not None:
        return _on_support(spec, *gathered_buckets(logq_k, ids, teacher.topk_logprobs), sample).sum()
    return -(sample[1] * logq_k[:, 0]).sum()


# ---- vocabulary blocks: no (chunk, V) tensor at all -----------------------------------------------------------------


class _Blocks:
    """One position chunk's student logits hc @ W[v0:v1]^T and teacher logits (stored, or from the target's
    hidden state and head) a block of the vocabulary at a time. Every quantity the losses need is a per-row sum
    over the vocabulary, so it is assembled block by block: logsumexps online (pass 1), then the divergence's
    sums (pass 2), then the gradient (last pass, recomputing the block's logits). Peak memory O(chunk x block);
    the price is recomputed head matmuls: one more pass for gathered losses (CE, top-k, sampled TVD++), two more
    for full-teacher divergences (Cut Cross-Entropy makes the same trade)."""

    def __init__(self, hc, w, teacher: Teacher, size: int):
        self.hc, self.w, self.t = hc, w, teacher
        self.spans = [(v0, min(v0 + size, w.shape[0])) for v0 in range(0, w.shape[0], size)]

    def student(self, v0, v1) -> torch.Tensor:
        return (self.hc @ self.w[v0:v1].t()).float()

    def teacher(self, v0, v1) -> torch.Tensor:
        t = self.t
        if t.logits is not None:
            return t.logits[:, v0:v1].float()
        if t.hidden is None:
            raise ValueError("teacher has neither top-k log-probs nor logits nor hidden states")
        return (t.hidden.to(t.head.dtype) @ t.head[v0:v1].t()).float()

    def lse(self, ids=None, teacher: bool = False):
        """Pass 1: the student's logsumexp (n,), the teacher's (or None), and the student's logits at ids (n, K)."""
        n, dev = self.hc.shape[0], self.hc.device
        mq = mp = torch.full((n,), -math.inf, device=dev)  # _online_lse never writes in place
        sq = sp = torch.zeros(n, device=dev)
        zk = None if ids is None else torch.zeros(ids.shape, device=dev)
        for v0, v1 in self.spans:
            z = self.student(v0, v1)
            mq, sq = _online_lse(mq, sq, z)
            if ids is not None:
                zk = torch.where((ids >= v0) & (ids < v1), z.gather(-1, (ids - v0).clamp(0, v1 - v0 - 1)), zk)
            if teacher:
                mp, sp = _online_lse(mp, sp, self.teacher(v0, v1))
        return mq + sq.log(), (mp + sp.log()) if teacher else None, zk

    def top(self, r: int) -> torch.Tensor:
        """Indices of the student's r largest logits per row (n, r), by a running merge over blocks."""
        vals = idx = None
        for v0, v1 in self.spans:
            v, i = self.student(v0, v1).topk(min(r, v1 - v0), -1)
            if vals is not None:
                v, i = torch.cat([vals, v], -1), torch.cat([idx, i + v0], -1)
                v, j = v.topk(min(r, v.shape[-1]), -1)
                i = i.gather(-1, j)
            vals, idx = v, i
        return idx

    def add_grads(self, g, v0, v1, gh, grad_w):
        """The head matmuls of one block's logit gradient g (n, block), accumulated in place."""
        g = g.to(self.w.dtype)
        if gh is not None:
            gh += (g @ self.w[v0:v1]).float()
        if grad_w is not None:
            grad_w[v0:v1].addmm_(g.t(), self.hc)


def _online_lse(m, s, z):
    """Running (max, sum of exp(z - max)) per row, updated with the block z."""
    new = torch.maximum(m, z.max(-1).values)
    return new, s * (m - new).exp() + (z - new[:, None]).exp().sum(-1)


def _blocked_gather(spec: LossSpec, B: _Blocks, sample, gh, grad_w):
    """Losses that read log q at K ids per row (see ``_fused_chunk``): pass 1 with the gather, autograd on (n, K),
    then one gradient pass: d loss / d z = scatter(g_k) - softmax(z) sum_k g_k, block by block."""
    ids = _gather_ids(spec, B.t, sample)
    lse, _, zk = B.lse(ids)
    need = gh is not None or grad_w is not None
    zk.requires_grad_(need)
    with torch.enable_grad():
        loss = _gathered_loss(spec, zk - lse[:, None], ids, B.t, sample)
    if need:
        from draftsmith.kernels.softmax import softmax_scale_

        (gk,) = torch.autograd.grad(loss, zk)
        neg_gsum = -gk.sum(-1)
        for v0, v1 in B.spans:
            g = softmax_scale_(B.student(v0, v1), lse, neg_gsum)  # the fused path's in-place pass, per block
            inside = (ids >= v0) & (ids < v1)
            g.scatter_add_(-1, (ids - v0).clamp(0, v1 - v0 - 1), torch.where(inside, gk, 0))
            B.add_grads(g, v0, v1, gh, grad_w)
    return loss.detach()


def _blocked_divergence(spec: LossSpec, B: _Blocks, gh, grad_w):
    """A divergence against a full teacher, L = combine(S), S_k = sum_v term_k(log p_v, log q_v). With
    c_k = dL/dS_k (autograd on (n, m)) and direct_v = sum_k c_k d term_k / d log q_v, the logit gradient is
    direct - q sum_v direct_v, and sum_v direct_v = sum_k c_k T_k where T_k = d S_k / d(shift of all log q),
    taken in the same pass as S."""
    div = DIVERGENCES[spec.kind]
    need = gh is not None or grad_w is not None
    lse_q, lse_p, _ = B.lse(teacher=True)
    n = lse_q.shape[0]
    S = T = torch.zeros(n, 1, device=lse_q.device)
    for v0, v1 in B.spans:
        logp, logq = B.teacher(v0, v1) - lse_p[:, None], B.student(v0, v1) - lse_q[:, None]
        if not need:
            S = S + div.sums(logp, logq, spec.beta)
            continue
        shift = torch.zeros(n, 1, device=logq.device, requires_grad=True)
        with torch.enable_grad():
            s_b = div.sums(logp, logq + shift, spec.beta)
            # d S_k / d shift, one small backward per term (terms like TVD++'s reward count have none)
            t_b = torch.stack(
                [
                    torch.autograd.grad(
                        s_b[:, k].sum(), shift, retain_graph=True, allow_unused=True, materialize_grads=True
                    )[0][:, 0]
                    for k in range(s_b.shape[1])
                ],
                -1,
            )
        S, T = S + s_b.detach(), T + t_b
    S.requires_grad_(need)
    with torch.enable_grad():
        loss = div.combine(S, kl_scale=spec.kl_scale, kl_decay=spec.kl_decay).sum()
    if need:
        (c,) = torch.autograd.grad(loss, S)
        through_lse = -(c * T).sum(-1, keepdim=True)
        for v0, v1 in B.spans:
            logp = B.teacher(v0, v1) - lse_p[:, None]
            logq = (B.student(v0, v1) - lse_q[:, None]).requires_grad_()
            with torch.enable_grad():
                (g,) = torch.autograd.grad((div.sums(logp, logq, spec.beta) * c).sum(), logq)
            B.add_grads(g.add_(logq.detach().exp_().mul_(through_lse)), v0, v1, gh, grad_w)
    return loss.detach()


@torch.no_grad()
def _blocked_tvdpp_sample(B: _Blocks, generator):
    """TVD++'s x ~ q and reward 1[p(x) > q(x)] without (n, V) tensors: the same uniform and inverse CDF as
    ``tvdpp_rewards``, walked over the blocks."""
    t = B.t
    if t.topk_ids is not None:  # on the K + 1 buckets, which need log q at the top-k ids only
        lse, _, zk = B.lse(t.topk_ids)
        return tvdpp_rewards(*gathered_buckets(zk - lse[:, None], t.topk_ids, t.topk_logprobs), generator)
    lse_q, lse_p, _ = B.lse(teacher=True)
    n = lse_q.shape[0]
    u = torch.rand(n, 1, generator=generator, device=lse_q.device, dtype=lse_q.dtype)
    x = torch.full((n,), -1, dtype=torch.long, device=lse_q.device)
    lpx, lqx = torch.zeros(n, device=x.device), torch.zeros(n, device=x.device)
    base = torch.zeros(n, 1, device=x.device)
    for v0, v1 in B.spans:
        logq = B.student(v0, v1) - lse_q[:, None]
        cdf = base + logq.exp().cumsum(-1)
        # the last block takes every row still open (u beyond the rounded total), as inverse_cdf does
        hit = (x < 0) & ((u[:, 0] < cdf[:, -1]) | (v1 == B.w.shape[0]))
        i = inverse_cdf(cdf, u)
        x = torch.where(hit, v0 + i, x)
        lqx = torch.where(hit, logq.gather(-1, i[:, None])[:, 0], lqx)
        lpx = torch.where(hit, (B.teacher(v0, v1) - lse_p[:, None]).gather(-1, i[:, None])[:, 0], lpx)
        base = cdf[:, -1:]
    return x, (lpx > lqx).float()


# ---- one driver: hidden states + LM head -> loss, chunked over positions (and optionally the vocabulary) ---------


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
            if _blocked(spec, w):
                B = _Blocks(hc, w, teacher.rows(s, e), spec.vocab_chunk)
                gh = torch.zeros(hc.shape, device=h.device) if need_h else None
                gw = grad_w if need_w else None
                if spec.kind in ("ce", "tvdpp") or teacher.topk_ids is not None:
                    total += _blocked_gather(spec, B, sample, gh, gw)
                else:
                    total += _blocked_divergence(spec, B, gh, gw)
                if need_h:
                    grad_h[s:e] = gh.to(h.dtype)
                continue
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


def _blocked(spec: LossSpec, w: torch.Tensor) -> bool:
    return 0 < spec.vocab_chunk < w.shape[0]


def head_loss(
    h: torch.Tensor, weight: torch.Tensor, teacher: Teacher, spec: LossSpec, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Mean over the N positions of ``spec.kind`` between the student ``h @ weight.T`` and the teacher.

    h (N, D) student final hidden states at the trained positions; weight (V', D) its LM head (V' may be a
    reduced vocabulary: then teacher top-k ids must already be in student index space, -1 where absent).
    TVD++ first draws x ~ q and standardises the rewards over all N positions (a no-grad pass), then takes the
    policy-gradient step on the same samples.
    """
    if not spec.chunk:
        spec = replace(spec, chunk=auto_chunk(weight))
    teacher = teacher.sharpened(spec.teacher_temperature) if spec.kind != "ce" else teacher
    samples = None
    if spec.kind == "tvdpp":
        xs, rs = [], []
        with torch.no_grad():
            for s in range(0, h.shape[0], spec.chunk):
                e = min(s + spec.chunk, h.shape[0])
                if _blocked(spec, weight):
                    x, r = _blocked_tvdpp_sample(
                        _Blocks(h[s:e].to(weight.dtype), weight, teacher.rows(s, e), spec.vocab_chunk), generator
                    )
                else:
                    x, r = tvdpp_rewards(*teacher.rows(s, e).log_pair(h[s:e].to(weight.dtype) @ weight.t()), generator)
                xs.append(x)
                rs.append(r)
        r = torch.cat(rs)
        samples = (torch.cat(xs), (r - r.mean()) / (r.std() + EPS) if r.numel() > 1 else r - r.mean())
    total = _ChunkedHeadLoss.apply(h, weight, spec, teacher, samples)
    if spec.hod_weight:  # HASS: the teacher's top-k tokens once more, each weighted by its p
        top = teacher.top(spec.hod_k, spec.chunk)
        total = total + spec.hod_weight * _ChunkedHeadLoss.apply(h, weight, replace(spec, kind="hod"), top, None)
    return total / max(1, h.shape[0])


@torch.no_grad()
def head_metrics(
    h: torch.Tensor,
    weight: torch.Tensor,
    teacher: Teacher,
    chunk: int | None = 1024,
    ranks: int = 0,
    vocab_chunk: int = 0,
) -> dict:
    """Chunked metrics at the trained positions: top-1 agreement with the labels, and (with a teacher
    distribution) alpha = sum min(p, q), a lower bound on the exact acceptance when the teacher is top-k.
    ranks > 0 adds ``rank_acc`` [P(label is the r-th best token) for r < ranks] (tree construction).
    vocab_chunk as in LossSpec: the vocabulary in blocks too, so no (chunk, V) tensor. chunk None: ``auto_chunk``.

    Values are 0-dim (``rank_acc``: (ranks,)) tensors on h's device (float32; float64 for a float64 h), never
    read by the host here: the train loop reads a logging window's metrics in one copy, so no step waits for the
    device."""
    n, dt = h.shape[0], torch.float64 if h.dtype == torch.float64 else torch.float32
    chunk = chunk or auto_chunk(weight)
    top1, a, hits = h.new_zeros((), dtype=dt), h.new_zeros((), dtype=dt), h.new_zeros(max(ranks, 1), dtype=dt)
    has_dist = teacher.topk_ids is not None or teacher.logits is not None or teacher.hidden is not None
    blocked = 0 < vocab_chunk < weight.shape[0]
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        t = teacher.rows(s, e)
        if blocked:
            B = _Blocks(h[s:e].to(weight.dtype), weight, t, vocab_chunk)
            top = B.top(max(ranks, 1))
        else:
            logits = h[s:e].to(weight.dtype) @ weight.t()
            top = logits.topk(min(max(ranks, 1), logits.shape[-1]), -1).indices  # (n, ranks), best first
        if t.labels is not None:
            top1 += (top[:, 0] == t.labels).sum(dtype=dt)
            if ranks:
                hits[: top.shape[1]] += (top == t.labels[:, None]).sum(0, dtype=dt)
        if not has_dist:
            continue
        if t.topk_ids is not None:  # top-k buckets only: the tail bucket could overstate acceptance
            if blocked:
                lse, _, zk = B.lse(t.topk_ids)
                logp, logq = gathered_buckets(zk - lse[:, None], t.topk_ids, t.topk_logprobs)
            else:
                logp, logq = t.log_pair(logits)
            a += alpha(logp[:, :-1], logq[:, :-1]).sum().to(dt)
        elif blocked:
            lse_q, lse_p, _ = B.lse(teacher=True)
            for v0, v1 in B.spans:
                a += alpha(B.teacher(v0, v1) - lse_p[:, None], B.student(v0, v1) - lse_q[:, None]).sum().to(dt)
        else:
            a += alpha(*t.log_pair(logits)).sum().to(dt)
    out = {"top1": top1 / max(1, n), "tokens": n}
    if ranks:
        out["rank_acc"] = hits / max(1, n)
    if has_dist:
        out["alpha"] = a / max(1, n)
    return out
