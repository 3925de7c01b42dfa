"""What verifying a checksum costs next to loading the file it guards (draftsmith/integrity.py).

Writes a SmolLM2-135M-sized checkpoint of random float32 tensors (30 tensors, 540 MB by default) to a temporary
folder, then times, best of ``--repeats``, with the file in the page cache (warm) and after dropping it from the page
cache (cold, ``posix_fadvise``): loading it into preallocated tensors
(``load_file`` + copy, what ``load_state_dict`` does), draftsmith's streamed sha256 (``sha256_file``, the check
every load runs), and, for comparison, streamed blake2b and zlib.crc32. Prints each time and its ratio to the
load, then the machine and the load average around the run (other processes share the CPU).

    python benchmarks/experiments/checksum_cost.py [--params 135e6 --repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import tempfile
import time
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.integrity import sha256_file


def _stream(path: Path, update) -> None:
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            update(view[:n])


def blake2b(path: Path) -> str:
    h = hashlib.blake2b(digest_size=32)
    _stream(path, h.update)
    return h.hexdigest()


def crc32(path: Path) -> int:
    c = 0

    def update(b):
        nonlocal c
        c = zlib.crc32(b, c)

    _stream(path, update)
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=135e6)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    n = int(a.params) // 30
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "model.safetensors"
        save_file({f"w{i:02d}": torch.randn(n) for i in range(30)}, str(path))
        dst = {f"w{i:02d}": torch.empty(n) for i in range(30)}

        def load():
            for k, v in load_file(str(path)).items():
                dst[k].copy_(v)

        def best(fn, cold: bool) -> float:
            times = []
            for _ in range(a.repeats):
                if cold:  # drop this file's pages from the page cache (only this file's)
                    fd = os.open(path, os.O_RDONLY)
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times)

        size = path.stat().st_size
        print(f"file {size / 1e6:.0f} MB, best of {a.repeats}; warm: in the page cache, cold: read from disk")
        for cold in (False, True):
            t_load = best(load, cold)
            print(f"{'cold' if cold else 'warm'} load_file + copy     {t_load:.3f} s")
            for name, fn in (("sha256 (draftsmith)", sha256_file), ("blake2b", blake2b), ("crc32", crc32)):
                t = best(lambda fn=fn: fn(path), cold)
                print(
                    f"{'cold' if cold else 'warm'} {name:20s} {t:.3f} s  ({t / t_load:.2f}x the load, "
                    f"{size / t / 1e9:.2f} GB/s)"
                )
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after"
    )


if __name__ == "__main__":
    main()
