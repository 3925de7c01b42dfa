"""Acceptance rules for chain speculative decoding (batch 1): greedy prefix matching, Leviathan/Chen rejection
sampling, and the logits -> probabilities processing shared by draft and target (docs/algorithms.md A1, C7).
Letters follow the docs: p = target, q = draft.
"""
from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits (..., V) -> fp32 probabilities (..., V) after temperature, then top-k, then top-p.

    Must be applied identically to draft and target logits (pitfall C7.2). ``temperature <= 0`` gives the
    one-hot argmax distribution, so greedy is the zero-temperature limit of the same rule.
    """
    x = logits.float()
    if temperature <= 0:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    x = x / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]  # (..., 1)
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        x = x.masked_fill(_top_p_drop(x, top_p), float("-inf"))
    return torch.softmax(x, dim=-1)


def _top_p_drop(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask (..., V) of tokens outside the smallest most-probable set whose mass reaches ``top_p``."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(-1) - probs  # mass of strictly more probable tokens
    drop_sorted = mass_before >= top_p  # the top token always has mass_before 0, so it is always kept
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def _accepted_prefix(ok: torch.Tensor) -> int:
    """Length of the leading run of True in a 1-D bool tensor (one host sync)."""
    return int(ok.long().cumprod(0).sum())


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft_tokens (γ,), target_logits (γ+1, V) -> (n accepted, next token).

    Row i of the target logits predicts the token after draft i-1, so draft i is accepted while it equals the
    target argmax there; next token is the target argmax at row n (a correction, or the bonus if n == γ).
    """
    gamma = draft_tokens.numel()
    best = target_logits.argmax(-1)  # (γ+1,)
    n = _accepted_prefix(draft_tokens == best[:gamma])
    return n, int(best[n])


def rejection_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """Standard speculative sampling. draft_tokens (γ,), draft_probs q (γ, V), target_probs p (γ+1, V).

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) (fp32, q = 0 rejects); at the first rejection draw
    the correction from normalised max(0, p_i - q_i), else the bonus from p_{γ+1}. Returns (n, next token).
    ``draft_probs`` must be the exact distributions the drafts were sampled from (pitfall C7.1).
    """
    gamma = draft_tokens.numel()
    p = target_probs.float()
    q = draft_probs.float()
    idx = draft_tokens.view(-1, 1)
    p_x = p[:gamma].gather(-1, idx).squeeze(-1)  # (γ,)
    q_x = q.gather(-1, idx).squeeze(-1)  # (γ,)
    ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(p_x))
    # u in [0, 1): P(u < ratio) = min(1, ratio), and ratio 0 (p = 0 or q = 0) never accepts.
    u = torch.rand(gamma, generator=generator, device=p.device)
    n = _accepted_prefix(u < ratio)
    if n == gamma:
        dist = p[gamma]
    else:
        dist = (p[n] - q[n]).clamp_min(0)
        if not float(dist.sum()) > 0:  # p <= q everywhere only if p == q up to rounding: fall back to p
            dist = p[n]
    return n, int(torch.multinomial(dist, 1, generator=generator))
