"""Export (draftsmith/export/): every format's key/config contract, the round trip back
into draftsmith's decoder (same greedy output and τ), atomic writes, the model card, hub push (dry run, offline,
token never shown) and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import drafter_kinds, small_section
from safetensors.torch import load_file

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import speculative_generate
from draftsmith.eval.tree import DynamicTree
from draftsmith.eval.tree_decoder import tree_speculative_generate
from draftsmith.export import formats
from draftsmith.export.writer import export, load_export, model_card, push_to_hub
from draftsmith.models.eagle import build_eagle
from draftsmith.models.loading import load_model
from draftsmith.models.registry import build_drafter, drafter_spec, load_drafter, save_drafter


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(str(tiny_model_dir)).model


def _perturbed(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return model


# Every registered drafter kind is exported from its small section (conftest.SMALL_SECTIONS, else its defaults),
# plus the variants whose layouts differ: a reduced vocabulary, a deeper EAGLE-3, EAGLE-1, Hydra++'s prefix layer.
VARIANTS = {
    "eagle3": ("eagle", {"version": 3, "draft_vocab": 120, "aux_layers": [0, 1]}),
    "eagle3_deep": ("eagle", {"version": 3, "n_layers": 2, "init_layers": [1]}),
    "eagle1": ("eagle", {"version": 1}),
    "fspad": ("eagle", {"version": 1, "feature_sampling": True, "partial_alignment": True}),
    "eagle3.1": ("eagle", {"version": 3, "fc_norm": True}),
    "peagle": ("eagle", {"version": 3, "parallel_drafts": 4, "ttt_steps": 4, "draft_vocab": 120}),
    "eagle3_window": ("eagle", {"version": 3, "sliding_window": 8, "ttt_steps": 3}),
    "eagle1_window": ("eagle", {"version": 1, "fc_bias": False, "sliding_window": 8}),
    "dflash_window": ("dflash", {"sliding_window": 8}),
    "hydra++": ("hydra", {"prefix_attention": True}),
    "medusa_vocab": ("medusa", {"n_heads": 2, "draft_vocab": 100}),
    "pard_reserved": ("pard", {"mask_token": 0}),  # the mask is a reserved id of the target (vLLM's PARD needs it)
}
BUILDS = {**{k: (k, {}) for k in drafter_kinds(role="drafter")}, **VARIANTS}
# Formats a kind lists but a variant's config cannot take: the export refuses in one line and writes nothing.
REFUSED = {
    ("medusa_vocab", "medusa"),  # the Medusa layout has no reduced vocabulary
    ("eagle3_deep", "sglang"),  # SGLang loads one EAGLE-3 layer
    ("eagle1", "vllm"),  # vLLM's EAGLE-1 fc has no bias
    ("fspad", "vllm"),  # no engine has FSPAD's token gate or split output
    ("fspad", "sglang"),
    ("eagle3.1", "sglang"),  # SGLang's EAGLE-3 layer has no per-layer fc norms
    ("peagle", "sglang"),  # P-EAGLE is written in speculators' layout only
    ("eagle3_window", "sglang"),  # SGLang's EAGLE-3 attention takes no window
    ("eagle1_window", "vllm"),  # the engines' EAGLE-1 layers take no window
    ("eagle1_window", "sglang"),
    ("pard", "vllm"),  # an appended mask token is outside the target's vocabulary
}
# Layouts that store the weights transformed (the same function): IBM's norm takes centred, scaled weights; vLLM's
# DFlash embeds the mask slot as the mask id's embedding row, which our DFlash never reads as a token.
# P-EAGLE likewise (its mask vector in the embedding row of its mask id).
REWRITTEN = {("mlp_speculator", "mlp-speculator"), ("dflash", "vllm"), ("dflash_window", "vllm"), ("peagle", "vllm")}


def _formats(name: str) -> list[str]:
    """The formats the variant's kind lists (DrafterSpec.exports), without those the kind always refuses."""
    kind, fields = BUILDS[name]
    info = {"kind": kind, "config": small_section(kind, **fields).model_dump()}
    entries = drafter_spec(kind).export_formats(info)
    return [f for f, e in entries.items() if not e["write"].startswith("refused: ")]


