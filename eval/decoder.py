"""Batch-1 decoding: plain autoregressive decoding on our KV cache (``autoregressive_generate``), the batch-1 entry
point of the speculative decoder (``speculative_generate``: the one loop of eval/batch_decoder.py with one row),
and what every decode shares: ``DecodeStats``, ``emit``, ``target_pass``. What a drafter does is its proposer's
(eval/proposers.py: draft LMs, feature heads, EAGLE, PARD); what a step drafts, verifies and accepts is its
shape's (eval/shapes.py: a chain, gpt-fast style, or a static or dynamic tree, algorithms.md A11). Lossless: at
temperature 0 both produce identical tokens for any drafter, and with sampling the output follows the target
distribution (docs/algorithms.md A1, B4, B7); only the judge hook is lossy, by design.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.eval.accept import Sampler
from draftsmith.eval.tree import DynamicTree, TreeSpec


@dataclass
class DecodeStats:
    """Counters of one or more (merged) decodes. Prefill is excluded from the forward counts and timings."""

    new_tokens: int = 0  # tokens emitted (after EOS/max truncation)
    target_forwards: int = 0  # verify forwards
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted (as verified: a step's drafts after an EOS still count)
    accept_counts: list[int] = field(default_factory=list)  # [k] = verify steps that accepted exactly k drafts
    judge_accepted: int = 0  # accepted drafts the target itself would not have chosen (lossy judge mode only)
    ngram_candidates: int = 0  # drafted tokens an own-vocabulary drafter's n-gram cache wrote (eval/hetero.py)
    draft_time_s: float = 0.0  # wall time in drafter calls
    verify_time_s: float = 0.0  # wall time in target verify calls and acceptance
    accepted_per_step: list[int] = field(default_factory=list)  # in order: where the target overruled the draft

    @property
    def tau(self) -> float:
        """Block efficiency: tokens produced per verify forward (accepted drafts + one correction/bonus each)."""
        return (self.accepted + self.target_forwards) / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def per_position_acceptance(self) -> list[float]:
        """[i] = P(draft i accepted | drafts < i accepted), from accept_counts; 0.0 where never reached.

        Steps whose γ was clamped near max_new_tokens count as rejections past their last draft.
        """
        c = self.accept_counts
        out = []
        for i in range(len(c) - 1):
            reached = sum(c[i:])
            out.append(sum(c[i + 1 :]) / reached if reached else 0.0)
        return out

    def step(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """Count one verify step that checked ``drafted`` tokens and accepted ``accepted`` of them."""
        self.target_forwards += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accept_counts[accepted] += 1
        self.accepted_per_step.append(accepted)
        self.draft_time_s += draft_s
        self.verify_time_s += verify_s

    def merge(self, other: DecodeStats) -> DecodeStats:
        """Add ``other`` into self (in place; returns self). Histograms of different lengths are zero-padded."""
        self.new_tokens += other.new_tokens
        self.target_forwards += other.target_forwards
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.judge_accepted += other.judge_accepted
        self.ngram_candidates += other.ngram_candidates
        self.draft_time_s += other.draft_time_s
        self.verify_time_s += other.verify_time_s
        n = max(len(self.accept_counts), len(other.accept_counts))
        a = self.accept_counts + [0] * (n - len(self.accept_counts))
        b = other.accept_counts + [0] * (n - len(other.accept_counts))
        self.accept_counts = [x + y for x, y in zip(a, b)]
        self.accepted_per_step += other.accepted_per_step
        return self

    def target_positions(self) -> list[int]:
        """Indices of emitted tokens the target chose itself (the first token, then each step's correction or
        bonus): where the drafter was wrong or out of drafts. Online distillation trains on these (OSD)."""
        pos, p = [0], 0
        for n in self.accepted_per_step:
            p += n + 1
            pos.append(p)
        return [q for q in pos if q < self.new_tokens]


def _sync(device: torch.device) -> None:
    # CUDA calls are asynchronous: wait for the queued work so perf_counter measures it, not its launch.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def emit(out: list[int], new: list[int], eos_ids: set[int] | None, max_new_tokens: int, on_token=None) -> bool:
    """Append ``new`` to ``out`` up to and including the first EOS and at most max_new_tokens; True when done.
    ``on_token(t)`` sees each token as it is committed (streaming servers); it may raise to abandon the decode."""
    for t in new:
        if len(out) >= max_new_tokens:
            return True
        out.append(t)
        if on_token is not None:
            on_token(t)
        if eos_ids and t in eos_ids:
            return True
    return len(out) >= max_new_tokens


def prepare_prompt(model, prompt_ids: torch.Tensor) -> torch.Tensor:
    """prompt_ids (T,) -> (1, T) long on the model's device."""
    if prompt_ids.dim() != 1:
        # Say so rather than flatten rows into one sequence; batches have their own decoder.
        raise ValueError(
            "the decoder takes one prompt (T,) at a time (batches: eval/batch_decoder.py); "
            f"got shape {tuple(prompt_ids.shape)}"
        )
    device = next(model.parameters()).device
    return prompt_ids.to(device=device, dtype=torch.long).view(1, -1)  # (1, T)


