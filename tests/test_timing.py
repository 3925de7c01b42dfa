"""The benchmarks' timing helper (eval/timing.py) on a fake clock: round-robin order, warm-up exclusion, per-call
division, medians and paired ratios, reported durations, and CUDA synchronisation only on a CUDA device."""

from __future__ import annotations

import pytest
import torch

from draftsmith.eval import timing
from draftsmith.eval.timing import Timing, interleave, machine_note, time_call


class Clock:
    """A clock that only moves when a timed callable says how long it took; every event is logged."""

    def __init__(self):
        self.now, self.log = 0.0, []

    def __call__(self) -> float:
        self.log.append("clock")
        return self.now

    def job(self, name: str, durations):
        """A callable that logs its name and advances the clock by the next of ``durations`` (the last repeats)."""
        left = list(durations)

        def fn():
            self.log.append(name)
            self.now += left.pop(0) if len(left) > 1 else left[0]
            return name

        return fn


def calls(log: list[str]) -> list[str]:
    return [e for e in log if e not in ("clock", "sync")]


def test_round_robin_order_with_warmup_and_number():
    c = Clock()
    interleave({"a": c.job("a", [1]), "b": c.job("b", [1])}, warmup=1, repeats=2, number=2, clock=c)
    assert calls(c.log) == ["a", "a", "b", "b"] * 3  # one warm-up round, then two timed rounds, a before b


def test_warmup_calls_are_not_timed():
    c = Clock()
    t = interleave({"a": c.job("a", [100, 100, 2, 4, 3])}, warmup=2, repeats=3, clock=c)
    assert t["a"].times == [2, 4, 3]
    assert c.log[:2] == ["a", "a"]  # the clock is not read during warm-up


def test_number_divides_and_statistics():
    c = Clock()
    t = time_call(c.job("a", [5, 5, 1, 1, 3, 3]), warmup=0, repeats=3, number=2, clock=c, name="a")
    assert isinstance(t, Timing) and t.name == "a" and t.last == "a"
    assert t.times == [5, 1, 3]
    assert (t.median, t.min, t.max) == (3, 1, 5)
    assert t.spread == pytest.approx(4 / 3)
    assert "3000.000 ms" in str(t) and "3 repeats" in str(t)


def test_ratio_is_the_median_of_paired_rounds():
    c = Clock()
    # Round 2 is slow for both (a shared machine): the paired ratio stays 2, the ratio of medians would not.
    t = interleave({"a": c.job("a", [2, 20, 2, 4]), "b": c.job("b", [1, 10, 1, 1])}, warmup=0, repeats=4, clock=c)
    assert t["a"].times == [2, 20, 2, 4] and t["b"].times == [1, 10, 1, 1]
    assert t.ratio("a", "b") == pytest.approx(2.0)
    assert t.ratio("b", "a") == pytest.approx(0.5)


def test_measure_replaces_the_clock():
    c = Clock()
    seconds = iter([0.5, 0.1, 0.2, 0.3])
    t = interleave({"a": lambda: next(seconds)}, warmup=1, repeats=3, measure=lambda out: out, clock=c)
    assert t["a"].times == [0.1, 0.2, 0.3]  # the warm-up call's 0.5 is left out
    assert t["a"].last == 0.3


@pytest.mark.parametrize("device,synced", [("cpu", False), (None, False), ("cuda", True), ("cuda:0", True)])
def test_cuda_sync_only_on_cuda(monkeypatch, device, synced):
    c = Clock()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: c.log.append("sync"))
    interleave({"a": c.job("a", [1]), "b": c.job("b", [1])}, warmup=1, repeats=2, device=device, clock=c)
    if not synced:
        assert "sync" not in c.log
        return
    # After the warm-up; then around every timed call: queued work finishes before the clock starts and stops.
    one = ["sync", "clock", "a", "sync", "clock", "sync", "clock", "b", "sync", "clock"]
    assert c.log == ["a", "b", "sync"] + one * 2


def test_sync_helper(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(device))
    timing.sync("cpu")
    timing.sync(torch.device("cpu"))
    timing.sync(None)
    assert seen == []
    timing.sync("cuda:0")
    assert seen == ["cuda:0"]


def test_note_names_the_machine_and_the_contention(monkeypatch):
    readings = iter([0.25])
    monkeypatch.setattr(timing.CpuShare, "stop", lambda self: next(readings))
    t = interleave({"a": lambda: None}, warmup=0, repeats=1)
    assert t.other_cpu == 0.25
    assert t.note.startswith("machine: cpu, ") and "torch threads" in t.note and "took 25% of the CPUs" in t.note
    assert "unknown" in machine_note("cpu", None)


@pytest.mark.parametrize("kw", [{"repeats": 0}, {"number": 0}, {"warmup": -1}])
def test_rejects_empty_runs(kw):
    with pytest.raises(ValueError):
        interleave({"a": lambda: None}, **kw)
