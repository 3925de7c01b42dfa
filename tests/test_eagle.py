"""EAGLE-1 / EAGLE-3 model: the training-time-test unroll equals what the decoder runs step by step with a KV cache
(so training simulates inference exactly), feature capture, and the reduced-vocabulary maps."""

from __future__ import annotations

import pytest
import torch

from draftsmith.models.eagle import build_eagle, default_aux_layers
from draftsmith.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=50, dim=32, n_layers=6, n_heads=4, n_kv_heads=2, hidden_dim=64)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return Llama(CFG).double().eval()


def _eagle(target, version, **params):
    e = build_eagle({"version": version, **params}, target).double()
    with torch.no_grad():
        for p in e.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return e


@pytest.mark.parametrize(
    "version,depth,window", [(1, 1, None), (3, 1, None), (1, 3, None), (3, 3, None), (3, 1, 5), (3, 2, 6)]
)
def test_ttt_unroll_equals_cached_step_by_step_drafting(target, version, depth, window):
    """Row i of TTT step s must be exactly the state the decoder reaches at position i + s after reading the
    real pairs 0..i and then feeding its own outputs with tokens x_{i+2}..x_{i+s+1} (every block of a deeper
    stack has its own keys per step); with a sliding window, both see only the last ``window`` positions."""
    torch.manual_seed(1)
    e = _eagle(target, version, n_layers=depth, sliding_window=window, ttt_steps=4)
    ids = torch.randint(0, CFG.vocab_size, (2, 12))
    _, cap = target(ids, capture_layers=e.capture_layers)
    f = e.features(cap, target)
    assert f.shape == (2, 12, CFG.dim * (3 if version == 3 else 1))
    outs = e(f, ids, steps=4)  # (steps, B, T, d)
    for b in range(2):
        for i in range(7):
            cache = e.new_cache(1, 32)
            _, out = e.step(e.project(f[b : b + 1, : i + 1]), ids[b : b + 1, 1 : i + 2], cache=cache)
            torch.testing.assert_close(out[0, -1], outs[0, b, i])
            for s in range(1, 4):
                _, out = e.step(out[:, -1:], ids[b : b + 1, i + s + 1 : i + s + 2], cache=cache)
                torch.testing.assert_close(out[0, -1], outs[s, b, i])


def test_eagle3_fuses_the_low_mid_high_layers_and_maps_its_vocabulary(target):
    assert default_aux_layers(32) == (1, 15, 28) and default_aux_layers(6) == (1, 2, 2)
    counts = torch.arange(CFG.vocab_size, dtype=torch.float64)  # the highest ids are the most frequent
    e = build_eagle({"version": 3, "draft_vocab": 10, "aux_layers": [0, 2, 4]}, target, counts=counts, eos_ids={3})
    assert e.capture_layers == (1, 3, 5) and e.fc.in_features == 3 * CFG.dim and e.fc.bias is None
    kept = torch.arange(len(e.d2t)) + e.d2t
    assert kept.tolist() == [3, *range(41, 50)]  # EOS forced in, then the 9 most frequent
    assert (e.t2d[kept] == torch.arange(10)).all() and int((e.t2d >= 0).sum()) == 10
    torch.testing.assert_close(e.lm_head.weight, target.lm_head.weight[kept].to(e.lm_head.weight.dtype))
    logits, _ = e.step(torch.zeros(1, 2, CFG.dim, dtype=torch.float64), torch.tensor([[1, 2]]))
    assert logits.shape == (1, 2, CFG.vocab_size) and torch.isinf(logits[0, 0, :41]).sum() == 40
    e1 = build_eagle({"version": 1}, target)
    assert e1.capture_layers == (CFG.n_layers,) and not e1.lm_head.weight.requires_grad
    assert not e1.embed_tokens.weight.requires_grad and e.lm_head.weight.requires_grad
    # EAGLE-1 with a reduced vocabulary (FR-Spec): a frozen slice of the target's head, same logits on kept ids
    s1 = build_eagle({"version": 1, "draft_vocab": 10}, target, counts=counts, eos_ids={2})
    kept = s1.lm_head.target_ids
    assert not s1.lm_head.weight.requires_grad and len(kept) == 10 and 2 in kept.tolist()
    torch.testing.assert_close(s1.lm_head.weight, target.lm_head.weight[kept])
    x = torch.randn(3, CFG.dim, dtype=s1.lm_head.weight.dtype)
    full, sliced = e1.lm_head(x), s1.lm_head(x)
    torch.testing.assert_close(sliced[:, kept], full[:, kept])
    assert torch.isinf(sliced).sum() == 3 * (CFG.vocab_size - 10)


