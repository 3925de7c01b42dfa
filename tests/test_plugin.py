"""A drafter kind defined entirely in this file (docs/adding-a-drafter.md): a bigram table that drafts the next
token from the current one. One spec object and one ``register_drafter`` call make it a kind like the shipped ones:
recipes accept ``drafter.kind: bigram``, the real train loop trains it and checkpoints it, ``load_drafter`` rebuilds
it, and the bundled decoder drafts with it losslessly. The registration is undone after each test."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from draftsmith.errors import DraftsmithError
from draftsmith.models.llama import KVCache
from draftsmith.models.registry import DRAFTERS, kinds, load_drafter, register_drafter, unregister_drafter
from draftsmith.models.spec import DrafterSpec, Strict
from draftsmith.recipes.loader import find_recipe, validate
from draftsmith.train.objectives import StepOutput

# ---- the new kind: a recipe section, a model, a builder, an objective, and the spec that ties them together ----


class BigramDrafterConfig(Strict):
    """The recipe's drafter section: ``kind`` tells it apart; its defaults are the only ones."""

    kind: Literal["bigram"] = "bigram"
    init_from_target: bool = True
    """Start each row from the target's logits for that token alone (a zero-layer target)."""


@dataclass(frozen=True)
class BigramConfig:
    """The model's shape, as drafter.json keeps it (``cfg.to_dict()`` / ``from_config``)."""

    vocab_size: int

    def to_dict(self) -> dict:
        return asdict(self)


class Bigram(nn.Module):
    """A token drafter (interface "tokens"): ``drafter(ids, cache=...) -> logits (B, T, V)`` and ``new_cache``."""

    def __init__(self, cfg: BigramConfig):
        super().__init__()
        self.cfg = cfg
        self.table = nn.Embedding(cfg.vocab_size, cfg.vocab_size)  # row t: logits of the token after t
        nn.init.zeros_(self.table.weight)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.keyless(batch, max_len, self.table.weight.device)  # a bigram keeps no keys

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, valid=None, **_) -> torch.Tensor:
        if cache is not None:  # the decoder's bookkeeping: which slots hold this row's tokens
            cache.advance(ids.shape[1], valid)
        return self.table(ids)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        return self.table.weight.numel()


def build_bigram(cfg: BigramDrafterConfig, target, **_) -> Bigram:
    model = Bigram(BigramConfig(vocab_size=target.cfg.vocab_size))
    if cfg.init_from_target:
        with torch.no_grad():
            model.table.weight.copy_(target.lm_head(target.norm(target.embed_tokens.weight)))
    return model.to(target.embed_tokens.weight.dtype)


def bigram_objective(model, batch: dict, cfg, ctx) -> StepOutput:
    """Cross-entropy on the target's next token at every trained position (summed; the loop normalises)."""
    logits = model(batch["input_ids"])[batch["predict_mask"]]  # (N, V)
    labels = batch["labels"]
    loss = F.cross_entropy(logits.float(), labels, reduction="sum")
    return StepOutput(loss, len(labels), {"top1": float((logits.argmax(-1) == labels).float().mean())})


SPEC = DrafterSpec(
    kind="bigram",
    config=BigramDrafterConfig,
    build=build_bigram,
    from_config=lambda c: Bigram(BigramConfig(**c)),
    interface="tokens",
    objective=bigram_objective,
    signals=frozenset(),
)  # the objective reads tokens only


@pytest.fixture
def bigram():
    register_drafter(SPEC)
    try:
        yield SPEC
    finally:
        unregister_drafter(SPEC.kind)


def _recipe(tmp_path, **drafter) -> dict:
    doc = yaml.safe_load(find_recipe("tiny").read_text())
    doc["drafter"] = {"kind": "bigram", **drafter}
    doc["export"]["enabled"] = False
    return doc


# ---- the proof ----


