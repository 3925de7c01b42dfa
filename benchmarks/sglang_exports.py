"""Every ``--format sglang`` export served by SGLang itself (GPU only: SGLang has no CPU kernels). For a GPU window
(``bash benchmarks/gpu_run.sh sglang``) on a machine where ``import sglang`` works.

For each case: a tiny random target of its family (head_dim 64, the smallest SGLang's attention kernels take) and
a drafter that drafts the target's own prediction again (``draftsmith.models.tiny.passthrough_eagle``, as the vLLM
tier builds them), exported as ``--format sglang`` and served with ``sglang.Engine`` (speculative algorithm EAGLE3
or EAGLE) on a chain of --draft-len tokens. Printed per case: greedy answers equal to draftsmith's plain decoding
(they must be), SGLang's tau (completion tokens / verify steps, from its meta_info) next to draftsmith's tau on the
same prompts. A case SGLang refuses prints SGLang's own error. Not yet run: no GPU machine here has had SGLang.

    python benchmarks/sglang_exports.py [--draft-len 3] [--max-new 32] [--out runs/sglang]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def cases():
    from draftsmith.models.tiny import passthrough_eagle

    def eagle3(**section):
        return lambda target, counts: passthrough_eagle(target, 3, counts=counts, eos_ids={2}, **section)

    return {
        "eagle3-llama": ("llama", eagle3(), "EAGLE3"),
        "eagle3-llama-full-vocab": ("llama", eagle3(draft_vocab=None), "EAGLE3"),
        "eagle3-qwen2-llama-layer": ("qwen2", eagle3(), "EAGLE3"),
        "eagle3-qwen3-llama-layer": ("qwen3", eagle3(), "EAGLE3"),
        "eagle1-llama": ("llama", lambda target, counts: passthrough_eagle(target, 1, seed=2), "EAGLE"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft-len", type=int, default=3, help="chain length SGLang and draftsmith draft")
    ap.add_argument("--max-new", type=int, default=32, help="new tokens per prompt")
    ap.add_argument("--out", default="runs/sglang", help="folder for the tiny targets, checkpoints and exports")
    a = ap.parse_args()
    try:
        import sglang
    except ImportError as e:
        sys.exit(f"sglang_exports: SGLang is not installed here ({e}); it needs a GPU machine with sglang")
    from draftsmith.eval.decoder import DecodeStats, autoregressive_generate, speculative_generate
    from draftsmith.export.writer import export
    from draftsmith.models.loading import load_model
    from draftsmith.models.registry import save_drafter
    from draftsmith.models.tiny import save_tiny_target, tiny_tokenizer

    root, eos = Path(a.out), 2
    tok = tiny_tokenizer(["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n"] * 4)
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 14)]
    print(f"sglang {sglang.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for name, (family, build, algorithm) in cases().items():
        rope = {"rope_type": "default", "rope_theta": 50000.0}
        tdir = save_tiny_target(root / f"target-{family}", tok, family, num_hidden_layers=4, hidden_size=256,
                                num_attention_heads=4, rope_parameters=rope, **({"head_dim": 64} if family == "qwen3"
                                                                                 else {}))  # fmt: skip
        target = load_model(str(tdir)).model
        ar = [autoregressive_generate(target, torch.tensor(p), a.max_new, eos_ids={eos}) for p in prompts]
        counts = torch.ones(target.cfg.vocab_size, dtype=torch.float64)
        drafter = build(target, counts).eval()
        ckpt = save_drafter(root / name / "checkpoints" / "final", drafter, "eagle", {"target": str(tdir), "step": 1})
        folder = export(ckpt, "sglang", root / name / "sglang")
        ours = DecodeStats()
        for p in prompts:
            ours.merge(speculative_generate(target, drafter, torch.tensor(p), a.max_new, draft_len=a.draft_len,
                                            eos_ids={eos})[1])  # fmt: skip
        try:
            engine = sglang.Engine(
                model_path=str(tdir),
                speculative_algorithm=algorithm,
                speculative_draft_model_path=str(folder),
                speculative_num_steps=a.draft_len,
                speculative_eagle_topk=1,
                speculative_num_draft_tokens=a.draft_len + 1,
                dtype="float32",
                skip_tokenizer_init=True,
            )
            outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": a.max_new})
            engine.shutdown()
        except Exception as e:  # SGLang's own words, one line
            print(f"{name}: refused by SGLang: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            continue
        same = [list(o["output_ids"])[: a.max_new] == r for o, r in zip(outs, ar)]
        steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
        tokens = sum(o["meta_info"].get("completion_tokens", 0) for o in outs)
        tau = tokens / steps if steps else float("nan")
        print(f"{name}: answers equal to the target's {sum(same)}/{len(same)}; tau SGLang {tau:.3f}, draftsmith "
              f"{ours.tau:.3f} (chain of {a.draft_len})")  # fmt: skip


if __name__ == "__main__":
    main()
