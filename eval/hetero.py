"""Speculative decoding with a draft LM whose tokenizer differs from the target's, lossless (docs/decoding.md
"Drafts with their own vocabulary"; Timor et al. 2025, arXiv 2502.05202; OmniDraft, arXiv 2507.02659): one
decode's draft side (``HeteroRow``), one per row of the decoder's ``OwnVocabRows``.

The draft reads and writes its own token ids; the target verifies target ids. Text is the common ground:

- ``slem`` (string-level exact match): the draft continues the committed text by γ of its tokens; their text is
  re-tokenized by the target's tokenizer from the last committed target token's text onward (so a merge across
  the boundary is seen) and the target verifies those tokens in one forward. Greedy keeps the longest prefix equal
  to the target's argmax; with sampling each candidate is a point proposal (accept x with probability p(x), else
  draw from p without x), which is lossless for any proposal.
- ``tli`` (token-level intersection): the draft's distribution restricted to the tokens whose strings both
  vocabularies have, renormalised and moved to target ids, then standard rejection sampling.

After every step the committed text is re-tokenized by the draft's tokenizer (a tail of it: ``DraftContext``); the
draft's KV cache keeps the longest unchanged prefix and reads the rest. ``NgramCache`` (OmniDraft-style) learns
draft-token n-grams -> target tokens from verified steps and translates later drafts without the tokenizer; like
everything on the draft side it changes only which candidates the target sees, never what is committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

from draftsmith.eval.accept import Sampler

BAD = "\ufffd"  # what a decoder writes for bytes that are not (yet) a whole UTF-8 character


@lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """The GPT-2 byte-level alphabet: printable stand-in character -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_surfaces(tok) -> dict[int, bytes | str]:
    """id -> what the token writes: its bytes (byte-level BPE, or SentencePiece with ``▁`` and ``<0xNN>``), or
    its content string for special/added tokens. Two vocabularies share a token when the surfaces are equal."""
    chars = _byte_level_chars()
    special = {t.content if hasattr(t, "content") else str(t) for t in tok.added_tokens_decoder.values()}
    vocab = tok.get_vocab()
    byte_level = all(c in chars for s in vocab if s not in special for c in s)
    out: dict[int, bytes | str] = {}
    for s, i in vocab.items():
        if s in special:
            out[i] = s
        elif byte_level:
            out[i] = bytes(chars[c] for c in s)
        elif len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            out[i] = bytes([int(s[3:5], 16)])
        else:
            out[i] = s.replace("\u2581", " ").encode()
    return out


