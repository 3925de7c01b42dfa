"""Export formats beyond EAGLE-3 / Medusa (draftsmith/export/formats.py): a reduced-vocabulary draft LM as a plain
LlamaForCausalLM (transformers' assisted generation), the MLP speculator in IBM's layout (vLLM / TGI), and EAGLE-1
in the layouts vLLM's and SGLang's EAGLE loaders read. Each is checked against a re-statement of what the engine
reads or computes, written here from the engines' sources, plus the round trip back into draftsmith."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import speculative_generate
from draftsmith.export.writer import FORMATS, export, load_export
from draftsmith.models.draft_lm import build_draft_lm
from draftsmith.models.eagle import build_eagle
from draftsmith.models.loading import load_model
from draftsmith.models.mlp_speculator import build_mlp_speculator
from draftsmith.models.registry import load_drafter, save_drafter


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_model(str(tiny_model_dir)).model


def _counts(t):
    return torch.arange(t.cfg.vocab_size, dtype=torch.float64)


def _perturbed(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # frozen copies of the target's (embeddings, EAGLE-1's head) stay its own
                p.add_(torch.randn_like(p) * 0.05)
    return model


def _save(root, name, model, kind, tiny_model_dir):
    return save_drafter(root / name / "checkpoints" / "final", model, kind, {"target": str(tiny_model_dir), "step": 3})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, target, tiny_model_dir):
    root = tmp_path_factory.mktemp("fmt-ckpts")
    models = {
        "draft_lm_vocab": (
            "draft_lm",
            build_draft_lm({"n_layers": 1, "draft_vocab": 120}, target, _counts(target), eos_ids={2}),
        ),
        "mlp": ("mlp_speculator", build_mlp_speculator({"n_predict": 3}, target)),
        "mlp_vocab": (
            "mlp_speculator",
            build_mlp_speculator({"n_predict": 2, "draft_vocab": 100}, target, _counts(target)),
        ),
        "eagle1": ("eagle", build_eagle({"version": 1}, target)),
        "eagle1_vocab": (
            "eagle",
            build_eagle({"version": 1, "draft_vocab": 120}, target, _counts(target), eos_ids={2}),
        ),
        "eagle1_deep": ("eagle", build_eagle({"version": 1, "n_layers": 2, "init_layers": [1]}, target)),
        "eagle1_no_fc_bias": ("eagle", build_eagle({"version": 1, "fc_bias": False}, target)),
    }
    out = {}
    for i, (name, (kind, model)) in enumerate(models.items()):
        model = _perturbed(model, 10 + i)
        out[name] = _save(root, name, model, kind, tiny_model_dir)
    m, _ = load_drafter(out["eagle1"])
    with torch.no_grad():
        m.fc.bias.zero_()  # vLLM's EAGLE-1 fc has no bias: only such a drafter exports there
    out["eagle1_nobias"] = _save(root, "eagle1_nobias", m, "eagle", tiny_model_dir)
    return out


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _decode(target, drafter, seed=5):
    """Greedy output, tau and acceptance counts of draftsmith's decoder with ``drafter``."""
    prompt = torch.randint(3, 300, (10,), generator=torch.Generator().manual_seed(seed))
    out, stats = speculative_generate(target, drafter, prompt, 24, draft_len=3)
    return out, stats.tau, stats.accept_counts


def test_new_formats_are_cli_choices():
    from draftsmith.cli import build_parser

    assert "mlp-speculator" in FORMATS
    sub = next(a for a in build_parser()._actions if getattr(a, "choices", None) and "export" in a.choices)
    fmt = next(a for a in sub.choices["export"]._actions if a.dest == "format")
    assert set(fmt.choices) == set(FORMATS)


# ---- 7. reduced-vocabulary draft LM as a plain LlamaForCausalLM --------------------------------------------------


