"""The packaged real target (slow: de-quantises the GGUF on first use). Run with DRAFTSMITH_SLOW=1."""

from __future__ import annotations

import pytest
import torch

from draftsmith.eval.decoder import speculative_generate
from draftsmith.models.loading import encode_chat, load_model, stop_ids
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
    assert out == ref[0, len(ids) :].tolist()
    assert stats.target_forwards > 0


def test_smollm2_multi_turn_data_signals_equal_full_forward(tmp_path):
    """The data stage on the real target: multi-turn ShareGPT at batch 8, EAGLE-3 layers and the last hidden state
    captured during generation equal one plain forward over each finished record."""
    from draftsmith.data.dataset import RecordDataset
    from draftsmith.data.generate import generate
    from draftsmith.recipes.loader import load_recipe

    recipe = load_recipe(
        "quickstart",
        [
            f"out_dir={tmp_path}",
            "data.prompts.n=8",
            "data.prompts.max_turns=2",
            "data.max_new_tokens=12",
            "data.batch_size=8",
            "data.signals.hidden_last=true",
            "data.signals.hidden_layers=eagle3",
            "data.signals.hidden_dtype=float16",
        ],
    )
    generate(recipe)
    tgt = load_model("smollm2-135m-instruct")
    n = tgt.model.cfg.n_layers
    ds = RecordDataset(tmp_path / "data", max_seq_len=4096)
    assert len(ds) >= 6 and any(int(r.loss_mask.long().diff().eq(1).sum()) == 2 for r in ds)  # two turns somewhere
    for r in ds:
        with torch.no_grad():
            logits, cap = tgt.model(r.input_ids[None], capture_layers=(2, n // 2, n - 3, n))
        torch.testing.assert_close(r.signals["hidden_last"], tgt.model.norm(cap[n])[0], atol=3e-2, rtol=1e-2)
        ref_aux = torch.stack([cap[i][0] for i in (2, n // 2, n - 3)], 1)
        torch.testing.assert_close(r.signals["hidden_aux"], ref_aux, atol=5e-2, rtol=1e-2)
        rows = torch.log_softmax(logits[0, :-1][r.loss_mask[1:]], -1)
        torch.testing.assert_close(
            rows.gather(-1, r.signals["topk_ids"]), r.signals["topk_logprobs"], atol=2e-2, rtol=1e-2
        )
