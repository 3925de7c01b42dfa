"""How much of the machine other processes used while we timed: speedups in our reports are same-process ratios
and survive a shared machine, but tokens/s do not, and a shared 2-core VM silently halves them (it happened to
rows of benchmarks/RESULTS.md). Linux only (/proc/stat); elsewhere the meter reports None.

    with CpuShare() as meter:
        ...timed work...
    meter.other  # fraction of all CPUs' time spent by other processes, 0..1 (or meter.start() ... meter.stop())
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_STAT = Path("/proc/stat")


def _busy_s() -> float | None:
    """Seconds of CPU time all processes have used since boot (user + nice + system + irq + softirq + steal)."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    t = os.times()  # this process and its threads (children are not ours to count: none run during timing)
    return t.user + t.system


class CpuShare:
    """Context manager: ``other`` = (machine CPU time - this process's) / (wall time x CPU count), clipped to 0..1."""

    def __init__(self):
        self.other: float | None = None

    def start(self) -> CpuShare:
        self._t0, self._busy0, self._own0 = time.perf_counter(), _busy_s(), _own_s()
        return self

    def stop(self) -> float | None:
        busy = _busy_s()
        wall = time.perf_counter() - self._t0
        if busy is None or self._busy0 is None or wall <= 0:
            return None
        others = (busy - self._busy0) - (_own_s() - self._own0)
        self.other = min(1.0, max(0.0, others / (wall * (os.cpu_count() or 1))))
        return self.other

    def machine(self) -> dict:
        """The reports' ``machine`` entry: CPU count, torch threads and the measured share (None before stop)."""
        import torch

        return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "other_cpu_share": self.other}

    def __enter__(self) -> CpuShare:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
