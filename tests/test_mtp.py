"""Native MTP heads (models/mtp.py) on tiny random targets of the transformers classes whose checkpoints ship MTP
layers: DeepSeek-V3 (latent attention, experts), GLM-4.5 (experts) and Qwen3-Next (linear + gated full attention,
experts), each saved with an MTP layer under its own checkpoint names."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from draftsmith.errors import DraftsmithError

FAMILIES = {
    "deepseek_v3": ("DeepseekV3", dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1,
        topk_group=1, num_nextn_predict_layers=1)),
    "glm4_moe": ("Glm4Moe", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16, first_k_dense_replace=1,
        n_group=1, topk_group=1, num_nextn_predict_layers=1)),
    "qwen3_next": ("Qwen3Next", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16,
        shared_expert_intermediate_size=64, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"] * 2, mtp_num_hidden_layers=1)),
}  # fmt: skip
QWEN_NEXT_NAMES = {  # Qwen3-Next's checkpoint names of the MTP layer's projection and norms
    "enorm.weight": "pre_fc_norm_embedding.weight",
    "hnorm.weight": "pre_fc_norm_hidden.weight",
    "eh_proj.weight": "fc.weight",
    "post_norm.weight": "norm.weight",
}


def save_mtp_target(path, tok, family: str, seed: int = 0, with_mtp: bool = True, **overrides) -> dict:
    """A tiny random ``family`` model saved as its checkpoints are, with an MTP layer in the family's own layout:
    its decoder block is the last decoder layer's tensors as transformers saved them (experts unmerged), under
    ``model.layers.{L}.*`` (DeepSeek / GLM, the final norm as ``shared_head.norm``) or ``mtp.layers.0.*`` (Qwen3-Next,
    with ``mtp.fc`` and its norms); the projection and norms random. Returns {checkpoint name: tensor} of the layer."""
    import transformers
    from safetensors.torch import load_file, save_file

    name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    cfg.update(extra)
    cfg.update(overrides)
    hf = getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**cfg))
    with torch.no_grad():  # weights big enough that the routing and the drafts matter
        for p in hf.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    sd = load_file(f"{path}/model.safetensors")
    L, last = cfg["num_hidden_layers"], f"model.layers.{cfg['num_hidden_layers'] - 1}."
    qwen = family == "qwen3_next"
    block = "mtp.layers.0." if qwen else f"model.layers.{L}."
    written = {block + k.removeprefix(last): v.clone() for k, v in sd.items() if k.startswith(last)}
    dim, g = cfg["hidden_size"], torch.Generator().manual_seed(seed + 1)
    own = {"eh_proj.weight": torch.randn(dim, 2 * dim, generator=g) / dim**0.5}
    own.update({f"{n}.weight": 1 + 0.1 * torch.randn(dim, generator=g) for n in ("enorm", "hnorm", "post_norm")})
    for k, v in own.items():
        name = f"mtp.{QWEN_NEXT_NAMES[k]}" if qwen else f"model.layers.{L}.{k.replace('post_norm', 'shared_head.norm')}"
        written[name] = v
    if with_mtp:
        save_file({**sd, **written}, f"{path}/model.safetensors", metadata={"format": "pt"})
    return written


def _target(path):
    from draftsmith.models.hf_target import load_hf_target

    return load_hf_target(path, json.loads((path / "config.json").read_text()), torch.float64, "cpu", False)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_target(request, tmp_path_factory, tiny_tokenizer):
    path = tmp_path_factory.mktemp(request.param)
    written = save_mtp_target(path, tiny_tokenizer, request.param)
    return request.param, path, _target(path), written


def test_the_target_layer_loads_and_drafts_as_transformers_runs_it(family_target):
    """The checkpoint's MTP block loads as transformers loads the same tensors into the target's last decoder layer
    (experts merged its way), the projection and norms as written; written back under the checkpoint's names (the
    vllm export) the layer is exactly the checkpoint's tensors; its first draft's logits are transformers'
    MtpModel's; a cached step gives the uncached step's logits."""
    from draftsmith.models.mtp import build_mtp, checkpoint_names

    family, path, t, written = family_target
    d = build_mtp({}, t).double()
    block, last = d.layer.mtp_block.state_dict(), t.hf.model.layers[-1].state_dict()
    assert block.keys() == last.keys() and all(torch.equal(block[k], last[k]) for k in block), family
    for name, own in {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden"}.items():
        v = written.get(f"mtp.{own}.weight", written.get(f"model.layers.4.{name}.weight"))
        assert torch.equal(getattr(d.layer, name).weight.float(), v.float()), (family, name)
    back = checkpoint_names(d)
    assert back.keys() == {*written, "model.embed_tokens.weight", "lm_head.weight"}, family
    assert all(torch.equal(back[k].float(), v.float()) for k, v in written.items()), family
    ids = torch.randint(3, t.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, cap = t(ids, capture_layers=d.capture_layers, return_hidden=True)
        f = d.features(cap, t)
        logits, _ = d.step(f[:, :-1], ids[:, 1:])
        mtp = d.mtp_model[0]
        e = mtp.embed_tokens(ids[:, 1:])
        if family != "qwen3_next":  # vLLM's DeepSeek and GLM MTP layers read a zero embedding at position 0; so do we
            e[:, 0] = 0
        ref = mtp._project_to_logits(mtp.forward_layer(0, f[:, :-1], torch.arange(11)[None], None, inputs_embeds=e))
        cached, _ = d.step(f[:, :-1], ids[:, 1:], cache=d.new_cache(2, 16))
    torch.testing.assert_close(logits, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(cached, logits, rtol=1e-9, atol=1e-9)


def test_a_windowed_mtp_layer_cuts_its_keys_in_training_and_decoding(family_target):
    """drafter.sliding_window on the target's own layer: the TTT unroll's rows equal the cached step-by-step
    decoder's, and equal the full-attention layer's only while every key is inside the window."""
    from draftsmith.models.mtp import build_mtp

    family, _, t, _ = family_target
    w = 4  # tolerance 1e-6: DeepSeek's router computes its expert weights in float32
    d, full = build_mtp({"sliding_window": w, "ttt_steps": 2}, t).double(), build_mtp({"ttt_steps": 2}, t).double()
    ids = torch.randint(3, t.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, cap = t(ids, capture_layers=d.capture_layers, return_hidden=True)
        f = d.features(cap, t)
        got, ref = d(f, ids, steps=2), full(f, ids, steps=2)
        for s in range(2):
            torch.testing.assert_close(got[s, :, : w - s], ref[s, :, : w - s], rtol=1e-6, atol=1e-6)
            assert (got[s, :, w - s : -2] - ref[s, :, w - s : -2]).abs().amax(-1).min() > 1e-5, family
        for i in (2, 7):  # the decoder: the real pairs 0..i with a cache, then its own output
            cache = d.new_cache(1, 16)
            _, out = d.step(f[:, : i + 1], ids[:, 1 : i + 2], cache=cache)
            torch.testing.assert_close(out[0, -1], got[0, 0, i], rtol=1e-6, atol=1e-6)
            _, out = d.step(out[:, -1:], ids[:, i + 2 : i + 3], cache=cache)
            torch.testing.assert_close(out[0, -1], got[1, 0, i], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strategy", ["chain", "tree"])
def test_decoding_with_the_mtp_layer_is_lossless(family_target, strategy):
    """Greedy chains and dynamic trees at batch 1, and batched rows of different lengths, give the target's own
    greedy tokens."""
    from draftsmith.eval.batch_decoder import BatchDecoder
    from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
    from draftsmith.eval.tree import DynamicTree
    from draftsmith.models.mtp import build_mtp

    family, _, t, _ = family_target
    d = build_mtp({}, t).double().eval()
    if family == "qwen3_next":  # linear-attention layers: no rollback of their state, so no speculative decoding
        with pytest.raises(DraftsmithError, match="linear_attention layers, whose recurrent state cannot roll back"):
            t.new_cache(1, 16)
        return
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, t.cfg.vocab_size, (n,), generator=gen) for n in (5, 9, 3)]
    tree = DynamicTree(top_k=2, depth=3, total_tokens=6) if strategy == "tree" else None
    with torch.no_grad():
        ar = [autoregressive_generate(t, p, 12) for p in prompts]
        for p, want in zip(prompts, ar):
            got, stats = speculative_generate(t, d, p, 12, draft_len=3, tree=tree)
            assert got == want, (family, strategy)
        if strategy == "chain":
            dec = BatchDecoder(t, d, draft_len=3, max_len=40)
            ids = [dec.add(p, 12) for p in prompts]
            outs = {i: [] for i in ids}
            while dec.active():
                for i, toks in dec.step().items():
                    outs[i].extend(toks)
            assert [outs[i] for i in ids] == ar, family


def test_targets_without_mtp_layers_are_refused(tmp_path, tiny_tokenizer, tiny_model_dir):
    """A target whose config declares no MTP layers, one whose checkpoint lacks their tensors, and a layer index
    past the target's are each one line; init=random trains a fresh layer on any of them."""
    from draftsmith.models.loading import load_model
    from draftsmith.models.mtp import build_mtp

    llama = load_model(str(tiny_model_dir)).model
    with pytest.raises(DraftsmithError, match="has no MTP layers.*drafter.init=random"):
        build_mtp({}, llama)
    assert build_mtp({"init": "random"}, llama).layer.mtp_block.__class__.__name__ == "LlamaDecoderLayer"
    save_mtp_target(tmp_path / "bare", tiny_tokenizer, "glm4_moe", with_mtp=False)
    bare = _target(tmp_path / "bare")
    with pytest.raises(DraftsmithError, match="safetensors hold none of their tensors"):
        build_mtp({}, bare)
    with pytest.raises(DraftsmithError, match="drafter.layer 1 is outside"):
        build_mtp({"layer": 1}, bare)
    assert build_mtp({"init": "random"}, bare).layer.mtp_block.__class__.__name__ == "Glm4MoeDecoderLayer"


