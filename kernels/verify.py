"""Fused chain verification: one kernel pass per step (two launches for greedy) decides how many drafts survive
and draws the next token, on device, with no host synchronisation inside (docs/algorithms.md A1, B1-B2, B5).

- ``verify_greedy``: accept drafts while they equal the target's argmax; next = argmax after the accepted prefix.
- ``verify_sampling``: accept draft i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw
  the correction from max(0, p - q), after a full acceptance the bonus from p. Sampling uses the exponential race
  argmax_v(w_v / E_v), E_v ~ Exp(1), which draws v with probability w_v / sum(w) and needs no normalisation
  (vLLM's recovered-token kernel does the same). Uniforms come from Philox (``tl.rand``) keyed by (seed, row).
- ``verify_sampling_rows``: the same rule for a batch whose rows draft different amounts and keep their own
  generators: one Philox seed per row, so each row gets what a batch of one would.

Each public function takes ``impl``: "auto" (Triton on CUDA, the PyTorch reference elsewhere), "triton" (also on
CPU under TRITON_INTERPRET=1, for tests) or "reference".
"""

from __future__ import annotations

import torch

from draftsmith.kernels.launch import HAS_TRITON, pick_impl, tl, triton

# ---- references ----------------------------------------------------------------------------------------------


def verify_greedy_reference(draft: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft (B, γ) long, logits (B, γ+1, V) -> (accepted (B,) int32, next token (B,) int64)."""
    best = logits.argmax(-1)  # (B, γ+1)
    n = (draft == best[:, :-1]).int().cumprod(-1).sum(-1)  # leading run of matches
    return n.int(), best.gather(1, n.long()[:, None])[:, 0]


def verify_sampling_reference(
    draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft (B, γ), q (B, γ, V) draft probs, p (B, γ+1, V) target probs (both already processed) ->
    (accepted (B,), next token (B,)). Same rule as the kernel, with torch's RNG."""
    B, G = draft.shape
    px = p[:, :G].gather(-1, draft[..., None])[..., 0].float()
    qx = q.gather(-1, draft[..., None])[..., 0].float()
    u = torch.rand(B, G, generator=generator, device=p.device)
    ok = (qx > 0) & (u * qx < px)  # u < p/q without dividing; q = 0 never accepts
    n = ok.int().cumprod(-1).sum(-1)
    rows = torch.arange(B, device=p.device)
    pn = p[rows, n.long()].float()  # (B, V) target at the stop position
    qn = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, n.long()].float()  # q = 0 after a full accept
    w = (pn - qn).clamp_min(0)
    w = torch.where(w.sum(-1, keepdim=True) > 0, w, pn)  # p == q up to rounding: fall back to p
    e = torch.empty_like(w).exponential_(generator=generator)
    return n.int(), (w / e).argmax(-1)