CASES = [(name, fmt) for name in BUILDS for fmt in _formats(name)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, target, tiny_model_dir):
    root = tmp_path_factory.mktemp("ckpts")
    counts = torch.arange(target.cfg.vocab_size, dtype=torch.float64)  # reduced vocabularies keep the highest ids
    out = {}
    for i, (name, (kind, fields)) in enumerate(BUILDS.items()):
        model = build_drafter(kind, small_section(kind, **fields), target, counts=counts, eos_ids={2})
        out[name] = save_drafter(
            root / name / "checkpoints" / "final",
            _perturbed(model, seed=i),
            kind,
            {"target": str(tiny_model_dir), "recipe": f"test-{name}", "step": 7},
        )
    return out


def _decode(target, drafter, tree=False):
    prompt = torch.randint(3, 300, (10,), generator=torch.Generator().manual_seed(5))
    if tree:  # as deep as the drafter drafts (heads: one token per head)
        depth = min(3, getattr(drafter, "max_draft_len", None) or 3)
        return tree_speculative_generate(target, drafter, prompt, 24, DynamicTree(top_k=2, depth=depth, total_tokens=6))
    return speculative_generate(target, drafter, prompt, 24, draft_len=3)


@pytest.mark.parametrize("name,fmt", CASES)
def test_round_trip_gives_the_same_output_and_tau(checkpoints, target, tmp_path, name, fmt):
    from draftsmith.models.registry import load_drafter

    ckpt = checkpoints[name]
    if (name, fmt) in REFUSED:
        with pytest.raises(DraftsmithError) as e:
            export(ckpt, fmt, tmp_path / fmt)
        assert "\n" not in str(e.value) and f"--format {fmt}" in str(e.value) and not any(tmp_path.iterdir())
        return
    out = export(ckpt, fmt, tmp_path / fmt)
    assert sorted(p.name for p in tmp_path.iterdir()) == [fmt]  # no .tmp left behind
    original, _ = load_drafter(ckpt)
    back, info = load_export(out, target)
    assert info["export_format"] == fmt
    sd_a, sd_b = original.state_dict(), back.state_dict()
    assert sd_a.keys() == sd_b.keys()
    assert (name, fmt) in REWRITTEN or all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    for tree in (False, True):
        (o1, s1), (o2, s2) = _decode(target, original, tree), _decode(target, back, tree)
        assert o1 == o2 and s1.tau == s2.tau and s1.accept_counts == s2.accept_counts


def test_medusa_layout_refuses_reduced_vocabulary_heads(checkpoints, tmp_path):
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match="keep 100 of 300 tokens.*--format hf"):
        export(checkpoints["medusa_vocab"], "medusa", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_sglang_refuses_a_deeper_eagle_and_vllm_stacks_its_blocks(checkpoints, tmp_path):
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match="--format sglang: .*n_layers=2 .*--format vllm or hf"):
        export(checkpoints["eagle3_deep"], "sglang", tmp_path / "sglang")
    assert not (tmp_path / "sglang").exists()
    out = export(checkpoints["eagle3_deep"], "vllm", tmp_path / "vllm")  # vLLM: plain Llama layers after layer 0
    conf = json.loads((out / "config.json").read_text())
    assert conf["transformer_layer_config"]["num_hidden_layers"] == 2
    names = load_file(str(out / "model.safetensors"))
    assert "layers.1.input_layernorm.weight" in names and not any(k.startswith("extra.") for k in names)