def target_pass(target, ids: torch.Tensor, cache, layers: tuple[int, ...] = (), last_only: bool = False, **kw):
    """A cached target forward over ids (1, T) -> (logits (1, T, V), or (V,) at the last position only; the hidden
    states it captured for ``layers``, {} for none). ``last_only`` runs the LM head there alone (a prefill: over a
    whole prompt it is the largest matmul, and only the last row is ever used)."""
    if last_only:
        kw["logits_at"] = torch.zeros_like(ids, dtype=torch.bool)
        kw["logits_at"][:, -1] = True
    out = target(ids, cache=cache, capture_layers=layers, **kw) if layers else target(ids, cache=cache, **kw)
    logits, captured = out if layers else (out, {})
    return (logits[-1] if last_only else logits), captured


@torch.no_grad()
def autoregressive_generate(target, prompt_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                            top_k: int = 0, top_p: float = 1.0, eos_ids: set[int] | None = None,
                            generator: torch.Generator | None = None, on_token=None) -> list[int]:  # fmt: skip
    """Plain decoding with our KV cache: prompt_ids (T,) -> the new tokens (EOS included if hit)."""
    if max_new_tokens <= 0:
        return []
    sampler = Sampler(temperature, top_k, top_p, generator)
    prompt = prepare_prompt(target, prompt_ids)
    cache = target.new_cache(1, prompt.shape[1] + max_new_tokens)
    logits, _ = target_pass(target, prompt, cache, last_only=True)  # (V,)
    out: list[int] = []
    while True:
        tok, _ = sampler.pick(logits)
        if emit(out, [int(tok)], eos_ids, max_new_tokens, on_token):
            return out
        logits = target(tok.view(1, 1), cache=cache)[0, -1]  # (V,)


def reads_target(drafter) -> bool:
    """Heads and EAGLE read the target's states; a draft LM reads tokens."""
    return bool(getattr(drafter, "reads_target_hidden", False) or getattr(drafter, "reads_target_features", False))


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int, *, draft_len: int = 4,
                         tree: TreeSpec | DynamicTree | None = None, temperature: float = 0.0, top_k: int = 0,
                         top_p: float = 1.0, eos_ids: set[int] | None = None, generator: torch.Generator | None = None,
                         stop_drafting=None, judge=None, on_token=None) -> tuple[list[int], DecodeStats]:  # fmt: skip
    """Speculative decoding, batch 1: prompt_ids (T,) -> (new tokens, truncated after the first EOS and to
    max_new_tokens; stats). Each step drafts a chain of up to ``draft_len`` tokens, or the ``tree`` (a static
    ``TreeSpec`` or an EAGLE-2 ``DynamicTree``), verifies it in one target forward, keeps what the acceptance rule
    accepts and adds the target's own next token. It is the batched decoder's one loop (eval/batch_decoder.py
    ``BatchDecoder``) with one row on the target's own contiguous cache, so any target decodes here (a
    transformers model without the slot cache, a CUDA-graph wrapper).

    Hooks: ``stop_drafting(n, logits, hidden) -> bool`` (chains) is asked, once the drafter has read its n-th draft,
    whether to end this step's block there (adaptive draft length: SpecDec++, entropy and confidence rules, with
    ``before_feed`` and ``min_len`` 0 variants; eval/proposers.py ``_chain``); draft_len stays the cap and the
    output stays lossless. ``judge`` (models/judge.py ``Judge``): **lossy** Judge-Decoding verification, greedy
    chains of a draft LM (eval/shapes.py ``Judged``). ``on_token(t)`` sees each token as it is committed
    (streaming); it may raise to abandon the decode. A drafter with its own tokenizer (eval/hetero.py
    ``OwnVocabDrafter``) decodes chains.
    """
    from draftsmith.eval.batch_decoder import BatchDecoder, step_room

    prompt = prepare_prompt(target, prompt_ids)[0]
    room = step_room(target, drafter, draft_len, tree, judge, stop_drafting)
    max_len = prompt.numel() + max(max_new_tokens, 0) + room
    dec = BatchDecoder(target, drafter, draft_len=draft_len, eos_ids=eos_ids, stop_drafting=stop_drafting, tree=tree,
                       judge=judge, max_len=max_len + 4, one_row=True)  # fmt: skip
    rid = dec.add(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    out: list[int] = []
    new = dec.prefill()  # the first token is streamed before the first draft (stop rules may count tokens)
    while True:
        for t in new.get(rid, []):
            out.append(t)
            if on_token is not None:
                on_token(t)
        if not dec.active():
            return out, dec.stats[rid]
        new = dec.step()
