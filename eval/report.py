"""Human-readable eval output: report.md (a summary table), acceptance.png (per-position acceptance and the
accepted-length histogram), by_category.png (tau and speedup per prompt category) and tau_vs_context.png (tau and
speedup per prompt length, eval.long_context)."""

from __future__ import annotations

from pathlib import Path


def write_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ppa = report["per_position_acceptance"]
    a1.bar(range(1, len(ppa) + 1), ppa, color="#4c72b0")
    a1.set(
        xlabel="draft position",
        ylabel="P(accept | earlier accepted)",
        ylim=(0, 1),
        title="Per-position acceptance",
        xticks=range(1, len(ppa) + 1),
    )
    counts = report["accept_counts"]
    total = max(sum(counts), 1)
    a2.bar(range(len(counts)), [c / total for c in counts], color="#55a868")
    a2.set(
        xticks=range(len(counts)),
        xlabel="drafts accepted per step",
        ylabel="fraction of steps",
        title=f"tau = {report['tau']:.2f}",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_category_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(report["by_category"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    a1.bar(cats, [report["by_category"][c]["tau"] for c in cats], color="#4c72b0")
    a1.axhline(1.0, color="grey", lw=0.8)
    a1.set(ylabel="tau", title="tau by category")
    a2.bar(cats, [report["by_category"][c]["speedup"] or 0.0 for c in cats], color="#c44e52")
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.set(ylabel="speedup vs own AR", title="speedup by category")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelrotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_context_plot(report: dict, path: Path) -> None:
    """tau_vs_context.png: tau and speedup vs own AR against the prompt length (eval.long_context), log2 x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["long_context"]
    lengths = [int(k) for k in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.2))
    a1.plot(lengths, [rows[k]["tau"] for k in rows], "o-", color="#4c72b0")
    a1.set(ylabel="tau", title="tau by context length")
    a2.plot(lengths, [rows[k]["speedup_vs_ar"] or 0.0 for k in rows], "o-", color="#c44e52")
    a2.axhline(1.0, color="grey", lw=0.8)
    a2.set(ylabel="speedup vs own AR", title="speedup by context length")
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="prompt tokens", xticks=lengths, xticklabels=[str(n) for n in lengths])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


SHARED = 0.1  # above this share of the CPUs taken by other processes, tokens/s are not this machine's own


def shared_warning(report: dict) -> str | None:
    """A one-line warning when other processes used a noticeable share of the machine while we timed."""
    share = (report.get("machine") or {}).get("other_cpu_share")
    if share is None or share <= SHARED:
        return None
    return (
        f"other processes used {share:.0%} of the machine's CPU time while this eval was timed: tokens/s are "
        f"lower than this machine's own; the speedups are same-process ratios and less affected"
    )


def rounding_note(report: dict) -> str | None:
    """Why a greedy eval in 16-bit can differ from the target's own output without a bug: a γ+1-token verify and a
    one-token AR step take different kernels, which round differently, so near-tied argmaxes can flip (measured:
    the target drafting for itself is exact in fp32 and not in bf16, benchmarks/RESULTS.md, 2026-11-24)."""
    m = report.get("lossless_match")
    if report.get("lossy") or m is None or m >= 1 or report.get("dtype") not in ("bfloat16", "float16"):
        return None
    return (
        f"in {report['dtype']}, a multi-token verify and one-token AR steps round differently, so near-tied "
        f"argmaxes can flip and outputs drift apart; run with target.dtype=float32 for an exact check"
    )


def write_markdown(report: dict, path: Path) -> None:
    r = report
    lines = [
        f"# Speculative decoding eval: {r['target']}",
        "",
        f"Drafter `{r['drafter']['kind']}` ({r['drafter']['params'] / 1e6:.1f}M params) from "
        f"`{r['drafter']['checkpoint']}`; {r['prompts']['n']} {r['prompts']['source']} prompts, "
        f"temperature {r['temperature']}, {r['max_new_tokens']} new tokens max, {r['strategy']['kind']} "
        f"({', '.join(f'{k} {v}' for k, v in r['strategy'].items() if k not in ('kind', 'choices'))}), "
        f"on {r['device']} ({r['dtype']}).",
        "",
        "| metric | value |",
        "|---|---|",
        f"| tau (tokens per target forward) | {_fmt(r['tau'])} |",
        f"| acceptance rate | {_fmt(r['acceptance_rate'])} |",
        f"| MBSU | {_fmt(r['mbsu'])} |",
    ]
    lines += [f"| tokens/s {k} | {v:.1f} |" for k, v in r["tokens_per_s"].items()]
    lines += [f"| speedup {k} | {v:.2f}x |" for k, v in r["speedup"].items()]
    lines += [f"| lossless match vs {r['lossless_reference']} | {_fmt(r['lossless_match'])} |", ""]
    if r.get("lossy"):  # judge verification: the output may differ from the target's own
        lines.insert(
            2,
            f"**LOSSY run**: judge verification (`{r['lossy']['judge']}`, delta {r['lossy']['delta']}); "
            f"{r['lossy']['judge_accepted']} drafts were kept only because the judge accepted them.\n",
        )
    if shared_warning(r):
        lines.insert(2, f"**Shared machine**: {shared_warning(r)}.\n")
    if rounding_note(r):
        lines.insert(2, f"**Lossless match below 1 in 16-bit**: {rounding_note(r)}.\n")
    if r.get("task_accuracy"):
        a = r["task_accuracy"]
        lines.insert(-1, f"| task accuracy ({a['tasks']}) speculative / AR | {a['spec']:.3f} / {a['ar']:.3f} |")
    lines.insert(-1, f"| efficiency (speedup vs AR / tau) | {_fmt(r['efficiency'])} |")
    if len(r["per_category"]) > 1:
        lines += ["| category | tau | acceptance | speedup vs AR |", "|---|---|---|---|"]
        lines += [
            f"| {c} | {v['tau']:.2f} | {v['acceptance_rate']:.3f} | {_fmt(r['by_category'][c]['speedup'])} |"
            for c, v in r["per_category"].items()
        ]
        lines += ["", "![by category](by_category.png)", ""]
    lines += [
        "Per-position acceptance: " + ", ".join(f"{x:.2f}" for x in r["per_position_acceptance"]),
        "",
        "![acceptance](acceptance.png)",
        "",
    ]
    if r.get("batches"):
        lines += batch_markdown(r) + ["![speedup vs batch size](speedup_vs_batch.png)", ""]
    if r.get("long_context"):
        lines += context_markdown(r) + ["![tau vs context length](tau_vs_context.png)", ""]
    if r.get("engines"):
        lines += engine_markdown(r)
    Path(path).write_text("\n".join(lines))


def engine_markdown(report: dict) -> list[str]:
    """draftsmith's numbers beside vLLM's on the same prompts (eval.engine=vllm)."""
    v = report["engines"]["vllm"]
    pos = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    rows = [
        ("tau", _fmt(report["tau"]), _fmt(v["tau"])),
        ("acceptance rate", _fmt(report["acceptance_rate"]), _fmt(v["acceptance_rate"])),
        ("per-position acceptance", pos(report["per_position_acceptance"]), pos(v["per_position_acceptance"])),
        ("tokens/s speculative", f"{report['tokens_per_s'].get('spec', 0):.1f}", f"{v['tokens_per_s']['spec']:.1f}"),
        ("tokens/s plain", f"{report['tokens_per_s'].get('ar', 0):.1f}", f"{v['tokens_per_s']['ar']:.1f}"),
        ("speedup vs own plain", f"{report['speedup'].get('vs_ar', float('nan')):.2f}x", f"{v['speedup_vs_ar']:.2f}x"),
        ("lossless match", _fmt(report["lossless_match"]), _fmt(v["lossless_match"])),
    ]
    return [
        f"## vLLM {v['version']} beside draftsmith",
        "",
        f"The same prompts, one at a time, in vLLM with the drafter exported as `--format vllm` "
        f"(`{v['speculative_config']['method']}`, {v['speculative_config']['num_speculative_tokens']} tokens). "
        f"vLLM's answers equal draftsmith's: plain {_fmt(v['matches_draftsmith_ar'])}, speculative "
        f"{_fmt(v['matches_draftsmith_spec'])}. Near max_new_tokens draftsmith shortens the last draft; vLLM drafts "
        "the full length and counts its acceptance, so its tau can sit slightly higher on the same drafts.",
        "",
        "| metric | draftsmith | vLLM |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
    ]


def context_markdown(report: dict) -> list[str]:
    """The eval.long_context table: one row per prompt length."""
    lines = [
        "## Long context",
        "",
        "| length | prompt tokens | tau | acceptance | speedup vs own AR | lossless |",
        "|---|---|---|---|---|---|",
    ]
    for length, r in report["long_context"].items():
        speedup = "-" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}x"
        lines.append(
            f"| {length} | {r['prompt_tokens']:.1f} | {r['tau']:.2f} | {r['acceptance_rate']:.3f} | {speedup} "
            f"| {'-' if r['lossless_match'] is None else _fmt(r['lossless_match'])} |"
        )
    return lines + [""]


def batch_markdown(report: dict) -> list[str]:
    sweep = report["batches"]
    lines = [
        "## Speedup by batch size",
        "",
        "| B | tau | acceptance | tokens/s own AR | tokens/s speculative | speedup | lossless | = batch 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sweep["rows"]:
        lines.append(
            f"| {r['batch_size']} | {r['tau']:.2f} | {r['acceptance_rate']:.3f} | {r['tokens_per_s']['ar']:.1f} "
            f"| {r['tokens_per_s']['spec']:.1f} | {r['speedup']:.2f}x | {r.get('lossless_match', '-')} "
            f"| {r.get('batch1_match', '-')} |"
        )
    cross = sweep["crossover"]
    lines += ["", f"Crossover: {'none in the sizes measured' if cross is None else f'B = {cross}'}.", ""]
    return lines
