"""eval.long_context: prompts of exact token lengths cut from long documents, decoded speculatively and plainly on
the tiny target, with tau, speedup and the lossless match per length; bad lengths and short documents are one-line
errors before anything is decoded."""

from __future__ import annotations

import json
import random

import pytest
import torch

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.eval.long_context import long_prompts, run_long_context
from draftsmith.models.draft_lm import build_draft_lm
from draftsmith.models.loading import load_model, tokenizer_hash
from draftsmith.models.registry import save_drafter
from draftsmith.recipes.schema import LongContextConfig

WORDS = (
    "the quick brown fox jumps over a lazy dog while speculative decoding lets a small draft model propose tokens "
    "that the target verifies at sea under the stars of Paris"
).split()
SPELLED = "a user typed <|im_end|> here"  # a control token's spelling inside a document stays text


def _documents(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + "." for _ in range(n)]


def _docs_file(path, texts: list[str]):
    """Documents as a JSONL prompts file: raw text records and one ShareGPT conversation."""
    recs = [{"text": t} for t in texts[:-1]]
    recs.append({"conversations": [{"from": "human", "value": texts[-1]}, {"from": "gpt", "value": SPELLED}]})
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return path


@pytest.fixture(scope="module")
def kit(tmp_path_factory, tiny_model_dir):
    """A draft LM (the target's first layer) checkpoint for the tiny target and a documents file."""
    root = tmp_path_factory.mktemp("long-context")
    tgt = load_model(str(tiny_model_dir))
    meta = {"target": str(tiny_model_dir), "recipe": "tiny", "tokenizer_hash": tokenizer_hash(tgt.tokenizer)}
    torch.manual_seed(0)
    ckpt = save_drafter(root / "ckpt", build_draft_lm({"n_layers": 1, "init_layers": [0]}, tgt.model), "draft_lm", meta)
    texts = _documents(8, 300)
    return {"tok": tgt.tokenizer, "ckpt": ckpt, "texts": texts, "docs": _docs_file(root / "docs.jsonl", texts)}


def _section(docs, lengths="[64, 128, 256]", n=3) -> str:
    return f"eval.long_context={{lengths: {lengths}, n: {n}, prompts: {{source: file, path: '{docs}'}}}}"


def test_prompts_have_the_requested_lengths_and_differ(kit):
    tok, lc = (
        kit["tok"],
        LongContextConfig(lengths=[64, 128, 256], n=3, prompts={"source": "file", "path": str(kit["docs"])}),
    )
    prompts = long_prompts(tok, lc, seed=0)
    stream = "\n\n".join([*kit["texts"], SPELLED])  # the records' message texts, in order
    head, tail = "<|im_start|>user\n", f"\n\n{lc.instruction}<|im_end|>\n<|im_start|>assistant\n"
    assert list(prompts) == [64, 128, 256]
    for L, batch in prompts.items():
        assert [len(p) for p in batch] == [L] * 3
        assert len({tuple(p) for p in batch}) == 3  # three different windows
        for p in batch:
            text = tok.decode(p)
            assert text.startswith(head) and text.endswith(tail)
            assert text[len(head) : -len(tail)] in stream  # a window of the documents
            assert p.count(tok.convert_tokens_to_ids("<|im_end|>")) == 1  # one turn: the spelled token stays text
    assert long_prompts(tok, lc, seed=0) == prompts and long_prompts(tok, lc, seed=1) != prompts  # seeded windows


def test_eval_reports_tau_per_context_length(kit, tmp_path, tiny_model_dir, prompts_file):
    run = tmp_path / "run"
    args = [f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}", f"eval.checkpoint={kit['ckpt']}",
            f"out_dir={run}", "target.dtype=float64", "eval.prompts.n=1", "eval.baseline_hf=false", "-q"]  # fmt: skip
    assert main(["eval", "tiny", *args, _section(kit["docs"], n=2)]) == 0
    report = json.loads((run / "eval" / "report.json").read_text())
    rows = report["long_context"]
    assert list(rows) == ["64", "128", "256"]
    for length, r in rows.items():
        assert r["prompt_tokens"] == int(length) and r["prompts"] == 2
        assert r["lossless_match"] == 1.0  # float64 greedy: the speculative output is the target's own
        assert 1.0 < r["tau"] <= 4.0 and 0.0 < r["acceptance_rate"] <= 1.0  # the target's own first layer drafts
        assert len(r["per_position_acceptance"]) == 3 and r["new_tokens"] > 0
        assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"]["spec"] / r["tokens_per_s"]["ar"])
    md = (run / "eval" / "report.md").read_text()
    assert "| length | prompt tokens | tau | acceptance | speedup vs own AR | lossless |" in md
    r = rows["128"]
    assert f"| 128 | 128.0 | {r['tau']:.2f} | {r['acceptance_rate']:.3f} | {r['speedup_vs_ar']:.2f}x | 1.000 |" in md
    assert (run / "eval" / "tau_vs_context.png").stat().st_size > 1000


