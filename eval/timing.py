"""Timing for benchmarks: warm-up, repeats, CUDA synchronisation, median and spread, and side-by-side runs.

A shared machine speeds up and slows down while a benchmark runs, so absolute times drift; ratios between
callables survive when every callable sees the same drift. ``interleave`` runs the callables round-robin (one
repeat of each, then the next round), so a slow stretch hits all of them alike, and ``Timings.ratio`` compares
them round by round. ``Timings.note`` says which machine ran them and how much of its CPU time other processes
took meanwhile (eval/contention.py ``CpuShare``).

    t = interleave({"eager": lambda: model(x), "fused": lambda: fast(x)}, warmup=2, repeats=10, device="cuda")
    print(t["fused"], t.ratio("eager", "fused"))  # 1.230 ms (min 1.200, max 1.310, 10 repeats) 1.8
    print(t.note)  # machine: cuda (NVIDIA H100 ..., CUDA 12.4), 16 CPUs (x86_64), torch 2.5.1, 16 torch threads;
                   # other processes took 3% of the CPUs' time while timing

``time_call(fn, ...)`` is the same for one callable. ``measure`` replaces the wall clock by a duration the call
reports itself (e.g. ``lambda out: out[1].draft_time_s``): the repeats, order and statistics stay the same.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from draftsmith.eval.contention import CpuShare


def sync(device: str | torch.device | None) -> None:
    """Wait for queued CUDA work on ``device``; nothing on any other device."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Seconds per call of one callable, one entry per repeat (warm-up calls excluded)."""

    name: str
    times: list[float] = field(default_factory=list)
    last: Any = None  # what the last timed call returned

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    @property
    def spread(self) -> float:
        """(max - min) / median: 0.05 means the repeats lay within 5% of the median's size."""
        return (self.max - self.min) / self.median if self.median else 0.0

    def __str__(self) -> str:
        return (
            f"{self.median * 1e3:.3f} ms (min {self.min * 1e3:.3f}, max {self.max * 1e3:.3f}, "
            f"{len(self.times)} repeats)"
        )


class Timings(dict):
    """``name -> Timing`` for callables timed side by side, with the machine note of the run."""

    device: str = "cpu"
    other_cpu: float | None = None  # share of all CPUs' time other processes used while timing (None: unknown)

    def ratio(self, a: str, b: str) -> float:
        """Median over rounds of time(a) / time(b): each round's pair saw the same machine."""
        return statistics.median(x / y for x, y in zip(self[a].times, self[b].times))

    @property
    def note(self) -> str:
        return machine_note(self.device, self.other_cpu)


def machine(device: str | torch.device = "cpu") -> str:
    """One line naming the machine that runs on ``device``: accelerator, CPU count, torch version and threads."""
    device = torch.device(device)
    threads = torch.get_num_threads()
    host = (
        f"{os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, "
        f"{threads} torch thread{'' if threads == 1 else 's'}"
    )
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}), {host}"
    return f"{device.type}, {host}"


def machine_note(device: str | torch.device = "cpu", other_cpu: float | None = None) -> str:
    """``machine: ...; other processes took N% of the CPUs while timing`` (how contended the numbers are)."""
    other = "unknown" if other_cpu is None else f"{other_cpu:.0%}"
    return f"machine: {machine(device)}; other processes took {other} of the CPUs' time while timing"


def interleave(
    fns: Mapping[str, Callable[[], Any]],
    *,
    warmup: int = 1,
    repeats: int = 5,
    number: int = 1,
    device: str | torch.device | None = "cpu",
    measure: Callable[[Any], float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Timings:
    """Time several callables side by side.

    ``warmup`` untimed rounds, then ``repeats`` timed rounds; in each round every callable runs ``number`` times
    in a row, in the mapping's order (round-robin). A repeat's time is the time of those ``number`` calls divided
    by ``number``; on a CUDA ``device`` the clock reads only after ``torch.cuda.synchronize``. With ``measure``,
    a repeat's time is the mean of ``measure(result)`` over its calls instead of the clock. The run is metered
    with ``CpuShare`` (``Timings.other_cpu``, ``Timings.note``).
    """
    if repeats < 1 or number < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1, number >= 1, warmup >= 0; got {repeats}, {number}, {warmup}")
    out = Timings({name: Timing(name) for name in fns})
    out.device = str(device or "cpu")
    meter = CpuShare().start()
    for _ in range(warmup):
        for fn in fns.values():
            for _ in range(number):
                fn()
    sync(device)
    for _ in range(repeats):
        for name, fn in fns.items():
            t = out[name]
            sync(device)
            t0, total = clock(), 0.0
            for _ in range(number):
                t.last = fn()
                if measure is not None:
                    total += measure(t.last)
            sync(device)
            t.times.append((total if measure is not None else clock() - t0) / number)
    out.other_cpu = meter.stop()
    return out


def time_call(fn: Callable[[], Any], *, name: str = "call", **options) -> Timing:
    """``interleave`` for one callable (``options``: its keywords) -> its ``Timing``."""
    return interleave({name: fn}, **options)[name]
