"""The one CLI: ``draftsmith {run,generate,train,eval,export,serve,online,show,sweep,tree} RECIPE [a.b=c ...]``.

Also ``python -m draftsmith ...`` and, for multi-GPU training, ``accelerate launch -m draftsmith train RECIPE``.
Every user error is one line on stderr and exit code 2; no tracebacks for bad input.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from draftsmith.errors import DraftsmithError, disk_full, redact

STAGES = {
    "run": "Run every stage the recipe enables, in order: generate -> train -> eval.",
    "generate": "Data: the target regenerates every assistant turn of the recipe's prompts (or a drafter writes "
    "them: data.on_policy; or the dataset's replies are scored: data.responses=dataset) and stores "
    "tokens, loss mask and the teacher signals in data.signals (top-k log-probs, hidden states) plus "
    "optional SpecDec++ labels as safetensors shards in <out_dir>/data. Resumable: rerun after a kill. "
    "Data-parallel: torchrun --nproc_per_node N -m draftsmith generate RECIPE.",
    "train": "Train the recipe's drafter on <out_dir>/data; checkpoints go to <out_dir>/checkpoints.",
    "eval": "Speculative decoding with the trained drafter vs plain decoding: tau, acceptance, tokens/s, "
    "speedup and a token-for-token lossless check -> <out_dir>/eval/report.{json,md}.",
    "export": "Write the drafter for hubs and serving engines: --format hf (self-contained folder + model card), "
    "vllm (speculators format, EAGLE-1), sglang (EAGLE-3, EAGLE-1), medusa (TensorRT-LLM / TGI) or mlp-speculator "
    "(IBM's layout: vLLM / TGI), to --out (default "
    "<out_dir>/export/<format>); RECIPE may also be a checkpoint folder. --push-to-hub REPO uploads it "
    "(token from HF_TOKEN, never printed); --dry-run lists what would be uploaded.",
    "serve": "OpenAI-compatible HTTP server (chat/completions, streaming, /health, /metrics) on the bundled "
    "speculative decoder with the current drafter; records traffic and, with online.learn, keeps the "
    "drafter learning from it with versioned hot swaps (<out_dir>/online). Loopback by default.",
    "online": "The online-distillation learner fed by request logs (online.logs: growing JSONL files): updates "
    "the drafter with the train loop, publishes a new version only if its measured tau on held-out "
    "requests is higher, exports it. --rollback [VERSION] points the current version back.",
    "show": "Print the fully resolved recipe (after overrides) and the stages `run` would execute; runs nothing.",
    "sweep": "Pick a decoding threshold on held-out prompts: decodes the recipe's eval prompts with plain AR, every "
    "fixed draft length (--fixed), every stop-rule threshold (--thresholds, --min-lens) and every judge "
    "delta (--deltas, lossy), interleaved prompt by prompt; prints tau, waste, tokens/s and speedup per "
    "configuration and writes <out_dir>/eval/sweep.json with the best threshold. --oracle adds two "
    "oracle stop rules that bound what any stop rule can gain with this drafter.",
    "tree": "Medusa trees per node count (--nodes) from a heads, EAGLE or PARD run's logged per-position rank "
    "accuracies (its metrics.jsonl), with the expected tau of each, printed as eval.tree.choices "
    "overrides. --measure times the run's target verifying each size on this machine and chooses the tree with "
    "the most expected tokens per unit of step cost (Sequoia). RECIPE may also be a run folder.",
}

EPILOG = """\
RECIPE is a path to a YAML file or a recipe name: shipped (e.g. `quickstart`), or in a DRAFTSMITH_RECIPES folder.
Overrides are dotted keys: `draftsmith run quickstart train.steps=50 eval.draft_len=3 data.prompts.n=64`;
values are parsed as YAML (numbers, true/false, [lists]) and the recipe is re-validated.
Multi-GPU: accelerate launch -m draftsmith train RECIPE [overrides]
Environment: DRAFTSMITH_CACHE (model cache, default ~/.cache/draftsmith), DRAFTSMITH_RECIPES (more recipe
folders, separated like PATH), HF_HUB_OFFLINE=1 (no hub access).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="draftsmith",
        description="Train draft models for speculative decoding.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in STAGES.items():
        sp = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sp.add_argument("recipe", metavar="RECIPE", help="recipe YAML path or shipped recipe name")
        sp.add_argument(
            "overrides",
            nargs="*",
            metavar="KEY=VALUE",
            help="dotted recipe overrides, e.g. train.steps=100 (re-validated)",
        )
        sp.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
        if name == "sweep":
            from draftsmith.eval.sweep import add_arguments

            add_arguments(sp)
        if name == "tree":
            from draftsmith.eval.tree import add_arguments

            add_arguments(sp)
        if name == "online":
            sp.add_argument(
                "--rollback",
                nargs="?",
                const="",
                default=None,
                metavar="VERSION",
                help="make VERSION (default: the previous one) current and exit; a running server "
                "swaps to it before its next request",
            )
        if name == "export":
            sp.add_argument(
                "--format",
                choices=("hf", "vllm", "sglang", "medusa", "mlp-speculator"),  # export.writer.FORMATS
                default=None,
                help="export format (default: the recipe's export.formats, else hf)",
            )
            sp.add_argument("--out", default=None, help="output folder (default <out_dir>/export/<format>)")
            sp.add_argument(
                "--push-to-hub",
                metavar="REPO",
                default=None,
                help="upload the export to this hub repo (org/name); token from HF_TOKEN",
            )
            sp.add_argument("--dry-run", action="store_true", help="with --push-to-hub: list files, upload nothing")
            sp.add_argument(
                "--include-embeddings",
                action=argparse.BooleanOptionalAction,
                default=None,
                help="vllm/sglang EAGLE-3: write the input embeddings (default: export.include_embeddings, on)",
            )
    return p


