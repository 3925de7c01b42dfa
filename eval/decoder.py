"""The bundled speculative decoder: plain autoregressive decoding and chain (gpt-fast style) speculative
decoding on our own KV cache, batch 1; tree decoding is in eval/tree_decoder.py. Lossless: at temperature 0
both produce identical tokens for any drafter, and with sampling the output follows the target distribution
(docs/algorithms.md A1, C4, C7).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftsmith.eval.accept import greedy_accept, judge_accept, rejection_accept
from draftsmith.models.feature_heads import first_stop, split_stop
from draftsmith.models.sampling import process_logits


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
    """A drafter's side of a decode, for the tree decoders (eval/tree_decoder.py) and EAGLE's chain.

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
        tokens from the root down) is for ``_HeadDrafting`` (eval/tree_decoder.py); a drafter with a cache reads
        them from the mask."""
        return self._call(tokens, states, **({} if pos is None else {"pos": pos.view(1, -1)}),
                          **({} if mask is None else {"attn_mask": mask}))

    def commit(self, accepted: torch.Tensor, feats: torch.Tensor | None) -> None:
        """accepted (n,) drafted tokens kept; feats (n + 1, F): the target's features at cur and at them."""
        self.cache.length = self.root_len
        self.ids, self.feats = accepted, feats


def _target_pass(target, drafter, ids: torch.Tensor, cache, **kw):
    """A cached target forward -> (logits, the drafter's input features (T, F) or None). Only EAGLE drafters
    read features from every verify; their layers are captured in the same forward."""
    if not getattr(drafter, "reads_target_features", False):
        return target(ids, cache=cache, **kw), None
    logits, cap = target(ids, cache=cache, capture_layers=drafter.capture_layers, **kw)
    return logits, drafter.features(cap, target)[0]


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
