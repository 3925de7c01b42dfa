"""The vLLM backend of the data stage (``data.backend: vllm``): vLLM writes the target's responses, one seeded request
per conversation turn, so a response never depends on the batch it ran in. Teacher signals come from draftsmith's
own model in one teacher-forced pass (data/engine.py ``score_batch``), or, with ``data.vllm_topk``, the top-k
log-probs come from vLLM itself (its raw log-probs of every response position) and that pass runs only for
hidden states or SpecDec++ labels.

Only imported when ``data.backend: vllm``; vLLM itself is never a dependency of draftsmith (draftsmith/engines/vllm.py).
"""

from __future__ import annotations

import torch

from draftsmith.data.engine import Generated
from draftsmith.engines.vllm import Engine, tokens_of
from draftsmith.errors import DraftsmithError
from draftsmith.models.sampling import row_generator


def _engine(prod) -> Engine:
    if prod._vllm is None:
        dtype = str(prod.tgt.model.embed_tokens.weight.dtype).removeprefix("torch.")
        dc = prod.dc
        prod._vllm = Engine(
            prod.tgt.path,
            dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "auto",
            seed=prod.seed,
            max_model_len=dc.max_prompt_tokens + dc.max_new_tokens + 1,
            max_num_seqs=dc.batch_size,
            gpu_memory_utilization=dc.vllm_gpu_memory,
            trust_remote_code=prod.trust_remote_code,
            max_logprobs=max(20, prod.capture.topk),
        )
    return prod._vllm


def vllm_topk(prod) -> bool:
    """Whether vLLM's own log-probs are the records' top-k signal."""
    return prod.dc.backend == "vllm" and prod.dc.vllm_topk and bool(prod.capture.topk)


def vllm_generate(prod, contexts: list[list[int]], keys: list[tuple[int, ...]]) -> list[Generated]:
    """One response per context with vLLM; ``keys`` seed each request (same keys, same samples)."""
    dc = prod.dc
    k = prod.capture.topk if vllm_topk(prod) else None
    seeds = [int(row_generator("cpu", *key).initial_seed() % (2**31)) for key in keys]
    outs, _, _ = _engine(prod).generate(
        contexts, dc.max_new_tokens, dc.temperature, dc.top_k, dc.top_p, prod.eos, seeds=seeds, logprobs=k
    )
    results = []
    for o in outs:
        tokens = tokens_of(o, prod.eos)[: dc.max_new_tokens]
        signals = {} if k is None else _topk_signals(o.outputs[0].logprobs, k, len(tokens))
        results.append(Generated(tokens, signals))
    return results


def _topk_signals(logprobs, k: int, n: int) -> dict[str, torch.Tensor]:
    """vLLM's per-position {token id: Logprob(logprob, rank)} -> topk_ids / topk_logprobs (n, k), by rank."""
    if logprobs is None or len(logprobs) < n:
        raise DraftsmithError(
            f"data.vllm_topk: vLLM returned log-probs for {0 if logprobs is None else len(logprobs)} of {n} "
            "response positions (set data.vllm_topk=false to score the responses with draftsmith's model)"
        )
    ids = torch.empty(n, k, dtype=torch.long)
    lps = torch.empty(n, k, dtype=torch.float32)
    for t, pos in enumerate(logprobs[:n]):
        top = sorted(((lp.rank, tid, lp.logprob) for tid, lp in pos.items() if lp.rank is not None and lp.rank <= k))
        if len(top) < k:
            raise DraftsmithError(f"data.vllm_topk: vLLM returned {len(top)} ranked log-probs, not {k}")
        ids[t] = torch.tensor([tid for _, tid, _ in top[:k]])
        lps[t] = torch.tensor([lp for _, _, lp in top[:k]])
    return {"topk_ids": ids, "topk_logprobs": lps}
