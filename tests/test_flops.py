"""draftsmith/flops.py: FLOPs counted on the dispatched operations, the peak they are measured against, and MFU."""

from __future__ import annotations

import pytest
import torch

from draftsmith import flops
from draftsmith.flops import Meter, count_flops, peak_flops


def test_count_flops_counts_matmuls_forward_and_backward():
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(10, 64)
    f, out = count_flops(lin, x)
    assert f == 2 * 10 * 64 * 32 and out.shape == (10, 32)

    def step():
        lin(x).sum().backward()

    f, _ = count_flops(step)  # forward + the weight's gradient (the input needs none)
    assert f == 2 * (2 * 10 * 64 * 32)


def test_a_llama_forward_is_about_two_flops_per_parameter_per_token():
    from conftest import tiny_model

    m = tiny_model(0)
    ids = torch.randint(0, m.cfg.vocab_size, (2, 16))
    f, _ = count_flops(m, ids)
    n = m.num_params(exclude_embeddings=True)  # the LM head counts; the embedding lookup does no matmul
    assert 0.9 * 2 * n * 32 <= f <= 2 * n * 32 * 1.5  # norms do no matmul; attention scores add some


def test_peak_comes_from_the_data_sheet_on_a_known_gpu_else_from_a_measurement(monkeypatch):
    peak, source = peak_flops("cpu", torch.float32)
    assert peak > 1e8 and source.startswith("measured")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops("cuda", torch.bfloat16) == (989e12, "NVIDIA H100 80GB HBM3 data sheet, dense bfloat16")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 PCIe")
    assert peak_flops("cuda", torch.bfloat16)[0] == 756e12
    monkeypatch.setattr(flops, "measured_peak", lambda d, t: 1.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Some Future GPU")
    assert peak_flops("cuda", torch.bfloat16) == (1.0, "measured: best large bfloat16 matmul")


def test_meter_turns_tokens_per_second_into_tflops_and_mfu(monkeypatch):
    monkeypatch.setattr(flops, "measured_peak", lambda d, t: 2e12)
    m = Meter.from_step(flops=6_000_000, tokens=1000, device="cpu", dtype=torch.float32)
    assert m.flops_per_token == 6000
    assert m.tflops(1e9) == pytest.approx(6.0) and m.mfu(1e9) == pytest.approx(3.0)


def test_training_logs_tflops_and_mfu_from_a_counted_step(train_run, monkeypatch):
    """`draftsmith train` counts one step's FLOPs and logs input tokens/s, TFLOP/s and MFU per device in every window
    after it (a fixed peak here, so MFU is TFLOP/s over it)."""
    import json

    monkeypatch.setattr(flops, "measured_peak", lambda d, t: 1e9)  # a fixed peak: MFU = FLOP/s / 1e9
    run = train_run("mfu", "train.steps=4", "train.log_every=1")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("stage") == "train" and "loss" in r]
    assert len(rows) == 4 and "mfu" not in rows[0]  # the first window comes before the counted step
    for r in rows[1:]:
        assert r["input_tokens_per_s"] > 0 and r["tflops"] > 0
        # both are logged to 6 significant figures
        assert r["mfu"] == pytest.approx(r["tflops"] * 1e12 / 1e9, rel=2e-5)


def test_generation_logs_tflops_and_mfu_per_shard(tmp_path, tiny_model_dir, prompts_file, monkeypatch):
    """`draftsmith generate` logs each shard's window rate and its TFLOP/s and MFU (FLOPs per token counted once on
    the target before its matmuls are packed)."""
    import json

    from draftsmith.cli import main

    monkeypatch.setattr(flops, "measured_peak", lambda d, t: 1e9)
    args = [f"target.model={tiny_model_dir}", f"data.prompts.path={prompts_file}", f"out_dir={tmp_path}"]
    assert main(["generate", "tiny", *args, "data.shard_size=2", "-q"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("stage") == "generate" and "shard" in r]
    assert len(rows) >= 2
    for r in rows:
        assert r["window_tokens_per_s"] > 0 and r["tflops"] > 0
        # both are logged to 6 significant figures
        assert r["mfu"] == pytest.approx(r["tflops"] * 1e12 / 1e9, rel=2e-5)
