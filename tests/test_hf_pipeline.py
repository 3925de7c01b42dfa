"""Train, eval and export drafters for targets that run through transformers (models/hf_target.py).

(a) The same tiny random Llama as the own model and through transformers (``target.backend``): a draft LM, Medusa
heads (full target teacher in the loop) and EAGLE-3 (hidden states computed in the loop) train to the same losses
and weights, and their chains decode to the same tokens, greedy and sampled, lossless against plain decoding.
(b) Gemma-2 (sliding window shorter than the prompts, both soft-caps), Phi-3 and Mixtral: `draftsmith run`
generate -> train -> eval (chain, lossless) -> export hf, and the export decodes to the checkpoint's output.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from conftest import drafter_kinds, save_tiny_llama, small_section, vllm_format
from test_hf_target import ARCHS, QUESTIONS, _save_arch

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.models.loading import encode_chat, load_model, stop_ids
from draftsmith.models.registry import build_drafter, drafter_spec, load_drafter

# Small pipeline sections of the shipped kinds: (drafter section, extra overrides of the run). Every registered
# drafter kind runs; one not listed here runs from its schema defaults.
SECTIONS = {
    "draft_lm": ({"kind": "draft_lm", "n_layers": 1, "init_layers": [0]}, ["train.loss.teacher=target"]),
    "medusa": ({"kind": "medusa", "n_heads": 3}, ["train.loss.teacher=target"]),
    "hydra": ({"kind": "hydra", "n_heads": 3}, []),
    "eagle": ({"kind": "eagle", "version": 3, "ttt_steps": 2}, []),
    "pard": ({"kind": "pard", "n_layers": 1, "init_layers": [0], "pard_k": 3}, []),
    "mlp_speculator": ({"kind": "mlp_speculator", "n_predict": 3}, ["train.loss.teacher=target"]),
    "mtp": ({"kind": "mtp", "init": "random", "ttt_steps": 2}, []),  # the tiny targets ship no MTP layers
}
VARIANTS = {  # decoding variants of a kind that build differently
    "hydra++": ({"kind": "hydra", "n_heads": 3, "prefix_attention": True}, []),
    "eagle1": ({"kind": "eagle", "version": 1, "ttt_steps": 2}, []),
}


def section(kind: str) -> tuple[dict, list[str]]:
    return SECTIONS.get(kind, ({"kind": kind}, []))


def _one_per_interface() -> list[str]:
    """The registry's first drafter kind of each interface: the runs repeated for every architecture."""
    first = {}
    for k in drafter_kinds(role="drafter"):
        first.setdefault(drafter_spec(k).interface, k)
    return list(first.values())


KINDS = {k: section(k) for k in _one_per_interface()}
BOTH_PATHS = {**{k: section(k) for k in drafter_kinds(role="drafter")}, **VARIANTS}  # the Llama run both ways


def _recipe(tmp_path, name: str, drafter: dict):
    from draftsmith.recipes.loader import find_recipe

    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = drafter
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, tiny_tokenizer):
    """A 4-layer tiny Llama (EAGLE-3's default layers are 0, 1, 2)."""
    return save_tiny_llama(tmp_path_factory.mktemp("llama4"), tiny_tokenizer, seed=3, num_hidden_layers=4)


@pytest.fixture(scope="module")
def llama_records(tmp_path_factory, llama4, prompts_file):
    out = tmp_path_factory.mktemp("hfp-data")
    args = [f"target.model={llama4}", f"data.prompts.path={prompts_file}", f"out_dir={out}", "-q"]
    assert main(["generate", "tiny", *args]) == 0
    return out / "data"


def _train_rows(run) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["stage"] == "train" and "loss" in r]


