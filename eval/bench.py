"""`draftsmith eval`: run a drafter checkpoint inside the bundled speculative decoder on a prompt set and
compare with plain autoregressive decoding (HF ``generate`` and our own cache), token for token.

Writes ``<run>/eval/report.json``, ``report.md`` and ``acceptance.png``. Keys of report.json are stable
(later versions add keys, never rename).
"""
from __future__ import annotations

import json
import platform
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.data.prompts import load_prompts
from draftsmith.errors import DraftsmithError
from draftsmith.eval.decoder import DecodeStats, autoregressive_generate, speculative_generate
from draftsmith.eval.report import write_markdown, write_plot
from draftsmith.models.hf import encode_chat, first_turn, load_model, stop_ids, tokenizer_hash
from draftsmith.models.registry import load_drafter
from draftsmith.runlog import RunLog
from draftsmith.runtime import resolve_device, resolve_dtype


def _truncate_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def _hf_generate(hf_model, ids: list[int], max_new: int, eos: set[int], pad_id: int) -> list[int]:
    x = torch.tensor([ids], device=hf_model.device)
    out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                            eos_token_id=sorted(eos), pad_token_id=pad_id, temperature=None, top_p=None, top_k=None)
    return _truncate_at_eos(out[0, len(ids):].tolist(), eos)


def _timed(fn, device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def evaluate(recipe) -> dict:
    ec, run = recipe.eval, recipe.run_dir
    device = resolve_device(recipe.target.device)
    dtype = resolve_dtype(recipe.target.dtype, device)
    ckpt = Path(ec.checkpoint) if ec.checkpoint else run / "checkpoints" / "final"
    tgt = load_model(recipe.target.model, dtype, device, recipe.target.trust_remote_code, recipe.target.revision)
    drafter, info = load_drafter(ckpt, dtype=dtype, device=device)
    if info.get("tokenizer_hash") not in (None, tokenizer_hash(tgt.tokenizer)):
        raise DraftsmithError(f"{ckpt}: drafter was trained with a different tokenizer than {recipe.target.model!r}")
    pc = ec.prompts
    prompts = load_prompts(pc.source, pc.path, pc.n, shuffle=pc.shuffle, seed=pc.seed, split=pc.split,
                           max_turns=pc.max_turns)
    eos = stop_ids(tgt.path, tgt.tokenizer)
    hf_model = None
    if ec.baseline_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(str(tgt.path), dtype=dtype).to(device).eval()
    pad_id = tgt.tokenizer.pad_token_id if tgt.tokenizer.pad_token_id is not None else min(eos)
    gen = torch.Generator(device=device).manual_seed(recipe.seed)
    encoded = [(p, encode_chat(tgt.tokenizer, first_turn(p.messages)))
               for p in prompts]

    def run_one(ids):
        x = torch.tensor(ids, device=device)
        spec, t_spec = _timed(lambda: speculative_generate(
            tgt.model, drafter, x, ec.max_new_tokens, draft_len=ec.draft_len, temperature=ec.temperature,
            eos_ids=eos, generator=gen), device)
        ar, t_ar = _timed(lambda: autoregressive_generate(
            tgt.model, x, ec.max_new_tokens, temperature=ec.temperature, eos_ids=eos, generator=gen), device)
        hf, t_hf = (None, 0.0)
        if hf_model is not None:
            hf, t_hf = _timed(lambda: _hf_generate(hf_model, ids, ec.max_new_tokens, eos, pad_id), device)
        return spec, t_spec, ar, t_ar, hf, t_hf

    with torch.no_grad():
        for _, ids in encoded[:ec.warmup]:  # first calls pay one-off allocation / kernel selection costs
            run_one(ids)
        total, per_cat = DecodeStats(), defaultdict(DecodeStats)
        times, toks, matches, n_cmp = defaultdict(float), defaultdict(int), 0, 0
        for p, ids in tqdm(encoded, desc="eval", unit="prompt", dynamic_ncols=True):
            (spec, st), t_spec, ar, t_ar, hf, t_hf = run_one(ids)
            total.merge(st)
            per_cat[p.category or "all"].merge(st)
            for k, out, t in (("spec", spec, t_spec), ("ar", ar, t_ar), ("ar_hf", hf, t_hf)):
                if out is not None:
                    times[k] += t
                    toks[k] += len(out)
            if ec.temperature == 0:
                ref = hf if hf is not None else ar
                matches += spec == ref
                n_cmp += 1
    tps = {k: toks[k] / times[k] for k in times if times[k] > 0}
    report = build_report(recipe, tgt, drafter, info, ckpt, total, per_cat, tps, matches, n_cmp, len(encoded),
                          device)
    out_dir = run / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    write_plot(report, out_dir / "acceptance.png")
    write_markdown(report, out_dir / "report.md")
    RunLog(run, "eval").log({k: v for k, v in report.items() if isinstance(v, (int, float))})
    print(f"eval: tau {report['tau']:.2f}, acceptance {report['acceptance_rate']:.3f}, "
          f"speedup vs HF {report['speedup'].get('vs_ar_hf', float('nan')):.2f}x, "
          f"lossless {report['lossless_match']} -> {out_dir / 'report.md'}")
    return report


def build_report(recipe, tgt, drafter, info, ckpt, total, per_cat, tps, matches, n_cmp, n, device) -> dict:
    ec = recipe.eval
    n_draft, n_target = drafter.num_params(), tgt.model.num_params()
    r = n_draft / n_target
    speedup = {f"vs_{k}": tps["spec"] / tps[k] for k in ("ar_hf", "ar") if k in tps and "spec" in tps}
    return {
        "target": recipe.target.model,
        "drafter": {"kind": info["kind"], "checkpoint": str(ckpt), "params": n_draft, "step": info.get("step")},
        "target_params": n_target,
        "prompts": {"source": ec.prompts.source, "n": n},
        "temperature": ec.temperature,
        "max_new_tokens": ec.max_new_tokens,
        "strategy": {"kind": ec.strategy, "draft_len": ec.draft_len},
        "tau": total.tau,
        "acceptance_rate": total.acceptance_rate,
        "per_position_acceptance": total.per_position_acceptance(),
        "accept_counts": total.accept_counts,
        # Memory-bound speed-up: tau / (draft_len * N_draft/N_target + 1) (algorithms.md A1.6).
        "mbsu": total.tau / (ec.draft_len * r + 1),
        "tokens_per_s": tps,
        "speedup": speedup,
        "lossless_match": (matches / n_cmp) if n_cmp else None,
        "lossless_reference": "ar_hf" if ec.baseline_hf else "ar",
        "per_category": {c: {"tau": s.tau, "acceptance_rate": s.acceptance_rate} for c, s in sorted(per_cat.items())},
        "time_split": {"draft_s": total.draft_time_s, "verify_s": total.verify_time_s},
        "new_tokens": total.new_tokens,
        "device": _device_name(device),
        "dtype": str(tgt.model.embed_tokens.weight.dtype).removeprefix("torch."),
        "torch": torch.__version__,
    }


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
