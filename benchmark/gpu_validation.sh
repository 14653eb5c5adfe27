#!/usr/bin/env bash
# One GPU-machine run of everything that needs a GPU, in one call: the AOT build of our CUDA ops
# (the image's archs), the registered CUDA suites (1 GPU; 2 GPUs when present), the multi-GPU
# bs>1-vs-bs=1 harnesses and the kit layer at cp 2 (when 2 GPUs are present), the op benchmark against the measured copy
# roofline, a SASS check of the copy loop and a compute-sanitizer memcheck of a slice of the ops
# tests. Needs torch+triton+pytest on the machine. Upstream-backed tests must run (a skip fails them,
# SGLANG_CPKV_REQUIRE_UPSTREAM=1): with wheels in .whl/ (scripts/gpu_env/prepare_wheels.sh, run on a CPU
# machine) the TEST-ONLY GPU test environment is installed first (scripts/gpu_env/install.sh: the pinned
# upstream from those wheels, the patch queue, the import-only sgl_kernel stand-in), and upstream's own DSA
# attention kit runs there (scripts/gpu_env/dsa_kit_smoke.py); without them the machine's own sglang is used.
#
#   OUT=/some/dir benchmark/gpu_validation.sh   # repo root; env.txt, bench.{json,log}, harness_*.json and
#                                                # logs.tar.gz (every log) under $OUT; exit 0 only when all passed
#   STEPS="suite kit-layer ops" ...              # only these steps (default: all; the environment and the AOT
#                                                # build always run): suite kit-smoke kit-cuda harness kit-layer
#                                                # forward ragged plan-host ops sass memcheck
#   kit-cuda: the 1-GPU files that run every route's real kernel through the kit (a part of suite, for iterating);
#   forward: the whole-forward time of the flashmla routes at the deployed shape, three processes (issue 35;
#            FORWARD_ROUTES="flashmla_kv:fp8" for one route, FORWARD_HISTORY, FORWARD_REPS);
#   ragged: issue 34's repro on pristine upstream and with the queue, and the fix's per-layer cost;
#   plan-host: the host cost of the mode's per-batch plan by request count.
set -uo pipefail
# Absolute: the suite runner starts each test file in the file's own directory.
export PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cpkv_gpu_validation}
mkdir -p "$OUT"
status=0
# At exit every log goes into one archive and only the key results stay beside it (the device tool
# returns at most 8 files).
pack_logs() {
  tar -czf "$OUT/logs.tar.gz" -C "$OUT" --exclude logs.tar.gz . 2>/dev/null &&
    find "$OUT" -maxdepth 1 -type f -name '*.log' ! -name bench.log -delete
}
trap pack_logs EXIT
step() { printf '\n=== %s (%s)\n' "$1" "$(date -u +%T)"; }
STEPS=${STEPS:-all}
want() { [ "$STEPS" = all ] || [[ " $STEPS " == *" $1 "* ]]; }

step environment
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  nvcc --version | tail -1; git log -1 --format='commit %H' 2>/dev/null || true; } | tee "$OUT/env.txt"

export SGLANG_CPKV_REQUIRE_UPSTREAM=1
if compgen -G ".whl/*.whl" >/dev/null; then
  step "GPU test environment (TEST-ONLY: carried upstream wheels, patch queue, sgl_kernel stand-in)"
  if env_file="$(scripts/gpu_env/install.sh --target /tmp/cpkv-site 2>"$OUT/gpu_env.log")"; then
    # shellcheck disable=SC1090
    . "$env_file"
    grep -vE '^\[(gpu_env|overlay)\]' "$OUT/gpu_env.log" | tee -a "$OUT/env.txt"
  else
    status=1
    tail -n 30 "$OUT/gpu_env.log"
  fi
fi

step "AOT build of the CUDA ops (${AOT_ARCHS:=90a,100a,103a})"
python3 -m sglang_cpkv.ops.cuda_build --aot --arch "$AOT_ARCHS" --out /tmp/cpkv_aot 2>&1 | tee "$OUT/aot.log" | tail -3
export SGLANG_CPKV_CUDA_LIB=/tmp/cpkv_aot
python3 -c "from sglang_cpkv.ops import cuda; assert cuda.is_available(), cuda.unavailable_reason(); print('CUDA ops loaded from the AOT library')" || status=1

