"""On-policy data written by drafters that read the target's states (heads, EAGLE): the one-row reference
(data/engine.py ``write_one``, on the decoder's proposers) writes the drafter's own first drafts, aligned
with the target's states (oracles), and the data stage's batched ``write_batch`` equals it row by row."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DECODE_PROMPTS,
    NEW,
    AlignedOracleHeads,
    EagleOracle,
    proposer_kinds,
    tiny_drafter,
    tiny_model,
)

from draftsmith.data.engine import write_one
from draftsmith.eval.decoder import speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one intra-op thread


class _WritingOracleHeads(AlignedOracleHeads):
    """Writes the target's greedy continuation one token per step, checking it is handed the state whose LM-head
    output is ``cur``: the writer reproduces AR iff every step lines up."""

    def draft_step(self, h, path):
        assert len(path) == 1 and int(self.target.lm_head(h[0]).argmax()) == int(path[0][0]) == self.ar[self.k]
        self.k += 1
        self.checked += 1
        logits = torch.zeros(1, self.target.cfg.vocab_size, dtype=h.dtype)
        logits[0, self.ar[self.k] if self.k < len(self.ar) else 0] = 10.0
        return logits, h


@pytest.mark.parametrize("kind", proposer_kinds("heads", "features"))
def test_write_one_lets_feature_drafters_write(target, ar_outputs, kind):
    eagle = kind.startswith("eagle")
    drafter = tiny_drafter(kind, target)
    differs = 0
    for prompt in DECODE_PROMPTS:
        want, x = ar_outputs[tuple(prompt)], torch.tensor(prompt)
        oracle = EagleOracle(target, prompt, want) if eagle else _WritingOracleHeads(target, want)
        out, st = write_one(target, oracle, x, NEW)
        assert out == want and oracle.checked >= len(want) - 2
        assert st.target_forwards == st.drafted == len(out) - 1 and st.accepted == 0  # one token, one forward
        # a real drafter writes its own first drafts: deterministic when greedy, seeded when sampling
        out, _ = write_one(target, drafter, x, NEW)
        assert len(out) == NEW and out == write_one(target, drafter, x, NEW)[0]
        differs += out != want
        sampled = [
            write_one(target, drafter, x, NEW, temperature=1.0, generator=torch.Generator().manual_seed(s))[0]
            for s in (7, 7, 8)
        ]
        assert sampled[0] == sampled[1] != sampled[2]
    assert differs > 0  # the drafter's text, not the target's
    with pytest.raises(ValueError, match="write mode"):  # a draft LM writes through the batched generator
        write_one(target, tiny_model(1), torch.tensor(DECODE_PROMPTS[0]), 4)
    with pytest.raises(TypeError, match="stop_drafting"):  # one draft per step: no stop hook (nor judge) to take
        write_one(target, drafter, torch.tensor(DECODE_PROMPTS[0]), 4, stop_drafting=lambda *a: True)
    with pytest.raises(TypeError, match="write"):  # the decoder proposes only; writing is the data stage's
        speculative_generate(target, drafter, torch.tensor(DECODE_PROMPTS[0]), 4, write=True)


# Every kind that writes through write_batch: those that read the target's states (draft LMs write in the batched
# generator, tests/test_gen_refill.py).
@pytest.mark.parametrize("kind", proposer_kinds("heads", "features"))
def test_batched_writer_equals_write_one_row_by_row(target, kind):
    """The data stage's batched writer (left-padded rows, one target cache, one drafter cache) writes exactly
    what ``write_one`` writes for each row alone: greedy and seeded sampling, with rows ending at EOS at
    different steps, whatever the batch order."""
    from draftsmith.data.engine import Sampling, write_batch

    torch.manual_seed(0)  # the drafter's draws must not depend on test order: some make no sampled row reach EOS
    drafter = tiny_drafter(kind, target)
    prompts = DECODE_PROMPTS + [[7, 7, 1, 2]]

    def row(p, eos, temperature=0.0, seed=0):
        return write_one(
            target,
            drafter,
            torch.tensor(p),
            NEW,
            eos_ids=eos,
            temperature=temperature,
            generator=torch.Generator().manual_seed(seed),
        )[0]

    for temperature in (0.0, 1.0):
        free = row(prompts[1], None, temperature, 12)
        eos = {free[len(free) // 2]}  # a token one row writes mid-way: rows stop at different steps
        s = Sampling(temperature)
        want = [row(p, eos, temperature, 11 + b) for b, p in enumerate(prompts)]
        assert len({len(w) for w in want}) > 1 and any(w[-1] in eos for w in want)
        got = write_batch(
            target, drafter, prompts, NEW, eos, s, [torch.Generator().manual_seed(11 + b) for b in range(len(prompts))]
        )
        assert [g.tokens for g in got] == want
        back = write_batch(
            target,
            drafter,
            prompts[::-1],
            NEW,
            eos,
            s,
            [torch.Generator().manual_seed(11 + b) for b in reversed(range(len(prompts)))],
        )
        assert [g.tokens for g in back] == want[::-1]