def test_eagle3_engine_contracts(checkpoints, tmp_path):
    ckpt, cfg = checkpoints["eagle3"], json.loads((checkpoints["eagle3"] / "drafter.json").read_text())["config"]
    v = export(ckpt, "vllm", tmp_path / "vllm", include_embeddings=False)
    conf = json.loads((v / "config.json").read_text())
    assert "model_type" not in conf and conf["speculators_model_type"] == "eagle3"  # vLLM routes on this
    assert conf["architectures"] == ["Eagle3Speculator"] and conf["norm_before_residual"] is False
    sc = conf["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["proposal_methods"][0]["speculative_tokens"] >= 1
    assert "name_or_path" in sc["verifier"]  # null here: the tiny target is a local folder with no hub id
    assert conf["draft_vocab_size"] == 120 and conf["transformer_layer_config"]["vocab_size"] == cfg["vocab_size"]
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 2]  # vLLM's input indices
    t = load_file(str(v / "model.safetensors"))
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.hidden_norm.weight",
        "layers.0.post_attention_layernorm.weight",
        "layers.0.mlp.down_proj.weight",
    } <= set(t)
    assert "embed_tokens.weight" not in t
    assert t["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * cfg["dim"]  # reads [norm(e), norm(state)]
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and int(t["t2d"].sum()) == 120
    assert torch.equal(torch.nonzero(t["t2d"])[:, 0], torch.arange(120) + t["d2t"])  # the same kept ids
    s = export(ckpt, "sglang", tmp_path / "sglang", include_embeddings=True)
    conf = json.loads((s / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["draft_vocab_size"] == 120
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]  # SGLang: layer outputs
    t = load_file(str(s / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in t and "midlayer.hidden_norm.weight" in t
    assert "embed_tokens.weight" in t and not any(k.startswith("layers.") for k in t)


def test_a_windowed_eagle3_is_a_sliding_window_layer_for_vllm(checkpoints, tmp_path):
    """vLLM's EAGLE-3 layers (Llama's and Qwen3's) take the window from layer_types and sliding_window."""
    v = export(checkpoints["eagle3_window"], "vllm", tmp_path / "vllm")
    layer = json.loads((v / "config.json").read_text())["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == 8
    assert layer["use_sliding_window"] is True  # Qwen3's config drops the window without it
    v = export(checkpoints["dflash_window"], "vllm", tmp_path / "dflash")
    dc = json.loads((v / "config.json").read_text())["dflash_config"]
    assert dc["use_swa"] is True and dc["swa_window_size"] == 8 and dc["causal"] is False


def test_medusa_layout_for_tensorrt_llm_and_tgi(checkpoints, tmp_path):
    out = export(checkpoints["medusa"], "medusa", tmp_path / "m")
    conf = json.loads((out / "config.json").read_text())
    assert "architectures" not in conf  # TGI disables Medusa when it sees one
    assert (conf["medusa_num_heads"], conf["medusa_num_layers"]) == (3, 1) and "base_model_name_or_path" in conf
    t = load_file(str(out / "medusa_lm_head.safetensors"))
    assert set(t) == {f"{h}.{k}" for h in range(3) for k in ("0.linear.weight", "0.linear.bias", "1.weight")}
    assert t["0.1.weight"].shape == (conf["vocab_size"], conf["hidden_size"])


def test_hf_draft_lm_loads_in_transformers_with_its_tokenizer_and_card(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.models.registry import load_drafter

    report = checkpoints["draft_lm"].parent.parent / "eval"
    report.mkdir()
    (report / "report.json").write_text(
        json.dumps(
            {
                "prompts": {"source": "mt_bench", "n": 8},
                "strategy": {"kind": "chain", "draft_len": 3},
                "tau": 2.5,
                "acceptance_rate": 0.6,
                "speedup": {"vs_ar": 1.7, "vs_ar_hf": 2.0},
                "lossless_match": 1.0,
                "device": "cpu",
                "dtype": "float32",
                "temperature": 0.0,
                "max_new_tokens": 64,
            }
        )
    )
    out = export(checkpoints["draft_lm"], "hf", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(str(out)).chat_template
    drafter, _ = load_drafter(checkpoints["draft_lm"])
    ids = torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, drafter(ids), rtol=1e-4, atol=1e-4)
    card = (out / "README.md").read_text()
    assert "| mt_bench × 8 | kind=chain draft_len=3 | 2.50 | 0.60 | 1.70× | 2.00× |" in card
    assert "library_name: transformers" in card and "test-draft_lm" in card


def test_model_card_without_an_eval_says_so():
    card = model_card({"kind": "eagle", "target": "org/model", "recipe": "r"}, "sglang", None)
    assert "base_model: org/model" in card and "No eval report" in card and "EAGLE3" in card


def test_wrong_format_for_a_kind_is_a_one_line_error(checkpoints, tmp_path, capsys):
    assert main(["export", str(checkpoints["hydra"]), "--format", "vllm", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "drafter.kind hydra exports as hf (not vllm)" in err
    assert not (tmp_path / "x").exists()


def test_export_refuses_an_out_folder_that_is_or_holds_its_checkpoint(checkpoints, tmp_path, capsys):
    import shutil

    ckpt = shutil.copytree(checkpoints["draft_lm"], tmp_path / "run" / "checkpoints" / "final")
    before = sorted(p.name for p in ckpt.iterdir())
    for out in (ckpt, ckpt.parent, ckpt.parent.parent):  # the folder itself, checkpoints/, the run folder
        assert main(["export", str(ckpt), "--format", "hf", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is or contains the checkpoint" in err[0]
    assert sorted(p.name for p in ckpt.iterdir()) == before
    load_export(export(ckpt, "hf", ckpt / "hf"), None)  # a folder inside it is fine: the checkpoint stays whole
    assert load_drafter(ckpt)[1]["kind"] == "draft_lm"


def test_an_out_folder_that_cannot_be_written_is_a_one_line_error(checkpoints, tmp_path, monkeypatch, capsys):
    """A read-only mount or a full disk: exit 2 with one line naming the folder, and no .tmp folder left."""
    import errno

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("draftsmith.export.writer.save_file", read_only)
    assert main(["export", str(checkpoints["draft_lm"]), "--format", "hf", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot write" in err[0] and "Read-only file system" in err[0]
    assert not list(tmp_path.iterdir())


def test_an_export_whose_config_was_edited_is_refused(checkpoints, tmp_path):
    """A drafter.json whose config changed after the export (rope_theta x 10: no shape changes, the weights'
    checksums still match) is refused at load, naming the file; the export as written loads."""
    out = export(checkpoints["draft_lm"], "hf", tmp_path / "x")
    load_export(out, None)
    meta = json.loads((out / "drafter.json").read_text())
    meta["config"]["rope_theta"] = meta["config"].get("rope_theta", 10000.0) * 10
    (out / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(DraftsmithError, match="drafter.json: its config differs"):
        load_export(out, None)


def test_a_failed_export_leaves_no_complete_looking_folder(checkpoints, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr("draftsmith.export.writer.save_file", boom)
    with pytest.raises(RuntimeError):
        export(checkpoints["draft_lm"], "hf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_cli_checkpoint_export_and_dry_run_push(checkpoints, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_SECRET_never_printed")
    out = tmp_path / "v"
    assert (
        main(
            [
                "export",
                str(checkpoints["eagle3"]),
                "--format",
                "vllm",
                "--out",
                str(out),
                "--push-to-hub",
                "me/eagle",
                "--dry-run",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert f"export: {out}" in text and "would upload model.safetensors" in text and "-> me/eagle" in text
    assert "SECRET" not in text
    assert not any("SECRET" in f.read_text() for f in out.iterdir() if f.suffix in (".json", ".md", ".yaml"))


def test_push_uses_the_env_token_and_never_shows_it(checkpoints, tmp_path, monkeypatch):
    out = export(checkpoints["medusa"], "medusa", tmp_path / "m")
    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo, exist_ok, private):
            calls["repo"] = repo

        def upload_folder(self, folder_path, repo_id, commit_message):
            calls["folder"] = folder_path
            raise OSError("401 Unauthorized for token hf_SECRET")  # errors must not echo the token either

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", "hf_SECRET")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(Exception) as e:
        push_to_hub(out, "me/medusa")
    assert calls == {"token": "hf_SECRET", "repo": "me/medusa", "folder": str(out)}
    assert "push to hub 'me/medusa' failed" in str(e.value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(Exception, match="HF_HUB_OFFLINE=1"):
        push_to_hub(out, "me/medusa")


def test_push_error_messages_hide_the_token(checkpoints, tmp_path, monkeypatch):
    out = export(checkpoints["medusa"], "medusa", tmp_path / "m")

    class FailingApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, *a, **k):
            raise OSError("bad credentials hf_SECRET")

    monkeypatch.setattr("huggingface_hub.HfApi", FailingApi)
    monkeypatch.setenv("HF_TOKEN", "hf_SECRET")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(Exception) as e:
        push_to_hub(out, "me/medusa")
    assert "hf_SECRET" not in str(e.value)


def test_speculators_package_loads_the_vllm_export(tmp_path, tiny_tokenizer):
    """Runs where `speculators` is installed (it pins its own torch, so CI skips it); checked with 0.9.0."""
    speculators = pytest.importorskip("speculators")
    from conftest import save_tiny_llama

    tdir = save_tiny_llama(tmp_path / "target", tiny_tokenizer, num_hidden_layers=6)  # 3 distinct aux layers
    t = load_model(str(tdir)).model
    e = _perturbed(
        build_eagle(
            {"version": 3, "draft_vocab": 120, "aux_layers": [0, 2, 3]},
            t,
            counts=torch.arange(t.cfg.vocab_size, dtype=torch.float64),
            eos_ids={2},
        ),
        3,
    )
    ckpt = save_drafter(tmp_path / "run" / "checkpoints" / "final", e, "eagle", {"target": str(tdir), "step": 1})
    out = export(ckpt, "vllm", tmp_path / "v")
    assert json.loads((out / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert speculators.SpeculatorModelConfig.from_pretrained(str(out)).speculators_model_type == "eagle3"
    cfg = speculators.SpeculatorModelConfig.from_pretrained(str(out))
    cfg.speculators_config.verifier.name_or_path = str(tdir)  # a local target: the export names none (null)
    model = speculators.SpeculatorModel.from_pretrained(str(out), config=cfg)
    ours = load_file(str(out / "model.safetensors"))
    theirs = model.state_dict()
    for k in ours:  # every tensor; the embeddings too (run it under several PYTHONHASHSEED values)
        assert torch.equal(theirs[k].to(ours[k].dtype), ours[k]), k
    assert torch.equal(theirs["embed_tokens.weight"], t.embed_tokens.weight)


def test_serving_format_names_are_documented():
    """Each format's card says how its engine loads the folder: the command, and the target where it is needed."""
    assert formats.weights_file({"kind": "medusa", "config": {}}, "medusa") == "medusa_lm_head.safetensors"
    for name, fmt in CASES:  # every kind in every format it writes: a usage line, in the card
        kind, fields = BUILDS[name]
        info = {"kind": kind, "config": small_section(kind, **fields).model_dump()}
        text = formats.usage(fmt, info, "org/m")
        assert text.strip() and text in model_card({**info, "target": "org/m", "recipe": "r"}, fmt, None), name
    # what the commands of the shipped kinds' layouts say (the format "medusa" is also a kind's name)
    want = {
        ("vllm", "eagle"): ["vllm serve ./this-folder", "EAGLE-3"],
        ("vllm", "draft_lm"): ["vllm serve org/m", '"model": "./this-folder"'],
        ("sglang", "eagle"): ["--model org/m", "--speculative-algorithm EAGLE3", "--speculative-draft-model-path"],
        ("medusa", "medusa"): ["text-generation-launcher --model-id ./this-folder", "TensorRT-LLM"],
        ("hf", "draft_lm"): ["assistant_model=AutoModelForCausalLM.from_pretrained", "draftsmith eval"],
        ("hf", "eagle"): ["draftsmith eval RECIPE eval.checkpoint=./this-folder", "draftsmith's own layout"],
    }
    for (fmt, kind), fragments in want.items():
        text = formats.usage(fmt, {"kind": kind}, "org/m")
        assert all(f in text for f in fragments), (fmt, kind, text)
        card = model_card({"kind": kind, "target": "org/m", "recipe": "r"}, fmt, None)
        assert text in card and "base_model: org/m" in card and f"Exported as `{fmt}`" in card
