#!/usr/bin/env bash
# One device-tool call's worth of GPU checks, run from the repo root on the GPU machine:
#   bash benchmarks/device_check.sh tests        # pytest -m gpu (kernels, launch layer, model engines), 8 workers
#   bash benchmarks/device_check.sh e2e          # benchmarks/e2e.py: model decode step, torch graph vs JAX jit
#   bash benchmarks/device_check.sh model-step   # benchmarks/model_step.py: the step at M3's layer shapes vs its
#                                                #   byte floor (MODEL_STEP_ARGS: extra arguments)
#   bash benchmarks/device_check.sh speculative  # benchmarks/speculative.py: n-gram drafts vs plain decoding at M3's
#                                                #   layer shapes (SPEC_ARGS: extra arguments)
#   bash benchmarks/device_check.sh jax [NS]     # benchmarks.jax_vs_torch on the anchors' 87 cases (about 5 minutes;
#                                                #   NS: only these decode_query_len values): JAX vs torch
#   bash benchmarks/device_check.sh grid OLD     # quick grid of checkout OLD, then of this one (same call)
#   bash benchmarks/device_check.sh cute-stage   # CuTeDSL, call 1 (carry .whl-cute1): park the first wheels in /tmp/cute
#   bash benchmarks/device_check.sh cutedsl      # CuTeDSL, call 2 within 30 s (carry .whl, .whl-cute2): install,
#                                                #   pytest tests/ops/test_cutedsl.py -m gpu, then benchmarks.indexer --quick
#   bash benchmarks/device_check.sh tp           # 2 GPUs: tensor-parallel GPU tests, then e2e.py --tp 2
#   bash benchmarks/device_check.sh fp8          # benchmarks.fp8: the decode grid with FP8 caches beside bf16
#   bash benchmarks/device_check.sh profile "ARGS" ...  # Nsight Compute on one msa_decode per ARGS
#                                                #   (benchmarks.profile_kernels arguments), ncu-*.log
# Logs and results go under $OUT (the device tool brings them back).
set -uo pipefail
OUT=${OUT:-/tmp/m3-out}; mkdir -p "$OUT"
here=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case "${1:-tests}" in
  tests)
    source benchmarks/device_env.sh
    # pytest-xdist and pytest-timeout are in the machine's image; the thread method ends a test stuck in C.
    # Two OpenMP threads per worker: with torch's default (one per core) in every worker the float64
    # references of the M3 prefill cases ran past 280 s; with two, the whole suite took 442 s on 8 workers
    # (2026-12-02). The outer timeout leaves the log to come back within a device call's 600 s.
    # Each failure's traceback is written when it happens (M3_FAILURE_LOG, one file per worker), and the
    # files are packed into one archive: a run cut by the time limit still shows why tests failed.
    mkdir -p /tmp/m3-failures
    M3_FAILURE_LOG=/tmp/m3-failures/failures.log OMP_NUM_THREADS=2 timeout 560 python3 -m pytest -q -m gpu \
      -p no:cacheprovider -n 8 --timeout 300 --timeout-method thread --tb=short -rfE --durations=12 2>&1 \
      | tee "$OUT/gpu-tests.log" | tail -25
    tar czf "$OUT/gpu-test-failures.tgz" -C /tmp/m3-failures . ;;
  e2e)
    source benchmarks/device_env.sh
    python3 -m benchmarks.e2e --out "$OUT/e2e" 2>&1 | tee "$OUT/e2e.log" | tail -40 ;;
  model-step)
    source benchmarks/device_env.sh
    python3 -m benchmarks.model_step --out "$OUT/model-step" ${MODEL_STEP_ARGS:-} 2>&1 | tee "$OUT/model-step.log" \
      | tail -40 ;;
  speculative)
    source benchmarks/device_env.sh
    python3 -m benchmarks.speculative --out "$OUT/speculative" ${SPEC_ARGS:-} 2>&1 | tee "$OUT/speculative.log" \
      | tail -40 ;;
  tp)
    source benchmarks/device_env.sh
    python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 240 --timeout-method thread -rs -s \
      tests/model/test_tp_torch.py tests/model/test_tp_jax.py 2>&1 | tee "$OUT/tp-tests.log" | tail -25
    python3 -m benchmarks.e2e --tp 2 --out "$OUT/e2e-tp" 2>&1 | tee "$OUT/e2e-tp.log" | tail -40 ;;
  jax)
    source benchmarks/device_env.sh
    python3 -m benchmarks.jax_vs_torch --grid --ns "${2:-1,2,4,8}" --budget-s 480 --out "$OUT/jax-vs-torch" 2>&1 \
      | tee "$OUT/jax-vs-torch.log" | tail -30 ;;
  fp8)
    source benchmarks/device_env.sh
    python3 -m benchmarks.fp8 ${FP8_ARGS:-} --out "$OUT/fp8" 2>&1 | tee "$OUT/fp8.log" | tail -40 ;;
  profile)
    source benchmarks/device_env.sh
    shift; i=0
    for case in "$@"; do
      i=$((i + 1))
      ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
        --section WarpStateStats --section Occupancy --section LaunchStats \
        python3 -m benchmarks.profile_kernels $case > "$OUT/ncu-$i.log" 2>&1
      echo "== $case"; grep -E "^  [a-z_]+_kernel|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Issue Slots Busy|No Eligible|Achieved Occupancy|Registers Per" "$OUT/ncu-$i.log"
    done ;;
  grid)
    for tree in "$2" "$here"; do
      (cd "$tree" && source benchmarks/device_env.sh && \
       python3 -m benchmarks.run --quick --budget-s "${BUDGET_S:-200}" --out "$OUT/grid-$(basename "$tree")" \
         2>&1 | tee "$OUT/grid-$(basename "$tree").log" | grep -E "msa|copy bandwidth|FAILED")
    done ;;
  cute-stage)
    mkdir -p /tmp/cute && cp .whl-cute1/* /tmp/cute/ && ls -la /tmp/cute ;;
  cutedsl)
    source benchmarks/device_env.sh
    python3 -c "import importlib.metadata as m, cutlass.cute; print('nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'))"
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_cutedsl.py 2>&1 | tee "$OUT/cutedsl-tests.log" | tail -30
    python3 -m benchmarks.indexer --quick --budget-s "${BUDGET_S:-240}" --out "$OUT/indexer" \
      2>&1 | tee "$OUT/indexer.log" | tail -40 ;;
esac
