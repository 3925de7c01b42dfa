"""The bundled speculative decoder: plain autoregressive decoding and chain (gpt-fast style) speculative
decoding on our own KV cache, batch 1. Lossless: at temperature 0 both produce identical tokens for any
drafter, and with sampling the output follows the target distribution (docs/algorithms.md A1, C4, C7).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from draftsmith.eval.accept import greedy_accept, judge_accept, rejection_accept
from draftsmith.eval.tree import (
    DynamicTree,
    TreeSpec,
    best_nodes,
    compact_cache,
    greedy_tree_accept,
    sample_tree_accept,
)
from draftsmith.kernels.tree import tree_mask
from draftsmith.models.feature_heads import first_stop, split_stop
from draftsmith.models.graphs import GraphedLlama
from draftsmith.models.sampling import process_logits

log = logging.getLogger(__name__)


@dataclass
class DecodeStats:
    """Counters of one or more (merged) decodes. Prefill is excluded from the forward counts and timings."""

    new_tokens: int = 0  # tokens emitted (after EOS/max truncation)
    target_forwards: int = 0  # verify forwards
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted (as verified: a step's drafts after an EOS still count)
    accept_counts: list[int] = field(default_factory=list)  # [k] = verify steps that accepted exactly k drafts
    judge_accepted: int = 0  # accepted drafts the target itself would not have chosen (lossy judge mode only)
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
            out.append(sum(c[i + 1:]) / reached if reached else 0.0)
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


def _run_drafter(drafter, ids: torch.Tensor, **kw):
    """The drafter's forward with its logits in the target's vocabulary. A drafter with a reduced vocabulary
    carries ``d2t`` (V_draft,) offsets, EAGLE-3 style: draft id i is target id i + d2t[i]
    (algorithms.md A10). Its logits are scattered into a -inf row of the target's size, so drafting, q and every
    acceptance rule work on target ids unchanged (the drafter still reads target ids)."""
    out = drafter(ids, **kw)
    d2t = getattr(drafter, "d2t", None)
    logits, extra = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    if d2t is None or logits.shape[-1] == drafter.target_vocab_size:  # already in target ids (ReducedHead)
        return out
    ids_t = torch.arange(len(d2t), device=d2t.device) + d2t
    full = logits.new_full((*logits.shape[:-1], drafter.target_vocab_size), float("-inf"))
    full[..., ids_t] = logits
    return (full, *extra) if extra else full


def _sync(device: torch.device) -> None:
    # CUDA calls are asynchronous: wait for the queued work so perf_counter measures it, not its launch.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator):
    """logits (V,) -> (token (1,) long, probs (V,) it was drawn from, or None when greedy)."""
    if temperature <= 0:
        return logits.argmax(-1, keepdim=True), None
    probs = process_logits(logits, temperature, top_k, top_p)  # (V,) fp32
    return torch.multinomial(probs, 1, generator=generator), probs


def _emit(out: list[int], new: list[int], eos_ids: set[int] | None, max_new_tokens: int, on_token=None) -> bool:
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


def _prefill(model, prompt: torch.Tensor, cache) -> torch.Tensor:
    """Fill the cache with the prompt (1, T); returns the last position's logits (V,). The LM head runs only there:
    over a whole prompt it is the largest matmul of the prefill, and only the last row is ever used."""
    last = torch.zeros_like(prompt, dtype=torch.bool)
    last[:, -1] = True
    return model(prompt, cache=cache, logits_at=last)[-1]


def _prepare(model, prompt_ids: torch.Tensor) -> torch.Tensor:
    if prompt_ids.dim() != 1:
        # Batched speculative decoding needs per-row acceptance lengths and ragged caches to stay
        # output-equivalent; until then, say so rather than flatten rows into one sequence.
        raise ValueError(f"the decoder takes one prompt (T,) at a time; got shape {tuple(prompt_ids.shape)}")
    device = next(model.parameters()).device
    return prompt_ids.to(device=device, dtype=torch.long).view(1, -1)  # (1, T)


@torch.no_grad()
def autoregressive_generate(target, prompt_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
                            top_k: int = 0, top_p: float = 1.0, eos_ids: set[int] | None = None,
                            generator: torch.Generator | None = None, on_token=None) -> list[int]:
    """Plain decoding with our KV cache: prompt_ids (T,) -> the new tokens (EOS included if hit)."""
    if max_new_tokens <= 0:
        return []
    prompt = _prepare(target, prompt_ids)
    cache = target.new_cache(1, prompt.shape[1] + max_new_tokens)
    logits = _prefill(target, prompt, cache)  # (V,)
    out: list[int] = []
    while True:
        tok, _ = _pick(logits, temperature, top_k, top_p, generator)
        if _emit(out, [int(tok)], eos_ids, max_new_tokens, on_token):
            return out
        logits = target(tok.view(1, 1), cache=cache)[0, -1]  # (V,)


def _draft(drafter, dcache, feed: torch.Tensor, gamma: int, temperature, top_k, top_p, generator, stop=None):
    """Propose up to γ tokens. feed (k,): tokens the drafter has not seen yet, ending with the current token.

    Returns drafts (γ',) long, q (γ', V) (the exact distributions sampled from) or None when greedy, and whether
    the drafter read the last draft. Without ``stop`` the last draft is never fed (the verify decides whether it
    survives). ``stop(n, logits, hidden)`` (adaptive draft length: SpecDec++, entropy rules) is asked once the
    drafter has read draft n < γ: logits (V,) is its distribution for the next token and hidden (D,) its final
    state at draft n's position (None when the drafter cannot return it); True ends the block with n drafts.
    It is first asked at n = 1, or at n = 0 (the drafter has just read the current token) when the hook's
    ``min_len`` is 0: stopping there drafts nothing, and the verify is a plain target step. A hook with
    ``before_feed`` is asked instead right after draft n < γ is picked, with the logits and state that produced it
    and the draft: ``stop(n, logits, hidden, token)``; stopping there costs no drafter forward.
    """
    drafts, q_rows, fed_last = [], [], False
    with_hidden = stop is not None and hasattr(drafter, "cfg")
    after, before = split_stop(stop)
    first = first_stop(after)
    for i in range(1, gamma + 1):
        out = _run_drafter(drafter, feed.view(1, -1), cache=dcache,
                           **({"capture_layers": (drafter.cfg.n_layers,)} if with_hidden else {}))
        logits, hidden = (out[0][0, -1], drafter.norm(out[1][drafter.cfg.n_layers][0, -1])) if with_hidden \
            else (out[0, -1], None)  # (V,), (D,)
        if after is not None and i - 1 >= first and after(i - 1, logits, hidden):
            fed_last = True
            break
        tok, q = _pick(logits, temperature, top_k, top_p, generator)
        drafts.append(tok)
        q_rows.append(q)
        if before is not None and i < gamma and before(i, logits, hidden, tok):
            break  # draft i was never fed: the verify decides whether it survives, as at the cap
        feed = tok
    drafts_t = torch.cat(drafts) if drafts else feed.new_empty(0)  # (γ,)
    q_t = torch.stack(q_rows) if drafts and q_rows[0] is not None else None  # (γ, V)
    return drafts_t, q_t, fed_last


def _verify(target, tcache, cur: torch.Tensor, drafts: torch.Tensor, q, temperature, top_k, top_p, generator):
    """One target forward over [cur, d1..dγ] and the acceptance rule -> (n accepted, next token)."""
    logits = target(torch.cat([cur, drafts]).view(1, -1), cache=tcache)[0]  # (γ+1, V)
    return _accept(drafts, q, logits, temperature, top_k, top_p, generator)


def _accept(drafts, q, logits, temperature, top_k, top_p, generator):
    """The chain acceptance rule on the verify logits (γ+1, V) -> (n accepted, next token)."""
    if temperature <= 0:
        return greedy_accept(drafts, logits)
    p = process_logits(logits, temperature, top_k, top_p)  # (γ+1, V), same processing as the drafts (C7.2)
    if q is None:  # γ = 0: nothing drafted, the "bonus" is an ordinary sample from p
        q = p.new_empty(0, p.shape[-1])
    return rejection_accept(drafts, q, p, generator)


@torch.no_grad()
def speculative_generate(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int, *, draft_len: int = 4,
                         temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                         eos_ids: set[int] | None = None, generator: torch.Generator | None = None,
                         stop_drafting=None, judge=None, on_token=None, write: bool = False,
                         ) -> tuple[list[int], DecodeStats]:
    """Chain speculative decoding with a Llama-like drafter (``drafter(ids, cache=c) -> logits``, ``new_cache``).

    ``stop_drafting(n, logits, hidden) -> bool``: optional hook asked, once the drafter has read its n-th draft,
    whether to end this step's block there (adaptive draft length, see ``_draft``); draft_len stays the cap. Any
    hook keeps the output lossless.

    ``judge`` (models/judge.py ``Judge``): **lossy** Judge-Decoding verification, greedy only: a draft the target
    would not have chosen is still kept when the judge accepts the target's state at it (``judge_accept``).

    ``write``: the drafter *writes* instead of proposing, for drafters that read the target's states: the one-row
    reference of the data stage's on-policy writer (data/engine.py ``write_batch`` batches it and is tested equal
    to it; standalone draft LMs write through the batched generator). The first token is the
    target's; every later one is the drafter's first draft, picked with the given sampling settings and committed
    unverified. The target runs once per token only to give the drafter the states it reads next. Not lossless,
    by design: it makes training data, never an eval.

    prompt_ids (T,) -> (new tokens, truncated after the first EOS and to max_new_tokens; stats).
    Cache invariant: both caches hold every committed token except the current one ``cur``; the draft cache may
    also lag by one ``pending`` token (the last draft of a fully accepted step, which it never saw).
    """
    if draft_len < 0:
        raise ValueError(f"draft_len must be >= 0, got {draft_len}")
    if judge is not None and (temperature > 0 or reads_target(drafter)):
        raise ValueError("judge verification is implemented for greedy decoding with a standalone draft LM")
    if write and (stop_drafting is not None or judge is not None):
        raise ValueError("write mode drafts exactly one token per step: no stop hook, no judge")
    if getattr(drafter, "reads_target_hidden", False):
        return _head_speculative(target, drafter, prompt_ids, max_new_tokens, draft_len, temperature, top_k, top_p,
                                 eos_ids, generator, on_token, stop_drafting, write)
    if getattr(drafter, "reads_target_features", False):
        return _feature_speculative(target, drafter, prompt_ids, max_new_tokens, draft_len, temperature, top_k,
                                    top_p, eos_ids, generator, on_token, stop_drafting, write)
    if write:
        raise ValueError("write mode is for drafters that read the target's states; a standalone draft LM writes "
                         "through the batched generator (data/engine.py decode_batch)")
    stats = DecodeStats(accept_counts=[0] * (draft_len + 1))
    if max_new_tokens <= 0:
        return [], stats
    prompt = _prepare(target, prompt_ids)
    device = prompt.device
    max_len = prompt.shape[1] + max_new_tokens + draft_len + 2
    tcache, dcache = target.new_cache(1, max_len), drafter.new_cache(1, max_len)
    logits = _prefill(target, prompt, tcache)  # (V,): the first new token comes from the prefill's last row
    cur, _ = _pick(logits, temperature, top_k, top_p, generator)  # (1,)
    v_draft = _run_drafter(drafter, prompt, cache=dcache).shape[-1]  # drafters promise the plain Llama call only
    if v_draft != logits.shape[-1]:  # draft ids are fed to the target as they are: the vocabularies must agree
        raise ValueError(f"drafter vocabulary {v_draft} != target vocabulary {logits.shape[-1]}")
    pending = prompt.new_empty(0)  # (0|1,)
    out: list[int] = []
    done = _emit(out, [int(cur)], eos_ids, max_new_tokens, on_token)
    while not done:
        # A step emits at most γ+1 tokens: never overshoot max_new_tokens (this also bounds the caches).
        gamma = min(draft_len, max_new_tokens - len(out) - 1)
        t0 = time.perf_counter()
        d0 = dcache.length
        drafts, q, fed_last = _draft(drafter, dcache, torch.cat([pending, cur]), gamma, temperature, top_k, top_p,
                                     generator, stop_drafting)
        gamma = drafts.numel()  # the hook may have stopped early
        _sync(device)
        t1 = time.perf_counter()
        t_len = tcache.length
        judged = 0
        if judge is None:
            n, nxt = _verify(target, tcache, cur, drafts, q, temperature, top_k, top_p, generator)
        else:  # the verify forward also returns the target's states at the drafts, which the judge reads
            logits, states = _with_hidden(target, torch.cat([cur, drafts]).view(1, -1), tcache)
            n, nxt, judged = judge_accept(drafts, logits[0], judge.accepts(states[0, 1:]))
        t2 = time.perf_counter()  # the acceptance rule synced on its result
        # Commit cur + d1..dn. The draft cache holds pending, cur, d1..d_{γ-1}: with n == γ all of it is kept
        # and dγ becomes pending; otherwise keep pending, cur, d1..dn (and nothing is pending any more).
        tcache.length = t_len + 1 + n
        if gamma > 0:
            dcache.length = min(dcache.length, d0 + pending.numel() + 1 + n)
            pending = drafts[gamma - 1:] if n == gamma and not fed_last else drafts[:0]
        elif fed_last:  # the stop hook skipped drafting after the drafter read pending + cur: all kept
            pending = pending[:0]
        else:  # nothing was fed to the drafter this step: cur joins the tokens it still has to see
            pending = torch.cat([pending, cur])
        cur = drafts.new_tensor([nxt])
        done = _emit(out, drafts[:n].tolist() + [nxt], eos_ids, max_new_tokens, on_token)
        stats.step(gamma, n, t1 - t0, t2 - t1)
        stats.judge_accepted += judged
    stats.new_tokens = len(out)
    return out, stats


def reads_target(drafter) -> bool:
    """Heads and EAGLE read the target's states (and decode through their own paths); a draft LM reads tokens."""
    return getattr(drafter, "reads_target_hidden", False) or getattr(drafter, "reads_target_features", False)


