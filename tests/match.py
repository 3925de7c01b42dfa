"""Test support (imported by tests/test_train_serve_match.py and benchmarks/experiments/overfit_eagle3.py, not by
the product). Train/serve match (docs/decoding.md): what a drafter was trained to predict at a position against what the
decoder drafts there, on the target's own greedy records.

A greedy (T = 0) record is the target's own answer, so every chain the decoder starts on its prompt starts at a
prefix of the record: at the chain that starts with current token x_j, draft 1 is the drafter's guess for x_{j+1}
from the same context the training objective shows it at position j - 1 (EAGLE's TTT step 0, feature head 0).
Draft k + 1 reads drafts 1..k; where those were accepted they are the record's tokens, which is what TTT step k
(head k) reads in training. So, drafter for drafter, the two must give the same token; anything else is a
train/serve mismatch (feature layers, norms, position or token shifts, the reduced vocabulary's maps, dtypes).

``teacher_forced`` runs the kind's training objective itself (train/objectives.py) on a collated batch and keeps
the argmax of every head input it scores; ``chain_steps`` runs the decoder (eval/decoder.py) and keeps each
step's drafts; ``compare`` lines them up. tests/test_train_serve_match.py asserts equality in float64;
benchmarks/experiments/overfit_eagle3.py reports the agreement on a real target in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from unittest import mock

import torch

from draftsmith.data.dataset import collate
from draftsmith.data.records import Record
from draftsmith.eval.decoder import speculative_generate
from draftsmith.eval.shapes import Chain
from draftsmith.models.registry import drafter_spec
from draftsmith.recipes.schema import LossConfig
from draftsmith.train.objectives import Context, objective_for


@torch.no_grad()
def teacher_forced(drafter, params, batch: dict, target=None, loss: LossConfig | None = None) -> tuple[dict, dict]:
    """The drafter's training objective on ``batch`` (collate's output) -> ({(step, row, t): target id ranked first
    by TTT step / head ``step`` at position t of batch row ``row``}, the objective's metrics). ``target``: the
    frozen target computes the features in the loop (the batch must then carry none); ``params``: the drafter's
    recipe section. The prediction is the argmax of the head input the objective scores, against the head
    weights it scores with (draft ids mapped back through d2t for a reduced vocabulary)."""
    T, preds = batch["input_ids"].shape[1], {}
    d2t = getattr(drafter, "d2t", None)

    def forward(*args, select, head_fn, **kw):
        def spy(s, x, w, *rest):
            if s >= 0:  # (s = -1: Medusa-2's adapted target)
                top = (x.to(w.dtype) @ w.t()).argmax(-1)
                top = top if d2t is None else top + d2t[top]
                for r, p in zip(select[s].tolist(), top.tolist()):  # select: flat indices of the positions
                    preds[s, r // T, r % T] = p
            return head_fn(s, x, w, *rest)

        return drafter(*args, select=select, head_fn=spy, **kw)

    forward.training = False  # (the objective's training-only augmentations stay off)
    ctx = Context(unwrapped=drafter, target=target, params=params)
    out = objective_for(drafter_spec(params.kind).kind)(forward, batch, loss or LossConfig(kind="ce"), ctx)
    return preds, out.host_metrics()


def chain_steps(target, drafter, prompt: torch.Tensor, max_new_tokens: int, gamma: int, eos_ids: set[int]):
    """A greedy chain decode (γ = ``gamma``) -> (new tokens, [(that step's drafts, how many were accepted)])."""
    steps, draft = [], Chain.draft

    def spy(self, dec, rows, cur, budgets):
        d = draft(self, dec, rows, cur, budgets)
        steps.append(d.tokens[0, : d.count[0]].tolist())  # one row
        return d

    with mock.patch.object(Chain, "draft", spy):
        out, st = speculative_generate(target, drafter, prompt, max_new_tokens, draft_len=gamma, eos_ids=eos_ids)
    return out, list(zip(steps, st.accepted_per_step)), st


@dataclass
class Match:
    """Counts over chain starts and draft positions (index s: draft s + 1 against TTT step / head s)."""

    starts: int = 0  # chain starts with at least one draft
    accepted_first: int = 0  # ... whose first draft was accepted
    compared: list[int] = field(default_factory=list)  # drafts compared with a trained prediction
    agreed: list[int] = field(default_factory=list)  # ... that equal it
    untrained_first: int = 0  # chain starts whose first draft's position the objective does not train
    trained_rows: list[int] = field(default_factory=list)  # teacher-forced rows over the whole records
    trained_hits: list[int] = field(default_factory=list)  # ... whose argmax is the record's token
    diverged: int = 0  # records the decoder's output left (float rounding flipped a target argmax)
    mismatches: list[tuple] = field(default_factory=list)  # (record, position t, draft s + 1, decoder, trained)
    decoded: list = field(default_factory=list)  # each record's (new tokens, steps, DecodeStats): reusable

    def rate(self, s: int = 0) -> float:
        return self.agreed[s] / self.compared[s] if self.compared[s] else float("nan")

    def top1(self, s: int = 0) -> float:
        return self.trained_hits[s] / self.trained_rows[s] if self.trained_rows[s] else float("nan")

    def acceptance(self) -> list[float]:
        """[k] = P(draft k + 1 accepted | drafts 1..k accepted and draft k + 1 drafted): the decoder's per-position
        acceptance without the steps whose γ the answer's end cut short (``DecodeStats`` counts those as
        rejections past their last draft), the number to set next to teacher-forced top-1."""
        reached, kept = [], []
        for _, steps, _ in self.decoded:
            for drafts, n in steps:
                for k in range(min(len(drafts), n + 1)):
                    while len(reached) <= k:
                        reached.append(0)
                        kept.append(0)
                    reached[k] += 1
                    kept[k] += n > k
        return [a / r for a, r in zip(kept, reached)]


def compare(
    target,
    drafter,
    params,
    records: list[Record],
    max_new_tokens: int,
    gamma: int,
    eos_ids: set[int],
    in_loop: bool = False,
    batch_size: int = 8,
    serving: tuple | None = None,
    decoded: list | None = None,
) -> Match:
    """Decode every record's prompt (its tokens before the first response token) and line each chain's drafts up
    with the objective's teacher-forced predictions on the record. ``in_loop``: the target computes the features
    (else the records' stored ones). ``serving``: the (target, drafter) pair that decodes, when it is not the pair
    the objective runs (the eval stage's fused, pre-packed copies). Only the first response of a record is
    decoded; a decode that leaves the record is compared up to where it left. ``decoded``: another ``Match``'s
    decodes of the same records, reused (features from the records and from the loop, one decode)."""
    dec_target, dec_drafter = serving or (target, drafter)
    depth = 0
    m = Match()
    for a in range(0, len(records), batch_size):
        part = records[a : a + batch_size]
        batch = collate(part)
        if in_loop:
            batch = {k: v for k, v in batch.items() if not k.startswith("hidden_")}
        preds, _ = teacher_forced(drafter, params, batch, target if in_loop else None)
        depth = max(depth, 1 + max((s for s, _, _ in preds), default=-1))
        while len(m.compared) < depth:
            for f in (m.compared, m.agreed, m.trained_rows, m.trained_hits):
                f.append(0)
        ids = batch["input_ids"]
        for (s, b, t), p in preds.items():
            m.trained_rows[s] += 1
            m.trained_hits[s] += p == int(ids[b, t + s + 2])
        for b, r in enumerate(part):
            mask = torch.as_tensor(r.loss_mask).bool()
            P = int(mask.nonzero()[0, 0])
            n = int(mask[P:].long().cumprod(0).sum())  # the first response
            want = torch.as_tensor(r.input_ids)[P : P + n].tolist()
            if decoded is None:
                prompt = torch.as_tensor(r.input_ids[:P])
                m.decoded.append(chain_steps(dec_target, dec_drafter, prompt, max_new_tokens, gamma, eos_ids))
            else:
                m.decoded.append(decoded[a + b])
            out, steps, _ = m.decoded[-1]
            same = next((i for i, (x, y) in enumerate(zip(out, want)) if x != y), min(len(out), len(want)))
            m.diverged += same < len(want)
            j = P  # the sequence position of the step's current token
            for drafts, acc in steps:
                if j >= P + same:
                    break
                if drafts:
                    m.starts += 1
                    m.accepted_first += acc > 0
                for s, tok in enumerate(drafts[: acc + 1][:depth]):  # draft s + 1: drafts 1..s were accepted
                    if j + s >= P + same:  # its context left the record
                        break
                    key = (s, b, j - 1)  # the objective's row for it: position j - 1, which reads x_j
                    if key not in preds:  # a label outside a reduced vocabulary: not trained
                        m.untrained_first += s == 0
                        continue
                    m.compared[s] += 1
                    m.agreed[s] += tok == preds[key]
                    if tok != preds[key]:
                        m.mismatches.append((a + b, j - 1, s + 1, tok, preds[key]))
                j += acc + 1
    return m


def train_briefly(drafter, params, batch, steps: int = 10):
    """A few AdamW steps of the training objective: first drafts mostly, not all, accepted on these records (both
    branches of a chain get checked)."""
    objective = objective_for(drafter_spec(params.kind).kind)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    drafter.train()
    for _ in range(steps):
        out = objective(drafter, batch, LossConfig(kind="ce"), Context(unwrapped=drafter, params=params))
        (out.loss_sum / out.n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return drafter.eval()