def _version() -> str:
    from draftsmith import __version__

    return __version__


def dispatch(command: str, recipe) -> None:
    if command == "show":
        from draftsmith.recipes.loader import dump_recipe

        print(dump_recipe(recipe), end="")
        print(f"# stages for `run`: {' -> '.join(recipe.stages()) or '(none enabled)'}; out_dir: {recipe.run_dir}")
        return
    if command in ("generate", "run") and (command == "generate" or recipe.data.enabled):
        with _stage("generate", recipe):
            if recipe.data.judge_labels is not None:
                from draftsmith.data.judge import mine

                mine(recipe)
            else:
                from draftsmith.data.generate import generate

                generate(recipe)
    if command in ("train", "run") and (command == "train" or recipe.train.enabled):
        from draftsmith.train.loop import train

        with _stage("train", recipe):
            train(recipe)
    if command in ("eval", "run") and (command == "eval" or recipe.eval.enabled):
        from draftsmith.eval.bench import evaluate

        with _stage("eval", recipe):
            evaluate(recipe)
    if command == "run" and recipe.export.enabled:
        from draftsmith.export.writer import run_export_stage

        with _stage("export", recipe):
            for out in run_export_stage(recipe):
                print(f"export: {out}")


@contextmanager
def _stage(stage: str, recipe):
    """A stage that runs out of disk space ends in one line: where, what it kept, and that a rerun resumes."""
    try:
        yield
    except Exception as e:
        if not disk_full(e):
            raise
        raise DraftsmithError(_out_of_space(stage, recipe, e)) from None


def _out_of_space(stage: str, recipe, e: BaseException) -> str:
    """The message for a full disk, after removing this process's partial files (it frees space too; their names
    already mark them incomplete: ``*.tmp<pid>`` shards, ``*.tmp`` checkpoint folders)."""
    run = recipe.run_dir
    folder = {"generate": run / "data", "train": run / "checkpoints", "eval": run / "eval"}.get(stage, run)
    if getattr(e, "filename", None):
        folder = Path(e.filename).parent
    head = f"{stage}: out of disk space writing {folder}"
    if stage == "generate":
        for p in (run / "data").glob(f"*.tmp{os.getpid()}"):
            p.unlink(missing_ok=True)
        n = len(list((run / "data").glob("shard-*.safetensors")))
        return f"{head}; kept {n} finished shard{'s' * (n != 1)}; free space and rerun the same command to resume"
    if stage == "train":
        import shutil

        from draftsmith.train.state import latest_resumable

        if int(os.environ.get("RANK", "0")) == 0:  # only the main process writes checkpoints
            for p in (run / "checkpoints").glob("*.tmp"):
                shutil.rmtree(p, ignore_errors=True)
        last = latest_resumable(run / "checkpoints")
        kept = f"kept the checkpoint of step {int(last.name.split('-')[1])}" if last else "no checkpoint was complete"
        then = "resume from it" if last else "start over"
        return f"{head}; {kept}; free space and rerun the same command to {then}"
    return f"{head}; free space and rerun the same command (finished stages are kept)"


