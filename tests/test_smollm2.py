"""The packaged real target (slow: de-quantises the GGUF on first use). Run with DRAFTSMITH_SLOW=1."""
from __future__ import annotations

import pytest
import torch

from draftsmith.eval.decoder import speculative_generate
from draftsmith.models.hf import encode_chat, load_model, stop_ids
from draftsmith.models.registry import build_drafter

pytestmark = pytest.mark.slow


def test_smollm2_alias_matches_hf_and_decodes_losslessly():
    from transformers import AutoModelForCausalLM

    tgt = load_model("smollm2-135m-instruct")
    assert tgt.model.cfg.n_layers == 30 and tgt.model.cfg.vocab_size == 49152
    hf = AutoModelForCausalLM.from_pretrained(str(tgt.path), dtype=torch.float32).eval()
    ids = encode_chat(tgt.tokenizer, [{"role": "user", "content": "Name three colours."}])
    x = torch.tensor([ids])
    eos = stop_ids(tgt.path, tgt.tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(tgt.model(x), hf(x).logits, atol=1e-3, rtol=1e-3)
        ref = hf.generate(x, max_new_tokens=24, do_sample=False, eos_token_id=sorted(eos), pad_token_id=min(eos))
        drafter = build_drafter("draft_lm", {"n_layers": 1, "init_layers": [0]}, tgt.model).eval()
        out, stats = speculative_generate(tgt.model, drafter, x[0], 24, draft_len=3, eos_ids=eos)
    assert out == ref[0, len(ids):].tolist()
    assert stats.target_forwards > 0
