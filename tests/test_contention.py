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


def test_meter_sees_a_busy_neighbour_and_not_our_own_work():
    with CpuShare() as alone:
        _spin(1.0)  # our own CPU time is subtracted
    neighbour = subprocess.Popen([sys.executable, "-c",
                                  "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 2.5: pass"])
    try:
        time.sleep(0.3)  # let it start spinning
        with CpuShare() as shared:
            time.sleep(1.5)
    finally:
        neighbour.wait()
    # Other test workers may load the machine too, so the checks hold whatever else runs. One spinning process
    # is one CPU's worth out of os.cpu_count(): the neighbour alone lifts the reading that far.
    n = os.cpu_count() or 1
    assert 0.0 <= alone.other <= 1.0 and 0.0 <= shared.other <= 1.0
    assert shared.other >= 0.6 / n
    # Our own spinning is not counted: it holds one CPU, so others can have used at most the rest.
    assert alone.other <= (n - 1) / n + 0.1


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
