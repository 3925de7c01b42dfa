"""Sliding-window attention on the own model, and tree attention on the transformers path, in float64 on tiny random
configs built here. Own model vs transformers for Mistral (a window over every layer, shorter than the sequence)
and Qwen2/Qwen3 (``use_sliding_window`` from ``max_window_layers``): full forward, prefill + token-by-token decode,
chain and static-tree speculative decoding and the batched decoder (B = 3, ragged prompts) equal transformers' greedy
``generate`` beyond the window. A config field the own model would ignore is a one-line error naming it, and
``target.backend: auto`` then loads the transformers path. Trees on the transformers path: static and dynamic trees
give the own model's tokens and accept counts on a tiny Llama, and transformers' greedy tokens on Gemma-2 (sliding
window, both soft-caps) and Phi-3 (sliding window)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from conftest import noisy_copy, vllm_format
from test_hf_pipeline import KINDS, _recipe

from draftsmith.errors import DraftsmithError
from draftsmith.eval.batch_decoder import speculative_generate_batch
from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.eval.tree import DynamicTree, tree_from_choices
from draftsmith.eval.tree_decoder import tree_speculative_generate
from draftsmith.models.llama import Llama
from draftsmith.models.loading import config_from_hf, load_llama_dir, load_model
from draftsmith.models.tiny import save_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

V, NEW = 64, 24
WINDOWED = {  # family -> (transformers class prefix, config fields): windows far shorter than prompt + answer
    "mistral": ("Mistral", dict(sliding_window=5)),
    "qwen2": ("Qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": ("Qwen3", dict(use_sliding_window=True, sliding_window=6, max_window_layers=2, head_dim=16)),
}
CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


def _save(path, name: str, fields: dict, tok=None, scale: float = 6.0, **extra):
    """A random ``name``ForCausalLM saved to ``path``; weights scaled up so that every token sees a difference."""
    import transformers

    torch.manual_seed(0)
    cfg = dict(
        vocab_size=len(tok) if tok is not None else V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    cfg.update(fields, **extra)
    hf = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**cfg))
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(scale)
    hf.save_pretrained(path, safe_serialization=True)
    if tok is not None:
        tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(WINDOWED))
def pair(request, tmp_path_factory):
    """(own model, transformers model) of one windowed family, float64."""
    from transformers import AutoModelForCausalLM

    name, fields = WINDOWED[request.param]
    path = _save(tmp_path_factory.mktemp(request.param), name, fields)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    return load_llama_dir(path, torch.float64), hf


def _atol(hf) -> float:
    """Qwen3's q/k RMS norms run in float32 on both sides (about 3e-7 apart with or without a window)."""
    return 1e-5 if hf.config.model_type == "qwen3" else 1e-9


def _prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, V, (n,), generator=g) for n in (3, 11, 7)]


