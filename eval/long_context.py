"""Long-context eval (``eval.long_context``): prompts of given token lengths cut from long documents, each decoded
speculatively and by draftsmith's own plain decoding, with tau, acceptance, speedup and the lossless match per length.

The documents (any prompt source) are joined into one token stream; each prompt is a chat whose user turn is a
window of that stream followed by an instruction, sized so that the encoded prompt (chat template included) has
the requested length. Windows of one length are spread across the stream.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.errors import DraftsmithError
from draftsmith.eval.bench import _strategy, _timed
from draftsmith.eval.decoder import DecodeStats, autoregressive_generate
from draftsmith.eval.graphs import graph_decoding
from draftsmith.eval.prompts import prompts_from
from draftsmith.models.loading import encode_chat, read_json

SLACK = 16  # stream tokens kept free past a window's nominal end: its size is adjusted and its start shifted
SHIFTS = 8  # start offsets tried when re-tokenization steps over the exact length
FIRST_READ = 64  # records read first when prompts.n is unset; the read grows 4x until the stream is long enough


def max_positions(tgt) -> int | None:
    """The target's context length: config.json's max_position_embeddings (n_positions in GPT-2-style configs);
    None when it names neither."""
    cfg = read_json(Path(tgt.path) / "config.json")
    return next((int(cfg[k]) for k in ("max_position_embeddings", "n_positions") if cfg.get(k)), None)


def check_lengths(setup, ec) -> None:
    """Refuse, in one line naming eval.long_context.lengths, a length whose prompt, answer and draft block would
    run past the target's positions."""
    limit = max_positions(setup.tgt)
    depth = _strategy(ec)[1]  # the deepest draft a step verifies: the chain's length or the tree's depth
    for L in ec.long_context.lengths:
        need = L + ec.max_new_tokens + depth
        if limit is not None and need > limit:
            raise DraftsmithError(
                f"eval.long_context.lengths: {L} + eval.max_new_tokens {ec.max_new_tokens} + a draft of {depth} "
                f"= {need} tokens exceeds the target's {limit} positions (max_position_embeddings)"
            )


def _content(text: str, instruction: str) -> str:
    return f"{text}\n\n{instruction}" if instruction else text


def _encode(tokenizer, text: str, instruction: str) -> list[int]:
    """The eval prompt encoding (encode_chat) of one user turn: the text, then the instruction. Literal: text that
    spells a control token stays text."""
    return encode_chat(tokenizer, [{"role": "user", "content": _content(text, instruction)}], literal=True)


def _texts(prompt) -> list[str]:
    return [prompt.text] if prompt.text is not None else [m["content"] for m in prompt.messages]


def _stream(tokenizer, pc, need: int) -> list[int]:
    """Token ids of the documents joined in order, read until they hold ``need`` tokens, the source ends or
    prompts.n records were read. Control-token spellings in the documents are tokenized as text."""
    bound = pc.n or FIRST_READ
    while True:
        docs = prompts_from(pc, bound, text_ok=True)
        text = "\n\n".join(t for p in docs for t in _texts(p) if t.strip())
        ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]
        if len(ids) >= need or pc.n or len(docs) < bound:
            return ids
        bound *= 4


def _starts(span: int, n: int, rng: random.Random) -> list[int]:
    """n window starts in [0, span], evenly spaced with a seeded phase (distinct when span + 1 >= n)."""
    step = (span + 1) / n
    phase = rng.random() * step
    return [int(phase + i * step) for i in range(n)]


def _fit_at(tokenizer, stream: list[int], start: int, k: int, L: int, instruction: str) -> list[int] | None:
    """The prompt on stream[start:start + k] (decoded) with k grown or shrunk by the miss until it encodes to L
    tokens; where re-tokenization steps over L, the longest prompt below it (None if none was)."""
    best, tried = None, set()
    while k not in tried and 0 < k <= len(stream) - start:
        tried.add(k)
        ids = _encode(tokenizer, tokenizer.decode(stream[start : start + k]), instruction)
        if len(ids) == L:
            return ids
        if len(ids) < L and (best is None or len(ids) > len(best)):
            best = ids
        k += L - len(ids)
    return best


def _fit(tokenizer, stream: list[int], start: int, k: int, L: int, instruction: str) -> list[int]:
    """An L-token prompt whose window starts at ``start`` or a few tokens later; else the longest one below L."""
    best = None
    for shift in range(SHIFTS):
        ids = _fit_at(tokenizer, stream, start + shift, k, L, instruction)
        if ids is not None and len(ids) == L:
            return ids
        if ids is not None and (best is None or len(ids) > len(best)):
            best = ids
    if best is None:
        raise DraftsmithError(f"eval.long_context: no window of the documents encodes to {L} tokens or fewer")
    return best


