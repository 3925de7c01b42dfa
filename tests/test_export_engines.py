"""EAGLE-3 exports as the serving engines read them, for Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k-norm) targets.

Each engine's reading rule is restated here from its source (docs/export.md names the files): vLLM 0.33
(transformers_utils/configs/speculators/algos.py, model_executor/models/llama_eagle3.py and qwen3_eagle3.py,
v1/worker/gpu_model_runner.py), SGLang 0.5.23 (srt/models/llama_eagle3.py, srt/models/llama.py,
model_runner_components/spec_aux_hidden_state.py) and speculators 0.9 (models/eagle3/). The tests at the end load
the vllm export with the `speculators` package itself and compare every tensor and the forward with draftsmith's;
they run where that package is installed (CI skips them)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftsmith.errors import DraftsmithError
from draftsmith.export.writer import export, load_export
from draftsmith.integrity import checksums
from draftsmith.models.eagle import build_eagle
from draftsmith.models.loading import load_model
from draftsmith.models.registry import load_drafter, save_drafter
from draftsmith.models.tiny import save_tiny_target as _save_tiny_target

FAMILIES = ("llama", "qwen2", "qwen3")


def save_tiny_target(path, tok, family: str, n_layers: int = 8):
    """A tiny random HF folder of ``family`` (Qwen2: q/k/v bias; Qwen3: q/k-norm, head_dim != dim / heads), with a
    RoPE base that is no library's default, so a reader that misses it computes another function."""
    rope = {"rope_type": "default", "rope_theta": 50000.0}
    return _save_tiny_target(path, tok, family, num_hidden_layers=n_layers, rope_parameters=rope)


