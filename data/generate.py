"""`draftsmith generate`: the target answers prompts; we store its tokens, the loss mask and top-k teacher
log-probs captured during generation (so the target never runs twice).

Batched, left-padded generation with one KV cache. Work is split into shards of ``data.shard_size`` prompts;
a finished shard is never redone, so a killed run resumes where it stopped. ``manifest.json`` comes last.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.data.prompts import load_prompts
from draftsmith.data.records import FORMAT, Record, read_shard_meta, shard_name, write_manifest, write_shard
from draftsmith.errors import DraftsmithError
from draftsmith.models.hf import encode_chat, first_turn, load_model, stop_ids, tokenizer_hash
from draftsmith.models.llama import Llama
from draftsmith.runlog import RunLog
from draftsmith.runtime import resolve_device, resolve_dtype

log = logging.getLogger("draftsmith.data")


def data_hash(recipe) -> str:
    """Everything that changes the records: the target and the data section (not `enabled`)."""
    d = {"target": recipe.target.model_dump(exclude={"device"}), "data": recipe.data.model_dump(exclude={"enabled"})}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


@torch.no_grad()
def generate_batch(model: Llama, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
                   eos_ids: set[int] = frozenset(), topk: int = 0, generator: torch.Generator | None = None):
    """Left-pad ``prompts`` into one batch and decode. Returns per prompt (response ids, topk ids, topk logprobs);
    the top-k rows are the target's distribution (temperature 1) at each response token, EOS included."""
    B, L = len(prompts), max(len(p) for p in prompts)
    dev = model.embed_tokens.weight.device
    ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    valid = torch.zeros(B, L, dtype=torch.bool, device=dev)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p, device=dev)
        valid[b, L - len(p):] = True
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)  # each row's RoPE positions start at 0 after its padding
    cache = model.new_cache(B, L + max_new_tokens)
    last = torch.zeros(B, L, dtype=torch.bool, device=dev)
    last[:, -1] = True  # the LM head only where the next token is predicted: prefill is compute-bound on CPU
    logits = model(ids, pos=pos, cache=cache, valid=valid, logits_at=last)  # (B, V)
    next_pos = pos[:, -1:] + 1
    eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    out, tk_ids, tk_lp = [], [], []
    for _ in range(max_new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B, V) fp32
        if temperature > 0:
            tok = torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator)[:, 0]
        else:
            tok = logp.argmax(-1)
        out.append(tok)
        if topk:
            v, i = logp.topk(topk, dim=-1)
            tk_ids.append(i)
            tk_lp.append(v)
        done |= torch.isin(tok, eos)
        if done.all():
            break
        logits = model(tok[:, None], pos=next_pos, cache=cache)[:, -1]
        next_pos = next_pos + 1
    toks = torch.stack(out, 1).cpu()  # (B, n)
    results = []
    for b in range(B):
        row = toks[b].tolist()
        n = next((j + 1 for j, t in enumerate(row) if t in eos_ids), len(row))  # keep EOS, drop what follows
        ti = torch.stack(tk_ids, 1)[b, :n].cpu() if topk else None
        tl = torch.stack(tk_lp, 1)[b, :n].cpu() if topk else None
        results.append((row[:n], ti, tl))
    return results


def tokenize_prompts(prompts, tok, max_len: int, too_long: str) -> tuple[list[tuple[int, list[int]]], int]:
    """Chat-template every prompt (first user turn and any system message); returns [(index, ids)], n_skipped."""
    kept, skipped = [], 0
    for i, p in enumerate(prompts):
        ids = encode_chat(tok, first_turn(p.messages))
        if len(ids) > max_len:
            if too_long == "skip":
                skipped += 1
                continue
            ids = ids[-max_len:]
        kept.append((i, ids))
    return kept, skipped