@pytest.mark.parametrize("version,depth", [(1, 1), (3, 1), (3, 2)])
def test_optimized_eagle_steps_like_the_plain_one(target, version, depth):
    import copy

    torch.manual_seed(2)
    e = build_eagle(
        {"version": version, "draft_vocab": 20, "n_layers": depth, "init_layers": [4] * (depth - 1)},
        target,
        counts=torch.rand(CFG.vocab_size),
    ).double()
    fast = copy.deepcopy(e).optimize_for_inference()
    state, ids = torch.randn(1, 5, CFG.dim, dtype=torch.float64), torch.randint(0, CFG.vocab_size, (1, 5))
    c1, c2 = e.new_cache(1, 8), fast.new_cache(1, 8)
    for a, b in zip(e.step(state, ids, cache=c1), fast.step(state, ids, cache=c2)):
        torch.testing.assert_close(a, b)
    la, _ = e.step(state[:, :2], ids[:, :2], cache=c1, last_only=True)
    assert la.shape == (1, 1, CFG.vocab_size) and fast.num_params() == e.num_params()


@pytest.mark.parametrize("version", [1, 3])
def test_a_deeper_eagle_starts_as_the_one_layer_one_or_from_target_layers(target, version, tmp_path):
    """Identity blocks: the same outputs as the 1-layer drafter it grows from (train.init_checkpoint may name that
    checkpoint: only the added blocks may be missing, and only for a warm start, never for resume).
    init_layers: the blocks are copies of those target layers."""
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.registry import load_weights_into, save_drafter

    torch.manual_seed(3)
    one = _eagle(target, version)
    deep = build_eagle({"version": version, "n_layers": 3}, target).double()
    save_drafter(tmp_path / "one", one, "eagle", {})
    load_weights_into(tmp_path / "one", deep, grow=True)
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    _, cap = target(ids, capture_layers=one.capture_layers)
    f = one.features(cap, target)
    torch.testing.assert_close(deep(f, ids, steps=3), one(f, ids, steps=3))
    with pytest.raises(DraftsmithError, match="does not fit"):
        load_weights_into(tmp_path / "one", deep)  # resume is strict
    copied = build_eagle({"version": version, "n_layers": 3, "init_layers": [5, 2]}, target)
    for block, src in zip(copied.extra, (5, 2)):
        for k, v in target.layers[src].state_dict().items():
            torch.testing.assert_close(block.state_dict()[k], v)
    assert copied.new_cache(1, 4).kv.shape[1] == 3
    with pytest.raises(DraftsmithError, match="init_layers"):
        build_eagle({"version": version, "n_layers": 3, "init_layers": [1]}, target)
    with pytest.raises(DraftsmithError, match="outside"):
        build_eagle({"version": version, "n_layers": 2, "init_layers": [6]}, target)