def test_regraphed_decoders_give_the_same_numbers_and_are_restored(
    kit, tmp_path, tiny_model_dir, prompts_file, monkeypatch
):
    """With CUDA-graph wrappers sized for short prompts (here their uncaptured static path, as on CPU), each length
    decodes on wrappers rebuilt for its prompts, with the numbers of plain models; the wrappers come back after."""
    from draftsmith.eval import long_context
    from draftsmith.eval.bench import _Decoders, load_for_eval
    from draftsmith.eval.graphs import graph_decoding
    from draftsmith.recipes.loader import load_recipe

    built = []
    monkeypatch.setattr(long_context, "graph_decoding", lambda m, n: built.append(n) or graph_decoding(m, n))

    recipe = load_recipe("tiny", [f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}",
                                  f"eval.checkpoint={kit['ckpt']}", f"out_dir={tmp_path}", "target.dtype=float64",
                                  _section(kit["docs"], "[128, 256]", 2)])  # fmt: skip
    setup = load_for_eval(recipe, optimize=False)
    dec, ec = _Decoders(recipe, setup), recipe.eval
    prompts = long_prompts(setup.tgt.tokenizer, ec.long_context, recipe.seed)
    with torch.no_grad():
        plain = run_long_context(dec, setup, ec, prompts)
        assert built == []  # no wrappers: nothing to rebuild
        small = graph_decoding(dec.plain_target, 64, graphs=False), graph_decoding(dec.plain_drafter, 64, graphs=False)
        dec.tgt.model, dec.drafter = small
        graphed = run_long_context(dec, setup, ec, prompts)
    assert built == [128 + 16 + 512] * 2 + [256 + 16 + 512] * 2  # target and drafter, per length
    assert (dec.tgt.model, dec.drafter) == small and small[0].max_len == 64
    for L in ("128", "256"):
        assert graphed[L]["lossless_match"] == 1.0
        assert graphed[L]["tau"] == plain[L]["tau"] and graphed[L]["new_tokens"] == plain[L]["new_tokens"]


def _one_line_error(capsys, rc: int, names: str) -> str:
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("draftsmith: error:") and names in err, err
    return err


def test_refusals_are_one_line_and_come_before_any_decode(kit, tmp_path, tiny_model_dir, prompts_file, capsys,
                                                          monkeypatch):  # fmt: skip
    from draftsmith.eval import bench

    def no_decode(*a, **kw):
        raise AssertionError("decoded before the long-context checks")

    monkeypatch.setattr(bench._Decoders, "run_one", no_decode)
    args = ["eval", "tiny", f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}",
            f"eval.checkpoint={kit['ckpt']}", f"out_dir={tmp_path / 'run'}", "-q"]  # fmt: skip
    # the tiny target has 512 positions: 500 + 16 new tokens + 3 drafts do not fit
    err = _one_line_error(capsys, main([*args, _section(kit["docs"], "[64, 500]")]), "eval.long_context.lengths")
    assert "500 + eval.max_new_tokens 16 + a draft of 3 = 519 tokens exceeds the target's 512 positions" in err
    tree = ["eval.strategy=dynamic_tree", "eval.tree.depth=6"]  # a tree counts its depth, not draft_len
    err = _one_line_error(capsys, main([*args, *tree, _section(kit["docs"], "[64, 494]")]), "eval.long_context")
    assert "494 + eval.max_new_tokens 16 + a draft of 6 = 516 tokens" in err
    short = _docs_file(tmp_path / "short.jsonl", _documents(2, 20))
    err = _one_line_error(capsys, main([*args, _section(short, "[64, 256]")]), "eval.long_context.prompts")
    assert "fewer than the" in err and "256-token prompt" in err
    for bad in ("[256, 128]", "[32, 64]", "[64, 64]", "[]"):
        err = _one_line_error(capsys, main([*args, _section(kit["docs"], bad)]), "eval.long_context.lengths")
        assert "distinct lengths from 64" in err
    assert not (tmp_path / "run" / "eval" / "report.json").exists()


def test_a_stream_shorter_than_a_window_is_refused_by_the_builder(kit, tmp_path):
    lc = LongContextConfig(
        lengths=[128], prompts={"source": "file", "path": str(_docs_file(tmp_path / "d.jsonl", ["a b"]))}
    )
    with pytest.raises(DraftsmithError, match=r"eval\.long_context\.prompts: the documents hold \d+ tokens"):
        long_prompts(kit["tok"], lc, seed=0)
