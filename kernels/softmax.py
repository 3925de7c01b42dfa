"""Row softmax pieces for the fused KD-loss path (train/losses.py): two memory-bound passes over a (N, V) logits
chunk, so that a loss on a stored top-k teacher (or CE) never materialises log-softmax, its gradient or an fp32
copy of the chunk.

- ``row_logsumexp(z)`` -> (N,) fp32: one online max / sum-exp pass per row.
- ``softmax_scale_(z, lse, coef)``: in place, z <- exp(z - lse) * coef, i.e. coef * softmax(z) per row. With
  coef = -sum_k g_k this is the dense part of d loss / d z for any loss of the log-probs at K ids (see
  ``head_loss``); the K sparse terms are added afterwards with one scatter.

Each takes ``impl``: "auto" (Triton on CUDA, the PyTorch reference elsewhere), "triton" (also on CPU under
TRITON_INTERPRET=1, for tests) or "reference". Both compute in fp32 whatever z's dtype.
"""

from __future__ import annotations

import torch

from draftsmith.kernels.launch import HAS_TRITON, pick_impl, tl, triton

_ROWS = 64  # reference: rows per block, so a bf16 chunk is upcast 64 rows at a time, never whole


def row_logsumexp_reference(z: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.logsumexp(z[r : r + _ROWS].float(), -1) for r in range(0, z.shape[0], _ROWS)])


def softmax_scale_reference_(z: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    for r in range(0, z.shape[0], _ROWS):
        blk = z[r : r + _ROWS]
        if blk.dtype == torch.float32:  # fully in place
            blk.sub_(lse[r : r + _ROWS, None]).exp_().mul_(coef[r : r + _ROWS, None])
        else:
            blk.copy_((blk.float() - lse[r : r + _ROWS, None]).exp_().mul_(coef[r : r + _ROWS, None]))
    return z


if HAS_TRITON:

    @triton.jit
    def _lse_kernel(z_ptr, out_ptr, V, stride, BLOCK: tl.constexpr):
        """One program per row: online max and rescaled sum of exponentials over blocks of the vocabulary."""
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * stride
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.full((), 0.0, tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        tl.store(out_ptr + row, m + tl.log(s))

    @triton.jit
    def _softmax_scale_kernel(z_ptr, lse_ptr, coef_ptr, V, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = z_ptr + row * stride
        lse = tl.load(lse_ptr + row)
        c = tl.load(coef_ptr + row)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < V
            x = tl.load(base + offs, mask=m, other=0.0).to(tl.float32)
            tl.store(base + offs, (tl.exp(x - lse) * c).to(z_ptr.dtype.element_ty), mask=m)


def _check(z: torch.Tensor, name: str) -> None:
    if z.dim() != 2 or z.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected a (N, V) tensor with unit stride over V, got shape {tuple(z.shape)} strides {z.stride()}"
        )


def row_logsumexp(z: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """z (N, V) -> logsumexp over V (N,) float32."""
    _check(z, "row_logsumexp")
    if pick_impl(impl, z) == "reference":
        return row_logsumexp_reference(z)
    out = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    if z.shape[0]:
        _lse_kernel[(z.shape[0],)](z, out, z.shape[1], z.stride(0), BLOCK=1024)
    return out


def softmax_scale_(z: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """In place: z (N, V) <- exp(z - lse[:, None]) * coef[:, None]; lse, coef (N,) float32. Returns z."""
    _check(z, "softmax_scale_")
    if lse.shape != (z.shape[0],) or coef.shape != (z.shape[0],):
        raise ValueError(
            f"softmax_scale_: lse and coef must be ({z.shape[0]},), got {tuple(lse.shape)} and {tuple(coef.shape)}"
        )
    lse, coef = lse.float().contiguous(), coef.float().contiguous()
    if pick_impl(impl, z) == "reference":
        return softmax_scale_reference_(z, lse, coef)
    if z.shape[0]:
        _softmax_scale_kernel[(z.shape[0],)](z, lse, coef, z.shape[1], z.stride(0), BLOCK=1024)
    return z
