"""Shared fixtures: everything is built in code, offline (a tiny byte-level BPE tokenizer with a ChatML template
and a tiny random HF Llama saved as a normal model folder). Slow tests need DRAFTSMITH_SLOW=1; gpu tests CUDA."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():  # Triton kernels run in its CPU interpreter; must be set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests' own recipes (tests/recipes: `tiny`) are found by name, here and in the subprocesses tests start.
_RECIPES = str(Path(__file__).resolve().parent / "recipes")
os.environ["DRAFTSMITH_RECIPES"] = os.pathsep.join(filter(None, (_RECIPES, os.environ.get("DRAFTSMITH_RECIPES"))))

from draftsmith.models.tiny import save_tiny_llama  # noqa: E402, F401 (tests import it from here)
from draftsmith.models.tiny import tiny_tokenizer as _tiny_tokenizer  # noqa: E402

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


def free_port() -> int:
    """A free TCP port on loopback (a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(*args: str, env: dict | None = None, timeout: int = 300):
    """``torch.distributed.run --nproc_per_node=2 ARGS`` (``-m MODULE ...`` or a script) on a free port, one
    thread per rank, offline -> the finished subprocess (stdout and stderr captured)."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def pytest_collection_modifyitems(config, items):
    slow_ok = os.environ.get("DRAFTSMITH_SLOW") == "1"
    vllm_ok = _importable("vllm")
    for item in items:
        if item.get_closest_marker("vllm") and not vllm_ok:
            item.add_marker(
                pytest.mark.skip(reason="vllm: not installed here (bash .ci/engines runs these in its venv)")
            )
        if "slow" in item.keywords and not slow_ok:
            item.add_marker(pytest.mark.skip(reason="slow: set DRAFTSMITH_SLOW=1 to run"))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="gpu: no CUDA device"))


def build_tokenizer():
    return _tiny_tokenizer(CORPUS)


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
    return [
        f"target.model={tiny_model_dir}",
        f"data.prompts.path={prompts_file}",
        f"eval.prompts.path={prompts_file}",
        f"out_dir={tmp_path / 'run'}",
    ]


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
    "mtp": {"init": "random", "ttt_steps": 2},  # the tiny targets ship no MTP layers: a fresh one of their kind
    "kangaroo": {"exit_layer": 1},  # the tiny targets have 2 layers
    "gumiho": {"version": 3, "serial_drafts": 2, "mlp_heads": 2, "mlp_layers": 2},
    "falcon": {"block_size": 2, "max_blocks": 3, "glance": 0.0},  # glancing draws positions: not layout-free
}


def drafter_kinds(**fields) -> list[str]:
    """Registered kinds whose spec fields equal ``fields``, e.g. ``drafter_kinds(interface="heads")``."""
    from draftsmith.models.registry import kinds

    return kinds(**fields)


def vllm_format(kind: str) -> str | None:
    """The export format vLLM's speculative method for ``kind`` reads (DrafterSpec.engines; ``vllm`` where it is
    one of them), or None when vLLM has no method for the kind."""
    from draftsmith.models.registry import drafter_spec

    entry = drafter_spec(kind).engine("vllm", {"kind": kind, "config": {}})
    return None if entry is None else ("vllm" if "vllm" in entry["formats"] else entry["formats"][0])


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
    args = [
        f"target.model={tiny_model_dir}",
        f"data.prompts.path={prompts_file}",
        f"out_dir={out}",
        "data.n_samples=2",
        "data.temperature=1.0",
        "-q",
    ]
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
        args = [
            "train",
            recipe,
            f"target.model={tiny_model_dir}",
            f"eval.prompts.path={prompts_file}",
            f"out_dir={out}",
            "-q",
            *overrides,
        ]
        assert main(args) == expect
        return out

    return run


@pytest.fixture
def killed_and_resumed(train_run, monkeypatch):
    """killed_and_resumed(name, *overrides) -> run folder: `draftsmith train` interrupted in its third optimizer
    step (exit 130), then rerun in the same folder to the end."""
    from draftsmith.train import loop

    def run(name: str, *overrides: str):
        real, calls = loop._optimizer_step, {"n": 0}

        def dies_in_step_3(*a, **kw):
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return real(*a, **kw)

        monkeypatch.setattr(loop, "_optimizer_step", dies_in_step_3)
        train_run(name, *overrides, expect=130)
        monkeypatch.setattr(loop, "_optimizer_step", real)
        return train_run(name, *overrides)

    return run


# ---- decoding: tiny float64 targets and drafters of every proposer kind (tests/test_decode_*.py, test_tree.py) -----
# float64 so rounding cannot flip an argmax; the fixtures are module-scoped, like the models they build.

from draftsmith.models.llama import LlamaConfig  # noqa: E402  (after the environment above, as every import here)

TINY_CFG = LlamaConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=256)
TINY_CFG8 = LlamaConfig(vocab_size=8, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32, max_seq_len=64)
DECODE_PROMPTS = [[5], [3, 14, 15, 92, 65], list(range(10, 40))]
NEW = 48  # new tokens per decode

# The drafter kinds the lossless tests cover, one per way of decoding: every registered kind that proposes
# (models/registry.py, spec interface set), with the variants that decode differently: a reduced draft vocabulary,
# Hydra++'s prefix layer, EAGLE-1 (also with FSPAD's two changes) and EAGLE-3. ``tiny_drafter`` builds each; a new
# kind needs no entry here.
VARIANTS = {
    "draft_lm": ("draft_lm", "draft_lm-vocab"),
    "hydra": ("hydra", "hydra++"),
    "eagle": ("eagle1", "fspad", "eagle3", "eagle3-vocab", "eagle3.1", "peagle"),
}


def proposer_kinds(*interfaces: str) -> tuple[str, ...]:
    """Every proposing kind's decoding variants, or only those whose spec interface is one of ``interfaces``."""
    from draftsmith.models.registry import DRAFTERS
    from draftsmith.models.spec import INTERFACES

    wanted = [k for k, s in DRAFTERS.items() if s.interface in (interfaces or INTERFACES)]
    return tuple(v for kind in wanted for v in VARIANTS.get(kind, (kind,)))


