"""Model FLOPs and utilisation: how far a stage runs below the hardware.

- ``count_flops(fn)``: the floating-point operations one call does, counted by PyTorch's ``FlopCounterMode`` on the
  operations it dispatches (matmuls, attention, convolutions; forward and, when ``fn`` calls backward, backward).
  Elementwise work is not counted, as in the usual model-FLOPs-utilisation (MFU) definition.
- ``peak_flops(device, dtype)``: the dense peak those FLOPs are measured against. A GPU the table below knows gets
  its vendor figure (dense, no sparsity); any other device gets a measured one: the best of a few large square
  matmuls in that dtype, which is what the hardware actually sustains on this machine (``source`` says which).
- ``Meter``: FLOPs per token from one counted step, then TFLOP/s and MFU for any number of tokens per second.
- ``HostOps``: what a step costs the host rather than the device: the kernels it launches and the places where the
  host waits for the device (syncs), counted on any machine (no GPU needed), per named phase.

A counted call runs slower than a normal one (the counter sits in every dispatch), so a stage counts one call and
reuses the figure: per token, which holds while the shapes (sequence lengths, batch) stay comparable.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Dense tensor-core peaks (FLOP/s) from the vendors' data sheets, by a substring of the device name, for the dtypes
# a stage runs in; float32 means TF32 on these cards (PyTorch's default for matmuls there is full fp32, so a fp32
# stage is reported against the TF32 figure, which flatters no one).
GPU_PEAKS: list[tuple[str, dict[torch.dtype, float]]] = [
    ("H200", {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494e12}),
    ("H100 PCIe", {torch.bfloat16: 756e12, torch.float16: 756e12, torch.float32: 378e12}),
    ("H100 NVL", {torch.bfloat16: 835e12, torch.float16: 835e12, torch.float32: 418e12}),
    ("H100", {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494e12}),  # SXM
    ("A100", {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 156e12}),
    ("L40S", {torch.bfloat16: 362e12, torch.float16: 362e12, torch.float32: 183e12}),
    ("L4", {torch.bfloat16: 121e12, torch.float16: 121e12, torch.float32: 60e12}),
    ("A10G", {torch.bfloat16: 70e12, torch.float16: 70e12, torch.float32: 35e12}),
]


def count_flops(fn, *args, **kwargs) -> tuple[int, object]:
    """(FLOPs of ``fn(*args, **kwargs)``, its result)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        out = fn(*args, **kwargs)
    return int(fc.get_total_flops()), out


@functools.cache
@torch.no_grad()
def measured_peak(device: str | torch.device, dtype: torch.dtype, n: int | None = None, reps: int = 3) -> float:
    """The best FLOP/s of ``reps`` (n x n) @ (n x n) matmuls in ``dtype`` on ``device`` (after one warm-up)."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 1024)
    g = torch.Generator(device=device).manual_seed(0)  # its own: a training run's random streams stay untouched
    a = torch.randn(n, n, device=device, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, generator=g).to(dtype)
    best = float("inf")
    for i in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first is the warm-up
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: str | torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(dense peak FLOP/s for ``dtype`` on ``device``, where the figure comes from)."""
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAKS:
            if key in name and dtype in peaks:
                return peaks[dtype], f"{name} data sheet, dense {str(dtype).removeprefix('torch.')}"
    return measured_peak(device, dtype), f"measured: best large {str(dtype).removeprefix('torch.')} matmul"


@dataclass
class Meter:
    """Utilisation from a FLOPs-per-token figure: ``flops_per_token`` (one counted step's FLOPs over its tokens)
    against ``peak`` FLOP/s."""

    flops_per_token: float
    peak: float
    peak_source: str = ""

    @classmethod
    def from_step(cls, flops: int, tokens: int, device, dtype) -> Meter:
        peak, source = peak_flops(device, dtype)
        return cls(flops / max(1, tokens), peak, source)

    def tflops(self, tokens_per_s: float) -> float:
        return self.flops_per_token * tokens_per_s / 1e12

    def mfu(self, tokens_per_s: float) -> float:
        return self.flops_per_token * tokens_per_s / self.peak


_ATEN = torch.ops.aten
_NO_KERNEL = {_ATEN.empty.memory_format, _ATEN.empty_strided.default, _ATEN.lift_fresh.default}
_INDEXING = {_ATEN.index.Tensor, _ATEN.index_put_.default, _ATEN.index_put.default}


class HostOps(TorchDispatchMode):
    """Counts, per named phase (``phase``), the kernels a region launches on a GPU and its host syncs, and times
    the phases' host seconds (with or without the counting active: ``with ops.counting(): ...``).

    Kernels: every ATen call that is not a view or a bare allocation (on a GPU each launches at least one).
    Syncs: calls whose result the host must wait for on a GPU: ``.item()``/``int()``/``float()``/``bool()``
    (``_local_scalar_dense``), ops whose output shape depends on the data (``nonzero``, ``masked_select``, ...,
    indexing with a boolean mask), and ``.tolist()`` / ``.cpu()`` calls, counted as called (on a CPU tensor they
    copy nothing; the count says what the same code does to device data). ``what``: (phase, op) -> syncs."""

    def __init__(self):
        super().__init__()
        self.kernels: Counter = Counter()
        self.syncs: Counter = Counter()
        self.seconds: Counter = Counter()
        self.what: Counter = Counter()
        self.where = "step"
        self._quiet = 0

    @contextlib.contextmanager
    def phase(self, name: str):
        prev, self.where = self.where, name
        t0 = time.perf_counter()
        try:
            yield self
        finally:
            dt = time.perf_counter() - t0
            self.seconds[name] += dt
            self.seconds[prev] -= dt  # an enclosing phase's time excludes this one
            self.where = prev

    def in_phase(self, name: str, fn):
        """``fn`` wrapped so that each call runs in phase ``name`` (e.g. ``opt.step = ops.in_phase("optimizer",
        opt.step)``)."""

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        return wrapped

    @contextlib.contextmanager
    def one_kernel(self):
        """Count the block as one kernel (what a fused GPU kernel does in one launch, where the code runs a CPU
        reference of several ops instead)."""
        self.kernels[self.where] += 1
        self._quiet += 1
        try:
            yield self
        finally:
            self._quiet -= 1

    def sync(self, op: str) -> None:
        self.syncs[self.where] += 1
        self.what[(self.where, op)] += 1

    @contextlib.contextmanager
    def counting(self):
        """Count inside the block (``.tolist()`` and ``.cpu()`` included)."""
        tolist, cpu = torch.Tensor.tolist, torch.Tensor.cpu

        def counted_tolist(t):
            self.sync("tolist")
            return tolist(t)

        def counted_cpu(t, *a, **k):
            self.sync("cpu")
            return cpu(t, *a, **k)

        torch.Tensor.tolist, torch.Tensor.cpu = counted_tolist, counted_cpu
        try:
            with self:
                yield self
        finally:
            torch.Tensor.tolist, torch.Tensor.cpu = tolist, cpu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view and func not in _NO_KERNEL and not self._quiet:
            self.kernels[self.where] += 1
        if torch.Tag.data_dependent_output in func.tags:
            self.sync(func.overloadpacket.__name__)
        elif func in _INDEXING:
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in idx):
                self.sync(func.overloadpacket.__name__ + "[bool]")
        elif torch.Tag.dynamic_output_shape in func.tags:
            self.sync(func.overloadpacket.__name__)
        return func(*args, **kwargs)
