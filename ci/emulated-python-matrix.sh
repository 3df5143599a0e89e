#!/usr/bin/env bash
# ci/emulated-python-matrix.sh [ARCH] - the Python-level emulated test stage.
#
# For each (qemu CPU model, expected variant) of ARCH, via ci/emulate-python (which builds and caches the
# target rootfs, wheels and the cross-built op library under build/emulated-ARCH/ on first use): the pytest subset
# below, with its dispatch check: w8a8_cpu.info()["selected_variant"] must be the expected variant, and that variant
# must be compiled into the build (a build without it fails; it never passes silently).
# Each stage is reported on its own with its wall time; a crash by signal (SIGILL: exit 132) is named.
# Exit status: non-zero if any stage failed.
#
# The pytest subsets. An emulated torch import costs 15-50 s and kernels run ~10-50x slower than native, so
# `full` is the whole suite minus the tests marked slow_under_emulation (torch.compile/inductor needs a C++
# compiler for the target; the CLI benchmark job is slow), with the smaller shape grids tests/conftest.py
# selects under emulation; `smoke` is its exact-reference, bit-identity and bad-input tests of the ops and
# the MoE. Subprocess tests start their child python through qemu (tests/conftest.py: python_command()).
# `lite` (ppc64le, where `full` takes ~4 min per model under qemu-ppc64le and Debian's torch 1.13) is `full`
# without: the subprocess tests (test_isa_env_*, test_cli_*: each child re-imports torch under qemu, ~15 s;
# the dispatch test checks dispatch), the two largest MoE shapes (M = 200; E = 64 with topk = 8:
# ~70 s, smaller shapes take the same code paths), tests/test_sglang_compat.py (w8a8_cpu.compat.sglang needs
# torch >= 2) and tests/test_demo.py (demo extra). Tests needing torch.library.opcheck (>= 2.4) or torch.compile
# skip themselves there. All of it still runs natively on x86_64 and emulated on aarch64 (torch 2.x).
# W8A8_EMU_PYTEST_ARGS replaces all three.
set -uo pipefail
cd "$(dirname "$0")/.."

ARCH=${1:-aarch64}
# "model variant subset" per python row of ci/emulation-matrix.tsv for ARCH: `full` (or `lite`) on the model that
# runs every variant, `smoke` (the selected variant end to end, no SIGILL anywhere in the package) on the others.
# ppc64le's torch is Debian bookworm's 1.13.1 (no ppc64le torch on PyPI / conda-forge): tests needing
# torch.library.opcheck (>= 2.4) or torch.compile (>= 2.0) skip themselves with that reason.
MATRIX=()
while read -r stage arch model variant subset; do
  [ "$stage" = python ] && [ "$arch" = "$ARCH" ] && MATRIX+=("$model $variant $subset")
