"""SpecDec++ acceptance predictor (algorithms.md A7) and the adaptive draft-length rules that use it.

The head reads a frozen drafter's state at the position of a just-drafted token and predicts the probability
that speculative sampling accepts that token: ``ResBlock^L -> Linear(d -> 1)`` (one logit instead of the
reference's two-way softmax; the same model). It trains with weighted soft-label BCE on labels min(1, p(y)/q(y))
for the drafter's sample y (train/objectives.py):
- a standalone draft LM: the data stage's SpecDec++ labels (``data.specdec_labels``); the head reads the draft's
  final normed state;
- an EAGLE drafter (``draft_kind`` eagle): labels are made in the loop, since they need the target's features
  anyway. The drafter, teacher-forced on the target's features, drafts y for the next position; the frozen
  target scores it; the drafter reads its own y (a TTT step with y as the token, ``Eagle.forward``
  ``step_tokens``) and the head reads that state through the drafter's ``head_input``, exactly the state the
  chain decoder hands a stop rule after the first draft.

Which state the head reads (``state``):
- ``after`` (the paper): the state after the drafter has read the draft. To judge draft n the drafter must read
  it first, so a block the rule ends costs one drafter forward more than a fixed length of the same size.
- ``before``: the state that *produced* draft n, plus the draft's own log-probability log q(y) and the entropy
  of q (both from the raw logits). Nothing extra runs when the rule stops. For greedy verification it is also
  the exact conditional the threshold rule multiplies: draft n matters only when drafts 1..n-1 were accepted,
  i.e. when the drafter's prefix is the target's own text, which is what the head is trained on (no mixing).

In the decoder, a *stop rule* decides after each draft whether to end the block (eval/decoder.py ``_draft``):
- ``AcceptanceStop``: keep P = prod of predicted acceptances of this block's drafts; stop once 1 - P > threshold
  (the paper's threshold policy);
- ``EntropyStop``: training-free baseline (SVIP-style): stop once the draft's next-token entropy exceeds a
  threshold (nats); ``before``: stop after a draft whose own distribution's entropy exceeded it.
- ``ConfidenceStop``: training-free, the threshold policy above with the drafter's own probability of its draft
  as the acceptance estimate (EAGLE-2 found draft confidence tracks acceptance). ``after``: asked before each
  next draft, it multiplies in that draft's top probability and drafts it only while 1 - P <= threshold, so a
  draft it distrusts never reaches the verify; with min_len 0 a step may draft nothing. ``before``: q(draft n).
A rule with ``before_feed`` set is asked right after draft n is picked, with the logits and state that produced
it and the draft itself: ``stop(n, logits, hidden, token)``; otherwise after the drafter has read draft n:
``stop(n, logits, hidden)``. Both respect ``min_len``; ``eval.draft_len`` stays the cap. Neither changes the
output (lossless either way).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.medusa import ResBlock

N_EXTRA = 2  # log q(y) and the entropy of q, appended to the producing state of a ``before`` head


def acceptance_features(hidden: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A ``before`` head's input: the state that produced the draft (..., d), its raw logits (..., V) and the draft
    y (...) -> (..., d + 2) = [state, log q(y), entropy of q] (q = softmax of the raw logits, whatever the decoding
    temperature, so training and decoding see the same numbers)."""
    logp = torch.log_softmax(logits.float(), -1)
    return torch.cat([hidden.float(), logp.gather(-1, y[..., None].long()), _entropy(logp)[..., None]], -1)


def _entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of log-probs (..., V) -> (...); -inf rows (reduced vocabularies) count as zero."""
    return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)


@dataclass(frozen=True)
class AcceptanceConfig:
    dim: int
    n_layers: int = 3
    draft: str | None = None  # the drafter checkpoint folder the head was trained on
    draft_kind: str = "draft_lm"  # its kind: draft_lm or eagle
    state: str = "after"  # after: the state after reading the draft (the paper); before: the producing state

    def to_dict(self) -> dict:
        return asdict(self)


class AcceptanceHead(nn.Module):
    """Predicted acceptance logit from a draft hidden state (..., d) -> (...)."""

    checkpoint_exclude = ("draft.",)  # the frozen draft LM has its own checkpoint (cfg.draft)

    def __init__(self, cfg: AcceptanceConfig):
        super().__init__()
        self.cfg = cfg
        # before: the producing state and two scalars of the draft's own distribution (acceptance_features)
        self.inp = nn.Linear(cfg.dim + N_EXTRA, cfg.dim) if cfg.state == "before" else None
        self.blocks = nn.Sequential(*(ResBlock(cfg.dim) for _ in range(cfg.n_layers)))  # separate instances
        self.out = nn.Linear(cfg.dim, 1)
        self.draft = None  # training only: the frozen draft LM whose states the head reads

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., d), or (..., d + 2) from ``acceptance_features`` for a ``before`` head -> logit (...)."""
        return self.out(self.blocks(h if self.inp is None else self.inp(h))).squeeze(-1)

    @property
    def signals_needed(self) -> set[str]:
        """Record signals the objective reads: stored labels for a draft LM; none for EAGLE (made in the loop)."""
        return set() if self.cfg.draft_kind == "eagle" else {"specdec"}

    @property
    def needs_target(self) -> bool:
        """Whether the loop must run the frozen target (EAGLE: its features and its distribution)."""
        return self.cfg.draft_kind == "eagle"

    def num_params(self, exclude_embeddings: bool = False) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if not n.startswith("draft."))


