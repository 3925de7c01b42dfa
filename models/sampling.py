"""Logits -> probabilities processing and seeded sampling, shared by data generation and the decoder.

``process_logits`` must be applied identically to draft and target logits (docs/algorithms.md B7.2). ``sample_rows``
draws each batch row from its own ``torch.Generator`` so a row's sample depends only on its seed, never on which
other rows share the batch (batch size, data-parallel rank and resume order cannot change the data).
"""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits (..., V) -> fp32 probabilities (..., V) after temperature, then top-k, then top-p.

    ``temperature <= 0`` gives the one-hot argmax distribution, so greedy is the zero-temperature limit of the
    same rule.
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
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False  # the top token is always kept (a top_p below fp32's range rounds to 0)
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """probs (B, V) -> tokens (B,) long, row b drawn with ``generators[b]`` (one multinomial per row)."""
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


def row_generator(device, *key: int) -> torch.Generator:
    """A generator seeded from integers (recipe seed, prompt index, sample index, ...): stable across runs."""
    seed = 0
    for k in key:  # FNV-style mixing keeps (1, 23) and (12, 3) apart
        seed = (seed * 1_000_003 + int(k) + 1) % (2**63 - 1)
    return torch.Generator(device=device).manual_seed(seed)