done < <(grep -v '^#' ci/emulation-matrix.tsv)
if [ ${#MATRIX[@]} -eq 0 ]; then
  echo "emulated-python-matrix: no python rows for ARCH '$ARCH' in ci/emulation-matrix.tsv" >&2
  exit 2
fi
# Tests that start a child python re-import torch under qemu (~20-75 s each); dispatch under emulation is already
# checked by each run's dispatch test (test_selected_variant_is_the_expected_one) and the emulated kernel tests'
# --expect-selected, so `full` leaves them out as `lite` does (and test_bad_options_exit_2_before_any_work is marked
# slow_under_emulation: nine child pythons). tests/test_sglang_plugin.py is left out too: it checks the installed
# distribution's metadata (here the package is a folder on PYTHONPATH, without any) and the plugin in child pythons;
# its sglang tests need sglang's venv (ci/sglang-env.sh); w8a8_cpu.compat.sglang's ops stay in test_sglang_compat.py.
# W8A8_EMU_PYTEST_ARGS replaces the subsets, the dispatch test included unless the arguments select it.
FULL_ARGS=(tests --ignore=tests/test_sglang_plugin.py -m "not slow_under_emulation"
           -k "not test_isa_env and not test_cli_ and not test_help_documents_both_commands and not test_refuses_ops_defined_elsewhere")
SMOKE_K="quant_matches_reference or fused_quant_matmul or bit_identical or matches_reference or bad_input"
SMOKE_K+=" or int4_linear_is_exact or selected_variant_is_the_expected_one"
SMOKE_ARGS=(tests/test_ops.py tests/test_moe.py tests/test_bad_input.py tests/test_w4a8.py -m "not slow_under_emulation"
            -k "$SMOKE_K")
LITE_ARGS=(tests/test_ops.py tests/test_moe.py tests/test_bad_input.py tests/test_nn_cli.py tests/test_w4a8.py -m "not slow_under_emulation"
           -k "not test_isa_env and not test_cli_ and not 200- and not 256-64-8")
if [ -n "${W8A8_EMU_PYTEST_ARGS:-}" ]; then
  read -r -a FULL_ARGS <<< "$W8A8_EMU_PYTEST_ARGS"   # split on whitespace, no quoting
  SMOKE_ARGS=("${FULL_ARGS[@]}")
  LITE_ARGS=("${FULL_ARGS[@]}")
fi

RESULTS=()
FAILED=0
describe() {  # exit status -> words
  local rc=$1
  case $rc in
    0) echo "ok" ;;
    132) echo "CRASH: SIGILL (illegal instruction, exit 132)" ;;
    134) echo "CRASH: SIGABRT (exit 134)" ;;
    139) echo "CRASH: SIGSEGV (exit 139)" ;;
    5) echo "FAILED: pytest collected no tests (exit 5)" ;;
    *) if [ "$rc" -gt 128 ]; then echo "CRASH: signal $((rc - 128)) (exit $rc)"; else echo "FAILED (exit $rc)"; fi ;;
  esac
}
stage() {  # stage NAME CMD... : run, time, record
  local name=$1; shift
  echo
  echo "=== [$ARCH] $name"
  local t0=$SECONDS rc=0
  "$@" || rc=$?
  local line
  line=$(printf '%-58s %-6s %s' "$name" "$((SECONDS - t0))s" "$(describe "$rc")")
  echo "--- $line"
  RESULTS+=("$line")
  [ "$rc" -eq 0 ] || FAILED=1
}

# Build (rootfs, wheels, cross-built extension) once, timed as its own stage, so the per-model stages time
# only the emulated work.
read -r first_model _ <<< "${MATRIX[0]}"
stage "build (rootfs + wheels + cross-build)" bash ci/emulate-python "$ARCH" "$first_model" python -c pass

for entry in "${MATRIX[@]}"; do
  read -r model expected selection <<< "$entry"
  case $selection in
    full) PYTEST_ARGS=("${FULL_ARGS[@]}") ;;
    lite) PYTEST_ARGS=("${LITE_ARGS[@]}") ;;
    *) PYTEST_ARGS=("${SMOKE_ARGS[@]}") ;;
  esac
  # One emulated python per model (its torch import costs 15-50 s): the dispatch check is a test of the subset
  # (tests/test_ops.py::test_selected_variant_is_the_expected_one, run when W8A8_CPU_EXPECT_SELECTED is set). A crash
  # kills pytest (128+n, 132: SIGILL); children of the emulated python report a signal as -n (-4: SIGILL), which
  # pytest shows in its failure output.
  stage "$model: pytest ($selection; selected variant == $expected)" \
    env W8A8_CPU_EXPECT_SELECTED="$expected" \
    bash ci/emulate-python "$ARCH" "$model" python -m pytest -q -p no:cacheprovider "${PYTEST_ARGS[@]}"
done

echo
echo "=== [$ARCH] emulated Python stage summary"
printf '%s\n' "${RESULTS[@]}"
exit "$FAILED"
