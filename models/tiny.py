"""A tiny random Llama target built in code: 2 layers, hidden 64, a 300-token byte-level BPE tokenizer trained on a
given corpus, and a ChatML chat template. The tests, the bad-input and kill probes and the load benchmark run on it,
offline and in seconds; it is a real HF folder (config.json, model.safetensors, tokenizer files), loaded like any
target."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(corpus: list[str], vocab_size: int = 300):
    """A byte-level BPE (``vocab_size`` tokens: <pad>, <|im_start|>, <|im_end|> and merges learned on ``corpus``),
    ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", bos_token="<|im_start|>"
    )
    fast.chat_template = CHATML
    return fast


def save_tiny_target(path, tok, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random model of ``family`` (llama; qwen2: q/k/v bias; qwen3: q/k-norm and head_dim 32, not dim / heads)
    over ``tok``, weights from ``torch.manual_seed(seed)``, saved with its tokenizer to ``path``; ``overrides``
    change config fields."""
    import transformers

    arch = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=len(tok),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        **({"head_dim": 32} if family == "qwen3" else {}),
    )
    cfg.update(overrides)
    config = getattr(transformers, f"{arch}Config")(**cfg)
    getattr(transformers, f"{arch}ForCausalLM")(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return Path(path)


def save_tiny_llama(path, tok, seed: int = 0, **overrides) -> Path:
    """``save_tiny_target`` of the llama family."""
    return save_tiny_target(path, tok, "llama", seed, **overrides)


def build_tiny_target(path, corpus: list[str], seed: int = 0) -> Path:
    """``save_tiny_llama`` with a tokenizer trained on ``corpus``."""
    return save_tiny_llama(path, tiny_tokenizer(corpus), seed)


def passthrough_eagle(target, version: int = 3, seed: int = 1, counts=None, eos_ids=frozenset(), **section):
    """An EAGLE drafter for a tiny target that drafts the target's own last prediction again: EAGLE-3's fc passes
    the last aux layer (the target's final layer output; ``aux_layers`` ends with it unless given) into the target's
    final norm and head, EAGLE-1's fc passes the final feature into the target's head; every other trainable tensor
    is small and random (norms near 1), so each one changes the output a little. On the repetitive answers of tiny
    random targets most drafts are accepted, which makes an engine's acceptance counts a real comparison.
    ``counts``: token frequencies for a reduced head (``draft_vocab``)."""
    from draftsmith.models.eagle import build_eagle

    L, d = target.cfg.n_layers, target.cfg.dim
    if version == 3:
        section = {"aux_layers": sorted({0, 1, L - 1}), "draft_vocab": 120, **section}
    e = build_eagle({"version": version, **section}, target, counts=counts, eos_ids=set(eos_ids))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in e.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.02 + (1.0 if "norm" in name else 0.0))
        if version == 3:  # the last aux block of fc's input
            e.fc.weight[:, -d:] += torch.eye(d)
            e.norm.weight.copy_(target.norm.weight)
        else:  # [embedding, final feature] -> the feature
            e.fc.weight[:, d:] += torch.eye(d)
        d2t = getattr(e, "d2t", None)
        keep = slice(None) if d2t is None else torch.arange(len(d2t)) + d2t
        e.lm_head.weight.copy_(target.lm_head.weight[keep])
    return e
