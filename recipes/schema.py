"""The recipe schema: one strict, typed pydantic model per section. Unknown keys are errors.

A recipe is one YAML file per pipeline (see recipes/*.yaml and the README's recipe reference). Code past the
CLI only ever sees a validated, frozen ``Recipe``.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class TargetConfig(Strict):
    model: str = "smollm2-135m-instruct"
    """Hub id (org/name), local HF folder, or the alias smollm2-135m-instruct (packaged GGUF, offline)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when ``model`` is a hub id."""
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    """Weights/compute dtype. auto = float32 on CPU, bfloat16 on GPU."""
    device: str = "auto"
    """auto = cuda if available, else cpu; or an explicit torch device string."""
    trust_remote_code: bool = False
    """Run the model repo's own Python code when loading its tokenizer. Off unless you ask."""


class PromptsConfig(Strict):
    source: Literal["sharegpt", "mt_bench", "humaneval", "file", "hub"]
    """sharegpt / mt_bench / humaneval (packaged, offline), file (local JSON/JSONL), hub (datasets name)."""
    path: str | None = None
    """File path (source=file) or hub dataset name (source=hub)."""
    split: str = "train"
    """Dataset split for source=hub."""
    n: int | None = Field(None, gt=0)
    """Use the first n usable prompts (after shuffling, if on). None = all."""
    shuffle: bool = False
    seed: int = 0
    max_turns: int | None = Field(1, gt=0)
    """Keep at most this many user turns of each conversation. None = all."""

    @model_validator(mode="after")
    def _path_needed(self):
        if self.source in ("file", "hub") and not self.path:
            raise ValueError(f"prompts.path is required when source is {self.source!r}")
        return self


class DataConfig(Strict):
    enabled: bool = True
    prompts: PromptsConfig = PromptsConfig(source="sharegpt", n=256)
    max_prompt_tokens: int = Field(512, gt=0)
    """Prompts longer than this (after the chat template) are truncated from the left or skipped."""
    too_long: Literal["truncate", "skip"] = "skip"
    max_new_tokens: int = Field(256, gt=0)
    """Longest target response generated per prompt (stops earlier at EOS)."""
    temperature: float = Field(0.0, ge=0.0)
    """0 = greedy target responses; > 0 samples them."""
    batch_size: int = Field(16, gt=0)
    """Prompts generated together (left-padded, one KV cache)."""
    topk: int = Field(32, ge=0)
    """Teacher top-k log-probs stored per response token (plus the tail mass). 0 = tokens only."""
    shard_size: int = Field(256, gt=0)
    """Prompts per safetensors shard; a shard is the unit of resume."""


class DraftLMConfig(Strict):
    """A standalone small Llama-style draft LM sharing the target's tokenizer (FastDraft / DistillSpec)."""

    kind: Literal["draft_lm"] = "draft_lm"
    n_layers: int = Field(2, gt=0)
    dim: int | None = Field(None, gt=0)
    """Hidden size; None = the target's (needed to copy its embeddings)."""
    n_heads: int | None = Field(None, gt=0)
    n_kv_heads: int | None = Field(None, gt=0)
    hidden_dim: int | None = Field(None, gt=0)
    """MLP width; None = the target's."""
    init_from_target: bool = True
    """Copy the target's token embeddings, final norm and LM head (requires dim == target dim)."""
    init_layers: list[int] | None = None
    """Target layer indices copied into the draft's layers (len == n_layers). None = random init."""
    freeze_embeddings: bool = True
    """Keep the copied embeddings / LM head frozen (they dominate the parameter count of small drafters)."""


DrafterConfig = Annotated[DraftLMConfig, Field(discriminator="kind")]


class LossConfig(Strict):
    kind: Literal["fkl", "ce"] = "fkl"
    """fkl = forward KL to the stored teacher top-k distribution (+ tail); ce = cross-entropy on target tokens."""


class TrainConfig(Strict):
    enabled: bool = True
    steps: int = Field(200, gt=0)
    """Optimizer steps."""
    lr: float = Field(3e-4, gt=0)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    micro_batch_size: int = Field(4, gt=0)
    grad_accum: int = Field(1, gt=0)
    grad_clip: float = Field(1.0, gt=0)
    max_seq_len: int = Field(1024, gt=1)
    """Training sequences are cut to this many tokens."""
    precision: Literal["no", "bf16", "fp16"] = "no"
    """accelerate mixed precision."""
    loss: LossConfig = LossConfig()
    log_every: int = Field(10, gt=0)
    save_every: int = Field(0, ge=0)
    """Save a resumable checkpoint every N steps (0 = only the final one)."""
    wandb: bool = False
    tensorboard: bool = False


class EvalConfig(Strict):
    enabled: bool = True
    prompts: PromptsConfig = PromptsConfig(source="mt_bench", n=20)
    max_new_tokens: int = Field(128, gt=0)
    temperature: float = Field(0.0, ge=0.0)
    """0 = greedy (output must equal the target's); > 0 = lossless rejection sampling."""
    strategy: Literal["chain"] = "chain"
    draft_len: int = Field(4, ge=1, le=32)
    """Draft tokens proposed per target forward."""
    baseline_hf: bool = True
    """Also time plain HF generate() and check the speculative output matches it token for token."""
    checkpoint: str | None = None
    """Drafter checkpoint folder; None = <out_dir>/checkpoints/final."""
    warmup: int = Field(1, ge=0)
    """Prompts run once untimed before timing starts."""


class Recipe(Strict):
    name: str = Field(min_length=1)
    out_dir: str | None = None
    """Run folder; None = runs/<name>."""
    seed: int = 0
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()
    drafter: DrafterConfig = DraftLMConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()

    @property
    def run_dir(self):
        from pathlib import Path

        return Path(self.out_dir or f"runs/{self.name}")

    def stages(self) -> list[str]:
        return [s for s in ("generate", "train", "eval") if getattr(self, "data" if s == "generate" else s).enabled]

    @model_validator(mode="after")
    def _cross_checks(self):
        d = self.drafter
        if d.init_layers is not None and len(d.init_layers) != d.n_layers:
            raise ValueError(f"drafter.init_layers has {len(d.init_layers)} entries but n_layers is {d.n_layers}")
        return self
