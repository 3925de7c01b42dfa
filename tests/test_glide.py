"""GliDe (models/glide.py): a one-layer draft LM whose cross-attention reads the target's KV cache. Decoding (every
shape, batches, sampling) comes from the shared suites (it is a token drafter); here: that training's lagged passes
compute exactly what decoding asks of each draft depth, on the target's real cache (interleaved keys too), what
trains, refusals, and a run through `draftsmith train` and `eval`."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.errors import DraftsmithError


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_tokenizer):
    from draftsmith.models.loading import load_model
    from draftsmith.models.tiny import save_tiny_llama

    path = save_tiny_llama(tmp_path_factory.mktemp("t3"), tiny_tokenizer, num_hidden_layers=3)
    return load_model(str(path)).model.double().eval()


def _noisy(d, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return d.eval()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cache_layer", [-1, 0])
def test_each_lag_is_what_decoding_reads_at_that_depth(target, cache_layer, interleaved):
    """The target's cache holds the committed tokens < P; the drafter reads x_0..x_{P+d} with its own cache and
    drafts at depth d from position P + d: its logits there equal the training pass at lag d + 1 (keys <= j - lag),
    also when the target keeps its keys in interleaved-RoPE order (a float32 target after optimize_for_inference)."""
    import copy

    from draftsmith.models.glide import build_glide, key_order, lagged, target_kv

    t = target
    if interleaved:
        t = copy.deepcopy(target).float().optimize_for_inference()
    d = _noisy(build_glide({"cache_layer": cache_layer}, target)).to(t.embed_tokens.weight.dtype)
    T, P = 14, 6
    ids = torch.randint(3, target.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    k, v = target_kv(target, ids, d.cfg.cache_layer)  # the training side reads the plain target
    tol = {"rtol": 1e-4, "atol": 1e-4} if interleaved else {"rtol": 1e-9, "atol": 1e-9}
    with torch.no_grad():
        cache = t.new_cache(2, 32)
        t(ids[:, :P], cache=cache)
        g = d.glimpse_of(cache, key_order(t))
        assert (g.order is not None) == interleaved
        own = d.new_cache(2, 32)
        d(ids[:, :P], cache=own)  # the prompt read (no glimpse: its outputs are discarded)
        for depth in range(4):
            j = P + depth
            got = d(ids[:, j : j + 1], cache=own, glimpse=d.glimpse_of(cache, key_order(t)))[:, 0]
            want = d(ids, glimpse=lagged(k, v, depth + 1))[:, j]  # the whole sequence, as training reads it
            torch.testing.assert_close(got.double(), want.double(), **tol)
            if depth:  # a wrong lag gives other logits: the test can tell lags apart
                other = d(ids, glimpse=lagged(k, v, depth))[:, j]
                assert not torch.allclose(got.double(), other.double(), **tol)


def test_it_starts_as_a_one_layer_draft_lm_and_its_cross_attention_computes_a_target_layers_attention(target):
    """init_layer 0: the layer is the target's first and the cross-attention's output projection zero, so the
    drafter starts as that one-layer draft LM whatever it reads; its query projection and norm are the cache
    layer's, so with that layer's output projection it computes exactly that layer's attention over the cache at
    lag 0 (a query reading its own and earlier keys). Embeddings and LM head are frozen."""
    from draftsmith.models.glide import build_glide, lagged, target_kv
    from draftsmith.models.llama import rope_cos_sin

    d = build_glide({"cache_layer": 1}, target)
    ids = torch.randint(3, target.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    k, v = target_kv(target, ids, 1)
    blk = d.layers[0]
    with torch.no_grad():
        torch.testing.assert_close(d(ids, glimpse=lagged(k, v, 1)), d(ids), rtol=0, atol=0)
        _, cap = target(ids, capture_layers=(1,))
        x = cap[1]  # the input of target layer 1
        layer = target.layers[1]
        cos, sin = rope_cos_sin(torch.arange(9)[None], target.inv_freq, x.dtype)
        want = layer.self_attn(layer.input_layernorm(x), cos, sin, None, None, 1)
        g = lagged(k, v, 0)
        g.cos, g.sin = cos, sin
        blk.cross_attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
        got = blk.cross_attn(blk.cross_attn_layernorm(x), g)
    torch.testing.assert_close(got, want)
    assert torch.equal(blk.mlp.down_proj.weight, target.layers[0].mlp.down_proj.weight)
    assert not d.embed_tokens.weight.requires_grad and not d.lm_head.weight.requires_grad
    assert all(w.requires_grad for n, w in d.named_parameters() if n.startswith(("layers.", "norm.")))


def test_refusals(target):
    from draftsmith.models.glide import build_glide

    with pytest.raises(DraftsmithError, match=r"drafter.cache_layer=3 is outside the target's 3 layers"):
        build_glide({"cache_layer": 3}, target)
    with pytest.raises(DraftsmithError, match="hidden_dim to be the target's"):
        build_glide({"hidden_dim": 8}, target)
    with pytest.raises(DraftsmithError, match=r"drafter.init_layer=5 is outside"):
        build_glide({"init_layer": 5}, target)
    d = build_glide({"hidden_dim": 8, "init_layer": None}, target)
    with pytest.raises(DraftsmithError, match="reads the target's slot KV cache"):
        d.glimpse_of(object())


def test_the_objective_trains_every_lag_and_the_cross_attention(target):
    from draftsmith.models.glide import build_glide
    from draftsmith.recipes.schema import LossConfig
    from draftsmith.train.objectives import Context, glide_objective

    d = build_glide({"lags": 3}, target)
    ids = torch.randint(3, target.cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    pm = torch.zeros(2, 10, dtype=torch.bool)
    pm[:, 4:9] = True
    batch = {"input_ids": ids, "predict_mask": pm, "labels": ids[:, 5:10][pm[:, 4:9]]}
    out = glide_objective(d, batch, LossConfig(kind="ce"), Context(unwrapped=d, target=target))
    assert out.n == 10 and torch.isfinite(out.loss_sum)
    assert {"top1_step0", "top1_step1", "top1_step2"} <= set(out.metrics)
    out.loss_sum.backward()  # the output projection starts at zero: it takes the first gradient of the branch
    assert d.layers[0].cross_attn.o_proj.weight.grad.abs().sum() > 0
    with pytest.raises(DraftsmithError, match="target must run in the loop"):
        glide_objective(d, batch, LossConfig(kind="ce"), Context(unwrapped=d))


def test_a_run_trains_and_decodes_losslessly(train_run, tiny_model_dir, prompts_file, tmp_path):
    """`draftsmith train` then `eval` (chain and dynamic tree): the cross-attention moved, the output is the
    target's, and the vLLM export is refused in one line."""
    import yaml

    from draftsmith.cli import main
    from draftsmith.models.registry import load_drafter
    from draftsmith.recipes.loader import find_recipe

    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "glide", "lags": 2}
    recipe = tmp_path / "tiny-glide.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    run = train_run("glide", "train.steps=3", "train.lr=1e-2", recipe=str(recipe))
    d, info = load_drafter(run / "checkpoints" / "final")
    assert info["kind"] == "glide" and d.cfg.lags == 2 and d.cfg.cache_layer == 1
    for strategy in ("eval.strategy=chain", "eval.strategy=dynamic_tree"):
        args = ["eval", str(recipe), f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}",
                f"out_dir={run}", "target.dtype=float64", strategy, "eval.batch_sizes=[1,3]", "-q"]  # fmt: skip
        assert main(args) == 0
        report = json.loads((run / "eval" / "report.json").read_text())
        assert report["lossless_match"] == 1.0
    assert main(["export", str(recipe), f"out_dir={run}", "--format", "vllm"]) != 0
