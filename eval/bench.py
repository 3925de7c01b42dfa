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
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.errors import DraftsmithError
from draftsmith.eval.batch_sweep import batch_sweep, write_batch_plot
from draftsmith.eval.contention import CpuShare
from draftsmith.eval.decoder import DecodeStats, autoregressive_generate, speculative_generate
from draftsmith.eval.graphs import graph_decoding
from draftsmith.eval.own_vocab import for_decoding
from draftsmith.eval.prompts import Prompt, prompts_from
from draftsmith.eval.report import (
    rounding_note,
    shared_warning,
    write_category_plot,
    write_context_plot,
    write_markdown,
    write_plot,
)
from draftsmith.eval.tasks import correct, load_tasks
from draftsmith.eval.tree import DynamicTree, TreeSpec, tree_from_choices
from draftsmith.eval.tree_decoder import tree_speculative_generate
from draftsmith.models.judge import Judge
from draftsmith.models.loading import (
    encode_chat,
    first_turn,
    hf_model_from_folder,
    load_model,
    stop_ids,
    to_hf_model,
)
from draftsmith.models.medusa import merge_adapter
from draftsmith.models.registry import DRAFTERS, check_fits_target, drafter_spec, load_drafter
from draftsmith.runlog import RunLog, save_recipe
from draftsmith.runtime import resolve_device, resolve_dtype


def _truncate_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _hf_generate(
    hf_model,
    ids: list[int],
    max_new: int,
    eos: set[int],
    pad_id: int,
    assistant=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> list[int]:
    """HF ``generate``: plain, or assisted by ``assistant`` (transformers' own speculative decoding)."""
    x = torch.tensor([ids], device=hf_model.device)
    if temperature > 0:
        sample = {"do_sample": True, "temperature": temperature, "top_k": top_k or None, "top_p": top_p}
    else:
        sample = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    out = hf_model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new,
        eos_token_id=sorted(eos),
        pad_token_id=pad_id,
        assistant_model=assistant,
        **sample,
    )
    return _truncate_at_eos(out[0, len(ids) :].tolist(), eos)


def _hf_assistant(drafter, info: dict, draft_len: int):
    """Our draft LM as a transformers assistant model with a fixed draft length (a like-for-like baseline)."""
    plain = drafter_spec(info["kind"]).causal_lm  # an ordinary causal LM (DrafterSpec.causal_lm)
    if not plain or getattr(drafter, "d2t", None) is not None or info.get("draft_tokenizer"):
        return None  # transformers has no reduced-vocabulary assistant: no like-for-like baseline
    assistant = to_hf_model(drafter)
    assistant.generation_config.num_assistant_tokens = draft_len
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    return assistant