if want suite; then
  step "CUDA suite, 1 GPU"
  python3 test/run_suite.py --hw cuda --suite cpkv-test-1-gpu > "$OUT/suite_1gpu.log" 2>&1 || status=1
  grep -E '^(=== |files:|FAILED)|passed|failed|skipped' "$OUT/suite_1gpu.log"
fi
if want kit-smoke; then
  step "upstream's DSA attention kit: sparse prefill, every Hopper prefill backend, bf16 and FP8 pools (mode off)"
  python3 -m pytest scripts/gpu_env/dsa_kit_smoke.py -v -rs -p no:cacheprovider > "$OUT/kit_smoke.log" 2>&1 || status=1
  grep -E 'PASSED|FAILED|SKIPPED|ERROR|[0-9]+ (passed|failed)' "$OUT/kit_smoke.log"
fi
if want kit-cuda; then
  step "the kit with every route's real kernel, cp 1 and cp 2 over gloo on one GPU (mode off and on)"
  for file in integration/test_cp_shared_kv_kit_cuda.py harness/test_serving_harness_cuda.py; do
    name="$(basename "$file" .py)"
    python3 -m pytest "test/registered/$file" -v -rs -p no:cacheprovider > "$OUT/$name.log" 2>&1 || status=1
    grep -E 'PASSED|FAILED|SKIPPED|ERROR|[0-9]+ (passed|failed)' "$OUT/$name.log" | tail -n 30
  done
fi
if want harness && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  step "CUDA suite, 2 GPUs"
  python3 test/run_suite.py --hw cuda --suite cpkv-test-2-gpu > "$OUT/suite_2gpu.log" 2>&1 || status=1
  grep -E '^(=== |files:|FAILED)|passed|failed|skipped' "$OUT/suite_2gpu.log"
  # (the suite above runs the serving-path harness at cp 1,2 over NCCL: test_serving_harness_nccl.py)
  step "kit layer at cp 2 over NCCL: layer-ahead prefetch beside upstream's all-gather vs synchronous vs mode off"
  for pool in bf16 fp8; do
    python3 benchmark/bench_kit_layer.py --cp 2 --requests 8 --history 8192,16384,32768 --extend 4096 --layers 4 \
      --heads 32 --topk 2048 $([ "$pool" = fp8 ] && echo --fp8) --out "$OUT/kit_layer_cp2_$pool.json" \
      > "$OUT/kit_layer_cp2_$pool.log" 2>&1 || status=1
    grep -vE '^\[20|[Ww]arn' "$OUT/kit_layer_cp2_$pool.log" | tail -n 12
  done
  for backend in cuda triton; do
    step "serving-path harness at cp 1,2 over NCCL, ops backend $backend"
    python3 scripts/run_cp_harness.py --cp 1,2 --bs-list 2,4,8 --device cuda \
      --backend "$backend" --out "$OUT/harness_$backend.json" > "$OUT/harness_$backend.log" 2>&1 || status=1
    tail -n 3 "$OUT/harness_$backend.log"
  done
fi

if want kit-layer; then
  step "upstream's kit layer (triton_sparse_mla), per-layer time, mode off / on (layer-ahead, synchronous), cp 1"
  # The kit's layer shape (4 heads, top-k 128), then the largest triton_sparse_mla takes: 32 heads per rank (it
  # refuses more), top-k 2048 (DeepSeek-V3.2's). --profile adds each kernel's GPU time (minutes under the profiler).
  for shape in "4 128" "32 2048"; do
    set -- $shape
    for pool in bf16 fp8; do
      name="kit_layer_${pool}_h$1_k$2"
      python3 benchmark/bench_kit_layer.py --requests 8 --history 8192 --extend 1024 --layers 4 --heads "$1" \
        --topk "$2" $([ "$pool" = fp8 ] && echo --fp8) --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || status=1
      grep -vE '^\[20|[Ww]arn' "$OUT/$name.log" | tail -n 40
    done
  done
  # Issue 24: 8 requests on one shared 8192-token history vs 8 distinct histories (the run above), same shape.
  name="kit_layer_fp8_h32_k2048_shared"
  python3 benchmark/bench_kit_layer.py --requests 8 --history 8192 --extend 1024 --layers 4 --heads 32 --topk 2048 \
    --fp8 --sharing shared --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || status=1
  grep -vE '^\[20|[Ww]arn' "$OUT/$name.log" | tail -n 40
