"""GraphedLlama (eval/graphs.py): the static-shape forward equals the eager one, and decoding through it stays
lossless for AR, chain, static and dynamic trees. On CPU the static path runs uncaptured; the `gpu` test
captures and replays real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.eval.graphs import GraphedLlama, graph_decoding
from draftsmith.eval.tree import DynamicTree, tree_from_choices, tree_mask
from draftsmith.eval.tree_decoder import tree_speculative_generate
from draftsmith.models.llama import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128)


def _model(seed, device="cpu", **over):
    torch.manual_seed(seed)
    return Llama(LlamaConfig(**{**CFG.to_dict(), **over})).to(device).eval()


def test_static_forward_matches_eager():
    m = _model(0)
    g = GraphedLlama(m, 64, graphs=False)
    prompt = torch.randint(0, 300, (1, 9))
    c_e, c_s = m.new_cache(1, 64), g.new_cache(1, 64)
    with torch.no_grad():
        assert torch.equal(m(prompt, cache=c_e), g(prompt, cache=c_s))  # the prefill runs eagerly
        for t in (1, 4, 1):  # decode, a verify of 4 tokens, decode again
            x = torch.randint(0, 300, (1, t))
            torch.testing.assert_close(g(x, cache=c_s), m(x, cache=c_e), rtol=1e-5, atol=1e-5)
            assert c_s.length == c_e.length
        parents = torch.tensor([-1, -1, 0, 0, 2])  # a tree verify: its own mask and RoPE positions
        anc, depth = tree_mask(parents)
        n = c_e.length
        mask = torch.ones(1, 6, n + 6, dtype=torch.bool)
        mask[0, :, n:] = anc
        x = torch.randint(0, 300, (1, 6))
        kw = {"pos": (n + depth).view(1, -1), "attn_mask": mask}
        torch.testing.assert_close(g(x, cache=c_s, **kw), m(x, cache=c_e, **kw), rtol=1e-5, atol=1e-5)
        x = torch.randint(0, 300, (1, 4))  # a verify that also returns hidden states (EAGLE, heads)
        (ls, hs), (le, he) = g(x, cache=c_s, capture_layers=(1, 2)), m(x, cache=c_e, capture_layers=(1, 2))
        torch.testing.assert_close(ls, le, rtol=1e-5, atol=1e-5)
        assert hs.keys() == he.keys() == {1, 2}
        for k in hs:
            torch.testing.assert_close(hs[k], he[k], rtol=1e-5, atol=1e-5)
    # one static shape per (T, own mask, own positions, captured layers)
    assert sorted(g._runs) == [
        (1, False, False, ()),
        (4, False, False, ()),
        (4, False, False, (1, 2)),
        (6, True, True, ()),
    ]


def test_feature_drafters_verify_through_the_static_forward():
    """EAGLE (every verify returns the target's layer features) and a Medusa head (its last state) decode
    through a GraphedLlama target exactly as through the eager one: same tokens, same acceptance."""
    from draftsmith.models.eagle import build_eagle
    from draftsmith.models.medusa import build_medusa

    t = _model(0)
    torch.manual_seed(3)
    drafters = {"eagle3": build_eagle({"version": 3}, t).eval(), "medusa": build_medusa({"n_heads": 3}, t).eval()}
    for d in drafters.values():
        with torch.no_grad():
            for q in d.parameters():
                q.add_(torch.randn_like(q) * 0.05)
    p = torch.randint(0, 300, (12,))
    ref = autoregressive_generate(t, p, 40)
    for name, d in drafters.items():
        gt = GraphedLlama(_model(0), 256, graphs=False)
        for k in (1, 4):
            out, st = speculative_generate(gt, d, p, 40, draft_len=k)
            out_e, st_e = speculative_generate(t, d, p, 40, draft_len=k)
            assert out == out_e == ref, name
            assert (st.accepted, st.drafted) == (st_e.accepted, st_e.drafted), name
        spec = DynamicTree(depth=3, top_k=3, total_tokens=8)
        assert tree_speculative_generate(gt, d, p, 40, spec)[0] == ref, name
        assert any(key[3] for key in gt._runs), name  # verifies with hidden states took the static path


def test_eagle_drafters_draft_through_the_static_step():
    """GraphedEagle: an EAGLE drafter's steps through the static-shape path (chains, a static and a dynamic tree)
    give the eager drafter's tokens and acceptance, over an eager or a graphed target; EAGLE-1, EAGLE-3 and a
    deeper EAGLE-3 whose extra block reads the same static cache."""
    from draftsmith.eval.graphs import GraphedEagle
    from draftsmith.models.eagle import build_eagle

    t = _model(0)
    p = torch.randint(0, 300, (12,))
    ref = autoregressive_generate(t, p, 40)
    for params in ({"version": 1}, {"version": 3}, {"version": 3, "n_layers": 2, "init_layers": [1]}):
        torch.manual_seed(3)
        d = build_eagle(params, t).eval()
        with torch.no_grad():
            for q in d.parameters():
                q.add_(torch.randn_like(q) * 0.05)
        g = graph_decoding(d, 256, graphs=False)
        assert isinstance(g, GraphedEagle) and g.capture_layers == d.capture_layers
        trees = (tree_from_choices([[0], [1], [0, 0], [0, 0, 0]]), DynamicTree(depth=3, top_k=3, total_tokens=8))
        eager = {k: speculative_generate(t, d, p, 40, draft_len=k) for k in (1, 4)}  # the references, once
        eager.update({("tree", i): tree_speculative_generate(t, d, p, 40, tree) for i, tree in enumerate(trees)})
        for target in (t, GraphedLlama(_model(0), 256, graphs=False)):
            for k in (1, 4):
                out, st = speculative_generate(target, g, p, 40, draft_len=k)
                out_e, st_e = eager[k]
                assert out == out_e == ref, params
                assert (st.accepted, st.drafted, st.accept_counts) == (
                    st_e.accepted,
                    st_e.drafted,
                    st_e.accept_counts,
                ), params
            for i, tree in enumerate(trees):
                out, st = tree_speculative_generate(target, g, p, 40, tree)
                out_e, st_e = eager["tree", i]
                assert out == out_e == ref and st.accepted == st_e.accepted, params
        # chain drafts (1 token, last-only roots of 1..5 tokens) and tree levels (own masks and positions)
        keys = set(g._runs)  # (T, own mask, own positions, last-only)
        assert (1, False, True, False) in keys and (1, False, True, True) in keys, params  # chain, root
        assert any(k[1] and k[2] for k in keys), params  # tree levels
        # step by step, as the static path sees them: a multi-token root, a draft, a tree level
        c_e, c_s = d.new_cache(1, 64), g.new_cache(1, 64)
        with torch.no_grad():
            for T, kw in ((9, {}), (3, {"last_only": True}), (1, {}), (4, "tree")):
                ids, st = torch.randint(0, 300, (1, T)), torch.randn(1, T, d.cfg.dim)
                if kw == "tree":
                    anc, depth = tree_mask(torch.tensor([-1, 0, 0]))  # root + 3 nodes
                    n = c_e.length
                    mask = torch.ones(1, T, n + T, dtype=torch.bool)
                    mask[0, :, n:] = anc
                    kw = {"pos": (n + depth).view(1, -1), "attn_mask": mask}
                (ls, ss), (le, se) = g.step(st, ids, cache=c_s, **kw), d.step(st, ids, cache=c_e, **kw)
                torch.testing.assert_close(ls, le, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(ss, se, rtol=1e-5, atol=1e-5)
                assert c_s.length == c_e.length
        assert (3, False, False, True) in g._runs


def test_a_failed_forward_capture_runs_uncaptured(monkeypatch, caplog):
    g = GraphedLlama(_model(0), 64, graphs=False)
    g.graphs = True  # as on CUDA; the capture itself fails as a refused op would

    def refuse(run):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(g, "_capture", refuse)
    p = torch.randint(0, 300, (12,))
    ref = autoregressive_generate(_model(0), p, 20)
    with caplog.at_level("WARNING", logger="draftsmith.eval.graphs"):
        assert autoregressive_generate(g, p, 20) == ref
        assert autoregressive_generate(g, p, 20) == ref
    assert [r.getMessage() for r in caplog.records] == [
        "CUDA-graph capture failed for a 1-token forward (operation not permitted when stream is capturing); it "
        "runs uncaptured"
    ]
    assert g._runs[(1, False, False, ())].graph is False


def test_graphed_decoding_is_lossless():
    t, d = _model(0), _model(1, n_layers=1)
    gt, gd = GraphedLlama(t, 256, graphs=False), GraphedLlama(d, 256, graphs=False)
    oracle = GraphedLlama(_model(0), 256, graphs=False)  # draft = target: everything is accepted
    p = torch.randint(0, 300, (12,))
    ref = autoregressive_generate(t, p, 40)
    assert autoregressive_generate(gt, p, 40) == ref
    for k in (1, 3, 5):
        assert speculative_generate(gt, gd, p, 40, draft_len=k)[0] == ref
        out, stats = speculative_generate(gt, oracle, p, 40, draft_len=k)
        assert out == ref and stats.tau > k  # full acceptance except where max_new_tokens cuts the last block
    tree = tree_from_choices([[0], [1], [0, 0], [0, 1], [1, 0]])
    assert tree_speculative_generate(gt, gd, p, 40, tree)[0] == ref
    assert tree_speculative_generate(gt, gd, p, 40, DynamicTree(depth=3, top_k=3, total_tokens=8))[0] == ref
    assert list(gd._tree_graphs) == [DynamicTree(depth=3, top_k=3, total_tokens=8)]  # drafted by TreeGraph
    out, stats = tree_speculative_generate(gt, oracle, p, 40, DynamicTree(depth=3, top_k=2, total_tokens=12))
    assert out == ref and stats.tau > 3


@torch.no_grad()
def test_tree_graph_drafts_the_same_tree_as_the_eager_levels():
    """TreeGraph (a dynamic tree with its slot offset on the device and full-width masks, captured on CUDA) against
    the eager levels it replaces, uncaptured on CPU: the same tokens, parents, mask and depths, step after step."""
    from draftsmith.eval.accept import Sampler
    from draftsmith.eval.batch_decoder import _Row
    from draftsmith.eval.decoder import DecodeStats
    from draftsmith.eval.proposers import TokenRows, TreeGraph, _Rows

    gd = GraphedLlama(_model(1, n_layers=1), 256, graphs=False)
    p = torch.randint(0, 300, (12,))
    for spec in (DynamicTree(depth=3, top_k=3, total_tokens=8), DynamicTree(depth=5, top_k=4, total_tokens=30)):
        run = TokenRows(_model(0), gd, 256)
        row = _Row(0, p, 64, Sampler(0.0), DecodeStats())
        run.join([row], p.view(1, -1), None, torch.arange(12)[None], {}, [0])
        assert run.rc.view is gd._cache  # one row in one-row storage: the wrapper's static cache
        cur = torch.tensor([5])
        with torch.no_grad():
            for accepted in ([], [7, 9], [11]):  # three steps: the tree's first slot moves on
                logits, _ = run.root([row], cur, 40, spec.depth)
                run._pos0, base = run.root_pos([row]), run.rc.length
                want = [x[0] for x in _Rows._levels(run, logits, None, spec)[:4]]  # the eager levels, one row
                got = TreeGraph.of(gd, spec)(logits[0], base)
                for w, g in zip(want, got, strict=True):
                    assert torch.equal(w, g)
                run.commit_tree([row], [torch.tensor(accepted, dtype=torch.long)], [], {})
    assert len(gd._tree_graphs) == 2


def test_a_failed_tree_capture_falls_back_to_the_levels(monkeypatch, caplog):
    """If a drafter's tree cannot be captured (an op CUDA graphs refuse), decoding stays lossless level by level
    and says so once."""
    from draftsmith.eval.proposers import TreeGraph

    t, d = _model(0), _model(1, n_layers=1)
    gt, gd = GraphedLlama(t, 256, graphs=False), GraphedLlama(d, 256, graphs=False)
    spec = DynamicTree(depth=3, top_k=3, total_tokens=8)
    TreeGraph.of(gd, spec).capturing = True  # as on CUDA; the capture itself fails as a refused op would

    def refuse(fn):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(gd, "capture", refuse)
    p = torch.randint(0, 300, (12,))
    ref = autoregressive_generate(t, p, 30)
    with caplog.at_level("WARNING", logger="draftsmith.eval.proposers"):
        assert tree_speculative_generate(gt, gd, p, 30, spec)[0] == ref
        assert tree_speculative_generate(gt, gd, p, 30, spec)[0] == ref
    assert not gd._tree_graphs[spec].usable
    assert [r.getMessage() for r in caplog.records].count(
        "dynamic tree: CUDA-graph capture failed (operation not permitted when stream is capturing); drafting "
        "level by level instead"
    ) == 1


def test_graph_decoding_wraps_llamas_and_nothing_unknown():
    m = _model(0)
    assert isinstance(graph_decoding(m, 32, graphs=False), GraphedLlama)
    head = torch.nn.Linear(4, 4)
    assert graph_decoding(head, 32) is head
    g = GraphedLlama(m, 32, graphs=False)
    assert g.cfg is m.cfg and g.new_cache(2, 16).k[0].shape[0] == 2  # batch > 1: an ordinary cache
    assert g.new_cache(1, 64).max_len == 64 and g.new_cache(1, 16) is g.new_cache(1, 32)


@pytest.mark.gpu
def test_cuda_graphs_replay_the_eager_decode():
    t, d = _model(0, "cuda"), _model(1, "cuda", n_layers=1)
    gt, gd = GraphedLlama(t, 256), GraphedLlama(d, 256)
    oracle = GraphedLlama(_model(0, "cuda"), 256)
    p = torch.randint(0, 300, (12,), device="cuda")
    ref = autoregressive_generate(t, p, 48)
    assert autoregressive_generate(gt, p, 48) == ref
    for k in (1, 4):
        assert speculative_generate(gt, gd, p, 48, draft_len=k)[0] == ref
        assert speculative_generate(gt, oracle, p, 48, draft_len=k)[0] == ref
    assert tree_speculative_generate(gt, gd, p, 48, DynamicTree(depth=3, top_k=3, total_tokens=8))[0] == ref
    assert any(r.graph is not None for r in gt._runs.values())
    assert all(g.graph is not None for g in gd._tree_graphs.values()) and gd._tree_graphs  # one captured tree
    from draftsmith.models.eagle import build_eagle

    eagle = build_eagle({"version": 3}, t).cuda().eval()  # verifies that return the target's layer features
    for k in (1, 4):
        assert speculative_generate(gt, eagle, p, 48, draft_len=k)[0] == ref
    assert any(r.graph for key, r in gt._runs.items() if key[3])  # captured, not run uncaptured
    ge = graph_decoding(eagle, 256)  # and the drafter's own steps: chain, static and dynamic trees
    for k in (1, 4):
        assert speculative_generate(gt, ge, p, 48, draft_len=k)[0] == ref
    for tree in (tree_from_choices([[0], [1], [0, 0]]), DynamicTree(depth=3, top_k=3, total_tokens=8)):
        assert tree_speculative_generate(gt, ge, p, 48, tree)[0] == ref
    assert ge._runs and all(r.graph for r in ge._runs.values())
