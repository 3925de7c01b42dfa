"""Target-answer generation at the hardware's pace: continuous refill (data/engine.py ``Refill``: a finished row's
slot takes the next pending prompt) equals one-prompt-at-a-time generation, tokens and teacher signals, greedy and
sampled; the data stage writes shards from a background thread whose errors surface in one line."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import shard_tensors

from draftsmith.cli import main
from draftsmith.data.engine import Capture, Refill, Sampling, batch_buckets, decode_batch, decode_refill
from draftsmith.models.draft_lm import build_draft_lm
from draftsmith.models.loading import load_llama_dir
from draftsmith.models.sampling import row_generator

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXTS = [[5], list(range(3, 60)), [7] * 20, [1, 2, 3], list(range(40, 70)), [9, 8], list(range(10, 21))]
BUDGETS = [9, 3, 14, 1, 6, 11, 8]


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_llama_dir(tiny_model_dir, dtype=torch.float64)


@pytest.fixture(scope="module")
def companion(target):
    torch.manual_seed(1)
    d = build_draft_lm({"n_layers": 1, "init_layers": [0]}, target)
    with torch.no_grad():
        for p in d.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))  # q != p: labels are not trivial
    return d.double().eval()


def _alone(target, ctxs, budgets, eos, sampling, seeds, capture, companion=None, ls=None):
    """The reference: every prompt alone (a batch of one)."""
    out = []
    for c, n, s in zip(ctxs, budgets, seeds):
        out += decode_batch(target, [c], n, eos, sampling, [row_generator("cpu", 0, s)], capture, companion, ls)
    return out


def _same(a, b, exact_signals: bool = False):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.tokens == y.tokens, i
        for part in ("loss_signals", "hidden"):
            dx, dy = getattr(x, part), getattr(y, part)
            assert dx.keys() == dy.keys(), (i, part)
            for k in dx:
                assert dx[k].shape == dy[k].shape, (i, k)
                if k in ("topk_ids", "spec_token") or exact_signals:
                    assert torch.equal(dx[k], dy[k]), (i, k)
                else:  # float64: batch shapes may change the summation order, never more than rounding
                    torch.testing.assert_close(dx[k], dy[k], atol=1e-12, rtol=1e-10), (i, k)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_greedy_refill_equals_one_prompt_at_a_time(target, companion, batch):
    """Prompts of 1..57 tokens with budgets of 1..14 tokens, some ending at EOS, through fewer slots than prompts:
    rows leave and new ones are prefilled into their slots. Every record (tokens, top-k, hidden_last, EAGLE-3
    layers, SpecDec++ labels) equals the prompt's own batch-of-one generation."""
    cap = Capture(topk=5, hidden_last=True, aux_layers=(0, 1))
    free = _alone(target, CONTEXTS, BUDGETS, set(), Sampling(), range(7), Capture())
    eos = {free[0].tokens[4], free[2].tokens[6]}  # rows 0 and 2 end early at EOS
    want = _alone(target, CONTEXTS, BUDGETS, eos, Sampling(), range(7), cap, companion)
    assert any(len(w.tokens) < n for w, n in zip(want, BUDGETS))
    gens = [row_generator("cpu", 0, s) for s in range(7)]
    got = decode_refill(target, CONTEXTS, BUDGETS, eos, Sampling(), gens, cap, companion, batch_size=batch)
    _same(got, want)
    for g, c in zip(got, CONTEXTS):
        assert len(g.hidden["hidden_last"]) == len(c) + len(g.tokens)


def test_refill_through_cache_compaction(target, companion):
    """A cache row of just the longest context + budget + 1 slots: the slot cache compacts (kernels/kv.py
    compact_rows, every row's valid slots right-aligned) while rows come and go, and nothing changes."""
    cap = Capture(topk=4, hidden_last=True)
    want = _alone(target, CONTEXTS, BUDGETS, set(), Sampling(), range(7), cap, companion)
    gen = Refill(target, 3, max(BUDGETS), set(), Sampling(), cap, companion, max_len=57 + 14 + 1)
    for i, (c, n) in enumerate(zip(CONTEXTS, BUDGETS)):
        gen.add(i, c, row_generator("cpu", 0, i), n)
    got = [None] * len(CONTEXTS)
    gen.run(lambda i, g: got.__setitem__(i, g))
    assert gen.rc.compactions > 0 and gen.dc.compactions > 0 and gen.prefills > 1
    _same(got, want)