PROPOSER_KINDS = proposer_kinds()


def tiny_model(seed: int, cfg: LlamaConfig = TINY_CFG, logit_scale: float = 1.0):
    from draftsmith.models.llama import Llama

    torch.manual_seed(seed)
    m = Llama(cfg).double().eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(logit_scale)  # sharper distributions: fewer effective outcomes, less sampling noise
    return m


def noisy_copy(model, scale: float = 0.25, seed: int = 2):
    """The model with Gaussian noise on every weight: a mediocre drafter that accepts some drafts, not all."""
    m = tiny_model(0, model.cfg)
    m.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * p.std())
    return m


class AntiDrafter(torch.nn.Module):
    """Llama-like drafter whose argmax is always the target's argmin, so every greedy draft is rejected."""

    def __init__(self, target):
        super().__init__()
        self.target = target

    def new_cache(self, batch: int, max_len: int):
        return self.target.new_cache(batch, max_len)

    def forward(self, ids, **kw):  # any call the target takes (cache, pos, tree attn_mask)
        return -self.target(ids, **kw)


# Token drafters of known quality for the lossless tests: a random model, a noisy copy of the target, the target
# itself (every draft accepted) and one whose argmax is always wrong (none accepted).
REFERENCE_DRAFTERS = ("bad", "noisy", "oracle", "anti")


def reference_drafter(kind: str, target):
    if kind == "bad":
        return tiny_model(1)
    if kind == "noisy":
        return noisy_copy(target)
    return target if kind == "oracle" else AntiDrafter(target)


def is_heads(kind: str) -> bool:
    """A decoding variant of a heads kind (Hydra++ is Hydra with its prefix layer)."""
    from draftsmith.models.registry import DRAFTERS

    spec = DRAFTERS.get(kind.removesuffix("++"))
    return spec is not None and spec.interface == "heads"


