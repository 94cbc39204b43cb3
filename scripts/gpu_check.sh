#!/usr/bin/env bash
# The GPU check, on the GPU machine (../shared/gpu/README.md): after kit/setup.sh has put onnxruntime-gpu and this
# project into /tmp/site, from the project root:
#   PYTHONPATH=/tmp/site bash scripts/gpu_check.sh [seconds for the benchmark]
# With the device tool: run ../shared/gpu/make-kit here, then four run calls back to back, carrying
#   .gpu/kit and .gpu/c1: mkdir -p /tmp/ortz && cp -r .gpu/kit .gpu/c1 /tmp/ortz/
#   .gpu/c2, then .gpu/c3:  mkdir -p /tmp/ortz && cp .gpu/cN /tmp/ortz/
#   .gpu/c4:                cp .gpu/c4 /tmp/ortz/ && bash /tmp/ortz/kit/setup.sh && PYTHONPATH=/tmp/site bash scripts/gpu_check.sh 270
# (timeout_s 600). The defaults cuda_graphs=False and cuda_memory="session" stay until this has measured the
# levers; the tests and the parity column run them on.
# Runs tests/test_cuda.py (training against eager with CUDA graphs, TF32 following torch, no host copies, one
# memory pool), then the GPU benchmark within the given seconds. Writes its logs, the JSON and the report's CUDA
# section under $OUT (or /tmp/gpu-check).
set -u
out=${OUT:-/tmp/gpu-check}; mkdir -p "$out"
budget=${1:-300}
export PYTHONUNBUFFERED=1 AOT2ONNX_CACHE_DIR=off
python3 - <<'PY' 2>&1 | tee "$out/env.log"
import torch, onnxruntime as ort
print("torch", torch.__version__, torch.cuda.get_device_name(0), "| onnxruntime", ort.__version__, ort.get_available_providers())
import aot2onnx; print("aot2onnx", aot2onnx.__file__)
PY
start=$(date +%s)
timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py -x -rs 2>&1 | tail -60 | tee "$out/tests.log"
echo "tests took $(( $(date +%s) - start )) s" | tee -a "$out/tests.log"
cp BENCHMARKS.md "$out/BENCHMARKS.md"
# aot2onnx's contenders on every model first; inductor (whose compiles take most of a minute each) after, on the
# model its target names, in what time is left.
timeout $(( budget + 90 )) python3 -m aot2onnx bench --device cuda --budget "$budget" --json "$out/bench.json" \
  --contenders eager,aot2onnx,aot2onnx-cuda-graphs,aot2onnx-shared-arena,aot2onnx-torch-memory,aot2onnx-graphs-shared \
  --memory-contenders eager,aot2onnx,aot2onnx-shared-arena,aot2onnx-torch-memory,aot2onnx-graphs-shared \
  --out "$out/BENCHMARKS.md" ${BENCH_ARGS:-} 2>&1 | grep -v "No registered plugin EP" | tee "$out/bench.log" | tail -60
timeout ${INDUCTOR_SECONDS:-150} python3 -m aot2onnx bench --device cuda --models gpt-d256 --no-parity \
  --contenders eager,inductor-ro,aot2onnx,aot2onnx-graphs-shared --memory-models "" --json "$out/inductor.json" --out "$out/inductor.md" 2>&1 \
  | grep -v "No registered plugin EP" | tee "$out/inductor.log" | tail -20