def _written(drafts: torch.Tensor) -> tuple[int, int]:
    """Write mode's "acceptance": keep none of the verify, and the first draft becomes the next token. Only ``cur``
    was fed to the target, so its state (which the drafter reads next, with the draft) is all that is committed."""
    return 0, int(drafts[0])


def _with_hidden(target, ids: torch.Tensor, cache, logits_at=None):
    """A cached target forward that also returns its final hidden states after the norm (1, T, D)."""
    L = target.cfg.n_layers
    logits, cap = target(ids, cache=cache, capture_layers=(L,), logits_at=logits_at)
    return logits, target.norm(cap[L])


def _head_speculative(target, drafter, prompt_ids, max_new_tokens, draft_len, temperature, top_k, top_p, eos_ids,
                      generator, on_token=None, stop=None, write=False) -> tuple[list[int], DecodeStats]:
    """Chain decoding with a drafter that reads the target's features (Medusa-style heads): each step drafts
    from the target's final hidden state at the position that produced ``cur``, and the verify forward returns
    the hidden state for the next step, so the drafter never runs a model of its own over the sequence."""
    gamma_max = min(draft_len, drafter.max_draft_len)
    stats = DecodeStats(accept_counts=[0] * (gamma_max + 1))
    if max_new_tokens <= 0:
        return [], stats
    prompt = _prepare(target, prompt_ids)
    max_len = prompt.shape[1] + max_new_tokens + gamma_max + 2
    tcache, context = target.new_cache(1, max_len), drafter.new_context(max_len)
    last = torch.zeros_like(prompt, dtype=torch.bool)
    last[:, -1] = True
    logits, h = _with_hidden(target, prompt, tcache, logits_at=last)
    h_cur = drafter.read_context(h[0], context)[-1]  # (D,): at the position whose LM-head output is cur

    def pick(row):
        return _pick(row, temperature, top_k, top_p, generator)

    cur, _ = pick(logits[-1])
    out: list[int] = []
    done = _emit(out, [int(cur)], eos_ids, max_new_tokens, on_token)
    while not done:
        gamma = 1 if write else min(gamma_max, max_new_tokens - len(out) - 1)
        t0 = time.perf_counter()
        drafts, q = drafter.propose(h_cur, cur, gamma, pick, **({"stop": stop} if stop is not None else {}))
        gamma = drafts.numel()
        _sync(prompt.device)
        t1 = time.perf_counter()
        t_len = tcache.length
        logits, h = _with_hidden(target, (cur if write else torch.cat([cur, drafts])).view(1, -1), tcache)
        n, nxt = _written(drafts) if write else _accept(drafts, q, logits[0], temperature, top_k, top_p, generator)
        t2 = time.perf_counter()
        h_cur = drafter.read_context(h[0, :n + 1], context)[-1]  # at d_n (or cur when n = 0), just before nxt
        tcache.length = t_len + 1 + n
        cur = drafts.new_tensor([nxt]) if gamma else cur.new_tensor([nxt])
        done = _emit(out, drafts[:n].tolist() + [nxt], eos_ids, max_new_tokens, on_token)
        stats.step(gamma, n, t1 - t0, t2 - t1)
    stats.new_tokens = len(out)
    return out, stats



