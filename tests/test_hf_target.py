"""The transformers target path (models/hf_target.py) for data generation and teacher-forced scoring.

The same tiny random Llama loaded as the own model and through transformers gives the same records: greedy and
sampled tokens, top-k ids and log-probs, hidden_last and the EAGLE-3 layers, at batch 1 and 4 with ragged,
multi-turn prompts, written by the target or taken from the dataset and scored. Other architectures (Gemma-2 with
a sliding window and soft-capping, Phi-3, Mixtral) generate records whose greedy tokens equal HF ``generate`` and
whose signals equal HF's own forward. float64 throughout, so rounding cannot flip an argmax between the paths.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import save_tiny_llama, shard_tensors

from draftsmith.cli import main
from draftsmith.data.engine import Capture, Sampling, decode_batch, score_batch, write_batch
from draftsmith.data.records import load_shard, read_manifest
from draftsmith.errors import DraftsmithError
from draftsmith.models.loading import encode_chat, load_model, stop_ids
from draftsmith.models.sampling import row_generator

CHATS = [  # ragged first turns, one to three user turns each
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about foxes and the lazy dog."},
            {"role": "assistant", "content": "Foxes are quick."},
            {"role": "user", "content": "And dogs?"},
            {"role": "assistant", "content": "Dogs are lazy."},
        ]
    },
    {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]},
    {
        "conversations": [
            {"from": "human", "value": "Write a short poem about the sea and the stars at night, please."},
            {"from": "gpt", "value": "The sea and the stars."},
            {"from": "human", "value": "Shorter."},
            {"from": "gpt", "value": "Sea."},
            {"from": "human", "value": "Thanks."},
            {"from": "gpt", "value": "You are welcome."},
        ]
    },
    {"messages": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"}]},
    {
        "messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ]
    },
]


QUESTIONS = ["Hi.", "Tell me about foxes.", "def add(a, b):", "Write a short poem about the sea and the stars."]


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory, tiny_tokenizer):
    """A 4-layer tiny Llama: EAGLE-3's default layers are (0, 1, 2), and layer 3's output is the final state."""
    return save_tiny_llama(tmp_path_factory.mktemp("llama4"), tiny_tokenizer, seed=3, num_hidden_layers=4)


@pytest.fixture(scope="module")
def chats_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("hft-chats") / "chats.jsonl"
    p.write_text("\n".join(json.dumps(c) for c in CHATS) + "\n")
    return p


def _assert_same(a: torch.Tensor, b: torch.Tensor, tol: float, what) -> None:
    if a.dtype.is_floating_point:
        torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, b), what


# ---- the engine's calls, own model vs transformers -------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("batch", [1, 4])
def test_engine_signals_equal_the_own_model(llama4_dir, batch, temperature, caplog):
    """decode_batch (left-padded prefill with padding masks, per-step decode, top-k, hidden_last, captured layers
    including the final pre-norm state) and score_batch (teacher-forced, right-padded, no cache) give the same
    tokens and signals on the own model and the transformers path; the load says which path it took."""
    own = load_model(str(llama4_dir), torch.float64)
    with caplog.at_level(logging.INFO, logger="draftsmith.models"):
        hft = load_model(str(llama4_dir), torch.float64, backend="transformers")
    assert own.backend == "own" and hft.backend == "transformers"
    assert type(hft.model).__name__ == "HFTarget" and hft.model.cfg.n_layers == 4
    assert any("transformers" in r.getMessage() for r in caplog.records)
    tok, eos = own.tokenizer, stop_ids(own.path, own.tokenizer)
    contexts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(c) for c in contexts}) == 4  # ragged: left padding in every batch of 4
    cap = Capture(topk=8, hidden_last=True, aux_layers=(0, 1, 3))
    sampling = Sampling(temperature)
    groups = [contexts] if batch == 4 else [[c] for c in contexts]
    for group in groups:
        outs = []
        for m in (own.model, hft.model):
            gens = [row_generator("cpu", 0, i, 0) for i in range(len(group))]
            outs.append(decode_batch(m, group, 12, eos, sampling, gens, cap))
        for a, b in zip(*outs):
            assert a.tokens == b.tokens and len(a.tokens) > 0
            assert a.loss_signals.keys() == b.loss_signals.keys() == {"topk_ids", "topk_logprobs"}
            assert a.hidden.keys() == b.hidden.keys() == {"hidden_last", "hidden_aux"}
            # float32 rounding: log-probs are float32 whatever the model dtype (engine._topk_rows), and both
            # paths' RMSNorms normalise in float32
            for k in a.loss_signals:
                _assert_same(a.loss_signals[k], b.loss_signals[k], 1e-6, k)
            for k in a.hidden:
                _assert_same(a.hidden[k], b.hidden[k], 1e-6, k)
        seqs = [c + g.tokens for c, g in zip(group, outs[0])]
        masks = [[0] * len(c) + [1] * len(g.tokens) for c, g in zip(group, outs[0])]
        sa, sb = (score_batch(m, seqs, masks, cap) for m in (own.model, hft.model))
        for a, b, g in zip(sa, sb, outs[0]):
            for k in a.loss_signals:
                _assert_same(a.loss_signals[k], b.loss_signals[k], 1e-6, k)
            for k in a.hidden:
                _assert_same(a.hidden[k], b.hidden[k], 1e-6, k)
            if temperature == 0:  # teacher-forced top-1 is the greedy token
                assert a.loss_signals["topk_ids"][:, 0].tolist() == g.tokens


@pytest.mark.parametrize("kind", ["eagle3", "hydra++"])
def test_drafter_written_responses_equal_the_own_model(llama4_dir, kind):
    """On-policy writing by a drafter that reads the target's states (EAGLE-3's captured layers, Hydra++'s final
    state through its prefix layer), the target one step behind: the same responses on both paths, batch 4."""
    from conftest import tiny_eagle, tiny_heads

    own = load_model(str(llama4_dir), torch.float64)
    hft = load_model(str(llama4_dir), torch.float64, backend="transformers")
    torch.manual_seed(0)
    drafter = tiny_eagle(3, own.model, 0.2) if kind == "eagle3" else tiny_heads(kind, own.model, 3, 0.2).double()
    contexts = [encode_chat(own.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    eos = stop_ids(own.path, own.tokenizer)
    a, b = (write_batch(m, drafter, contexts, 12, eos, Sampling(), [None] * 4) for m in (own.model, hft.model))
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert all(len(g.tokens) > 0 for g in a)


def test_transformers_path_refuses_what_it_does_not_do(llama4_dir):
    """An index outside 0..n_layers is an error; the own backend names the key that routes an architecture it does
    not implement through transformers (tree masks: tests/test_window_trees.py)."""
    hft = load_model(str(llama4_dir), torch.float64, backend="transformers").model
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="capture_layers"):
        hft(ids, capture_layers=(5,))
    with pytest.raises(DraftsmithError, match="target.backend"):
        load_model(str(llama4_dir), torch.float64, backend="bogus")


# ---- `draftsmith generate` records, own model vs transformers ----------------------------------------------------


def _generate(tmp_path, name: str, model_dir, prompts, *extra: str):
    args = [
        "generate",
        "tiny",
        f"target.model={model_dir}",
        f"data.prompts.path={prompts}",
        f"out_dir={tmp_path / name}",
        "target.dtype=float64",
        "data.max_prompt_tokens=256",
        "data.signals.hidden_last=true",
        "data.signals.hidden_layers=eagle3",
        "data.signals.hidden_dtype=float16",
        "-q",
        *extra,
    ]
    assert main(args) == 0
    return tmp_path / name / "data"


@pytest.mark.parametrize("responses", ["target", "dataset"])
def test_generate_records_equal_the_own_model(tmp_path, llama4_dir, chats_file, responses):
    """`draftsmith generate` through transformers (target.backend=transformers on a Llama) writes the records the
    own model writes, at batch 1 and 4, multi-turn; the manifest, the shards and the log say which path ran and
    the data hash does not depend on it."""
    runs = {}
    for backend in ("own", "transformers"):
        for bs in (1, 4):
            runs[backend, bs] = _generate(
                tmp_path,
                f"{backend}-{bs}",
                llama4_dir,
                chats_file,
                f"target.backend={backend}",
                f"data.batch_size={bs}",
                f"data.responses={responses}",
                "data.prompts.max_turns=null",
            )
    ref = shard_tensors(runs["own", 1])
    names = set(next(iter(ref.values())))
    assert {"topk_ids", "topk_logprobs", "hidden_last", "hidden_aux"} <= names
    for (backend, bs), d in runs.items():
        got = shard_tensors(d)
        assert got.keys() == ref.keys()
        for shard, tensors in ref.items():
            assert got[shard].keys() == tensors.keys()
            for k, v in tensors.items():
                _assert_same(v, got[shard][k], 2e-3, (backend, bs, shard, k))
        m = read_manifest(d)
        assert m["target_path"] == backend and m["data_hash"] == read_manifest(runs["own", 1])["data_hash"]
        assert m["signals"]["hidden_aux"]["layers"] == [0, 1, 2]
        done = [json.loads(x) for x in (d.parent / "metrics.jsonl").read_text().splitlines()]
        assert [r["target_path"] for r in done if r.get("done")] == [backend]
    turns = [  # response segments per record: multi-turn conversations really ran
        int(torch.as_tensor(r.loss_mask).long().diff().eq(1).sum())
        for p in runs["own", 1].glob("shard-*")
        for r in map(load_shard(p).record, range(len(load_shard(p))))
    ]
    assert max(turns) == 3 and len(turns) == len(CHATS)


# ---- other architectures --------------------------------------------------------------------------------------

ARCHS = {  # tiny random configs; Gemma-2 with a window shorter than the prompts and both soft-caps on
    "gemma2": dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=16, final_logit_softcapping=3.0, attn_logit_softcapping=5.0
    ),
    "phi3": dict(),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(  # attention sinks, alternating sliding-window layers, MoE
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16),
    "deepseek_v3": dict(  # multi-head latent attention (no grouped K/V heads), shared + routed experts
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    ),
    "gemma3": dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16),  # scaled embeddings, local + global
    "glm4": dict(head_dim=16),
    "olmo2": dict(),  # norms after attention and MLP, q/k norms
    "granite": dict(embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5),
    "cohere": dict(logit_scale=0.5),  # parallel attention + MLP, LayerNorm
}
CLASSES = {
    "gemma2": "Gemma2", "phi3": "Phi3", "mixtral": "Mixtral", "gpt_oss": "GptOss", "qwen3_moe": "Qwen3Moe",
    "gemma3": "Gemma3", "deepseek_v3": "DeepseekV3", "glm4": "Glm4", "olmo2": "Olmo2", "granite": "Granite",
    "cohere": "Cohere",
}  # fmt: skip
CONFIGS = {"gemma3": "Gemma3TextConfig"}  # Gemma3Config is the multimodal one
MOE = {"mixtral", "gpt_oss", "qwen3_moe", "deepseek_v3"}
SEEDS = {"qwen3_moe": 2}  # seed 0 gives a tiny Qwen3-MoE that writes EOS first


def _save_arch(path, tok, family: str):
    import transformers

    torch.manual_seed(SEEDS.get(family, 0))
    cfg = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
    )
    cfg.update(ARCHS[family])
    name = CLASSES[family]
    config = getattr(transformers, CONFIGS.get(family, f"{name}Config"))(**cfg)
    hf = getattr(transformers, f"{name}ForCausalLM")(config)
    with torch.no_grad():  # random weights big enough that the soft-caps and the MoE routing matter
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    hf.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("family", list(ARCHS))
def test_other_architectures_generate_records(tmp_path, tiny_tokenizer, prompts_file, family):
    """A Gemma-2 / Phi-3 / Mixtral target (target.backend auto) generates records: one per usable prompt, the
    greedy response HF `generate` gives, top-k log-probs of HF's own logits (soft-capped where the model caps) and
    hidden states equal to HF's final-norm output and layer outputs."""
    from transformers import AutoModelForCausalLM

    path = _save_arch(tmp_path / family, tiny_tokenizer, family)
    d = _generate(tmp_path, "run", path, prompts_file)
    m = read_manifest(d)
    assert m["target_path"] == "transformers" and m["n_sequences"] == 8
    moe = {"experts_implementation": "eager"} if family in MOE else {}  # grouped_mm has no float64 kernel
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64, **moe).eval()
    eos = stop_ids(path, tiny_tokenizer)
    n = 0
    for p in sorted(d.glob("shard-*.safetensors")):
        shard = load_shard(p)
        for i in range(len(shard)):
            r = shard.record(i)
            ids, mask = torch.as_tensor(r.input_ids).long(), torch.as_tensor(r.loss_mask).bool()
            start = int(mask.nonzero()[0])
            resp = ids[start:].tolist()
            assert mask[start:].all() and 0 < len(resp) <= 16
            with torch.no_grad():
                ref = hf.generate(
                    ids[None, :start], max_new_tokens=16, do_sample=False, pad_token_id=tiny_tokenizer.pad_token_id
                )[0, start:].tolist()
                out = hf(ids[None], output_hidden_states=True)
            k = next((j + 1 for j, t in enumerate(ref) if t in eos), len(ref))
            assert resp == ref[:k], (family, i)
            T, D = len(ids), hf.config.hidden_size
            assert r.signals["hidden_last"].shape == (T, D) and r.signals["hidden_aux"].shape == (T, 3, D)
            logp = torch.log_softmax(out.logits[0, start - 1 : -1], -1)
            v, j = logp.topk(8, -1)
            assert torch.equal(r.signals["topk_ids"].long(), j)
            _assert_same(v, r.signals["topk_logprobs"], 2e-3, "topk_logprobs")
            last = hf.model(ids[None]).last_hidden_state[0]
            _assert_same(last, r.signals["hidden_last"], 2e-3, "hidden_last")
            for a, layer in enumerate((0, 1, 2)):  # hidden_states[i + 1] is layer i's output (i < n - 1)
                _assert_same(out.hidden_states[layer + 1][0], r.signals["hidden_aux"][:, a], 2e-3, layer)
            n += 1
    assert n == 8