def test_a_budget_of_zero_gives_an_empty_answer(target):
    """Also for a context queued while the generator runs (a conversation's next turn)."""
    out = decode_refill(target, [[1, 2], [3], [4, 5, 6]], [2, 0, 1], set(), Sampling(), [None] * 3, batch_size=2)
    assert [len(g.tokens) for g in out] == [2, 0, 1]
    gen, got = Refill(target, 2, 3, set(), Sampling()), {}

    def done(key, g):
        got[key] = g.tokens
        if key == 0:
            gen.add(1, [7, 7], None, 0)

    gen.add(0, [1, 2], None, 3)
    gen.run(done)
    assert len(got[0]) == 3 and got[1] == []


def test_batch_buckets():
    assert batch_buckets(1) == (1,) and batch_buckets(5) == (1, 2, 4, 5) and batch_buckets(16) == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("batch", [3, 5])
def test_static_shape_decode_steps_equal_the_eager_ones(target, companion, batch):
    """The decode step at static shapes per batch bucket (what a GPU captures as CUDA graphs; here run
    uncaptured on CPU): n rows run as the first rows of a bucket of 1, 2, 4, ... or batch_size rows, attention
    over the whole cache buffer under a mask; through refills and compaction, the records do not change."""
    cap = Capture(topk=4, hidden_last=True, aux_layers=(1,))
    ctxs, budgets = CONTEXTS * 2, BUDGETS[::-1] + BUDGETS
    want = _alone(target, ctxs, budgets, set(), Sampling(), range(14), cap, companion)
    gen = Refill(target, batch, max(budgets), set(), Sampling(), cap, companion, max_len=72, static=True)
    for i, (c, n) in enumerate(zip(ctxs, budgets)):
        gen.add(i, c, row_generator("cpu", 0, i), n)
    got = [None] * len(ctxs)
    gen.run(lambda i, g: got.__setitem__(i, g))
    assert gen.step_fn is not None and len(gen.step_fn.runs) > 1 and gen.rc.compactions > 0
    _same(got, want)


@pytest.mark.gpu
def test_cuda_graph_decode_steps_equal_eager_ones(tiny_model_dir):
    """On a GPU: each batch bucket's decode step captured once and replayed; the same tokens as eager refill and as
    one prompt at a time, top-k log-probs to float32 rounding."""
    t = load_llama_dir(tiny_model_dir, dtype=torch.float32).cuda()
    cap = Capture(topk=4, hidden_last=True)
    want = _alone(t, CONTEXTS, BUDGETS, set(), Sampling(), range(7), cap)
    gen = Refill(t, 3, max(BUDGETS), set(), Sampling(), cap, max_len=72, static=True)
    for i, (c, n) in enumerate(zip(CONTEXTS, BUDGETS)):
        gen.add(i, c, None, n)
    got = [None] * len(CONTEXTS)
    gen.run(lambda i, g: got.__setitem__(i, g))
    assert all(r["graph"] is not None for r in gen.step_fn.runs.values()) and gen.rc.compactions > 0
    assert [g.tokens for g in got] == [w.tokens for w in want]
    for g, w in zip(got, want):
        assert torch.equal(g.loss_signals["topk_ids"], w.loss_signals["topk_ids"])
        torch.testing.assert_close(g.loss_signals["topk_logprobs"], w.loss_signals["topk_logprobs"])
        torch.testing.assert_close(g.hidden["hidden_last"], w.hidden["hidden_last"], atol=1e-4, rtol=1e-4)


def test_sampled_refill_does_not_depend_on_batch_size(target, companion):
    """Each row draws only from its own generator, seeded per unit: the same tokens and labels whatever the
    batch size and whoever shares it, and each generator ends having drawn what it draws alone."""
    s, ls = Sampling(temperature=1.0, top_k=20), Sampling(temperature=0.7)
    cap = Capture(topk=3)
    want = _alone(target, CONTEXTS, BUDGETS, {11}, s, range(7), cap, companion, ls)
    ref_state = None
    for batch in (1, 3, 8):
        gens = [row_generator("cpu", 0, i) for i in range(7)]
        got = decode_refill(target, CONTEXTS, BUDGETS, {11}, s, gens, cap, companion, ls, batch_size=batch)
        _same(got, want)
        state = [g.get_state() for g in gens]
        ref_state = ref_state or state
        assert all(torch.equal(a, b) for a, b in zip(state, ref_state))


