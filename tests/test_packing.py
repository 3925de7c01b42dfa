"""Sequence packing (train.packing): records share rows of train.pack_tokens tokens with per-document attention
masks and positions. A packed batch trains exactly like the same records unpacked (loss and gradients, float64,
every kind that packs), no document ever sees another, resume after a kill stays exact, and the kinds that cannot
pack are refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import drafter_kinds, small_section

from draftsmith.data.dataset import collate, collate_packed, pack_rows
from draftsmith.data.records import Record
from draftsmith.errors import DraftsmithError
from draftsmith.models.loading import load_model
from draftsmith.models.registry import DRAFTERS, build_drafter, drafter_spec
from draftsmith.recipes.schema import LossConfig
from draftsmith.train import objectives

LENGTHS = [9, 17, 5, 23, 12, 7, 30, 4, 14]
K = 8  # stored top-k


def _records(vocab: int, dim: int, n_aux: int, seed: int = 0) -> list[Record]:
    """Records of mixed lengths with every signal a kind reads: top-k (loss axis), hidden_last and hidden_aux (token
    axis). Loss masks cover a response and, in every third record, a second turn after a gap."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(3, vocab, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3 :] = True
        if i % 3 == 0 and n > 8:
            mask[n // 2 : n // 2 + 2] = False  # a second turn's prompt inside the response
        n_loss = int(mask.sum())
        logits = torch.randn(n_loss, vocab, generator=g, dtype=torch.float64)
        top = torch.log_softmax(logits, -1).topk(K, -1)
        sig = {
            "topk_ids": top.indices,
            "topk_logprobs": top.values,
            "hidden_last": torch.randn(n, dim, generator=g, dtype=torch.float64),
            "hidden_aux": torch.randn(n, n_aux, dim, generator=g, dtype=torch.float64),
        }
        out.append(Record(ids, mask, i, 0, 0, sig))
    return out


def test_first_fit_decreasing_fills_rows_and_never_splits_a_record():
    rows = pack_rows(LENGTHS, 32)
    assert sorted(i for r in rows for i in r) == list(range(len(LENGTHS)))
    assert all(sum(LENGTHS[i] for i in r) <= 32 for r in rows)
    assert rows[0][0] == LENGTHS.index(max(LENGTHS))  # longest first
    assert len(rows) == -(-sum(LENGTHS) // 32)  # these lengths pack without a spare row
    assert pack_rows(LENGTHS, 32) == rows  # a function of the lengths only
    with pytest.raises(ValueError, match="40 tokens"):
        pack_rows([40], 32)


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(str(tiny_model_dir)).model.double().requires_grad_(False)


def test_a_packed_batch_holds_each_record_whole_with_its_own_positions_and_signals(target):
    recs = _records(target.cfg.vocab_size, target.cfg.dim, 3)
    b = collate_packed(recs, 32)
    R, T = b["input_ids"].shape
    assert T <= 32 and R == len(pack_rows(LENGTHS, 32))
    labels_at = b["predict_mask"].flatten().long().cumsum(0).view(R, T) - 1
    seen = set()
    for r in range(R):
        for d in b["doc"][r].unique().tolist():
            if d < 0:
                continue
            at = (b["doc"][r] == d).nonzero().flatten()
            assert torch.equal(at, torch.arange(int(at[0]), int(at[0]) + len(at)))  # contiguous
            i = next(
                i
                for i, x in enumerate(recs)
                if len(x.input_ids) == len(at) and i not in seen and torch.equal(x.input_ids, b["input_ids"][r, at])
            )
            seen.add(i)
            rec = recs[i]
            assert torch.equal(b["pos"][r, at], torch.arange(len(at)))  # positions restart at 0
            assert torch.equal(b["hidden_last"][r, at], rec.signals["hidden_last"])
            assert torch.equal(b["hidden_aux"][r, at], rec.signals["hidden_aux"])
            pm = b["predict_mask"][r, at]
            assert not pm[-1] and torch.equal(pm[:-1], rec.loss_mask[1:])  # the last token predicts nothing
            rows = labels_at[r, at][pm]
            assert torch.equal(b["topk_ids"][rows], rec.signals["topk_ids"])  # loss-axis rows aligned
            assert torch.equal(b["labels"][rows], rec.input_ids[1:][rec.loss_mask[1:]])
    assert seen == set(range(len(recs)))
    assert int(b["attention_mask"].sum()) == sum(LENGTHS)
    mask = objectives.doc_mask(b)
    d = b["doc"]
    same = (d[:, :, None] == d[:, None, :]) & (d[:, :, None] >= 0)
    assert not (mask & ~same & (d[:, :, None] >= 0)).any()  # a real token attends inside its document only


def _stored(kind: str) -> set[str]:
    """Every record signal the kind's spec declares, stored (the loop computes nothing itself)."""
    signals = drafter_spec(kind).signals
    return set(signals(None) if callable(signals) else signals)


# (name, kind, section fields, loss, stored signals): every kind that packs (DrafterSpec.packs) from its small
# section with its signals stored, then the variants that train differently: another loss or teacher, features in
# the loop, a reduced vocabulary, EAGLE-1 and a deeper EAGLE-3, Medusa-2, Hydra++'s prefix layer.
CASES = [(kind, kind, {}, LossConfig(kind="fkl"), _stored(kind)) for kind in drafter_kinds(packs=True)] + [
    ("draft_lm-ce", "draft_lm", {}, LossConfig(kind="ce"), set()),
    ("draft_lm-target", "draft_lm", {}, LossConfig(kind="jsd", teacher="target"), set()),
    ("draft_lm-vocab", "draft_lm", {"draft_vocab": 64}, LossConfig(kind="fkl"), {"topk"}),
    ("medusa-in-loop", "medusa", {}, LossConfig(kind="rkl", teacher="target"), {"topk"}),
    ("medusa-2", "medusa", {"lora_r": 4}, LossConfig(kind="fkl"), {"topk"}),
    ("hydra++", "hydra", {"prefix_attention": True}, LossConfig(kind="fkl"), {"topk", "hidden_last"}),
    ("hydra++-in-loop", "hydra", {"prefix_attention": True}, LossConfig(kind="ce"), set()),
    ("eagle1", "eagle", {"version": 1, "ttt_steps": 3}, LossConfig(kind="fkl"), {"topk", "hidden_last"}),
    ("eagle3-aux-only", "eagle", {"version": 3, "ttt_steps": 3}, LossConfig(kind="fkl"), {"topk", "hidden_aux"}),
    ("eagle3-in-loop", "eagle", {"version": 3, "ttt_steps": 3}, LossConfig(kind="fkl", teacher="target"), set()),
    ("pard-k3", "pard", {"pard_k": 3}, LossConfig(kind="fkl"), {"topk"}),
    ("pard-target-vocab", "pard", {"pard_k": 4, "draft_vocab": 64}, LossConfig(kind="ce"), set()),
    ("eagle3-deep-vocab", "eagle", {"ttt_steps": 3, "n_layers": 2, "draft_vocab": 64}, LossConfig(kind="ce"), set()),
]


def _counts(recs, vocab):
    c = torch.zeros(vocab, dtype=torch.long)
    for r in recs:
        c += torch.bincount(r.input_ids[r.loss_mask], minlength=vocab)
    return c


def _strip(recs, keep: set[str]):
    groups = {"topk_ids": "topk", "topk_logprobs": "topk", "hidden_last": "hidden_last", "hidden_aux": "hidden_aux"}
    return [
        Record(
            r.input_ids, r.loss_mask, r.prompt_index, 0, 0, {k: v for k, v in r.signals.items() if groups[k] in keep}
        )
        for r in recs
    ]


@pytest.mark.parametrize("name,kind,fields,cfg,signals", CASES, ids=[c[0] for c in CASES])
def test_a_packed_batch_trains_exactly_like_its_records_unpacked(target, name, kind, fields, cfg, signals):
    """Loss sum, trained-position count, metrics and every gradient of one packed batch equal those of the same
    records in a padded batch (float64): packing changes the layout, never what is trained."""
    _packed_equals_padded(target, kind, fields, cfg, signals)


@pytest.mark.parametrize("kind", drafter_kinds(packs=True))
def test_the_transformers_path_target_teaches_packed_rows_like_padded_ones(tiny_model_dir, kind):
    """The frozen target in the loop on the transformers path (models/hf_target.py) takes the packed layout too:
    the teacher for every kind that packs, and the features for those that read them."""
    hf = load_model(str(tiny_model_dir), torch.float64, backend="transformers").model.requires_grad_(False)
    _packed_equals_padded(hf, kind, {}, LossConfig(kind="fkl", teacher="target"), set())


def _packed_equals_padded(target, kind, fields, cfg, signals):
    torch.manual_seed(0)
    tc = target.cfg
    params = small_section(kind, **fields)
    n_aux = 3
    if kind == "eagle" and params.version == 3:
        from draftsmith.models.eagle import default_aux_layers

        n_aux = len(default_aux_layers(tc.n_layers))
    recs = _strip(_records(tc.vocab_size, tc.dim, n_aux), signals)
    model = build_drafter(kind, params, target, counts=_counts(recs, tc.vocab_size)).double().train()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # off the zero-initialised start (identity blocks), so every weight gets a gradient
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    objective = objectives.objective_for(kind)
    ctx = objectives.Context(unwrapped=model, target=target, params=params)
    objectives.check_packing(kind)  # every case here packs

    def run(batch):
        model.zero_grad()
        out = objective(model, batch, cfg, ctx)
        out.loss_sum.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return out, grads

    plain, g_plain = run(collate(recs))
    packed_batch = collate_packed(recs, 40)
    assert packed_batch["input_ids"].shape[0] < len(recs)  # rows hold several records
    packed, g_packed = run(packed_batch)
    assert packed.n == plain.n > 0
    # The models run in float64; the losses accumulate in float32 (train/losses.py) over positions in another
    # order, so sums agree to float32 rounding. A document seeing a neighbour moves them by orders of magnitude more.
    torch.testing.assert_close(packed.loss_sum, plain.loss_sum, rtol=1e-6, atol=1e-6)
    assert g_plain.keys() == g_packed.keys() and g_plain
    assert any(g.abs().sum() > 0 for g in g_plain.values())
    for n in g_plain:
        torch.testing.assert_close(g_packed[n], g_plain[n], rtol=1e-5, atol=1e-7, msg=n)
    got = packed.host_metrics()
    for k, v in plain.host_metrics().items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_a_document_never_sees_its_row_neighbours(target):
    """Perturbing one document's tokens leaves every other document's outputs in its row unchanged: the target and
    a draft LM (pos + block mask), EAGLE-3's TTT unroll and Hydra++'s prefix layer."""
    tc = target.cfg
    recs = _records(tc.vocab_size, tc.dim, 3)
    b = collate_packed(recs, 64)
    r = int((b["doc"].amax(1)).argmax())  # the row with the most documents
    assert int(b["doc"][r].max()) >= 2
    victim = b["doc"][r] == 1
    ids2 = b["input_ids"].clone()
    ids2[r][victim] = (ids2[r][victim] + 7) % tc.vocab_size
    others = (b["doc"] >= 0) & ~(victim[None] & (torch.arange(len(b["doc"]))[:, None] == r))
    mask, pos = objectives.doc_mask(b), b["pos"]

    def check(fn, keep=others):
        a, c = fn(b["input_ids"]), fn(ids2)
        torch.testing.assert_close(a[keep], c[keep], rtol=0, atol=1e-12)
        assert not torch.allclose(a[r][victim], c[r][victim])

    check(lambda ids: target(ids, pos=pos, attn_mask=mask))
    draft = build_drafter("draft_lm", small_section("draft_lm"), target).double()
    check(lambda ids: draft(ids, pos=pos, attn_mask=mask))
    eagle = build_drafter("eagle", small_section("eagle", ttt_steps=3), target).double()
    feats = torch.randn(*b["input_ids"].shape, eagle.cfg.feature_dim, dtype=torch.float64)
    # TTT step 2 at i reads the token at i + 3: rows whose token lies past their document's end (never trained:
    # objectives.shifted_teachers) may read the victim, and only ever affect themselves.
    doc = b["doc"]
    inside = torch.zeros_like(others)
    inside[:, :-3] = doc[:, :-3] == doc[:, 3:]
    check(lambda ids: eagle(feats, ids, steps=3, pos=pos, attn_mask=mask)[-1], others & inside)
    hydra = build_drafter("hydra", small_section("hydra", prefix_attention=True), target).double()
    with torch.no_grad():
        for p in hydra.parameters():
            p.add_(0.05 * torch.randn_like(p))

    def hydra_ctx(ids):  # the prefix layer over states that depend on the tokens
        h = target(ids, pos=pos, attn_mask=mask, return_hidden=True)
        return hydra.read_context(h, pos=pos, attn_mask=mask)

    check(hydra_ctx)


@pytest.mark.parametrize("kind", [k for k, spec in DRAFTERS.items() if not spec.packs])
def test_kinds_that_cannot_pack_are_refused_in_one_line(kind):
    with pytest.raises(DraftsmithError, match=r"train\.packing") as e:
        objectives.check_packing(kind)
    assert "\n" not in str(e.value) and kind in str(e.value)


def test_a_recipe_that_packs_a_kind_that_cannot_is_refused_at_load():
    from draftsmith.recipes.loader import load_recipe

    with pytest.raises(DraftsmithError, match=r"train\.packing: drafter\.kind=judge .*train\.packing=false$"):
        load_recipe("judge-smollm2", ["train.packing=true"])
    assert load_recipe("tiny", ["drafter.kind=pard", "train.packing=true"]).train.packing


def test_pack_tokens_below_max_seq_len_is_refused():
    from pydantic import ValidationError

    from draftsmith.recipes.schema import TrainConfig

    with pytest.raises(ValidationError, match="pack_tokens"):
        TrainConfig(packing=True, max_seq_len=128, pack_tokens=64)
    assert TrainConfig(packing=True, max_seq_len=128).pack_tokens is None


def _rows(run):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["stage"] == "train"]


def test_packed_training_resumes_exactly_after_a_kill_and_logs_its_padding(train_run, killed_and_resumed):
    """With packing on, a run killed after a checkpoint and rerun ends with the uninterrupted run's weights and
    metrics (the micro-batches are the same records, packed the same way); packing halves the padding of this data
    (pad_frac in metrics.jsonl) and trains the same tokens per step as the padded run."""
    from safetensors.torch import load_file

    common = ["train.steps=4", "train.save_every=2", "train.micro_batch_size=4", "train.loss.kind=ce"]
    packed = [*common, "train.packing=true", "train.pack_tokens=256"]
    plain = train_run("plain", *common)
    full = train_run("full", *packed)
    resumed = killed_and_resumed("resumed", *packed)
    a, b, c = (load_file(str(p / "checkpoints" / "final" / "model.safetensors")) for p in (full, resumed, plain))
    assert a.keys() == b.keys() == c.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for k in a:  # packed and padded training take the same steps (float32 rounding apart)
        torch.testing.assert_close(a[k], c[k], rtol=1e-5, atol=1e-6, msg=k)
    ra, rb, rp = _rows(full), _rows(resumed), _rows(plain)
    assert [r["step"] for r in rb] == [1, 2, 3, 4]
    for x, y, z in zip(ra, rb, rp):
        assert x["loss"] == y["loss"]
        assert x["loss"] == pytest.approx(z["loss"], rel=1e-4)  # the same records, trained alike
        assert x["input_tokens"] == z["input_tokens"] and "pad_frac" in x and "pad_frac" in z
        assert 0 <= x["pad_frac"] < z["pad_frac"]


@pytest.mark.parametrize(
    "drafter",
    [
        "{kind: eagle, ttt_steps: 2}",
        "{kind: hydra, n_heads: 2, prefix_attention: true}",
        "{kind: pard, n_layers: 1, pard_k: 3}",
    ],
    ids=["eagle3", "hydra++", "pard"],
)
def test_the_loop_trains_packed_like_padded_with_the_target_in_the_loop(train_run, drafter):
    """Through `draftsmith train`: features and teacher from the frozen target in the loop (the records store top-k
    only), packed and padded runs end with the same weights, and packing leaves less padding."""
    from safetensors.torch import load_file

    common = [f"drafter={drafter}", "train.steps=2", "train.micro_batch_size=4", "train.loss.teacher=target"]
    plain = train_run("plain", *common)
    packed = train_run("packed", *common, "train.packing=true", "train.pack_tokens=256")
    a, b = (load_file(str(p / "checkpoints" / "final" / "model.safetensors")) for p in (plain, packed))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    for x, y in zip(_rows(plain), _rows(packed)):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        assert y["input_tokens"] == x["input_tokens"] and y["pad_frac"] < x["pad_frac"]


@pytest.mark.skipif(torch.cuda.device_count() == 1, reason="two ranks on one GPU")
def test_two_gloo_processes_packing_their_halves_equal_one(train_run, tiny_model_dir, prompts_file):
    """Each rank packs its own slice of the global batch; the step is normalised by the trained tokens of all
    ranks, so two packed processes train like one packed (or padded) process."""
    import shutil

    from conftest import run_two_ranks
    from safetensors.torch import load_file

    packed = ["train.packing=true", "train.steps=3", "train.loss.kind=fkl"]
    one = train_run("one", "train.micro_batch_size=4", *packed)
    two = one.parent / "two"
    shutil.copytree(one / "data", two / "data")
    res = run_two_ranks(
        "-m", "draftsmith", "train", "tiny", f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}",
        f"out_dir={two}", "-q", "train.micro_batch_size=2", *packed,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = (load_file(str(p / "checkpoints" / "final" / "model.safetensors")) for p in (one, two))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    for x, y in zip(_rows(one), _rows(two), strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4) and y["input_tokens"] == x["input_tokens"]


@pytest.mark.parametrize("backend", ["own", "transformers"])
def test_sliding_window_targets_slide_inside_each_document(tmp_path, tiny_tokenizer, backend):
    """A Qwen2 target whose first layer slides a 4-token window: each packed document's hidden states equal the
    record's own forward alone, on both target paths (the window counts positions inside the document)."""
    from draftsmith.models.tiny import save_tiny_target

    path = save_tiny_target(
        tmp_path / "qwen2w", tiny_tokenizer, "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1
    )
    tgt = load_model(str(path), torch.float64, backend=backend).model
    recs = _records(len(tiny_tokenizer), 64, 3)
    b = collate_packed(recs, 64)
    h = tgt(b["input_ids"], return_hidden=True, **objectives.packed_kw(b))
    seen = 0
    for r in range(len(h)):
        for j in range(int(b["doc"][r].max()) + 1):
            at = b["doc"][r] == j
            alone = tgt(b["input_ids"][r][at][None], return_hidden=True)[0]
            torch.testing.assert_close(h[r][at], alone, rtol=1e-9, atol=1e-10)
            seen += 1
    assert seen == len(recs)


@pytest.mark.parametrize("packing", ["false", "true"])
def test_loader_workers_change_nothing_but_who_collates(train_run, packing):
    """train.loader_workers: micro-batches read and collated (or packed) by worker processes train to the same
    losses and weights as the main process's."""
    import json

    from safetensors.torch import load_file

    runs = [
        train_run(f"w{w}-{packing}", "train.steps=3", f"train.loader_workers={w}", f"train.packing={packing}")
        for w in (0, 2)
    ]
    losses = [
        [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        for run in runs
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    a, b = (load_file(run / "checkpoints" / "final" / "model.safetensors") for run in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
