"""GPU decoder benchmark: a random-weight ~1B Llama-shaped target (Llama-3.2-1B shapes), bf16, batch 1.

Measured side by side in one process (eval/timing.py: round-robin rounds, CUDA-synchronised, medians; ratios are
the result):
  * step latency of the target: one decode token (our AR step, and transformers' for the same weights), a verify
    forward over γ+1 tokens, and over a 60-token tree under its tree mask, next to one draft step;
  * the share of a speculative step spent in draftsmith's kernels (fused greedy verification; for trees the tree
    mask and KV compaction), next to the PyTorch references of the same calls;
  * end-to-end chain and dynamic-tree speculative decoding vs our own AR decoder: τ, speedup, and
    efficiency = speedup / τ;
each for the plain eager modules and for the eval decoder's CUDA path (fused matmuls + CUDA graphs,
eval/graphs.py). Speedups are against the faster of the two AR decoders.

Random weights accept nothing from a real drafter, so acceptance is scripted and only the *cost* of drafting is
real: the target's LM head is tied to a permutation π of its input embeddings (random otherwise), which makes its
greedy next token π(current token) with a wide logit margin, so bf16 verify and decode agree; the drafter runs a
real one-layer draft model (EAGLE-3 sized: one target-width layer, a 32k reduced-vocabulary head) whose head then
proposes π(token) with probability α, else a wrong token, so τ = (1 − α^(γ+1)) / (1 − α) in expectation (a chain;
trees accept more). The script lives inside the draft model (``ScriptedHead``), so the CUDA-graph path drafts
dynamic trees as the eval decoder does, from one captured graph per tree. Output equality with the AR decoder is
checked for every run.

Reading the output: "[eager]" and "[graphs]" lines give each step in ms and as a multiple of that decoder's decode
step (c = draft step / decode step); "kernels:" gives the kernels' time and their share of a chain (γ=5) and a
tree step; each end-to-end line gives τ, tokens/s, the speedup over the best own AR decoder, the efficiency
speedup / τ (1.0 = drafting and verifying cost nothing beyond a decode step), the bound the measured model costs
alone allow, and whether the output equals AR's. The last line names the machine and how much of its CPU other
processes took meanwhile. --json writes every number.

    python benchmarks/gpu_decoder.py                # CUDA, ~1B target
    python benchmarks/gpu_decoder.py --tiny         # a small config: smoke test on CPU
    python benchmarks/gpu_decoder.py --skip-eager   # only the CUDA-graph decoder (no eager / transformers rows)
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from draftsmith.eval.contention import CpuShare
from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
from draftsmith.eval.graphs import GraphedLlama, graph_decoding
from draftsmith.eval.timing import interleave, machine_note
from draftsmith.eval.tree import DynamicTree, compact_cache
from draftsmith.eval.tree_decoder import tree_speculative_generate
from draftsmith.kernels.kv import compact_kv_reference
from draftsmith.kernels.tree import tree_mask
from draftsmith.kernels.verify import verify_greedy
from draftsmith.models.llama import Llama, LlamaConfig

LLAMA_1B = dict(
    vocab_size=128256,
    dim=2048,
    n_layers=16,
    n_heads=32,
    n_kv_heads=8,
    hidden_dim=8192,
    rope_theta=500000.0,
    max_seq_len=8192,
)
TINY = dict(vocab_size=4096, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=256, max_seq_len=2048)


def build_target(shape: dict, device, dtype, seed: int) -> tuple[Llama, torch.Tensor]:
    """Random weights (normal, std 0.02; embeddings std 1) and lm_head[π(x)] = 0.02·embed[x]: greedy next = π(x)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Llama(LlamaConfig(**shape, tie_embeddings=False))
    model.to(dtype).eval().requires_grad_(False)
    for name, p in model.named_parameters():
        if "norm" not in name:
            p.normal_(0.0, 1.0 if name == "embed_tokens.weight" else 0.02)
    perm = torch.randperm(shape["vocab_size"], device=device)
    model.lm_head.weight[perm] = 0.02 * model.embed_tokens.weight
    return model, perm