def test_refill_with_optimized_float32_target_matches_tokens(tiny_model_dir):
    """The generate stage's default model (fused, pre-packed float32 matmuls): refill runs and keeps the tokens of
    the fixed-batch path on a tiny model."""
    t = load_llama_dir(tiny_model_dir, dtype=torch.float32).optimize_for_inference()
    want = _alone(t, CONTEXTS, BUDGETS, set(), Sampling(), range(7), Capture(topk=2))
    got = decode_refill(t, CONTEXTS, BUDGETS, set(), Sampling(), [None] * 7, Capture(topk=2), batch_size=2)
    assert [g.tokens for g in got] == [w.tokens for w in want]


# --- the data stage ------------------------------------------------------------------------------------------------

CHATS_ARGS = (
    "target.dtype=float64",
    "data.prompts.max_turns=null",
    "data.max_prompt_tokens=256",
    "data.signals.hidden_last=true",
    "data.signals.hidden_layers=[0, 1]",
    "data.signals.hidden_dtype=float16",
    "data.max_new_tokens=9",
    "data.shard_size=3",
    "-q",
)


@pytest.fixture
def gen_args(tmp_path, tiny_overrides):
    def args(*extra, out="run"):
        return ["generate", "tiny", *tiny_overrides, f"out_dir={tmp_path / out}", *CHATS_ARGS, *extra]

    return args


@pytest.mark.parametrize("sampled", [False, True])
def test_data_stage_refill_equals_fixed_batches(tmp_path, gen_args, sampled):
    """The fixture prompts (multi-turn ones included) at batch 2: refill and the fixed-batch path write the same
    records (tokens, top-k ids; log-probs and hidden states to their float16 storage)."""
    extra = ("data.temperature=1.0", "data.n_samples=2") if sampled else ()
    assert main(gen_args("data.refill=false", "data.batch_size=2", *extra, out="fixed")) == 0
    assert main(gen_args("data.batch_size=2", *extra, out="refill")) == 0
    a, b = shard_tensors(tmp_path / "fixed" / "data"), shard_tensors(tmp_path / "refill" / "data")
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys()
        for k in a[name]:
            if a[name][k].is_floating_point():
                torch.testing.assert_close(a[name][k].float(), b[name][k].float(), atol=2e-3, rtol=2e-3)
            else:
                assert torch.equal(a[name][k], b[name][k]), (name, k)


def test_shards_are_written_by_a_background_thread(tmp_path, gen_args, monkeypatch):
    import draftsmith.data.generate as gen

    real, threads = gen.write_shard, []

    def spy(*a, **k):
        threads.append(threading.current_thread() is threading.main_thread())
        return real(*a, **k)

    monkeypatch.setattr(gen, "write_shard", spy)
    assert main(gen_args(out="bg")) == 0
    assert threads and not any(threads)
    threads.clear()
    assert main(gen_args("data.write_queue=0", out="sync")) == 0  # 0: written in the main thread, as it generates
    assert threads and all(threads)
    _same_shards(tmp_path / "bg" / "data", tmp_path / "sync" / "data")


def _same_shards(a, b):
    ta, tb = shard_tensors(a), shard_tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        for k in ta[name]:
            assert torch.equal(ta[name][k], tb[name][k]), (name, k)


def test_a_writer_thread_error_is_one_line_and_non_zero(tmp_path, gen_args, monkeypatch, capsys):
    import draftsmith.data.generate as gen

    def broken(path, *a, **k):
        raise RuntimeError("the device went away")

    monkeypatch.setattr(gen, "write_shard", broken)
    assert main(gen_args(out="bad")) == 2
    err = [x.split("\r")[-1] for x in capsys.readouterr().err.splitlines()]
    err = [x for x in err if x.startswith("draftsmith")]  # (not the progress bar's lines)
    assert len(err) == 1 and "shard-00000.safetensors" in err[0] and "the device went away" in err[0], err
    data = tmp_path / "bad" / "data"
    assert not (data / "manifest.json").exists() and not list(data.glob("shard-*"))