class _Drafting:
    """A drafter's side of a decode, for the tree decoders and EAGLE's chain.

    Each step starts with ``root(cur)``: the drafter reads what it has not seen yet plus the current token and
    returns the root's logits (and, for EAGLE, its output state). ``expand`` runs drafted nodes (the caller sets
    slots, positions and masks); ``commit`` rolls the cache back to the root and queues the accepted tokens, which
    the next ``root`` reads. Llama-like drafters read tokens. EAGLE reads (feature f_i, token x_{i+1}) pairs:
    committed positions use the target's features from the verify forward, drafted nodes the drafter's own
    output state, which is what its training-time test simulates.
    """

    def __init__(self, drafter, max_len: int, prompt: torch.Tensor, feats: torch.Tensor | None):
        self.d, self.cache = drafter, drafter.new_cache(1, max_len)
        self.eagle = getattr(drafter, "reads_target_features", False)
        self.ids = prompt[1:] if self.eagle else prompt  # pair i holds token i+1; cur completes the last pair
        self.feats = feats  # (len(ids) + 1, F) for EAGLE
        self.root_len = 0

    def _call(self, ids: torch.Tensor, states, last_only: bool = False, **kw):
        if self.eagle:
            logits, out = self.d.step(states[None], ids.view(1, -1), cache=self.cache, last_only=last_only, **kw)
            return logits[0], out[0]
        return _run_drafter(self.d, ids.view(1, -1), cache=self.cache, **kw)[0], None

    def root(self, cur: torch.Tensor):
        """-> (logits (V,), state (d,) or None) of the current token's position."""
        logits, out = self._call(torch.cat([self.ids, cur]), self.d.project(self.feats) if self.eagle else None,
                                 last_only=True)
        self.root_len = self.cache.length
        return logits[-1], None if out is None else out[-1]

    def expand(self, tokens: torch.Tensor, states, pos=None, mask=None, paths=None):
        """tokens (n,), states (n, d) or None -> (logits (n, V), states (n, d) or None). ``paths`` (the nodes'
        tokens from the root down) is for ``_HeadDrafting``; a drafter with a cache reads them from the mask."""
        return self._call(tokens, states, **({} if pos is None else {"pos": pos.view(1, -1)}),
                          **({} if mask is None else {"attn_mask": mask}))

    def commit(self, accepted: torch.Tensor, feats: torch.Tensor | None) -> None:
        """accepted (n,) drafted tokens kept; feats (n + 1, F): the target's features at cur and at them."""
        self.cache.length = self.root_len
        self.ids, self.feats = accepted, feats