def test_registering_a_kind_is_all_a_recipe_needs_and_is_undone(tmp_path):
    doc = _recipe(tmp_path)
    with pytest.raises(DraftsmithError, match="Input tag 'bigram' found using 'kind' does not match"):
        validate(doc, "before")
    register_drafter(SPEC)
    try:
        recipe = validate(doc, "registered")
        assert isinstance(recipe.drafter, BigramDrafterConfig) and recipe.drafter.init_from_target
        assert "bigram" in kinds(interface="tokens")  # so registry-parametrised tests would include it
        with pytest.raises(DraftsmithError, match="unknown key drafter.colour"):  # strict, errors name the key
            validate(_recipe(tmp_path, colour="red"), "bad")
        with pytest.raises(DraftsmithError, match="already registered"):
            register_drafter(SPEC)
    finally:
        unregister_drafter("bigram")
    assert "bigram" not in DRAFTERS
    with pytest.raises(DraftsmithError, match="does not match"):
        validate(doc, "after")


def test_a_kind_defined_in_a_test_trains_checkpoints_and_decodes_losslessly(
    bigram, train_run, tiny_model_dir, prompts_file, tmp_path
):
    from draftsmith.data.dataset import RecordDataset, collate
    from draftsmith.eval.decoder import autoregressive_generate, speculative_generate
    from draftsmith.models.loading import load_model

    recipe = tmp_path / "tiny-bigram.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tmp_path)))
    run = train_run("bigram", "train.steps=6", "train.lr=3e-2", "train.warmup_steps=0", recipe=str(recipe))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("stage") == "train"] == [1, 2, 3, 4, 5, 6]
    drafter, info = load_drafter(run / "checkpoints" / "final")  # rebuilt through the spec's from_config
    assert info["kind"] == "bigram" and isinstance(drafter, Bigram) and info["step"] == 6
    target = load_model(str(tiny_model_dir)).model.eval()
    # the loop trained it: on all the records, its loss is below the builder's starting point
    ds = RecordDataset(run / "data", 128, signals=set())
    batch = collate([ds[i] for i in range(len(ds))])
    with torch.no_grad():
        start, trained = (
            bigram_objective(m, batch, None, None) for m in (build_bigram(BigramDrafterConfig(), target), drafter)
        )
    assert trained.loss_sum / trained.n < start.loss_sum / start.n
    drafted = 0
    for seed in range(3):
        prompt = torch.randint(3, target.cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(seed))
        want = autoregressive_generate(target, prompt, 24)
        for draft_len in (1, 3):
            got, stats = speculative_generate(target, drafter, prompt, 24, draft_len=draft_len)
            assert got == want  # greedy: token for token the target's own output
            drafted += stats.drafted
    assert drafted > 0
    # the batched decoder and trees take it as they take the shipped kinds: rows of a batch, static and dynamic
    from draftsmith.eval.batch_decoder import speculative_generate_batch
    from draftsmith.eval.tree import DynamicTree, tree_from_choices

    prompts = [
        torch.randint(3, target.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 9, 5)
    ]
    wants = [autoregressive_generate(target, p, 24) for p in prompts]
    for tree in (None, tree_from_choices([[0], [1], [0, 0]]), DynamicTree(top_k=2, depth=3, total_tokens=6)):
        outs, stats = speculative_generate_batch(target, drafter, prompts, 24, draft_len=3, tree=tree)
        assert outs == wants and sum(st.drafted for st in stats) > 0
        assert [speculative_generate(target, drafter, p, 24, draft_len=3, tree=tree)[0] for p in prompts] == wants
    # and `draftsmith eval` on the run: the same decoder, timed against plain decoding
    from draftsmith.cli import main

    assert (
        main(
            [
                "eval",
                str(recipe),
                f"target.model={tiny_model_dir}",
                f"eval.prompts.path={prompts_file}",
                f"out_dir={run}",
                "target.dtype=float64",
                "-q",
            ]
        )
        == 0
    )
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["lossless_match"] == 1.0 and report["drafter"]["kind"] == "bigram"