def test_cuda_graphs_are_off_on_cpu(tmp_path, gen_args):
    assert main(gen_args("data.cuda_graphs=true", out="g")) == 0
    assert main(gen_args(out="e")) == 0
    _same_shards(tmp_path / "g" / "data", tmp_path / "e" / "data")


@pytest.mark.parametrize("bad", ["data.refill=maybe", "data.write_queue=-1", "data.cuda_graphs=2"])
def test_bad_refill_and_queue_values_are_one_line_errors(gen_args, capsys, bad):
    assert main(gen_args(bad, out="x")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and bad.split("=")[0] in err[0] and "unknown key" not in err[0], err


@pytest.mark.parametrize("min_join", [2, 3])
def test_joins_that_wait_for_free_rows_change_no_record_and_share_prefills(target, companion, min_join):
    """data.refill_join: turns wait until min_join rows are free and prefill together; every record still equals
    the prompt's own generation, greedy and sampled, and fewer prefill forwards run."""
    cap = Capture(topk=5, hidden_last=True, aux_layers=(0, 1))
    for sampling in (Sampling(), Sampling(temperature=1.0)):
        runs = []
        for join in (1, min_join):
            gen = Refill(target, 4, max(BUDGETS), set(), sampling, cap, companion, max_prefill_pad=64, min_join=join)
            for i, (c, n) in enumerate(zip(CONTEXTS, BUDGETS)):
                gen.add(i, c, row_generator("cpu", 0, i), n)
            got = [None] * len(CONTEXTS)
            gen.run(lambda i, g, got=got: got.__setitem__(i, g))
            runs.append((got, gen.prefills))
        (a, pa), (b, pb) = runs
        _same(b, a)
        assert pb < pa, (pa, pb)


def test_refill_join_is_a_recipe_key(tmp_path, tiny_model_dir, prompts_file):
    """data.refill_join through `draftsmith generate`: the same shards as without it; below 1 is a one-line error."""
    from conftest import shard_tensors

    from draftsmith.cli import main

    common = [f"target.model={tiny_model_dir}", f"data.prompts.path={prompts_file}", "data.batch_size=3", "-q"]
    assert main(["generate", "tiny", f"out_dir={tmp_path / 'a'}", *common]) == 0
    assert main(["generate", "tiny", f"out_dir={tmp_path / 'b'}", "data.refill_join=3", *common]) == 0
    a, b = shard_tensors(tmp_path / "a" / "data"), shard_tensors(tmp_path / "b" / "data")
    assert a.keys() == b.keys()
    for shard in a:
        assert all(torch.equal(a[shard][k], b[shard][k]) for k in a[shard]), shard
    assert main(["generate", "tiny", f"out_dir={tmp_path / 'c'}", "data.refill_join=0", *common]) == 2


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_refill_decode_step_waits_for_the_device_once(target, static):
    """Between joins and hand-overs, a decode step reads one thing back: the (B,) EOS flags, after the next forward
    is queued. Top-k capture, hidden states and the bookkeeping of rows stay on the device (draftsmith/flops.py
    ``HostOps`` counts the waits on CPU tensors)."""
    from draftsmith.flops import HostOps

    ops, steps = HostOps(), {"n": 0}
    gen = Refill(target, 3, max(BUDGETS), set(), Sampling(), Capture(topk=4, hidden_last=True), static=static)
    for i, (c, n) in enumerate(zip(CONTEXTS, BUDGETS)):
        gen.add(i, c, None, n)
    for name in ("_join", "_finish"):  # joins (prefills) and hand-overs: once per row, not per step
        setattr(gen, name, ops.in_phase(name, getattr(gen, name)))
    fwd = target.forward

    def forward(ids, *a, **k):
        steps["n"] += ops.where == "step"  # a decode step (prefills run inside _join)
        return fwd(ids, *a, **k)

    target.forward = forward
    out = []
    try:
        with ops.counting(), torch.no_grad():
            gen.run(lambda i, g: out.append(g))
    finally:
        del target.forward
    assert len(out) == len(CONTEXTS) and steps["n"] >= max(BUDGETS)
    assert ops.what == {("step", "tolist"): steps["n"]} | {k: v for k, v in ops.what.items() if k[0] != "step"}
    assert ops.syncs["step"] == steps["n"]