def _greedy(hf, prompt: torch.Tensor, n: int = NEW) -> list[int]:
    """transformers' greedy ``generate`` (up to and including an EOS, as the decoders given ``_eos(hf)``)."""
    with torch.no_grad():
        out = hf.generate(prompt[None], max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _eos(hf) -> set[int]:
    eos = hf.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def test_config_reads_the_window_as_transformers_does(pair):
    own, hf = pair
    c = own.cfg
    assert c.sliding_window == hf.config.sliding_window
    kinds = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * c.n_layers
    assert [c.windowed(i) for i in range(c.n_layers)] == [k == "sliding_attention" for k in kinds]
    off = config_from_hf({**hf.config.to_dict(), "use_sliding_window": False, "layer_types": None})
    assert off.sliding_window == (c.sliding_window if hf.config.model_type == "mistral" else None)  # Qwen: off
    assert config_from_hf({**hf.config.to_dict(), "sliding_window": None}).sliding_window is None


def test_full_forward_equals_transformers(pair):
    own, hf = pair
    ids = torch.randint(1, V, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(own(ids), want, rtol=1e-7, atol=_atol(hf))
        full = Llama(replace(own.cfg, sliding_window=None)).double()
        full.load_state_dict(own.state_dict())
        assert (full(ids) - want)[:, -1].abs().max() > 1e-3  # the window matters here


def test_prefill_then_decode_equals_transformers(pair):
    own, hf = pair
    ids = torch.randint(1, V, (1, 22), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids).logits[0]
        cache = own.new_cache(1, 32)
        got = [own(ids[:, :7], cache=cache)[0]]
        got += [own(ids[:, t : t + 1], cache=cache)[0] for t in range(7, 22)]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-7, atol=_atol(hf))


def test_chain_and_tree_decoding_equal_transformers_greedy(pair):
    own, hf = pair
    drafter = noisy_copy(own, scale=0.1)
    fused = copy.deepcopy(own).optimize_for_inference()  # fused q/k/v and gate/up: the decoder's fast path
    for prompt in _prompts():
        ref = _greedy(hf, prompt)
        assert autoregressive_generate(own, prompt, NEW) == ref
        assert autoregressive_generate(fused, prompt, NEW) == ref
        out, st = speculative_generate(own, drafter, prompt, NEW, draft_len=3)
        assert out == ref
        assert 0 < st.accepted  # the drafter is close enough to be accepted sometimes
        out, _ = speculative_generate(own, own, prompt, NEW, draft_len=4)  # every draft accepted
        assert out == ref
        out, st = tree_speculative_generate(own, drafter, prompt, NEW, tree_from_choices(CHOICES))
        assert out == ref


def test_batched_rows_with_holes_equal_transformers_greedy(pair):
    """B = 3 ragged prompts: left padding, ragged accepts (holes) and compaction; the window follows each row's
    positions, not the slots."""
    own, hf = pair
    prompts = _prompts()
    refs = [_greedy(hf, p) for p in prompts]
    drafter = noisy_copy(own, scale=0.1)
    assert speculative_generate_batch(own, None, prompts, NEW)[0] == refs
    assert speculative_generate_batch(own, drafter, prompts, NEW, draft_len=3, max_len=45)[0] == refs
    assert speculative_generate_batch(own, drafter, prompts, NEW, tree=tree_from_choices(CHOICES))[0] == refs


# ---- configs the own model would compute wrongly: refused by name, run through transformers on auto -----------


LLAMA = dict(model_type="llama", vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64)  # fmt: skip


@pytest.mark.parametrize(
    "fields, key",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_parameters"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 4,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            "layer_types",
        ),
    ],
)
def test_config_fields_the_own_model_cannot_honour_are_named(fields, key):
    with pytest.raises(DraftsmithError, match=key) as e:
        config_from_hf({**LLAMA, **fields})
    assert "\n" not in str(e.value)


def test_auto_backend_falls_back_to_transformers(tmp_path, tiny_tokenizer):
    path = save_tiny_llama(tmp_path / "m", tiny_tokenizer, mlp_bias=True)
    with pytest.raises(DraftsmithError, match="mlp_bias"):
        load_model(str(path), torch.float64, backend="own")
    loaded = load_model(str(path), torch.float64, backend="auto")
    assert loaded.backend == "transformers"
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids), loaded.model.hf(ids).logits)


# ---- trees on the transformers path --------------------------------------------------------------------------


def test_trees_on_the_transformers_path_equal_the_own_model(tmp_path, tiny_tokenizer):
    path = save_tiny_llama(tmp_path / "llama", tiny_tokenizer, seed=3)
    own = load_model(str(path), torch.float64, backend="own").model
    hft = load_model(str(path), torch.float64, backend="transformers").model
    drafter = noisy_copy(own, scale=0.1)
    for prompt in (torch.tensor([5, 9, 14, 3]), torch.tensor(list(range(20, 40)))):
        ref, eos = _greedy(hft.hf, prompt), _eos(hft.hf)
        for tree in (tree_from_choices(CHOICES), DynamicTree(top_k=3, depth=3, total_tokens=8)):
            a, sa = tree_speculative_generate(own, drafter, prompt, NEW, tree, eos_ids=eos)
            b, sb = tree_speculative_generate(hft, drafter, prompt, NEW, tree, eos_ids=eos)
            assert a == b == ref
            assert sa.accept_counts == sb.accept_counts
            assert sa.accepted > 0


OTHER = {  # transformers-only families: Gemma-2 with a window shorter than the prompts and both soft-caps; Phi-3
    "gemma2": (
        "Gemma2",
        dict(
            head_dim=8,
            sliding_window=6,
            query_pre_attn_scalar=8,
            final_logit_softcapping=3.0,
            attn_logit_softcapping=5.0,
        ),
    ),
    "phi3": ("Phi3", dict(sliding_window=6)),
}


