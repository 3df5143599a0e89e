#!/usr/bin/env bash
# conda build script (rattler-build / conda-build): builds the op library with the same CMake tree as every
# other build (CMakeLists.txt picks csrc/<arch> from CMAKE_SYSTEM_PROCESSOR, which conda's CMAKE_ARGS set for
# cross builds), installs the package into $PREFIX, then runs the torch-free C++ kernel tests when the
# target's binaries can run here (native, or cross with $CROSSCOMPILING_EMULATOR).
set -euxo pipefail

# The target's torch: conda-forge's libtorch installs its CMake package under $PREFIX/share/cmake/Torch;
# a pip-layout torch (Open-CE pytorch-base, PyPI) has it inside the torch package in site-packages.
TORCH_DIR=$PREFIX/share/cmake/Torch
if [[ ! -f $TORCH_DIR/TorchConfig.cmake ]]; then
  TORCH_DIR=$(ls -d "$PREFIX"/lib/python*/site-packages/torch/share/cmake/Torch 2>/dev/null | head -n1)
fi
[[ -f $TORCH_DIR/TorchConfig.cmake ]] || { echo "build.sh: no TorchConfig.cmake in \$PREFIX ($PREFIX)" >&2; exit 1; }

EMULATOR_ARGS=()
if [[ -n ${CROSSCOMPILING_EMULATOR:-} ]]; then
  EMULATOR_ARGS=(-DCMAKE_CROSSCOMPILING_EMULATOR="$CROSSCOMPILING_EMULATOR")
fi

# scikit-build-core reads $CMAKE_ARGS from the environment: pass conda's (toolchain, cross settings) through.
export CMAKE_ARGS="${CMAKE_ARGS:-} -DTorch_DIR=$TORCH_DIR ${EMULATOR_ARGS[*]}"
export CMAKE_GENERATOR=Ninja
export CMAKE_BUILD_PARALLEL_LEVEL=${CPU_COUNT:-2}
"$PYTHON" -m pip install . -vv --no-deps --no-build-isolation \
  --config-settings=build-dir="$SRC_DIR/build/conda-ops"

# C++ kernel tests: only when the target's binaries run here (native, or emulated when cross).
cross=0
if [[ ${CONDA_BUILD_CROSS_COMPILATION:-0} == 1 ]] \
   || [[ -n ${build_platform:-} && -n ${target_platform:-} && $build_platform != "$target_platform" ]]; then
  cross=1
fi
if [[ $cross == 0 || -n ${CROSSCOMPILING_EMULATOR:-} ]]; then
  # shellcheck disable=SC2086  # CMAKE_ARGS is a list of flags
  cmake -S . -B build/conda-kernel-tests -G Ninja ${CMAKE_ARGS} \
    -DW8A8_CPU_BUILD_TORCH_OPS=OFF -DW8A8_CPU_BUILD_KERNEL_TESTS=ON
  cmake --build build/conda-kernel-tests --parallel "${CPU_COUNT:-2}"
  ctest --test-dir build/conda-kernel-tests --output-on-failure
else
  echo "build.sh: cross build without CROSSCOMPILING_EMULATOR: C++ kernel tests built nowhere, skipped"
fi