class _HeadDrafting:
    """Feature heads behind ``_Drafting``'s interface, for dynamic trees: no cache to fill; a node's children are
    head d's logits after the node's path (``logits_after``), all frontier nodes of a level in one batched call."""
    eagle = False

    def __init__(self, drafter, h: torch.Tensor):
        self.d, self.h = drafter, h  # h (D,): the context state at the position that produced cur
        self.cache = SimpleNamespace(length=0)  # written by _draft_dynamic, read by nothing

    def root(self, cur: torch.Tensor):
        self.cur = cur
        return self.d.logits_after(self.h, [cur]), None

    def expand(self, tokens, states, pos=None, mask=None, paths=None):
        n = paths.shape[0]
        return self.d.logits_after(self.h.expand(n, -1), [self.cur.expand(n), *paths.t()]), None


def _target_pass(target, drafter, ids: torch.Tensor, cache, **kw):
    """A cached target forward -> (logits, the drafter's input features (T, F) or None). Only EAGLE drafters
    read features from every verify; their layers are captured in the same forward."""
    if not getattr(drafter, "reads_target_features", False):
        return target(ids, cache=cache, **kw), None
    logits, cap = target(ids, cache=cache, capture_layers=drafter.capture_layers, **kw)
    return logits, drafter.features(cap, target)[0]