@pytest.mark.parametrize("fmt", ["hf", "vllm"])
def test_reduced_vocab_draft_lm_loads_in_transformers_and_assists_generate(
    ckpts, target, tiny_model_dir, tmp_path, fmt
):
    from transformers import AutoModelForCausalLM

    ckpt = ckpts["draft_lm_vocab"]
    ours, _ = load_drafter(ckpt)
    keep = ours.lm_head.target_ids
    out = export(ckpt, fmt, tmp_path / fmt)
    hf, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert hf.lm_head.weight.shape == (target.cfg.vocab_size, target.cfg.dim)
    hf.eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ids = torch.randint(3, 300, (16, 24), generator=g)
        a, b = hf(ids).logits.argmax(-1), ours(ids).argmax(-1)  # ours: target ids (-inf outside the kept rows)
        assert torch.equal(a, b)  # the same greedy draft at every position
        assert bool(torch.isin(a, keep).all())
        # Dropped ids against the head on 20k random hidden states (the final norm's output on its sphere).
        h = F.normalize(torch.randn(20000, target.cfg.dim, generator=g), dim=-1) * math.sqrt(target.cfg.dim)
        top = (h * hf.model.norm.weight) @ hf.lm_head.weight.T
        assert bool(torch.isin(top.argmax(-1), keep).all())

    tgt = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    for seed in range(3):
        prompt = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(seed))
        kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
        alone = tgt.generate(prompt, **kw)
        assisted = tgt.generate(prompt, assistant_model=hf, **kw)
        assert torch.equal(alone, assisted)
        drafts = hf.generate(prompt, **kw)[0, 8:].tolist()  # the draft's own greedy continuation
        seq = prompt[0].tolist()
        with torch.no_grad():
            for _ in range(20):
                seq.append(int(ours(torch.tensor([seq]))[0, -1].argmax()))
        assert drafts == seq[8:]

    back, binfo = load_export(out, target)
    assert binfo["export_format"] == fmt and _same_weights(ours, back)
    assert _decode(target, ours) == _decode(target, back)


# ---- 8a. MLP speculator in IBM's layout ---------------------------------------------------------------------------


