"""EAGLE drafters (FeatureRows): (feature, next token) pairs re-read with the target's features after every
verify. Lossless chains, static and dynamic trees for EAGLE-1/3, reduced vocabularies and deeper stacks; the
pairs, features and positions aligned (an oracle); sampling keeping the target's distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DECODE_PROMPTS,
    NEW,
    TINY_CFG8,
    EagleOracle,
    check_tau_consistency,
    sampled_joint,
    tiny_eagle,
    tiny_model,
    tv,
)

from draftsmith.eval.decoder import speculative_generate
from draftsmith.eval.tree_decoder import tree_speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


@pytest.mark.parametrize("version,vocab,depth", [(1, None, 1), (3, None, 1), (1, 24, 1), (3, 24, 1), (3, 24, 3)])
def test_eagle_is_lossless_chain_static_and_dynamic_trees(target, ar_outputs, version, vocab, depth):
    from draftsmith.eval.tree import DynamicTree, tree_from_choices

    eagle = tiny_eagle(version, target, 0.05, draft_vocab=vocab, n_layers=depth)
    tree = tree_from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    for prompt in DECODE_PROMPTS:
        want = ar_outputs[tuple(prompt)]
        for draft_len in (1, 4):
            out, st = speculative_generate(target, eagle, torch.tensor(prompt), NEW, draft_len=draft_len)
            assert out == want
            check_tau_consistency(st)
        out, _ = tree_speculative_generate(target, eagle, torch.tensor(prompt), NEW, tree)
        assert out == want
        out, st = tree_speculative_generate(target, eagle, torch.tensor(prompt), NEW, DynamicTree(3, 4, 10))
        assert out == want and st.drafted <= 10 * st.target_forwards


def test_eagle_features_and_positions_are_aligned(target, ar_outputs):
    """The off-by-one check: an oracle fed the decoder's pairs reaches full acceptance, chain and trees."""
    from draftsmith.eval.tree import DynamicTree, tree_from_choices

    static = tree_from_choices([[0], [1], [0, 0], [0, 0, 0]])
    for prompt in DECODE_PROMPTS:
        want, x = ar_outputs[tuple(prompt)], torch.tensor(prompt)
        for decode in (
            lambda d, x=x: speculative_generate(target, d, x, NEW, draft_len=5),
            lambda d, x=x: tree_speculative_generate(target, d, x, NEW, static),
            lambda d, x=x: tree_speculative_generate(target, d, x, NEW, DynamicTree(2, 5, 8)),
        ):
            oracle = EagleOracle(target, prompt, want)
            out, st = decode(oracle)
            assert out == want and oracle.checked >= NEW - 7  # pairs of the last step are never re-read
            assert st.accept_counts[-1] >= st.target_forwards - 1  # full depth each step (the last may clamp)


@pytest.mark.parametrize("version,vocab", [(1, None), (3, None), (1, 5)])
def test_eagle_sampling_keeps_the_target_distribution(version, vocab):
    """EAGLE-1 through the chain (rejection sampling), EAGLE-3 through a dynamic tree (point-mass rule). With a
    reduced vocabulary (5 of 8 tokens) the 3 missing tokens get q = 0 and must still appear at p's rate."""
    from draftsmith.eval.tree import DynamicTree

    tgt = tiny_model(0, TINY_CFG8, logit_scale=3.0)
    eagle = tiny_eagle(version, tgt, 0.3, draft_vocab=vocab)
    gen = torch.Generator().manual_seed(0)
    if version == 1:

        def decode(x):
            return speculative_generate(tgt, eagle, x, 4, draft_len=2, temperature=1.0, generator=gen)
    else:

        def decode(x):
            return tree_speculative_generate(tgt, eagle, x, 4, DynamicTree(2, 2, 4), temperature=1.0, generator=gen)

    emp, joint, st = sampled_joint(decode, tgt, [1, 2, 3, 4], 3, 3000)
    assert st.accept_counts[0] > 300 and sum(st.accept_counts[1:]) > 300  # both outcomes exercised
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert tv(emp.sum(dims), joint.sum(dims)) < 0.03, dims
    assert tv(emp.sum(2), joint.sum(2)) < 0.05