def _timed(fn, device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


@dataclass
class EvalSetup:
    """What every decode of an eval needs, loaded once (``load_for_eval``)."""

    tgt: object  # models.loading.Loaded: model, tokenizer, path
    drafter: torch.nn.Module
    info: dict
    ckpt: Path
    device: str
    dtype: torch.dtype
    encoded: list  # [(prompt, token ids)]
    eos: set[int]
    adapted: bool  # Medusa-2: the target carries merged adapters
    stop_drafting: object = None  # adaptive draft-length hook (eval.stop)
    stop_info: dict | None = None
    judge: object = None  # lossy judge verification (eval.judge): models.judge.Judge
    tasks: list | None = None  # eval/tasks.py Task per encoded prompt, when task accuracy is scored


def load_for_eval(recipe, optimize: bool = True) -> EvalSetup:
    """Target, drafter (Medusa-2 adapters merged, an acceptance head resolved to its draft + stop rule) and the
    encoded eval prompts. ``optimize``: apply eval.optimize now (callers that first build HF copies pass False)."""
    ec, run = recipe.eval, recipe.run_dir
    device = resolve_device(recipe.target.device)
    dtype = resolve_dtype(recipe.target.dtype, device)
    ckpt = Path(ec.checkpoint) if ec.checkpoint else run / "checkpoints" / "final"
    tgt = load_model(
        recipe.target.model,
        dtype,
        device,
        recipe.target.trust_remote_code,
        recipe.target.revision,
        backend=recipe.target.backend,
    )
    drafter, info = load_drafter(ckpt, dtype=dtype, device=device)
    drafter = for_decoding(ckpt, drafter, info, tgt.tokenizer, ec)  # its own vocabulary: eval/hetero.py
    stop_drafting, stop_info = None, None
    if stops(info, ec):
        drafter, info, stop_drafting, stop_info = stop_rule(ec, drafter, info, ckpt, dtype, device)
    if not info.get("draft_tokenizer"):
        check_fits_target(ckpt, info, tgt)
    adapted = getattr(drafter, "target_adapter", None) is not None
    if adapted:  # Medusa-2 serves the jointly trained target: decoding is lossless w.r.t. the adapted target
        merge_adapter(tgt.model, drafter.target_adapter, info["config"]["lora"])
    pc, jc, tasks = ec.prompts, ec.judge, None
    if jc is not None and jc.tasks:  # the prompts are the tasks whose accuracy is scored
        tasks = load_tasks(jc.tasks, jc.tasks_path, pc.n, jc.tasks_start)
        prompts = [Prompt(f"{t.kind}:{t.id}", t.messages, t.kind) for t in tasks]
    else:
        prompts = prompts_from(pc, pc.n)
    encoded = [(p, encode_chat(tgt.tokenizer, first_turn(p.messages))) for p in prompts]
    judge = None
    if jc is not None:
        head, head_info = load_drafter(Path(jc.head), dtype=dtype, device=device)
        if drafter_spec(head_info["kind"]).role != "judge_head" or head.cfg.dim != tgt.model.cfg.dim:
            raise DraftsmithError(
                f"eval.judge.head {jc.head!r} is not a judge for this target "
                f"({head_info.get('kind')}, {getattr(head.cfg, 'dim', '?')}-wide)"
            )
        judge = Judge(head, jc.delta)
    setup = EvalSetup(
        tgt,
        drafter,
        info,
        ckpt,
        device,
        dtype,
        encoded,
        stop_ids(tgt.path, tgt.tokenizer),
        adapted,
        stop_drafting,
        stop_info,
        judge,
        tasks,
    )
    if optimize:
        optimize_models(setup, ec)
    return setup


def fast_model(model, ec, device: str, max_len: int):
    """The decoder's fast path for one model: fused, pre-packed matmuls (eval.optimize) and, on CUDA, CUDA-graph
    replay over a cache of max_len slots (eval.cuda_graphs). Optimised modules lose their HF-named weights, so
    build HF copies first. Used by eval and by the server."""
    if ec.optimize and hasattr(model, "optimize_for_inference"):
        model.optimize_for_inference()
    if ec.cuda_graphs and torch.device(device).type == "cuda":
        model = graph_decoding(model, max_len)
    return model


def optimize_models(setup: EvalSetup, ec) -> None:
    # Room for the longest prompt, the answer and the widest draft block or tree (EAGLE-2 trees stay < 512).
    max_len = max((len(ids) for _, ids in setup.encoded), default=0) + ec.max_new_tokens + 512
    setup.tgt.model = fast_model(setup.tgt.model, ec, setup.device, max_len)
    setup.drafter = fast_drafter(setup.drafter, ec, setup.device, max_len)


def fast_drafter(drafter, ec, device: str, max_len: int):
    """``fast_model`` for a drafter; one with its own tokenizer (eval/hetero.py) runs its draft LM eagerly, each
    decode or batch row on its own cache: fused matmuls only."""
    if not getattr(drafter, "own_vocab", False):
        return fast_model(drafter, ec, device, max_len)
    if ec.optimize and hasattr(drafter.lm, "optimize_for_inference"):
        drafter.lm.optimize_for_inference()
    return drafter


def evaluate(recipe) -> dict:
    ec, run = recipe.eval, recipe.run_dir
    setup = load_for_eval(recipe, optimize=False)
    if ec.long_context is not None:  # checked and built before anything is decoded
        from draftsmith.eval import long_context

        long_prompts = long_context.prepare(setup, ec, recipe.seed)
    save_recipe(recipe)
    vllm_drafter = None
    if ec.engine == "vllm":  # exported first: a drafter vLLM cannot serve is refused before any decoding
        from draftsmith.engines import vllm as engine

        vllm_drafter = engine.export_for_eval(setup.ckpt, run / "eval" / "vllm-drafter")
    dec = _Decoders(recipe, setup)
    tally = _Tally()
    with torch.no_grad():
        for _, ids in setup.encoded[: ec.warmup]:  # first calls pay one-off allocation / kernel selection costs
            dec.run_one(ids)
        meter = CpuShare().start()  # tokens/s need the machine to ourselves: say if not
        for i, (p, ids) in enumerate(tqdm(setup.encoded, desc="eval", unit="prompt", dynamic_ncols=True)):
            tally.add(setup, i, p.category or "all", dec.run_one(ids), ec.temperature == 0)
        batches = dec.batches(tally) if ec.batch_sizes else None
        long = long_context.run_long_context(dec, setup, ec, long_prompts) if ec.long_context is not None else None
        meter.stop()
    tps = {k: tally.toks[k] / tally.times[k] for k in tally.times if tally.times[k] > 0}
    t = tally
    report = build_report(recipe, setup.tgt, dec.drafter, setup.info, setup.ckpt, t.total, t.per_cat, tps,
                          t.matches, t.n_cmp, len(setup.encoded), setup.device, t.cat_times)  # fmt: skip
    report["machine"] = meter.machine()
    _report_extras(report, recipe, setup, dec.drafter, tally, batches)
    if long is not None:
        report["long_context"] = long
    if vllm_drafter is not None:
        dt, ids = str(setup.dtype).removeprefix("torch."), [ids for _, ids in setup.encoded]
        vllm = engine.compare(vllm_drafter, setup.tgt.path, ids, ec, setup.eos, dt, recipe.seed, t.refs, t.specs)
        report["engines"] = {"vllm": vllm}
    _write_report(report, run, bool(ec.batch_sizes))
    return report


class _Decoders:
    """What eval runs on each prompt: the speculative decoder (chain or tree), the target alone, and the
    transformers baselines (plain and assisted generation) when eval.baseline_hf asks for them."""

    def __init__(self, recipe, setup):
        ec, tgt = recipe.eval, setup.tgt
        self.ec, self.setup, self.seed, self.tgt, self.device = ec, setup, recipe.seed, tgt, setup.device
        self.hf_model = self.assistant = None
        if ec.baseline_hf and not setup.adapted:  # HF would run the original target: not a like-for-like baseline
            if tgt.backend == "transformers":  # the transformers model the target already is (one copy in memory)
                self.hf_model = tgt.model.hf
            else:
                hf = hf_model_from_folder(tgt.path, "eval.baseline_hf", dtype=setup.dtype)
                self.hf_model = hf.to(setup.device).eval()
            self.assistant = _hf_assistant(setup.drafter, setup.info, ec.draft_len)
        self.plain_target, self.plain_drafter = tgt.model, setup.drafter  # the batched decoder takes them unwrapped
        optimize_models(setup, ec)
        self.drafter = setup.drafter  # possibly wrapped for CUDA graphs
        eos = setup.eos
        self.pad_id = tgt.tokenizer.pad_token_id if tgt.tokenizer.pad_token_id is not None else min(eos)
        self.gen = torch.Generator(device=setup.device).manual_seed(recipe.seed)
        self.tree = build_tree(ec, getattr(self.drafter, "max_draft_len", None))
        self.sampling = {"temperature": ec.temperature, "top_k": ec.top_k, "top_p": ec.top_p}

    def speculative(self, x):
        ec, s, kw = self.ec, self.setup, {"eos_ids": self.setup.eos, "generator": self.gen, **self.sampling}
        if self.tree is None:
            return speculative_generate(self.tgt.model, self.drafter, x, ec.max_new_tokens, draft_len=ec.draft_len,
                                        stop_drafting=s.stop_drafting, judge=s.judge, **kw)  # fmt: skip
        return tree_speculative_generate(self.tgt.model, self.drafter, x, ec.max_new_tokens, self.tree, **kw)

    def run_one(self, ids):
        """-> (speculative (tokens, stats), its seconds, the target's own tokens, seconds, and the HF baselines'
        tokens and seconds, None and 0 when not run)."""
        ec, dev, eos, kw = self.ec, self.device, self.setup.eos, self.sampling
        x = torch.tensor(ids, device=dev)
        spec, t_spec = _timed(lambda: self.speculative(x), dev)
        ar, t_ar = _timed(
            lambda: autoregressive_generate(self.tgt.model, x, ec.max_new_tokens, eos_ids=eos, generator=self.gen,
                                            **kw), dev,
        )  # fmt: skip
        hf, t_hf, hfa, t_hfa = None, 0.0, None, 0.0
        if self.hf_model is not None:
            n, pad = ec.max_new_tokens, self.pad_id
            hf, t_hf = _timed(lambda: _hf_generate(self.hf_model, ids, n, eos, pad, None, **kw), dev)
            if self.assistant is not None:
                hfa, t_hfa = _timed(lambda: _hf_generate(self.hf_model, ids, n, eos, pad, self.assistant, **kw), dev)
        return spec, t_spec, ar, t_ar, hf, t_hf, hfa, t_hfa

    def batches(self, tally: _Tally) -> dict:
        """eval.batch_sizes: the batched decoder on every prompt at each batch size (greedy rows checked against
        the target's and the batch-1 speculative outputs)."""
        ec, s, greedy = self.ec, self.setup, self.ec.temperature == 0
        prompts = [torch.tensor(ids, device=self.device) for _, ids in s.encoded]
        return batch_sweep(self.plain_target, self.plain_drafter, prompts, ec.batch_sizes, ec.max_new_tokens,
                           draft_len=ec.draft_len, eos_ids=s.eos, sampling=self.sampling, seed=self.seed,
                           reference=tally.refs if greedy else None, batch1=tally.specs if greedy else None,
                           stop_drafting=s.stop_drafting, tree=self.tree, judge=s.judge)  # fmt: skip


class _Tally:
    """eval's counts over the prompts: decode stats (all and per category), seconds and tokens per decoder, the
    greedy match count, solved tasks, and each prompt's outputs."""

    def __init__(self):
        self.total, self.per_cat = DecodeStats(), defaultdict(DecodeStats)
        self.times, self.toks, self.matches, self.n_cmp = defaultdict(float), defaultdict(int), 0, 0
        self.cat_times = defaultdict(lambda: defaultdict(float))  # category -> decoder -> (seconds | tokens)
        self.solved, self.refs, self.specs = defaultdict(int), [], []

    def add(self, setup, i: int, cat: str, outs, greedy: bool) -> None:
        (spec, st), t_spec, ar, t_ar, hf, t_hf, hfa, t_hfa = outs
        if setup.tasks:  # task accuracy of both outputs (the judge may change the speculative one)
            for k, out in (("spec", spec), ("ar", ar)):
                self.solved[k] += correct(setup.tasks[i], setup.tgt.tokenizer.decode(out, skip_special_tokens=True))
        self.total.merge(st)
        self.per_cat[cat].merge(st)
        for k, out, t in (("spec", spec, t_spec), ("ar", ar, t_ar), ("ar_hf", hf, t_hf), ("hf_assisted", hfa, t_hfa)):
            if out is not None:
                self.times[k] += t
                self.toks[k] += len(out)
                self.cat_times[cat][k + "_s"] += t
                self.cat_times[cat][k + "_tokens"] += len(out)
        if greedy:
            self.matches += spec == (hf if hf is not None else ar)
            self.n_cmp += 1
        self.refs.append(ar)
        self.specs.append(spec)


def _report_extras(report: dict, recipe, setup, drafter, tally: _Tally, batches) -> None:
    """The report's optional parts: an own-vocabulary draft's tokenizer, batches, the stop rule, a judge's lossy
    verification and task accuracy."""
    ec, total = recipe.eval, tally.total
    if getattr(drafter, "own_vocab", False):  # the draft's vocabulary and how its drafts reach the target's
        method = drafter.method if drafter.method != "auto" else "slem" if ec.temperature <= 0 else "tli"
        report["drafter"]["tokenizer"] = {"vocab_size": len(drafter.tokenizer), "method": method}
        if drafter.ngram:  # how many of the drafted candidates the n-gram cache wrote
            scope = "drafter" if drafter.shared is not None else "decode"
            ngram = {"ngram_cache": True, "ngram_scope": scope, "ngram_candidates": total.ngram_candidates}
            ngram["drafted"] = total.drafted
            report["drafter"]["tokenizer"] |= ngram
    if batches is not None:
        report["batches"] = batches
    if setup.stop_info is not None:
        report["strategy"]["stop"] = setup.stop_info
    if setup.judge is not None:  # lossy: the output may differ from the target's; say so everywhere
        report["lossy"] = {"judge": ec.judge.head, "delta": ec.judge.delta, "judge_accepted": total.judge_accepted}
    if setup.tasks:
        report["task_accuracy"] = {k: tally.solved[k] / len(setup.encoded) for k in ("spec", "ar")}
        report["task_accuracy"]["tasks"] = ec.judge.tasks


def _write_report(report: dict, run: Path, batched: bool) -> None:
    """RUN/eval: report.json, report.md and the plots; a metrics row; the summary lines."""
    out_dir = run / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    write_plot(report, out_dir / "acceptance.png")
    write_category_plot(report, out_dir / "by_category.png")
    if batched:
        write_batch_plot(report, out_dir / "speedup_vs_batch.png")
    if "long_context" in report:
        write_context_plot(report, out_dir / "tau_vs_context.png")
    write_markdown(report, out_dir / "report.md")
    RunLog(run, "eval").log({k: v for k, v in report.items() if isinstance(v, (int, float))})
    print(
        f"eval: tau {report['tau']:.2f}, acceptance {report['acceptance_rate']:.3f}, "
        f"speedup vs own AR {report['speedup'].get('vs_ar', float('nan')):.2f}x"
        + (f", vs HF {report['speedup']['vs_ar_hf']:.2f}x" if "vs_ar_hf" in report["speedup"] else "")
        + ", "
        f"lossless {report['lossless_match']} -> {out_dir / 'report.md'}"
    )
    if "engines" in report:
        v = report["engines"]["vllm"]
        print(f"eval: vLLM {v['version']}: tau {v['tau']:.2f}, speedup vs its own AR {v['speedup_vs_ar']:.2f}x, "
              f"lossless {v['lossless_match']}")  # fmt: skip
    if warning := shared_warning(report):
        print("eval: warning: " + warning)
    if note := rounding_note(report):
        print("eval: note: " + note)


def stops(info: dict, ec) -> bool:
    """Whether decoding runs under a stop rule: the recipe's eval.stop, or a stop head given as the checkpoint."""
    return ec.stop is not None or drafter_spec(info["kind"]).role == "stop_head"


def stop_rule(ec, drafter, info: dict, ckpt: Path, dtype, device):
    """eval.stop -> (the drafter to decode with, its info, the stop hook, the report's description). An
    acceptance-head checkpoint stands for its draft LM decoded with the SpecDec++ rule."""
    from draftsmith.models.acceptance import AcceptanceStop, ConfidenceStop, EntropyStop
    from draftsmith.recipes.schema import StopConfig

    sc = ec.stop or StopConfig()
    if ec.strategy != "chain":
        raise DraftsmithError("eval.stop (adaptive draft length) works with eval.strategy=chain only")
    head = None
    given_head = DRAFTERS[info.get("kind")].role == "stop_head"  # the checkpoint is the head (DrafterSpec.role)
    if sc.rule == "specdecpp":
        if given_head:
            head, head_path = drafter, ckpt
        elif sc.head:
            head, head_info = load_drafter(Path(sc.head), dtype=dtype, device=device)
            head_path = sc.head
            if DRAFTERS[head_info.get("kind")].role != "stop_head":
                raise DraftsmithError(
                    f"eval.stop.head {sc.head!r} is a {head_info.get('kind')} checkpoint, not an acceptance head"
                )
        else:
            raise DraftsmithError("eval.stop.rule=specdecpp needs eval.stop.head (an acceptance-head checkpoint)")
    if given_head:  # decode with the drafter the head was trained on
        drafter, info = load_drafter(Path(head.cfg.draft), dtype=dtype, device=device)
    kind = info.get("kind")
    heads = DRAFTERS[kind].interface == "heads"  # feature heads, read through draft_step (load_drafter knows kind)
    if head is not None and DRAFTERS[kind].acceptance is None:  # training-free rules: every drafter
        able = ", ".join(k for k, sp in DRAFTERS.items() if sp.acceptance)
        raise DraftsmithError(f"eval.stop.rule=specdecpp needs a drafter an acceptance head reads ({able}), not {kind}")
    width = (drafter.state_dim if heads else drafter.cfg.dim) if head is not None else None
    if head is not None and (head.cfg.dim != width or head.cfg.draft_kind != kind):
        raise DraftsmithError(
            f"eval.stop.head {head_path} was trained on a {head.cfg.draft_kind} with "
            f"{head.cfg.dim}-wide states; this drafter is a {kind} with {width}"
        )
    if (
        head is not None
        and sc.state not in (None, head.cfg.state)
        and not (sc.state == "next" and head.cfg.state == "before")
    ):
        raise DraftsmithError(
            f"eval.stop.state={sc.state} but the head {head_path} was trained with "
            f"drafter.state={head.cfg.state}" + (" (state=next needs a before head)" if sc.state == "next" else "")
        )
    prepare = getattr(drafter, "head_input", None)  # a drafter whose head reads a transformed state (EAGLE)
    training_free = {"entropy": EntropyStop, "confidence": ConfidenceStop}
    keep = drafter.head_ids if heads else None  # reduced heads: features from their rows only
    hook = (
        AcceptanceStop(head, sc.threshold, sc.min_len, prepare, skip=sc.state == "next", keep=keep)
        if head is not None
        else training_free[sc.rule](sc.threshold, sc.min_len, before_feed=sc.state == "before")
    )
    state = ("next" if sc.state == "next" else head.cfg.state) if head is not None else (sc.state or "after")
    desc = {
        "rule": sc.rule,
        "threshold": sc.threshold,
        "min_len": sc.min_len,
        "state": state,
        **({"head": str(head_path)} if head is not None else {}),
    }
    return drafter, info, hook, desc


def build_tree(ec, max_depth: int | None = None) -> TreeSpec | DynamicTree | None:
    """The eval recipe's draft tree; None for chain decoding. ``max_depth``: the drafter's limit (heads), which
    caps the default static tree; a tree the recipe makes deeper is refused in one line naming the key."""
    if ec.strategy == "dynamic_tree":
        t = ec.tree
        tree = DynamicTree(t.top_k, t.depth, t.total_tokens, t.sampling, t.frontier, t.min_prob)
        key, depth = "eval.tree.depth", tree.depth
    elif ec.strategy == "tree":
        # default: the top-1 chain plus the runner-up sibling at every depth
        depths = range(1, min(ec.draft_len, max_depth or ec.draft_len) + 1)
        default = [[0] * d for d in depths] + [[0] * (d - 1) + [1] for d in depths]
        tree = tree_from_choices(ec.tree.choices or default, ec.tree.sampling)
        key, depth = "eval.tree.choices", max(tree.depths)
    else:
        return None
    if max_depth is not None and depth > max_depth:
        raise DraftsmithError(
            f"{key}: the tree is {depth} levels deep, but the drafter drafts at most {max_depth} tokens a step"
        )
    return tree


def _strategy(ec, max_depth: int | None = None) -> tuple[dict, int]:
    """The report's strategy entry and the number of sequential draft passes per step (the MBSU's gamma)."""
    tree = build_tree(ec, max_depth)
    if tree is None:
        gamma = min(ec.draft_len, max_depth or ec.draft_len)  # heads draft at most one token per head
        return {"kind": "chain", "draft_len": gamma}, gamma
    if isinstance(tree, DynamicTree):
        return {
            "kind": "dynamic_tree",
            "top_k": tree.top_k,
            "depth": tree.depth,
            "total_tokens": tree.total_tokens,
            "frontier": tree.width,
            "min_prob": tree.min_prob,
        }, tree.depth
    depth = max(tree.depths)
    return {"kind": "tree", "nodes": len(tree), "depth": depth, "choices": ec.tree.choices}, depth


def _by_category(per_cat: dict, cat_times: dict) -> dict:
    """{category: {tau, speedup}}, speedup = speculative vs own AR tokens/s over that category's prompts."""
    out = {}
    for c, s in sorted(per_cat.items()):
        t = cat_times[c]
        rate = {k: t[k + "_tokens"] / t[k + "_s"] for k in ("spec", "ar") if t[k + "_s"] > 0}
        out[c] = {"tau": s.tau, "speedup": rate["spec"] / rate["ar"] if len(rate) == 2 else None}
    return out


def build_report(
    recipe, tgt, drafter, info, ckpt, total, per_cat, tps, matches, n_cmp, n, device, cat_times=None
) -> dict:
    ec = recipe.eval
    n_draft, n_target = drafter.num_params(), tgt.model.num_params()
    r = n_draft / n_target
    strategy, gamma = _strategy(ec, getattr(drafter, "max_draft_len", None))
    speedup = {f"vs_{k}": tps["spec"] / tps[k] for k in ("ar_hf", "ar", "hf_assisted") if k in tps and "spec" in tps}
    return {
        "target": recipe.target.model,
        "target_path": tgt.backend,  # own (models/llama.py) or transformers (models/hf_target.py)
        "drafter": {"kind": info["kind"], "checkpoint": str(ckpt), "params": n_draft, "step": info.get("step")},
        "target_params": n_target,
        "prompts": {"source": ec.prompts.source, "n": n},
        "temperature": ec.temperature,
        "top_k": ec.top_k,
        "top_p": ec.top_p,
        "max_new_tokens": ec.max_new_tokens,
        "strategy": strategy,
        "tau": total.tau,
        "acceptance_rate": total.acceptance_rate,
        "per_position_acceptance": total.per_position_acceptance(),
        "accept_counts": total.accept_counts,
        # Memory-bound speed-up: tau / (gamma * N_draft/N_target + 1), gamma = sequential draft passes (A1.6).
        "mbsu": total.tau / (gamma * r + 1),
        "tokens_per_s": tps,
        "speedup": speedup,
        "lossless_match": (matches / n_cmp) if n_cmp else None,
        # what the lossless check compared against: HF generate where it ran (not for Medusa-2: HF would run the
        # target without its adapters), else draftsmith's own AR decoder
        "lossless_reference": "ar_hf" if "ar_hf" in tps else "ar",
        "per_category": {c: {"tau": s.tau, "acceptance_rate": s.acceptance_rate} for c, s in sorted(per_cat.items())},
        "by_category": _by_category(per_cat, cat_times or {c: defaultdict(float) for c in per_cat}),
        # The share of the ideal tau-fold speedup that survives drafting and verify overheads (B6: EAGLE-3 ~0.72).
        "efficiency": speedup["vs_ar"] / total.tau if "vs_ar" in speedup and total.tau else None,
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
