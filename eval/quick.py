"""A quick decoder eval for use during training: measured tau on a few held-out prompts next to the
teacher-forced estimate of tau from the per-position acceptance alpha = sum_x min(p, q) (docs/algorithms.md A1.2-A1.3).

The gap between the two says how far the i.i.d.-acceptance model is from the real decoder (acceptance falls with
depth, and drafts condition on the drafter's own earlier drafts, which teacher forcing never shows it).
"""

from __future__ import annotations

import torch

from draftsmith.eval.decoder import DecodeStats, reads_target, speculative_generate
from draftsmith.models.sampling import process_logits


def tau_from_alpha(alpha: float, draft_len: int) -> float:
    """Expected tokens per target forward if every draft is accepted independently with probability alpha."""
    return float(sum(alpha**k for k in range(draft_len + 1)))


@torch.no_grad()
def teacher_forced_alpha(target, drafter, seq: torch.Tensor, start: int, temperature: float) -> torch.Tensor:
    """alpha_t = sum_x min(p_t, q_t) at every position predicting seq[start:], both models reading seq (T,).
    At temperature 0 the processed distributions are one-hot, so alpha_t = 1[argmax q == argmax p]."""
    ids = seq.view(1, -1)
    p = process_logits(target(ids)[0, start - 1 : -1], temperature)  # (n, V)
    q = process_logits(drafter(ids)[0, start - 1 : -1], temperature)
    return torch.minimum(p, q).sum(-1)


@torch.no_grad()
def quick_eval(
    target,
    drafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    draft_len: int,
    temperature: float = 0.0,
    eos_ids: set[int] | None = None,
    seed: int = 0,
    tree=None,
    stop_drafting=None,
) -> dict:
    """Decode each prompt speculatively (a chain of ``draft_len``, or ``tree``; ``stop_drafting``: the recipe's
    stop rule), then score the produced sequences teacher-forced. Returns
    {tau_measured, tau_estimate, tau_gap, alpha, acceptance_rate}; the estimate is the chain's."""
    device = next(target.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    stats, alphas = DecodeStats(), []
    for ids in prompts:
        prompt = torch.tensor(ids, device=device)
        kw = {"tree": tree, "stop_drafting": stop_drafting, "eos_ids": eos_ids, "generator": gen}
        out, st = speculative_generate(
            target, drafter, prompt, max_new_tokens, draft_len=draft_len, temperature=temperature, **kw
        )
        stats.merge(st)
        # heads / EAGLE: the loop logs alpha per head or TTT step; a draft with its own vocabulary has no per-token
        # distribution over the target's tokens to score
        if len(out) > 1 and not reads_target(drafter) and not getattr(drafter, "own_vocab", False):
            seq = torch.cat([prompt, torch.tensor(out, device=device)])
            alphas.append(teacher_forced_alpha(target, drafter, seq, len(ids), temperature))
    out = {"tau_measured": stats.tau, "acceptance_rate": stats.acceptance_rate}
    if alphas:
        alpha = float(torch.cat(alphas).mean())
        est = tau_from_alpha(alpha, draft_len)
        out.update(tau_estimate=est, tau_gap=stats.tau - est, alpha=alpha)
    return out
