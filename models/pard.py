"""PARD (An et al., AMD, 2025): a standalone draft LM that drafts k tokens in ONE forward.

After the context (the committed tokens it has not read yet, then the current token) it reads k-1 copies of a
reserved mask token, each at its own next RoPE position under the causal mask; its logits at the current token
and at mask i are its distributions for draft 1 and draft i+1 (eval/proposers.py ``TokenRows``). Each
distribution depends on the committed context only, never on the other drafts, so sampling draft i from its own
q_i is a valid proposal for the chain's rejection rule.

The mask token is id ``vocab_size`` (one past the target's vocabulary) by default, or a reserved id of the
target's vocabulary (``drafter.mask_token``, what PARD's own checkpoints and vLLM's ``pard_token`` use). Its input
embedding is its own trained vector ``mask_embed`` (started at the mean token embedding), so the copied target
embeddings can stay frozen and the LM head still scores target ids only. Everything else is the ``draft_lm``
architecture (models/draft_lm.py), built the same way (target layers, ``init_from`` an existing draft LM: PARD
adapts an autoregressive draft into a parallel one, ``draft_vocab``). The HF export (draftsmith/export/formats.py
``_pard_hf``) is a LlamaForCausalLM with ``pard_token`` and ``pard_k`` in its config.

Training (``cod_layout``; train/objectives.py ``pard_objective``): the paper's conditional drop-token (COD)
scheme. Besides the plain sequence (distance 1 everywhere), segment i = 1..k-1 adds mask tokens: a mask at RoPE
position p of segment i sees the real tokens up to p - i and the masks of segments 1..i at positions p-i+1..p
(its own chain), exactly what decoding shows it, and learns the token at p + 1, i + 1 tokens after its last real
token. Segment i keeps a random ``max(retain**i, retain_min)`` fraction of the response positions, and a position
is only a candidate when its predecessor (segment i-1, position p-1) was kept, so every kept mask has its whole
chain in the sequence (the "conditional" part). Our choices where the paper leaves room: only positions whose
next token is a response token are kept (they are the only ones trained), and the masks are scored with the same
KD loss as the plain positions, against the teacher's distribution for the token they predict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.draft_lm import DraftLMConfig, build_draft_lm
from draftsmith.models.llama import Block, Llama, LlamaConfig
from draftsmith.models.spec import EXPORT, DrafterSpec, as_section


class PardDrafterConfig(DraftLMConfig):
    """A PARD parallel draft LM: the draft_lm architecture plus a mask token; drafts pard_k tokens per forward."""

    kind: Literal["pard"] = "pard"  # type: ignore[assignment]
    pard_k: int = Field(4, gt=0)
    """Parallel drafts per forward (the current token plus pard_k - 1 mask tokens): the distances trained and the
    longest chain or tree depth it drafts."""
    cod_retain: float = Field(0.7, gt=0, le=1)
    """COD: segment i (distance i + 1) keeps a random cod_retain**i fraction of the response positions."""
    cod_retain_min: float = Field(0.2, ge=0, le=1)
    """COD: the least fraction any segment keeps (before its predecessors' limits)."""
    mask_token: int | None = Field(None, ge=0)
    """The mask token's id. None: one past the target's vocabulary (the HF export then has one row more). An id of
    the target's vocabulary that it never writes (a reserved or unused token, as PARD uses for Llama 3) keeps the
    vocabulary size, which vLLM's parallel drafting needs (--format vllm). Either way its input embedding is the
    drafter's own trained vector."""


@dataclass(frozen=True)
class PardConfig(LlamaConfig):
    pard_k: int = 4  # parallel drafts per forward
    mask_token: int | None = None  # None: the mask token is id vocab_size

    @property
    def mask_id(self) -> int:
        return self.vocab_size if self.mask_token is None else self.mask_token


class Pard(Llama):
    """A draft LM with a mask token (id ``cfg.mask_id``) whose input embedding is the parameter ``mask_embed``."""

    def __init__(self, cfg: PardConfig):
        super().__init__(cfg)
        self.mask_embed = nn.Parameter(torch.zeros(cfg.dim))

    @property
    def parallel_drafts(self) -> int:
        return self.cfg.pard_k

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        is_mask = ids == self.cfg.mask_id
        x = self.embed_tokens(ids.masked_fill(is_mask, 0))
        return torch.where(is_mask[..., None], self.mask_embed.to(x.dtype), x)


def build_pard(cfg: PardDrafterConfig | dict, target: Llama, **data) -> Pard:
    """The draft_lm builder's draft (the same fields), turned into a Pard with a mask embedding."""
    cfg = as_section(PardDrafterConfig, cfg)
    if cfg.mask_token is not None and cfg.mask_token >= target.cfg.vocab_size:
        raise DraftsmithError(
            f"drafter.mask_token={cfg.mask_token} is outside the target's vocabulary ({target.cfg.vocab_size} "
            f"tokens): name a reserved id, or leave it unset for one past the vocabulary"
        )
    draft = build_draft_lm(cfg, target, **data)
    pard = Pard(PardConfig(**draft.cfg.to_dict(), pard_k=cfg.pard_k, mask_token=cfg.mask_token))
    pard = pard.to(draft.embed_tokens.weight.dtype)
    pard.load_state_dict(draft.state_dict(), strict=False)  # all but mask_embed; d2t / t2d of a reduced head too
    if pard.cfg.tie_embeddings:
        pard.lm_head.weight = pard.embed_tokens.weight
    trainable = {n: p.requires_grad for n, p in draft.named_parameters()}
    for n, p in pard.named_parameters():
        p.requires_grad_(trainable.get(n, True))
    with torch.no_grad():
        pard.mask_embed.copy_(pard.embed_tokens.weight.mean(0))
    return pard


def from_config(c: dict) -> Pard:
    return Pard(PardConfig(**c))


# ---- training layout ----------------------------------------------------------------------------------------------


@dataclass
class CodLayout:
    """One COD batch: ids / pos / attn_mask (B, T', T') for the drafter's forward; ``train`` (B, T') the positions
    trained, in whose (row-major) order ``rows`` (M,) gives each one's row of the records' labels / top-k (the
    predict_mask row of the token it predicts) and ``dist`` (M,) its prediction distance 1..k."""

    ids: torch.Tensor
    pos: torch.Tensor
    attn_mask: torch.Tensor
    train: torch.Tensor
    rows: torch.Tensor
    dist: torch.Tensor


def cod_segments(pm: torch.Tensor, k: int, retain: float, retain_min: float, generator=None) -> list[torch.Tensor]:
    """One row's kept mask positions per segment i = 1..k-1: pm (T,) bool (position p predicts a response
    token). Segment i keeps int(N * max(retain**i, retain_min)) of its candidates (N = response positions), drawn
    at random among the positions p whose predecessor p - 1 segment i-1 kept (segment 0: every real token)."""
    P = pm.nonzero().flatten()
    n, prev, out = P.numel(), None, []
    for i in range(1, k):
        cand = P[P >= 1] if prev is None else P[torch.isin(P, prev + 1)]
        m = min(int(n * max(retain**i, retain_min)), cand.numel())
        if m == 0:
            out.extend(P[:0] for _ in range(i, k))
            break
        r = torch.rand(cand.numel(), generator=generator, device=cand.device)
        prev = cand[r.argsort()[:m]].sort().values
        out.append(prev)
    return out


def cod_layout(
    ids: torch.Tensor,
    pm: torch.Tensor,
    k: int,
    mask_id: int,
    retain: float,
    retain_min: float,
    generator=None,
    doc: torch.Tensor | None = None,
    pos: torch.Tensor | None = None,
) -> CodLayout:
    """ids, pm (B, T): the records' tokens and predict_mask -> the COD training batch (module docstring). Row b's
    masks follow its T real tokens, segment by segment; rows are right-padded with masks that see only
    themselves and are not trained.

    Packed rows (train.packing): ``doc`` (B, T) each token's document in its row (-1: padding) and ``pos`` (B, T)
    its position in that document. Each document draws its own segments (``generator[b][j]`` for document j of
    row b, so its draws are those it gets alone in a padded row), its masks follow the row's tokens document by
    document, and a mask sees only its own document's real tokens and chain."""
    B, T = ids.shape
    dev = ids.device
    packed = doc is not None
    if not packed:  # one document per row, positions 0..T-1
        doc = torch.zeros(B, T, dtype=torch.long, device=dev)
        pos = torch.arange(T, device=dev).expand(B, T)
    gens = generator if isinstance(generator, list) else [generator] * B  # one per row, or one for all
    spans = []  # per row: (document, first column, its segments' positions in the document)
    for b in range(B):
        row = []
        for j in doc[b].unique().tolist() if packed else [0]:
            if j < 0:
                continue
            cols = (doc[b] == j).nonzero().flatten()
            a, e = int(cols[0]), int(cols[-1]) + 1
            g = gens[b][j] if packed else gens[b]
            row.append((j, a, cod_segments(pm[b, a:e], k, retain, retain_min, g)))
        spans.append(row)
    extra = [sum(p.numel() for _, _, segs in row for p in segs) for row in spans]
    W = T + max(extra, default=0)
    out_ids = torch.full((B, W), mask_id, dtype=ids.dtype, device=dev)
    out_ids[:, :T] = ids
    out_pos = torch.zeros(B, W, dtype=torch.long, device=dev)
    out_doc = torch.full((B, W), -1, dtype=torch.long, device=dev)
    seg = torch.full((B, W), -1, dtype=torch.long, device=dev)
    anchor = torch.full((B, W), -2, dtype=torch.long, device=dev)  # the last real token each position sees
    out_pos[:, :T], out_doc[:, :T], seg[:, :T], anchor[:, :T] = pos, doc, 0, pos
    train = torch.zeros(B, W, dtype=torch.bool, device=dev)
    train[:, :T] = pm
    row = pm.flatten().long().cumsum(0).view(B, T) - 1  # records' row of each predicting position
    rows, dist = [], []
    for b in range(B):
        rows.append(row[b, pm[b]])
        dist.append(torch.ones(int(pm[b].sum()), dtype=torch.long, device=dev))
        s = T
        for j, a, segs in spans[b]:
            for i, p in enumerate(segs, start=1):
                e = s + p.numel()
                out_pos[b, s:e], out_doc[b, s:e], seg[b, s:e], anchor[b, s:e], train[b, s:e] = p, j, i, p - i, True
                rows.append(row[b, a + p])
                dist.append(torch.full((p.numel(),), i + 1, dtype=torch.long, device=dev))
                s = e
    sq, sk = seg[:, :, None], seg[:, None, :]
    aq, ak = anchor[:, :, None], anchor[:, None, :]
    same = out_doc[:, :, None] == out_doc[:, None, :]
    real_key = (sk == 0) & same & (out_pos[:, None, :] <= aq) & (sq >= 0)
    chain_key = (sk >= 1) & same & (ak == aq) & (sk <= sq)
    mask = real_key | chain_key | torch.eye(W, dtype=torch.bool, device=dev)[None]
    return CodLayout(out_ids, out_pos, mask, train, torch.cat(rows), torch.cat(dist))


SPEC = DrafterSpec(
    kind="pard",
    config=PardDrafterConfig,
    build=build_pard,
    from_config=from_config,
    interface="tokens",
    objective="draftsmith.train.objectives:pard_objective",
    signals=frozenset({"topk"}),
    fsdp_wrap=(Block,),
    packs=True,
    exports={  # PARD's own HF folder; vLLM's parallel drafting reads it (with the mask in the target's vocabulary)
        "hf": {
            "write": EXPORT + "to_pard_hf",
            "read": EXPORT + "read_pard_hf",
            "usage": EXPORT + "usage_pard",
            "plain_lm": True,
        },
        "vllm": {
            "write": EXPORT + "to_pard_vllm",
            "read": EXPORT + "read_pard_hf",
            "usage": EXPORT + "usage_pard",
            "plain_lm": True,
        },
    },
    engines={"vllm": {"method": "draft_model", "formats": ("hf", "vllm"), "parallel_drafting": True}},
)