@pytest.mark.parametrize("version", [1, 3])
def test_acceptance_labels_and_states_match_the_decoders_first_draft(target, version):
    """SpecDec++ on EAGLE: per selected position t, the label is [draft == target argmax at t+1] (greedy) and the
    head input is the state the decoder reaches after reading the real pairs 0..t and then its own first draft."""
    from draftsmith.models.acceptance import AcceptanceConfig, AcceptanceHead, AcceptanceHeadConfig
    from draftsmith.train.objectives import Context, eagle_acceptance_inputs

    torch.manual_seed(2)
    e = _eagle(target, version)
    ids = torch.randint(0, CFG.vocab_size, (2, 10))
    pm = torch.zeros(2, 10, dtype=torch.bool)
    pm[:, 3:9] = True  # positions 3..8 predict response tokens
    head = AcceptanceHead(AcceptanceConfig(dim=CFG.dim, n_layers=1, draft_kind="eagle"))
    assert head.needs_target and head.signals_needed == set()
    ctx = Context(unwrapped=head, target=target, params=AcceptanceHeadConfig(draft="-", n_layers=1))
    x, s = eagle_acceptance_inputs(
        e, {"input_ids": ids, "predict_mask": pm}, ctx, chunk=3
    )  # chunks of 3 rows: 10 selected rows cross chunk boundaries
    assert x.shape == (10, CFG.dim) and s.shape == (10,)
    _, cap = target(ids, capture_layers=e.capture_layers)
    f = e.features(cap, target)
    tlogits = target(ids)
    row = 0
    for b in range(2):
        for t in range(3, 8):  # pm[t] and pm[t+1]
            cache = e.new_cache(1, 32)
            logits, out = e.step(e.project(f[b : b + 1, : t + 1]), ids[b : b + 1, 1 : t + 2], cache=cache)
            y = logits[0, -1].argmax()
            assert float(s[row]) == float(y == tlogits[b, t + 1].argmax())
            _, out = e.step(out[:, -1:], y.view(1, 1), cache=cache)
            torch.testing.assert_close(x[row], e.head_input(out[0, -1]).float())
            row += 1
    assert row == 10


def test_the_sliding_window_is_in_force_in_training_and_decoding(target):
    """A windowed drafter equals the full-attention one with the same weights while every key is inside the window,
    and differs once keys fall out of it: in the TTT unroll (step s at position i: i + s < window) and in cached
    decoding (a prefill longer than the window)."""
    torch.manual_seed(2)
    w, ids = 4, torch.randint(0, CFG.vocab_size, (2, 12))
    e = _eagle(target, 3, sliding_window=w, ttt_steps=3)
    full = _eagle(target, 3, ttt_steps=3)
    full.load_state_dict(e.state_dict())
    _, cap = target(ids, capture_layers=e.capture_layers)
    f = e.features(cap, target)
    got, ref = e(f, ids, steps=3), full(f, ids, steps=3)
    for s in range(3):
        inside = w - s  # rows 0..w-s-1 keep all their step-0 keys
        torch.testing.assert_close(got[s, :, :inside], ref[s, :, :inside])
        assert (got[s, :, inside:] - ref[s, :, inside:]).abs().amax(-1).min() > 1e-6
    logits = [m.step(m.project(f), ids, cache=m.new_cache(2, 16))[0] for m in (e, full)]
    torch.testing.assert_close(logits[0][:, :w], logits[1][:, :w])
    assert (logits[0][:, w:] - logits[1][:, w:]).abs().amax(-1).min() > 1e-6


@pytest.mark.parametrize("version", [1, 3])
def test_hass_context_alignment_is_the_decoder_fed_its_own_outputs_as_constants(target, version):
    """``drafter.ttt_detach`` (HASS): the unroll's values are unchanged, and the weights' gradient of a row's step-s
    output is the cached step-by-step decoder's when each of its own outputs is fed back as a constant; without
    it the gradient also flows back through the earlier outputs (and differs)."""
    torch.manual_seed(2)
    e = _eagle(target, version, ttt_steps=4)
    ids = torch.randint(0, CFG.vocab_size, (1, 10))
    with torch.no_grad():
        _, cap = target(ids, capture_layers=e.capture_layers)
        f = e.features(cap, target)
    params = [p for p in e.parameters() if p.requires_grad]
    i, s = 4, 3

    def grads(loss):
        return [
            g if g is not None else torch.zeros_like(p)
            for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))
        ]

    hass, full = e(f, ids, steps=4, detach=True), e(f, ids, steps=4)
    torch.testing.assert_close(hass, full, rtol=0, atol=0)
    cache = e.new_cache(1, 32)
    _, out = e.step(e.project(f[:, : i + 1]), ids[:, 1 : i + 2], cache=cache)
    for a in range(1, s + 1):
        _, out = e.step(out[:, -1:].detach(), ids[:, i + a + 1 : i + a + 2], cache=cache)
    ref, got, through = grads(out[0, -1].sum()), grads(hass[s, 0, i].sum()), grads(full[s, 0, i].sum())
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r)
    assert max((a - b).abs().max().item() for a, b in zip(got, through)) > 1e-6