fi

if want forward; then
  step "the forward (plan + 78 layers) at the deployed shape: flashmla_sparse bf16, flashmla_kv FP8, 64 heads, top-k 2048"
  # A cp-8 rank's tokens: 8 requests x 1024 current tokens over 8K, 32K and 128K histories, distinct and shared.
  for route in ${FORWARD_ROUTES:-flashmla_sparse:bf16 flashmla_kv:fp8}; do
    set -- ${route/:/ }
    name="forward_${1}_$2"
    python3 benchmark/bench_kit_layer.py --backend "$1" $([ "$2" = fp8 ] && echo --fp8) --heads 64 --topk 2048 \
      --requests 8 --history "${FORWARD_HISTORY:-8192,32768,131072}" --extend 1024 --sharing distinct,shared \
      --layers 4 --reps "${FORWARD_REPS:-5}" --processes 3 --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || status=1
    grep -vE '^\[20|[Ww]arn|^process ' "$OUT/$name.log" | tail -n 14
  done
fi

if want ragged; then
  step "the RAGGED route's per-request keys (issue 34): the repro on pristine upstream and with the queue; the cost"
  # The repro uses upstream's own kit only: the carried pristine wheel in its own directory, ahead of the patched one.
  pristine=/tmp/cpkv-pristine-sglang
  rm -rf "$pristine" && python3 -m pip install --quiet --no-index --no-deps --no-compile --target "$pristine" .whl/sglang-*.whl
  for backend in flashmla_sparse triton_sparse_mla; do
    heads=$([ "$backend" = triton_sparse_mla ] && echo 32 || echo 64) # triton_sparse_mla takes at most 32
    PYTHONPATH="$pristine:$PYTHONPATH" python3 scripts/repro/ragged_history_less_fp8.py --backend "$backend" --heads "$heads" \
      2>&1 | tail -n 1 | sed 's/^/pristine 0.5.23: /' | tee -a "$OUT/ragged_repro.txt"
    python3 scripts/repro/ragged_history_less_fp8.py --backend "$backend" --heads "$heads" \
      2>&1 | tail -n 1 | sed 's/^/with the queue: /' | tee -a "$OUT/ragged_repro.txt"
    python3 benchmark/bench_ragged_history_less.py --backend "$backend" --heads "$heads" --topk 2048 --requests 8 \
      --with-history 4 --history "${RAGGED_HISTORY:-8192,32768}" --extend 1024 --out "$OUT/ragged_cost_$backend.json" \
      > "$OUT/ragged_cost_$backend.log" 2>&1 || status=1
    grep -vE '^\[20|[Ww]arn' "$OUT/ragged_cost_$backend.log" | tail -n 4
  done
fi

if want plan-host; then
  step "host cost of the mode's per-batch plan by request count (flashmla_kv FP8)"
  python3 benchmark/bench_plan_host.py --device cuda --out "$OUT/plan_host.json" > "$OUT/plan_host.log" 2>&1 || status=1
  tail -n 20 "$OUT/plan_host.log"
fi

if want ops; then
  step "op benchmark (roofline + every op per provider)"
  python3 benchmark/bench_cp_shared_kv_ops.py --out "$OUT/bench.json" ${OPS_ONLY:+--only $OPS_ONLY} > "$OUT/bench.log" 2>&1 || status=1
  tail -n 80 "$OUT/bench.log"
fi

if want sass; then
  step "SASS: 16-byte loads in the sm_90a library"
  cuobjdump --dump-sass --gpu-architecture sm_90a /tmp/cpkv_aot/*.so 2>/dev/null | grep -cE 'LDG\.E\.128' | sed 's/^/LDG.E.128 instructions: /'
fi

if want memcheck; then
  step "compute-sanitizer memcheck (slice of the ops tests, uncached allocator)"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 150 compute-sanitizer --tool memcheck --print-limit 20 python3 -m pytest \
    test/registered/kernels/test_cuda_ops.py -q -p no:cacheprovider -k "shared_page or bad_ids" 2>&1 |
    tee "$OUT/memcheck.log" | tail -4
fi

step "done: status $status"
exit "$status"
