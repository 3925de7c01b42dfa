"""Training a draft LM with its own tokenizer (``drafter.tokenizer``): learning a small byte-level BPE and
re-tokenizing the target-written records (eval/own_vocab.py loads such a drafter for decoding).

Training is sequence-level distillation with cross-entropy: the records' stored top-k log-probs are over the
target's vocabulary and cannot be moved onto another one, so only the target's text is used.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.utils.data import Dataset

from draftsmith.data.records import Record
from draftsmith.errors import DraftsmithError

log = logging.getLogger(__name__)

TRAINED_DIR = "draft_tokenizer"  # in a run folder: the BPE learned for drafter.tokenizer=train


def _special_strings(tok) -> list[str]:
    """The target's special and added tokens (chat markers, EOS, pad), lowest id first."""
    added = sorted(tok.added_tokens_decoder.items())
    return list(dict.fromkeys(t.content for _, t in added))


def train_bpe(texts, vocab_size: int, target_tok):
    """A byte-level BPE of ``vocab_size`` tokens learned on ``texts``, with the target's special tokens (so its chat
    markers and EOS are single tokens with the same strings: they map to the target's) and its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = _special_strings(target_tok)
    if vocab_size < 256 + len(specials) + 1:
        raise DraftsmithError(f"drafter.vocab_size={vocab_size}: a byte-level BPE needs more than 256 + specials")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    named = {k: getattr(target_tok, k) for k in ("eos_token", "pad_token", "bos_token") if getattr(target_tok, k, None)}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    fast.chat_template = target_tok.chat_template
    return fast


def record_texts(data_dir: Path, target_tok):
    """Every record's text (prompt and the target's answer), decoded: what a drafter tokenizer is learned on."""
    from draftsmith.data.dataset import RecordDataset

    ds = RecordDataset(data_dir, 1 << 30, signals=set())
    for i in range(len(ds)):
        yield target_tok.decode(ds[i].input_ids.tolist(), skip_special_tokens=False)


def draft_tokenizer(section, run_dir: Path, target_tok, data_dir: Path):
    """The tokenizer ``drafter.tokenizer`` names: a folder, or ``train``: the BPE learned once on the run's records
    (data.prompts and the target's answers) and kept in RUN/draft_tokenizer, reused by later runs."""
    from transformers import AutoTokenizer

    spec = section.tokenizer
    path = Path(run_dir) / TRAINED_DIR if spec == "train" else Path(spec)
    if spec == "train" and not (path / "tokenizer.json").is_file():
        tok = train_bpe(record_texts(data_dir, target_tok), section.vocab_size, target_tok)
        tok.save_pretrained(path)
        log.info("draft tokenizer: %d tokens learned on %s -> %s", len(tok), data_dir, path)
    if not path.is_dir():
        raise DraftsmithError(f"drafter.tokenizer {spec!r}: no tokenizer folder at {path}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a folder without tokenizer files
        raise DraftsmithError(f"drafter.tokenizer {spec!r}: cannot load a tokenizer from {path} ({e})") from None


def retokenize(r: Record, target_tok, draft_tok, max_len: int) -> Record:
    """A target record as draft ids: each run of prompt or answer tokens decoded and re-encoded on its own (so the
    answer mask stays exact), no teacher signals."""
    ids, mask = torch.as_tensor(r.input_ids).tolist(), [int(m) for m in torch.as_tensor(r.loss_mask).tolist()]
    out_ids: list[int] = []
    out_mask: list[int] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = target_tok.decode(ids[start:i], skip_special_tokens=False)
            new = draft_tok.encode(text, add_special_tokens=False)
            out_ids += new
            out_mask += [mask[start]] * len(new)
            start = i
    out_ids, out_mask = out_ids[:max_len], out_mask[:max_len]
    return Record(torch.tensor(out_ids), torch.tensor(out_mask), r.prompt_index, r.sample_index, r.source, {})


class RetokenizedDataset(Dataset):
    """A RecordDataset's records in the draft's tokenization (``retokenize``)."""

    def __init__(self, ds, target_tok, draft_tok, max_len: int):
        self.ds, self.t, self.d, self.max_len = ds, target_tok, draft_tok, max_len

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> Record:
        return retokenize(self.ds[i], self.t, self.d, self.max_len)


def check_loss(tc) -> None:
    """Only the target's text crosses vocabularies: cross-entropy on it, with the records as the teacher."""
    if tc.loss.kind != "ce" or tc.loss.teacher != "records":
        raise DraftsmithError(
            f"drafter.tokenizer: a draft with its own vocabulary trains with train.loss.kind=ce on the target's "
            f"answers (got kind={tc.loss.kind}, teacher={tc.loss.teacher}); the stored top-k log-probs and the "
            f"target's logits are over the target's vocabulary"
        )
