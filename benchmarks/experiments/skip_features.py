"""Would a skip rule for feature heads (SpecDec++-style stop rule) predict acceptance better with more inputs?
An offline study.

The trained skip head (``eval.stop.state: next``) reads the state a head drafts from, log q(y), the
entropy of q and which head it is. Two cheap signals it does not read are known in the decoder when the rule is
asked: the target's own confidence where the block starts (log max p and the entropy of the distribution the
current token came from) and whether the drafter got the current token right (head 0 one position earlier).
This script makes the head's labels exactly as training does (``heads_acceptance_inputs``: each head k,
teacher-forced, drafts greedily at every response position; label 1 iff the target's argmax agrees), adds those
signals, and fits small logistic models (linear and a 32-unit MLP) on 70% of the records, scoring the other 30%
(split by record): Brier score, its share of the base rate's (R2), log loss and AUC. The trained head's own logit
is one of the inputs (it saw every record in training, so its rows flatter it).

Usage: python benchmarks/experiments/skip_features.py --heads runs/hydra/checkpoints/final \
           --head runs/skip-head/checkpoints/final --data runs/skip-head/data
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from draftsmith.data.dataset import RecordDataset, collate
from draftsmith.models.acceptance import AcceptanceHeadConfig
from draftsmith.models.loading import load_model
from draftsmith.models.registry import load_drafter
from draftsmith.train.objectives import Context, heads_acceptance_inputs


def rows(heads, head, target, data: Path, batch_size: int, max_len: int, heads_dir: str) -> dict[str, torch.Tensor]:
    """One row per (head k, position t) as the head's training sees them, with the extra signals."""
    ds = RecordDataset(data, max_len, signals=set())
    ctx = Context(unwrapped=head, target=target, params=AcceptanceHeadConfig(draft=heads_dir, label_temperature=0.0))
    cols: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("record", "slot", "label", "logq", "entropy", "target_logp", "target_entropy", "prev", "head")
    }
    t0 = time.time()
    for i0 in range(0, len(ds), batch_size):
        batch = collate([ds[i] for i in range(i0, min(len(ds), i0 + batch_size))])
        T = batch["input_ids"].shape[1]
        x, s, slot, start = heads_acceptance_inputs(heads, batch, ctx, positions=True)
        logp = torch.log_softmax(target.lm_head(target(batch["input_ids"], return_hidden=True)).float(), -1)
        logp = logp.flatten(0, 1)[start]  # the distribution the block's current token came from
        prev = torch.full((batch["input_ids"].numel(),), -1.0)
        prev[start[slot == 0] + 1] = s[slot == 0]  # head 0 at t - 1 drafted the token at t + 1: right or not
        cols["record"].append(i0 + start // T)
        cols["slot"].append(slot)
        cols["label"].append(s)
        cols["logq"].append(x[:, -2])
        cols["entropy"].append(x[:, -1])
        cols["target_logp"].append(logp.max(-1).values)
        cols["target_entropy"].append(-(logp.exp() * logp).sum(-1))
        cols["prev"].append(prev[start])
        cols["head"].append(head(x, slot))
        print(f"\rrecords {min(len(ds), i0 + batch_size)}/{len(ds)}  {time.time() - t0:.0f} s", end="", flush=True)
    print()
    return {k: torch.cat(v) for k, v in cols.items()}


def fit_predict(X: torch.Tensor, y: torch.Tensor, Xt: torch.Tensor, mlp: bool, steps: int = 600) -> torch.Tensor:
    """Logistic regression (or a 32-unit MLP) on standardised inputs, full-batch Adam -> P(accept) on Xt."""
    mu, sd = X.mean(0), X.std(0).clamp_min(1e-6)
    X, Xt = (X - mu) / sd, (Xt - mu) / sd
    net = (
        torch.nn.Sequential(torch.nn.Linear(X.shape[1], 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
        if mlp
        else torch.nn.Linear(X.shape[1], 1)
    )
    opt = torch.optim.Adam(net.parameters(), 1e-2 if mlp else 3e-2)
    for _ in range(steps):
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(net(X)[:, 0], y).backward()
        opt.step()
    with torch.no_grad():
        return torch.sigmoid(net(Xt)[:, 0])


def auc(p: torch.Tensor, y: torch.Tensor) -> float:
    """Area under the ROC curve (rank statistic; ties are rare for continuous p)."""
    r = torch.empty_like(p)
    r[p.argsort()] = torch.arange(1, len(p) + 1, dtype=p.dtype)
    n1 = y.sum()
    return float((r[y == 1].sum() - n1 * (n1 + 1) / 2) / (n1 * (len(y) - n1)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", required=True, help="a medusa / hydra / mlp_speculator checkpoint folder")
    ap.add_argument("--head", required=True, help="a skip (before) acceptance head trained on those heads")
    ap.add_argument("--data", required=True, help="a data folder of target-written records")
    ap.add_argument("--target", default="smollm2-135m-instruct", help="the target model (alias, folder or hub id)")
    ap.add_argument("--batch-size", type=int, default=8, help="records per forward")
    ap.add_argument("--max-len", type=int, default=384, help="tokens per record kept (the head recipe's)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the record split and the fits")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        target = load_model(args.target).model.float().eval()
        heads, _ = load_drafter(Path(args.heads))
        head, _ = load_drafter(Path(args.head))
        c = rows(heads, head, target, Path(args.data), args.batch_size, args.max_len, args.heads)
    y, slot = c["label"], F.one_hot(c["slot"].long(), heads.max_draft_len).float()
    recs = c["record"].unique()
    test = torch.isin(c["record"], recs[torch.randperm(len(recs))[: len(recs) * 3 // 10]])
    print(f"rows {len(y)} (held out {int(test.sum())}), acceptance {float(y.mean()):.3f}")
    for k in range(heads.max_draft_len):  # how acceptance depends on the drafter's last call
        at = c["slot"] == k
        right, wrong = at & (c["prev"] == 1), at & (c["prev"] == 0)
        print(
            f"head {k}: acceptance {float(y[at].mean()):.3f}; after a right draft {float(y[right].mean()):.3f} "
            f"(n {int(right.sum())}), after a wrong one {float(y[wrong].mean()):.3f} (n {int(wrong.sum())})"
        )
    q = [slot, c["logq"][:, None], c["entropy"][:, None]]
    tgt = [c["target_logp"][:, None], c["target_entropy"][:, None]]
    prev = [(c["prev"] == 1).float()[:, None], (c["prev"] == 0).float()[:, None]]
    sets = {
        "head slot": [slot],
        "slot + q": q,
        "slot + q + target": q + tgt,
        "slot + q + prev": q + prev,
        "slot + q + target + prev": q + tgt + prev,
        "trained head": [c["head"][:, None]],
        "trained head + slot + q": [c["head"][:, None]] + q,
        "trained head + slot + q + target + prev": [c["head"][:, None]] + q + tgt + prev,
    }
    yt = y[test]
    base = float(((y[~test].mean() - yt) ** 2).mean())
    print(f"base-rate Brier {base:.4f}\n{'inputs':40s} model  Brier   R2     logloss AUC")
    for name, parts in sets.items():
        X = torch.cat(parts, 1)
        for mlp in (False, True):
            p = fit_predict(X[~test], y[~test], X[test], mlp)
            b = float(((p - yt) ** 2).mean())
            ll = float(F.binary_cross_entropy(p.clamp(1e-6, 1 - 1e-6), yt))
            print(f"{name:40s} {'mlp' if mlp else 'lin':5s}  {b:.4f}  {1 - b / base:.3f}  {ll:.4f}  {auc(p, yt):.3f}")


if __name__ == "__main__":
    main()
