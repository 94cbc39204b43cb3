#!/usr/bin/env bash
# The GPU check, on the GPU machine (../shared/gpu/README.md), in stages that fit the device tool's calls.
# Run ../shared/gpu/make-kit here first, then these run calls back to back (the machine goes back after 30 s
# idle), each from the project root with timeout_s as given:
#   1. carry .gpu/kit .gpu/c1:  mkdir -p /tmp/ortz && cp -r .gpu/kit .gpu/c1 /tmp/ortz/ && bash scripts/gpu_check.sh inductor
#      (torch alone: eager against inductor with CUDA graphs, while the kit is incomplete)      timeout_s 200
#   2. carry .gpu/c2:           mkdir -p /tmp/ortz && cp .gpu/c2 /tmp/ortz/
#   3. carry .gpu/c3:           likewise
#   4. carry .gpu/c4:           cp .gpu/c4 /tmp/ortz/ && bash /tmp/ortz/kit/setup.sh && PYTHONPATH=/tmp/site bash scripts/gpu_check.sh bench
#                                                                                                timeout_s 330
#   5. no carry:                PYTHONPATH=/tmp/site bash scripts/gpu_check.sh tests-memory      timeout_s 280
# Stage seconds can be set: BENCH_BUDGET (new measurements start until then), TESTS_SECONDS, MEMORY_BUDGET;
# TESTS_K selects tests (pytest's -k); BENCH_MODELS, BENCH_CONTENDERS and PROFILE_MODELS the bench's models,
# contenders and the models profiled (kernels, copies and host waits per step).
# Every stage writes its log and JSON under $OUT (or /tmp/gpu-check) as it goes, so a stage stopped at its
# limit still returns what it measured.
set -u
stage=${1:-bench}
out=${OUT:-/tmp/gpu-check}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 AOT2ONNX_CACHE_DIR=off
quiet() { grep --line-buffered -v "No registered plugin EP"; }

case "$stage" in
inductor)
  # onnx-ir from the kit, so that aot2onnx imports; onnxruntime is the image's (CPU) one, unused here.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site0 /tmp/ortz/kit/onnx_ir-*.whl 2>&1 | grep -v "'root' user"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$out/smi.log"
  PYTHONPATH=/tmp/site0 timeout ${INDUCTOR_SECONDS:-170} python3 -m aot2onnx bench --device cuda \
    --models ${INDUCTOR_MODELS:-gpt-d256,mlp,cnn} --no-parity --budget ${INDUCTOR_BUDGET:-110} \
    --contenders eager,inductor-ro --memory-models "" --json "$out/inductor.json" --out "$out/inductor.md" 2>&1 \
    | quiet | tee "$out/inductor.log"
  ;;
bench)
  python3 - <<'PY' 2>&1 | tee "$out/env.log"
import torch, onnxruntime as ort
print("torch", torch.__version__, torch.cuda.get_device_name(0), "| onnxruntime", ort.__version__, ort.get_available_providers())
import aot2onnx; print("aot2onnx", aot2onnx.__file__)
PY
  cp BENCHMARKS.md "$out/BENCHMARKS.md"
  # aot2onnx's default and its two speed levers against eager, models in the order of the issue's targets.
  timeout $(( ${BENCH_BUDGET:-210} + 80 )) python3 -m aot2onnx bench --device cuda --budget ${BENCH_BUDGET:-210} \
    --models ${BENCH_MODELS:-gpt-d256,mlp,cnn,gpt-d768,mobilenet,bert,gpt2-small} \
    --contenders ${BENCH_CONTENDERS:-eager,aot2onnx,aot2onnx-cuda-graphs} --memory-models "" \
    --profile-models ${PROFILE_MODELS:-gpt-d256,cnn} \
    --json "$out/bench.json" --out "$out/BENCHMARKS.md" ${BENCH_ARGS:-} 2>&1 | quiet | tee "$out/bench.log"
  ;;
tests-memory)
  # The CUDA tests, each test at most 60 s; then GPT-2 small's memory, a fresh process per contender.
  select=(); [ -n "${TESTS_K:-}" ] && select=(-k "$TESTS_K")
  timeout ${TESTS_SECONDS:-120} python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py -rfEs \
    --timeout 60 "${select[@]}" 2>&1 | quiet > "$out/tests.log"
  grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^E  " "$out/tests.log" | cut -c1-400 | tail -40
  # run-to-run drift against drift from eager, on the CNN (cuDNN's heuristics, then its benchmark)
  timeout ${DRIFT_SECONDS:-60} python3 scripts/cuda_drift.py cnn 8 2>&1 | quiet | tee "$out/drift.log" | tail -10
  DRIFT_BENCHMARK=1 timeout ${DRIFT_SECONDS:-60} python3 scripts/cuda_drift.py cnn 8 2>&1 | quiet | tee -a "$out/drift.log" | tail -10
  timeout $(( ${MEMORY_BUDGET:-100} + 70 )) python3 -m aot2onnx bench --device cuda --models gpt2-small --no-parity \
    --contenders "" --precisions "" --budget ${MEMORY_BUDGET:-100} --timeout 65 \
    --memory-models gpt2-small --memory-contenders ${MEMORY_CONTENDERS:-eager,aot2onnx,aot2onnx-cuda-graphs} \
    --json "$out/memory.json" --out "$out/memory.md" 2>&1 | quiet | tee "$out/memory.log"
  ;;
*)
  echo "usage: gpu_check.sh inductor|bench|tests-memory"; exit 2;;
esac