def _draft_tree(run: _Drafting, cur: torch.Tensor, tree: TreeSpec, anc: torch.Tensor) -> torch.Tensor:
    """Greedy static-tree drafting -> node tokens (N,) in the tree's (depth-sorted) order.

    After the root, one forward per depth level over that level's nodes: node i sits at slot ``base + i`` and
    attends to the committed prefix and its ancestors (``anc`` = ancestor_mask). Node i's token is the
    ``ranks[i]``-th best of its parent's distribution. The deepest level is never fed (nothing below it is drafted).
    """
    device = cur.device
    root_logits, root_state = run.root(cur)
    logits, states = {-1: root_logits}, {-1: root_state}  # parent node -> its logits (V,) and state
    base = run.cache.length  # unpadded batch 1: slot index == RoPE position; the root is at base - 1
    depths = tree.depths
    tokens = torch.zeros(len(tree), dtype=torch.long, device=device)
    for d in range(1, max(depths) + 1):
        level = [i for i, di in enumerate(depths) if di == d]
        for i in level:
            tokens[i] = torch.topk(logits[tree.parents[i]], tree.ranks[i] + 1).indices[-1]
        if d == max(depths):
            break
        lo, hi = level[0], level[-1] + 1
        mask = torch.ones(1, hi - lo, base + hi, dtype=torch.bool, device=device)
        mask[0, :, base:] = anc[lo + 1:hi + 1, 1:hi + 1]
        pos = torch.full((hi - lo,), base - 1 + d, device=device)
        run.cache.length = base + lo  # levels are fed in order, so the cache ends where this level starts
        st = torch.stack([states[tree.parents[i]] for i in level]) if run.eagle else None
        out, out_st = run.expand(tokens[lo:hi], st, pos, mask)  # (n, V)
        logits.update({i: out[i - lo] for i in level})
        if run.eagle:
            states.update({i: out_st[i - lo] for i in level})
    return tokens


def _draft_dynamic(run: _Drafting, cur: torch.Tensor, spec: DynamicTree):
    """EAGLE-2 dynamic tree -> (node tokens (N,), parents (N,), tree mask (N+1, N+1), depths (N+1,)) in depth-sorted
    order, mask and depths as kernels/tree.py ``tree_mask`` gives them.

    Root: the drafter's top-k tokens. Each level: feed the k frontier nodes in one forward (tree mask: committed
    prefix + own ancestors), score their top-k children by cumulative log-prob, keep the k best as the next
    frontier. Finally keep the ``total_tokens`` best of all recorded nodes. Every shape is fixed by (k, depth), so
    the whole step stays on the device with no host sync: node ids are assigned level by level (children after
    their parents), an ancestor matrix grows with them, and a stable sort by score ranks them. A draft LM wrapped
    for CUDA graphs (models/graphs.py) drafts every level after the root from one captured graph (``TreeGraph``).
    """
    root_logits, root_state = run.root(cur)
    base = run.cache.length  # the root (current token) sits at slot base - 1; slot index == position
    if isinstance(run.d, GraphedLlama) and root_state is None and run.cache is run.d._cache:
        graph = TreeGraph.of(run.d, spec)
        if graph.usable:
            return graph(root_logits, base)
    return _tree_levels(run, root_logits, root_state, base, spec, _level)


def _level(run, tokens, states, d: int, base: int, n_fed: int, anc, paths):
    """One level of a dynamic tree: the k frontier nodes in one forward, after the n_fed nodes already in the
    cache; anc (k, n_fed + k) is their ancestor mask over the tree slots."""
    k = tokens.numel()
    mask = torch.cat([torch.ones(k, base, dtype=torch.bool, device=tokens.device), anc], 1)
    run.cache.length = base + n_fed
    pos = torch.full((k,), base - 1 + d, device=tokens.device)
    return run.expand(tokens, states, pos, mask[None], paths=paths)


def _tree_levels(run, root_logits, root_state, base, spec: DynamicTree, level):
    """The levels and the final selection of ``_draft_dynamic``; ``level`` runs the drafter on a frontier."""
    k, device = spec.top_k, root_logits.device
    n_max = k + (spec.depth - 1) * k * k
    top = torch.log_softmax(root_logits.float(), -1).topk(k)
    tok = torch.zeros(n_max, dtype=torch.long, device=device)
    score = torch.full((n_max,), float("-inf"), device=device)
    par = torch.full((n_max,), -1, dtype=torch.long, device=device)
    depth = torch.ones(n_max, dtype=torch.long, device=device)
    anc = torch.eye(n_max, dtype=torch.bool, device=device)  # row n: n and its ancestors (root excluded)
    tok[:k], score[:k] = top.indices, top.values
    state = root_state.expand(n_max, -1).clone() if run.eagle else None  # each node's input: its parent's output
    path = torch.zeros(n_max, spec.depth, dtype=torch.long, device=device)  # node tokens from the root down
    path[:k, 0] = top.indices
    frontier = torch.arange(k, device=device)
    fed = frontier[:0]  # node ids in slot order after base
    for d in range(1, spec.depth):
        order = torch.cat([fed, frontier])
        out, out_st = level(run, tok[frontier], state[frontier] if run.eagle else None, d, base, fed.numel(),
                            anc[frontier][:, order], path[frontier, :d])  # (k, V)
        fed = order
        cv, ci = torch.log_softmax(out.float(), -1).topk(k, -1)  # (k, k)
        new = torch.arange(k + (d - 1) * k * k, k + d * k * k, device=device)  # children, row by row
        tok[new], score[new] = ci.flatten(), (score[frontier, None] + cv).flatten()
        par[new] = frontier.repeat_interleave(k)
        depth.index_fill_(0, new, d + 1)  # a scalar through index_put_ would be a host copy (no CUDA graph)
        path[new] = path[par[new]]
        path[new, d] = tok[new]
        anc[new] |= anc[par[new]]
        if run.eagle:
            state[new] = out_st.repeat_interleave(k, 0)
        frontier = new[score[new].topk(k).indices]
    keep = best_nodes(score, depth, min(spec.total_tokens, n_max))  # ancestor-closed, parents first
    index = torch.full((n_max,), -1, dtype=torch.long, device=device)
    index[keep] = torch.arange(keep.numel(), device=device)
    parents = torch.where(par[keep] >= 0, index[par[keep].clamp_min(0)], -1)
    n = keep.numel()
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=device)
    mask[:, 0] = True
    mask[1:, 1:] = anc[keep][:, keep]
    depths = torch.cat([depth.new_zeros(1), depth[keep]]).int()
    return tok[keep], parents, mask, depths


