"""SpecDec++ acceptance predictor (docs/algorithms.md A7) and the adaptive draft-length rules that use it.

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
- feature heads (``draft_kind`` medusa, hydra, mlp_speculator; ``before`` only): labels are made in the loop too.
  The frozen heads, teacher-forced on the target's features and true tokens, draft y at every position with each
  head k; the target scores it; the head reads the state head k drafted y from (``FeatureHeads.draft_step``), log
  q(y), the entropy of q, and which head it was (a learned slot vector: every head has its own accuracy).

Which state the head reads (``state``):
- ``after`` (the paper): the state after the drafter has read the draft. To judge draft n the drafter must read
  it first, so a block the rule ends costs one drafter forward more than a fixed length of the same size.
- ``before``: the state that *produced* draft n, plus the draft's own log-probability log q(y) and the entropy
  of q (both from the raw logits). Nothing extra runs when the rule stops. For greedy verification it is also
  the exact conditional the threshold rule multiplies: draft n matters only when drafts 1..n-1 were accepted,
  i.e. when the drafter's prefix is the target's own text, which is what the head is trained on (no mixing).

In the decoder, a *stop rule* decides after each draft whether to end the block (eval/proposers.py ``_chain``):
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

``AcceptanceStop(skip=True)`` (``eval.stop.state: next``) asks a ``before`` head in the second slot: once the
drafter has read n drafts, about draft n + 1, from the state and logits that would produce it and their top token
(the draft itself at T = 0). A stop leaves that draft out, so no verify carries a draft the head distrusts, and
with ``min_len`` 0 a step whose first draft looks unsure drafts nothing. ``sweep --oracle``'s ``oracle-skip``
bounds this rule (eval/sweep.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.medusa import ResBlock
from draftsmith.models.spec import DrafterSpec, Strict, as_section

N_EXTRA = 2  # log q(y) and the entropy of q, appended to the producing state of a ``before`` head


class AcceptanceHeadConfig(Strict):
    """SpecDec++ acceptance predictor (docs/algorithms.md A7): a head on a frozen draft LM's hidden state that predicts
    whether each drafted token will be accepted; the decoder then stops drafting adaptively (eval.stop)."""

    kind: Literal["acceptance_head"] = "acceptance_head"
    draft: str = Field(min_length=1)
    """The drafter checkpoint folder whose tokens the head judges; it stays frozen. A draft LM (kind draft_lm):
    the records must carry SpecDec++ labels made with the same draft (data.specdec_labels.checkpoint). An EAGLE
    drafter (kind eagle) or feature heads (medusa, hydra, mlp_speculator; needs state=before): any target-written
    records; the loop runs the target and makes the labels."""
    n_layers: int = Field(3, ge=0)
    """Residual blocks before the output logit."""
    state: Literal["after", "before"] = "after"
    """after (the paper): the head reads the draft's state after it has read the judged token, so a block the rule
    ends costs one more drafter forward. before: it reads the state that produced the token, plus the token's
    log q and the entropy of q; stopping costs nothing extra (trained on the target's own text, no mixing). A
    before head can also judge each next draft before it is drafted (eval.stop.state=next). Feature heads: before
    only (the state is the judged head's own, plus which head it is)."""
    mixing_ratio: float = Field(0.15, ge=0, lt=1)
    """state=after: share of response positions that keep the target's token instead of the draft's sample in
    the input."""
    weight_mismatch: float = Field(6.0, gt=0)
    """Loss weight of the rejected class (acceptance is the common case)."""
    label_temperature: float = Field(0.0, ge=0)
    """EAGLE drafters: the temperature of the labels made in the loop (0: greedy, y = argmax q, label 1 iff the
    target's argmax agrees). Draft LMs take theirs from data.specdec_labels.temperature."""


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
    # its kind (a DrafterSpec with ``acceptance``); the default names the kind of heads saved before the field
    # existed, so their drafter.json still loads
    draft_kind: str = "draft_lm"
    state: str = "after"  # after: the state after reading the draft (the paper); before: the producing state
    n_slots: int = 0  # feature heads: one learned vector per head (which head drafted the token); 0 = none

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
        self.slots = nn.Embedding(cfg.n_slots, cfg.dim) if cfg.n_slots else None
        self.blocks = nn.Sequential(*(ResBlock(cfg.dim) for _ in range(cfg.n_layers)))  # separate instances
        self.out = nn.Linear(cfg.dim, 1)
        self.draft = None  # training only: the frozen draft LM whose states the head reads

    def forward(self, h: torch.Tensor, slot: torch.Tensor | int | None = None) -> torch.Tensor:
        """h (..., d), or (..., d + 2) from ``acceptance_features`` for a ``before`` head; slot (...) or an int:
        the head that drafted the token (feature heads) -> logit (...)."""
        x = h if self.inp is None else self.inp(h)
        if self.slots is not None:
            slot = torch.as_tensor(slot, device=x.device)
            x = x + self.slots(slot).to(x.dtype)
        return self.out(self.blocks(x)).squeeze(-1)

    @property
    def signals_needed(self) -> set[str]:
        """Record signals the objective reads (the drafter kind's ``DrafterSpec.acceptance``): stored labels for a
        draft LM; none where the labels are made in the loop (EAGLE, feature heads)."""
        from draftsmith.models.registry import drafter_spec

        return set(drafter_spec(self.cfg.draft_kind).acceptance["signals"])

    @property
    def needs_target(self) -> bool:
        """Whether the loop must run the frozen target (labels made in the loop: EAGLE, feature heads)."""
        from draftsmith.models.registry import drafter_spec

        return bool(drafter_spec(self.cfg.draft_kind).acceptance["needs_target"])

    def num_params(self, exclude_embeddings: bool = False) -> int:
        return sum(p.numel() for n, p in self.named_parameters() if not n.startswith("draft."))


def build_acceptance_head(cfg: AcceptanceHeadConfig | dict, target, **_) -> AcceptanceHead:
    """A fresh head on the frozen drafter ``cfg.draft`` (a draftsmith draft LM, EAGLE or heads checkpoint)."""
    from draftsmith.models.registry import DRAFTERS, load_drafter

    cfg = as_section(AcceptanceHeadConfig, cfg)
    path = cfg.draft
    draft, info = load_drafter(Path(path))
    kind, state = info.get("kind"), cfg.state
    feature = DRAFTERS[kind].interface == "heads"  # any heads kind: read through FeatureHeads.draft_step
    if DRAFTERS[kind].acceptance is None:
        raise DraftsmithError(
            f"drafter.draft {path!r} is a {kind} checkpoint; the acceptance head reads "
            f"{', '.join(k for k, sp in DRAFTERS.items() if sp.acceptance)} drafters"
        )
    if getattr(draft, "drafts_parallel", 0):
        raise DraftsmithError(
            f"drafter.draft {path!r} drafts in parallel (P-EAGLE): its mask slots have no per-draft state for an "
            f"acceptance head to read; train the head on an autoregressive EAGLE"
        )
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        raise DraftsmithError(
            f"drafter.draft {path!r}: vocabulary {draft.cfg.vocab_size} != target {target.cfg.vocab_size}"
        )
    if feature and state != "before":
        raise DraftsmithError(
            f"drafter.state={state}: an acceptance head on {kind} heads needs state=before (heads "
            f"have no state after a draft: the next head's state is the one that drafts it)"
        )
    if getattr(draft, "target_adapter", None) is not None:
        raise DraftsmithError(
            f"drafter.draft {path!r} is a Medusa-2 checkpoint (it decodes against its adapted "
            f"target); the acceptance head supports Medusa-1 heads"
        )
    head = AcceptanceHead(
        AcceptanceConfig(
            dim=draft.state_dim if feature else draft.cfg.dim,
            n_layers=cfg.n_layers,
            draft=str(path),
            draft_kind=kind,
            state=state,
            n_slots=draft.max_draft_len if feature else 0,
        )
    )
    head.draft = draft.float().requires_grad_(False)  # frozen: only the head trains (as in the reference)
    return head


class AcceptanceStop:
    """SpecDec++ threshold rule: stop once P(some draft of this block is rejected) = 1 - prod p_hat > threshold.
    Asked before or after the drafter reads each draft, as the head was trained (its ``state``). ``skip`` (a
    ``before`` head): asked once the drafter has read n drafts (n >= 0 with ``min_len`` 0) about draft n + 1, whose
    estimate then joins P; a stop leaves that draft out."""

    def __init__(
        self,
        head: AcceptanceHead,
        threshold: float,
        min_len: int = 1,
        prepare=None,
        skip: bool = False,
        keep: torch.Tensor | None = None,
    ):
        if skip and head.cfg.state != "before":
            raise DraftsmithError(
                "eval.stop.state=next needs a head trained with drafter.state=before (it judges "
                "a draft from the state that produces it)"
            )
        self.head, self.threshold, self.min_len, self.skip = head, threshold, min_len, skip
        self.prepare = prepare  # drafter state -> head input (EAGLE: its head_input, as in training)
        self.before_feed = head.cfg.state == "before" and not skip
        # A reduced draft vocabulary's target ids (sorted): log q(y) and the entropy read only those logits (the
        # rest are -inf), a sixth of the work with 8,192 of 49k rows (benchmarks/experiments/rule_costs.py).
        self.keep = keep
        self.p_all = 1.0

    def __call__(self, n: int, logits: torch.Tensor, hidden: torch.Tensor | None, token=None) -> bool:
        if hidden is None:
            raise DraftsmithError("the SpecDec++ stop rule needs a drafter that returns its hidden states")
        # a new block starts at the first n the decoder asks (first_stop; min_len may be set after construction)
        if n == (0 if self.skip and self.min_len < 1 else 1):
            self.p_all = 1.0
        judged = n + 1 if self.skip else n  # which draft of the block the estimate is about
        with torch.no_grad():
            x = self.prepare(hidden) if self.prepare is not None else hidden
            if self.head.cfg.state == "before":
                y = logits.argmax() if self.skip else token.reshape(())
                if self.keep is not None:  # the same numbers from the kept rows only
                    logits = logits[self.keep]
                    y = torch.searchsorted(self.keep, y.reshape(1))[0]
                x = acceptance_features(x, logits, y)
            slot = judged - 1 if self.head.slots is not None else None  # feature heads: head judged - 1 drafted it
            self.p_all *= float(torch.sigmoid(self.head(x.to(self.head.out.weight.dtype), slot)))
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


def check_recipe(recipe) -> None:
    """An acceptance head against the rest of the recipe (DrafterSpec.check): its stop rule adapts chains."""
    if recipe.eval.strategy != "chain":
        raise ValueError("eval.stop (adaptive draft length) works with eval.strategy=chain only")
    if recipe.train.eval_every:
        raise ValueError("train.eval_every does not apply to an acceptance head: run `draftsmith eval`")


SPEC = DrafterSpec(
    kind="acceptance_head",
    config=AcceptanceHeadConfig,
    build=build_acceptance_head,
    from_config=lambda c: AcceptanceHead(AcceptanceConfig(**c)),
    interface=None,
    role="stop_head",
    objective="draftsmith.train.objectives:acceptance_objective",
    # Labels: stored with the records for a draft LM, made in the loop (with the target) for EAGLE and heads.
    signals=lambda head: head.signals_needed,
    needs_target=lambda head: head.needs_target,
    check=check_recipe,
)
