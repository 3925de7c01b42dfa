#!/usr/bin/env bash
# The GPU checks of issues 4 and 5 in one command, for a lent GPU machine (see benchmarks/RESULTS.md):
#   bash benchmarks/gpu_run.sh [tests] [gpu-tests] [loss] [decoder] [trees]   (default: tests loss decoder trees)
# tests:   the whole pytest suite natively (the Triton kernels, CUDA graphs, the gpu-marked tests);
# loss:    benchmarks/loss_memory.py on CUDA (the fused KD-loss gradient's Triton kernels): SmolLM2 and Llama-3 shapes;
# decoder: benchmarks/gpu_decoder.py (~1B target, CUDA graphs, kernel share, efficiency; extra flags in
#          DECODER_ARGS, e.g. "--skip-eager");
# trees:   benchmarks/dynamic_tree_draft.py --device cuda --profile (where a dynamic tree's drafting time goes).
# Logs go to $OUT (the device tool's folder) or runs/gpu. Python packages the machine lacks travel as wheels in .whl/
# (installed into /tmp/site); .gpu/old holds eval/{decoder,tree}.py of 4c6937a for machines without git history.
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
stages=${*:-tests loss decoder trees}
for s in $stages; do
  case $s in
    tests)
      # Many tests start subprocesses that each initialise CUDA: spread them over the machine's cores when
      # pytest-xdist is there; a per-test limit keeps one hang from eating the lease.
      par=""; python3 -c "import xdist, pytest_timeout" 2>/dev/null && par="-n ${PYTEST_WORKERS:-12} --timeout 240"
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
    gpu-tests)  # only the gpu-marked tests (the shipped DDP / FSDP2 launcher configs, native kernels)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$out/pytest-gpu.log" | tail -15 ;;
    decoder)
      # shellcheck disable=SC2086
      python3 benchmarks/gpu_decoder.py ${DECODER_ARGS:-} --json "$out/gpu_decoder.json" 2>&1 \
        | tee "$out/gpu_decoder.log" ;;
    trees)
      old=""; [ -d .gpu/old ] && old="--old-dir .gpu/old"
      # shellcheck disable=SC2086
      python3 benchmarks/dynamic_tree_draft.py --device cuda --profile $old 2>&1 | tee "$out/dynamic_tree.log" ;;
    *) echo "unknown stage: $s (tests, gpu-tests, loss, decoder, trees)"; exit 2 ;;
  esac
done
