"""Train/serve match (tests/match.py, docs/decoding.md): what a drafter is trained to predict at a position is what
the decoder drafts there.

On the target's own greedy records (T = 0) every chain the decoder starts is at a prefix of the record, so the
training objective's teacher-forced prediction there (EAGLE's TTT step 0, feature head 0) must be the chain's
first draft, token for token, and step / head k must be draft k + 1 wherever drafts 1..k were accepted. The
predictions come from the training objective itself on batches from the training collate; the drafts from the
decoder. float64 throughout, so rounding cannot flip an argmax: any difference is a mismatch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from match import compare, teacher_forced, train_briefly

from draftsmith.data.dataset import collate
from draftsmith.data.engine import Capture, Sampling, decode_batch
from draftsmith.data.records import Record
from draftsmith.models.llama import LlamaConfig
from draftsmith.models.registry import build_drafter, drafter_spec

CFG = LlamaConfig(vocab_size=97, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=256)
PROMPTS = [[5, 17, 33], [3, 14, 15, 92, 65], list(range(10, 30)), [40, 41], [7, 7, 8, 60, 61, 62, 1]]
NEW, EOS, GAMMA = 40, {2}, 4
AUX = [0, 2, 3]  # EAGLE-3's fused layers: distinct, so a wrong index shows

SECTIONS = {  # drafter variant -> (kind, recipe section); each trains / checks 3 draft positions
    "eagle3": ("eagle", {"version": 3, "aux_layers": AUX, "ttt_steps": 3}),
    "eagle3-vocab": ("eagle", {"version": 3, "aux_layers": AUX, "ttt_steps": 3, "draft_vocab": 40}),
    "eagle3-deep": ("eagle", {"version": 3, "aux_layers": AUX, "ttt_steps": 3, "n_layers": 2}),
    "eagle1": ("eagle", {"version": 1, "ttt_steps": 3}),
    "fspad": ("eagle", {"version": 1, "ttt_steps": 3, "feature_sampling": True, "partial_alignment": True}),
    "gumiho": ("gumiho", {"version": 3, "aux_layers": AUX, "serial_drafts": 2, "mlp_heads": 2, "mlp_layers": 2}),
    "gumiho1": ("gumiho", {"version": 1, "n_layers": 1, "serial_drafts": 1, "mlp_heads": 3}),  # drafts 2, 3: heads
    "falcon": ("falcon", {"block_size": 3, "glance": 0.0}),  # drafts 1-3: the first block, what training sees
    "peagle": ("eagle", {"version": 3, "aux_layers": AUX, "parallel_drafts": 3, "fc_norm": True}),
    "eagle3-window": ("eagle", {"version": 3, "aux_layers": AUX, "ttt_steps": 3, "sliding_window": 6}),
    "peagle-window": ("eagle", {"version": 3, "aux_layers": AUX, "parallel_drafts": 3, "sliding_window": 5}),
    "medusa": ("medusa", {"n_heads": 3}),
    "hydra": ("hydra", {"n_heads": 3}),
    "hydra++": ("hydra", {"n_heads": 3, "prefix_attention": True}),
    "mlp_speculator": ("mlp_speculator", {"n_predict": 3}),
    "mtp": ("mtp", {"init": "random", "ttt_steps": 3}),  # a fresh MTP layer of the target's kind (Llama here)
    "mtp-window": ("mtp", {"init": "random", "ttt_steps": 3, "sliding_window": 6}),
}


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, CFG, logit_scale=3.0)


@pytest.fixture(scope="module")
def records(target):
    """The target's greedy answers to PROMPTS from the data stage's generator, with every feature the drafters
    read (EAGLE-3's fused layers, the final normed state), kept in float64."""
    gens = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
    out = decode_batch(target, PROMPTS, NEW, EOS, Sampling(0.0), gens, Capture(0, True, tuple(AUX)))
    return [
        Record(torch.tensor(p + g.tokens), torch.tensor([0] * len(p) + [1] * len(g.tokens)), i, signals=g.hidden)
        for i, (p, g) in enumerate(zip(PROMPTS, out))
    ]


def _drafter(name: str, target, records, noise: float = 0.05):
    kind, fields = SECTIONS[name]
    params = drafter_spec(kind).section(fields)
    counts = sum(torch.bincount(r.input_ids[r.loss_mask.bool()], minlength=CFG.vocab_size) for r in records)
    torch.manual_seed(3)
    d = build_drafter(kind, params, target, counts=counts, eos_ids=EOS).double()
    with torch.no_grad():  # non-trivial random weights (an identity start would draft the target's own argmax)
        for p in d.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * noise)
    return d.eval(), params


def _check(target, drafter, params, records, in_loop: bool = False):
    m = compare(target, drafter, params, records, NEW, GAMMA, EOS, in_loop=in_loop, batch_size=3)
    assert m.mismatches == [] and m.diverged == 0, m.mismatches[:5]
    # a reduced vocabulary does not train every label; Falcon's first block has no pairs before a 2-token prompt
    assert m.untrained_first == 0 or getattr(drafter, "d2t", None) is not None or hasattr(drafter, "output_lag")
    assert m.compared[0] + m.untrained_first == m.starts  # every chain start was compared
    return m


