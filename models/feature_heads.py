"""What every drafter that reads the target's features shares (Medusa, Hydra, MLP speculator).

Decoder protocol: ``reads_target_hidden = True``; ``max_draft_len``; ``logits_after(h, path)`` = the logits of
the token after ``path``, where h (D,) is the drafter's context state at the position that produced path[0] (the
current token) and path[1:] are drafted tokens. Head k = len(path) - 1 answers. The chain proposal and the tree
drafting in eval/decoder.py are built on that one method.

The context state is the target's final hidden state itself, unless the drafter has a context layer (Hydra++'s
prefix attention): then the decoder feeds every committed position's hidden state through ``read_context`` with
the cache from ``new_context`` and drafts from the last output.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class HeadsConfig:
    """Shape of Medusa and Hydra heads (the MLP speculator has its own: stages, inner width)."""
    dim: int
    vocab_size: int
    n_heads: int = 4
    n_layers: int = 1

    def to_dict(self) -> dict:
        return asdict(self)


class FeatureHeads(nn.Module):
    reads_target_hidden = True

    @property
    def max_draft_len(self) -> int:
        raise NotImplementedError

    def logits_after(self, h: torch.Tensor, path: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def new_context(self, max_len: int):
        """A cache for ``read_context`` (None: the heads read the target's hidden states as they are)."""
        return None

    def read_context(self, hs: torch.Tensor, cache=None) -> torch.Tensor:
        """Target hidden states of new committed positions (n, D) -> the heads' context states (n, D)."""
        return hs

    @torch.no_grad()
    def propose(self, h: torch.Tensor, cur: torch.Tensor, gamma: int, pick):
        """A chain of up to gamma drafts after ``cur``. pick(logits (V,)) -> (token (1,), q (V,) or None); each
        draft is drawn from the q it reports, which is all rejection sampling needs."""
        path, qs = [cur], []
        for _ in range(min(gamma, self.max_draft_len)):
            tok, q = pick(self.logits_after(h, path))
            path.append(tok)
            qs.append(q)
        if len(path) == 1:
            return cur.new_empty(0), None
        return torch.cat(path[1:]), (torch.stack(qs) if qs[0] is not None else None)


@torch.no_grad()
def copy_target_head(lm_heads: nn.ModuleList, target, freeze: bool) -> None:
    """Every head's LM head starts as a copy of the target's, frozen if asked (only the blocks then train)."""
    for lm in lm_heads:
        lm.weight.copy_(target.lm_head.weight)
        lm.weight.requires_grad_(not freeze)
