"""Shared by the kernel files: whether Triton is importable, and which implementation a call runs.

``impl``: "auto" runs the Triton kernel on CUDA tensors and the PyTorch reference elsewhere; "triton" forces the
kernel (on CPU it needs TRITON_INTERPRET=1 set before triton is imported: the tests do this); "reference" forces
the reference.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # triton is an optional extra: every kernel has a PyTorch reference
    triton = tl = None
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pick_impl(impl: str, x: torch.Tensor) -> str:
    if impl not in ("auto", "triton", "reference"):
        raise ValueError(f"impl must be auto, triton or reference, got {impl!r}")
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("impl='triton' needs the triton package: pip install 'draftsmith[triton]'")
        if not x.is_cuda and not INTERPRET:
            raise RuntimeError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")
        return "triton"
    if impl == "auto" and HAS_TRITON and x.is_cuda:
        return "triton"
    return "reference"