def _ibm_speculator(folder):
    """IBM's MLP speculator forward, restated from fms-extras (fms_extras/models/speculator.py) and vLLM's copy:
    per stage i, state = proj_i(state) + emb_i(token) * (emb_weight / state_weight), then an L2-style norm (no mean
    subtraction, eps 1e-6, learned scale and shift) and GELU; head_i(state) scores the next token. Reads only the
    exported config.json and safetensors."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {k.removeprefix("speculator."): v for k, v in load_file(str(folder / "model.safetensors")).items()}
    n, inner = cfg["n_predict"], cfg["inner_dim"] or cfg["emb_dim"]
    sw = 0.5 ** (0.5 / n)
    ew = math.sqrt((1 - sw**2) * (inner / 2))

    def norm(x, i):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w[f"ln.{i}.weight"] * x + w[f"ln.{i}.bias"]

    def run(h, tokens):  # h (B, emb_dim), tokens: [(B,)] * k -> logits of stage k-1
        state = h
        for i, tok in enumerate(tokens):
            z = w[f"emb.{i}.weight"][tok]
            state = F.gelu(norm(state @ w[f"proj.{i}.weight"].T + z * (ew / sw), i))
        return state @ w[f"head.{len(tokens) - 1}.weight"].T

    return cfg, w, run


def test_mlp_speculator_layout_matches_ibms_forward(ckpts, target, tmp_path):
    ckpt = ckpts["mlp"]
    ours, _ = load_drafter(ckpt)
    out = export(ckpt, "mlp-speculator", tmp_path / "m")
    cfg, w, ibm = _ibm_speculator(out)
    assert cfg["model_type"] == "mlp_speculator" and cfg["architectures"] == ["MLPSpeculatorPreTrainedModel"]
    assert (cfg["emb_dim"], cfg["inner_dim"], cfg["n_predict"], cfg["vocab_size"]) == (64, 64, 3, 300)
    assert cfg["tie_weights"] is False and cfg["scale_input"] is False and "base_model_name_or_path" in cfg
    assert len(cfg["top_k_tokens_per_head"]) == cfg["n_predict"] and cfg["n_candidates"] >= 1
    want = {f"{m}.{i}.weight" for m in ("emb", "proj", "head", "ln") for i in range(3)} | {
        f"ln.{i}.bias" for i in range(3)
    }
    assert set(w) == want  # TGI reads speculator.{emb,proj,head,ln}.{i}.*; vLLM strips "speculator."
    g = torch.Generator().manual_seed(1)
    h = F.normalize(torch.randn(32, 64, generator=g), dim=-1) * 8  # the target's final (normed) hidden states
    toks = [torch.randint(0, 300, (32,), generator=g) for _ in range(3)]
    with torch.no_grad():
        for k in range(1, 4):
            theirs = ibm(h, toks[:k])
            mine = ours.draft_step(h, toks[:k])[0]
            torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-4)
            assert torch.equal(theirs.argmax(-1), mine.argmax(-1))
    back, _ = load_export(out, target)
    assert _decode(target, ours) == _decode(target, back)


def test_mlp_speculator_layout_refuses_reduced_vocabulary_heads(ckpts, tmp_path):
    with pytest.raises(DraftsmithError, match="keep 100 of 300 tokens.*--format hf"):
        export(ckpts["mlp_vocab"], "mlp-speculator", tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_mlp_speculator_layout_is_only_for_mlp_speculators(ckpts, tmp_path):
    with pytest.raises(DraftsmithError, match="mlp-speculator: drafter.kind eagle exports as hf, vllm, sglang"):
        export(ckpts["eagle1"], "mlp-speculator", tmp_path / "m")


# ---- 8b. EAGLE-1 for vLLM and SGLang ------------------------------------------------------------------------------


def _eagle1_engine_keys(cfg: dict, fc_bias: bool) -> dict[str, tuple[int, ...]]:
    """The parameters vLLM's EagleLlamaForCausalLM / SGLang's LlamaForCausalLMEagle build from config.json (and so
    load by name): fc (2d -> d; SGLang's with a bias, vLLM's without), then num_hidden_layers Llama layers of which
    layer 0 has no input norm; no final norm; the embeddings and LM head come from the target."""
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, ff = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    keys = {"fc.weight": (d, 2 * d)} | ({"fc.bias": (d,)} if fc_bias else {})
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        keys |= {
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (ff, d),
            p + "mlp.up_proj.weight": (ff, d),
            p + "mlp.down_proj.weight": (d, ff),
        }
        if i > 0:
            keys[p + "input_layernorm.weight"] = (d,)
    return keys


def _engine_eagle1_logits(folder, target, feats, ids):
    """The engines' EAGLE-1 step restated with transformers' Llama layer: x = fc([embed(ids), feats]), the layer
    with an identity input norm, then the target's LM head on the output (no final norm)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    hc = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "draftsmith")})
    hc._attn_implementation = "eager"
    x = F.linear(torch.cat([target.embed_tokens.weight[ids], feats], -1), w["fc.weight"], w.get("fc.bias"))
    T = ids.shape[1]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    pos = torch.arange(T)[None]
    rope = LlamaRotaryEmbedding(hc)(x, pos)
    for i in range(cfg["num_hidden_layers"]):
        layer = LlamaDecoderLayer(hc, i)
        if i == 0:
            layer.input_layernorm = torch.nn.Identity()
        sd = {k.removeprefix(f"layers.{i}."): v for k, v in w.items() if k.startswith(f"layers.{i}.")}
        assert not layer.load_state_dict(sd, strict=False).unexpected_keys
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        x = x[0] if isinstance(x, tuple) else x
    return x @ target.lm_head.weight.T