class ScriptedHead(nn.Module):
    """A real draft model's cost with scripted acceptance: its LM head proposes π(token) with probability α, else
    π(token)+1. It sits inside the model, so CUDA graphs replay it too (a whole captured dynamic tree included):
    the input ids come from a forward pre-hook on the model, the coin is an integer hash of (id, call counter) on
    the device (no RNG state, no host value in a graph), and α is a device tensor set between runs."""

    def __init__(self, inner: nn.Module, model: Llama, perm: torch.Tensor):
        super().__init__()
        self.inner, self.perm, self.ids = inner, perm, None
        self.alpha = torch.zeros((), device=perm.device)
        self.calls = torch.zeros((), dtype=torch.long, device=perm.device)
        self.hook = model.register_forward_pre_hook(lambda module, args: setattr(self, "ids", args[0]))

    def forward(self, h):
        logits = self.inner(h)
        self.calls += 1
        x = (self.ids * 1103515245 + self.calls * 12345 + 12345) % 2147483648
        hit = ((x >> 8) % 65536).float() / 65536 < self.alpha
        right = self.perm[self.ids]
        choice = torch.where(hit, right, (right + 1) % logits.shape[-1])
        return logits.scatter(-1, choice[..., None], 1e4)


def script(model: Llama, perm: torch.Tensor) -> ScriptedHead:
    model.lm_head = ScriptedHead(model.lm_head, model, perm)
    return model.lm_head


def unscript(model: Llama) -> None:
    model.lm_head.hook.remove()
    model.lm_head = model.lm_head.inner


