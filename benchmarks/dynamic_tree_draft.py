"""Dynamic-tree drafting: the on-device version (eval/tree_decoder.py) against the list-based one it replaced, on a
tiny drafter where Python and host syncs, not the model, set the cost (the regime of a GPU drafter).

    python benchmarks/dynamic_tree_draft.py [--old-rev 4c6937a | --old-dir DIR] [--device cpu]

The list-based version is read from git (``--old-rev``, the last commit that had it) into a temporary folder.
Checks that both give the same tree, then prints ms per 48-node tree (top-k 8, depth 6): five interleaved rounds
of 20 trees each.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_old(rev: str, folder: Path, old_dir: str | None = None):
    for name in ("decoder", "tree"):
        if old_dir:  # a copy of that commit's eval/ files, for machines without the git history (a lent GPU)
            src = (Path(old_dir) / f"{name}.py").read_text()
        else:
            src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:eval/{name}.py"], check=True,
                                 capture_output=True, text=True).stdout
        src = src.replace("from draftsmith.eval.tree import (", "from old_tree import (")
        (folder / f"old_{name}.py").write_text(src)
    sys.path.insert(0, str(folder))
    import old_decoder
    import old_tree
    return old_decoder, old_tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-rev", default="4c6937a", help="a commit with the list-based _draft_dynamic")
    ap.add_argument("--old-dir", default=None, help="read decoder.py and tree.py from this folder instead of git")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--profile", action="store_true", help="also profile the on-device version (op/launch counts)")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from test_decoder import _model

    from draftsmith.eval import tree_decoder as new  # _draft_dynamic, and the _Drafting it imports
    from draftsmith.eval.tree import DynamicTree

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        old, old_tree = load_old(a.old_rev, Path(tmp), a.old_dir)
        drafter = _model(3).float().to(a.device)
        prompt = torch.arange(1, 30, device=a.device)
        cur = torch.tensor([3], device=a.device)
        specs = {old: old_tree.DynamicTree(8, 6, 48), new: DynamicTree(8, 6, 48)}

        def trees(mod, n: int):
            run = mod._Drafting(drafter, 1024, prompt, None)
            out = None
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(n):
                out = mod._draft_dynamic(run, cur, specs[mod])
                run.commit(prompt[:0], None)  # back to the root: the next tree drafts from the same state
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            return (time.perf_counter() - t) / n * 1e3, out

        with torch.no_grad():
            (_, (tok_old, par_old)), (_, (tok_new, par_new, _, _)) = trees(old, 1), trees(new, 1)
            assert tok_old.tolist() == tok_new.tolist() and par_old == par_new.tolist(), "the trees differ"
            res = {"list-based": [], "on-device": []}
            for _ in range(5):
                res["list-based"].append(trees(old, 20)[0])
                res["on-device"].append(trees(new, 20)[0])
        if a.profile:
            with torch.no_grad():
                profile(new, drafter, prompt, cur, specs[new], a.device)
    for k, v in res.items():
        print(f"{k:<11} ms per tree: " + " ".join(f"{x:.2f}" for x in v) + f"   (min {min(v):.2f})")
    print(f"on-device / list-based (min over rounds): {min(res['on-device']) / min(res['list-based']):.2f}")


def profile(mod, drafter, prompt, cur, spec, device: str, n: int = 10) -> None:
    """Where a tree's time goes: operator and launch counts per tree, device time against wall time, for the
    drafter as is (eager) and wrapped for CUDA-graph replay (eval/graphs.py), as the eval decoder runs it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    from draftsmith.eval.graphs import graph_decoding

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    for name, d in (("eager drafter", drafter), ("graphed drafter", graph_decoding(drafter, 1024))):
        run = mod._Drafting(d, 1024, prompt, None)
        for _ in range(3):  # warm-up (captures the graphs)
            mod._draft_dynamic(run, cur, spec)
            run.commit(prompt[:0], None)
        with prof(activities=acts) as p:
            t = time.perf_counter()
            for _ in range(n):
                mod._draft_dynamic(run, cur, spec)
                run.commit(prompt[:0], None)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / n * 1e3
        ev = p.key_averages()
        count = {e.key: e.count for e in ev}
        aten = sum(e.count for e in ev if e.key.startswith("aten::"))
        launches = sum(v for k, v in count.items() if k in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                            "cudaLaunchKernelExC"))
        syncs = sum(v for k, v in count.items() if "Synchronize" in k or k.startswith("cudaMemcpy"))
        replays = sum(v for k, v in count.items() if k in ("cudaGraphLaunch",))
        dev_ms = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA") / 1e3 / n
        print(f"[profile, {name}] per tree: {wall:.2f} ms wall (under the profiler), {dev_ms:.2f} ms device, "
              f"{aten / n:.0f} aten ops, {launches / n:.0f} kernel launches, {replays / n:.0f} graph replays, "
              f"{syncs / n:.1f} syncs/copies")
        print(ev.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


if __name__ == "__main__":
    main()
