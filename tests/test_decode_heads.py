"""Feature heads (HeadRows: Medusa, Hydra, Hydra++, MLP speculator): lossless chains, static and dynamic
trees, the hidden state handed to them aligned with cur (oracles), reduced vocabularies, Hydra++'s prefix
layer context, and sampling through chains and trees keeping the target's distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DECODE_PROMPTS,
    NEW,
    TINY_CFG,
    TINY_CFG8,
    AlignedOracleHeads,
    check_tau_consistency,
    proposer_kinds,
    sampled_joint,
    tiny_heads,
    tiny_model,
    tv,
)

from draftsmith.eval.decoder import speculative_generate
from draftsmith.eval.tree_decoder import tree_speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


class _TreeOracleHeads(AlignedOracleHeads):
    """For dynamic trees: ``logits_after`` checks the hidden state at each step's root and ranks the known greedy
    continuation first after any path that follows it, batched over frontier nodes as the decoder calls it."""

    def __init__(self, target, ar, depth):
        super().__init__(target, ar)
        self.k, self.depth = None, depth

    def logits_after(self, h, path):
        if len(path) == 1:  # a step's root: cur is ar[k], just after the last accepted path
            cur = int(path[0][0])
            assert int(self.target.lm_head(h[0]).argmax()) == cur
            lo = 0 if self.k is None else self.k + 1
            self.k = (
                lo
                if self.k is None
                else max(i for i in range(lo, min(lo + self.depth + 1, len(self.ar))) if self.ar[i] == cur)
            )
            self.checked += 1
        rows = torch.stack([t.reshape(-1) for t in path], -1).view(-1, len(path)).tolist()  # (n, depth + 1)
        logits = torch.zeros(len(rows), self.target.cfg.vocab_size, dtype=h.dtype)
        nxt = self.k + len(path)
        for r, row in enumerate(rows):
            logits[r, self.ar[nxt] if row == self.ar[self.k : nxt] and nxt < len(self.ar) else r % 5] = 10.0
        return logits


@pytest.mark.parametrize("kind", proposer_kinds("heads"))
@pytest.mark.parametrize("draft_len", [1, 3, 5])
def test_feature_heads_are_lossless_and_features_aligned(target, ar_outputs, draft_len, kind):
    heads = tiny_heads(kind, target, 4, 0.05)
    for prompt in DECODE_PROMPTS:
        out, st = speculative_generate(target, heads, torch.tensor(prompt), NEW, draft_len=draft_len)
        assert out == ar_outputs[tuple(prompt)]
        assert st.drafted <= min(draft_len, 4) * st.target_forwards
        check_tau_consistency(st)
        oracle = AlignedOracleHeads(target, ar_outputs[tuple(prompt)])
        out, st = speculative_generate(target, oracle, torch.tensor(prompt), NEW, draft_len=draft_len)
        assert out == ar_outputs[tuple(prompt)] and st.acceptance_rate == 1.0 and oracle.checked > 1
    from draftsmith.eval.tree import DynamicTree, tree_from_choices

    # EAGLE-2-style dynamic trees, head d scoring the children of depth-d nodes; deeper than the heads is refused
    for spec in (DynamicTree(2, 2, 4), DynamicTree(3, 4, 10)):
        for prompt in DECODE_PROMPTS:
            out, st = tree_speculative_generate(target, heads, torch.tensor(prompt), NEW, spec)
            assert out == ar_outputs[tuple(prompt)] and st.drafted == st.target_forwards * spec.total_tokens
        oracle = _TreeOracleHeads(target, ar_outputs[tuple(DECODE_PROMPTS[2])], spec.depth)
        out, st = tree_speculative_generate(target, oracle, torch.tensor(DECODE_PROMPTS[2]), NEW, spec)
        assert out == ar_outputs[tuple(DECODE_PROMPTS[2])] and oracle.checked == st.target_forwards > 1
        assert st.accepted >= (st.target_forwards - 1) * spec.depth  # the known path is found at full depth
    with pytest.raises(ValueError, match="exceeds"):
        tree_speculative_generate(target, heads, torch.tensor(DECODE_PROMPTS[0]), 4, DynamicTree(2, 5, 4))
    # static Medusa-style trees: top-2 at each of the first two depths, a top-1 spine below
    tree = tree_from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]][: 2 + draft_len])
    for prompt in DECODE_PROMPTS:
        out, st = tree_speculative_generate(target, heads, torch.tensor(prompt), NEW, tree)
        assert out == ar_outputs[tuple(prompt)] and st.accepted <= st.target_forwards * max(tree.depths)


@pytest.mark.parametrize("kind", proposer_kinds("heads"))
def test_heads_with_a_reduced_vocabulary_decode_losslessly_and_round_trip(target, ar_outputs, kind, tmp_path):
    """drafter.draft_vocab for heads: the N most frequent tokens' rows of the target's LM head, -inf elsewhere in
    the target vocabulary; lossless chain and tree; checkpoint and pre-packed (eval.optimize) paths agree."""
    from draftsmith.eval.tree import tree_from_choices
    from draftsmith.models.registry import build_drafter, load_drafter, save_drafter

    counts = torch.arange(TINY_CFG.vocab_size, dtype=torch.float)  # the highest ids are the most frequent
    params = {
        "n_predict" if kind == "mlp_speculator" else "n_heads": 3,
        "draft_vocab": 24,
        **({"prefix_attention": True} if kind == "hydra++" else {}),
    }
    heads = build_drafter(kind.rstrip("+"), params, target, counts=counts, eos_ids={2})
    lm = lambda m: m.head if kind == "mlp_speculator" else m.lm_heads  # noqa: E731
    keep = heads.head_ids
    assert (
        len(keep) == 24
        and 2 in keep.tolist()
        and set(range(TINY_CFG.vocab_size - 23, TINY_CFG.vocab_size)) <= set(keep.tolist())
    )
    torch.testing.assert_close(lm(heads)[1].weight, target.lm_head.weight[keep])
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    h, cur = torch.randn(TINY_CFG.dim, dtype=torch.float64), torch.tensor([keep[0]])
    row = heads.logits_after(h, [cur, cur])
    assert row.shape == (TINY_CFG.vocab_size,)
    assert torch.isinf(row[heads.t2d < 0]).all() and torch.isfinite(row[keep]).all()
    tree = tree_from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    for prompt in DECODE_PROMPTS:
        want = ar_outputs[tuple(prompt)]
        assert speculative_generate(target, heads, torch.tensor(prompt), NEW, draft_len=3)[0] == want
        assert tree_speculative_generate(target, heads, torch.tensor(prompt), NEW, tree)[0] == want
    loaded, info = load_drafter(save_drafter(tmp_path / kind, heads, kind.rstrip("+"), {}), dtype=torch.float64)
    assert info["config"]["head_vocab_size"] == 24
    torch.testing.assert_close(loaded.logits_after(h, [cur, cur]), row)
    n_params = loaded.num_params()
    hs = torch.randn(5, TINY_CFG.dim, dtype=torch.float64)
    context = loaded.read_context(hs, loaded.new_context(8))  # Hydra++'s prefix layer (the identity otherwise)
    fast = loaded.float().optimize_for_inference()
    assert fast.num_params() == n_params and type(lm(fast)[0]).__name__ == "FusedLinear"  # counts kept
    torch.testing.assert_close(fast.logits_after(h.float(), [cur, cur]), row.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        fast.read_context(hs.float(), fast.new_context(8)), context.float(), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("kind", proposer_kinds("heads"))
def test_feature_heads_sampling_keeps_the_target_distribution(kind):
    tgt = tiny_model(0, TINY_CFG8, logit_scale=3.0)
    heads = tiny_heads(kind, tgt, 2, 0.3)
    gen = torch.Generator().manual_seed(0)
    emp, joint, st = sampled_joint(
        lambda x: speculative_generate(tgt, heads, x, 4, draft_len=2, temperature=1.0, generator=gen),
        tgt,
        [1, 2, 3, 4],
        3,
        3000,
    )
    assert 0.05 < st.acceptance_rate < 0.95
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert tv(emp.sum(dims), joint.sum(dims)) < 0.03, dims
    assert tv(emp.sum(2), joint.sum(2)) < 0.05


def test_feature_heads_tree_sampling_keeps_the_target_distribution():
    from draftsmith.eval.tree import tree_from_choices

    tgt = tiny_model(0, TINY_CFG8, logit_scale=3.0)
    heads = tiny_heads("hydra", tgt, 2, 0.3)
    tree = tree_from_choices([[0], [1], [0, 0], [1, 0]])
    gen = torch.Generator().manual_seed(1)
    emp, joint, st = sampled_joint(
        lambda x: tree_speculative_generate(tgt, heads, x, 4, tree, temperature=1.0, generator=gen),
        tgt,
        [1, 2, 3, 4],
        3,
        3000,
    )
    assert 0.05 < st.acceptance_rate < 0.95
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert tv(emp.sum(dims), joint.sum(dims)) < 0.03, dims


def test_hydra_pp_prefix_layer_context_matches_the_training_pass(target, ar_outputs):
    """Hydra++: the prefix layer's decode-time cache (fed each step's committed positions) must hand the heads
    exactly the state the causal training pass computes at the position that produced the current token."""
    from draftsmith.eval.tree import tree_from_choices

    heads = tiny_heads("hydra++", target, 3, 0.05)
    assert heads.new_context(8) is not None
    prompt = DECODE_PROMPTS[1]
    seq = prompt + ar_outputs[tuple(prompt)]
    with torch.no_grad():
        ctx_full = heads.read_context(target(torch.tensor([seq]), return_hidden=True))[0]  # (T, D)
    seen, orig = [], heads.draft_step

    def draft_step(h, path):  # chains call it directly, trees through logits_after
        if len(path) == 1:
            d = (ctx_full - h).abs().amax(-1)
            r = int(d.argmin())
            assert d[r] < 1e-9 and seq[r + 1] == int(path[0])
            seen.append(r)
        return orig(h, path)

    heads.draft_step = draft_step
    for decode in (
        lambda: speculative_generate(target, heads, torch.tensor(prompt), NEW, draft_len=3),
        lambda: tree_speculative_generate(
            target, heads, torch.tensor(prompt), NEW, tree_from_choices([[0], [1], [0, 0]])
        ),
    ):
        seen.clear()
        out, st = decode()
        assert out == ar_outputs[tuple(prompt)] and len(seen) >= st.target_forwards - 1  # last step: γ may be 0
        assert seen == sorted(seen) and seen[0] == len(prompt) - 1