def test_a_run_on_a_deepseek_target_trains_and_decodes_losslessly(tmp_path, tiny_tokenizer, prompts_file):
    """generate -> train (the shipped MTP layer, TTT) -> eval (chain, then a dynamic tree with batches of 1 and 2),
    lossless throughout; the checkpoint reloads to the trained layer."""
    from draftsmith.cli import main
    from draftsmith.export.writer import load_export
    from draftsmith.models.registry import load_drafter
    from draftsmith.recipes.loader import find_recipe

    path = tmp_path / "dsv3"
    save_mtp_target(path, tiny_tokenizer, "deepseek_v3")
    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "mtp", "ttt_steps": 2}
    spec["data"]["signals"]["hidden_last"] = True
    recipe = tmp_path / "mtp.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    out = tmp_path / "run"
    args = [f"target.model={path}", f"data.prompts.path={prompts_file}", f"eval.prompts.path={prompts_file}",
            f"out_dir={out}", "train.steps=3", "eval.prompts.n=3", "eval.max_new_tokens=12", "-q"]  # fmt: skip
    assert main(["run", str(recipe), *args]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["stage"] == "train" and "loss" in r]
    assert len(train) == 3 and all(r["loss"] == r["loss"] for r in train) and "top1_step1" in train[-1]
    assert json.loads((out / "eval" / "report.json").read_text())["lossless_match"] == 1.0
    tree = ["eval.strategy=dynamic_tree", "eval.tree.depth=3", "eval.batch_sizes=[1,2]"]
    assert main(["eval", str(recipe), *args, *tree]) == 0
    assert json.loads((out / "eval" / "report.json").read_text())["lossless_match"] == 1.0
    ckpt, info = load_drafter(out / "checkpoints" / "final")
    assert info["kind"] == "mtp" and type(ckpt.layer.mtp_block).__name__ == "DeepseekV3DecoderLayer"
    assert main(["export", str(recipe), *args[:-1], "--format", "vllm"]) == 0  # vLLM's mtp method: target's names
    folder = out / "export" / "vllm"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["num_nextn_predict_layers"] == 1
    back, _ = load_export(folder)
    sd = ckpt.state_dict()
    assert back.state_dict().keys() == sd.keys()
    assert all(torch.equal(v.float(), sd[k].float()) for k, v in back.state_dict().items())