def tiny_heads(kind: str, target, k: int, noise: float):
    """Medusa, MLP speculator, Hydra or Hydra++ heads (k of them) with noise on every weight (global RNG)."""
    from draftsmith.models.registry import build_drafter

    params = {"n_predict": k} if kind == "mlp_speculator" else {"n_heads": k}
    if kind == "hydra++":
        kind, params = "hydra", {**params, "prefix_attention": True}
    heads = build_drafter(kind, params, target)
    with torch.no_grad():  # non-trivial heads, not the identity start
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * noise)
    return heads


def tiny_eagle(version: int, target, noise: float, **params):
    from draftsmith.models.eagle import build_eagle

    counts = torch.arange(target.cfg.vocab_size, dtype=torch.float)  # draft_vocab keeps the highest ids (+ EOS 2)
    e = build_eagle({"version": version, **params}, target, counts=counts, eos_ids={2}).double().eval()
    with torch.no_grad():  # a non-trivial random drafter
        for p in e.parameters():
            p.add_(torch.randn_like(p) * noise)
    return e


def tiny_mtp(target, noise: float):
    """A fresh MTP layer of the target's kind whose projection passes the target's state through (eh_proj = [0, I])
    and whose block starts near the identity: it drafts roughly what the target last predicted, so repetitive tiny
    outputs accept some drafts and not all."""
    from draftsmith.models.registry import build_drafter

    m = build_drafter("mtp", small_section("mtp"), target).to(target.lm_head.weight.dtype).eval()
    with torch.no_grad():
        for p in m.layer.parameters():
            p.mul_(0.1)
            p.add_(torch.randn_like(p) * noise)
        d = m.layer.eh_proj.weight.shape[0]
        m.layer.eh_proj.weight[:, d:] += torch.eye(d, dtype=m.layer.eh_proj.weight.dtype)
        for norm in (m.layer.enorm, m.layer.hnorm, m.layer.post_norm):
            norm.weight.fill_(1.0)
    return m