def _fspad_from(plain, target):
    """An FSPAD drafter (token gate + split output) holding ``plain``'s EAGLE-1 weights, both outputs equal."""
    e = build_eagle({"version": 1, "feature_sampling": True, "partial_alignment": True}, target).double()
    sd = {**plain.state_dict(), "mlp.down_proj.weight": plain.mlp.down_proj.weight.repeat(2, 1)}
    e.load_state_dict({**e.state_dict(), **sd})
    return e


def test_fspad_starts_as_eagle1_and_its_unroll_is_what_it_decodes(target):
    """At init FSPAD's token gate adds nothing and both outputs are EAGLE-1's one: the same logits and next state.
    Trained off that start, TTT step s still equals the decoder fed its own next states (the regressed half),
    while the head reads the other half."""
    torch.manual_seed(4)
    plain = _eagle(target, 1)
    e = _fspad_from(plain, target)
    state, ids = torch.randn(1, 6, CFG.dim, dtype=torch.float64), torch.randint(0, CFG.vocab_size, (1, 6))
    for a, b in zip(plain.step(state, ids), e.step(state, ids)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        for p in e.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, CFG.vocab_size, (1, 10))
    _, cap = target(ids, capture_layers=e.capture_layers)
    f = e.features(cap, target)
    outs = e(f, ids, steps=3)  # (steps, B, T, 2d): [head output, next state]
    assert outs.shape[-1] == 2 * CFG.dim
    assert not torch.allclose(e.head_input(outs), e.next_state(outs))  # the two outputs really differ
    for i in range(5):
        cache = e.new_cache(1, 32)
        logits, out = e.step(e.project(f[:, : i + 1]), ids[:, 1 : i + 2], cache=cache)
        for s in range(3):
            torch.testing.assert_close(out[0, -1], e.next_state(outs[s, 0, i]))
            torch.testing.assert_close(logits[0, -1], e.lm_head(e.head_input(outs[s, 0, i])))
            logits, out = e.step(out[:, -1:], ids[:, i + s + 2 : i + s + 3], cache=cache)


def test_fspad_partial_alignment_trains_each_output_by_its_own_loss(target):
    """The token loss reaches only the head half of the MLP's output rows, the feature loss only the state half;
    everything before the split (attention, the gate, the MLP's gate/up) is shared by both."""
    torch.manual_seed(5)
    e = _fspad_from(_eagle(target, 1), target)
    with torch.no_grad():
        e.fs.down_proj.weight.normal_(0, 0.1)  # off the zero start, so the gate's own weights get gradients
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    _, cap = target(ids, capture_layers=e.capture_layers)
    out = e(e.features(cap, target), ids, steps=1)[0]
    w, d = e.mlp.down_proj.weight, CFG.dim
    for loss, used, unused in (
        (e.lm_head(e.head_input(out)).logsumexp(-1).sum(), slice(0, d), slice(d, 2 * d)),
        (e.next_state(out).pow(2).sum(), slice(d, 2 * d), slice(0, d)),
    ):
        e.zero_grad()
        loss.backward(retain_graph=True)
        assert w.grad[unused].abs().max() == 0 and w.grad[used].abs().max() > 0
        assert e.fs.gate_proj.weight.grad.abs().max() > 0 and e.mlp.gate_proj.weight.grad.abs().max() > 0


def test_fspad_options_are_checked_in_one_line(target):
    from draftsmith.errors import DraftsmithError
    from draftsmith.train.objectives import Context, eagle_acceptance_inputs

    with pytest.raises(DraftsmithError, match="feature_sampling .*needs drafter.version=1"):
        build_eagle({"version": 3, "feature_sampling": True}, target)
    with pytest.raises(DraftsmithError, match="partial_alignment .*n_layers=1"):
        build_eagle({"version": 1, "partial_alignment": True, "n_layers": 2}, target)
    e = build_eagle({"version": 1, "partial_alignment": True}, target)
    with pytest.raises(DraftsmithError, match="partial_alignment"):
        eagle_acceptance_inputs(e, {}, Context(unwrapped=e, target=target))
