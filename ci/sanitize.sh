#!/usr/bin/env bash
# ci/sanitize.sh - the sanitizer stage: ASan + UBSan build of the op library and the C++ kernel tests, then
#   1. the kernel tests (every variant this CPU runs), leak checking on;
#   2. a pytest subset over the ops' bad-input, edge-case and fuzz tests, in a python that loads the
#      ASan-built op library (LD_PRELOAD puts the ASan runtime first; leak checking off: CPython and torch keep
#      their allocations until exit by design).
# Build: build/asan (W8A8_SANITIZE_BUILD_DIR), -DW8A8_CPU_SANITIZE=ON: -fsanitize=address,undefined
# -fno-sanitize-recover=undefined -fno-omit-frame-pointer on every TU, on top of each variant's own ISA flags.
# The python side imports a copy of python/w8a8_cpu with the ASan library in place of the normal one
# ($BUILD/python, first on PYTHONPATH; the loader takes the libw8a8_cpu_ops*.so next to __init__.py), checked
# before any test runs: the library mapped into the process must be the ASan build.
# Failure: any non-zero exit status, and any ASan report at all: ASan reports go to per-process files under
# $BUILD/reports (log_path), so one from a child process that a test started fails the stage even if the test
# ignored the child's exit status; every report is printed. UBSan aborts the process (exit status 1).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
B=$ROOT/${W8A8_SANITIZE_BUILD_DIR:-build/asan}
T0=$SECONDS
log() { echo "[sanitize $((SECONDS - T0))s] $*"; }

log "build ($B): ASan + UBSan op library and kernel tests"
mkdir -p "$B"
cmake -S . -B "$B" -G Ninja -DW8A8_CPU_SANITIZE=ON -DW8A8_CPU_BUILD_TORCH_OPS=ON -DW8A8_CPU_BUILD_KERNEL_TESTS=ON \
  >"$B/configure.log" 2>&1 || { cat "$B/configure.log"; exit 1; }
grep "w8a8-cpu:" "$B/configure.log" || true
cmake --build "$B"

LIBASAN=$(gcc -print-file-name=libasan.so)
LIBSTDCXX=$(gcc -print-file-name=libstdc++.so)
for f in "$LIBASAN" "$LIBSTDCXX"; do [ -f "$f" ] || { echo "sanitize: $f not found" >&2; exit 1; }; done
REPORTS=$B/reports
rm -rf "$REPORTS"
mkdir -p "$REPORTS"
# ASan writes each report to $REPORTS/asan.<pid>. UBSan reports go to the process's stderr (GCC's libubsan, loaded
# beside libasan, does not apply log_path) and, with halt_on_error and -fno-sanitize-recover, end the process with
# exit status 1; the one child process of the subset (the fuzzer) asserts its exit status and prints its stderr.
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
finish() {  # finish WHAT STATUS: print every ASan report, fail if there was one or STATUS is non-zero
  local files
  files=$(find "$REPORTS" -type f | sort)
  for f in $files; do echo "----- sanitizer report $f"; cat "$f"; done
  [ -z "$files" ] || { echo "sanitize: FAILED: $(echo "$files" | wc -l) ASan report(s) above ($1)" >&2; exit 1; }
  [ "$2" -eq 0 ] || { echo "sanitize: FAILED: $1 exited with status $2" >&2; exit "$2"; }
}

log "C++ kernel tests (ASan + UBSan, leak checking on)"
rc=0
ASAN_OPTIONS="detect_leaks=1:log_path=$REPORTS/asan" "$B/w8a8_kernel_tests" || rc=$?
finish "C++ kernel tests" "$rc"

# The package as python/w8a8_cpu has it, with the ASan build's op library and build info.
PKG=$B/python
rm -rf "$PKG"
mkdir -p "$PKG"
cp -r python/w8a8_cpu "$PKG/"
find "$PKG" \( -name '*.so' -o -name '_build_info.py' \) -type f -delete
find "$PKG" -name __pycache__ -type d -prune -exec rm -rf {} +
cp "$B/libw8a8_cpu_ops.so" "$B/_build_info.py" "$PKG/w8a8_cpu/"

export PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH}
# A scikit-build-core editable install (the dev setup, never CI) puts a finder ahead of PYTHONPATH; this variable
# is its documented switch to stand aside for the build directories it names.
EDITABLE=$(python3 -c "import sys; print(':'.join(f.path for f in sys.meta_path
  if type(f).__name__ == 'ScikitBuildRedirectingFinder' and getattr(f, 'path', None)))")
[ -n "$EDITABLE" ] && export SKBUILD_EDITABLE_SKIP=$EDITABLE${SKBUILD_EDITABLE_SKIP:+:$SKBUILD_EDITABLE_SKIP}
# libstdc++ too: python does not link it, and ASan binds its __cxa_throw interceptor at start-up only (without it,
# the first C++ exception thrown in the op library aborts with "CHECK failed ... real___cxa_throw != 0").
export LD_PRELOAD=$LIBASAN:$LIBSTDCXX${LD_PRELOAD:+:$LD_PRELOAD}
export ASAN_OPTIONS="detect_leaks=0:log_path=$REPORTS/asan"

log "python loads the ASan op library; a heap overflow in a child python is reported"
rc=0
python3 - "$PKG/w8a8_cpu/libw8a8_cpu_ops.so" <<'PY' || rc=$?
import ctypes, subprocess, sys
import w8a8_cpu
want = sys.argv[1]
mapped = {line.split()[-1] for line in open("/proc/self/maps") if "libw8a8_cpu_ops" in line}
assert mapped == {want}, f"op libraries mapped: {mapped}, expected only the ASan build {want}"
assert hasattr(ctypes.CDLL(None), "__asan_init"), "ASan runtime not loaded"
print(f"  {w8a8_cpu.__file__}\n  {want}\n  selected variant: {w8a8_cpu.info()['selected_variant']}")
# The child writes 32 bytes into a 16-byte malloc block (ASan's memmove interceptor checks it); its exit status is
# ignored here, as a careless test might: the report file must still be there.
subprocess.run([sys.executable, "-c", "import ctypes, w8a8_cpu; libc = ctypes.CDLL(None); "
                "libc.malloc.restype = ctypes.c_void_p; ctypes.memmove(libc.malloc(16), b'x' * 32, 32)"])
PY
[ "$rc" -eq 0 ] || finish "the loader check" "$rc"
if ! grep -qs "heap-buffer-overflow" "$REPORTS"/asan.*; then
  echo "sanitize: the deliberate overflow in a child process left no ASan report in $REPORTS" >&2
  exit 1
fi
rm -f "$REPORTS"/*
echo "  the child's overflow was reported (and its report removed)"

# Bad input, edge cases and the fuzzers (the layer ops; packed blobs; checkpoint directories: configs, indexes and safetensors
# headers, loaded through the ASan build): everything that feeds the C++ odd shapes or hostile bytes; and every op from
# 8 threads at once (shared scratch, at::parallel_for from several callers). Left out: the two largest MoE shapes
# (M = 200; the smaller ones take the same code paths), opcheck and torch.compile (torch's own machinery, slow
# under ASan, and inductor compiles C++ with LD_PRELOAD set).
TESTS=(tests/test_bad_input.py tests/test_ops.py tests/test_moe.py tests/test_concurrency.py tests/test_non_finite.py)
TESTS+=(tests/test_packed_weight_safety.py tests/test_checkpoint_fuzz.py tests/test_layer_ops.py)
# the hostile-input suite at its CI counts (its children inherit LD_PRELOAD and ASan's log_path)
TESTS+=(tests/hostile/test_hostile.py)
log "pytest under ASan + UBSan: ${TESTS[*]}"
rc=0
python3 -m pytest -q -p no:cacheprovider --durations=5 "${TESTS[@]}" \
  -k "not opcheck and not compile and not 200-" || rc=$?
finish "pytest" "$rc"
log "done: no sanitizer reports"
