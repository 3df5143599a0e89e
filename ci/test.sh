#!/usr/bin/env bash
# The project's test command (README): installs the Python test dependencies, builds and installs the
# package, builds and runs the torch-free C++ kernel tests, then runs pytest. Any failure, or a pytest
# run that collects no tests (exit 5), fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet torch==2.13.0 scikit-build-core ninja pytest numpy expecttest
python3 -m pip install --quiet --no-build-isolation .

echo "== C++ kernel tests (native) =="
cmake -S . -B build/kernel-tests -G Ninja -DW8A8_CPU_BUILD_TORCH_OPS=OFF -DW8A8_CPU_BUILD_KERNEL_TESTS=ON
cmake --build build/kernel-tests
ctest --test-dir build/kernel-tests --output-on-failure -V | grep -E "variant|sweep|extreme|quantization|shared vectors|identical|OK|FAIL|tests passed"

echo "== pytest =="
python3 -m pytest tests -q -p no:cacheprovider