class Vocabs:
    """The target's and the draft's tokenizers: text in both directions, and the shared tokens (``d2t``: draft id
    -> target id, -1 where the target has no token with that surface)."""

    def __init__(self, target_tok, draft_tok, target_size: int | None = None, draft_size: int | None = None):
        self.t, self.d = target_tok, draft_tok
        t_of = {s: i for i, s in token_surfaces(target_tok).items() if target_size is None or i < target_size}
        d_surf = token_surfaces(draft_tok)
        n_d = draft_size or max(d_surf) + 1
        self.d2t = torch.full((n_d,), -1, dtype=torch.long)
        for i, s in d_surf.items():
            if i < n_d and s in t_of:
                self.d2t[i] = t_of[s]
        self.shared = self.d2t >= 0

    @staticmethod
    def text(tok, ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @staticmethod
    def ids(tok, text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    def draft_context(self, target_ids: list[int]) -> list[int]:
        """The committed target ids as draft ids: their text (a trailing partial character dropped) re-tokenized."""
        return self.ids(self.d, self.text(self.t, target_ids).rstrip(BAD))

    def draft_text(self, context: list[int], drafts: list[int], window: int = 4) -> str:
        """The text the drafts add after the draft context (decoded with a few context tokens, so decoders that
        depend on the left neighbour write it right); a trailing partial character dropped."""
        ctx = context[-window:]
        before = self.text(self.d, ctx)
        return self.text(self.d, ctx + drafts)[len(before) :].rstrip(BAD)

    def to_target(self, cur: int, text: str) -> list[int]:
        """``text`` after the committed token ``cur`` as target ids: re-tokenized together with cur's text, so a
        merge across the boundary is seen; if the re-tokenization no longer starts with cur (cur's text merges
        with the draft's), the text alone."""
        head = self.text(self.t, [cur])
        if BAD not in head:
            enc = self.ids(self.t, head + text)
            if enc[:1] == [cur]:
                return enc[1:]
        return self.ids(self.t, text)


class DraftContext:
    """The committed target ids as draft ids, re-tokenizing only a tail: once the tail holds more than 2·``window``
    target tokens, its head up to a word boundary (a space next) is fixed, provided its draft tokens are the same
    alone as in the whole tail. Each step then costs O(window), not O(text); it can only differ from re-tokenizing
    everything where a draft token would span that boundary, which changes acceptance, never output."""

    def __init__(self, vocabs: Vocabs, window: int = 64):
        self.v, self.window = vocabs, window
        self.n, self.fixed = 0, []  # target tokens before the anchor, their draft ids

    def __call__(self, seq: list[int]) -> list[int]:
        v, tail = self.v, seq[self.n :]
        tail_ids = v.ids(v.d, v.text(v.t, tail).rstrip(BAD))
        out = self.fixed + tail_ids
        if len(tail) > 2 * self.window:
            for k in range(len(tail) - self.window, len(tail) - self.window - 8, -1):
                head, rest = v.text(v.t, tail[:k]), v.text(v.t, tail[k:])
                if head.endswith(BAD) or not rest[:1].isspace():
                    continue
                head_ids = v.ids(v.d, head)
                if tail_ids[: len(head_ids)] == head_ids:
                    self.n, self.fixed = self.n + k, self.fixed + head_ids
                break
        return out


@dataclass
class NgramCache:
    """OmniDraft-style translation table: a tuple of up to ``max_n`` draft ids -> the target ids that write the
    same text, learned from verified steps (segments whose boundaries agree in both tokenizations). ``translate``
    covers a draft by longest matches or gives None (the caller re-tokenizes)."""

    max_n: int = 4
    max_entries: int = 1 << 16  # a table shared by a long-running server stays bounded: the oldest n-gram goes first
    table: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def translate(self, drafts: list[int]) -> list[int] | None:
        """Draft ids -> target ids by longest matches in the table; None unless it covers every draft."""
        out, i = [], 0
        while i < len(drafts):
            for n in range(min(self.max_n, len(drafts) - i), 0, -1):
                tgt = self.table.get(tuple(drafts[i : i + n]))
                if tgt is not None:
                    out += tgt
                    i += n
                    break
            else:
                self.misses += 1
                return None
        self.hits += 1
        return out

    def learn(self, vocabs: Vocabs, drafts: list[int], kept: list[int]) -> None:
        """Record the aligned segments of a step: ``drafts`` (draft ids) and ``kept``, target ids the target
        accepted that write a prefix of the drafts' text."""
        if not Vocabs.text(vocabs.d, drafts).startswith(Vocabs.text(vocabs.t, kept).rstrip(BAD)):
            return  # the kept ids do not write the drafts' text from its start: nothing lines up
        cut_d = _boundaries(vocabs.d, drafts)
        cut_t = _boundaries(vocabs.t, kept)
        i = j = 0  # tokens consumed on each side
        for c in sorted(set(cut_d) & set(cut_t)):
            a, b = cut_d[c], cut_t[c]
            if 0 < a - i <= self.max_n:
                key = tuple(drafts[i:a])
                self.table.pop(key, None)  # re-learned: now the newest
                self.table[key] = tuple(kept[j:b])
                if len(self.table) > self.max_entries:
                    del self.table[next(iter(self.table))]
            i, j = a, b


def _boundaries(tok, ids: list[int]) -> dict[int, int]:
    """Character offset after each whole-character prefix of ``ids`` -> how many tokens that prefix has."""
    out = {}
    for n in range(1, len(ids) + 1):
        s = Vocabs.text(tok, ids[:n])
        if not s.endswith(BAD):
            out[len(s)] = n
    return out


class _Draft:
    """The draft LM with its KV cache and the ids in it; ``logits_after(context)`` keeps the longest cached prefix
    of the new context, rolls back the rest and reads what is new."""

    def __init__(self, lm, max_len: int):
        self.lm, self.max_len = lm, max_len
        self.cache, self.ids = lm.new_cache(1, max_len), []
        self.device = next(iter(lm.parameters())).device

    def logits_after(self, context: list[int]) -> torch.Tensor:
        n = 0
        for a, b in zip(self.ids, context[:-1]):  # at least the last token is read again: its logits are needed
            if a != b:
                break
            n += 1
        self.cache.length, self.ids = n, self.ids[:n]
        return self.feed(context[n:])

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Read ``ids`` -> the logits after the last one (V_draft,)."""
        if len(self.ids) + len(ids) > self.max_len:  # a longer text than sized for: a bigger cache, read again
            self.max_len = 2 * (len(self.ids) + len(ids))
            ids, self.ids = self.ids + ids, []
            self.cache = self.lm.new_cache(1, self.max_len)
        out = self.lm(torch.tensor(ids, device=self.device).view(1, -1), cache=self.cache)
        self.ids += ids
        return (out[0] if isinstance(out, tuple) else out)[0, -1]


class OwnVocabDrafter(torch.nn.Module):
    """A draft LM with its own tokenizer, ready for the decoders (its proposer: ``OwnVocabRows``).
    method: "slem", "tli", or "auto" (slem when greedy, tli when sampling); ngram: use an ``NgramCache``, one per
    decode, or with ``shared_ngram`` one for every decode of this drafter (``shared``: learned across prompts and
    requests; it changes which candidates the target sees, never what is committed)."""

    own_vocab = True

    def __init__(self, lm: torch.nn.Module, tokenizer, target_tokenizer, method: str = "auto", ngram: bool = False,
                 shared_ngram: bool = False):  # fmt: skip
        super().__init__()
        self.shared = NgramCache() if ngram and shared_ngram else None
        self.lm, self.tokenizer, self.target_tokenizer, self.method, self.ngram = (
            lm,
            tokenizer,
            target_tokenizer,
            method,
            ngram,
        )
        self._vocabs: Vocabs | None = None

    def vocabs(self, target) -> Vocabs:
        if self._vocabs is None:
            self._vocabs = Vocabs(self.target_tokenizer, self.tokenizer, target.cfg.vocab_size, self.lm.cfg.vocab_size)
        return self._vocabs

    def num_params(self) -> int:
        return sum(p.numel() for p in self.lm.parameters())


def resolve_method(method: str, sampler: Sampler, draft_len: int) -> tuple[str, int]:
    """An ``OwnVocabDrafter``'s method for a decode with ``sampler`` -> (slem or tli, the most candidates a step
    verifies: 2·draft_len for slem, draft_len for tli)."""
    m = method if method != "auto" else ("slem" if sampler.greedy else "tli")
    if m not in ("slem", "tli"):
        raise ValueError(f"own-vocabulary drafting method must be slem, tli or auto, got {method!r}")
    if draft_len < 1:
        raise ValueError(f"draft_len must be >= 1 for an own-vocabulary drafter, got {draft_len}")
    return m, 2 * draft_len if m == "slem" else draft_len


class HeteroRow:
    """One decode's draft side with an ``OwnVocabDrafter``: the committed target ids (``seq``, the last one not yet
    in the target's cache), their draft ids (``DraftContext``), the draft's KV cache (``_Draft``) and its
    ``NgramCache``. A step is ``propose`` (candidate target ids and, for tli, their q), the target's verify of
    them with the chain's rule, and ``commit``; the decoder keeps one per row (``OwnVocabRows``), every row verified
    in one target forward."""

    def __init__(self, target, drafter: OwnVocabDrafter, sampler: Sampler, draft_len: int, seq: list[int],
                 max_new_tokens: int, ngram: NgramCache | None = None):  # fmt: skip
        self.method, self.depth = resolve_method(drafter.method, sampler, draft_len)
        self.sampler, self.draft_len, self.seq = sampler, draft_len, seq
        self.vocabs = drafter.vocabs(target)
        if ngram is None and drafter.ngram:  # the drafter's shared table, else one of this decode's own
            ngram = drafter.shared if drafter.shared is not None else NgramCache()
        self.ngram = ngram
        self.ctx = DraftContext(self.vocabs)
        self.context: list[int] | None = self.ctx(seq)
        self.draft = _Draft(drafter.lm, len(self.context) + 4 * max_new_tokens + draft_len + 8)
        self.device = next(target.parameters()).device
        self.d2t, self.shared = self.vocabs.d2t.to(self.device), self.vocabs.shared.to(self.device)
        self.V = target.cfg.vocab_size
        self.drafts: list[int] = []  # this step's draft ids
        self.q: list[torch.Tensor] = []  # tli: the distributions (over target ids) they were drawn from
        self.cand: list[int] = []  # this step's candidate target ids
        self.cached = 0  # how many of them the n-gram cache translated

    def propose(self, budget: int) -> list[int]:
        """The draft writes up to draft_len of its tokens after the committed text -> up to min(depth, budget)
        candidate target ids: slem re-tokenizes their text (or the n-gram cache translates them), tli maps them."""
        sampler, gen, budget = self.sampler, self.sampler.generator, min(self.depth, budget)
        d2t, shared = self.d2t, self.shared
        if self.context is None:
            self.context = self.ctx(self.seq)
        dl = self.draft.logits_after(self.context)
        drafts, q = [], []
        for i in range(min(self.draft_len, budget)):
            if self.method == "tli":  # the draft's distribution on the shared tokens, renormalised
                probs = sampler.probs(dl).masked_fill(~shared[: dl.shape[-1]], 0)
                if not float(probs.sum()) > 0:
                    break
                probs = probs / probs.sum()
                tok = int(probs.argmax()) if sampler.greedy else int(torch.multinomial(probs, 1, generator=gen))
                zero = torch.zeros(self.V, device=self.device, dtype=probs.dtype)
                q.append(zero.index_add_(0, d2t[shared], probs[shared]))
            else:
                tok = int(dl.argmax())
            drafts.append(tok)
            if i + 1 < min(self.draft_len, budget):
                dl = self.draft.feed([tok])
        self.cached = 0
        if self.method == "tli":
            cand = d2t[torch.tensor(drafts, dtype=torch.long, device=self.device)].tolist() if drafts else []
        else:
            cand = self.ngram.translate(drafts) if self.ngram is not None and drafts else None
            if cand is not None:
                self.cached = len(cand[:budget])
            elif drafts:
                cand = self.vocabs.to_target(self.seq[-1], self.vocabs.draft_text(self.context, drafts))
            else:
                cand = []
            cand = cand[:budget]
        self.drafts, self.q, self.cand = drafts, q, cand
        return cand

    def commit(self, n: int, nxt: int) -> None:
        """The target kept the first n candidates and wrote nxt after them."""
        if self.ngram is not None and self.method == "slem" and n:
            self.ngram.learn(self.vocabs, self.drafts, self.cand[:n])
        self.seq += self.cand[:n] + [nxt]
        self.context, self.cand, self.drafts, self.q = None, [], [], []  # re-tokenized when the next step needs it


class OwnVocabRows:
    """The proposer of a draft LM with its own tokenizer (``OwnVocabDrafter``), for the chain shape: each row keeps
    its own ``HeteroRow`` (committed target ids, draft-side context, draft KV cache, n-gram cache); its candidates
    are a chain of 0..2·draft_len target ids (slem re-tokenizes text, so rows differ), verified with every other
    row's in one target forward and accepted by the chain's rule: the greedy prefix, or rejection sampling with a
    point proposal at each slem candidate or tli's intersection distribution as q.
    Greedy rows use slem and sampled rows tli under method auto."""

    reads_target = False
    layers: tuple[int, ...] = ()

    def __init__(self, target, drafter: OwnVocabDrafter, draft_len: int):
        resolve_method(drafter.method, Sampler(0.0), draft_len)  # refuses a bad method or draft_len now
        self.t, self.d, self.draft_len = target, drafter, draft_len
        self.depth = 2 * draft_len if drafter.method in ("slem", "auto") else draft_len  # the most a row verifies
        self.caches: list = []

    def row_depth(self, sampler: Sampler) -> int:
        return resolve_method(self.d.method, sampler, self.draft_len)[1]

    def join(self, rows, ids: torch.Tensor, valid, pos, captured: dict, live: list[int]) -> None:
        for j in live:
            r = rows[j]
            r.hetero = HeteroRow(self.t, self.d, r.sampler, self.draft_len, r.prompt.tolist() + [r.cur], r.max_new)

    def draft(self, rows, cur: torch.Tensor, gam: list[int], pick):
        """Every row's candidates (each row's draft side, one after another) -> (candidates per position [(B,)],
        their q per position [(B, V)] or [None] when every row is greedy, candidates per row); None: none."""
        cands = []
        for r, g in zip(rows, gam):
            cands.append(r.hetero.propose(g) if g > 0 else [])
            if g > 0:
                r.stats.ngram_candidates += r.hetero.cached
        G = max(len(c) for c in cands)
        if G == 0:
            return None
        B, V, dev = len(rows), self.t.cfg.vocab_size, cur.device
        toks = torch.zeros(B, G, dtype=torch.long, device=dev)
        for b, c in enumerate(cands):
            toks[b, : len(c)] = torch.tensor(c, dtype=torch.long, device=dev)
        q = None
        if any(not r.sampler.greedy for r in rows):
            q = torch.zeros(B, G, V, device=dev)
            for b, (r, c) in enumerate(zip(rows, cands)):
                if r.sampler.greedy or not c:
                    continue
                if r.hetero.method == "tli":
                    q[b, : len(c)] = torch.stack(r.hetero.q[: len(c)])
                else:  # a point proposal at each candidate (lossless for any proposal: the module docstring)
                    q[b, torch.arange(len(c), device=dev), toks[b, : len(c)]] = 1.0
        return list(toks.unbind(1)), [None] * G if q is None else list(q.unbind(1)), [len(c) for c in cands]

    def commit(self, rows, cur: torch.Tensor, drafts: torch.Tensor, v, captured: dict) -> None:
        for r, a, t in zip(rows, v.accepted, v.nxt):
            r.hetero.commit(len(a), t)


def hetero_generate(target, drafter: OwnVocabDrafter, prompt_ids: torch.Tensor, max_new_tokens: int, **options):
    """Speculative decoding with an ``OwnVocabDrafter``, batch 1: prompt_ids (T,) target ids -> (new target ids,
    truncated after the first EOS and to max_new_tokens; stats), as ``speculative_generate`` (the same loop; its
    keywords in ``options``). Each step the draft writes ``draft_len`` of its tokens; a slem step verifies up to
    2·draft_len target tokens of their text, a tli step exactly the drafts. Counters: drafted/accepted are target
    tokens; ngram_candidates those the n-gram cache wrote."""
    from draftsmith.eval.decoder import speculative_generate

    return speculative_generate(target, drafter, prompt_ids, max_new_tokens, **options)