def _export(args, recipe) -> None:
    """`draftsmith export`: a recipe's checkpoint (or a checkpoint folder when recipe is None) in each format."""
    from draftsmith.export.writer import check_repo_id, checkpoint_of, export, push_to_hub

    ec = recipe.export if recipe is not None else None
    repo = args.push_to_hub or (ec.push_to_hub if ec else None)
    if repo:  # before anything is written or sent
        check_repo_id(repo, "--push-to-hub" if args.push_to_hub else "export.push_to_hub")
    ckpt = Path(args.recipe) if recipe is None else checkpoint_of(recipe)
    formats = [args.format] if args.format else (list(ec.formats) if ec else ["hf"])
    if args.out and len(formats) > 1:
        raise DraftsmithError(f"--out names one folder but the recipe exports {formats}: add --format")
    base = Path(ec.out) if ec and ec.out else (recipe.run_dir if recipe else ckpt.parent.parent) / "export"
    outs = [
        export(
            ckpt,
            f,
            Path(args.out) if args.out else base / f,
            recipe,
            args.include_embeddings if args.include_embeddings is not None else (ec.include_embeddings if ec else True),
        )
        for f in formats
    ]
    for out in outs:
        print(f"export: {out}")
    if repo:
        dry = args.dry_run or bool(ec and ec.dry_run)
        files = push_to_hub(outs[0], repo, dry_run=dry)
        for name, size in files:
            print(f"  {'would upload' if dry else 'uploaded'} {name} ({size:,} bytes) -> {repo}")


def _tree(args, run_dir: Path) -> None:
    from draftsmith.eval.tree import run_cli

    try:
        run_cli(args, run_dir)
    except json.JSONDecodeError as e:  # before ValueError, its base
        raise DraftsmithError(f"{run_dir / 'metrics.jsonl'}: not JSON lines ({e.msg})") from None
    except (OSError, ValueError) as e:
        raise DraftsmithError(str(e)) from None


_LEFT_A_GROUP = False


def _leave_process_group(ok: bool = True) -> None:
    global _LEFT_A_GROUP
    if "torch.distributed" in sys.modules:  # only a stage that imported torch can have joined a process group
        from draftsmith.runtime import shutdown_distributed

        _LEFT_A_GROUP = shutdown_distributed(ok) or _LEFT_A_GROUP


def entry() -> None:
    """The console script and ``python -m draftsmith``. A rank of a multi-process run exits without the
    interpreter's teardown: its work is written and its process group left, and gloo threads still referenced by
    the wrapped model can abort that teardown (SIGABRT), which the launcher would report as a failed run (seen
    in about 1 of 20 loaded two-process runs; pytorch/pytorch#179291 describes the cause)."""
    code = main()
    if _LEFT_A_GROUP:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may come after options (`run quickstart -q train.steps=3`): argparse leaves those over.
    bad = [a for a in extra if a.startswith("-") or "=" not in a]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides = [*args.overrides, *extra]
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr
    )
    for noisy in ("httpx", "urllib3", "filelock", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.command == "export" and (Path(args.recipe) / "drafter.json").is_file():
            if args.overrides:
                raise DraftsmithError("overrides apply to recipes; a checkpoint folder takes none")
            _export(args, None)  # a checkpoint folder: no recipe needed
            return 0
        if args.command == "tree" and (Path(args.recipe) / "metrics.jsonl").is_file():
            if args.overrides:
                raise DraftsmithError("overrides apply to recipes; a run folder takes none")
            _tree(args, Path(args.recipe))
            return 0
        from draftsmith.recipes.loader import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        if args.command == "export":  # reads the run folder; leaves its recipe.yaml as the run wrote it
            _export(args, recipe)
        elif args.command == "serve":
            from draftsmith.serving.server import serve

            serve(recipe)
        elif args.command == "online":
            from draftsmith.serving.online import online

            online(recipe, rollback=args.rollback)
        elif args.command == "sweep":
            from draftsmith.eval.sweep import run_cli

            run_cli(args, recipe)
        elif args.command == "tree":
            _tree(args, recipe.run_dir)
        else:
            dispatch(args.command, recipe)
    except DraftsmithError as e:
        print(f"draftsmith: error: {redact(str(e))}", file=sys.stderr)
        _leave_process_group(ok=False)
        return 2
    except Exception as e:  # a full disk in any command: one line, no traceback
        if not disk_full(e):
            raise
        print(
            f"draftsmith: error: {args.command}: out of disk space ({redact(str(e))}); free space and rerun",
            file=sys.stderr,
        )
        _leave_process_group(ok=False)
        return 2
    except KeyboardInterrupt:
        print("draftsmith: interrupted (finished shards and checkpoints are kept; rerun to resume)", file=sys.stderr)
        _leave_process_group(ok=False)
        return 130
    _leave_process_group()
    return 0