class TreeGraph:
    """Every level of a dynamic tree after the root, for a draft LM in a ``GraphedLlama``: the same
    ``_tree_levels``, with the tree's first slot (``base``) held in a device tensor and each level's mask built
    over the whole static cache, so no shape or Python value depends on the step. On CUDA it is captured once per
    (drafter, tree spec) and replayed: one launch instead of a few hundred small kernels per tree (the eager tree
    was launch-bound on an H100, benchmarks/RESULTS.md). Elsewhere (``graphs=False``) it runs uncaptured, which is
    how the tests check it against the eager levels on CPU."""

    def __init__(self, model: GraphedLlama, spec: DynamicTree):
        self.model, self.spec = model, spec
        self.root = None  # the root's logits: allocated at the first call, from their shape
        self.base = torch.zeros((), dtype=torch.long, device=model._arange.device)
        self.run = SimpleNamespace(d=model, eagle=False)
        self.graph, self.out = None, None
        self.capturing = model.graphs  # on CUDA; elsewhere the levels run uncaptured
        self.usable = True  # False once a capture failed: the caller drafts level by level instead

    @staticmethod
    def of(model: GraphedLlama, spec: DynamicTree) -> TreeGraph:
        graphs = model.__dict__.setdefault("_tree_graphs", {})
        if spec not in graphs:
            graphs[spec] = TreeGraph(model, spec)
        return graphs[spec]

    def _levels(self):
        return _tree_levels(self.run, self.root, None, self.base, self.spec, self._level)

    def _level(self, run, tokens, states, d: int, base: torch.Tensor, n_fed: int, anc, paths):
        k, m = tokens.numel(), self.model
        mask = (m._arange < base).expand(k, -1).clone()  # the committed prefix, then this tree's slots
        mask[:, base + m._arange[:anc.shape[1]]] = anc
        pos = (base - 1 + d).expand(k)
        return _run_drafter(m, tokens.view(1, -1), cache=m._cache, pos=pos.view(1, -1), attn_mask=mask[None],
                            s0=base + n_fed)[0], None

    def __call__(self, root_logits: torch.Tensor, base: int):
        if self.root is None:
            self.root = torch.empty_like(root_logits)
        self.root.copy_(root_logits)
        self.base.fill_(base)
        if not self.capturing:
            return self._levels()
        if self.graph is None:
            try:
                self.graph, self.out = self.model.capture(self._levels)
            except RuntimeError as e:  # an op of this drafter that cannot be captured: stay correct, say so once
                self.usable = False
                log.warning("dynamic tree: CUDA-graph capture failed (%s); drafting level by level instead",
                            str(e).splitlines()[0])
                return self._levels()
        self.graph.replay()
        return tuple(t.clone() for t in self.out)  # the next replay overwrites the graph's outputs


def _draft_chain(run: _Drafting, cur: torch.Tensor, gamma: int, pick, stop=None):
    """A chain of up to gamma drafts from the runner -> (drafts (γ,), q (γ, V) or None). ``stop(n, logits,
    state)`` may end it after n >= 1 drafts (see ``_draft``; state is EAGLE's output at draft n, or for a
    ``before_feed`` hook the output that produced draft n)."""
    logits, state = run.root(cur)
    drafts, qs = [], []
    after, before = split_stop(stop)
    first = first_stop(after)
    for i in range(gamma):
        if after is not None and i >= first and after(i, logits, state):
            break
        tok, q = pick(logits)
        drafts.append(tok)
        qs.append(q)
        if before is not None and i + 1 < gamma and before(i + 1, logits, state, tok):
            break
        if i + 1 < gamma:  # the last draft is never fed: the verify decides whether it survives
            out, st = run.expand(tok, None if state is None else state[None])
            logits, state = out[-1], None if st is None else st[-1]
    if not drafts:
        return cur.new_empty(0), None
    return torch.cat(drafts), (torch.stack(qs) if qs[0] is not None else None)