def build_acceptance_head(params: dict, target, **_) -> AcceptanceHead:
    """A fresh head on the frozen drafter ``params['draft']`` (a draftsmith draft_lm or eagle checkpoint)."""
    from draftsmith.models.registry import load_drafter

    path = params.get("draft")
    if not path:
        raise DraftsmithError("drafter.draft: the draft LM checkpoint whose acceptance the head predicts is required")
    draft, info = load_drafter(Path(path))
    if info.get("kind") not in ("draft_lm", "eagle"):
        raise DraftsmithError(f"drafter.draft {path!r} is a {info.get('kind')} checkpoint; the acceptance head "
                              f"reads a standalone draft LM or an EAGLE drafter")
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise DraftsmithError(f"drafter.draft {path!r}: vocabulary {draft.cfg.vocab_size} != target "
                              f"{target.cfg.vocab_size}")
    head = AcceptanceHead(AcceptanceConfig(dim=draft.cfg.dim, n_layers=params.get("n_layers", 3),
                                           draft=str(path), draft_kind=info["kind"],
                                           state=params.get("state", "after")))
    head.draft = draft.float().requires_grad_(False)  # frozen: only the head trains (as in the reference)
    return head


class AcceptanceStop:
    """SpecDec++ threshold rule: stop once P(some draft of this block is rejected) = 1 - prod p_hat > threshold.
    Asked before or after the drafter reads each draft, as the head was trained (its ``state``)."""

    def __init__(self, head: AcceptanceHead, threshold: float, min_len: int = 1, prepare=None):
        self.head, self.threshold, self.min_len = head, threshold, min_len
        self.prepare = prepare  # drafter state -> head input (EAGLE: its head_input, as in training)
        self.before_feed = head.cfg.state == "before"
        self.p_all = 1.0

    def __call__(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None, token=None) -> bool:
        if hidden is None:
            raise DraftsmithError("the SpecDec++ stop rule needs a drafter that returns its hidden states")
        if n == 1:  # a new block: the verified token's factor is 1
            self.p_all = 1.0
        with torch.no_grad():
            x = self.prepare(hidden) if self.prepare is not None else hidden
            if self.before_feed:
                x = acceptance_features(x, logits, token.reshape(()))
            self.p_all *= float(torch.sigmoid(self.head(x.to(self.head.out.weight.dtype))))
        return n >= self.min_len and 1.0 - self.p_all > self.threshold


class EntropyStop:
    """Training-free baseline: stop once the draft's next-token entropy (nats) exceeds the threshold; with
    ``before_feed``, stop after a draft drawn from a distribution whose entropy exceeded it (no extra forward)."""

    def __init__(self, threshold: float, min_len: int = 1, before_feed: bool = False):
        self.threshold, self.min_len, self.before_feed = threshold, min_len, before_feed

    def __call__(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None, token=None) -> bool:
        entropy = float(_entropy(torch.log_softmax(logits.float(), -1)))
        return n >= self.min_len and entropy > self.threshold


class ConfidenceStop:
    """Training-free threshold rule with the drafter's own confidence as the acceptance estimate: P = prod of the
    block's draft probabilities; stop once 1 - P > threshold. ``after`` (asked once the drafter has read n drafts,
    about draft n + 1): P takes draft n + 1's top probability max q, which at T = 0 is q of the draft it would
    pick, and a stop leaves that draft out, so with ``min_len`` 0 a step whose first draft looks unsure drafts
    nothing (with ``min_len`` >= 1 the decoder first asks once draft 1 is made, so P starts at draft 2).
    ``before_feed`` (asked right after draft n is picked): P takes q(draft n), and draft n stays in."""

    def __init__(self, threshold: float, min_len: int = 1, before_feed: bool = False):
        self.threshold, self.min_len, self.before_feed = threshold, min_len, before_feed
        self.p_all = 1.0

    def __call__(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None, token=None) -> bool:
        # a new block starts at the first n the decoder asks (first_stop); min_len may be set after construction
        if n == (0 if self.min_len < 1 and not self.before_feed else 1):
            self.p_all = 1.0
        probs = torch.softmax(logits.float(), -1)
        self.p_all *= float(probs[int(token)] if self.before_feed else probs.max())
        return n >= self.min_len and 1.0 - self.p_all > self.threshold
