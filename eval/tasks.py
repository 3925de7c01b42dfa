"""Tasks with checkable outcomes, for judge labels (data/judge.py) and task accuracy in eval.

- ``humaneval``: the packaged HumanEval problems (or a file of the same form). The outcome is whether the
  completion passes the problem's unit tests, run in a separate Python process (``python -I`` in an empty
  temporary folder, a minimal environment, CPU-time, memory and file-size limits, a wall-clock timeout, and its
  whole process group killed when the check ends). Generated code is untrusted: it never runs inside this
  process, but that process is not a sandbox: it runs as the user, can read and write their files and reach the
  network. Only recipes that set ``data.judge_labels`` (tasks humaneval) or ``eval.judge.tasks: humaneval`` run it.
- ``gsm8k``: a JSON-lines file of ``{"question", "answer"}`` records in GSM8K's form (the answer ends with
  ``#### <number>``). The outcome is the final number of the response.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import DraftsmithError
from draftsmith.eval.prompts import iter_jsonl, package_file

KINDS = ("humaneval", "gsm8k")


@dataclass
class Task:
    id: str
    kind: str
    messages: list[dict]
    data: dict = field(default_factory=dict)


def load_tasks(kind: str, path: str | None = None, n: int | None = None, start: int = 0) -> list[Task]:
    """Tasks ``start .. start + n`` of the file (all from ``start`` when n is None): mine judge labels on one range
    and evaluate on another."""
    if kind not in KINDS:
        raise DraftsmithError(f"unknown task kind {kind!r}; expected one of {', '.join(KINDS)}")
    if kind == "gsm8k" and not path:
        raise DraftsmithError('gsm8k tasks need a path: a JSONL file of {"question", "answer"} records')
    file = Path(path) if path else package_file("humaneval")
    tasks = []
    try:
        rows = iter_jsonl(file)  # one-line errors name the file and line
        for index, (_, rec, where) in enumerate(rows):
            if index < start:
                continue
            tasks.append(_task(kind, rec, f"{file} {where}", index))
            if n is not None and len(tasks) >= n:
                rows.close()
                break
    except FileNotFoundError:
        raise DraftsmithError(f"tasks file {file}: not found") from None
    if not tasks:
        raise DraftsmithError(f"tasks file {file}: no tasks" + (f" from index {start}" if start else ""))
    return tasks


def _task(kind: str, rec: dict, where: str, index: int) -> Task:
    need = ("prompt", "test", "entry_point") if kind == "humaneval" else ("question", "answer")
    missing = [k for k in need if not isinstance(rec.get(k), str)]
    if missing:
        raise DraftsmithError(f"{where}: a {kind} record needs string field(s) {', '.join(missing)}")
    if kind == "humaneval":
        code = rec["prompt"] if rec["prompt"].endswith("\n") else rec["prompt"] + "\n"
        turn = f"Complete the following Python function:\n\n```python\n{code}```"  # as eval/prompts.py words it
        return Task(
            str(rec.get("task_id", index)), kind, [{"role": "user", "content": turn}], {k: rec[k] for k in need}
        )
    return Task(
        str(rec.get("id", index)), kind, [{"role": "user", "content": rec["question"]}], {"answer": rec["answer"]}
    )


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str:
    """The last number of a response (after '####' when present), commas dropped; '' when there is none."""
    tail = text.rsplit("####", 1)[-1]
    nums = _NUMBER.findall(tail) or _NUMBER.findall(text)
    if not nums:
        return ""
    x = nums[-1].replace(",", "")
    return x[:-2] if x.endswith(".0") else x


def extract_code(task: Task, text: str) -> str:
    """The program a response stands for: its first fenced code block (or the whole text), prefixed by the
    problem's prompt when it does not define the entry point itself, else by the prompt's imports (a model that
    restates ``def f(xs: List[int])`` rarely restates ``from typing import List``)."""
    m = re.search(r"```(?:python|py)?\n(.*?)(?:```|$)", text, re.S)
    code = m.group(1) if m else text
    if f"def {task.data['entry_point']}" not in code:
        return task.data["prompt"] + code
    imports = [ln for ln in task.data["prompt"].splitlines() if re.match(r"(import|from)\s+\w", ln)]
    return "\n".join(imports) + "\n" + code if imports else code


def _limits(cpu_s: int, mem_bytes: int):
    def apply():  # runs in the child before exec (POSIX)
        import resource

        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    return apply


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child and everything it spawned. The child leads its own session, so its process group holds its
    descendants unless they left it on purpose; on a timeout *and* on a normal exit, a background process the
    generated code started must not outlive the check."""
    if os.name == "posix":
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is already gone
            pass
    else:
        proc.kill()
    proc.wait()


def run_tests(task: Task, text: str, timeout: float = 10.0) -> bool:
    """True when the response's code passes the task's tests in an isolated subprocess."""
    program = f"{extract_code(task, text)}\n\n{task.data['test']}\n\ncheck({task.data['entry_point']})\n"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "solution.py"
        src.write_text(program)
        # No pipes: a grandchild holding one open would keep a read (and this check) waiting past the timeout.
        proc = subprocess.Popen(
            [sys.executable, "-I", str(src)],
            cwd=tmp,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"},
            start_new_session=True,
            preexec_fn=_limits(int(timeout) + 1, 1 << 30) if os.name == "posix" else None,
        )
        try:
            return proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            return False
        finally:
            _kill_group(proc)


def outcome(task: Task, text: str, timeout: float = 10.0) -> str:
    """The task outcome a judge label compares: 'pass' / 'fail' (humaneval) or the final answer (gsm8k)."""
    if task.kind == "humaneval":
        return "pass" if run_tests(task, text, timeout) else "fail"
    return final_answer(text)


def outcome_correct(task: Task, result: str) -> bool:
    """Whether an ``outcome`` is right: the tests passed (humaneval) or the final answer is the reference's."""
    if task.kind == "humaneval":
        return result == "pass"
    return result != "" and result == final_answer(task.data["answer"])


def correct(task: Task, text: str, timeout: float = 10.0) -> bool:
    """Task accuracy: tests pass (humaneval) or the final answer equals the reference's (gsm8k)."""
    return outcome_correct(task, outcome(task, text, timeout))