def long_prompts(tokenizer, lc, seed: int) -> dict[int, list[list[int]]]:
    """{length: lc.n encoded chat prompts of that many tokens}: windows of the document stream spread across it
    (overlapping when the stream is short), each followed by lc.instruction. A prompt is exactly its length
    unless re-tokenization at the window's edges steps over it; then it is the longest one below it."""
    overhead = len(_encode(tokenizer, "", lc.instruction))
    if lc.lengths[0] <= overhead:
        raise DraftsmithError(
            f"eval.long_context.lengths: {lc.lengths[0]} tokens leave no room for a document after the chat template "
            f"and eval.long_context.instruction ({overhead} tokens)"
        )
    k_max = lc.lengths[-1] - overhead
    stream = _stream(tokenizer, lc.prompts, lc.n * (k_max + SLACK))
    if len(stream) < k_max + SLACK:
        raise DraftsmithError(
            f"eval.long_context.prompts: the documents hold {len(stream)} tokens, fewer than the {k_max + SLACK} a "
            f"{lc.lengths[-1]}-token prompt needs (use a longer source or shorter eval.long_context.lengths)"
        )
    rng, out = random.Random(seed), {}
    for L in lc.lengths:
        k = L - overhead
        starts = _starts(len(stream) - k - SLACK, lc.n, rng)
        out[L] = [_fit(tokenizer, stream, s, k, L, lc.instruction) for s in starts]
    return out


def prepare(setup, ec, seed: int) -> dict[int, list[list[int]]]:
    """Checks the lengths against the target, then builds the prompts: before anything is decoded."""
    check_lengths(setup, ec)
    return long_prompts(setup.tgt.tokenizer, ec.long_context, seed)


@contextmanager
def _graphed_for(dec, max_len: int):
    """While open, the decoders' CUDA-graph wrappers (eval.cuda_graphs) are rebuilt around the plain models with a
    static cache of ``max_len`` slots where the main prompts' cache is smaller; yields whether any was. Without
    wrappers (CPU, eval.cuda_graphs false) nothing changes."""
    tgt, drafter = dec.tgt.model, dec.drafter
    new_tgt = tgt is not dec.plain_target and tgt.max_len < max_len
    new_drafter = drafter is not dec.plain_drafter and drafter.max_len < max_len
    try:
        if new_tgt:
            dec.tgt.model = graph_decoding(dec.plain_target, max_len)
        if new_drafter:
            dec.drafter = graph_decoding(dec.plain_drafter, max_len)
        yield new_tgt or new_drafter
    finally:
        dec.tgt.model, dec.drafter = tgt, drafter


def _decode(dec, ec, eos: set[int], ids: list[int]):
    """-> ((speculative tokens, stats), seconds, own plain tokens, seconds), as eval's decoders run one prompt."""
    x = torch.tensor(ids, device=dec.device)
    spec, t_spec = _timed(lambda: dec.speculative(x), dec.device)
    ar, t_ar = _timed(
        lambda: autoregressive_generate(dec.tgt.model, x, ec.max_new_tokens, eos_ids=eos, generator=dec.gen,
                                        **dec.sampling), dec.device,
    )  # fmt: skip
    return spec, t_spec, ar, t_ar


def _entry(prompts: list[list[int]], runs: list, greedy: bool) -> dict:
    """One length's report entry from its prompts' decodes."""
    stats, secs, toks, matches = DecodeStats(), {"spec": 0.0, "ar": 0.0}, {"spec": 0, "ar": 0}, 0
    for (spec, st), t_spec, ar, t_ar in runs:
        stats.merge(st)
        secs["spec"], secs["ar"] = secs["spec"] + t_spec, secs["ar"] + t_ar
        toks["spec"], toks["ar"] = toks["spec"] + len(spec), toks["ar"] + len(ar)
        matches += spec == ar
    tps = {k: toks[k] / secs[k] for k in secs if secs[k] > 0}
    return {
        "prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "prompts": len(prompts),
        "tau": stats.tau,
        "acceptance_rate": stats.acceptance_rate,
        "per_position_acceptance": stats.per_position_acceptance(),
        "tokens_per_s": tps,
        "speedup_vs_ar": tps["spec"] / tps["ar"] if len(tps) == 2 and tps["ar"] > 0 else None,
        "lossless_match": matches / len(runs) if greedy else None,
        "new_tokens": stats.new_tokens,
    }


def run_long_context(dec, setup, ec, prompts: dict[int, list[list[int]]]) -> dict:
    """{str(length): {prompt_tokens (mean), prompts, tau, acceptance_rate, per_position_acceptance, tokens_per_s
    {spec, ar}, speedup_vs_ar, lossless_match (greedy: share of prompts whose speculative output equals the plain
    one), new_tokens}}. ``dec``: eval's decoders (eval/bench.py ``_Decoders``); no HF baselines run here."""
    out, greedy = {}, ec.temperature == 0
    bar = tqdm(total=sum(map(len, prompts.values())), desc="long context", unit="prompt", dynamic_ncols=True)
    with bar:
        for L, batch in prompts.items():
            # room for the prompt, the answer and the widest draft block or tree, as for the main prompts
            with _graphed_for(dec, max(map(len, batch)) + ec.max_new_tokens + 512) as regraphed:
                if regraphed and ec.warmup:  # new graphs are captured on their first calls: not timed
                    _decode(dec, ec, setup.eos, batch[0])
                runs = []
                for ids in batch:
                    runs.append(_decode(dec, ec, setup.eos, ids))
                    bar.update()
            out[str(L)] = _entry(batch, runs, greedy)
    return out