@pytest.mark.parametrize("kind", list(BOTH_PATHS))
def test_training_is_the_same_on_both_paths(tmp_path, llama4, llama_records, prompts_file, kind):
    """`draftsmith train` on the transformers path gives the own path's losses and weights; both checkpoints then
    decode (float64 targets, both paths) to the same chains, greedy and sampled, greedy equal to plain decoding."""
    drafter, extra = BOTH_PATHS[kind]
    recipe = _recipe(tmp_path, kind, drafter)
    runs = {}
    for backend in ("own", "transformers"):
        out = tmp_path / backend
        shutil.copytree(llama_records, out / "data")
        args = [f"target.model={llama4}", f"eval.prompts.path={prompts_file}", f"out_dir={out}"]
        assert main(["train", recipe, *args, f"target.backend={backend}", "train.steps=3", *extra, "-q"]) == 0
        runs[backend] = out
    a, b = (_train_rows(r) for r in runs.values())
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-5)
    (da, ia), (db, ib) = (load_drafter(r / "checkpoints" / "final", dtype=torch.float64) for r in runs.values())
    assert (ia["target_path"], ib["target_path"]) == ("own", "transformers")  # the checkpoint says which ran
    for (k, v), w in zip(da.state_dict().items(), db.state_dict().values()):
        torch.testing.assert_close(w, v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    own = load_model(str(llama4), torch.float64)
    hft = load_model(str(llama4), torch.float64, backend="transformers")
    eos = stop_ids(own.path, own.tokenizer)
    for q in QUESTIONS[:2]:
        x = torch.tensor(encode_chat(own.tokenizer, [{"role": "user", "content": q}]))
        ref = autoregressive_generate(own.model, x, 12, eos_ids=eos)
        for t in (0.0, 1.0):
            outs = []
            for tgt in (own.model, hft.model):
                gen = torch.Generator().manual_seed(5)
                out, st = speculative_generate(tgt, da, x, 12, draft_len=3, temperature=t, eos_ids=eos, generator=gen)
                outs.append((out, st.accept_counts))
            assert outs[0] == outs[1], (q, t)
            if t == 0:
                assert outs[0][0] == ref


def test_draft_lm_from_a_transformers_target_copies_what_maps(tmp_path, tiny_tokenizer, llama4):
    """init_from_target on the transformers path: a Llama target's embeddings, norm, head and layers are copied as
    on the own path; Gemma-2's (1 + w) norm is folded into the draft's weight, but its soft-capped head and scaled
    embeddings are refused in one line naming the key, and a Phi-3's fused layers refuse init_layers."""
    own = load_model(str(llama4), torch.float32).model
    hft = load_model(str(llama4), torch.float32, backend="transformers").model
    sec = small_section("draft_lm", init_layers=[2])
    torch.manual_seed(0)
    a = build_drafter("draft_lm", sec, own)
    torch.manual_seed(0)
    b = build_drafter("draft_lm", sec, hft)
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(v, w), k
    gemma = load_model(str(_save_arch(tmp_path / "gemma2", tiny_tokenizer, "gemma2")), backend="auto").model
    with pytest.raises(DraftsmithError, match="drafter.init_from_target=false") as e:
        build_drafter("draft_lm", small_section("draft_lm"), gemma)
    assert "soft-caps" in str(e.value) and "\n" not in str(e.value)
    d = build_drafter("draft_lm", small_section("draft_lm", init_from_target=False), gemma)
    assert d.cfg.dim == 64
    phi = load_model(str(_save_arch(tmp_path / "phi3", tiny_tokenizer, "phi3")), backend="auto").model
    with pytest.raises(DraftsmithError, match="drafter.init_layers=null"):
        build_drafter("draft_lm", small_section("draft_lm", init_layers=[0]), phi)
    with pytest.raises(DraftsmithError, match="drafter.init_layers=null"):
        build_drafter("eagle", small_section("eagle", n_layers=2, init_layers=[0]), phi)
    with pytest.raises(DraftsmithError, match="drafter.lora_r=0"):  # Medusa-2's adapters name own-model modules
        build_drafter("medusa", small_section("medusa", lora_r=4), hft)
    d = build_drafter("draft_lm", small_section("draft_lm"), phi)  # plain RMSNorm and head: copied
    assert torch.equal(d.embed_tokens.weight, phi.embed_tokens.weight)
    assert torch.equal(d.norm.weight, phi.norm.weight)


# ---- other architectures, the whole pipeline ---------------------------------------------------------------------

ARCH_KINDS = {  # what a draft LM takes from each target (soft-capped or scaled heads and embeddings: nothing)
    "gemma2": {"init_from_target": False, "init_layers": None},
    "gemma3": {"init_from_target": False, "init_layers": None},
    "granite": {"init_from_target": False, "init_layers": None},
    "cohere": {"init_from_target": False, "init_layers": None},
}  # the others copy embeddings, final norm and head; none has Llama layers


FIRST = ("gemma2", "phi3", "mixtral")  # every kind; the other architectures with EAGLE-3, the most demanding
PIPELINES = [(f, k) for f in ARCHS for k in KINDS if f in FIRST or k == "eagle"]


@pytest.mark.parametrize("family,kind", PIPELINES)
def test_other_architectures_run_the_whole_pipeline(tmp_path, tiny_tokenizer, prompts_file, family, kind):
    """generate -> train -> eval (chain, T = 0, lossless against HF generate) -> export hf (and vllm where the
    kind has an engine layout, or medusa); every exported folder reads back to a drafter that decodes as the
    checkpoint does (same tokens, same accepted drafts)."""
    from draftsmith.export.writer import load_export

    path = _save_arch(tmp_path / family, tiny_tokenizer, family)
    drafter, extra = KINDS[kind]
    if kind == "draft_lm":
        drafter = {**drafter, **ARCH_KINDS.get(family, {"init_layers": None})}
    recipe = _recipe(tmp_path, kind, drafter)
    out = tmp_path / "run"
    formats = ["hf", *([f] if (f := vllm_format(kind)) else [])]  # and the layout vLLM's method reads
    args = [
        f"target.model={path}",
        f"data.prompts.path={prompts_file}",
        f"eval.prompts.path={prompts_file}",
        f"out_dir={out}",
        "target.dtype=float64",
        "train.steps=2",
        "eval.prompts.n=2",
        "eval.max_new_tokens=12",
        f"export.formats=[{','.join(formats)}]",
        *extra,
        "-q",
    ]
    assert main(["run", recipe, *args]) == 0
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["target_path"] == "transformers" and report["lossless_match"] == 1.0
    assert report["strategy"]["kind"] == "chain" and report["tau"] >= 1.0
    tgt = load_model(str(path), torch.float64, backend="auto")
    ckpt, info = load_drafter(out / "checkpoints" / "final", dtype=torch.float64)
    assert info["target_path"] == "transformers"
    eos = stop_ids(path, tiny_tokenizer)
    x = torch.tensor(encode_chat(tiny_tokenizer, [{"role": "user", "content": QUESTIONS[1]}]))
    ref = autoregressive_generate(tgt.model, x, 12, eos_ids=eos)
    exported = [load_export(out / "export" / f, dtype=torch.float64)[0] for f in formats]
    runs = [speculative_generate(tgt.model, d, x, 12, draft_len=3, eos_ids=eos) for d in (ckpt, *exported)]
    assert runs[0][0] == ref
    for out_, st in runs[1:]:  # the same tokens and the same drafts accepted: the same drafter
        assert out_ == ref and st.accept_counts == runs[0][1].accept_counts
    sampled = [  # sampled chains: the same seed, the same tokens from the checkpoint and from every export
        speculative_generate(
            tgt.model, d, x, 12, draft_len=3, temperature=1.0, eos_ids=eos, generator=torch.Generator().manual_seed(1)
        )[0]
        for d in (ckpt, *exported)
    ]
    assert len(sampled[0]) > 0 and all(s == sampled[0] for s in sampled)
    if kind == "eagle":  # the engine layout is a Llama layer whatever the target; the verifier is named as it is
        conf = json.loads((out / "export" / "vllm" / "config.json").read_text())
        verifier = conf["speculators_config"]["verifier"]["architectures"]
        assert verifier == json.loads((path / "config.json").read_text())["architectures"]
        assert info["target_architectures"] == verifier


def test_a_soft_capped_head_teaches_with_the_logits_the_model_gives(tmp_path, tiny_tokenizer):
    """train.loss.teacher=target on Gemma-2: the teacher is the soft-capped logits of HF's own forward, not the
    linear head on the final state; restricted to a reduced draft vocabulary it is refused in one line."""
    from types import SimpleNamespace

    from draftsmith.train.losses import Teacher
    from draftsmith.train.objectives import target_teacher

    gemma = load_model(str(_save_arch(tmp_path / "g", tiny_tokenizer, "gemma2")), torch.float64, backend="auto").model
    ids = torch.tensor([[1, 5, 9, 14, 20, 31, 40, 52, 60, 77]])  # longer than the sliding window (8)
    ctx = SimpleNamespace(target=gemma)
    with torch.no_grad():
        h = gemma(ids, return_hidden=True)[0]
        want = gemma.hf(ids).logits[0]
    t = target_teacher(Teacher(), h, ctx)
    assert t.hidden is None and not torch.allclose(h @ gemma.lm_head.weight.t(), want)
    torch.testing.assert_close(t.logits, want)
    with pytest.raises(DraftsmithError, match="teacher=records"):
        target_teacher(Teacher(), h, ctx, head=gemma.lm_head.weight[:10])
