"""Optional vLLM backend for the data stage: vLLM writes the target's responses (fast GPU serving), then
draftsmith's own model scores them in one teacher-forced pass (data/engine.py ``score_batch``), since vLLM does
not expose top-k log-probs over the full vocabulary or hidden states in a form we can store.

Only imported when ``data.backend: vllm``; vLLM itself is never a dependency of draftsmith.
"""

from __future__ import annotations

from draftsmith.data.engine import Generated
from draftsmith.errors import DraftsmithError
from draftsmith.models.sampling import row_generator


def _engine(prod):
    if prod._vllm is None:
        try:
            from vllm import LLM
        except ImportError:
            raise DraftsmithError(
                "data.backend=vllm needs vLLM installed (a GPU machine): pip install vllm; or use data.backend=native"
            ) from None
        dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(
            str(prod.tgt.model.embed_tokens.weight.dtype).removeprefix("torch."), "auto"
        )
        prod._vllm = LLM(
            model=str(prod.tgt.path),
            tokenizer=str(prod.tgt.path),
            dtype=dtype,
            seed=prod.seed,
            gpu_memory_utilization=prod.dc.vllm_gpu_memory,
            skip_tokenizer_init=True,
        )
    return prod._vllm


def vllm_generate(prod, contexts: list[list[int]], keys: list[tuple[int, ...]]) -> list[Generated]:
    """One response per context with vLLM; ``keys`` seed each request (same keys, same samples)."""
    llm = _engine(prod)
    from vllm import SamplingParams

    dc = prod.dc
    params = [
        SamplingParams(
            n=1,
            temperature=dc.temperature,
            top_k=dc.top_k if dc.top_k > 0 else -1,
            top_p=dc.top_p,
            max_tokens=dc.max_new_tokens,
            stop_token_ids=sorted(prod.eos),
            seed=int(row_generator("cpu", *key).initial_seed() % (2**31)),
            detokenize=False,
        )
        for key in keys
    ]
    outs = llm.generate([{"prompt_token_ids": c} for c in contexts], params, use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        tokens = list(c.token_ids)
        # A stop on a stop_token_id may leave the id out of token_ids; the record needs its end-of-turn token.
        if c.finish_reason == "stop" and (not tokens or tokens[-1] not in prod.eos) and isinstance(c.stop_reason, int):
            tokens.append(c.stop_reason)
        results.append(Generated(tokens[: dc.max_new_tokens]))
    return results