def tiny_drafter(kind: str, target, heads: int = 4, noise: float = 0.05, lm_noise: float = 0.25):
    """A tiny drafter of one of ``PROPOSER_KINDS`` for ``target``, good enough to accept some drafts, not all: a
    draft LM is the target with ``lm_noise`` on its weights, other kinds are random with ``noise`` on theirs.
    Reduced vocabularies keep 48 (draft LM) or 24 (EAGLE) ids, at most half the target's."""
    V = target.cfg.vocab_size
    if kind == "draft_lm":
        return noisy_copy(target, lm_noise)
    if kind == "draft_lm-vocab":  # the noisy copy's layers, its head cut to the most frequent (here: highest) ids
        from draftsmith.models.registry import build_drafter

        counts = torch.arange(V, dtype=torch.float)
        small = build_drafter(
            "draft_lm", {"n_layers": target.cfg.n_layers, "draft_vocab": min(48, V // 2)}, target, counts=counts,
            eos_ids={2},
        ).eval()  # fmt: skip
        small.layers.load_state_dict(noisy_copy(target, lm_noise).layers.state_dict())
        return small
    if kind == "peagle":  # P-EAGLE: EAGLE-3.1 drafting 4 tokens per forward
        return tiny_eagle(3, target, noise, parallel_drafts=4, fc_norm=True)
    if kind == "fspad":  # the EAGLE-1 drafter with FSPAD's token gate and split output, each a little off its start
        base = tiny_eagle(1, target, noise)
        e = tiny_eagle(1, target, 0.0, feature_sampling=True, partial_alignment=True)
        sd = {**base.state_dict(), "mlp.down_proj.weight": base.mlp.down_proj.weight.repeat(2, 1)}
        e.load_state_dict({**e.state_dict(), **sd})
        with torch.no_grad():
            for p in (*e.fs.parameters(), e.mlp.down_proj.weight):
                p.add_(torch.randn_like(p) * noise * 0.3)
        return e
    if kind.startswith("eagle"):
        vocab = {"draft_vocab": min(24, V // 2)} if kind.endswith("vocab") else {}
        fc_norm = {"fc_norm": True} if kind == "eagle3.1" else {}  # EAGLE-3.1: a norm per fused layer
        return tiny_eagle(int(kind[5]), target, noise, **vocab, **fc_norm)
    if is_heads(kind):
        return tiny_heads(kind, target, heads, noise)
    if kind == "mtp":
        return tiny_mtp(target, noise)
    if kind == "kangaroo":  # the target's first layers (none of a 1-layer target) and the adapter, noise on what trains
        from draftsmith.models.kangaroo import build_kangaroo

        k = build_kangaroo({"exit_layer": min(1, target.cfg.n_layers - 1)}, target).to(target.lm_head.weight.dtype)
        with torch.no_grad():
            for p in k.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * noise)
        return k.eval()
    if kind == "falcon":  # its outputs predict k positions on: a random one drafts nearly nothing a test can accept
        import copy

        if "_falcon" not in target.__dict__:  # trained once per target (a module's fixture), a copy per call
            target.__dict__["_falcon"] = trained_falcon(target)
        return copy.deepcopy(target.__dict__["_falcon"])
    from draftsmith.models.registry import build_drafter  # any other registered kind: its small section, with noise

    drafter = build_drafter(kind, small_section(kind), target).to(target.lm_head.weight.dtype).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * noise)
    return drafter


def trained_falcon(target, steps: int = 8, **fields):
    """A Falcon drafter trained a few AdamW steps on the target's own greedy continuations of three prompts: it
    drafts some tokens right, some wrong (a random one, predicting k positions on, drafts almost none right)."""
    from match import train_briefly

    from draftsmith.data.dataset import collate
    from draftsmith.data.engine import Capture, Sampling, decode_batch
    from draftsmith.data.records import Record
    from draftsmith.models.registry import build_drafter, drafter_spec

    torch.manual_seed(7)
    params = drafter_spec("falcon").section({**SMALL_SECTIONS["falcon"], **fields})
    d = build_drafter("falcon", params, target).to(target.lm_head.weight.dtype)
    V, dt = target.cfg.vocab_size, target.lm_head.weight.dtype
    prompts = [torch.randint(3, V, (n,)).tolist() for n in (3, 6, 9)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    out = decode_batch(target, prompts, 32, set(), Sampling(0.0), gens, Capture(0, True, ()))
    recs = [Record(torch.tensor(p + g.tokens), torch.tensor([0] * len(p) + [1] * len(g.tokens)), i,
                   signals={k: v.to(dt) for k, v in g.hidden.items()})
            for i, (p, g) in enumerate(zip(prompts, out))]  # fmt: skip
    return train_briefly(d, params, collate(recs), steps)


@pytest.fixture(scope="module")
def one_thread():
    # Tiny models: intra-op threads only add sync overhead, and on a busy small box they can cost 10x.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def ar_outputs(target):
    """The target's own greedy output for every decode prompt: what every lossless decode must reproduce."""
    from draftsmith.eval.decoder import autoregressive_generate

    return {tuple(p): autoregressive_generate(target, torch.tensor(p), NEW) for p in DECODE_PROMPTS}


def check_tau_consistency(st):
    # tau = 1 + sum_k prod_{j<=k} alpha_j holds exactly when both come from the same histogram (A1.3).
    import math

    assert sum(st.accept_counts) == st.target_forwards
    assert sum(k * c for k, c in enumerate(st.accept_counts)) == st.accepted
    ppa = st.per_position_acceptance()
    assert st.tau == pytest.approx(1 + sum(math.prod(ppa[:k]) for k in range(1, len(ppa) + 1)))


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def exact_joint(model, prompt: list[int], depth: int) -> torch.Tensor:
    """P(t1..t_depth | prompt) at temperature 1 by enumerating all V**depth continuations (no cache)."""
    from draftsmith.models.sampling import process_logits

    V = model.cfg.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(V)] * depth).view(-1, depth)  # (V**depth, depth)
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs[:, :-1]], dim=1)
    with torch.no_grad():
        probs = process_logits(model(ids)[:, len(prompt) - 1 :], 1.0)  # (V**depth, depth, V)
    return probs.gather(-1, seqs[..., None]).squeeze(-1).prod(-1).view(*[V] * depth)