@pytest.mark.parametrize("name", list(SECTIONS))
def test_decoder_drafts_are_the_objectives_teacher_forced_predictions(target, records, name, one_thread):
    """Random and briefly trained drafters: every chain's first draft is the objective's step-0 (head-0) argmax at
    that position; drafts 2 and 3 match steps / heads 1 and 2 wherever the drafts before them were accepted."""
    drafter, params = _drafter(name, target, records)
    m = _check(target, drafter, params, records)  # random: nearly every first draft rejected
    assert m.starts > 150 and m.compared[0] >= 0.9 * m.starts
    train_briefly(drafter, params, collate(records))
    m = _check(target, drafter, params, records)
    assert 0.3 * m.starts < m.accepted_first < m.starts, m  # accepted and rejected first drafts
    third = 5 if name.startswith("peagle") else 10  # P-EAGLE's third draft reads no draft: accepted less after 10 steps
    assert m.compared[1] > 20 and m.compared[2] > third, m
    if params.kind in ("eagle", "mtp"):  # the frozen target computing the features in the loop: the same drafts
        assert _check(target, drafter, params, records, in_loop=True).compared == m.compared


def test_teacher_forced_predictions_are_the_objectives_top1(target, records):
    """The predictions ``teacher_forced`` keeps are the ones the objective's own top-1 metrics count."""
    drafter, params = _drafter("eagle3-vocab", target, records)
    train_briefly(drafter, params, collate(records))
    batch = collate(records)
    preds, metrics = teacher_forced(drafter, params, batch)
    ids = batch["input_ids"]
    for s in range(3):
        hits = [p == int(ids[b, t + s + 2]) for (k, b, t), p in preds.items() if k == s]
        assert len(hits) > 100 and sum(hits) / len(hits) == pytest.approx(metrics[f"top1_step{s}"])


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory, tiny_tokenizer):
    from conftest import save_tiny_llama

    return save_tiny_llama(
        tmp_path_factory.mktemp("tiny-llama-5"), tiny_tokenizer, num_hidden_layers=5, initializer_range=0.15
    )


@pytest.mark.parametrize("backend", ["own", "transformers"])
def test_the_whole_pipeline_trains_what_the_decoder_drafts(backend, deep_model_dir, prompts_file, tmp_path, one_thread):
    """`draftsmith generate` (greedy, EAGLE-3 features stored in bf16, on either target path) -> `draftsmith train`
    (float32) -> the checkpoint decoded in float64 on the own path, as the eval stage runs it (fused, pre-packed
    copies) and plain: at every chain start the first draft is the TTT step-0 argmax of the objective on the
    stored records (features from the target in the loop: exactly; from the records' bf16 rows: wherever
    rounding does not flip it), and drafts 2 and 3 are steps 1 and 2 after accepted drafts."""
    import copy

    import yaml

    from draftsmith.cli import main
    from draftsmith.data.dataset import RecordDataset
    from draftsmith.models.loading import load_model, stop_ids
    from draftsmith.models.registry import load_drafter
    from draftsmith.recipes.loader import find_recipe

    fields = {"version": 3, "aux_layers": AUX, "ttt_steps": 3, "draft_vocab": 150}
    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "eagle", **fields}
    recipe = tmp_path / "tiny-eagle3.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    common = [f"target.model={deep_model_dir}", f"data.prompts.path={prompts_file}", f"out_dir={tmp_path / 'run'}"]
    data = ["data.temperature=0", "data.max_new_tokens=32", f"data.signals.hidden_layers={AUX}", "target.dtype=float64"]
    assert main(["generate", str(recipe), *common, *data, f"target.backend={backend}", "-q"]) == 0
    train = ["train.steps=40", "train.lr=5e-3", "train.loss.kind=ce", "train.eval_every=0", "-q"]
    assert main(["train", str(recipe), *common, f"eval.prompts.path={prompts_file}", *train]) == 0
    tgt = load_model(str(deep_model_dir), torch.float64)
    drafter, _ = load_drafter(tmp_path / "run" / "checkpoints" / "final", dtype=torch.float64)
    params = drafter_spec("eagle").section(fields)
    ds = RecordDataset(tmp_path / "run" / "data", 256)
    records = [ds[i] for i in range(len(ds))]
    assert len(records) == 8 and "hidden_aux" in records[0].signals and ds.manifest["target_path"] == backend
    eos = stop_ids(tgt.path, tgt.tokenizer)
    exact = compare(tgt.model, drafter, params, records, 32, GAMMA, eos, in_loop=True)
    assert exact.mismatches == [] and exact.diverged == 0, exact.mismatches[:5]
    assert exact.compared[0] == exact.starts > 50 and exact.compared[1] > 20
    assert 0.3 * exact.starts < exact.accepted_first < exact.starts  # accepted and rejected first drafts
    assert exact.acceptance()[0] == exact.accepted_first / exact.starts
    stored = compare(tgt.model, drafter, params, records, 32, GAMMA, eos, decoded=exact.decoded)
    assert stored.compared == exact.compared and stored.rate(0) >= 0.95 and stored.rate(1) >= 0.95
    serving = copy.deepcopy(tgt.model).optimize_for_inference(), copy.deepcopy(drafter).optimize_for_inference()
    fused = compare(tgt.model, drafter, params, records, 32, GAMMA, eos, in_loop=True, serving=serving)
    assert fused.mismatches == [] and fused.compared == exact.compared
