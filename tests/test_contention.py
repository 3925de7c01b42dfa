"""The eval's contention meter (eval/contention.py): it sees another process's CPU use and stays quiet otherwise."""

import os
import subprocess
import sys
import time

import pytest

from draftsmith.eval import contention
from draftsmith.eval.contention import CpuShare
from draftsmith.eval.report import shared_warning

pytestmark = pytest.mark.skipif(not contention._STAT.is_file(), reason="needs Linux /proc/stat")


def _spin(seconds: float) -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pass


def test_meter_sees_a_busy_neighbour():
    neighbour = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 2.5: pass"]
    )
    try:
        time.sleep(0.3)  # let it start spinning
        with CpuShare() as shared:
            time.sleep(1.5)
    finally:
        neighbour.wait()
    # One spinning process is one CPU's worth out of os.cpu_count(); other test workers can only add to it (and
    # take part of a CPU from it on a loaded 2-core machine, hence 0.4 rather than 1).
    assert 0.0 <= shared.other <= 1.0
    assert shared.other >= 0.4 / (os.cpu_count() or 1)


def test_meter_subtracts_our_own_cpu_time(monkeypatch):
    """The arithmetic, on fixed readings (a live check would depend on what else the machine runs): over 2 s of
    wall time on 2 CPUs the machine used 3 CPU-seconds, 1.5 of them ours, so others used 1.5 / 4."""
    from types import SimpleNamespace

    readings = {"busy": iter([100.0, 103.0]), "own": iter([10.0, 11.5]), "clock": iter([50.0, 52.0])}
    monkeypatch.setattr(contention, "_busy_s", lambda: next(readings["busy"]))
    monkeypatch.setattr(contention, "_own_s", lambda: next(readings["own"]))
    monkeypatch.setattr(contention, "time", SimpleNamespace(perf_counter=lambda: next(readings["clock"])))
    monkeypatch.setattr(contention.os, "cpu_count", lambda: 2)
    assert CpuShare().start().stop() == pytest.approx(0.375)


def test_meter_reports_none_without_proc_stat(monkeypatch, tmp_path):
    monkeypatch.setattr(contention, "_STAT", tmp_path / "missing")
    with CpuShare() as m:
        pass
    assert m.other is None


def test_shared_warning_only_above_the_threshold():
    assert shared_warning({"machine": {"other_cpu_share": 0.05}}) is None
    assert shared_warning({"machine": {"other_cpu_share": None}}) is None
    assert shared_warning({}) is None  # reports written before the meter existed
    assert "45%" in shared_warning({"machine": {"other_cpu_share": 0.45}})