def _feature_speculative(target, drafter, prompt_ids, max_new_tokens, draft_len, temperature, top_k, top_p,
                         eos_ids, generator, on_token=None, stop=None, write=False) -> tuple[list[int], DecodeStats]:
    """Chain decoding with an EAGLE drafter: every target forward also returns the features the drafter reads
    next step; the drafter re-reads the accepted positions with those real features (``_Drafting``)."""
    stats = DecodeStats(accept_counts=[0] * (draft_len + 1))
    if max_new_tokens <= 0:
        return [], stats
    prompt = _prepare(target, prompt_ids)
    max_len = prompt.shape[1] + max_new_tokens + draft_len + 2
    tcache = target.new_cache(1, max_len)
    last = torch.zeros_like(prompt, dtype=torch.bool)
    last[:, -1] = True
    logits, feats = _target_pass(target, drafter, prompt, tcache, logits_at=last)

    def pick(row):
        return _pick(row, temperature, top_k, top_p, generator)

    cur, _ = pick(logits[-1])
    run = _Drafting(drafter, max_len, prompt[0], feats)
    out: list[int] = []
    done = _emit(out, [int(cur)], eos_ids, max_new_tokens, on_token)
    while not done:
        gamma = 1 if write else min(draft_len, max_new_tokens - len(out) - 1)
        t0 = time.perf_counter()
        drafts, q = _draft_chain(run, cur, gamma, pick, stop)
        gamma = drafts.numel()  # the hook may have stopped early
        _sync(prompt.device)
        t1 = time.perf_counter()
        t_len = tcache.length
        fed = cur if write else torch.cat([cur, drafts])
        logits, feats = _target_pass(target, drafter, fed.view(1, -1), tcache)
        n, nxt = _written(drafts) if write else _accept(drafts, q, logits[0], temperature, top_k, top_p, generator)
        t2 = time.perf_counter()
        tcache.length = t_len + 1 + n
        run.commit(drafts[:n], feats[:n + 1])
        cur = cur.new_tensor([nxt])
        done = _emit(out, drafts[:n].tolist() + [nxt], eos_ids, max_new_tokens, on_token)
        stats.step(gamma, n, t1 - t0, t2 - t1)
    stats.new_tokens = len(out)
    return out, stats


@torch.no_grad()
def tree_speculative_generate(target, drafter, prompt_ids: torch.Tensor, max_new_tokens: int,
                              tree: TreeSpec | DynamicTree, *,
                              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                              eos_ids: set[int] | None = None,
                              generator: torch.Generator | None = None, on_token=None) -> tuple[list[int], DecodeStats]:
    """Tree speculative decoding, batch 1, over a static tree (``tree_from_choices``) or an EAGLE-2-style
    ``DynamicTree`` rebuilt every step from the drafter's confidence.

    Each step drafts the whole tree (children are the drafter's top-k tokens), verifies it in one target forward
    under the tree mask, and compacts the target KV cache to the accepted path. Greedy: the deepest path whose
    tokens are the target's argmax; output equals the target's greedy decoding token for token. Sampling: the
    point-mass rule of ``sample_tree_accept``; output follows the target's processed distribution. The drafter
    re-reads the accepted path next step (its cache is rolled back to the root), keeping it trivially consistent.
    """
    if getattr(drafter, "reads_target_hidden", False):
        return _head_tree(target, drafter, prompt_ids, max_new_tokens, tree, temperature, top_k, top_p, eos_ids,
                          generator, on_token)
    dynamic = isinstance(tree, DynamicTree)
    max_depth = tree.depth if dynamic else max(tree.depths)
    n_nodes = _most_nodes(tree)
    stats = DecodeStats(accept_counts=[0] * (max_depth + 1))
    if max_new_tokens <= 0:
        return [], stats
    prompt = _prepare(target, prompt_ids)
    device = prompt.device
    if not dynamic:
        parents = torch.tensor(tree.parents, dtype=torch.long, device=device)
        anc, depths = tree_mask(parents)  # (N+1, N+1) ancestors, (N+1,) depths, root first
    max_len = prompt.shape[1] + max_new_tokens + n_nodes + max_depth + 2
    tcache = target.new_cache(1, max_len)
    last = torch.zeros_like(prompt, dtype=torch.bool)
    last[:, -1] = True
    logits, feats = _target_pass(target, drafter, prompt, tcache, logits_at=last)
    cur, _ = _pick(logits[-1], temperature, top_k, top_p, generator)  # (1,)
    run = _Drafting(drafter, max_len, prompt[0], feats)  # the drafter has seen nothing yet
    out: list[int] = []
    done = _emit(out, [int(cur)], eos_ids, max_new_tokens, on_token)
    while not done:
        t0 = time.perf_counter()
        if dynamic:
            tokens, parents, anc, depths = _draft_dynamic(run, cur, tree)
        else:
            tokens = _draft_tree(run, cur, tree, anc)
        _sync(device)
        t1 = time.perf_counter()
        t_len = tcache.length
        mask = torch.ones(1, len(tokens) + 1, t_len + len(tokens) + 1, dtype=torch.bool, device=device)
        mask[0, :, t_len:] = anc
        logits, feats = _target_pass(target, drafter, torch.cat([cur, tokens]).view(1, -1), tcache,
                                     pos=(t_len + depths).view(1, -1), attn_mask=mask)
        path, nxt = _tree_accept(tokens, parents, logits[0], temperature, top_k, top_p, generator)  # (N+1, V)
        t2 = time.perf_counter()
        keep = [0] + [i + 1 for i in path]  # cur and the accepted path
        compact_cache(tcache, t_len, keep)
        accepted = tokens[path]
        run.commit(accepted, None if feats is None else feats[keep])
        cur = tokens.new_tensor([nxt])
        done = _emit(out, accepted.tolist() + [nxt], eos_ids, max_new_tokens, on_token)
        stats.step(len(tokens), len(path), t1 - t0, t2 - t1)
    stats.new_tokens = len(out)
    return out, stats