def sampled_joint(decode, target, prompt, depth: int, N: int):
    """Run ``decode(prompt_tensor) -> (tokens, stats)`` N times. Returns the empirical joint of the first ``depth``
    new tokens, the exact joint under the target, and the merged stats."""
    from draftsmith.eval.decoder import DecodeStats

    joint = exact_joint(target, prompt, depth)  # (V,) * depth
    counts = torch.zeros_like(joint)
    st = DecodeStats()
    for _ in range(N):
        out, s = decode(torch.tensor(prompt))
        counts[tuple(out[:depth])] += 1
        st.merge(s)
    return counts / N, joint, st


class AlignedOracleHeads:
    """A feature drafter that checks the decoder hands it the right hidden state (the target's LM head on it gives
    back ``cur``) and proposes the known greedy continuation ``ar``: full acceptance iff everything lines up. One
    row; chains (``draft_step``, one call per draft of a step, all accepted)."""

    reads_target_hidden = True
    max_draft_len = 4

    def __init__(self, target, ar):
        self.target, self.ar, self.k, self.checked, self.calls = target, ar, 0, 0, None

    def new_context(self, max_len, batch=1):
        return None

    def read_context(self, hs, cache=None, pos=None, valid=None):
        return hs

    def draft_step(self, h, path):
        if len(path) == 1:  # a step's first draft: h is the state that produced cur
            if self.calls is not None:
                self.k += self.calls + 1  # the last step's drafts, all accepted, and its bonus token
            self.calls = 0
            assert int(self.target.lm_head(h[0]).argmax()) == int(path[0][0]) == self.ar[self.k]
            self.checked += 1
        self.calls += 1
        nxt = self.k + len(path)
        logits = torch.zeros(1, self.target.cfg.vocab_size, dtype=h.dtype)
        logits[0, self.ar[nxt] if nxt < len(self.ar) else 0] = 10.0
        return logits, h

    def logits_after(self, h, path):
        return self.draft_step(h, path)[0]


class EagleOracle:
    """An EAGLE-protocol drafter that checks every committed pair (f_i, x_{i+1}) it is handed is aligned (the
    target's LM head on f_i gives x_{i+1}, for generated positions) and proposes the known greedy continuation:
    full acceptance iff the decoder's features, tokens and positions all line up."""

    reads_target_features = True

    def __init__(self, target, prompt, ar):
        self.target, self.seq, self.P = target, list(prompt) + list(ar), len(prompt)
        self.capture_layers, self.checked, self._real = (target.cfg.n_layers,), 0, False

    def features(self, cap, target):
        return target.norm(cap[target.cfg.n_layers])

    def project(self, f):
        self._real = True  # only the root call reads target features
        return f

    def new_cache(self, batch, max_len):
        from draftsmith.models.llama import KVCache

        return KVCache.keyless(batch, max_len)

    def step(self, state, ids, pos=None, cache=None, attn_mask=None, last_only=False, valid=None):
        T = ids.shape[1]
        pos = torch.arange(cache.length, cache.length + T) if pos is None else pos[0]
        cache.advance(T, valid)
        if self._real:  # pair at position i: feature f_i, token x_{i+1}
            self._real = False
            for j in range(T):
                assert int(ids[0, j]) == self.seq[int(pos[j]) + 1]
                if pos[j] >= self.P - 1:
                    assert int(self.target.lm_head(state[0, j]).argmax()) == int(ids[0, j])
                    self.checked += 1
        V = self.target.cfg.vocab_size
        logits = torch.full((1, T, V), -10.0, dtype=torch.float64)
        for j in range(T):
            nxt = int(pos[j]) + 2
            logits[0, j, self.seq[nxt] if nxt < len(self.seq) else 0] = 10.0
        return (logits[:, -1:] if last_only else logits), state
