"""Shared fixtures: everything is built in code, offline (a tiny byte-level BPE tokenizer with a ChatML template
and a tiny random HF Llama saved as a normal model folder). Slow tests need DRAFTSMITH_SLOW=1; gpu tests CUDA."""
from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():  # Triton kernels run in its CPU interpreter; must be set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding lets a small draft model propose tokens that a large target verifies.",
    "def add(a, b):\n    return a + b\n",
    "Write a short poem about the sea and the stars at night.",
    "What is the capital of France? Paris is the capital of France.",
] * 4

PROMPTS = [
    {"conversations": [{"from": "human", "value": "Tell me about foxes."}, {"from": "gpt", "value": "Foxes."}]},
    {"question_id": 7, "category": "writing", "turns": ["Write a poem about the sea.", "Now shorter."]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]},
    {"messages": [{"role": "user", "content": "Explain speculative decoding."}]},
    {"conversations": [{"from": "human", "value": "def add(a, b):"}]},
    {"turns": ["Name the capital of France."], "category": "reasoning"},
    {"messages": [{"role": "user", "content": "Count to five."}]},
    {"messages": [{"role": "user", "content": "Say something about stars."}]},
]


def pytest_collection_modifyitems(config, items):
    slow_ok = os.environ.get("DRAFTSMITH_SLOW") == "1"
    for item in items:
        if "slow" in item.keywords and not slow_ok:
            item.add_marker(pytest.mark.skip(reason="slow: set DRAFTSMITH_SLOW=1 to run"))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="gpu: no CUDA device"))


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHATML
    return fast


def save_tiny_llama(path, tok, seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
               tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
               bos_token_id=tok.bos_token_id)
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer)


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in PROMPTS) + "\n")
    return p


@pytest.fixture
def tiny_overrides(tmp_path, tiny_model_dir, prompts_file):
    """Overrides that point the shipped `tiny` recipe at the fixtures, writing into tmp_path."""
    return [f"target.model={tiny_model_dir}", f"data.prompts.path={prompts_file}",
            f"eval.prompts.path={prompts_file}", f"out_dir={tmp_path / 'run'}"]


def shard_tensors(data_dir) -> dict:
    """{shard file name: {tensor name: tensor}} for every shard of a data folder (for byte-identity checks)."""
    from draftsmith.data.records import load_shard

    out = {}
    for p in sorted(data_dir.glob("shard-*.safetensors")):
        shard = load_shard(p)
        out[p.name] = {k: shard.tensor(k) for k in shard.keys()}
    return out


# ---- Drafter kinds: tests parametrise over the registry (models/registry.py), so a new kind joins them by existing.

# Small recipe sections of the shipped kinds for the tiny targets built here; any other kind (a new one) is built
# with its schema defaults, which suit a tiny target too.
SMALL_SECTIONS = {
    "draft_lm": {"n_layers": 1},
    "medusa": {"n_heads": 3},
    "mlp_speculator": {"n_predict": 3},
    "hydra": {"n_heads": 3},
    "eagle": {"version": 3, "ttt_steps": 2},
}


def drafter_kinds(**fields) -> list[str]:
    """Registered kinds whose spec fields equal ``fields``, e.g. ``drafter_kinds(interface="heads")``."""
    from draftsmith.models.registry import kinds

    return kinds(**fields)


def small_section(kind: str, **fields):
    """The typed recipe section of ``kind``: SMALL_SECTIONS[kind] (or the schema's defaults) updated with fields."""
    from draftsmith.models.registry import drafter_spec

    return drafter_spec(kind).section({**SMALL_SECTIONS.get(kind, {}), **fields})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, tiny_model_dir, prompts_file):
    """Records of the tiny recipe generated once per module (8 prompts, 2 samples each, top-8 signals); tests copy
    them into their own run folders (``train_run``)."""
    from draftsmith.cli import main

    out = tmp_path_factory.mktemp("train-data")
    args = [f"target.model={tiny_model_dir}", f"data.prompts.path={prompts_file}", f"out_dir={out}",
            "data.n_samples=2", "data.temperature=1.0", "-q"]
    assert main(["generate", "tiny", *args]) == 0
    return out / "data"


@pytest.fixture
def train_run(tmp_path, data_dir, tiny_model_dir, prompts_file):
    """train_run(name, *overrides) -> run folder, after `draftsmith train` returned 0 on a copy of the records."""
    import shutil

    from draftsmith.cli import main

    def run(name: str, *overrides: str, expect: int = 0, recipe: str = "tiny"):
        out = tmp_path / name
        if not (out / "data").exists():
            shutil.copytree(data_dir, out / "data")
        args = ["train", recipe, f"target.model={tiny_model_dir}", f"eval.prompts.path={prompts_file}",
                f"out_dir={out}", "-q", *overrides]
        assert main(args) == expect
        return out
    return run
