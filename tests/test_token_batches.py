"""train.batch_tokens: micro-batches cut by input tokens (train/loop.py ``TokenBatches``), deterministic, resumable
by arithmetic, split over processes, and through `draftsmith train` with and without packing."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.train.loop import TokenBatches


def _lengths(n: int = 40, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 50, (n,), generator=g).tolist()


def _take(sampler, k: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(k)]


def test_micro_batches_fill_the_budget_in_the_epochs_order():
    lengths, budget = _lengths(), 60
    s = TokenBatches(lengths, budget, rank=0, world=1, seed=3)
    n0 = s.per_epoch(0)
    batches = _take(s, n0 + 3)
    perm = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(3 * 100003)).tolist()
    flat = [i for b in batches[:n0] for i in b]
    assert flat == perm[: len(flat)] and len(flat) == len(lengths)  # world 1 keeps the whole epoch
    for b in batches:
        used = sum(lengths[i] for i in b)
        assert used <= budget or len(b) == 1
    for a, b in zip(batches[:n0], batches[1 : n0 + 1]):  # each cut is where the next record would overflow
        if b:
            assert sum(lengths[i] for i in a) + lengths[b[0]] > budget
    assert batches[n0 : n0 + 3] == TokenBatches(lengths, budget, 0, 1, seed=3)._epoch(1)[:3]  # the next epoch


def test_resume_is_arithmetic_and_processes_split_global_batches():
    lengths = _lengths(60, seed=1)
    whole = _take(TokenBatches(lengths, 70, 0, 1, seed=5), 50)
    assert _take(TokenBatches(lengths, 70, 0, 1, seed=5, start=17), 33) == whole[17:]
    two = [_take(TokenBatches(lengths, 70, r, 2, seed=5), 20) for r in (0, 1)]
    for e in (0, 1):
        cuts = TokenBatches(lengths, 70, 0, 2, seed=5)._epoch(e)
        assert len(cuts) % 2 == 0
    ref = TokenBatches(lengths, 70, 0, 2, seed=5)
    seq = [b for e in range(6) for b in ref._epoch(e)]  # the world-2 cuts, epoch after epoch
    assert [b for pair in zip(*two) for b in pair] == seq[:40]
    assert _take(TokenBatches(lengths, 70, 1, 2, seed=5, start=7), 5) == two[1][7:12]


def test_too_few_records_for_one_global_batch_is_one_line():
    from draftsmith.errors import DraftsmithError

    with pytest.raises(DraftsmithError, match="lower train.batch_tokens"):
        TokenBatches([10, 10], 100, 0, 2, seed=0)


@pytest.mark.parametrize("packing", ["false", "true"])
def test_train_with_a_token_budget_resumes_exactly(train_run, killed_and_resumed, packing):
    """`draftsmith train train.batch_tokens=...`: every step trains at most the budget of input tokens (one long
    record alone excepted), and a run killed after a checkpoint resumes to the
    uninterrupted run's weights and losses."""
    from safetensors.torch import load_file

    common = [
        "train.steps=4",
        "train.save_every=2",
        "train.batch_tokens=256",
        "train.max_seq_len=128",
        "train.log_every=1",
        f"train.packing={packing}",
    ]
    full = train_run("full", *common)
    resumed = killed_and_resumed("resumed", *common)
    a, b = (load_file(str(p / "checkpoints" / "final" / "model.safetensors")) for p in (full, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [
        [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
        for p in (full, resumed)
    ]
    assert [r["loss"] for r in rows[0]] == [r["loss"] for r in rows[1]] and len(rows[0]) == 4
    assert all(0 < r["input_tokens"] <= 256 for r in rows[0])


def test_a_budget_below_max_seq_len_is_refused_in_one_line():
    from draftsmith.recipes.loader import load_recipe

    with pytest.raises(Exception, match="train.batch_tokens=64 is below train.max_seq_len=128"):
        load_recipe("tiny", ["train.batch_tokens=64", "train.max_seq_len=128"])