def build_draft(shape: dict, device, dtype, seed: int) -> Llama:
    cfg = dict(shape, n_layers=1, head_vocab_size=min(32000, shape["vocab_size"] // 2))
    torch.manual_seed(seed)
    with torch.device(device):
        model = Llama(LlamaConfig(**cfg, tie_embeddings=False))
    model.set_head_vocab(torch.arange(cfg["head_vocab_size"], device=device))
    return model.to(dtype).eval().requires_grad_(False)


def forward_job(
    model: Llama, ctx: int, t: int, device, mask: torch.Tensor | None = None, depths: torch.Tensor | None = None
):
    """A callable: one cached forward of t tokens after a ctx-token prefix (a tree's mask/positions when given)."""
    cache = model.new_cache(1, ctx + t + 1)
    model(torch.randint(0, 1000, (1, ctx), device=device), cache=cache)
    x = torch.randint(0, 1000, (1, t), device=device)
    kw = {}
    if mask is not None:
        full = torch.ones(1, t, ctx + t, dtype=torch.bool, device=device)
        full[0, :, ctx:] = mask[1:, 1:] if mask.shape[0] == t + 1 else mask
        kw = {"attn_mask": full, "pos": (ctx + depths).view(1, -1)}

    def step():
        cache.length = ctx  # a graphed model has one static cache: every job resets it to its own prefix
        model(x, cache=cache, **kw)

    return step


def hf_step_latency(model: Llama, ctx: int, device, new: int) -> float | None:
    """transformers' decode step for the same weights: generate ``new`` tokens after ctx, minus the prefill."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        from draftsmith.models.loading import config_to_hf, own_to_hf_key
    except ImportError:
        return None
    d = config_to_hf(model.cfg)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(d.pop("model_type"), **d), dtype=model.embed_tokens.weight.dtype
        )
    hf.load_state_dict({own_to_hf_key(k): v for k, v in model.state_dict().items()}, strict=False)
    hf.eval()
    ids = torch.randint(0, 1000, (1, ctx), device=device)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        t = interleave(
            {
                "full": lambda: hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw),
                "prefill": lambda: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw),
            },
            warmup=1,
            repeats=3,
            device=device,
        )
    return (t["full"].median - t["prefill"].median) / (new - 1)


def random_tree(n: int, seed: int) -> torch.Tensor:
    """Parent pointers of an n-node tree, EAGLE-2-like shape (wide near the root)."""
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([-1 if i < 4 else int(torch.randint(-1, i, (1,), generator=g)) // 2 for i in range(n)])


def latencies(target, draft, a, dev, label: str, parents) -> dict:
    """Decode step, draft step, verify for each γ+1 and the tree verify, round-robin, in ms; printed as ratios to
    the decode step."""
    anc, depths = tree_mask(parents)
    jobs = {"decode": forward_job(target, a.ctx, 1, dev), "draft": forward_job(draft, a.ctx, 1, dev)}
    jobs.update({f"verify {g}": forward_job(target, a.ctx, g + 1, dev) for g in a.gammas})
    jobs["tree"] = forward_job(target, a.ctx, len(parents) + 1, dev, mask=anc, depths=depths)
    t = interleave(jobs, warmup=3, repeats=a.reps, device=dev)
    r = {
        "ar_step_ms": t["decode"].median * 1e3,
        "draft_step_ms": t["draft"].median * 1e3,
        "verify_ms": {g: t[f"verify {g}"].median * 1e3 for g in a.gammas},
        "tree_verify_ms": t["tree"].median * 1e3,
    }
    print(
        f"[{label}] target decode step {r['ar_step_ms']:.3f} ms; draft step {r['draft_step_ms']:.3f} ms "
        f"(c = {t.ratio('draft', 'decode'):.3f})",
        flush=True,
    )
    for g in a.gammas:
        print(
            f"[{label}] verify γ={g} ({g + 1} tokens): {r['verify_ms'][g]:.3f} ms = "
            f"{t.ratio(f'verify {g}', 'decode'):.2f}x a decode step"
        )
    print(
        f"[{label}] verify tree of {len(parents)} nodes (+root): {r['tree_verify_ms']:.3f} ms = "
        f"{t.ratio('tree', 'decode'):.2f}x a decode step",
        flush=True,
    )
    return r


def end_to_end(
    target, draft, prompt, a, dev, label: str, t_best: float, ref: list[int], configs, lat: dict
) -> tuple[list, float]:
    """Our AR decoder and the chain runs per (α, γ), or dynamic trees where γ is a DynamicTree, round-robin (one
    untimed round, then 3). ``bound`` is the efficiency the measured model costs alone allow, AR step / (γ draft
    steps + one verify): the rest is decoder overhead. Speedups are against the faster of this decoder's AR and
    ``t_best`` (another decoder's AR seconds); returns the rows and this decoder's AR seconds."""
    head = (draft.model if isinstance(draft, GraphedLlama) else draft).lm_head
    jobs, meta = {"ar": lambda: autoregressive_generate(target, prompt, a.new_tokens)}, {}
    for alpha, gamma in configs:

        def scripted(alpha=alpha):  # every run sees the same coins: its own α, the counter from zero
            head.alpha.fill_(alpha)
            head.calls.zero_()

        if isinstance(gamma, DynamicTree):

            def run(gamma=gamma, scripted=scripted):
                scripted()
                return tree_speculative_generate(target, draft, prompt, a.new_tokens, gamma)

            name, bound = f"dynamic tree (depth {gamma.depth}, top-{gamma.top_k}, {gamma.total_tokens} nodes)", None
        else:

            def run(gamma=gamma, scripted=scripted):
                scripted()
                return speculative_generate(target, draft, prompt, a.new_tokens, draft_len=gamma)

            verify = lat["verify_ms"].get(gamma)
            bound = lat["ar_step_ms"] / (gamma * lat["draft_step_ms"] + verify) if verify else None
            name = f"γ={gamma}"
        jobs[f"α={alpha} {name}"] = run
        meta[f"α={alpha} {name}"] = (alpha, name, bound)
    t = interleave(jobs, warmup=1, repeats=3, device=dev)
    t_ar = t["ar"].median
    print(
        f"[{label}] own AR: {a.new_tokens / t_ar:.1f} tokens/s ({t_ar / a.new_tokens * 1e3:.3f} ms/token)", flush=True
    )
    best = min(t_ar, t_best)
    rows = []
    for key, (alpha, name, bound) in meta.items():
        out, stats = t[key].last
        speedup = t.ratio("ar", key) * best / t_ar  # paired with this decoder's AR, scaled to the best
        row = {
            "decoder": label,
            "alpha": alpha,
            "draft": name,
            "tau": stats.tau,
            "speedup": speedup,
            "efficiency": speedup / stats.tau,
            "bound": bound,
            "lossless": out == ref,
            "tokens_per_s": a.new_tokens / t[key].median,
        }
        rows.append(row)
        print(
            f"[{label}] {key}: τ {stats.tau:.2f}, {row['tokens_per_s']:.0f} tokens/s, speedup "
            f"{speedup:.2f}x vs the best own AR, efficiency {row['efficiency']:.2f}"
            + (f" (model-cost bound {bound:.2f})" if bound else "")
            + f", lossless {row['lossless']}",
            flush=True,
        )
    return rows, t_ar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small config (CPU smoke test)")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda (bfloat16) or cpu (float32; CUDA graphs need cuda, so the graphs rows run uncaptured)",
    )
    ap.add_argument("--ctx", type=int, default=512, help="context length for the latency measurements")
    ap.add_argument(
        "--reps",
        type=int,
        default=50,
        help="timed round-robin repetitions per latency (median reported; the kernels get 4x)",
    )
    ap.add_argument("--gammas", type=int, nargs="+", default=[1, 3, 5, 7], help="verify widths γ (γ+1 tokens)")
    ap.add_argument("--tree-nodes", type=int, default=60, help="nodes of the verified trees (plus their root)")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.6, 0.8, 0.9], help="scripted acceptance rates")
    ap.add_argument("--e2e-gammas", type=int, nargs="+", default=[3, 5], help="draft lengths end to end")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens generated per end-to-end run")
    ap.add_argument("--prompt-len", type=int, default=128, help="random prompt length end to end")
    ap.add_argument("--no-graphs", action="store_true", help="measure only the eager decoder")
    ap.add_argument("--skip-eager", action="store_true", help="measure only the CUDA-graph decoder")
    ap.add_argument("--json", default=None, help="also write every number here (JSON)")
    a = ap.parse_args()
    if a.no_graphs and a.skip_eager:
        ap.error("--no-graphs and --skip-eager leave nothing to measure")
    dev, shape = a.device, TINY if a.tiny else LLAMA_1B
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    res: dict = {
        "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "shape": shape,
        "ctx": a.ctx,
    }
    torch.set_grad_enabled(False)
    meter = CpuShare().start()
    target, perm = build_target(shape, dev, dtype, seed=0)
    draft = build_draft(shape, dev, dtype, seed=1)
    script(draft, perm)
    res["params"] = {"target": target.num_params(), "draft": draft.num_params(exclude_embeddings=True)}
    print(
        f"device {res['device']}, {dtype}, target {res['params']['target'] / 1e9:.2f} B params, "
        f"draft {res['params']['draft'] / 1e6:.0f} M (without embeddings), ctx {a.ctx}",
        flush=True,
    )
    parents = random_tree(a.tree_nodes, seed=0).to(dev)
    prompt = torch.randint(0, shape["vocab_size"], (a.prompt_len,), device=dev)
    ref = autoregressive_generate(target, prompt, a.new_tokens)
    res["target_follows_perm"] = sum(ref[i + 1] == int(perm[ref[i]]) for i in range(len(ref) - 1)) / (len(ref) - 1)
    print(f"target greedy = π(token) for {res['target_follows_perm']:.1%} of steps")

    # --- eager: plain modules, one Python launch per kernel ------------------------------------------------
    configs = [(al, g) for al in a.alphas for g in a.e2e_gammas]
    t_ar_eager, res["e2e"] = float("inf"), []
    if not a.skip_eager:
        hf = hf_step_latency(target, a.ctx, dev, 64)
        if hf is not None:
            res["hf_step_ms"] = hf * 1e3
            print(f"[transformers] decode step {hf * 1e3:.3f} ms", flush=True)
        res["eager"] = latencies(target, draft, a, dev, "eager", parents)
        if not a.no_graphs:  # with --no-graphs the full end-to-end set below runs eagerly
            res["e2e"], t_ar_eager = end_to_end(
                target, draft, prompt, a, dev, "eager", t_ar_eager, ref, configs[-1:], res["eager"]
            )
            res["eager"]["ar_tokens_per_s"] = a.new_tokens / t_ar_eager

    # --- the eval decoder on CUDA: fused matmuls + CUDA graphs (eval/graphs.py) --------------------------
    label = "eager" if a.no_graphs else "graphs"
    if not a.no_graphs:
        max_len = max(a.ctx + a.tree_nodes + 2, a.prompt_len + a.new_tokens + max(a.e2e_gammas) + 2)
        target = graph_decoding(target.optimize_for_inference(), max_len)
        unscript(draft)  # optimize_for_inference packs the real head; the script goes back on top of it
        draft = graph_decoding(draft.optimize_for_inference(), max_len)
        script(draft.model, perm)
        res["graphs"] = latencies(target, draft, a, dev, "graphs", parents)

    # --- kernels: their time against the step they sit in, next to their PyTorch references ---------------
    V, g = shape["vocab_size"], 5
    cache = target.new_cache(1, a.ctx + a.tree_nodes + 2)
    keep = [i for i in (0, 3, 9, 30) if i <= a.tree_nodes]  # an accepted path's slots (cur first)
    keep_t = torch.tensor(keep, device=dev)
    logits = torch.randn(1, g + 1, V, device=dev, dtype=dtype)
    drafts = logits[:, :g].argmax(-1)

    def compact():
        cache.length = a.ctx + a.tree_nodes + 1
        compact_cache(cache, a.ctx, keep)

    k = interleave(
        {
            "verify_greedy_g5": lambda: verify_greedy(drafts, logits),
            "tree_mask_60": lambda: tree_mask(parents),
            "compact_kv_all_layers": compact,
            "ref verify_greedy_g5": lambda: verify_greedy(drafts, logits, impl="reference"),
            "ref tree_mask_60": lambda: tree_mask(parents, impl="reference"),
            "ref compact_kv_all_layers": lambda: compact_kv_reference(
                cache.kv.view(-1, *cache.kv.shape[3:]), a.ctx, keep_t
            ),
        },
        warmup=3,
        repeats=a.reps * 4,
        device=dev,
    )
    names = ("verify_greedy_g5", "tree_mask_60", "compact_kv_all_layers")
    res["kernel_ms"] = {n: k[n].median * 1e3 for n in names}
    res["reference_ms"] = {n: k[f"ref {n}"].median * 1e3 for n in names}
    k_verify, k_mask, k_compact = (k[n].median for n in names)
    lat = res[label]
    chain_step = (lat["draft_step_ms"] * g + lat["verify_ms"].get(g, lat["verify_ms"][max(lat["verify_ms"])])) / 1e3
    tree_step = lat["draft_step_ms"] * 6 / 1e3 + lat["tree_verify_ms"] / 1e3
    res["kernel_share"] = {"chain_g5": k_verify / chain_step, "tree_60": (k_mask + k_compact + k_verify) / tree_step}
    print(
        f"kernels: verify_greedy {k_verify * 1e6:.1f} us, tree_mask({a.tree_nodes}) {k_mask * 1e6:.1f} us, "
        f"KV compaction (all layers) {k_compact * 1e6:.1f} us; share of a [{label}] step: chain γ=5 "
        f"{res['kernel_share']['chain_g5']:.2%}, {a.tree_nodes}-node tree {res['kernel_share']['tree_60']:.2%}",
        flush=True,
    )
    print(
        "PyTorch references for the same calls: "
        + ", ".join(
            f"{n} {res['reference_ms'][n] * 1e3:.1f} us ({k.ratio(f'ref {n}', n):.2f}x the kernel)" for n in names
        )
    )

    # --- end to end ---------------------------------------------------------------------------------------
    trees = [(al, DynamicTree(depth=6, top_k=4, total_tokens=a.tree_nodes)) for al in a.alphas[-2:]]
    rows, t_ar = end_to_end(target, draft, prompt, a, dev, label, t_ar_eager, ref, configs + trees, res[label])
    res["e2e"] += rows
    res[label]["ar_tokens_per_s"] = a.new_tokens / t_ar
    res["other_cpu"] = meter.stop()
    res["machine"] = machine_note(dev, res["other_cpu"])
    print(res["machine"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