def _row_draws(gam: list[int], generators: list, V: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b's gam[b] uniforms, then V Exp(1) draws, from generators[b], in row order: what ``rejection_accept``
    (eval/accept.py) draws alone, its last token being ``torch.multinomial`` of one sample, which is the exponential
    race argmax(w / E) over E ~ Exp(1) of w's shape. -> (u (B, max gam) padded with 1, e (B, V))."""
    u = torch.ones(len(gam), max(gam, default=0), device=device)
    e = torch.empty(len(gam), V, device=device)
    for b, (g, gen) in enumerate(zip(gam, generators)):
        u[b, :g].uniform_(generator=gen)  # torch.rand(g) draws the same
        e[b].exponential_(generator=gen)
    return u, e


def verify_sampling_rows_reference(
    draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, gam: torch.Tensor, generators: list
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling for B rows at once, row b on its first gam[b] drafts with its own generator: row for row
    the (accepted, next token) of ``rejection_accept`` on the same generator state (its fp32 ratio test and its
    fallback to p when max(0, p - q) is empty), with the draws of :func:`_row_draws`."""
    B, G = draft.shape
    V, dev = p.shape[-1], p.device
    u, e = _row_draws(gam.tolist(), generators, V, dev)
    px = p[:, :G].gather(-1, draft[..., None])[..., 0].float()
    qx = q.gather(-1, draft[..., None])[..., 0].float()
    ratio = torch.where(qx > 0, px / qx.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(px))
    ok = (u[:, :G] < ratio) & (torch.arange(G, device=dev)[None] < gam[:, None])
    n = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(B, device=dev)
    pn = p[rows, n].float()
    if G == 0:
        return n.int(), (pn / e).argmax(-1)
    w = (pn - q[rows, n.clamp(max=G - 1)].float()).clamp_min(0)
    w = torch.where((n == gam)[:, None] | ~(w.sum(-1, keepdim=True) > 0), pn, w)  # the bonus, or p == q
    return n.int(), (w / e).argmax(-1)


# ---- kernels ---------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _chunk_argmax_kernel(logits_ptr, pmax_ptr, pidx_ptr, V, NC, CHUNK: tl.constexpr):
        """Program (row, c): max and first argmax of chunk c of one logits row. Many programs per row keep a
        128k vocabulary from being scanned by a single SM."""
        row, c = tl.program_id(0), tl.program_id(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + row * V + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        tl.store(pmax_ptr + row * NC + c, m)
        tl.store(pidx_ptr + row * NC + c, tl.min(tl.where(x == m, offs, V), 0))

    @triton.jit
    def _row_best(pmax_ptr, pidx_ptr, row, V, NC, BLOCK_C: tl.constexpr):
        offs = tl.arange(0, BLOCK_C)
        vals = tl.load(pmax_ptr + row * NC + offs, mask=offs < NC, other=float("-inf"))
        idx = tl.load(pidx_ptr + row * NC + offs, mask=offs < NC, other=V)
        return tl.min(tl.where(vals == tl.max(vals, 0), idx, V), 0)  # chunks ascend: the first index on ties

    @triton.jit
    def _greedy_accept_kernel(draft_ptr, pmax_ptr, pidx_ptr, n_ptr, next_ptr, G, V, NC, BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        n = 0
        running = 1  # 1 while every draft so far matched
        nxt = 0
        for i in range(0, G + 1):
            best = _row_best(pmax_ptr, pidx_ptr, b * (G + 1) + i, V, NC, BLOCK_C)
            nxt = tl.where(running == 1, best, nxt)  # the last row reached with all drafts before it matched
            if i < G:
                d = tl.load(draft_ptr + b * G + i)
                running = running * (d == best).to(tl.int32)
                n += running
        tl.store(n_ptr + b, n)
        tl.store(next_ptr + b, nxt.to(tl.int64))

    @triton.jit
    def _verify_sampling_kernel(
        draft_ptr, q_ptr, p_ptr, n_ptr, next_ptr, seed, seed_ptr, gam_ptr, G, V, BLOCK_V: tl.constexpr,
        PER_ROW: tl.constexpr,
    ):  # fmt: skip
        """PER_ROW: row b has its own seed seed_ptr[b] and uses its first gam_ptr[b] drafts, with the Philox offsets
        a batch of one would use, so each row is the batch-1 launch on its seed; else one seed for all rows."""
        b = tl.program_id(0)
        if PER_ROW:
            seed = tl.load(seed_ptr + b)
            g = tl.load(gam_ptr + b)  # int32, as the batch-1 offsets are
            u_off = 0
            base = (g + 1) * V
        else:
            g = G
            u_off = b * (G + 1)
            base = (tl.num_programs(0) * (G + 1) + b) * V  # past B*(G+1): apart from the acceptance uniforms
        n = 0
        running = 1
        for i in range(0, G):
            d = tl.load(draft_ptr + b * G + i)
            px = tl.load(p_ptr + (b * (G + 1) + i) * V + d).to(tl.float32)
            qx = tl.load(q_ptr + (b * G + i) * V + d).to(tl.float32)
            u = tl.rand(seed, u_off + i)  # one uniform per (row, position)
            ok = (qx > 0) & (u * qx < px) & (i < g)
            running = running * ok.to(tl.int32)
            n += running
        # Exponential race over the residual max(0, p_n - q_n) (q = 0 past the row's last draft), then over p_n if
        # the residual is empty.
        p_row = p_ptr + (b * (G + 1) + n) * V
        q_row = q_ptr + (b * G + tl.maximum(tl.minimum(n, g - 1), 0)) * V  # always a valid row ...
        has_q = (n < g).to(tl.float32)  # ... zeroed when every draft was accepted (the bonus samples p)
        best_r, arg_r, best_p, arg_p = -1.0, 0, -1.0, 0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            m = offs < V
            pv = tl.load(p_row + offs, mask=m, other=0.0).to(tl.float32)
            qv = tl.load(q_row + offs, mask=m, other=0.0).to(tl.float32) * has_q
            e = -tl.log(tl.maximum(tl.rand(seed, base + offs), 1e-20))  # Exp(1)
            r = tl.where(m, tl.maximum(pv - qv, 0.0) / e, -1.0)
            s = tl.where(m, pv / e, -1.0)
            rm, sm = tl.max(r, 0), tl.max(s, 0)
            ri = tl.min(tl.where(r == rm, offs, V), 0)
            si = tl.min(tl.where(s == sm, offs, V), 0)
            arg_r = tl.where(rm > best_r, ri, arg_r)
            best_r = tl.maximum(rm, best_r)
            arg_p = tl.where(sm > best_p, si, arg_p)
            best_p = tl.maximum(sm, best_p)
        nxt = tl.where(best_r > 0, arg_r, arg_p)
        tl.store(n_ptr + b, n)
        tl.store(next_ptr + b, nxt.to(tl.int64))


def _check(draft: torch.Tensor, logits: torch.Tensor, name: str) -> None:
    B, G = draft.shape
    if logits.dim() != 3 or logits.shape[:2] != (B, G + 1):
        raise ValueError(f"{name}: expected (B, γ+1, V) = ({B}, {G + 1}, V) target rows, got {tuple(logits.shape)}")
    if draft.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: draft ids must be int32/int64, got {draft.dtype}")


def verify_greedy(draft: torch.Tensor, logits: torch.Tensor, impl: str = "auto"):
    """Greedy chain verification. draft (B, γ), logits (B, γ+1, V) -> (accepted (B,) int32, next (B,) int64)."""
    _check(draft, logits, "verify_greedy")
    if pick_impl(impl, logits) == "reference":
        return verify_greedy_reference(draft, logits)
    B, G = draft.shape
    V = logits.shape[-1]
    n = torch.empty(B, dtype=torch.int32, device=logits.device)
    nxt = torch.empty(B, dtype=torch.int64, device=logits.device)
    chunk = min(4096, triton.next_power_of_2(V))
    nc = triton.cdiv(V, chunk)
    pmax = torch.empty(B * (G + 1), nc, dtype=torch.float32, device=logits.device)
    pidx = torch.empty(B * (G + 1), nc, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(B * (G + 1), nc)](logits.contiguous(), pmax, pidx, V, nc, CHUNK=chunk)
    _greedy_accept_kernel[(B,)](draft.contiguous(), pmax, pidx, n, nxt, G, V, nc, BLOCK_C=triton.next_power_of_2(nc))
    return n, nxt


def verify_sampling(
    draft: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    seed: int,
    impl: str = "auto",
    generator: torch.Generator | None = None,
):
    """Lossless chain rejection sampling. draft (B, γ), q (B, γ, V), p (B, γ+1, V) processed probabilities;
    ``seed`` keys the kernel's Philox stream (the reference uses ``generator``)."""
    _check(draft, p, "verify_sampling")
    if q.shape != (*draft.shape, p.shape[-1]):
        raise ValueError(f"verify_sampling: q must be (B, γ, V) = {(*draft.shape, p.shape[-1])}, got {tuple(q.shape)}")
    if pick_impl(impl, p) == "reference":
        return verify_sampling_reference(draft, q, p, generator)
    B, G = draft.shape
    V = p.shape[-1]
    n = torch.empty(B, dtype=torch.int32, device=p.device)
    nxt = torch.empty(B, dtype=torch.int64, device=p.device)
    q = q.contiguous() if G else p.new_zeros(B, 1, V)  # a valid pointer even when nothing was drafted
    _verify_sampling_kernel[(B,)](
        draft.contiguous(), q, p.contiguous(), n, nxt, seed, n, n, G, V, BLOCK_V=min(1024, triton.next_power_of_2(V)),
        PER_ROW=False,
    )  # fmt: skip
    return n, nxt


def verify_sampling_rows(
    draft: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    gam: torch.Tensor,
    generators: list,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling for a batch whose rows draft different amounts and keep their own generators
    (eval/batch_decoder.py). draft (B, G), q (B, G, V), p (B, G+1, V) processed probabilities, gam (B,): row b uses its
    first gam[b] drafts (the rest are ignored) and draws only from generators[b] (None: torch's default), so row b
    gets what ``rejection_accept`` gives it alone on the same generator state. The kernel takes one Philox seed
    per row, drawn from its generator as ``rejection_accept`` draws its one seed. -> (accepted (B,), next (B,))."""
    _check(draft, p, "verify_sampling_rows")
    B, G = draft.shape
    V = p.shape[-1]
    if q.shape != (B, G, V) or gam.shape != (B,) or len(generators) != B:
        raise ValueError(
            f"verify_sampling_rows: expected q {(B, G, V)}, gam ({B},) and {B} generators, got {tuple(q.shape)}, "
            f"{tuple(gam.shape)} and {len(generators)}"
        )
    if pick_impl(impl, p) == "reference":
        return verify_sampling_rows_reference(draft, q, p, gam, generators)
    seeds = [torch.randint(2**31 - 1, (1,), generator=g, device="cpu" if g is None else g.device) for g in generators]
    seeds = torch.cat([s.to(p.device) for s in seeds]) if B else torch.zeros(0, dtype=torch.long, device=p.device)
    n = torch.empty(B, dtype=torch.int32, device=p.device)
    nxt = torch.empty(B, dtype=torch.int64, device=p.device)
    q = q.contiguous() if G else p.new_zeros(B, 1, V)
    if B:
        _verify_sampling_kernel[(B,)](
            draft.contiguous(), q, p.contiguous(), n, nxt, 0, seeds, gam.to(p.device, torch.int32), G, V,
            BLOCK_V=min(1024, triton.next_power_of_2(V)), PER_ROW=True,
        )  # fmt: skip
    return n, nxt