@pytest.mark.parametrize(
    "name,fmt",
    [
        ("eagle1", "sglang"),
        ("eagle1_deep", "sglang"),
        ("eagle1_nobias", "vllm"),
        ("eagle1_no_fc_bias", "vllm"),
        ("eagle1_no_fc_bias", "sglang"),
    ],
)
def test_eagle1_engine_layout_and_forward(ckpts, target, tmp_path, name, fmt):
    ours, _ = load_drafter(ckpts[name])
    out = export(ckpts[name], fmt, tmp_path / fmt)
    cfg = json.loads((out / "config.json").read_text())
    # vLLM prefixes Eagle (LlamaForCausalLM -> EagleLlamaForCausalLM) and refuses LlamaForCausalLMEagle; SGLang
    # registers that name as is. tests/test_vllm.py serves the vllm folder in vLLM itself.
    arch = "LlamaForCausalLM" if fmt == "vllm" else "LlamaForCausalLMEagle"
    assert cfg["architectures"] == [arch] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == ours.cfg.n_layers and cfg["vocab_size"] == 300
    t = load_file(str(out / "model.safetensors"))
    # SGLang overrides a draft's embeddings with the target's (written by default); vLLM's are never written
    assert ("embed_tokens.weight" in t) == (fmt == "sglang")
    shapes = {k: tuple(v.shape) for k, v in t.items() if k != "embed_tokens.weight"}
    assert shapes == _eagle1_engine_keys(cfg, fc_bias=fmt == "sglang")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 300, (2, 12), generator=g)
    feats = F.normalize(torch.randn(2, 12, 64, generator=g), dim=-1) * 8
    with torch.no_grad():
        theirs = _engine_eagle1_logits(out, target, feats, ids)
        mine = ours.step(feats, ids)[0]
    torch.testing.assert_close(theirs, mine, rtol=1e-4, atol=1e-4)
    back, info = load_export(out, target)
    assert info["export_format"] == fmt and _same_weights(ours, back)
    assert _decode(target, ours) == _decode(target, back)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_eagle1_reduced_vocabulary_is_refused_by_the_engine_layouts(ckpts, tmp_path, fmt):
    """vLLM's EAGLE-1 cannot slice the target's head; SGLang slices it only by a pickled hot-token map
    (``--speculative-token-map``, read with torch.load), and draftsmith writes no pickles."""
    with pytest.raises(DraftsmithError, match=rf"{fmt}: .*keeps 120 of 300 tokens.*draft_vocab=null"):
        export(ckpts["eagle1_vocab"], fmt, tmp_path / fmt)
    assert not (tmp_path / fmt).exists()


def test_vllm_refuses_what_its_eagle1_cannot_hold(ckpts, tmp_path):
    with pytest.raises(DraftsmithError, match=r"vllm: .*fc has no bias.*fc\.bias.*fc_bias=false"):
        export(ckpts["eagle1"], "vllm", tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_vllm_eagle1_card_and_no_embeddings(ckpts, tmp_path):
    out = export(ckpts["eagle1_nobias"], "vllm", tmp_path / "v", include_embeddings=True)
    # vLLM skips a draft's embed_tokens (it shares the target's) yet would mark them as its own: never written
    assert "embed_tokens.weight" not in load_file(str(out / "model.safetensors"))
    card = (out / "README.md").read_text()
    assert '"method": "eagle"' in card and '"model": "./this-folder"' in card


def test_recipes_accept_the_new_formats():
    from draftsmith.recipes.loader import load_recipe

    r = load_recipe("eagle1-smollm2", ["drafter.n_layers=2", "export.formats=[hf,sglang]"])  # EAGLE-1 depth: fine
    assert r.export.formats == ["hf", "sglang"]
    r = load_recipe("mlp-speculator-smollm2", ["drafter.draft_vocab=null", "export.formats=[hf,mlp-speculator]"])
    assert r.export.formats == ["hf", "mlp-speculator"]
    with pytest.raises(DraftsmithError, match="mlp-speculator, but drafter.draft_vocab"):
        load_recipe("mlp-speculator-smollm2", ["export.formats=[mlp-speculator]"])  # its 8,192-row heads
    with pytest.raises(DraftsmithError, match="one-layer EAGLE-3"):
        load_recipe("eagle3-smollm2", ["drafter.n_layers=2", "export.formats=[sglang]"])