def generate(recipe) -> Path:
    """Run the data stage; returns the data folder (with manifest.json)."""
    out = recipe.run_dir / "data"
    out.mkdir(parents=True, exist_ok=True)
    dc = recipe.data
    device = resolve_device(recipe.target.device)
    tgt = load_model(recipe.target.model, resolve_dtype(recipe.target.dtype, device), device,
                     recipe.target.trust_remote_code, recipe.target.revision)
    pc = dc.prompts
    prompts = load_prompts(pc.source, pc.path, pc.n, shuffle=pc.shuffle, seed=pc.seed, split=pc.split,
                           max_turns=pc.max_turns)
    items, skipped = tokenize_prompts(prompts, tgt.tokenizer, dc.max_prompt_tokens, dc.too_long)
    if not items:
        raise DraftsmithError(f"data.prompts: all {len(prompts)} prompts are longer than data.max_prompt_tokens")
    dhash, thash = data_hash(recipe), tokenizer_hash(tgt.tokenizer)
    meta = {"data_hash": dhash, "target": recipe.target.model, "tokenizer_hash": thash}
    eos = stop_ids(tgt.path, tgt.tokenizer)
    gen = torch.Generator(device=device).manual_seed(recipe.seed)
    runlog = RunLog(recipe.run_dir, "generate")
    shards = [items[i:i + dc.shard_size] for i in range(0, len(items), dc.shard_size)]
    entries, t0, new_tokens = [], time.perf_counter(), 0
    bar = tqdm(total=len(items), desc="generate", unit="prompt", dynamic_ncols=True)
    for si, shard_items in enumerate(shards):
        path = out / shard_name(si)
        if path.exists():
            if read_shard_meta(path).get("data_hash") != dhash:
                raise DraftsmithError(f"{path} was written by a different recipe (data hash differs): use a new "
                                      f"out_dir or delete {out}")
            entries.append(_entry_from_existing(path))
            bar.update(len(shard_items))
            continue
        records = []
        order = sorted(shard_items, key=lambda x: len(x[1]))  # similar lengths per batch: less padding
        for b in range(0, len(order), dc.batch_size):
            batch = order[b:b + dc.batch_size]
            res = generate_batch(tgt.model, [ids for _, ids in batch], dc.max_new_tokens,
                                 temperature=dc.temperature, eos_ids=eos, topk=dc.topk, generator=gen)
            for (idx, ids), (resp, ti, tl) in zip(batch, res):
                records.append(Record(ids + resp, [0] * len(ids) + [1] * len(resp), idx, ti, tl))
                new_tokens += len(resp)
            bar.update(len(batch))
            rate = new_tokens / (time.perf_counter() - t0)
            bar.set_postfix(tok_s=f"{rate:.0f}")
        records.sort(key=lambda r: r.prompt_index)
        entries.append(write_shard(path, records, meta))
        runlog.log({"shard": si, "new_tokens": new_tokens, "tokens_per_s": round(rate, 1)})
    bar.close()
    n_tok = sum(e["n_tokens"] for e in entries)
    n_loss = sum(e["n_loss_tokens"] for e in entries)
    total_bytes = sum(e["bytes"] for e in entries)
    manifest = {
        "format": FORMAT, **meta, "recipe": recipe.name,
        "n_sequences": sum(e["n_sequences"] for e in entries), "n_tokens": n_tok, "n_loss_tokens": n_loss,
        "skipped_too_long": skipped,
        "signals": {"topk": dc.topk, "topk_dtype": "float16"} if dc.topk else {},
        "bytes_per_token": round(total_bytes / max(n_tok, 1), 2),
        "bytes_per_loss_token": round(total_bytes / max(n_loss, 1), 2),
        "shards": entries,
    }
    write_manifest(out, manifest)
    dt = time.perf_counter() - t0
    runlog.log({"done": True, "n_sequences": manifest["n_sequences"], "n_loss_tokens": n_loss,
                "seconds": round(dt, 1), "bytes_per_loss_token": manifest["bytes_per_loss_token"]})
    print(f"generate: {manifest['n_sequences']} sequences, {n_loss} target tokens, {skipped} prompts skipped "
          f"(too long), {manifest['bytes_per_loss_token']} bytes/target token -> {out}")
    return out


def _entry_from_existing(path: Path) -> dict:
    from draftsmith.data.records import load_shard

    s = load_shard(path)
    return {"file": path.name, "n_sequences": len(s), "n_tokens": len(s.tensors["input_ids"]),
            "n_loss_tokens": int(s.tensors["loss_mask"].sum()), "bytes": path.stat().st_size}
