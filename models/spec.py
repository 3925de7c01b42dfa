"""The seam between a drafter kind and the rest of draftsmith: one ``DrafterSpec`` per kind.

Each ``models/<kind>.py`` ends with ``SPEC = DrafterSpec(...)``; models/registry.py collects them into ``DRAFTERS``,
from which the recipe schema builds its ``drafter`` union (recipes/schema.py), the train loop picks the objective,
the record signals, whether the frozen target runs in the loop and what FSDP wraps (train/loop.py), and checkpoints
are rebuilt (``from_config``). docs/adding-a-drafter.md walks through the fields.

``Strict`` (the frozen, unknown-keys-are-errors pydantic base of every recipe section) lives here so that a kind's
recipe section can sit next to its model without models importing recipes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, ValidationError

from draftsmith.errors import DraftsmithError

Interface = Literal["tokens", "heads", "features", "block"]
INTERFACES = ("tokens", "heads", "features", "block")
Role = Literal["drafter", "stop_head", "judge_head"]
ROLES = ("drafter", "stop_head", "judge_head")


class Strict(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, protected_namespaces=(), use_attribute_docstrings=True, allow_inf_nan=False
    )  # every float finite: train.lr=.inf would train to NaN weights


# Export writers and readers are named as strings in this module, so models import nothing from export/.
EXPORT = "draftsmith.export.formats:"
OBJ = "draftsmith.train.objectives:"  # objectives and acceptance inputs, likewise (models never import train/)


@dataclass(frozen=True)
class DrafterSpec:
    """What draftsmith needs to know about one drafter kind.

    kind: the ``drafter.kind`` value, also written to drafter.json.
    config: the recipe's drafter section for this kind, a ``Strict`` model with ``kind: Literal[<kind>]``; the one
        source of the kind's defaults. Builders and objectives receive an instance of it.
    build: ``build(cfg, target, **data) -> nn.Module``: a fresh drafter from its section and the target; data are
        optional facts about the training records (counts: response token frequencies, tokenizer, eos_ids).
    from_config: ``from_config(config dict) -> nn.Module``: an (untrained) drafter of the shape drafter.json's
        ``config`` describes (what ``model.cfg.to_dict()`` wrote); registry.load_drafter loads the weights into it.
    interface: how the decoder drives it. "tokens": a Llama-like token drafter (``drafter(ids, cache=...)`` and
        ``new_cache``); "heads": heads on the target's final hidden state (``reads_target_hidden``,
        models/feature_heads.py); "features": an EAGLE-style feature drafter (``reads_target_features``,
        models/eagle.py); "block": a drafter that drafts a whole block in one forward over the target's fused
        features (``drafts_block``, models/dflash.py); None: not a proposer (an acceptance head, the judge).
    objective: the training loss, ``objective(model, batch, loss_cfg, ctx) -> StepOutput``
        (train/objectives.py), or its dotted name ``"package.module:function"``, imported when the loop needs it
        (models never import train/).
    signals: record signal groups the objective reads (data/records.py: topk, hidden_last, hidden_aux, specdec,
        judge); a callable of the built drafter when they depend on it. Feature signals are dropped when the loop
        computes the features itself.
    needs_target: the loop must run the frozen target even for a records teacher (a callable of the built drafter
        when it depends on it); drafters that read target features get it anyway when the records lack them.
    fsdp_wrap: module classes FSDP (recipes/accelerate/fsdp2.yaml) shards as units; those absent from a built
        drafter (an optional block) are skipped.
    packs: the objective trains on packed batches (train.packing, data/dataset.py ``collate_packed``): it passes
        the batch's per-document positions and mask (train/objectives.py ``packed_kw``) to every forward that
        mixes positions and keeps shifted targets inside a document. Kinds without it refuse train.packing.
    exports: the export formats (``draftsmith export --format``) the kind writes; ``hf`` is always one (by default
        draftsmith's own layout). {format: the writer ``"module:function"``, ``writer(model, info, verifier,
        include_embeddings) -> (tensors, config)``; or ``"refused: <why>"`` when the format cannot carry the kind;
        or an entry ``{"write": writer, "read": reader, "usage": usage, "plain_lm": bool}``: ``read(tensors, info,
        target, folder) -> tensors`` turns the engine's names back into the drafter's (``load_export``), ``usage(fmt,
        info, target, tokens) -> str`` says how an engine serves the folder (the card, the export log), and
        ``plain_lm`` marks a plain transformers causal-LM folder (the tokenizer is copied, the card says
        transformers, a reduced head is written in full with its kept ids recorded), ``head_ids`` a layout that
        drops a reduced head's maps, so drafter.json records its kept ids}; a callable of drafter.json's
        info when the answer depends on the config (EAGLE's version). A format not listed is refused in one line
        naming the kind's formats.
    check: ``check(recipe) -> None``, raising ValueError: the kind's checks of its section against the recipe's other
        sections (export formats, eval strategy, train options), run when a recipe is validated. Checks within the
        section go in its own validators.
    role: what a checkpoint of the kind is for. "drafter": it drafts; "stop_head": a head that decides when to stop
        drafting (``eval.stop.head``); eval, given one as the drafter, decodes with the drafter it was trained on
        (its ``cfg.draft``) under the head's stop rule; "judge_head": a head that judges rejected drafts
        (``eval.judge.head``, lossy verification). Only drafters have an ``interface``.
    causal_lm: a checkpoint is an ordinary causal LM over the target's tokens (one token per forward, no target
        state), so it can write and label sequences on its own (``data.draft``, ``data.specdec_labels``,
        ``data.judge_labels``) and stand in for transformers' assistant model (eval's like-for-like baseline).
    acceptance: how a SpecDec++ acceptance head (``role`` "stop") reads this kind's drafts, or None when it cannot:
        {"inputs": ``"module:function"``, ``inputs(drafter, batch, ctx, before=...) -> (x, s)`` or ``(x, s, slot)``
        (train/objectives.py); "signals": record signals the labels come from (stored labels), "needs_target":
        labels are made in the loop from the target}.
    engines: how a serving engine speculates with the kind's exports: {engine: {"method": its speculative method,
        "formats": the export formats it loads, and any further keys of its speculative config}}; a callable of
        drafter.json's info when it depends on the config (EAGLE's version). An engine not listed has no method
        for the kind (draftsmith/engines/vllm.py refuses it in one line).
    """

    kind: str
    config: type[Strict]
    build: Callable
    from_config: Callable
    interface: Interface | None
    objective: str | Callable
    signals: frozenset[str] | Callable = frozenset({"topk"})
    needs_target: bool | Callable = False
    fsdp_wrap: tuple[type, ...] = ()
    packs: bool = False
    exports: dict | Callable = field(default_factory=dict)
    check: Callable | None = None
    engines: dict | Callable = field(default_factory=dict)
    role: Role = "drafter"
    causal_lm: bool = False
    acceptance: dict | None = None

    def export_formats(self, info: dict) -> dict[str, dict]:
        """{format: its entry} for the checkpoint drafter.json's ``info`` describes (``exports``), each entry a dict
        with ``write`` (a writer or a refusal) and optionally ``read``, ``usage`` and ``plain_lm``; ``hf`` always
        listed."""
        table = self.exports(info) if callable(self.exports) else self.exports
        out = {"hf": {"write": "draftsmith.export.formats:to_own_layout"}}
        out.update({f: e if isinstance(e, dict) else {"write": e} for f, e in table.items()})
        return out

    def engine(self, name: str, info: dict) -> dict | None:
        """How engine ``name`` speculates with the export drafter.json's ``info`` describes (``engines``), or None."""
        table = self.engines(info) if callable(self.engines) else self.engines
        return table.get(name)

    def __post_init__(self):
        if self.role not in ROLES or (self.role == "drafter") != (self.interface is not None):
            raise ValueError(
                f"DrafterSpec {self.kind!r}: role must be one of {ROLES}, 'drafter' exactly when it has an interface; "
                f"got role={self.role!r}, interface={self.interface!r}"
            )
        if self.interface not in (*INTERFACES, None):
            raise ValueError(
                f"DrafterSpec {self.kind!r}: interface must be one of {INTERFACES} or None, got {self.interface!r}"
            )
        tag = self.config.model_fields.get("kind")
        if tag is None or get_args(tag.annotation) != (self.kind,):
            raise ValueError(
                f"DrafterSpec {self.kind!r}: {self.config.__name__} needs a field "
                f"kind: Literal[{self.kind!r}] = {self.kind!r}"
            )

    @property
    def reads_features(self) -> bool:
        """Trains on the target's final hidden states: from the records when stored, else the target runs in the
        loop (heads and feature drafters)."""
        return self.interface in ("heads", "features")

    def section(self, cfg) -> Strict:
        """``cfg`` as this kind's typed section: a section passes through; a dict of its fields (without or with
        ``kind``) is validated, with the section's defaults filled in."""
        return as_section(self.config, cfg)

    def signals_for(self, drafter) -> set[str]:
        return set(self.signals(drafter) if callable(self.signals) else self.signals)

    def needs_target_for(self, drafter) -> bool:
        return bool(self.needs_target(drafter) if callable(self.needs_target) else self.needs_target)


def dotted(obj: str | Callable) -> Callable:
    """A callable named ``"package.module:function"`` (imported now), or ``obj`` itself when it is callable: spec
    hooks name code in train/ and export/ as strings so that models import neither."""
    if callable(obj):
        return obj
    module, _, name = obj.partition(":")
    return getattr(importlib.import_module(module), name)


def as_section(config: type[Strict], cfg) -> Strict:
    """A drafter section from itself or from a dict of its fields; invalid fields are one DraftsmithError."""
    if isinstance(cfg, config):
        return cfg
    if isinstance(cfg, BaseModel):
        raise DraftsmithError(f"drafter: expected a {config.__name__}, got a {type(cfg).__name__}")
    try:
        return config.model_validate(dict(cfg))
    except ValidationError as e:
        msgs = []
        for err in e.errors()[:3]:
            key = ".".join(["drafter", *map(str, err["loc"])])
            msg = err["msg"].removeprefix("Value error, ")
            msgs.append(f"unknown key {key}" if err["type"] == "extra_forbidden" else f"{key}: {msg}")
        raise DraftsmithError("; ".join(msgs)) from None