@pytest.mark.parametrize("family", list(OTHER))
def test_trees_on_other_architectures_equal_transformers_greedy(tmp_path, tiny_tokenizer, family):
    name, fields = OTHER[family]
    path = _save(tmp_path / family, name, fields, tok=tiny_tokenizer, scale=4.0)
    loaded = load_model(str(path), torch.float64, backend="auto")
    assert loaded.backend == "transformers"
    tgt = loaded.model
    oracle = load_model(str(path), torch.float64, backend="transformers").model  # drafts the target's own tokens
    for prompt in (torch.tensor([5, 9, 14, 3, 7, 8, 30, 41, 2, 6]), torch.tensor([11, 12])):
        ref = _greedy(tgt.hf, prompt)
        for tree in (tree_from_choices(CHOICES), DynamicTree(top_k=2, depth=3, total_tokens=6)):
            out, st = tree_speculative_generate(tgt, oracle, prompt, NEW, tree, eos_ids=_eos(tgt.hf))
            assert out == ref
            assert st.accepted > 0


def test_transformers_path_refuses_trees_without_a_4d_mask(tmp_path, tiny_tokenizer):
    path = save_tiny_llama(tmp_path / "llama", tiny_tokenizer)
    hft = load_model(str(path), torch.float64, backend="transformers").model
    hft._mask_how = "none"  # as for a model whose attention builds its own mask from a 2-D one
    with pytest.raises(DraftsmithError, match="4-D mask"):
        hft(torch.tensor([[1, 2, 3]]), cache=hft.new_cache(1, 8), attn_mask=torch.ones(1, 3, 3, dtype=torch.bool))


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_windowed_families_run_the_whole_pipeline(tmp_path, tiny_tokenizer, prompts_file, family, kind):
    """Mistral and Qwen2 with windows far shorter than prompt + answer, on the own model: generate -> train -> eval
    (chain and a static tree, lossless) -> export hf (and vLLM's layout); every export decodes, chain and tree, to
    transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    from draftsmith.cli import main
    from draftsmith.eval.decoder import speculative_generate
    from draftsmith.eval.tree import TreeSpec
    from draftsmith.export.writer import load_export
    from draftsmith.models.loading import encode_chat, stop_ids
    from draftsmith.models.registry import load_drafter

    name, fields = WINDOWED[family]
    path = _save(
        tmp_path / family, name, fields, tok=tiny_tokenizer, scale=4.0, eos_token_id=tiny_tokenizer.eos_token_id
    )
    drafter, extra = KINDS[kind]
    if family == "qwen2" and drafter.get("init_layers"):  # q/k/v biases: Llama layers cannot take the target's
        drafter = {**drafter, "init_layers": None}
    formats = ["hf", *([f] if (f := vllm_format(kind)) else [])]  # and the layout vLLM's method reads
    out = tmp_path / "run"
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
    assert main(["run", _recipe(tmp_path, kind, drafter), *args]) == 0
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["target_path"] == "own" and report["lossless_match"] == 1.0
    tgt = load_model(str(path), torch.float64, backend="auto")
    assert tgt.backend == "own" and tgt.model.cfg.sliding_window == fields["sliding_window"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    eos = stop_ids(path, tiny_tokenizer)
    ckpt, _ = load_drafter(out / "checkpoints" / "final", dtype=torch.float64)
    drafters = [ckpt, *(load_export(out / "export" / f, dtype=torch.float64)[0] for f in formats)]
    tree = TreeSpec((-1, -1, 0, 0, 2), (0, 1, 0, 1, 0))
    for q in ("Tell me about foxes.", "Write a short poem about the sea and the stars."):
        x = torch.tensor(encode_chat(tiny_tokenizer, [{"role": "user", "content": q}]))
        assert x.numel() > fields["sliding_window"]
        ref = _greedy(hf, x, 12)
        for d in drafters:
            for t in (None, tree):
                got, _ = speculative_generate(tgt.model, d, x, 12, draft_len=3, eos_ids=eos, tree=t)
                assert got == ref[: len(got)] and len(got) == len(ref), (kind, t)
