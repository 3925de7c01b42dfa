"""Decoding a drafter with its own tokenizer (drafter.json ``draft_tokenizer``): eval's and serve's settings for
it, and the wrapper the decoders take (eval/hetero.py ``OwnVocabDrafter``); train/own_vocab.py trains one."""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.eval.hetero import OwnVocabDrafter


def own_vocab_drafter(ckpt: Path, lm, info: dict, target_tok, method: str = "auto", ngram: bool = False,
                      ngram_scope: str = "decode"):  # fmt: skip
    """A loaded drafter checkpoint with its own tokenizer, wrapped for decoding (eval/hetero.py)."""
    from transformers import AutoTokenizer

    path = Path(ckpt) / info["draft_tokenizer"]
    if not path.is_dir():
        raise DraftsmithError(f"{ckpt}: drafter.json names a draft tokenizer, but {path} is missing")
    tok = AutoTokenizer.from_pretrained(path)
    return OwnVocabDrafter(lm, tok, target_tok, method, ngram, shared_ngram=ngram and ngram_scope == "drafter")


def own_vocab_options(ckpt: Path, info: dict, ec) -> tuple[str, bool, str] | None:
    """eval's settings for the drafter at ``ckpt`` -> (method, n-gram cache, its scope) for one with its own
    tokenizer, None
    for one in the target's vocabulary. Refuses what the own-vocabulary decoder does not do (trees, eval.stop,
    eval.judge) and eval.own_vocab set for a drafter in the target's vocabulary."""
    ov = ec.own_vocab
    if not info.get("draft_tokenizer"):
        if ov is not None:
            raise DraftsmithError(
                f"eval.own_vocab: {ckpt} drafts in the target's vocabulary (no drafter.tokenizer); unset eval.own_vocab"
            )
        return None
    if ec.strategy != "chain" or ec.stop is not None or ec.judge is not None:
        raise DraftsmithError(
            f"{ckpt}: a drafter with its own tokenizer decodes chains only: set eval.strategy=chain and leave "
            f"eval.stop and eval.judge unset"
        )
    return (ov.method, ov.ngram_cache, ov.ngram_scope) if ov is not None else ("auto", False, "decode")


def for_decoding(ckpt: Path, lm, info: dict, target_tok, ec):
    """A loaded drafter as the decoders take it: one with its own tokenizer wrapped (``own_vocab_drafter``) with
    eval.own_vocab's method and n-gram cache, any other as it is (``own_vocab_options`` refuses first)."""
    opts = own_vocab_options(ckpt, info, ec)
    return lm if opts is None else own_vocab_drafter(ckpt, lm, info, target_tok, *opts)


def refuse_own_vocab(path: Path, info: dict, what: str) -> None:
    """One line for what takes a drafter in the target's vocabulary only (export)."""
    if info.get("draft_tokenizer"):
        raise DraftsmithError(
            f"{path}: this drafter has its own tokenizer; {what} takes drafters in the target's vocabulary only "
            f"(draftsmith eval and serve decode it)"
        )
