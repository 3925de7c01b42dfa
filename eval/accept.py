"""Acceptance rules for chain speculative decoding (batch 1): greedy prefix matching and Leviathan/Chen rejection
sampling (docs/algorithms.md A1, B7), and the ``Sampler`` that drafts, target tokens and these rules share; the
logits processing they rely on lives in models/sampling.py. Letters follow the docs: p = target, q = draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.kernels.launch import pick_impl
from draftsmith.kernels.verify import verify_greedy, verify_sampling
from draftsmith.models.sampling import process_logits


@dataclass(frozen=True)
class Sampler:
    """One decode's sampling settings. Drafts and the target's own tokens are drawn with ``pick``; the acceptance
    rules process the target's logits with ``probs``, the same processing as the drafts' q (B7.2)."""

    temperature: float = 0.0  # <= 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    impl: str = "auto"  # acceptance kernels: "auto" (Triton on CUDA), "triton" or "reference" (kernels/launch.py)
    greedy: bool = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "greedy", self.temperature <= 0)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (..., V) -> the processed distribution (..., V), fp32."""
        return process_logits(logits, self.temperature, self.top_k, self.top_p)

    def pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits (V,) -> (token (1,) long, probs (V,) it was drawn from, or None when greedy)."""
        if self.greedy:
            return logits.argmax(-1, keepdim=True), None
        probs = self.probs(logits)
        return torch.multinomial(probs, 1, generator=self.generator), probs


def _accepted_prefix(ok: torch.Tensor) -> int:
    """Length of the leading run of True in a 1-D bool tensor (one host sync)."""
    return int(ok.long().cumprod(0).sum())


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor, impl: str = "auto") -> tuple[int, int]:
    """draft_tokens (γ,), target_logits (γ+1, V) -> (n accepted, next token).

    Row i of the target logits predicts the token after draft i-1, so draft i is accepted while it equals the
    target argmax there; next token is the target argmax at row n (a correction, or the bonus if n == γ).
    One fused launch on CUDA (kernels/verify.py), the same rule in PyTorch elsewhere.
    """
    n, nxt = verify_greedy(draft_tokens.view(1, draft_tokens.numel()), target_logits.unsqueeze(0), impl)
    return int(n[0]), int(nxt[0])


def judge_accept(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, judged_ok: torch.Tensor
) -> tuple[int, int, int]:
    """**Lossy** Judge-Decoding rule (algorithms.md A8): draft i is kept while it equals the target argmax *or*
    the judge accepts it (judged_ok (γ,) bool); the target's argmax after the kept prefix follows. Returns
    (n accepted, next token, how many of the n only the judge accepted)."""
    match = draft_tokens == target_logits[:-1].argmax(-1)
    n = _accepted_prefix(match | judged_ok)
    return n, int(target_logits[n].argmax()), int((~match[:n]).sum())


def _device_of(generator: torch.Generator | None) -> str:
    return "cpu" if generator is None else generator.device.type


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    impl: str = "auto",
) -> tuple[int, int]:
    """Standard speculative sampling. draft_tokens (γ,), draft_probs q (γ, V), target_probs p (γ+1, V).

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) (fp32, q = 0 rejects); at the first rejection draw
    the correction from normalised max(0, p_i - q_i), else the bonus from p_{γ+1}. Returns (n, next token).
    ``draft_probs`` must be the exact distributions the drafts were sampled from (pitfall B7.1).
    On CUDA (``impl`` "auto") one fused kernel launch applies the same rule (kernels/verify.py), its Philox stream
    seeded by one draw from ``generator``; elsewhere the PyTorch rule below.
    """
    if pick_impl(impl, target_probs) == "triton":
        seed = int(torch.randint(2**31 - 1, (1,), generator=generator, device=_device_of(generator)))
        n, nxt = verify_sampling(
            draft_tokens.view(1, draft_tokens.numel()), draft_probs[None], target_probs[None], seed, "triton"
        )
        return int(n[0]), int(nxt[0])
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


@dataclass(frozen=True)
class Adjust:
    """A request's changes to the target's logits (OpenAI's ``presence_penalty``, ``frequency_penalty``,
    ``logit_bias`` and ``min_tokens``), applied to the target's logits before any acceptance rule sees them, so
    greedy decoding follows the adjusted argmax and sampling draws exactly from the adjusted distribution whatever
    the drafter proposed (drafts are proposed from the drafter's own, unadjusted distribution).

    Penalties count the tokens generated so far (the prompt is not counted) plus, at a draft position, the drafts
    on its path: ``logit -= frequency * count + presence * (count > 0)``. ``min_tokens`` bans ``banned`` (the stop
    ids) at every position before that many tokens were generated."""

    presence: float = 0.0
    frequency: float = 0.0
    bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit)
    min_tokens: int = 0
    banned: tuple[int, ...] = ()

    def apply(self, logits: torch.Tensor, out: list[int], ids=None, anc=None, depth=None) -> None:
        """In place: logits (W, V) of W positions, position i predicting the token after node i of ``ids`` (W,),
        node 0 being the last generated token (already in ``out``); ``anc`` (W, W) bool: node j is on node i's path
        (itself included), lower-triangular for a chain (the default); ``depth`` (W,): drafts before the predicted
        token (default 0..W-1)."""
        W, V, dev = *logits.shape, logits.device
        if self.bias:
            tok = torch.tensor([t for t, _ in self.bias], device=dev)
            logits[:, tok] += torch.tensor([v for _, v in self.bias], device=dev, dtype=logits.dtype)
        if self.presence or self.frequency:
            counts = torch.zeros(W, V, device=dev)
            if out:
                counts += torch.bincount(torch.tensor(out, device=dev), minlength=V)[:V].float()
            if W > 1 and ids is not None:
                path = torch.ones(W, W, dtype=torch.bool, device=dev).tril() if anc is None else anc
                hot = torch.nn.functional.one_hot(ids[1:W].long(), V).float()  # the drafts, (W-1, V)
                counts += path[:, 1:W].float() @ hot
            logits -= (self.frequency * counts + self.presence * (counts > 0).float()).to(logits.dtype)
        if self.min_tokens > len(out) and self.banned:
            before = len(out) + (torch.arange(W, device=dev) if depth is None else depth.to(dev))
            rows = (before < self.min_tokens).nonzero()[:, 0]
            if rows.numel():
                logits[rows[:, None], torch.tensor(self.banned, device=dev)[None]] = float("-inf")