@torch.no_grad()
def _static_head_tree(drafter, h_cur: torch.Tensor, cur: torch.Tensor, tree: TreeSpec) -> torch.Tensor:
    """Node tokens (N,) of a static tree drafted by heads: one ``logits_after`` call per distinct parent."""
    tokens = torch.zeros(len(tree), dtype=torch.long, device=cur.device)
    child_logits = {}  # parent node (-1 = root) -> logits of its children
    for i, (par, rank) in enumerate(zip(tree.parents, tree.ranks)):
        if par not in child_logits:
            path, n = [], par
            while n >= 0:
                path.append(tokens[n:n + 1])
                n = tree.parents[n]
            child_logits[par] = drafter.logits_after(h_cur, [cur, *reversed(path)])
        tokens[i] = torch.topk(child_logits[par], rank + 1).indices[-1]
    return tokens


def _most_nodes(tree: TreeSpec | DynamicTree) -> int:
    """The most draft nodes one step can hold (KV-cache room): every node a dynamic tree records, or the tree."""
    if isinstance(tree, DynamicTree):
        return tree.top_k + (tree.depth - 1) * tree.top_k ** 2
    return len(tree)


def _tree_accept(tokens, parents, logits, temperature, top_k, top_p, generator) -> tuple[list[int], int]:
    """Greedy (deepest argmax path) or point-mass sampling verification of a tree -> (accepted path, next)."""
    if temperature <= 0:
        return greedy_tree_accept(tokens, parents, logits)
    return sample_tree_accept(tokens, parents, process_logits(logits, temperature, top_k, top_p), generator)


def _head_tree(target, drafter, prompt_ids, max_new_tokens, tree: TreeSpec | DynamicTree, temperature, top_k,
               top_p, eos_ids, generator, on_token=None) -> tuple[list[int], DecodeStats]:
    """Tree decoding with feature heads. Static (Medusa-style) trees: node (r1..rd) is the r_d-th best token of
    head d-1 after its ancestors' tokens. Dynamic trees: EAGLE-2's expansion by cumulative draft log-prob
    (``_draft_dynamic``), head d scoring the children of every depth-d frontier node. One target forward under the
    tree mask verifies all nodes and returns the hidden state of the last accepted node for the next step. No
    drafter cache at all (Hydra++'s prefix layer reads only committed positions)."""
    dynamic = isinstance(tree, DynamicTree)
    max_depth = tree.depth if dynamic else max(tree.depths)
    if max_depth > drafter.max_draft_len:
        raise ValueError(f"tree depth {max_depth} exceeds the drafter's {drafter.max_draft_len} heads")
    stats = DecodeStats(accept_counts=[0] * (max_depth + 1))
    if max_new_tokens <= 0:
        return [], stats
    prompt = _prepare(target, prompt_ids)
    device = prompt.device
    if not dynamic:
        parents = torch.tensor(tree.parents, dtype=torch.long, device=device)
        anc, depths = tree_mask(parents)
    n_nodes = _most_nodes(tree)
    max_len = prompt.shape[1] + max_new_tokens + n_nodes + max_depth + 2
    tcache, context = target.new_cache(1, max_len), drafter.new_context(max_len)
    last = torch.zeros_like(prompt, dtype=torch.bool)
    last[:, -1] = True
    logits, h = _with_hidden(target, prompt, tcache, logits_at=last)
    h_cur = drafter.read_context(h[0], context)[-1]
    cur, _ = _pick(logits[-1], temperature, top_k, top_p, generator)
    out: list[int] = []
    done = _emit(out, [int(cur)], eos_ids, max_new_tokens, on_token)
    while not done:
        t0 = time.perf_counter()
        if dynamic:
            tokens, parents, anc, depths = _draft_dynamic(_HeadDrafting(drafter, h_cur), cur, tree)
        else:
            tokens = _static_head_tree(drafter, h_cur, cur, tree)
        _sync(device)
        t1 = time.perf_counter()
        t_len = tcache.length
        mask = torch.ones(1, len(tokens) + 1, t_len + len(tokens) + 1, dtype=torch.bool, device=device)
        mask[0, :, t_len:] = anc
        L = target.cfg.n_layers
        logits, cap = target(torch.cat([cur, tokens]).view(1, -1), pos=(t_len + depths).view(1, -1), cache=tcache,
                             attn_mask=mask, capture_layers=(L,))
        logits = logits[0]
        path, nxt = _tree_accept(tokens, parents, logits, temperature, top_k, top_p, generator)
        t2 = time.perf_counter()
        keep = [0] + [i + 1 for i in path]  # cur and the accepted path; the last one's LM-head output is nxt
        h_cur = drafter.read_context(target.norm(cap[L][0, keep]), context)[-1]
        compact_cache(tcache, t_len, keep)
        accepted = tokens[path]
        cur = tokens.new_tensor([nxt])
        done = _emit(out, accepted.tolist() + [nxt], eos_ids, max_new_tokens, on_token)
        stats.step(len(tokens), len(path), t1 - t0, t2 - t1)
    stats.new_tokens = len(out)
    return out, stats