@pytest.fixture(scope="module")
def targets(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("targets")
    return {f: save_tiny_target(root / f, tiny_tokenizer, f) for f in FAMILIES}


def _drafter_ckpt(tmp_path, tdir, **section):
    t = load_model(str(tdir)).model
    e = build_eagle(
        {"version": 3, "draft_vocab": 120, **section},
        t,
        counts=torch.arange(t.cfg.vocab_size, dtype=torch.float64),
        eos_ids={2},
    )
    torch.manual_seed(1)
    with torch.no_grad():  # away from init: norms != 1, biases random, so a dropped tensor shows
        for p in e.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    return save_drafter(tmp_path / "run" / "checkpoints" / "final", e, "eagle", {"target": str(tdir), "step": 1}), t


def _conf(folder):
    return json.loads((folder / "config.json").read_text())


# ---- the engines' reading rules -----------------------------------------------------------------------------------


def vllm_hf_config(conf: dict) -> dict:
    """The HF config vLLM builds from a folder: a speculators config becomes its transformer_layer_config plus the
    keys update_eagle3 copies; any other config (the sglang layout) is read as is."""
    if "speculators_model_type" not in conf:
        return conf
    hf = dict(conf["transformer_layer_config"])
    hf["draft_vocab_size"] = conf.get("draft_vocab_size")
    hf["norm_before_residual"] = conf.get("norm_before_residual", True)
    arch = {"qwen3": "Eagle3Qwen3ForCausalLM", "llama": "Eagle3LlamaForCausalLM"}.get(hf.get("model_type", "llama"))
    assert arch, f"vLLM raises: unsupported model_type {hf.get('model_type')}"
    hf["architectures"] = [arch]
    if conf.get("eagle_aux_hidden_state_layer_ids"):
        hf["eagle_aux_hidden_state_layer_ids"] = conf["eagle_aux_hidden_state_layer_ids"]
    return hf


def vllm_num_aux(hf: dict) -> int:
    """The width of vLLM's fc, in target hidden states (llama_eagle3.py; qwen3_eagle3.py also reads the top-level
    ids, which we always write with the count)."""
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return hf.get("num_aux_hidden_states") or (len(ids) if ids else 3)


def vllm_capture(hf: dict, n_layers: int) -> list[int]:
    """Which residual streams vLLM captures (id k = the input of layer k = the output of layer k - 1), in order."""
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return sorted(set(ids or (2, n_layers // 2, n_layers - 3)))


def sglang_num_aux(conf: dict) -> int:
    ids = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return conf.get("num_aux_hidden_states") or (len(ids) if ids else 3)


def sglang_capture(conf: dict, n_layers: int) -> list[int]:
    """SGLang's capture ids in vLLM's convention: it adds 1 to eagle_config's (layer outputs)."""
    ids = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return sorted({i + 1 for i in ids}) if ids else [2, n_layers // 2, n_layers - 3]


def engine_attention_tensors(layer_cfg: dict, engine: str) -> set[str]:
    """The attention tensors the engine's first EAGLE-3 layer holds and loads.
    vLLM Llama: attention_bias puts a bias on q, k, v and o (llama.py bias_o_proj). vLLM Qwen3: q/k-norm, q/k/v bias
    from attention_bias, no o bias. SGLang: q/k/v never biased, o biased by attention_bias, no q/k-norm.
    speculators (HF Llama / Qwen3 attention): q/k/v/o bias from attention_bias, q/k-norm for qwen3."""
    bias, qwen3 = layer_cfg.get("attention_bias", False), layer_cfg.get("model_type") == "qwen3"
    names = {f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    if engine == "sglang":
        return names | ({"o_proj.bias"} if bias else set())
    if bias:
        names |= {"q_proj.bias", "k_proj.bias", "v_proj.bias"} | (
            {"o_proj.bias"} if not (qwen3 and engine == "vllm") else set()
        )
    return names | ({"q_norm.weight", "k_norm.weight"} if qwen3 else set())


# ---- the layer a drafter trains ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_style_llama_is_the_default_and_target_copies_qwen_attention(targets, family):
    t = load_model(str(targets[family])).model
    assert t.cfg.rope_theta == 50000.0
    plain = build_eagle({"version": 3}, t)
    assert not plain.cfg.qk_norm and not plain.cfg.attention_bias
    assert not any("q_norm" in k or k.endswith("_proj.bias") for k in plain.state_dict())
    same = build_eagle({"version": 3, "layer_style": "target"}, t)
    assert (same.cfg.qk_norm, same.cfg.attention_bias) == (t.cfg.qk_norm, t.cfg.attention_bias)
    assert ("self_attn.q_norm.weight" in same.state_dict()) == (family == "qwen3")
    assert ("self_attn.q_proj.bias" in same.state_dict()) == (family == "qwen2")


def test_init_layers_from_a_qwen_target_need_its_attention(targets):
    t = load_model(str(targets["qwen3"])).model
    with pytest.raises(DraftsmithError, match="drafter.init_layers.*layer_style=target"):
        build_eagle({"version": 3, "n_layers": 2, "init_layers": [3]}, t)
    build_eagle({"version": 3, "n_layers": 2, "init_layers": [3], "layer_style": "target"}, t)


# ---- item 1 and 2: the layer each engine builds ------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("style", ["target", "llama"])
def test_vllm_export_names_a_layer_vllm_and_speculators_load_whole(targets, tmp_path, family, style):
    ckpt, _ = _drafter_ckpt(tmp_path, targets[family], layer_style=style)
    out = export(ckpt, "vllm", tmp_path / "v")
    conf, tensors = _conf(out), load_file(str(out / "model.safetensors"))
    layer = conf["transformer_layer_config"]
    qk, bias = style == "target" and family == "qwen3", style == "target" and family == "qwen2"
    assert layer["model_type"] == ("qwen3" if qk else "llama") and layer["attention_bias"] is bias
    assert vllm_hf_config(conf)["architectures"] == ["Eagle3Qwen3ForCausalLM" if qk else "Eagle3LlamaForCausalLM"]
    attn = {k.removeprefix("layers.0.self_attn.") for k in tensors if k.startswith("layers.0.self_attn.")}
    for engine in ("vllm", "speculators"):
        assert attn == engine_attention_tensors(layer, engine), engine
    if bias:  # HF / vLLM / speculators read attention_bias as q, k, v *and* o: ours has no o bias, so a zero one
        assert torch.equal(tensors["layers.0.self_attn.o_proj.bias"], torch.zeros(64))
    back, _ = load_export(out)  # and draftsmith reads it back as the same drafter
    original, _ = load_drafter(ckpt)
    assert back.state_dict().keys() == original.state_dict().keys()
    assert all(torch.equal(v, original.state_dict()[k]) for k, v in back.state_dict().items())


def test_import_refuses_a_nonzero_o_bias(targets, tmp_path):
    from safetensors.torch import save_file

    ckpt, _ = _drafter_ckpt(tmp_path, targets["qwen2"], layer_style="target")
    out = export(ckpt, "vllm", tmp_path / "v")
    t = load_file(str(out / "model.safetensors"))
    t["layers.0.self_attn.o_proj.bias"] += 1
    save_file(t, str(out / "model.safetensors"))
    meta = json.loads((out / "drafter.json").read_text())  # a well-formed folder (checksums right) an engine wrote
    meta["sha256"] = checksums(out)
    (out / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(DraftsmithError, match="o_proj.bias"):
        load_export(out)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_sglang_refuses_a_layer_its_eagle3_class_would_drop(targets, tmp_path, family):
    ckpt, _ = _drafter_ckpt(tmp_path, targets[family], layer_style="target")
    what = "q/k/v bias" if family == "qwen2" else "q/k-norm"
    with pytest.raises(DraftsmithError, match=f"--format sglang: SGLang's .*no {what}.*layer_style=llama"):
        export(ckpt, "sglang", tmp_path / "s")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_export_of_a_llama_style_layer_loads_whole(targets, tmp_path, family):
    ckpt, _ = _drafter_ckpt(tmp_path, targets[family])  # the default layer_style: llama
    out = export(ckpt, "sglang", tmp_path / "s")
    conf, tensors = _conf(out), load_file(str(out / "model.safetensors"))
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["attention_bias"] is False
    attn = {k.removeprefix("midlayer.self_attn.") for k in tensors if k.startswith("midlayer.self_attn.")}
    assert attn == engine_attention_tensors(conf, "sglang") == engine_attention_tensors(conf, "vllm")


# ---- item 3: the aux-layer count and ids ----------------------------------------------------------------------------


@pytest.mark.parametrize("aux", [None, [1, 2, 4, 5]])
def test_every_reader_sizes_fc_and_captures_our_layers(targets, tmp_path, aux):
    ckpt, t = _drafter_ckpt(tmp_path, targets["llama"], **({"aux_layers": aux} if aux else {}))
    ours = list(load_drafter(ckpt)[0].cfg.aux_layers)
    want = [i + 1 for i in ours]  # vLLM's convention: the residual entering layer i + 1 = the output of layer i
    L, n = t.cfg.n_layers, len(ours)
    v = export(ckpt, "vllm", tmp_path / "v")
    conf = _conf(v)
    assert load_file(str(v / "model.safetensors"))["fc.weight"].shape == (64, 64 * n)
    hf = vllm_hf_config(conf)
    assert vllm_num_aux(hf) == n and vllm_capture(hf, L) == want
    assert len(conf["eagle_aux_hidden_state_layer_ids"]) == n  # speculators sizes fc from these
    s = export(ckpt, "sglang", tmp_path / "s")
    conf = _conf(s)
    assert sglang_num_aux(conf) == n and sglang_capture(conf, L) == want
    assert vllm_num_aux(vllm_hf_config(conf)) == n and vllm_capture(vllm_hf_config(conf), L) == want  # vLLM reading it


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
@pytest.mark.parametrize("aux", [[4, 1, 2], [1, 1, 2]])
def test_engine_formats_refuse_aux_layers_the_engines_reorder(targets, tmp_path, fmt, aux):
    ckpt, _ = _drafter_ckpt(tmp_path, targets["llama"], aux_layers=aux)
    with pytest.raises(DraftsmithError, match=rf"--format {fmt}: .*ascending.*aux_layers={re.escape(str(aux))}"):
        export(ckpt, fmt, tmp_path / fmt)
    assert not (tmp_path / fmt).exists()
    export(ckpt, "hf", tmp_path / "hf")  # draftsmith's own layout keeps any order


# ---- item 4: embeddings ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_embeddings_are_written_by_default(targets, tmp_path, fmt):
    from draftsmith.cli import main
    from draftsmith.recipes.schema import ExportConfig

    ckpt, t = _drafter_ckpt(tmp_path, targets["llama"])
    tensors = load_file(str(export(ckpt, fmt, tmp_path / "a") / "model.safetensors"))
    assert torch.equal(tensors["embed_tokens.weight"], t.embed_tokens.weight)
    assert "embed_tokens.weight" not in load_file(
        str(export(ckpt, fmt, tmp_path / "b", include_embeddings=False) / "model.safetensors")
    )
    assert ExportConfig().include_embeddings is True
    assert main(["export", str(ckpt), "--format", fmt, "--out", str(tmp_path / "c")]) == 0
    assert "embed_tokens.weight" in load_file(str(tmp_path / "c" / "model.safetensors"))
    assert main(["export", str(ckpt), "--format", fmt, "--out", str(tmp_path / "d"), "--no-include-embeddings"]) == 0
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "d" / "model.safetensors"))


# ---- the speculators package itself -------------------------------------------------------------------------------


def _speculators_step0_logits(model, feats, tok):
    """speculators' own forward (one TTT step, eager attention): the draft logits its lm_head produced."""
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    T = tok.shape[1]
    with torch.no_grad():
        model(
            hidden_states=feats,
            input_ids=tok,
            document_ids=torch.zeros(1, T, dtype=torch.long),
            position_ids=torch.arange(T)[None],
            ttt_steps=1,
        )
    hook.remove()
    return seen[0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("style", ["target", "llama"])
def test_speculators_loads_every_tensor_and_computes_our_layer(targets, tmp_path, family, style):
    """Checked with speculators 0.9.0 under several PYTHONHASHSEED values (its embedding loading depended on it)."""
    speculators = pytest.importorskip("speculators")
    ckpt, t = _drafter_ckpt(tmp_path, targets[family], layer_style=style, aux_layers=[0, 2, 3])
    out = export(ckpt, "vllm", tmp_path / "v")
    cfg = speculators.SpeculatorModelConfig.from_pretrained(str(out))
    # a local target has no hub id, so the export names no verifier (null); speculators resolves one on load:
    # name it in the config, as docs/export.md tells users to
    assert cfg.speculators_config.verifier.name_or_path is None
    cfg.speculators_config.verifier.name_or_path = str(targets[family])
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = speculators.SpeculatorModel.from_pretrained(str(out), config=cfg).eval()
    ours, theirs = load_file(str(out / "model.safetensors")), model.state_dict()
    assert set(theirs) - set(ours) == {"verifier_lm_head.weight", "verifier_norm.weight"}  # nothing left unloaded
    for k, v in ours.items():
        assert torch.equal(theirs[k].to(v.dtype), v), k
    assert torch.equal(theirs["embed_tokens.weight"], t.embed_tokens.weight)
    own, _ = load_drafter(ckpt)
    torch.manual_seed(2)
    T = 12
    feats, tok = torch.randn(1, T, 3 * 64), torch.randint(3, 300, (1, T))
    with torch.no_grad():
        _, state = own.step(own.project(feats), tok)
        want = F.linear(own.head_input(state), own.lm_head.weight)
    torch.testing.assert_close(_speculators_step0_logits(model, feats, tok), want, rtol=1e-5, atol=1e-5)
