"""What every drafter that reads the target's features shares (Medusa, Hydra, MLP speculator).

Decoder protocol: ``reads_target_hidden = True``; ``max_draft_len``; ``logits_after(h, path)`` = the logits of
the token after ``path``, where h (D,) is the drafter's context state at the position that produced path[0] (the
current token) and path[1:] are drafted tokens. Head k = len(path) - 1 answers. The chain proposal and the tree
drafting (eval/proposers.py ``HeadRows``) are built on that one method; it also takes a batch of rows
(h (B, D)), which the data stage's batched writer uses (data/engine.py ``write_batch``).

The context state is the target's final hidden state itself, unless the drafter has a context layer (Hydra++'s
prefix attention): then the decoder feeds every committed position's hidden state through ``read_context`` with
the cache from ``new_context`` and drafts from the last output.

Reduced draft vocabulary (``head_vocab_size``, docs/algorithms.md A10): every head's LM head keeps only the N most
frequent response tokens (rows copied from the target's LM head), with EAGLE-3's d2t / t2d maps as checkpointed
buffers. On a 2-core CPU a head step with SmolLM2's full 49k-row LM head costs 0.125 of a target step, so four
heads cost half a step per block; 8,192 rows cut that ~10x (benchmarks/step_costs.py). ``logits_after`` still
returns target-vocabulary logits (-inf outside the kept rows), so decoders and acceptance rules never see draft
ids; training reads the small weights and maps labels / teacher ids through t2d (train/objectives.py
``shifted_teachers``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from pydantic import Field
from torch import nn

from draftsmith.models.llama import ReducedVocab
from draftsmith.models.spec import OBJ, Strict

# How a SpecDec++ acceptance head reads any heads kind (DrafterSpec.acceptance): labels made in the loop, from the
# target's features and distribution, on the state before each draft (heads have no state after one).
HEADS_ACCEPTANCE = {"inputs": OBJ + "heads_acceptance_inputs", "signals": frozenset(), "needs_target": True}


class HeadsSection(Strict):
    """Recipe fields shared by Medusa and Hydra heads (their drafter sections subclass it)."""

    n_heads: int = Field(4, gt=0)
    """K heads; head k predicts the token k+2 positions ahead (the draft length is at most K)."""
    n_layers: int = Field(1, ge=0)
    """Residual blocks per head (separate weights per block)."""
    freeze_lm_heads: bool = False
    """Keep each head's LM head (a copy of the target's) frozen and train only the blocks."""
    head_decay: float = Field(0.8, gt=0, le=1)
    """Loss weight of head k is head_decay**k."""
    draft_vocab: int | None = Field(None, gt=1)
    """Every head's LM head keeps only the N most frequent response tokens (rows of the target's LM head, d2t /
    t2d maps, EOS always kept; docs/algorithms.md A10): each head step gets ~V/N times cheaper. None = full
    vocabulary."""


@dataclass(frozen=True)
class HeadsConfig:
    """Shape of Medusa and Hydra heads (the MLP speculator has its own: stages, inner width)."""

    dim: int
    vocab_size: int
    n_heads: int = 4
    n_layers: int = 1
    head_vocab_size: int | None = None  # reduced draft vocabulary: rows of every head's LM head (None = full)

    def to_dict(self) -> dict:
        return asdict(self)


class FeatureHeads(ReducedVocab, nn.Module):
    """Reduced vocabularies reuse the draft LMs' and EAGLE's d2t / t2d machinery (models/llama.py ReducedVocab:
    subclasses call ``_init_vocab_maps`` when cfg.head_vocab_size is set, builders ``set_head_vocab``)."""

    reads_target_hidden = True

    def __init__(self):
        super().__init__()
        self.base = None  # Medusa-2 training: the LoRA-adapted copy of the target the heads read (models/medusa.py)

    @property
    def head_ids(self) -> torch.Tensor | None:
        """Target ids of the reduced head rows (n_kept,), or None for full-vocabulary heads."""
        d2t = getattr(self, "d2t", None)
        return None if d2t is None else torch.arange(len(d2t), device=d2t.device) + d2t

    def to_target(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Head logits (..., n) -> target-vocabulary logits (..., V): -inf outside a reduced vocabulary."""
        if getattr(self, "d2t", None) is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        full[..., self.head_ids] = logits
        return full

    @property
    def max_draft_len(self) -> int:
        raise NotImplementedError

    def draft_step(self, h: torch.Tensor, path: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """h (D,) with path tokens (1,) -> (logits (V,), the state head len(path) - 1 read them from (S,)); or a
        batch: h (B, D) with path tokens (B,) -> ((B, V), (B, S)). The state is what an acceptance head on these
        heads reads (models/acceptance.py), the same one the heads' forward hands ``head_fn`` in training."""
        raise NotImplementedError

    def logits_after(self, h: torch.Tensor, path: list[torch.Tensor]) -> torch.Tensor:
        """h (D,) with path tokens (1,) -> (V,); or a batch: h (B, D) with path tokens (B,) -> (B, V)."""
        return self.draft_step(h, path)[0]

    def features_in(self, signals: dict) -> bool:
        """Whether records with these signals (a manifest's) hold the features the heads read: the final hidden
        state; a Medusa-2 drafter computes its own with the adapted target."""
        return self.base is not None or "hidden_last" in signals

    @property
    def state_dim(self) -> int:
        """Width of the states ``draft_step`` returns."""
        return self.cfg.dim

    def optimize_for_inference(self) -> FeatureHeads:
        """The decoder's fast path (eval.optimize): every linear layer pre-packed for oneDNN (models/llama.py
        ``FusedLinear``); a head is a few matrix-vector products, and the LM heads dominate them. Stops training;
        parameter counts are kept for the reports."""
        from draftsmith.models.llama import FusedLinear

        counts = (self.num_params(), self.num_params(exclude_embeddings=True))
        for mod in list(self.modules()):
            for name, child in list(mod.named_children()):
                if type(child) is nn.Linear:
                    setattr(mod, name, FusedLinear(child))
        self.num_params = lambda exclude_embeddings=False: counts[exclude_embeddings]  # shadows the method
        return self.requires_grad_(False)

    def new_context(self, max_len: int, batch: int = 1):
        """A cache for ``read_context`` (None: the heads read the target's hidden states as they are)."""
        return None

    def read_context(self, hs: torch.Tensor, cache=None, pos=None, valid=None) -> torch.Tensor:
        """Target hidden states of new committed positions (n, D), or (B, n, D) for a batch (``pos`` / ``valid``
        (B, n): left-padded rows) -> the heads' context states, same shape."""
        return hs


def split_stop(stop):
    """A stop hook -> (asked after the drafter reads each draft, asked right after each draft is picked): one of
    the two is the hook, the other None (models/acceptance.py: hooks with ``before_feed``)."""
    if stop is not None and getattr(stop, "before_feed", False):
        return None, stop
    return stop, None


def first_stop(stop) -> int:
    """The first draft count a stop hook (eval/decoder.py) is asked about: 1, or 0 for a hook with ``min_len`` 0
    (it may skip drafting when even the first draft looks unsure; a hook without the attribute is asked from 1 on)."""
    return 0 if stop is not None and getattr(stop, "min_len", 1) < 1 else 1


@torch.no_grad()
def copy_target_head(lm_heads: nn.ModuleList, target, freeze: bool, keep: torch.Tensor | None = None) -> None:
    """Every head's LM head starts as a copy of the target's (its ``keep`` rows for a reduced vocabulary), frozen
    if asked (only the blocks then train)."""
    w = target.lm_head.weight if keep is None else target.lm_head.weight[keep.to(target.lm_head.weight.device)]
    for lm in lm_heads:
        lm.weight.copy_(w)
        lm.weight.requires_grad_(not freeze)


def head_vocab(n: int | None, target, counts: torch.Tensor | None, eos_ids) -> torch.Tensor | None:
    """drafter.draft_vocab = n -> the kept target ids (the N most frequent response tokens, EOS forced in), or
    None."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.draft_lm import select_vocab

    if not n or n >= target.cfg.vocab_size:
        return None
    if counts is None:
        raise DraftsmithError("drafter.draft_vocab needs training records to count token frequencies")
    return select_vocab(counts, n, set(eos_ids or ()))
