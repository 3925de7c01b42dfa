"""Draft LMs (TokenRows): chains lossless for good, bad, oracle and adversarial drafters with the rollback of
both caches mid-chain, the fused fp32 fast path, speculative sampling end to end, and the stop hook reading the
drafter's final state. Trees of draft LMs are in tests/test_tree.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (
    DECODE_PROMPTS,
    NEW,
    REFERENCE_DRAFTERS,
    TINY_CFG,
    TINY_CFG8,
    check_tau_consistency,
    noisy_copy,
    reference_drafter,
    sampled_joint,
    tiny_model,
    tv,
)

from draftsmith.eval.decoder import DecodeStats, autoregressive_generate, speculative_generate
from draftsmith.eval.tree_decoder import tree_speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


@pytest.mark.parametrize("draft_len", [1, 3, 5])
@pytest.mark.parametrize("kind", REFERENCE_DRAFTERS)
def test_greedy_lossless(target, ar_outputs, kind, draft_len):
    drafter = reference_drafter(kind, target)
    total = DecodeStats()
    for prompt in DECODE_PROMPTS:
        out, st = speculative_generate(target, drafter, torch.tensor(prompt), NEW, draft_len=draft_len)
        assert out == ar_outputs[tuple(prompt)]
        assert st.new_tokens == NEW
        assert st.accepted <= st.drafted <= draft_len * st.target_forwards
        check_tau_consistency(st)
        if kind == "oracle":  # every draft accepted: full steps of draft_len + 1, the last one maybe clamped
            assert st.acceptance_rate == 1.0
            assert st.target_forwards == math.ceil((NEW - 1) / (draft_len + 1))
            assert st.tau == pytest.approx((NEW - 1) / st.target_forwards)
            assert st.accept_counts[draft_len] >= st.target_forwards - 1
            # only the clamped last step can look like a rejection to the histogram-based estimate
            assert min(st.per_position_acceptance()) >= 1 - 1 / st.target_forwards
        if kind == "anti":  # every draft rejected: one token per verify
            assert st.drafted == draft_len * st.target_forwards - sum(range(1, draft_len + 1))
            assert st.accepted == 0 and st.acceptance_rate == 0.0
            assert st.target_forwards == NEW - 1 and st.tau == 1.0
            assert st.accept_counts[0] == st.target_forwards
            assert st.per_position_acceptance() == [0.0] * draft_len
        total.merge(st)
    if kind == "noisy":  # partial acceptance: the rollback of both caches mid-chain is exercised
        assert 0.1 < total.acceptance_rate < 0.9
        assert sum(total.accept_counts[1:draft_len]) > 0 or draft_len == 1


@pytest.mark.parametrize("draft_len", [1, 3])
def test_optimized_fp32_models_stay_lossless(draft_len):
    """The eval default (fused, pre-packed fp32 target and drafter) keeps speculative output = its own AR output."""
    from draftsmith.eval.tree import DynamicTree

    tgt = tiny_model(0).float().optimize_for_inference()
    drafter = noisy_copy(tiny_model(0)).float().optimize_for_inference()
    tree = DynamicTree(top_k=3, depth=draft_len, total_tokens=6)
    for prompt in DECODE_PROMPTS:
        x = torch.tensor(prompt)
        ar = autoregressive_generate(tgt, x, NEW)
        assert speculative_generate(tgt, drafter, x, NEW, draft_len=draft_len)[0] == ar
        assert tree_speculative_generate(tgt, drafter, x, NEW, tree)[0] == ar


def test_speculative_sampling_matches_target_end_to_end():
    target, drafter = tiny_model(0, TINY_CFG8, logit_scale=3.0), tiny_model(1, TINY_CFG8, logit_scale=3.0)
    gen = torch.Generator().manual_seed(0)
    # 4 new tokens: the prefill one, then a first verify step with the full γ = 2
    emp, joint, st = sampled_joint(
        lambda x: speculative_generate(target, drafter, x, 4, draft_len=2, temperature=1.0, generator=gen),
        target,
        [1, 2, 3, 4],
        3,
        3000,
    )
    assert 0.05 < st.acceptance_rate < 0.95  # both accept and reject paths were exercised
    for dims in [(1, 2), (0, 2), (0, 1)]:  # marginals of t1, t2, t3
        assert tv(emp.sum(dims), joint.sum(dims)) < 0.03, dims
    assert tv(emp.sum(2), joint.sum(2)) < 0.05  # joint of (t1, t2)


def test_stop_drafting_hook_adapts_length_and_stays_lossless(target, ar_outputs):
    """An adaptive-length hook (here: stop when the drafter is unsure, or at random) changes how many tokens are
    drafted per step, never the output; the hook sees the drafter's logits and final hidden state."""
    drafter = noisy_copy(target)
    seen = []

    def unsure(i, logits, hidden):
        seen.append((i, logits.shape, None if hidden is None else hidden.shape))
        return bool(torch.softmax(logits, -1).max() < 0.5)

    gen = torch.Generator().manual_seed(0)

    def coin(i, logits, hidden):
        return bool(torch.rand((), generator=gen) < 0.5)

    for prompt in DECODE_PROMPTS:
        ref = ar_outputs[tuple(prompt)]
        fixed = speculative_generate(target, drafter, torch.tensor(prompt), NEW, draft_len=5)[1]
        for hook in (unsure, coin):
            out, st = speculative_generate(target, drafter, torch.tensor(prompt), NEW, draft_len=5, stop_drafting=hook)
            assert out == ref
            assert st.drafted < fixed.drafted  # it really stopped early somewhere
    assert seen and seen[0][1] == (TINY_CFG.vocab_size,) and seen[0][2] == (TINY_CFG.dim,)
    # stop after the first draft == draft_len 1
    one = speculative_generate(
        target, drafter, torch.tensor(DECODE_PROMPTS[1]), NEW, draft_len=5, stop_drafting=lambda i, lg, h: True
    )[1]
    ref1 = speculative_generate(target, drafter, torch.tensor(DECODE_PROMPTS[1]), NEW, draft_len=1)[1]
    assert (one.drafted, one.accepted, one.target_forwards) == (ref1.drafted, ref1.accepted, ref1.target_forwards)