def test_pipeline_on_the_transformers_path(tmp_path, llama4_dir, prompts_file):
    """`draftsmith run` with target.backend=transformers: generate, train and eval run the target through
    transformers and say so; eval's chain decoding stays lossless against HF generate."""
    out = tmp_path / "run"
    args = [f"target.model={llama4_dir}", f"data.prompts.path={prompts_file}", f"eval.prompts.path={prompts_file}"]
    assert (
        main(["run", "tiny", *args, f"out_dir={out}", "target.dtype=float64", "target.backend=transformers", "-q"]) == 0
    )
    assert read_manifest(out / "data")["target_path"] == "transformers"
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["target_path"] == "transformers" and report["lossless_match"] == 1.0


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_transformers_target_gives_the_same_logits_and_records(tmp_path, llama4_dir, tiny_tokenizer, family):
    """optimize_for_inference on the transformers path (data.optimize) pre-packs every linear layer for oneDNN:
    float32 logits and captured states match the unpacked model to rounding, greedy answers and parameter counts
    are unchanged, and the LM head still exposes its weight."""
    from draftsmith.models.llama import FusedLinear

    path = llama4_dir if family == "llama" else _save_arch(tmp_path / family, tiny_tokenizer, family)
    plain = load_model(str(path), torch.float32, backend="transformers").model
    fast = load_model(str(path), torch.float32, backend="transformers").model
    counts = (fast.num_params(), fast.num_params(exclude_embeddings=True))
    fast.optimize_for_inference()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build: nothing is packed")
    assert sum(isinstance(m, FusedLinear) for m in fast.hf.modules()) > 4 * 4  # every projection of every layer
    assert (fast.num_params(), fast.num_params(exclude_embeddings=True)) == counts
    assert fast.lm_head.weight is not None and fast.lm_head.weight.shape == plain.lm_head.weight.shape
    ids = torch.randint(3, 100, (2, 12))
    with torch.no_grad():
        a, ca = plain(ids, capture_layers=(1, 4))
        b, cb = fast(ids, capture_layers=(1, 4))
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    for k in (1, 4):
        torch.testing.assert_close(cb[k], ca[k], atol=1e-4, rtol=1e-4)
    tok = tiny_tokenizer
    eos = stop_ids(path, tok)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    sampling = Sampling(temperature=0.0)
    gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    outs = [decode_batch(m, prompts, 12, eos, sampling, gens, Capture(topk=4)) for m in (plain, fast)]
    assert [r.tokens for r in outs[0]] == [r.tokens for r in outs[1]]