def test_the_vllm_export_is_refused_where_vllms_mtp_layer_cannot_run_it(tmp_path, tiny_model_dir, family_target):
    """A fresh MTP layer on a Llama target (vLLM runs the MTP layers of DeepSeek-V3, GLM-4.5 and Qwen3-Next only)
    and a windowed layer (vLLM's attends to everything) are refused in one line, with nothing written."""
    from draftsmith.export.writer import export
    from draftsmith.models.loading import load_model
    from draftsmith.models.mtp import build_mtp
    from draftsmith.models.registry import save_drafter

    family, path, t, _ = family_target
    llama = load_model(str(tiny_model_dir)).model
    cases = {"llama": (build_mtp({"init": "random"}, llama), tiny_model_dir, "runs the MTP layers of"),
             "window": (build_mtp({"sliding_window": 4, "ttt_steps": 2}, t), path, "sliding_window")}  # fmt: skip
    for name, (d, tgt, why) in cases.items():
        ckpt = save_drafter(tmp_path / name / "ckpt", d, "mtp", {"target": str(tgt), "step": 1})
        with pytest.raises(DraftsmithError, match=why) as e:
            export(ckpt, "vllm", tmp_path / name / "vllm")
        assert "\n" not in str(e.value) and not (tmp_path / name / "vllm").exists()
