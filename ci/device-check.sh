#!/usr/bin/env bash
# One call on a lent x86 device machine (docs/ADDING_A_VARIANT.md, "A device machine"): the variants our own CPUs
# cannot run (avx512_vnni, a future amx_int8) checked for exactness there, then the GEMV bench and a prefill GEMM.
# ~3 minutes on a 16-core Xeon. Logs and JSON (at most 7 files, what the device tool returns) go to $OUT, else
# build/device-check. Exit status 1 when any step failed (each failing step says so), else 0.
#   bash ci/device-check.sh             # every step
#   W8A8_DEVICE_SKIP_BENCH=1 bash ...   # exactness only (~2 minutes)
# The op library is built against the torch already there (any minor: import checks it matches what it was built
# against), with the system g++ and no inherited LDFLAGS: one image's CXX pointed at a GCC that links libstdc++
# statically (CMakeLists.txt copes with that now, but that GCC's own libstdc++.so may be newer than the one torch
# loads).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/build/device-check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the tests run from /tmp
export PYTHONUNBUFFERED=1 W8A8_CPU_CACHE=/tmp/w8a8-device-cache
PYTHON=${PYTHON:-python3}
T0=$SECONDS
FAILED=0
step() { echo "== [$((SECONDS - T0)) s] $*"; }
failed() { echo "FAILED: $*"; FAILED=1; }

step "machine"
lscpu | grep -E 'Model name|^CPU\(s\)'
lscpu | grep -o -E 'avx512_vnni|avx_vnni|amx_int8|avx512_bf16' | sort -u | tr '\n' ' '; echo
"$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"

step "C++ kernel tests (in the background, beside the op library's build)"
kernel_tests() {
  cmake -S . -B /tmp/w8a8-device-kt -G Ninja -DW8A8_CPU_BUILD_TORCH_OPS=OFF -DW8A8_CPU_BUILD_KERNEL_TESTS=ON \
    -DCMAKE_BUILD_TYPE=Release > /tmp/w8a8-device-kt.log 2>&1 \
    && ninja -C /tmp/w8a8-device-kt >> /tmp/w8a8-device-kt.log 2>&1 \
    || { echo "kernel tests: the build failed:"; tail -n 40 /tmp/w8a8-device-kt.log; return 2; }
  timeout 300 /tmp/w8a8-device-kt/w8a8_kernel_tests
}
kernel_tests > "$OUT/kernel_tests.log" 2>&1 &
KERNEL_TESTS=$!
trap 'kill "$KERNEL_TESTS" 2>/dev/null' EXIT  # an early exit does not leave it writing into $OUT

step "op library against this torch (system g++)"
rm -rf /tmp/w8a8-device-pkg
if ! env -u LDFLAGS CXX=g++ CC=gcc timeout 400 "$PYTHON" -m pip install -q --no-build-isolation --no-deps \
    --no-compile --target /tmp/w8a8-device-pkg -C build-dir=/tmp/w8a8-device-build . > /tmp/w8a8-device-build.log 2>&1
then
  cp /tmp/w8a8-device-build.log "$OUT/build.log"; tail -n 30 "$OUT/build.log"; failed "the op library's build"; exit 1
fi
export PYTHONPATH=/tmp/w8a8-device-pkg
cd /tmp  # the built package, not the source tree's python/ folder
"$PYTHON" -c "import w8a8_cpu; print(w8a8_cpu.info())" || { failed "import w8a8_cpu"; exit 1; }

wait "$KERNEL_TESTS" || failed "C++ kernel tests (exit status $?)"
step "kernel tests done"
tail -n 20 "$OUT/kernel_tests.log"

# pytest exit status 5 (nothing collected) fails too
run_pytest() {
  local log=$1; shift
  timeout 400 "$PYTHON" -m pytest -q -p no:cacheprovider "$@" > "$OUT/$log" 2>&1 \
    || failed "pytest, $log (exit status $?)"
  tail -n 3 "$OUT/$log"
}
# the variants this CPU runs beyond what CI machines have (pytest ids are the variant names)
EXTRA=$("$PYTHON" -c "import w8a8_cpu
print(' or '.join(v for v in w8a8_cpu.info()['runnable_variants'] if v not in ('ref', 'avx2')))")
if [ -n "$EXTRA" ]; then
  step "pytest: tests parametrized by variant, for $EXTRA"
  run_pytest pytest_variants.log "$ROOT/tests" -k "$EXTRA"
fi
step "pytest: the op, W4A8, fused-layer, layer-op, MoE and packed-weight files on the selected variant"
run_pytest pytest_files.log "$ROOT"/tests/{test_ops,test_w4a8,test_fused_layers,test_layer_ops,test_moe}.py \
  "$ROOT/tests/test_packed_weight_safety.py"

if [ "${W8A8_DEVICE_SKIP_BENCH:-0}" != 1 ]; then
  bench() {
    local name=$1; shift
    timeout 300 "$PYTHON" -m w8a8_cpu bench "$@" --no-moe --no-progress --json "$OUT/$name.json" \
      > "$OUT/$name.log" 2>&1 || failed "bench, $name (exit status $?)"
    grep -E '^decode|^prefill|w8a8_cpu  |W4A8|torch.ao|onnxruntime int8|unavailable' "$OUT/$name.log"
  }
  step "GEMV bench, 1 and 2 threads"
  bench bench --threads 1 2 --m 1 2 4 --shapes 4096x4096 14336x4096
  step "prefill GEMM (M = 512), 1 thread"
  bench prefill --threads 1 --m 512 --shapes 4096x4096 14336x4096
fi
step "done"
exit "$FAILED"
