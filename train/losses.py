"""Pure distillation losses. Each takes student logits at the trained positions and returns a per-position
loss (N,); gradients flow through the student only. Teacher distributions come as stored top-k log-probs plus
the tail mass 1 - sum(top-k), treated as one extra bucket so the divergence stays a proper one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-8


def topk_buckets(student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor):
    """Project both distributions onto K+1 buckets (top-k ids + tail). Returns (log p, log q), each (N, K+1).

    student_logits (N, V) any float dtype; topk_ids (N, K) long; topk_logprobs (N, K) teacher log-probs.
    """
    logq_all = F.log_softmax(student_logits.float(), dim=-1)
    logq_k = logq_all.gather(-1, topk_ids)  # (N, K)
    logp_k = topk_logprobs.float()
    # log(1 - sum exp(.)) computed stably; the tail is clamped away from 0 (fp16 storage can round it negative).
    tail_p = (1 - logp_k.exp().sum(-1, keepdim=True)).clamp_min(EPS)
    tail_q = (1 - logq_k.exp().sum(-1, keepdim=True)).clamp_min(EPS)
    return torch.cat([logp_k, tail_p.log()], -1), torch.cat([logq_k, tail_q.log()], -1)


def forward_kl(student_logits, topk_ids, topk_logprobs) -> torch.Tensor:
    """KL(p || q) over the top-k + tail buckets, per position (N,)."""
    logp, logq = topk_buckets(student_logits, topk_ids, topk_logprobs)
    return (logp.exp() * (logp - logq)).sum(-1)


def cross_entropy(student_logits, labels) -> torch.Tensor:
    """Hard-label CE on the target-written tokens, per position (N,)."""
    return F.cross_entropy(student_logits.float(), labels, reduction="none")


@torch.no_grad()
def acceptance_lower_bound(student_logits, topk_ids, topk_logprobs) -> torch.Tensor:
    """sum_x min(p, q) over the teacher's top-k: a lower bound on the exact acceptance 1 - TVD (N,)."""
    logp, logq = topk_buckets(student_logits, topk_ids, topk_logprobs)
    return torch.minimum(logp[:, :-1].exp(), logq[:, :-1].exp()).sum(-1)
